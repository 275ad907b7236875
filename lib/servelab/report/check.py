"""The consistency check of a whole run (``servelab check RUN_ID``; ``render`` and the demo run it too): every
page and every recorded fact read back, and every contradiction a reader would trip on reported
(``docs/method.md#check``).

From the facts (:mod:`servelab.core.facts`):

- **same fact, different values** — a question answered twice with two answers;
- **VALID below its sample rule** — a fact VALID on fewer samples than :data:`~servelab.core.facts.MIN_SAMPLES`
  of its kind; a Phase 9 point VALID on fewer completed requests than a throughput needs;
- **headline against its fact** — a phase's headline number for a fact that is not what the fact states (a bare
  number where the fact is unsettled, INDICATIVE or INVALID: an invalid source behind a finding);
- **a headline number without a recorded fact** — every number a successful phase's headline states is a fact
  (``report.answers.record_headline``, called when the phase finishes);
- **milestone against a recorded verdict** — M4's correctness check passing beside a recorded regression;
- **a finding against its fact** — a page's findings naming one of its phase's facts by its label
  (``P1 P50 TTFT``) and stating another number beside it.

From the pages (``<phase>/report.html``, ``index.html``): a Python repr (``np.float64(``, ``{'``, ``: None``, a
``True``/``nan`` cell), ``nan`` in a sentence, a ``<placeholder>`` in a command, a number in exponent notation, a
latency or throughput header without its unit, a stale cross-reference (a page saying another phase "has not
written" a file the run holds: it was rendered before that phase ran), a row of an INVALID case in a table that
marks it nowhere, and one number shown twice with two values (same column, same case and identifying columns, in
two tables of one page, further apart than their shown precision allows).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.facts import INDICATIVE, INVALID, MIN_SAMPLES, VALID, enough, indicative, read_facts
from servelab.core.run import read_manifest
from servelab.report.findings import is_fraction_key, split_unit


@dataclass
class Finding:
    """One contradiction: where (a page or ``facts.jsonl``), which rule, what exactly."""
    where: str
    rule: str
    detail: str

    def line(self) -> str:
        return f"{self.where}: {self.rule}: {self.detail}"


# ---------------------------------------------------------------- pages

class _Page(HTMLParser):
    """A rendered page as the check reads it: the findings box's text, the commands, every table (header and cells)
    and the visible text outside code inputs, scripts and styles."""

    SKIP = {"script", "style"}
    VOID = {"br", "img", "meta", "link", "input", "hr", "wbr", "col", "source"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str]] = []
        self.text: list[str] = []
        self.findings: list[str] = []
        self.captions: list[str] = []
        self.commands: list[str] = []
        self.tables: list[dict[str, Any]] = []
        self._cell: list[str] | None = None
        self._cmd: list[str] | None = None
        self._cmd_depth = 0

    def _in(self, cls: str) -> bool:
        return any(cls in c for _, c in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        cls = dict(attrs).get("class") or ""
        self.text.append(" ")                 # a tag separates words (<br>, a new cell, a list item)
        if self._in("servelab-findings"):
            self.findings.append(" ")
        if tag in self.VOID:
            if tag == "br" and self._cell is not None:
                self._cell.append("\n")
            return
        self.stack.append((tag, cls))
        if tag == "table":
            self.tables.append({"heads": [], "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []
        if self._cmd is None and "servelab-cmd" in cls.split():
            self._cmd, self._cmd_depth = [], len(self.stack)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        while self.stack:
            t, _ = self.stack.pop()
            if self._cmd is not None and len(self.stack) < self._cmd_depth:
                self.commands.append("".join(self._cmd))
                self._cmd = None
            if t in ("td", "th") and self._cell is not None and self.tables:
                cell = " ".join("".join(self._cell).split())
                row = self.tables[-1]["rows"]
                if t == "th":
                    self.tables[-1]["heads"].append(cell)
                elif row:
                    row[-1].append(cell)
                self._cell = None
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        if any(t in self.SKIP for t, _ in self.stack) or self._in("jp-InputArea") or self._in("input_area"):
            return
        if self._cell is not None:
            self._cell.append(data)
        if self._cmd is not None:
            self._cmd.append(data)
        if self._in("servelab-findings"):
            self.findings.append(data)
        if self._in("servelab-caption"):
            self.captions.append(" ".join(data.split()))
        self.text.append(data)


def read_page(path: Path) -> _Page:
    p = _Page()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    p.close()
    return p


REPR_RE = re.compile(r"np\.(?:float|int)\d*\(|\{'|Timestamp\(|\bdtype[:=]|=None\b|=True\b|=False\b|"
                     r"\bobject at 0x[0-9a-f]+|:\s(?:True|False|None)\b")
CELL_REPRS = {"True", "False", "None", "nan", "NaN", "NaT", "<NA>", "[]", "{}"}
NAN_RE = re.compile(r"(?<![\w.])(?:nan|NaN)(?![\w])")
PLACEHOLDER_RE = re.compile(r"<[A-Za-z_][^<>\n]{0,60}>")
EXPONENT_RE = re.compile(r"(?<![\w.])\d(?:\.\d+)?e[+-]\d{1,3}\b")
UNIT_HEADER_RE = re.compile(r"^(?:p\d+ |mean |median |max |min )?(?:ttft|tpot|itl|e2e|e2el|latency|output tps|"
                            r"throughput)$", re.IGNORECASE)
STALE_RE = re.compile(r"has not (?:yet )?written ((?:phase\d+|cases)/[\w./\-]+\w)")


def invalid_cases(run_dir: Path) -> set[str]:
    """The ids of the run's cases whose recorded verdict is INVALID (``cases/<id>/summary.json``)."""
    out = set()
    for p in Path(run_dir).glob("cases/*/summary.json"):
        try:
            s = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if (s.get("verdict") or {}).get("status") == INVALID:
            out.add(str(s.get("case_id") or p.parent.name))
    return out


