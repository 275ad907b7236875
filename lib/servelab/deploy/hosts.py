"""Hosts: run commands, start/stop tracked background processes and move files — locally or over SSH.

``LocalHost`` and ``SSHHost`` share one interface:

- ``run(argv, env, cwd, timeout) -> Result``           (argv list; never a shell string)
- ``start(argv, log_path, env, cwd) -> Handle``        (own process group, output to a log file)
- ``is_running(handle)``, ``stop(handle)``              (TERM to the group, then KILL)
- ``put(local, remote)``, ``get(remote, local)``, ``read_file(path)``, ``write_file(path, data)``

Every started process belongs to a ``ProcessTracker``; ``with ProcessTracker() as t`` stops all of them
on success, failure, KeyboardInterrupt (SIGTERM included, while the tracker is open) and interpreter exit; a
SIGTERM whose interrupt something swallowed still stops them in bounded time (``core.signals``' watchdog).
SSH host keys are verified against known_hosts; accepting an unknown key is an explicit per-node option and is recorded.
"""
from __future__ import annotations

import atexit
import base64
import concurrent.futures as cf
import ctypes
import hashlib
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from servelab.core import signals
from servelab.core.paths import cache_root
from servelab.core.run import is_secret_name, now_iso
from servelab.deploy.pid_records import DEFAULT_STATE_DIR, PROC_TAG_ENV, HostError, PidRecords


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
    tag: str = ""               # SERVELAB_PROC_TAG in its environment (and its children's)
    record_path: str = ""       # its pid record on the node ("" = none could be written)
    what: str = ""
    # stop: SIGTERM to the group leader alone first (it stops its own children: SGLang's server shuts down in ~5 s
    # that way, while a TERM to every process makes it wait on a "crashed" scheduler), else to the whole group
    term_leader_first: bool = False


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still alive on this machine (zombies waiting to be reaped are not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and _group_alive(pgid):
        time.sleep(0.05)


def _pdeathsig() -> None:
    """In the child: get SIGTERM if the parent dies (no orphans even if the kernel is killed), own group."""
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalHost(PidRecords):
    """This machine."""

    kind = "local"

    def __init__(self, name: str = "local", state_dir: str = ""):
        self.name = name
        self.state_dir = state_dir or str(cache_root())
        self.python = sys.executable
        self.run_id = ""                  # written into the pid record of every process started here

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
              cwd: str | None = None, what: str = "") -> Handle:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
        tag = secrets.token_hex(8)
        try:
            p = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=cwd, env={**os.environ, **(env or {}), PROC_TAG_ENV: tag}, preexec_fn=_pdeathsig)
        except FileNotFoundError as exc:
            raise HostError(f"{self.name}: cannot start {argv[0]}: {exc}") from exc
        finally:
            log.close()
        h = Handle(self.name, [str(a) for a in argv], p.pid, str(log_path), now_iso(), dict(env or {}), popen=p,
                   tag=tag, what=what)
        self._record(h, self.run_id, what)
        return h

    def is_running(self, h: Handle) -> bool:
        return h.popen is not None and h.popen.poll() is None

    def stop(self, h: Handle, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL; returns the exit code."""
        if h.popen is None:
            return h.exit_code
        if h.popen.poll() is None:
            try:
                if h.term_leader_first:
                    os.kill(h.pid, signal.SIGTERM)
                else:
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
        # the group may hold children that outlived the leader: killed, and waited for until none is alive
        try:
            os.killpg(h.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _wait_group_gone(h.pid, 5.0)
        h.exit_code = h.popen.returncode
        h.stopped = h.stopped or now_iso()
        if h.record_path:
            Path(h.record_path).unlink(missing_ok=True)
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


def servelab_known_hosts() -> Path:
    """Where host keys accepted with ``accept_new_host_key`` are kept when the node names no file of its own."""
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "servelab" / "known_hosts"


def sha256_fingerprint(key: Any) -> str:
    """``SHA256:...`` as ``ssh-keygen -l`` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _SavingAddPolicy:
    """Accept an unknown host key only when the user opted in, save it to a known_hosts file (so every later
    connection is verified against it), and remember that we did."""

    def __init__(self, accepted: list[dict[str, str]], save_to: Path):
        self.accepted, self.save_to = accepted, save_to

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.save_to.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.save_to, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        self.accepted.append({"host": hostname, "key_type": key.get_name(),
                              "fingerprint": key.get_fingerprint().hex(), "sha256": sha256_fingerprint(key),
                              "saved_to": str(self.save_to), "when": now_iso()})


class SSHHost(PidRecords):
    """A node reached over SSH (paramiko). Host keys verified against known_hosts by default; a key accepted
    with ``accept_new_host_key`` is saved, and every later connection is verified against it."""

    kind = "ssh"

    def __init__(self, name: str, host: str, port: int = 22, user: str = "", key_file: str = "",
                 known_hosts: str = "", accept_new_host_key: bool = False, connect_timeout: float = 10.0,
                 state_dir: str = ""):
        import paramiko
        self.name, self.host, self.port = name, host, port
        self.user = user or os.environ.get("USER", "root")
        self.state_dir = state_dir or DEFAULT_STATE_DIR
        self.python = "python3"
        self.run_id = ""
        self.accepted_keys: list[dict[str, str]] = []
        self._lock = threading.Lock()
        client = paramiko.SSHClient()
        # a node's own file holds its keys and takes the accepted ones; otherwise ~/.ssh/known_hosts is read and
        # accepted keys go to servelab's own file, read too
        files = [Path(known_hosts).expanduser()] if known_hosts else \
            [Path.home() / ".ssh" / "known_hosts", servelab_known_hosts()]
        save_to = files[-1]
        kh = " or ".join(str(f) for f in files)
        for f in files:
            if f.exists():
                client.get_host_keys().load(str(f))
        client.set_missing_host_key_policy(_SavingAddPolicy(self.accepted_keys, save_to) if accept_new_host_key
                                           else paramiko.RejectPolicy())
        try:
            client.connect(host, port=port, username=self.user, key_filename=key_file or None,
                           look_for_keys=not key_file, allow_agent=not key_file, timeout=connect_timeout,
                           banner_timeout=connect_timeout, auth_timeout=connect_timeout)
        except paramiko.BadHostKeyException as exc:
            raise HostError(f"{name} ({host}:{port}): host key does not match known_hosts {kh} — refusing to "
                            f"connect (possible man-in-the-middle; got {exc.key.get_name()} "
                            f"{sha256_fingerprint(exc.key)}). If the node was really reinstalled, remove its old "
                            f"line from that file") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise HostError(f"{name} ({host}:{port}): unknown host key (not in {kh}); add it with "
                                f"ssh-keyscan after checking its fingerprint, or set accept_new_host_key: true "
                                f"for this node") from None
            raise HostError(f"{name} ({host}:{port}): SSH failed: {exc}") from None
        except (OSError, socket.timeout) as exc:
            raise HostError(f"{name} ({host}:{port}): unreachable: {exc}") from None
        self.client = client
        key = client.get_transport().get_remote_server_key()
        self.host_key = {"node": name, "host": f"{host}:{port}", "key_type": key.get_name(),
                         "sha256": sha256_fingerprint(key), "when": now_iso(),
                         "check": (f"accepted as new and saved to {save_to}" if self.accepted_keys
                                   else f"verified against {kh}")}

    def _exec(self, command: str, timeout: float | None, stdin: str = "") -> tuple[int, str, str]:
        chan_in, out, err = self.client.exec_command(command, timeout=timeout)
        if stdin:
            chan_in.write(stdin)
            chan_in.flush()
        chan_in.close()
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        code = out.channel.recv_exit_status()
        transport = self.client.get_transport()
        if code == -1 and (transport is None or not transport.is_active()):   # no status: the link itself went
            raise HostError(f"{self.name}: the SSH connection was lost while a command ran on it")
        return code, stdout, stderr

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
              cwd: str | None = None, what: str = "") -> Handle:
        """Start in a new session on the node (``setsid``); the group id is printed back and tracked.

        Variables whose name says secret (``LLAMA_API_KEY``, ``*_TOKEN``...) never appear in a command line:
        they are written to the SSH channel's stdin and read into the environment by the starting shell."""
        env = dict(env or {})
        hidden = {k: str(v) for k, v in env.items() if is_secret_name(k)}
        for k, v in hidden.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or "\n" in v:
                raise HostError(f"{self.name}: secret variable {k!r} must be a plain name with a one-line value")
        tag = secrets.token_hex(8)
        plain = {**{k: v for k, v in env.items() if k not in hidden}, PROC_TAG_ENV: tag}
        inner = self._command(argv, plain, cwd, exec_=True)
        log = shlex.quote(str(log_path))
        reads = "".join(f"IFS= read -r {k} && export {k}; " for k in hidden)
        # `;` not `&&`: the background job must be setsid itself (its pid = new group id), holding no channel fd
        cmd = (f"{reads}mkdir -p {shlex.quote(str(Path(log_path).parent))}; "
               f"setsid sh -c {shlex.quote(inner)} "
               f">>{log} 2>&1 </dev/null & echo $!")
        code, out, err = self._exec(cmd, 30, stdin="".join(v + "\n" for v in hidden.values()))
        if code != 0 or not out.strip().isdigit():
            raise HostError(f"{self.name}: cannot start {argv[0]}: {err.strip() or out.strip()}")
        h = Handle(self.name, [str(a) for a in argv], int(out.strip()), str(log_path), now_iso(), env, tag=tag,
                   what=what)
        self._record(h, self.run_id, what)
        return h

    def is_running(self, h: Handle) -> bool:
        """A member of the started session is alive. ``kill -0`` alone also succeeds on a zombie, and a process that
        died at once (a collector whose binary is missing) stays one until the node's init reaps it — seen taking
        over a second on a loaded node — so with ``ps`` on the node, zombies do not count."""
        pg = int(h.pid)
        script = (f"if command -v ps >/dev/null 2>&1; then ps -o stat= -s {pg} 2>/dev/null | grep -q '^[^Z]'; "
                  f"else kill -0 -- -{pg} 2>/dev/null; fi")
        code, _, _ = self._exec(script, 15)
        return code == 0

    def stop(self, h: Handle, grace_s: float = 10.0) -> int | None:
        pg = int(h.pid)
        first = f"kill -TERM {pg}" if h.term_leader_first else f"kill -TERM -- -{pg}"
        script = (f"{first} 2>/dev/null; i=0; while kill -0 -- -{pg} 2>/dev/null && "
                  f"[ $i -lt {int(grace_s * 10)} ]; do sleep 0.1; i=$((i+1)); done; "
                  f"kill -KILL -- -{pg} 2>/dev/null; true")
        if h.record_path:
            script += f"; rm -f -- {shlex.quote(h.record_path)}"
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
    """A host object for a target node (``servelab.deploy.spec.Node``)."""
    if node.kind == "local":
        return LocalHost(node.name, state_dir=getattr(node, "state_dir", ""))
    return SSHHost(node.name, node.host, node.port, node.user, node.key_file, node.known_hosts,
                   node.accept_new_host_key, state_dir=getattr(node, "state_dir", ""))


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
    """Owns every background process a phase starts, and stops them all — whatever happens. Clean-up steps
    registered with :meth:`on_exit` (copy remote logs back, remove a node's private work folder) run after
    the processes are stopped, last registered first."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, Handle]] = []
        self.cleanups: list[tuple[str, Callable[[], Any]]] = []
        self.cleanup_errors: list[str] = []
        self._closed = False
        self._term_before: Any = None
        atexit.register(self.stop_all)

    def start(self, host: Any, argv: list[str], log_path: str | Path, env: dict[str, str] | None = None,
              cwd: str | None = None, what: str = "") -> Handle:
        h = host.start(argv, log_path, env=env, cwd=cwd, **({"what": what} if what else {}))
        self.entries.append((host, h))
        return h

    def on_exit(self, name: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once, after every process is stopped (on success, failure, Ctrl-C, SIGTERM)."""
        self.cleanups.append((name, fn))

    def run_cleanup(self, name: str) -> None:
        """Run the clean-up step ``name`` now (and not again at exit)."""
        for item in [c for c in self.cleanups if c[0] == name]:
            self.cleanups.remove(item)
            try:
                item[1]()
            except Exception as exc:  # recorded, never hides the other steps
                self.cleanup_errors.append(f"{name}: {exc}")

    def stop(self, handle: Handle) -> None:
        for host, h in self.entries:
            if h is handle and h.stopped is None:
                host.stop(h)

    def stop_all(self) -> list[Handle]:
        """Stop in reverse start order, then run the clean-up steps; returns the handles (each with ``stopped``
        set)."""
        for host, h in reversed(self.entries):
            if h.stopped is None:
                try:
                    host.stop(h)
                except Exception as exc:
                    h.stopped = f"stop failed: {exc}"
        for name, _ in reversed(list(self.cleanups)):
            self.run_cleanup(name)
        return [h for _, h in self.entries]

    def running(self) -> list[Handle]:
        return [h for host, h in self.entries if h.stopped is None and host.is_running(h)]

    def kill_all(self) -> None:
        """The watchdog's stop (``core.signals``): every process still running, with a 1 s grace."""
        for host, h in reversed(self.entries):
            if h.stopped is None:
                try:
                    host.stop(h, grace_s=1.0)
                except Exception as exc:  # noqa: BLE001  (recorded; the next one is still stopped)
                    h.stopped = f"stop failed: {exc}"

    def __enter__(self) -> "ProcessTracker":
        self._term_before = signals.stop_on((signal.SIGTERM,))
        signals.register(id(self), self.kill_all)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop_all()
        finally:
            atexit.unregister(self.stop_all)
            signals.unregister(id(self))
            if self._term_before:
                signals.restore(self._term_before)
                self._term_before = None


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
