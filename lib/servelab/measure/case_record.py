"""The case record: one folder layout and one versioned ``summary.json`` for every measured case of every phase.

A *case* is one measured workload against a running engine (a Phase 1 matrix point, a Phase 2 replay, a Phase 7
interference case, a Phase 8 hit-rate point, a Phase 9 speculative point). Every phase writes it through
:class:`CaseFolder`, in this order:

1. ``meta.json`` — ``status: running`` and ``started`` before anything is sent (what was asked, how);
2. ``requests.jsonl`` — the raw request records, appended one line per request as each completes (line-buffered,
   :meth:`CaseFolder.stream_record`), then rewritten whole and fsynced at the end of the case (nothing is
   summarised before it is on disk); a case stopped by Ctrl-C keeps the records it received and gets an
   ``INTERRUPTED`` summary (:meth:`CaseFolder.interrupt`), which resume never takes as done;
3. ``server/`` — the engine's metrics over the case (``metrics.parquet`` scraped during it, and/or the
   ``metrics_before.prom`` / ``metrics_after.prom`` snapshots around the window), the engine log excerpt;
4. phase tables (``windows.csv``, ``injections.csv`` …), if the phase has any;
5. ``summary.json`` — last of the case's results, refused before ``requests.jsonl`` exists;
6. ``meta.json`` again with the final ``status``, ``ended`` and ``error``.

``summary.json`` (schema version :data:`SCHEMA_VERSION`) has the same keys in every phase
(:class:`CaseSummary`); the verdict of a case is ``verdict.status`` (``VALID`` / ``INVALID`` /
``INTERRUPTED``) with its
``verdict.reasons`` and nowhere else. Readers (A/B, milestones, archive, explorer) go through
:func:`read_summaries` / :func:`repeat_frame`, never through a phase's own tables. The layout and the rules are
described for users in ``docs/case.md``.
"""
from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd

from servelab.core.run import now_iso, write_json_atomic
from servelab.measure import request_metrics as mx
from servelab.measure.records import write_records, ClientRun, read_records

SCHEMA_VERSION = 1
VALID, INVALID = "VALID", "INVALID"
INTERRUPTED = "INTERRUPTED"          # stopped by the user (Ctrl-C) mid-case: its records are kept, it is not a result
VERDICTS = (VALID, INVALID, INTERRUPTED)
# how the case ran (independent of whether its numbers may be used: that is the verdict)
RUN_STATUSES = ("success", "failed", "ENGINE_CRASH", "OOM", INTERRUPTED)
# what sort of case it is
KINDS = ("prefill", "decode", "mixed", "search", "interference", "prefix_cache", "speculative")
REQUIRED = ("schema_version", "case_id", "repeat_of", "phase", "kind", "status", "verdict", "started", "ended",
            "counts", "definition", "metrics", "repeats", "details", "percentile_method")
# optional keys (schema 1, added without a version bump; docs/case.md#schema-history): absent in older summaries
OPTIONAL = ("integrity",)
CASES_INDEX = "cases.json"            # in a run-like record: which case summaries it holds, under which case id


class SummarySchemaError(ValueError):
    """A ``summary.json`` that does not follow the case schema (names the file and every problem)."""