# the columns that say which thing a row is about (never a measured value): two tables that share them and a case
# column state the same numbers for the same thing
ID_HEADS = {"case", "case id", "case_id", "repeat", "config", "definition", "node", "concurrency", "rank", "run",
            "side", "scenario", "metric", "window", "point", "source", "question", "role", "stage"}
CASE_HEADS = {"case", "case id", "case_id"}
MARK_HEADS = ("validity", "verdict", "status", "valid", "reason")
NUMBER_RE = re.compile(r"^[−-]?\d[\d,]*(?:\.(\d+))?(?![\d.eE])")


def _number(cell: str) -> tuple[float, int] | None:
    """The number a cell states first and how many decimals it shows; None for text or a labelled other quantity
    ("0.42 · max of 4" is a maximum shown where a percentile needs more values)."""
    c = cell.strip()
    if "max of" in c:
        return None
    m = NUMBER_RE.match(c)
    if not m:
        return None
    return float(m.group(0).replace(",", "").replace("−", "-")), len(m.group(1) or "")


def _parts(tables: list[dict[str, Any]]) -> list[list[int]]:
    """For each table, the indexes of the parts of the one table it belongs to: consecutive tables with the same
    first header and the same first-column cells (a wide table split to fit the page repeats its first column)."""
    def first(t: dict[str, Any]) -> tuple:
        return (t["heads"][:1], [r[0] for r in t["rows"] if r])
    groups: list[list[int]] = []
    for i, t in enumerate(tables):
        if groups and t["heads"] and first(tables[groups[-1][-1]]) == first(t):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [g for g in groups for _ in g]


def table_findings(where: str, tables: list[dict[str, Any]], invalid: set[str]) -> list[Finding]:
    """Across one page's tables: a row of an INVALID case in a table with no validity/verdict/status column whose
    row does not say so either; the same number (same column, same case and identifying columns) shown with two
    values that their shown precision cannot both round from."""
    out: list[Finding] = []
    seen: dict[tuple, tuple[float, int, str]] = {}      # from the tables before this one
    parts = _parts(tables)
    for i, t in enumerate(tables):
        here: dict[tuple, tuple[float, int, str] | None] = {}   # None: the key names several rows of this table
        heads = [h.strip().lower() for h in t["heads"]]
        name = " | ".join(t["heads"][:4])[:80] or f"table {i + 1}"
        cases = [j for j, h in enumerate(heads) if h in CASE_HEADS]
        if not cases:
            continue
        ids = [j for j, h in enumerate(heads) if h in ID_HEADS]
        # a wide table is split into parts that repeat its first column: a mark in any part marks the row
        group = [tables[k] for k in parts[i]]
        marked = any(m in h.lower() for g in group for h in g["heads"] for m in MARK_HEADS)
        for r, row in enumerate(t["rows"]):
            if len(row) != len(heads):
                continue
            case = row[cases[0]]
            said = " ".join(c for g in group if r < len(g["rows"]) for c in g["rows"][r])
            if not marked and case in invalid and not re.search(r"invalid|indicative", said, re.I):
                out.append(Finding(where, "INVALID case without a mark",
                                   f"{name}: {case} is INVALID, and neither the row nor a column says so"))
            key_id = tuple((heads[j], row[j]) for j in ids)
            for j, h in enumerate(heads):
                if j in ids:
                    continue
                got = _number(row[j])
                if got is None:
                    continue
                key = (key_id, h, case)
                here[key] = None if key in here else (got[0], got[1], row[j])
        for key, got in here.items():
            if got is None:
                continue
            if key in seen:
                v0, d0, c0 = seen[key]
                if abs(got[0] - v0) > 0.5 * 10 ** -min(d0, got[1]) + 1e-9 * max(1.0, abs(v0)):
                    out.append(Finding(where, "one number, two values", f"{key[1]} of {key[2]}: {c0} and {got[2]}"))
            else:
                seen[key] = got
    return out


