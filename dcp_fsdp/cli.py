"""`dcp-fsdp COMMAND [hydra overrides]`: a thin shell over the library.

Parse the command, compose and validate the settings (`config/`), then either run as
one rank (under torchrun: RANK is set) or launch `nproc` ranks on this machine
(`launch/`). `report` and `wait` need neither Hydra nor torch.

Every rank process starts here, under any launcher (the local launcher's ranks too:
`python -m dcp_fsdp COMMAND` with the composed settings in a file), and ends in
`end_rank`: the top layer prints the end-of-run summary from the record the rank
returns, so the rank layer never imports `analysis`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from dcp_fsdp.config.schema import BenchmarkConfig
    from dcp_fsdp.rank.session import RankResult

PROCESS_START_MONO = time.monotonic()


def _process_started() -> None:
    global PROCESS_START_MONO
    PROCESS_START_MONO = time.monotonic()


# A rank forked from the agent (launch/forked_rank.py), which imported this module, starts at
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
    """The validated config of one job, after every check that needs no rank: bad input
    fails here, before anything starts (for a sweep: before its first job starts)."""
    from dcp_fsdp.config.compose import compose

    from dcp_fsdp.config.usage import STORAGE_ONLY_COMMANDS

    # `list` and `clean-uploads` take the same storage settings as a save; the command
    # value is unused.
    cfg = compose("save" if command in STORAGE_ONLY_COMMANDS else command, overrides)
    if command in STORAGE_ONLY_COMMANDS:
        from dcp_fsdp.launch.checks import check_endpoint_environment

        check_endpoint_environment(cfg)
    elif not under_torchrun():
        from dcp_fsdp.launch.checks import check_launch

        check_launch(cfg)
    return cfg


def execute(command: str, cfg: BenchmarkConfig, min_age_s: float | None = None, check: bool = False) -> int:
    if command == "list":  # check: its --check (main)
        from dcp_fsdp.launch.listing import list_checkpoints

        return list_checkpoints(cfg, check)
    if command == "clean-uploads":  # min_age_s: its --min-age-s / --force (main)
        from dcp_fsdp.launch.listing import DEFAULT_MIN_AGE_S, clean_uploads

        return clean_uploads(cfg, DEFAULT_MIN_AGE_S if min_age_s is None else min_age_s)
    if command == "delete":  # the same options: the age an incomplete suffix must have
        from dcp_fsdp.launch.listing import DEFAULT_MIN_AGE_S, delete_checkpoint

        return delete_checkpoint(cfg, DEFAULT_MIN_AGE_S if min_age_s is None else min_age_s)
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
    """rank.session.run_rank, imported (torch with it) with the collector paused
    (process/collector.py); a forked rank has it imported already."""
    from dcp_fsdp.process.collector import paused_for_imports

    with paused_for_imports():
        from dcp_fsdp.rank.session import run_rank
    return run_rank


def launched_rank() -> NoReturn:
    """A rank started by the local launcher: its settings were composed and checked by the
    launcher and come as a file (CONFIG_ENV)."""
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
        # The signal came before the rank's guard could turn it into a record (building the
        # session, installing the guard): the launcher prints the run's one `interrupted`
        # line and writes its record; a rank that printed its own was a second line.
        end_process(EXIT_INTERRUPTED)
    end_rank(result)


def _own_torch_cache_dir() -> Path | None:
    """Under a plain torchrun, torch makes $TMPDIR/torchinductor_$USER in every rank and
    leaves it (at the first import of torch._dynamo, which building any module does); a
    rank-owned directory instead (unless the user chose one), removed at the end (the local
    launcher points it into its run directory). `plan` builds modules too: the same."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    from dcp_fsdp.process.lifeline import owned_tempdir

    own = owned_tempdir("dcp-fsdp-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(own)
    return own


def _drop_own_torch_cache_dir(own_dir: Path | None) -> None:
    """The directory of `_own_torch_cache_dir` removed, and the variable it set with it (a
    command run in-process, e.g. by a test, leaves the environment as it found it)."""
    if own_dir is None:
        return
    import shutil

    shutil.rmtree(own_dir, ignore_errors=True)
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def end_rank(result: RankResult, own_dir: Path | None = None) -> NoReturn:
    """The end of a rank's process (a `rank.session.RankResult`): on the rank that wrote
    the record, the run's table, where the record is and the suffixes a save made (the
    batch scripts read the SUFFIXES= line); then the exit code."""
    import signal

    from dcp_fsdp import contract, log
    from dcp_fsdp.process.lifeline import end_process

    # The outcome is known: a later Ctrl-C / SIGTERM (the agent stopping its ranks) must not
    # cut the record's lines or land inside an import (no torch is imported from here on).
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
    if own_dir is not None:
        import shutil

        shutil.rmtree(own_dir, ignore_errors=True)
    end_process(result.exit_code)


def check_torchrun_rank(cfg: BenchmarkConfig) -> None:
    """A rank under torchrun, before it joins the group: what the launcher would have
    checked (results_dir on rank 0, the one that writes the record)."""
    from dcp_fsdp.errors import UserError
    from dcp_fsdp.launch import checks
    from dcp_fsdp.launch.preflight import needs_embedded_server
    from dcp_fsdp.rank.device import one_device_per_task

    ranks_here = checks.check_torchrun_environment()
    checks.check_model(cfg)
    checks.check_replicas(cfg.model.replicas, int(os.environ["WORLD_SIZE"]), "WORLD_SIZE")
    checks.check_tensor_parallel(cfg, int(os.environ["WORLD_SIZE"]), "WORLD_SIZE")
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
    checks.check_staging_space(cfg, ranks_here, int(os.environ["WORLD_SIZE"]))


def run_command(command: str, overrides: list[str], min_age_s: float | None = None,
                check: bool = False) -> int:
    from dcp_fsdp.contract import EXIT_INTERRUPTED
    from dcp_fsdp.errors import UserError

    try:
        if command == "tune":  # a parent that launches trial runs (launch/tune.py)
            from dcp_fsdp.launch.tune import tune

            return tune(overrides, PROCESS_START_MONO)
        return execute(command, prepare(command, overrides), min_age_s, check)
    except UserError as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)


