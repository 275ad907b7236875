"""Engine server lifecycle on a target: prepare, launch on every node, wait healthy, probe, stop.

``start_server`` records the executed launch command per node (with its log path) and returns a
``RunningServer``; ``stop_server`` stops every process and checks the port is free again. Both are
used through a ``ProcessTracker`` so that a failure or Ctrl-C leaves nothing behind.
"""
from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import posixpath
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.deploy import attach as attachlib
from servelab.deploy import container as containerlib
from servelab.deploy import hosts as hostlib
from servelab.deploy import slurm as slurmlib
from servelab.deploy import start_checks
from servelab.deploy.engines import engine_for
from servelab.deploy.engines.base import SECRET_DIR, LaunchPlan
from servelab.deploy.spec import Target
from servelab.core.run import CommandRecord, now_iso, record_command, redact_env, update_manifest
from servelab.core.redact import redact_bytes


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
    containers: dict[str, containerlib.RunningContainer] = field(default_factory=dict)   # mode=docker, per node
    api_key: str = field(default="", repr=False)
    notes: list[str] = field(default_factory=list)      # exposure warnings and the like, for the page
    attached: bool = False                                # a server servelab did not start (deploy.attach)
    slurm_job: Any = None                                 # launch.via: slurm: its deploy.slurm.SlurmJob

    @property
    def auth_headers(self) -> dict[str, str]:
        """``Authorization: Bearer <key>`` when the target has an API key (every call to the server sends it)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def engine(self):
        return engine_for(self.target.engine)

    @property
    def metrics_path(self) -> str:
        """The Prometheus path of this server ("" when an attached target says it has none)."""
        return attachlib.metrics_path(self.target, self.engine) if self.attached else self.engine.metrics_path

    @property
    def head_handle(self) -> hostlib.Handle:
        return self.handles[self.target.head.name]

    def node_status(self) -> dict[str, bool]:
        """Is each node's engine process alive?"""
        problems = self.node_problems()
        return {n: n not in problems for n in self.handles}

    def node_problems(self) -> dict[str, str]:
        """The nodes whose engine is not running, each with why: its process is gone, or the node cannot be
        reached (its SSH connection failed: the node, its sshd or the link is lost)."""
        out = {}
        for n, h in self.handles.items():
            try:
                if not self.hosts[n].is_running(h):
                    out[n] = "its engine process is gone"
            except Exception as exc:   # the node itself is gone
                first = (str(exc).strip().splitlines() or [""])[0]
                out[n] = f"unreachable ({type(exc).__name__}{': ' + first if first else ''})"
        return out


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


