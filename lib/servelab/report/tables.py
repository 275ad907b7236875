"""How a table looks on a phase page — the one formatter every table of a page goes through.

- headers in words with their unit (``p95_tpot_ms`` → ``P95 TPOT (ms)``), no index column;
- counts as integers (a unitless column whose values are all whole: ``8``, never ``8.00``); ids, ports, pids,
  tasks, slots, ranks without thousands separators (``port 60599``, not ``60,599``);
- fractions as percentages (``hit_rate`` 0.203 → ``hit rate (%)`` 20.3): one unit per quantity across the run;
- no Python reprs (``None`` → —, booleans → yes / no, lists joined);
- a table wider than the page is split into parts of columns that fit, its key column repeated in each part
  (nothing is cut off or hidden behind a scroll bar at the page's width);
- a long table (a raw log or telemetry dump) shows a short excerpt; the whole table is one click away as a CSV
  file in the phase folder (``tables/*.csv``), or inline as a ``data:`` link where no folder is known;
- every cell escaped.

``open_phase`` registers :func:`table_html` as the notebook's HTML display of a ``DataFrame`` (with the phase
folder for the CSV files), so every table a phase shows follows these rules without the phase doing anything.
A table may carry ``df.attrs["caption"]`` (drawn above it) and ``df.attrs["max_rows"]`` (rows shown before
the excerpt rule applies).
"""
from __future__ import annotations

import base64
import hashlib
import html
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd
from IPython import get_ipython

from servelab.report.findings import format_value, is_fraction_key, split_unit

MAX_ROWS = 200                 # rows shown on the page for a table that asks for more than the excerpt
LONG_ROWS = 40                 # beyond this a table is a dump: an excerpt on the page, the whole table as a file
EXCERPT_ROWS = 12              # rows of that excerpt
MAX_CSV_BYTES = 4_000_000      # beyond this an inline (data:) CSV link is left out
PAGE_WIDTH_PX = 1000           # what a table may take on a page at 1400 px (output area, margins, prompt)
CHAR_PX = 7.2                  # one character of a table cell at the page's table font (12 px sans)
CELL_PAD_PX = 18               # a cell's padding and border
WRAP_CHARS = 36                # a longer cell wraps (anywhere, if it has no space) at about this many characters
# the last word of a column that holds an identifier, not a quantity: shown without thousands separators
ID_WORDS = frozenset({"id", "ids", "pid", "ppid", "tid", "lwp", "port", "task", "slot", "rank", "seed", "index",
                      "idx", "core", "gpu", "device", "chunk", "step", "repeat", "attempt", "stream", "commit"})
KEY_COLUMNS = frozenset({"case", "case_id", "config", "run", "window", "node", "metric", "definition", "phase",
                         "collector", "kernel", "name", "rank", "scenario", "point", "variant", "layout", "label"})


def header(name: Any) -> str:
    """``p95_tpot_ms`` → ``P95 TPOT (ms)``, ``case_id`` → ``case id``; a name already in words stays as it is."""
    text = str(name)
    if " " in text or "(" in text:
        return text
    label, unit = split_unit(text)
    return f"{label} ({unit})" if unit else label


def _norm(name: Any) -> str:
    return re.sub(r"[\s()]+", "_", str(name).strip().lower()).strip("_")


def is_id_column(name: Any) -> bool:
    words = [w for w in re.split(r"[_\s]+", str(name).strip().lower()) if w]
    return bool(words) and words[-1] in ID_WORDS


def is_fraction_column(name: Any) -> bool:
    """A column holding a fraction in [0, 1] (``FRACTION_SUFFIXES``): shown as a percentage."""
    return is_fraction_key(name)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        try:
            v = v.item()
        except (ValueError, AttributeError):
            return None
    if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
        return float(v)
    return None


def _missing(value: Any) -> bool:
    if value is None or value is pd.NaT:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    try:
        return pd.isna(value) is True
    except (TypeError, ValueError):
        return False


def _id_text(value: Any) -> str:
    x = _number(value)
    if x is not None and math.isfinite(x) and x == int(x):
        return str(int(x))
    return format_value(value)


