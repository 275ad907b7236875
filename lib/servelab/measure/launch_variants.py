"""One engine per launch variant: a target with changed launch settings, served, snapshotted and recorded.

Phases 7–9 restart the engine for every value of a setting (a scheduler knob, a prefix-cache point, a draft
model). This module holds what they share:

- :func:`with_launch` — the target with some ``launch`` keys changed (``None`` removes a key), validated by the
  engine adapter exactly as a target file would be; a key that is an environment variable (``env.NCCL_ALGO`` or a
  bare upper-case name, :func:`env_variable`) changes the target's ``env`` instead, and :func:`serving` then
  checks that the value reached every rank (:mod:`servelab.measure.env_reach`) before anything is measured;
- :func:`launch_argv` — the head node's command for a target, so a sweep can refuse a setting the engine
  ignores (the same argv for two values means the knob does not exist on this engine);
- :func:`serving` — start the engine inside a ``ProcessTracker`` and always stop it; once it is healthy, the
  greedy correctness probe (:func:`servelab.measure.correctness.greedy_probe`: the same fixed prompts on every
  variant, so an A/B can compare what each side answers) runs first, its outputs kept on the server
  (``srv.facts["greedy_outputs"]``) for the variant's record;
- :func:`metrics_snapshot` / :func:`snapshot_deltas` — the raw ``/metrics`` text at one instant and the counter
  deltas between two snapshots (the exact measurement window, never a running average);
- :func:`server_cpu_s` — CPU seconds the local engine process has used (``/proc/<pid>/stat``), for the CPU
  utilisation of a window; ``None`` on remote nodes;
- :func:`write_run_record` — a run-like folder (``manifest.json`` + ``cases.json``) per variant, which
  :func:`servelab.measure.abtest.ab_compare` reads like any run, so the one-variable A/B rules apply to sweeps too.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

from servelab.core.params import ParamError, did_you_mean

from servelab.deploy.spec import Target

from servelab.deploy.targets import target_from_dict
from servelab.measure.case_record import repeat_frame, write_case_index
from servelab.measure.engine_metrics import counter_deltas, parse_text, label_key
from servelab.measure.correctness import greedy_probe
from servelab.core.scope import RunScope
from servelab.core.run import now_iso, redact, write_json_atomic
from servelab.deploy.server import RunningServer, http_text, plan_launch, start_server, stop_server
from servelab.deploy.engines import engine_for
from servelab.deploy.hosts import ProcessTracker
from servelab.measure.correctness import write_greedy
from servelab.measure.env_reach import EnvReach, env_reach, write_reach

ENV_KNOB = re.compile(r"^(?:env\.)?([A-Z][A-Z0-9_]*)$")


def env_variable(knob: str) -> str | None:
    """The environment variable a sweep or A/B variable names (``env.NCCL_ALGO``, ``NCCL_ALGO``), else ``None``
    (a launch setting: lower case, as every engine adapter spells them)."""
    m = ENV_KNOB.match(str(knob))
    return m.group(1) if m else None


def env_changes(changes: dict[str, Any]) -> dict[str, str]:
    """The environment variables ``changes`` sets (removals left out), by name, values as strings."""
    return {name: str(v) for k, v in changes.items() if (name := env_variable(k)) and v is not None}


def with_launch(target: Target, changes: dict[str, Any], name_suffix: str = "") -> Target:
    """``target`` with ``launch`` keys changed (a value ``None`` removes the key); validated by the adapter."""
    raw = dataclasses.asdict(target)
    source = raw.pop("source")
    launch = copy.deepcopy(raw.get("launch") or {})
    env = dict(raw.get("env") or {})
    for k, v in changes.items():
        name = env_variable(k)
        into, key = (env, name) if name else (launch, k)
        if v is None:
            into.pop(key, None)
        else:
            into[key] = str(v) if name else v
    raw["launch"], raw["env"] = launch, env
    if name_suffix:
        raw["description"] = f"{target.description} [{name_suffix}]"
    return target_from_dict(raw, f"{source} with launch {changes}")


def launch_argv(target: Target) -> list[str]:
    """The head node's engine command for ``target`` (builds/caches local artifacts, starts nothing)."""
    plans, _ = plan_launch(target, port=target.port or 1)
    return next(p for p in plans if p.role == "head").argv


