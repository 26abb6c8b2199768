"""The S3 store's control plane, through boto3 (which fails in seconds with a typed error,
where the CRT client retries a dead endpoint for tens of seconds): pre-flight failures in one
line, listing checkpoints, and the small objects we add (manifest, claim)."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from dcp_fsdp import log
from dcp_fsdp.errors import UserError
from dcp_fsdp.storage.layout import (CEILING_ROOT, METADATA_NAME, CheckpointInfo, OpenUpload,
                                     checkpoint_info)
from dcp_fsdp.storage.s3_target import S3Target


# key -> observer of every control-plane client this process creates (observe_clients)
_client_observers: dict[str, Callable[[Any], None]] = {}


def observe_clients(key: str, observer: Callable[[Any], None]) -> None:
    """Call `observer(events)` with the botocore event emitter of each boto3 client this
    process's control planes create from now on (telemetry/control_plane.py hooks in there):
    observing imports no boto3. One observer per key: a later one replaces it."""
    _client_observers[key] = observer


def credential_chain_error(error: BaseException) -> UserError | None:
    """One line for a broken AWS credential chain (profile, shared files), naming the
    variable or file and the fix; None for other errors."""
    import botocore.exceptions as bx

    config_file = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    credentials_file = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    if isinstance(error, bx.ProfileNotFound):
        profile = error.kwargs.get("profile") or os.environ.get("AWS_PROFILE")
        keys = (" (AWS_ACCESS_KEY_ID is set, but a named profile is read first)"
                if os.environ.get("AWS_ACCESS_KEY_ID") else "")
        return UserError(f"AWS_PROFILE={profile}: no such profile in {config_file} or {credentials_file}"
                         f"{keys}; unset AWS_PROFILE or add the profile")
    if isinstance(error, bx.ConfigParseError):
        path = error.kwargs.get("path", "?")
        variable = next((name for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
                         if os.environ.get(name) and os.path.expanduser(os.environ[name]) == path),
                        None)
        named = f"{variable}={path}" if variable else f"AWS file {path}"
        return UserError(f"{named}: cannot parse it (not INI: '[profile]' then 'key = value' "
                         f"lines); fix the file" + (f" or unset {variable}" if variable else ""))
    if isinstance(error, bx.PartialCredentialsError):
        provider = error.kwargs.get("provider", "?")
        missing = error.kwargs.get("cred_var", "a key")
        source = {"shared-credentials-file": credentials_file, "config-file": config_file,
                  "env": "the environment"}.get(provider, provider)
        return UserError(f"AWS credentials in {source} are incomplete: {missing} is missing; "
                         "add it next to the key id, or set AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY")
    return None


class _NotS3(Exception):
    """Raised from a response hook: the endpoint's answers are not S3's."""


def _answer(error: Any) -> tuple[int | None, str]:
    """A botocore ClientError's HTTP status and S3 error code ("" where it names none)."""
    response = error.response
    return (response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            str(response.get("Error", {}).get("Code", "")))


