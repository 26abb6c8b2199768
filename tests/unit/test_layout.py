"""The checkpoint layout and suffix policy (storage/layout.py), on the file-system store
(a real directory) and against the CheckpointStore contract."""

from __future__ import annotations

import datetime
import re

import pytest

from dcp_fsdp.config.schema import ModelConfig, StorageConfig, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.storage import layout, make_store
from dcp_fsdp.storage.base import CheckpointStore
from dcp_fsdp.storage.fs import FsStore
from dcp_fsdp.storage.s3 import S3Store


@pytest.fixture
def store(tmp_path) -> FsStore:
    made = make_store(StorageConfig(kind=StorageKind.fs, path=str(tmp_path / "ckpt")))
    assert isinstance(made, FsStore)
    return made


def test_both_stores_implement_the_contract(tmp_path):
    fs = make_store(StorageConfig(kind=StorageKind.fs, path=str(tmp_path)))
    s3 = make_store(StorageConfig(uri="s3://my-bucket/some/prefix/", region="eu-west-1"))
    assert isinstance(fs, CheckpointStore) and isinstance(s3, CheckpointStore)
    assert isinstance(s3, S3Store) and s3.location("x") == "s3://my-bucket/some/prefix/x"
    assert s3.target.key("sfx", layout.MANIFEST_NAME) == "some/prefix/sfx/dcp_fsdp.json"
    assert s3.describe()["region"] == "eu-west-1"


def test_s3_store_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    store = make_store(StorageConfig(uri="s3://b-1/p", endpoint="http://127.0.0.1:9"))
    assert isinstance(store, S3Store)
    import os

    assert "AWS_ENDPOINT_URL" not in os.environ  # the rank applies it, not the constructor
    assert store.environment() == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    assert store.target.force_path_style is True


def test_new_suffix_sorts_by_time_and_is_valid():
    early = layout.new_suffix(datetime.datetime(2026, 1, 2, 3, 4))
    late = layout.new_suffix(datetime.datetime(2026, 1, 2, 3, 5))
    assert re.fullmatch(r"2026-01-02-03-04-[0-9a-f]{4}", early)
    assert early[:16] < late[:16]
    layout.check_suffix(early)


@pytest.mark.parametrize("bad", ["-x", "a b", "a/b", "", "..", "x;rm"])
def test_bad_suffixes_are_refused_with_the_rule(bad):
    with pytest.raises(UserError, match="suffix=.*letters, digits"):
        layout.check_suffix(bad)


def test_configured_suffix_gets_iteration_numbers_and_never_overwrites(store):
    assert layout.save_suffix(store, "mine", 1, 1, []) == ("mine", layout.CLAIM_EXCLUSIVE)
    assert layout.save_suffix(store, "mine", 3, 2, [])[0] == "mine-2"
    with pytest.raises(UserError, match="suffix=mine-2: a checkpoint already exists"):
        layout.save_suffix(store, "mine", 3, 2, [])  # its claim is there


def test_fresh_suffixes_avoid_used_and_existing_ones(store, monkeypatch):
    names = iter(["taken", "used", "free"])
    monkeypatch.setattr(layout, "new_suffix", lambda now=None: next(names))
    store.put_small("taken", "x", b"1")
    assert layout.save_suffix(store, None, 5, 1, ["used"])[0] == "free"
    assert store.has_objects("free")  # a fresh suffix is claimed too


def test_a_save_that_loses_the_claim_is_refused_in_one_line_before_writing(store, monkeypatch):
    """Two saves checked the suffix empty at once: the first claim wins, the second is
    refused naming the suffix, the other run and the fix (fs: O_EXCL decides)."""
    monkeypatch.setenv("DCP_FSDP_RUN_ID", "run-first")
    assert layout.save_suffix(store, "race", 1, 1, []) == ("race", layout.CLAIM_EXCLUSIVE)
    monkeypatch.setattr(store, "has_objects", lambda suffix: False)  # it checked before
    with pytest.raises(UserError) as refused:
        layout.save_suffix(store, "race", 1, 1, [])
    assert "suffix=race: another save claimed it" in str(refused.value)
    assert "run run-first" in str(refused.value) and "omit it" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert [p.name for p in (store.root / "race").iterdir()] == [layout.CLAIM_NAME]


def _claim_after(root, start, results) -> None:
    start.wait()
    results.put(FsStore(StorageConfig(kind=StorageKind.fs, path=str(root))).claim("one", b"x").won)


