"""Checks of the machine and environment before any rank starts (the settings themselves:
config/validate.py), each failure one UserError naming the setting or variable and the fix.
No torch import: the launcher stays light.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from collections.abc import Callable

from dcp_fsdp.units import GIB
from dcp_fsdp import compat, contract, log
# the models' shapes only: no torch, no transformers
from dcp_fsdp.models.llama_model_config import param_count
from dcp_fsdp.models.presets import DTYPE_BYTES, model_shape
from dcp_fsdp.models.tensor_parallel import check_tp, rank_holdings
from dcp_fsdp.process import allocator
from dcp_fsdp.config.schema import (AsyncCheckpointer, Backend, BenchmarkConfig,
                                    CheckpointState, Command, Dtype, Malloc, StorageKind)
from dcp_fsdp.config.validate import check_endpoint, check_region, check_replicas
from dcp_fsdp.errors import UserError
from dcp_fsdp.storage.s3_target import endpoint_source
from dcp_fsdp.telemetry.results_dir import record_written, writable_dir_problem  # noqa: F401

RANKS_PER_CORE = 4  # more ranks than this per core only measures the scheduler
CONNECTOR_LOG_ENV = ("S3_TORCH_CONNECTOR_DEBUG_LOGS", "S3_TORCH_CONNECTOR_LOGS_DIR_PATH")
RETRY_MODES = ("legacy", "standard", "adaptive")  # botocore's AWS_RETRY_MODE values
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
NOFILE_ADVISED = 1024  # a rank's files and sockets: its client's connections, torch's store
PROC_GPUS = Path("/proc/driver/nvidia/gpus")
_GPU_LINE = re.compile(r"^GPU \d+:", re.MULTILINE)
_NVIDIA_SMI_TIMEOUT_S = 30
SHM_PATH = "/dev/shm"
# A rank holds more than its state at moments (the build, a save's staging, a load's
# buffers): above this share of what is available the run is warned, not refused.
MEMORY_WARN_SHARE = 0.5


def check_results_dir(results_dir: str) -> None:
    if problem := writable_dir_problem(results_dir):
        raise UserError(f"results_dir={results_dir}: {problem}; choose a directory you can "
                        "write to, e.g. results_dir=$HOME/dcp-fsdp-results")


def cpu_quota_cores(path: str = CGROUP_CPU_MAX) -> float | None:
    """The container's CPU quota in cores (cgroup v2 cpu.max); None when none can be read."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path(path).read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    return None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a container's CPU
    quota (rounded up: 1.5 cores is 2 to schedule on, at 75 % each)."""
    cores = os.cpu_count() or 1  # not Linux: no affinity
    with contextlib.suppress(AttributeError):
        cores = len(os.sched_getaffinity(0))
    quota = cpu_quota_cores()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def host_limit_notes(nproc: int, quota: float | None = None) -> list[str]:
    """A line each for `ulimit -n` below NOFILE_ADVISED, any `ulimit -v`, a CPU quota below nproc:
    warnings, not refusals (a run may fit within them; where it fails, its error names the limit)."""
    import resource

    notes = []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile != resource.RLIM_INFINITY and nofile < NOFILE_ADVISED:
        notes.append(f"ulimit -n is {nofile}: each rank opens files and sockets (its storage "
                     "client's connections, torch's store); a run may fail with 'Too many open "
                     "files': raise it (ulimit -n 65536)")
    if (address_space := resource.getrlimit(resource.RLIMIT_AS)[0]) != resource.RLIM_INFINITY:
        notes.append(f"ulimit -v is {address_space // 1024} KiB: torch and the storage "
                     "clients reserve far more address space than they use, so a cap fails "
                     "allocations ('Cannot allocate memory'): lift it (ulimit -v unlimited)")
    quota = cpu_quota_cores() if quota is None else quota
    if quota is not None and quota < nproc:
        notes.append(f"this container's CPU quota is {quota:.2f} core(s) for nproc={nproc} "
                     "ranks: they share it, and CPU-bound figures (hashing, staging, the "
                     "client's threads) are the quota's, not the machine's")
    return notes


def _cuda_driver_present() -> bool:
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/nvidia0",
                                                 "/proc/driver/nvidia/version"))


def visible_count(physical: int, cuda_visible_devices: str | None) -> int:
    """How many of `physical` GPUs CUDA would enumerate under CUDA_VISIBLE_DEVICES: its
    entries in order, up to the first that is not a device (an index out of range or
    repeated, -1, garbage); UUIDs (GPU-..., MIG-...) are taken as given."""
    if cuda_visible_devices is None:
        return physical
    seen: set[str] = set()
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if entry.isdigit():
            if int(entry) >= physical or str(int(entry)) in seen:
                break
            seen.add(str(int(entry)))
        elif entry.startswith(("GPU-", "MIG-")) and entry not in seen:
            seen.add(entry)
        else:
            break
    return len(seen)


def visible_gpu_count() -> int:
    """GPUs the driver lists (`nvidia-smi -L`, else /proc/driver/nvidia/gpus/*) under CUDA_VISIBLE_DEVICES."""
    physical = None
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        answer = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=_NVIDIA_SMI_TIMEOUT_S)
        if answer.returncode == 0:
            physical = len(_GPU_LINE.findall(answer.stdout))
    if physical is None:
        with contextlib.suppress(OSError):
            physical = sum(1 for entry in PROC_GPUS.iterdir() if entry.is_dir())
    return visible_count(physical, os.environ.get("CUDA_VISIBLE_DEVICES")) if physical else 0


@functools.cache
def cuda_device_count() -> int:
    """The CUDA devices this process could use, counted without torch (its CUDA start-up costs
    5-20 s): the driver's list, narrowed by CUDA_VISIBLE_DEVICES as CUDA does (a MIG slice counts as one)."""
    return visible_gpu_count() if _cuda_driver_present() else 0


def check_devices(backend: Backend, ranks_here: int, device_count: Callable[[], int],
                  bound_per_task: bool = False) -> None:
    """`ranks_here` ranks on this machine, one CUDA device each under nccl (`device_count` called
    only when the backend may use CUDA). `bound_per_task`: a torchrun rank sees only the one GPU
    its task is bound to (Slurm's --gpus-per-task=1), which is its own."""
    if backend == Backend.gloo:
        return
    count = device_count()
    if backend == Backend.nccl and count == 0:
        raise UserError("backend=nccl needs CUDA devices, and none is visible here (check "
                        "CUDA_VISIBLE_DEVICES and the driver); use backend=gloo or backend=auto")
    if count and ranks_here > count and not (count == 1 and bound_per_task):
        raise UserError(f"nproc={ranks_here}: only {count} CUDA device(s) visible here and "
                        f"backend={backend.value} gives each rank its own; use nproc={count} or "
                        "fewer, or backend=gloo for CPU ranks")


def state_bytes_estimate(cfg: BenchmarkConfig) -> int:
    """The state's bytes from the model's shape, dtype and state (no torch): weights, plus
    AdamW's two moments with state=model_and_optimizer. A tied embedding counts once: DCP
    writes it under both keys, but the stager copies each storage once, as memory holds it."""
    weights = param_count(model_shape(cfg.model)) * DTYPE_BYTES[cfg.model.dtype.value]
    return weights * (3 if cfg.state.value == "model_and_optimizer" else 1)


def check_staging_space(cfg: BenchmarkConfig, ranks_here: int, world_size: int,
                        shm_path: str = SHM_PATH) -> None:
    """save_mode=async with the process checkpointer stages each rank's shard in shared
    memory (/dev/shm, 64 MiB in a Docker container by default): too small, and the
    checkpoint daemon dies mid-staging. Checked against this node's shards."""
    saves = cfg.command in (Command.save, Command.save_and_load)
    if not (saves and cfg.save_mode.value == "async" and cfg.async_save.shared_memory
            and cfg.async_save.checkpointer == AsyncCheckpointer.process):
        return
    try:
        free_bytes = shutil.disk_usage(shm_path).free
    except OSError:  # no /dev/shm (not Linux): torch shares memory another way
        return
    # each rank holds 1 / (world / replicas) of the state (replicas hold copies)
    need_bytes = -(-state_bytes_estimate(cfg) * cfg.model.replicas * ranks_here // world_size)
    if need_bytes > free_bytes:
        size_gib = -(-need_bytes * 5 // 4 // GIB)  # a quarter more, whole GiB
        raise UserError(
            f"async_save.checkpointer=process stages each rank's shard in {shm_path} "
            f"(async_save.shared_memory=true): the {ranks_here} rank(s) here need about "
            f"{need_bytes / GIB:.2f} GiB and it has {free_bytes / GIB:.2f} GiB free; enlarge it "
            f"(docker run --shm-size={size_gib}g, or a larger tmpfs), or use "
            "async_save.checkpointer=thread or async_save.shared_memory=false")


def check_nproc(nproc: int) -> None:
    cores = usable_cores()
    if nproc > cores * RANKS_PER_CORE:
        raise UserError(f"nproc={nproc}: this machine has {cores} usable CPU core(s); use at most "
                        f"nproc={cores * RANKS_PER_CORE} ({RANKS_PER_CORE} per core), or more "
                        "machines (torchrun, Slurm)")


def _positive_int(name: str, example: str) -> None:
    if (value := os.environ.get(name)) is not None and not re.fullmatch(r"\s*[1-9]\d*\s*", value):
        raise UserError(f"{name}={value!r}: must be a positive whole number; unset it or "
                        f"export {name}={example}")


def check_torch() -> None:
    """The installed torch against the tested range (no import): older refused, newer warned."""
    problem = compat.torch_version_problem()
    if problem and compat.release(compat.installed_version("torch")) < compat.TORCH_MIN:
        raise UserError(problem)
    if problem:
        log.warning(f"{problem}; if a run fails, install a tested release")


def check_environment(cfg: BenchmarkConfig) -> None:
    """The environment variables we read, in the launcher and in every torchrun rank."""
    check_torch()
    _positive_int("OMP_NUM_THREADS", "4")
    if cfg.malloc == Malloc.raised:
        _check_glibc_allocator()
    if cfg.storage.kind == StorageKind.s3:
        _check_s3_environment(cfg)
    if contract.CONFIG_ENV in os.environ:
        raise UserError(f"{contract.CONFIG_ENV} is set: it is for ranks that dcp-fsdp starts "
                        f"itself; unset {contract.CONFIG_ENV}")
    # the test suite's switch: "1" forks the ranks, unset or "0" execs them; no other value
    name = contract.FORK_RANKS_TEST_ONLY_ENV
    if (value := os.environ.get(name)) not in (None, "", "0", "1"):
        raise UserError(f"{name}={value!r}: a test-only switch, 1 (forked ranks) or 0; "
                        f"unset {name} to measure ranks as users run them")


def _check_glibc_allocator() -> None:
    """malloc=raised sets glibc's thresholds: the ranks must run glibc's malloc."""
    if (replacement := allocator.preloaded_replacement()) is not None:
        raise UserError(f"malloc=raised: LD_PRELOAD loads {replacement}, whose thresholds "
                        "glibc's settings do not reach; drop malloc=raised (the record names "
                        "the allocator) or unset LD_PRELOAD")
    if not allocator.loaded_allocator().startswith("glibc"):
        raise UserError(f"malloc=raised: this system's allocator is "
                        f"{allocator.loaded_allocator()}, not glibc's; drop malloc=raised")
    for name, value in allocator.ENVIRONMENT.items():
        if os.environ.get(name, value) != value:
            raise UserError(f"malloc=raised: it sets {name}={value} in the ranks, and the "
                            f"environment has {name}={os.environ[name]}; unset {name}, or "
                            "drop malloc=raised to run with your own")


def check_endpoint_environment(cfg: BenchmarkConfig) -> str | None:
    """The AWS_ENDPOINT_URL* variable an s3 store uses (the first one set and not empty, as
    botocore reads them, where storage.endpoint is not), checked: its name, or None. Also for
    the commands that connect without the launch checks (list, delete, clean-uploads)."""
    name = endpoint_source(cfg.storage)
    if cfg.storage.kind != StorageKind.s3 or name == "storage.endpoint":
        return None
    check_endpoint(os.environ[name], name)
    return name


def _check_s3_environment(cfg: BenchmarkConfig) -> None:
    """The AWS variables an s3 run reads, and the connector's log variables request_stats owns."""
    if (name := check_endpoint_environment(cfg)) is not None and cfg.storage.uri is None:
        raise UserError(f"storage.uri is not set but {name} is: give the bucket "
                        "too, e.g. storage.uri=s3://my-bucket/checkpoints (or "
                        f"unset {name} for the embedded server)")
    region = next((name for name in ("AWS_REGION", "AWS_DEFAULT_REGION") if name in os.environ), None)
    if region is not None and cfg.storage.region is None:
        check_region(os.environ[region], region)
    # botocore's retry variables: a value it refuses would fail inside the ranks unnamed
    _positive_int("AWS_MAX_ATTEMPTS", "5")
    mode = os.environ.get("AWS_RETRY_MODE")
    if mode is not None and mode not in RETRY_MODES:
        raise UserError(f"AWS_RETRY_MODE={mode!r}: botocore takes {', '.join(RETRY_MODES)}; "
                        "set one of them or unset AWS_RETRY_MODE")
    if cfg.request_stats:
        from dcp_fsdp.telemetry.connector_log import version_problem

        problem = version_problem()  # its counts could be silently wrong otherwise
        if problem:
            raise UserError(f"request_stats=true: {problem}")
        for name in CONNECTOR_LOG_ENV:
            if name in os.environ:
                raise UserError(f"{name} is set, but request_stats=true sets the "
                                f"connector's log itself: unset {name}, or add "
                                "request_stats=false to keep your own log")


def check_torchrun_environment() -> int:
    """Under torchrun: the variables env:// rendezvous reads. The ranks on this machine."""
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UserError(f"RANK is set but {name} is not: start the ranks with torchrun "
                            "(which sets both), or unset RANK to let dcp-fsdp launch nproc ranks")
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        value = os.environ.get(name, "0" if name == "LOCAL_RANK" else os.environ["WORLD_SIZE"])
        if not re.fullmatch(r"\d+", value.strip()):
            raise UserError(f"{name}={value!r}: must be a whole number (torchrun sets it)")
        numbers[name] = int(value)
    if not numbers["RANK"] < numbers["WORLD_SIZE"] or numbers["WORLD_SIZE"] < 1:
        raise UserError(f"RANK={numbers['RANK']} WORLD_SIZE={numbers['WORLD_SIZE']}: RANK must "
                        "be below WORLD_SIZE (start the ranks with torchrun)")
    if not 0 < numbers["MASTER_PORT"] < 65536:
        raise UserError(f"MASTER_PORT={numbers['MASTER_PORT']}: must be a port, 1..65535")
    _check_launcher_variables()
    return numbers["LOCAL_WORLD_SIZE"]


def _check_launcher_variables() -> None:
    """What dcp-fsdp's launcher hands its ranks: a run id and the command line."""
    run_id = os.environ.get(contract.RUN_ID_ENV)
    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", run_id):
        raise UserError(f"{contract.RUN_ID_ENV}={run_id!r}: a run id is a file name: use "
                        "letters, digits, '.', '_' and '-'")
    if argv := os.environ.get(contract.ARGV_ENV):
        try:
            if not isinstance(json.loads(argv), list):
                raise ValueError
        except ValueError:
            raise UserError(f"{contract.ARGV_ENV} is not a JSON list: it is set by dcp-fsdp's "
                            f"launcher; unset {contract.ARGV_ENV}") from None


def check_model(cfg: BenchmarkConfig) -> None:
    """The model's shape can be built (a preset's, or model.config's config.json)."""
    model_shape(cfg.model)


def check_tensor_parallel(cfg: BenchmarkConfig, world_size: int, name: str) -> None:
    """model.tp: whole TP groups, the model split evenly over one; `name`: where `world_size` came from."""
    check_tp(model_shape(cfg.model), cfg.model.tp, cfg.model.replicas, world_size, name)


def available_memory_bytes() -> int:
    """What this node can still give: MemAvailable, or less under a cgroup memory limit."""
    import psutil

    available = psutil.virtual_memory().available
    with contextlib.suppress(OSError, ValueError):  # no cgroup v2 memory controller here
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - current)
    return available


def rank_state_bytes(cfg: BenchmarkConfig, ranks_here: int, world_size: int) -> tuple[int, int]:
    """(the largest rank's state, the most any node of `ranks_here` consecutive ranks holds),
    in bytes, from each rank's block of every tensor, not the mean: an MoE whose dp shards
    outnumber its experts has whole experts on its first shards."""
    world_size = max(1, world_size)
    scale = DTYPE_BYTES[cfg.model.dtype.value] * (3 if cfg.state.value == "model_and_optimizer"
                                                  else 1)
    held = [count * scale for count in rank_holdings(
        model_shape(cfg.model), cfg.model.tp, cfg.model.replicas, world_size,
        cfg.model.moe_layout.value)]
    here = max(1, min(ranks_here, world_size))
    nodes = [sum(held[start:start + here]) for start in range(0, world_size, here)]
    return max(held), max(nodes)


def check_memory(cfg: BenchmarkConfig, ranks_here: int, world_size: int) -> None:
    """Ranks that keep their state in host memory (gloo) must fit it on this node: refused
    before the build rather than killed by the kernel part way (SIGKILL, no record)."""
    if cfg.backend == Backend.nccl or (cfg.backend == Backend.auto and _cuda_driver_present()):
        return  # the state lives on the GPUs
    per_rank, needed = rank_state_bytes(cfg, ranks_here, world_size)
    available = available_memory_bytes()
    what = f"model={cfg.model.name} model.dtype={cfg.model.dtype.value} state={cfg.state.value}"
    if needed > available:
        choices = ["a smaller model="]  # the fix: only settings that would change something
        if cfg.model.dtype != Dtype.bf16:
            choices.append("model.dtype=bf16")
        if cfg.state != CheckpointState.model:
            choices.append("state=model")
        listed = choices[0] if len(choices) == 1 else ", ".join(choices[:-1]) + " or " + choices[-1]
        raise UserError(
            f"{what}: the {ranks_here} rank(s) on this node hold {needed / GIB:.1f} GiB of state "
            f"(the largest {per_rank / GIB:.2f} GiB), more than the {available / GIB:.1f} GiB of memory "
            f"available here; the kernel would kill a rank part way. Choose {listed}, or spread "
            "the ranks over more nodes")
    if needed > MEMORY_WARN_SHARE * available:
        warn_once(f"{what}: the ranks on this node hold {needed / GIB:.1f} GiB of state, "
                    f"{needed / available:.0%} of the {available / GIB:.1f} GiB available; a save's "
                    "staging or a load's buffers may push a rank over (then killed by SIGKILL)")


@functools.cache
def warn_once(text: str) -> None:
    """A launch check's warning, once per process (the command line and the launcher check)."""
    log.warning(text)


def check_launch(cfg: BenchmarkConfig) -> None:
    """Everything the local launcher checks before storage and ranks."""
    check_model(cfg)
    check_environment(cfg)
    check_results_dir(cfg.results_dir)
    check_nproc(cfg.nproc)
    for note in host_limit_notes(cfg.nproc):
        warn_once(note)
    if os.environ.get("MSC_CONFIG") and cfg.storage.kind == StorageKind.s3 and cfg.storage.client.value == "msc":
        warn_once("MSC_CONFIG is set and not read: storage.client=msc runs on a profile dcp-fsdp "
                  "writes from the storage.* settings (docs/clients.md); unset MSC_CONFIG")
    check_replicas(cfg.model.replicas, cfg.nproc, "nproc", cfg.model.tp)
    check_tensor_parallel(cfg, cfg.nproc, "nproc")
    check_devices(cfg.backend, cfg.nproc, cuda_device_count)
    if cfg.command.value != "ceiling":
        check_memory(cfg, cfg.nproc, cfg.nproc)
    check_staging_space(cfg, cfg.nproc, cfg.nproc)
