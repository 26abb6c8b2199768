"""torch's DCP logs a failed read with its traceback on every rank (issue 31: a checkpoint
deleted under a running load printed 4 tracebacks); a rank routes that logger to one line."""

from __future__ import annotations

import logging

from dcp_fsdp import log


def test_torch_checkpoint_warnings_are_one_line_without_a_traceback(capsys):
    torch_logger = logging.getLogger(log.TORCH_CHECKPOINT_LOGGER)
    kept = list(torch_logger.handlers), torch_logger.propagate
    try:
        _one_line(capsys)
    finally:  # this process's other tests keep torch's logger as it was
        torch_logger.handlers[:], torch_logger.propagate = kept


def _one_line(capsys) -> None:
    log.route_library_logs()
    log.route_library_logs()  # once is enough: no second handler
    logger = logging.getLogger(log.TORCH_CHECKPOINT_LOGGER + ".state_dict_loader")
    try:
        raise FileNotFoundError("s3://b/ck/.metadata:\nNoSuchKey\x1b[2J")
    except FileNotFoundError:
        logger.warning("Global metadata is not found. Falling back to rank local metadata.",
                       exc_info=True)
    logger.info("not shown: below warning")
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "dcp-fsdp: warning: torch: Global metadata is not found. Falling back to rank local "
        "metadata. (FileNotFoundError: s3://b/ck/.metadata: NoSuchKey\\x1b[2J)"]
    assert "Traceback" not in err
    handlers = logging.getLogger(log.TORCH_CHECKPOINT_LOGGER).handlers
    assert len(handlers) == 1


def test_msc_errors_are_one_printable_warning_line(capsys):
    """MSC logs a failed upload at ERROR before raising it (no handler of its own: Python's
    last resort printed it raw): one printable warning line, the run's own error line the only
    error."""
    msc_logger = logging.getLogger(log.MSC_LOGGER)
    kept = list(msc_logger.handlers), msc_logger.propagate
    try:
        log.route_library_logs()
        logging.getLogger(log.MSC_LOGGER + ".client").error(
            "Non-retryable error occurred for upload_file: request_id: \x1b[2JX, status_code: 500")
        err = capsys.readouterr().err
        assert err.splitlines() == [
            "dcp-fsdp: warning: msc: Non-retryable error occurred for upload_file: request_id: "
            "\\x1b[2JX, status_code: 500"]
    finally:
        msc_logger.handlers[:], msc_logger.propagate = kept
