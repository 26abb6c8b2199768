"""One parser for every command's flags (dcp_fsdp/config/arguments.py): the settings pass
through in their order, each command takes only its own flags, and a bad flag or value is
one UserError line naming the command and the fix, never argparse's usage block."""

from __future__ import annotations

import pytest

from dcp_fsdp.config.arguments import CommandArguments, settings_line
from dcp_fsdp.errors import UserError


def test_settings_pass_through_in_order_with_the_flags_taken_out():
    line = settings_line("save", ["model=L7b", "-m", "nproc=1,2", "--config", "a.yaml",
                                  "iterations=3", "--config=b.yaml"])
    assert line.settings == ["model=L7b", "nproc=1,2", "iterations=3"]
    assert line.multirun and line.config_files == ["a.yaml", "b.yaml"]
    assert (line.check, line.min_age_s) == (False, None)


def test_list_takes_check_and_the_aged_commands_take_their_age():
    assert settings_line("list", ["storage.uri=s3://b/p", "--check"]).check
    assert settings_line("clean-uploads", ["--min-age-s", "8"]).min_age_s == 8.0
    assert settings_line("delete", ["suffix=x", "--min-age-s=0.5"]).min_age_s == 0.5
    assert settings_line("delete", ["--min-age-s", "8", "--force"]).min_age_s == 0.0
    assert settings_line("clean-uploads", []).min_age_s is None  # the command's default


@pytest.mark.parametrize("command, flag", [("save", "--check"), ("list", "--force"),
                                           ("load", "--min-age-s"), ("save", "--nproc"),
                                           ("clean-uploads", "--min")])  # no abbreviations
def test_a_flag_the_command_does_not_take_stays_for_the_settings_check_to_name(command, flag):
    # (cli.py refuses it by name: "'--nproc': settings are written key=value without dashes")
    assert flag in settings_line(command, ["nproc=2", flag]).settings


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan", ""])
def test_a_bad_age_is_one_line_with_the_fix(value):
    with pytest.raises(UserError) as refused:
        settings_line("clean-uploads", [f"--min-age-s={value}"])
    assert str(refused.value) == (f"clean-uploads --min-age-s={value}: give seconds, a number "
                                  ">= 0 (e.g. --min-age-s 3600), or --force for every upload")


def test_a_flag_without_its_value_names_the_command_and_its_help():
    with pytest.raises(UserError) as refused:
        settings_line("save", ["model=L7b", "--config"])
    assert str(refused.value) == ("save: argument --config: expected one argument "
                                  "(dcp-fsdp save --help)")


def test_errors_never_print_usage_or_exit(capsys):
    parser = CommandArguments("report", help_flag=True)
    parser.add_argument("--format", choices=("table", "csv"))
    with pytest.raises(UserError, match=r"^report: argument --format: invalid choice: 'x'"):
        parser.parse_args(["--format", "x"])
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("args, message", [
    (["start", "--force"], "s3-server start: unexpected '--force'"),
    (["stop", "bucket=x"], "s3-server stop: unexpected 'bucket=x'"),
    (["bogus"], "s3-server bogus: unknown action"),
    (["start", "bucket=Not_Valid"], "s3-server bucket=Not_Valid: not a valid S3 bucket name"),
    (["stop", "--bogus"], "s3-server: unrecognized arguments: --bogus (dcp-fsdp s3-server --help)"),
])
def test_s3_server_refuses_what_its_action_does_not_take(args, message):
    from dcp_fsdp.launch.s3_server import main

    with pytest.raises(UserError) as refused:
        main(args)
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