def page_findings(run_dir: Path, path: Path, invalid: set[str] | None = None) -> list[Finding]:
    """What a reader would trip on in one page (``invalid``: the run's INVALID case ids, read when None)."""
    where = str(path.relative_to(run_dir))
    page = read_page(path)
    out: list[Finding] = []
    said = " ".join("".join(page.findings).split())
    for m in REPR_RE.finditer(said):
        out.append(Finding(where, "Python repr in the findings", said[max(0, m.start() - 60):m.end() + 20]))
    for m in NAN_RE.finditer(said):
        out.append(Finding(where, "nan in the findings", said[max(0, m.start() - 60):m.end() + 20]))
    for m in EXPONENT_RE.finditer(said):
        out.append(Finding(where, "exponent notation in the findings", said[max(0, m.start() - 40):m.end() + 10]))
    for cap in page.captions:
        for m in REPR_RE.finditer(cap):
            out.append(Finding(where, "Python repr in a table caption", cap[max(0, m.start() - 60):m.end() + 20]))
    for cmd in page.commands:
        for m in PLACEHOLDER_RE.finditer(cmd):
            out.append(Finding(where, "placeholder in a command", f"{m.group(0)} in {' '.join(cmd.split())[:160]!r}"))
    for i, t in enumerate(page.tables):
        name = " | ".join(t["heads"][:4])[:80] or f"table {i + 1}"
        cells = [c for row in t["rows"] for c in row]
        cmd_cols = [j for j, h in enumerate(t["heads"]) if "command" in h.lower()]
        for h in t["heads"]:
            if REPR_RE.search(h):
                out.append(Finding(where, "Python repr in a table header", f"{name}: {h!r}"))
            if UNIT_HEADER_RE.match(h.strip()):
                out.append(Finding(where, "header without its unit", f"{name}: {h!r}"))
        bad = sorted({c for c in cells if c in CELL_REPRS})
        if bad:
            out.append(Finding(where, "Python repr as a table cell", f"{name}: {', '.join(map(repr, bad))}"))
        exp = sorted({m.group(0) for c in cells for m in EXPONENT_RE.finditer(c)})
        if exp:
            out.append(Finding(where, "exponent notation in a table", f"{name}: {', '.join(exp[:4])}"))
        for row in t["rows"]:
            for j in cmd_cols:
                if j < len(row) and PLACEHOLDER_RE.search(row[j]):
                    out.append(Finding(where, "placeholder in a command", f"{name}: {row[j][:160]!r}"))
    out += table_findings(where, page.tables, invalid_cases(run_dir) if invalid is None else invalid)
    text = " ".join("".join(page.text).split())
    for m in STALE_RE.finditer(text):
        if (run_dir / m.group(1)).exists():
            out.append(Finding(where, "stale cross-reference",
                               f"says it has not written {m.group(1)}, which the run holds: render it again"))
    return out


# ---------------------------------------------------------------- facts

