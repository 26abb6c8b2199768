"""Checks beyond types, before any rank starts. Every error names the setting and the fix."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from dcp_fsdp import contract
from dcp_fsdp.config.schema import (MLPERF_CHECKPOINTS, BenchmarkConfig, Command, Dtype, ModelConfig,
                                    PrefixStrategy, Protocol, ReaderKind, ReplicaLoad, SaveMode,
                                    StorageClient, StorageConfig, StorageKind, TrainStepWork,
                                    iter_settings)
from dcp_fsdp.errors import UserError

S3_MIN_PART_SIZE_MIB = 5  # S3 rejects multipart parts below 5 MiB (except the last)
S3_MAX_PART_SIZE_MIB = 5 * 1024

MAX_THREAD_COUNT = 256  # writer threads per rank: more only adds files and contention
MAX_ATTEMPTS = 100  # the CRT client retries with back-off: more would hang on a dead server
MAX_TIMEOUT_S = 7 * 86400.0  # a week: beyond that a typo, and timers overflow
MAX_DELAY_S = 86400.0

# Group names and nested nodes that may be given on their own (`model=L7b`, `storage=fs`).
GROUPS = ("model", "storage")
NODES = ("async_save", "tune")


def _storage_settings(prefix: str) -> frozenset[str]:
    """The storage.* settings whose help starts with `prefix`: the one kind or client using them."""
    return frozenset(name for name, _, _, text in iter_settings()
                     if name.startswith("storage.") and text.startswith(prefix))


# storage.* settings only one storage kind uses; the rest (kind, thread_count, ...) both use.
FS_ONLY, S3_ONLY = _storage_settings("fs:"), _storage_settings("s3:")
# storage.* settings of one S3 client only (storage.client=); the rest reach every client.
CLIENT_ONLY = {
    StorageClient.s3torchconnector: frozenset({
        "storage.part_size_mib", "storage.throughput_target_gbps", "storage.max_attempts",
        "storage.prefix_strategy", "storage.prefix_count", "storage.round_robin_prefixes",
        "storage.reader", "storage.max_gap_size_mib"}),
    StorageClient.fsspec: _storage_settings("s3: client=fsspec only:"),
    StorageClient.msc: _storage_settings("s3: client=msc only:"),
}
# What each client needs installed, and how (pyproject's dependencies bring all three).
CLIENT_PACKAGES = {StorageClient.s3torchconnector: ("s3torchconnector", "'s3torchconnector[dcp]'"),
                   StorageClient.fsspec: ("s3fs", "s3fs"),
                   StorageClient.msc: ("multistorageclient", "multi-storage-client")}

_S3_URI = re.compile(r"^s3://(?P<bucket>[^/]+)(?:/(?P<prefix>.*))?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# A checkpoint's suffix starts with a letter or digit: no suffix can take the name of the raw
# ceiling's folder (storage/layout.py).
_SUFFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

NAME_MAX_BYTES = 255  # a file or directory name on Linux file systems
KEY_MAX_BYTES = 1024  # an S3 object key
LONGEST_OBJECT_NAME = 64  # room for DCP's object names under a suffix (__0_0.distcp, ...)
GENERATED_SUFFIX_ROOM = 32  # a generated suffix (2026-11-22-13-45-ab12, 21 bytes) and -N, '/'s


def check_suffix_length(suffix: str, iterations: int, kind: str, prefix: str = "") -> None:
    """A suffix the storage cannot hold fails here, not after every rank built the model (a
    save of several iterations writes NAME-1 .. NAME-N)."""
    longest = f"{suffix}-{iterations}" if iterations > 1 else suffix
    size = len(longest.encode())
    if kind == "fs" and size > NAME_MAX_BYTES:
        raise UserError(f"suffix={suffix}: {longest!r} is {size} bytes, longer than a file "
                        f"name may be ({NAME_MAX_BYTES}); use a shorter suffix")
    limit = KEY_MAX_BYTES - LONGEST_OBJECT_NAME - len(prefix.encode())
    if kind == "s3" and size > limit:
        raise UserError(f"suffix={suffix}: {size} bytes; with the prefix and DCP's object "
                        f"names an S3 key would pass {KEY_MAX_BYTES} bytes: use at most {limit}")


def suffix_taken(suffix: str) -> bool:
    """Whether `suffix=` (load, delete) accepts this name."""
    return bool(_SUFFIX.match(suffix))


def check_suffix(suffix: str) -> None:
    if not suffix_taken(suffix):
        raise UserError(f"suffix={suffix}: start with an ASCII letter or digit, then use letters, "
                        "digits, '.', '_' and '-' only, e.g. suffix=run-1")


def model_config_names(conf_dir: Path) -> list[str]:
    """The presets `model=` can name: one conf/model/<name>.yaml each (a test holds them equal
    to models/presets.py)."""
    return sorted(path.stem for path in (conf_dir / "model").glob("*.yaml"))


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) or UserError."""
    match = _S3_URI.match(uri)
    if not match:
        hint = (" (storage.client=msc builds its own msc:// profile from the s3:// URI)"
                if uri.startswith("msc://") else "")
        raise UserError(f"storage.uri={uri}: not an S3 URI; write it as s3://bucket/prefix{hint}")
    bucket, prefix = match["bucket"], (match["prefix"] or "").strip("/")
    if {".", ".."} & set(prefix.split("/")) or "//" in prefix:
        raise UserError(f"storage.uri={uri}: the prefix has an empty, '.' or '..' part; S3 keys "
                        "have no folders to step through (servers refuse or keep them "
                        "literally): write the prefix plainly, e.g. s3://bucket/ckpt/run1")
    # room for a generated suffix and DCP's object names (suffix= is checked exactly apart)
    longest_prefix = KEY_MAX_BYTES - LONGEST_OBJECT_NAME - GENERATED_SUFFIX_ROOM
    if len(prefix.encode()) > longest_prefix:
        raise UserError(f"storage.uri: its prefix is {len(prefix.encode())} bytes; with a "
                        f"checkpoint's suffix and DCP's object names an S3 key would pass "
                        f"{KEY_MAX_BYTES} bytes: use a prefix of at most {longest_prefix} bytes")
    if not _BUCKET.match(bucket) or ".." in bucket or re.match(r"^\d+\.\d+\.\d+\.\d+$", bucket):
        raise UserError(
            f"storage.uri={uri}: '{bucket}' is not a valid S3 bucket name; use 3-63 lowercase "
            "letters, digits, dots and hyphens, starting and ending with a letter or digit")
    return bucket, prefix


