"""One-variable A/B discipline: manifest diff, confound flags, noise-aware case comparison, the seven questions.

``docs/method.md#discipline``: every experiment answers seven questions — what changed, why it should touch the current
bottleneck, what else changed, how the end-to-end metrics moved, how the profile evidence moved, whether it adds
accuracy / stability / memory risk, whether to keep it — and never changes several parameters at once and
reports only the final TPS, never compares a profiling run with a clean run, never looks only at means. This
module makes the first and third questions mechanical (the manifests are diffed and *everything* besides the
declared variable is flagged), the fourth honest (repeat-based noise band), and shows the judgement questions
as ``not answered`` until the user answers them through parameters.

Difference statuses (:func:`diff_manifests`):

- ``declared``  the variable under test (matched by dotted key or by its last component, e.g.
  ``chunked_prefill_size`` matches ``launch.settings.chunked_prefill_size``);
- ``derived``   follows from a declared change (the launch command string when a launch setting, env or the model
  differs; phase parameters that copy a declared key);
- ``accepted``  listed by the user as known and harmless (``accepted=[...]``) — still shown;
- ``volatile``  snapshot values expected to differ between any two runs (GPU utilisation/clock/memory readings,
  container uptime, timestamps, run ids, log paths);
- ``confound``  anything else: the A/B is confounded, and the page says so loudly — a package version, a model
  file's sha256, the image id or the engine's commit that differs between the runs' frozen environments
  (``frozen.<node>.*``, written by Phase 0) included; where only some runs froze their environment, one row says
  that those could not be compared.

Noise rule (:func:`compare_cases`): per case and metric, mean / min / max / CV (sample std, ddof = 1, as
:func:`servelab.measure.request_metrics.cv_across_repeats`) over the repeats of each side. The change is **within noise** when
``|Δ%| ≤ k · max(CV_A, CV_B)`` (k = 2 by default) **or** the min–max ranges of the repeats overlap; otherwise it
is ``better`` or ``worse`` according to the metric's direction. Fewer than two repeats on a side: ``no repeats``
(uncertainty unknown). A case invalid on either side: ``invalid`` — nothing invalid is a result.

Environment variables (:mod:`servelab.measure.env_reach`): where a run-like record holds the check that its
environment-variable change reached every rank (``env_reach.json``, written by
:func:`servelab.measure.launch_variants.write_run_record`), a run whose check failed makes the A/B **INVALID**:
the notice names each rank the variable missed, and every comparison row against that run is ``invalid``.

Correctness (:mod:`servelab.measure.correctness`): where both runs hold the greedy outputs of the same fixed prompts
(``greedy_outputs.json``, written into every launch variant's record), each B's outputs are compared with A's token
for token (``ABResult.correctness``) and the sixth question (accuracy risk) says whether they are identical.

Case summaries come from the run's ``cases/<case_id>/summary.json`` (the case schema of
:mod:`servelab.measure.case_record`, one row per repeat), or — for a run-like record of a launch variant — from the
summaries its ``cases.json`` lists, under the case id they are compared as. A case is valid when its verdict is
VALID (and, where a phase judges repeats one by one, the repeat is). Missing metrics are reported, not fatal.

Notebook cell pattern for any phase that compares runs (parameters ``ab_runs: list``, ``ab_variable: str``,
``ab_why: str``, ``ab_profile_change: str``, ``ab_risk: str``, ``ab_keep: str``, ``ab_accepted: list``)::

    from servelab.measure.abtest import ab_compare
    from servelab.report import ab_figures
    ab = ab_compare(ctx.params["ab_runs"], ctx.params["ab_variable"], answers=answers_from_params(ctx.params),
                    accepted=ctx.params["ab_accepted"])
    ab_figures.ab_banner(ab)         # cell 1: red banner when confounded, green otherwise
    ab.differences                   # cell 2: every manifest difference with its status
    ab_figures.delta_figure(ab.comparison)   # cell 3: Δ% per case and metric with the noise band
    ab.questions                     # cell 4: the seven questions
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from servelab.core.run import read_manifest, run_dir
from servelab.measure.case_record import SummarySchemaError, repeat_frame, summary_paths
from servelab.measure.request_metrics import SGLANG_BENCH
from servelab.measure.correctness import correctness_verdict
from servelab.measure.correctness import ab_greedy
from servelab.measure.env_reach import EnvReach, read_reach
from servelab.deploy.facts import FREEZE_MARKING

# metric → True when higher is better
METRICS: dict[str, bool] = {"output_tps": True, "p95_ttft_ms": False, "p95_tpot_ms": False, "p95_e2e_ms": False}
# metric names in case summaries → ours
ALIASES: dict[str, str] = {"output_throughput": "output_tps", "p95_e2el_ms": "p95_e2e_ms", "e2e_p95_ms": "p95_e2e_ms",
                           "ttft_p95_ms": "p95_ttft_ms", "tpot_p95_ms": "p95_tpot_ms"}
VOLATILE_PATTERNS = (r"^run_id$", r"created$", r"updated$", r"started$", r"ended$", r"\.log$", r"\.headline\.",
                     r"\.status$", r"\.notes", r"^phases\.[^.]+\.params\.run_id$", r"^phases\.[^.]+\.notebook$",
                     r"^hosts\.[^.]+\.(gpu_query|containers|addresses|memory_used|uptime|date)$",
                     r"^security", r"\.ready_s$", r"^phases\.[^.]+\.from_samples$", r"^phases\.[^.]+\.not_executed",
                     # the start checks' snapshots (free disk, clock offsets, log paths, when): a refused check
                     # never reaches a measurement, so a passing one is no setting of the run
                     r"^preflight\.", r"^gate\.")
NOT_ANSWERED = "not answered"


class SummaryFormatError(ValueError):
    """A run's case summaries cannot be read (names the folder or file and what is wrong)."""


