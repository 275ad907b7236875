"""What do the Phase 2 collectors themselves cost a node? CPU share of one core at their default interval.

Each collector of ``default_collectors`` that can run on this machine is started alone through the same
runner the phases use (``start_telemetry`` on the local host), left running for ``--seconds``, and its CPU
time is read from ``/proc`` just before it is stopped: for every process of its process group,
``utime + stime`` (itself) ``+ cutime + cstime`` (children it has already waited for: ``sar`` forks ``sadc``,
the sampler program runs ``numastat``/``ethtool`` every interval). Overhead = CPU seconds / wall seconds, as a
percentage of one core. Then the whole default set runs together the same way.

In the same run:
- **peer**: sysstat's own data collector ``sadc 1`` (what ``sar`` runs underneath; the usual always-on
  sampler on a node), measured the same way;
- **floor**: reading, in this process, the kernel files the set reads per interval (``/proc/stat``,
  ``/proc/net/dev``, ``/proc/<pid>/task/*/stat`` and ``status`` of the engine stand-in, ``/proc/<pid>/numa_maps``
  every ``slow_interval``), timed with ``time.process_time`` over many rounds — the cost of the data itself
  without any process, fork or formatting.

    python benchmarks/bench_telemetry_overhead.py --seconds 60 --out benchmarks/results/telemetry_overhead_<date>.json

The engine stand-in (the ``pid`` that ``pidstat``/``numastat`` follow) is a sleeping Python process with a
few threads. GPU collectors (nvidia-smi, DCGM) run only where their binaries and a GPU are present; the
result says which collectors ran and which were skipped, and why.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_times(pid: int) -> tuple[int, float] | None:
    """(pgid, own + waited-children CPU seconds) of a live process, from /proc/<pid>/stat."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    # fields[0] is field 3 (state); pgrp = field 5, utime..cstime = fields 14..17
    pgid = int(fields[2])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return pgid, (utime + stime + cutime + cstime) / CLK_TCK


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of every live process in process group ``pgid`` (with the children each has waited for)."""
    total = 0.0
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat_times(int(d))
            if st and st[0] == pgid:
                total += st[1]
    return total


def _standin() -> subprocess.Popen:
    """A sleeping process with 4 threads: what pidstat/numastat follow instead of an engine."""
    code = ("import threading,time\n"
            "for _ in range(4): threading.Thread(target=time.sleep, args=(10**6,), daemon=True).start()\n"
            "time.sleep(10**6)\n")
    return subprocess.Popen([sys.executable, "-c", code])


def _netdevs_with_stats() -> list[str] | None:
    """The first network device whose driver reports ``ethtool -S`` statistics (``lo`` has none)."""
    if not shutil.which("ethtool"):
        return None
    for dev in sorted(os.listdir("/sys/class/net")):
        if dev != "lo" and subprocess.run(["ethtool", "-S", dev], capture_output=True).returncode == 0:
            return [dev]
    return None


def run_collectors(specs: list, seconds: float, work: Path) -> dict:
    """Start ``specs`` together on the local host for ``seconds``; CPU share of each and of all."""
    from servelab.measure.telemetry.runner import NodePlan, RequiredCollectorError, start_telemetry
    from servelab.deploy.hosts import LocalHost
    for s in specs:
        s.required = False
    case = Path(tempfile.mkdtemp(dir=work))
    try:
        session = start_telemetry(case, [NodePlan(LocalHost(), specs, node="local")], grace_s=0.5)
    except RequiredCollectorError as exc:     # not expected: nothing is required here
        return {"error": str(exc)}
    running = [r for r in session.running if r.handle is not None]
    if not running:                           # nothing could start here: no need to wait
        result = session.stop()
        return {"collectors": {}, "not_running": {st.collector: f"{st.status}: {st.reason}"
                                                  for st in result.statuses}, "total_core_pct": 0.0}
    t0 = time.monotonic()
    base = {r.spec.name: group_cpu_s(int(r.handle.pid)) for r in running}
    time.sleep(seconds)
    wall = time.monotonic() - t0
    per = {r.spec.name: group_cpu_s(int(r.handle.pid)) - base[r.spec.name] for r in running}
    result = session.stop()
    statuses = {st.collector: st.status for st in result.statuses}
    return {"wall_s": round(wall, 2),
            "collectors": {n: {"cpu_s": round(c, 3), "core_pct": round(100 * c / wall, 3),
                               "status": statuses.get(n, "")} for n, c in per.items()},
            "not_running": {st.collector: f"{st.status}: {st.reason}" for st in result.statuses
                            if st.collector not in per},
            "total_core_pct": round(100 * sum(per.values()) / wall, 3)}


def run_peer_sadc(seconds: float, work: Path) -> dict:
    """sysstat's ``sadc 1`` writing its binary file, measured the same way (own process group)."""
    sadc = next((p for p in ("/usr/lib/sysstat/sadc", "/usr/lib64/sa/sadc", "/usr/libexec/sysstat/sadc")
                 if Path(p).exists()), None)
    if sadc is None:
        return {"skipped": "sadc not found (Debian package sysstat)"}
    p = subprocess.Popen([sadc, "-S", "ALL", "1", str(work / "sadc.bin")], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        t0, c0 = time.monotonic(), group_cpu_s(p.pid)
        time.sleep(seconds)
        wall, c = time.monotonic() - t0, group_cpu_s(p.pid) - c0
    finally:
        p.terminate()
        p.wait(10)
    return {"argv": ["sadc", "-S", "ALL", "1", "<file>"], "wall_s": round(wall, 2), "cpu_s": round(c, 3),
            "core_pct": round(100 * c / wall, 3)}


def floor_reads(pid: int, rounds: int, slow_every: int = 5) -> dict:
    """In-process cost of reading the kernel files one interval of the set reads (no fork, no formatting)."""
    files_1s = ["/proc/stat", "/proc/net/dev", f"/proc/{pid}/status"]
    tasks = [f"/proc/{pid}/task/{t}/stat" for t in os.listdir(f"/proc/{pid}/task")]
    t0 = time.process_time()
    for i in range(rounds):
        for f in files_1s + tasks:
            with open(f, "rb") as fh:
                fh.read()
        if i % slow_every == 0:
            with open(f"/proc/{pid}/numa_maps", "rb") as fh:
                fh.read()
    per_round = (time.process_time() - t0) / rounds
    return {"files_per_interval": len(files_1s) + len(tasks), "cpu_us_per_interval": round(per_round * 1e6, 1),
            "core_pct_at_1s": round(100 * per_round, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long each measurement runs")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from servelab.measure.telemetry.collectors import default_collectors

    stand = _standin()
    work = Path(tempfile.mkdtemp(prefix="bench-telemetry-"))
    try:
        time.sleep(0.5)
        gpus = 1 if shutil.which("nvidia-smi") else 0
        netdevs = _netdevs_with_stats()

        def specs() -> list:
            return default_collectors(pid=stand.pid, netdevs=netdevs, gpus=gpus, required=[])

        alone = {}
        for s in specs():
            r = run_collectors([s], a.seconds, work)
            alone[s.name] = r["collectors"].get(s.name) or {"skipped": r.get("not_running", {}).get(s.name, "")}
        together = run_collectors(specs(), a.seconds, work)
        peer = run_peer_sadc(a.seconds, work)
        floor = floor_reads(stand.pid, 20000)
    finally:
        stand.kill()
        stand.wait()
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    out = {
        "benchmark": "telemetry_overhead",
        "command": "python benchmarks/bench_telemetry_overhead.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_1m_at_end": round(load[0], 2)},
        "target": "the default set under 1 % of one core per node at the default interval",
        "default_interval_s": 1.0,
        "each_alone": alone,
        "default_set_together": together,
        "peer_sadc": peer,
        "floor_kernel_reads": floor,
        "ratio_set_to_peer": (round(together["total_core_pct"] / peer["core_pct"], 2)
                              if peer.get("core_pct") else None),
        "meets_target": together.get("total_core_pct", 100) < 1.0,
    }
    text = json.dumps(out, indent=2)
    if a.out:
        a.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
