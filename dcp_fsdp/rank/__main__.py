"""Entry point of a rank started by the local launcher under torch's elastic agent
(config passed as a file): `python -m dcp_fsdp.rank`."""

import os
import signal
import time

PROCESS_START_MONO = time.monotonic()


def _quiet_exit(signum, frame):
    # Ctrl-C / SIGTERM while torch is still importing (the first seconds): end without a
    # KeyboardInterrupt traceback; the launcher records the run as interrupted.
    os._exit(130)


def main() -> int:
    from omegaconf import OmegaConf

    from dcp_fsdp.config.schema import BenchmarkConfig
    from dcp_fsdp.contract import CONFIG_ENV
    from dcp_fsdp.rank.session import run_rank

    if not os.environ.get(CONFIG_ENV):
        from dcp_fsdp import log

        log.error(f"{CONFIG_ENV} is not set: `python -m dcp_fsdp.rank` is started by the "
                  "launcher; run `dcp-fsdp COMMAND ...` (or torchrun -m dcp_fsdp) instead")
        return 2
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BenchmarkConfig),
                                              OmegaConf.load(os.environ[CONFIG_ENV])))
    return run_rank(cfg, PROCESS_START_MONO)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _quiet_exit)
    signal.signal(signal.SIGTERM, _quiet_exit)
    from dcp_fsdp.lifeline import die_with_parent

    die_with_parent(signal.SIGTERM)  # the agent killed: this rank ends too
    from dcp_fsdp.rank.distributed import end_process

    end_process(main())
