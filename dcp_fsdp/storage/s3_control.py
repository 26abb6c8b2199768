"""The S3 store's control plane, through boto3: fast pre-flight failures with one clear
line, listing checkpoints, and the small objects we add (manifest, checksums).

boto3 is used here (not the CRT client) because it fails in seconds with a typed
error, where the CRT client would retry a dead endpoint for tens of seconds.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from dcp_fsdp.errors import UserError
from dcp_fsdp.storage.layout import CEILING_ROOT, METADATA_NAME, CheckpointInfo

if TYPE_CHECKING:
    from dcp_fsdp.storage.s3 import S3Target


class S3ControlPlane:
    def __init__(self, target: "S3Target", connect_timeout_s: float) -> None:
        self.target = target
        self.connect_timeout_s = connect_timeout_s
        self._boto_client = None

    def client(self):
        if self._boto_client is None:
            import boto3
            import botocore.config

            self._boto_client = boto3.client(
                "s3", region_name=self.target.region, endpoint_url=self.target.endpoint,
                config=botocore.config.Config(
                    connect_timeout=self.connect_timeout_s, read_timeout=30,
                    retries={"mode": "standard", "total_max_attempts": 2},
                    s3={"addressing_style": "path" if self.target.force_path_style else "auto"},
                ),
            )
        return self._boto_client

    def _explain(self, error: BaseException) -> UserError:
        """One line for a boto3 failure against this bucket."""
        import botocore.exceptions as bx

        where = f"storage.uri={self.target.uri}"
        if isinstance(error, bx.NoCredentialsError):
            return UserError(f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use an instance role")
        if isinstance(error, (bx.EndpointConnectionError, bx.ConnectTimeoutError,
                              bx.ReadTimeoutError)):
            target = self.target.endpoint or f"AWS S3 in {self.target.region}"
            return UserError(f"storage.endpoint={target}: cannot connect ({type(error).__name__}); "
                             "check the address and that the server is up")
        if isinstance(error, bx.ClientError):
            response = error.response
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            if code in ("404", "NoSuchBucket"):
                return UserError(f"{where}: bucket '{self.target.bucket}' does not exist; create it or "
                                 "fix the bucket name")
            if status == 301 or code in ("301", "PermanentRedirect", "AuthorizationHeaderMalformed"):
                actual = headers.get("x-amz-bucket-region", "another region")
                return UserError(f"storage.region={self.target.region}: bucket '{self.target.bucket}' is in "
                                 f"{actual}; set storage.region={actual}")
            # A HEAD answer has no body: its "code" is just the status again.
            answer = f"HTTP {status}" if code in ("", str(status)) else f"HTTP {status} {code}"
            if code in ("403", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId",
                        "InvalidToken", "ExpiredToken"):
                return UserError(f"{where}: S3 refused the credentials ({answer}); "
                                 "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE "
                                 "and the bucket policy")
            return UserError(f"{where}: S3 answered {answer}")
        if isinstance(error, bx.BotoCoreError):
            return UserError(f"{where}: {type(error).__name__}: {error}")
        raise error

    def preflight(self) -> None:
        """Fail in seconds (not after the CRT's retries) on bad bucket, keys or endpoint."""
        import botocore.exceptions as bx

        client = self.client()
        # The CRT client signs for storage.region and would fail every request (after its
        # retries) in another region. boto3 follows a 301 to the bucket's region by itself
        # (and an S3-compatible server may then accept it), so a redirect seen on the way
        # is a mismatch on any endpoint.
        redirects: list[str | None] = []

        def on_response(response_dict=None, **_):
            if response_dict and response_dict.get("status_code") == 301:
                redirects.append(response_dict.get("headers", {}).get("x-amz-bucket-region"))

        client.meta.events.register("response-received.s3.HeadBucket", on_response)
        try:
            response = client.head_bucket(Bucket=self.target.bucket)
        except (bx.BotoCoreError, bx.ClientError) as error:
            raise self._explain(error) from None
        bucket_region = redirects[0] if redirects else None
        if not redirects and (self.target.endpoint is None or "amazonaws.com" in self.target.endpoint):
            # AWS names the bucket's region; S3-compatible servers often report a nominal
            # one that does not matter, so only AWS endpoints are checked without a redirect.
            bucket_region = response.get("BucketRegion") or response.get(
                "ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
        if bucket_region and bucket_region != self.target.region:
            raise UserError(f"storage.region={self.target.region}: bucket '{self.target.bucket}' is in "
                            f"{bucket_region}; set storage.region={bucket_region}")
        if redirects and bucket_region is None:
            raise UserError(f"storage.region={self.target.region}: bucket '{self.target.bucket}' is in "
                            "another region; set storage.region to the bucket's region")

    def list_checkpoints(self) -> list[CheckpointInfo]:
        import botocore.exceptions as bx

        client = self.client()
        base = f"{self.target.prefix}/" if self.target.prefix else ""
        found: dict[str, dict[str, Any]] = {}
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.target.bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    rest = obj["Key"][len(base):]
                    if "/" not in rest:
                        continue
                    suffix, name = rest.split("/", 1)
                    if suffix == CEILING_ROOT:  # the raw ceiling's, never a checkpoint
                        continue
                    entry = found.setdefault(suffix, {"size": 0, "count": 0, "modified": None,
                                                      "complete": False})
                    entry["size"] += obj["Size"]
                    entry["count"] += 1
                    modified = obj["LastModified"]
                    if entry["modified"] is None or modified > entry["modified"]:
                        entry["modified"] = modified
                    if name == METADATA_NAME:
                        entry["complete"] = True
        except (bx.BotoCoreError, bx.ClientError) as error:
            raise self._explain(error) from None
        return [CheckpointInfo(suffix, e["complete"], e["size"], e["count"],
                               e["modified"].astimezone(datetime.timezone.utc).isoformat())
                for suffix, e in sorted(found.items())]

    def has_objects(self, suffix: str) -> bool:
        response = self.client().list_objects_v2(
            Bucket=self.target.bucket, Prefix=self.target.key(suffix) + "/", MaxKeys=1)
        return response.get("KeyCount", 0) > 0

    def is_complete(self, suffix: str) -> bool:
        import botocore.exceptions as bx

        try:
            self.client().head_object(Bucket=self.target.bucket, Key=self.target.key(suffix, METADATA_NAME))
            return True
        except bx.ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._explain(error) from None

    def put_small(self, suffix: str, name: str, data: bytes) -> None:
        self.client().put_object(Bucket=self.target.bucket, Key=self.target.key(suffix, name), Body=data)

    def get_small(self, suffix: str, name: str) -> bytes | None:
        import botocore.exceptions as bx

        try:
            response = self.client().get_object(Bucket=self.target.bucket,
                                                     Key=self.target.key(suffix, name))
            return response["Body"].read()
        except bx.ClientError:
            return None

    def delete_checkpoint(self, suffix: str) -> None:
        """Every object under the suffix, 1,000 keys per request (the S3 limit)."""
        client = self.client()
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=self.target.bucket, Prefix=self.target.key(suffix) + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.target.bucket, Delete={"Objects": keys})