def run_sweep(command: str, jobs: list[list[str]], min_age_s: float | None = None,
              check: bool = False) -> int:
    """Every job composed and checked first: a bad value in the last job fails before the
    first one runs."""
    from dcp_fsdp import log
    from dcp_fsdp.contract import EXIT_INTERRUPTED
    from dcp_fsdp.errors import UserError

    configs = []
    for number, job in enumerate(jobs):
        try:
            configs.append(prepare(command, job))
        except UserError as error:
            swept = [arg for arg in job if not all(arg in other for other in jobs)]
            return _fail(f"multirun job {number + 1}/{len(jobs)} ({' '.join(swept)}): {error}")
    worst = 0
    for number, (job, cfg) in enumerate(zip(jobs, configs)):
        log.info(f"multirun job {number + 1}/{len(jobs)}: {' '.join(job)}")
        try:
            code = execute(command, cfg, min_age_s, check)
        except UserError as error:
            code = _fail(str(error))
        except KeyboardInterrupt:
            return _fail("interrupted", EXIT_INTERRUPTED)
        worst = worst or code
        if code == EXIT_INTERRUPTED:  # an interrupt ends the sweep, not just this job
            log.info(f"multirun: interrupted at job {number + 1}/{len(jobs)}; later jobs not run")
            break
    return worst


def run_plan(args: list[str]) -> int:
    """`dcp-fsdp plan`: no rank, no storage; its own keys beside a save's settings."""
    from dcp_fsdp.config import usage as helptext
    from dcp_fsdp.errors import UserError

    if any(arg in ("-h", "--help") for arg in args):
        print(helptext.plan_help())
        return 0
    own_dir = _own_torch_cache_dir()  # building the state's modules imports torch._dynamo
    try:
        from dcp_fsdp.plan.command import main as plan_main

        return plan_main(args)
    except UserError as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    finally:
        _drop_own_torch_cache_dir(own_dir)


def main(argv: list[str] | None = None) -> int:
    """Every command answers Ctrl-C with one line and exit 130, at any moment: its imports
    (pandas, torch: seconds) included (the trial's case 109: a KeyboardInterrupt traceback)."""
    sys.unraisablehook = _interrupt_lost_in_a_callback
    try:
        return _command(argv)
    except KeyboardInterrupt:
        return interrupted()
    except BrokenPipeError:
        return _reader_gone()


