"""``servelab`` command line: run a phase end to end, the demo archive, rendering, and help.

    servelab run phase1 --target local [--run-id ID] [-p key=value ...] [--resume]
    servelab demo [--run-id ID]
    servelab render RUN_ID [PHASE]
    servelab check RUN_ID                       # every page and fact of a run read back: contradictions reported
    servelab case RUN_ID CASE_ID [--target T]   # re-run one measured case as a new attempt
    servelab phases | targets | params PHASE
    servelab build            # build/cache llama-server and the models

Everything is validated before anything starts: an unknown phase, target or parameter is an error
that names the closest valid one.
"""
from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from servelab.core.params import ParamError, coerce, parse_overrides, run_phase_checks, did_you_mean

from servelab.deploy.targets import available_targets, load_target, target_from_dict
from servelab.core.notebooks import NOTEBOOKS, available_phases, kernel_manager_class, notebook_path
from servelab.core.paths import project_root
from servelab.core.run import UNSUPPORTED, read_manifest, new_run_id, validate_run_id, run_dir
from servelab.deploy.target_secrets import (derived_target, launch_over_secrets, recorded_run_secrets, run_secrets,
                                            target_dict_with_launch)
from servelab.core import run as runlib
from servelab.core import signals
from servelab.measure import param_checks  # noqa: F401  (registers the phase checks)
from servelab.phases import definition
from servelab.core.redact import scrub_tree
from servelab.deploy.attach import check_attached
from servelab.deploy.engines import engine_for
from servelab.deploy.server import http_json
from servelab.deploy.llamacpp_build import ensure_llama_server
from servelab.deploy.models import gemma_model, tiny_model, TINY_HF_KEY
from servelab.deploy.sglang_cpu import SGLANG_CPU_PYTHON, SGLANG_VERSION, resolve_sglang_cpu
from servelab.deploy.freeze_end import freeze_end
from servelab.report.archive import write_run_index

# phases the demo runs, in order; those without a live meaning locally read data/samples themselves
DEMO_PHASES = ("phase0", "phase1", "phase2", "phase3", "phase5", "phase4", "phase6", "phase7", "phase8", "phase9")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ProgressTail:
    """While a phase runs, print each event it appends to ``<run>/<phase>/progress.jsonl`` as one line (stderr).

    The library never prints (:func:`servelab.core.run.emit_progress`); this thread follows the file from where
    it ended when the phase started, and on ``stop()`` (every exit path of a ``with`` block) prints what is left
    and ends."""

    def __init__(self, path: Path, say: Any = None, interval_s: float = 0.5) -> None:
        self.path, self.interval_s = Path(path), interval_s
        self.say = say or _say
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="servelab-progress", daemon=True)

    def __enter__(self) -> "ProgressTail":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()
        self.poll()

    def poll(self) -> int:
        """Print the complete lines added since the last call; returns how many."""
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:     # replaced: start over
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return 0
        end = data.rfind(b"\n")
        if end < 0:
            return 0
        self.offset += end + 1
        n = 0
        for raw in data[:end + 1].splitlines():
            try:
                ev = json.loads(raw)
                line = f"{ev.get('phase') or self.path.parent.name}: {ev['message']}"
            except (ValueError, KeyError, TypeError):
                continue
            try:
                self.say(line)
            except Exception:       # a closed terminal never stops the phase
                pass
            n += 1
        return n


