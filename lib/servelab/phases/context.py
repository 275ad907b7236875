"""The one call a phase notebook makes after its parameters cell, and the one it makes at the end.

    ctx = open_phase(phase0.Params, globals())
    result = phase0.run(ctx)          # every phase module's one entry: run(ctx: PhaseContext) -> PhaseResult
    ...
    finish_phase(ctx, headline=result.headline(), findings=result.findings())

``open_phase`` takes the values of the phase's parameters (its ``Params`` definition, which the notebook's
``parameters`` cell writes out) from the namespace (papermill has injected its overrides there), layers
``params/<phase>.yaml``, validates everything, resolves the target, and opens ``outputs/<run_id>/<phase>/``. The
same call serves the CLI, plain papermill and JupyterLab; :func:`phase_context` builds one from keywords (tests,
scripts).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pandas as pd

from servelab.core import run as runlib
from servelab.core import signals
from servelab.core.notebooks import notebook_path
from servelab.core.params import PhaseParams, run_phase_checks
from servelab.core.scope import RunScope
from servelab.measure import param_checks  # noqa: F401  (registers the phase checks)
from servelab.report import answers
from servelab.report.findings import format_value
from servelab.report.tables import register_table_display
from servelab.deploy.targets import load_target
from servelab.deploy.attach import check_phase
from servelab.deploy.engines import engine_for
from servelab.core.redact import scrub_tree


@runtime_checkable
class PhaseResult(Protocol):
    """What every phase's ``run(ctx)`` returns: the result knows the key numbers ``finish_phase`` records in the
    manifest and the run index (``headline``) and the sentences of the findings box that opens the page
    (``findings``)."""

    def headline(self) -> dict[str, Any]: ...

    def findings(self) -> list[str]: ...


@dataclass(kw_only=True)
class PhaseContext(RunScope):
    """A run scope (:class:`servelab.core.scope.RunScope`) with the phase's typed, validated parameters and the
    moment it opened."""
    params: PhaseParams
    started: str = ""

    def params_table(self) -> pd.DataFrame:
        """The resolved parameters as a two-column table (for the page; no Python reprs)."""
        return pd.DataFrame([{"parameter": k, "value": format_value(v) if v not in ("", [], {}) else "(default)"}
                             for k, v in self.params.as_dict().items()])


def papermill_output(pid: int | None = None) -> Path | None:
    """Where plain ``papermill IN OUT ...`` writes this executed notebook: read from the command line of the
    kernel's parent process (the papermill CLI) with papermill's own argument parser. ``None`` when the kernel
    was not started by the papermill CLI (``servelab run``, JupyterLab, the Python API) or OUT is not a file."""
    ppid = os.getppid() if pid is None else pid
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0") if a]
        cwd = Path(os.readlink(f"/proc/{ppid}/cwd"))
    except OSError:
        return None
    start = next((i + 1 for i, a in enumerate(argv) if Path(a).name == "papermill"), None)
    if start is None:
        return None
    try:
        from papermill.cli import papermill as papermill_cli
        ctx = papermill_cli.make_context("papermill", argv[start:], resilient_parsing=True)
    except Exception:          # not papermill's own arguments after all
        return None
    out = ctx.params.get("output_path")
    if not out or out == "-" or "://" in str(out):
        return None
    path = Path(out)
    return path if path.is_absolute() else (cwd / path).resolve()


def jupyter_notebook(environ: dict[str, str] | None = None) -> Path | None:
    """The notebook file a JupyterLab (jupyter-server) kernel runs: jupyter-server starts each notebook's kernel with
    ``JPY_SESSION_NAME`` = the notebook's path (absolute, or relative to the server's root, where the kernel's
    working folder is the notebook's own). ``None`` outside JupyterLab or when the file is not found."""
    name = (os.environ if environ is None else environ).get("JPY_SESSION_NAME", "")
    if not name.endswith(".ipynb"):
        return None
    p = Path(name)
    for cand in ([p] if p.is_absolute() else [Path.cwd() / p, Path.cwd() / p.name]):
        if cand.is_file():
            return cand.resolve()
    return None


def stop_on_sigterm() -> None:
    """SIGTERM in this process (the kernel: papermill/nbclient terminating it, ``kill PID``) ends the same way as
    Ctrl-C: a ``KeyboardInterrupt`` in the running cell, so every ``ProcessTracker`` stops what it started, on
    every node; and if the interrupt is swallowed, the process still ends in bounded time (``core.signals``). Only
    the main thread can install it; elsewhere nothing changes."""
    signals.stop_on((signal.SIGTERM,), only_default=False)


