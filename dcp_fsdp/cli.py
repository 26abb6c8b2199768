"""`dcp-fsdp COMMAND [hydra overrides]`: parse, compose and validate the settings, then run
as one rank (under torchrun) or launch `nproc` ranks on this machine. Every rank process, under
any launcher, starts here and ends in `end_rank`, which prints the run's summary from the record
the rank returns: the rank layer never imports `analysis`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from pathlib import Path

    from dcp_fsdp.config.schema import BenchmarkConfig
    from dcp_fsdp.rank.session import RankResult

PROCESS_START_MONO = time.monotonic()


def _process_started() -> None:
    global PROCESS_START_MONO
    PROCESS_START_MONO = time.monotonic()


# A rank forked by the fork server (launch/forked_rank.py), which imported this module, starts at
# its fork: its init_s counts from there, as an exec'd rank's counts from its interpreter.
os.register_at_fork(after_in_child=_process_started)


def _fail(message: str, code: int = 2) -> int:
    from dcp_fsdp import log

    log.error(message)
    return code


def under_torchrun() -> bool:
    from dcp_fsdp.contract import CONFIG_ENV

    return "RANK" in os.environ and CONFIG_ENV not in os.environ


def prepare(command: str, overrides: list[str]) -> BenchmarkConfig:
    """The validated config of one job, after every check that needs no rank (a storage-only
    command composes as a save; its refusals name it)."""
    from dcp_fsdp.config.arguments import STORAGE_ONLY_COMMANDS
    from dcp_fsdp.config.compose import compose

    cfg = compose("save" if command in STORAGE_ONLY_COMMANDS else command, overrides,
                  named=command)
    from dcp_fsdp.launch import checks

    if command in STORAGE_ONLY_COMMANDS:
        checks.check_endpoint_environment(cfg)
    elif not under_torchrun():
        checks.check_launch(cfg)
    return cfg


def execute(args: argparse.Namespace, cfg: BenchmarkConfig) -> int:
    if args.command == "list":
        from dcp_fsdp.launch.listing import list_checkpoints

        return list_checkpoints(cfg, args.check)
    if args.command in ("clean-uploads", "delete"):  # the age an upload or suffix must have
        from dcp_fsdp.launch.listing import clean_uploads, delete_checkpoint

        remove = clean_uploads if args.command == "clean-uploads" else delete_checkpoint
        return remove(cfg, args.min_age_s)
    if under_torchrun():
        import signal

        from dcp_fsdp.process.lifeline import die_with_parent

        die_with_parent(signal.SIGTERM)  # the agent killed: this rank ends too
        check_torchrun_rank(cfg)  # before torch is imported: bad input fails in a second
        run_rank = _rank_entry()
        own_dir = _own_torch_cache_dir()
        end_rank(run_rank(cfg, PROCESS_START_MONO), own_dir)
    from dcp_fsdp.launch.local import launch_local

    return launch_local(cfg)


def _rank_entry() -> Callable[[BenchmarkConfig, float], RankResult]:
    """rank.session.run_rank, imported (torch with it) with the collector paused."""
    from dcp_fsdp.process.collector import paused_for_imports

    with paused_for_imports():
        from dcp_fsdp.rank.session import run_rank
    return run_rank


def launched_rank() -> NoReturn:
    """A rank started by the local launcher: its checked settings come as a file (CONFIG_ENV)."""
    from omegaconf import OmegaConf

    from dcp_fsdp.config.schema import BenchmarkConfig, to_config
    from dcp_fsdp.contract import CONFIG_ENV, EXIT_INTERRUPTED
    from dcp_fsdp.process.lifeline import end_process
    from dcp_fsdp.process.signals import Terminated

    run_rank = _rank_entry()
    try:
        cfg = to_config(OmegaConf.merge(OmegaConf.structured(BenchmarkConfig),
                                        OmegaConf.load(os.environ[CONFIG_ENV])))
        result = run_rank(cfg, PROCESS_START_MONO)
    except (KeyboardInterrupt, Terminated):
        # Before the rank's guard could record it: the launcher prints the one `interrupted` line.
        end_process(EXIT_INTERRUPTED)
    end_rank(result)


def _own_torch_cache_dir() -> Path | None:
    """A directory of this process's own for torch's inductor cache (unless the user chose one),
    removed at the end: torch._dynamo would leave $TMPDIR/torchinductor_$USER behind."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    from dcp_fsdp.process.lifeline import owned_tempdir

    own = owned_tempdir("dcp-fsdp-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(own)
    return own


def _drop_own_torch_cache_dir(own_dir: Path | None) -> None:
    """The directory removed, and its variable (an in-process command leaves the environment as found)."""
    if own_dir is None:
        return
    import shutil

    shutil.rmtree(own_dir, ignore_errors=True)
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def end_rank(result: RankResult, own_dir: Path | None = None) -> NoReturn:
    """The end of a rank's process: on the rank that wrote the record, the run's table, where
    the record is and the suffixes a save made (batch scripts read SUFFIXES=); then exit."""
    import signal

    from dcp_fsdp import contract, log
    from dcp_fsdp.process.lifeline import end_process

    # The outcome is known: a later Ctrl-C / SIGTERM must not cut the record's lines.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    run = result.run
    if run is not None:
        if run.status == "ok":
            from dcp_fsdp.analysis.run_summary import print_run_summary

            print_run_summary(run, result.samples)
        log.info(f"record: {result.record_path}")
        if run.suffixes and run.command != "load":
            if os.environ.get(contract.EMBEDDED_ENV) == "1":
                # No SUFFIXES= line: a script would try to load what no longer exists.
                log.info(f"checkpoint {','.join(run.suffixes)} was deleted with the embedded "
                         "S3 server at exit; to save and then load, keep a server up: "
                         "dcp-fsdp s3-server start (then export what it prints)")
            else:
                log.info(f"SUFFIXES={','.join(run.suffixes)}")
    _drop_own_torch_cache_dir(own_dir)
    end_process(result.exit_code)


def check_torchrun_rank(cfg: BenchmarkConfig) -> None:
    """A rank under torchrun, before it joins the group: what the launcher would have checked."""
    from dcp_fsdp.errors import UserError
    from dcp_fsdp.launch import checks
    from dcp_fsdp.launch.preflight import needs_embedded_server
    from dcp_fsdp.rank.device import one_device_per_task

    ranks_here = checks.check_torchrun_environment()
    world = int(os.environ["WORLD_SIZE"])
    checks.check_model(cfg)
    checks.check_replicas(cfg.model.replicas, world, "WORLD_SIZE", cfg.model.tp)
    checks.check_tensor_parallel(cfg, world, "WORLD_SIZE")
    checks.check_environment(cfg)
    if needs_embedded_server(cfg):
        raise UserError(
            "storage.uri is not set: under torchrun the embedded S3 server is not "
            "started; set storage.uri=s3://bucket/prefix (and storage.endpoint or "
            "AWS_ENDPOINT_URL for S3-compatible servers), or run without torchrun")
    if os.environ["RANK"].strip() == "0":
        checks.check_results_dir(cfg.results_dir)

    def torch_device_count() -> int:
        import torch

        return torch.cuda.device_count()
    checks.check_devices(cfg.backend, ranks_here, torch_device_count,
                         bound_per_task=one_device_per_task())
    checks.check_staging_space(cfg, ranks_here, world)


def run_settings(args: argparse.Namespace) -> int:
    """A command of settings (key=value, `--config FILE`, `-m` sweeps): one run or a sweep."""
    from dcp_fsdp.config.compose import config_file_overrides, expand_sweeps, parse_error_line
    from dcp_fsdp.errors import UserError

    overrides = [*config_file_overrides(args.config), *args.settings]
    if args.command == "tune":  # a parent that launches trial runs (launch/tune.py)
        if args.multirun:
            raise UserError("-m: tune runs its own search over the connector settings; drop -m "
                            "(and give the fixed settings, e.g. model=L7b nproc=8)")
        from dcp_fsdp.launch.tune import tune

        return tune(overrides, PROCESS_START_MONO)
    if not args.multirun:
        return execute(args, prepare(args.command, overrides))
    try:
        jobs = expand_sweeps(overrides)
    except Exception as error:  # Hydra's parser raises its own exception types
        raise UserError(parse_error_line(overrides, error)) from None
    return run_sweep(args, jobs)


def run_sweep(args: argparse.Namespace, jobs: list[list[str]]) -> int:
    """Every job composed and checked before the first one runs."""
    from dcp_fsdp import log
    from dcp_fsdp.contract import EXIT_INTERRUPTED
    from dcp_fsdp.errors import UserError

    configs = []
    for number, job in enumerate(jobs):
        try:
            configs.append(prepare(args.command, job))
        except UserError as error:
            swept = [arg for arg in job if not all(arg in other for other in jobs)]
            raise UserError(f"multirun job {number + 1}/{len(jobs)} ({' '.join(swept)}): "
                            f"{error}") from None
    worst = 0
    for number, (job, cfg) in enumerate(zip(jobs, configs)):
        log.info(f"multirun job {number + 1}/{len(jobs)}: {' '.join(job)}")
        try:
            code = execute(args, cfg)
        except UserError as error:
            code = _fail(str(error))
        worst = worst or code
        if code == EXIT_INTERRUPTED:  # an interrupt ends the sweep, not just this job
            log.info(f"multirun: interrupted at job {number + 1}/{len(jobs)}; later jobs not run")
            break
    return worst


def run_plan(args: argparse.Namespace) -> int:
    """`dcp-fsdp plan`: no rank, no storage; its options beside a save's settings."""
    own_dir = _own_torch_cache_dir()  # building the state's modules imports torch._dynamo
    try:
        from dcp_fsdp.plan.command import main as plan_main

        return plan_main(args)
    finally:
        _drop_own_torch_cache_dir(own_dir)


def main(argv: list[str] | None = None) -> int:
    """The entry point: every command answers Ctrl-C with one line and exit 130, its imports included."""
    try:
        from dcp_fsdp.process.signals import own_the_unraisable_hook

        own_the_unraisable_hook()
        return _command(argv)
    except KeyboardInterrupt:
        return interrupted()
    except BrokenPipeError:
        # stdout's reader left (`... --help | head`): end silently, as SIGPIPE would; stdout to
        # /dev/null so that the interpreter's last flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE
    except Exception as error:
        # A library that caught Ctrl-C and raised its own error from it (pydantic's serializer
        # raises PydanticSerializationError from a KeyboardInterrupt in a model's serializer)
        if isinstance(error.__cause__, KeyboardInterrupt):
            return interrupted()
        raise


def interrupted() -> int:
    """The one line of an interrupted command; a second Ctrl-C is ignored (no traceback)."""
    import signal
    import threading

    from dcp_fsdp.contract import EXIT_INTERRUPTED

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _fail("interrupted", EXIT_INTERRUPTED)


def _command(argv: list[str] | None) -> int:
    """The command line parsed, then the function its command names run (imported only then)."""
    import importlib

    from dcp_fsdp.config.arguments import parse
    from dcp_fsdp.contract import CONFIG_ENV
    from dcp_fsdp.errors import UserError

    if os.environ.get(CONFIG_ENV) and "RANK" in os.environ:
        launched_rank()  # a rank of the local launcher (launch/local.py)
    try:
        try:
            args = parse(argv)
        except SystemExit as printed:  # --help or --version
            return int(printed.code or 0)
        module, _, function = args.entry.partition(":")
        return int(getattr(importlib.import_module(module), function)(args))
    except UserError as error:
        return _fail(str(error))


if __name__ == "__main__":
    sys.exit(main())
