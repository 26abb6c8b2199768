"""Replicated loads (model.replicas=2 on 4 ranks, HSDP) on a real SeaweedFS with real
torchrun ranks: the save writes each shard once; a load where every replica reads fetches
the checkpoint twice; read_once fetches it once and broadcasts; every load is verified bit
for bit.

Two runs of 4 ranks (one save-and-load per variant), about 25 s each on a 2-core machine.
The 1x reference is the checkpoint's stored data objects, listed from the server: what a
plain 4-rank load fetches from a checkpoint of its own layout (measured: 1.016x of them,
docs/metrics.md "Replicated loads"). A third run for it would cost another 25-30 s; and a
plain 4-rank load of *this* checkpoint is no reference: it reshards 2 shards to 4 and reads
each stored item whole for half of it (2x, like tests/integration/test_reshard.py).
"""

from __future__ import annotations

import pytest

from tests.kit.cli import read_run, run_cli, s3_args, s3_env, s3_client


def _run(s3, uri, results_dir, *args):
    result = run_cli([*args, *s3_args(s3, uri), "nproc=4", f"results_dir={results_dir}"],
                     env=s3_env(s3))
    assert result.returncode == 0, result.stdout + result.stderr
    run, samples = read_run(results_dir)
    assert run["status"] == "ok" and run["world_size"] == 4
    return result, run, samples


def _op(samples, op):
    return sorted((s for s in samples if s["op"] == op), key=lambda s: s["rank"])


def _egress(loads) -> int:
    return sum(s["fetched_bytes"] for s in loads)


def _requests(loads) -> int:
    return sum(s["requests"]["count"] for s in loads)


def _stored_data_bytes(s3, uri: str, suffix: str) -> int:
    client = s3_client(s3)
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{suffix}/")["Contents"]
    return sum(obj["Size"] for obj in listed if obj["Key"].endswith(".distcp"))


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    """The every_replica and the read_once save-and-load, each its own checkpoint (the
    same layout: the values and the plans are deterministic)."""
    s3 = s3_server.endpoint
    uri = f"s3://{s3.bucket}/replicas"
    root = tmp_path_factory.mktemp("replicas")
    every = _run(s3, uri, root / "every", "save-and-load", "model.replicas=2", "ceiling=true")
    once = _run(s3, uri, root / "once", "save-and-load", "model.replicas=2",
                "model.replica_load=read_once", "ceiling=true")
    stored = {name: _stored_data_bytes(s3, uri, run["suffixes"][0])
              for name, (_, run, _) in (("every", every), ("once", once))}
    return {"every": every, "once": once, "stored": stored}


def test_a_replicated_save_writes_each_shard_once(runs):
    for name in ("every", "once"):
        _, run, samples = runs[name]
        saves = _op(samples, "save")
        assert [s["replica"] for s in saves] == [0, 0, 1, 1]
        state_bytes = run["model"]["state_bytes"]
        # each rank counts its replica's share: the sum is the checkpoint, not 2x
        assert sum(s["bytes"] for s in saves) == state_bytes
        stored = runs["stored"][name]
        assert sum(s["written_bytes"] for s in saves) == stored
        assert state_bytes <= stored < 1.01 * state_bytes  # DCP's framing only: not 2x
        assert sum(s["requests"]["bytes_up"] for s in saves) >= stored
    assert runs["stored"]["every"] == runs["stored"]["once"]


def test_every_replica_reads_the_checkpoint_twice_and_read_once_reads_it_once(runs):
    every_loads = _op(runs["every"][2], "load")
    once_loads = _op(runs["once"][2], "load")
    stored = runs["stored"]["every"]
    # replica 0 alone reads what a plain load of this layout reads: the checkpoint, once
    assert 0.98 < _egress(every_loads[:2]) / stored < 1.05
    assert 1.9 < _egress(every_loads) / stored < 2.1
    assert 0.95 < _egress(once_loads) / stored < 1.05
    # replica 1 of read_once asked storage for nothing; replica 0 asked what every
    # replica asks in every_replica (the same checkpoint layout)
    assert [s["fetched_bytes"] for s in once_loads[2:]] == [0, 0]
    assert [s["requests"]["count"] for s in once_loads[2:]] == [0, 0]
    assert _requests(once_loads) > 0
    assert _requests(every_loads) == 2 * _requests(once_loads)
    assert _egress(every_loads) == 2 * _egress(once_loads)
    # the broadcast is inside the timed load
    for sample in once_loads:
        assert 0 < sample["broadcast_s"] <= sample["duration_s"]
    assert all(s["broadcast_s"] is None for s in every_loads)
    # the end-of-run table: egress on the load's line, and the 2x said on it
    for name, loads, note in (("every", every_loads, True), ("once", once_loads, False)):
        out = runs[name][0].stdout
        header = next(line for line in out.splitlines() if line.startswith("| op "))
        assert [cell.strip() for cell in header.split("|")][4:6] == ["MiB", "egress MiB"]
        (line,) = [line for line in out.splitlines() if line.startswith("| load ")]
        assert f" {_egress(loads) / 2**20:.1f} " in line
        assert ("reads 2.0" in line) == note
    assert "as 2 replicas (loads: read_once)" in runs["once"][0].stdout


def test_the_raw_ceiling_moves_what_the_replicated_save_and_load_move(runs):
    """raw_put writes the checkpoint once (as the deduplicated save); raw_get reads it as the
    load does: twice with every replica reading, once with read_once. Both count the
    checkpoint's bytes once, as the DCP rows do, so efficiency compares like with like."""
    stored = runs["stored"]["every"]
    for name, reads in (("every", 2), ("once", 1)):
        samples = runs[name][2]
        puts, gets = _op(samples, "raw_put"), _op(samples, "raw_get")
        assert sum(s["bytes"] for s in puts) == stored
        assert sum(s["bytes"] for s in gets) == stored
        assert _egress(gets) == reads * stored
        # the load fetched a little more: the reader's ranges overlap (see the test above)
        assert _egress(gets) == pytest.approx(_egress(_op(samples, "load")), rel=0.02)
    assert [s["fetched_bytes"] for s in _op(runs["once"][2], "raw_get")][2:] == [0, 0]


def test_every_load_is_verified_bit_for_bit(runs):
    for name in ("every", "once"):
        run = runs[name][1]
        assert run["integrity"] == {run["suffixes"][0]: {"checked": True, "reason": None}}
