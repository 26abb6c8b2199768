"""Before any rank starts: the storage the run will use (the embedded SeaweedFS when no S3 is
configured), checked in the light parent, so bad input fails before any rank imports torch.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from dcp_fsdp.process.environ import environment
from dcp_fsdp.units import MIB
from dcp_fsdp import contract, log
from dcp_fsdp.config.schema import BenchmarkConfig, Command, StorageClient, StorageKind, to_config
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.embedded_s3 import EmbeddedS3
from dcp_fsdp.models.llama_model_config import param_count, state_shapes
from dcp_fsdp.models.presets import model_setting, model_shape, shape_digest
from dcp_fsdp.storage import layout, make_store, metadata_peek
from dcp_fsdp.storage.metadata_peek import MetadataFacts
from dcp_fsdp.storage.s3_target import resolve_endpoint

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dcp_fsdp.storage.base import CheckpointStore

EMBEDDED_BUCKET = "dcp-fsdp"


def needs_embedded_server(cfg: BenchmarkConfig) -> bool:
    return (cfg.storage.kind == StorageKind.s3 and cfg.storage.uri is None
            and resolve_endpoint(cfg.storage) is None)


def forget_aws_credentials() -> None:
    """A fresh boto3 default session: it keeps the credentials it resolved first, and the next
    job of a sweep (its own embedded server, its own keys) was signed with job 1's (HTTP 403)."""
    if "boto3" in sys.modules:
        sys.modules["boto3"].setup_default_session()


@contextlib.contextmanager
def storage_environment(cfg: BenchmarkConfig
                        ) -> Iterator[tuple[BenchmarkConfig, dict[str, str], EmbeddedS3 | None]]:
    """Yield (cfg, extra env, the embedded server or None): the embedded server's if needed."""
    forget_aws_credentials()
    if not needs_embedded_server(cfg):
        yield cfg, {}, None
        return
    if cfg.command == Command.load:
        raise UserError("storage.uri is not set: the embedded S3 server starts empty each run, so "
                        "there is nothing to load; use save-and-load, or keep a server up "
                        "(dcp-fsdp s3-server start) and point storage.uri at it")
    server = EmbeddedS3(bucket=EMBEDDED_BUCKET)
    log.info("no S3 configured: starting the embedded SeaweedFS server on 127.0.0.1")
    endpoint = server.start()
    try:
        cfg = to_config(OmegaConf.merge(OmegaConf.structured(cfg), {"storage": {
            "uri": f"s3://{endpoint.bucket}/checkpoints", "endpoint": endpoint.endpoint_url,
            "region": endpoint.region, "metrics_url": endpoint.metrics_url}}))
        yield cfg, {**endpoint.client_env(), contract.EMBEDDED_ENV: "1"}, server
    finally:
        server.stop()


def preflight(cfg: BenchmarkConfig, server_env: dict[str, str]) -> MetadataFacts | None:
    """The store answers, a save's suffix is free, a load's checkpoint is complete and fits the
    model, dtype and state (else UserError); a load's screened .metadata, read once, for the ranks."""
    with environment(server_env):
        if cfg.storage.kind == StorageKind.fs:
            check_fs_root(cfg.storage.path, must_exist=cfg.command == Command.load)
        store = make_store(cfg.storage)
        store.preflight(writes=cfg.command != Command.load or cfg.ceiling)  # the raw ceiling PUTs
        if cfg.command == Command.load:
            layout.check_loadable(store, _load_suffix(cfg))
            return check_compatible(store, cfg)
        if cfg.suffix and cfg.command in (Command.save, Command.save_and_load):
            layout.check_save_suffixes_free(store, cfg.suffix, cfg.iterations)
        return None


def claim_save_suffixes(cfg: BenchmarkConfig, server_env: dict[str, str],
                        run_id: str) -> tuple[list[str], dict[str, str]]:
    """Claim a save's suffixes (`suffix=NAME`) for `run_id` before any rank starts; of two racing
    saves the loser gets a UserError. (The suffixes claimed, the env telling rank 0 they are its run's.)"""
    if not cfg.suffix or cfg.command not in (Command.save, Command.save_and_load):
        return [], {}
    with environment(server_env):
        claimed, method = layout.claim_configured_suffixes(
            make_store(cfg.storage), cfg.suffix, cfg.iterations, run_id)
    return claimed, {contract.SUFFIX_CLAIMED_ENV: method}


