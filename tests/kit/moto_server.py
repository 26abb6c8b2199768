"""moto's S3 in server mode, in this process, as a second S3 implementation for tests.

SeaweedFS is what every other integration test runs against; S3-compatible servers differ
(error bodies, HEAD status codes, CopyObject, multipart limits, checksums), so the same
product paths also run against moto (tests/integration/test_moto.py).

`ThreadedMotoServer` serves moto's in-memory backends over real HTTP on 127.0.0.1, so the
ranks (other processes, CRT client and boto3) talk to it exactly as to any endpoint. It is
slow and holds every object in this process's memory: keep checkpoints small (tiny models).
By default moto accepts any credentials; here its IAM authentication is switched on (moto's
`/moto-api/reset-auth`) after an IAM user with an s3:* policy and a fresh access key are
created, so SigV4 signatures are checked (wrong keys get 403) as on SeaweedFS and AWS.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

from dcp_fsdp.launch.embedded_s3 import LOOPBACK, S3Endpoint, free_ports


class MotoS3:
    """`start()` -> S3Endpoint with `bucket` created; `stop()` shuts the server down."""

    def __init__(self, bucket: str = "bench", region: str = "us-east-1") -> None:
        self.bucket = bucket
        self.region = region
        self._server: Any = None  # moto's ThreadedMotoServer, once started
        self._url = ""
        self.endpoint: S3Endpoint | None = None

    def start(self) -> S3Endpoint:
        import boto3
        from moto.server import ThreadedMotoServer

        # werkzeug logs every request to stderr; test output needs only failures.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        port = free_ports(1)[0]
        url = self._url = f"http://{LOOPBACK}:{port}"
        server = self._server = ThreadedMotoServer(ip_address=LOOPBACK, port=port, verbose=False)
        server.start()
        # Before auth is on, any keys may create the user that all later requests must sign as.
        iam = boto3.client("iam", endpoint_url=url, region_name=self.region,
                           aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
        iam.create_user(UserName="bench")
        iam.put_user_policy(UserName="bench", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="bench")["AccessKey"]
        self._set_auth_after("0")
        self.endpoint = S3Endpoint(endpoint_url=url, bucket=self.bucket,
                                   access_key_id=key["AccessKeyId"],
                                   secret_access_key=key["SecretAccessKey"], region=self.region)
        client = boto3.client("s3", endpoint_url=url, region_name=self.region,
                              aws_access_key_id=self.endpoint.access_key_id,
                              aws_secret_access_key=self.endpoint.secret_access_key)
        client.create_bucket(Bucket=self.bucket)
        return self.endpoint

    def _set_auth_after(self, count: str) -> None:
        """IAM auth from the `count`-th request on ("inf": never; moto's default)."""
        request = urllib.request.Request(f"{self._url}/moto-api/reset-auth",
                                         data=count.encode(), method="POST",
                                         headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def stop(self) -> None:
        if self._server is not None:
            # The auth switch is a global of the moto package in this process: put it back.
            self._set_auth_after("inf")
            self._server.stop()
            self._server = None

    def __enter__(self) -> S3Endpoint:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()
