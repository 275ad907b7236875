"""Engine server lifecycle on a target: prepare, launch on every node, wait healthy, probe, stop.

``start_server`` records the executed launch command per node (with its log path) and returns a
``RunningServer``; ``stop_server`` stops every process and checks the port is free again. Both are
used through a ``ProcessTracker`` so that a failure or Ctrl-C leaves nothing behind.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab import hosts as hostlib
from servelab.engines import engine_for
from servelab.engines.base import LaunchPlan
from servelab.params import Target
from servelab.run import CommandRecord, now_iso, record_command


class ServerError(RuntimeError):
    """The engine did not start, died, or stopped answering."""


@dataclass
class RunningServer:
    target: Target
    base_url: str
    port: int
    plans: list[LaunchPlan]
    handles: dict[str, hostlib.Handle]
    hosts: dict[str, Any]
    log_paths: dict[str, str]
    model_path: str
    started: str
    ready_s: float
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def engine(self):
        return engine_for(self.target.engine)

    @property
    def head_handle(self) -> hostlib.Handle:
        return self.handles[self.target.head.name]


def http_json(url: str, body: Any = None, method: str | None = None, timeout: float = 10.0,
              headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """A small JSON HTTP call (stdlib); returns (status, parsed body or text). Status 0 = no connection."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if body is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode(errors="replace")
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(errors="replace"), exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, None
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def http_text(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


def resolve_local_artifacts(target: Target) -> tuple[str, str]:
    """For llama.cpp targets: (binary, model path), building/assembling them if needed."""
    from servelab.llamacpp_build import ensure_llama_server
    from servelab.models import resolve_model
    binary = target.launch.get("binary") or str(ensure_llama_server())
    return binary, str(resolve_model(target.model))


def plan_launch(target: Target, port: int | None = None) -> tuple[list[LaunchPlan], str]:
    """The per-node launch plans (no side effect besides building/caching local artifacts)."""
    engine = engine_for(target.engine)
    port = port or target.port or hostlib.free_port(target.api_host)
    if target.engine == "llamacpp":
        binary, model = resolve_local_artifacts(target)
        draft = None
        spec = target.launch.get("spec") or {}
        if spec.get("draft_model"):
            from servelab.models import resolve_model
            draft = str(resolve_model(spec["draft_model"]))
        return engine.launch_plans(target, port, binary=binary, model_path=model, draft_path=draft), model
    return engine.launch_plans(target, port), target.model


def wait_healthy(base_url: str, path: str, timeout_s: float, alive: Any = None, log_path: str = "") -> float:
    """Poll ``base_url+path`` until HTTP 200; fail fast if ``alive()`` turns false. Returns seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        status, _ = http_json(base_url + path, timeout=2.0)
        if status == 200:
            return time.monotonic() - t0
        if alive is not None and not alive():
            tail = Path(log_path).read_text(errors="replace")[-2000:] if log_path and Path(log_path).exists() else ""
            raise ServerError(f"the engine exited before becoming healthy (log {log_path}):\n{tail}")
        time.sleep(0.1)
    raise ServerError(f"{base_url}{path} not healthy after {timeout_s:.0f} s (log {log_path})")


def start_server(target: Target, log_dir: Path, tracker: hostlib.ProcessTracker, run_dir: Path | None = None,
                 phase: str = "", health_timeout_s: float = 900.0, port: int | None = None,
                 hosts: dict[str, Any] | None = None) -> RunningServer:
    """Launch the engine on every node of ``target`` and wait until the head answers its health probe."""
    plans, model_path = plan_launch(target, port)
    engine = engine_for(target.engine)
    hosts = hosts or {n.name: hostlib.connect(n) for n in target.nodes}
    handles: dict[str, hostlib.Handle] = {}
    logs: dict[str, str] = {}
    started = now_iso()
    for plan in plans:
        node = next(n for n in target.nodes if n.name == plan.node)
        log = (Path(node.workdir) / "logs" if node.kind == "ssh" and node.workdir else log_dir) / \
            f"{target.engine}_{plan.node}.log"
        h = tracker.start(hosts[plan.node], plan.argv, log, env=plan.env)
        handles[plan.node], logs[plan.node] = h, str(log)
        if run_dir is not None:
            record_command(run_dir, CommandRecord(label="executed", argv=plan.argv, phase=phase,
                                                  title=f"start {target.engine} on {plan.node}", host=plan.node,
                                                  env=plan.env, start=h.started, log=str(log)))
    base_url = f"http://{target.api_host}:{plans[0].port}"
    head = target.head.name
    try:
        ready = wait_healthy(base_url, engine.health_path, health_timeout_s,
                             alive=lambda: all(hosts[n].is_running(handles[n]) for n in handles),
                             log_path=logs[head])
    except BaseException:
        tracker.stop_all()
        raise
    return RunningServer(target, base_url, plans[0].port, plans, handles, hosts, logs, model_path, started, ready)


def is_healthy(srv: RunningServer, timeout: float = 5.0) -> bool:
    status, _ = http_json(srv.base_url + srv.engine.health_path, timeout=timeout)
    return status == 200 and all(srv.hosts[n].is_running(h) for n, h in srv.handles.items())


def stop_server(srv: RunningServer, tracker: hostlib.ProcessTracker, run_dir: Path | None = None,
                phase: str = "") -> dict[str, Any]:
    """Stop every engine process; report exit codes and whether the port was released."""
    for h in srv.handles.values():
        tracker.stop(h)
    released = hostlib.wait_port_free(srv.target.api_host, srv.port, 10.0) if srv.target.is_local else None
    info = {"stopped": now_iso(), "port_released": released,
            "exit_codes": {n: h.exit_code for n, h in srv.handles.items()}}
    if run_dir is not None:
        for n, h in srv.handles.items():
            record_command(run_dir, CommandRecord(label="executed", argv=["kill", "-TERM", f"-{h.pid}"], phase=phase,
                                                  title=f"stop {srv.target.engine} on {n}", host=n,
                                                  start=h.stopped, exit_code=h.exit_code,
                                                  note="process group TERM, then KILL after 10 s"))
    return info


def engine_info(srv: RunningServer) -> dict[str, Any]:
    """What the engine says about itself (version endpoints), as returned."""
    out: dict[str, Any] = {}
    for path in srv.engine.version_paths:
        status, body = http_json(srv.base_url + path, timeout=10.0)
        if status == 200:
            out[path] = body
    return out
