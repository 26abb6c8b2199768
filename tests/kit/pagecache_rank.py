"""One real rank (gloo, world size 1) running the tool's own loop, with the page cache of the
checkpoint's files observed at the instant each timed read starts.

  python -m tests.kit.pagecache_rank OUT.json SETTING=VALUE ...

`dcp.load` and the ceiling's fs GET are wrapped (torch itself is not changed) so that right
when the timed call begins, mincore(2) counts the pages of every file it is about to read
that are still in the page cache. Written to OUT.json: {"load": [resident, pages],
"raw_get": [resident, pages], "samples": [...]}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    out, overrides = sys.argv[1], sys.argv[2:]
    import torch.distributed.checkpoint as dcp

    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.rank.session import RankSession
    from dcp_fsdp.storage import pagecache
    from dcp_fsdp.storage.raw import FsRawArea

    seen: dict[str, list[int]] = {}

    def residency(paths) -> list[int]:
        counts = [pagecache.resident_pages(path) for path in paths]
        return [sum(r for r, _ in counts), sum(p for _, p in counts)]

    real_load = dcp.load

    def observed_load(state_dict, *args, storage_reader=None, **kwargs):
        seen.setdefault("load", residency(pagecache.checkpoint_files(storage_reader.path)))
        return real_load(state_dict, *args, storage_reader=storage_reader, **kwargs)

    real_get = FsRawArea.get  # the ceiling's fs GET (storage/raw.py)

    def observed_get(self, client, name):
        seen.setdefault("raw_get", residency([self.path(name)]))
        return real_get(self, client, name)

    dcp.load = observed_load
    # instrumented in this process only (the rank this script is): the class's own method
    FsRawArea.get = observed_get  # type: ignore[method-assign]
    session = RankSession(compose("save-and-load", overrides), time.monotonic())
    session.join()
    session.open_store()
    sharded, state_dict = session.build()
    session.run_loop(sharded, state_dict)
    assert session.loop is not None  # run_loop made it
    samples = [s.model_dump() for s in session.loop.samples]
    with open(out, "w") as sink:
        json.dump({**seen, "samples": samples}, sink)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RANK", "0")
    sys.exit(main())
