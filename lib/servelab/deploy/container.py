"""Engines in containers (``launch.mode: docker``): ``docker run`` as users run it, made safe on a shared node.

- **Environment by file.** The container's environment (NCCL_*, tokens...) goes through ``--env-file``: a file of
  mode 0600 in a private per-run folder (``mktemp -d``, mode 0700) on the node, written through the host layer
  (local or SSH) and removed when the container stops. No value ever appears in the ``docker run`` argv, so
  ``ps`` on the node shows none; the docker CLI process gets no extra environment either.
- **A name per run.** ``<launch.docker.name or servelab-<engine>-<node>>-<run id>-<4 hex>`` (a valid docker name),
  labelled ``servelab.run=<run id>``, so two starts never collide and stop knows what to remove.
- **Stop on every exit path.** The tracker sees the docker CLI process through :class:`ContainerHost`: stopping it
  runs ``docker stop -t <grace> <name>`` first (the CLI does not pass SIGKILL on, and a killed CLI leaves the
  container running), then stops the CLI process, then ``docker rm -f <name>`` and removes the private folder.
  Idempotent; never raises.
- **What the ranks saw.** :meth:`RunningContainer.process_environments` reads ``/proc/<pid>/environ`` of every
  process inside the container (``docker exec``), falling back to the host's ``/proc`` for the pids
  ``docker top`` lists.

Nothing here knows an engine: the adapters build a :class:`ContainerSpec` (``engines/base.py``) and the server
lifecycle (``server.py``) starts it with :func:`start_container`.
"""
from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from servelab.core.params import ParamError, reject_unknown
from servelab.deploy.hosts import HostError
from servelab.deploy.pid_records import CONTAINER_WHAT

# docker's own rule for container names
DOCKER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
DOCKER_KEYS: dict[str, str] = {
    "image": "the engine image (required)",
    "name": "base of the container name; the run id and a short random suffix are appended",
    "gpus": "value of --gpus (default: all when the node has gpus > 0, none otherwise; false = none)",
    "devices": "host devices passed with --device (e.g. /dev/infiniband/uverbs0)",
    "shm_size": "--shm-size (default 32g)",
    "extra_args": "further docker run argv items (mounts: [\"-v\", \"/models:/models:ro\"])",
    "stop_grace_s": "seconds docker stop waits before it kills the container (default 10)",
    "client": "the docker client on the node (default: docker)",
}
PLANNED_ENV_FILE = "ENV_FILE"          # a planned command's fill-in value (core.run.FILL_IN)
LABEL = "servelab.run"


def slug(text: str, limit: int = 48) -> str:
    """``text`` as a piece of a docker name: letters, digits, ``_.-`` only."""
    out = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(text)).strip("-.")
    return out[:limit].rstrip("-.") or "x"


def validate_docker(d: Any, source: str) -> None:
    """``launch.docker``: a mapping of known keys, a valid name, a list of devices, a positive grace."""
    if not isinstance(d, dict):
        raise ParamError(f"{source}: launch.docker must be a mapping {{image, name, ...}}, got {d!r}")
    reject_unknown(d, set(DOCKER_KEYS), f"{source}: launch.docker")
    if d.get("name") is not None and not DOCKER_NAME.match(str(d["name"])):
        raise ParamError(f"{source}: launch.docker.name {d['name']!r} is not a valid docker name "
                         "(letters, digits, '_', '.', '-'; starting with a letter or digit)")
    if d.get("devices") is not None and not isinstance(d["devices"], list):
        raise ParamError(f"{source}: launch.docker.devices must be a list of device paths, got {d['devices']!r}")
    g = d.get("stop_grace_s")
    if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or g < 0):
        raise ParamError(f"{source}: launch.docker.stop_grace_s must be a number of seconds >= 0, got {g!r}")


def env_file_text(env: dict[str, str]) -> str:
    """The ``--env-file`` content: one ``NAME=value`` per line, taken literally by docker (no quoting), so a
    value may hold anything but a line break."""
    lines = []
    for k, v in env.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_.]*$", str(k)):
            raise ParamError(f"env: {k!r} is not a valid environment variable name for a container")
        if "\n" in str(v) or "\r" in str(v) or "\0" in str(v):
            raise ParamError(f"env: the value of {k} holds a line break; docker's --env-file cannot carry it")
        lines.append(f"{k}={v}")
    return "".join(f"{line}\n" for line in lines)