def _interrupt_lost_in_a_callback(unraisable: sys.UnraisableHookArgs) -> None:
    """Ctrl-C that landed in a callback Python cannot raise from (an import lock's weakref
    callback, during the imports: Python prints "Exception ignored in ... KeyboardInterrupt"
    with a traceback and goes on): raised again as a signal, so that it ends the command with
    its one line. Anything else is reported as Python would."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        try:
            _interrupt_later()
        except KeyboardInterrupt:  # another Ctrl-C, here: where it cannot go either
            _interrupt_later()
        return
    sys.__unraisablehook__(unraisable)


def _interrupt_later() -> None:
    """SIGINT to this process from another thread, handled by the main thread once this hook
    has returned: raised in the hook itself (raise_signal on the main thread), it could not
    propagate and Python printed it with a traceback (the trial's Ctrl-C case, 0.75 s in)."""
    import os
    import signal
    import threading

    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT), daemon=True).start()


def _reader_gone() -> int:
    """stdout's reader left (`dcp-fsdp save --help | head`): end as a program killed by
    SIGPIPE would, silently; stdout pointed at /dev/null so that the interpreter's last
    flush cannot raise again (no "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13  # SIGPIPE


def interrupted() -> int:
    """The one line of an interrupted command; a second Ctrl-C while it is written and the
    process ends is ignored, so that it cannot print a traceback of its own."""
    import signal
    import threading

    from dcp_fsdp.contract import EXIT_INTERRUPTED

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _fail("interrupted", EXIT_INTERRUPTED)


def _command(argv: list[str] | None) -> int:
    from dcp_fsdp.config import usage as helptext
    from dcp_fsdp.contract import CONFIG_ENV

    if os.environ.get(CONFIG_ENV) and "RANK" in os.environ:
        launched_rank()  # a rank of the local launcher (launch/local.py)
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(helptext.usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from dcp_fsdp import __version__

        print(f"dcp-fsdp {__version__}")
        return 0
    command, rest = args[0], args[1:]
    own = _own_parser_command(command, rest)
    if own is not None:
        return own
    if command not in helptext.SETTINGS_COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, list(helptext.COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return _fail(f"unknown command '{command}'; {hint}choose one of "
                     f"{', '.join(helptext.COMMANDS)} (dcp-fsdp --help)")
    if any(arg in ("-h", "--help") for arg in rest):
        print(helptext.command_help(command))
        return 0
    return _settings_command(command, rest)


def _own_parser_command(command: str, rest: list[str]) -> int | None:
    """Commands with their own arguments (no Hydra, no torch); None for the others."""
    if command == "wait":  # see dcp_fsdp/wait.py
        from dcp_fsdp.wait import main as wait_main
        return wait_main(rest)
    if command == "report":  # its own argparse (dcp-fsdp report --help)
        from dcp_fsdp.analysis.report import main as report_main
        return report_main(rest)
    if command == "plan":  # DCP's plan for a world you do not have: dcp_fsdp/plan/
        return run_plan(rest)
    if command != "s3-server":
        return None
    from dcp_fsdp.errors import UserError  # a local S3 that outlives one run: launch/s3_server.py
    from dcp_fsdp.launch.s3_server import main as s3_server_main

    try:
        return s3_server_main(rest)
    except UserError as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _settings_command(command: str, rest: list[str]) -> int:
    """A command of settings (key=value, `--config FILE`, `-m` sweeps): one run or a sweep."""
    from dcp_fsdp.config.arguments import settings_line
    from dcp_fsdp.config.compose import config_file_overrides, expand_sweeps, parse_error_line
    from dcp_fsdp.errors import UserError

    try:
        line = settings_line(command, rest)
        overrides = [*config_file_overrides(line.config_files), *line.settings]
    except UserError as error:
        return _fail(str(error))
    multirun, min_age_s, check = line.multirun, line.min_age_s, line.check
    if multirun and command == "tune":
        return _fail("-m: tune runs its own search over the connector settings; drop -m "
                     "(and give the fixed settings, e.g. model=L7b nproc=8)")
    for arg in overrides:
        if arg.startswith("-"):
            name = arg.lstrip("-").split("=", 1)[0]
            return _fail(f"'{arg}': settings are written key=value without dashes, e.g. "
                         f"{name}=VALUE (dcp-fsdp {command} --help lists them)")
    if not multirun:
        return run_command(command, overrides, min_age_s, check)
    try:
        jobs = expand_sweeps(overrides)
    except Exception as error:  # Hydra's parser raises its own exception types
        return _fail(parse_error_line(overrides, error))
    return run_sweep(command, jobs, min_age_s, check)


if __name__ == "__main__":
    sys.exit(main())
