"""The one parser of `dcp-fsdp` (argparse): a subcommand per command, each naming the function
that runs it (`entry`, imported only then: `--help` and `wait` import no Hydra, no torch). The
settings commands take the arguments no flag takes as Hydra overrides (`args.settings`). A bad
argument is one UserError line naming the command and its --help, not argparse's usage block."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from dcp_fsdp.errors import UserError

# clean-uploads / delete: an upload or incomplete suffix this young may belong to a save still
# writing; left alone unless forced (launch/listing.py).
CLEAN_UPLOADS_MIN_AGE_S = 3600.0
STORAGE_ONLY_COMMANDS = ("list", "clean-uploads", "delete")  # settings of a save; no ranks
SETTINGS = "dcp_fsdp.cli:run_settings"  # the entry of every command of settings but plan
EXAMPLES = """examples:
  dcp-fsdp save-and-load nproc=2
  dcp-fsdp save model=L7b storage.uri=s3://my-bucket/ckpt storage.region=us-east-2 iterations=5
  torchrun --nproc-per-node 8 -m dcp_fsdp save model=L13b storage.uri=s3://my-bucket/ckpt
  dcp-fsdp save -m model=tiny_llama,tiny_gpt2 nproc=2
  dcp-fsdp save-and-load ceiling=true nproc=2     # DCP vs the raw storage, same bytes
  dcp-fsdp tune nproc=2 tune.budget_s=600         # best connector settings, as overrides
  dcp-fsdp report results/ --format md --plot plots/
  dcp-fsdp plan --world-size 1024 --ranks-per-node 8 model=L70b state=model_and_optimizer

settings: dcp-fsdp COMMAND --help lists every setting with its type, default and meaning"""


class CommandArguments(argparse.ArgumentParser):
    """An argparse parser whose errors raise UserError instead of printing usage and exiting.
    `settings`: the arguments no flag takes are settings (else refused). `table`: --help ends
    with the settings table."""

    def __init__(self, *args: Any, settings: bool = False, table: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})
        self.settings = settings
        self.table = table

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("dcp-fsdp").strip()
        raise UserError(f"{command}: " * bool(command) + f"{message} ({self.prog} --help)")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        for arg in args or ():  # before argparse's own errors (`plan world_size=8`)
            self._refuse_option_as_setting(arg)
        parsed, rest = super().parse_known_args(args, namespace)
        if rest and not self.settings:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        for arg in rest:
            if arg.startswith("-"):
                self.error(f"'{arg}': settings are written key=value without dashes, e.g. "
                           f"{arg.lstrip('-').partition('=')[0]}=VALUE")
        return parsed, rest

    def _refuse_option_as_setting(self, arg: str) -> None:
        """`world_size=8`: an option of this command spelt as a setting, named as the option."""
        key, equals, value = arg.partition("=")
        flag = "--" + key.replace("_", "-")
        action = self._option_string_actions.get(flag) if equals and key.isidentifier() else None
        if action is None or flag in ("--help", "--version"):
            return
        spelled = f"{flag} (a switch, no value)" if action.nargs == 0 else f"{flag} {value}"
        self.error(f"{arg}: an option, not a setting; write {spelled}")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """argparse's check of a choice, with the closest one suggested (`sav`: save)."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            from dcp_fsdp.config.validate import did_you_mean

            hint = did_you_mean(str(value), list(action.choices or ()))
            if not hint:
                raise
            raise argparse.ArgumentError(action, error.message + hint) from None

    def format_help(self) -> str:
        if not self.table:
            return super().format_help()
        from dcp_fsdp.config.usage import settings_table

        return (super().format_help() + "\nsettings (key=value; groups: model=PRESET, "
                "storage=s3|fs):\n" + settings_table() + "\n")


def checked(prefix: str, convert: Callable[[str], Any], within: Callable[[Any], bool], fix: str,
            range_fix: str | None = None) -> Callable[[str], Any]:
    """An option's `type=`: the value converted and `within` range, else one UserError line
    "PREFIX VALUE: fix" (`range_fix` for a value that converts but is out of range)."""
    def value(text: str) -> Any:
        try:
            number = convert(text)
        except ValueError:
            raise UserError(f"{prefix}{text}: {fix}") from None
        if not within(number):
            raise UserError(f"{prefix}{text}: {range_fix or fix}")
        return number
    return value


def whole(option: str) -> Callable[[str], int]:
    return checked(f"{option}=", int, lambda count: count >= 1, "give a whole number, 1 or more",
                   "must be 1 or more")


def above_zero(option: str, convert: Callable[[str], Any], fix: str) -> Callable[[str], Any]:
    """A report decision option: a finite number above 0."""
    return checked(f"report: {option} ", convert, lambda number: 0 < number < math.inf, fix)


