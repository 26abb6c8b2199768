"""What a checkpoint holds, read from DCP's `.metadata` without importing torch (the light
parent decides whether a load can work before any rank starts): the screen that refuses a
hostile or damaged `.metadata` before any rank unpickles it.

`.metadata` is a pickle, and torch's reader is a plain `pickle.load` on every rank: it would
run whatever a crafted file names, and checkpoints may sit in a bucket others can write to.
`read_facts` either returns what the file holds or raises `MetadataRefused` (one line).

The unpickler admits only the globals DCP's metadata is made of (`ADMITTED`: torch 2.11-2.15,
checked by saving real checkpoints and listing what the pickle names), each answered by a
plain stand-in defined here, never by the real class. No builtins but `getattr` in the one
shape in which Python 3.11.0-3.11.x pickle an Enum member (Debian 12's python3.11; 3.11.7
pickles it by value). DCP pickles with protocol >= 2, where containers are opcodes. A
dataclass stand-in accepts its state only as a dict of lower-case field names (no dunders:
a `__setstate__` payload cannot set `__class__`) holding no callables; fields a newer torch
adds are kept. Persistent ids are refused (the default unpickler's behaviour).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import pickle
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, ClassVar, Iterable

from dcp_fsdp.compat import METADATA_LAYOUT, METADATA_MEMORY_FORMAT, METADATA_STORAGE_INFO, saving_rank
from dcp_fsdp.errors import UserError

# Far above any real `.metadata` (~1 KiB per tensor chunk: ~10 MiB for a 7B model on 64
# ranks), far below what would hurt the launcher's memory.
MAX_METADATA_BYTES = 1 << 30

# Every torch dtype name (torch 2.11-2.15, aliases included) and its bytes per element
# (sub-byte and packed types are stored one byte per element).
DTYPE_BYTES = {
    "float32": 4, "float": 4, "float64": 8, "double": 8, "float16": 2, "half": 2,
    "bfloat16": 2, "complex32": 4, "chalf": 4, "complex64": 8, "cfloat": 8,
    "complex128": 16, "cdouble": 16, "int64": 8, "long": 8, "int32": 4, "int": 4,
    "int16": 2, "short": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    "bits8": 1, "bits16": 2, "bit": 1,
    **{f"{kind}{bits}": 1 for kind in ("int", "uint") for bits in range(1, 8)},
}
_LAYOUTS = {"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc",
            "_mkldnn", "jagged"}
# _MEM_FORMAT_ENCODING's members (torch/distributed/checkpoint/metadata.py), of values 0-2
_MEMORY_FORMAT_MEMBERS = {"TORCH_CONTIGUOUS_FORMAT": "contiguous_format",
                          "TORCH_CHANNELS_LAST": "channels_last", "TORCH_PRESERVE_FORMAT": "preserve_format"}
_MEMORY_FORMATS = dict(enumerate(_MEMORY_FORMAT_MEMBERS.values()))
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


class MetadataRefused(UserError):
    """The screen would not read a `.metadata`: possibly hostile or damaged, not loaded."""


class _Refused(Exception):
    """Raised inside the unpickler: what was found, for the one-line refusal."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str  # torch's name, e.g. "bfloat16"

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 4)


# -- the stand-ins: plain data in, plain data out -----------------------------------------

class _DType(str):
    """`torch.<name>` for a dtype: the name. No __dict__, so a BUILD on it fails."""

    __slots__ = ()


class _Record:
    """A stand-in for one of DCP's dataclasses: its fields as attributes, nothing else. Built
    as a dataclass pickles (NEWOBJ, then BUILD): a call with arguments (REDUCE) is refused."""

    TORCH_NAME: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        if args or kwargs:
            raise _Refused(f"{cls.TORCH_NAME} called with arguments")
        return super().__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slots): a dataclass with __slots__
        if not isinstance(state, dict):
            raise _Refused(f"{self.TORCH_NAME} state of type {type(state).__name__}")
        for name, value in state.items():
            if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name):
                raise _Refused(f"{self.TORCH_NAME} state setting {name!r}")
            if callable(value):  # only a class this module admits can be one
                raise _Refused(f"{self.TORCH_NAME}.{name} set to a callable")
        self.__dict__.update(state)


