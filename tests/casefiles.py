"""Hand-built case folders for tests of the readers (A/B, milestones, Phase 4): written through the same
``CaseFolder`` as the phases, so they follow the case contract (an empty ``requests.jsonl`` first, then a
``summary.json`` in the case schema)."""
from __future__ import annotations

from pathlib import Path

from servelab.measure.case_record import CaseFolder, CaseSummary, verdict

DEFINITIONS = ("sglang", "vllm")


def write_cases(run_dir: Path, rows: list[dict], phase: str = "phase1", kind: str = "decode") -> list[Path]:
    """One case folder per ``case_id`` of ``rows`` (one row per repeat: ``case_id``, ``repeat``, metric columns,
    optional ``valid``); a case with any row ``valid: False`` is INVALID. The metrics go under both
    definitions. Returns the case folders."""
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(str(r["case_id"]), []).append(r)
    out = []
    for cid, reps in by_case.items():
        ok = all(r.get("valid", True) for r in reps)
        folder = CaseFolder(run_dir, cid, phase, kind, {"synthetic": True})
        folder.write_requests([])
        metrics = [{k: v for k, v in r.items() if k not in ("case_id", "repeat", "valid")} for r in reps]
        folder.write_summary(CaseSummary(
            case_id=cid, phase=phase, kind=kind, status="success",
            verdict=verdict("VALID") if ok else verdict("INVALID", ["marked invalid by the test"]),
            definition="vllm", metrics={d: metrics[0] for d in DEFINITIONS},
            repeats=[{"repeat": int(r.get("repeat", i)), "metrics": {d: m for d in DEFINITIONS}}
                     for i, (r, m) in enumerate(zip(reps, metrics))]))
        folder.finish("success")
        out.append(folder.dir)
    return out
