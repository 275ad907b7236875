"""nccl-tests output (``all_reduce_perf`` & co.) → runs with their size table, footer and a verdict.

Format (NVIDIA/nccl-tests ``src/common.cu``/``util.cu``): ``# nccl-tests version …``, ``# Collective test
starting: <name>``, ``# nThread … nGpus … minBytes … maxBytes … step: …``, ``#  Rank  0 Group  0 Pid … on
<host> device  0 [<bus>] <GPU>``, a column header ``size count type redop root | time algbw busbw #wrong``
for **out-of-place** then **in-place** (time in µs, GB/s = 1e9 B/s; older builds print ``error`` for
``#wrong`` and have no ``root``; nccl-tests 1.x names the columns ``bytes N type op … res``; older headers
have no ``Group``; launcher tags such as ``[1,0]<stdout>:``
are stripped first), rows, then ``# Out of bounds values : 0 OK``, ``# Avg bus bandwidth :
<x>`` and ``# Collective test concluded``. ``#wrong`` is ``N/A`` when nothing is validated.

With ``NCCL_DEBUG=INFO`` NCCL's own lines (``<host>:<pid>:<tid> [<dev>] NCCL INFO …``) are printed
in the middle of table rows; they are cut out before the table is read. The ``size`` column is what
nccl-tests calls the message: the per-rank buffer for all-reduce, the total gathered/scattered buffer
for all-gather / reduce-scatter.

A run's ``status`` is ``ok``, ``wrong results`` (``#wrong`` > 0 or out-of-bounds values),
``failed`` (a ``Test … failure`` line or a non-zero exit) or ``truncated`` (no footer), with a reason.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

NCCL_LINE_GENERIC = r"[^\s:\[\]]+:\d+:\d+ \[\d+\] NCCL (?:INFO|WARN|TRACE|ABORT)[^\n]*(?:\n|$)"
# launcher tags in front of every line: Open MPI ``--tag-output`` (``[1,0]<stdout>:``), ``[0] ``, srun ``-l`` (``0: ``)
TAG_RE = re.compile(r"^(?:\[\d+,\d+\]<std(?:out|err)>:|\[\d+\] |\d+: )", re.MULTILINE)
# older nccl-tests print ``#   Rank  0 Pid … on …`` without ``Group``
RANK_RE = re.compile(r"^#\s+Rank\s+(?P<rank>\d+)(?:\s+Group\s+(?P<group>\d+))?\s+Pid\s+(?P<pid>\d+)\s+on\s+(?P<host>\S+)\s+"
                     r"device\s+(?P<dev>\d+)\s+\[(?P<bus>[^\]]*)\]\s+(?P<gpu>.*)$")
VERSION_RE = re.compile(r"^# nccl-tests version (?P<v>\S+)(?: nccl-headers=(?P<h>\d+))?(?: nccl-library=(?P<l>\d+))?")
PARAMS_RE = re.compile(r"^# nThread (?P<nthread>\d+) nGpus (?P<ngpus>\d+) minBytes (?P<min>\d+) maxBytes (?P<max>\d+) "
                       r"step: (?P<step>\d+)\((?P<steptype>factor|bytes)\)(?P<rest>.*)$")
FAIL_RE = re.compile(r"(Test (?:NCCL |CUDA )?failure[^\n]*|NCCL (?:WARN|ERROR)[^\n]*(?:failed|error)[^\n]*)",
                     re.IGNORECASE)
NAME_RE = re.compile(r"(all_reduce|all_gather|reduce_scatter|alltoall|sendrecv|broadcast|reduce|gather|scatter|"
                     r"hypercube)_perf")


@dataclass
class NcclTestRun:
    """One nccl-tests invocation: its table (``rows``, long format), footer and verdict."""
    collective: str
    rows: pd.DataFrame
    status: str
    reason: str = ""
    version: str = ""
    nccl_library: str = ""
    nranks: int = 0
    params: dict[str, object] = field(default_factory=dict)
    devices: pd.DataFrame = field(default_factory=pd.DataFrame)
    avg_busbw_gbps: float = float("nan")
    oob_ok: bool | None = None
    expected_sizes: list[int] = field(default_factory=list)
    info_lines: int = 0
    source: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# column names of older tables → today's (nccl-tests 1.x: ``bytes N type op time algbw busbw res``)
HEADER_ALIASES = {"bytes": "size", "N": "count", "op": "redop", "res": "error", "#wrong": "#wrong"}


class NcclTestsFormatError(ValueError):
    """The output cannot be read as nccl-tests output (one line saying why)."""


def _strip_tags(text: str) -> str:
    return TAG_RE.sub("", text)


def _strip_nccl_lines(text: str) -> tuple[str, int]:
    hosts = sorted({m["host"] for m in (RANK_RE.match(l) for l in text.splitlines()) if m}, key=len, reverse=True)
    pats = [NCCL_LINE_GENERIC]
    if hosts:
        pats.insert(0, r"(?:" + "|".join(re.escape(h) for h in hosts) + r"):\d+:\d+ \[\d+\] NCCL (?:INFO|WARN|TRACE|ABORT)"
                    r"[^\n]*(?:\n|$)")
    n = 0
    for p in pats:
        text, k = re.subn(p, "", text)
        n += k
    return text, n


def _expected_sizes(params: dict) -> list[int]:
    lo, hi, step = int(params.get("min_bytes", 0)), int(params.get("max_bytes", 0)), int(params.get("step", 0))
    if lo <= 0 or hi < lo or step <= 0:
        return []
    out, s = [], lo
    if params.get("step_type") == "factor":
        if step == 1:
            if hi > lo:
                raise NcclTestsFormatError(f"nccl-tests header says minBytes {lo} maxBytes {hi} step: 1(factor): a factor "
                                           "of 1 never reaches maxBytes (use -f 2, or -i <bytes> for a fixed increment)")
            return [lo]
        while s <= hi:
            out.append(s)
            s *= step
    else:
        while s <= hi:
            out.append(s)
            s += step
    return out


def _parse_table(lines: list[str]) -> tuple[pd.DataFrame, list[str]]:
    header: list[str] | None = None
    recs, problems = [], []
    for line in lines:
        s = line.strip()
        cols = s[1:].split() if s.startswith("#") else []
        if cols and ({"size", "bytes"} & set(cols)) and ({"count", "N"} & set(cols)):
            header = [HEADER_ALIASES.get(c, c) for c in cols]
            continue
        if header is None or not s or s.startswith("#"):
            continue
        toks = s.split()
        if not re.fullmatch(r"\d+", toks[0]):
            continue
        lead = header.index("time") if "time" in header else (header.index("cputime") if "cputime" in header else 5)
        group = header[lead:]
        glen = next((i + 1 for i, t in enumerate(group) if t in ("#wrong", "error")), 4)
        ngroups = max(1, len(group) // glen)
        if len(toks) < lead + glen:
            problems.append(f"incomplete row: {s[:80]}")
            continue
        base = dict(zip(header[:lead], toks[:lead]))
        for g in range(ngroups):
            vals = toks[lead + g * glen: lead + (g + 1) * glen]
            if len(vals) < glen:
                problems.append(f"row for size {toks[0]} has no {'in-place' if g else 'out-of-place'} values")
                continue
            cols = dict(zip(group[:glen], vals))
            wrong = cols.get("#wrong", cols.get("error", "nan"))
            recs.append({
                "size_bytes": int(base["size"]), "count": int(base.get("count", -1)),
                "type": base.get("type", ""), "redop": base.get("redop", ""),
                "root": int(base["root"]) if base.get("root", "").lstrip("-").isdigit() else -1,
                "placement": "in-place" if g else "out-of-place",
                "time_us": float(cols.get("time", cols.get("cputime", "nan"))),
                "algbw_gbps": float(cols.get("algbw", "nan")), "busbw_gbps": float(cols.get("busbw", "nan")),
                "wrong": float(wrong) if re.fullmatch(r"[\d.e+-]+", wrong) else np.nan,
            })
    cols = ["size_bytes", "count", "type", "redop", "root", "placement", "time_us", "algbw_gbps", "busbw_gbps", "wrong"]
    return pd.DataFrame(recs, columns=cols), problems


def _split_runs(text: str) -> list[str]:
    text = _strip_tags(text)
    marker = "# nccl-tests version" if "# nccl-tests version" in text else "# nThread"
    idx = [m.start() for m in re.finditer(re.escape(marker), text)]
    if not idx:
        return [text]
    idx[0] = 0
    return [text[a:b] for a, b in zip(idx, idx[1:] + [len(text)])]


def parse_run(text: str, collective: str = "", exit_code: int | None = None, source: str = "") -> NcclTestRun:
    """Parse the output of one nccl-tests invocation (see module doc for the verdict rules)."""
    text = _strip_tags(text)
    clean, n_info = _strip_nccl_lines(text)
    lines = clean.splitlines()
    version = library = ""
    params: dict[str, object] = {}
    devs = []
    avg = float("nan")
    oob_ok = None
    name = collective
    for line in lines:
        s = line.strip()
        if m := VERSION_RE.match(s):
            version, library = m["v"], m["l"] or ""
        elif m := PARAMS_RE.match(s):
            params = {"nthread": int(m["nthread"]), "ngpus": int(m["ngpus"]), "min_bytes": int(m["min"]),
                      "max_bytes": int(m["max"]), "step": int(m["step"]), "step_type": m["steptype"]}
            for k, v in re.findall(r"([a-z ]+?):\s*(-?\d+)", m["rest"]):
                params[k.strip().replace(" ", "_")] = int(v)
        elif m := RANK_RE.match(s):
            devs.append({"rank": int(m["rank"]), "group": int(m["group"] or 0), "pid": int(m["pid"]), "host": m["host"],
                         "device": int(m["dev"]), "bus": m["bus"], "gpu": m["gpu"].strip()})
        elif s.startswith("# Avg bus bandwidth"):
            try:
                avg = float(s.split(":", 1)[1].split()[0])
            except (IndexError, ValueError):
                pass
        elif s.startswith("# Out of bounds values"):
            oob_ok = s.rstrip().endswith("OK")
        elif s.startswith("# Collective test starting:") and not name:
            name = s.split(":", 1)[1].strip()
    if not name:
        m = NAME_RE.search(text.split("# Collective test concluded", 1)[0])
        name = m.group(0) if m else "unknown"
    name = name.removesuffix("_perf")
    rows, problems = _parse_table(lines)
    expected = _expected_sizes(params)
    failures = FAIL_RE.findall(clean) + [l.split("NCCL WARN", 1)[1].strip() for l in text.splitlines()
                                        if "NCCL WARN" in l and re.search(r"fail|error", l, re.I)]
    status, reason = "ok", ""
    if failures or (exit_code not in (None, 0)):
        status = "failed"
        reason = "; ".join(dict.fromkeys(f.strip() for f in failures))[:500] or f"exit code {exit_code}"
        if exit_code not in (None, 0) and failures:
            reason += f" (exit code {exit_code})"
    elif rows.empty:
        status, reason = "truncated", "no result rows (the test did not reach its size table)"
    elif avg != avg:
        sizes = sorted(rows.size_bytes.unique())
        missing = [s for s in expected if s not in set(sizes)]
        status = "truncated"
        reason = (f"no '# Avg bus bandwidth' footer; last size {sizes[-1]} B, "
                  f"{len(missing)} of {len(expected)} expected sizes missing" if expected else
                  f"no '# Avg bus bandwidth' footer; last size {sizes[-1]} B")
    elif (rows.wrong.fillna(0) > 0).any() or oob_ok is False:
        bad = sorted(rows[rows.wrong.fillna(0) > 0].size_bytes.unique())
        status = "wrong results"
        reason = (f"#wrong > 0 at sizes {bad[:6]}" if bad else "") + ("; out-of-bounds values" if oob_ok is False else "")
    if problems and status == "ok":
        status, reason = "truncated", "; ".join(problems[:3])
    nranks = len(devs) or int(params.get("ngpus", 0)) * int(params.get("nthread", 1))
    return NcclTestRun(name, rows, status, reason.strip("; "), version, library, nranks, params,
                       pd.DataFrame(devs), avg, oob_ok, expected, n_info, source)


def parse_log(text: str, source: str = "") -> list[NcclTestRun]:
    """Every nccl-tests run in a log (a log may hold several collectives one after another)."""
    if not text.strip():
        raise NcclTestsFormatError(f"nccl-tests output{f' {source}' if source else ''}: the input is empty")
    runs = [parse_run(chunk, source=source) for chunk in _split_runs(text) if chunk.strip()]
    if all(r.rows.empty and not r.params and r.devices.empty for r in runs) and not FAIL_RE.search(text):
        raise NcclTestsFormatError(f"nccl-tests output{f' {source}' if source else ''}: no '# nThread … step:' header, no "
                                   "'#  Rank' line and no size table in "
                                   f"{sum(1 for line in text.splitlines() if line.strip())} line(s)")
    return runs


def parse_file(path: Path) -> list[NcclTestRun]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"nccl-tests log not found: {path}")
    return parse_log(path.read_text(errors="replace"), source=str(path))


def runs_frame(runs: list[NcclTestRun], label: str = "") -> pd.DataFrame:
    """All rows of all runs in one long frame (collective, nranks, status, label …)."""
    frames = [r.rows.assign(collective=r.collective, nranks=r.nranks, status=r.status, label=label or r.source)
              for r in runs if not r.rows.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def runs_table(runs: list[NcclTestRun]) -> pd.DataFrame:
    """One line per run: collective, ranks, sizes, peak busbw, the footer's average, verdict."""
    rows = []
    for r in runs:
        oop = r.rows[r.rows.placement == "out-of-place"] if not r.rows.empty else r.rows
        rows.append({
            "collective": r.collective, "nranks": r.nranks, "nccl_tests": r.version, "nccl": r.nccl_library,
            "sizes": int(oop.size_bytes.nunique()) if not oop.empty else 0,
            "min_size_bytes": int(oop.size_bytes.min()) if not oop.empty else None,
            "max_size_bytes": int(oop.size_bytes.max()) if not oop.empty else None,
            "peak_busbw_gbps": float(r.rows.busbw_gbps.max()) if not r.rows.empty else math.nan,
            "small_msg_time_us": float(oop.time_us.iloc[0]) if not oop.empty else math.nan,
            "avg_busbw_gbps": r.avg_busbw_gbps, "status": r.status, "reason": r.reason,
        })
    return pd.DataFrame(rows)
