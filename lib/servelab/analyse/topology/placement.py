"""Where each rank runs: rank → node, GPU, PCI bus, NUMA node, CPU cores, nearest NIC/HCA and PCIe switch, joined from
the node's own outputs, so that a per-rank verdict (slow rank, stage balance, exposed communication per rank) can be
read beside the hardware the rank sits on.

Sources (each optional; a column is ``—`` where no source says it):

- ``nvidia-smi topo -m`` of each node (Phase 0's ``gpu_topology`` fact): per GPU its CPU affinity and NUMA node, and
  its link to every NIC (``PIX`` at most one PCIe bridge, ``PXB`` several bridges without the host bridge, ``PHB``
  through the host bridge, ``NODE`` across host bridges in one NUMA node, ``SYS`` across NUMA nodes; ``NIC Legend``
  names the NICs). A GPU's *nearest NIC* is the NIC(s) at its best link; GPUs whose nearest NICs are reached at
  ``PIX``/``PXB`` sit behind the same PCIe switch as those NICs: the switch is named by them (``switch(mlx5_0,mlx5_1)``);
- NCCL INFO of the engine (``deploy.nccl_info.parse_info``): ``ncclCommInitRank … rank r … cudaDev d … busId b`` →
  the rank's host, CUDA device and PCI bus; its NET channels → the HCA(s) the rank really used;
- on CPU: the rank's process (``/proc/<pid>/status`` ``Cpus_allowed_list``) and the NUMA node of those cores
  (``/sys/devices/system/node/node<N>/cpulist``).

:func:`shared_placement` says when two or more slow ranks share a NIC, a NUMA node or a PCIe switch — the question
"is the slow rank tied to one NIC or NUMA node?" of ``docs/method.md#placement``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from servelab.deploy.nccl_info import NcclInfo

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LINK_ORDER = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}      # nearest first (NVLink cells are GPU-GPU)
SWITCH_LINKS = ("PIX", "PXB")
COLUMNS = ["rank", "node", "GPU", "PCI bus", "NUMA node", "CPU cores", "NIC", "NIC link", "PCIe switch", "HCA used",
           "source"]


@dataclass
class TopoM:
    """One node's ``nvidia-smi topo -m``: per GPU its affinity and nearest NICs; the NIC legend."""
    gpus: pd.DataFrame                      # gpu, cpu_affinity, numa, nearest_nics, nic_link, switch
    nics: dict[str, str] = field(default_factory=dict)       # NIC0 → mlx5_0
    links: dict[tuple[str, str], str] = field(default_factory=dict)   # (GPU0, NIC3) → PXB


def parse_topo_m(text: str) -> TopoM:
    """Parse ``nvidia-smi topo -m`` (the header may carry ANSI underline codes; the NIC legend is optional)."""
    lines = [ANSI.sub("", ln).rstrip("\n") for ln in text.splitlines()]
    nics = {m[1]: m[2] for ln in lines if (m := re.match(r"\s*(NIC\d+):\s*(\S+)", ln))}
    head_i = next((i for i, ln in enumerate(lines) if re.search(r"(^|\t)\s*GPU0\s*(\t|$)", ln)
                   and not ln.lstrip(" ").startswith("GPU0")), None)
    rows: list[dict[str, Any]] = []
    links: dict[tuple[str, str], str] = {}
    if head_i is None:
        return TopoM(pd.DataFrame(columns=["gpu", "cpu_affinity", "numa", "nearest_nics", "nic_link", "switch"]), nics)
    labels = [c.strip() for c in lines[head_i].split("\t") if re.fullmatch(r"(GPU|NIC)\d+", c.strip())]
    for ln in lines[head_i + 1:]:
        cells = ln.split("\t")
        name = cells[0].strip()
        if not re.fullmatch(r"GPU\d+", name):
            if name.startswith("NIC") or not name:
                continue
            break
        vals = [c.strip() for c in cells[1:]]
        for lab, v in zip(labels, vals):
            links[(name, lab)] = v
        rest = [v for v in vals[len(labels):] if v != ""]
        aff = rest[0] if rest else ""
        numa = rest[1] if len(rest) > 1 and rest[1] != "N/A" else ""
        nic_links = {lab: links[(name, lab)] for lab in labels if lab.startswith("NIC") and (name, lab) in links}
        best = min((LINK_ORDER.get(v, 9) for v in nic_links.values()), default=None)
        near = [lab for lab, v in nic_links.items() if best is not None and LINK_ORDER.get(v, 9) == best]
        link = next((v for v in nic_links.values() if LINK_ORDER.get(v, 9) == best), "")
        names = [nics.get(lab, lab) for lab in near]
        rows.append({"gpu": int(name[3:]), "cpu_affinity": aff, "numa": numa, "nearest_nics": names,
                     "nic_link": link, "switch": f"switch({','.join(names)})" if link in SWITCH_LINKS else ""})
    return TopoM(pd.DataFrame(rows, columns=["gpu", "cpu_affinity", "numa", "nearest_nics", "nic_link", "switch"]),
                 nics, links)


