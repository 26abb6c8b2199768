"""One parser for every command (dcp_fsdp/config/arguments.py): a subcommand each, the
settings pass through in their order, each command takes only its own flags, and a bad flag
or value is one UserError line naming the command and the fix, never argparse's usage block."""

from __future__ import annotations

import pytest

from dcp_fsdp import cli
from dcp_fsdp.config.arguments import CLEAN_UPLOADS_MIN_AGE_S, parse
from dcp_fsdp.errors import UserError

COMMANDS = ["save", "load", "save-and-load", "ceiling", "tune", "list", "clean-uploads",
            "delete", "wait", "report", "s3-server", "plan"]


def test_settings_pass_through_in_order_with_the_flags_taken_out():
    args = parse(["save", "model=L7b", "-m", "nproc=1,2", "--config", "a.yaml", "iterations=3",
                  "--config=b.yaml"])
    assert args.settings == ["model=L7b", "nproc=1,2", "iterations=3"]
    assert args.multirun and args.config == ["a.yaml", "b.yaml"]
    assert (args.check, args.min_age_s) == (False, CLEAN_UPLOADS_MIN_AGE_S)


def test_list_takes_check_and_the_aged_commands_take_their_age():
    assert parse(["list", "storage.uri=s3://b/p", "--check"]).check
    assert parse(["clean-uploads", "--min-age-s", "8"]).min_age_s == 8.0
    assert parse(["delete", "suffix=x", "--min-age-s=0.5"]).min_age_s == 0.5
    assert parse(["delete", "--force", "suffix=x"]).min_age_s == 0.0
    assert parse(["clean-uploads"]).min_age_s == CLEAN_UPLOADS_MIN_AGE_S
    with pytest.raises(UserError, match="argument --force: not allowed with argument --min-age-s"):
        parse(["delete", "--min-age-s", "8", "--force"])


@pytest.mark.parametrize("command, flag", [("save", "--check"), ("list", "--force"),
                                           ("load", "--min-age-s"), ("save", "--nproc"),
                                           ("clean-uploads", "--min")])  # no abbreviations
def test_a_flag_the_command_does_not_take_is_refused_as_a_dashed_setting(command, flag):
    with pytest.raises(UserError) as refused:
        parse([command, "nproc=2", flag])
    assert str(refused.value) == (f"{command}: '{flag}': settings are written key=value without "
                                  f"dashes, e.g. {flag.lstrip('-')}=VALUE (dcp-fsdp {command} "
                                  "--help)")


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan", ""])
def test_a_bad_age_is_one_line_with_the_fix(value):
    with pytest.raises(UserError) as refused:
        parse(["clean-uploads", f"--min-age-s={value}"])
    assert str(refused.value) == (f"clean-uploads --min-age-s={value}: give seconds, a number "
                                  ">= 0 (e.g. --min-age-s 3600), or --force for every upload")


def test_a_flag_without_its_value_names_the_command_and_its_help():
    with pytest.raises(UserError) as refused:
        parse(["save", "model=L7b", "--config"])
    assert str(refused.value) == ("save: argument --config: expected one argument "
                                  "(dcp-fsdp save --help)")