def _record(torch_name: str) -> type[_Record]:
    short = torch_name.rsplit(".", 1)[1]
    return type(short, (_Record,), {"TORCH_NAME": torch_name, "__module__": __name__})


class _TensorProperties(_Record):
    """Pickles as a tuple: (dtype, layout, requires_grad, memory format encoding,
    pin_memory), plus strides from torch 2.15 on."""

    TORCH_NAME = f"{_DCP_METADATA}.TensorProperties"
    dtype: str

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            super().__setstate__(state)
            return
        if not isinstance(state, tuple) or len(state) not in (5, 6):
            raise _Refused(f"{self.TORCH_NAME} state {type(state).__name__} of "
                           f"{len(state) if isinstance(state, tuple) else '?'} items")
        dtype, layout, requires_grad, memory_format, pin_memory = state[:5]
        strides = state[5] if len(state) == 6 else None
        if not isinstance(dtype, _DType):
            raise _Refused(f"{self.TORCH_NAME} dtype {type(dtype).__name__}, not a torch dtype")
        if (not isinstance(layout, str) or not isinstance(memory_format, str)
                or not isinstance(requires_grad, bool) or not isinstance(pin_memory, bool)
                or not (strides is None or _is_int_tuple(strides))):
            raise _Refused(f"{self.TORCH_NAME} state of other types than DCP's")
        self.__dict__.update(dtype=str(dtype), layout=layout, requires_grad=requires_grad,
                             memory_format=memory_format, pin_memory=pin_memory,
                             strides=strides)


class _Callable:
    """A stand-in called by the pickle (REDUCE): __new__ returns plain data, so there is
    never an instance, and a BUILD on the class itself is refused."""

    @staticmethod
    def __setstate__(*args: Any) -> None:
        raise _Refused("state set on a stand-in callable")


class _Size(_Callable):
    def __new__(cls, dims: Any = ()) -> tuple[int, ...]:  # type: ignore[misc]
        if not _is_int_tuple(dims, allow_list=True):
            raise _Refused("torch.Size of other than non-negative ints")
        return tuple(dims)


class _Layout(_Callable):
    def __new__(cls, name: Any) -> str:  # type: ignore[misc]
        short = name.removeprefix("torch.") if isinstance(name, str) else None
        if short not in _LAYOUTS:
            raise _Refused(f"{'.'.join(METADATA_LAYOUT)} of {name!r}")
        return short


class _MemoryFormatEncoding(_Callable):
    def __new__(cls, value: Any) -> str:  # type: ignore[misc]
        if type(value) is not int or value not in _MEMORY_FORMATS:
            raise _Refused(f"{METADATA_MEMORY_FORMAT[1]} of {value!r}")
        return _MEMORY_FORMATS[value]


class _EnumMemberByName(_Callable):
    """`builtins.getattr` as Python 3.11.0-3.11.x pickle an Enum member, by its name:
    `getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")`, and in no other shape."""

    def __new__(cls, owner: Any, name: Any) -> str:  # type: ignore[misc]
        if owner is not _MemoryFormatEncoding or not isinstance(name, str) or (
                name not in _MEMORY_FORMAT_MEMBERS):
            owner_name = next((".".join(key) for key, standin in ADMITTED.items()
                               if standin is owner), type(owner).__name__)
            raise _Refused(f"builtins.getattr({owner_name}, {name!r}), not a "
                           f"{METADATA_MEMORY_FORMAT[1]} member")
        return _MEMORY_FORMAT_MEMBERS[name]


class _PosixPath(_Callable):
    """A pathlib path (`StorageMeta.checkpoint_id` of a local save): rebuilt as a string."""

    PURE: ClassVar[type[PurePosixPath] | type[PureWindowsPath]] = PurePosixPath

    def __new__(cls, *parts: Any) -> str:  # type: ignore[misc]
        if not all(isinstance(part, str) for part in parts):
            raise _Refused("a pathlib path of other than strings")
        return str(cls.PURE(*parts))


class _WindowsPath(_PosixPath):
    PURE = PureWindowsPath


class _MultiStoragePath(_Record):
    """multi-storage-client's path (`StorageMeta.checkpoint_id` of an MSC save): its path strings."""

    TORCH_NAME = "multistorageclient.pathlib.MultiStoragePath"

    def __setstate__(self, state: Any) -> None:
        if (not isinstance(state, dict) or not set(state) <= {"_path", "_internal_path"}
                or not all(isinstance(value, str) for value in state.values())):
            raise _Refused(f"{self.TORCH_NAME} state other than its path strings")
        self.path = state.get("_path")