@dataclass
class CaseSummary:
    """What ``summary.json`` holds (see the module docstring and ``docs/case.md``)."""
    case_id: str                                  # the folder name under ``cases/``
    phase: str                                    # phase1, phase2, phase7 ...
    kind: str                                     # one of KINDS
    status: str                                   # how the case ran: one of RUN_STATUSES
    verdict: dict[str, Any]                       # {"status": VALID | INVALID, "reasons": [...]}: the only verdict
    definition: str                               # the metric definition the phase reports in (vllm | sglang)
    metrics: dict[str, dict[str, Any]]            # definition → pooled summary over every repeat
    repeats: list[dict[str, Any]]                 # [{"repeat": i, "valid": bool, "metrics": {definition: {...}}}]
    counts: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)     # phase-specific, free form
    repeat_of: str = ""                           # the case this folder repeats ("" → case_id)
    started: str = ""
    ended: str = ""
    schema_version: int = SCHEMA_VERSION
    percentile_method: str = mx.PERCENTILE_METHOD
    integrity: dict[str, Any] = field(default_factory=dict)   # mx.integrity: did the client keep up ({}: not measured)

    def to_json(self) -> dict[str, Any]:
        """The ``summary.json`` object: ``repeat_of`` defaults to ``case_id``; a repeat is valid only when it says
        so (default yes) and the case is VALID."""
        out = asdict(self)
        out["repeat_of"] = self.repeat_of or self.case_id
        ok = self.verdict.get("status") == VALID
        out["repeats"] = [{"repeat": int(r.get("repeat", i)), "valid": bool(r.get("valid", True)) and ok,
                           "metrics": r.get("metrics") or {}} for i, r in enumerate(self.repeats)]
        return {**{k: out[k] for k in REQUIRED}, **({"integrity": out["integrity"]} if self.integrity else {})}


def verdict(status: str, reasons: Iterable[str] = ()) -> dict[str, Any]:
    """The verdict object of a summary: ``{"status": VALID | INVALID | INTERRUPTED, "reasons": [...]}``."""
    if status not in VERDICTS:
        raise ValueError(f"verdict status must be one of {VERDICTS}, got {status!r}")
    return {"status": status, "reasons": [str(r) for r in reasons]}


def verdict_of(v: mx.Verdict) -> dict[str, Any]:
    return verdict(v.verdict, v.reasons)


def client_integrity(run: Any) -> dict[str, Any]:
    """``request_metrics.integrity`` of a client run that had its loop-lag monitor on; ``{}`` (not measured) for
    none, or for a run without monitor samples."""
    if not isinstance(run, ClientRun) or not run.loop_lag_ns:
        return {}
    return mx.integrity(run)


