"""The storage contract: what a rank and the launcher need from any checkpoint store (as
torchtitan's `CheckpointStorage`), implemented by the S3 and the file-system store. Layout and
suffix policy are `layout.py`'s, in its terms; nothing outside `storage/` reaches past it.
"""

from __future__ import annotations

import dataclasses
import datetime
import secrets
from collections.abc import Callable
from typing import Any, Concatenate, Iterable, ParamSpec, Protocol, TypeVar, runtime_checkable

from dcp_fsdp.storage.timeline import HookTimeline


# -- what a store answers (layout.py re-exports them with the rules that use them) ---------
@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    suffix: str
    complete: bool
    size_bytes: int
    object_count: int
    modified: str  # ISO 8601, UTC, of the newest object
    # nothing but the claim: a save that ended before its first object, or one starting now
    claim_only: bool = False
    # Folders below it holding checkpoints of their own: a prefix (`ckpt/<run>/<suffix>`)
    nested: tuple[str, ...] = ()
    own_object_count: int = 0  # objects directly in it (a prefix strategy's data lie deeper)

    @property
    def recognised(self) -> bool:
        """Removable as one checkpoint: objects of its own, and no checkpoint below it."""
        return self.own_object_count > 0 and not self.nested


@dataclasses.dataclass(frozen=True)
class SuffixClaim:
    """A store's answer to a claim: did this save get the suffix, and how it was decided."""

    won: bool  # False: another save's claim object is there
    method: str  # layout's CLAIM_CONDITIONAL | CLAIM_EXCLUSIVE | CLAIM_NOT_ATOMIC


@dataclasses.dataclass(frozen=True)
class OpenUpload:
    """A multipart upload neither completed nor aborted: its parts are stored (on AWS, billed)."""

    suffix: str  # the checkpoint it belongs to ("" when directly under the root)
    key: str
    upload_id: str
    initiated: str  # ISO 8601, UTC
    part_count: int
    size_bytes: int

    def age_s(self, now: datetime.datetime | None = None) -> float:
        """Seconds since it was started (by the server's clock; never negative)."""
        now = now or datetime.datetime.now(datetime.timezone.utc)
        return max(0.0, (now - datetime.datetime.fromisoformat(self.initiated)).total_seconds())


