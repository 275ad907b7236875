"""Hosts: run commands, start/stop tracked background processes and move files — locally or over SSH.

``LocalHost`` and ``SSHHost`` share one interface:

- ``run(argv, env, cwd, timeout) -> Result``           (argv list; never a shell string)
- ``start(argv, log_path, env, cwd) -> Handle``        (own process group, output to a log file)
- ``is_running(handle)``, ``stop(handle)``              (TERM to the group, then KILL)
- ``put(local, remote)``, ``get(remote, local)``, ``read_file(path)``, ``write_file(path, data)``

Every started process belongs to a ``ProcessTracker``; ``with ProcessTracker() as t`` stops all of them
on success, failure, KeyboardInterrupt (SIGTERM included, while the tracker is open) and interpreter exit.
SSH host keys are verified against known_hosts; accepting an unknown key is an explicit per-node option and is recorded.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from servelab.core.run import now_iso


class HostError(RuntimeError):
    """A host could not be reached, refused us, or a command on it failed to start."""


@dataclass
class Result:
    host: str
    argv: list[str]
    exit_code: int
    stdout: str
    stderr: str
    start: str
    end: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class Handle:
    """A background process: its group id, its log file, and how it was started."""
    host: str
    argv: list[str]
    pid: int
    log_path: str
    started: str
    env: dict[str, str] = field(default_factory=dict)
    popen: Any = None           # local only
    stopped: str | None = None
    exit_code: int | None = None


def _pdeathsig() -> None:
    """In the child: get SIGTERM if the parent dies (no orphans even if the kernel is killed), own group."""
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalHost:
    """This machine."""

    kind = "local"

    def __init__(self, name: str = "local"):
        self.name = name

    def run(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float | None = 60) -> Result:
        start = now_iso()
        try:
            p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                               env={**os.environ, **(env or {})}, errors="replace")
            code, out, err = p.returncode, p.stdout, p.stderr
        except FileNotFoundError as exc:
            code, out, err = 127, "", f"{argv[0]}: not found ({exc})"
        except subprocess.TimeoutExpired as exc:
            code, out, err = 124, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                else (exc.stdout or ""), f"timed out after {timeout} s"
        return Result(self.name, [str(a) for a in argv], code, out, err, start, now_iso())

    def start(self, argv: list[str], log_path: str | Path, env: dict[str, str] | None = None,
              cwd: str | None = None) -> Handle:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
        try:
            p = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=cwd, env={**os.environ, **(env or {})}, preexec_fn=_pdeathsig)
        except FileNotFoundError as exc:
            raise HostError(f"{self.name}: cannot start {argv[0]}: {exc}") from exc
        finally:
            log.close()
        return Handle(self.name, [str(a) for a in argv], p.pid, str(log_path), now_iso(), dict(env or {}), popen=p)

    def is_running(self, h: Handle) -> bool:
        return h.popen is not None and h.popen.poll() is None

    def stop(self, h: Handle, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL; returns the exit code."""
        if h.popen is None:
            return h.exit_code
        if h.popen.poll() is None:
            try:
                os.killpg(h.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                h.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(h.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                h.popen.wait(5)
        # the group may hold children that outlived the leader
        try:
            os.killpg(h.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        h.exit_code = h.popen.returncode
        h.stopped = h.stopped or now_iso()
        return h.exit_code

    def put(self, local: str | Path, remote: str | Path) -> None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        Path(remote).write_bytes(Path(local).read_bytes())

    def get(self, remote: str | Path, local: str | Path) -> None:
        self.put(remote, local)

    def read_file(self, path: str | Path) -> bytes:
        return Path(path).read_bytes()

    def write_file(self, path: str | Path, data: bytes) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)

    def close(self) -> None:
        pass


class _RecordingAddPolicy:
    """Accept an unknown host key only when the user opted in, and remember that we did."""

    def __init__(self, accepted: list[dict[str, str]]):
        self.accepted = accepted

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.accepted.append({"host": hostname, "key_type": key.get_name(),
                              "fingerprint": key.get_fingerprint().hex(), "when": now_iso()})


class SSHHost:
    """A node reached over SSH (paramiko). Host keys verified against known_hosts by default."""

    kind = "ssh"

    def __init__(self, name: str, host: str, port: int = 22, user: str = "", key_file: str = "",
                 known_hosts: str = "", accept_new_host_key: bool = False, connect_timeout: float = 10.0):
        import paramiko
        self.name, self.host, self.port = name, host, port
        self.user = user or os.environ.get("USER", "root")
        self.accepted_keys: list[dict[str, str]] = []
        self._lock = threading.Lock()
        client = paramiko.SSHClient()
        kh = Path(known_hosts or Path.home() / ".ssh" / "known_hosts").expanduser()
        if kh.exists():
            client.load_host_keys(str(kh))
        client.set_missing_host_key_policy(_RecordingAddPolicy(self.accepted_keys) if accept_new_host_key
                                           else paramiko.RejectPolicy())
        try:
            client.connect(host, port=port, username=self.user, key_filename=key_file or None,
                           look_for_keys=not key_file, allow_agent=not key_file, timeout=connect_timeout,
                           banner_timeout=connect_timeout, auth_timeout=connect_timeout)
        except paramiko.BadHostKeyException as exc:
            raise HostError(f"{name} ({host}:{port}): host key does not match known_hosts {kh} — refusing to "
                            f"connect (possible man-in-the-middle). Got {exc.key.get_name()}") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise HostError(f"{name} ({host}:{port}): unknown host key (not in {kh}); add it with "
                                f"ssh-keyscan after checking its fingerprint, or set accept_new_host_key: true "
                                f"for this node") from None
            raise HostError(f"{name} ({host}:{port}): SSH failed: {exc}") from None
        except (OSError, socket.timeout) as exc:
            raise HostError(f"{name} ({host}:{port}): unreachable: {exc}") from None
        self.client = client

    def _exec(self, command: str, timeout: float | None) -> tuple[int, str, str]:
        chan_in, out, err = self.client.exec_command(command, timeout=timeout)
        chan_in.close()
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        return out.channel.recv_exit_status(), stdout, stderr

    @staticmethod
    def _command(argv: list[str], env: dict[str, str] | None, cwd: str | None, exec_: bool = False) -> str:
        """``[cd DIR &&] [exec] [env K=V ...] argv`` with every piece quoted; ``exec_`` leaves no wrapper shell
        (the started program itself holds the process group and the environment)."""
        parts = []
        if cwd:
            parts.append(f"cd {shlex.quote(cwd)} &&")
        if exec_:
            parts.append("exec")
        if env:
            parts.append("env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()))
        parts.append(shlex.join([str(a) for a in argv]))
        return " ".join(parts)

    def run(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float | None = 60) -> Result:
        start = now_iso()
        try:
            code, out, err = self._exec(self._command(argv, env, cwd), timeout)
        except socket.timeout:
            code, out, err = 124, "", f"timed out after {timeout} s"
        return Result(self.name, [str(a) for a in argv], code, out, err, start, now_iso())

    def start(self, argv: list[str], log_path: str | Path, env: dict[str, str] | None = None,
              cwd: str | None = None) -> Handle:
        """Start in a new session on the node (``setsid``); the group id is printed back and tracked."""
        inner = self._command(argv, env, cwd, exec_=True)
        log = shlex.quote(str(log_path))
        # `;` not `&&`: the background job must be setsid itself (its pid = new group id), holding no channel fd
        cmd = (f"mkdir -p {shlex.quote(str(Path(log_path).parent))}; "
               f"setsid sh -c {shlex.quote(inner)} "
               f">>{log} 2>&1 </dev/null & echo $!")
        code, out, err = self._exec(cmd, 30)
        if code != 0 or not out.strip().isdigit():
            raise HostError(f"{self.name}: cannot start {argv[0]}: {err.strip() or out.strip()}")
        return Handle(self.name, [str(a) for a in argv], int(out.strip()), str(log_path), now_iso(), dict(env or {}))

    def is_running(self, h: Handle) -> bool:
        code, _, _ = self._exec(f"kill -0 -- -{h.pid} 2>/dev/null", 15)
        return code == 0

    def stop(self, h: Handle, grace_s: float = 10.0) -> int | None:
        pg = int(h.pid)
        script = (f"kill -TERM -- -{pg} 2>/dev/null; i=0; while kill -0 -- -{pg} 2>/dev/null && "
                  f"[ $i -lt {int(grace_s * 10)} ]; do sleep 0.1; i=$((i+1)); done; "
                  f"kill -KILL -- -{pg} 2>/dev/null; true")
        try:
            self._exec(script, grace_s + 20)
        except Exception as exc:  # the node may be gone; say so in the handle, never hide it
            h.exit_code = None
            h.stopped = f"stop failed: {exc}"
            return None
        h.stopped = h.stopped or now_iso()
        return None

    def put(self, local: str | Path, remote: str | Path) -> None:
        with self.client.open_sftp() as sftp:
            sftp.put(str(local), str(remote))

    def get(self, remote: str | Path, local: str | Path) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        with self.client.open_sftp() as sftp:
            sftp.get(str(remote), str(local))

    def read_file(self, path: str | Path) -> bytes:
        with self.client.open_sftp() as sftp, sftp.open(str(path), "rb") as f:
            return f.read()

    def write_file(self, path: str | Path, data: bytes) -> None:
        with self.client.open_sftp() as sftp, sftp.open(str(path), "wb") as f:
            f.write(data)

    def close(self) -> None:
        self.client.close()


def connect(node: Any) -> LocalHost | SSHHost:
    """A host object for a target node (``servelab.target.spec.Node``)."""
    if node.kind == "local":
        return LocalHost(node.name)
    return SSHHost(node.name, node.host, node.port, node.user, node.key_file, node.known_hosts,
                   node.accept_new_host_key)


def fan_out(hosts: Iterable[Any], fn: Callable[[Any], Any], max_workers: int = 16) -> dict[str, Any]:
    """Call ``fn(host)`` on every host in parallel; returns {host.name: result or the exception raised}."""
    hosts = list(hosts)
    out: dict[str, Any] = {}
    with cf.ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts)))) as pool:
        futures = {pool.submit(fn, h): h.name for h in hosts}
        for fut in cf.as_completed(futures):
            try:
                out[futures[fut]] = fut.result()
            except Exception as exc:  # returned, so one node's failure never hides the others' results
                out[futures[fut]] = exc
    return out


