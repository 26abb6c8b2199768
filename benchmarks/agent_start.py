"""What the agent's interpreter flags (launch/agent.py PYTHON_FLAGS) save, in CPU seconds.

torch's c10d rendezvous names each of its events with `inspect.stack()` (twice per event).
For a frame of a frozen standard-library module, as runpy's two frames under every
`python -m`, inspect searches every imported module for the frame's file, and the agent holds
the ~2,700 modules of its forked ranks. Each measured launch is a fresh
`python [FLAGS] -m benchmarks.agent_start --agent`: it imports what our agent imports
(torch's launcher, the ranks' modules), then runs torch's elastic agent with the c10d
rendezvous (what `--standalone` uses) and 2 ranks started by fork that return at once, so
the figure is the agent's own work. The child's CPU (user + system, its ranks included)
comes from its rusage; the two ways alternate, so a drift of the machine's speed meets both.

  python -m benchmarks.agent_start --repeat 6

2026-11-28 (2-core VM, torch 2.13.0+cpu): see docs/measurements/2026-11-27-ci-cost.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid

from dcp_fsdp.launch.agent import PYTHON_FLAGS

WAYS = {"-m (frozen runpy)": (), f"{' '.join(PYTHON_FLAGS)} -m": PYTHON_FLAGS}


def _rank() -> None:
    """A rank that has nothing to do: the launch measured is the agent's."""


def agent() -> None:
    """Our agent's imports, then torch's agent with the c10d rendezvous and 2 forked ranks."""
    import importlib

    from dcp_fsdp import compat
    from dcp_fsdp.launch import forked_rank
    from dcp_fsdp.process.collector import paused_for_imports

    with paused_for_imports():  # as launch/agent.py
        for name in ("torch.distributed.run", *compat.RANK_TORCH_MODULES,
                     *forked_rank.RANK_MODULES):
            importlib.import_module(name)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", run_id=uuid.uuid4().hex,
                          max_restarts=0, monitor_interval=0.1, start_method="fork")
    elastic_launch(config, _rank)()


def measure(flags: tuple[str, ...]) -> float:
    """One launch's CPU seconds (the child and its ranks). TMPDIR is a directory of its own,
    removed after: torch's agent leaves torchelastic_* there, and torch._dynamo makes
    torchinductor_$USER."""
    with tempfile.TemporaryDirectory(prefix="dcp-fsdp-agent-start-") as tmp:
        before = os.times()
        subprocess.run([sys.executable, *flags, "-m", "benchmarks.agent_start", "--agent"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "TMPDIR": tmp})
        after = os.times()
    return (after.children_user - before.children_user
            + after.children_system - before.children_system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        agent()
        return
    cpu_s: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeat):
        for way, flags in WAYS.items():
            cpu_s[way].append(measure(flags))
    for way, samples in cpu_s.items():
        print(f"{way:26} mean {statistics.mean(samples):.2f} CPU s "
              f"({', '.join(f'{s:.2f}' for s in samples)})")


if __name__ == "__main__":
    main()