@functools.cache
def setting_names() -> tuple[str, ...]:
    return tuple(name for name, _, _, _ in iter_settings())


def check_setting_name(written: str, key: str, package: str | None = None) -> None:
    """`key` (written as `written`, with any +, ++ or ~) names a setting, or UserError naming
    the closest one."""
    if package:
        written = written.split("@", 1)[0]
        raise UserError(f"{written}@{package}: package overrides (@) are not supported; "
                        f"write {key}=VALUE")
    if key in setting_names() or key in NODES:
        if written.startswith("+") and not written.startswith("++"):
            raise UserError(f"{written}: {key} is a setting already; write {key}=VALUE "
                            "(without +)")
        return
    if key in GROUPS:
        if written.startswith("~"):
            raise UserError(f"{written}: {key} cannot be removed; choose another, e.g. "
                            + ("model=L7b" if key == "model" else "storage=fs"))
        return
    raise UserError(f"{written}: unknown setting{did_you_mean(key, [*setting_names(), *GROUPS])} "
                    "(dcp-fsdp save --help lists every setting)")


def did_you_mean(value: str, choices: list[str]) -> str:
    """'; did you mean X?' for a typo, else '': first a choice whose last dotted part is the
    same but for case and punctuation (L7B: L7b, gpt4b: GPT-4B, uri: storage.uri)."""
    def plain(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.rsplit(".", 1)[-1].lower())

    same = [choice for choice in choices if plain(choice) == plain(value)]
    close = same or difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def check_storage_settings(cfg: BenchmarkConfig, given: set[str]) -> None:
    """A storage setting given for the other storage kind would be ignored: refuse it."""
    kind = cfg.storage.kind
    for name in sorted(given):
        if kind == StorageKind.s3 and name in FS_ONLY:
            raise UserError(f"{name} is used only with storage=fs, and this run uses storage=s3 "
                            "(it would save to S3): add storage=fs")
        if kind == StorageKind.fs and name in S3_ONLY:
            raise UserError(f"{name} is used only with storage=s3, and this run uses storage=fs: "
                            f"remove {name}, or use storage=s3")
        for owner, names in CLIENT_ONLY.items():  # another client would ignore it
            if owner != cfg.storage.client and name in names:
                raise UserError(f"{name} is a setting of storage.client={owner.value}, and this "
                                f"run uses storage.client={cfg.storage.client.value}: remove "
                                f"{name}, or add storage.client={owner.value}")
        if name == "storage.max_gap_size_mib" and cfg.storage.reader != ReaderKind.dcp_optimized:
            raise UserError(f"{name} is used only with storage.reader=dcp_optimized, and this run "
                            f"uses storage.reader={cfg.storage.reader.value}: remove {name}")


