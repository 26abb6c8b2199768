"""A suffix that holds only a save's claim as objects, with multipart uploads open under it:
`list` and the clean-up after a stopped run called it "an abandoned claim (a save that ended
before writing)" while its parts (201.9 MiB in the trial) were stored and billed. They now
say what it is, what the uploads hold and the command that cleans it (issue 49)."""

from __future__ import annotations

import datetime

import pytest

from dcp_fsdp.config.schema import BenchmarkConfig, StorageConfig, StorageKind
from dcp_fsdp.storage import layout
from dcp_fsdp.storage.base import OpenUpload
from dcp_fsdp.storage.fs import FsStore

RUN_ID = "20260101-000000-save-abcdef"


def _upload(suffix: str, name: str, parts: int, mib: float) -> OpenUpload:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    return OpenUpload(suffix, f"ckpt/{suffix}/{name}", f"id-{name}", started, parts,
                      int(mib * 2**20))


@pytest.fixture
def store(tmp_path) -> FsStore:
    made = FsStore(StorageConfig(kind=StorageKind.fs, path=str(tmp_path / "ckpt")))
    made.put_small("cut", layout.CLAIM_NAME, layout._claim_body(RUN_ID))
    made.put_small("orphan", layout.CLAIM_NAME, layout._claim_body("gone-run"))
    return made


def test_list_names_open_uploads_under_a_claim_and_the_command_that_cleans_them(
        store, monkeypatch, capsys):
    from dcp_fsdp.launch import listing

    uploads = [_upload("cut", "__0_0.distcp", 20, 160.0), _upload("cut", "__1_0.distcp", 6, 41.9)]
    monkeypatch.setattr(store, "open_uploads", lambda suffix=None: uploads)
    monkeypatch.setattr(listing, "_store", lambda cfg, command: store)
    cfg = BenchmarkConfig(storage=StorageConfig(kind=StorageKind.fs, path=str(store.root)))
    assert listing.list_checkpoints(cfg) == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith("| cut "))
    assert "CLAIMED, UPLOADS OPEN, NOTHING COMMITTED (" in row, row
    note = next(line for line in out if line.startswith("suffix=cut:"))
    assert "ended before writing" not in note and "abandoned claim" not in note, note
    assert ("no object was committed, but 2 multipart upload(s) holding 26 part(s), 201.9 MiB "
            "are open there, stored and billed until aborted: a save that ended mid-upload") in note
    # the claim is seconds old: delete would refuse it without --force (a second refusal)
    assert "`dcp-fsdp delete suffix=cut --force` with the same storage settings aborts them" in note
    # a claim with no upload under it stays what it was, with the command that works
    orphan = next(line for line in out if line.startswith("suffix=orphan:"))
    assert "abandoned claim (a save that ended before writing)" in orphan
    assert "`dcp-fsdp delete suffix=orphan --force`" in orphan
    assert "| orphan " in "\n".join(out) and "CLAIMED, NO DATA (" in next(
        line for line in out if line.startswith("| orphan "))


def _stopped_save(tmp_path, store, monkeypatch, listings):
    """settle() for a save stopped while writing suffix `cut`; the store's open uploads as
    `listings` gives them, one list per call (before the abort, after it)."""
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.launch import aftermath

    calls = iter(listings)
    monkeypatch.setattr(store, "open_uploads", lambda suffix=None: next(calls))
    monkeypatch.setattr(store, "abort_uploads", lambda suffix=None, *rest: 2)
    monkeypatch.setattr(aftermath, "make_store", lambda *args, **kwargs: store)
    cfg = compose("save", ["storage=fs", f"storage.path={store.root}",
                           f"results_dir={tmp_path / 'results'}", "suffix=cut"])
    aftermath.settle(cfg, RUN_ID, aftermath.RanksOutcome(130, "interrupted", "interrupted by SIGINT",
                                                         writing_suffix="cut"), claimed=["cut"])


def test_the_clean_up_after_ctrl_c_says_a_save_ended_mid_upload(tmp_path, store, monkeypatch,
                                                                capsys):
    uploads = [_upload("cut", "__0_0.distcp", 20, 160.0), _upload("cut", "__1_0.distcp", 6, 41.9)]
    _stopped_save(tmp_path, store, monkeypatch, [uploads, []])
    said = [line for line in capsys.readouterr().out.splitlines() if "suffix=cut" in line]
    assert len(said) == 1, said
    assert "ended before writing" not in said[0], said
    assert ("a save that ended mid-upload (nothing committed; 2 multipart upload(s) holding 26 "
            "part(s), 201.9 MiB, aborted") in said[0], said
    assert not store.has_objects("cut")  # the claim is gone: the suffix is free


def test_uploads_still_open_after_the_abort_are_named_and_the_claim_kept(tmp_path, store,
                                                                        monkeypatch, capsys):
    late = [_upload("cut", "__1_0.distcp", 6, 41.9)]  # a rank started it after the abort
    _stopped_save(tmp_path, store, monkeypatch, [[], late])
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "suffix=cut" in line]
    assert len(said) == 1 and "ended before writing" not in said[0], said
    assert "1 multipart upload(s) holding 6 part(s), 41.9 MiB still open after the abort" in said[0]
    assert "`dcp-fsdp delete suffix=cut --force`" in said[0]
    assert store.has_objects("cut")  # the claim stays with its open upload