def open_phase(definition: type[PhaseParams], namespace: dict[str, Any]) -> PhaseContext:
    """Validate the parameters of ``definition`` (the phase's ``Params``; values from ``namespace``, the notebook's
    globals), resolve the target and open the run directory (no other side effect besides the SIGTERM handler of
    :func:`stop_on_sigterm`)."""
    stop_on_sigterm()
    import plotly.io as pio
    # papermill + nbconvert can only render this mimetype pair offline (plotly.js inlined once)
    pio.renderers.default = "plotly_mimetype+notebook"
    pd.set_option("display.max_colwidth", 160)
    pd.set_option("display.max_rows", 200)
    given = {k: namespace[k] for k in definition.specs() if k in namespace}
    ctx = phase_context(definition.resolve(given=given))
    executed = papermill_output() or jupyter_notebook()
    if executed is not None:       # plain papermill, JupyterLab: `servelab render RUN_ID` takes the notebook from here
        runlib.update_manifest(ctx.run_dir, phases={ctx.phase: {**runlib.read_manifest(ctx.run_dir)["phases"][ctx.phase],
                                                                "executed_notebook": str(executed)}})
    return ctx


def phase_context(params: PhaseParams) -> PhaseContext:
    """The context of one phase run with these (resolved) parameters: the target resolved and checked for the
    phase (an attached target refuses a phase that needs a restart), the parameters' own checks run, then the run
    folder and the phase folder opened and the phase recorded as running."""
    phase = params.phase
    nb = notebook_path(phase)
    given_target = params.target or "local"          # a name or a target file's path, as servelab run had it
    target = load_target(given_target)
    values = params.as_dict()
    check_phase(target, phase, values, engine_for(target.engine))     # attached: a restart is refused here
    run_phase_checks(phase, {**values, "target": given_target})     # before the run folder is made
    run_id = params.run_id or os.environ.get("SERVELAB_RUN_ID") or runlib.new_run_id(target.name)
    rdir = runlib.init_run(run_id, target.name)
    pdir = rdir / phase
    pdir.mkdir(parents=True, exist_ok=True)
    # every table on the page: units in headers, counts as integers, no index, split to fit, long ones as files
    register_table_display(pdir / "tables")
    started = runlib.now_iso()
    params = params.replace(run_id=run_id)
    entry = {"status": "running", "started": started, "params": params.as_dict(), "notebook": nb.name}
    runlib.update_manifest(rdir, phases={phase: entry})
    runlib.write_json_atomic(pdir / "params.json", runlib.redact(params.as_dict()))
    return PhaseContext(phase=phase, run_id=run_id, run_dir=rdir, phase_dir=pdir, params=params,
                        target=target, started=started)


def finish_phase(ctx: PhaseContext, status: str = "success", headline: dict[str, Any] | None = None,
                 not_executed: list[str] | None = None, findings: list[str] | None = None,
                 error: str = "") -> dict[str, Any]:
    """Close the phase in the manifest: status, end time, headline numbers, the findings in sentences (they
    open the page), what was not executed; a phase that did not succeed says why in one line (``error``: the
    terminal, the manifest and the top of the page show it)."""
    names: dict[str, str] = {}
    if status == "success" and headline:      # every headline number a recorded fact (a failed attempt keeps the last)
        origin = "; ".join(str(s.get("what") or "") for s in ctx.sources) or (
            "recorded sample data" if ctx.from_samples else f"measured on {ctx.target.name}")
        headline, names = answers.record_headline(ctx.run_dir, ctx.phase, headline, since=ctx.started,
                                                  origin=f"{ctx.phase}: {origin}")
    entry = {"status": status, "ended": runlib.now_iso(), "headline": headline or {}, "headline_facts": names,
             "findings": findings or [],
             "from_samples": ctx.from_samples, "not_executed": not_executed or [], "notes": ctx.notes,
             "sources": list(ctx.sources) or [
                 {"kind": "samples", "what": "recorded sample data (data/samples)"} if ctx.from_samples else
                 {"kind": "live", "what": f"measured on {ctx.target.name}"}]}
    if status != "success":
        entry["error"] = error or f"the phase ended {status} without a recorded reason"
    m = runlib.read_manifest(ctx.run_dir)
    merged = {**m.get("phases", {}).get(ctx.phase, {}), **entry}
    runlib.update_manifest(ctx.run_dir, phases={ctx.phase: merged})
    runlib.write_json_atomic(ctx.phase_dir / "phase.json", runlib.redact(merged))
    scrub_phase_files(ctx)
    return merged


def scrub_phase_files(ctx: PhaseContext) -> None:
    """Every text file the phase wrote (its folder, and the run's files written since it opened: cases, manifest,
    commands) through the one redaction routine with the target's known secrets — the same however the notebook
    runs (``servelab run``, plain papermill, JupyterLab)."""
    known = ctx.target.secret_values()
    try:
        since = dt.datetime.fromisoformat(ctx.started).timestamp() - 2.0
    except (TypeError, ValueError):
        since = 0.0
    busy = (".ipynb",)            # the executed notebook is papermill's until the kernel ends (scrubbed after it)
    scrub_tree(ctx.phase_dir, known, exclude=busy)
    scrub_tree(ctx.run_dir, known, since=since, exclude=busy)


def load_phase_json(run_dir: Path, phase: str) -> dict[str, Any]:
    p = run_dir / phase / "phase.json"
    return json.loads(p.read_text()) if p.exists() else {}
