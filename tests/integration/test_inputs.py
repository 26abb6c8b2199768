"""What a new user's trial broke (issue 17): credential chains, endpoints that are not S3,
paths, checkpoint compatibility before any rank starts, messages. Each is one line naming
the setting or variable and the fix, non-zero exit, in seconds, with no rank started."""

from __future__ import annotations

import http.server
import threading

import pytest

from tests.integration.test_bad_input import assert_refused
from tests.kit.cli import read_run, run_cli, s3_args, s3_env


def assert_before_ranks(result, results_dir):
    """Refused by the light parent: no rank printed its run line, no record."""
    assert " world_size=" not in result.stdout, result.stdout
    assert not list(results_dir.glob("*.jsonl")) if results_dir.exists() else True


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 404
    server: http.server.ThreadingHTTPServer  # what http_server() serves it with

    def _answer(self):
        self.send_response(self.status)
        if self.status == 301:  # a redirect to itself, as a misconfigured proxy would
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}{self.path}")
        body = b"<html>not here</html>"
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def not_s3():
    """{301: url, 404: url}: plain HTTP servers on 127.0.0.1 that are not S3."""
    servers = {}
    for status in (301, 404):
        handler = type(f"Answer{status}", (_Answer,), {"status": status})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[status] = server
    yield {status: f"http://127.0.0.1:{server.server_port}" for status, server in servers.items()}
    for server in servers.values():
        server.shutdown()
        server.server_close()


# -- item 3: the AWS credential chain ---------------------------------------------------------

def test_credential_chain_problems_are_one_line(s3, s3_uri, tmp_path):
    half = tmp_path / "credentials"
    half.write_text("[default]\naws_access_key_id = AKIAHALF\n")
    broken = tmp_path / "config"
    broken.write_text("this is = not [ini\n[[[\n")
    nothing = str(tmp_path / "none")
    cases = [
        ({**s3_env(s3), "AWS_PROFILE": "nosuch"}, ["AWS_PROFILE=nosuch", "unset AWS_PROFILE"]),
        ({"AWS_SHARED_CREDENTIALS_FILE": str(half), "AWS_CONFIG_FILE": nothing},
         [str(half), "incomplete", "aws_secret_access_key"]),
        ({**s3_env(s3), "AWS_CONFIG_FILE": str(broken)},
         [f"AWS_CONFIG_FILE={broken}", "cannot parse"]),
    ]
    for env, fragments in cases:
        results = tmp_path / "results"
        result = run_cli(["save", *s3_args(s3, s3_uri), "nproc=2", f"results_dir={results}"],
                         env=env)
        assert_refused(result, *fragments)
        assert_before_ranks(result, results)


# -- item 4: an endpoint that is not S3 ---------------------------------------------------------

def test_an_endpoint_that_is_not_s3(not_s3, tmp_path):
    env = {"AWS_ACCESS_KEY_ID": "AKIATEST", "AWS_SECRET_ACCESS_KEY": "secret"}
    https = not_s3[404].replace("http://", "https://")
    cases = [
        (["list", "storage.uri=s3://bench/x", f"storage.endpoint={not_s3[301]}"],
         [f"storage.endpoint={not_s3[301]}", "not an S3 server"], {}),
        (["save", "storage.uri=s3://bench/x", f"storage.endpoint={not_s3[404]}"],
         [f"storage.endpoint={not_s3[404]}", "not an S3 server"], {}),
        (["save", "storage.uri=s3://bench/x"], [f"AWS_ENDPOINT_URL={not_s3[404]}", "not an S3"],
         {"AWS_ENDPOINT_URL": not_s3[404]}),
        (["save", "storage.uri=s3://bench/x", f"storage.endpoint={https}"],
         [f"storage.endpoint={https}", "TLS", f"storage.endpoint={not_s3[404]}"], {}),
    ]
    for args, fragments, extra in cases:
        results = tmp_path / "results"
        result = run_cli([*args, f"results_dir={results}"], env={**env, **extra})
        assert_refused(result, *fragments)
        assert "does not exist" not in result.stderr
        assert_before_ranks(result, results)


# -- item 5: list and tune with AWS_ENDPOINT_URL and no storage.uri -------------------------------

def test_list_and_tune_with_an_endpoint_variable_and_no_uri(s3, tmp_path):
    env = {**s3_env(s3), "AWS_ENDPOINT_URL": s3.endpoint_url}
    for args in (["list"], ["tune", "tune.budget_s=30", f"results_dir={tmp_path}"]):
        result = run_cli(args, env=env)
        assert_refused(result, "storage.uri is not set", "AWS_ENDPOINT_URL")


# -- items 6 and 12: paths ---------------------------------------------------------------------

