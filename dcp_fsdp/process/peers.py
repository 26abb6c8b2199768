"""Which of this node's ranks have already ended, through psutil (no torch, no network): torch's
elastic agent stops the survivors with SIGTERM when one rank ends first, a scheduler or a user
sends the same SIGTERM, and a survivor tells them apart by whether a sibling (a child of its
agent, same TORCHELASTIC_RUN_ID) has ended. Exits take much longer than this check, so a signal
sent to every process at once finds all siblings alive.
"""

from __future__ import annotations

import os

import psutil

from dcp_fsdp import contract
from dcp_fsdp.process import lifeline

_START_PARENT = os.getppid()


def _started() -> None:
    global _START_PARENT
    _START_PARENT = os.getppid()


# A rank forked from an agent that had imported this module: its parent is the agent.
os.register_at_fork(after_in_child=_started)


def _live_children(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:  # the agent is gone
        return []
    return [child for child in children if lifeline.alive(child.pid)]


def sibling_local_rank(child: psutil.Process, run_id: str, base: int) -> int | None:
    """The local rank of a child of this rank's agent, or None when it is not a rank of this
    run: a forked rank by its name (global rank - base: its /proc environ is the agent's), an
    exec'd one by its environment."""
    try:
        name = child.name()
    except psutil.Error:
        name = ""
    if name.startswith(contract.RANK_PROCESS_NAME_PREFIX):
        global_rank = contract.rank_of_process_name(name)
        return None if global_rank is None else global_rank - base
    try:
        env = child.environ()
    except psutil.Error:
        env = {}
    if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("LOCAL_RANK", "").isdigit():
        return int(env["LOCAL_RANK"])
    return None


def ended_local_peers() -> list[int]:
    """Global ranks of this node's ranks that have ended; [] when not under torchrun, when
    every sibling is alive, or when the agent itself is gone (then nobody failed first)."""
    try:
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        rank = int(os.environ["RANK"])
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
    except (KeyError, ValueError):
        return []
    parent = os.getppid()
    if parent != _START_PARENT or parent == 1:
        return []
    others = [child for child in _live_children(parent) if child.pid != os.getpid()]
    if len(others) >= local_world - 1:
        # as many as its siblings: none has ended (a sibling forked this moment, not named
        # yet, counts too)
        return []
    base = rank - local_rank
    alive = {local_rank, *(sibling_local_rank(child, run_id, base) for child in others)}  # None: not a rank
    return [base + other for other in range(local_world) if other not in alive]