def http_text(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


def plan_launch(target: Target, port: int | None = None) -> tuple[list[LaunchPlan], str]:
    """The per-node launch plans and the model path (no side effect besides building/caching local artifacts).
    With ``api_key_env`` the head's plan carries the key the engine's own way (adapter ``apply_api_key``)."""
    try:
        key = target.api_key()
    except ValueError as exc:
        raise ServerError(str(exc)) from None
    port = port or target.port or hostlib.free_port(target.api_host)
    engine = engine_for(target.engine)
    plans, model_path = engine.resolve_launch(target, port)
    if key:
        engine.apply_api_key(plans, key)
    return plans, model_path


def wait_healthy(base_url: str, path: str, timeout_s: float, alive: Any = None, log_path: str = "",
                 headers: dict[str, str] | None = None) -> float:
    """Poll ``base_url+path`` until HTTP 200; fail fast if ``alive()`` turns false. Returns seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        status, _ = http_json(base_url + path, timeout=2.0, headers=headers)
        if status == 200:
            return time.monotonic() - t0
        if alive is not None and not alive():
            tail = Path(log_path).read_text(errors="replace")[-2000:] if log_path and Path(log_path).exists() else ""
            raise ServerError(f"the engine exited before becoming healthy (log {log_path}):\n{tail}")
        time.sleep(0.1)
    raise ServerError(f"{base_url}{path} not healthy after {timeout_s:.0f} s (log {log_path})")


def connect_nodes(target: Target) -> dict[str, Any]:
    """Connect to every node first (in parallel): an unreachable node or a wrong host key is an error
    before anything is started anywhere."""
    results = hostlib.fan_out(target.nodes, lambda n: hostlib.connect(n)) if len(target.nodes) > 1 else \
        {target.nodes[0].name: hostlib.connect(target.nodes[0])}
    errors = {n: r for n, r in results.items() if isinstance(r, BaseException)}
    if errors:
        for r in results.values():
            if not isinstance(r, BaseException):
                r.close()
        raise ServerError("cannot reach every node, nothing was started: " +
                          "; ".join(f"{n}: {e}" for n, e in sorted(errors.items())))
    return results


def wait_tcp(host: str, port: int, timeout_s: float, alive: Any = None, log_path: str = "") -> float:
    """Wait until ``host:port`` accepts a TCP connection (a worker's RPC port)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((host, port)) == 0:
                return time.monotonic() - t0
        if alive is not None and not alive():
            raise ServerError(f"worker exited before opening {host}:{port} (log {log_path})")
        time.sleep(0.1)
    raise ServerError(f"{host}:{port} not open after {timeout_s:.0f} s (log {log_path})")


def start_server(target: Target, log_dir: Path, tracker: hostlib.ProcessTracker, run_dir: Path | None = None,
                 phase: str = "", health_timeout_s: float = 900.0, port: int | None = None,
                 hosts: dict[str, Any] | None = None) -> RunningServer:
    """Launch the engine on every node of ``target`` and wait until it is ready.

    Order: connect to every node (fail before any start); preflight on every node, once per run and target
    (``target.start_checks``: a failed required check starts nothing); start the workers; wait for those with a
    readiness port; start the head; wait for its health probe while checking that every node's process
    is still alive; a target with a ``gate:`` then has its rank logs judged by the transport gate. Any failure
    stops everything already started (their logs are kept).
    """
    if target.attached:
        return attach_server(target, run_dir, phase, tracker, health_timeout_s=min(health_timeout_s, 60.0),
                             hosts=hosts)
    if slurmlib.uses_slurm(target.launch):
        return slurm_server(target, log_dir, tracker, run_dir, phase, health_timeout_s, port)
    target = start_checks.prepare(target)           # a gated target's engine prints NCCL INFO
    plans, model_path = plan_launch(target, port)
    engine = engine_for(target.engine)
    owned = hosts is None
    hosts = hosts or connect_nodes(target)
    prepare_nodes(target, hosts, run_dir, phase)
    start_checks.before_launch(target, hosts, run_dir, phase, log_dir, close_on_refusal=owned)
    handles: dict[str, hostlib.Handle] = {}
    containers: dict[str, containerlib.RunningContainer] = {}
    logs: dict[str, str] = {}
    offsets: dict[str, int] = {}                   # where this start's lines begin in each (appended) log
    started = now_iso()
    head_plan = next(p for p in plans if p.role == "head")
    api_key = target.api_key()
    remote_logs = _private_log_dirs(target, hosts, tracker, log_dir, logs,
                                    secret=api_key if api_key and engine.logs_api_key else "")

    def alive() -> bool:
        return all(hosts[n].is_running(handles[n]) for n in handles)

    def launch(plan: LaunchPlan) -> None:
        log = Path(remote_logs.get(plan.node) or log_dir) / f"{target.engine}_{plan.node}.log"
        offsets[plan.node] = start_checks.log_size(hosts[plan.node], log) if target.gate else 0
        argv, note = plan.argv, ""
        if plan.container is not None:      # docker: env file + per-run name; the tracker tears it down
            h, c = containerlib.start_container(tracker, hosts[plan.node], plan.container, log,
                                                run_dir.name if run_dir is not None else "")
            containers[plan.node], argv = c, c.argv
            plan.argv = c.argv               # srv.plans show what ran: this start's name and env file
            note = f"environment in a mode-0600 env file, removed at stop: {', '.join(plan.container.env) or 'none'}"
        else:
            private = _private_ipc_dir(engine, plan, hosts[plan.node], tracker)
            if private:
                note = (f"{' and '.join(private)}: a private folder for this start's socket and temporary files, "
                        "removed at stop")
            if plan.secret_files:
                _write_secret_files(plan, hosts[plan.node], tracker)
                note = "; ".join(filter(None, [note, f"{', '.join(plan.secret_files)}: mode 0600 in a private folder "
                                                     "of this start, removed at stop (the API key is never in argv)"]))
            h = tracker.start(hosts[plan.node], plan.argv, log, env=plan.env, what=f"{target.engine} {plan.role}")
            h.term_leader_first = engine.term_leader_first
        handles[plan.node], logs[plan.node] = h, str(log)
        if run_dir is not None:
            record_command(run_dir, CommandRecord(label="executed", argv=argv, phase=phase,
                                                  title=f"start {target.engine} {plan.role} on {plan.node}",
                                                  host=plan.node, env=plan.env, start=h.started, log=str(log),
                                                  note=note))

    base_url = f"http://{target.api_host}:{head_plan.port}"
    try:
        for plan in plans:
            if plan.role != "head":
                launch(plan)
        for plan in plans:
            if plan.ready == "tcp":
                wait_tcp(plan.ready_host or "127.0.0.1", plan.ready_port, 120.0, alive, logs[plan.node])
        launch(head_plan)
        ready = wait_healthy(base_url, engine.health_path, health_timeout_s, alive=alive,
                             log_path=logs[head_plan.node],
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        start_checks.after_healthy(target, hosts, logs, log_dir, run_dir, phase, offsets)
    except BaseException:
        tracker.stop_all()
        raise
    return RunningServer(target, base_url, head_plan.port, plans, handles, hosts, logs, model_path, started, ready,
                         containers=containers, api_key=api_key, notes=engine.exposure_warnings(target, bool(api_key)) +
                         engine.exposure_notes(target, bool(api_key)))


def attach_server(target: Target, run_dir: Path | None, phase: str, tracker: hostlib.ProcessTracker,
                  health_timeout_s: float = 60.0, hosts: dict[str, Any] | None = None) -> RunningServer:
    """An attached target (``deploy.attach``): nothing is started; its declared nodes are connected (closed when the
    tracker exits), the endpoint must answer its health probe, and the run manifest says it was attached."""
    try:
        key = target.api_key()
    except ValueError as exc:
        raise ServerError(str(exc)) from None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = attachlib.base_url(target)
    ready = attachlib.wait_endpoint(url, engine_for(target.engine).health_path, health_timeout_s, headers, http_json)
    if hosts is None and target.nodes_given:
        hosts = connect_nodes(target)
        for name, host in hosts.items():
            tracker.on_exit(f"close {name}", host.close)
    if run_dir is not None:
        update_manifest(run_dir, attached={"endpoint": target.endpoint, "phase": phase, "at": now_iso(),
                                           "nodes": [n.name for n in target.nodes] if target.nodes_given else []})
    return RunningServer(target, url, attachlib.endpoint_port(target), [], {}, hosts or {}, {},
                         target.served_model_name or target.model, now_iso(), ready, api_key=key,
                         notes=[f"{attachlib.ATTACH_NOTE} ({target.endpoint})"], attached=True)


def slurm_server(target: Target, log_dir: Path, tracker: hostlib.ProcessTracker, run_dir: Path | None, phase: str,
                 health_timeout_s: float, port: int | None) -> RunningServer:
    """``launch.via: slurm`` (``deploy.slurm``): earlier runs' orphaned jobs cancelled, one allocation (salloc) of the target's
    node count, its nodes as the target's, the per-node commands planned there, one job step of one task per node
    (``srun``, tracked here), healthy; the job is cancelled at stop and on every exit path (the tracker's step)."""
    run_id = run_dir.name if run_dir is not None else ""
    swept = slurmlib.sweep()
    local = hostlib.LocalHost("slurm-step")
    name = f"servelab-{target.name}-{run_id or 'run'}-{os.urandom(3).hex()}"
    try:
        holder: list[hostlib.Handle] = []
        job = slurmlib.allocate(target.launch, len(target.nodes), name, Path(log_dir), run_id,
                                timeout_s=health_timeout_s,
                                start=lambda argv, log: holder.append(tracker.start(local, argv, log,
                                                                                    what="slurm allocation")),
                                alive=lambda: bool(holder) and local.is_running(holder[0]))
    except BaseException:
        tracker.stop_all()
        raise
    tracker.on_exit(f"slurm {job.job_id}", job.cancel)
    try:
        placed = start_checks.prepare(slurmlib.placed_target(target, job.nodes))
        if run_dir is not None:
            update_manifest(run_dir, slurm={"job_id": job.job_id, "nodes": job.nodes, "phase": phase,
                                            "submitted": job.submitted}, **({"swept": swept} if swept else {}))
            for c in job.commands or []:
                record_command(run_dir, CommandRecord(label="executed", argv=c["argv"], phase=phase, host="local",
                                                      title=f"Slurm allocation {job.job_id}", start=c["at"]))
        plans, model_path = plan_launch(placed, port)
        hosts = connect_nodes(placed)
        for name, host in hosts.items():
            tracker.on_exit(f"close {name}", host.close)
        start_checks.before_launch(placed, hosts, run_dir, phase, Path(log_dir))     # on the nodes Slurm gave
        folder = local.private_dir()
        tracker.on_exit(f"{SECRETS_CLEANUP} slurm {folder}", lambda: local.remove_private_dir(folder))
        for p in plans:
            if p.secret_files:
                _write_secret_files(p, local, tracker)
        script = slurmlib.task_script(plans, [n.name for n in placed.nodes], folder, local.write_file)
        argv = job.step_argv(script, list(target.launch.get("srun_args") or []))
        log = Path(log_dir) / f"{target.engine}_slurm_{job.job_id}.log"
        h = tracker.start(local, argv, log, what=f"{target.engine} slurm step")
        if run_dir is not None:
            record_command(run_dir, CommandRecord(label="executed", argv=argv, phase=phase, host="local", start=h.started,
                                                  title=f"start {target.engine} on {', '.join(job.nodes)} (job "
                                                        f"{job.job_id})", log=str(log),
                                                  note="one task per node; each runs its node's planned command "
                                                       "from a mode-0700 task script in a private folder"))
        head = next(p for p in plans if p.role == "head")
        base_url = f"http://{placed.api_host}:{head.port}"
        key = placed.api_key()
        ready = wait_healthy(base_url, engine_for(target.engine).health_path, health_timeout_s,
                             alive=lambda: local.is_running(h), log_path=str(log),
                             headers={"Authorization": f"Bearer {key}"} if key else None)
    except BaseException:
        tracker.stop_all()
        raise
    return RunningServer(placed, base_url, head.port, plans, {placed.head.name: h}, {**hosts, placed.head.name: local},
                         {placed.head.name: str(log)}, model_path, job.submitted, ready, api_key=key, slurm_job=job)


def log_clock(srv: RunningServer) -> dict[str, Any]:
    """How the head engine log's lines map to the wall clock, saved beside a case's log excerpt: the log file, the
    time servelab started the head process (ISO, ms, this machine's clock), the engine's line-time kind
    (``elapsed`` since the process started | ``wall`` on the server's local clock | ``""`` none), and this
    machine's UTC offset (a ``wall`` time is read in it: right for local targets and nodes on the same zone)."""
    head = srv.target.head.name
    h = srv.handles.get(head)
    offset = dt.datetime.now().astimezone().utcoffset()
    return {"node": head, "log": srv.log_paths.get(head, ""), "process_started": getattr(h, "started", srv.started),
            "kind": srv.engine.log_time[0], "note": srv.engine.log_time_note,
            "utc_offset_s": offset.total_seconds() if offset is not None else 0.0,
            "remote": not srv.target.is_local}


def prepare_nodes(target: Target, hosts: dict[str, Any], run_dir: Path | None = None, phase: str = "") -> None:
    """Before anything starts: each host's pid records carry the run id, what earlier runs left running on each
    node is stopped (``manifest["swept"]``), and how each node's host key was checked is recorded
    (``manifest["host_keys"]``)."""
    run_id = run_dir.name if run_dir is not None else ""
    swept, keys = [], []
    for host in hosts.values():
        if hasattr(host, "run_id"):
            host.run_id = run_id
        if hasattr(host, "sweep") and getattr(host, "swept", None) is None:     # once per connection
            host.swept = host.sweep()
            swept += [{**row, "by_run": run_id, "phase": phase} for row in host.swept]
        if getattr(host, "host_key", None):
            keys.append({**host.host_key, "phase": phase})
    if run_dir is not None and (swept or keys):
        update_manifest(run_dir, **({"swept": swept} if swept else {}), **({"host_keys": keys} if keys else {}))


IPC_CLEANUP = "engine-ipc"       # tracker clean-up steps that remove a start's IPC folder: "engine-ipc NODE PATH"


def _private_ipc_dir(engine: Any, plan: LaunchPlan, host: Any, tracker: hostlib.ProcessTracker) -> list[str]:
    """Where the engine names a variable for its IPC socket folder (vLLM: ``VLLM_RPC_BASE_PATH``) and the
    target leaves it unset: a private folder on the node for this start (``mktemp -d`` in its ``$TMPDIR``, a short
    path: a unix socket's name is limited to 107 bytes), removed when the server stops. Without it every start
    leaves its socket files in the node's temp folder. An engine with ``private_tmp`` also gets the folder as
    its ``TMPDIR`` (unless the target sets one), and ``TORCHINDUCTOR_CACHE_DIR`` pinned to the node's
    ``<temp>/torchinductor_<user>``, torch's default, so a start does not recompile. Docker plans need none:
    the container's /tmp goes with it. Returns the variables pointed at the folder (none when none was made)."""
    var = engine.ipc_dir_env
    if not var or var in plan.env or not hasattr(host, "private_dir"):
        return []
    path = host.private_dir()
    env, names = {**plan.env, var: path}, [var]
    if engine.private_tmp and "TMPDIR" not in plan.env:
        env["TMPDIR"] = path
        names.append("TMPDIR (torch inductor's cache pinned)")
        user = getattr(host, "user", "") or getpass.getuser()
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", f"{posixpath.dirname(path)}/torchinductor_{user}")
    plan.env = env
    tracker.on_exit(f"{IPC_CLEANUP} {plan.node} {path}", lambda: host.remove_private_dir(path))
    return names


SECRETS_CLEANUP = "secrets"      # tracker clean-up steps that remove a start's secret files: "secrets NODE PATH"


def _write_secret_files(plan: LaunchPlan, host: Any, tracker: hostlib.ProcessTracker) -> None:
    """The plan's secret files, mode 0600 in a new private folder (``mktemp -d``, mode 0700) on its node; the
    folder's path replaces :data:`SECRET_DIR` in argv; the folder is removed at stop (and on every exit path)."""
    path = host.private_dir()
    tracker.on_exit(f"{SECRETS_CLEANUP} {plan.node} {path}", lambda: host.remove_private_dir(path))
    for name, content in plan.secret_files.items():
        f = f"{path}/{name}"
        host.write_file(f, b"")
        host.run(["chmod", "600", f], timeout=30)
        host.write_file(f, content.encode())
    plan.argv = [a.replace(SECRET_DIR, path) if isinstance(a, str) else a for a in plan.argv]


def _private_log_dirs(target: Target, hosts: dict[str, Any], tracker: hostlib.ProcessTracker, log_dir: Path,
                      logs: dict[str, str], secret: str = "") -> dict[str, str]:
    """A private folder per SSH node for this start (``mktemp -d`` under the node's workdir or ``$TMPDIR``); at
    the tracker's exit, after the engine stopped, each log is copied back into ``log_dir`` (``logs`` then names
    the local copy) and the folder is removed. With ``secret`` (an engine that prints its API key into its log)
    local nodes get one too, and every copy is redacted on its way back: the key never lands in ``log_dir``."""
    out: dict[str, str] = {}
    for node in target.nodes:
        if node.kind != "ssh" and not secret:
            continue
        host = hosts[node.name]
        out[node.name] = host.private_dir(node.workdir if node.kind == "ssh" else "")

        def back(node: str = node.name, host: Any = host) -> None:
            remote = logs.get(node)
            try:
                if remote and remote.startswith(out[node]):
                    local = Path(log_dir) / Path(remote).name
                    data = host.read_file(remote)
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_bytes(redact_bytes(data, known=[secret]) if secret else data)
                    logs[node] = str(local)
            finally:
                host.remove_private_dir(out[node])
        tracker.on_exit(f"workdir {node.name} {out[node.name]}", back)
    return out


def is_healthy(srv: RunningServer, timeout: float = 5.0) -> bool:
    """Head answers its health probe AND every node's engine process is alive."""
    return not health_problem(srv, timeout)


def health_problem(srv: RunningServer, timeout: float = 5.0) -> str:
    """What keeps the server from being healthy, in one line naming the part ("" when healthy): the head's health
    probe's answer, and each node whose engine process is gone or that cannot be reached."""
    status, _ = http_json(srv.base_url + srv.engine.health_path, timeout=timeout, headers=srv.auth_headers)
    parts = [] if status == 200 else [f"the health probe {srv.engine.health_path} answered "
                                      f"{status if status else 'nothing (no connection)'}"]
    parts += [f"node {n}: {why}" for n, why in srv.node_problems().items()]
    return "; ".join(parts)


def stop_server(srv: RunningServer, tracker: hostlib.ProcessTracker, run_dir: Path | None = None,
                phase: str = "") -> dict[str, Any]:
    """Stop every engine process (head first, then workers, in parallel); report exit codes, whether the
    ports were released on every node, and any process still alive. An attached server is left as it is."""
    if srv.attached:
        return {"stopped": None, "attached": srv.target.endpoint, "port_released": None, "exit_codes": {},
                "cleanup": [], "note": attachlib.ATTACH_NOTE}
    head = srv.target.head.name
    if head in srv.handles:
        tracker.stop(srv.handles[head])
    workers = [n for n in srv.handles if n != head]
    if workers:
        hostlib.fan_out([srv.hosts[n] for n in workers], lambda h: tracker.stop(srv.handles[h.name]))
    var = srv.engine.ipc_dir_env
    ipc = {f"{IPC_CLEANUP} {p.node} {p.env[var]}" for p in srv.plans if var and var in p.env}
    for name in [c[0] for c in tracker.cleanups
                 if c[0].startswith(("workdir ", f"{SECRETS_CLEANUP} ", "slurm ")) or c[0] in ipc]:
        tracker.run_cleanup(name)        # logs copied back, the nodes' private folders removed
    cleanup = verify_cleanup(srv)
    released = bool(cleanup["port_free"].all()) if len(cleanup) else None
    info = {"stopped": now_iso(), "port_released": released,
            "exit_codes": {n: h.exit_code for n, h in srv.handles.items()},
            "cleanup": cleanup.to_dict(orient="records")}
    if run_dir is not None:
        for n, h in srv.handles.items():
            record_command(run_dir, CommandRecord(label="executed", argv=["kill", "-TERM", f"-{h.pid}"], phase=phase,
                                                  title=f"stop {srv.target.engine} on {n}", host=n,
                                                  start=h.stopped, exit_code=h.exit_code,
                                                  note="process group TERM, then KILL after 10 s"))
        for n, c in srv.containers.items():
            done, c.stop_results = c.stop_results, []        # each teardown command recorded once
            for r in done:
                if isinstance(r, hostlib.Result):
                    record_command(run_dir, CommandRecord(label="executed", argv=r.argv, phase=phase, host=n,
                                                          title=f"stop container {c.name} on {n}", start=r.start,
                                                          end=r.end, exit_code=r.exit_code))
    if srv.containers:
        info["containers"] = {n: {"name": c.name, "removed": c.removed} for n, c in srv.containers.items()}
    return info


def version_argv(srv: RunningServer) -> list[str] | None:
    """The command that prints the engine's version on the head node (inside its container in docker mode)."""
    plan = next(p for p in srv.plans if p.role == "head")
    argv = srv.engine.version_command(plan.container.engine_argv if plan.container else plan.argv)
    c = srv.containers.get(plan.node)
    return c.exec_argv(argv) if argv and c is not None else argv


def engine_info(srv: RunningServer) -> dict[str, Any]:
    """What the engine says about itself (version endpoints), as returned."""
    out: dict[str, Any] = {}
    for path in srv.engine.version_paths:
        status, body = http_json(srv.base_url + path, timeout=10.0, headers=srv.auth_headers)
        if status == 200:
            out[path] = body
    return out


def verify_cleanup(srv: RunningServer) -> "Any":
    """Per node after stop: our process group gone, our port no longer listening, GPU memory released
    (where nvidia-smi exists). A frame with one row per node."""
    rows = []
    for plan in srv.plans:
        host, h = srv.hosts[plan.node], srv.handles.get(plan.node)
        try:
            gone = h is None or not host.is_running(h)
            deadline = time.monotonic() + 10
            port = plan.ready_port or plan.port
            listening = True
            while time.monotonic() < deadline:
                r = host.run(["ss", "-ltnH", f"sport = :{port}"], timeout=15)
                listening = r.ok and bool(r.stdout.strip())
                if not listening:
                    break
                time.sleep(0.2)
            smi = host.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                           timeout=30)
            gpu = "no GPU" if smi.exit_code != 0 else (smi.stdout.strip() or "released")
        except Exception as exc:
            gone, listening, gpu = False, None, f"node unreachable: {exc}"
        rows.append({"node": plan.node, "role": plan.role, "process_gone": gone, "port": plan.ready_port or plan.port,
                     "port_free": listening is False, "gpu_memory": gpu})
    return pd.DataFrame(rows)


def collect_logs(srv: RunningServer, dest: Path) -> dict[str, str]:
    """Copy every node's engine log into ``dest/<node>.log`` (SSH get; local copy). Returns node -> path
    or the error text, so a dead node never hides the others' logs."""
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for node, remote in srv.log_paths.items():
        local = dest / f"{node}.log"
        try:
            if str(Path(remote).resolve()) == str(local.resolve()):
                pass
            elif Path(remote).is_file() and srv.handles[node].stopped:   # already copied back from the node
                local.write_bytes(Path(remote).read_bytes())
            else:
                srv.hosts[node].get(remote, local)
            out[node] = str(local)
        except Exception as exc:
            out[node] = f"not collected: {exc}"
    return out


ENV_PREFIXES = ("NCCL_", "GLOO_", "UCX_", "NVSHMEM_", "CUDA_VISIBLE_DEVICES", "SGLANG_", "VLLM_")

# Reads the environment of every process in a process group from /proc (Linux): what the engine's rank
# processes actually saw. The group id is a positional argument ($1), never interpolated into the script.
_GROUP_ENV_SCRIPT = ('for p in $(ps -eo pid=,pgid= | awk -v g="$1" \'$2==g {print $1}\'); do '
                     'printf "PID %s %s\\n" "$p" "$(tr -d "\\n" < /proc/$p/comm 2>/dev/null)"; '
                     'tr "\\0" "\\n" < /proc/$p/environ 2>/dev/null; done')


def rank_environments(srv: RunningServer, prefixes: tuple[str, ...] = ENV_PREFIXES) -> "Any":
    """What each engine process on each node really saw: the communication variables in its environment.

    NCCL variables given to a container can be lost in SGLang's worker spawn (``docs/method.md#rank-env``); this reads
    ``/proc/<pid>/environ`` of every process in the engine's process group on every node (the bare engine and its
    spawned ranks) or, in docker mode, of every process inside the engine's container (``docker exec``), and
    compares with what the target asked for. One row per node, process and expected variable.
    """
    expected = redact_env({k: v for k, v in srv.target.env.items() if k.startswith(prefixes)})
    rows = []
    for node, h in srv.handles.items():
        if node in srv.containers:           # the container's own processes, read through the runtime
            procs, why = srv.containers[node].process_environments()
            if why:
                rows.append({"node": node, "pid": h.pid, "process": srv.containers[node].name, "variable": "-",
                             "expected": "-", "seen": "-", "verdict": why})
        else:
            procs = _group_environments(srv.hosts[node], h.pid)
        for (pid, comm), env in procs.items():
            env = redact_env({k: v for k, v in env.items() if k.startswith(prefixes)})
            keys = sorted(set(expected) | set(env))
            for k in keys or ["-"]:
                want, got = expected.get(k), env.get(k)
                rows.append({"node": node, "pid": int(pid), "process": comm, "variable": k,
                             "expected": "-" if want is None else want, "seen": "-" if got is None else got,
                             "verdict": ("ok" if want == got else "MISSING" if got is None else
                                         "extra" if want is None else "DIFFERENT") if k != "-" else "none set"})
    return pd.DataFrame(rows, columns=["node", "pid", "process", "variable", "expected", "seen", "verdict"])


# The title of each pid given as an argument (its /proc cmdline, NULs as spaces): engines name their ranks there
_TITLE_SCRIPT = 'for p do printf "%s " "$p"; tr "\\000\\n" "  " < /proc/$p/cmdline 2>/dev/null; echo; done'


def engine_processes(srv: RunningServer) -> tuple[list[dict[str, Any]], list[str]]:
    """Every engine process on every node with the whole environment it started with (``/proc/<pid>/environ``),
    its title (``/proc/<pid>/cmdline``, bare engines; the process name in a container) and the parallel rank the
    engine adapter reads from the title (``EngineAdapter.rank_of_process``); on a node where no process names a
    rank, the node's engine process itself (the group leader) is marked ``rank`` ``"engine"``. Returns
    ``(processes, notes)``: one note per node whose processes could not be read."""
    out: list[dict[str, Any]] = []
    notes: list[str] = []
    for node, h in srv.handles.items():
        if node in srv.containers:
            procs, why = srv.containers[node].process_environments()
            titles: dict[str, str] = {}
            if why:
                notes.append(why)
        else:
            procs = _group_environments(srv.hosts[node], h.pid)
            r = srv.hosts[node].run(["sh", "-c", _TITLE_SCRIPT, "servelab-title", *(p for p, _ in procs)],
                                    timeout=30) if procs else None
            titles = dict(line.split(" ", 1) for line in (r.stdout.splitlines() if r else []) if " " in line)
            if not procs:
                notes.append(f"{node}: no process of the engine's group {h.pid} could be read")
        rows = [{"node": node, "pid": int(pid), "process": comm, "title": titles.get(pid, "").strip() or comm,
                 "env": env} for (pid, comm), env in procs.items()]
        for row in rows:
            row["rank"] = srv.engine.rank_of_process(row["title"])
        if rows and not any(r["rank"] for r in rows):
            lead = next((r for r in rows if r["pid"] == h.pid), rows[0])
            lead["rank"] = "engine"
        out += rows
    return out, notes


def _group_environments(host: Any, pgid: int) -> dict[tuple[str, str], dict[str, str]]:
    """``{(pid, comm): env}`` of every process in a process group on a node (from ``/proc``)."""
    r = host.run(["sh", "-c", _GROUP_ENV_SCRIPT, "servelab-env", str(pgid)], timeout=30)
    procs: dict[tuple[str, str], dict[str, str]] = {}
    cur = None
    for line in r.stdout.splitlines():
        if line.startswith("PID "):
            parts = line.split(" ", 2)
            cur = (parts[1], parts[2] if len(parts) > 2 else "")
            procs[cur] = {}
        elif cur is not None and "=" in line:
            k, v = line.split("=", 1)
            procs[cur][k] = v
    return procs