def test_a_checkpoint_is_loadable_only_with_its_metadata(store):
    store.put_small("done", "__0_0.distcp", b"data")
    store.put_small("done", layout.METADATA_NAME, b"meta")
    store.put_small("half", "__0_0.distcp", b"data")
    layout.check_loadable(store, "done")
    with pytest.raises(UserError, match=r"suffix=half: checkpoint is incomplete .*complete "
                                        r"checkpoints there: done"):
        layout.check_loadable(store, "half")
    with pytest.raises(UserError, match="suffix=nope: checkpoint does not exist"):
        layout.check_loadable(store, "nope")
    listed = {c.suffix: c for c in store.list_checkpoints()}
    assert listed["done"].complete and not listed["half"].complete
    assert listed["done"].object_count == 2 and listed["done"].size_bytes == 8


def test_a_load_of_a_suffix_a_save_is_writing_names_the_save(store):
    """Issue 31: a load of a suffix another run still writes said "the save did not finish";
    the claim names the run, so the line says it is being written and by whom."""
    store.put_small("busy", layout.CLAIM_NAME, layout._claim_body("run-writing"))
    store.put_small("busy", "__0_0.distcp", b"data")
    with pytest.raises(UserError) as refused:
        layout.check_loadable(store, "busy")
    line = str(refused.value)
    assert line.startswith("suffix=busy: checkpoint is incomplete (no .metadata yet) and "
                           "claimed by a save (run run-writing on host ")
    assert "still writing it" in line and "did not finish" not in line and "\n" not in line


def test_manifest_round_trip_and_garbage(store):
    store.put_small("s", layout.MANIFEST_NAME, layout.encode_manifest({"model": "tiny_llama"}))
    assert layout.read_manifest(store, "s") == {"model": "tiny_llama"}
    assert layout.read_manifest(store, "missing") is None  # only an absent one is None
    for garbage in (b"{not json", b"[1, 2]"):
        store.put_small("t", layout.MANIFEST_NAME, garbage)
        with pytest.raises(UserError, match=r"suffix=t: its manifest dcp_fsdp.json is damaged"
                                            r".*integrity=false"):
            layout.read_manifest(store, "t")
        assert layout.manifest_if_readable(store, "t") is None


@pytest.mark.parametrize("integrity", [True, False])
def test_a_load_refuses_a_damaged_manifest_before_any_rank_unless_unverified(tmp_path, integrity):
    """The trial's case 81: `{not json` in dcp_fsdp.json was read as "no manifest stored" and
    the load ran unverified, exit 0."""
    import torch.distributed.checkpoint as dcp

    from dcp_fsdp.config.schema import BenchmarkConfig, Command
    from dcp_fsdp.launch.preflight import check_compatible

    cfg = BenchmarkConfig(command=Command.load, suffix="s", integrity=integrity,
                          model=ModelConfig(preset="tiny_llama"),
                          storage=StorageConfig(kind=StorageKind.fs, path=str(tmp_path)))
    dcp.save(_model_state(cfg), storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")),
             no_dist=True)
    (tmp_path / "s" / layout.MANIFEST_NAME).write_bytes(b"{not json")
    if integrity:
        with pytest.raises(UserError, match=r"suffix=s: its manifest dcp_fsdp.json is damaged"):
            check_compatible(FsStore(cfg.storage), cfg)
    else:  # not to be verified: the manifest is not needed, .metadata stands alone
        check_compatible(FsStore(cfg.storage), cfg)


def _model_state(cfg) -> dict:
    """The configured model's state as this tool saves it (zeros, meta-free): {"model": ...}."""
    import torch

    from dcp_fsdp.models.llama_model_config import state_shapes
    from dcp_fsdp.models.presets import model_shape

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.model.dtype.value]
    return {"model": {name: torch.zeros(dims, dtype=dtype)
                      for name, dims in state_shapes(model_shape(cfg.model))}}