def check_fs_root(path: str | None, must_exist: bool) -> None:
    """storage.path: a directory (or, for a save, one that can be made). Never creates it."""
    if not path:
        raise UserError("storage=fs needs storage.path=DIR: the directory the checkpoints "
                        "are (or will be) in")
    root = Path(path).expanduser()
    if root.exists() and not root.is_dir():
        raise UserError(f"storage.path={path}: is a file, not a directory; give the directory "
                        "the checkpoints are (or will be) in")
    if must_exist and not root.exists():
        raise UserError(f"storage.path={path}: no such directory (nothing was created); check "
                        "the path (`dcp-fsdp list storage=fs storage.path=DIR` shows checkpoints)")


def _load_suffix(cfg: BenchmarkConfig) -> str:
    if not cfg.suffix:  # validation requires it; a caller that skipped validation gets this
        raise UserError("load needs suffix=NAME: the checkpoint to load (`dcp-fsdp list` "
                        "shows them)")
    return cfg.suffix


def check_compatible(store: CheckpointStore, cfg: BenchmarkConfig) -> MetadataFacts:
    """Before any rank builds the model: DCP's .metadata passes the screen (else a UserError),
    and the checkpoint's model, dtype and state (its manifest's, else .metadata's) fit the
    settings. A model-only load of a model-and-optimizer checkpoint is allowed, and said."""
    suffix = _load_suffix(cfg)
    # a damaged manifest is refused unless the load is not to be verified (integrity=false)
    manifest = (layout.read_manifest(store, suffix) if cfg.integrity
                else layout.manifest_if_readable(store, suffix)) or {}
    # Read here, by the screen, before any rank: torch's reader would unpickle anything.
    facts = layout.metadata_facts(store, suffix)
    only_msc = metadata_peek.msc_only(facts)
    if only_msc and not (cfg.storage.kind == StorageKind.s3 and cfg.storage.client == StorageClient.msc):
        raise UserError(f"suffix={suffix}: {only_msc}: load it with storage.client=msc "
                        "(saves by this version store a plain string: any client loads them)")
    layout.check_objects_whole(store, suffix, facts, cfg.storage.prefix_strategy.value)
    if cfg.ceiling:
        layout.check_mirrorable(facts, cfg.nproc, suffix)
    tensors = facts.tensors
    parts = metadata_peek.bytes_by_part(tensors) if tensors else {}
    saved_state = manifest.get("state") or (
        ("model_and_optimizer" if "optim" in parts else "model") if parts else None)
    # the model's dtype as a setting value, from its parameters' dtype in .metadata
    dtypes = {entry.dtype for key, entry in (tensors or {}).items() if key.startswith("model.")}
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(dtypes.pop()) if len(dtypes) == 1 else None
    saved = {"model": manifest.get("model"), "model.moe_layout": manifest.get("model.moe_layout"),
             "model.dtype": manifest.get("model.dtype") or dtype, "state": saved_state}
    wanted = {"model": cfg.model.name, "model.moe_layout": cfg.model.moe_layout.value,
              "model.dtype": cfg.model.dtype.value, "state": cfg.state.value}
    if not manifest:  # not saved by this tool (plain dcp.save): its tensors say what it is
        _check_model_tensors(suffix, cfg, tensors)
    # A manifest with the model's shape identifies the model by its tensors, not by its name
    # (model.config's path): the file edited is refused, an identical copy is taken.
    same_shape = _check_same_shape(suffix, cfg, manifest, tensors)
    differ = [key for key in wanted if saved[key] is not None and saved[key] != wanted[key]
              and not (key == "state" and saved[key] == "model_and_optimizer")
              and not (key == "model" and same_shape)]
    if differ:
        # model.moe_layout=hf is the default: a fix need not name it
        known = " ".join(model_setting(key, value) for key, value in saved.items()
                         if value and (key, value) != ("model.moe_layout", "hf"))
        asked = " ".join(model_setting(key, wanted[key]) for key in differ)
        raise UserError(f"suffix={suffix}: checkpoint was saved with {known}, not {asked}; "
                        f"load it with {known}")
    if saved_state == "model_and_optimizer" and cfg.state.value == "model":
        sizes = (f": {parts['model'] / MIB:.1f} of {sum(parts.values()) / MIB:.1f} MiB"
                 if parts.get("model") else "")
        log.info(f"suffix={suffix} holds model and optimizer state; state=model loads the "
                 f"model state only{sizes} (add state=model_and_optimizer for all of it)")
    return facts


