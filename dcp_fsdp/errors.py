"""Errors the user can fix: printed as one line naming the setting and the fix."""


class UserError(Exception):
    """Bad input or environment. The message is the whole story: no traceback is shown."""


class BenchmarkFailure(Exception):
    """A run failed on some rank; the message carries the root cause."""
