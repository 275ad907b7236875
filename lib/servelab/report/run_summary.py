"""What one run is, in a few lines, and what holds for all of it: the run summary that opens the run index.

The facts — target, engine, model, hardware, where the client ran — come from the manifest (Phase 0 wrote the
hosts, the engine and the model). Each phase says where its numbers come from (``sources`` in its manifest entry,
:data:`SOURCE_KINDS`): measured live on the target, recorded sample data (and which), or a model (and which), so a
reader never takes a recorded H200 bus bandwidth for this target's. The run-level verdicts are computed from the
run's own files, each with the evidence it rests on:

- **host-bound**: the client runs on the engine's host, that host has few cores, Phase 2 saw them saturated in
  its windows and/or cases are INVALID because the client fell behind — then every latency figure of the run is
  bounded by the host, not by the engine;
- **cross-checks**: results that answer the same question and disagree beyond their noise (``report.crosscheck``);
- **validity**: how many measured cases are not results.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.core.run import read_manifest
from servelab.deploy.facts import FREEZE_MARKING
from servelab.deploy.targets import load_target
from servelab.measure.case_record import read_summaries
from servelab.report import crosscheck

SOURCE_KINDS = {"live": "measured live", "samples": "recorded sample data", "model": "model only",
                "unsupported": "not supported on this target"}
BADGE_CLASS = {"live": "live", "samples": "samples", "model": "model", "unsupported": "model"}
BUSY_PCT = 90.0          # a window whose whole-machine CPU busy mean is at least this is saturated
FEW_CORES = 8            # a host with at most this many cores, shared by client and engine, bounds the latencies


def phase_sources(entry: dict[str, Any]) -> list[dict[str, str]]:
    """Where a phase's numbers come from: its recorded ``sources`` (kind + what), else live — or recorded sample
    data when the phase only says ``from_samples``."""
    if entry.get("status") == "unsupported":      # it said why before starting anything: nothing was measured
        return [{"kind": "unsupported", "what": str(entry.get("error") or "the target cannot do what it measures")}]
    got = [s for s in entry.get("sources") or [] if isinstance(s, dict) and s.get("kind") in SOURCE_KINDS]
    if got:
        return got
    if entry.get("from_samples"):
        return [{"kind": "samples", "what": "recorded sample data (data/samples)"}]
    return [{"kind": "live", "what": "measured on this run's target"}]


@dataclass
class Verdict:
    """One run-level verdict and the files / page sections it rests on (paths relative to the run folder)."""
    key: str
    text: str
    level: str = "warning"               # warning | ok | info
    evidence: list[tuple[str, str]] = field(default_factory=list)     # (label, href)


def _hosts(m: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in (m.get("hosts") or {}).items() if isinstance(v, dict)}


def _target(m: dict[str, Any], run_dir: Path) -> Any:
    name = str(m.get("target") or "")
    for cand in (run_dir / "targets" / f"{name}.yaml", name):
        try:
            if isinstance(cand, Path) and not cand.is_file():
                continue
            return load_target(str(cand))
        except (ValueError, OSError, KeyError, TypeError):    # a target that no longer loads: said unknown
            continue
    return None


def _int(v: Any) -> int | None:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return None


def end_changes_text(m: dict[str, Any]) -> str | None:
    """The run index's line: when the end freeze was taken and what changed per node since Phase 0 (None when no
    end freeze was taken)."""
    end = m.get("frozen_end") or {}
    if not end:
        return None
    changes = m.get("frozen_end_changes") or []
    when = max((str(v.get("taken", "")) for v in end.values() if isinstance(v, dict)), default="")
    per_node = []
    for node in end:
        mine = [c for c in changes if c.get("node") == node]
        per_node.append(f"{node}: " + ("no change" if not mine else "; ".join(
            f"{c['what']} {c['before']} → {c['after']}" for c in mine[:6]) + (" …" if len(mine) > 6 else "")))
    marked = sorted({c["kind"] for c in changes if c.get("kind") in FREEZE_MARKING})
    return (f"frozen again at the run's end ({when}) against Phase 0: " + "; ".join(per_node)
            + (f". CHANGED {', '.join(marked)}: the run's comparisons are marked" if marked else ""))


def facts(run_dir: Path) -> list[tuple[str, str]]:
    """(label, text) rows: target, engine, model, hardware, client."""
    m = read_manifest(run_dir)
    t = _target(m, run_dir)
    rows = [("target", f"{m.get('target', '-')}" + (f" — {t.description}" if t is not None and t.description else ""))]
    eng = m.get("engine") or {}
    if eng:
        rows.append(("engine", " ".join(x for x in (str(eng.get("name") or eng.get("engine") or ""),
                                                   str(eng.get("version") or "").replace("version: ", "")) if x)))
    elif t is not None:
        rows.append(("engine", f"{t.engine} (version not recorded: Phase 0 did not run)"))
    model = m.get("model") or {}
    if model:
        size = _int(model.get("size_bytes"))
        arch = model.get("general.architecture") or model.get("architecture") or ""
        name = model.get("general.name") or Path(str(model.get("path", ""))).name
        rows.append(("model", f"{name} ({Path(str(model.get('path', ''))).name}"
                              + (f", {size / 2**20:,.1f} MiB" if size else "") + (f", {arch}" if arch else "") + ")"))
    elif t is not None:
        rows.append(("model", f"{t.model} (file facts not recorded: Phase 0 did not run)"))
    hw = []
    for node, h in _hosts(m).items():
        gpus = h.get("gpu_list") or "-"
        gpu = "no GPU" if gpus in ("-", "", None) else f"{len(str(gpus).splitlines())} GPU(s): " \
            + str(gpus).splitlines()[0].split("(")[0].strip()
        mem = str(h.get("memory_total", "")).split()
        mem_txt = f", {int(mem[1]) / 2**20:,.1f} GiB memory" if len(mem) >= 2 and mem[1].isdigit() else ""
        hw.append(f"{node}: {h.get('cpu_count', '?')} CPU core(s) ({h.get('cpu_model', '?')}){mem_txt}, {gpu}")
    rows.append(("hardware", "; ".join(hw) or "not recorded (Phase 0 did not run)"))
    rows.append(("client", client_location(m, t)))
    if (end := end_changes_text(m)) is not None:
        rows.append(("environment at the end", end))
    return rows


def client_location(m: dict[str, Any], t: Any) -> str:
    """Where the benchmark client ran relative to the engine."""
    if t is None:
        return "where servelab ran (the target could not be read)"
    if t.is_local:
        return (f"on the same host as the engine ({t.api_host}, loopback): client and engine share its CPU cores")
    return (f"on the machine servelab ran on, sending to {t.api_host}:{t.port} — the engine on "
            + ", ".join(f"{n.name} ({n.kind})" for n in t.nodes))


def _cpu_busy(run_dir: Path) -> list[tuple[str, float, int]]:
    """(case, whole-machine CPU busy mean %, samples) per Phase 2 window on the head node."""
    p = run_dir / "phase2" / "case_cpu_busy_pct_summary.csv"
    out = []
    try:
        with open(p, newline="") as f:
            for r in csv.DictReader(f):
                try:
                    out.append((r["case"], float(r["head_mean"]), int(float(r["head_n"]))))
                except (KeyError, ValueError):
                    continue
    except OSError:
        return []
    return out


def client_stalls(run_dir: Path) -> list[tuple[str, str]]:
    """(case, reason) of every INVALID case whose verdict says the client fell behind (integrity)."""
    out = []
    for s in read_summaries(run_dir, errors=[]):
        v = s.get("verdict") or {}
        if v.get("status") == "VALID":
            continue
        why = [r for r in v.get("reasons") or [] if "client" in r or "event loop" in r or "dispatch" in r]
        if why:
            out.append((s["case_id"], why[0]))
    return out


def host_bound(run_dir: Path) -> Verdict | None:
    """The host-bound verdict (module docstring), or None when the evidence does not hold it."""
    m = read_manifest(run_dir)
    t = _target(m, run_dir)
    if t is None or not t.is_local:
        return None
    head = next(iter(_hosts(m).values()), {})
    cores = _int(head.get("cpu_count"))
    busy = _cpu_busy(run_dir)
    saturated = [b for b in busy if b[1] >= BUSY_PCT]
    stalls = client_stalls(run_dir)
    few = cores is not None and cores <= FEW_CORES
    if not (few and (saturated or stalls)):
        return None
    parts = []
    ev = [("Phase 0: the host's cores", "phase0/facts.csv")]
    if busy:
        lo = min(b[1] for b in saturated) if saturated else None
        parts.append(f"Phase 2 saw the whole machine ≥ {BUSY_PCT:g} % busy in {len(saturated)} of its {len(busy)} "
                     f"case windows" + (f" (lowest mean {lo:.1f} %)" if lo is not None else ""))
        ev.append(("Phase 2: CPU busy per window", "phase2/case_cpu_busy_pct_summary.csv"))
    else:
        parts.append("Phase 2 did not measure CPU use in this run")
    if stalls:
        parts.append(f"{len(stalls)} case(s) are INVALID because the client fell behind ("
                     + "; ".join(f"{c}: {r}" for c, r in stalls[:3]) + (" …" if len(stalls) > 3 else "") + ")")
        ev += [(f"case {c}", f"cases/{c}/summary.json") for c, _ in stalls[:3]]
    state = "saturated " if saturated else ""
    text = (f"Client and engine share {cores} {state}CPU core(s) of one host: latency and throughput figures of this "
            f"run are bounded by the host, not by the engine. " + "; ".join(parts) + ".")
    return Verdict("host-bound", text, "warning", ev)


def verdicts(run_dir: Path) -> list[Verdict]:
    """Every run-level verdict, most important first."""
    out = []
    hb = host_bound(run_dir)
    if hb is not None:
        out.append(hb)
    for text in crosscheck.findings(run_dir):
        level = "warning" if "disagree" in text else ("ok" if "agree" in text else "info")
        out.append(Verdict("crosscheck", text, level, [("Phase 1: cross-checks", "phase1/report.html#Cross-checks:"
                                                        "-results-that-answer-the-same-question")]))
    sums = read_summaries(run_dir, errors=[])
    bad = [s for s in sums if (s.get("verdict") or {}).get("status") != "VALID"]
    if sums:
        out.append(Verdict("validity", f"{len(sums) - len(bad)} of {len(sums)} measured cases are VALID"
                           + (f"; the {len(bad)} INVALID {'is' if len(bad) == 1 else 'are'} never presented as results"
                              if bad else "") + ".",
                           "warning" if bad else "ok", [("Measured cases", "#measured-cases")]))
    m = read_manifest(run_dir)
    rec = [p for p, e in (m.get("phases") or {}).items()
           if any(s["kind"] != "live" for s in phase_sources(e))]
    if rec:
        out.append(Verdict("sources", "Numbers of " + ", ".join(sorted(rec, key=_phase_no)) + " are (partly) "
                           "recorded sample data or a model, not measurements of this target: they are badged "
                           "as such here and at the top of their pages.", "info"))
    return out


def _phase_no(p: str) -> int:
    return int(p[5:]) if p[5:].isdigit() else 99


def sources_rows(run_dir: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """(kind label, [(phase, what)]) for live, recorded and model data, and phases the target cannot run."""
    m = read_manifest(run_dir)
    by: dict[str, list[tuple[str, str]]] = {k: [] for k in SOURCE_KINDS}
    for p in sorted(m.get("phases") or {}, key=_phase_no):
        for s in phase_sources(m["phases"][p]):
            by[s["kind"]].append((p, str(s.get("what") or "")))
    return [(SOURCE_KINDS[k], v) for k, v in by.items() if v or k != "unsupported"]


def summary_json(run_dir: Path) -> dict[str, Any]:
    """The run summary as data (what the index shows)."""
    return {"facts": facts(run_dir), "sources": sources_rows(run_dir),
            "verdicts": [{"key": v.key, "text": v.text, "level": v.level, "evidence": v.evidence}
                         for v in verdicts(run_dir)]}


def write_summary_json(run_dir: Path) -> Path:
    out = run_dir / "run_summary.json"
    out.write_text(json.dumps(summary_json(run_dir), indent=1, ensure_ascii=False))
    return out
