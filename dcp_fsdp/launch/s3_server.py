"""`dcp-fsdp s3-server start|status|env|stop`: a local S3 that outlives one run (docs/s3-servers.md).

`start` runs a daemon (`serve`) owning the embedded SeaweedFS, with its endpoint and keys in a
state file (mode 0600: it holds the secret key); `stop` ends it and removes the state directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dcp_fsdp import log
from dcp_fsdp.process import lifeline
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch.agent import raise_terminated
from dcp_fsdp.launch.embedded_s3 import EmbeddedS3, S3Endpoint, fatal_line

STATE_NAME = "state.json"
LOG_NAME = "server.log"
START_TIMEOUT_S = 90.0  # SeaweedFS answers in ~1 s idle; a loaded 2-core machine is slower
STOP_TIMEOUT_S = 30.0
LOCK_WAIT_S = START_TIMEOUT_S + STOP_TIMEOUT_S + 30.0  # the longest start or stop, and some


def state_dir() -> Path:
    """$XDG_RUNTIME_DIR/dcp-fsdp-s3, else ~/.cache/dcp-fsdp-s3. Where that path is too long for
    SeaweedFS's unix sockets, EmbeddedS3 puts them in a short directory of their own in /tmp."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and Path(runtime).is_dir() else Path.home() / ".cache"
    return base / "dcp-fsdp-s3"


def _cannot_write(path: Path, action: str, error: OSError) -> UserError:
    return UserError(f"s3-server {action}: cannot create {path} ({error.strerror or error}); "
                     "the server's state and data live in $XDG_RUNTIME_DIR/dcp-fsdp-s3, else "
                     "~/.cache/dcp-fsdp-s3: set XDG_RUNTIME_DIR to a short writable directory "
                     "(e.g. XDG_RUNTIME_DIR=/run/user/$(id -u), or a directory under /tmp)")


