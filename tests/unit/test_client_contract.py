"""One client contract (storage/s3_clients.py): a client the S3 store has never seen, added by
a registry line, carries a tiny_llama save and load, verified bit for bit, with no edit to
the store; the store warms a client up once per writer or reader."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_fsdp.config.schema import CheckpointState, Dtype, StorageConfig
from dcp_fsdp.storage import make_store, s3
from dcp_fsdp.storage.s3_clients import S3Client
from dcp_fsdp.storage.base import host_state_kwargs
from dcp_fsdp.storage.s3_target import S3Target
from dcp_fsdp.storage.timeline import HookTimeline


class DirectoryClient(S3Client):
    """A fourth client: DCP's own file-system writer and reader, over a local directory."""

    name = "directory"
    packages: tuple[str, ...] = ("torch",)
    settings: frozenset[str] = frozenset()
    root = Path()  # set by the test

    def __init__(self, target: S3Target, config: StorageConfig) -> None:
        self.target, self.warm_ups = target, 0

    def environment(self) -> dict[str, str]:
        return {"DIRECTORY_CLIENT_ROOT": str(self.root)}

    def retry(self) -> dict[str, Any]:
        return {"retry_mode": "none", "max_attempts": 1}

    def close(self) -> None:
        pass

    def writer(self, suffix: str, timeline: HookTimeline | None = None, host_state: bool = False) -> Any:
        from dcp_fsdp.storage.timed_dcp import TimedFileSystemWriter

        return TimedFileSystemWriter(self.root / self.target.prefix / suffix,
                                     timeline=timeline or HookTimeline(), overwrite=False,
                                     **host_state_kwargs(host_state))

    def reader(self, suffix: str, timeline: HookTimeline | None = None) -> Any:
        return dcp.FileSystemReader(self.root / self.target.prefix / suffix)

    def warm_up(self, storage_io: Any) -> list[Any]:
        self.warm_ups += 1
        return ["events"]


@pytest.fixture
def one_rank_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_registered_fourth_client_saves_and_loads_tiny_llama_verified(one_rank_group, tmp_path,
                                                                        monkeypatch):
    from dcp_fsdp.models.build import build_sharded_model, dcp_state_dict
    from dcp_fsdp.rank.state import verify_values, zero_local_tensors

    monkeypatch.setitem(s3.CLIENTS, DirectoryClient.name, DirectoryClient)
    monkeypatch.setattr(DirectoryClient, "root", tmp_path)
    storage = StorageConfig(uri="s3://bucket/ckpt", endpoint="http://127.0.0.1:9",
                            client=cast(Any, DirectoryClient.name))
    store = make_store(storage)
    sharded = build_sharded_model("tiny_llama", Dtype.fp32, CheckpointState.model,
                                  torch.device("cpu"), 1, seed=7)
    state_dict = dcp_state_dict(sharded.model, sharded.optimizer)

    writer = store.writer("s1", HookTimeline(), host_state=True)
    assert store.warm_up(writer) == ["events"]
    dcp.save(state_dict, storage_writer=writer)
    zero_local_tensors(state_dict)
    dcp.load(state_dict, storage_reader=store.reader("s1"))
    verify_values(state_dict, 7, "the fourth client's load")  # raises on any element

    assert (tmp_path / "ckpt" / "s1" / ".metadata").is_file()
    client = cast(Any, store).client
    assert client.warm_ups == 1  # the request statistics' emitters came with the one warm-up
    described = store.describe()
    assert (described["client"], described["retry_mode"], described["max_attempts"]) == (
        "directory", "none", 1)
    assert set(described["client_versions"]) == {"torch"}
    assert store.environment() == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                                   "DIRECTORY_CLIENT_ROOT": str(tmp_path)}


@pytest.mark.parametrize("name", sorted(s3.CLIENTS))
def test_every_registered_client_is_its_settings_value_and_owns_only_real_settings(name):
    from dcp_fsdp.config.schema import StorageClient
    from dcp_fsdp.config.validate import setting_names

    client = s3.CLIENTS[name]
    assert StorageClient(name).value == cast(Any, client).name
    assert cast(Any, client).settings <= set(setting_names())


def test_an_fsspec_error_answer_names_its_object_and_s3_code():
    """s3fs raised only 'OSError: [Errno 22] Bad Request' (issue 49): the fsspec client's
    warm-up makes S3's code, the request and the object part of the answer's message, which
    survives s3fs's translation and the pickling of a rank's error to the coordinator."""
    import pickle

    import botocore.stub

    from dcp_fsdp.process.failures import root_cause
    from dcp_fsdp.storage.timed_fs import client_file_system

    store = make_store(StorageConfig(uri="s3://bucket/ckpt", endpoint="http://127.0.0.1:9",
                                     region="us-east-1", client=cast(Any, "fsspec")))
    writer = store.writer("s1")
    store.warm_up(writer)
    s3fs = cast(Any, client_file_system(writer)).fs
    with botocore.stub.Stubber(s3fs.s3) as stub, pytest.raises(OSError) as raised:
        stub.add_client_error("get_object", service_error_code="InvalidRequest",
                              service_message="Bad Request", http_status_code=400)
        s3fs.cat_file("bucket/ckpt/s1/__0_0.distcp", start=0, end=4)  # one ranged GET, as read_ahead
    error = pickle.loads(pickle.dumps(raised.value))  # as DCP gathers it: no __cause__ left
    assert root_cause(error) == ("OSError: [Errno 22] Bad Request (S3 InvalidRequest, GetObject "
                                 "s3://bucket/ckpt/s1/__0_0.distcp)")