@dataclass
class ContainerSpec:
    """One node's engine container, as planned: everything ``docker run`` needs except the per-run name and the
    env file's place, which :func:`start_container` fills in."""
    image: str
    base_name: str
    engine_argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    gpus: str | None = None
    shm_size: str = "32g"
    devices: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    stop_grace_s: float = 10.0
    client: str = "docker"

    def run_argv(self, name: str = "", env_file: str = "", run_id: str = "") -> list[str]:
        """``docker run`` for this container: names only, never an environment value."""
        out = [self.client, "run", "--rm", "--name", name or self.base_name, "--env-file", env_file or PLANNED_ENV_FILE]
        if run_id:
            out += ["--label", f"{LABEL}={run_id}"]
        if self.gpus:
            out += ["--gpus", self.gpus]
        out += ["--network", "host", "--ipc", "host", "--shm-size", self.shm_size]
        for dev in self.devices:
            out += ["--device", dev]
        return [*out, *self.extra_args, self.image, *self.engine_argv]


def container_spec(launch: dict[str, Any], argv: list[str], env: dict[str, str], base_name: str,
                   node_gpus: int = 0) -> ContainerSpec:
    """The container of one engine process from ``launch.docker`` (``base_name``: used when ``docker.name`` is
    unset); ``--gpus`` only where the node has GPUs (or ``docker.gpus`` says so)."""
    d = launch.get("docker") or {}
    if not d.get("image"):
        raise ParamError("launch.mode=docker needs launch.docker.image")
    env_file_text(env)        # a value docker cannot carry fails here, before anything starts
    gpus = d.get("gpus", "all" if node_gpus > 0 else None)
    gpus = None if gpus in (None, False, "none", "") else str(gpus)
    return ContainerSpec(image=str(d["image"]), base_name=str(d.get("name") or base_name),
                         engine_argv=[str(a) for a in argv], env=dict(env), gpus=gpus,
                         shm_size=str(d.get("shm_size", "32g")), devices=[str(x) for x in d.get("devices") or []],
                         extra_args=[str(a) for a in d.get("extra_args") or []],
                         stop_grace_s=float(d.get("stop_grace_s", 10)), client=str(d.get("client", "docker")))


# Inside the container: every process but this shell, as "\0PID <pid> <comm>\n\0" + its NUL-separated environ.
# `set --` globs in the shell itself (no child to list); only sh builtins and cat are needed.
_CONTAINER_ENV_SCRIPT = ('set -- /proc/[0-9]*; for d do p=${d#/proc/}; [ "$p" = "$$" ] && continue; '
                         'printf "\\0PID %s " "$p"; cat "$d/comm"; printf "\\0"; cat "$d/environ"; '
                         'done 2>/dev/null; true')
# On the host: the same for the pids given as arguments (what `docker top` lists)
_HOST_ENV_SCRIPT = ('for p do printf "\\0PID %s " "$p"; cat "/proc/$p/comm"; printf "\\0"; cat "/proc/$p/environ"; '
                    'done 2>/dev/null; true')