def judged_row(records: Sequence[Any], run: Any, definition: str, row_ok: bool, reasons_text: str | None,
               status: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pooled metrics, verdict) of a case whose phase judged it as a table row (Phase 8's ACCEPTED/REJECTED,
    Phase 9's validity): the measured requests summarised under ``definition``; VALID only when the row was judged
    good, the case ran to success and the client kept up (:func:`client_integrity`); otherwise INVALID with the
    row's ``"; "``-joined reasons (or the status) and the integrity reasons."""
    measured = [r for r in records if r.role == "measure"]
    pooled = {definition: mx.summarize(measured, max(run.duration_s, 1e-9), definition)} if run and measured else {}
    behind = list(client_integrity(run).get("reasons") or [])
    ok = row_ok and status == "success" and not behind
    reasons = [x for x in str(reasons_text or "").split("; ") if x]
    if not reasons and not (row_ok and status == "success"):
        reasons = [f"case status {status}"]
    return pooled, verdict(VALID if ok else INVALID, [] if ok else reasons + [b for b in behind if b not in reasons])


def is_valid(summary: dict[str, Any]) -> bool:
    return (summary.get("verdict") or {}).get("status") == VALID


def request_counts(records: Sequence[Any], measured_roles: tuple[str, ...] = ("measure",)) -> dict[str, int]:
    """``requests`` (all), one count per role, and ``measured`` / ``completed`` / ``failed`` over ``measured_roles``."""
    out: dict[str, int] = {"requests": len(records)}
    for r in records:
        out[r.role] = out.get(r.role, 0) + 1
    measured = [r for r in records if r.role in measured_roles]
    out["measured"] = len(measured)
    out["completed"] = sum(1 for r in measured if r.ok)
    out["failed"] = out["measured"] - out["completed"]
    return out


# ---------------------------------------------------------------- validation

def summary_problems(obj: Any) -> list[str]:
    """Every way ``obj`` departs from the schema (empty: it follows it)."""
    if not isinstance(obj, dict):
        return [f"not a JSON object but {type(obj).__name__}"]
    p = [f"missing key '{k}'" for k in REQUIRED if k not in obj]
    p += [f"unknown key '{k}'" for k in obj if k not in REQUIRED and k not in OPTIONAL]
    if p:
        return p
    if obj["schema_version"] != SCHEMA_VERSION:
        p.append(f"schema_version {obj['schema_version']!r}, this servelab reads {SCHEMA_VERSION}")
    for k in ("case_id", "repeat_of", "phase", "definition", "started", "ended"):
        if not isinstance(obj[k], str):
            p.append(f"'{k}' is not a string")
    if not obj["case_id"] or not obj["repeat_of"] or not str(obj["phase"]).startswith("phase"):
        p.append("case_id and repeat_of must be set and phase must be 'phase<N>'")
    if obj["kind"] not in KINDS:
        p.append(f"kind {obj['kind']!r} is not one of {KINDS}")
    if obj["status"] not in RUN_STATUSES:
        p.append(f"status {obj['status']!r} is not one of {RUN_STATUSES}")
    v = obj["verdict"]
    if not isinstance(v, dict) or set(v) != {"status", "reasons"} or v.get("status") not in VERDICTS \
            or not isinstance(v.get("reasons"), list):
        p.append("verdict must be {'status': VALID|INVALID|INTERRUPTED, 'reasons': [...]}")
    else:
        if v["status"] in (INVALID, INTERRUPTED) and not v["reasons"]:
            p.append(f"an {v['status']} verdict must give its reasons")
        if (v["status"] == INTERRUPTED) != (obj["status"] == INTERRUPTED):
            p.append("an INTERRUPTED verdict goes with an INTERRUPTED status, and only with it")
        if v["status"] == VALID and v["reasons"]:
            p.append("a VALID verdict has no reasons")
        if v["status"] == VALID and obj["status"] != "success":
            p.append(f"a case that ended {obj['status']} cannot be VALID")
    if not isinstance(obj["counts"], dict) or not all(isinstance(x, int) for x in obj["counts"].values()):
        p.append("counts must map names to integers")
    if not isinstance(obj["metrics"], dict) or not all(isinstance(x, dict) for x in obj["metrics"].values()):
        p.append("metrics must map a definition to a summary object")
    elif obj["metrics"] and obj["definition"] not in obj["metrics"]:
        p.append(f"metrics has no entry for the case's definition {obj['definition']!r}")
    if not isinstance(obj["repeats"], list):
        p.append("repeats must be a list")
    else:
        for i, r in enumerate(obj["repeats"]):
            if not isinstance(r, dict) or set(r) != {"repeat", "valid", "metrics"} or not isinstance(r["repeat"], int) \
                    or not isinstance(r["valid"], bool) or not isinstance(r["metrics"], dict):
                p.append(f"repeats[{i}] must be {{'repeat': int, 'valid': bool, 'metrics': {{definition: {{...}}}}}}")
            elif r["valid"] and isinstance(v, dict) and v.get("status") != VALID:
                p.append(f"repeats[{i}] is valid in an INVALID case")
    if not isinstance(obj["details"], dict):
        p.append("details must be an object")
    if "integrity" in obj:
        g = obj["integrity"]
        if not isinstance(g, dict) or not isinstance(g.get("ok"), bool) or not isinstance(g.get("reasons"), list):
            p.append("integrity must be {'ok': bool, 'reasons': [...], ...}")
        elif not g["ok"] and isinstance(v, dict) and v.get("status") == VALID:
            p.append("a case whose client fell behind (integrity not ok) cannot be VALID")
    return p


def validate_summary(obj: Any, source: str | Path = "summary.json") -> dict[str, Any]:
    """``obj`` if it follows the case schema; else :class:`SummarySchemaError` naming ``source`` and every problem."""
    problems = summary_problems(obj)
    if problems:
        raise SummarySchemaError(f"{source}: not a servelab case summary (schema {SCHEMA_VERSION}): "
                                 + "; ".join(problems))
    return obj


def read_summary(path: str | Path) -> dict[str, Any]:
    """One ``summary.json``, validated."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SummarySchemaError(f"{path}: not JSON ({exc})") from exc
    return validate_summary(obj, path)


# ---------------------------------------------------------------- writing a case

class CaseFolder:
    """``<run>/cases/<case_id>/`` written in the contract's order (module docstring).

    ``meta`` is what the phase records about how the case was run; ``case_id``, ``phase``, ``kind``, ``status``
    and ``started`` are added here. Stale results of an earlier attempt (``summary.json``, ``requests.jsonl``)
    are removed first, so a folder never pairs new raw data with an old summary.
    """

    def __init__(self, run_dir: str | Path, case_id: str, phase: str, kind: str, meta: dict[str, Any] | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.case_id, self.phase, self.kind = case_id, phase, kind
        self.dir = Path(run_dir) / "cases" / case_id
        (self.dir / "server").mkdir(parents=True, exist_ok=True)
        for stale in ("summary.json", "requests.jsonl"):
            (self.dir / stale).unlink(missing_ok=True)
        self.meta: dict[str, Any] = {"case_id": case_id, "phase": phase, "kind": kind, **(meta or {}),
                                     "status": "running", "started": now_iso()}
        self._raw_written = False
        self._stream: Any = None                  # requests.jsonl open for appending while the case runs
        self._stream_lock = threading.Lock()      # records may arrive from the client's thread
        self._streamed = 0
        self.save_meta()

    @property
    def started(self) -> str:
        return str(self.meta["started"])

    def save_meta(self, **updates: Any) -> None:
        self.meta.update(updates)
        write_json_atomic(self.dir / "meta.json", self.meta)

    @property
    def requests_path(self) -> Path:
        return self.dir / "requests.jsonl"

    def stream_record(self, rec: Any) -> None:
        """Append one record to ``requests.jsonl`` as its request completes (line-buffered: on disk at once, so
        a Ctrl-C or a killed kernel keeps every record received). Safe from any thread; after
        :meth:`close_stream` (the case ended or was interrupted) a late record is dropped. A
        ``ClientConfig.on_record`` hook."""
        line = json.dumps(rec.to_json(), ensure_ascii=False) + "\n"
        with self._stream_lock:
            if self._stream is False:
                return
            if self._stream is None:
                self._stream = open(self.requests_path, "a", buffering=1, encoding="utf-8")
            self._stream.write(line)
            self._streamed += 1

    def close_stream(self) -> int:
        """Flush, fsync and close the record stream; later records are dropped. Returns how many were streamed."""
        with self._stream_lock:
            f, self._stream = self._stream, False
            if f:
                try:
                    f.flush()
                    os.fsync(f.fileno())
                finally:
                    f.close()
            return self._streamed

    def write_requests(self, records: Sequence[Any]) -> Path:
        """The raw records of the whole case, in order (fsynced): always before the summary. Replaces what was
        streamed during the case (the same records, in completion order) in one atomic step."""
        self.close_stream()
        path = self.requests_path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write_records(tmp, list(records))
        os.replace(tmp, path)
        self._raw_written = True
        return path

    def interrupt(self, reason: str = "stopped by the user (Ctrl-C)", definition: str = mx.VLLM_BENCH,
                  details: dict[str, Any] | None = None, measured_roles: tuple[str, ...] = ("measure",)
                  ) -> dict[str, Any]:
        """The case was stopped mid-way: the streamed records are fsynced and kept as they are, ``summary.json``
        says ``status`` / ``verdict.status`` ``INTERRUPTED`` (with how many records were received), ``meta.json``
        is closed with the same status. No metrics: the records are evidence, not a result. Returns the
        summary written."""
        self.close_stream()
        path = self.requests_path
        if not path.exists():
            path.touch()
        try:
            records: list[Any] = read_records(path)
        except ValueError:                          # a line cut mid-write by the interrupt: keep the file as is
            records = []
        self._raw_written = True
        counts = request_counts(records, measured_roles)
        why = f"{reason}: {counts['measured']} measured request(s) received before the stop"
        obj = self.write_summary(CaseSummary(
            case_id=self.case_id, phase=self.phase, kind=self.kind, status=INTERRUPTED,
            verdict=verdict(INTERRUPTED, [why]), definition=definition, metrics={}, repeats=[], counts=counts,
            details={**(details or {}), "interrupted": {"reason": reason, "records": len(records)}}))
        self.finish(INTERRUPTED, why)
        return obj

    def write_metrics(self, scrape: pd.DataFrame | None = None, before: Any = None, after: Any = None,
                      scrape_errors: Any = None) -> None:
        """The engine's metrics over the case: the scraped series and/or the raw snapshots around the window."""
        if scrape is not None and not scrape.empty:
            scrape.to_parquet(self.dir / "server" / "metrics.parquet")
        if scrape_errors is not None:
            write_json_atomic(self.dir / "server" / "scrape_errors.json", scrape_errors)
        if before is not None and after is not None:
            write_snapshots(self.dir, before, after)

    def write_log_excerpt(self, text: str, limit: int = 200_000, clock: dict[str, Any] | None = None) -> None:
        """The engine log written during the case (its last ``limit`` characters) and, with ``clock``
        (``target.server.log_clock``), how its lines map to the wall clock (``engine_log_clock.json``)."""
        (self.dir / "server" / "engine_log_excerpt.txt").write_text(text[-limit:])
        if clock is not None:
            write_json_atomic(self.dir / "server" / "engine_log_clock.json",
                              {**clock, "truncated_head": len(text) > limit})

    def write_summary(self, summary: CaseSummary) -> dict[str, Any]:
        """``summary.json``: refused before ``requests.jsonl``; validated; a repeat is never valid in an
        INVALID case. Returns what was written."""
        if not self._raw_written or not (self.dir / "requests.jsonl").is_file():
            raise RuntimeError(f"{self.dir}: requests.jsonl must be written before summary.json")
        summary.case_id, summary.phase, summary.kind = self.case_id, self.phase, self.kind
        summary.started = summary.started or self.started
        summary.ended = summary.ended or now_iso()
        obj = json.loads(json.dumps(summary.to_json(), default=_json_default, ensure_ascii=False))
        validate_summary(obj, self.dir / "summary.json")
        write_json_atomic(self.dir / "summary.json", obj)
        return obj

    def finish(self, status: str, error: str = "", **meta: Any) -> None:
        """``meta.json`` closed: final status, end time, error (empty when none)."""
        self.save_meta(status=status, ended=now_iso(), error=error, **meta)


def write_snapshots(case_dir: Path, before: Any, after: Any) -> None:
    """Both raw ``/metrics`` bodies of a window under ``server/`` (``metrics_before.prom``, ``metrics_after.prom``)
    and their times (``metrics_snapshots.json``); ``before`` / ``after`` are
    ``servelab.measure.launch_variants.Snapshot`` objects."""
    d = Path(case_dir) / "server"
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics_before.prom").write_text(before.text)
    (d / "metrics_after.prom").write_text(after.text)
    write_json_atomic(d / "metrics_snapshots.json", {
        "before": {"ts_ns": before.ts_ns, "wall_ns": before.wall_ns, "status": before.status},
        "after": {"ts_ns": after.ts_ns, "wall_ns": after.wall_ns, "status": after.status},
        "window_s": (after.ts_ns - before.ts_ns) / 1e9})


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):                       # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    return str(o)


