"""What ``servelab.deploy.server.start_server`` checks around every engine start — fail-closed.

- :func:`before_launch`: the per-node preflight (``servelab.deploy.preflight``), once per run and target, after
  every node is connected and **before any process is started**; a failed required check raises
  ``PreflightFailed`` with its one-line reason (recorded in ``manifest["preflight"]``).
- :func:`prepare`: a target that declares ``gate:`` starts its engine with ``NCCL_DEBUG=INFO`` and the ``INIT`` and
  ``NET`` subsystems (``servelab.deploy.nccl_gate.GATE_ENV``).
- :func:`after_healthy`: once the engine answers its health probe, every node's engine log is collected into
  ``<log_dir>/nccl-gate/`` and judged by ``gate_from_folder``; a refusal (a violation, or no rank printed NCCL
  INFO lines) raises ``GateRefused`` — the caller stops the engine — and the verdict is recorded in
  ``manifest["gate"]`` whatever it is.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servelab.core.run import now_iso, update_manifest
from servelab.deploy.nccl_gate import GateRefused, gate_from_folder, with_gate_env
from servelab.deploy.preflight import PreflightReport, ensure_preflight
from servelab.deploy.spec import Target

GATE_LOG_DIR = "nccl-gate"


def prepare(target: Target) -> Target:
    """The target the engine really starts: with the gate's INFO environment when it declares a gate."""
    return with_gate_env(target)


def before_launch(target: Target, hosts: dict[str, Any], run_dir: Path | None, phase: str,
                  log_dir: Path, close_on_refusal: bool = False) -> PreflightReport | None:
    """Preflight on every node before anything starts (reused from the manifest when this run already passed it
    for this target). Raises ``PreflightFailed`` — after closing the node connections when ``close_on_refusal``
    (the caller opened them only to start the engine)."""
    try:
        return ensure_preflight(target, hosts, run_dir=run_dir, phase=phase, local_work_dir=log_dir)
    except BaseException:
        if close_on_refusal:
            for h in hosts.values():
                try:
                    h.close()
                except Exception:       # closing a dead connection must not hide the refusal
                    pass
        raise


def log_size(host: Any, path: str | Path) -> int:
    """The size of a node's log file now (0 when it does not exist yet): where this start's lines will begin,
    since a node's log is appended to across starts and runs."""
    r = host.run(["stat", "-c", "%s", "--", str(path)], timeout=15)
    out = r.stdout.strip()
    return int(out) if r.ok and out.isdigit() else 0


def collect_rank_logs(hosts: dict[str, Any], log_paths: dict[str, str], dest: Path,
                      offsets: dict[str, int] | None = None) -> dict[str, str]:
    """Every node's engine log — from ``offsets[node]`` on: only what this start wrote — copied into
    ``dest/<node>.log`` (SFTP or a local read): node → local path, or the error text for a node whose log could not
    be fetched."""
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for node, remote in log_paths.items():
        local = dest / f"{node}.log"
        try:
            local.write_bytes(hosts[node].read_file(remote)[(offsets or {}).get(node, 0):])
            out[node] = str(local)
        except Exception as exc:    # the verdict must say a node's log is missing, never crash on it
            out[node] = f"not collected: {exc}"
    return out


def after_healthy(target: Target, hosts: dict[str, Any], log_paths: dict[str, str], log_dir: Path,
                  run_dir: Path | None, phase: str, offsets: dict[str, int] | None = None) -> Any:
    """The transport gate on the running engine's rank logs (each from its ``offsets`` entry on: an older start's
    lines in the same file prove nothing about this one); returns the verdict (``None`` without a gate) or raises
    ``GateRefused``. The verdict goes to ``manifest["gate"]`` either way."""
    if not target.gate:
        return None
    dest = Path(log_dir) / GATE_LOG_DIR
    logs = collect_rank_logs(hosts, log_paths, dest, offsets)
    v = gate_from_folder(target.gate, dest)
    if not v.configured:          # ``gate:`` present but requiring nothing: reported as such, nothing enforced
        return v
    missing = {n: p for n, p in logs.items() if p.startswith("not collected")}
    if missing:                   # a node whose log we could not read proves nothing: fail closed
        why = "engine log not collected from " + ", ".join(f"{n} ({p})" for n, p in missing.items())
        v.reasons.append(why)
        v.message = f"REFUSED — {why}. {v.message}" if v.passed else f"{v.message} [{len(v.reasons)}] {why}."
        v.passed = False
    if not v.passed:
        v.message = v.message.rstrip(". ") + ". The engine was stopped before any measurement."
    if run_dir is not None:
        update_manifest(Path(run_dir), gate={
            "target": target.name, "phase": phase, "when": now_iso(), "gate": target.gate, "verdict": v.verdict,
            "passed": v.passed, "message": v.message, "reasons": list(v.reasons), "logs": logs,
            "engine_stopped": not v.passed,
            "per_rank": json.loads(v.per_rank.to_json(orient="records")) if not v.per_rank.empty else []})
    if not v.passed:
        raise GateRefused(v)
    return v
