"""docs/record-format.md names every field of the record models and no other: its field
list is generated from them (`python -m tests.unit.test_record_format_doc` rewrites it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from dcp_fsdp.telemetry import records

DOC = Path(__file__).resolve().parents[2] / "docs" / "record-format.md"
BEGIN, END = "<!-- fields: generated from telemetry/records.py -->", "<!-- end of fields -->"


def field_list() -> str:
    """One line per model: its name and its fields, in the order a line holds them."""
    models = [value for value in vars(records).values() if isinstance(value, type)
              and issubclass(value, BaseModel) and value.__module__ == records.__name__
              and value.model_fields]
    return "\n".join(f"- `{model.__name__}`: " + ", ".join(f"`{name}`" for name in model.model_fields)
                     for model in models)


def _documented() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def test_the_doc_lists_every_field_of_the_models_and_no_other():
    assert _documented() == field_list(), "run python -m tests.unit.test_record_format_doc"


if __name__ == "__main__":
    text = DOC.read_text()
    DOC.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + field_list() + "\n"
                   + text[text.index(END):])