def parse_environ_dump(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """``{(pid, comm): env}`` from the dump the scripts above print."""
    procs: dict[tuple[str, str], dict[str, str]] = {}
    cur = None
    for item in text.split("\0"):
        if item.startswith("PID "):
            parts = item.strip().split(" ", 2)
            cur = (parts[1], parts[2] if len(parts) > 2 else "")
            procs[cur] = {}
        elif cur is not None and "=" in item:
            k, v = item.split("=", 1)
            procs[cur][k] = v
    return procs


@dataclass
class RunningContainer:
    """A started container on a node: its per-run name, its private folder and env file there, and what
    stopping it did."""
    host: Any
    spec: ContainerSpec
    name: str
    run_id: str
    private_dir: str
    env_file: str
    argv: list[str]
    stop_results: list[Any] = field(default_factory=list)
    stopped: bool = False
    removed: bool = False             # the container and its env file are gone
    env_file_removed: bool = False

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the container."""
        return [self.spec.client, "exec", self.name, *argv]

    def stop(self) -> None:
        """``docker stop -t <grace> <name>``: TERM to the container's main process, KILL after the grace."""
        if self.stopped:
            return
        grace = int(round(self.spec.stop_grace_s))
        try:
            r = self.host.run([self.spec.client, "stop", "-t", str(grace), self.name], timeout=grace + 60)
            self.stop_results.append(r)
            self.stopped = r.ok or _no_such(r)
        except Exception as exc:     # a node gone: say so, keep going with the rest of the teardown
            self.stop_results.append(exc)

    def remove(self) -> None:
        """``docker rm -f <name>`` (gone already is fine) and the private folder with the env file; idempotent."""
        if self.removed:
            return
        gone = False
        try:
            r = self.host.run([self.spec.client, "rm", "-f", self.name], timeout=60)
            self.stop_results.append(r)
            # `--rm` may be removing it already ("removal ... already in progress"): wait until the daemon is done
            deadline = time.monotonic() + 30
            while not (gone := not self.exists()) and time.monotonic() < deadline:
                time.sleep(0.2)
        except Exception as exc:
            self.stop_results.append(exc)
        # the env file goes whatever happened to the container (the CLI read it when it started)
        self.env_file_removed = self.env_file_removed or remove_private_dir(self.host, self.private_dir)
        self.removed = gone and self.env_file_removed

    def exists(self) -> bool:
        """Is a container of this name still known to the daemon (running or not)?"""
        r = self.host.run([self.spec.client, "ps", "-aq", "--filter", f"name=^/{self.name}$"], timeout=30)
        return bool(r.stdout.strip()) if r.ok else True

    def process_environments(self) -> tuple[dict[tuple[str, str], dict[str, str]], str]:
        """``({(pid, comm): env}, note)`` for every process in the container: read inside it (``docker exec``,
        pids of the container's namespace); where the image has no ``sh``/``cat``, the host's ``/proc`` of the
        pids ``docker top`` lists. ``note`` says why nothing could be read."""
        r = self.host.run(self.exec_argv(["sh", "-c", _CONTAINER_ENV_SCRIPT]), timeout=30)
        procs = parse_environ_dump(r.stdout) if r.ok else {}
        if procs:
            return procs, ""
        top = self.host.run([self.spec.client, "top", self.name, "-eo", "pid"], timeout=30)
        pids = [line.strip() for line in top.stdout.splitlines()[1:] if line.strip().isdigit()] if top.ok else []
        if pids:
            h = self.host.run(["sh", "-c", _HOST_ENV_SCRIPT, "servelab-env", *pids], timeout=30)
            procs = parse_environ_dump(h.stdout)
            if procs:
                return procs, ""
        why = (r.stderr or top.stderr or "no process listed").strip().splitlines()
        return {}, f"container {self.name}: environment not readable ({why[0] if why else 'unknown'})"


def _no_such(r: Any) -> bool:
    return "no such container" in (r.stderr or "").lower()


def make_private_dir(host: Any, run_id: str) -> str:
    """A fresh folder only the node's user can enter (``mktemp -d``: mode 0700) under the node's temp folder."""
    r = host.run(["mktemp", "-d", "-t", f"servelab-{slug(run_id, 32)}-XXXXXXXX"], timeout=30)
    path = r.stdout.strip()
    if not r.ok or not path.startswith("/"):
        raise HostError(f"{host.name}: cannot create a private folder for the container's env file: "
                         f"{(r.stderr or r.stdout).strip()}")
    return path


def remove_private_dir(host: Any, path: str) -> bool:
    """Remove a folder :func:`make_private_dir` made (refuses any other path); True when it is gone."""
    if not path or not PurePosixPath(path).name.startswith("servelab-"):
        return False
    try:
        return host.run(["rm", "-rf", "--", path], timeout=60).ok
    except Exception:
        return False


def write_env_file(host: Any, private_dir: str, env: dict[str, str]) -> str:
    """Write ``env`` as ``<private_dir>/container.env``, created empty with mode 0600 before any value goes in."""
    path = f"{private_dir}/container.env"
    r = host.run(["install", "-m", "600", "/dev/null", path], timeout=30)
    if not r.ok:
        raise HostError(f"{host.name}: cannot create the container's env file: {r.stderr.strip()}")
    host.write_file(path, env_file_text(env).encode())
    return path


def container_name(spec: ContainerSpec, run_id: str) -> str:
    """``<base>-<run id>-<4 hex>``: unique per start, valid for docker."""
    parts = [slug(spec.base_name, 64)] + ([slug(run_id, 48)] if run_id else []) + [secrets.token_hex(2)]
    return "-".join(parts)


class ContainerHost:
    """A node's host as the process tracker sees one container's docker CLI process: stopping that process
    stops and removes the container (and its env file) too. Everything else is the node's host."""

    def __init__(self, host: Any, container: RunningContainer):
        self.host, self.container = host, container

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.host, attr)

    def stop(self, h: Any, grace_s: float = 10.0) -> int | None:
        self.container.stop()
        try:
            code = self.host.stop(h, grace_s)
        finally:
            self.container.remove()
        return code


def start_container(tracker: Any, host: Any, spec: ContainerSpec, log_path: Any, run_id: str = ""
                    ) -> tuple[Any, RunningContainer]:
    """Write the env file in a private folder on the node, start ``docker run`` under a per-run name with the
    tracker (which then tears the container down on any exit path). Returns (CLI handle, container)."""
    private = make_private_dir(host, run_id)
    name = container_name(spec, run_id)
    try:
        env_file = write_env_file(host, private, spec.env)
        argv = spec.run_argv(name, env_file, run_id)
        running = RunningContainer(host, spec, name, run_id, private, env_file, argv)
        handle = tracker.start(ContainerHost(host, running), argv, log_path, env={},
                               what=CONTAINER_WHAT.format(name=name, client=spec.client, private=private))
    except BaseException:
        remove_private_dir(host, private)
        raise
    return handle, running