def _is_int_tuple(value: Any, allow_list: bool = False) -> bool:
    kinds = (tuple, list) if allow_list else (tuple,)
    return isinstance(value, kinds) and all(type(n) is int and n >= 0 for n in value)


class _TensorStorageMetadata(_Record):
    TORCH_NAME = f"{_DCP_METADATA}.TensorStorageMetadata"
    size: tuple[int, ...]
    properties: _TensorProperties


_Metadata = _record(f"{_DCP_METADATA}.Metadata")
_BytesStorageMetadata = _record(f"{_DCP_METADATA}.BytesStorageMetadata")
_DCP_RECORDS: tuple[type[_Record], ...] = (
    _Metadata, _TensorStorageMetadata, _BytesStorageMetadata, _TensorProperties,
    *(_record(f"{_DCP_METADATA}.{name}") for name in ("ChunkStorageMetadata", "MetadataIndex", "StorageMeta")))
# (module, name) -> stand-in: the whole allowlist, apart from the torch.<dtype> names.
ADMITTED: dict[tuple[str, str], type] = {
    **{(_DCP_METADATA, standin.TORCH_NAME.rsplit(".", 1)[1]): standin for standin in _DCP_RECORDS},
    METADATA_MEMORY_FORMAT: _MemoryFormatEncoding,
    ("builtins", "getattr"): _EnumMemberByName,  # that enum's member by name (Python 3.11.2)
    METADATA_STORAGE_INFO: _record(".".join(METADATA_STORAGE_INFO)),
    ("torch", "Size"): _Size,
    ("multistorageclient.pathlib", "MultiStoragePath"): _MultiStoragePath,
    METADATA_LAYOUT: _Layout,
    # `pathlib._local`: where Python 3.13 defines them
    **{(module, name): standin for module in ("pathlib", "pathlib._local")
       for name, standin in (("PosixPath", _PosixPath), ("PurePosixPath", _PosixPath),
                             ("WindowsPath", _WindowsPath), ("PureWindowsPath", _WindowsPath))},
}


class _ScreeningUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in DTYPE_BYTES:
            return _DType(name)
        standin = ADMITTED.get((module, name))
        if standin is None:
            raise _Refused(f"global {module}.{name}")
        return standin


@dataclasses.dataclass(frozen=True)
class MetadataFacts:
    """What the tool needs of a checkpoint's `.metadata`, from its one screened read per run."""

    tensors: dict[str, TensorEntry]  # flattened key -> shape and dtype
    object_sizes: dict[str, int]  # data object (relative path) -> bytes: its last item's end
    # of the bytes screened: DCP's own read must be these bytes before it unpickles them
    sha256: str = ""
    # its StorageMeta holds MSC's path object (an MSC save before PortableMscWriter): only
    # storage.client=msc, with the writer's profile, can unpickle it (msc_only)
    msc_paths: bool = False

    @property
    def saving_world_size(self) -> int:
        """How many ranks wrote the data objects (DCP names them `__<rank>_<n>.distcp`)."""
        ranks = [rank for name in self.object_sizes if (rank := saving_rank(name)) is not None]
        return 1 + max(ranks) if ranks else 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetadataFacts:
        tensors = {key: TensorEntry(tuple(t["shape"]), t["dtype"]) for key, t in data["tensors"].items()}
        return cls(**{**data, "tensors": tensors})


# A data object's name as DCP writes it (`__0_0.distcp`): never a path out of the checkpoint.
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


def first_difference(stored: dict[str, TensorEntry],
                     expected: Iterable[tuple[str, tuple[int, ...], str | None]]) -> str | None:
    """The first difference of a checkpoint's tensors from the expected ones (key, shape,
    dtype name or None for any), or None."""
    for key, shape, dtype in expected:
        entry = stored.get(key)
        if entry is None:
            return f"it has no tensor '{key}'"
        if tuple(entry.shape) != tuple(shape):
            return f"'{key}' is {list(entry.shape)} there but {list(shape)} here"
        if dtype is not None and entry.dtype != dtype:
            return f"'{key}' is torch.{entry.dtype} there but torch.{dtype} here"
    return None