def split_overrides(phase: str, target: str, overrides: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """``-p`` keys are phase parameters or, where the phase has no such key, launch settings of the target's
    engine (``-p tp_size=8``). Anything else is an error naming the closest key of either kind."""
    t = load_target(target)
    phase_keys = set(definition(phase).specs())
    launch_keys = engine_for(t.engine).launch_keys()
    phase_over, launch_over = {}, {}
    for k, v in overrides.items():
        if k in phase_keys:
            phase_over[k] = v
        elif k in launch_keys:
            launch_over[k] = yaml.safe_load(v)
        else:
            raise ParamError(f"unknown parameter '{k}'{did_you_mean(k, phase_keys | launch_keys)}; "
                             f"{phase.split('_')[0]} parameters: {', '.join(sorted(phase_keys))}; "
                             f"{t.engine} launch settings: {', '.join(sorted(launch_keys))}")
    if launch_over and t.attached:
        raise ParamError(f"-p {', '.join(sorted(launch_over))}: {t.name} is attached to {t.endpoint}, which servelab "
                         f"did not start; its launch settings are not servelab's to change")
    if launch_over:
        target_from_dict(target_dict_with_launch(t, launch_over), f"{target} with -p {launch_over}")   # validates the combination
    return phase_over, launch_over


def validate(phase: str, target: str, overrides: dict[str, str], run_id: str = "") -> tuple[Path, dict[str, Any]]:
    """Resolve and check everything a phase run needs; no side effect. Returns (notebook, parameters). ``run_id``:
    the run it goes into ("" for a new one), for parameters that name another phase's results (Phase 3's
    ``capture_at``)."""
    nb = notebook_path(phase)
    phase_over, _ = split_overrides(phase, target, overrides)
    params = definition(phase).resolve(overrides=phase_over).as_dict()
    t = load_target(target)
    if t.attached:
        check_attached(t, phase, params, engine_for(t.engine), http_json)
    else:
        engine_for(t.engine).check_model(t)
    params["target"] = target
    # the folders, files, cases, runs and Phase 1 points (capture_at) the parameters name
    run_phase_checks(phase, {**params, "run_id": run_id or params.get("run_id") or ""})
    return nb, params


def scrub_phase_outputs(rdir: Path, key: str, known: tuple[str, ...], since: float | None = None) -> None:
    """The last pass over what a phase wrote, before its page is rendered: the executed notebook (text and
    stream outputs, tracebacks), every text file of the phase folder, and every other text file of the run written
    since ``since`` (its cases, manifest, commands, derived targets) — known secret values and secret-looking text
    replaced (:mod:`servelab.core.redact`)."""
    scrub_tree(rdir / key, known)
    scrub_tree(rdir, known, since=since if since is not None else 0.0)


def execute_phase(phase: str, target: str, run_id: str, overrides: dict[str, str], render: bool = True,
                  timeout_s: int | None = None) -> tuple[Path, str]:
    """Execute the phase notebook with papermill into ``outputs/<run_id>/<phase>/notebook.ipynb`` and render
    ``report.html``. Returns (run_dir, status)."""
    import papermill as pm

    from servelab.report.archive import write_root_index, write_run_index
    from servelab.report.html import render_notebook

    nb, _ = validate(phase, target, overrides, run_id=run_id)
    t0_wall = time.time() - 2.0        # files written from here on are scrubbed (2 s: coarse modification times)
    phase_over, launch_over = split_overrides(phase, target, overrides)
    key = phase.split("_")[0]
    specs = definition(phase).specs()
    params: dict[str, Any] = {k: coerce(specs[k], v, "-p") for k, v in phase_over.items()}
    rdir = runlib.init_run(run_id, load_target(target).name)
    kernel_env: dict[str, str] = {}
    known = run_secrets(target)
    if launch_over:
        known = run_secrets(target, launch_over_secrets(launch_over))
        runlib.update_manifest(rdir, launch_overrides={key: runlib.redact(launch_over, known)})
        target, kernel_env = derived_target(rdir, target, launch_over)
        known = tuple(sorted({*known, *run_secrets(target, kernel_env)}, key=lambda v: (-len(v), v)))
    params.update(run_id=run_id, target=target)
    out_nb = rdir / key / "notebook.ipynb"
    out_nb.parent.mkdir(parents=True, exist_ok=True)
    good = kept_good_attempt(rdir, key)           # the page of an earlier good attempt survives a failed one
    backup = out_nb.with_name(".notebook.good.ipynb")
    if good is not None and out_nb.exists():
        shutil.copyfile(out_nb, backup)
    status = "success"
    error: BaseException | None = None
    t0 = time.monotonic()
    started = runlib.now_iso()
    try:
        with ProgressTail(runlib.progress_path(rdir, key)):       # "case i of n" while the notebook runs
            pm.execute_notebook(str(nb), str(out_nb), parameters=params, kernel_name="python3",
                                cwd=str(project_root()), progress_bar=False, execution_timeout=timeout_s,
                                request_save_on_cell_execute=True,
                                kernel_manager_class=kernel_manager_class(out_nb.parent / "kernel.log", kernel_env))
    except KeyboardInterrupt:
        status, error = "interrupted", None
        runlib.update_manifest(rdir, phases={key: {"status": "interrupted", "ended": runlib.now_iso()}})
        raise
    except Exception as exc:  # the notebook failed: keep everything, mark the phase, still render
        status, error = "failed", exc
        reason = runlib.failure_reason(exc)
        if signals.received():        # the kernel failed its cell on the signal forwarded to it (core.signals)
            status, error, reason = "interrupted", None, f"interrupted by {signal.Signals(signals.received()).name}"
        elif getattr(exc, "ename", None) == runlib.PhaseUnsupported.__name__:   # the target cannot: no failure
            status, error = runlib.UNSUPPORTED, None
            reason = str(getattr(exc, "evalue", "") or reason)
        runlib.edit_manifest(rdir, lambda m: m.setdefault("phases", {}).setdefault(key, {}).update(
            status=status, ended=runlib.now_iso(), error=reason))
    finally:
        signals.stop_forwarding()     # the kernel has ended
        record_phase_commands(rdir, key, nb, out_nb, params, overrides, target, started,
                              0 if status == "success" else 1)
        scrub_phase_outputs(rdir, key, known, since=t0_wall)
        wall_s = round(time.monotonic() - t0, 1)
        m = runlib.edit_manifest(rdir, lambda m: m.setdefault("phases", {}).setdefault(key, {}).update(wall_s=wall_s))
        entry = m.get("phases", {}).get(key, {})
        # every attempt is kept: the index shows the final results in its body and failed ones as lessons
        runlib.update_manifest(rdir, attempts=[{"phase": key, "status": entry.get("status", status),
                                                "started": entry.get("started"), "ended": entry.get("ended"),
                                                "wall_s": entry["wall_s"], "error": entry.get("error", ""),
                                                "not_executed": entry.get("not_executed", []),
                                                "params": {k: v for k, v in params.items() if k != "run_id"}}])
        final = "failed" if error is not None else str(entry.get("status") or status)
        page_meta = {"run_id": run_id, "phase": key, "target": target, "status": final,
                     "error": entry.get("error", ""), "title": f"{key} · {NOTEBOOKS[key]}"}
        if final != "success" and good is not None and (rdir / key / "report.html").exists():
            keep_good_page(rdir, key, out_nb, backup, good, final, entry, page_meta if render else None,
                           known=known)
        else:
            backup.unlink(missing_ok=True)
            if final == "success":
                runlib.edit_manifest(rdir, lambda m: [m.get("phases", {}).get(key, {}).pop(k, None)
                                                      for k in ("kept_page", "failed_page")])
            if render and out_nb.exists():
                render_notebook(out_nb, rdir / key / "report.html", page_meta, known=known)
        write_run_index(rdir)
        write_root_index(rdir.parent)
    if signals.received():
        raise KeyboardInterrupt(f"signal {signals.received()}")       # the page is written; no phase after it
    if error is not None:
        status = "failed"
    elif entry.get("status") not in (None, "success"):
        status = str(entry["status"])        # the notebook ran, but the phase itself judged a failure
    return rdir, status


def kept_good_attempt(rdir: Path, key: str) -> dict[str, Any] | None:
    """The last good attempt of phase ``key`` whose page ``<run>/<key>/report.html`` is there to keep: the phase
    entry of the manifest when it says success, or the ``kept_page`` an earlier failure already kept; else None."""
    if not (rdir / key / "report.html").is_file():
        return None
    e = read_manifest(rdir).get("phases", {}).get(key, {})
    if e.get("kept_page"):
        return dict(e["kept_page"])
    if e.get("status") == "success":
        return {"page": "report.html", "status": "success", "started": e.get("started"), "ended": e.get("ended"),
                "headline": e.get("headline", {})}
    return None


def keep_good_page(rdir: Path, key: str, out_nb: Path, backup: Path, good: dict[str, Any], status: str,
                   entry: dict[str, Any], page_meta: dict[str, Any] | None, known: Any = None) -> str:
    """A failed (or interrupted) attempt after a good one: its notebook and page go to
    ``notebook.failed-<n>.ipynb`` / ``report.failed-<n>.html``, the good notebook comes back, the good page stays
    ``report.html`` with a banner naming the failure and linking its page; the manifest's phase entry (which says
    the latest attempt failed) gets ``kept_page`` (the good attempt) and ``failed_page``; the attempt record links
    its page. Returns the failed page's name."""
    from servelab.report.html import mark_later_failure, render_notebook
    pdir = rdir / key
    n = 1
    while (pdir / f"report.failed-{n}.html").exists() or (pdir / f"notebook.failed-{n}.ipynb").exists():
        n += 1
    failed_nb, failed_page = pdir / f"notebook.failed-{n}.ipynb", f"report.failed-{n}.html"
    if out_nb.exists():
        os.replace(out_nb, failed_nb)
    if backup.exists():
        os.replace(backup, out_nb)
    page = failed_page if page_meta is not None and failed_nb.exists() else None
    if page is not None:
        render_notebook(failed_nb, pdir / failed_page, page_meta, known=known)
    when = str(entry.get("ended") or runlib.now_iso())
    reason = str(entry.get("error") or status)
    mark_later_failure(pdir / "report.html", when, status, reason, page)

    def edit(m: dict[str, Any]) -> None:
        e = m.setdefault("phases", {}).setdefault(key, {})
        e["kept_page"], e["failed_page"] = good, page
        for a in reversed(m.get("attempts", [])):
            if a.get("phase") == key:
                a["page"] = f"{key}/{page}" if page else None
                break
    runlib.edit_manifest(rdir, edit)
    return failed_page


def record_phase_commands(rdir: Path, key: str, nb: Path, out_nb: Path, params: dict[str, Any],
                          overrides: dict[str, str], target: str, started: str, exit_code: int) -> None:
    """Every phase page shows how the phase itself ran: the papermill execution (``executed``) and the one
    ``servelab run`` line that repeats it into the same run (``reproduce``)."""
    argv = ["papermill", str(nb.relative_to(project_root()) if nb.is_relative_to(project_root()) else nb),
            str(out_nb)]
    for k, v in params.items():
        argv += ["-p", k, str(v)]
    runlib.record_command(rdir, runlib.CommandRecord(
        label="executed", argv=argv, phase=key, title=f"execute the {key} notebook", cwd=str(project_root()),
        start=started, end=runlib.now_iso(), exit_code=exit_code))
    again = ["servelab", "run", key, "--target", str(params.get("target", target)), "--run-id", rdir.name]
    for k, v in overrides.items():
        again += ["-p", f"{k}={v}"]
    runlib.record_command(rdir, runlib.CommandRecord(label="reproduce", argv=again, phase=key,
                                                     title=f"run {key} again into this run"))


def cmd_run(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.p or [])
    if args.resume:
        overrides.setdefault("resume", "true")
    validate(args.phase, args.target, overrides, run_id=args.run_id or "")      # before any side effect
    run_id = validate_run_id(args.run_id) if args.run_id else new_run_id(args.target)
    rdir, status = execute_phase(args.phase, args.target, run_id, overrides, render=not args.no_render,
                                 timeout_s=args.timeout)
    key = args.phase.split("_")[0]
    if key != "phase0":
        _end_freeze(rdir, args.target)
    print(f"{key}: {status}{_why(rdir, key, status)}")
    print(rdir / key / "report.html")
    print(rdir / "index.html")
    return 0 if status in ("success", UNSUPPORTED) else 1


def _run_target(rdir: Path, name: str = "") -> Any:
    """The target a run ran on: ``name`` (else the manifest's), with the launch settings Phase 0 recorded."""
    m = read_manifest(rdir)
    t = load_target(name or str(m.get("target") or ""))
    settings = (m.get("launch") or {}).get("settings")
    return target_from_dict(target_dict_with_launch(t, {k: v for k, v in settings.items() if t.launch.get(k) != v}),
                            f"{t.source} as run {rdir.name} recorded it") if isinstance(settings, dict) else t


def _end_freeze(rdir: Path, target: str = "") -> int:
    """The run-end freeze (``phases.freeze_end``) where Phase 0 froze the run; one line for what it found, the run
    index rewritten. A freeze that fails says why in one line and fails nothing else."""
    if not (read_manifest(rdir).get("frozen") or {}):
        return 0
    try:
        changes = freeze_end(rdir, _run_target(rdir, target))
    except Exception as exc:      # an unreachable node, a missing interpreter ...: said, the run stays as it is
        _say(f"run-end freeze not taken: {runlib.failure_reason(exc)}")
        return 1
    _say("run-end freeze: " + ("no change since Phase 0" if changes.empty else
                               f"{len(changes)} change(s) since Phase 0: " + "; ".join(
                                   f"{r.node} {r.what} {r.before} → {r.after}" for r in changes.head(4).itertuples())))
    write_run_index(rdir)
    return 0


def cmd_freeze(args: argparse.Namespace) -> int:
    """``servelab freeze RUN_ID``: take the run-end freeze of an existing run now."""
    rdir = run_dir(validate_run_id(args.run_id))
    if not (rdir / "manifest.json").is_file():
        raise ParamError(f"no run '{args.run_id}' under {rdir.parent} (servelab run ... --run-id ID makes one)")
    if not (read_manifest(rdir).get("frozen") or {}):
        raise ParamError(f"run '{args.run_id}' has no Phase 0 freeze to compare with: "
                         f"servelab run phase0 --target <target> --run-id {args.run_id}")
    code = _end_freeze(rdir, args.target or "")
    print(rdir / "freeze_end.csv")
    return code


def _why(rdir: Path, key: str, status: str) -> str:
    """`` — <reason>`` for a phase that did not succeed (from the manifest), else ``""``."""
    if status == "success":
        return ""
    err = read_manifest(rdir).get("phases", {}).get(key, {}).get("error", "")
    return f" — {err}" if err else ""


def cmd_demo(args: argparse.Namespace) -> int:
    run_id = validate_run_id(args.run_id) if args.run_id else new_run_id("demo")
    phases = [p for p in DEMO_PHASES if p in available_phases()]
    if args.phases:
        phases = [p for p in args.phases.split(",") if p]
    for p in phases:
        validate(p, args.target, {})
    t0 = time.monotonic()
    target = load_target(args.target)
    ready = engine_for(target.engine).prepare(target, progress=_say)
    _say(f"{ready} in {time.monotonic() - t0:.1f} s")
    failed: list[str] = []
    unsupported: list[str] = []
    rdir = None
    for i, p in enumerate(phases, 1):
        t = time.monotonic()
        _say(f"[{i}/{len(phases)}] {p} · {NOTEBOOKS.get(p, p)} …")
        rdir, status = execute_phase(p, args.target, run_id, {}, timeout_s=args.timeout)
        _say(f"[{i}/{len(phases)}] {p}: {status} in {time.monotonic() - t:.1f} s{_why(rdir, p, status)}")
        if status == UNSUPPORTED:                         # "not supported here" says why and is no failure
            unsupported.append(p)
        elif status != "success":
            failed.append(p)
    assert rdir is not None
    _end_freeze(rdir, args.target)
    ok = len(phases) - len(failed) - len(unsupported)
    _say(f"demo finished in {time.monotonic() - t0:.0f} s; {ok} of {len(phases)} phases succeeded"
         + (f"; not supported on this target: {', '.join(unsupported)}" if unsupported else "")
         + (f"; failed: {', '.join(failed)}" if failed else ""))
    report_check(rdir)          # each finding on stderr and in check.json; `servelab check` exits 1 on any
    print(rdir / "index.html")
    return 1 if failed else 0


def report_check(rdir: Path) -> int:
    """The run's consistency check (``report.check``): each finding one line on stderr, the count last; written to
    ``<run>/check.json``. Returns the number of findings."""
    from servelab.report.check import check_run
    found = check_run(rdir)
    runlib.write_json_atomic(rdir / "check.json", {"checked": runlib.now_iso(), "findings": [asdict(f) for f in found]})
    for f in found:
        _say(f"check: {f.line()}")
    _say(f"consistency check of {rdir.name}: " + (f"{len(found)} finding(s)" if found else "no contradictions"))
    return len(found)


def cmd_check(args: argparse.Namespace) -> int:
    rdir = run_dir(args.run_id)
    if not (rdir / "manifest.json").exists():
        raise ParamError(f"no run '{args.run_id}' under {rdir.parent}")
    return 1 if report_check(rdir) else 0


def cmd_render(args: argparse.Namespace) -> int:
    from servelab.report.archive import write_root_index, write_run_index
    from servelab.report.html import render_notebook
    rdir = run_dir(args.run_id)
    if not rdir.exists():
        raise ParamError(f"no run directory {rdir}")
    if args.notebook and not args.phase:
        raise ParamError("--notebook renders one phase: name it (servelab render RUN_ID PHASE --notebook FILE)")
    if args.notebook and not Path(args.notebook).is_file():
        raise ParamError(f"--notebook {args.notebook}: no such file")
    m = read_manifest(rdir)
    phases = [args.phase] if args.phase else list(m.get("phases", {}))
    scrubbed = False
    for p in phases:
        nb = rdir / p / "notebook.ipynb"
        source = Path(args.notebook) if args.notebook else None
        recorded = m.get("phases", {}).get(p, {}).get("executed_notebook")
        if source is None and recorded and Path(recorded).exists() and (
                not nb.exists() or Path(recorded).stat().st_mtime > nb.stat().st_mtime):
            source = Path(recorded)        # run with plain papermill or in JupyterLab: its executed notebook
        if source is not None and source.exists() and (not nb.exists() or not source.samefile(nb)):
            # taken into the run (scrubbed below, with everything the phase wrote), then rendered from there
            nb.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, nb)
        if not nb.exists():
            _say(f"{p}: no executed notebook (expected {source or nb}); run the phase with `servelab run` or pass "
                 "--notebook")
            continue
        if nb.exists():
            entry = m.get("phases", {}).get(p, {})
            status = entry.get("status", "")
            known = recorded_run_secrets(rdir)
            scrub_tree(rdir / p, known)                # the notebook and the phase's files: secrets never stay
            scrubbed = True
            kept = entry.get("kept_page") if not args.notebook else None
            # a kept good page (a later attempt failed) is rendered as the good attempt it is, with its banner
            out = render_notebook(nb, rdir / p / "report.html", {"run_id": args.run_id, "phase": p,
                                                                 "target": m.get("target", ""),
                                                                 "status": kept.get("status", "success") if kept
                                                                 else status,
                                                                 "error": "" if kept else entry.get("error", ""),
                                                                 "title": f"{p} · {NOTEBOOKS.get(p, p)}"}, known=known)
            if kept:
                from servelab.report.html import mark_later_failure
                mark_later_failure(out, str(entry.get("ended") or ""), status, str(entry.get("error") or status),
                                   entry.get("failed_page"))
            print(out)
    if scrubbed:                 # the run's other files (cases, manifest, commands) once, e.g. after plain papermill
        scrub_tree(rdir, recorded_run_secrets(rdir))
    write_run_index(rdir)
    write_root_index(rdir.parent)
    report_check(rdir)                     # the pages just rendered, read back (render itself still succeeds)
    print(rdir / "index.html")
    return 0