def check_model_settings(cfg: BenchmarkConfig, given: set[str]) -> None:
    """model.config decides the shape: a preset given beside it would be ignored."""
    if cfg.model.config and given & {"model", "model.preset"}:
        raise UserError(f"model={cfg.model.preset} and model.config={cfg.model.config} both name "
                        "the model: give one of them")


# A config.json's dtype field as model.dtype (`dtype` since transformers 4.56, `torch_dtype`
# before). float16 is built as bf16: as many bytes a parameter, and fast to fill on CPUs too.
CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}
CONFIG_DTYPE_FIELDS = ("dtype", "torch_dtype")


def config_json_dtype(path: str) -> tuple[str, Any] | None:
    """(field, value) of the dtype a config.json names, or None: no such field, or a file that
    models/hf_json.py refuses in its own line."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return next(((field, data[field]) for field in CONFIG_DTYPE_FIELDS
                 if data.get(field) is not None), None)


def apply_config_dtype(cfg: BenchmarkConfig, given: set[str]) -> None:
    """model.config's model is built in the dtype its file names unless model.dtype is given;
    a dtype the tool does not build is refused."""
    if not cfg.model.config or "model.dtype" in given:
        return
    found = config_json_dtype(cfg.model.config)
    if found is None:
        return
    field, value = found
    if value not in CONFIG_DTYPES:
        raise UserError(f"model.config={cfg.model.config}: '{field}' is {value!r}, which this "
                        "tool does not build (float32, bfloat16, float16 as bfloat16); give "
                        "model.dtype=fp32 or model.dtype=bf16")
    cfg.model.dtype = Dtype(CONFIG_DTYPES[value])


def dtype_origin(model: ModelConfig) -> tuple[str, str]:
    """(where model.dtype came from: "config.json" or "model.dtype", a few words saying it), for
    the run line, `plan` and the record."""
    found = config_json_dtype(model.config) if model.config else None
    if found is None:
        return "model.dtype", ("the config.json names no dtype: model.dtype's" if model.config
                               else "")
    field, value = found
    if CONFIG_DTYPES.get(value) == model.dtype.value:
        same_bytes = ", as many bytes" if value == "float16" else ""
        return "config.json", f"the config.json's {field} {value}{same_bytes}"
    return "model.dtype", f"model.dtype given; the config.json's {field} is {value}"


def apply_protocol(cfg: BenchmarkConfig, given: set[str], named: str | None = None) -> None:
    """protocol=mlperf fixes MLPerf's counts, times only saves and loads and verifies every load
    (docs/mlperf.md): a setting that would change these is refused. `named`: the command as
    typed, where it composes as another (plan as save)."""
    if cfg.protocol != Protocol.mlperf:
        return
    if named == "plan":
        raise UserError("protocol=mlperf: plan answers for one save and its load, the same "
                        f"under either protocol (MLPerf's run makes {MLPERF_CHECKPOINTS} such "
                        f"saves, then loads the last {MLPERF_CHECKPOINTS} times); drop protocol")
    if cfg.command != Command.save_and_load:
        raise UserError(f"protocol=mlperf: MLPerf's checkpointing protocol saves then loads; run "
                        f"it with dcp-fsdp save-and-load (not {named or cfg.command.value}), or "
                        "drop protocol")
    if not cfg.verify:
        raise UserError("verify=false: protocol=mlperf verifies every load bit for bit, after "
                        "its timer (no figure pays for it; docs/mlperf.md); drop verify=false, "
                        "or drop protocol=mlperf")
    if "iterations" in given and cfg.iterations != MLPERF_CHECKPOINTS:
        raise UserError(f"iterations={cfg.iterations}: protocol=mlperf fixes {MLPERF_CHECKPOINTS} "
                        f"saves, then {MLPERF_CHECKPOINTS} loads of the last; drop iterations, "
                        "or drop protocol=mlperf")
    if cfg.ceiling:
        raise UserError("ceiling=true: protocol=mlperf times only its saves and loads; drop "
                        "ceiling, or drop protocol=mlperf")
    cfg.iterations = MLPERF_CHECKPOINTS


MAX_READ_AHEAD = 64  # the tool's reader's fetches in flight (threads) per rank


def _check_numbers(cfg: BenchmarkConfig) -> None:
    values: dict[str, Any] = {name: functools.reduce(getattr, name.split("."), cfg) for name in setting_names()}
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{name}={value}: give a finite number")
    ranges = (  # (setting, lowest, highest, whether the lowest is allowed)
        ("iterations", 1, 1_000_000, True), ("nproc", 1, None, True),
        ("model.replicas", 1, None, True), ("model.tp", 1, None, True),
        ("seed", 0, 2**32 - 1, True), ("delay_s", 0, MAX_DELAY_S, True),
        ("op_timeout_s", 0, MAX_TIMEOUT_S, False),
        ("collective_timeout_s", 0, MAX_TIMEOUT_S, False),
        ("train_step_s", 0, 3600.0, True), ("progress_interval_s", 0, MAX_DELAY_S, False),
        ("tune.budget_s", 0, MAX_TIMEOUT_S, False), ("tune.repeats", 1, 1000, True),
        ("tune.trials", 1, 100_000, True), ("async_save.steps_between_saves", 0, 1_000_000, True),
        ("storage.max_attempts", 1, MAX_ATTEMPTS, True),
        ("storage.thread_count", 1, MAX_THREAD_COUNT, True),
        ("storage.throughput_target_gbps", 0, None, False),
        ("storage.connect_timeout_s", 0, 600.0, False),
        ("storage.prefix_count", 1, None, True),
        ("storage.max_gap_size_mib", 0, None, True),
        ("storage.fsspec_block_size_mib", S3_MIN_PART_SIZE_MIB, S3_MAX_PART_SIZE_MIB, True),
        ("storage.fsspec_max_pool_connections", 1, 1024, True),
        ("storage.msc_part_size_mib", S3_MIN_PART_SIZE_MIB, S3_MAX_PART_SIZE_MIB, True),
        ("storage.msc_multipart_threshold_mib", S3_MIN_PART_SIZE_MIB, None, True),
        ("storage.msc_max_concurrency", 1, MAX_THREAD_COUNT, True),
        ("storage.msc_prefetch_threads", 1, MAX_THREAD_COUNT, True),
        ("storage.read_ahead", 0, MAX_READ_AHEAD, True),
        ("storage.read_ahead_mib", 1, S3_MAX_PART_SIZE_MIB, True),
    )
    for name, lowest, highest, lowest_ok in ranges:
        value = values[name]
        if value is None:
            continue
        too_low = value < lowest if lowest_ok else value <= lowest
        if too_low or (highest is not None and value > highest):
            low = f"{lowest} or more" if lowest_ok else f"more than {lowest}"
            span = low + (f", at most {_number(highest)}" if highest is not None else "")
            raise UserError(f"{name}={_number(value)}: must be {span}")


def check_replicas(replicas: int, world_size: int, name: str, tp: int = 1) -> None:
    """`world_size` ranks (from the setting or variable `name`) must form `replicas` groups of
    equal size. With model.tp the fix counts its groups too, so model.tp's check accepts it."""
    if world_size % replicas == 0:
        return
    group = replicas * tp
    fits = [r for r in range(1, world_size // tp + 1) if world_size % (r * tp) == 0]
    multiple = group * -(-world_size // group)
    times = f" = {replicas} x model.tp={tp}" if tp > 1 else ""
    raise UserError(f"model.replicas={replicas}: {name}={world_size} ranks cannot form "
                    f"{replicas} replica groups of equal size; use {name}={multiple} (a "
                    f"multiple of {group}{times}), or model.replicas one of "
                    f"{', '.join(map(str, fits or [1]))}")


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def validate(cfg: BenchmarkConfig, conf_dir: Path) -> None:
    """Checks beyond types. Raises UserError naming the setting and the fix."""
    presets = model_config_names(conf_dir)
    if cfg.model.preset not in presets:
        raise UserError(f"model={cfg.model.preset}: unknown preset; choose one of "
                        + ", ".join(presets))
    _check_numbers(cfg)
    _, unknown = contract.harness_off(os.environ.get(contract.HARNESS_OFF_ENV))
    if unknown:
        raise UserError(f"{contract.HARNESS_OFF_ENV}: unknown piece(s) {', '.join(unknown)}; "
                        f"name any of {', '.join(contract.HARNESS_PIECES)} (benchmark-only)")
    if not cfg.results_dir.strip():
        raise UserError("results_dir is empty: give the directory for the record, e.g. "
                        "results_dir=results")
    _check_combinations(cfg)
    if cfg.command == Command.load and not cfg.suffix:
        raise UserError("suffix is not set: `load` needs the suffix a save printed, e.g. "
                        "suffix=2026-11-22-13-45-ab12 (`dcp-fsdp list` shows them)")
    if cfg.suffix is not None:
        check_suffix(cfg.suffix)
        prefix = parse_s3_uri(cfg.storage.uri)[1] if cfg.storage.uri else ""
        check_suffix_length(cfg.suffix, cfg.iterations if cfg.command != Command.load else 1,
                            cfg.storage.kind.value, prefix)
    _check_storage(cfg.storage)


def _check_combinations(cfg: BenchmarkConfig) -> None:
    """Settings that only mean something together."""
    if cfg.train_step_s > 0 and cfg.save_mode != SaveMode["async"]:
        raise UserError(f"train_step_s={cfg.train_step_s:g}: training steps run only while an "
                        "async save uploads; add save_mode=async (or drop train_step_s)")
    if cfg.async_save.steps_between_saves > 0 and cfg.train_step_s <= 0:
        raise UserError(f"async_save.steps_between_saves={cfg.async_save.steps_between_saves}: "
                        "the steps between saves need a step length; add train_step_s=0.05 "
                        "(and save_mode=async), or drop steps_between_saves")
    if cfg.async_save.train_step_work != TrainStepWork.matmul and cfg.train_step_s <= 0:
        raise UserError(f"async_save.train_step_work={cfg.async_save.train_step_work.value}: "
                        "the simulated training step is off; add train_step_s=0.05 (and "
                        "save_mode=async), or drop train_step_work")
    if cfg.model.replica_load == ReplicaLoad.read_once and cfg.model.replicas < 2:
        raise UserError("model.replica_load=read_once: only replicas other than the first "
                        "receive a broadcast, and this run has model.replicas="
                        f"{cfg.model.replicas}; add model.replicas=2 (nproc a multiple of it), "
                        "or drop replica_load")
    if cfg.plan_caching and cfg.save_mode != SaveMode.sync:
        raise UserError("plan_caching=true: applies to sync saves only; remove it, or "
                        "use save_mode=sync")


def _check_storage(storage: StorageConfig) -> None:
    if storage.kind == StorageKind.fs:
        if not storage.path:
            raise UserError("storage.path is not set: give the directory for storage=fs, "
                            "e.g. storage.path=/fsx/checkpoints")
        return
    if storage.endpoint is not None:  # first: the message below repeats the endpoint
        check_endpoint(storage.endpoint, "storage.endpoint")
    if storage.uri is not None:
        parse_s3_uri(storage.uri)
    elif storage.endpoint:
        raise UserError(f"storage.uri is not set but storage.endpoint={storage.endpoint} is: "
                        "give the bucket too, e.g. storage.uri=s3://my-bucket/checkpoints")
    if storage.region is not None:
        check_region(storage.region, "storage.region")
    module, package = CLIENT_PACKAGES[storage.client]
    if importlib.util.find_spec(module) is None:  # found, not imported: the launcher stays light
        raise UserError(f"storage.client={storage.client.value} needs the package {package}, "
                        f"which is not installed: pip install {package} (make setup installs it)")
    if storage.metrics_url is not None and not re.match(r"^https?://[^/\s]+/\S*$",
                                                        storage.metrics_url):
        raise UserError(f"storage.metrics_url={storage.metrics_url}: write it as "
                        "http(s)://host:port/metrics (the server's Prometheus endpoint)")
    if not S3_MIN_PART_SIZE_MIB <= storage.part_size_mib <= S3_MAX_PART_SIZE_MIB:
        raise UserError(f"storage.part_size_mib={storage.part_size_mib}: S3 multipart parts must "
                        f"be {S3_MIN_PART_SIZE_MIB}..{S3_MAX_PART_SIZE_MIB} MiB")
    _check_prefixes(storage)


def _check_prefixes(storage: StorageConfig) -> None:
    """storage.prefix_strategy and the settings that go with one strategy only."""
    if storage.prefix_strategy == PrefixStrategy.round_robin and not storage.round_robin_prefixes:
        raise UserError("storage.round_robin_prefixes is empty: prefix_strategy=round_robin needs "
                        "a list, e.g. 'storage.round_robin_prefixes=[a,b,c]'")
    if storage.prefix_count is not None and storage.prefix_strategy not in (
            PrefixStrategy.binary, PrefixStrategy.hex):
        raise UserError(f"storage.prefix_count={storage.prefix_count} is used only with "
                        "storage.prefix_strategy=binary or hex (it is "
                        f"{storage.prefix_strategy.value}): add one, or drop prefix_count")
    if storage.round_robin_prefixes and storage.prefix_strategy != PrefixStrategy.round_robin:
        raise UserError("storage.round_robin_prefixes is used only with "
                        "storage.prefix_strategy=round_robin: add it, or drop the prefixes")
    for prefix in storage.round_robin_prefixes:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", str(prefix)):
            raise UserError(f"storage.round_robin_prefixes: '{prefix}' is not a key prefix; use "
                            "letters, digits, '.', '_' and '-', e.g. [a,b,c]")


def check_endpoint(endpoint: str, name: str) -> None:
    """`name`: the setting or variable it came from. One with credentials is refused without
    repeating it: the endpoint is recorded and printed."""
    if "@" in endpoint:
        raise UserError(f"{name} holds credentials (user:password@ before the host), which "
                        "would be recorded and printed: remove them from the URL and set "
                        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead")
    if not re.match(r"^https?://[^/\s]+/?$", endpoint):
        raise UserError(f"{name}={endpoint}: write it as http(s)://host:port")


def check_region(region: str, name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", region):
        raise UserError(f"{name}={region!r}: not a region name; give one like us-east-1")