def check_knob_changes_command(target: Target, knob: str, values: list[Any]) -> None:
    """Raise ``ParamError`` unless every value of ``knob`` gives a different engine command.

    Guards a sweep against a setting the engine adapter accepts but never passes to the engine (e.g.
    ``chunked_prefill_size`` on llama.cpp, whose per-iteration token budget is ``batch_size``).
    """
    if knob not in _launch_keys(target):
        keys = _launch_keys(target)
        raise ParamError(f"'{knob}' is not a launch setting of {target.engine}{did_you_mean(knob, keys)}; "
                         f"settings: {', '.join(sorted(keys))}")
    if len(values) < 2:
        raise ParamError(f"a sweep of '{knob}' needs at least two values, got {values!r}")
    if len(set(map(repr, values))) != len(values):
        raise ParamError(f"sweep values of '{knob}' repeat: {values!r}")
    seen: dict[str, Any] = {}
    for v in values:
        argv = " ".join(launch_argv(with_launch(target, {knob: v})))
        if argv in seen:
            raise ParamError(f"{target.engine} ignores launch.{knob}: {knob}={seen[argv]!r} and {knob}={v!r} give the "
                             f"same command ({argv[:200]}) — this engine has no such knob")
        seen[argv] = v


def _launch_keys(target: Target) -> set[str]:
    return engine_for(target.engine).launch_keys()


@contextlib.contextmanager
def serving(target: Target, log_dir: Path, run_dir: Path | None = None, phase: str = "",
            health_timeout_s: float = 300.0, greedy: bool = True,
            check_env: dict[str, str] | None = None) -> Iterator[RunningServer]:
    """Start ``target``'s engine (commands recorded as executed when ``run_dir`` is given); always stop it. With
    ``greedy`` the correctness probe runs on the healthy engine before anything else (its outputs in
    ``srv.facts["greedy_outputs"]``, which :func:`write_run_record` writes into the variant's record). With
    ``check_env`` (variable → value), whether each reached every rank (``srv.facts["env_reach"]``, an
    :class:`~servelab.measure.env_reach.EnvReach` that :func:`write_run_record` writes beside the manifest)."""
    with ProcessTracker() as tracker:
        srv = start_server(target, Path(log_dir), tracker, run_dir=run_dir, phase=phase,
                           health_timeout_s=health_timeout_s)
        try:
            if check_env:
                srv.facts["env_reach"] = env_reach(srv, check_env)
            if greedy:
                srv.facts["greedy_outputs"] = greedy_probe(srv, run_dir=run_dir, phase=phase)
            yield srv
        finally:
            stop_server(srv, tracker, run_dir, phase)


# ---------------------------------------------------------------- /metrics snapshots

@dataclass
class Snapshot:
    """The raw ``/metrics`` body at one instant (``perf_counter_ns`` and wall ns), or the failure."""
    ts_ns: int
    wall_ns: int
    status: int
    text: str

    @property
    def ok(self) -> bool:
        return self.status == 200

    def frame(self) -> pd.DataFrame:
        """Rows like :class:`servelab.measure.engine_metrics.Scraper` keeps (``ts_ns, wall_ns, name, labels, value, type``)."""
        if not self.ok:
            return pd.DataFrame(columns=["ts_ns", "wall_ns", "name", "labels", "value", "type"])
        return pd.DataFrame([{"ts_ns": self.ts_ns, "wall_ns": self.wall_ns, "name": s["name"],
                              "labels": label_key(s["labels"]), "value": s["value"], "type": s["type"]}
                             for s in parse_text(self.text)],
                            columns=["ts_ns", "wall_ns", "name", "labels", "value", "type"])


def metrics_snapshot(srv: RunningServer, timeout_s: float = 10.0) -> Snapshot:
    """One ``GET /metrics`` of the head node (raw text kept: tests recompute deltas from it by hand)."""
    t, wall = time.perf_counter_ns(), time.time_ns()
    if not srv.metrics_path:            # an attached target with metrics_path: none
        return Snapshot(t, wall, 0, "")
    status, text = http_text(srv.base_url + srv.metrics_path, timeout=timeout_s, headers=srv.auth_headers)
    return Snapshot(t, wall, status, text)


