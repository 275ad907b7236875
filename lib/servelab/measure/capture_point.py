"""Phase 3's ``capture_at``: capture at a point the user chose from Phase 1 — a case id of the same run (or of an
earlier run, ``<run_id>:<case_id>``), or a point of a run's concurrency search: ``max_tps`` (the max-TPS
concurrency), ``slo_max`` (the highest concurrency under the SLO) or ``C=<n>`` (the search point at concurrency n),
each optionally prefixed with ``<run_id>:``.

:func:`resolve_capture_point` reads the run's ``summary.csv`` (every case: lengths, concurrency) and
``phase1/search.json`` (the search's answers and points) and returns the case; a point that does not exist is a
one-line :class:`~servelab.core.params.ParamError` — the CLI calls it before the run folder is made.
:func:`at_point` then gives the capture scenarios that case's lengths and concurrency, bound to its case id."""
from __future__ import annotations

import csv
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from servelab.core.params import ParamError
from servelab.core.run import run_dir as run_dir_of, validate_run_id
from servelab.measure.capture import ProfileScenario

SEARCH_POINTS = {"max_tps": "max_tps_concurrency", "slo_max": "max_under_slo_concurrency"}
_C_RE = re.compile(r"^C=(\d+)$", re.I)


@dataclass(frozen=True)
class CapturePoint:
    """The Phase 1 case a capture is bound to: its run, id, kind, lengths and concurrency, and how it was named."""
    run_id: str
    case_id: str
    kind: str
    input_len: int
    output_len: int
    concurrency: int
    named: str

    def describe(self) -> str:
        return (f"Phase 1 case {self.case_id} of run {self.run_id} ({self.named}): {self.input_len} → "
                f"{self.output_len} tokens at C={self.concurrency}")


def _cases(rdir: Path) -> dict[str, dict[str, str]]:
    """Every case of a run (``summary.csv``, else ``phase1/matrix.csv``), by case id."""
    for f in (rdir / "summary.csv", rdir / "phase1" / "matrix.csv"):
        if f.is_file():
            with open(f, newline="") as fh:
                return {r["case_id"]: r for r in csv.DictReader(fh) if r.get("case_id")}
    return {}


def resolve_capture_point(spec: str, run_id: str) -> CapturePoint | None:
    """The case ``spec`` names (None for an empty spec). ``run_id``: this run's id ("" for a new run: then
    ``spec`` must name its run). One-line ParamError when the run, its Phase 1 results or the point do not exist."""
    spec = (spec or "").strip()
    if not spec:
        return None
    src, _, point = spec.rpartition(":")
    src = src or run_id
    if not src:
        raise ParamError(f"capture_at={spec}: a new run has no Phase 1 results; give --run-id of a run with Phase 1 "
                         f"or name one: capture_at=<run_id>:{point}")
    try:
        validate_run_id(src)
    except ValueError as exc:
        raise ParamError(f"capture_at={spec}: {exc}") from None
    rdir = run_dir_of(src)
    cases = _cases(rdir)
    if not cases:
        raise ParamError(f"capture_at={spec}: run {src} has no Phase 1 results ({rdir}/summary.csv); run "
                         f"`servelab run phase1 --run-id {src}` first or name another run")
    named = point
    key = SEARCH_POINTS.get(point.lower())
    m = _C_RE.match(point)
    if key or m:
        try:
            search = json.loads((rdir / "phase1" / "search.json").read_text())
        except (OSError, ValueError):
            raise ParamError(f"capture_at={spec}: run {src} has no concurrency search (phase1/search.json); name a "
                             f"case id instead: {', '.join(sorted(cases))}") from None
        conc = search.get(key) if key else int(m.group(1))
        points = {int(p["concurrency"]): p.get("case_id") for p in search.get("points", [])}
        if conc is None or int(conc) not in points or not points[int(conc)]:
            have = ", ".join(f"C={c}" for c in sorted(points)) or "none"
            raise ParamError(f"capture_at={spec}: run {src}'s search has no such point "
                             f"({'its ' + point + ' is not set' if key and conc is None else 'search points: ' + have})")
        point = points[int(conc)]
    if point not in cases:
        raise ParamError(f"capture_at={spec}: run {src} has no Phase 1 case {point!r}; its cases: "
                         f"{', '.join(sorted(cases))}")
    r = cases[point]
    try:
        return CapturePoint(src, point, r.get("kind", ""), int(r["input_len"]), int(r["output_len"]),
                            int(r["concurrency"]), named)
    except (KeyError, ValueError):
        raise ParamError(f"capture_at={spec}: case {point} of run {src} records no input/output length or "
                         "concurrency in summary.csv") from None


def at_point(scenarios: list[ProfileScenario], at: CapturePoint | None) -> list[ProfileScenario]:
    """The scenarios run at ``at``: the decode control's and the mixed treatment's background (and the prefix hit's
    requests) take the case's lengths and concurrency; the long prefill takes its prompt length when the case is a
    prefill case. Each is bound to the case (``case_id`` = the Phase 1 case id + ``-profile``)."""
    if at is None:
        return scenarios
    out = []
    for s in scenarios:
        kw: dict = {"case_id": f"{at.case_id}-profile"}
        if s.name in ("decode_control", "mixed_treatment"):
            kw.update(isl_tokens=at.input_len, osl_tokens=at.output_len, concurrency=at.concurrency)
        elif s.name == "prefix_hit":
            kw.update(concurrency=at.concurrency)
        elif s.name == "long_prefill" and at.kind == "prefill":
            kw.update(isl_tokens=at.input_len)
        new = dataclasses.replace(s, **kw)
        desc = (s.description.replace(f"{s.isl_tokens}->{s.osl_tokens}, C={s.concurrency}",
                                      f"{new.isl_tokens}->{new.osl_tokens}, C={new.concurrency}")
                .replace(f", C={s.concurrency} sharing", f", C={new.concurrency} sharing")
                .replace(f"{s.isl_tokens}->1, C=1", f"{new.isl_tokens}->1, C=1"))
        out.append(dataclasses.replace(new, description=f"at Phase 1 case {at.case_id}: {desc}"))
    return out