def read_facts(data: bytes, source: str = ".metadata") -> MetadataFacts:
    """The tensors and data-object sizes of a `.metadata`; MetadataRefused (one line naming
    `source`) for a file the screen does not admit."""
    metadata = screen(data, source)
    sizes: dict[str, int] = {}
    storage_data = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage_data, dict):
        raise _refusal(source, "its storage_data is not a dict", hostile=False)
    for info in storage_data.values():
        path, offset, length = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
        if not (isinstance(path, str) and _OBJECT_NAME.fullmatch(path) and path not in (".", "..")
                and type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise _refusal(source, f"a storage entry names object {path!r} at {offset!r}+{length!r}",
                           hostile=True)
        sizes[path] = max(sizes.get(path, 0), offset + length)
    storage_meta = getattr(metadata, "storage_meta", None)
    msc_paths = isinstance(getattr(storage_meta, "checkpoint_id", None), _MultiStoragePath)
    tensors = {key: TensorEntry(entry.size, entry.properties.dtype)
               for key, entry in metadata.state_dict_metadata.items()
               if isinstance(entry, _TensorStorageMetadata)}  # not bytes entries (e.g. lr, step ints)
    return MetadataFacts(tensors, sizes, hashlib.sha256(data).hexdigest(), msc_paths)


def msc_only(facts: MetadataFacts) -> str | None:
    """Why only storage.client=msc can load this checkpoint, or None (any client can)."""
    if not facts.msc_paths:
        return None
    return ("it was saved by storage.client=msc and its .metadata holds multi-storage-client "
            "path objects, which only MSC (with its profile) can unpickle")


def screen(data: bytes, source: str = ".metadata") -> Any:
    """The Metadata stand-in unpickled from `data`, every global checked against ADMITTED;
    MetadataRefused otherwise."""
    if len(data) > MAX_METADATA_BYTES:
        raise _refusal(source, f"{len(data)} bytes, over the {MAX_METADATA_BYTES} a "
                       "DCP .metadata may have here", hostile=False)
    try:
        metadata = _ScreeningUnpickler(io.BytesIO(data)).load()
    except _Refused as found:
        raise _refusal(source, f"it names {found}, which DCP's metadata never holds",
                       hostile=True) from None
    except RecursionError:
        raise _refusal(source, "it nests deeper than Python can follow", hostile=True) from None
    except Exception as error:  # truncated, not a pickle, a stand-in misused: all unreadable
        raise _refusal(source, f"it is not a readable pickle ({type(error).__name__}: "
                       f"{(str(error).splitlines() or [''])[0][:200]})", hostile=False) from None
    problem = _shape_problem(metadata)
    if problem:
        raise _refusal(source, problem, hostile=False)
    return metadata


def _shape_problem(metadata: Any) -> str | None:
    """What makes an admitted unpickled object other than DCP's Metadata, or None."""
    if not isinstance(metadata, _Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return "its state_dict_metadata is not a dict"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"state_dict_metadata has a {type(key).__name__} key"
        if isinstance(entry, _BytesStorageMetadata):
            continue
        if not isinstance(entry, _TensorStorageMetadata):
            return f"state_dict_metadata[{key!r}] is a {type(entry).__name__}"
        properties = getattr(entry, "properties", None)
        if not _is_int_tuple(getattr(entry, "size", None)) or not isinstance(
                getattr(properties, "dtype", None), str):
            return f"state_dict_metadata[{key!r}] has no size and dtype"
    return None


def _refusal(source: str, found: str, hostile: bool) -> MetadataRefused:
    why = "possibly hostile" if hostile else "damaged or possibly hostile"
    return MetadataRefused(
        f"{source}: refused as {why}: {found}; the checkpoint was not loaded (torch would "
        "unpickle this file on every rank); remove it or load another suffix")


def bytes_by_part(tensors: dict[str, TensorEntry]) -> dict[str, int]:
    """Bytes per top-level part of the state dict: {"model": ..., "optim": ...}."""
    parts: dict[str, int] = {}
    for key, entry in tensors.items():
        part = key.split(".", 1)[0]
        parts[part] = parts.get(part, 0) + entry.size_bytes
    return parts
