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
import base64
import concurrent.futures as cf
import ctypes
import hashlib
import json
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

from servelab.core.paths import cache_root
from servelab.core.run import is_secret_name, now_iso


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


# ---------------------------------------------------------------- pid records on every node
#
# Every process a host starts carries SERVELAB_PROC_TAG=<random tag> in its environment (its children inherit
# it) and gets a record in <state_dir>/pids/<tag>.json on its node (mode 0700 folder, 0600 file): pid, process
# group, start time in clock ticks since boot, boot id, argv0, run id, what it is, and which controller process
# started it. A normal stop removes the record. If the controller died without stopping it (the kernel was
# SIGKILLed), the next start on that node finds the record, checks that the controller is gone and that the
# process still is the one recorded (same boot, same start time, or the tag in its environment), and stops it:
# TERM, then KILL (docs/method.md#leftovers).

PROC_TAG_ENV = "SERVELAB_PROC_TAG"
DEFAULT_STATE_DIR = "~/.cache/servelab"

# stdlib only, run on a node as `python3 -c PROGRAM ACTION STATE_DIR ...`; data only ever in argv items
_REGISTRY_PROGRAM = r"""
import json, os, signal, sys, time
act, state = sys.argv[1], os.path.expanduser(sys.argv[2])
pids_dir = os.path.realpath(os.path.join(state, "pids"))

def start_ticks(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])    # a zombie is no longer running
    except (OSError, ValueError, IndexError):
        return None

def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""

def tagged(tag):
    want = ("SERVELAB_PROC_TAG=" + tag).encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open("/proc/%s/environ" % d, "rb") as f:
                    if want in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                pass
    return out

def leader_ok(rec):
    return rec.get("boot_id") == boot_id() and rec.get("start_ticks") is not None \
        and start_ticks(int(rec["pid"])) == rec.get("start_ticks")

def alive(rec):
    pids = set(tagged(rec["tag"]))
    if leader_ok(rec):
        pids.add(int(rec["pid"]))
    return sorted(pids)

def signal_all(rec, sig):
    if leader_ok(rec):
        try:
            os.killpg(int(rec["pgid"]), sig)
        except OSError:
            pass
    for p in tagged(rec["tag"]):
        try:
            os.kill(p, sig)
        except OSError:
            pass

if act == "record":
    rec = json.loads(sys.argv[3])
    os.makedirs(pids_dir, mode=0o700, exist_ok=True)
    os.chmod(pids_dir, 0o700)
    rec["start_ticks"], rec["boot_id"] = start_ticks(int(rec["pid"])), boot_id()
    path = os.path.join(pids_dir, rec["tag"] + ".json")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)
    print(json.dumps({"path": path, "start_ticks": rec["start_ticks"]}))
elif act == "list":
    out = []
    if os.path.isdir(pids_dir):
        for name in sorted(os.listdir(pids_dir)):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(pids_dir, name)) as f:
                        rec = json.load(f)
                    rec["path"], rec["alive"] = os.path.join(pids_dir, name), alive(rec)
                except (OSError, ValueError, KeyError):
                    continue
                out.append(rec)
    print(json.dumps(out))
elif act == "kill":
    grace, out = float(sys.argv[3]), []
    for path in sys.argv[4:]:
        if os.path.dirname(os.path.realpath(path)) != pids_dir:
            continue
        with open(path) as f:
            rec = json.load(f)
        before = alive(rec)
        signal_all(rec, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive(rec) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(rec):
            signal_all(rec, signal.SIGKILL)
            time.sleep(0.3)
        left = alive(rec)
        if not left:
            os.remove(path)
        out.append({"path": path, "killed": before, "survived": left})
    print(json.dumps(out))
"""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """A running process's start time in clock ticks since boot; None when gone or a zombie (dead, unreaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def controller_identity() -> dict[str, Any]:
    """This process (the phase's kernel) as the owner of what it starts: machine, boot, pid, start time."""
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
            "start_ticks": _start_ticks(os.getpid())}


def owner_alive(owner: dict[str, Any]) -> bool | None:
    """Is the controller process that started a recorded process still running? None: it ran on another
    machine (or an earlier boot of this one cannot be told apart), so nobody here can tell."""
    if owner.get("host") != socket.gethostname():
        return None
    if owner.get("boot_id") != _boot_id():
        return False                      # this machine rebooted since: that controller is gone
    want = owner.get("start_ticks")
    return want is not None and _start_ticks(int(owner.get("pid", 0))) == want