def display_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The table as text, cell by cell, with headers in words: what :func:`table_html` draws (and what a test
    reads). Fractions become percentages, whole-valued unitless columns integers, id columns plain digits."""
    table = flat(df)
    out: dict[str, list[str]] = {}
    for col in table.columns:
        values = list(table[col])
        keyform = " " not in str(col) and "(" not in str(col)
        label, unit = split_unit(str(col)) if keyform else (str(col), "")
        name = header(col)
        nums = [x for x in (_number(v) for v in values) if x is not None]
        if is_fraction_column(col) and nums and all(0.0 <= x <= 1.0 for x in nums):
            values = [v * 100 if _number(v) is not None else v for v in values]
            name, unit = f"{label} (%)", "%"
        has_unit = bool(unit) or "(" in name
        if is_id_column(col):
            cells = ["—" if _missing(v) else _id_text(v) for v in values]
        elif nums and not has_unit and all(math.isfinite(x) and abs(x) < 2**53 and x == int(x) for x in nums):
            cells = ["—" if _missing(v) else (format_value(int(x)) if (x := _number(v)) is not None
                                              else format_value(v)) for v in values]
        else:
            cells = ["—" if _missing(v) else format_value(v) for v in values]
        while name in out:                       # two columns that read the same keep both
            name += " "
        out[name] = cells
    return pd.DataFrame(out, index=range(len(table)))


def flat(df: pd.DataFrame) -> pd.DataFrame:
    """The index becomes columns when it carries labels (a named index, or unnamed labels that are not row
    numbers: they become an ``item`` column); row numbers — a RangeIndex, or integers left over from a filter or a
    ``groupby().head()`` — are dropped."""
    out = df
    names = [n for n in out.index.names if n is not None]
    if isinstance(out.index, pd.MultiIndex) or names:
        out = out.reset_index()
    elif not isinstance(out.index, pd.RangeIndex):
        if pd.api.types.is_integer_dtype(out.index.dtype):
            out = out.reset_index(drop=True)
        else:
            out = out.reset_index(names="item")
    if isinstance(out.columns, pd.MultiIndex):
        out = out.copy()
        out.columns = [" ".join(str(p) for p in col if str(p)) for col in out.columns]
    return out


def _text_px(text: str) -> float:
    """How wide a cell of ``text`` gets: a long text wraps at spaces (or anywhere beyond :data:`WRAP_CHARS`)."""
    if len(text) <= WRAP_CHARS:
        return len(text) * CHAR_PX
    longest = max((len(w) for w in text.split()), default=0)
    return min(max(longest, WRAP_CHARS // 2), WRAP_CHARS) * CHAR_PX


def column_px(name: str, cells: list[str]) -> float:
    head = max((len(w) for w in name.split()), default=0) * CHAR_PX * 1.1       # bold header, wraps at spaces
    return max([head, *(_text_px(c) for c in cells)]) + CELL_PAD_PX


def column_parts(shown: pd.DataFrame, width_px: float = PAGE_WIDTH_PX) -> list[list[str]]:
    """The table's columns in parts that each fit ``width_px``; the key columns (the first, and a second when both
    name what a row is) lead every part. One part when the whole table fits."""
    cols = list(shown.columns)
    px = {c: column_px(c, list(shown[c])) for c in cols}
    if sum(px.values()) <= width_px or len(cols) <= 2:
        return [cols]
    keys = cols[:1]
    if len(cols) > 2 and _norm(cols[0]) in KEY_COLUMNS and _norm(cols[1]) in KEY_COLUMNS:
        keys = cols[:2]
    if sum(px[c] for c in keys) > width_px / 2:
        keys = cols[:1]
    base = sum(px[c] for c in keys)
    parts: list[list[str]] = []
    cur: list[str] = []
    used = base
    for c in cols[len(keys):]:
        if cur and used + px[c] > width_px:
            parts.append(cur)
            cur, used = [], base
        cur.append(c)
        used += px[c]
    if cur:
        parts.append(cur)
    return [keys + p for p in parts]


def _csv_link(table: pd.DataFrame, files_dir: Path | None, caption: str) -> str:
    """A link to the whole table as CSV: a file in ``files_dir`` (relative to the page beside it), else inline."""
    csv = table.to_csv(index=False).encode()
    n = len(table)
    if files_dir is not None:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", caption.lower()).strip("-")[:40] or "table"
        name = f"{slug}-{hashlib.sha1(csv).hexdigest()[:10]}.csv"
        try:
            files_dir.mkdir(parents=True, exist_ok=True)
            path = files_dir / name
            if not path.is_file():
                path.write_bytes(csv)
            href = html.escape(f"{files_dir.name}/{name}", quote=True)
            return f'<a href="{href}">whole table as CSV ({n:,} rows): {html.escape(files_dir.name)}/{html.escape(name)}</a>'
        except OSError:
            pass
    if len(csv) > MAX_CSV_BYTES:
        return ""
    href = "data:text/csv;base64," + base64.b64encode(csv).decode()
    return f'<a download="table.csv" href="{href}">full table as CSV ({n:,} rows)</a>'


def _table(shown: pd.DataFrame, cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(str(c).rstrip())}</th>" for c in cols)
    rows = []
    for row in shown[cols].itertuples(index=False, name=None):
        cells = []
        for v in row:
            # a word longer than a wrapped line (a path, a flag list, a kernel name) may break anywhere
            long = len(v) > WRAP_CHARS and max((len(w) for w in v.split()), default=0) > WRAP_CHARS
            style = ' style="overflow-wrap:anywhere;word-break:break-all;min-width:12em"' if long else ""
            cells.append(f"<td{style}>{html.escape(v)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table class="dataframe servelab-fit"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody>'
            "</table>")


def table_html(df: pd.DataFrame, max_rows: int | None = None, files_dir: Path | None = None,
               width_px: float = PAGE_WIDTH_PX) -> str:
    """The table as the page shows it; ``df.attrs["caption"]`` (if any) is drawn above it, escaped.

    ``max_rows``: rows shown (default: all up to :data:`LONG_ROWS`, an excerpt of :data:`EXCERPT_ROWS` beyond);
    ``files_dir``: where the whole table is written as CSV for the link (default: an inline ``data:`` link)."""
    caption = str(df.attrs.get("caption") or "")
    table = flat(df)
    limit = max_rows if max_rows is not None else df.attrs.get("max_rows")
    if limit is None:
        limit = len(table) if len(table) <= LONG_ROWS else EXCERPT_ROWS
    limit = int(min(limit, MAX_ROWS))
    shown = display_frame(table.head(limit))
    note = f"first {limit} of {len(table):,} rows" if len(table) > limit else ""
    link = _csv_link(table, files_dir, caption)
    foot = " · ".join(x for x in (note, link) if x)
    parts = column_parts(shown, width_px)
    body = []
    for i, cols in enumerate(parts):
        if len(parts) > 1:
            body.append(f'<div class="servelab-part" style="font-size:0.8em;color:#555;margin:6px 0 0">'
                        f"part {i + 1} of {len(parts)} (the table has {len(table.columns)} columns; "
                        f"{html.escape(str(cols[0]))} repeated in each part)</div>")
        body.append(_table(shown, cols))
    return ('<div class="servelab-table" style="max-width:100%;overflow-x:auto">'
            + (f'<div class="servelab-caption" style="font-size:0.9em;color:#333;margin:2px 0 4px">'
               f'{html.escape(caption)}</div>' if caption else "")
            + "".join(body)
            + (f'<div style="font-size:0.8em;color:#555;margin-top:2px">{foot}</div>' if foot else "")
            + "</div>")


def register_table_display(files_dir: Path | None = None) -> None:
    """Make :func:`table_html` the HTML display of DataFrames in the running notebook (no-op outside one);
    ``files_dir``: where the whole tables are written as CSV (a phase's ``<phase>/tables``)."""
    ip = get_ipython()
    if ip is None:
        return
    where = Path(files_dir) if files_dir is not None else None
    ip.display_formatter.formatters["text/html"].for_type(pd.DataFrame,
                                                          lambda df: table_html(df, files_dir=where))