@pytest.mark.parametrize("name, mode, attempts", [("s3torchconnector", "crt_standard", 10),
                                                  ("fsspec", "adaptive", 4),
                                                  ("msc", "standard", 4)])
def test_the_record_says_the_retry_mode_and_attempts_each_client_ran_with(monkeypatch, name, mode,
                                                                          attempts):
    """AWS_RETRY_MODE=adaptive was used by s3fs and not recorded (issue 49); MSC fixes its
    mode to standard, the connector's CRT client reads neither variable."""
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    store = make_store(StorageConfig(uri="s3://bucket/ckpt", endpoint="http://127.0.0.1:9",
                                     client=cast(Any, name)))
    described = store.describe()
    assert (described["client"], described["retry_mode"], described["max_attempts"]) == (
        name, mode, attempts)


def test_a_users_msc_config_is_said_to_be_unread_at_launch(tmp_path, monkeypatch, capsys):
    """The ranks run on the profile the tool writes: a user's MSC_CONFIG was ignored without a
    word (issue 49); the launch says so in one line."""
    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.launch import checks

    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "mine.yaml"))
    checks.warn_once.cache_clear()
    checks.check_launch(compose("save", ["storage.client=msc", "nproc=1", f"results_dir={tmp_path}"]))
    lines = [line for line in capsys.readouterr().err.splitlines() if "MSC_CONFIG" in line]
    assert len(lines) == 1 and "MSC_CONFIG is set and not read" in lines[0], lines
    checks.check_launch(compose("save", ["nproc=1", f"results_dir={tmp_path}"]))  # the connector
    assert "MSC_CONFIG" not in capsys.readouterr().err


@pytest.mark.parametrize("variables, mode, attempts", [({}, "standard", 3),
                                                        ({"AWS_MAX_ATTEMPTS": "2"}, "standard", 2),
                                                        ({"AWS_RETRY_MODE": "legacy", "AWS_MAX_ATTEMPTS": "2"},
                                                         "legacy", 2)])
def test_fsspec_tries_a_refused_connection_as_often_as_its_record_says(monkeypatch, tmp_path, variables,
                                                                       mode, attempts):
    """A save under fsspec ended 23 s after its server's kill -9 (issue 49, late 1): s3fs's
    botocore ran its default legacy mode, 5 attempts with up to 15 s of backoff, on each of the
    three requests a failed save makes. It runs standard's 3 unless the user's AWS_RETRY_MODE
    or AWS_MAX_ATTEMPTS say otherwise; the attempts counted are what the record says."""
    from dcp_fsdp.storage.timed_fs import client_file_system

    for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    refusing = socket.socket()  # bound, not listening: every connection to it is refused
    refusing.bind(("127.0.0.1", 0))
    store = make_store(StorageConfig(uri="s3://bucket/ckpt", region="us-east-1", client=cast(Any, "fsspec"),
                                     endpoint=f"http://127.0.0.1:{refusing.getsockname()[1]}"))
    writer = store.writer("s1")
    store.warm_up(writer)
    s3fs = cast(Any, client_file_system(writer)).fs
    sent: list[str] = []
    s3fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    try:
        with pytest.raises(Exception, match="Could not connect to the endpoint URL"):
            s3fs.cat_file("bucket/ckpt/s1/__0_0.distcp")
    finally:
        refusing.close()
    assert len(sent) == attempts, sent
    described = store.describe()
    assert (described["retry_mode"], described["max_attempts"]) == (mode, attempts)


def test_fsspecs_loop_drops_only_a_broken_connections_unretrieved_task(caplog):
    """A save under fsspec whose endpoint went away printed asyncio's "Task exception was never
    retrieved" with aiohttp's traceback beside its one error line (CI, test_faults): fsspec's
    loop drops that task's connection error; any other context still reaches asyncio's
    default handler, which logs it."""
    import asyncio
    import logging

    from dcp_fsdp.storage.s3_clients import quiet_broken_connection_tasks

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            quiet_broken_connection_tasks(loop, {"message": "Task exception was never retrieved",
                                                 "exception": ConnectionResetError("closing transport")})
            assert not caplog.records
            quiet_broken_connection_tasks(loop, {"message": "Task exception was never retrieved",
                                                 "exception": ValueError("a bug")})
            assert [r.getMessage() for r in caplog.records] == ["Task exception was never retrieved"]
    finally:
        loop.close()
