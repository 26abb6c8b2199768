"""`dcp-fsdp COMMAND [hydra overrides]`: a thin shell over the library.

Parse the command, compose and validate the settings (`config/`), then either run as
one rank (under torchrun: RANK is set) or launch `nproc` ranks on this machine
(`launch/`). `report` and `wait` need neither Hydra nor torch.
"""

from __future__ import annotations

import os
import sys
import time

PROCESS_START_MONO = time.monotonic()


def _fail(message: str, code: int = 2) -> int:
    from dcp_fsdp import log

    log.error(message)
    return code


def run_command(command: str, overrides: list[str]) -> int:
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.contract import CONFIG_ENV, EXIT_INTERRUPTED
    from dcp_fsdp.errors import UserError

    try:
        if command == "tune":  # a parent that launches trial runs (launch/tune.py)
            from dcp_fsdp.launch.tune import tune

            return tune(overrides, PROCESS_START_MONO)
        # `list` takes the same storage settings as a save; the command value is unused.
        cfg = compose("save" if command == "list" else command, overrides)
        if command == "list":
            from dcp_fsdp.launch.listing import list_checkpoints

            return list_checkpoints(cfg)
        if "RANK" in os.environ and CONFIG_ENV not in os.environ:
            from dcp_fsdp.launch.preflight import needs_embedded_server
            from dcp_fsdp.rank.distributed import end_process
            from dcp_fsdp.rank.session import run_rank

            if needs_embedded_server(cfg):
                raise UserError(
                    "storage.uri is not set: under torchrun the embedded S3 server is not "
                    "started; set storage.uri=s3://bucket/prefix (and storage.endpoint or "
                    "AWS_ENDPOINT_URL for S3-compatible servers), or run without torchrun")
            end_process(run_rank(cfg, PROCESS_START_MONO))
        from dcp_fsdp.launch.local import launch_local

        return launch_local(cfg)
    except UserError as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)


def main(argv: list[str] | None = None) -> int:
    from dcp_fsdp.config import usage as helptext

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(helptext.usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from dcp_fsdp import __version__

        print(f"dcp-fsdp {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "wait":  # no Hydra, no torch: see dcp_fsdp/wait.py
        from dcp_fsdp.wait import main as wait_main
        return wait_main(rest)
    if command == "report":  # no Hydra, no torch: its own argparse (dcp-fsdp report --help)
        from dcp_fsdp.analysis.report import main as report_main
        return report_main(rest)
    if command not in helptext.SETTINGS_COMMANDS:
        return _fail(f"unknown command '{command}'; choose one of "
                     f"{', '.join(helptext.SETTINGS_COMMANDS)} (dcp-fsdp --help)")
    if any(arg in ("-h", "--help") for arg in rest):
        print(helptext.command_help(command))
        return 0
    from dcp_fsdp.config.compose import expand_config_files, expand_sweeps, one_line
    from dcp_fsdp.errors import UserError

    multirun = any(arg in ("-m", "--multirun") for arg in rest)
    overrides = [arg for arg in rest if arg not in ("-m", "--multirun")]
    try:
        overrides = expand_config_files(overrides)
    except UserError as error:
        return _fail(str(error))
    if not multirun:
        return run_command(command, overrides)
    try:
        jobs = expand_sweeps(overrides)
    except Exception as error:  # Hydra's parser raises its own exception types
        return _fail(f"cannot parse overrides: {one_line(error)}")
    from dcp_fsdp import log

    worst = 0
    for number, job in enumerate(jobs):
        log.info(f"multirun job {number + 1}/{len(jobs)}: {' '.join(job)}")
        code = run_command(command, job)
        worst = worst or code
    return worst


if __name__ == "__main__":
    sys.exit(main())
