"""Settings are documented once, in config/schema.py: docs/settings.md's table must list
exactly the schema's settings with the same defaults, and every `setting=value` example in
the README, docs/ and the batch scripts must name a real setting (with a valid choice for enums)."""

from __future__ import annotations

import re
from pathlib import Path

from dcp_fsdp.config.usage import markdown_table, settings_rows

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SETTINGS_DOC = REPO / "docs" / "settings.md"


def readme_settings_table() -> dict[str, str]:
    """{setting: default} from the first table of docs/settings.md."""
    section = SETTINGS_DOC.read_text()
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
    assert "setting" in header and "default" in header, header
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        name = cells[header.index("setting")].strip("`")
        assert name not in rows, f"{name} is in docs/settings.md's table twice"
        rows[name] = cells[header.index("default")].strip("`")
    return rows


def test_readme_settings_table_matches_the_schema():
    documented = readme_settings_table()
    schema = {name: default for name, _, default, _ in settings_rows()}
    missing = sorted(set(schema) - set(documented))
    extra = sorted(set(documented) - set(schema))
    assert not missing, f"settings missing from docs/settings.md: {missing}"
    assert not extra, f"docs/settings.md lists settings the schema lacks: {extra}"
    wrong = {name: (documented[name], schema[name]) for name in schema
             if documented[name] != schema[name]}
    assert not wrong, f"docs/settings.md default != schema default (doc, schema): {wrong}"


def test_readme_settings_table_is_the_generated_one():
    """Type and meaning too: the table is markdown_table()'s output, verbatim."""
    assert markdown_table() in SETTINGS_DOC.read_text(), (
        "regenerate docs/settings.md's table: python -c \"from dcp_fsdp.config.usage "
        "import markdown_table; print(markdown_table())\"")


def test_examples_in_the_readme_and_batch_scripts_use_valid_choices():
    """e.g. `state=full` (not a choice: model, model_and_optimizer) once drifted in."""
    choices = {name: type_name.split("|") for name, type_name, _, _ in settings_rows()
               if "|" in type_name}
    sources = [README, *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "batch").glob("*.sh"))]
    bad = []
    for path in sources:
        text = path.read_text()
        if path.name in ("2026-11-23-bad-input-trial.md",  # trials of wrong values, on purpose
                         "2026-11-25-cluster-trial.md"):
            continue
        if path.name == "reliability.md":  # the bad-input table shows wrong values on purpose
            text = re.sub(r"### Bad input.*?(\n## |\Z)", "", text, flags=re.S)
        for name, value in re.findall(r"(?<![\w.$])([a-z_]+(?:\.[a-z_]+)*)=([A-Za-z0-9_.-]+)",
                                      text):
            value = value.rstrip(".")  # the end of a sentence, not of the value
            valid = choices.get(name)
            if valid and value not in valid and not value.isupper():  # NAME: a placeholder
                bad.append(f"{path.name}: {name}={value} (choose from {', '.join(valid)})")
    assert not bad, bad


def doc_command_lines(text: str) -> list[str]:
    """The arguments of each `dcp-fsdp ...` (or `-m dcp_fsdp ...`) command line of a page: in
    its code blocks (continuation lines joined, comments cut) and in its inline code; <...>
    placeholders read as one word. Synopses ([optional], ..., CAPITALS for a value) are left
    out: they name forms, not commands; so is a command's name alone in inline code."""
    text = re.sub(r"<[^<>\n]*>", "X", text)
    found = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.search(r"(?:^|\s)(?:dcp-fsdp|-m dcp_fsdp)\s+([^#]*)", line)
            if command and not line.lstrip().startswith("[dcp-fsdp]"):  # output, not input
                found.append(re.split(r"\s(?:\||&&|;)\s", command.group(1))[0])  # one command
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        command = re.match(r"(?:dcp-fsdp|python -m dcp_fsdp)\s+(\S+\s+\S.*)",
                           span.replace("\n", " "))
        if command:  # (a command's name alone, `dcp-fsdp plan`, names it: not a line)
            found.append(command.group(1))
    return [line for line in found if not re.search(r"\[|\.\.\.|(?<![\w.=/-])[A-Z]+\b(?!=)", line)]


def test_every_command_line_in_the_docs_parses():
    """Issue 48 item 1's fallout: the one parser changed plan's, wait's and s3-server's options
    (--world-size, --exact, --duration, --bucket) and docs kept the old key=value forms. Each
    command line the README and docs/ show must pass the parser and name real settings."""
    import shlex

    from dcp_fsdp.config.arguments import parse
    from dcp_fsdp.config.compose import check_overrides, expand_sweeps
    from dcp_fsdp.errors import UserError

    bad, checked = [], 0
    for path in [README, *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        if path.name == "reliability.md":  # the bad-input table shows wrong input on purpose
            text = re.sub(r"### Bad input.*?(\n## |\Z)", "", text, flags=re.S)
        for line in doc_command_lines(text):
            args = shlex.split(line)
            if not args or {"-h", "--help", "-V", "--version"} & set(args):
                continue
            try:
                parsed = parse(args)
                jobs = expand_sweeps(parsed.settings) if getattr(parsed, "multirun", False) \
                    else [parsed.settings]
                check_overrides(jobs[0])
            except UserError as error:
                bad.append(f"{path.name}: dcp-fsdp {line.strip()}: {error}")
            checked += 1
    assert not bad, "\n".join(bad)
    assert checked > 40, checked  # the extraction still finds the pages' commands