class _PidRecords:
    """Pid records and the leftover sweep, the same for both kinds of host (run through ``self.run``)."""

    name: str
    state_dir: str
    python: str

    def _registry(self, *args: str, timeout: float = 60) -> Any:
        r = self.run([self.python, "-c", _REGISTRY_PROGRAM, *args], timeout=timeout)  # type: ignore[attr-defined]
        if r.exit_code != 0:
            raise HostError(f"{self.name}: pid records in {self.state_dir}: "
                            f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or r.exit_code}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def _record(self, h: Handle, run_id: str, what: str) -> None:
        """Write the started process's record on its node; a node where it cannot be written keeps the handle
        without one (``record_path`` empty) — the process is still stopped with its tracker."""
        rec = {"tag": h.tag, "pid": h.pid, "pgid": h.pid, "argv0": Path(h.argv[0]).name if h.argv else "",
               "what": what or (Path(h.argv[0]).name if h.argv else ""), "run_id": run_id, "node": self.name,
               "started": h.started, "log": h.log_path, "owner": controller_identity()}
        try:
            h.record_path = str(self._registry("record", self.state_dir, json.dumps(rec))["path"])
        except (HostError, ValueError, IndexError, KeyError):
            h.record_path = ""

    def private_dir(self, base: str = "") -> str:
        """A new folder for this run only (``mktemp -d``: mode 0700, unpredictable name) under ``base`` or the
        node's ``$TMPDIR``; remove it with :meth:`remove_private_dir`."""
        script = ('b="${1:-${TMPDIR:-/tmp}}"; mkdir -p -- "$b" && exec mktemp -d -- "$b/servelab-XXXXXXXXXX"')
        r = self.run(["sh", "-c", script, "servelab-mkdtemp", base], timeout=30)  # type: ignore[attr-defined]
        path = r.stdout.strip()
        if r.exit_code != 0 or not path.startswith("/"):
            raise HostError(f"{self.name}: cannot make a private work folder under {base or '$TMPDIR'}: "
                            f"{(r.stderr or r.stdout).strip()}")
        return path

    def remove_private_dir(self, path: str) -> bool:
        """Remove a folder made by :meth:`private_dir` (nothing else: its name must be ``servelab-*``)."""
        if not path or not Path(path).name.startswith("servelab-"):
            return False
        r = self.run(["rm", "-rf", "--", path], timeout=120)  # type: ignore[attr-defined]
        return r.exit_code == 0

    def sweep(self, grace_s: float = 5.0) -> list[dict[str, Any]]:
        """Stop what earlier runs left on this node (their controller is gone, the process is still the recorded
        one): one row per record found — node, pid, what, from which run, and what was done."""
        rows = []
        try:
            recs = self._registry("list", self.state_dir)
        except HostError as exc:
            return [{"node": self.name, "action": f"not swept: {exc}"}]
        kill = []
        for rec in recs:
            alive = owner_alive(rec.get("owner") or {})
            row = {"node": self.name, "pid": rec.get("pid"), "what": rec.get("what", ""), "argv0": rec.get("argv0"),
                   "run_id": rec.get("run_id", ""), "started": rec.get("started", ""),
                   "owner": f"{(rec.get('owner') or {}).get('host')} pid {(rec.get('owner') or {}).get('pid')}",
                   "when": now_iso()}
            if alive:
                continue                                  # a live controller's own process: not a leftover
            if alive is None and rec.get("alive"):
                rows.append({**row, "action": "kept: started from another machine, which may still be running"})
                continue
            kill.append(rec["path"])
            box = CONTAINER_WHAT_RE.match(rec.get("what") or "")
            if rec.get("alive") or box:   # a record whose processes are all gone is removed without a row
                rows.append({**row, "processes": rec.get("alive") or [], "path": rec["path"],
                             "action": "stopped (TERM, then KILL)" if rec.get("alive") else "client already gone",
                             **({"container": box.groupdict()} if box else {})})
        if kill:
            done = {d["path"]: d for d in self._registry("kill", self.state_dir, str(grace_s), *kill,
                                                          timeout=grace_s * len(kill) + 60)}
            for row in rows:
                left = done.get(row.pop("path", ""), {}).get("survived")
                if left:
                    row["action"] = f"could not stop pids {left}"
                box = row.pop("container", None)
                if box:                   # the docker CLI's death does not stop its container: remove it too
                    row["action"] += "; " + self._remove_container(box)
        return rows

    def _remove_container(self, box: dict[str, str]) -> str:
        """``docker rm -f`` a container an earlier run left (and the private folder of its env file)."""
        r = self.run([box["client"], "rm", "-f", box["name"]], timeout=120)  # type: ignore[attr-defined]
        gone = r.exit_code == 0 or "No such container" in (r.stderr or "")
        if box["private"].rsplit("/", 1)[-1].startswith("servelab-"):
            self.run(["rm", "-rf", "--", box["private"]], timeout=60)  # type: ignore[attr-defined]
        return (f"container {box['name']} removed" if gone else
                f"container {box['name']} could not be removed: {(r.stderr or r.stdout).strip()[:200]}")


# how a container's docker CLI process is described in its pid record, so that a sweep can remove the container
# (the CLI's death — e.g. a SIGKILLed kernel's — leaves it running) and the folder of its env file
CONTAINER_WHAT = "docker container {name} via {client} (env file in {private})"
CONTAINER_WHAT_RE = re.compile(r"^docker container (?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*) via (?P<client>\S+) "
                               r"\(env file in (?P<private>/\S*)\)$")


class LocalHost(_PidRecords):
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


class SSHHost(_PidRecords):
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
