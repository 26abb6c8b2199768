"""`dcp-fsdp COMMAND [hydra overrides]`: a thin shell over the library.

Configuration is composed with Hydra's compose API from `conf/` onto the
structured config in `dcp_fsdp.config`; `-m`/`--multirun` expands sweeps
(`iterations=1,3 model=tiny_llama,tiny_gpt2`) with Hydra's own override parser
and runs the jobs one after another. Under torchrun (RANK is set) this process
is a rank; otherwise it launches `nproc` ranks on this machine.
"""

from __future__ import annotations

import itertools
import re
import os
import sys
import time
from pathlib import Path

PROCESS_START_MONO = time.monotonic()

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
RUN_COMMANDS = ("save", "load", "save-and-load")
USAGE = """usage: dcp-fsdp COMMAND [-m] [--config FILE] [key=value ...]

commands:
  save            save checkpoints (iterations=N), print their suffixes
  load            load the checkpoint named by suffix=...
  save-and-load   N x (save, load, bit-exact check): the stress loop
  list            list checkpoint suffixes under storage.uri / storage.path
  wait            hold an allocation doing nothing: duration=2m (batch/waitbatch.sh)
  report          tables and plots over records: report [PATHS] [--format md|csv] [--plot DIR]

examples:
  dcp-fsdp save-and-load nproc=2
  dcp-fsdp save model=L7b storage.uri=s3://my-bucket/ckpt storage.region=us-east-2 iterations=5
  torchrun --nproc-per-node 8 -m dcp_fsdp save model=L13b storage.uri=s3://my-bucket/ckpt
  dcp-fsdp save -m model=tiny_llama,tiny_gpt2 nproc=2
  dcp-fsdp report results/ --format md --plot plots/

settings: see conf/config.yaml and dcp_fsdp/config.py (README: "Settings")."""


def _fail(message: str, code: int = 2) -> int:
    print(f"dcp-fsdp: error: {message}", file=sys.stderr, flush=True)
    return code


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Hydra multirun semantics: the cartesian product of every swept override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combination) for combination in itertools.product(*choices)]


def expand_config_files(args: list[str]) -> list[str]:
    """`--config FILE` (YAML of settings) becomes overrides placed before the others.

    The file holds the same keys as the command line, nested or dotted, e.g.
    `{model: L7b, iterations: 5, storage: {uri: s3://my-bucket/ckpt}}`; the
    command line wins where both set a key.
    """
    from dcp_fsdp.errors import UserError

    expanded: list[str] = []
    from_files: list[str] = []
    position = 0
    while position < len(args):
        arg = args[position]
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if position + 1 >= len(args):
                    raise UserError("--config: give a YAML file, e.g. --config my-run.yaml")
                path, position = args[position + 1], position + 2
            else:
                path, position = arg.split("=", 1)[1], position + 1
            from_files.extend(_config_file_overrides(path))
            continue
        expanded.append(arg)
        position += 1
    return from_files + expanded


def _config_file_overrides(path: str) -> list[str]:
    import yaml

    from dcp_fsdp.errors import UserError

    try:
        with open(path) as source:
            content = yaml.safe_load(source)
    except OSError as error:
        raise UserError(f"--config {path}: cannot read it ({error.strerror or error}); "
                        "check the path and its permissions") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"--config {path}: not valid YAML{line}; fix the file") from None
    if content is None:
        return []
    if not isinstance(content, dict):
        raise UserError(f"--config {path}: expected a mapping of settings (key: value), "
                        f"found {type(content).__name__}")

    def flatten(node: dict, prefix: str = "") -> list[str]:
        overrides = []
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                overrides.extend(flatten(value, f"{name}."))
            elif isinstance(value, list):
                overrides.append(f"{name}=[{','.join(str(v) for v in value)}]")
            elif value is None:
                overrides.append(f"{name}=null")
            else:
                overrides.append(f"{name}={str(value).lower() if isinstance(value, bool) else value}")
        return overrides
    return flatten(content)


