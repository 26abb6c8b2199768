"""Every private torch, s3torchconnector or multi-storage-client internal the tool uses, and only here
(docs/architecture.md): each use checks that it is there and raises MissingInternal (one line) when
a release dropped it. Importing it imports neither torch nor the connector (the light launcher uses
the version checks) nor anything of the package: a warning or a death signal is handed in.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, overload

if TYPE_CHECKING:
    from torch.distributed.checkpoint import DefaultSavePlanner

# The torch releases this tool is tested on (pyproject's range; `make torch-smoke` runs the
# lowest and the newest, the pinned CPU build runs the full suite).
TORCH_MIN = (2, 11)
TORCH_MAX_TESTED = (2, 15)
# torch's modules a rank imports before its first figure, for the agent to import before it forks
# its ranks (launch/forked_rank.py). torch._dynamo is private: fully_shard's first DTensor imports it.
RANK_TORCH_MODULES = ("torch", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                      "torch.distributed.fsdp", "torch._dynamo")

_warned: set[str] = set()


class MissingInternal(RuntimeError):
    """A private internal this tool relies on is not in the installed release."""


def installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.11.0+cu130' or '2.15.0'."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def torch_version_problem() -> str | None:
    """Why the installed torch is outside the tested range (None: inside). No torch import."""
    version = installed_version("torch")
    found = release(version)
    low, high = ".".join(map(str, TORCH_MIN)), ".".join(map(str, TORCH_MAX_TESTED))
    if found < TORCH_MIN:
        return (f"torch {version} is older than {low}, the oldest release this tool is tested "
                f"on; install torch>={low},<{TORCH_MAX_TESTED[0]}.{TORCH_MAX_TESTED[1] + 1}")
    if found > TORCH_MAX_TESTED:
        return f"torch {version} is newer than {high}, the newest release this tool is tested on"
    return None


def _missing(what: str, package: str, way_out: str) -> MissingInternal:
    return MissingInternal(f"{what} is not in {package} {installed_version(package)} "
                           f"(this tool is tested on torch {TORCH_MIN[0]}.{TORCH_MIN[1]} to "
                           f"{TORCH_MAX_TESTED[0]}.{TORCH_MAX_TESTED[1]}); {way_out}")


def _internal(module: str, name: str, package: str = "torch",
              way_out: str = "install a torch release in the tested range") -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{name}", package, way_out) from None


def _warn_once(key: str, message: str, warn: Callable[[str], None]) -> None:
    if key not in _warned:
        _warned.add(key)
        warn(message)


# -- torch: how DCP names a checkpoint's data objects ---------------------------------------
# FileSystemWriter writes rank r's data as `__<r>_<n>.distcp` (torch 2.11-2.15); the connector's
# prefix strategies put the same base names under folders of their own.
DATA_OBJECT_SUFFIX = ".distcp"
_DATA_OBJECT_NAME = re.compile(r"__(\d+)_\d+\.distcp")


def data_object_prefix(rank: int) -> str:
    return f"__{rank}_"


def saving_rank(name: str) -> int | None:
    """The rank that wrote a data object, from its key or path (None: not a DCP data object)."""
    found = _DATA_OBJECT_NAME.fullmatch(name.rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


# -- torch: DCP's reader internals the tool's own reader reuses (storage/read_ahead.py) ------

def load_stream(reader: Any, read_item: Any, storage_info: Any, raw: Any) -> Any:
    """An item's stream after DCP's load transforms (`FileSystemReader.transforms`, private;
    torch 2.11-2.15), as DCP's read_data makes it; the raw stream where a reader has none."""
    transforms = getattr(reader, "transforms", None)
    if transforms is None:
        return raw
    return transforms.transform_load_stream(
        read_item, getattr(storage_info, "transform_descriptors", None) or (), raw)


