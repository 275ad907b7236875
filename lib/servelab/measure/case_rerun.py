"""One measured case run again as a new attempt: what ``servelab case RUN_ID CASE_ID`` does.

The case is rebuilt from what its folder recorded when it ran (``cases/<case_id>/meta.json``): the matrix point
(``case``: every ``CaseSpec`` field, clamped lengths and notes included), the settings of the run's cases
(``case_env``: repeats, seed, SLOs, API, timeouts, CV bound), the phase, and the target (``target``: name and
the file it was read from — a target with ``-p`` launch overrides is the copy kept in the run's ``targets/``).
The same target's engine is started inside a ``ProcessTracker`` and stopped on every exit path, the case runs
through the same routine as in its phase (:func:`servelab.measure.matrix.dispatch_case`: the M1 injection wave
or the closed-loop wave), with the same workload seeds, so the same prompts are sent.

The result is a NEW ATTEMPT beside the first one, never over it: ``cases/<case_id>@a<n>/`` (n = 2, 3, … — the
first attempt is ``cases/<case_id>/`` itself), the same files, a ``summary.json`` in the case schema whose
``repeat_of`` is the case id and whose ``details.attempt`` says ``{"n", "of", "first"}``. The engine's own log of
the re-run goes to ``<run>/<phase>/server/<case_id>@a<n>/``; the engine launch and stop and the re-run itself are
recorded as ``executed`` commands of the case's phase, so its page lists them when it is rendered again.

Supported: Phase 1 cases (matrix points and concurrency-search points). A Phase 2 ``hw-`` replay needs its
hardware collectors around the case and the other phases build their waves from their phase's settings (no recipe
in ``meta.json``): re-running those is refused with a reason (``ParamError``). The layout and the rules for users:
``docs/case.md#attempts``.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from servelab.core import run as runlib
from servelab.core.params import ParamError, did_you_mean
from servelab.core.paths import project_root
from servelab.core.redact import known_secrets, scrub_tree
from servelab.measure import request_metrics as mx
from servelab.measure.case import (ATTEMPT_SEP, ENGINE_CRASH, CaseEnv, CaseSpec, EngineCrash, attempt_folder,
                                   make_env, split_attempt)
from servelab.deploy.hosts import ProcessTracker
from servelab.deploy.server import start_server, stop_server
from servelab.deploy.targets import load_target
from servelab.measure.matrix import dispatch_case

SUPPORTED_PHASES = ("phase1",)
ENV_KEYS = ("repeats", "seed", "api", "timeout_s", "scrape_interval_s", "max_cv_pct", "phase", "clients")


def case_command(run_id: str, case_id: str, target: str | None = None) -> list[str]:
    """The command that re-runs one case as a new attempt (recorded as ``reproduce`` on the phase's page)."""
    argv = ["servelab", "case", run_id, case_id]
    return argv + ["--target", target] if target else argv


@dataclass
class CaseRecipe:
    """What a case folder says about how its case ran: enough to run it again exactly."""
    run_dir: Path
    case_id: str                       # the case (the first attempt's folder name)
    folder: str                        # the folder the recipe was read from (the case or one of its attempts)
    phase: str
    spec: CaseSpec
    env_kw: dict[str, Any]             # CaseEnv keyword arguments (make_env)
    target: str                        # a target name or file, as load_target reads it
    target_name: str
    notes: list[str] = field(default_factory=list)


@dataclass
class Attempt:
    """The new attempt: where it was written and its verdict."""
    case_id: str
    attempt: int
    case_dir: Path
    status: str                        # how it ran: success | failed | ENGINE_CRASH | OOM
    verdict: str                       # VALID | INVALID
    reasons: list[str]
    target: str
    error: str = ""

    @property
    def exit_code(self) -> int:
        """0 for a VALID attempt, 1 for anything else (an INVALID verdict, a failed or crashed case)."""
        return 0 if self.status == "success" and self.verdict == "VALID" else 1


def _cases(rdir: Path) -> list[str]:
    return sorted(p.name for p in (rdir / "cases").glob("*") if (p / "meta.json").is_file())


def read_recipe(run_id: str, case_id: str) -> CaseRecipe:
    """The recipe of ``case_id`` in run ``run_id`` (its folder's ``meta.json`` and the run's manifest).
    ``ParamError`` when the run or the case does not exist, the case is of a phase that cannot be re-run yet, or
    its ``meta.json`` does not say how it ran."""
    rdir = runlib.run_dir(run_id)
    if not (rdir / "manifest.json").is_file():
        raise ParamError(f"no run '{run_id}' under {rdir.parent}")
    cdir = rdir / "cases" / case_id
    meta_path = cdir / "meta.json"
    if not meta_path.is_file():
        known = _cases(rdir)
        raise ParamError(f"no case '{case_id}' in run '{run_id}'{did_you_mean(case_id, known)}; "
                         f"cases: {', '.join(known) or 'none'}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ParamError(f"{meta_path}: unreadable ({exc})") from exc
    phase = str(meta.get("phase", ""))
    if phase not in SUPPORTED_PHASES:
        why = ("a Phase 2 replay needs the hardware collectors around it: run the phase again "
               f"(servelab run phase2 --run-id {run_id})" if phase == "phase2" else
               f"{phase or 'its phase'} builds its wave from the phase's settings: run the phase again")
        raise ParamError(f"case '{case_id}' is a {phase or 'unknown-phase'} case: re-running one case is not "
                         f"supported yet for it (only Phase 1 cases); {why}")
    raw = meta.get("case")
    names = {f.name for f in fields(CaseSpec)}
    if not isinstance(raw, dict) or not {"case_id", "scenario", "kind"} <= set(raw):
        raise ParamError(f"{meta_path}: no recorded case spec ('case'): this case cannot be rebuilt")
    spec = CaseSpec(**{k: v for k, v in raw.items() if k in names})
    base, _ = split_attempt(case_id)
    if spec.case_id != base:
        raise ParamError(f"{meta_path}: the folder '{case_id}' records case '{spec.case_id}'")
    manifest = runlib.read_manifest(rdir)
    phase_params = manifest.get("phases", {}).get(phase, {}).get("params", {})
    notes: list[str] = []
    recorded = meta.get("case_env")
    if isinstance(recorded, dict):
        env_kw = {k: recorded[k] for k in ENV_KEYS if k in recorded}
        slo = recorded.get("slo") or {}
    else:        # a folder written before case_env was recorded: its own keys, the SLOs from the phase's params
        env_kw = {k: meta[k] for k in ("repeats", "seed", "api") if k in meta}
        slo = {"ttft_ms": phase_params.get("slo_ttft_ms") or None, "tpot_ms": phase_params.get("slo_tpot_ms") or None}
        notes.append("meta.json has no case_env (written by an older servelab): repeats, seed and API from "
                     "meta.json, SLOs from the phase's parameters, the other settings at their defaults")
    env_kw["slo"] = mx.SLO(**{k: v for k, v in slo.items() if k in ("ttft_ms", "tpot_ms", "e2el_ms")})
    env_kw["phase"] = phase
    if recorded and recorded.get("profiler_attached"):
        notes.append("the first attempt ran with a profiler attached; this attempt runs without one")
    tref = meta.get("target") if isinstance(meta.get("target"), dict) else {}
    name = str(tref.get("name") or manifest.get("target") or "")
    source = str(tref.get("source") or "")
    candidates = [source, str(phase_params.get("target") or ""), str(rdir / "targets" / f"{name}.yaml")]
    target = next((c for c in candidates if c and c.endswith((".yaml", ".yml")) and Path(c).is_file()), name)
    if not target:
        raise ParamError(f"{meta_path}: the case does not say which target it ran on; pass --target")
    return CaseRecipe(rdir, spec.case_id, case_id, phase, spec, env_kw, target, name, notes)


def _reserve(rdir: Path, case_id: str) -> tuple[int, Path]:
    """The next attempt's number and folder (created here, so two re-runs never share one)."""
    rx = re.compile(rf"{re.escape(case_id)}{re.escape(ATTEMPT_SEP)}(\d+)")
    taken = [int(m.group(1)) for p in (rdir / "cases").iterdir() if (m := rx.fullmatch(p.name))]
    n = max([1, *taken]) + 1
    while True:
        d = rdir / "cases" / attempt_folder(case_id, n)
        try:
            d.mkdir(parents=True)
            return n, d
        except FileExistsError:
            n += 1


def rerun_case(run_id: str, case_id: str, target: str | None = None, health_timeout_s: float = 900.0,
               recipe: CaseRecipe | None = None) -> Attempt:
    """Run ``case_id`` of ``run_id`` again on the same target (or ``target``) as a new attempt; see the module
    docstring. Raises ``ParamError`` before anything starts when the case cannot be re-run, ``ServerError``
    when the engine does not start (the reserved attempt folder is removed again)."""
    r = recipe or read_recipe(run_id, case_id)
    tgt = load_target(target or r.target)
    rdir = r.run_dir
    started = runlib.now_iso()
    t0_wall = time.time() - 2.0            # files written from here on are scrubbed (2 s: coarse modification times)
    n, adir = _reserve(rdir, r.case_id)
    folder = adir.name
    log_dir = rdir / r.phase / "server" / folder
    known = set(tgt.secret_values())
    status, verdict, reasons, error = ENGINE_CRASH, "INVALID", ["the case did not run"], ""
    try:
        with ProcessTracker() as tracker:
            srv = start_server(tgt, log_dir, tracker, run_dir=rdir, phase=r.phase, health_timeout_s=health_timeout_s)
            known |= {v for p in srv.plans for v in p.secret_values()} | ({srv.api_key} if srv.api_key else set())
            try:
                env: CaseEnv = make_env(srv, rdir, attempt=n, **r.env_kw)
                try:
                    res = dispatch_case(env, dataclasses.replace(r.spec, notes=list(r.spec.notes)))
                    status, verdict, reasons, error = res.status, res.verdict.verdict, res.verdict.reasons, res.error
                except EngineCrash as exc:       # everything measured is written; the summary (if any) says how
                    status, error = ENGINE_CRASH, str(exc)
                    summ = adir / "summary.json"
                    if summ.is_file():
                        v = json.loads(summ.read_text())["verdict"]
                        verdict, reasons = v["status"], v["reasons"]
                    else:
                        reasons = [error]
            finally:
                stop_server(srv, tracker, rdir, r.phase)
    except BaseException:
        if not (adir / "meta.json").exists():     # the case never started: give the attempt number back
            shutil.rmtree(adir, ignore_errors=True)
        raise
    finally:
        ran = (adir / "meta.json").exists()
        code = 0 if status == "success" and verdict == "VALID" else 1
        title = f"re-run case {r.case_id} as attempt {n} ({folder})" if ran else \
            f"re-run case {r.case_id}: did not start"
        runlib.record_command(rdir, runlib.CommandRecord(
            label="executed", argv=case_command(run_id, case_id, target), phase=r.phase, title=title,
            cwd=str(project_root()), start=started, end=runlib.now_iso(), exit_code=code,
            note=f"verdict {verdict}" if ran else ""))
        scrub_attempt(rdir, adir, log_dir, tuple(known), since=t0_wall)
    return Attempt(r.case_id, n, adir, status, verdict, list(reasons), tgt.name, error)


def scrub_attempt(rdir: Path, attempt_dir: Path, log_dir: Path, known: tuple[str, ...], since: float) -> None:
    """The re-run's last pass, as a phase's (``docs/method.md#secrets``): the attempt's folder (its engine-log excerpt
    among its files), the engine's own log of the re-run, and every other text file of the run written since the
    re-run began (manifest, commands) — known secret values (the target's, its launch plans', the API key, the
    process environment's) and secret-looking text replaced."""
    values = tuple(sorted({*known, *known_secrets()}, key=lambda v: (-len(v), v)))
    for folder in (attempt_dir, log_dir):
        if folder.is_dir():
            scrub_tree(folder, values)
    scrub_tree(rdir, values, since=since, exclude=(".ipynb",))
