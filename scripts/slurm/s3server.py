"""Keep a SeaweedFS S3 server running for the local test cluster (scripts/slurm/localcluster.sh).

It binds the bridge address the cluster script created, so every emulated node
can reach it, and writes the standard AWS variables a job needs to ENV_FILE
(shell `export` lines, mode 0600) once the bucket answers. It stops the
server on SIGTERM/SIGINT and removes the env file.

    python scripts/slurm/s3server.py --host 10.213.77.1 --env-file DIR/s3.env --pid-file DIR/s3.pid
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path

from dcp_fsdp.launch.embedded_s3 import MEMORY_LIMIT_MIB, EmbeddedS3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="address to bind (the cluster's bridge)")
    parser.add_argument("--bucket", default="dcp-fsdp")
    parser.add_argument("--prefix", default="checkpoints", help="URI prefix written to the env file")
    parser.add_argument("--env-file", required=True, type=Path)
    parser.add_argument("--pid-file", type=Path)
    parser.add_argument("--memory-limit-mib", type=int, default=MEMORY_LIMIT_MIB)
    args = parser.parse_args()

    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.pid_file:
        args.pid_file.write_text(f"{os.getpid()}\n")
    server = EmbeddedS3(bucket=args.bucket, host=args.host,
                        memory_limit_mib=args.memory_limit_mib)
    try:
        endpoint = server.start()
        variables = {**endpoint.client_env(), "URI": f"s3://{endpoint.bucket}/{args.prefix}"}
        tmp = args.env_file.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text("".join(f"export {key}={shlex.quote(value)}\n"
                               for key, value in variables.items()))
        os.replace(tmp, args.env_file)
        print(f"s3server: SeaweedFS S3 at {endpoint.endpoint_url}, bucket {endpoint.bucket}, "
              f"data in {server.workdir}", flush=True)
        assert server.process is not None
        server.process.wait()  # a signal interrupts this (the handler raises)
        if not stopping:
            print(f"s3server: SeaweedFS exited:\n{server.tail_log()}", file=sys.stderr, flush=True)
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        args.env_file.unlink(missing_ok=True)
        server.stop()
        if args.pid_file:
            args.pid_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
