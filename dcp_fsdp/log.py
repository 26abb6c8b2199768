"""The tool's one logger: `[dcp-fsdp] ...` on stdout for progress, `dcp-fsdp: warning: ...`
and `dcp-fsdp: error: ...` on stderr (the forms users and scripts read)."""

from __future__ import annotations

import contextlib
import logging
import sys


def printable(text: str) -> str:
    """`text` with every character a terminal would act on escaped (ESC as \\x1b): text from
    storage or a record must neither clear the screen nor split a line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # Every line is one line: a key or record field in a message cannot break it.
        message = printable(record.getMessage())
        if record.levelno >= logging.ERROR:
            return f"dcp-fsdp: error: {message}"
        if record.levelno >= logging.WARNING:
            return f"dcp-fsdp: warning: {message}"
        return f"[dcp-fsdp] {message}"


class _StreamByLevel(logging.Handler):
    """Info to stdout, warnings and errors to stderr; looked up at emit time, so a
    redirected sys.stdout (tests, capture) is honoured; flushed every line."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        with contextlib.suppress(OSError, ValueError):
            stream.write(self.format(record) + "\n")
            stream.flush()


def get() -> logging.Logger:
    logger = logging.getLogger("dcp_fsdp")
    if not logger.handlers:
        handler = _StreamByLevel()
        handler.setFormatter(_Format())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def info(message: str) -> None:
    get().info(message)


def warning(message: str) -> None:
    get().warning(message)


def error(message: str) -> None:
    get().error(message)


# torch's DCP logs a failed read with its traceback on every rank, before raising the error the
# run records: a rank routes that logger here, one line each, without the traceback. MSC logs
# a failed upload or download at ERROR before raising what the run's own line names (no
# handler of its own: Python's last resort printed it raw, a server's answer in it unescaped):
# routed here too, as a warning, so the run's error line stays the only one.
TORCH_CHECKPOINT_LOGGER = "torch.distributed.checkpoint"
MSC_LOGGER = "multistorageclient"
_LIBRARY_LOGGERS = {TORCH_CHECKPOINT_LOGGER: ("torch", logging.CRITICAL), MSC_LOGGER: ("msc", logging.WARNING)}


class _OneLineFormat(_Format):
    def __init__(self, label: str, max_level: int) -> None:
        super().__init__()
        self.label, self.max_level = label, max_level

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(logging.makeLogRecord({
            **record.__dict__, "msg": f"{self.label}: {record.getMessage()}", "args": None,
            "exc_info": None, "exc_text": None, "levelno": min(record.levelno, self.max_level)}))
        error = record.exc_info[1] if record.exc_info else None
        return line + (printable(f" ({type(error).__name__}: {' '.join(str(error).split())[:300]})")
                       if error is not None else "")


def route_library_logs() -> None:
    """torch's DCP warnings (and worse), and MSC's, as one line each on stderr, never a traceback."""
    for name, (label, max_level) in _LIBRARY_LOGGERS.items():
        logger = logging.getLogger(name)
        if any(isinstance(h, _StreamByLevel) for h in logger.handlers):
            continue
        handler = _StreamByLevel()
        handler.setFormatter(_OneLineFormat(label, max_level))
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)
        logger.propagate = False
