"""Preflight (``docs/method.md#preflight``): before an engine starts anywhere, every node shows what the target
needs — RDMA devices present, HCAs and netdevs (the rails) up, GPUs visible and idle, the engine's ports free,
disk space in the work directory, and its clock close to the head's.

Each check is **required** when its key is in the target's ``preflight:`` mapping, **advisory** otherwise (it is
still run where the node declares something to check, and reported, but never stops a start). Each has a result
— ``ok``, ``failed`` or ``n/a`` (nothing to check on that node: no GPU declared and no ``nvidia-smi``, no fixed
port, the head's own clock) — and a one-line detail. A failed required check refuses the start before any process
is launched (:class:`PreflightFailed`, whose message is the one-line reason).

Keys of ``preflight:`` (all optional)::

    devices: [/dev/infiniband/rdma_cm, /dev/infiniband/uverbs0]   # present on every node
    hcas: true                       # every node's ``hcas`` (or a list) have a port in state ACTIVE
    netdevs: [eth0, eth3]            # up on every node (``true``: each node's own ``netdevs``)
    ports_free: [30000, 50000]       # a bind test on every node succeeds
    gpus_idle: true                  # each node's declared GPUs visible, no compute process on any (n/a on a
                                     # node with gpus: 0 and no nvidia-smi)
    disk_free_gb: 50                 # free space in each node's work directory
    max_clock_offset_ms: 5           # |offset to the head| + its uncertainty stays below this

Every probe is an argv run through the hosts layer (``LocalHost`` / ``SSHHost``); names and paths are passed as
positional arguments, never interpolated into a shell string. The result is written to the run's
``manifest["preflight"]`` and reused by the later phases of the same run while the target's nodes and
preflight settings are unchanged (only a passing result is reused: a refused start is checked again).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.run import now_iso, read_manifest, update_manifest
from servelab.deploy import hosts as hostlib
from servelab.deploy.spec import Node, Target
from servelab.core.params import ParamError, did_you_mean

PREFLIGHT_KEYS = {"devices": list, "hcas": (bool, list), "netdevs": (bool, list), "ports_free": list,
                  "gpus_idle": bool, "disk_free_gb": (int, float), "max_clock_offset_ms": (int, float)}
# where a key is absent, the advisory check uses these limits
ADVISORY_DISK_FREE_GB = 10.0
ADVISORY_CLOCK_OFFSET_MS = 50.0
CLOCK_SAMPLES = 5
CHECKS = ("rdma devices", "hcas up", "netdevs up", "gpus visible", "gpus idle", "ports free", "disk free",
          "clock offset")
COLUMNS = ["node", "check", "required", "result", "detail"]


class PreflightFailed(RuntimeError):
    """A required preflight check failed: nothing was started. ``str()`` is the one-line reason."""

    def __init__(self, report: "PreflightReport"):
        super().__init__(report.reason)
        self.report = report


def validate_preflight(pre: dict | None, where: str = "preflight") -> dict:
    """Check the ``preflight:`` keys and value types (one-line error naming the key); returns it unchanged."""
    pre = dict(pre or {})
    for k, v in pre.items():
        if k not in PREFLIGHT_KEYS:
            raise ParamError(f"{where}: unknown preflight key '{k}'{did_you_mean(k, PREFLIGHT_KEYS)}; known: "
                             f"{', '.join(sorted(PREFLIGHT_KEYS))}")
        want = PREFLIGHT_KEYS[k]
        if not isinstance(v, want) or (isinstance(v, bool) and want in ((int, float),)):
            raise ParamError(f"{where}: preflight '{k}' has the wrong type ({v!r}); see docs/method.md#preflight")
        if k in ("devices", "hcas", "netdevs") and isinstance(v, list) and not all(isinstance(x, str) for x in v):
            raise ParamError(f"{where}: preflight '{k}' must list names, got {v!r}")
        if k in ("disk_free_gb", "max_clock_offset_ms") and not (0 <= v < float("inf")):
            raise ParamError(f"{where}: preflight '{k}' must be a finite number ≥ 0, got {v!r}")
        if k == "ports_free" and not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in v):
            raise ParamError(f"{where}: preflight 'ports_free' must list ports 1..65535, got {v!r}")
    return pre


@dataclass
class Check:
    node: str
    check: str
    required: bool
    result: str            # ok | failed | n/a
    detail: str

    def row(self) -> dict[str, Any]:
        return {"node": self.node, "check": self.check, "required": "yes" if self.required else "no",
                "result": self.result, "detail": self.detail}


@dataclass
class PreflightReport:
    """Every check on every node, the clock offsets, and the verdict."""
    target: str
    fingerprint: str
    checks: list[Check]
    clock: dict[str, dict[str, Any]] = field(default_factory=dict)
    when: str = ""
    phase: str = ""
    reused: bool = False

    @property
    def failed_required(self) -> list[Check]:
        return [c for c in self.checks if c.required and c.result == "failed"]

    @property
    def passed(self) -> bool:
        return not self.failed_required

    @property
    def reason(self) -> str:
        """One line: why the start is refused (empty when it is not)."""
        bad = self.failed_required
        if not bad:
            return ""
        return (f"preflight refused to start on target '{self.target}' (nothing was started): "
                + "; ".join(f"{c.node}: {c.check} — {c.detail}" for c in bad))

    @property
    def table(self):
        return pd.DataFrame([c.row() for c in self.checks], columns=COLUMNS)

    def to_manifest(self) -> dict[str, Any]:
        return {"target": self.target, "fingerprint": self.fingerprint, "when": self.when, "phase": self.phase,
                "passed": self.passed, "reason": self.reason, "checks": [c.row() for c in self.checks],
                "clock": self.clock}

    @classmethod
    def from_manifest(cls, d: dict[str, Any]) -> "PreflightReport":
        checks = [Check(r["node"], r["check"], r["required"] == "yes", r["result"], r["detail"])
                  for r in d.get("checks", [])]
        return cls(d.get("target", ""), d.get("fingerprint", ""), checks, d.get("clock", {}), d.get("when", ""),
                   d.get("phase", ""), reused=True)


def fingerprint(target: Target) -> str:
    """What a preflight result depends on: the nodes, the preflight settings, the port. Launch settings
    (a knob a later phase changes) do not make the nodes any different."""
    body = {"name": target.name, "nodes": [asdict(n) for n in target.nodes], "preflight": target.preflight,
            "port": target.port, "api_host": target.api_host}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the checks, one node each

def _names(key: str, target: Target, node: Node, own: list[str]) -> tuple[list[str], bool]:
    """The names a list-or-true key asks for on this node, and whether the check is required."""
    v = target.preflight.get(key)
    if v is None or v is False:
        return list(own), False
    return (list(own) if v is True else [str(x) for x in v]), True


def check_devices(host: Any, target: Target, node: Node) -> Check:
    required = "devices" in target.preflight
    paths = [str(p) for p in target.preflight.get("devices") or []]
    if not paths:
        if not node.hcas:
            return Check(node.name, "rdma devices", required, "n/a", "no RDMA device declared for this node")
        paths = ["/dev/infiniband/rdma_cm"]
    r = host.run(["stat", "-L", "-c", "%n|%F", "--", *paths], timeout=30)
    found = {ln.split("|", 1)[0]: ln.split("|", 1)[1] for ln in r.stdout.splitlines() if "|" in ln}
    missing = [p for p in paths if p not in found]
    if missing:
        return Check(node.name, "rdma devices", required, "failed",
                     f"missing {', '.join(missing)} ({len(paths) - len(missing)} of {len(paths)} present)")
    return Check(node.name, "rdma devices", required, "ok",
                 f"{len(paths)} present: " + ", ".join(f"{p} ({found[p]})" for p in paths))


_HCA_SCRIPT = ('for h in "$@"; do found=0; for f in /sys/class/infiniband/"$h"/ports/*/state; do '
               '[ -e "$f" ] || continue; found=1; printf "%s|%s|%s\\n" "$h" "$(basename "$(dirname "$f")")" '
               '"$(cat "$f")"; done; [ $found = 1 ] || printf "%s|-|MISSING\\n" "$h"; done')


def check_hcas(host: Any, target: Target, node: Node) -> Check:
    hcas, required = _names("hcas", target, node, node.hcas)
    if not hcas:
        return Check(node.name, "hcas up", required, "n/a", "no HCA declared for this node")
    r = host.run(["sh", "-c", _HCA_SCRIPT, "servelab-preflight", *hcas], timeout=30)
    ports: dict[str, list[tuple[str, str]]] = {h: [] for h in hcas}
    for ln in r.stdout.splitlines():
        parts = ln.split("|")
        if len(parts) == 3 and parts[0] in ports and parts[2] != "MISSING":
            ports[parts[0]].append((parts[1], parts[2].strip()))
    bad, good = [], []
    for h in hcas:
        if not ports[h]:
            bad.append(f"{h}: no such HCA (/sys/class/infiniband/{h} missing)")
        elif not any("ACTIVE" in state for _, state in ports[h]):
            bad.append(f"{h}: no port ACTIVE ({', '.join(f'port {p} {s}' for p, s in ports[h])})")
        else:
            good.append(f"{h} " + ", ".join(f"port {p} {s}" for p, s in ports[h]))
    if bad:
        return Check(node.name, "hcas up", required, "failed", "; ".join(bad + good))
    return Check(node.name, "hcas up", required, "ok", "; ".join(good))


_NET_SCRIPT = ('for d in "$@"; do if [ -e /sys/class/net/"$d" ]; then printf "%s|%s|%s\\n" "$d" '
               '"$(cat /sys/class/net/"$d"/operstate)" "$(cat /sys/class/net/"$d"/flags)"; '
               'else printf "%s|MISSING|0\\n" "$d"; fi; done')


def check_netdevs(host: Any, target: Target, node: Node) -> Check:
    devs, required = _names("netdevs", target, node, node.netdevs)
    if not devs:
        return Check(node.name, "netdevs up", required, "n/a", "no netdev declared for this node")
    r = host.run(["sh", "-c", _NET_SCRIPT, "servelab-preflight", *devs], timeout=30)
    seen = {p[0]: (p[1], p[2]) for p in (ln.split("|") for ln in r.stdout.splitlines()) if len(p) == 3}
    bad, good = [], []
    for d in devs:
        state, flags = seen.get(d, ("MISSING", "0"))
        try:
            up_flag = bool(int(flags, 16) & 0x1)             # IFF_UP
        except ValueError:
            up_flag = False
        if state == "MISSING":
            bad.append(f"{d}: no such device (/sys/class/net/{d} missing)")
        elif state == "up":
            good.append(f"{d} up")
        elif state == "unknown" and up_flag:               # loopback and some virtual devices report no operstate
            good.append(f"{d} administratively up (operstate unknown)")
        else:
            bad.append(f"{d}: operstate {state}{'' if up_flag else ', interface down'}")
    if bad:
        return Check(node.name, "netdevs up", required, "failed", "; ".join(bad + good))
    return Check(node.name, "netdevs up", required, "ok", ", ".join(good))


def check_gpus(host: Any, target: Target, node: Node) -> list[Check]:
    required = bool(target.preflight.get("gpus_idle"))
    q = host.run(["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total",
                  "--format=csv,noheader,nounits"], timeout=60)
    if q.exit_code == 127 or "not found" in q.stderr and not q.stdout:
        if node.gpus > 0:
            detail = f"nvidia-smi not found; the node declares {node.gpus} GPU(s)"
            return [Check(node.name, "gpus visible", required, "failed", detail),
                    Check(node.name, "gpus idle", required, "failed", "cannot tell without nvidia-smi")]
        na = "no nvidia-smi and the node declares gpus: 0 — nothing to check"
        return [Check(node.name, "gpus visible", required, "n/a", na),
                Check(node.name, "gpus idle", required, "n/a", na)]
    if not q.ok:
        err = (q.stderr or q.stdout).strip().splitlines()
        detail = f"nvidia-smi failed (exit {q.exit_code}): {err[0] if err else 'no output'}"
        return [Check(node.name, "gpus visible", required, "failed", detail),
                Check(node.name, "gpus idle", required, "failed", detail)]
    gpus = [ln.split(", ") for ln in q.stdout.strip().splitlines() if ln.strip()]
    if node.gpus and len(gpus) < node.gpus:
        vis = Check(node.name, "gpus visible", required, "failed",
                    f"{len(gpus)} GPU(s) visible, the node declares {node.gpus}")
    else:
        names = sorted({g[1] for g in gpus if len(g) > 1})
        vis = Check(node.name, "gpus visible", required, "ok" if gpus else "n/a",
                    f"{len(gpus)} visible ({', '.join(names) or 'none'}); the node declares {node.gpus}")
    apps = host.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                     "--format=csv,noheader,nounits"], timeout=60)
    procs = [ln.split(", ") for ln in apps.stdout.strip().splitlines() if ln.strip()] if apps.ok else []
    used = [float(g[2]) for g in gpus if len(g) > 2 and g[2].replace(".", "", 1).isdigit()]
    if not apps.ok:
        idle = Check(node.name, "gpus idle", required, "failed", f"nvidia-smi --query-compute-apps failed "
                                                                  f"(exit {apps.exit_code})")
    elif procs:
        idle = Check(node.name, "gpus idle", required, "failed",
                     f"{len(procs)} compute process(es) hold GPUs: " +
                     ", ".join(f"pid {p[1]} {p[2]} ({p[3]} MiB)" for p in procs[:6] if len(p) > 3))
    else:
        idle = Check(node.name, "gpus idle", required, "ok" if gpus else "n/a",
                     f"no compute process; memory used at most {max(used):.0f} MiB per GPU" if used
                     else "no compute process")
    return [vis, idle]


_BIND_PROGRAM = """import socket, sys
for p in sys.argv[1:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT is not 'in use'; a listener is
    try:
        s.bind(("0.0.0.0", int(p)))
        print(p, "free")
    except OSError as e:
        print(p, "busy", e.strerror)
    finally:
        s.close()
"""


def check_ports(host: Any, target: Target, node: Node) -> Check:
    required = "ports_free" in target.preflight
    ports = [int(p) for p in target.preflight.get("ports_free") or []]
    if not ports and target.port and node.name == target.head.name:
        ports = [int(target.port)]
    if not ports:
        return Check(node.name, "ports free", required, "n/a", "no fixed port (the engine's port is picked free "
                                                               "at start)")
    r = host.run(["python3", "-c", _BIND_PROGRAM, *map(str, ports)], timeout=30)
    status: dict[int, str] = {}
    how = "bind test on 0.0.0.0"
    if r.ok:
        for ln in r.stdout.splitlines():
            parts = ln.split(" ", 2)
            if len(parts) >= 2 and parts[0].isdigit():
                status[int(parts[0])] = "free" if parts[1] == "free" else f"in use ({parts[2] if len(parts) > 2 else ''})"
    else:                                                  # no python3 on the node: what is listening
        how = "ss -ltn (no python3 for a bind test)"
        for p in ports:
            s = host.run(["ss", "-ltnH", f"sport = :{p}"], timeout=15)
            status[p] = ("in use (listening)" if s.stdout.strip() else "free") if s.ok else \
                f"unknown (ss exit {s.exit_code})"
    busy = [f"{p} {status.get(p, 'unknown')}" for p in ports if status.get(p) != "free"]
    if busy:
        return Check(node.name, "ports free", required, "failed", f"{'; '.join(busy)} — {how}")
    return Check(node.name, "ports free", required, "ok", f"{', '.join(map(str, ports))} free — {how}")


_DF_SCRIPT = 'd="$1"; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; printf "%s\\n" "$d"; df -Pk -- "$d"'


def check_disk(host: Any, target: Target, node: Node, work_dir: str) -> Check:
    required = "disk_free_gb" in target.preflight
    need = float(target.preflight.get("disk_free_gb", ADVISORY_DISK_FREE_GB))
    r = host.run(["sh", "-c", _DF_SCRIPT, "servelab-preflight", work_dir], timeout=30)
    lines = r.stdout.strip().splitlines()
    try:
        existing = lines[0]
        fields = lines[-1].split()
        free_gb = int(fields[3]) * 1024 / 1e9
    except (IndexError, ValueError):
        return Check(node.name, "disk free", required, "failed",
                     f"df failed for {work_dir} (exit {r.exit_code}): {r.stderr.strip()[:200]}")
    where = work_dir if existing == work_dir else f"{work_dir} (not yet created; on {existing})"
    if free_gb < need:
        return Check(node.name, "disk free", required, "failed",
                     f"{free_gb:.1f} GB free in {where}, below {need:g} GB")
    return Check(node.name, "disk free", required, "ok", f"{free_gb:.1f} GB free in {where} (needs {need:g} GB)")


def clock_vs_local(host: Any, samples: int = CLOCK_SAMPLES) -> dict[str, Any]:
    """The node's clock minus this machine's, in ns, from ``date +%s%N`` round trips: the midpoint of the round
    trip with the shortest duration, give or take half of it (the date ran somewhere inside it)."""
    if getattr(host, "kind", "") == "local":
        return {"offset_ns": 0, "uncertainty_ns": 0, "rtt_ns": 0, "how": "same machine as servelab"}
    best = None
    for _ in range(samples):
        t0 = time.time_ns()
        r = host.run(["date", "+%s%N"], timeout=15)
        t1 = time.time_ns()
        out = r.stdout.strip()
        if not r.ok or not out.isdigit():
            continue
        if best is None or t1 - t0 < best[1] - best[0]:
            best = (t0, t1, int(out))
    if best is None:
        return {"offset_ns": None, "uncertainty_ns": None, "rtt_ns": None, "how": "date +%s%N failed"}
    t0, t1, remote = best
    return {"offset_ns": remote - (t0 + t1) // 2, "uncertainty_ns": (t1 - t0 + 1) // 2, "rtt_ns": t1 - t0,
            "how": f"date +%s%N over the shortest of {samples} round trips"}


def _vs_client(raw: Any) -> dict[str, Any]:
    """``vs_client``: the node's clock minus this machine's (where servelab and its benchmark client run), in ns,
    with its uncertainty and round trip — what a profiled case uses to put the node's trace on the client's clock
    (``measure.capture.case_clock_record``). Empty when it was not measured."""
    if not isinstance(raw, dict) or raw.get("offset_ns") is None:
        return {}
    return {"vs_client": {k: raw[k] for k in ("offset_ns", "uncertainty_ns", "rtt_ns", "how")}}


def clock_checks(target: Target, hosts: dict[str, Any]) -> tuple[list[Check], dict[str, dict[str, Any]]]:
    """Each node's clock offset to the head's, with its uncertainty (both measured against this machine), and each
    node's raw offset to this machine (``vs_client``)."""
    required = "max_clock_offset_ms" in target.preflight
    limit = float(target.preflight.get("max_clock_offset_ms", ADVISORY_CLOCK_OFFSET_MS))
    raw = hostlib.fan_out(hosts.values(), clock_vs_local)
    head = target.head.name
    h = raw.get(head)
    checks, clock = [], {}
    for node in target.nodes:
        c = raw.get(node.name)
        if node.name == head:
            clock[node.name] = {"offset_ms": 0.0, "uncertainty_ms": 0.0, "reference": True, **_vs_client(c)}
            checks.append(Check(node.name, "clock offset", False, "n/a", "the head: the reference clock"))
            continue
        if isinstance(c, BaseException) or isinstance(h, BaseException) or c is None or h is None or \
                c["offset_ns"] is None or h["offset_ns"] is None:
            why = c if isinstance(c, BaseException) else h if isinstance(h, BaseException) else \
                (c or {}).get("how") if (c or {}).get("offset_ns") is None else (h or {}).get("how")
            clock[node.name] = {"offset_ms": None, "uncertainty_ms": None, "error": str(why)}
            checks.append(Check(node.name, "clock offset", required, "failed", f"not measured: {why}"))
            continue
        off = (c["offset_ns"] - h["offset_ns"]) / 1e6
        unc = (c["uncertainty_ns"] + h["uncertainty_ns"]) / 1e6
        clock[node.name] = {"offset_ms": round(off, 3), "uncertainty_ms": round(unc, 3), "vs": head,
                            "how": c["how"], **_vs_client(c)}
        detail = f"{off:+.3f} ms ± {unc:.3f} ms vs {head} ({c['how']})"
        bad = abs(off) + unc > limit
        checks.append(Check(node.name, "clock offset", required, "failed" if bad else "ok",
                            detail + (f"; cannot show it is within {limit:g} ms" if bad else f"; limit {limit:g} ms")))
    return checks, clock


# each node check, the rows it yields, and the preflight key that makes them required
_NODE_CHECKS = ((check_devices, ("rdma devices",), "devices"), (check_hcas, ("hcas up",), "hcas"),
                (check_netdevs, ("netdevs up",), "netdevs"), (check_gpus, ("gpus visible", "gpus idle"), "gpus_idle"),
                (check_ports, ("ports free",), "ports_free"))


def _node_checks(host: Any, target: Target, node: Node, work_dir: str) -> list[Check]:
    out: list[Check] = []
    calls = [(lambda fn=fn: fn(host, target, node), names, key) for fn, names, key in _NODE_CHECKS]
    calls.append((lambda: check_disk(host, target, node, work_dir), ("disk free",), "disk_free_gb"))
    for call, names, key in calls:
        try:
            res = call()
            out += res if isinstance(res, list) else [res]
        except Exception as exc:   # a node that stops answering mid-check fails that check, visibly
            out += [Check(node.name, n, key in target.preflight, "failed", f"could not run: {exc}") for n in names]
    return out


def run_preflight(target: Target, hosts: dict[str, Any], local_work_dir: str | Path = ".",
                  phase: str = "") -> PreflightReport:
    """Every check on every node (in parallel), the clock offsets to the head. Never raises for a failed check:
    the report says what failed; :func:`ensure_preflight` turns a failed required check into a refusal."""
    by_name = {n.name: n for n in target.nodes}

    def one(host: Any) -> list[Check]:
        node = by_name[host.name]
        wd = node.workdir or (str(Path(local_work_dir).resolve()) if node.kind == "local" else ".")
        return _node_checks(host, target, node, wd)

    results = hostlib.fan_out([hosts[n.name] for n in target.nodes], one)
    checks: list[Check] = []
    for node in target.nodes:
        r = results.get(node.name)
        if isinstance(r, BaseException):
            checks.append(Check(node.name, "node reachable", True, "failed", f"{r}"))
        else:
            checks += r or []
    cchecks, clock = clock_checks(target, hosts)
    checks += cchecks
    order = {c: i for i, c in enumerate(CHECKS)}
    checks.sort(key=lambda c: ([n.name for n in target.nodes].index(c.node), order.get(c.check, -1)))
    return PreflightReport(target.name, fingerprint(target), checks, clock, now_iso(), phase)


def cached(run_dir: Path | None, target: Target) -> PreflightReport | None:
    """The passing preflight this run already recorded for this target (same fingerprint), if any."""
    if run_dir is None:
        return None
    rec = read_manifest(Path(run_dir)).get("preflight") or {}
    if rec.get("fingerprint") == fingerprint(target) and rec.get("passed"):
        return PreflightReport.from_manifest(rec)
    return None


def ensure_preflight(target: Target, hosts: dict[str, Any], run_dir: Path | None = None, phase: str = "",
                     local_work_dir: str | Path = ".", force: bool = False) -> PreflightReport | None:
    """Preflight once per run and target: reuse a passing result from the manifest, else run it and record it in
    ``manifest["preflight"]``; raise :class:`PreflightFailed` when a required check failed.

    Without a run directory and with no ``preflight:`` keys nothing is required and nothing can be recorded:
    returns ``None`` without probing."""
    if not force:
        hit = cached(run_dir, target)
        if hit is not None:
            return hit
    if run_dir is None and not target.preflight:
        return None
    report = run_preflight(target, hosts, local_work_dir=run_dir or local_work_dir, phase=phase)
    if run_dir is not None:
        update_manifest(Path(run_dir), preflight=report.to_manifest())
    if not report.passed:
        raise PreflightFailed(report)
    return report