def bucket_name(name: str) -> str:
    """`s3-server start --bucket`: the S3 bucket-name rules (those of storage.uri)."""
    from dcp_fsdp.config.validate import parse_s3_uri

    try:
        parse_s3_uri(f"s3://{name}")
    except UserError:
        raise UserError(f"s3-server --bucket={name}: not a valid S3 bucket name; use 3-63 "
                        "lowercase letters, digits, dots and hyphens, e.g. --bucket ckpt"
                        ) from None
    return name


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line parsed: `command`, `entry` (module:function), its options, `settings`
    (the key=value overrides, in order). SystemExit(0) once --help or --version has printed."""
    parsed, settings = tree().parse_known_args(argv)
    parsed.settings = settings
    return parsed


def tree() -> CommandArguments:
    from dcp_fsdp import __version__

    top = CommandArguments(prog="dcp-fsdp", settings=True, epilog=EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="A checkpoint I/O benchmark of PyTorch DCP on S3.")
    top.add_argument("-V", "--version", action="version", version=f"dcp-fsdp {__version__}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                  parser_class=CommandArguments)

    def command(name: str, text: str, entry: str = SETTINGS, **kwargs: Any) -> CommandArguments:
        parser: CommandArguments = commands.add_parser(name, help=text, description=text,
                                                       **kwargs)
        parser.set_defaults(entry=entry)
        if kwargs.get("table"):
            parser.set_defaults(check=False, min_age_s=CLEAN_UPLOADS_MIN_AGE_S)
            parser.add_argument("-m", "--multirun", action="store_true",
                                help="a sweep: key=a,b runs a job per value; every job is "
                                     "checked before the first one runs")
            parser.add_argument("--config", action="append", default=[], metavar="FILE",
                                help="settings from a YAML file, before the key=value ones")
        return parser

    runs = {"save": "save checkpoints (iterations=N), print their suffixes",
            "load": "load the checkpoint named by suffix=...",
            "save-and-load": "N x (save, load, bit-exact check): the stress loop",
            "ceiling": "the storage's raw PUT/GET ceiling for this model's shards, no DCP",
            "tune": "search connector settings within tune.budget_s; prints the best as "
                    "overrides"}
    for name, text in runs.items():
        command(name, text, settings=True, table=True)
    command("list", "list checkpoint suffixes under storage.uri / storage.path, and open "
                    "uploads (--check)", settings=True, table=True).add_argument(
        "--check", action="store_true",
        help="read each complete checkpoint's .metadata (screened) and compare the objects it "
             "names with those stored: a missing or short one marks it DAMAGED (exit 1)")
    aged = {"clean-uploads": ("abort open multipart uploads under storage.uri older than 1 h",
                              "abort only uploads started at least this long ago"),
            "delete": ("remove checkpoint suffix=... (complete, or incomplete and older than "
                       "1 h)", "remove an incomplete suffix (an abandoned claim included) "
                               "only when its newest object is at least this old")}
    for name, (text, age) in aged.items():
        either = command(name, text, settings=True, table=True).add_mutually_exclusive_group()
        seconds = checked(f"{name} --min-age-s=", float, lambda age_s: 0 <= age_s < math.inf,
                          "give seconds, a number >= 0 (e.g. --min-age-s 3600), or --force for "
                          + ("every upload" if name == "clean-uploads" else "any age"))
        either.add_argument("--min-age-s", type=seconds, metavar="SECONDS",
                            help=f"{age} (default {CLEAN_UPLOADS_MIN_AGE_S:g}): a younger one "
                                 "may belong to a save still writing")
        either.add_argument("--force", action="store_const", const=0.0, dest="min_age_s",
                            help="whatever its age (a save writing there fails)")
    _wait(command("wait", "hold an allocation doing nothing (batch/waitbatch.sh)",
                  "dcp_fsdp.wait:main"))
    _report(command("report", "tables and plots over records",
                    "dcp_fsdp.analysis.report:run"))
    _s3_server(command("s3-server", "a local S3 server kept up across runs",
                       "dcp_fsdp.launch.s3_server:main"))
    _plan(command("plan", "DCP's save plan for --world-size N ranks, no ranks: objects, "
                          "requests, .metadata, prefixes, memory; --record projects times",
                  "dcp_fsdp.cli:run_plan", settings=True,
                  epilog="and a save's settings (key=value: model=, state=, storage=s3|fs, "
                         "model.replicas, storage.part_size_mib, storage.thread_count, "
                         "storage.prefix_strategy, ...): dcp-fsdp save --help"))
    for parser in commands.choices.values():
        if parser.settings:  # the overrides no option declares, in the usage line too
            parser.usage = parser.format_usage().removeprefix("usage: ").strip() \
                + " [key=value ...]"
    return top


def _wait(wait: CommandArguments) -> None:
    wait.description = ("Hold the allocation for --duration with next to no CPU, print a "
                        "heartbeat every --heartbeat, exit 0 when the time is up or on "
                        "SIGTERM/SIGINT (scancel).")
    wait.add_argument("--duration", default="2m",
                      help="with a unit: 90s, 2m, 1h30m, 1.5h, 2d, or forever (until "
                           "signalled); default 2m")
    wait.add_argument("--heartbeat", default="1m",
                      help="the same units (default 1m); 0 turns heartbeats off")


def _s3_server(server: CommandArguments) -> None:
    server.epilog = "state and data: $XDG_RUNTIME_DIR/dcp-fsdp-s3 (else ~/.cache/dcp-fsdp-s3)"
    actions = server.add_subparsers(dest="action", required=True, metavar="ACTION",
                                    parser_class=CommandArguments)
    start = actions.add_parser(
        "start", help="start a local SeaweedFS S3 server that stays up across runs")
    start.add_argument("--bucket", type=bucket_name, default="dcp-fsdp",
                       help="the bucket to create (default dcp-fsdp)")
    actions.add_parser("status", help="say whether it is up, and where")
    actions.add_parser("env", help="print its settings as export lines: "
                                   "eval \"$(dcp-fsdp s3-server env)\"")
    stop = actions.add_parser("stop", help="stop it and delete its data (refused while a run "
                                           "uses it, unless --force)")
    stop.add_argument("--force", action="store_true",
                      help="stop it even while a run uses it (the run fails)")
    serve = actions.add_parser("serve")  # the daemon `start` runs: no help, not listed
    serve.add_argument("state_dir")
    serve.add_argument("--bucket", type=bucket_name, required=True)


def _plan(plan: CommandArguments) -> None:
    plan.add_argument("--world-size", type=whole("--world-size"), required=True, metavar="N",
                      help="ranks of the world to plan")
    plan.add_argument("--ranks-per-node", type=whole("--ranks-per-node"), metavar="K",
                      help="ranks per node (default min(8, N)); N must be a multiple")
    plan.add_argument("--exact", action="store_true",
                      help="build every layer even above 300,000 write items (else a subset "
                           "of the layers, the rest added per layer: docs/plan.md)")
    plan.add_argument("--record", metavar="PATH",
                      help="a run's record (.jsonl) or results directory: project save and "
                           "load times per node count from its per-rank MiB/s")


def _report(report: CommandArguments) -> None:
    report.description = ("Tables (and plots) over run records, grouped by node count, world "
                          "size, model, operation, storage and every setting that differs "
                          "between runs.")
    report.add_argument("paths", nargs="*", default=["results"],
                        help="record files (read whatever their name), directories "
                             "(searched recursively) or globs; these two take *.jsonl "
                             "(default: results)")
    report.add_argument("--format", choices=("table", "md", "csv"), default="table",
                        help="table: terminal; md: Markdown; csv: the wide group table")
    report.add_argument("--columns", choices=("compact", "all"), default="compact",
                        help="table: compact (fits the terminal width) or all columns")
    report.add_argument("--wide", action="store_const", const="all", dest="columns",
                        help="the same as --columns all")
    report.add_argument("--csv", metavar="FILE", help="also write the wide group table as CSV")
    report.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    decide = report.add_argument_group(
        "decisions", "how often to checkpoint, the training time it costs, and dollars, from "
                     "the records' own figures (docs/decisions.md)")
    decide.add_argument("--node-mtbf-hours", metavar="H",
                        type=above_zero("--node-mtbf-hours", float, "give a number of hours above 0"),
                        help="mean time between failures of one node, hours (e.g. 6000)")
    count_fix = "give a whole number, 1 or more"
    decide.add_argument("--nodes", type=above_zero("--nodes", int, count_fix), metavar="N",
                        help="nodes of the training job (default: each run's node count)")
    decide.add_argument("--interval-minutes", metavar="X",
                        type=above_zero("--interval-minutes", float, "give a number of minutes above 0"),
                        help="also price and cost a checkpoint every X minutes")
    decide.add_argument("--keep", type=above_zero("--keep", int, count_fix), default=1, metavar="K",
                        help="checkpoints kept in storage (default 1)")
    decide.add_argument("--prices", metavar="FILE",
                        help="prices YAML (default: S3 Standard us-east-1 list prices, "
                             "conf/prices/s3-standard-us-east-1.yaml)")
