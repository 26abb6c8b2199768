"""The flags of every command, by one parser (argparse): the settings commands' `-m` and
`--config FILE`, `list --check`, `clean-uploads` / `delete` `--min-age-s N` and `--force`,
`s3-server ACTION [bucket=NAME] [--force]`, `report`'s options and the batch scripts' own
`after_job`. A bad flag or value is one line naming the command and the fix (UserError:
exit 2), never argparse's usage block; the settings (key=value) pass through in order.
`wait` takes settings only (key=value, dcp_fsdp/wait.py)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from dcp_fsdp.errors import UserError

# The commands with an age below which an open upload or incomplete suffix is left alone.
AGED_COMMANDS = ("clean-uploads", "delete")


class CommandArguments(argparse.ArgumentParser):
    """argparse for `dcp-fsdp COMMAND`: its errors raise UserError (one line naming the
    command, exit 2 where the CLI prints it) instead of printing usage and exiting. No
    `--help` of argparse's unless asked (`help_flag=True`): the tool's own pages say more."""

    def __init__(self, command: str, help_flag: bool = False, prog: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(prog=prog or f"dcp-fsdp {command}", add_help=help_flag,
                         allow_abbrev=False, **kwargs)
        self.command = command

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.command}: {message} ({self.prog} --help)")


@dataclass
class SettingsLine:
    """A settings command's arguments: the settings (key=value, in their order, and anything
    else the command's flags do not take: the settings' check refuses it by name) and flags."""

    settings: list[str]
    multirun: bool = False
    config_files: list[str] = field(default_factory=list)
    check: bool = False  # list --check
    min_age_s: float | None = None  # clean-uploads / delete: --min-age-s, or 0 with --force


def settings_line(command: str, args: list[str]) -> SettingsLine:
    """The flags of a settings command (`save`, `list`, `delete`, ...) and its settings."""
    parser = CommandArguments(command)
    parser.add_argument("-m", "--multirun", action="store_true")
    parser.add_argument("--config", action="append", default=[], metavar="FILE")
    if command == "list":
        parser.add_argument("--check", action="store_true")
    if command in AGED_COMMANDS:
        parser.add_argument("--min-age-s", type=seconds_for(command), default=None)
        parser.add_argument("--force", action="store_true")
    flags, settings = parser.parse_known_args(args)
    min_age_s = 0.0 if getattr(flags, "force", False) else getattr(flags, "min_age_s", None)
    return SettingsLine(settings, flags.multirun, flags.config, getattr(flags, "check", False),
                        min_age_s)


def seconds_for(command: str) -> Callable[[str], float]:
    """`--min-age-s`'s value: seconds, a number >= 0 (UserError naming the fix otherwise)."""
    def seconds(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not number >= 0 or math.isinf(number):
            raise UserError(f"{command} --min-age-s={value}: give seconds, a number >= 0 "
                            "(e.g. --min-age-s 3600), or --force for "
                            + ("every upload" if command == "clean-uploads" else "any age"))
        return number
    return seconds
