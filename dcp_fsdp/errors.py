"""Errors the user can fix: printed as one line naming the setting and the fix."""


class UserError(Exception):
    """Bad input or environment. The message is the whole story: no traceback is shown."""


class BenchmarkFailure(Exception):
    """A run failed on some rank; the message carries the root cause."""


class StorageStreamError(Exception):
    """An object stream's write or close failed first, and DCP then raised something that
    hides it (torch's zip writer: "unexpected pos"). One string argument: it pickles whole into
    DCP's CheckpointException."""