def saved_tensor_layout(open_item: Any) -> tuple[Any, int]:
    """Where the tensor one `torch.save` wrote lies in its bytes: (the tensor on the meta device,
    the offset of its data record from the item's start), from the zip's framing only (torch's
    private zip reader gives the record's offset). `open_item()`: a new seekable file each call."""
    import torch

    meta = torch.load(open_item(), map_location="meta", weights_only=True)
    if meta.untyped_storage().nbytes() == 0:
        return meta, 0
    records: Any = torch._C.PyTorchFileReader(open_item())
    (name,) = [record for record in records.get_all_records() if record.startswith("data/")]
    return meta, int(records.get_record_offset(name))


def saved_tensor_view(item: memoryview, as_file: Any) -> Any:
    """The tensor one `torch.save` wrote into `item` (its bytes, writable), as a view of
    those bytes (`saved_tensor_layout`). `as_file(view)`: a seekable file over a memoryview."""
    import torch

    meta, offset = saved_tensor_layout(lambda: as_file(item))
    if meta.untyped_storage().nbytes() == 0:  # frombuffer takes no empty range
        return torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype)
    data = torch.frombuffer(item, dtype=torch.uint8, count=meta.untyped_storage().nbytes(),
                            offset=offset)
    return data.view(meta.dtype).as_strided(meta.size(), meta.stride(), meta.storage_offset())


def narrow_tensor_by_index(tensor: Any, offsets: Any, sizes: Any) -> Any:
    """DCP's own narrowing of a loaded item to the part a read asks for."""
    return _internal("torch.distributed._shard._utils", "narrow_tensor_by_index")(tensor, offsets, sizes)


# -- torch: the private names a `.metadata` pickle holds --------------------------------------
# storage/metadata_peek.py's screen admits these (module, name) globals, each stood in by a
# class of its own: nothing of torch is imported to read a `.metadata` (torch 2.11-2.15).
METADATA_MEMORY_FORMAT = ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
METADATA_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
METADATA_LAYOUT = ("torch.serialization", "_get_layout")


# -- torch: state dicts and DTensor shards --------------------------------------------------


def flatten_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """DCP's own flattening ("model.x.weight" keys), so keys match what DCP writes."""
    return _internal("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")(state_dict)


