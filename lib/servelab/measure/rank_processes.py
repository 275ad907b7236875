"""Where each rank of a running engine runs, recorded while it runs: the raw facts placement is built from.

For every engine process that the engine adapter names a rank (``EngineAdapter.rank_of_process``: SGLang's
``sglang::scheduler_TP1``, ``…_PP1_TP0``), on every node: its pid, title, the cores it may run on
(``Cpus_allowed_list`` of ``/proc/<pid>/status``) and the node's NUMA nodes with their cores
(``/sys/devices/system/node/node*/cpulist``). Written as ``rank_processes.json`` beside the capture, before any
analysis (``analyse.topology.placement.cpu_placement_from`` reads it for ranks on CPU). No environment is written:
only the title, which is the process's own name.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from servelab.core.run import now_iso, write_json_atomic
from servelab.deploy.server import RunningServer, engine_processes

FILE = "rank_processes.json"
_NUMA_SCRIPT = ('for n in /sys/devices/system/node/node[0-9]*; do [ -r "$n/cpulist" ] && '
                'echo "${n##*node} $(cat "$n/cpulist")"; done')


def rank_identity(name: str) -> dict[str, int]:
    """``PP1_TP0`` → ``{"pp": 1, "tp": 0}`` (the parallel coordinates an engine's rank name holds)."""
    return {k.lower(): int(v) for k, v in re.findall(r"(TP|PP|DP|EP)(\d+)", name.upper())}


def record_rank_processes(srv: RunningServer, folder: Path) -> Path | None:
    """Read every node's rank processes and NUMA layout and write :data:`FILE` under ``folder``; None (nothing
    written) for an attached server or where no process names a rank. A node that cannot be read is a note."""
    if srv.attached:
        return None
    procs, notes = engine_processes(srv)
    ranks = [p for p in procs if p.get("rank") and p["rank"] != "engine"]
    if not ranks:
        return None
    numa: dict[str, dict[str, str]] = {}
    rows: list[dict[str, Any]] = []
    for p in ranks:
        host = srv.hosts[p["node"]]
        if p["node"] not in numa:
            r = host.run(["sh", "-c", _NUMA_SCRIPT], timeout=30)
            numa[p["node"]] = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln) if r.ok else {}
        cores = ""
        try:
            status = host.read_file(f"/proc/{p['pid']}/status").decode(errors="replace")
            cores = next((ln.split(":", 1)[1].strip() for ln in status.splitlines()
                          if ln.startswith("Cpus_allowed_list:")), "")
        except Exception as exc:  # noqa: BLE001  (a process gone or a node unreadable is a note, not a failure)
            notes.append(f"{p['node']}: /proc/{p['pid']}/status not read ({exc})")
        rows.append({"rank": p["rank"], "identity": rank_identity(p["rank"]), "node": p["node"], "pid": p["pid"],
                     "title": p["title"], "cpus_allowed": cores})
    path = Path(folder) / FILE
    write_json_atomic(path, {"read_at": now_iso(), "ranks": rows, "numa": numa, "notes": notes})
    return path
