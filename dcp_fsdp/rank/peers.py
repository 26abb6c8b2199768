"""Which of this node's ranks have already ended, read from /proc (no torch, no network).

torch's elastic agent stops the surviving ranks with SIGTERM when one rank ends with an
error or a signal; a scheduler (scancel) or a user sends the same SIGTERM. The survivors
tell the two apart here: when the signal arrives, has a sibling (a child of the same
agent, same TORCHELASTIC_RUN_ID) already ended? Exits take much longer than this check,
so a signal sent to every process at once finds all siblings alive.
"""

from __future__ import annotations

import os
from pathlib import Path

_START_PARENT = os.getppid()


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    tasks = Path(f"/proc/{pid}/task")
    try:
        for task in tasks.iterdir():
            found.update(int(c) for c in (task / "children").read_text().split())
        return found
    except OSError:  # kernels without /proc/.../children: scan every process
        pass
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


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
    for pid in _children(parent):
        if pid == os.getpid() or _zombie(pid):
            continue
        env = _environ(pid)
        if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("LOCAL_RANK", "").isdigit():
            alive.add(int(env["LOCAL_RANK"]))
    base = rank - local_rank
    return [base + other for other in range(local_world) if other not in alive]
