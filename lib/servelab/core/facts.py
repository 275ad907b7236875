"""The run's facts: every number or verdict a page's findings, the index, the milestones or the ledger state, recorded
once by the phase that computes it (``outputs/<run>/facts.jsonl``), and the sample-size rules a fact must meet to be
VALID (``docs/method.md#facts``).

A fact is one answer to one question of the run — ``max_output_tps``, ``max_under_slo_concurrency``,
``correctness:phase9/ngram-3`` — with its value, unit, source (the case or file it was read from), sample count,
validity and definition. A phase writes all of its facts in one call (:func:`write_facts`), which replaces what that
phase wrote before (a re-run states its own answers, never a mix). Pages, milestones and the run summary read them
(:func:`read_facts`, :func:`fact`) instead of computing the number again; ``servelab check`` reports a question two
phases answer differently.

Where two measurements answer the same question and do not agree, the fact's value is the string
``unsettled: A vs B`` with both — never two answers in two places.

**Sample-size rules, in one place** (:data:`MIN_SAMPLES`): a fact of a kind below its minimum is not VALID
(``INDICATIVE``); no standard error or verdict is computed from it and pages say ``indicative (n=…)``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from servelab.core.run import file_lock, now_iso

FACTS_FILE = "facts.jsonl"
FACTS_SCHEMA = 1

# the fewest samples a claim of each kind needs to be VALID (docs/method.md#facts)
MIN_SAMPLES: dict[str, int] = {
    "percentile": 2,          # a P50 needs two values; a higher percentile is shown as "max of N" below its own need
    "throughput": 4,          # an output TPS over fewer than four completed requests is one batch's luck
    "ab_verdict": 2,          # a better/worse verdict or a standard error needs at least two samples per side
    "acceptance_rate": 20,    # accepted / proposed draft tokens: fewer than 20 proposals says nothing
    "count": 1,               # a count or a setting read from a file is its own sample
    "verdict": 1,             # a verdict read from its own table (correctness, a milestone)
}
VALID, INDICATIVE, INVALID = "VALID", "INDICATIVE", "INVALID"


def enough(kind: str, n: int | None) -> bool:
    """Whether ``n`` samples are enough for a claim of ``kind`` (:data:`MIN_SAMPLES`; an unknown kind needs 1)."""
    return n is not None and int(n) >= MIN_SAMPLES.get(kind, 1)


def indicative(n: int | None) -> str:
    """How a page marks a number below its rule: ``indicative (n=1)``."""
    return f"indicative (n={'?' if n is None else int(n)})"


@dataclass
class Fact:
    """One recorded answer. ``validity`` is VALID only where the source was VALID and ``samples`` meets the rule
    of ``kind`` (set by :func:`make`)."""
    name: str
    value: Any
    unit: str = ""
    source: str = ""
    samples: int | None = None
    validity: str = VALID
    definition: str = ""
    kind: str = "count"
    phase: str = ""
    note: str = ""
    schema: int = FACTS_SCHEMA
    recorded: str = field(default_factory=now_iso)

    @property
    def settled(self) -> bool:
        return not (isinstance(self.value, str) and self.value.startswith("unsettled"))

    def stated(self) -> Any:
        """What a headline shows: the value where VALID and settled, else the fact as shown (``unsettled: …``,
        ``…, indicative (n=1)``, ``…, INVALID: not a result``)."""
        return self.value if self.settled and self.validity == VALID else self.shown()

    def shown(self, digits: int = 1) -> str:
        """``71.4 tok/s (D2_c8, n=32)``, ``indicative (n=1)`` added below the rule, ``unsettled: …`` as it is."""
        v = self.value
        if isinstance(v, float):
            v = f"{v:,.{digits}f}"
        text = f"{v} {self.unit}".strip() if self.settled else str(v)
        src = ", ".join(x for x in (self.source, None if self.samples is None else f"n={self.samples}") if x)
        if src and self.settled:
            text += f" ({src})"
        if self.validity == INDICATIVE:
            text += f", {indicative(self.samples)}"
        elif self.validity == INVALID:
            text += ", INVALID: not a result"
        return text


def make(name: str, value: Any, *, unit: str = "", source: str = "", samples: int | None = None,
         source_valid: bool = True, definition: str = "", kind: str = "count", phase: str = "",
         note: str = "") -> Fact:
    """A fact with its validity decided by the rules: INVALID where its source is, INDICATIVE where ``samples`` is
    below :data:`MIN_SAMPLES` of ``kind``, else VALID."""
    validity = INVALID if not source_valid else (VALID if enough(kind, samples if samples is not None else 1)
                                                 else INDICATIVE)
    return Fact(name, value, unit, source, samples, validity, definition, kind, phase, note)


def plain(headline: dict[str, Any]) -> dict[str, Any]:
    """A headline whose values may be facts, as JSON holds it: each fact stated (:meth:`Fact.stated`)."""
    return {k: v.stated() if isinstance(v, Fact) else v for k, v in headline.items()}


def facts_path(run_dir: Path) -> Path:
    return Path(run_dir) / FACTS_FILE


def read_facts(run_dir: Path) -> list[Fact]:
    """Every fact of the run, in the order written (a line of another schema or not JSON is skipped)."""
    p = facts_path(run_dir)
    out: list[Fact] = []
    if not p.is_file():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("schema") == FACTS_SCHEMA and "name" in d:
            out.append(Fact(**{k: d[k] for k in Fact.__dataclass_fields__ if k in d}))
    return out


def fact(run_dir: Path, name: str) -> Fact | None:
    """The fact called ``name`` (the last written where, wrongly, two are)."""
    got = [f for f in read_facts(run_dir) if f.name == name]
    return got[-1] if got else None


def write_facts(run_dir: Path, phase: str, facts: Iterable[Fact]) -> list[Fact]:
    """Record ``phase``'s facts: everything the phase wrote before is replaced (under a lock, written atomically)."""
    p = facts_path(run_dir)
    new = [Fact(**{**asdict(f), "phase": f.phase or phase}) for f in facts]
    with file_lock(p.with_name(f".{p.name}.lock")):
        keep = [f for f in read_facts(run_dir) if f.phase != phase]
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(asdict(f), ensure_ascii=False, default=str) + "\n" for f in keep + new),
                       encoding="utf-8")
        os.replace(tmp, p)
    return new