def cmd_archive(args: argparse.Namespace) -> int:
    from servelab.report.archive import write_root_index, write_run_index, zip_run
    rdir = run_dir(args.run_id)
    if not (rdir / "manifest.json").exists():
        raise ParamError(f"no run '{args.run_id}' under {rdir.parent}")
    print(write_run_index(rdir))
    write_root_index(rdir.parent)
    if args.zip:
        print(zip_run(rdir, known=recorded_run_secrets(rdir)))    # every text member redacted as it enters
    return 0


def cmd_case(args: argparse.Namespace) -> int:
    """Re-run one measured case from its recorded meta as a new attempt; one line for its verdict, one for its
    folder (stdout). A case that cannot be re-run is a ParamError (exit 2) before anything starts."""
    from servelab.measure.case_rerun import read_recipe, rerun_case
    recipe = read_recipe(args.run_id, args.case_id)
    target = load_target(args.target or recipe.target)                 # validated before anything starts
    for note in recipe.notes:
        _say(f"note: {note}")
    other = f" (recorded: {recipe.target_name})" if recipe.target_name and target.name != recipe.target_name else ""
    _say(f"re-running {recipe.case_id} of run {args.run_id} ({recipe.phase}) on target {target.name}{other} …")
    t0 = time.monotonic()
    try:
        att = rerun_case(args.run_id, args.case_id, args.target, recipe=recipe)
    except ParamError:
        raise
    except Exception as exc:       # the engine did not start, a node is unreachable ...: one line, exit 1
        print(f"servelab: error: {runlib.failure_reason(exc)}", file=sys.stderr)
        return 1
    _say(f"attempt {att.attempt} of {att.case_id} done in {time.monotonic() - t0:.1f} s")
    print(f"{att.case_dir.name}: {att.verdict} ({att.status})"
          + (f" — {'; '.join(att.reasons)}" if att.reasons else ""))
    print(att.case_dir)
    if not args.no_render:
        from servelab.report.archive import write_root_index, write_run_index
        from servelab.report.html import render_notebook
        rdir = att.case_dir.parents[1]
        nb = rdir / recipe.phase / "notebook.ipynb"
        if nb.exists():            # the phase page lists the re-run among its executed commands
            m = read_manifest(rdir)
            entry = m.get("phases", {}).get(recipe.phase, {})
            known = tuple(sorted({*recorded_run_secrets(rdir), *target.secret_values()}, key=lambda v: (-len(v), v)))
            render_notebook(nb, rdir / recipe.phase / "report.html",
                            {"run_id": args.run_id, "phase": recipe.phase, "target": m.get("target", ""),
                             "status": entry.get("status", ""), "error": entry.get("error", ""),
                             "title": f"{recipe.phase} · {NOTEBOOKS.get(recipe.phase, recipe.phase)}"}, known=known)
        write_run_index(rdir)
        write_root_index(rdir.parent)
    return att.exit_code