def snapshot_deltas(before: Snapshot, after: Snapshot) -> pd.DataFrame:
    """Counter deltas (``name, labels, first, last, delta, reset``) from ``before`` to ``after``.

    Raises ``ValueError`` when either scrape failed: a missing counter is never a zero.
    """
    for which, s in (("before", before), ("after", after)):
        if not s.ok:
            raise ValueError(f"/metrics snapshot {which} the window failed (HTTP {s.status}): no counter deltas")
    return counter_deltas(pd.concat([before.frame(), after.frame()], ignore_index=True))


def delta_of(deltas: pd.DataFrame, series: str, labels: str | None = None) -> float | None:
    """The delta of one counter series (summed over label sets unless ``labels`` is given); None if absent."""
    if deltas.empty:
        return None
    sel = deltas[deltas["name"].isin([series, series + "_total"])]
    if labels is not None:
        sel = sel[sel["labels"] == labels]
    return float(sel["delta"].sum()) if not sel.empty else None


# ---------------------------------------------------------------- server CPU time

def server_cpu_s(srv: RunningServer) -> float | None:
    """User + system CPU seconds used so far by the head engine process (local nodes only), else None."""
    if not srv.target.head.kind == "local":
        return None
    try:
        pid = srv.head_handle.pid
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, ValueError, IndexError, KeyError, AttributeError):
        return None


def log_reproduce(ctx: RunScope, target: str = "") -> None:
    """Record how to re-run this phase (label ``reproduce``) in the run's command log; ``target``: as the run was
    given it (a name or a file), default the target's name."""
    ctx.log_command("reproduce", ["servelab", "run", ctx.phase, "--target", target or ctx.target.name,
                                  "--run-id", ctx.run_id], title=f"re-run {ctx.phase}")


# ---------------------------------------------------------------- run-like records for abtest

def write_run_record(record_dir: Path, run_id: str, target: Target, srv: RunningServer | None,
                     cases: list[tuple[str, Path | None, str]], parent_manifest: dict[str, Any] | None = None,
                     extra: dict[str, Any] | None = None) -> Path:
    """A folder that :func:`servelab.measure.abtest.load_run` reads as a run: ``manifest.json`` (tool, engine, model,
    launch plans/env/settings as Phase 0 records them), ``cases.json`` (each ``(case id, case folder, reason)`` of
    ``cases``: the case's ``summary.json`` entered under the case id it is compared as, or — folder None — the
    reason it did not run), ``summary.csv`` (one row per case × repeat, read from those summaries, for people) and,
    when ``srv`` ran the correctness probe, ``greedy_outputs.json`` (:mod:`servelab.measure.correctness`)."""
    record_dir = Path(record_dir)
    record_dir.mkdir(parents=True, exist_ok=True)
    parent = parent_manifest or {}
    known = target.secret_values()
    plans = []
    if srv is not None:
        known = tuple(sorted({*known, *(v for p in srv.plans for v in p.secret_values())}, key=lambda v: (-len(v), v)))
        for p in srv.plans:
            plans.append({"node": p.node, "command": p.shell(known), "port": p.port,
                          "log": srv.log_paths.get(p.node, "")})
    manifest = {"schema_version": parent.get("schema_version", 1), "run_id": run_id,
                "tool": parent.get("tool", {}), "python": parent.get("python"), "platform": parent.get("platform"),
                "created": now_iso(), "target": target.name, "parent_run": parent.get("run_id"),
                "engine": {"name": target.engine}, "model": {"model": target.model,
                                                             "path": srv.model_path if srv else ""},
                "launch": {"plans": plans, "env": dict(target.env), "settings": copy.deepcopy(target.launch)},
                **(extra or {})}
    write_json_atomic(record_dir / "manifest.json", redact(manifest, known))      # env, argv, URLs: no secrets
    write_case_index(record_dir, cases)
    if srv is not None and srv.facts.get("greedy_outputs") is not None:
        write_greedy(record_dir, srv.facts["greedy_outputs"])
    if srv is not None and isinstance(srv.facts.get("env_reach"), EnvReach):
        write_reach(record_dir, srv.facts["env_reach"])
    frame, _ = repeat_frame(record_dir)
    frame.to_csv(record_dir / "summary.csv", index=False)
    return record_dir