def _check_same_shape(suffix: str, cfg: BenchmarkConfig, manifest: dict, tensors: dict) -> bool:
    """Whether the configured model has the tensors the checkpoint was saved from (the manifest's
    `model.shape`): then another name or path for it loads. The same name with other tensors
    (config.json edited since) is refused: a smaller model would load part of the checkpoint."""
    if not isinstance(manifest.get("model.shape"), str):
        if manifest:  # saved before model.shape: no model tensor there may be missing here
            _check_no_extra_tensors(suffix, cfg, tensors, manifest)
        return False
    if shape_digest(cfg.model) == manifest["model.shape"]:
        return True
    saved = model_setting("model", manifest.get("model"))
    asked = model_setting("model", cfg.model.name)
    if saved != asked:
        return False
    there = manifest.get("param_count")
    counts = (f"{there:,} parameters there, " if isinstance(there, int) else "") + (
        f"{param_count(model_shape(cfg.model)):,} here")
    raise UserError(f"suffix={suffix}: checkpoint was saved from another model than {asked} "
                    f"describes now (was the file edited since the save?): its tensors differ "
                    f"({counts}); restore the file as it was at the save, or give a config.json "
                    "of that shape")


def _check_no_extra_tensors(suffix: str, cfg: BenchmarkConfig, tensors: dict,
                            manifest: dict) -> None:
    """A checkpoint whose manifest has no `model.shape`: refused for a model tensor the
    configured model has not, and, saved with the very settings given, for a model tensor of
    another shape ('load it with' would name what the user typed)."""
    expected = {f"model.{name}": tuple(dims) for name, dims in state_shapes(
        model_shape(cfg.model), cfg.model.moe_layout.value)}
    asked = model_setting("model", cfg.model.name)
    if (extra := layout.extra_model_tensor(tensors, expected)) is not None:
        raise UserError(f"suffix={suffix}: checkpoint was saved from another model than {asked} "
                        f"describes now ({extra}); load it with the model it was saved from "
                        f"({model_setting('model', manifest.get('model'))} as it was then)")
    same_settings = (manifest.get("model") == cfg.model.name
                     and manifest.get("model.moe_layout", "hf") == cfg.model.moe_layout.value)
    changed = same_settings and metadata_peek.first_difference(
        tensors, ((key, dims, None) for key, dims in expected.items()))
    if changed:
        raise UserError(f"suffix={suffix}: checkpoint was saved from another model than {asked} "
                        f"describes now ({changed}): the settings are those of the save, so the "
                        "model they name changed since (was the file edited?); restore the file "
                        "as it was at the save, or give a config.json of that shape")


def _check_model_tensors(suffix: str, cfg: BenchmarkConfig, tensors: dict) -> None:
    """A checkpoint with no manifest (a plain `dcp.save`): its model tensors must be the
    configured model's, named and shaped as this tool's state dict has them."""
    expected = {f"model.{name}": tuple(dims)
                for name, dims in state_shapes(model_shape(cfg.model), cfg.model.moe_layout.value)}
    problem = metadata_peek.first_difference(
        tensors, ((key, dims, None) for key, dims in expected.items())) or layout.extra_model_tensor(
            tensors, expected)
    if problem is None:
        return
    held = ", ".join(f"'{key}'" for key in list(tensors)[:3]) + (", ..." if len(tensors) > 3 else "")
    raise UserError(f"suffix={suffix}: not a checkpoint of this tool (no {layout.MANIFEST_NAME}) "
                    f"and not model={cfg.model.name}'s state ({problem}); it holds "
                    f"{len(tensors)} tensor(s) ({held or 'none'}): this tool loads the state of "
                    "its own models, a preset or model.config=PATH, as `dcp-fsdp save` writes it")
