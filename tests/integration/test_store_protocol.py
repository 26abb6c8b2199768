"""The store protocol's control methods the tuner and the raw ceiling use (storage/base.py:
delete, probe, data_object_prefix), on the real SeaweedFS and on a directory. The raw
area's PUT/GET with the connector's client runs in ranks: tests/integration/test_ceiling.py."""

from __future__ import annotations

import boto3
import botocore.config
import pytest

from dcp_fsdp.config.schema import PrefixStrategy, StorageConfig, StorageKind
from dcp_fsdp.errors import UserError
from dcp_fsdp.storage import make_store
from dcp_fsdp.storage.base import CheckpointStore


def _keys(s3, uri: str) -> list[str]:
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1",
                          aws_access_key_id=s3.access_key_id,
                          aws_secret_access_key=s3.secret_access_key,
                          config=botocore.config.Config(s3={"addressing_style": "path"}))
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + ".")  # beside it too
    listed_in = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix):] for page in (listed, listed_in)
                  for o in page.get("Contents", []))


def test_s3_store_deletes_a_checkpoint_and_probes_without_a_trace(s3, s3_uri, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_access_key)
    store = make_store(StorageConfig(kind=StorageKind.s3, uri=s3_uri, endpoint=s3.endpoint_url))
    assert isinstance(store, CheckpointStore)
    for name in ("__0_0.distcp", "sub/__1_0.distcp", ".metadata"):
        store.put_small("gone", name, b"x" * 10)
    store.put_small("kept", ".metadata", b"y")
    store.delete("gone")
    store.delete("never-was")  # nothing to remove: no error
    for bad in ("", "../kept"):  # never the whole prefix, never outside it
        with pytest.raises(UserError):
            store.delete(bad)
    store.probe()
    assert _keys(s3, s3_uri) == ["/kept/.metadata"]
    assert not store.has_objects("gone") and store.is_complete("kept")
    assert store.data_object_prefix(3).endswith("__3_")


def test_s3_prefix_strategy_names_the_ranks_folders(s3, s3_uri):
    store = make_store(StorageConfig(kind=StorageKind.s3, uri=s3_uri, endpoint=s3.endpoint_url,
                                     prefix_strategy=PrefixStrategy.binary, prefix_count=4))
    prefixes = {store.data_object_prefix(rank) for rank in range(4)}
    assert len(prefixes) == 4 and all("/" in p for p in prefixes)


def test_fs_store_deletes_a_checkpoint_and_probes_without_a_trace(tmp_path):
    store = make_store(StorageConfig(kind=StorageKind.fs, path=str(tmp_path / "ckpt")))
    assert isinstance(store, CheckpointStore)
    store.put_small("gone", "sub/__0_0.distcp", b"x")
    store.put_small("kept", ".metadata", b"y")
    store.delete("gone")
    store.delete("never-was")
    for bad in ("", "../ckpt"):
        with pytest.raises(UserError):
            store.delete(bad)
    store.probe()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "ckpt", "ckpt/kept", "ckpt/kept/.metadata"]
    assert store.data_object_prefix(3) == "__3_"


def test_only_a_404_reads_as_absent(s3, s3_uri, monkeypatch):
    """A manifest GET refused or failing on the server is an error, never "no manifest":
    a load must not run unverified because S3 answered 503 (or 403)."""
    from tests.kit.fault_proxy import FaultProxy

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_access_key)
    direct = make_store(StorageConfig(kind=StorageKind.s3, uri=s3_uri, endpoint=s3.endpoint_url))
    direct.put_small("ck", "dcp_fsdp.json", b'{"model": "tiny_llama"}')
    with FaultProxy(s3.endpoint_url, error_503_rate=1.0, targets=("GetObject",),
                    key_pattern=r"/dcp_fsdp\.json$") as proxy:
        store = make_store(StorageConfig(kind=StorageKind.s3, uri=s3_uri, endpoint=proxy.url))
        assert store.get_small("ck", "missing.json") is None  # a 404: absent
        with pytest.raises(UserError, match=r"dcp_fsdp\.json: GET answered HTTP 503"):
            store.get_small("ck", "dcp_fsdp.json")
    assert direct.get_small("ck", "dcp_fsdp.json") == b'{"model": "tiny_llama"}'
