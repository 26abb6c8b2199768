"""multi-storage-client's DCP writer and reader, as this tool builds them (storage.client=msc;
ranks only): subclasses of MSC's own classes that fix two things.

- **A `.metadata` any client can load.** torch's writer pickles the checkpoint id, MSC's
  `MultiStoragePath`, which only MSC with the writer's profile can unpickle:
  `PortableMscWriter` stores it as its string, as a local save stores a path.
- **Each object downloaded once.** MSC's reader with `thread_count` > 1 prefetches every file
  and `read_data` then opens it again: with no MSC cache each object came down twice.
  `OnceMscReader` prefetches (`storage.msc_prefetch_threads`, 1 = none) into the file objects
  `read_data` then reads; a prefetched rank holds all its objects in memory at once. No disk
  cache instead: it would sit between later loads and the bucket, and write inside the timer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from multistorageclient.contrib.torch.filesystem import (
    MultiStorageFileSystem,
    MultiStorageFileSystemReader,
    MultiStorageFileSystemWriter,
)
from multistorageclient.pathlib import MultiStoragePath
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from dcp_fsdp.storage.timed_clients import TimedMscReader, TimedMscWriter

_Result = TypeVar("_Result")


class PortableMscWriter(MultiStorageFileSystemWriter):
    """MSC's writer whose `.metadata` names its checkpoint by a string, not an MSC path."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None and meta.checkpoint_id is not None:
            meta.checkpoint_id = str(meta.checkpoint_id)
        return meta


class TimedPortableMscWriter(TimedMscWriter, PortableMscWriter):
    pass  # timed as TimedMscWriter (timeline=), portable .metadata


class _PrefetchedFileSystem(MultiStorageFileSystem):
    """MSC's file system that hands `read_data` each prefetched file object once (closed when
    DCP's `with` ends); any other path as MSC opens it."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[str, Any] = {}

    def hold(self, path: str | os.PathLike, stream: Any) -> None:
        self._held[str(path)] = stream

    def release(self) -> None:
        """Close what was prefetched and never opened (a plan that failed part-way)."""
        held, self._held = self._held, {}
        for stream in held.values():
            stream.close()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        held = self._held.pop(str(path), None) if mode == "rb" else None
        with super().create_stream(path, mode) if held is None else contextlib.closing(held) as stream:
            yield stream


def _download(path: str | os.PathLike) -> Any:
    """MSC's file object for `path`, its download done (below MSC's memory limit the whole
    object; above it, MSC reads ranges on demand and nothing is fetched here)."""
    stream = MultiStoragePath(path).open(mode="rb", prefetch_file=True)
    try:
        stream.tell()  # MSC's file waits for its download in any call
    except BaseException:
        stream.close()
        raise
    return stream


class OnceMscReader(MultiStorageFileSystemReader):
    """MSC's reader; `prefetch_threads` > 1 downloads the plan's files that many at a time."""

    def __init__(self, path: str | os.PathLike, prefetch_threads: int = 1) -> None:
        super().__init__(path, thread_count=1)  # MSC's own prefetch off: it fetches twice
        self.prefetch_threads = prefetch_threads
        self._prefetched = _PrefetchedFileSystem()
        self.fs = self._prefetched  # type: ignore[assignment]  # as MSC's own __init__ sets its fs

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            if self.prefetch_threads > 1:
                self._prefetch(plan)
            return super().read_data(plan, planner)
        finally:
            self._prefetched.release()

    def _prefetch(self, plan: LoadPlan) -> None:
        names = dict.fromkeys(self.storage_data[item.storage_index].relative_path
                              for item in plan.items)
        # as DCP's read_data names them (the same keys)
        paths = [self._prefetched.concat_path(self.path, name) for name in names]
        with ThreadPoolExecutor(max_workers=self.prefetch_threads,
                                thread_name_prefix="msc-prefetch") as pool:
            futures = [pool.submit(_download, path) for path in paths]
            try:
                for path, future in zip(paths, futures):
                    self._prefetched.hold(path, self.prefetch_wait(future.result))
            except BaseException:
                for future in futures:  # the others: closed once done
                    if not future.cancel() and future.exception() is None:
                        future.result().close()
                raise

    def prefetch_wait(self, wait: Callable[[], _Result]) -> _Result:
        """Where the rank waits for a prefetched download (the timed reader clocks it)."""
        return wait()


class TimedOnceMscReader(TimedMscReader, OnceMscReader):
    """Timed as TimedMscReader, and the rank's wait for prefetched downloads on the storage clock."""

    def prefetch_wait(self, wait: Callable[[], _Result]) -> _Result:
        with self.timeline.storage_clock:
            return wait()
