"""The report's tables as text: terminal (fit to a width), Markdown, or the wide CSV
(docs/report.md "Fitting the terminal")."""

from __future__ import annotations

import textwrap
from typing import Any

import pandas as pd
from tabulate import tabulate

from dcp_fsdp.analysis import columns as cols
from dcp_fsdp.analysis.columns import Column, cell
from dcp_fsdp.analysis.run_summary import MLPERF_DIFFERENCE, mlperf_op_lines
from dcp_fsdp.telemetry.figures import ceiling_lines, mlperf_shortfall

DEFAULT_WIDTH = 100  # when the output is not a terminal
KEY_CELL_MAX = 18  # characters of a group key's value in the compact view
KEY_HEADER_MAX = 14
# the storage labels' short forms in the compact view
STORAGE_SHORT = {"s3 (embedded SeaweedFS)": "s3 embedded"}


def key_cell(value: Any) -> str:
    """A group key's value as text: blank where unknown, a whole float without its ".0"."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else cell(value, "s")


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "~"


def _column_cells(frame: pd.DataFrame, column: Column) -> list[str]:
    names = column.names if isinstance(column.names, tuple) else (column.names,)
    parts = [[cell(row.get(name), column.spec) for name in names] for _, row in frame.iterrows()]
    return ["/".join(cells) if any(cells) else "" for cells in parts]


def _key_headers(keys: list[str]) -> dict[str, str]:
    """Settings by their last name part (two parts where that is ambiguous), shortened."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    headers = {}
    for key, short in zip(keys, last):
        if last.count(short) > 1:
            short = ".".join(key.split(".")[-2:])
        headers[key] = _shorten(short, KEY_HEADER_MAX)
    return headers


def _compact_text(headers: list[str], columns: list[list[str]]) -> str:
    """tabulate's "simple" table without the two spaces it pads each header with (its
    module-wide MIN_PADDING, which no call can set): the headers as a "plain" row."""
    rows = list(zip(*columns))
    lines = tabulate([headers, *rows], tablefmt="plain", disable_numparse=True).split("\n")
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    return "\n".join([lines[0], "  ".join("-" * width for width in widths), *lines[1:]])


def full_table(frame: pd.DataFrame, keys: list[str], columns: list[Column], tablefmt: str
               ) -> str:
    """Every key and every column (--wide, Markdown)."""
    cells = [[key_cell(v) for v in frame[k]] for k in keys]
    cells += [_column_cells(frame, c) for c in columns]
    return tabulate(list(zip(*cells)), headers=[*keys, *(c.header for c in columns)],
                    tablefmt=tablefmt, disable_numparse=True)


def compact_table(frame: pd.DataFrame, keys: list[str], columns: list[Column], width: int
                  ) -> tuple[str, list[str]]:
    """The terminal view of one table within `width` characters; and the headers dropped
    to fit (columns empty in every row are not counted: they have nothing to show)."""
    headers = _key_headers(keys)
    key_headers = [headers[k] for k in keys]
    key_cells = [[_shorten(STORAGE_SHORT.get(key_cell(v), key_cell(v)), KEY_CELL_MAX)
                  for v in frame[k]] for k in keys]
    shown = [(column, _column_cells(frame, column)) for column in columns if column.compact is not None]
    shown = [(column, cells) for column, cells in shown if any(cells)]
    dropped: list[str] = []
    while True:
        text = _compact_text(key_headers + [c.header for c, _ in shown],
                             key_cells + [cells for _, cells in shown])
        if max(map(len, text.splitlines()), default=0) <= width or not shown:
            return text, dropped
        # the least important column goes first; of equals, the rightmost
        worst = max(range(len(shown)), key=lambda i: (shown[i][0].compact, i))
        dropped.append(shown.pop(worst)[0].header)


LEGEND_KEY = "group"  # the compact view's column that stands for many group keys
KEPT_RANK = 1  # throughput columns of this compact rank or better are never dropped for keys


def _key_values(frame: pd.DataFrame, keys: list[str]) -> list[tuple[str, ...]]:
    """Each row's group key values as shown, op left out: what the legend names."""
    rest = frame[[k for k in keys if k != "op"]]
    return [tuple(key_cell(v) for v in values) for values in rest.itertuples(index=False)]


