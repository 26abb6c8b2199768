"""What processes of one run agree on: every DCP_FSDP_* environment variable and exit code.
Nothing else lives here, so any module may import it."""

from __future__ import annotations

import enum

# -- environment variables ---------------------------------------------------------------
CONFIG_ENV = "DCP_FSDP_CONFIG"  # launcher -> rank: path of the resolved config (YAML)
RUN_ID_ENV = "DCP_FSDP_RUN_ID"  # launcher -> rank: the run id every rank records under
PREFLIGHT_DONE_ENV = "DCP_FSDP_PREFLIGHT_DONE"  # launcher -> rank: storage already checked
EMBEDDED_ENV = "DCP_FSDP_EMBEDDED_S3"  # launcher -> rank: the embedded SeaweedFS is in use
ARGV_ENV = "DCP_FSDP_ARGV"  # launcher -> rank: the user's command line (JSON list)
DEBUG_ENV = "DCP_FSDP_DEBUG"  # user: print tracebacks of failures as well as the one line
AGENT_SUMMARY_ENV = "DCP_FSDP_AGENT_SUMMARY"  # launcher -> agent: where to write the outcome
# launcher -> rank 0: a file where rank 0 notes the suffix a save is writing, so a launcher
# whose rank 0 was stopped in native code (no record) can still name the partial checkpoint
WRITING_SUFFIX_FILE_ENV = "DCP_FSDP_WRITING_SUFFIX_FILE"

TUNE_ENV = "DCP_FSDP_TUNE"  # tune -> rank: path of the tune session's plan (JSON)
# launcher -> rank 0: the load's .metadata as the launcher's screen read it (JSON: suffix and
# facts), so the tool reads a checkpoint's .metadata once per run, not once per check
METADATA_FACTS_ENV = "DCP_FSDP_METADATA_FACTS"
# launcher -> rank 0: the launcher claimed the save's `suffix=` suffixes for this run (the
# claim objects name DCP_FSDP_RUN_ID) before any rank started; the value is how
# (layout.CLAIM_*). Rank 0 takes those claims as its own instead of claiming again.
SUFFIX_CLAIMED_ENV = "DCP_FSDP_SUFFIX_CLAIMED"

# benchmarks/harness_cost.py -> rank, benchmark-only (not a setting): instrumentation pieces
# left out of the timed path, comma-separated names from HARNESS_PIECES; recorded on the run
HARNESS_OFF_ENV = "DCP_FSDP_HARNESS_OFF"
HARNESS_PIECES = ("hooks", "watchdog", "memory")  # stream/hook timing, op watchdog, RSS marks

# The test suite -> our agent, test-only (the product never sets it): "1" forks the ranks from
# a fork server that has imported what a rank imports (launch/forked_rank.py), instead of
# exec'ing each: ~5 CPU s less per rank. The run line's `rank_start` says which way ranks started.
FORK_RANKS_TEST_ONLY_ENV = "DCP_FSDP_TEST_ONLY_FORK_RANKS"
RANK_START_EXEC, RANK_START_FORK = "exec", "fork"  # the run line's rank_start


def harness_off(value: str | None) -> tuple[frozenset[str], list[str]]:
    """(pieces named in HARNESS_OFF_ENV's value, unknown names)."""
    names = {name.strip() for name in (value or "").split(",") if name.strip()}
    return frozenset(names & set(HARNESS_PIECES)), sorted(names - set(HARNESS_PIECES))


# -- signals -----------------------------------------------------------------------------
# launcher -> surviving ranks after another rank failed: end as "failed", not "interrupted"
# (SIGTERM / SIGINT mean a user or the scheduler stopped the run).
PEER_FAILED_SIGNAL_NAME = "SIGUSR1"

# -- processes ---------------------------------------------------------------------------
# The name (Linux's comm, 15 bytes at most) of a rank forked from our agent, whose /proc environ
# is its agent's: siblings and tests know it by this ("dcp-fsdp-r" and up to 5 digits fit).
RANK_PROCESS_NAME_PREFIX = "dcp-fsdp-r"


def rank_process_name(rank: int) -> str:
    return f"{RANK_PROCESS_NAME_PREFIX}{rank}"


def rank_of_process_name(name: str) -> int | None:
    """The global rank a process name (rank_process_name) gives, or None for any other name."""
    digits = name.removeprefix(RANK_PROCESS_NAME_PREFIX)
    return int(digits) if name.startswith(RANK_PROCESS_NAME_PREFIX) and digits.isdigit() else None

# -- exit codes --------------------------------------------------------------------------
EXIT_OK = 0
EXIT_FAILED = 1  # a save or load failed (storage, timeout, corruption)
EXIT_USER_ERROR = 2  # bad input: the message names the setting and the fix
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM: the record says "interrupted"


# -- how a run ended ---------------------------------------------------------------------
class EndCause(str, enum.Enum):
    """Why a run (or one rank) ended: a field of the record, the rank's error file and the
    agent's summary. Processes decide on it, never on the wording of an error line."""

    OK = "ok"
    ERROR = "error"  # this rank raised: the error line says what
    USER_ERROR = "user_error"  # bad input, named with its fix
    INTERRUPTED = "interrupted"  # SIGINT / SIGTERM from a user or the scheduler
    PEER_ENDED = "peer_ended"  # stopped because another rank ended first (not the root cause)
    KILLED = "killed"  # ended by a signal it could not handle (seen by the parent)
    AGENT = "agent"  # torch's elastic agent failed, or no rank said why


# The key of our own fields in a rank's TORCHELASTIC_ERROR_FILE (torch reads "message").
ERROR_FILE_KEY = "dcp_fsdp"
