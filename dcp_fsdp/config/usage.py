"""`dcp-fsdp --help` and `dcp-fsdp COMMAND --help`, rendered from the schema (the one place
settings are described)."""

from __future__ import annotations

from typing import Any

from dcp_fsdp.config.schema import format_default, iter_settings

COMMANDS = {
    "save": "save checkpoints (iterations=N), print their suffixes",
    "load": "load the checkpoint named by suffix=...",
    "save-and-load": "N x (save, load, bit-exact check): the stress loop",
    "ceiling": "the storage's raw PUT/GET ceiling for this model's shards, no DCP",
    "tune": "search connector settings within tune.budget_s; prints the best as overrides",
    "list": "list checkpoint suffixes under storage.uri / storage.path, and open uploads (--check)",
    "clean-uploads": "abort open multipart uploads under storage.uri older than 1 h (--min-age-s, --force)",
    "delete": "remove checkpoint suffix=... (complete, or incomplete and older than 1 h: --min-age-s, --force)",
    "wait": "hold an allocation doing nothing: duration=2m (batch/waitbatch.sh)",
    "report": "tables and plots over records: report [PATHS] [--format md|csv] [--plot DIR]",
    "s3-server": "a local S3 server kept up across runs: s3-server start|status|env|stop",
    "plan": "DCP's save plan for world_size=N ranks_per_node=K, no ranks: objects, requests, "
            ".metadata, prefixes, memory; record=PATH projects times",
}
RUN_COMMANDS = ("save", "load", "save-and-load", "ceiling")
SETTINGS_COMMANDS = (*RUN_COMMANDS, "tune", "list", "clean-uploads", "delete")
STORAGE_ONLY_COMMANDS = ("list", "clean-uploads", "delete")  # settings of a save; no ranks
# clean-uploads: an upload this young may belong to a save still running; left alone
# unless forced (launch/listing.py).
CLEAN_UPLOADS_MIN_AGE_S = 3600.0
CLEAN_OPTIONS_HELP = (
    "options:\n"
    f"  --min-age-s SECONDS  abort only uploads started at least this long ago (default "
    f"{CLEAN_UPLOADS_MIN_AGE_S:g}): a younger one may belong to a save still writing\n"
    "  --force              abort every open upload, whatever its age (a save writing there "
    "fails)\n")
LIST_OPTIONS_HELP = (
    "options:\n"
    "  --check  read each complete checkpoint's .metadata (screened) and compare the objects it "
    "names with those stored: a missing or short one marks it DAMAGED (exit 1)\n")
DELETE_OPTIONS_HELP = (
    "options:\n"
    f"  --min-age-s SECONDS  remove an incomplete suffix (an abandoned claim included) only when "
    f"its newest object is at least this old (default {CLEAN_UPLOADS_MIN_AGE_S:g}): a younger "
    "one may be a save writing there\n"
    "  --force              remove it whatever its age (a save writing there fails)\n")

EXAMPLES = """examples:
  dcp-fsdp save-and-load nproc=2
  dcp-fsdp save model=L7b storage.uri=s3://my-bucket/ckpt storage.region=us-east-2 iterations=5
  torchrun --nproc-per-node 8 -m dcp_fsdp save model=L13b storage.uri=s3://my-bucket/ckpt
  dcp-fsdp save -m model=tiny_llama,tiny_gpt2 nproc=2
  dcp-fsdp save-and-load ceiling=true nproc=2     # DCP vs the raw storage, same bytes
  dcp-fsdp tune nproc=2 tune.budget_s=600         # best connector settings, as overrides
  dcp-fsdp report results/ --format md --plot plots/
  dcp-fsdp plan model=L70b state=model_and_optimizer world_size=1024 ranks_per_node=8"""


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: dcp-fsdp COMMAND [-m] [--config FILE] [key=value ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", EXAMPLES, "",
              "settings: dcp-fsdp COMMAND --help lists every setting with its type, default "
              "and meaning", "version: dcp-fsdp --version"]
    return "\n".join(lines)


def settings_rows() -> list[tuple[str, str, str, str]]:
    """(setting, type, default, meaning) for every user setting, schema order."""
    return [(name, type_name, format_default(effective_default(name, default)), text)
            for name, type_name, default, text in iter_settings()]


def effective_default(name: str, default: Any) -> Any:
    """A group's member (model.preset) has no schema default: conf/config.yaml's defaults
    list chooses it (model: tiny_llama)."""
    if format_default(default) != "(required)":
        return default
    import yaml

    from dcp_fsdp.config.compose import CONF_DIR

    with open(CONF_DIR / "config.yaml") as source:
        choices = {key: value for entry in yaml.safe_load(source)["defaults"]
                   if isinstance(entry, dict) for key, value in entry.items()}
    return choices.get(name.split(".")[0], default)


def command_help(command: str) -> str:
    from tabulate import tabulate

    header = [f"usage: dcp-fsdp {command} [-m] [--config FILE] [key=value ...]",
              f"  {COMMANDS[command]}", "",
              "settings (key=value; groups: model=PRESET, storage=s3|fs):"]
    table = tabulate([list(row) for row in settings_rows()],
                     headers=["setting", "type", "default", "meaning"], tablefmt="simple",
                     maxcolwidths=[None, 24, 14, 60], disable_numparse=True)
    if command == "clean-uploads":  # its options beside the settings (launch/listing.py)
        header[2:2] = ["", CLEAN_OPTIONS_HELP.rstrip()]
    if command == "delete":
        header[2:2] = ["", DELETE_OPTIONS_HELP.rstrip()]
    if command == "list":
        header[2:2] = ["", LIST_OPTIONS_HELP.rstrip()]
    return "\n".join(header) + "\n" + table


def markdown_table() -> str:
    """The README's Settings table, from the schema (tests/unit/test_settings_doc.py checks
    the README against the schema): `python -c "from dcp_fsdp.config.usage import
    markdown_table; print(markdown_table())"`."""
    lines = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    bar = "\\|"  # a | inside a cell
    for name, type_name, default, text in settings_rows():
        lines.append(f"| `{name}` | {type_name.replace('|', bar)} | `{default}` | "
                     f"{text.replace('|', bar)} |")
    return "\n".join(lines)


PLAN_SETTINGS = (
    ("world_size", "int", "(required)", "ranks of the world to plan"),
    ("ranks_per_node", "int", "min(8, world_size)", "ranks per node; world_size must be a multiple"),
    ("exact", "bool", "false", "build every layer even above 300,000 write items (else a "
                               "subset of the layers, the rest added per layer: docs/plan.md)"),
    ("record", "path", "null", "a run's record (.jsonl) or results directory: project save and "
                               "load times per node count from its per-rank MiB/s"),
)


def plan_help() -> str:
    """`dcp-fsdp plan --help`: the plan's own keys, then a save's settings it reads."""
    from tabulate import tabulate

    own = tabulate([list(row) for row in PLAN_SETTINGS],
                   headers=["setting", "type", "default", "meaning"], tablefmt="simple",
                   disable_numparse=True)
    return (f"usage: dcp-fsdp plan world_size=N [ranks_per_node=K] [record=PATH] [key=value ...]\n"
            f"  {COMMANDS['plan']}\n  nothing starts: no rank, no storage request "
            "(docs/plan.md)\n\nthe plan's own settings:\n" + own + "\n\nand a save's "
            "settings (model=, state=, storage=s3|fs, model.replicas, storage.part_size_mib, "
            "storage.thread_count, storage.prefix_strategy, storage.prefix_count, ...): "
            "dcp-fsdp save --help")