# ---------------------------------------------------------------- reading cases

def summary_paths(run_dir: str | Path) -> list[tuple[str | None, Path | None, str]]:
    """``(case id or None, summary path or None, note)`` for the cases a run (or a run-like record) holds.

    A run: every ``cases/*/summary.json`` (case id None: the summary's own ``repeat_of`` names the case). A
    run-like record (Phases 7 and 9 write one per launch variant): the cases its ``cases.json`` lists, under the
    case id they are compared as (the same on every side of an A/B); a case that could not run is listed
    without a summary and with the reason.
    """
    rdir = Path(run_dir)
    index = rdir / CASES_INDEX
    if index.is_file():
        out: list[tuple[str | None, Path | None, str]] = []
        for e in json.loads(index.read_text()).get("cases", []):
            p = e.get("summary")
            out.append((str(e["case_id"]), (rdir / p).resolve() if p else None, str(e.get("reason", ""))))
        return out
    return [(None, p, "") for p in sorted((rdir / "cases").glob("*/summary.json"))]


def read_summaries(run_dir: str | Path, phase: str | None = None, errors: list[str] | None = None
                   ) -> list[dict[str, Any]]:
    """Every case summary of a run (validated), optionally of one phase; each gets ``_path``. A file that does
    not follow the schema raises, or — with ``errors`` given — is skipped and its problem appended there."""
    out = []
    for _, p, _ in summary_paths(run_dir):
        if p is None:
            continue
        try:
            s = read_summary(p)
        except (SummarySchemaError, OSError) as exc:
            if errors is None:
                raise
            errors.append(str(exc))
            continue
        if phase is None or s["phase"] == phase:
            out.append({**s, "_path": str(p)})
    return out


