"""The file-system store: DCP's own FileSystemWriter/Reader on a directory."""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import shutil
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_fsdp.units import MIB
import dcp_fsdp.storage.pagecache as pagecache
from dcp_fsdp.compat import data_object_prefix
from dcp_fsdp.config.schema import StorageConfig
from dcp_fsdp.errors import UserError
from dcp_fsdp.storage.layout import (CLAIM_EXCLUSIVE, CLAIM_NAME, METADATA_NAME, CheckpointInfo,
                                     SuffixClaim, check_suffix, checkpoint_info)
from dcp_fsdp.storage.raw import FsRawArea, fs_ceiling_dir
from dcp_fsdp.storage.base import CheckpointStore, built, host_state_kwargs, read_ahead_reader
from dcp_fsdp.storage.timeline import HookTimeline

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


def _info(entry: Path) -> CheckpointInfo:
    """What folder `entry` under the root holds: its files at any depth."""
    files = [f for f in entry.rglob("*") if f.is_file()]
    names = [str(f.relative_to(entry)) for f in files]
    sizes = [f.stat().st_size for f in files]
    newest = max((f.stat().st_mtime for f in files), default=entry.stat().st_mtime)
    return checkpoint_info(entry.name, names, (entry / METADATA_NAME).exists(), sum(sizes),
                           datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).isoformat())


class FsStore(CheckpointStore):
    """DCP's FileSystemWriter/Reader on a directory: the baseline."""

    kind = "fs"

    def __init__(self, storage: StorageConfig) -> None:
        assert storage.path is not None
        self.config = storage
        self.root = Path(storage.path).expanduser().absolute()

    def location(self, suffix: str) -> str:
        return str(self.root / suffix)

    def describe(self) -> dict[str, Any]:
        return {"kind": "fs", "path": str(self.root)}

    def writer(self, suffix: str, timeline: HookTimeline | None = None,
               host_state: bool = False) -> FileSystemWriter:
        from torch.distributed.checkpoint import FileSystemWriter

        from dcp_fsdp.storage.timed_dcp import TimedFileSystemWriter

        return built(FileSystemWriter, TimedFileSystemWriter, timeline, self.location(suffix),
                     thread_count=self.config.thread_count, sync_files=self.config.sync_files,
                     overwrite=False, **host_state_kwargs(host_state))

    def drop_cache(self, suffix: str, share: tuple[int, int] = (0, 1)) -> str:
        index, count = share
        return pagecache.drop(pagecache.checkpoint_files(self.location(suffix))[index::count])

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> FileSystemReader:
        from torch.distributed.checkpoint import FileSystemReader

        import dcp_fsdp.storage.timed_dcp as timed_dcp

        if self.config.read_ahead:  # the tool's reader, always timed (it owns its clocks)
            return read_ahead_reader(timed_dcp.TimedReadAheadFileSystemReader, self.config, timeline,
                                     self.location(suffix))
        return built(FileSystemReader, timed_dcp.TimedFileSystemReader, timeline, self.location(suffix))

    def preflight(self, writes: bool = True) -> None:
        """Writable, or creatable by the first save; readable for `writes=False`. Creates nothing
        (a mistyped path must not appear because of a `list` or a `load`)."""
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"storage.path={self.root}: is a file, not a directory; give the "
                            "directory the checkpoints are (or will be) in")
        if not writes:
            if self.root.is_dir() and not os.access(self.root, os.R_OK | os.X_OK):
                raise UserError(f"storage.path={self.root}: not readable; choose a directory you "
                                "can read")
            return
        where = next(path for path in (self.root, *self.root.parents) if path.exists())
        probe = where / f".dcp-fsdp-probe-{secrets.token_hex(4)}"
        try:
            if not where.is_dir():
                raise NotADirectoryError(20, f"{where} is a file")
            probe.write_bytes(b"probe")
            probe.unlink()
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise UserError(f"storage.path={self.root}: the file system is full ({error.strerror}); "
                                "free space there or choose another directory") from None
            raise UserError(f"storage.path={self.root}: not writable ({error.strerror or error}); "
                            "choose a directory you can write to") from None

    def list_checkpoints(self, suffix: str | None = None) -> list[CheckpointInfo]:
        if not self.root.is_dir():
            return []
        entries = [self.root / suffix] if suffix else sorted(self.root.iterdir())
        return [_info(entry) for entry in entries if entry.is_dir()]

    def object_sizes(self, suffix: str) -> dict[str, int]:
        """Each file under the suffix and its size. An entry that is neither a file nor a folder
        (a FIFO, a device, a link to /dev/zero) is refused: DCP would hang or read forever."""
        root = self.root / suffix
        if not root.is_dir():
            return {}
        sizes = {}
        for path in root.rglob("*"):
            if path.is_file():
                sizes[str(path.relative_to(root))] = path.stat().st_size
            elif path.exists() and not path.is_dir():  # (a dangling link: missing)
                raise UserError(f"{path}: not a regular file (a FIFO, a device, a socket or a "
                                "link to one); a checkpoint's objects are files, so it cannot "
                                "be read: remove it")
        return sizes

    def has_objects(self, suffix: str) -> bool:
        path = self.root / suffix
        return path.exists() and any(path.iterdir())

    def is_complete(self, suffix: str) -> bool:
        return (self.root / suffix / METADATA_NAME).exists()

    def claim(self, suffix: str, data: bytes) -> SuffixClaim:
        """O_CREAT|O_EXCL: the kernel (and NFS v3+) creates the file for one caller only."""
        path = self.root / suffix / CLAIM_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return SuffixClaim(False, CLAIM_EXCLUSIVE)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        return SuffixClaim(True, CLAIM_EXCLUSIVE)

    def put_small(self, suffix: str, name: str, data: bytes) -> None:
        path = self.root / suffix / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def get_small(self, suffix: str, name: str, max_bytes: int | None = None) -> bytes | None:
        path = self.root / suffix / name
        try:
            # O_NONBLOCK: a FIFO put where an object belongs opens at once instead of waiting
            # for a writer forever (a hung `load`, `list --check`); fstat then refuses it.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserError(f"{path}: not a regular file (a FIFO, a device or a socket); "
                                "a checkpoint's objects are files, so it cannot be read: "
                                "remove it")
            return file.read(-1 if max_bytes is None else max_bytes)

    def delete(self, suffix: str) -> None:
        check_suffix(suffix)  # never "" (the whole root) nor a path outside it
        shutil.rmtree(self.root / suffix, ignore_errors=True)

    def probe(self) -> None:
        """A file written and removed: what preflight does."""
        self.preflight()

    # -- raw objects (the raw ceiling), see raw.py --------------------------------------
    def data_object_prefix(self, rank: int) -> str:
        return data_object_prefix(rank)  # FileSystemWriter's: no folders

    def clean_raw_area(self, token: str) -> int:
        area = fs_ceiling_dir(self.root, token)
        shutil.rmtree(area, ignore_errors=True)
        with contextlib.suppress(OSError):
            area.parent.rmdir()  # `<path>.ceiling`, when nothing else is there
        return 0

    def raw_area(self, token: str) -> FsRawArea:
        return FsRawArea(fs_ceiling_dir(self.root, token), self.config.part_size_mib * MIB,
                         self.config.sync_files)
