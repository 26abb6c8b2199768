"""Which of this node's ranks have already ended, read through psutil (no torch, no network).

torch's elastic agent stops the surviving ranks with SIGTERM when one rank ends with an
error or a signal; a scheduler (scancel) or a user sends the same SIGTERM. The survivors
tell the two apart here: when the signal arrives, has a sibling (a child of the same
agent, same TORCHELASTIC_RUN_ID) already ended? Exits take much longer than this check,
so a signal sent to every process at once finds all siblings alive.
"""

from __future__ import annotations

import os

import psutil

_START_PARENT = os.getppid()


def _live_children(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:  # the agent is gone
        return []
    return [child for child in children if _running(child)]


def _running(child: psutil.Process) -> bool:
    try:
        return child.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it ended while we looked
        return False
    except psutil.Error:
        return True


def _environ(child: psutil.Process) -> dict[str, str]:
    try:
        return child.environ()
    except psutil.Error:
        return {}


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
    alive = {local_rank}
    for child in _live_children(parent):
        if child.pid == os.getpid():
            continue
        env = _environ(child)
        if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("LOCAL_RANK", "").isdigit():
            alive.add(int(env["LOCAL_RANK"]))
    base = rank - local_rank
    return [base + other for other in range(local_world) if other not in alive]