class ProcessTracker:
    """Owns every background process a phase starts, and stops them all — whatever happens."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, Handle]] = []
        self._closed = False
        self._term_before: Any = None
        atexit.register(self.stop_all)

    def start(self, host: Any, argv: list[str], log_path: str | Path, env: dict[str, str] | None = None,
              cwd: str | None = None) -> Handle:
        h = host.start(argv, log_path, env=env, cwd=cwd)
        self.entries.append((host, h))
        return h

    def stop(self, handle: Handle) -> None:
        for host, h in self.entries:
            if h is handle and h.stopped is None:
                host.stop(h)

    def stop_all(self) -> list[Handle]:
        """Stop in reverse start order; returns the handles (each with ``stopped`` set)."""
        for host, h in reversed(self.entries):
            if h.stopped is None:
                try:
                    host.stop(h)
                except Exception as exc:
                    h.stopped = f"stop failed: {exc}"
        return [h for _, h in self.entries]

    def running(self) -> list[Handle]:
        return [h for host, h in self.entries if h.stopped is None and host.is_running(h)]

    def __enter__(self) -> "ProcessTracker":
        self._term_before = _term_as_interrupt()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop_all()
        finally:
            atexit.unregister(self.stop_all)
            if self._term_before is not None:
                signal.signal(signal.SIGTERM, self._term_before)
                self._term_before = None


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _term_as_interrupt() -> Any:
    """SIGTERM (a kernel or a run being terminated) becomes KeyboardInterrupt — the Ctrl-C path, where every
    tracked process and container is stopped — while a tracker is open. Only in the main thread and only where
    SIGTERM had its default action; returns that action to restore, or None when nothing was changed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    before = signal.getsignal(signal.SIGTERM)
    if before is not signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, _raise_interrupt)
    return before


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port_free(host: str, port: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) != 0:
                return True
        time.sleep(0.1)
    return False