def local_shape_and_global_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard of a DTensor: its shape and global offset as DCP computes them (uneven too)."""
    compute = _internal("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    return compute(tensor.shape, tensor.device_mesh, tensor.placements)


def split_by_size_and_type(bins: int, items: list) -> list[list]:
    """How DCP's FileSystemWriter bins a rank's write items into thread_count files."""
    split = _internal("torch.distributed.checkpoint.filesystem", "_split_by_size_and_type",
                      way_out="use dcp-fsdp save (ceiling needs DCP's own file binning)")
    return split(bins, items)


def dedup_save_plans(plans: list) -> list:
    """DCP's coordinator's deduplication (DefaultSavePlanner.create_global_plan's first step), for
    `dcp-fsdp plan` to lay out a large world's files without the rest of the global plan."""
    return _internal("torch.distributed.checkpoint._dedup_save_plans", "dedup_save_plans")(plans)


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """What DCP's FileSystemWriter records for one write item in `.metadata`'s storage_data
    (`dcp-fsdp plan` builds the `.metadata` a save would write, without writing one)."""
    return _internal("torch.distributed.checkpoint.filesystem", "_StorageInfo")(relative_path, offset, length)


# -- torch: a tensor with no memory behind it -----------------------------------------------

@functools.cache
def _fake_tensor_mode() -> Any:
    return _internal("torch._subclasses.fake_tensor", "FakeTensorMode")()


def fake_tensor(shape: tuple[int, ...], dtype: Any) -> Any:
    """A tensor of `shape` and `dtype` with no memory behind it (torch's FakeTensorMode):
    torch.save under `torch.serialization.skip_data(materialize_fake_tensors=True)` writes
    all but its bytes, so `plan` sizes a chunk without allocating it."""
    import torch

    with _fake_tensor_mode():
        return torch.empty(shape, dtype=dtype)


def dcp_metadata_version() -> str:
    return str(_internal("torch.distributed.checkpoint.filesystem", "CURRENT_DCP_VERSION"))


# -- torch: the process checkpointer's daemon -----------------------------------------------

_EXECUTOR = "torch.distributed.checkpoint._async_process_executor"


def start_checkpoint_daemon(group: Any, wrap_init_info: Callable[[Any], Any]) -> None:
    """Start the process checkpointer's daemon now, untimed (dcp.async_save would, inside the first
    timed save), joined to `group`. `wrap_init_info(info)`, pickled in place of torch's init info, ties
    the daemon's life to the rank's (lifeline.DiesWithParent: no orphan may still commit .metadata)."""
    executor: Any = importlib.import_module(_EXECUTOR)  # private names, checked below
    names = ("_CHECKPOINT_PROCESS", "_AsyncCheckpointProcess", "_ProcessGroupInitInfo")
    if not all(hasattr(executor, name) for name in names):
        raise _missing(f"{_EXECUTOR}.{'/'.join(names)}", "torch", "use async_save.checkpointer=thread")
    if executor._CHECKPOINT_PROCESS is None:
        info = wrap_init_info(executor._ProcessGroupInitInfo(group))
        executor._CHECKPOINT_PROCESS = executor._AsyncCheckpointProcess(info)


# -- s3torchconnector: its native (CRT) client ----------------------------------------------

def build_native_client(file_system: Any, warn: Callable[[str], None]) -> bool:
    """Build the lazy native client of a DCP writer's or reader's S3FileSystem (storage/timed_fs.py
    `client_file_system`) now; False (`warn` once per process) where this release hides it."""
    client = getattr(file_system, "_client", None)
    if client is None or not hasattr(type(client), "_client"):
        _warn_once("client", f"s3torchconnector {installed_version('s3torchconnector')}: its S3 client "
                   "could not be built before the timer starts (no _client._client on its storage "
                   "writer's/reader's file system); client set-up (~1 s) is inside the first timed "
                   "save or load of each rank", warn)
        return False
    client._client  # noqa: B018 - property access builds the client
    return True


def s3_client(region: str, client_config: Any) -> Any:
    """The connector's S3Client (not exported by the package), native client built now."""
    way_out = "install s3torchconnector[dcp]~=1.5.0"
    client_class = _internal("s3torchconnector._s3client", "S3Client", "s3torchconnector", way_out)
    client = client_class(region, s3client_config=client_config)
    if not hasattr(type(client), "_client"):
        raise _missing("s3torchconnector S3Client._client", "s3torchconnector", way_out)
    client._client  # noqa: B018 - property access builds the native client
    return client


def object_chunks(client: Any, bucket: str, key: str) -> Iterable[bytes]:
    """An object's bytes as the native client streams them (no reader buffering): the ceiling's raw GET."""
    return client._client.get_object(bucket, key)


# The connector's native module: it configures its request logger once, when first imported.
CONNECTOR_NATIVE_MODULE = "s3torchconnectorclient._mountpoint_s3_client"


def connector_native_loaded() -> bool:
    """Whether the connector's native module is imported (too late then to turn its request log on)."""
    return CONNECTOR_NATIVE_MODULE in sys.modules


@overload
def save_planner(plan_caching: Literal[True], cache_key: str) -> DefaultSavePlanner: ...
@overload
def save_planner(plan_caching: bool, cache_key: str) -> DefaultSavePlanner | None: ...
def save_planner(plan_caching: bool, cache_key: str) -> DefaultSavePlanner | None:
    """DCP's DefaultSavePlanner with save plan caching, or None (DCP's default planner). DCP
    keys its class-level plan cache by class name, and the plans it replays carry the writer's
    file prefixes: the subclass keys them per writer layout (`cache_key`), so a save with another
    prefix strategy (tune, between trials) never replays stale plans."""
    if not plan_caching:
        return None
    return _keyed_save_planner_class()(cache_key)


@functools.cache
def _keyed_save_planner_class() -> type:
    from torch.distributed.checkpoint import DefaultSavePlanner

    class KeyedSavePlanner(DefaultSavePlanner):
        def __init__(self, cache_key: str) -> None:
            super().__init__(enable_plan_caching=True)
            self._cached_plans_key = f"DefaultSavePlanner:{cache_key}"
            self.cache_key = cache_key

        def __reduce__(self) -> tuple:
            # pickled into the process checkpointer's daemon: rebuilt there by name (the class is
            # made on first use, so that importing compat imports no torch)
            return save_planner, (True, self.cache_key)

    return KeyedSavePlanner


def host_stager(options: Any) -> Any:
    """A DefaultStager that stages in its thread (`options.use_async_staging`) without the
    accelerator stream torch's own creates whenever the machine has one (a CUDA context on GPU 0
    in every gloo rank of a GPU host): for CPU ranks."""
    if options.use_pinned_memory or options.use_non_blocking_copy:
        raise ValueError("host_stager: pinned memory and non-blocking copies need a device")
    return _host_stager_class()(options)


@functools.cache
def _host_stager_class() -> type:
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.checkpoint.staging import DefaultStager

    class HostStager(DefaultStager):
        def __init__(self, options: Any) -> None:
            super().__init__(dataclasses.replace(options, use_async_staging=False))
            if not all(hasattr(self, name) for name in ("_config", "_staging_executor")):
                raise _missing("DefaultStager._config/_staging_executor", "torch",
                               "use async_save.async_staging=false on CPU ranks")
            if options.use_async_staging:
                self._config = options
                self._staging_executor = ThreadPoolExecutor(max_workers=1)

    return HostStager


def round_robin_prefix_strategy(prefixes: Iterable[str]) -> Any:
    """storage.prefix_strategy=round_robin: the connector's, not exported by s3torchconnector.dcp (1.5)."""
    strategy = _internal("s3torchconnector.dcp.s3_prefix_strategy", "RoundRobinPrefixStrategy",
                         "s3torchconnector", "use storage.prefix_strategy=default, binary or hex")
    return strategy(list(prefixes))


# -- the other DCP clients (storage.client=fsspec|msc; storage/s3_clients.py) ---------------

def fsspec_dcp_classes() -> tuple[type, type]:
    """torch's FsspecWriter / FsspecReader: in torch 2.11-2.15 they live in the private
    `torch.distributed.checkpoint._fsspec_filesystem` (newer torch makes the module public)."""
    for module in ("torch.distributed.checkpoint.fsspec",
                   "torch.distributed.checkpoint._fsspec_filesystem"):
        try:
            found = importlib.import_module(module)
            return found.FsspecWriter, found.FsspecReader
        except (ImportError, AttributeError):
            continue
    raise _missing("torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter", "torch",
                   "use storage.client=s3torchconnector")


def msc_botocore_events(storage_client: Any, warn: Callable[[str], None]) -> Any:
    """The botocore event emitter of an MSC StorageClient's S3 provider (MSC exposes neither), or
    None (`warn` once per process) where it has none (its Rust client, another provider)."""
    provider = getattr(storage_client, "_storage_provider", None)
    boto = getattr(provider, "_s3_client", None)
    meta = getattr(boto, "meta", None)
    if meta is None:
        _warn_once("msc-events", "multi-storage-client's S3 provider exposes no boto3 client "
                                 "here: its requests are not counted by the tool (the server's "
                                 "counters still are, with storage.metrics_url)", warn)
        return None
    return meta.events


def msc_reads_ranged(stream: Any) -> bool:
    """Whether an MSC object file reads by ranged GETs (above its 512 MiB `MEMORY_LOAD_LIMIT`: a
    private `RemoteFileReader` behind `_file`), not the whole object downloaded; ask after its first call."""
    return type(getattr(stream, "_file", None)).__name__ == "RemoteFileReader"


def use_multiprocessing_tempdir(path: str) -> None:
    """multiprocessing's temporary directory for this process (private: its process's
    `_config["tempdir"]`, which `util.get_temp_dir()` reads before it makes one in TMPDIR):
    the fork server's socket goes there, and a unix socket's path holds at most 107 bytes."""
    import multiprocessing.process

    config = getattr(multiprocessing.process.current_process(), "_config", None)
    if not isinstance(config, dict):
        raise MissingInternal(f"multiprocessing's process _config is not in Python "
                              f"{sys.version.split()[0]}; unset DCP_FSDP_TEST_ONLY_FORK_RANKS "
                              "(ranks are then exec'd)")
    config["tempdir"] = path
