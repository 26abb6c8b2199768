"""The settings table of `dcp-fsdp COMMAND --help` and docs/settings.md, rendered from the
schema (the one place settings are described)."""

from __future__ import annotations

from typing import Any

import yaml
from tabulate import tabulate

from dcp_fsdp.config.conf_dir import conf_dir
from dcp_fsdp.config.schema import format_default, iter_settings


def settings_rows() -> list[tuple[str, str, str, str]]:
    """(setting, type, default, meaning) for every user setting, schema order."""
    return [(name, type_name, format_default(effective_default(name, default)), text)
            for name, type_name, default, text in iter_settings()]


def effective_default(name: str, default: Any) -> Any:
    """A group's member (model.preset) has no schema default: conf/config.yaml's defaults
    list chooses it (model: tiny_llama)."""
    if format_default(default) != "(required)":
        return default
    with open(conf_dir() / "config.yaml") as source:
        choices = {key: value for entry in yaml.safe_load(source)["defaults"]
                   if isinstance(entry, dict) for key, value in entry.items()}
    return choices.get(name.split(".")[0], default)


def settings_table() -> str:
    """The settings table of a settings command's --help (config/arguments.py)."""
    return tabulate(settings_rows(),
                    headers=["setting", "type", "default", "meaning"], tablefmt="simple",
                    maxcolwidths=[None, 24, 14, 60], disable_numparse=True)


def markdown_table() -> str:
    """docs/settings.md's table, from the schema (tests/unit/test_settings_doc.py checks it)."""
    lines = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    bar = "\\|"  # a | inside a cell
    for name, type_name, default, text in settings_rows():
        lines.append(f"| `{name}` | {type_name.replace('|', bar)} | `{default}` | "
                     f"{text.replace('|', bar)} |")
    return "\n".join(lines)
