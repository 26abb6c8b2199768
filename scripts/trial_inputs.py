"""A new user's trial: >= 150 bad values, wrong environments and odd paths against the CLI.

Each bad case must exit non-zero with exactly one `dcp-fsdp: error:` line that names the
setting (a fragment per case), no traceback, within LIMIT_S, before any rank starts (no
rank's `run ...:` line, no record). Good cases must exit 0. Servers: one SeaweedFS
(embedded_s3, 127.0.0.1), plus tiny HTTP servers that are not S3 (301 loop, 404).

    .venv/bin/python scripts/trial_inputs.py [--markdown /tmp/trial.md] [-k FRAGMENT]

Prints one line per case and a summary; exits 1 if any case is wrong.
"""

from __future__ import annotations

import argparse
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dcp_fsdp.launch.embedded_s3 import EmbeddedS3  # noqa: E402

LIMIT_S = 10.0  # a refusal on this loaded 2-core machine; most take ~1 s
SCRUB = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
         "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
         "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
         "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 404
    server: http.server.ThreadingHTTPServer  # what http_server() serves it with

    def _answer(self):
        self.send_response(self.status)
        if self.status == 301:
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}{self.path}")
        body = b"<html>not here</html>"
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = _answer

    def log_message(self, *args):
        pass


def http_server(status: int) -> http.server.ThreadingHTTPServer:
    handler = type(f"Answer{status}", (_Answer,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(args, env_extra=None, cwd=REPO, timeout_s=300):
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    env.update(env_extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "dcp_fsdp", *args], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        code, out, err = None, str(expired.stdout or ""), str(expired.stderr or "")
    return code, out, err, time.monotonic() - started


def judge(case, code, out, err, seconds, results_dir):
    """(ok?, what was seen) for one case."""
    expect = case["expect"]
    if expect == "ok":
        if code == 0:
            return True, "exit 0"
        return False, f"exit {code}: {(err.strip().splitlines() or ['?'])[-1][:160]}"
    errors = [line for line in err.splitlines() if line.startswith("dcp-fsdp: error:")]
    problems = []
    if code in (0, None):
        problems.append(f"exit {code}")
    if len(errors) != 1:
        problems.append(f"{len(errors)} error lines")
    if "Traceback" in err or "Traceback" in out:
        problems.append("traceback")
    if seconds > case.get("limit_s", LIMIT_S):
        problems.append(f"took {seconds:.1f} s")
    if "] run " in out and " world_size=" in out:
        problems.append("a rank started")
    if results_dir is not None and any(Path(results_dir).glob("*.jsonl")):
        problems.append("a record was written")
    message = errors[0][len("dcp-fsdp: error: "):] if errors else (err.strip()[-160:] or "")
    for fragment in expect if isinstance(expect, (list, tuple)) else [expect]:
        if errors and fragment not in errors[0]:
            problems.append(f"no '{fragment}'")
    return not problems, ("; ".join(problems) + ": " if problems else "") + message


def cases(ctx):  # noqa: C901 - one long list of cases, on purpose
    s3, uri = ctx["s3"], ctx["uri"]
    keys = {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key}
    at = [f"storage.uri={uri}", f"storage.endpoint={s3.endpoint_url}"]
    tmp = ctx["tmp"]
    fs = ["storage=fs", f"storage.path={ctx['fs_root']}"]
    out = []

    def bad(name, args, expect, env=None, **extra):
        out.append({"name": name, "args": args, "expect": expect, "env": env or {}, **extra})

    def good(name, args, env=None, **extra):
        out.append({"name": name, "args": args, "expect": "ok", "env": env or {}, **extra})

    # -- commands and syntax ----------------------------------------------------------
    good("no command: the usage, exit 2", [], exit_code=2, says="usage: dcp-fsdp COMMAND")
    bad("unknown command sav", ["sav"], "did you mean save")
    bad("unknown command lod", ["lod"], "did you mean load")
    bad("unknown command s3server", ["s3server"], "s3-server")
    bad("dashed setting --nproc=2", ["save", "--nproc=2"], "nproc=VALUE")
    bad("dashed flag -x", ["save", "-x"], "'-x'")
    bad("tune with -m", ["tune", "-m", "nproc=1,2"], "-m")
    bad("sweep without -m", ["save", "iterations=1,2"], "-m")
    bad("sweep, bad last job", ["save", "-m", "iterations=1,abc"], "multirun job 2/2")
    bad("sweep, unparsable", ["save", "-m", "iterations=[1,"], "iterations")
    bad("--config missing file", ["save", "--config", str(tmp / "nosuch.yaml")], "--config")
    bad("--config without file", ["save", "--config"], "--config")
    bad("--config bad YAML", ["save", "--config", str(ctx["bad_yaml"])], "not valid YAML")
    bad("--config a list", ["save", "--config", str(ctx["list_yaml"])], "expected a mapping")
    bad("--config a directory", ["save", "--config", str(tmp)], "--config")
    bad("--config unknown key", ["save", "--config", str(ctx["typo_yaml"])], "iteratons")
    # -- unknown settings -------------------------------------------------------------
    for arg, fragment in [("iteratons=3", "iterations"), ("foo=1", "foo"), ("+foo=1", "foo"),
                          ("++foo=1", "foo"), ("storage.foo=1", "storage.foo"),
                          ("modle=L7b", "model"), ("+iterations=2", "without +"),
                          ("~model", "model"), ("model@pkg=L7b", "package"),
                          ("storage.partsize=8", "part_size_mib"), ("Nproc=2", "nproc")]:
        bad(f"unknown setting {arg}", ["save", arg], fragment)
    # -- Hydra's parser ---------------------------------------------------------------
    for arg in ["storage.path=/tmp/données", "storage.path=~/ckpt", "storage.path=/tmp/run(1)",
                "results_dir=a#b", "suffix=a'b", "results_dir=[unclosed",
                "storage.uri=s3://b/ä ö", "storage.path=/tmp/a&b", "results_dir=x=y"]:
        bad(f"unquoted {arg!r}", ["save", "storage=fs" if "path" in arg else "nproc=1", arg],
            ["quoted", arg.split("=", 1)[0]])
    # -- model, dtype, state ----------------------------------------------------------
    for value, fragment in [("L8b", "choose one of"), ("L7B", "did you mean L7b"),
                            ("l7b", "did you mean L7b"), ("tiny", "model=tiny"),
                            ("gpt4b", "did you mean GPT-4B"), ("", "model")]:
        bad(f"model={value}", ["save", f"model={value}"], fragment)
    for arg in ["model.dtype=fp16", "model.dtype=bf32", "model.dtype=", "state=optimizer",
                "state=full", "backend=mpi", "save_mode=sync2", "storage.reader=fast",
                "storage.prefix_strategy=random", "async_save.checkpointer=fork",
                "verify=maybe", "integrity=2", "progress=yes please"]:
        key = arg.split("=")[0]
        bad(arg, ["save", arg], key)
    # -- numbers ------------------------------------------------------------------------
    for arg in ["nproc=0", "nproc=-1", "nproc=two", "nproc=1.5", "nproc=100000", "nproc=",
                "iterations=0", "iterations=-3", "iterations=abc", "iterations=2000000",
                "seed=-1", "seed=x", "seed=99999999999", "delay_s=-1", "delay_s=nan",
                "delay_s=inf", "delay_s=abc", "delay_s=100000000", "op_timeout_s=0",
                "op_timeout_s=-5", "collective_timeout_s=0", "collective_timeout_s=1e12",
                "train_step_s=-1", "progress_interval_s=0", "storage.part_size_mib=1",
                "storage.part_size_mib=6000", "storage.part_size_mib=x",
                "storage.thread_count=0", "storage.thread_count=1000",
                "storage.max_attempts=0", "storage.max_attempts=1000",
                "storage.throughput_target_gbps=0", "storage.throughput_target_gbps=-1",
                "storage.connect_timeout_s=0", "storage.connect_timeout_s=1000",
                "storage.prefix_count=0"]:
        key = arg.split("=")[0]
        bad(arg, ["save", arg], key)
    bad("train_step_s without async", ["save", "train_step_s=1"], "save_mode=async")
    bad("prefix_count without binary/hex", ["save", "storage.prefix_count=4"], "prefix_count")
    bad("round_robin without prefixes", ["save", "storage.prefix_strategy=round_robin"],
        "round_robin_prefixes")
    bad("round_robin prefix with /", ["save", "storage.prefix_strategy=round_robin",
                                      "storage.round_robin_prefixes=[a/b]"], "a/b")
    bad("prefixes without round_robin", ["save", "storage.round_robin_prefixes=[a]"],
        "round_robin")
    bad("round_robin_prefixes not a list", ["save", "storage.round_robin_prefixes=a"],
        "round_robin_prefixes")
    bad("backend=nccl without CUDA", ["save", "backend=nccl"], "backend=nccl")
    # -- storage kind, URI, endpoint, region --------------------------------------------
    for arg, fragment in [("storage=gcs", "storage=gcs"), ("storage=", "storage"),
                          ("storage.kind=ftp", "storage.kind"),
                          ("storage.uri=my-bucket/ckpt", "s3://bucket/prefix"),
                          ("storage.uri=s3://", "storage.uri"),
                          ("storage.uri=s3://UPPER/x", "bucket name"),
                          ("storage.uri=s3://ab/x", "bucket name"),
                          ("storage.uri=s3://under_score/x", "bucket name"),
                          ("storage.uri=s3://1.2.3.4/x", "bucket name"),
                          ("storage.uri=s3://b..b/x", "bucket name"),
                          ("storage.uri=http://bucket/x", "s3://bucket/prefix"),
                          ("storage.endpoint=localhost:9000", "http(s)://host:port"),
                          ("storage.endpoint=ftp://x", "storage.endpoint"),
                          ("storage.region=us east", "storage.region"),
                          ("storage.region=", "storage.region"),
                          ("storage.endpoint=", "storage.endpoint")]:
        # an endpoint is checked with a bucket (without one, the missing uri is the error)
        given = [f"storage.uri={uri}", arg] if arg.startswith("storage.endpoint") else [arg]
        bad(arg, ["save", *given], fragment)
    bad("endpoint without uri", ["save", f"storage.endpoint={s3.endpoint_url}"], "storage.uri")
    bad("storage.path with s3", ["save", f"storage.path={tmp}"], "storage=fs")
    bad("storage=fs without path", ["save", "storage=fs"], "storage.path")
    bad("storage=fs with uri", ["save", "storage=fs", f"storage.path={tmp}", f"storage.uri={uri}"],
        "storage.uri")
    bad("storage=fs with part_size_mib", ["save", *fs, "storage.part_size_mib=8"],
        "storage.part_size_mib")
    bad("storage.path a file", ["save", "storage=fs", f"storage.path={ctx['a_file']}"],
        ["storage.path", "is a file"])
    bad("storage.path under a file", ["save", "storage=fs",
                                      f"storage.path={ctx['a_file']}/x"], "storage.path")
    bad("storage.path on /proc", ["save", "storage=fs", "storage.path=/proc/dcp-fsdp"],
        "storage.path")
    # -- suffixes ---------------------------------------------------------------------
    for value in ["..", ".", "-x", "a/b", "_x"]:
        bad(f"suffix={value}", ["save", *fs, f"suffix={value}"], ["suffix", "letter or digit"])
    bad("suffix=ü", ["save", *fs, "suffix=ü"], ["suffix", "quoted"])
    bad("suffix='ü' (quoted)", ["save", *fs, "suffix='ü'"], ["suffix", "letter or digit"])
    bad("suffix of 256 bytes (fs)", ["save", *fs, "suffix=" + "a" * 256], ["suffix", "255"])
    bad("suffix of 252 bytes, iterations=100 (fs): NAME-100 is 256", ["save", *fs, "suffix="
                                                                     + "a" * 252,
                                                                     "iterations=100"], "255")
    bad("suffix of 1000 bytes (s3)", ["save", *at, "suffix=" + "a" * 1000], ["suffix", "1024"],
        env=keys)
    bad("save suffix that exists (s3)", ["save", *at, f"suffix={ctx['s3_suffix']}", "nproc=2"],
        ["already exists"], env=keys)
    bad("save suffix that exists (fs)", ["save", *fs, f"suffix={ctx['fs_suffix']}"],
        "already exists")
    # -- results_dir --------------------------------------------------------------------
    bad("results_dir a file", ["save", *fs, f"results_dir={ctx['a_file']}"], "results_dir",
        no_results=True)
    bad("results_dir under a file", ["save", *fs, f"results_dir={ctx['a_file']}/r"],
        "results_dir", no_results=True)
    bad("results_dir on /proc", ["save", *fs, "results_dir=/proc/r"], "results_dir",
        no_results=True)
    bad("results_dir empty", ["save", *fs, "results_dir="], "results_dir", no_results=True)
    # -- load ---------------------------------------------------------------------------
    bad("load without suffix", ["load", *fs], "suffix is not set")
    bad("load a missing suffix (fs)", ["load", *fs, "suffix=nosuch"], "does not exist")
    bad("load a missing suffix (s3)", ["load", *at, "suffix=nosuch"], "does not exist", env=keys)
    bad("load an incomplete checkpoint", ["load", *at, f"suffix={ctx['incomplete']}"],
        "incomplete", env=keys)
    bad("load with a mistyped storage.path", ["load", "storage=fs",
                                              f"storage.path={tmp}/typo", "suffix=x"],
        ["storage.path", "no such directory"], created=tmp / "typo")
    bad("load on the embedded server", ["load", "suffix=x"], "s3-server start")
    bad("load with another model", ["load", *fs, f"suffix={ctx['fs_suffix']}",
                                    "model=tiny_gpt2"], ["model=tiny_llama", "model=tiny_gpt2"])
    bad("load with another dtype", ["load", *fs, f"suffix={ctx['fs_suffix']}",
                                    "model.dtype=bf16"], "model.dtype=fp32")
    bad("load optimizer state of a model-only checkpoint",
        ["load", *fs, f"suffix={ctx['fs_suffix']}", "state=model_and_optimizer"], "state=model")
    bad("load with another model (s3)", ["load", *at, f"suffix={ctx['s3_suffix']}",
                                         "model=L7b"], "model=tiny_llama", env=keys)
    bad("load another dtype, no manifest (.metadata)",
        ["load", *fs, f"suffix={ctx['bare_suffix']}", "model.dtype=bf16"], "model.dtype=fp32")
    # -- list -------------------------------------------------------------------------------
    bad("list without storage", ["list"], "storage.uri is not set")
    bad("list a mistyped storage.path", ["list", "storage=fs", f"storage.path={tmp}/typo2"],
        "no such directory", created=tmp / "typo2")
    bad("list storage.path a file", ["list", "storage=fs", f"storage.path={ctx['a_file']}"],
        "is a file")
    bad("list a missing bucket", ["list", "storage.uri=s3://no-such-bucket/x",
                                  f"storage.endpoint={s3.endpoint_url}"], "does not exist",
        env=keys)
    bad("list with AWS_ENDPOINT_URL only", ["list"], ["storage.uri is not set",
                                                      "AWS_ENDPOINT_URL"],
        env={**keys, "AWS_ENDPOINT_URL": s3.endpoint_url})
    # -- S3 answers ---------------------------------------------------------------------
    bad("missing bucket", ["save", "storage.uri=s3://no-such-bucket/x",
                           f"storage.endpoint={s3.endpoint_url}", "nproc=2"],
        "does not exist", env=keys)
    bad("wrong secret key", ["save", *at], "refused the credentials",
        env={**keys, "AWS_SECRET_ACCESS_KEY": "wrong"})
    bad("unknown key id", ["save", *at], "refused the credentials",
        env={**keys, "AWS_ACCESS_KEY_ID": "AKIANOSUCH"})
    bad("no credentials at all", ["save", *at], "credentials",
        env={"AWS_SHARED_CREDENTIALS_FILE": str(tmp / "none"),
             "AWS_CONFIG_FILE": str(tmp / "none"), "AWS_EC2_METADATA_DISABLED": "true"})
    bad("closed port", ["save", f"storage.uri={uri}", f"storage.endpoint={ctx['closed']}"],
        ["storage.endpoint", "cannot connect"], env=keys)
    bad("endpoint answering 301 (not S3)", ["save", f"storage.uri={uri}",
                                            f"storage.endpoint={ctx['http301']}"],
        ["storage.endpoint", "not an S3 server"], env=keys)
    bad("endpoint answering 404 (not S3)", ["save", f"storage.uri={uri}",
                                            f"storage.endpoint={ctx['http404']}"],
        ["storage.endpoint", "not an S3 server"], env=keys)
    bad("https against plain http", ["save", f"storage.uri={uri}", "storage.endpoint="
                                     + ctx["http404"].replace("http://", "https://")],
        ["TLS", "http://"], env=keys)
    bad("AWS_ENDPOINT_URL answering 404", ["save", f"storage.uri={uri}"],
        ["AWS_ENDPOINT_URL", "not an S3 server"], env={**keys, "AWS_ENDPOINT_URL": ctx["http404"]})
    bad("list against a 301 endpoint", ["list", f"storage.uri={uri}",
                                        f"storage.endpoint={ctx['http301']}"],
        "not an S3 server", env=keys)
    # -- the AWS credential chain -------------------------------------------------------
    bad("AWS_PROFILE=nosuch with keys", ["save", *at], "AWS_PROFILE=nosuch",
        env={**keys, "AWS_PROFILE": "nosuch"})
    bad("AWS_PROFILE=nosuch, list", ["list", *at], "AWS_PROFILE=nosuch",
        env={"AWS_PROFILE": "nosuch"})
    bad("credentials file with only a key id", ["save", *at], ["incomplete", "aws_secret"],
        env={"AWS_SHARED_CREDENTIALS_FILE": str(ctx["half_credentials"]),
             "AWS_CONFIG_FILE": str(tmp / "none")})
    bad("unparsable AWS_CONFIG_FILE", ["save", *at], "AWS_CONFIG_FILE",
        env={**keys, "AWS_CONFIG_FILE": str(ctx["bad_ini"])})
    bad("unparsable AWS_SHARED_CREDENTIALS_FILE", ["save", *at],
        "AWS_SHARED_CREDENTIALS_FILE", env={"AWS_SHARED_CREDENTIALS_FILE": str(ctx["bad_ini"])})
    # -- environment variables we read --------------------------------------------------
    for name, value, fragment in [("OMP_NUM_THREADS", "0", "OMP_NUM_THREADS"),
                                  ("OMP_NUM_THREADS", "abc", "OMP_NUM_THREADS"),
                                  ("AWS_ENDPOINT_URL", "localhost:9000", "AWS_ENDPOINT_URL"),
                                  ("AWS_ENDPOINT_URL", s3.endpoint_url, "storage.uri"),
                                  ("AWS_ENDPOINT_URL_S3", "nohttp", "AWS_ENDPOINT_URL_S3"),
                                  ("AWS_REGION", "us east", "AWS_REGION"),
                                  ("AWS_DEFAULT_REGION", "x/y", "AWS_DEFAULT_REGION"),
                                  ("S3_TORCH_CONNECTOR_DEBUG_LOGS", "debug",
                                   "S3_TORCH_CONNECTOR_DEBUG_LOGS"),
                                  ("DCP_FSDP_CONFIG", "/x.yaml", "DCP_FSDP_CONFIG")]:
        bad(f"{name}={value}", ["save"], fragment, env={name: value})
    for env, fragment in [({"RANK": "0"}, "WORLD_SIZE"),
                          ({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": "29500"}, "RANK"),
                          ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": "99999"}, "MASTER_PORT"),
                          ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": "29500"}, "RANK")]:
        bad(f"torchrun variables {env}", ["save", *fs], fragment, env=env)
    # -- tune ---------------------------------------------------------------------------
    bad("tune with AWS_ENDPOINT_URL only", ["tune", f"results_dir={tmp}/tune"],
        "storage.uri is not set", env={**keys, "AWS_ENDPOINT_URL": s3.endpoint_url})
    bad("tune.budget_s=0", ["tune", "tune.budget_s=0"], "tune.budget_s")
    bad("tune.repeats=0", ["tune", "tune.repeats=0"], "tune.repeats")
    bad("tune.trials=0", ["tune", "tune.trials=0"], "tune.trials")
    bad("tune under torchrun", ["tune"], "torchrun", env={"RANK": "0"})
    # -- report and wait ------------------------------------------------------------------
    bad("report a missing path", ["report", str(tmp / "nosuch")], "nosuch")
    bad("report --format xml", ["report", str(tmp), "--format", "xml"], "xml")
    bad("report --plot into a file", ["report", str(tmp), "--plot", str(ctx["a_file"])],
        "--plot")
    bad("wait --duration abc", ["wait", "--duration", "abc"], "--duration")
    bad("wait --duration=-1m", ["wait", "--duration=-1m"], "--duration")
    bad("wait --heartbeat 0.001s", ["wait", "--heartbeat", "0.001s"], "--heartbeat")
    # -- s3-server ----------------------------------------------------------------------------
    bad("s3-server bogus", ["s3-server", "bogus"], "invalid choice: 'bogus'")
    bad("s3-server start --bucket BAD_", ["s3-server", "start", "--bucket", "BAD_"], "bucket name",
        env={"XDG_RUNTIME_DIR": str(tmp)})
    bad("s3-server env when not running", ["s3-server", "env"], "not running",
        env={"XDG_RUNTIME_DIR": str(tmp)})
    bad("s3-server stop extra=1", ["s3-server", "stop", "extra=1"], "unrecognized arguments")
    # -- good cases ---------------------------------------------------------------------------
    good("--help", ["--help"])
    good("save --help", ["save", "--help"])
    good("--version", ["--version"])
    good("list (s3)", ["list", *at], env=keys)
    good("list (fs)", ["list", *fs])
    good("report of the trial's records", ["report", str(ctx["results"])])
    good("s3-server status (not running: exit 3)", ["s3-server", "status"],
         env={"XDG_RUNTIME_DIR": str(tmp)}, exit_code=3)
    good("load by suffix (s3)", ["load", *at, f"suffix={ctx['s3_suffix']}", "nproc=2",
                                 f"results_dir={ctx['results']}"], env=keys)
    good("load model only of a model+optimizer checkpoint (says so)",
         ["load", *fs, f"suffix={ctx['full_suffix']}", f"results_dir={ctx['results']}"],
         says="model state only")
    good("save-and-load on the embedded server (says the checkpoint is deleted)",
         ["save-and-load", "nproc=2", f"results_dir={ctx['results']}"], says="was deleted")
    return out


def prepare(tmp: Path, s3, results: Path) -> dict:
    keys = {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key}
    uri = f"s3://{s3.bucket}/trial"
    fs_root = tmp / "fs"
    ctx = {"s3": s3, "uri": uri, "tmp": tmp, "fs_root": fs_root, "results": results}
    at = [f"storage.uri={uri}", f"storage.endpoint={s3.endpoint_url}"]
    fs = ["storage=fs", f"storage.path={fs_root}"]
    for name, args, env in [("s3_suffix", ["save", *at, "suffix=trial-s3", "nproc=2"], keys),
                            ("fs_suffix", ["save", *fs, "suffix=trial-fs"], {}),
                            ("full_suffix", ["save", *fs, "suffix=trial-full",
                                             "state=model_and_optimizer"], {}),
                            ("bare_suffix", ["save", *fs, "suffix=trial-bare"], {})]:
        code, _, err, seconds = run([*args, f"results_dir={results}"], env)
        if code != 0:
            raise SystemExit(f"setting up {name} failed: {err}")
        ctx[name] = next(a for a in args if a.startswith("suffix=")).split("=", 1)[1]
        print(f"prepared {name}={ctx[name]} ({seconds:.1f} s)", flush=True)
    (fs_root / "trial-bare" / "dcp_fsdp.json").unlink()  # a checkpoint without our manifest
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1",
                          aws_access_key_id=s3.access_key_id,
                          aws_secret_access_key=s3.secret_access_key)
    client.put_object(Bucket=s3.bucket, Key="trial/half-done/__0_0.distcp", Body=b"x")
    ctx["incomplete"] = "half-done"
    (tmp / "a-file").write_text("not a directory")
    ctx["a_file"] = tmp / "a-file"
    (tmp / "bad.yaml").write_text("model: [unclosed\n")
    ctx["bad_yaml"] = tmp / "bad.yaml"
    (tmp / "list.yaml").write_text("- a\n- b\n")
    ctx["list_yaml"] = tmp / "list.yaml"
    (tmp / "typo.yaml").write_text("iteratons: 3\n")
    ctx["typo_yaml"] = tmp / "typo.yaml"
    (tmp / "half").write_text("[default]\naws_access_key_id = AKIAHALF\n")
    ctx["half_credentials"] = tmp / "half"
    (tmp / "bad.ini").write_text("this is = not [ini\n[[[\n")
    ctx["bad_ini"] = tmp / "bad.ini"
    from dcp_fsdp.launch.embedded_s3 import free_ports

    ctx["closed"] = f"http://127.0.0.1:{free_ports(1)[0]}"
    return ctx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dcp-fsdp-trial-"))
    server = EmbeddedS3(bucket="trial")
    servers = [http_server(301), http_server(404)]
    rows, wrong = [], 0
    try:
        s3 = server.start()
        results = tmp / "results"
        ctx = prepare(tmp, s3, results)
        ctx["http301"] = f"http://127.0.0.1:{servers[0].server_port}"
        ctx["http404"] = f"http://127.0.0.1:{servers[1].server_port}"
        todo = [case for case in cases(ctx) if args.k in case["name"]]
        for number, case in enumerate(todo, 1):
            results_dir = None
            argv = list(case["args"])
            if case["expect"] != "ok" and not case.get("no_results") and argv and argv[0] in (
                    "save", "load", "save-and-load", "ceiling", "list"):
                results_dir = tmp / f"r{number}"
                argv.append(f"results_dir={results_dir}")
            code, out, err, seconds = run(argv, case["env"])
            if case["expect"] == "ok":
                ok = code == case.get("exit_code", 0) and "Traceback" not in err
                seen = f"exit {code}"
                if case.get("says") and case["says"] not in out:
                    ok, seen = False, seen + f"; no '{case['says']}'"
                if not ok:
                    seen += f": {(err.strip().splitlines() or [''])[-1][:160]}"
            else:
                ok, seen = judge(case, code, out, err, seconds, results_dir)
            if case.get("created") and Path(case["created"]).exists():
                ok, seen = False, f"created {case['created']}; " + seen
            wrong += not ok
            rows.append((number, case["name"], "ok" if ok else "WRONG", seconds, code, seen))
            print(f"{number:3d} {'ok   ' if ok else 'WRONG'} {seconds:5.1f} s  {case['name']}: "
                  f"{seen[:150]}", flush=True)
    finally:
        for http in servers:
            http.shutdown()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(rows)} cases, {wrong} wrong")
    if args.markdown:
        lines = ["| # | case | result | exit | s | what you see |", "|---|---|---|---|---|---|"]
        for number, name, result, seconds, code, seen in rows:
            cell = seen.replace("|", "\\|")
            lines.append(f"| {number} | {name.replace('|', '/')} | {result} | {code} | "
                         f"{seconds:.1f} | {cell} |")
        args.markdown.write_text("\n".join(lines) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