def compose(command: str, overrides: list[str]):
    """The validated BenchmarkConfig for a command and overrides, or UserError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dcp_fsdp.config import BenchmarkConfig, validate
    from dcp_fsdp.errors import UserError

    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "model" and value:
            presets = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
            if value not in presets:
                raise UserError(f"model={value}: unknown preset; choose one of {', '.join(presets)}")
        if key.lstrip("+~") == "storage" and value not in ("s3", "fs"):
            raise UserError(f"storage={value}: unknown storage; choose s3 or fs")
        if key == "command":
            raise UserError("command is set by the subcommand (save, load, save-and-load)")

    ConfigStore.instance().store(name="base_config", node=BenchmarkConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = hydra_compose(config_name="config",
                                     overrides=[f"command={command.replace('-', '_')}", *overrides])
        cfg = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise UserError(_one_line(error)) from None
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)
    return cfg


def _one_line(error: BaseException) -> str:
    """Hydra/OmegaConf errors as one line that names the setting and the fix."""
    cause = error.__cause__ or error
    text = " ".join(str(cause).split())
    key_match = re.search(r"full_key: (\S+)", text)
    key = key_match.group(1) if key_match else None
    text = text.split(" full_key:")[0]
    if "not in '" in text or "is not in struct" in text:
        name = key or text
        return (f"{name}: unknown setting; check the spelling against the README's Settings "
                "(or conf/config.yaml)")
    if key:
        return f"{key}: {text}"
    return f"{' '.join(str(error).split())} (see the README's Settings)"


def run_command(command: str, overrides: list[str]) -> int:
    from dcp_fsdp.errors import UserError

    try:
        # `list` takes the same storage settings as a save; the command value is unused.
        cfg = compose("save" if command == "list" else command, overrides)
        if command == "list":
            return list_checkpoints(cfg)
        if "RANK" in os.environ and "DCP_FSDP_CONFIG" not in os.environ:
            from dcp_fsdp.launcher import needs_embedded_server
            from dcp_fsdp.runner import run_rank

            if needs_embedded_server(cfg):
                raise UserError(
                    "storage.uri is not set: under torchrun the embedded S3 server is not "
                    "started; set storage.uri=s3://bucket/prefix (and storage.endpoint or "
                    "AWS_ENDPOINT_URL for S3-compatible servers), or run without torchrun")
            from dcp_fsdp.distributed import end_process

            end_process(run_rank(cfg, PROCESS_START_MONO))
        from dcp_fsdp.launcher import launch_local

        return launch_local(cfg)
    except UserError as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def list_checkpoints(cfg) -> int:
    from tabulate import tabulate

    from dcp_fsdp.launcher import needs_embedded_server
    from dcp_fsdp.errors import UserError
    from dcp_fsdp.storage import make_backend

    if needs_embedded_server(cfg):
        raise UserError("storage.uri is not set: give the location to list, e.g. "
                        "storage.uri=s3://my-bucket/ckpt (or storage=fs storage.path=DIR)")
    backend = make_backend(cfg.storage)
    backend.preflight()
    checkpoints = backend.list_checkpoints()
    rows = [[c.suffix, "complete" if c.complete else "INCOMPLETE", f"{c.size_bytes / 2**20:.1f}",
             c.object_count, c.modified] for c in checkpoints]
    print(f"checkpoints under {backend.location('')}")
    print(tabulate(rows, headers=["suffix", "state", "MiB", "objects", "modified (UTC)"],
                   tablefmt="github"))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "wait":  # no Hydra, no torch: see dcp_fsdp/wait.py
        from dcp_fsdp.wait import main as wait_main
        return wait_main(rest)
    if command == "report":  # no Hydra, no torch: its own argparse (dcp-fsdp report --help)
        from dcp_fsdp.report import main as report_main
        return report_main(rest)
    if command not in (*RUN_COMMANDS, "list"):
        return _fail(f"unknown command '{command}'; choose one of "
                     f"{', '.join((*RUN_COMMANDS, 'list'))} (dcp-fsdp --help)")
    multirun = any(arg in ("-m", "--multirun") for arg in rest)
    overrides = [arg for arg in rest if arg not in ("-m", "--multirun")]
    from dcp_fsdp.errors import UserError

    try:
        overrides = expand_config_files(overrides)
    except UserError as error:
        return _fail(str(error))
    if not multirun:
        return run_command(command, overrides)
    try:
        jobs = expand_sweeps(overrides)
    except Exception as error:  # Hydra's parser raises its own exception types
        return _fail(f"cannot parse overrides: {_one_line(error)}")
    worst = 0
    for number, job in enumerate(jobs):
        print(f"[dcp-fsdp] multirun job {number + 1}/{len(jobs)}: {' '.join(job)}", flush=True)
        code = run_command(command, job)
        worst = worst or code
    return worst


if __name__ == "__main__":
    sys.exit(main())
