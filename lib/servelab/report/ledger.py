"""The investigation ledger: hypotheses (the built-in H1–H7 of ``docs/method.md#hypotheses`` plus the user's),
and the evidence phases record.

A phase notebook states what its data says about a hypothesis:

    record_evidence(ctx, "H5", "refuted", "decode is graph-replayed: 98% of kernels; host-bound gaps 0.4%",
                    anchor="CUDA-graph-coverage-(Q5)", table=["trace_graph_coverage.csv", "trace_gap_summary.csv"])

Evidence goes to ``<run>/evidence.jsonl`` (append-only, with the phase, a link to the section of its page and
the tables it rests on, relative to the run folder: ``phase3/trace_graph_coverage.csv``). Each phase's latest
evidence about a hypothesis supersedes what that phase said before. A hypothesis is ``open`` without evidence,
else the verdict of its latest evidence; evidence of different phases that disagrees is shown as ``contested``.
A refutation is evidence too: "PP bubble refuted: both stages busy 96%".

Evidence computed from recorded sample data (``ctx.from_samples``: the phase read ``data/samples``, not this
target) says so in its summary, keeps what the rule said in ``numbers["rule_verdict"]`` and is recorded as
``inconclusive``: it never supports or refutes anything about the live target (as milestone M2 never counts
sample windows).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import yaml

from servelab.core.paths import project_root
from servelab.core.run import now_iso, read_manifest
from servelab.core.params import ParamError, did_you_mean
from servelab.core.scope import RunScope

VERDICTS = ("supported", "refuted", "inconclusive")


@dataclass
class Evidence:
    hypothesis: str
    verdict: str
    summary: str
    phase: str
    link: str
    when: str
    numbers: dict[str, Any]
    tables: list[str] = field(default_factory=list)   # the tables it rests on, relative to the run folder
    from_samples: bool = False                         # computed from recorded sample data, not this target


def hypotheses() -> dict[str, dict[str, Any]]:
    """The built-in H1–H7 and the user's own (``params/hypotheses.yaml``), by id."""
    builtin = yaml.safe_load((Path(__file__).resolve().parents[1] / "data" / "hypotheses.yaml").read_text())
    user_file = project_root() / "params" / "hypotheses.yaml"
    user = yaml.safe_load(user_file.read_text()) if user_file.exists() else {}
    for h in (user or {}).values():
        h.setdefault("source", "user")
    for h in builtin.values():
        h.setdefault("source", "built-in")
    return {**builtin, **(user or {})}


def record_evidence(ctx: RunScope, hypothesis: str, verdict: str, summary: str, anchor: str = "",
                    numbers: dict[str, Any] | None = None, table: str | Sequence[str] = (),
                    from_samples: bool | None = None) -> Evidence:
    """Append one piece of evidence from this phase about ``hypothesis``.

    ``anchor``: the section of the phase page that shows the data; ``table``: the file(s) the rule read, in this
    phase's folder (``trace_actions.csv``) or relative to the run folder (``phase3/trace_summary.csv``,
    ``cases/M1_treatment/summary.json``).
    ``from_samples`` (default ``ctx.from_samples``): the data is a recorded sample — the evidence is then
    recorded as ``inconclusive`` with the rule's own verdict in ``numbers["rule_verdict"]``."""
    known = hypotheses()
    if hypothesis not in known:
        raise ParamError(f"unknown hypothesis '{hypothesis}'{did_you_mean(hypothesis, set(known))}")
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, not '{verdict}'")
    link = f"{ctx.phase}/report.html" + (f"#{anchor}" if anchor else "")
    tables = [ctx.run_relative(t) for t in ([table] if isinstance(table, (str, Path)) else table) if str(t)]
    numbers = dict(numbers or {})
    sample = bool(ctx.from_samples if from_samples is None else from_samples)
    if sample:
        numbers["rule_verdict"] = verdict
        said = f"the rule says {verdict}: " if verdict != "inconclusive" else ""
        summary = f"recorded sample data, not this target — {said}{summary}"
        verdict = "inconclusive"
    ev = Evidence(hypothesis, verdict, summary, ctx.phase, link, now_iso(), numbers, tables, sample)
    with open(ctx.run_dir / "evidence.jsonl", "a") as f:
        f.write(json.dumps(asdict(ev), ensure_ascii=False, default=str) + "\n")
    return ev




def evidence_frame(evs: Sequence[Evidence]) -> pd.DataFrame:
    """Recorded evidence as the table a phase page shows: hypothesis, verdict, summary, the tables it rests on."""
    return pd.DataFrame([{"hypothesis": e.hypothesis, "verdict": e.verdict, "summary": e.summary,
                          "tables": ", ".join(e.tables), "from_samples": e.from_samples} for e in evs],
                        columns=["hypothesis", "verdict", "summary", "tables", "from_samples"])


def read_evidence(run_dir: Path) -> list[Evidence]:
    p = run_dir / "evidence.jsonl"
    if not p.exists():
        return []
    names = {f.name for f in fields(Evidence)}
    return [Evidence(**{k: v for k, v in json.loads(line).items() if k in names})
            for line in p.read_text().splitlines() if line.strip()]


def current_evidence(run_dir: Path) -> list[Evidence]:
    """The latest evidence of each phase about each hypothesis (a phase run again supersedes what it said
    before; ``evidence.jsonl`` keeps everything), in the order it was recorded."""
    latest: dict[tuple[str, str], Evidence] = {}
    for e in read_evidence(run_dir):
        latest.pop((e.hypothesis, e.phase), None)
        latest[(e.hypothesis, e.phase)] = e
    return list(latest.values())


def target_has_gpu(run_dir: Path) -> bool | None:
    """Whether the run's nodes have a GPU, as Phase 0 recorded them (``hosts.<node>.gpu_list``); None unrecorded."""
    hosts = [h for h in (read_manifest(Path(run_dir)).get("hosts") or {}).values() if isinstance(h, dict)]
    if not hosts or not any("gpu_list" in h for h in hosts):
        return None
    return any(h.get("gpu_list") not in (None, "", "-") for h in hosts)


def ledger(run_dir: Path) -> pd.DataFrame:
    """One row per hypothesis: status (open / supported / refuted / inconclusive / contested / not applicable) and
    its current evidence (:func:`current_evidence`: the latest of each phase). A hypothesis that ``requires: gpu``
    on a target Phase 0 recorded without a GPU is ``not applicable`` (unless live evidence decided it)."""
    evs = current_evidence(run_dir)
    gpu = target_has_gpu(run_dir)
    rows = []
    for hid, h in hypotheses().items():
        mine = [e for e in evs if e.hypothesis == hid]
        decisive = {e.verdict for e in mine if e.verdict != "inconclusive"}
        if h.get("requires") == "gpu" and gpu is False and not decisive:
            status = "not applicable"
        elif not mine:
            status = "open"
        elif len(decisive) > 1:
            status = "contested"
        else:
            status = mine[-1].verdict if mine[-1].verdict != "inconclusive" or not decisive else decisive.pop()
        decided_by = ", ".join(h.get("decided_by", []))
        if status == "not applicable":
            decided_by = f"GPU-only: not applicable on this target (Phase 0 recorded no GPU); elsewhere: {decided_by}"
        rows.append({"id": hid, "hypothesis": h.get("title", ""), "source": h.get("source", ""), "status": status,
                     "evidence": [asdict(e) for e in mine], "decided_by": decided_by})
    return pd.DataFrame(rows)
