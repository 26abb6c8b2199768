"""moto's S3 in server mode, in this process, as a second S3 implementation for tests.

SeaweedFS is what every other integration test runs against; S3-compatible servers differ
(error bodies, HEAD status codes, CopyObject, multipart limits, checksums), so the same
product paths also run against moto (tests/integration/test_moto.py).

`ThreadedMotoServer` serves moto's in-memory backends over real HTTP on 127.0.0.1, so the
ranks (other processes, CRT client and boto3) talk to it exactly as to any endpoint. It is
slow and holds every object in this process's memory: keep checkpoints small (tiny models).
moto accepts any credentials (it does not check SigV4 unless IAM auth is switched on for the
whole process); fresh random keys are still generated so nothing reuses real ones.
"""

from __future__ import annotations

import secrets

from dcp_fsdp.launch.embedded_s3 import LOOPBACK, S3Endpoint, free_ports


class MotoS3:
    """`start()` -> S3Endpoint with `bucket` created; `stop()` shuts the server down."""

    def __init__(self, bucket: str = "bench", region: str = "us-east-1") -> None:
        self.bucket = bucket
        self.region = region
        self._server = None
        self.endpoint: S3Endpoint | None = None

    def start(self) -> S3Endpoint:
        import boto3
        from moto.server import ThreadedMotoServer

        port = free_ports(1)[0]
        self._server = ThreadedMotoServer(ip_address=LOOPBACK, port=port, verbose=False)
        self._server.start()
        self.endpoint = S3Endpoint(
            endpoint_url=f"http://{LOOPBACK}:{port}", bucket=self.bucket,
            access_key_id="AKID" + secrets.token_hex(8).upper(),
            secret_access_key=secrets.token_urlsafe(30), region=self.region)
        client = boto3.client("s3", endpoint_url=self.endpoint.endpoint_url, region_name=self.region,
                              aws_access_key_id=self.endpoint.access_key_id,
                              aws_secret_access_key=self.endpoint.secret_access_key)
        client.create_bucket(Bucket=self.bucket)
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> S3Endpoint:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()
