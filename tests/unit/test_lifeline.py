"""What a killed process leaves is removed by the next one: directories named after a
dead owner go (with the SeaweedFS sockets they list), a live owner's stay."""

from __future__ import annotations

import os
import pickle
import signal
import types
from pathlib import Path

from dcp_fsdp.process import lifeline


def test_owned_tempdir_names_its_owner(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    path = lifeline.owned_tempdir("dcp-fsdp-run-")
    assert path.parent == Path(tmp_path) and f"-p{os.getpid()}-h{lifeline.host_tag()}-" in path.name


def test_seaweed_sockets_nobody_listens_on_are_removed_once_old():
    """Whatever left them (a server killed with a launcher whose directory was elsewhere, a
    killed s3-server daemon): real unix sockets, only the old ones nobody listens on go."""
    import shutil
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="lfl-", dir="/tmp"))  # a socket path is short
    try:
        _sockets_in(short)
    finally:
        shutil.rmtree(short)


def _sockets_in(tmp_path: Path) -> None:
    import socket
    import time

    def bound(name: str, listening: bool, age_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp_path / name))
        if listening:
            sock.listen(1)
        then = time.time() - age_s
        os.utime(tmp_path / name, (then, then))
        return sock

    live = bound("seaweedfs-master-grpc-41001.sock", listening=True, age_s=3600)
    dead = bound("seaweedfs-volume-grpc-41002.sock", listening=False, age_s=3600)
    young = bound("seaweedfs-filer-grpc-41003.sock", listening=False, age_s=1)  # binding now
    dead.close()  # a killed server's: the file stays, nobody listens
    (tmp_path / "seaweedfs-s3-grpc-41004.sock").touch()  # not a socket: not ours to judge
    try:
        removed = lifeline.remove_dead_seaweed_sockets([str(tmp_path)])
        assert [p.name for p in removed] == ["seaweedfs-volume-grpc-41002.sock"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "seaweedfs-filer-grpc-41003.sock", "seaweedfs-master-grpc-41001.sock",
            "seaweedfs-s3-grpc-41004.sock"]
    finally:
        live.close()
        young.close()


def test_a_payload_unpickles_as_itself_after_the_death_signal(monkeypatch):
    """torch's process checkpointer pickles its init info into the daemon
    (compat.start_checkpoint_daemon): the daemon sets its death signal before it gets it."""
    calls = []
    monkeypatch.setattr(lifeline, "die_with_parent", lambda signum: calls.append(signum))
    info = types.SimpleNamespace(global_rank=1, world_size=2)
    restored = pickle.loads(pickle.dumps(lifeline.DiesWithParent(info)))
    assert calls == [signal.SIGKILL]
    assert type(restored) is types.SimpleNamespace and restored.global_rank == 1
