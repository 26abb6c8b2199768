"""Whether one line of a record file can be read: the field types of telemetry.records.

A record file may be cut off, hand-edited, copied from another tool or written by a newer
version; a reader must not crash on it nor let a nonsensical number (a string, NaN, a
negative byte count) into a figure. Each check returns why a line cannot be read, or None.
The reason names the field but not its value, so that many bad lines share one reason
(the report prints one line per reason, with a count).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, Union

# Numeric sample fields that may be negative: a ratio to a baseline minus 1, and time lost
# against a baseline (noise can put either below zero). Every other number in a record is a
# count, a size, a duration or a clock reading, never below zero.
SIGNED_FIELDS = frozenset({"train_step_slowdown", "train_lost_s", "train_lost_share"})
# Nested run fields the report turns into group labels: text (or absent), each part of the
# path an object (or absent), nothing else.
RUN_TEXT_PATHS = ("model.preset", "gpus.model", "storage.kind", "storage.endpoint",
                  "storage.region", "config.model.preset", "config.storage.kind",
                  "config.storage.endpoint", "config.storage.region")
# No count, size, duration or clock reading in a record reaches it.
MAX_MAGNITUDE = 2**63
# The pairs of clock readings whose difference is a span in the figures.
SPANS = (("begin_wall_s", "end_wall_s"), ("begin_mono_s", "end_mono_s"))


@dataclasses.dataclass(frozen=True)
class FieldType:
    """What a field may hold: one JSON kind (int, float, str, list, dict), maybe null."""

    kind: type
    optional: bool
    required: bool  # no default in the dataclass: a line without it cannot be read


def field_types(cls: type) -> dict[str, FieldType]:
    """Each dataclass field's JSON kind, from its annotation (`int`, `float | None`, ...)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        members = (typing.get_args(annotation)
                   if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,))
        kinds = [typing.get_origin(m) or m for m in members if m is not type(None)]
        required = (field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING)
        kind = kinds[0] if isinstance(kinds[0], type) else object  # Any: anything goes
        found[field.name] = FieldType(kind, type(None) in members, required)
    return found


def _number_problem(name: str, value: object, integer: bool) -> str | None:
    # JSON has one number type; bool is an int to Python but never a count or a time
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} is not {'an integer' if integer else 'a number'}"
    if integer and not isinstance(value, int):
        return f"{name} is not an integer"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} is not a finite number"
    # JSON integers have no bound: a 401-digit one cannot even become a float (OverflowError),
    # and nothing a run measures comes near 2**63 (pandas' int64 holds no more)
    if abs(value) >= MAX_MAGNITUDE:
        return f"{name} is out of range (2**63 or more)"
    if value < 0 and name not in SIGNED_FIELDS:
        return f"{name} is negative"
    return None


_KIND_NAMES: dict[type, str] = {str: "text", list: "a list", dict: "an object"}


def _kind_problem(name: str, value: object, expected: FieldType) -> str | None:
    if value is None:
        return None if expected.optional else f"{name} is null"
    if expected.kind in (int, float):
        return _number_problem(name, value, integer=expected.kind is int)
    if not isinstance(value, expected.kind):
        return f"{name} is not {_KIND_NAMES.get(expected.kind, expected.kind.__name__)}"
    return None


def fields_problem(row: dict[str, Any], expected: dict[str, FieldType]) -> str | None:
    """The first field of `row` that is missing or of the wrong kind; unknown keys (a newer
    writer's fields) are not looked at."""
    for name, field_type in expected.items():
        if name not in row:
            if field_type.required:
                return f"no {name}"
            continue
        problem = _kind_problem(name, row[name], field_type)
        if problem:
            return problem
    return None


def sample_problem(row: dict[str, Any], expected: dict[str, FieldType]) -> str | None:
    """Why a `"record": "sample"` line cannot enter a figure, or None."""
    problem = fields_problem(row, expected)
    if problem:
        return problem
    for begin, end in SPANS:
        if row[end] < row[begin]:
            return f"{end} before {begin}"
    return None


def _text_path_problem(row: dict[str, Any], dotted: str) -> str | None:
    names = dotted.split(".")
    value: Any = row
    for depth, name in enumerate(names):
        if not isinstance(value, dict):
            return f"{'.'.join(names[:depth])} is not an object"
        value = value.get(name)
        if value is None:
            return None
    return None if isinstance(value, str) else f"{dotted} is not text"


def run_problem(row: dict[str, Any], expected: dict[str, FieldType],
                init_expected: dict[str, FieldType]) -> str | None:
    """Why a `"record": "run"` line cannot be read, or None."""
    if not isinstance(row.get("run_id"), str) or not row["run_id"]:
        return "no run_id"
    problem = fields_problem(row, expected)
    if problem:
        return problem
    for dotted in RUN_TEXT_PATHS:
        problem = _text_path_problem(row, dotted)
        if problem:
            return problem
    for init_row in row.get("init") or []:
        problem = (fields_problem(init_row, init_expected) if isinstance(init_row, dict)
                   else "an init entry is not an object")
        if problem:
            return f"init: {problem}"
    return None


# No line this tool writes nests deeper than a few levels (a sample's request summaries);
# a deeper one is not a record line, and what reads rows (asdict, pandas) recurses per level.
MAX_LINE_DEPTH = 32


def _nested_deeper(value: Any, levels: int = MAX_LINE_DEPTH) -> bool:
    """Whether containers in `value` nest more than `levels` deep (a bounded recursion)."""
    if not isinstance(value, (dict, list)):
        return False
    if levels == 0:
        return True
    items = value.values() if isinstance(value, dict) else value
    return any(_nested_deeper(item, levels - 1) for item in items)


def parse_line(text: str) -> tuple[Any, str]:
    """(the line's JSON value, "") or (None, why it cannot be read): not JSON, or nested too
    deep (deeper than the parser goes, RecursionError, or than any record line:
    MAX_LINE_DEPTH; walked only where the line has enough brackets to be)."""
    try:
        row = json.loads(text)
    except ValueError:
        return None, "not JSON"
    except RecursionError:
        return None, "nested too deeply"
    if text.count("{") + text.count("[") > MAX_LINE_DEPTH and _nested_deeper(row):
        return None, "nested too deeply"
    return row, ""
