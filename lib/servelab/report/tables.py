"""How a table looks on a phase page: headers with their unit in words, sensible precision, no index column,
wide tables scroll instead of being cut, the full table one click away as CSV, every cell escaped.

``open_phase`` registers :func:`table_html` as the notebook's HTML display of a ``DataFrame``, so every table a
phase shows follows these rules without the phase doing anything.
"""
from __future__ import annotations

import base64
import html
import math
from typing import Any

import pandas as pd

from servelab.report.findings import format_value, split_unit

MAX_ROWS = 200                 # rows shown on the page; the CSV link holds them all
MAX_CSV_BYTES = 4_000_000      # beyond this the CSV stays in the phase folder only


def header(name: Any) -> str:
    """``p95_tpot_ms`` → ``p95 tpot (ms)``; a name without a unit suffix stays as it is."""
    text = str(name)
    label, unit = split_unit(text)
    if not unit:
        return text
    return f"{label} ({unit})"


def _cell(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "—"
    if value is None or value is pd.NaT:
        return "—"
    try:
        if pd.isna(value) is True:
            return "—"
    except (TypeError, ValueError):
        pass
    return format_value(value)


def flat(df: pd.DataFrame) -> pd.DataFrame:
    """The index becomes columns when it carries labels; a plain 0..N index is dropped."""
    out = df
    if not isinstance(out.index, pd.RangeIndex) or out.index.name is not None:
        out = out.reset_index()
    if isinstance(out.columns, pd.MultiIndex):
        out = out.copy()
        out.columns = [" ".join(str(p) for p in col if str(p)) for col in out.columns]
    return out


def table_html(df: pd.DataFrame, max_rows: int = MAX_ROWS) -> str:
    """The table as the page shows it; ``df.attrs["caption"]`` (if any) is drawn above it, escaped."""
    caption = str(df.attrs.get("caption") or "")
    table = flat(df)
    shown = table.head(max_rows)
    head = "".join(f"<th>{html.escape(header(c))}</th>" for c in shown.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
                   for row in shown.itertuples(index=False, name=None))
    note = ""
    if len(table) > max_rows:
        note = f"first {max_rows} of {len(table):,} rows"
    csv = table.to_csv(index=False).encode()
    link = ""
    if len(csv) <= MAX_CSV_BYTES:
        href = "data:text/csv;base64," + base64.b64encode(csv).decode()
        link = f'<a download="table.csv" href="{href}">full table as CSV ({len(table):,} rows)</a>'
    foot = " · ".join(x for x in (note, link) if x)
    return ('<div class="servelab-table" style="max-width:100%;overflow-x:auto">'
            + (f'<div class="servelab-caption" style="font-size:0.9em;color:#333;margin:2px 0 4px">'
               f'{html.escape(caption)}</div>' if caption else "")
            + f'<table class="dataframe"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
            + (f'<div style="font-size:0.8em;color:#555;margin-top:2px">{foot}</div>' if foot else "")
            + "</div>")


def register_table_display() -> None:
    """Make :func:`table_html` the HTML display of DataFrames in the running notebook (no-op outside one)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    ip.display_formatter.formatters["text/html"].for_type(pd.DataFrame, table_html)
