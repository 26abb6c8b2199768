import os
import sys

from dcp_fsdp.contract import CONFIG_ENV

if os.environ.get(CONFIG_ENV) and "RANK" in os.environ:
    # A rank of the local launcher: until run_rank installs the real handlers, Ctrl-C / SIGTERM
    # end it without a traceback (the launcher records the run), and it dies with the agent.
    import signal

    from dcp_fsdp.process.lifeline import die_with_parent

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: os._exit(130))
    die_with_parent(signal.SIGTERM)

try:
    from dcp_fsdp.cli import main
except KeyboardInterrupt:  # Ctrl-C before cli.main can answer it: its one line, no traceback
    sys.stderr.write("dcp-fsdp: error: interrupted\n")
    sys.exit(130)

sys.exit(main())
