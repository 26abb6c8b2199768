"""Environment variables set for one block of the launcher, as they were after it."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """os.environ with `extra` inside the block (the stores' clients read S3's endpoint and keys there)."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