# ---------------------------------------------------------------- runs

@dataclass
class RunRef:
    run_id: str
    run_dir: Path
    manifest: dict[str, Any]
    label: str = ""


def load_run(run: str | Path | RunRef, label: str = "") -> RunRef:
    """A run by id (under ``SERVELAB_OUTPUTS``) or by directory path; its manifest must exist."""
    if isinstance(run, RunRef):
        return run
    p = Path(run)
    d = p if p.is_dir() else run_dir(str(run))
    m = read_manifest(d)
    if not m:
        raise FileNotFoundError(f"{d}: no manifest.json — not a servelab run directory (run id or path expected)")
    rid = m.get("run_id") or d.name
    return RunRef(rid, d, m, label or rid)


# ---------------------------------------------------------------- manifest diff

def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        if not obj and prefix:
            out[prefix] = "{}"
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        for i, x in enumerate(obj):
            key = x.get("node") or x.get("name") or str(i)
            _flatten(x, f"{prefix}.{key}", out)
    else:
        out[prefix] = json.dumps(obj, sort_keys=True) if isinstance(obj, (list, dict)) else obj


def flatten_manifest(m: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys for every leaf of a manifest (``launch.settings.tp_size``, ``hosts.node5.gpu_driver`` ...)."""
    out: dict[str, Any] = {}
    _flatten(m, "", out)
    return out


def category(key: str) -> str:
    """What a manifest key describes: tool, target, engine, model, launch, env, command, params, host, other."""
    head = key.split(".", 1)[0]
    if key.startswith("launch.env"):
        return "env"
    if key.startswith("launch.plans"):
        return "command"
    if key.startswith("launch"):
        return "launch"
    if head == "phases":
        return "params"
    if head == "hosts":
        return "host"
    if head in ("tool", "python", "platform"):
        return "tool"
    if head == "frozen":                 # Phase 0's freeze: the engine's software, and the model's files
        return "model" if ".weights" in key else "software"
    return head if head in ("target", "engine", "model") else "other"


def _matches(key: str, names: Iterable[str]) -> bool:
    for n in names:
        n = n.strip()
        if n and (key == n or key.endswith("." + n) or key.startswith(n + ".")):
            return True
    return False


def diff_manifests(runs: Sequence[RunRef], variable: str | Sequence[str] = "",
                   accepted: Sequence[str] = ()) -> pd.DataFrame:
    """Every key whose value differs between the runs' manifests, with its category and status.

    Columns: ``key, category, <label of each run>..., status, note``. Statuses: see the module docstring.
    """
    declared = [variable] if isinstance(variable, str) else list(variable)
    declared = [d for d in declared if d]
    flats = [flatten_manifest(r.manifest) for r in runs]
    froze = [bool(r.manifest.get("frozen")) for r in runs]
    if any(froze) and not all(froze):      # one row, not one per package: these runs cannot be compared there
        flats = [{k: v for k, v in f.items() if not k.startswith("frozen.")} for f in flats]
        for f, r, fz in zip(flats, runs, froze):
            f["frozen"] = f"recorded ({len(r.manifest['frozen'])} node(s))" if fz else "<absent>"
    keys = sorted(set().union(*[f.keys() for f in flats]))
    rows = []
    for k in keys:
        vals = [f.get(k, "<absent>") for f in flats]
        if all(v == vals[0] for v in vals):
            continue
        rows.append({"key": k, "category": category(k), **{r.label: v for r, v in zip(runs, vals)}})
    df = pd.DataFrame(rows, columns=["key", "category", *[r.label for r in runs]])
    if df.empty:
        df["status"], df["note"] = pd.Series(dtype=str), pd.Series(dtype=str)
        return df
    sources = df[df["category"].isin(["launch", "env", "model", "engine"]) & ~df["key"].map(
        lambda k: any(re.search(p, k) for p in VOLATILE_PATTERNS))]
    declared_sources = sources[sources["key"].map(lambda k: _matches(k, declared) or _matches(k, accepted))]
    status, note = [], []
    for _, r in df.iterrows():
        k = r["key"]
        if _matches(k, declared):
            status.append("declared"), note.append("the variable under test")
        elif any(re.search(p, k) for p in VOLATILE_PATTERNS):
            status.append("volatile"), note.append("snapshot value; expected to differ between runs")
        elif r["category"] == "command":
            if not declared_sources.empty and len(declared_sources) == len(sources):
                status.append("derived"), note.append("launch command follows from " +
                                                       ", ".join(declared_sources["key"]))
            elif sources.empty:
                status.append("confound"), note.append("launch command differs with no recorded setting change")
            else:
                status.append("confound"), note.append("launch command follows from undeclared "
                                                        + ", ".join(sorted(set(sources["key"]) -
                                                                           set(declared_sources["key"]))))
        elif r["category"] == "params" and k.split(".")[-1] in {d.split(".")[-1] for d in declared}:
            status.append("derived"), note.append("phase parameter that sets the declared variable")
        elif _matches(k, accepted):
            status.append("accepted"), note.append("accepted by the user as harmless")
        elif k.startswith("frozen"):
            derived, why = _frozen_follows(k, declared)
            status.append("derived" if derived else "confound"), note.append(why)
        else:
            status.append("confound"), note.append("changed besides the declared variable")
    df["status"], df["note"] = status, note
    order = {"declared": 0, "confound": 1, "accepted": 2, "derived": 3, "volatile": 4}
    return df.sort_values(["status", "category", "key"], key=lambda s: s.map(order) if s.name == "status" else s
                          ).reset_index(drop=True)


# a frozen key follows from a declared change of what produces it: the weights from the model, the image id from
# the image, the packages and the engine's commit from the image or the interpreter
_FROZEN_SOURCES = {"weights": ("model",), "weights_sha256": ("model",), "image": ("image", "docker"),
                   "image_id": ("image", "docker"), "packages": ("image", "docker", "python"),
                   "engine": ("image", "docker", "python"), "engine_commit": ("image", "docker", "python"),
                   "python": ("image", "docker", "python"), "executable_sha256": ("image", "docker", "binary")}


def _frozen_follows(key: str, declared: Sequence[str]) -> tuple[bool, str]:
    """(derived?, note) for a differing ``frozen.*`` key."""
    if key == "frozen":
        return False, ("only some runs recorded their frozen environment (Phase 0): packages, image and model "
                       "checksums not compared — run Phase 0 in each")
    part = key.split(".")[2] if key.count(".") >= 2 else ""
    what = {"packages": f"package {key.split('.', 3)[-1]} version", "weights": f"model file {key.split('.', 3)[-1]} "
            "sha256", "weights_sha256": "model checksum", "image_id": "image id", "image": "image",
            "engine_commit": "engine commit", "engine": "engine version", "python": "interpreter version",
            "executable_sha256": "engine executable sha256"}.get(part, part)
    sources = _FROZEN_SOURCES.get(part, ())
    if any(_matches(d, sources) for d in declared):
        return True, f"{what} follows from the declared {', '.join(declared)}"
    return False, f"{what} differs between the runs: a different engine build or model than the declared change"


# ---------------------------------------------------------------- case summaries

@dataclass
class CaseSummaries:
    """Per-repeat case metrics of one run and what could not be read."""
    frame: pd.DataFrame            # run, case_id, repeat, <metrics>, valid
    source: str
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_case_summaries(rdir: str | Path, definition: str = SGLANG_BENCH, metrics: Sequence[str] = tuple(METRICS),
                        label: str = "") -> CaseSummaries:
    """Per-repeat case metrics of a run directory or run-like record, from its case summaries (the case schema,
    :mod:`servelab.measure.case_record`): one row per repeat, ``valid`` from the case verdict (and the repeat's own
    flag), metrics in ``definition`` where the case has it."""
    rdir = Path(rdir)
    if not summary_paths(rdir):
        raise SummaryFormatError(f"{rdir}: no case summaries in this run (cases/<case>/summary.json, or a record's "
                                 "cases.json; Phases 1, 2, 7, 8 and 9 write them)")
    try:
        frame, notes = repeat_frame(rdir, definition, tuple(metrics), ALIASES)
    except SummarySchemaError as exc:
        raise SummaryFormatError(str(exc)) from exc
    frame = frame.drop(columns=["case_dir", "phase", "kind"])
    missing = [m for m in metrics if m not in frame.columns or frame[m].isna().all()]
    for m in missing:
        frame[m] = np.nan
    frame.insert(0, "run", label or rdir.name)
    if missing:
        notes.append(f"metrics not in this run's summaries: {', '.join(missing)}")
    return CaseSummaries(frame[["run", "case_id", "repeat", *metrics, "valid"]],
                         f"{rdir} case summaries ({definition})", missing, notes)


def repeat_stats(values: Iterable[float]) -> dict[str, float]:
    """n, mean, min, max, sample std (ddof 1) and CV % of repeat values (NaNs dropped)."""
    v = np.array([x for x in values if x is not None and not pd.isna(x)], dtype=float)
    n = int(v.size)
    if n == 0:
        return {"n": 0, "mean": math.nan, "min": math.nan, "max": math.nan, "std": math.nan, "cv_pct": math.nan}
    std = float(v.std(ddof=1)) if n > 1 else math.nan
    mean = float(v.mean())
    return {"n": n, "mean": mean, "min": float(v.min()), "max": float(v.max()), "std": std,
            "cv_pct": 100.0 * std / abs(mean) if n > 1 and mean else math.nan}


def classify_change(a: dict[str, float], b: dict[str, float], higher_is_better: bool, k: float = 2.0) -> tuple[str, float]:
    """(verdict, noise band %) of B against A: ``within noise`` / ``better`` / ``worse`` / ``no repeats`` / ``no data``."""
    if a["n"] == 0 or b["n"] == 0 or math.isnan(a["mean"]) or math.isnan(b["mean"]):
        return "no data", math.nan
    if a["n"] < 2 or b["n"] < 2:
        return "no repeats", math.nan
    band = k * max(a["cv_pct"], b["cv_pct"])
    delta = 100.0 * (b["mean"] - a["mean"]) / abs(a["mean"]) if a["mean"] else math.inf
    overlap = not (b["min"] > a["max"] or b["max"] < a["min"])
    if abs(delta) <= band or overlap:
        return "within noise", band
    up = delta > 0
    return ("better" if up == higher_is_better else "worse"), band


def compare_cases(a: pd.DataFrame | CaseSummaries, b: pd.DataFrame | CaseSummaries,
                  metrics: dict[str, bool] | None = None, k: float = 2.0) -> pd.DataFrame:
    """Per shared case and metric: A and B repeat statistics, Δ% of the means, the noise band and the verdict."""
    fa = a.frame if isinstance(a, CaseSummaries) else a
    fb = b.frame if isinstance(b, CaseSummaries) else b
    metrics = metrics or METRICS
    rows = []
    cases = [c for c in dict.fromkeys(fa["case_id"]) if c in set(fb["case_id"])]
    for cid in cases:
        ca, cb = fa[fa["case_id"] == cid], fb[fb["case_id"] == cid]
        va = ca["valid"].dropna() if "valid" in ca else pd.Series(dtype=bool)
        vb = cb["valid"].dropna() if "valid" in cb else pd.Series(dtype=bool)
        invalid = (len(va) and not va.all()) or (len(vb) and not vb.all())
        for m, hib in metrics.items():
            if m not in fa.columns or m not in fb.columns:
                continue
            sa, sb = repeat_stats(ca[m]), repeat_stats(cb[m])
            verdict, band = classify_change(sa, sb, hib, k)
            if invalid:
                verdict = "invalid"
            delta = 100.0 * (sb["mean"] - sa["mean"]) / abs(sa["mean"]) if sa["mean"] and not math.isnan(sa["mean"]) \
                else math.nan
            rows.append({"case_id": cid, "metric": m, "higher_is_better": hib,
                         "a_n": sa["n"], "a_mean": sa["mean"], "a_min": sa["min"], "a_max": sa["max"],
                         "a_cv_pct": sa["cv_pct"], "b_n": sb["n"], "b_mean": sb["mean"], "b_min": sb["min"],
                         "b_max": sb["max"], "b_cv_pct": sb["cv_pct"], "delta_pct": delta, "noise_band_pct": band,
                         "verdict": verdict})
    return pd.DataFrame(rows, columns=["case_id", "metric", "higher_is_better", "a_n", "a_mean", "a_min", "a_max",
                                       "a_cv_pct", "b_n", "b_mean", "b_min", "b_max", "b_cv_pct", "delta_pct",
                                       "noise_band_pct", "verdict"])


# ---------------------------------------------------------------- the seven questions

QUESTIONS = (
    ("what_changed", "1. What changed?"),
    ("why", "2. Why should it affect the current bottleneck?"),
    ("what_else", "3. What else changed besides this variable?"),
    ("end_to_end", "4. How did the end-to-end metrics change?"),
    ("profile_change", "5. How did the profile evidence change?"),
    ("risk", "6. Accuracy, stability or memory risk?"),
    ("keep", "7. Keep it?"),
)


def answers_from_params(params: dict[str, Any]) -> dict[str, str]:
    """User answers from phase parameters named ``ab_<question key>`` (``ab_why``, ``ab_keep``...)."""
    return {key: str(params[f"ab_{key}"]) for key, _ in QUESTIONS if str(params.get(f"ab_{key}", "") or "").strip()}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def seven_questions(diff: pd.DataFrame, comparison: pd.DataFrame, labels: Sequence[str],
                    answers: dict[str, str] | None = None, correctness: pd.DataFrame | None = None) -> pd.DataFrame:
    """The seven questions (``docs/method.md#discipline``): measured parts from the diff and the comparison (and,
    for the risk question, the greedy outputs compared in ``correctness``: :func:`servelab.measure.correctness.
    compare_greedy` rows of the last run), judgement parts from ``answers`` (keys ``what_changed, why, what_else,
    end_to_end, profile_change, risk, keep``); an empty judgement is shown as ``not answered``. Columns:
    ``question, answer, source``."""
    answers = {k: v for k, v in (answers or {}).items() if str(v).strip()}
    a_lab, b_lab = labels[0], labels[-1]
    rows = []

    def add(key: str, title: str, measured: str, judgement_only: bool = False) -> None:
        user = answers.get(key, "")
        if judgement_only:
            rows.append({"question": title, "answer": user or NOT_ANSWERED, "source": "user" if user else NOT_ANSWERED})
            return
        text = measured + (f" — user: {user}" if user else "")
        rows.append({"question": title, "answer": text, "source": "measured + user" if user else "measured"})

    dec = diff[diff["status"] == "declared"] if not diff.empty else diff
    if dec.empty:
        what = "no difference found in the declared variable (was it recorded in the manifest?)"
    else:
        what = "; ".join(f"{r['key']}: {_fmt(r[a_lab])} → {_fmt(r[b_lab])}" for _, r in dec.iterrows())
    add("what_changed", QUESTIONS[0][1], what)
    add("why", QUESTIONS[1][1], "", judgement_only=True)
    conf = diff[diff["status"] == "confound"] if not diff.empty else diff
    n_other = {s: int((diff["status"] == s).sum()) for s in ("accepted", "derived", "volatile")} if not diff.empty else {}
    if conf.empty:
        other = (f"nothing else (also listed: {n_other.get('derived', 0)} derived, {n_other.get('accepted', 0)} "
                 f"accepted, {n_other.get('volatile', 0)} volatile differences)")
    else:
        other = (f"CONFOUNDED — {len(conf)} other difference(s): " +
                 "; ".join(f"{r['key']}: {_fmt(r[a_lab])} → {_fmt(r[b_lab])}" for _, r in conf.head(8).iterrows()) +
                 (" …" if len(conf) > 8 else ""))
    add("what_else", QUESTIONS[2][1], other)
    if comparison.empty:
        e2e = "no shared cases with summaries"
    else:
        parts = []
        for m, g in comparison.groupby("metric", sort=False):
            counts = g["verdict"].value_counts()
            med = g["delta_pct"].median()
            parts.append(f"{m}: median Δ {med:+.1f} % over {len(g)} case(s) — " +
                         ", ".join(f"{n} {v}" for v, n in counts.items()))
        e2e = "; ".join(parts)
    add("end_to_end", QUESTIONS[3][1], e2e)
    add("profile_change", QUESTIONS[4][1], "", judgement_only=True)
    inval = comparison[comparison["verdict"] == "invalid"]["case_id"].unique() if not comparison.empty else []
    risk_measured = (f"{len(inval)} case(s) invalid on a side: {', '.join(map(str, inval))}" if len(inval)
                     else "no invalid case on either side")
    if correctness is not None and not correctness.empty:
        verdict, detail = correctness_verdict(correctness)
        risk_measured += f"; greedy outputs, {b_lab} against {a_lab}: {verdict} ({detail})"
    add("risk", QUESTIONS[5][1], risk_measured)
    keep_user = answers.get("keep", "")
    if not conf.empty:
        keep_text = "cannot be decided from this A/B: it is confounded" + (f" — user: {keep_user}" if keep_user else "")
        rows.append({"question": QUESTIONS[6][1], "answer": keep_text, "source": "measured + user" if keep_user else "measured"})
    else:
        add("keep", QUESTIONS[6][1], "", judgement_only=True)
    return pd.DataFrame(rows, columns=["question", "answer", "source"])


# ---------------------------------------------------------------- one call

@dataclass
class ABResult:
    runs: list[RunRef]
    variable: list[str]
    differences: pd.DataFrame
    summaries: list[CaseSummaries]
    comparison: pd.DataFrame          # baseline (first run) vs each other run; column 'b_run'
    questions: pd.DataFrame           # for the last run against the baseline
    notes: list[str] = field(default_factory=list)
    # each other run's greedy outputs against the baseline's, per prompt (measure.correctness.compare_greedy rows)
    correctness: pd.DataFrame = field(default_factory=pd.DataFrame)
    # per run: the check that its environment-variable change reached every rank (None: no such check)
    env_reach: list[EnvReach | None] = field(default_factory=list)

    @property
    def env_failures(self) -> list[str]:
        """``<run>: <which variable missed which rank>`` for each run whose environment check failed."""
        return [f"{r.label}: {e.reason}" for r, e in zip(self.runs, self.env_reach) if e is not None and not e.ok]

    @property
    def drift(self) -> list[str]:
        """``<run>: <node> <what> <before> → <after>`` for each driver, engine, image or weights change between a
        run's Phase 0 freeze and its run-end freeze (``frozen_end_changes``, :mod:`servelab.deploy.freeze_end`)."""
        return [f"{r.label}: {c.get('node')} {c.get('what')} {c.get('before')} → {c.get('after')}"
                for r in self.runs for c in (r.manifest.get("frozen_end_changes") or [])
                if isinstance(c, dict) and c.get("kind") in FREEZE_MARKING]

    @property
    def env_table(self) -> pd.DataFrame:
        """Every run's environment check, one row per rank × variable, with the run's label first."""
        parts = [e.table.assign(run=r.label) for r, e in zip(self.runs, self.env_reach) if e is not None]
        if not parts:
            return pd.DataFrame()
        t = pd.concat(parts, ignore_index=True)
        return t[["run", *[c for c in t.columns if c != "run"]]]

    @property
    def confounds(self) -> pd.DataFrame:
        return self.differences[self.differences["status"] == "confound"] if not self.differences.empty \
            else self.differences

    @property
    def confounded(self) -> bool:
        return not self.confounds.empty

    @property
    def profiled_vs_clean(self) -> bool:
        """True when one side had a profiler attached and the other not (``docs/method.md#profiled-runs``: never compared)."""
        flags = [bool((r.manifest.get("launch") or {}).get("settings", {}).get("profiler_dir")) for r in self.runs]
        return len(set(flags)) > 1

    def verdict_notice(self) -> tuple[str, str, str]:
        """(kind, title, text) of the notice an A/B page opens with: a warning when confounded (or profiled vs
        clean), information when only the variable changed. Drawn by ``servelab.report.ab_figures.ab_banner``.
        An environment variable that did not reach every rank makes the A/B INVALID, before anything else."""
        if self.env_failures:
            return ("warning", "INVALID A/B — the variable did not reach every rank",
                    "; ".join(self.env_failures) + ". A side whose ranks did not all run with the value compares "
                    "nothing about it: no conclusion can be drawn.")
        if self.drift and not (self.confounded or self.profiled_vs_clean):
            return ("warning", "The environment changed during a run",
                    "; ".join(self.drift[:6]) + (" …" if len(self.drift) > 6 else "") + ". Its measurements may come "
                    "from two environments: re-run it, or compare only what it measured before the change.")
        if self.confounded or self.profiled_vs_clean:
            keys = ", ".join(self.confounds["key"].head(10))
            extra = " A profiled run is compared with a clean run." if self.profiled_vs_clean else ""
            return ("warning", "CONFOUNDED A/B — more than one variable changed",
                    f"Declared variable: {', '.join(self.variable) or '(none)'}. "
                    f"{len(self.confounds)} other difference(s) changed too: {keys}"
                    f"{' …' if len(self.confounds) > 10 else ''}.{extra} No conclusion about the variable "
                    f"can be drawn from this comparison.")
        volatile = int((self.differences["status"] == "volatile").sum()) if not self.differences.empty else 0
        return ("info", "One-variable A/B", f"Only the declared variable changed ({', '.join(self.variable)}); "
                f"{volatile} volatile snapshot differences listed for completeness.")


def ab_compare(runs: Sequence[str | Path | RunRef], variable: str | Sequence[str] = "",
               answers: dict[str, str] | None = None, accepted: Sequence[str] = (), k: float = 2.0,
               definition: str = SGLANG_BENCH, metrics: dict[str, bool] | None = None) -> ABResult:
    """Compare two or more runs: the first is the baseline (A), each other is compared with it."""
    refs = [load_run(r) for r in runs]
    if len(refs) < 2:
        raise ValueError(f"an A/B needs at least two runs, got {len(refs)}")
    labels = [r.label for r in refs]
    if len(set(labels)) != len(labels):
        for i, r in enumerate(refs):
            r.label = f"{chr(65 + i)}:{r.run_id}"
    variables = [variable] if isinstance(variable, str) else list(variable)
    variables = [v for v in variables if v]
    diff = diff_manifests(refs, variables, accepted)
    metrics = metrics or METRICS
    notes: list[str] = []
    sums: list[CaseSummaries] = []
    for r in refs:
        try:
            sums.append(read_case_summaries(r.run_dir, definition, tuple(metrics), r.label))
        except SummaryFormatError as exc:
            notes.append(str(exc))
            sums.append(CaseSummaries(pd.DataFrame(columns=["run", "case_id", "repeat", *metrics, "valid"]),
                                      "absent", list(metrics), [str(exc)]))
        notes += [f"{r.label}: {n}" for n in sums[-1].notes]
    comps = [compare_cases(sums[0], s, metrics, k).assign(b_run=refs[i].label) for i, s in enumerate(sums) if i > 0]
    reach = [read_reach(r.run_dir) for r in refs]
    bad = [e is not None and not e.ok for e in reach]
    for i, c in enumerate(comps, start=1):
        if (bad[0] or bad[i]) and not c.empty:
            c["verdict"] = "invalid"
    comparison = pd.concat(comps, ignore_index=True) if comps else pd.DataFrame()
    last = comparison[comparison["b_run"] == refs[-1].label] if not comparison.empty else comparison
    correctness = ab_greedy([(r.label, r.run_dir) for r in refs])
    last_ok = correctness[correctness["b_run"] == refs[-1].label] if not correctness.empty else correctness
    questions = seven_questions(diff, last, [refs[0].label, refs[-1].label], answers, last_ok)
    if not variables:
        notes.append("no variable declared: every difference counts as a confound")
    notes += [f"environment changed during the run {c}" for c in
              ABResult(refs, variables, diff, sums, comparison, questions).drift]
    notes += [f"INVALID: {f}" for f in (f"{r.label}: {e.reason}" for r, e, b in zip(refs, reach, bad) if b)]
    return ABResult(refs, variables, diff, sums, comparison, questions, notes, correctness, reach)


def write_ab_tables(ab: ABResult, phase_dir: Path) -> None:
    """The A/B as every phase with one writes it, for the milestones and for people: ``ab_differences.csv``,
    ``ab_comparison.csv``, ``ab_correctness.csv`` (the greedy outputs compared per prompt) and ``ab_questions.csv``."""
    phase_dir = Path(phase_dir)
    phase_dir.mkdir(parents=True, exist_ok=True)
    ab.differences.to_csv(phase_dir / "ab_differences.csv", index=False)
    ab.comparison.to_csv(phase_dir / "ab_comparison.csv", index=False)
    ab.correctness.to_csv(phase_dir / "ab_correctness.csv", index=False)
    ab.questions.to_csv(phase_dir / "ab_questions.csv", index=False)


def repeats_frame(ab: ABResult) -> pd.DataFrame:
    """All per-repeat rows of all runs (for the repeats figure)."""
    return pd.concat([s.frame for s in ab.summaries], ignore_index=True)