def test_a_mistyped_storage_path_is_not_created(tmp_path):
    typo = tmp_path / "chekpoints"
    for args in (["list"], ["load", "suffix=x", f"results_dir={tmp_path / 'r'}"]):
        result = run_cli([*args, "storage=fs", f"storage.path={typo}"])
        assert_refused(result, f"storage.path={typo}", "no such directory")
        assert not typo.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for command in ("save", "list"):
        result = run_cli([command, "storage=fs", f"storage.path={a_file}",
                          f"results_dir={tmp_path / 'r'}"])
        assert_refused(result, f"storage.path={a_file}", "is a file, not a directory")


# -- item 12: messages that misled -------------------------------------------------------------

def test_messages_that_misled(tmp_path):
    for value in ("/tmp/données", "~/ckpt", "/tmp/run(1)"):
        result = run_cli(["save", "storage=fs", f"storage.path={value}"])
        assert_refused(result, "storage.path", "quoted", f"storage.path='{value}'")
    result = run_cli(["save", "storage=fs", f"storage.path={tmp_path}", "suffix=.."])
    assert_refused(result, "suffix=..", "start with an ASCII letter or digit")
    result = run_cli(["save", "model=L7B"])
    assert_refused(result, "model=L7B", "did you mean L7b?")


# -- items 8 and 9: checkpoint compatibility, before any rank ------------------------------------

@pytest.fixture(scope="module")
def fs_checkpoints(tmp_path_factory):
    """A model-and-optimizer checkpoint and a model-only one without its manifest (fs)."""
    root = tmp_path_factory.mktemp("ckpts")
    results = tmp_path_factory.mktemp("saves")
    for suffix, state in (("full", "model_and_optimizer"), ("bare", "model")):
        result = run_cli(["save", "storage=fs", f"storage.path={root}", f"suffix={suffix}",
                          f"state={state}", f"results_dir={results}"])
        assert result.returncode == 0, result.stderr
    (root / "bare" / "dcp_fsdp.json").unlink()  # as a checkpoint written by another tool
    return root


def test_incompatible_loads_are_refused_before_any_rank(fs_checkpoints, tmp_path):
    fs = ["storage=fs", f"storage.path={fs_checkpoints}"]
    cases = [
        (["suffix=full", "model=tiny_gpt2", "state=model_and_optimizer"],
         ["suffix=full", "model=tiny_llama", "not model=tiny_gpt2"]),
        (["suffix=full", "model.dtype=bf16"], ["model.dtype=fp32", "not model.dtype=bf16"]),
        # no manifest: the dtype and state come from DCP's .metadata
        (["suffix=bare", "model.dtype=bf16"], ["model.dtype=fp32"]),
        (["suffix=bare", "state=model_and_optimizer"], ["state=model"]),
    ]
    for args, fragments in cases:
        results = tmp_path / "results"
        result = run_cli(["load", *fs, *args, f"results_dir={results}"])
        assert_refused(result, *fragments, within_s=10)
        assert_before_ranks(result, results)


def test_saving_to_an_existing_suffix_or_a_too_long_one_fails_up_front(fs_checkpoints,
                                                                      tmp_path):
    fs = ["storage=fs", f"storage.path={fs_checkpoints}"]
    for args, fragments in ((["suffix=full"], ["suffix=full", "already exists"]),
                            (["suffix=" + "a" * 256], ["255"]),
                            (["suffix=" + "a" * 254, "iterations=10"], ["255"])):
        results = tmp_path / "results"
        result = run_cli(["save", *fs, *args, f"results_dir={results}"])
        assert_refused(result, *fragments, within_s=10)
        assert_before_ranks(result, results)


def test_a_model_only_load_of_a_full_checkpoint_says_so(fs_checkpoints, tmp_path):
    result = run_cli(["load", "storage=fs", f"storage.path={fs_checkpoints}", "suffix=full",
                      f"results_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "model state only" in line)
    run, samples = read_run(tmp_path)
    loaded_mib = sum(s["bytes"] for s in samples if s["op"] == "load") / 2**20
    # "model state only: 28.1 of 84.2 MiB": the first figure is what the load moved
    shown = line.split("model state only: ")[1].split(" MiB")[0]
    part, whole = (float(x) for x in shown.split(" of "))
    assert abs(part - loaded_mib) < 0.1, (line, loaded_mib)
    assert whole > 2.5 * part  # model + AdamW's two moments


# -- item 12: the embedded server's checkpoint is gone at exit ----------------------------------

def test_a_save_on_the_embedded_server_says_its_checkpoint_is_deleted(tmp_path):
    result = run_cli(["save", f"results_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    assert "SUFFIXES=" not in result.stdout
    run, _ = read_run(tmp_path)
    assert f"checkpoint {run['suffixes'][0]} was deleted" in result.stdout
    assert "dcp-fsdp s3-server start" in result.stdout
