"""How a rank's run ended, as fields (status, line, exit code, cause), and where torch's
elastic agent reads it: the rank's TORCHELASTIC_ERROR_FILE."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import NamedTuple

from dcp_fsdp import contract


class RankEnding(NamedTuple):
    """How this rank's run ended: what the record says, the exit code, and why as a field."""

    status: str  # ok | failed | interrupted
    error_line: str | None
    exit_code: int
    cause: contract.EndCause


def write_error_file(ending: RankEnding) -> None:
    """This rank's outcome where torch's elastic agent reads it (TORCHELASTIC_ERROR_FILE,
    the file torch's `record()` writes): torchrun prints "message"; our agent passes the
    fields under contract.ERROR_FILE_KEY to the launcher, which decides on the cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "w") as f:  # else the agent has the exit code
        json.dump({"message": f"{ending.status}: {ending.error_line}", "timestamp": int(time.time()),
                   contract.ERROR_FILE_KEY: {"status": ending.status, "error": ending.error_line,
                                             "cause": ending.cause.value}}, f)