def test_errors_never_print_usage_or_exit(capsys):
    with pytest.raises(UserError, match=r"^report: argument --format: invalid choice: 'x'"):
        parse(["report", "--format", "x"])
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_command_s_help_is_argparse_s_from_the_one_tree(command, capsys):
    assert cli.main([command, "--help"] if command else ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dcp-fsdp {command}".rstrip()), out[:200]
    assert ("\nsettings (key=value" in out) == (command in COMMANDS[:8]), out  # with the table
    if not command:
        assert all(f"\n    {name} " in out or f"\n    {name}\n" in out for name in COMMANDS)


def test_an_unknown_command_is_one_line_naming_the_closest(capsys):
    assert cli.main(["sav", "nproc=2"]) == 2
    captured = capsys.readouterr()
    line = captured.err.strip()
    assert captured.out == "" and "\n" not in line, captured
    assert line.startswith("dcp-fsdp: error: argument COMMAND: invalid choice: 'sav'"), line
    assert line.endswith("; did you mean save? (dcp-fsdp --help)"), line


@pytest.mark.parametrize("args, message", [
    (["plan", "--world-size", "8", "--exact=maybe"],
     "plan: argument --exact: ignored explicit argument 'maybe' (dcp-fsdp plan --help)"),
    # the key=value spellings of the options before the one parser: the option named
    (["plan", "--world-size", "8", "exact=maybe"],
     "plan: exact=maybe: an option, not a setting; write --exact (a switch, no value) "
     "(dcp-fsdp plan --help)"),
    (["plan", "model=L7b", "world_size=64", "ranks_per_node=8"],
     "plan: world_size=64: an option, not a setting; write --world-size 64"),
    (["plan", "--world-size", "8", "record=results/"],
     "plan: record=results/: an option, not a setting; write --record results/"),
    (["wait", "heartbeat=5m"], "wait: heartbeat=5m: an option, not a setting; write --heartbeat 5m"),
    (["s3-server", "start", "bucket=ckpt"],
     "s3-server start: bucket=ckpt: an option, not a setting; write --bucket ckpt "
     "(dcp-fsdp s3-server start --help)"),
    (["delete", "suffix=x", "force=true"], "delete: force=true: an option, not a setting; write --force"),
    (["plan", "--ranks-per-node", "8"],
     "plan: the following arguments are required: --world-size (dcp-fsdp plan --help)"),
    (["plan", "--world-size", "many"], "--world-size=many: give a whole number, 1 or more"),
    (["wait", "duration=2m"], "wait: duration=2m: an option, not a setting; write --duration 2m "
                              "(dcp-fsdp wait --help)"),
    (["wait", "duration_min=2"], "wait: unrecognized arguments: duration_min=2 (dcp-fsdp wait --help)"),
    (["wait", "--duration", "5"], "--duration=5: give a unit, e.g. --duration=5m (minutes)"),
    (["wait", "--duration=99999d"], "--duration=99999d: more than a year; use --duration forever"),
    (["wait", "--heartbeat", "0.001s"], "--heartbeat=0.001s: too often"),
])
def test_a_bad_option_is_one_line_naming_it(args, message, capsys):
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    line = captured.err.strip()
    assert captured.out == "" and "\n" not in line, captured
    assert line.startswith(f"dcp-fsdp: error: {message}") or message in line, line


def test_plans_exact_is_a_real_boolean():
    assert parse(["plan", "--world-size", "8", "--exact", "model=L7b"]).exact is True
    plain = parse(["plan", "--world-size", "8", "model=L7b"])
    assert plain.exact is False and plain.settings == ["model=L7b"]


@pytest.mark.parametrize("args, message", [
    (["start", "--force"], "s3-server start: unrecognized arguments: --force"),
    (["stop", "--bucket", "x"], "s3-server stop: unrecognized arguments: --bucket x"),
    (["bogus"], "s3-server: argument ACTION: invalid choice: 'bogus'"),
    (["start", "--bucket", "Not_Valid"], "s3-server --bucket=Not_Valid: not a valid S3 bucket name"),
    (["stop", "--bogus"], "s3-server stop: unrecognized arguments: --bogus "
                          "(dcp-fsdp s3-server stop --help)"),
])
def test_s3_server_refuses_what_its_action_does_not_take(args, message):
    with pytest.raises(UserError) as refused:
        parse(["s3-server", *args])
    assert str(refused.value).startswith(message)


def test_report_and_after_job_say_a_bad_flag_in_one_line(capsys, tmp_path):
    from dcp_fsdp.analysis.report import main as report_main
    from dcp_fsdp.launch.after_job import main as after_job_main

    assert report_main([str(tmp_path), "--format", "xml"]) == 2
    assert after_job_main(["--job-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and not any("usage:" in line for line in err), err
    assert err[0].startswith("dcp-fsdp: error: report: argument --format: invalid choice: 'xml'")
    assert "after_job: the following arguments are required: --step-exit" in err[1]


@pytest.mark.parametrize("command", ["list", "clean-uploads", "delete"])
def test_the_storage_commands_refusals_name_the_command_as_typed(command):
    """They compose a save's settings; a refusal that names the command said '(not save)'."""
    with pytest.raises(UserError) as refused:
        cli.prepare(command, ["protocol=mlperf"])
    assert f"(not {command})" in str(refused.value), refused.value
