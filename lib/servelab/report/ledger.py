"""The investigation ledger: hypotheses (the built-in H1–H7 of ``docs/method.md#hypotheses`` plus the user's),
and the evidence phases record.

A phase notebook states what its data says about a hypothesis:

    record_evidence(ctx, "H5", "refuted", "decode is graph-replayed: 98% of kernels; host-bound gaps 0.4%",
                    anchor="cuda-graph-coverage")

Evidence goes to ``<run>/evidence.jsonl`` (append-only, with the phase and a link to its page). A
hypothesis is ``open`` without evidence, else the verdict of its latest evidence; evidence that disagrees
is shown as ``contested``. A refutation is evidence too: "PP bubble refuted: both stages busy 96%".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from servelab.core.paths import project_root
from servelab.core.run import now_iso

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


def record_evidence(ctx: Any, hypothesis: str, verdict: str, summary: str, anchor: str = "",
                    numbers: dict[str, Any] | None = None) -> Evidence:
    """Append one piece of evidence from this phase about ``hypothesis``."""
    known = hypotheses()
    if hypothesis not in known:
        from servelab.core.params import ParamError, did_you_mean
        raise ParamError(f"unknown hypothesis '{hypothesis}'{did_you_mean(hypothesis, set(known))}")
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, not '{verdict}'")
    link = f"{ctx.phase}/report.html" + (f"#{anchor}" if anchor else "")
    ev = Evidence(hypothesis, verdict, summary, ctx.phase, link, now_iso(), numbers or {})
    with open(ctx.run_dir / "evidence.jsonl", "a") as f:
        f.write(json.dumps(asdict(ev), ensure_ascii=False, default=str) + "\n")
    return ev


def read_evidence(run_dir: Path) -> list[Evidence]:
    p = run_dir / "evidence.jsonl"
    if not p.exists():
        return []
    return [Evidence(**json.loads(line)) for line in p.read_text().splitlines() if line.strip()]


def ledger(run_dir: Path) -> pd.DataFrame:
    """One row per hypothesis: status (open / supported / refuted / inconclusive / contested) and its evidence."""
    evs = read_evidence(run_dir)
    rows = []
    for hid, h in hypotheses().items():
        mine = [e for e in evs if e.hypothesis == hid]
        decisive = {e.verdict for e in mine if e.verdict != "inconclusive"}
        if not mine:
            status = "open"
        elif len(decisive) > 1:
            status = "contested"
        else:
            status = mine[-1].verdict if mine[-1].verdict != "inconclusive" or not decisive else decisive.pop()
        rows.append({"id": hid, "hypothesis": h.get("title", ""), "source": h.get("source", ""), "status": status,
                     "evidence": [asdict(e) for e in mine], "decided_by": ", ".join(h.get("decided_by", []))})
    return pd.DataFrame(rows)