def fact_findings(run_dir: Path) -> list[Finding]:
    """Contradictions among the facts, and between the facts and what the phases' headlines and the milestones
    state."""
    facts = read_facts(run_dir)
    out: list[Finding] = []
    by_name: dict[str, list[Any]] = {}
    for f in facts:
        by_name.setdefault(f.name, []).append(f)
    for name, fs in by_name.items():
        values = {json.dumps(f.value, sort_keys=True, default=str) for f in fs}
        if len(values) > 1:
            out.append(Finding("facts.jsonl", "same fact, different values", f"{name}: " + " vs ".join(
                f"{f.value!s} ({f.phase}{', ' + f.source if f.source else ''})" for f in fs)))
    for f in facts:
        if f.validity == VALID and f.samples is not None and not enough(f.kind, f.samples):
            out.append(Finding("facts.jsonl", "VALID below its sample rule",
                               f"{f.name} = {f.value} on n={f.samples} ({f.kind} needs {MIN_SAMPLES.get(f.kind, 1)}): "
                               f"{indicative(f.samples)} at most"))
    phases = read_manifest(run_dir).get("phases") or {}
    latest = {name: fs[-1] for name, fs in by_name.items()}
    for phase, entry in phases.items():
        names = entry.get("headline_facts") or {}
        for key, v in (entry.get("headline") or {}).items():
            f = latest.get(names.get(key) or key)
            if f is None:
                if entry.get("status") == "success":
                    out.append(Finding(f"{phase} headline", "a headline number without a recorded fact",
                                       f"{key} = {v!s}: no fact {names.get(key) or phase + '/' + key} in facts.jsonl "
                                       "(the phase records its headline when it finishes: run it again)"))
                continue
            want = f.stated()
            if v != want and not (isinstance(v, (int, float)) and isinstance(want, (int, float))
                                  and abs(float(v) - float(want)) <= 1e-9 * max(1.0, abs(float(want)))):
                why = ("an INVALID source behind a headline" if f.validity in (INVALID, INDICATIVE)
                       else "headline against its fact")
                out.append(Finding(f"{phase} headline", why, f"{key} = {v!s}, the recorded fact: {want!s}"))
    regressions = [f for f in facts if f.name.startswith("correctness:") and f.value == "regression"]
    index = run_dir / "index.html"
    if regressions and index.is_file():
        text = " ".join("".join(read_page(index).text).split())
        if re.search(r"\bpass no correctness regression\b", text):
            out.append(Finding("index.html", "milestone against a recorded verdict",
                               "M4 passes 'no correctness regression' while the run records " + "; ".join(
                                   f"{f.name.split(':', 1)[1]}: regression ({f.note})" for f in regressions)))
    points = run_dir / "phase9" / "points.csv"
    if points.is_file():
        try:
            p = pd.read_csv(points)
        except (ValueError, pd.errors.EmptyDataError):
            p = pd.DataFrame()
        if {"validity", "completed"} <= set(p.columns):
            few = p[(p["validity"] == VALID) & ~p["completed"].map(lambda n: enough("throughput", n if n == n else 0))]
            for r in few.itertuples():
                out.append(Finding("phase9/points.csv", "VALID below its sample rule",
                                   f"{getattr(r, 'case_id', '?')}: VALID on {r.completed:.0f} completed request(s) "
                                   f"(a throughput needs {MIN_SAMPLES['throughput']})"))
    return out


# a sentence naming a fact's label, then (past a parenthesis, a colon or "of"/"is"/"at") a number
SAID_GAP = (r"(?![\w/])(?:\s*\([^()0-9;]{0,40}\))?[\s:=]{0,3}(?:(?:of|is|was|were|at)\s+)?"
            r"(?<![\w.])([−-]?\d[\d,]*(?:\.\d+)?)(?![\d.])")


def said_against_facts(where: str, said: str, facts: list[Any]) -> list[Finding]:
    """A number a page's findings state right after a fact's label (``P1 P50 TTFT (prefill floor) 145.58 ms`` for
    the fact ``phase1/P1_p50_ttft_ms``) that is not the fact's value within the precision shown. Labels of one
    word (``cases``) and percentages shown from a fraction are not looked for."""
    out: list[Finding] = []
    for f in facts:
        if isinstance(f.value, bool) or not isinstance(f.value, (int, float)):
            continue
        key = f.name.split("/", 1)[-1]
        label = split_unit(key)[0]
        if len(label.split()) < 2 or is_fraction_key(key):
            continue
        for m in re.finditer(re.escape(label) + SAID_GAP, said):
            text = m.group(1).replace(",", "").replace("−", "-")
            digits = len(text.split(".")[1]) if "." in text else 0
            if abs(float(text) - float(f.value)) > 0.5 * 10 ** -digits + 1e-9 * max(1.0, abs(float(f.value))):
                out.append(Finding(where, "a finding against its fact",
                                   f"says {said[m.start():m.end()]!r}; the recorded fact {f.name} = {f.value}"))
    return out


def check_run(run_dir: str | Path) -> list[Finding]:
    """Every finding of the run: the facts first, then each page (phases in order, then the index) — and a page's
    findings against its phase's facts."""
    run_dir = Path(run_dir)
    out = fact_findings(run_dir)
    invalid = invalid_cases(run_dir)
    facts = read_facts(run_dir)
    for page in sorted(run_dir.glob("phase*/report.html")) + [run_dir / "index.html"]:
        if page.is_file():
            out += page_findings(run_dir, page, invalid)
            phase = page.parent.name if page.parent != run_dir else None
            if phase:
                said = " ".join("".join(read_page(page).findings).split())
                out += said_against_facts(str(page.relative_to(run_dir)), said,
                                          [f for f in facts if f.phase == phase])
    return out