def _legend(frame: pd.DataFrame, keys: list[str], width: int) -> dict[tuple, str] | None:
    """{group's key values (op left out): "g1", ...} when, with the keys as columns, the
    throughput table would drop its main figures to fit `width`; else None (keys stay)."""
    if set(keys) <= {"op"}:
        return None
    _, dropped = compact_table(frame, keys, cols.THROUGHPUT, width)
    main = {c.header for c in cols.THROUGHPUT if c.compact is not None and c.compact <= KEPT_RANK}
    if not main.intersection(dropped):
        return None
    return {values: f"g{n}" for n, values in enumerate(dict.fromkeys(_key_values(frame, keys)), 1)}


def _differing_keys(result: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(group keys that differ between the groups, "key=value" of those all groups share)."""
    table = result["throughput"]
    differ, shared = [], []
    for key in result["group_keys"]:
        values = sorted({key_cell(v) for v in table[key]})
        if key == "op" or len(values) > 1:
            differ.append(key)
        else:
            shared.append(f"{key}={values[0] if values else ''}")
    return differ, shared


class _Page:
    """The report's lines: wrapped for a terminal (fmt "table"), whole for markdown ("md")."""

    def __init__(self, fmt: str, width: int, compact: bool, keys: list[str],
                 legend: dict[tuple, str] | None) -> None:
        self.fmt, self.width, self.compact = fmt, width, compact
        self.keys, self.legend = keys, legend
        self.out: list[str] = []

    def wrapped(self, text: str, indent: str = "") -> None:
        if self.fmt == "table":
            self.out.extend(textwrap.wrap(text, self.width, subsequent_indent=indent + "    ",
                                          initial_indent=indent, break_on_hyphens=False))
        else:
            self.out.append(indent + text)

    def heading(self, text: str) -> None:
        self.out.append(f"### {text}\n" if self.fmt == "md" else f"{text}\n{'-' * len(text)}")

    def table(self, frame: pd.DataFrame, columns: list[Column]) -> None:
        if not self.compact:
            self.out.append(full_table(frame, self.keys, columns, "github" if self.fmt == "md" else "simple"))
        else:
            keys = self.keys
            if self.legend is not None:  # one group column in place of the keys the legend names
                groups = [self.legend.get(values, "?") for values in _key_values(frame, keys)]
                frame = frame.assign(**{LEGEND_KEY: groups})
                keys = [k for k in keys if k == "op"] + [LEGEND_KEY]
            text, dropped = compact_table(frame, keys, columns, self.width)
            self.out.append(text)
            if dropped:
                self.wrapped(f"(to fit {self.width} columns, left out: {', '.join(dropped)}; "
                             "--wide shows every column)")
        self.out.append("")

    def text(self) -> str:
        return "\n".join(self.out).rstrip() + "\n"


def render(result: dict[str, Any], fmt: str, warnings: list[str], width: int | None = None,
           wide: bool = False) -> str:
    """fmt "table" (the terminal; compact to `width` unless `wide`) or "md"."""
    width = width or DEFAULT_WIDTH
    compact = fmt == "table" and not wide
    keys, legend, shared = result["group_keys"], None, list[str]()
    if compact and not result["throughput"].empty:
        keys, shared = _differing_keys(result)
        legend = _legend(result["throughput"], keys, width)
    page = _Page(fmt, width, compact, keys, legend)
    _summary(page, result["runs"], shared)
    _figures(page, result)
    _mlperf(page, result)
    if legend is not None:
        page.heading("Groups (the group column above)")
        rest = [k for k in keys if k != "op"]
        for values, name in legend.items():
            page.wrapped(f"{name}: " + ", ".join(f"{k}={v}" for k, v in zip(rest, values)), "  ")
        page.out.append("")
    _left_out(page, result["not_ok"])
    for warning in warnings:
        page.wrapped(f"note: {warning}")
    return page.text()


def _summary(page: _Page, runs: pd.DataFrame, shared: list[str]) -> None:
    ok = int((runs["status"] == "ok").sum()) if len(runs) else 0
    incomplete = int((runs["status"] == "incomplete").sum()) if len(runs) else 0
    failed = len(runs) - ok - incomplete
    page.wrapped(f"{len(runs)} run(s) read: {ok} ok, {failed} failed or interrupted"
                 + (f", {incomplete} incomplete record(s)" if incomplete else "")
                 + " (left out of every figure)." + ("\n" if page.fmt == "md" else ""))
    if shared:
        page.wrapped("All groups: " + ", ".join(shared) + ".")
    renamed = (_key_headers([k for k in page.keys if "." in k])
               if page.compact and page.legend is None else {})
    if renamed:
        page.wrapped("Settings: " + ", ".join(f"{h}={k}" for k, h in renamed.items()) + ".")
    if shared or renamed:
        page.out.append("")


def _figures(page: _Page, result: dict[str, Any]) -> None:
    if result["throughput"].empty:
        page.out.append("no successful save or load to report.")
        return
    page.heading("Throughput (one row per group)")
    page.table(result["throughput"], cols.THROUGHPUT)
    page.heading("S3 requests in the timed regions (all ranks)")
    page.table(result["throughput"], cols.REQUESTS)
    page.heading("DCP phases, memory and coordination (mean per rank and operation)")
    page.table(result["phases"], cols.PHASES)
    if not result["types"].empty:
        page.heading("S3 requests by type (timed regions, all ranks)")
        page.table(result["types"], cols.TYPES)
    _splits(page, result)
    _ceilings(page, result)


def _ceilings(page: _Page, result: dict[str, Any]) -> None:
    """Per run with ceiling=true: each ceiling and DCP's efficiency against it."""
    ops = result["operations"]
    found = [(run_id, ceiling_lines(group)) for run_id, group in ops.groupby("run_id", sort=True)]
    found = [(run_id, lines) for run_id, lines in found if lines]
    if not found:
        return
    page.heading("Ceilings (ceiling=true runs; docs/metrics.md)")
    for run_id, lines in found:
        page.wrapped(f"{run_id}:")
        for line in lines:
            page.wrapped(line, "  ")
    page.out.append("")


def _splits(page: _Page, result: dict[str, Any]) -> None:
    """Where each group's time went and what bounds it (telemetry/time_split.py)."""
    if not result.get("splits"):
        return
    page.heading("Where the time went (mean per rank and operation; docs/metrics.md)")
    varying = [key for key in result["group_keys"] if key != "op"]
    for labels, line in result["splits"]:
        settings = ", ".join(f"{key}={labels[key]}" for key in varying if key in labels)
        page.wrapped(f"{line}" + (f" [{settings}]" if settings else ""),
                     "- " if page.fmt == "md" else "  ")
    page.out.append("")


def _mlperf(page: _Page, result: dict[str, Any]) -> None:
    """protocol=mlperf runs of MLPerf's counts: MLPerf's figure beside ours, per run; the
    others (tune's trials were recorded with protocol=mlperf) are named in one note."""
    runs, samples = result["runs"], result["samples"]
    if "protocol" not in runs or samples.empty:
        return
    chosen = runs[(runs["status"] == "ok") & (runs["protocol"] == "mlperf")]
    short = {run_id: mlperf_shortfall(samples[samples["run_id"] == run_id])
             for run_id in chosen["run_id"]}
    whole = [run_id for run_id, why in short.items() if why is None]
    if whole:
        page.heading("MLPerf Storage v3.0 checkpointing (protocol=mlperf runs), GiB/s")
        for run_id in whole:
            page.wrapped(f"{run_id}:")
            for line in mlperf_op_lines(samples[samples["run_id"] == run_id]):
                page.wrapped(line.strip(), "  ")
        page.wrapped(MLPERF_DIFFERENCE)
        page.out.append("")
    partial = [(run_id, why) for run_id, why in short.items() if why is not None]
    if partial:
        page.wrapped(f"{len(partial)} run(s) recorded with protocol=mlperf are not shown as "
                     f"MLPerf Storage figures, their counts are not its protocol's (e.g. "
                     f"{partial[0][0]}: {partial[0][1]}; tune's trials were recorded so)")
        page.out.append("")


def _left_out(page: _Page, not_ok: pd.DataFrame) -> None:
    if not len(not_ok):
        return
    page.wrapped(f"Left out of every figure: {len(not_ok)} run(s) that did not finish or whose "
                 "record is not whole:" + ("\n" if page.fmt == "md" else ""))
    for _, run in not_ok.iterrows():
        error = run["error"] if isinstance(run["error"], str) else ""
        error = " ".join(error.split())[:200]
        page.wrapped(f"{run['run_id']} ({run['command']}, {run['status']})"
                     f"{': ' + error if error else ''}", "- " if page.fmt == "md" else "  ")
    page.out.append("")


def wide_csv(result: dict[str, Any]) -> pd.DataFrame:
    """Throughput and phase columns side by side, one row per group (raw numbers)."""
    if result["throughput"].empty:
        return pd.DataFrame(columns=result["group_keys"])
    return result["throughput"].merge(result["phases"], on=result["group_keys"], how="left")
