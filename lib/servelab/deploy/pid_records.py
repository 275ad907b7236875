"""Pid records on every node and the leftover sweep (``docs/method.md#leftovers``), shared by both kinds of host.

Every process a host starts carries SERVELAB_PROC_TAG=<random tag> in its environment (its children inherit
it) and gets a record in <state_dir>/pids/<tag>.json on its node (mode 0700 folder, 0600 file): pid, process
group, start time in clock ticks since boot, boot id, argv0, run id, what it is, and which controller process
started it. A normal stop removes the record. If the controller died without stopping it (the kernel was
SIGKILLed), the next start on that node finds the record, checks that the controller is gone and that the
process still is the one recorded (same boot, same start time, or the tag in its environment), and stops it:
TERM, then KILL (docs/method.md#leftovers).
"""
from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from servelab.core.run import now_iso


class HostError(RuntimeError):
    """A host could not be reached, refused us, or a command on it failed to start."""


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


class PidRecords:
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

    def _record(self, h: Any, run_id: str, what: str) -> None:
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