def test_a_checkpoint_not_of_this_tool_is_refused_before_any_rank_naming_what_it_holds(tmp_path):
    """Issue 31: a checkpoint written by plain dcp.save (no manifest) was refused only after
    the ranks built the model, with advice that could not work; the launcher now compares its
    tensors with the model's by arithmetic and says what it holds."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_fsdp.config.schema import BenchmarkConfig, Command
    from dcp_fsdp.launch.preflight import check_compatible

    cfg = BenchmarkConfig(command=Command.load, suffix="plain",
                          model=ModelConfig(preset="tiny_llama"),
                          storage=StorageConfig(kind=StorageKind.fs, path=str(tmp_path)))
    dcp.save({"layer.weight": torch.ones(4, 4), "layer.bias": torch.ones(4)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")), no_dist=True)
    with pytest.raises(UserError) as refused:
        check_compatible(FsStore(cfg.storage), cfg)
    line = str(refused.value)
    assert line.startswith("suffix=plain: not a checkpoint of this tool (no dcp_fsdp.json)")
    assert f"not model={cfg.model.name}'s state (it has no tensor 'model." in line
    assert "it holds 2 tensor(s) ('layer.weight', 'layer.bias')" in line or \
        "it holds 2 tensor(s) ('layer.bias', 'layer.weight')" in line
    assert "model.dtype=" not in line  # the old advice, which could not work
    # the same model's state saved by plain dcp.save (no manifest) passes: it is the model's
    dcp.save(_model_state(cfg), storage_writer=dcp.FileSystemWriter(str(tmp_path / "same")),
             no_dist=True)
    cfg.suffix = "same"
    check_compatible(FsStore(cfg.storage), cfg)


def test_a_suffix_holding_only_a_claim_is_named_so_and_recognised_as_its_runs(store, monkeypatch):
    monkeypatch.setenv("DCP_FSDP_RUN_ID", "run-a")
    assert layout.save_suffix(store, "only", 1, 1, []) == ("only", layout.CLAIM_EXCLUSIVE)
    assert layout.save_suffix(store, "used", 1, 1, [])[0] == "used"
    store.put_small("used", "__0_0.distcp", b"data")
    listed = {c.suffix: c for c in store.list_checkpoints()}
    assert listed["only"].claim_only and not listed["used"].claim_only
    assert [c.suffix for c in store.list_checkpoints("only")] == ["only"]
    assert store.list_checkpoints("absent") == []
    assert layout.holds_only_claim_of(store, "only", "run-a")
    assert not layout.holds_only_claim_of(store, "only", "run-b")  # another run's claim
    assert not layout.holds_only_claim_of(store, "used", "run-a")  # it holds data


# -- the launcher's claim (trial cases 16/18: the loser refused before any rank) ------------

def _fs_save(tmp_path, *overrides: str):
    from dcp_fsdp.config.compose import compose

    return compose("save", ["storage=fs", f"storage.path={tmp_path / 'ckpt'}",
                            f"results_dir={tmp_path / 'results'}", *overrides])


def test_the_launcher_claims_a_configured_suffix_and_its_rank_0_takes_it_as_its_runs(
        tmp_path, monkeypatch):
    """The launcher claims suffix= for its run before any rank starts; a second launcher is
    refused there in one line; rank 0 of the first run recognises the claim as its own."""
    from dcp_fsdp.launch.preflight import claim_save_suffixes

    cfg = _fs_save(tmp_path, "suffix=race1")
    claimed, env = claim_save_suffixes(cfg, {}, "run-a")
    store = make_store(cfg.storage)
    assert claimed == ["race1"] and layout.read_claim(store, "race1")["run_id"] == "run-a"
    with pytest.raises(UserError) as refused:
        claim_save_suffixes(cfg, {}, "run-b")  # the loser: its launcher, before its ranks
    assert "suffix=race1:" in str(refused.value) and "omit it" in str(refused.value)
    assert "\n" not in str(refused.value)
    # rank 0 of run-a, with what its launcher handed it, goes on with the claim
    monkeypatch.setenv("DCP_FSDP_RUN_ID", "run-a")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert layout.save_suffix(store, "race1", 1, 1, []) == ("race1", layout.CLAIM_EXCLUSIVE)
    # ... but never takes another run's claim for its own
    monkeypatch.setenv("DCP_FSDP_RUN_ID", "run-b")
    with pytest.raises(UserError, match="suffix=race1: a checkpoint already exists"):
        layout.save_suffix(store, "race1", 1, 1, [])


def test_a_launcher_that_loses_one_of_its_suffixes_releases_the_ones_it_took(tmp_path):
    from dcp_fsdp.launch.preflight import claim_save_suffixes

    cfg = _fs_save(tmp_path, "suffix=it", "iterations=3")
    store = make_store(cfg.storage)
    assert layout.save_suffix(store, "it-2", 1, 1, [])[0] == "it-2"  # another save's
    with pytest.raises(UserError, match="suffix=it-2:"):
        claim_save_suffixes(cfg, {}, "run-a")
    assert not store.has_objects("it-1") and store.has_objects("it-2")
    assert claim_save_suffixes(_fs_save(tmp_path, "suffix=x"), {}, "run-a")[0] == ["x"]
    assert claim_save_suffixes(_fs_save(tmp_path), {}, "run-a") == ([], {})  # fresh: rank 0's


def test_the_aftermath_removes_the_launchers_claims_a_failed_run_never_wrote(tmp_path, capsys):
    """A run that died before writing (here: no rank recorded anything) leaves no claim of
    its own behind; one it wrote into is kept and named partial."""
    from dcp_fsdp.launch import aftermath
    from dcp_fsdp.launch.preflight import claim_save_suffixes

    cfg = _fs_save(tmp_path, "suffix=gone", "iterations=2")
    claimed, _ = claim_save_suffixes(cfg, {}, "20260101-000000-save-abcdef")
    store = make_store(cfg.storage)
    store.put_small("gone-2", "__0_0.distcp", b"data")  # the run's second save, cut short
    aftermath.settle(cfg, "20260101-000000-save-abcdef",
                     aftermath.RanksOutcome(1, "failed", "rank 0 was killed by SIGKILL"),
                     claimed=claimed)
    assert not store.has_objects("gone-1") and store.has_objects("gone-2")
    said = capsys.readouterr().out
    assert "suffix=gone-1 held only this run's claim" in said
    assert "partial checkpoint suffix=gone-2" in said


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_data_object_that_is_not_a_file_is_named_not_called_missing(store, kind):
    """Issue 31: a FIFO or a symlink to /dev/zero where a data object belongs read as
    "missing"; the load's pre-check and `list --check` now say what it is, in one line."""
    import os

    from dcp_fsdp.storage.metadata_peek import MetadataFacts

    store.put_small("odd", layout.METADATA_NAME, b"meta")
    target = store.root / "odd" / "__0_0.distcp"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    facts = MetadataFacts({}, {"__0_0.distcp": 16})
    with pytest.raises(UserError, match=r"__0_0\.distcp: not a regular file \(a FIFO, a device"):
        layout.check_objects_whole(store, "odd", facts, "default")
    (store.root / "dangling").mkdir()
    (store.root / "dangling" / "__0_0.distcp").symlink_to(store.root / "nowhere")
    assert store.object_sizes("dangling") == {}  # a dangling link: missing, as it is


