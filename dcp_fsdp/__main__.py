import sys

from dcp_fsdp.cli import main

sys.exit(main())