def repeat_frame(run_dir: str | Path, definition: str = mx.VLLM_BENCH, metrics: Sequence[str] | None = None,
                 aliases: dict[str, str] | None = None, phase: str | None = None
                 ) -> tuple[pd.DataFrame, list[str]]:
    """One row per repeat of every case: ``case_id`` (the case it repeats, or its A/B case id in a record),
    ``case_dir``, ``phase``, ``kind``, ``repeat``, ``valid`` and the metric columns (``metrics`` or all), taken
    in ``definition`` where the case has it (else in the case's own definition, with a note). Returns
    ``(frame, notes)``."""
    aliases = aliases or {}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    fell_back: set[str] = set()
    for cid, path, reason in summary_paths(run_dir):
        if path is None:
            cid = cid or "?"
            rows.append({"case_id": cid, "case_dir": "", "phase": "", "kind": "", "repeat": 0, "valid": False})
            notes.append(f"{cid}: no case summary ({reason or 'the case did not run'})")
            continue
        s = read_summary(path)
        if phase is not None and s["phase"] != phase:
            continue
        key = cid if cid is not None else s["repeat_of"]
        for r in s["repeats"]:
            m = r["metrics"].get(definition)
            if m is None:
                m = r["metrics"].get(s["definition"], {})
                fell_back.add(s["definition"])
            m = {aliases.get(k, k): v for k, v in m.items()}
            keep = {k: v for k, v in m.items() if (metrics is None or k in metrics) and _scalar(v)}
            rows.append({"case_id": key, "case_dir": path.parent.name, "phase": s["phase"], "kind": s["kind"],
                         "repeat": r["repeat"], "valid": r["valid"], **keep})
    if fell_back:
        notes.append(f"definition '{definition}' absent in some cases; their own used: {', '.join(sorted(fell_back))}")
    frame = pd.DataFrame(rows, columns=["case_id", "case_dir", "phase", "kind", "repeat", "valid"]
                         + sorted({k for r in rows for k in r} - {"case_id", "case_dir", "phase", "kind", "repeat",
                                                                   "valid"}))
    return frame, notes


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (int, float, str, bool)) and not (isinstance(v, float) and math.isinf(v))


def write_case_index(record_dir: str | Path, cases: Sequence[tuple[str, Path | None, str]]) -> Path:
    """``cases.json`` of a run-like record: ``(case id to compare as, case folder or None, reason)`` each."""
    record_dir = Path(record_dir)
    record_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for cid, cdir, reason in cases:
        p = Path(cdir) / "summary.json" if cdir is not None else None
        rel = os.path.relpath(p, record_dir) if p is not None and p.is_file() else None
        e: dict[str, Any] = {"case_id": cid, "summary": rel}
        if rel is None:
            e["reason"] = reason or "no summary.json"
        entries.append(e)
    path = record_dir / CASES_INDEX
    write_json_atomic(path, {"schema_version": SCHEMA_VERSION, "cases": entries})
    return path
