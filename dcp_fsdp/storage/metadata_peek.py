"""What a checkpoint holds, read from DCP's `.metadata` without importing torch.

The light parent decides whether a load can work (model, dtype, state) before any rank
starts; importing torch there would cost seconds per run. `.metadata` is a pickle of
DCP's dataclasses, so it is read here with an unpickler that builds plain stand-ins for
torch's classes and refuses every other global: nothing from the file is executed.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import re

# Bytes per element of the dtypes a checkpoint of ours can hold (torch's names).
_DTYPE_BYTES = {"float32": 4, "float": 4, "float64": 8, "double": 8, "float16": 2, "half": 2,
                "bfloat16": 2, "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1}
_SAFE_BUILTINS = {("builtins", name) for name in ("dict", "list", "tuple", "set", "frozenset",
                                                    "int", "float", "str", "bytes", "object")}
_SAFE_BUILTINS |= {("collections", "OrderedDict"), ("copyreg", "_reconstructor"),
                   ("builtins", "getattr")}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str  # torch's name, e.g. "bfloat16"

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 4)


class _Stand:
    """A stand-in for any torch class: keeps the pickled state as attributes."""

    def __init__(self, *args, **kwargs) -> None:
        self._args = args

    def __setstate__(self, state) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and any(isinstance(part, dict) for part in state):
            for part in state:  # (dict, slots)
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, tuple):
            # TensorProperties pickles (dtype, layout, requires_grad, memory format, pin)
            names = [part for part in state if isinstance(part, str) and part.startswith("torch.")]
            if names:
                self.dtype = names[0]


class _Size(tuple):
    pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and name == "Size":
            return _Size
        if module == "torch" and not name[:1].isupper():
            return f"torch.{name}"  # torch.bfloat16, torch.strided, torch.contiguous_format
        if module == "torch" or module.startswith("torch.") or module == "pathlib":
            return type(name, (_Stand,), {})
        if (module, name) in _SAFE_BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")


def read_tensors(data: bytes) -> dict[str, TensorEntry] | None:
    """{flattened key ("model.x.weight", "optim.state..."): shape and dtype}, or None when
    the file is not a pickle we understand (the ranks then check it themselves)."""
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
        entries = metadata.state_dict_metadata
    except Exception:  # any malformed or newer file: not ours to refuse here
        return None
    if not isinstance(entries, dict):
        return None
    tensors = {}
    for key, entry in entries.items():
        size = getattr(entry, "size", None)
        properties = getattr(entry, "properties", None)
        if size is None or properties is None:
            continue  # bytes entries (e.g. step counters saved as objects)
        dtype = str(getattr(properties, "dtype", "torch.float32"))
        tensors[str(key)] = TensorEntry(tuple(int(n) for n in size),
                                        re.sub(r"^torch\.", "", dtype))
    return tensors


def bytes_by_part(tensors: dict[str, TensorEntry]) -> dict[str, int]:
    """Bytes per top-level part of the state dict: {"model": ..., "optim": ...}."""
    parts: dict[str, int] = {}
    for key, entry in tensors.items():
        part = key.split(".", 1)[0]
        parts[part] = parts.get(part, 0) + entry.size_bytes
    return parts