class S3ControlPlane:
    def __init__(self, target: S3Target, connect_timeout_s: float,
                 answer_timeout_s: float | None = None) -> None:
        self.target = target
        self.connect_timeout_s = connect_timeout_s
        self.answer_timeout_s = answer_timeout_s  # after a failure: one attempt, this long
        self._boto_client = None
        self._honours_if_none_match: bool | None = None  # asked once, on the first claim

    def client(self) -> Any:
        """boto3's client, built once: botocore reads the credential chain then (UserError if broken)."""
        if self._boto_client is None:
            self._boto_client = self._built(self.answer_timeout_s or 30,
                                            1 if self.answer_timeout_s else 2)
        return self._boto_client

    def _built(self, read_timeout_s: float, attempts: int) -> Any:
        """A boto3 client (the observers told of it); UserError for a broken profile or file."""
        import boto3
        import botocore.config
        import botocore.exceptions as bx

        try:
            client = boto3.client(
                "s3", region_name=self.target.region, endpoint_url=self.target.endpoint,
                config=botocore.config.Config(
                    connect_timeout=self.connect_timeout_s, read_timeout=read_timeout_s,
                    retries={"mode": "standard", "total_max_attempts": attempts},
                    s3={"addressing_style": "path" if self.target.force_path_style else "auto"}))
        except bx.BotoCoreError as error:
            raise self._explain(error) from None  # (it tries credential_chain_error first)
        for observer in list(_client_observers.values()):
            observer(client.meta.events)
        return client

    @property
    def _endpoint(self) -> str:
        """The endpoint setting and its value, as an error line names them."""
        return f"{self.target.endpoint_source}={self.target.endpoint or f'AWS S3 in {self.target.region}'}"

    def _explain(self, error: BaseException) -> UserError:
        """One line for a boto3 failure against this bucket."""
        import botocore.exceptions as bx

        where = f"storage.uri={self.target.uri}"
        chain = credential_chain_error(error)
        if chain is not None:
            return chain
        if isinstance(error, bx.SSLError):
            endpoint = self.target.endpoint or "AWS S3"
            plain = (f"; if the server speaks plain HTTP, write "
                     f"{self.target.endpoint_source}=http://{endpoint.split('://', 1)[-1]}"
                     if endpoint.startswith("https://") else "")
            words = " ".join(str(error).split())
            words = words if len(words) <= 120 else words[:120] + "..."
            return UserError(f"{self.target.endpoint_source}={endpoint}: TLS handshake failed ({words}){plain}")
        if isinstance(error, bx.NoCredentialsError):
            return UserError(f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use an instance role")
        if isinstance(error, bx.ReadTimeoutError):  # connected: the server did not answer
            return UserError(f"{self._endpoint}: connected, but no answer "
                             f"within storage.connect_timeout_s={self.connect_timeout_s:g} s "
                             "(ReadTimeoutError, the pre-flight's bound on an answer): check that "
                             "it is an S3 server and that it is up (raise "
                             "storage.connect_timeout_s for a slow one)")
        if isinstance(error, bx.ConnectTimeoutError):
            return UserError(f"{self._endpoint}: cannot connect within "
                             f"storage.connect_timeout_s={self.connect_timeout_s:g} s "
                             "(ConnectTimeoutError); check the address and that the server is up")
        if isinstance(error, bx.EndpointConnectionError):
            errno_text = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(error.kwargs.get("error")))
            reason = f": {errno_text[1].strip().lower()}" if errno_text else ""  # refused, ...
            return UserError(f"{self._endpoint}: cannot connect "
                             f"({type(error).__name__}{reason}); check the address and that the "
                             "server is up")
        if isinstance(error, bx.ClientError):
            return self._explain_answer(error)
        if isinstance(error, bx.BotoCoreError):
            return UserError(f"{where}: {type(error).__name__}: {error}")
        raise error

    def _explain_answer(self, error: Any) -> UserError:
        """One line for an error answer of the server (botocore's ClientError)."""
        where = f"storage.uri={self.target.uri}"
        status, code = _answer(error)
        headers = error.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        if code == "404" and not self._is_s3_answer():
            return self._not_s3(f"HTTP {status} without an S3 error code")
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

    def _is_s3_answer(self) -> bool:
        """A HEAD 404 has no body: is it S3's 'no such bucket', or a server that is not S3?
        A GET of the bucket answers an S3 error code (NoSuchBucket) only from S3."""
        import botocore.exceptions as bx

        try:
            self.client().list_objects_v2(Bucket=self.target.bucket, MaxKeys=1)
            return True
        except bx.ClientError as error:
            code = _answer(error)[1]
            return bool(code) and not code.isdigit()  # S3 names its errors
        except (bx.BotoCoreError, RecursionError):
            return False

    def _not_s3(self, answer: str) -> UserError:
        return UserError(f"{self._endpoint}: answered {answer}: it is "
                         "not an S3 server; check the address and port (SeaweedFS's S3 "
                         "port, e.g. http://127.0.0.1:8333)")

    def preflight(self) -> None:
        """Fail in seconds (not after the CRT's retries) on bad bucket, keys or endpoint."""
        import botocore.exceptions as bx

        # One attempt, connect_timeout_s to connect and as long for the answer: a server that
        # accepts TCP and never answers is refused in that time, not after botocore's 2 x 30 s.
        client = self._built(self.connect_timeout_s, 1)
        # The CRT client signs for storage.region and fails every request in another region;
        # boto3 follows a 301 to the bucket's region by itself, so a redirect on the way is a
        # mismatch on any endpoint.
        redirects: list[str | None] = []

        def on_response(response_dict: dict[str, Any] | None = None, **_: Any) -> None:
            if response_dict and response_dict.get("status_code") == 301:
                region = response_dict.get("headers", {}).get("x-amz-bucket-region")
                if region is None and redirects:  # S3 names the region on a 301: not S3
                    raise _NotS3()  # (boto3 would follow it until RecursionError)
                redirects.append(region)

        client.meta.events.register("response-received.s3.HeadBucket", on_response)
        try:
            response = client.head_bucket(Bucket=self.target.bucket)
        except (_NotS3, RecursionError):
            raise self._not_s3("HTTP 301 redirects without an S3 bucket region") from None
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

    @contextlib.contextmanager
    def _explaining(self) -> Iterator[None]:
        """boto3 calls on the bucket; their failure as one line (UserError) naming the fix."""
        import botocore.exceptions as bx

        try:
            yield
        except (bx.BotoCoreError, bx.ClientError) as error:
            raise self._explain(error) from None

    def _listed(self, operation: str, key: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Every entry (`key`: "Contents", "Uploads", "Parts") of the bucket's listing `operation`."""
        with self._explaining():
            for page in self.client().get_paginator(operation).paginate(Bucket=self.target.bucket, **params):
                yield from page.get(key, [])

    def list_checkpoints(self, suffix: str | None = None) -> list[CheckpointInfo]:
        base = f"{self.target.prefix}/" if self.target.prefix else ""
        found: dict[str, dict[str, Any]] = {}
        for obj in self._listed("list_objects_v2", "Contents", Prefix=base + (f"{suffix}/" if suffix else "")):
            owner, slash, name = obj["Key"][len(base):].partition("/")
            if not slash or owner == CEILING_ROOT:  # (the raw ceiling's: never a checkpoint)
                continue
            entry = found.setdefault(owner, {"size": 0, "modified": obj["LastModified"], "names": []})
            entry["size"] += obj["Size"]
            entry["names"].append(name)  # relative to the suffix
            entry["modified"] = max(entry["modified"], obj["LastModified"])
        return [checkpoint_info(owner, e["names"], METADATA_NAME in e["names"], e["size"],
                                e["modified"].astimezone(datetime.timezone.utc).isoformat())
                for owner, e in sorted(found.items())]

    def object_sizes(self, suffix: str) -> dict[str, int]:
        base = self.target.key(suffix) + "/"
        return {obj["Key"][len(base):]: obj["Size"]
                for obj in self._listed("list_objects_v2", "Contents", Prefix=base)}

    def has_objects(self, suffix: str) -> bool:
        response = self.client().list_objects_v2(
            Bucket=self.target.bucket, Prefix=self.target.key(suffix) + "/", MaxKeys=1)
        return response.get("KeyCount", 0) > 0

    def is_complete(self, suffix: str) -> bool:
        import botocore.exceptions as bx

        try:
            self.client().head_object(Bucket=self.target.bucket, Key=self.target.key(suffix, METADATA_NAME))
            return True
        except (bx.BotoCoreError, bx.ClientError) as error:  # e.g. the endpoint gone
            if isinstance(error, bx.ClientError) and _answer(error)[1] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._explain(error) from None

    def put_small(self, suffix: str, name: str, data: bytes) -> None:
        self.client().put_object(Bucket=self.target.bucket, Key=self.target.key(suffix, name), Body=data)

    def get_small(self, suffix: str, name: str, max_bytes: int | None = None) -> bytes | None:
        import botocore.exceptions as bx

        key = self.target.key(suffix, name)
        try:
            response = self.client().get_object(Bucket=self.target.bucket, Key=key)
        except bx.ClientError as error:
            status, code = _answer(error)
            if status == 404 or code in ("NoSuchKey", "404"):
                return None  # only a missing object is absent
            # A refusal (403) or a server error (5xx) says nothing about whether it is
            # there: a manifest or .metadata read as absent would let a load run unchecked.
            raise UserError(f"s3://{self.target.bucket}/{key}: GET answered HTTP {status} "
                            f"{code}; it could not be read (not absent: only a 404 is): check "
                            "the credentials' read access and the server, then retry") from None
        with contextlib.closing(response["Body"]) as body:  # closed: the rest is not read
            return body.read(max_bytes)

    def put_key(self, key: str, data: bytes) -> None:
        with self._explaining():  # (client()'s own failure is a UserError already)
            self.client().put_object(Bucket=self.target.bucket, Key=key, Body=data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """PutObject with If-None-Match: *; False when the key exists (412) or another
        conditional write of it is in flight (409), as S3 answers."""
        import botocore.exceptions as bx

        try:
            return self._put_if_absent(key, data)
        except bx.ClientError as error:
            raise self._explain(error) from None

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """put_if_absent, any other answer raised as botocore's ClientError."""
        import botocore.exceptions as bx

        try:
            self.client().put_object(Bucket=self.target.bucket, Key=key, Body=data,
                                     IfNoneMatch="*")
            return True
        except bx.ClientError as error:
            status, code = _answer(error)
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise

    def honours_if_none_match(self) -> bool:
        """Does the server honour If-None-Match: * on PutObject? A key of its own is written
        twice with it: the second must be refused (412); a server that rejects the header (400,
        501) does not. Asked once per control plane; said in the log when not honoured."""
        import botocore.exceptions as bx

        if self._honours_if_none_match is None:
            key = self.target.key(f"_dcp_fsdp.claim-probe-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                honoured = self._put_if_absent(key, b"probe") and not self._put_if_absent(key, b"probe")
            except bx.ClientError as error:
                # any other refusal (403, a 5xx) says nothing about the header: it is the answer
                if _answer(error)[0] not in (400, 501):
                    raise self._explain(error) from None
                honoured = False
            finally:
                with contextlib.suppress(Exception):  # a probe left behind is harmless
                    self.delete_key(key)
            self._honours_if_none_match = honoured
            if not honoured:
                log.warning(f"{self.target.endpoint_source}={self.target.endpoint or 'AWS S3'} "
                            "does not honour If-None-Match: * (a second conditional PUT of one "
                            "key was not refused): a save claims its suffix by a check, then a "
                            "write, not atomically; two saves started at once with one suffix= "
                            "could both write it (recorded as suffix_claim=not_atomic)")
        return self._honours_if_none_match

    def delete_key(self, key: str) -> None:
        with self._explaining():
            self.client().delete_object(Bucket=self.target.bucket, Key=key)

    def delete_prefix(self, prefix: str) -> None:
        """Every object whose key begins with `prefix` (1000 per request, S3's limit)."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=self.target.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.target.bucket, Delete={"Objects": keys})

    def _abort(self, key: str, upload_id: str) -> int:
        """1 for an upload aborted now, 0 for one completed or aborted meanwhile."""
        import botocore.exceptions as bx

        try:
            self.client().abort_multipart_upload(Bucket=self.target.bucket, Key=key, UploadId=upload_id)
        except bx.ClientError as error:
            if _answer(error)[1] != "NoSuchUpload":
                raise
            return 0
        return 1

    def abort_uploads_under(self, key_prefix: str) -> int:
        """Abort the open multipart uploads under `key_prefix` (a raw area); how many."""
        with self._explaining():
            return sum(self._abort(upload["Key"], upload["UploadId"])
                       for upload in self._listed("list_multipart_uploads", "Uploads", Prefix=key_prefix))

    # -- multipart uploads a stopped save left open -----------------------------------------
    def open_uploads(self, suffix: str | None = None) -> list[OpenUpload]:
        base = f"{self.target.prefix}/" if self.target.prefix else ""
        found = []
        for upload in self._listed("list_multipart_uploads", "Uploads",
                                   Prefix=self.target.key(suffix) + "/" if suffix else base):
            parts = list(self._listed("list_parts", "Parts", Key=upload["Key"], UploadId=upload["UploadId"]))
            rest = upload["Key"][len(base):]
            found.append(OpenUpload(
                suffix=rest.split("/", 1)[0] if "/" in rest else "",
                key=upload["Key"], upload_id=upload["UploadId"],
                initiated=upload["Initiated"].astimezone(datetime.timezone.utc).isoformat(),
                part_count=len(parts), size_bytes=sum(p["Size"] for p in parts)))
        return found

    def abort_uploads(self, suffix: str | None = None, min_age_s: float = 0.0,
                      now: datetime.datetime | None = None) -> int:
        with self._explaining():  # one younger than min_age_s: maybe a save still writing it
            return sum(self._abort(upload.key, upload.upload_id) for upload in self.open_uploads(suffix)
                       if min_age_s <= 0 or upload.age_s(now) >= min_age_s)