def gpu_placement(topo: dict[str, TopoM], rank_gpu: dict[int, tuple[str, int]], info: NcclInfo | None = None
                  ) -> pd.DataFrame:
    """One row per rank (:data:`COLUMNS`): ``rank_gpu`` maps a rank to (node, CUDA device); where NCCL INFO is given,
    its ``ncclCommInitRank`` lines add (or supply) the host, device and PCI bus, and its NET channels the HCAs the
    rank used."""
    rank_gpu = dict(rank_gpu)
    bus: dict[int, str] = {}
    hca: dict[int, str] = {}
    if info is not None and not info.ranks.empty:
        for r in info.ranks.itertuples():
            rank_gpu.setdefault(int(r.rank), (str(r.host), int(r.cuda_dev)))
            bus[int(r.rank)] = str(r.bus_id)
    if info is not None and not info.channels.empty and "hca" in info.channels.columns:
        net = info.channels[info.channels["hca"].notna() & (info.channels["hca"] != "")]
        for rank, g in net.groupby("rank"):
            hca[int(rank)] = ", ".join(sorted(set(map(str, g["hca"]))))
    rows = []
    for rank, (node, dev) in sorted(rank_gpu.items()):
        t = topo.get(node)
        g = t.gpus[t.gpus["gpu"] == dev].to_dict("records") if t is not None else []
        g0 = g[0] if g else {}
        rows.append({"rank": rank, "node": node, "GPU": dev, "PCI bus": bus.get(rank, "—"),
                     "NUMA node": g0.get("numa") or "—", "CPU cores": g0.get("cpu_affinity") or "—",
                     "NIC": ", ".join(g0.get("nearest_nics") or []) or "—", "NIC link": g0.get("nic_link") or "—",
                     "PCIe switch": g0.get("switch") or "—", "HCA used": hca.get(rank, "—"),
                     "source": "nvidia-smi topo -m" + (" + NCCL INFO" if info is not None and rank in bus else "")
                     if g else ("NCCL INFO" if rank in bus else "—")})
    return pd.DataFrame(rows, columns=COLUMNS)


