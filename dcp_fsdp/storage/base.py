"""The storage contract: what a rank and the launcher need from any checkpoint store.

Modelled on torchtitan's `CheckpointStorage`: one Protocol, implemented by the S3 store
(s3torchconnector's DCP writer/reader; boto3 for the control plane) and the file-system
store (DCP's own FileSystemWriter/Reader, the baseline). Layout and suffix policy are
not here: `layout.py` owns them, in terms of this contract.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from dcp_fsdp.storage.layout import CheckpointInfo


@runtime_checkable
class CheckpointStore(Protocol):
    kind: str  # "s3" | "fs"

    # -- where ------------------------------------------------------------------------
    def location(self, suffix: str) -> str:
        """The URI / path of checkpoint `suffix` ("" for the root)."""

    def describe(self) -> dict[str, Any]:
        """What the run record says about this store (no secrets)."""

    # -- data plane: DCP's writer and reader ---------------------------------------------
    def writer(self, suffix: str) -> Any:
        """A DCP StorageWriter for a new checkpoint `suffix`."""

    def reader(self, suffix: str) -> Any:
        """A DCP StorageReader for checkpoint `suffix`."""

    def warm_up(self, storage_io: Any) -> None:
        """Build any client the writer/reader would build lazily, outside the timed region."""

    def drop_cache(self, suffix: str) -> str | None:
        """Before a timed load (untimed): make the load read storage, not a local cache; the
        cache policy that held (storage/pagecache.py), or None where there is no such cache."""

    # -- control plane ------------------------------------------------------------------
    def preflight(self) -> None:
        """Fail in seconds, with a UserError naming the setting, if the store is unusable."""

    def list_checkpoints(self) -> list[CheckpointInfo]: ...

    def has_objects(self, suffix: str) -> bool: ...

    def is_complete(self, suffix: str) -> bool:
        """True when `suffix` has DCP's `.metadata` (the commit point)."""

    def put_small(self, suffix: str, name: str, data: bytes) -> None: ...

    def get_small(self, suffix: str, name: str) -> bytes | None: ...
