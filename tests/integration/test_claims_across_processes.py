"""Suffix claims on fs taken by forked processes at once. Moved from tests/unit/test_layout.py."""

from __future__ import annotations

import pytest

from dcp_fsdp.config.schema import StorageConfig, StorageKind
from dcp_fsdp.storage import make_store
from dcp_fsdp.storage.fs import FsStore
from tests.unit.test_layout import _claim_after


@pytest.fixture
def store(tmp_path) -> FsStore:
    made = make_store(StorageConfig(kind=StorageKind.fs, path=str(tmp_path / "ckpt")))
    assert isinstance(made, FsStore)
    return made


def test_fs_claims_are_exclusive_across_processes(store):
    """8 processes claim one suffix at the same moment: exactly one gets it."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(8), context.Queue()
    claimers = [context.Process(target=_claim_after, args=(store.root, start, results))
                for _ in range(8)]
    for claimer in claimers:
        claimer.start()
    won = sorted(results.get(timeout=60) for _ in claimers)
    for claimer in claimers:
        claimer.join()
    assert won == [False] * 7 + [True]
