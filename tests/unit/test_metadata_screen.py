"""The `.metadata` screen (storage/metadata_peek.py): real DCP metadata passes, crafted
pickles are refused in one line and run nothing, and a load of one stops in the pre-flight."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import pytest

from dcp_fsdp.errors import UserError
from dcp_fsdp.storage import metadata_peek
from dcp_fsdp.storage.metadata_peek import MetadataRefused, TensorEntry

DATA = Path(__file__).parent / "data"
METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def _save(tmp_path: Path, state: dict) -> bytes:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    return (tmp_path / ".metadata").read_bytes()


def test_a_model_only_metadata_passes_with_its_shapes_and_dtypes(tmp_path):
    import torch

    model = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.ones(5),
             "h": torch.zeros(2, dtype=torch.float16), "x": torch.zeros(1, 2, 3, 4).to(
                 memory_format=torch.channels_last)}
    tensors = metadata_peek.read_facts(_save(tmp_path, {"model": model})).tensors
    assert tensors == {"model.w": TensorEntry((3, 4), "bfloat16"),
                       "model.b": TensorEntry((5,), "float32"),
                       "model.h": TensorEntry((2,), "float16"),
                       "model.x": TensorEntry((1, 2, 3, 4), "float32")}


def test_a_metadata_with_adamw_state_passes(tmp_path):
    import torch

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": b"raw"}
    tensors = metadata_peek.read_facts(_save(tmp_path, state)).tensors
    assert tensors["optim.state.0.step"] == TensorEntry((), "float32")  # a scalar tensor
    assert tensors["optim.state.0.exp_avg"] == TensorEntry((3, 4), "float32")
    assert "optim.param_groups.0.lr" not in tensors and "extra" not in tensors  # bytes entries
    assert metadata_peek.bytes_by_part(tensors) == {"model": 15 * 4, "optim": 2 * 4 + 2 * 15 * 4}


def test_a_torch_2_15_metadata_with_strides_passes():
    """Saved by torch 2.15 (`TensorProperties` gained a 6th item, strides); a PosixPath id."""
    data = (DATA / "torch215_adamw.metadata").read_bytes()
    tensors = metadata_peek.read_facts(data).tensors
    assert tensors["model.weight"] == TensorEntry((3, 4), "bfloat16")
    assert tensors["optim.state.1.exp_avg_sq"] == TensorEntry((3,), "float32")
    properties = metadata_peek.screen(data).state_dict_metadata["model.weight"].properties
    assert properties.strides == (4, 1) and properties.memory_format == "contiguous_format"


def test_a_metadata_written_under_python_3_11_2_passes():
    """Saved (torch 2.13, AdamW state, 2 ranks) by Debian 12's python3.11 (3.11.2), whose Enum
    pickles a member by name, `builtins.getattr(_MEM_FORMAT_ENCODING, "TORCH_..._FORMAT")`:
    the screen refused every such checkpoint as possibly hostile."""
    data = (DATA / "torch213_py3112_adamw.metadata").read_bytes()
    assert b"getattr" in data and b"TORCH_CONTIGUOUS_FORMAT" in data
    tensors = metadata_peek.read_facts(data).tensors
    assert tensors["model.model.embed_tokens.weight"] == TensorEntry((8192, 256), "float32")
    assert tensors["optim.state.model.norm.weight.exp_avg"] == TensorEntry((256,), "float32")
    entries = metadata_peek.screen(data).state_dict_metadata
    assert {entry.properties.memory_format for entry in entries.values()
            if hasattr(entry, "properties")} == {"contiguous_format"}


# -- crafted pickles ----------------------------------------------------------------------

def _text(value: str) -> bytes:
    return b"V" + value.encode("raw-unicode-escape") + b"\n"  # UNICODE, protocol 0


def _call(callable_ops: bytes, *args: bytes) -> bytes:
    return callable_ops + b"(" + b"".join(args) + b"tR"  # callable(*args): MARK ... TUPLE REDUCE


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _shell(marker: Path) -> bytes:
    """A pickle that creates `marker` through os.system, as a nested payload."""
    return _call(_global("os", "system"), _text(f"touch {marker}")) + b"."


def _getattr_chain(marker: Path) -> bytes:
    """The issue's chain: getattr(stand-in class, "__init__").__globals__.get("pickle")
    .loads(a payload that runs os.system)."""
    getattr_ = _global("builtins", "getattr")
    init = _call(getattr_, _global(METADATA_MODULE, "TensorProperties"), _text("__init__"))
    module_globals = _call(getattr_, init, _text("__globals__"))
    pickle_module = _call(_call(getattr_, module_globals, _text("get")), _text("pickle"))
    payload = _shell(marker)
    loads = _call(getattr_, pickle_module, _text("loads"))
    return _call(loads, b"C" + bytes([len(payload)]) + payload) + b"."


def test_the_getattr_chain_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    attack = _getattr_chain(marker)
    with pytest.raises(MetadataRefused) as refused:
        metadata_peek.read_facts(attack, "suffix=x: .metadata")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("suffix=x: .metadata: refused")
    assert f"builtins.getattr({METADATA_MODULE}.TensorProperties, '__init__')" in message
    assert "possibly hostile" in message
    assert "not loaded" in message
    assert not marker.exists()


@pytest.mark.parametrize("owner, name", [
    (_global(METADATA_MODULE, "_MEM_FORMAT_ENCODING"), _text("__class__")),
    (_global(METADATA_MODULE, "_MEM_FORMAT_ENCODING"), _text("mro")),
    (_global(METADATA_MODULE, "_MEM_FORMAT_ENCODING"), b"I0\n"),  # a member's value, not name
    (_global("torch", "Size"), _text("TORCH_CONTIGUOUS_FORMAT")),
    (_global("torch.serialization", "_get_layout"), _text("__globals__")),
], ids=["dunder", "method", "not-a-name", "another-owner", "globals"])
def test_getattr_in_any_other_shape_is_refused(owner, name):
    with pytest.raises(MetadataRefused) as refused:
        metadata_peek.read_facts(_call(_global("builtins", "getattr"), owner, name) + b".")
    message = str(refused.value)
    assert "builtins.getattr(" in message and "possibly hostile" in message, message


class _Reduce:
    def __init__(self, target, args):
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def _attacks(marker: Path) -> dict[str, tuple[bytes, str]]:
    """{attack: (pickle, what the refusal names)}: none must create `marker`."""
    import os

    new_tensor_metadata = _global(METADATA_MODULE, "TensorStorageMetadata") + b")\x81"  # NEWOBJ
    return {
        "os.system reduce": (pickle.dumps(_Reduce(os.system, (f"touch {marker}",))),
                             "global posix.system"),
        "os.system global": (_shell(marker), "global os.system"),
        "builtins.eval": (_call(_global("builtins", "eval"),
                                _text(f"open({str(marker)!r}, 'w')")) + b".",
                          "global builtins.eval"),
        "subprocess.Popen": (pickle.dumps(_Reduce(subprocess.Popen, (["touch", str(marker)],))),
                             "global subprocess.Popen"),
        "torch._utils._rebuild_tensor": (_call(_global("torch._utils", "_rebuild_tensor"),
                                               _text("x")) + b".",
                                         "global torch._utils._rebuild_tensor"),
        "torch.load": (_call(_global("torch", "load"), _text(str(marker))) + b".",
                       "global torch.load"),
        "a torch module's __builtins__": (_global(METADATA_MODULE, "__builtins__") + b".",
                                          f"global {METADATA_MODULE}.__builtins__"),
        "a torch module's os": (_global("torch.serialization", "os") + b".",
                                "global torch.serialization.os"),
        "a dotted name into a class": (
            pickle.PROTO + b"\x04" + b"\x8c" + bytes([len(METADATA_MODULE)])
            + METADATA_MODULE.encode() + b"\x8c\x11Metadata.__init__\x93.",
            f"global {METADATA_MODULE}.Metadata.__init__"),
        "functools.partial": (_global("functools", "partial") + b".", "global functools.partial"),
        "importlib.import_module": (_global("importlib", "import_module") + b".",
                                    "global importlib.import_module"),
        "__setstate__ setting __class__": (
            new_tensor_metadata + b"(V__class__\n" + _global("torch", "Size") + b"db.",
            "state setting '__class__'"),
        "slot state setting __class__": (
            new_tensor_metadata + b"N(V__class__\n" + _global("torch", "Size") + b"d\x86b.",
            "state setting '__class__'"),
        "state shadowing __setstate__": (
            new_tensor_metadata + b"(V__setstate__\nI1\ndb.", "state setting '__setstate__'"),
        "a callable as a field": (
            new_tensor_metadata + b"(Vappend\n" + _global("torch", "Size") + b"db.",
            "append set to a callable"),
        "state set on a stand-in class": (_global("torch", "Size") + b"(Vx\nI1\ndb.",
                                          "state set on a stand-in callable"),
        "a dataclass called with arguments": (
            _call(_global(METADATA_MODULE, "Metadata"), _text("x")) + b".",
            "Metadata called with arguments"),
        "torch.Size of a string": (_call(_global("torch", "Size"), _text("rm -rf")) + b".",
                                   "torch.Size of other than"),
        "a persistent id": (b"P0\n.", "not a readable pickle"),
    }


@pytest.mark.parametrize("attack", list(_attacks(Path("/nonexistent"))))
def test_crafted_pickles_are_refused_in_one_line_and_run_nothing(tmp_path, attack):
    marker = tmp_path / "pwned"
    data, found = _attacks(marker)[attack]
    with pytest.raises(MetadataRefused) as refused:
        metadata_peek.read_facts(data, "suffix=x: .metadata")
    message = str(refused.value)
    assert "\n" not in message and found in message, message
    assert "refused as" in message and "not loaded" in message
    assert not marker.exists()
    assert metadata_peek._Size.__dict__.get("x") is None  # no stand-in was changed


def test_damaged_and_oversized_files_are_refused(monkeypatch, tmp_path):
    import torch

    real = _save(tmp_path, {"model": {"w": torch.zeros(2)}})
    for damaged in (real[: len(real) // 2], b"not a pickle", b"", pickle.dumps({"a": 1})):
        with pytest.raises(MetadataRefused, match="damaged or possibly hostile"):
            metadata_peek.read_facts(damaged)
    monkeypatch.setattr(metadata_peek, "MAX_METADATA_BYTES", len(real) - 1)
    with pytest.raises(MetadataRefused, match="bytes, over the"):
        metadata_peek.read_facts(real)


# -- the pre-flight of a load -------------------------------------------------------------

def _hostile_checkpoint(root: Path, marker: Path) -> None:
    (root / "x").mkdir(parents=True)
    (root / "x" / ".metadata").write_bytes(_getattr_chain(marker))


def test_preflight_refuses_a_load_of_a_hostile_metadata(tmp_path):
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.launch.preflight import preflight

    marker = tmp_path / "pwned"
    _hostile_checkpoint(tmp_path / "ckpt", marker)
    cfg = compose("load", ["storage=fs", f"storage.path={tmp_path / 'ckpt'}", "suffix=x"])
    with pytest.raises(UserError) as refused:
        preflight(cfg, {})
    assert "suffix=x: .metadata: refused as possibly hostile" in str(refused.value)
    assert not marker.exists()


def test_facts_carry_the_object_sizes_and_refuse_a_path_out_of_the_checkpoint(tmp_path):
    """The ceiling names its raw objects after the checkpoint's: a storage entry naming
    `../..` would point an fs mirror outside its directory. Refused, not followed."""
    import torch

    raw = _save(tmp_path, {"model": {"w": torch.zeros(64, 8), "b": torch.ones(5)}})
    facts = metadata_peek.read_facts(raw)
    on_disk = {p.name: p.stat().st_size for p in tmp_path.glob("*.distcp")}
    assert facts.object_sizes == on_disk and set(facts.tensors) == {"model.w", "model.b"}
    assert metadata_peek.MetadataFacts.from_json(facts.to_json()) == facts
    metadata = pickle.loads(raw)  # torch's own classes: the test builds the hostile file
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.distcp"
    with pytest.raises(MetadataRefused, match="outside.distcp"):
        metadata_peek.read_facts(pickle.dumps(metadata), "suffix=s: .metadata")


def test_a_multi_storage_client_save_passes(tmp_path, monkeypatch):
    """storage.client=msc: DCP keeps the writer's path, a MultiStoragePath, in
    StorageMeta.checkpoint_id; a load of such a checkpoint was refused as hostile."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp
    from multistorageclient.contrib.torch import MultiStorageFileSystemWriter

    config = tmp_path / "msc.json"
    config.write_text(json.dumps({"profiles": {"local": {"storage_provider": {
        "type": "file", "options": {"base_path": str(tmp_path)}}}}}))
    monkeypatch.setenv("MSC_CONFIG", str(config))
    dcp.save({"w": torch.ones(3)}, no_dist=True,
             storage_writer=MultiStorageFileSystemWriter("msc://local/ckpt", sync_files=False))
    raw = (tmp_path / "ckpt" / ".metadata").read_bytes()
    assert b"MultiStoragePath" in raw
    assert metadata_peek.read_facts(raw).tensors == {"w": TensorEntry((3,), "float32")}
