"""The storage contract: what a rank and the launcher need from any checkpoint store.

Modelled on torchtitan's `CheckpointStorage`: one Protocol, implemented by the S3 store
(s3torchconnector's DCP writer/reader; boto3 for the control plane) and the file-system
store (DCP's own FileSystemWriter/Reader, the baseline). Layout and suffix policy are
not here: `layout.py` owns them, in terms of this contract.

Nothing outside `storage/` reaches into a store: the raw ceiling (`rank/ceiling.py`) and
the tuner (`launch/tune.py`) use only what is declared here (`data_object_prefix`,
`raw_area`, `delete`, `probe`).
"""

from __future__ import annotations

import dataclasses
import datetime

from typing import Any, Iterable, Protocol, runtime_checkable

from dcp_fsdp.storage.timeline import HookTimeline


# -- what a store answers (layout.py re-exports them with the rules that use them) ---------
@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    suffix: str
    complete: bool
    size_bytes: int
    object_count: int
    modified: str  # ISO 8601, UTC, of the newest object
    # Nothing but the claim (layout.CLAIM_NAME): a save that ended between its claim and its first
    # object (an abandoned claim), or one starting there now; not a checkpoint.
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
    """A multipart upload neither completed nor aborted: its parts are stored (and, on
    AWS, billed) until it is aborted."""

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
    """Objects moved raw (no DCP), by the client DCP's writer and reader use, in an area
    beside the checkpoints: never inside one, never seen by `list`. Names are relative to
    the area and may hold '/' (folders). A `client` comes from `open()`; the file system's
    is None."""

    location: str  # the area's URI / path, for messages

    def open(self) -> Any:
        """A client built now, so that no timed operation pays its set-up."""

    def prepare(self, names: Iterable[str]) -> None:
        """Create what must exist before the objects are written (folders); untimed."""

    def put(self, client: Any, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Write one object from its chunks, durably (fs: fsync'd, as DCP's writer does)."""

    def get(self, client: Any, name: str) -> int:
        """Read one object to its end, discarding the bytes; the number read."""

    def get_into(self, client: Any, name: str, target: memoryview) -> int:
        """Read one object into `target` (a preallocated tensor's bytes); the number read."""

    def delete(self, client: Any, names: Iterable[str]) -> None:
        """Remove these objects; the area's folders go when nothing is left in them."""

    def drop_cache(self, names: Iterable[str]) -> str | None:
        """Untimed, before a timed GET: these objects out of the page cache; the policy that
        held (storage/pagecache.py), None where there is no local cache (S3)."""


# A writer's kwargs for state in host memory: no copy-ahead. DCP's writers pick a loader by
# the machine, not the tensors: with CUDA available and one thread they overlap device-to-host
# copies on torch.cuda.current_stream(), which opens a CUDA context on GPU 0 in every gloo
# rank of a GPU host (seen on the lent H100, issue 32). With 0 they read the tensors in order.
HOST_STATE_WRITER_KWARGS: dict[str, Any] = {"per_thread_copy_ahead": 0}


def host_state_kwargs(host_state: bool) -> dict[str, Any]:
    """What every store's writer adds for `writer(..., host_state=)`."""
    return HOST_STATE_WRITER_KWARGS if host_state else {}


@runtime_checkable
class CheckpointStore(Protocol):
    kind: str  # "s3" | "fs"

    # -- where ------------------------------------------------------------------------
    def location(self, suffix: str) -> str:
        """The URI / path of checkpoint `suffix` ("" for the root)."""

    def describe(self) -> dict[str, Any]:
        """What the run record says about this store (no secrets)."""

    # -- data plane: DCP's writer and reader ---------------------------------------------
    def writer(self, suffix: str, timeline: HookTimeline | None = None,
               host_state: bool = False) -> Any:
        """A DCP StorageWriter for a new checkpoint `suffix`; with a timeline, the timed
        subclass of it that records there (storage/timed_dcp.py). `host_state`: the tensors
        are in host memory (a CPU rank), so no copy-ahead (HOST_STATE_WRITER_KWARGS)."""

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> Any:
        """A DCP StorageReader for checkpoint `suffix`; with a timeline, timed likewise."""

    def warm_up(self, storage_io: Any) -> list[Any]:
        """Build any client the writer/reader would build lazily, outside the timed region;
        the botocore event emitters of that client, where the request statistics hook in
        (storage.client=fsspec|msc); [] where the requests are known otherwise (the
        connector's log) or there are none (fs)."""

    def environment(self) -> dict[str, str]:
        """Variables a rank sets before it builds a writer or reader (storage/s3_clients.py)."""

    def close(self) -> None:
        """At the end of the process: remove what the store made in it (MSC's profile)."""

    def drop_cache(self, suffix: str, share: tuple[int, int] = (0, 1)) -> str | None:
        """Before a timed load (untimed): make the load read storage, not a local cache; the
        cache policy that held (storage/pagecache.py), or None where there is no such cache.
        `share` = (index, count): this caller handles every count-th file from index, so the
        ranks of one node together drop each file once (the cache is the node's)."""

    # -- control plane ------------------------------------------------------------------
    def preflight(self, writes: bool = True) -> None:
        """Fail in seconds, with a UserError naming the setting, if the store is unusable;
        `writes=False` (a load, `list`): readable is enough (a snapshot, a read-only export)."""

    def list_checkpoints(self, suffix: str | None = None) -> list[CheckpointInfo]:
        """Every suffix under the root with what it holds (`suffix`: that one only, [] when
        it holds nothing), sorted by suffix."""
        ...

    def has_objects(self, suffix: str) -> bool: ...

    def object_sizes(self, suffix: str) -> dict[str, int]:
        """Every object of checkpoint `suffix` (its name under the suffix -> bytes)."""
        ...

    def is_complete(self, suffix: str) -> bool:
        """True when `suffix` has DCP's `.metadata` (the commit point)."""

    def claim(self, suffix: str, data: bytes) -> SuffixClaim:
        """Create `suffix`'s claim object (layout.CLAIM_NAME) holding `data`, only if it does
        not exist, atomically where the store can (S3 If-None-Match: *, O_EXCL): of racing
        claims exactly one is `won`. The launcher before any rank starts (`suffix=NAME`),
        else rank 0 before any rank writes into `suffix`."""

    def put_small(self, suffix: str, name: str, data: bytes) -> None: ...

    def get_small(self, suffix: str, name: str, max_bytes: int | None = None) -> bytes | None:
        """A small object's bytes (None when absent): at most `max_bytes` of them, so a
        caller that caps a size can ask for one byte more and never hold a huge file."""

    def delete(self, suffix: str) -> None:
        """Remove checkpoint `suffix`, every object of it; nothing when it does not exist.
        UserError for anything that is not a suffix ("" would be every checkpoint)."""

    def probe(self) -> None:
        """Write and remove one small object (untimed): a fresh server's one-time set-up
        (SeaweedFS grows its volumes on a bucket's first write) is paid here."""

    # -- raw objects, beside the checkpoints (the raw ceiling) ----------------------------
    def data_object_prefix(self, rank: int) -> str:
        """How DCP's writer for this store begins the names of `rank`'s data objects
        (its folders under the prefix strategy, then `__<rank>_`)."""

    def raw_area(self, token: str) -> RawArea:
        """An area for raw objects beside the checkpoints, `<root>.ceiling/<token>`."""

    # -- what a stopped save leaves (S3 multipart uploads: stored and billed until aborted)
    def open_uploads(self, suffix: str | None = None) -> list[OpenUpload]:
        """Uploads started and neither completed nor aborted, under `suffix` (None: all
        under the store's root). A file system has none."""

    def abort_uploads(self, suffix: str | None = None, min_age_s: float = 0.0,
                      now: datetime.datetime | None = None) -> int:
        """Abort those uploads started at least `min_age_s` before `now` (default: the
        moment of the call); how many were aborted. A caller that showed which uploads it
        would abort passes the `now` it decided with, so none is aborted that it said it
        would leave."""

    def clean_raw_area(self, token: str) -> int:
        """Everything a run left in its raw area `token` (a ceiling cut short: its objects,
        and on S3 its open multipart uploads, aborted); how many uploads were aborted."""


def ceiling_token(run_id: str | None) -> str:
    """The raw area of one run's ceiling rounds: named by the run, so that the launcher can
    clean up after a run killed mid-round (launch/aftermath.py); a random name without one."""
    import secrets

    return run_id or f"t-{secrets.token_hex(4)}"


def read_ahead_kwargs(storage: Any) -> dict[str, int]:
    """The tool's reader's arguments (storage/read_ahead.py) from a store's settings."""
    return {"read_ahead": storage.read_ahead, "group_bytes": storage.read_ahead_mib * 2**20}