def test_list_names_a_complete_checkpoint_whose_name_load_and_delete_refuse(tmp_path, capsys):
    """Issue 31: `list` called `complete` a suffix that `load` and `delete` refuse by its
    name; the state and a line after the table now say so."""
    from dcp_fsdp.config.schema import BenchmarkConfig
    from dcp_fsdp.launch.listing import list_checkpoints

    cfg = BenchmarkConfig(storage=StorageConfig(kind=StorageKind.fs, path=str(tmp_path)))
    store = FsStore(cfg.storage)
    for suffix in ("good-1", "my ckpt"):
        store.put_small(suffix, "__0_0.distcp", b"data")
        store.put_small(suffix, layout.METADATA_NAME, b"meta")
    assert list_checkpoints(cfg) == 0
    out = capsys.readouterr().out
    assert "| my ckpt  | complete; NAME NOT TAKEN |" in out
    assert "| good-1   | complete                 |" in out
    assert "suffix=my ckpt: complete, but not a name `load` and `delete` take" in out
    assert "suffix=good-1:" not in out


def test_clean_uploads_aborts_exactly_what_its_table_says(monkeypatch, capsys):
    """CI (2026-11-27, under load): the table said `leave (younger than 8 s)` for an upload
    8 s old, then the abort, which looked at the clock again, aborted it too. The table
    and the abort now decide with one moment. The listing's clock is the test's: each read
    is 10 ms after the one before (how busy the machine is changes nothing), so a second
    read would make the upload 8 s old."""
    import datetime
    import types

    from dcp_fsdp.config.schema import BenchmarkConfig
    from dcp_fsdp.launch import listing

    first = datetime.datetime(2026, 11, 29, 12, 0, tzinfo=datetime.timezone.utc)

    class Clock(datetime.datetime):
        reads = 0

        @classmethod
        def now(cls, tz=None):
            Clock.reads += 1
            return first + datetime.timedelta(seconds=0.01 * (Clock.reads - 1))

    monkeypatch.setattr(listing, "datetime", types.SimpleNamespace(
        datetime=Clock, timezone=datetime.timezone))
    started = first - datetime.timedelta(seconds=7.999)
    young = layout.OpenUpload("s", "p/s/__0_0.distcp", "u1", started.isoformat(), 0, 0)

    class Store:
        decided_at: datetime.datetime | None = None

        def open_uploads(self, suffix=None):
            return [young]

        def location(self, suffix):
            return f"s3://b/p/{suffix}"

        def abort_uploads(self, suffix=None, min_age_s=0.0, now=None):
            Store.decided_at = now
            return int(young.age_s(now) >= min_age_s)

    monkeypatch.setattr(listing, "_store", lambda cfg, command: Store())
    assert listing.clean_uploads(BenchmarkConfig(), min_age_s=8.0) == 0
    out = capsys.readouterr().out
    assert "leave (younger than 8 s)" in out and "aborted 0 open multipart upload(s)" in out
    assert Store.decided_at == first  # the table's moment, handed to the abort