def cmd_import(args: argparse.Namespace) -> int:
    """Bring peer tools' result files into a run (every file validated before anything is written)."""
    from servelab.measure import peer_compare as pc
    rdir = runlib.run_dir(args.run_id)
    if not (rdir / "manifest.json").exists():
        raise ParamError(f"no run '{args.run_id}' under {rdir.parent} (run a phase with --run-id {args.run_id} first)")
    started = runlib.now_iso()
    try:
        table, added = pc.import_into_run(rdir, args.files)
    except pc.PeerImportError as exc:
        raise ParamError(str(exc)) from None
    scrub_tree(rdir / pc.PEERS_DIR, recorded_run_secrets(rdir))      # a peer's file may carry a key or a URL token
    runlib.record_command(rdir, runlib.CommandRecord(
        label="executed", argv=["servelab", "import", *[str(f) for f in args.files], "--run-id", args.run_id],
        phase="phase1", title="import peer benchmark results", cwd=str(Path.cwd()), start=started, end=runlib.now_iso(),
        exit_code=0, note=f"copied into {pc.PEERS_DIR}/files/; table {pc.PEERS_DIR}/peer_results.csv"))
    print("\n".join(pc.import_report(rdir, table, added)))
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    defn = definition(args.phase)      # the parameters cell it writes out, or one line per parameter
    print(defn.cell_source() if args.cell else "\n".join(f"{s.name:28s} {s.type_name:6s} = {s.default!r:24s} # {s.help}"
                                                          for s in defn.specs().values()))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    print(ensure_llama_server(progress=_say), f"({time.monotonic() - t0:.1f} s)")
    print(tiny_model())
    if not args.tiny_only:
        print(gemma_model())
    if args.sglang:
        t0 = time.monotonic()
        _say(f"sglang {SGLANG_VERSION} for CPU: installing its own venv under the servelab cache if not there yet "
             "(about 2 minutes and 3.3 GB the first time)")
        model, launch = resolve_sglang_cpu(TINY_HF_KEY, {"python": SGLANG_CPU_PYTHON})
        print(launch["python"], model, f"({time.monotonic() - t0:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="servelab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one phase end to end (papermill + HTML)")
    r.add_argument("phase", help=f"one of: {', '.join(NOTEBOOKS)}")
    r.add_argument("--target", default="local", help="params/targets/<name>.yaml or a path")
    r.add_argument("--run-id", help="add this phase to an existing investigation (default: a new id)")
    r.add_argument("-p", action="append", metavar="KEY=VALUE", help="override a phase parameter (repeatable)")
    r.add_argument("--resume", action="store_true", help="skip cases already measured successfully")
    r.add_argument("--no-render", action="store_true")
    r.add_argument("--timeout", type=int, default=None, help="per-cell timeout in seconds")
    r.set_defaults(fn=cmd_run)
    d = sub.add_parser("demo", help="the demo archive against the embedded local target")
    d.add_argument("--run-id")
    d.add_argument("--target", default="local")
    d.add_argument("--phases", help="comma-separated subset (default: every phase that exists)")
    d.add_argument("--timeout", type=int, default=None)
    d.set_defaults(fn=cmd_demo)
    rn = sub.add_parser("render", help="(re)render a run's pages and indexes")
    rn.add_argument("run_id")
    rn.add_argument("phase", nargs="?")
    rn.add_argument("--notebook", help="an executed notebook (plain papermill, JupyterLab) to take into the run as "
                                       "PHASE's notebook, scrubbed of secrets, and render")
    rn.set_defaults(fn=cmd_render)
    ck = sub.add_parser("check", help="read every page and fact of a run and report contradictions (exit 1 on any)")
    ck.add_argument("run_id")
    ck.set_defaults(fn=cmd_check)
    cs = sub.add_parser("case", help="re-run one measured case from its recorded meta as a new attempt "
                                     "(cases/<case>@a<n>/)")
    cs.add_argument("run_id")
    cs.add_argument("case_id", help="a folder under outputs/<run_id>/cases/ (Phase 1 cases)")
    cs.add_argument("--target", help="run on this target instead of the recorded one")
    cs.add_argument("--no-render", action="store_true", help="do not render the phase page and the run index again")
    cs.set_defaults(fn=cmd_case)
    fz = sub.add_parser("freeze", help="freeze an existing run's environment again now and compare with its Phase 0 "
                                       "freeze (done after every phase run and at the end of the demo)")
    fz.add_argument("run_id")
    fz.add_argument("--target", help="the target's name or file, if not the recorded one")
    fz.set_defaults(fn=cmd_freeze)
    sub.add_parser("phases", help="list phases").set_defaults(
        fn=lambda a: print("\n".join(f"{k}  {v}{'' if k in available_phases() else '  (not yet)'}"
                                     for k, v in NOTEBOOKS.items())) or 0)
    sub.add_parser("targets", help="list targets").set_defaults(fn=lambda a: print("\n".join(available_targets())) or 0)
    ar = sub.add_parser("archive", help="rewrite a run's index (ledger, milestones); --zip makes one bundle")
    ar.add_argument("run_id")
    ar.add_argument("--zip", action="store_true")
    ar.set_defaults(fn=cmd_archive)
    im = sub.add_parser("import", help="bring SGLang bench_serving / vllm bench serve / AIPerf / guidellm result "
                                       "files into a run (Phase 1 shows them beside ours)")
    im.add_argument("files", nargs="+", metavar="FILE", help="result files: SGLang bench_serving JSONL, `vllm bench serve` "
                    "JSON, AIPerf profile_export_aiperf.json, guidellm benchmarks.json")
    im.add_argument("--run-id", required=True, help="the run to import into (it must exist)")
    im.set_defaults(fn=cmd_import)
    pp = sub.add_parser("params", help="a phase's parameters, types and defaults")
    pp.add_argument("phase")
    pp.add_argument("--cell", action="store_true", help="print the notebook's parameters cell this definition makes")
    pp.set_defaults(fn=cmd_params)
    b = sub.add_parser("build", help="build and cache llama-server and the local models")
    b.add_argument("--tiny-only", action="store_true", help="only the tiny test model, not Gemma-3-270M")
    b.add_argument("--sglang", action="store_true", help="also SGLang for CPU (its own venv) and the tiny HF model "
                   "(the local-sglang target)")
    b.set_defaults(fn=cmd_build)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM takes Ctrl-C's path, in bounded time, with the status naming the signal (Ctrl-C reaches the kernel
    # from the terminal itself, and keeps Python's own handler)
    changed = signals.stop_on((signal.SIGTERM,))
    try:
        return int(args.fn(args) or 0)
    except ParamError as exc:
        print(f"servelab: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"servelab: error: the disk is full ({exc.strerror}: {exc.filename or '?'}); nothing measured was marked "
              "done and the run directory cannot record more: free space, then the same command with --resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # nbclient may leave a task that later fails with DeadKernelError (the kernel got the same SIGINT); asyncio
        # would log it with a traceback when the task is collected, after our one line. The kernel's own account
        # is in the phase's kernel.log; the terminal gets one line.
        logging.getLogger("asyncio").disabled = True
        gc.collect()
        got = signals.received()
        by = f" by {signal.Signals(got).name}" if got else ""
        print(f"servelab: interrupted{by}; everything measured so far is kept in the run directory", file=sys.stderr)
        return signals.exit_status()
    finally:
        signals.restore(changed)


if __name__ == "__main__":
    sys.exit(main())