class RawArea(Protocol):
    """Objects moved raw (no DCP) by the client DCP uses, beside the checkpoints (never listed);
    names are relative to it and may hold '/'. The defaults are S3's: nothing to create, no cache."""

    location: str  # the area's URI / path, for messages

    def open(self) -> Any:
        """A client built now, so that no timed operation pays its set-up (fs: None)."""
        return None

    def prepare(self, names: Iterable[str]) -> None:
        """Create what must exist before the objects are written (folders); untimed."""
        return None

    def put(self, client: Any, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Write one object from its chunks, durably (fs: fsync'd, as DCP's writer does)."""

    def get(self, client: Any, name: str) -> int:
        """Read one object to its end, discarding the bytes; the number read."""

    def get_into(self, client: Any, name: str, target: memoryview) -> int:
        """Read one object into `target` (a preallocated tensor's bytes); the number read."""

    def delete(self, client: Any, names: Iterable[str]) -> None:
        """Remove these objects; the area's folders go when nothing is left in them."""

    def drop_cache(self, names: Iterable[str]) -> str | None:
        """These objects out of the page cache (untimed); the policy that held, None for S3."""
        return None


# A writer's kwargs for state in host memory: no copy-ahead. With CUDA available DCP's writers
# overlap device-to-host copies on torch.cuda.current_stream(), which opens a CUDA context on
# GPU 0 in every gloo rank of a GPU host (issue 32).
HOST_STATE_WRITER_KWARGS: dict[str, Any] = {"per_thread_copy_ahead": 0}


def host_state_kwargs(host_state: bool) -> dict[str, Any]:
    return HOST_STATE_WRITER_KWARGS if host_state else {}


_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")


def delegated(holder: str, method: Callable[Concatenate[Any, _Args], _Result]
              ) -> Callable[Concatenate[Any, _Args], _Result]:
    """A method that calls its namesake `method` on `self.<holder>`, the object a wrapper holds."""
    name = method.__name__

    def forwarded(self: Any, *args: _Args.args, **kwargs: _Args.kwargs) -> _Result:
        return getattr(getattr(self, holder), name)(*args, **kwargs)

    return forwarded


def built(plain: type, timed: type, timeline: HookTimeline | None, *args: Any, **kwargs: Any) -> Any:
    """A `plain` writer or reader, or with a timeline the `timed` subclass, recording there."""
    return plain(*args, **kwargs) if timeline is None else timed(*args, timeline=timeline, **kwargs)


@runtime_checkable
class CheckpointStore(Protocol):
    """What every store implements; the defaults: no client to build, no cache, no multipart uploads."""

    kind: str  # "s3" | "fs"

    # -- where ------------------------------------------------------------------------
    def location(self, suffix: str) -> str:
        """The URI / path of checkpoint `suffix` ("" for the root)."""

    def describe(self) -> dict[str, Any]:
        """What the run record says about this store (no secrets)."""

    # -- data plane: DCP's writer and reader ---------------------------------------------
    def writer(self, suffix: str, timeline: HookTimeline | None = None,
               host_state: bool = False) -> Any:
        """A DCP StorageWriter for a new checkpoint `suffix`; with a timeline, the timed subclass
        (storage/timed_dcp.py). `host_state`: in host memory (HOST_STATE_WRITER_KWARGS)."""

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> Any:
        """A DCP StorageReader for checkpoint `suffix`; with a timeline, timed likewise."""

    def warm_up(self, storage_io: Any) -> list[Any]:
        """Build any client the writer/reader would build lazily, outside the timed region; its
        botocore event emitters, for the request statistics ([] where there are none)."""
        return []

    def environment(self) -> dict[str, str]:
        """Variables a rank sets before it builds a writer or reader (storage/s3_clients.py)."""
        return {}

    def close(self) -> None:
        """At the end of the process: remove what the store made in it (MSC's profile)."""
        return None

    def drop_cache(self, suffix: str, share: tuple[int, int] = (0, 1)) -> str | None:
        """Before a timed load (untimed): make it read storage, not a local cache; the policy that
        held (storage/pagecache.py), None where there is none. `share` = (index, count): every
        count-th file from index, so the ranks of one node drop each file once."""
        return None

    # -- control plane ------------------------------------------------------------------
    def preflight(self, writes: bool = True) -> None:
        """Fail in seconds, with a UserError naming the setting, if the store is unusable;
        `writes=False` (a load, `list`): readable is enough."""

    def list_checkpoints(self, suffix: str | None = None) -> list[CheckpointInfo]:
        """Every suffix under the root with what it holds, sorted (`suffix`: that one, [] if empty)."""

    def has_objects(self, suffix: str) -> bool: ...

    def object_sizes(self, suffix: str) -> dict[str, int]:
        """Every object of checkpoint `suffix` (its name under the suffix -> bytes)."""

    def is_complete(self, suffix: str) -> bool:
        """True when `suffix` has DCP's `.metadata` (the commit point)."""

    def claim(self, suffix: str, data: bytes) -> SuffixClaim:
        """Create `suffix`'s claim object (layout.CLAIM_NAME) holding `data`, only if it does not
        exist, atomically where the store can: of racing claims exactly one is `won`."""

    def put_small(self, suffix: str, name: str, data: bytes) -> None: ...

    def get_small(self, suffix: str, name: str, max_bytes: int | None = None) -> bytes | None:
        """A small object's bytes (None when absent): at most `max_bytes` of them, so a
        caller that caps a size can ask for one byte more and never hold a huge file."""

    def delete(self, suffix: str) -> None:
        """Remove checkpoint `suffix`, every object of it; nothing when it does not exist.
        UserError for anything that is not a suffix ("" would be every checkpoint)."""

    def probe(self) -> None:
        """Write and remove one small object (untimed): a fresh server's one-time set-up is paid here."""

    # -- raw objects, beside the checkpoints (the raw ceiling) ----------------------------
    def data_object_prefix(self, rank: int) -> str:
        """How DCP's writer begins `rank`'s data object names (prefix strategy folders, `__<rank>_`)."""

    def raw_area(self, token: str) -> RawArea:
        """An area for raw objects beside the checkpoints, `<root>.ceiling/<token>`."""

    # -- what a stopped save leaves (S3 multipart uploads: stored and billed until aborted)
    def open_uploads(self, suffix: str | None = None) -> list[OpenUpload]:
        """Uploads neither completed nor aborted under `suffix` (None: the whole root); fs has none."""
        return []

    def abort_uploads(self, suffix: str | None = None, min_age_s: float = 0.0,
                      now: datetime.datetime | None = None) -> int:
        """Abort those uploads started at least `min_age_s` before `now` (default: the moment of
        the call; a caller that showed which it would abort passes the `now` it decided with)."""
        return 0

    def clean_raw_area(self, token: str) -> int:
        """Remove what a run left in its raw area `token` (S3: uploads aborted); how many aborted."""


def ceiling_token(run_id: str | None) -> str:
    """One run's raw area: named by the run (the launcher cleans up after it), else random."""
    return run_id or f"t-{secrets.token_hex(4)}"


def read_ahead_reader(reader: type, storage: Any, timeline: HookTimeline | None, *args: Any, **kwargs: Any) -> Any:
    """The tool's reader (storage/read_ahead.py) with a store's settings; timed (it owns its clocks)."""
    return reader(*args, timeline=timeline or HookTimeline(), read_ahead=storage.read_ahead,
                  group_bytes=storage.read_ahead_mib * 2**20, **kwargs)
