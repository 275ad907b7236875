"""Phase 0 facts: what exactly is running on each node, asked with real commands.

Each probe is an argv list run on a host. A probe whose program is absent is ``not present`` (a CPU
host has no nvidia-smi; that is a fact, not a failure). Raw outputs are kept next to the table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.run import redact_env, redact_text


@dataclass(frozen=True)
class Probe:
    fact: str
    argv: tuple[str, ...]
    group: str          # system | gpu | network | software | engine
    summarize: str = "first_line"   # first_line | all | lines:N | regex:<pattern>


PROBES: tuple[Probe, ...] = (
    Probe("hostname", ("hostname",), "system"),
    Probe("kernel", ("uname", "-srm"), "system"),
    Probe("os", ("sh", "-c", ". /etc/os-release && echo \"$PRETTY_NAME\""), "system"),
    Probe("cpu_model", ("sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"), "system"),
    Probe("cpu_count", ("nproc",), "system"),
    Probe("numa", ("sh", "-c", "ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l"), "system"),
    Probe("memory_total", ("sh", "-c", "grep MemTotal /proc/meminfo"), "system"),
    Probe("python", ("python3", "--version"), "software"),
    Probe("gpu_list", ("nvidia-smi", "-L"), "gpu", "all"),
    Probe("gpu_driver", ("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"), "gpu"),
    Probe("gpu_query", ("nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,utilization.gpu,"
                        "clocks.sm,clocks.mem,power.limit,pstate,pci.bus_id", "--format=csv,noheader"), "gpu", "all"),
    Probe("cuda_version", ("sh", "-c", "nvidia-smi | grep -o 'CUDA Version: [0-9.]*'"), "gpu"),
    Probe("nvcc", ("nvcc", "--version"), "gpu", "regex:release ([0-9.]+)"),
    Probe("gpu_topology", ("nvidia-smi", "topo", "-m"), "gpu", "all"),
    Probe("nccl_library", ("sh", "-c", "ldconfig -p | grep -m3 libnccl"), "gpu", "all"),
    Probe("dcgm", ("dcgmi", "--version"), "gpu"),
    Probe("rdma_devices", ("sh", "-c", "ls /sys/class/infiniband 2>/dev/null"), "network", "all"),
    Probe("netdevs", ("ip", "-brief", "link"), "network", "all"),
    Probe("addresses", ("ip", "-brief", "addr"), "network", "all"),
    Probe("docker", ("docker", "--version"), "software"),
    Probe("containers", ("docker", "ps", "--format", "{{.ID}} {{.Image}} {{.Names}} {{.Status}}"), "software", "all"),
)


def _summary(probe: Probe, out: str) -> str:
    out = out.strip()
    if not out:
        return ""
    if probe.summarize == "all":
        return out
    if probe.summarize.startswith("regex:"):
        m = re.search(probe.summarize[6:], out)
        return m.group(1) if m else out.splitlines()[0]
    return out.splitlines()[0].strip()


def collect_facts(host: Any, probes: tuple[Probe, ...] = PROBES, raw_dir: Path | None = None) -> pd.DataFrame:
    """Run every probe on ``host``; one row per fact: node, group, fact, status, value, command, exit code.

    status: ``ok``; ``not present`` (program missing, or nothing to report: e.g. no GPU, no RDMA);
    ``failed`` (the program exists and failed). Raw outputs go to ``raw_dir/<fact>.txt``.
    """
    rows = []
    for p in probes:
        r = host.run(list(p.argv), timeout=30)
        out = redact_text(r.stdout)
        missing = r.exit_code == 127 or "not found" in r.stderr and r.exit_code != 0
        value = _summary(p, out)
        if missing or (r.exit_code != 0 and p.argv[0] in ("nvidia-smi", "dcgmi", "nvcc", "docker")):
            status = "not present"
        elif not value and p.group in ("gpu", "network"):  # e.g. grep/ls found no NCCL, no RDMA device
            status = "not present"
        elif r.exit_code == 0:
            status = "ok"
        else:
            status = "failed"
        if raw_dir is not None:
            raw_dir.mkdir(parents=True, exist_ok=True)
            (raw_dir / f"{p.fact}.txt").write_text(f"$ {' '.join(p.argv)}\n# exit {r.exit_code}\n{out}\n{r.stderr}")
        rows.append({"node": host.name, "group": p.group, "fact": p.fact, "status": status,
                     "value": value if status == "ok" else "-", "command": " ".join(p.argv),
                     "exit_code": r.exit_code})
    return pd.DataFrame(rows)


def nccl_env(env: dict[str, str]) -> pd.DataFrame:
    """The communication variables (NCCL_*, GLOO_*, UCX_*, *_IFNAME) of an environment, redacted."""
    keep = {k: v for k, v in env.items() if k.startswith(("NCCL_", "GLOO_", "UCX_", "NVSHMEM_")) or "IFNAME" in k}
    return pd.DataFrame([{"variable": k, "value": v} for k, v in sorted(redact_env(keep).items())],
                        columns=["variable", "value"])


# ---------------------------------------------------------------- snapshots


def process_snapshot(host: Any) -> pd.DataFrame:
    """Processes on the host: pid, ppid, user, state (``ps`` STAT: ``Z`` = a zombie, exited and waiting to be
    reaped), cpu %, rss MiB, elapsed, command (secrets redacted)."""
    r = host.run(["ps", "-eo", "pid=,ppid=,user=,stat=,pcpu=,rss=,etime=,args="], timeout=30)
    rows = []
    for line in r.stdout.splitlines():
        parts = line.split(None, 7)
        if len(parts) < 8:
            continue
        pid, ppid, user, stat, cpu, rss, etime, args = parts
        rows.append({"node": host.name, "pid": int(pid), "ppid": int(ppid), "user": user, "state": stat,
                     "cpu_pct": float(cpu), "rss_mib": round(int(rss) / 1024, 1), "elapsed": etime,
                     "command": redact_text(args)[:300]})
    return pd.DataFrame(rows, columns=["node", "pid", "ppid", "user", "state", "cpu_pct", "rss_mib", "elapsed",
                                       "command"])


def port_snapshot(host: Any) -> pd.DataFrame:
    """Listening TCP sockets (``ss -ltnH``): address, port, process where visible."""
    r = host.run(["ss", "-ltnpH"], timeout=30)
    rows = []
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        local = parts[3]
        addr, _, port = local.rpartition(":")
        proc = " ".join(parts[5:]) if len(parts) > 5 else ""
        m = re.search(r'\("([^"]+)",pid=(\d+)', proc)
        rows.append({"node": host.name, "address": addr, "port": int(port) if port.isdigit() else port,
                     "process": m.group(1) if m else "", "pid": int(m.group(2)) if m else None})
    return pd.DataFrame(rows, columns=["node", "address", "port", "process", "pid"])


def snapshot_diff(before: pd.DataFrame, after: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    """Rows of ``after`` not in ``before`` (new processes / new listening ports), by ``key``."""
    if before.empty:
        return after
    merged = after.merge(before[key].drop_duplicates(), on=key, how="left", indicator=True)
    return merged[merged["_merge"] == "left_only"].drop(columns="_merge").reset_index(drop=True)


def gguf_facts(path: Path) -> dict[str, Any]:
    """Architecture and sizes from a GGUF file's metadata (no tensors loaded)."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.") or not fld.types:
            continue
        try:
            val = fld.contents()
        except Exception:
            continue
        if isinstance(val, (list, tuple)) and len(val) > 8:
            continue
        out[name] = val
    out["tensor_count"] = len(reader.tensors)
    return out