def cpu_numa_of(cores: Iterable[int], node_cpulists: dict[int, str]) -> list[int]:
    """The NUMA nodes that hold ``cores`` (``node_cpulists``: node → its ``cpulist`` text)."""
    want = set(cores)
    return sorted(n for n, text in node_cpulists.items() if want & set(parse_cpulist(text)))


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` → ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out += range(int(a), int(b) + 1)
        elif part.strip():
            out.append(int(part))
    return out


def _cpu_row(rank: Any, node: str, cores: str, node_cpulists: dict[int, str], source: str) -> dict[str, Any]:
    """One placement row of a rank on CPU: its allowed cores and the NUMA nodes that hold them."""
    numa = cpu_numa_of(parse_cpulist(cores), node_cpulists) if cores else []
    return {"rank": rank, "node": node, "GPU": "— (CPU)", "PCI bus": "—", "NUMA node": ",".join(map(str, numa)) or "—",
            "CPU cores": cores or "—", "NIC": "—", "NIC link": "—", "PCIe switch": "—", "HCA used": "—",
            "source": source}


def cpu_placement(processes: list[dict[str, Any]], sys_root: Path = Path("/")) -> pd.DataFrame:
    """Ranks on CPU: one row per rank process (``rank``, ``node``, ``pid``; ``rank`` as the engine names it) with the
    cores it may run on (``/proc/<pid>/status`` ``Cpus_allowed_list``) and their NUMA nodes (``/sys``), read on this
    host."""
    nodes = {int(p.name[4:]): (p / "cpulist").read_text()
             for p in sorted((sys_root / "sys/devices/system/node").glob("node[0-9]*")) if (p / "cpulist").is_file()}
    rows = []
    for p in processes:
        status = sys_root / "proc" / str(p["pid"]) / "status"
        cores = ""
        if status.is_file():
            cores = next((ln.split(":", 1)[1].strip() for ln in status.read_text().splitlines()
                          if ln.startswith("Cpus_allowed_list:")), "")
        rows.append(_cpu_row(p["rank"], p["node"], cores, nodes, f"/proc/{p['pid']}/status + /sys NUMA"))
    return pd.DataFrame(rows, columns=COLUMNS)


def cpu_placement_from(record: dict[str, Any], trace_ranks: dict[int, dict[str, int]]) -> pd.DataFrame:
    """Ranks on CPU from the facts recorded while the engine ran (``measure.rank_processes``): each trace rank
    (``{rank: {"tp": .., "pp": ..}}`` from its file name) matched to the process with the same parallel
    coordinates, with its cores and their NUMA nodes. Ranks without a matching process are left out."""
    def coords(ident: dict[str, int]) -> tuple[int, int]:
        return int(ident.get("tp") or 0), int(ident.get("pp") or 0)

    numa = {node: {int(k): v for k, v in m.items()} for node, m in (record.get("numa") or {}).items()}
    procs = {coords(p["identity"]): p for p in record.get("ranks", [])}
    rows = []
    for rank, ident in sorted(trace_ranks.items()):
        proc = procs.get(coords(ident))
        if proc is not None:
            rows.append(_cpu_row(rank, proc["node"], str(proc.get("cpus_allowed") or ""), numa.get(proc["node"], {}),
                                 f"{proc['title']} (pid {proc['pid']}): /proc status + /sys NUMA, read while it ran"))
    return pd.DataFrame(rows, columns=COLUMNS)


def with_placement(table: pd.DataFrame, placement: pd.DataFrame, on: str = "rank") -> pd.DataFrame:
    """A per-rank table with the placement columns beside it (left join on ``on``; ``—`` where unplaced)."""
    if placement.empty or on not in table.columns:
        return table
    cols = [c for c in COLUMNS if c not in ("rank", "source") and c not in table.columns]
    p = placement[["rank", *cols]].rename(columns={"rank": on})
    try:
        p[on] = p[on].astype(table[on].dtype)
    except (TypeError, ValueError):
        return table
    out = table.merge(p, on=on, how="left")
    out[cols] = out[cols].astype(object).fillna("—")
    out.attrs = dict(table.attrs)
    return out


def with_group_placement(table: pd.DataFrame, placement: pd.DataFrame, on: str = "ranks") -> pd.DataFrame:
    """A table whose rows are groups of ranks (a pipeline stage: ``ranks`` = ``"0,1"``) with where they run beside
    it: per placement column, the distinct values of the group's ranks joined by ``/`` (``—`` where unplaced), so a
    stage on one NUMA node or NIC reads as one value and a stage across two as both."""
    if placement.empty or on not in table.columns or table.empty:
        return table
    by_rank = placement.assign(rank=placement["rank"].astype(str)).set_index("rank")
    cols = [c for c in ("node", "NUMA node", "NIC", "PCIe switch") if c in by_rank.columns]
    out = table.copy()
    for c in cols:
        vals = []
        for group in out[on].astype(str):
            got = [str(by_rank.at[r, c]) for r in group.split(",") if r.strip() in by_rank.index]
            vals.append(" / ".join(dict.fromkeys(got)) if got else "—")
        out[c] = vals
    out.attrs = dict(table.attrs)
    return out


def shared_placement(placement: pd.DataFrame, slow_ranks: Iterable[Any]) -> str | None:
    """One sentence when two or more slow ranks share a NIC, a NUMA node (on one node) or a PCIe switch; ``None``
    when fewer than two slow ranks are placed or they share nothing."""
    slow = [str(r) for r in slow_ranks]
    p = placement.assign(rank=placement["rank"].astype(str))
    p = p[p["rank"].isin(slow)]
    if len(p) < 2:
        return None
    shared = []
    for col, what in (("NIC", "NIC"), ("PCIe switch", "PCIe switch"), ("NUMA node", "NUMA node")):
        vals = {(r["node"], r[col]) for r in p.to_dict("records")}
        if len(vals) == 1 and next(iter(vals))[1] not in ("—", ""):
            node, v = next(iter(vals))
            shared.append(f"{what} {v} on {node}")
    if not shared:
        return None
    return (f"The slow ranks {', '.join(p['rank'])} share {'; '.join(shared)}: look at that resource (its traffic, "
            f"errors, interrupts and memory placement) before at the ranks' own work.")