@contextlib.contextmanager
def locked(where: Path, action: str) -> Iterator[None]:
    """Hold an flock on `<where>.lock` (beside it: stop removes `where`) for one start or stop;
    a second caller waits for it."""
    path = where.parent / f"{where.name}.lock"
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by the daemon
    except OSError as error:
        raise _cannot_write(path, action, error) from None
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        for attempt in itertools.count():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 0:
                    log.info(f"s3-server {action}: another start or stop is under way; "
                             "waiting for it")
                if time.monotonic() > deadline:
                    raise UserError(f"s3-server {action}: another start or stop has held {path} "
                                    f"for {LOCK_WAIT_S:g} s; try again when it has ended") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def runs_using(state: dict) -> list[tuple[int, str]]:
    """Local dcp-fsdp processes pointed at this server (AWS_ENDPOINT_URL in their environment,
    or storage.endpoint= on their command line), outermost first: (pid, command line).
    Other users' processes and other machines cannot be seen."""
    import psutil

    url = state["endpoint_url"]
    own = {os.getpid(), state.get("daemon_pid"), state.get("server_pid")}
    found: dict[int, tuple[int, str]] = {}
    for process in psutil.process_iter(["ppid", "cmdline", "environ"]):
        words, environ = process.info["cmdline"], process.info["environ"]  # None: not readable
        text = " ".join(words or [])
        if (process.pid in own or words is None or environ is None or "s3-server" in words
                or ("dcp_fsdp" not in text and "dcp-fsdp" not in text)):
            continue
        if url in (environ.get(name, "").rstrip("/") for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")) \
                or f"storage.endpoint={url}" in text:
            found[process.pid] = (process.info["ppid"], text)
    return [(pid, text) for pid, (parent, text) in sorted(found.items()) if parent not in found]


def read_state(where: Path) -> dict | None:
    """The running server's state, or None (a dead daemon's is removed with what it left)."""
    try:
        state = json.loads((where / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    if lifeline.alive(state.get("daemon_pid")):
        return state
    _kill_group(state.get("server_pid"))
    if isinstance(ports := state.get("ports"), dict):  # its gRPC sockets, in /tmp whatever TMPDIR says
        lifeline.remove_seaweed_sockets(p for p in ports.values() if isinstance(p, int))
    shutil.rmtree(where, ignore_errors=True)
    return None


def _kill_group(pid: int | None) -> None:
    if pid and lifeline.alive(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # SeaweedFS runs in its own process group


def exports(state: dict) -> str:
    fields = {field.name for field in dataclasses.fields(S3Endpoint)}  # a state file may predate one
    endpoint = S3Endpoint(**{name: value for name, value in state.items() if name in fields})
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in endpoint.client_env().items())


def _describe(state: dict) -> str:
    return (f"S3 server up at {state['endpoint_url']} (pid {state['daemon_pid']}, bucket "
            f"{state['bucket']}, data in {state['workdir']}); stop it with `dcp-fsdp s3-server stop`")


def _print_usage_of(state: dict) -> None:
    log.info(_describe(state))
    print(exports(state))
    log.info(f"then: dcp-fsdp save storage.uri={state['uri']}   (and load with "
             f"storage.uri={state['uri']} suffix=... in another run)")


def start(where: Path, bucket: str) -> int:
    lifeline.remove_stale()  # a killed daemon's server left its sockets in /tmp
    if (state := read_state(where)) is not None:
        log.info("already running")
        _print_usage_of(state)
        return 0
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as error:  # its lock beside it was made: seldom, e.g. a full disk
        raise _cannot_write(where, "start", error) from None
    env = {**os.environ, "TMPDIR": str(where)}  # SeaweedFS's sockets go here, not /tmp
    with open(where / LOG_NAME, "ab") as out:
        daemon = subprocess.Popen([sys.executable, "-m", "dcp_fsdp", "s3-server", "serve",
                                   "--bucket", bucket, str(where)], env=env, stdout=out,
                                  stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while (state := read_state(where) if (where / STATE_NAME).exists() else None) is None:
            if daemon.poll() is not None:
                raise UserError(f"s3-server: SeaweedFS did not start (exit {daemon.returncode}): "
                                f"{_tail(where / LOG_NAME)}")
            if time.monotonic() > deadline:
                raise UserError(f"s3-server: no answer within {START_TIMEOUT_S:g} s; the "
                                "machine may be overloaded, try again")
            time.sleep(0.2)
    except (KeyboardInterrupt, UserError):
        daemon.terminate()  # nothing once it has ended
        daemon.wait()
        shutil.rmtree(where, ignore_errors=True)
        raise
    _print_usage_of(state)
    return 0


def _tail(path: Path) -> str:
    """The line that says why: SeaweedFS's first fatal line (F...) or panic, else the last."""
    text = ""
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace")
    return fatal_line(text) or next((line for line in reversed(text.splitlines()) if line.strip()), "no log")


def stop(where: Path, force: bool = False) -> int:
    if not (where / STATE_NAME).exists():
        shutil.rmtree(where, ignore_errors=True)
        log.info("s3-server: not running")
        return 0
    if (state := read_state(where)) is None:
        log.info("s3-server: not running (removed what a stopped server left)")
        return 0
    if users := runs_using(state):
        named = "; ".join(f"pid {pid}: {text[:80]}" for pid, text in users[:3]) + (
            f"; and {len(users) - 3} more" if len(users) > 3 else "")
        if not force:
            raise UserError(f"s3-server stop: {len(users)} run(s) use the server at "
                            f"{state['endpoint_url']} ({named}); stopping deletes their data: "
                            "wait for them to end, or stop anyway: dcp-fsdp s3-server stop --force")
        log.warning(f"s3-server stop --force: stopping the server {len(users)} run(s) use "
                    f"({named}); they will fail")
    os.kill(state["daemon_pid"], signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while lifeline.alive(state["daemon_pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if lifeline.alive(state["daemon_pid"]):
        os.kill(state["daemon_pid"], signal.SIGKILL)
    _kill_group(state.get("server_pid"))
    shutil.rmtree(where, ignore_errors=True)
    log.info(f"s3-server: stopped the server at {state['endpoint_url']}; its data is deleted")
    return 0


def serve(where: Path, bucket: str) -> int:
    """The daemon: owns SeaweedFS until SIGTERM/SIGINT, then stops it."""
    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGINT, raise_terminated)
    server = EmbeddedS3(bucket=bucket)
    try:
        endpoint = server.start()
        process = server.process
        assert process is not None
        state = {"daemon_pid": os.getpid(), "server_pid": process.pid, **dataclasses.asdict(endpoint),
                 "uri": f"s3://{endpoint.bucket}/checkpoints", "workdir": str(server.workdir),
                 "ports": server.ports}
        tmp = where / (STATE_NAME + ".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(json.dumps(state))
        os.replace(tmp, where / STATE_NAME)
        process.wait()  # a signal interrupts this
        print(f"s3-server: SeaweedFS exited:\n{server.tail_log()}", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        (where / STATE_NAME).unlink(missing_ok=True)
        server.stop()


def main(args: argparse.Namespace) -> int:
    """`dcp-fsdp s3-server ACTION` parsed (config/arguments.py)."""
    if args.action == "serve":
        return serve(Path(args.state_dir), args.bucket)
    where = state_dir()
    if args.action in ("start", "stop"):
        with locked(where, args.action):
            return start(where, args.bucket) if args.action == "start" else stop(where, args.force)
    if (state := read_state(where)) is None:  # status or env
        if args.action == "env":
            raise UserError("s3-server: not running; start it: dcp-fsdp s3-server start")
        log.info("s3-server: not running (start it: dcp-fsdp s3-server start)")
        return 3
    if args.action == "env":
        print(exports(state))
    else:
        log.info(_describe(state))
    return 0
