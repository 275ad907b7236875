"""The Slurm launcher: ``launch: {via: slurm, partition, account, time_limit, srun_args, ...engine settings}``.

Where a cluster is scheduled by Slurm, servelab does not start the engine over SSH: it asks Slurm for one job of
``len(nodes)`` nodes (``salloc``, held by a command that ends with the process that asked: a killed kernel's
allocation ends with it), reads the nodes Slurm gave (``squeue``/``scontrol show hostnames``) — they become the
target's nodes for the launch plan, preflight, telemetry and traces — and runs the engine as one job step of one
task per node (``srun --jobid``), each task running the per-node command servelab plans for that node (a task
script, mode 0700 in a private folder, picks its command by ``SLURM_NODEID``: no value in any argv). The job id is
recorded under the servelab cache with the controller's identity; the job is cancelled (``scancel``) on success,
failure, Ctrl-C and SIGTERM, and a job whose controller and ``salloc`` both died is cancelled by the next start's
:func:`sweep`.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from servelab.core.params import ParamError
from servelab.core.paths import cache_root
from servelab.core.run import now_iso
from servelab.deploy.pid_records import controller_identity, owner_alive
from servelab.deploy.spec import Target

SLURM_KEYS = {"via", "partition", "account", "time_limit", "srun_args"}


class SlurmError(RuntimeError):
    """Slurm refused the job, never ran it, or a command of it failed."""


def uses_slurm(launch: dict[str, Any]) -> bool:
    return launch.get("via") == "slurm"


def engine_launch(launch: dict[str, Any]) -> dict[str, Any]:
    """The launch settings without the Slurm keys: what the engine adapter reads."""
    return {k: v for k, v in launch.items() if k not in SLURM_KEYS}


def validate_slurm(launch: dict[str, Any], source: str) -> None:
    """The Slurm keys' own rules, before anything starts."""
    if "via" in launch and launch["via"] != "slurm":
        raise ParamError(f"{source}: launch.via must be 'slurm' (or absent: servelab starts the engine itself), "
                         f"got {launch['via']!r}")
    if not uses_slurm(launch):
        extra = SLURM_KEYS & set(launch) - {"via"}
        if extra:
            raise ParamError(f"{source}: launch.{sorted(extra)[0]} is a Slurm setting: add 'via: slurm'")
        return
    for k in ("partition", "account", "time_limit"):
        if k in launch and not isinstance(launch[k], str):
            raise ParamError(f"{source}: launch.{k} must be a string, got {launch[k]!r}")
    args = launch.get("srun_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ParamError(f"{source}: launch.srun_args must be a list of strings (one srun option per item)")
    if launch.get("mode") == "docker":
        raise ParamError(f"{source}: launch.via: slurm runs the engine as a job step; mode: docker is not supported "
                         f"with it")


def _jobs_dir() -> Path:
    d = cache_root() / "slurm-jobs"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def _run(argv: list[str], timeout: float = 60.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except FileNotFoundError as exc:
        raise SlurmError(f"{argv[0]} not found: launch.via: slurm needs the Slurm client commands on this "
                         f"machine ({exc})") from None


@dataclass
class SlurmJob:
    """One allocation: its id, the record file that lets a later start sweep it, and what happened."""
    job_id: str
    name: str
    record: Path
    submitted: str
    nodes: list[str]
    cancelled: str = ""
    commands: list[dict[str, Any]] | None = None

    def state(self) -> str:
        """The job's state as ``squeue`` says it ("" once Slurm no longer lists it)."""
        r = _run(["squeue", "-h", "-j", self.job_id, "-o", "%T"], timeout=30)
        return r.stdout.strip() if r.returncode == 0 else ""

    def cancel(self, wait_s: float = 30.0) -> None:
        """``scancel`` and wait until ``squeue`` no longer lists the job; the record goes with it."""
        if not self.cancelled:
            _run(["scancel", self.job_id], timeout=30)
            self.cancelled = now_iso()
            (self.commands or []).append({"argv": ["scancel", self.job_id], "at": self.cancelled})
        deadline = time.monotonic() + wait_s
        while self.state() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.record.unlink(missing_ok=True)

    def step_argv(self, script: str, srun_args: list[str]) -> list[str]:
        """The engine's job step: one task per node, each running ``script`` (which picks its node's command)."""
        n = str(len(self.nodes))
        return ["srun", f"--jobid={self.job_id}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=1", *srun_args, "bash", script]


def allocate(launch: dict[str, Any], n_nodes: int, name: str, log_dir: Path, run_id: str = "",
             timeout_s: float = 300.0, start: Callable[[list[str], Path], Any] | None = None,
             alive: Callable[[], bool] | None = None) -> SlurmJob:
    """Ask for the allocation and wait until it runs; returns the job with its nodes.

    ``salloc`` holds the allocation for as long as its command runs, and its command is ``tail --pid=<this
    process>``: the allocation ends with the process that asked for it, even when that process is SIGKILLed. ``start``
    starts the ``salloc`` command as a tracked process (default: a plain child). The job is found by its unique name
    and recorded (for the sweep); a job that does not run within ``timeout_s`` is cancelled with the error."""
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = ["salloc", f"--job-name={name}", f"--nodes={n_nodes}", f"--ntasks={n_nodes}", "--ntasks-per-node=1"]
    for key, flag in (("partition", "--partition"), ("account", "--account"), ("time_limit", "--time")):
        if launch.get(key):
            argv.append(f"{flag}={launch[key]}")
    argv += ["tail", f"--pid={os.getpid()}", "-f", "/dev/null"]
    log = log_dir / f"salloc_{name}.log"
    if start is not None:
        start(argv, log)
    else:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        alive = alive or (lambda: proc.poll() is None)
    job = SlurmJob("", name, Path(), now_iso(), [], commands=[{"argv": argv, "at": now_iso()}])
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        r = _run(["squeue", "-h", f"--name={name}", "-o", "%i %T"], timeout=30)
        found = r.stdout.split()
        if found and not job.job_id:
            job.job_id = found[0]
            job.record = _jobs_dir() / f"{job.job_id}.json"
            job.record.write_text(json.dumps({"job_id": job.job_id, "name": name, "run_id": run_id,
                                              "submitted": job.submitted, "slurm_conf": os.environ.get("SLURM_CONF", ""),
                                              "owner": controller_identity()}))
            job.record.chmod(0o600)
        state = found[1] if len(found) > 1 else ""
        if state == "RUNNING":
            job.nodes = allocated_nodes(job.job_id)
            return job
        if alive is not None and not alive():
            break
        time.sleep(0.2)
    if job.job_id:
        job.cancel()
    tail = log.read_text(errors="replace")[-400:].strip() if log.exists() else ""
    raise SlurmError(f"the Slurm allocation {name} did not start within {timeout_s:.0f} s (state "
                     f"{state or 'not listed'}){'; salloc: ' + tail if tail else ''}")


def allocated_nodes(job_id: str) -> list[str]:
    """The host names of a running job's nodes, in Slurm's order (the first is the head)."""
    r = _run(["squeue", "-h", "-j", job_id, "-o", "%N"], timeout=30)
    expr = r.stdout.strip()
    h = _run(["scontrol", "show", "hostnames", expr], timeout=30)
    names = h.stdout.split()
    if not names:
        raise SlurmError(f"Slurm job {job_id}: cannot read its nodes ({(r.stderr + h.stderr).strip()[:300]})")
    return names


def sweep() -> list[dict[str, Any]]:
    """Cancel every recorded job whose controller is gone (a SIGKILLed kernel): one row per job found."""
    rows = []
    for rec_path in sorted(_jobs_dir().glob("*.json")):
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, ValueError):
            rec_path.unlink(missing_ok=True)
            continue
        if owner_alive(rec.get("owner") or {}):
            continue
        job = SlurmJob(str(rec["job_id"]), rec.get("name", ""), rec_path, rec.get("submitted", ""), [])
        was = job.state()
        job.cancel()
        rows.append({"node": "slurm", "what": f"job {job.job_id} ({job.name})", "run_id": rec.get("run_id", ""),
                     "action": f"scancel (was {was})" if was else "already gone; record removed", "when": now_iso()})
    return rows


def placed_target(target: Target, hosts: list[str]) -> Target:
    """``target`` with the nodes Slurm gave: node i of the target (its settings: gpus, netdevs, workdir...) on the
    i-th allocated host; a host that is this machine is a local node, the others are reached over SSH."""
    me = {socket.gethostname(), socket.getfqdn(), "localhost"}
    nodes = []
    for node, host in zip(target.nodes, hosts):
        local = host in me or host.split(".")[0] == socket.gethostname().split(".")[0]
        nodes.append(replace(node, name=host, kind="local" if local else "ssh",
                             host="127.0.0.1" if local else host))
    api_host = "127.0.0.1" if nodes[0].kind == "local" else nodes[0].host
    return replace(target, nodes=nodes, api_host=api_host if target.api_host in ("", "127.0.0.1") else target.api_host)


def task_script(plans: list[Any], node_order: list[str], folder: str, write: Callable[[str, bytes], None]) -> str:
    """The job step's script: task ``SLURM_NODEID`` = i runs node i's planned command with its environment
    (``exec env K=V ... argv``), written mode 0700 into ``folder`` (private, removed at stop)."""
    by_node = {p.node: p for p in plans}
    lines = ["#!/bin/bash", "# written by servelab: one task per node, each its node's planned command",
             'case "$SLURM_NODEID" in']
    for i, node in enumerate(node_order):
        p = by_node.get(node)
        if p is None:
            continue
        env = [f"{k}={v}" for k, v in p.env.items()]
        lines.append(f"  {i}) exec env {shlex.join(env)} {shlex.join(map(str, p.argv))} ;;" if env else
                     f"  {i}) exec {shlex.join(map(str, p.argv))} ;;")
    lines += ['  *) echo "servelab: no command for node $SLURM_NODEID" >&2; exit 2 ;;', "esac", ""]
    path = f"{folder}/servelab-task.sh"
    write(path, "\n".join(lines).encode())
    os.chmod(path, 0o700)
    return path
