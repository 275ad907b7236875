"""Phase 3's evidence-chain sections, kept beside the phase module: where each rank runs, next to the
per-rank verdicts (``analyse.topology.placement``), and the capture's collectives against the communication ceiling
(``analyse.ceiling``). ``phases/phase3_timeline.py`` calls them from its marked hooks."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from servelab.analyse.ceiling import collectives_vs_ceiling
from servelab.analyse.nccl.perf_log import parse_file, runs_frame
from servelab.analyse.topology.placement import cpu_placement_from, gpu_placement, parse_topo_m, shared_placement
from servelab.analyse.trace.analysis import CaptureAnalysis
from servelab.analyse.trace.nccl import comm_ops
from servelab.core.run import read_manifest
from servelab.measure.rank_processes import FILE as RANK_PROCESSES


def _rank_nodes(a: CaptureAnalysis) -> dict[int, str]:
    r = a.ranks
    if r is None or r.height == 0 or "node" not in r.columns:
        return {}
    return {int(k): str(n) for k, n in zip(r["rank"], r["node"]) if k is not None}


def rank_placement(a: CaptureAnalysis, run_dir: Path | None = None) -> pd.DataFrame:
    """Each GPU rank's node, GPU, NUMA node, cores, nearest NIC and PCIe switch (``analyse.topology.placement``) from
    each node's ``nvidia-smi topo -m`` — Phase 0's ``gpu_topology`` fact in the run's manifest, or, for the recorded
    H200 sample, the ``env.txt`` recorded beside its traces. A rank's GPU is its local rank on its node (rank order
    within the node: SGLang's ``base_gpu_id`` 0, ``gpu_id_step`` 1). Ranks on CPU: their process's cores and NUMA
    nodes as recorded while this run's live capture ran. Empty when nothing was recorded."""
    if not a.rops:
        return pd.DataFrame()
    if all(r.device == "cpu" for r in a.rops):
        return _cpu_rank_placement(a, run_dir)
    nodes = _rank_nodes(a)
    hosts = (read_manifest(Path(run_dir)).get("hosts") or {}) if run_dir is not None else {}
    texts = {n: str(f.get("gpu_topology") or "") for n, f in hosts.items() if isinstance(f, dict)}
    env = Path(a.capture.trace_dir).parent / "env.txt"
    if not any(texts.values()) and env.is_file():
        texts = {n: env.read_text(errors="replace") for n in set(nodes.values())}
    topo = {n: parse_topo_m(t) for n, t in texts.items() if t}
    if not topo:
        return pd.DataFrame()
    rank_gpu: dict[int, tuple[str, int]] = {}
    for node in sorted(set(nodes.values())):
        for i, rank in enumerate(sorted(r for r, n in nodes.items() if n == node)):
            rank_gpu[rank] = (node, i)
    out = gpu_placement(topo, rank_gpu)
    out["source"] = out["source"].replace("nvidia-smi topo -m", "nvidia-smi topo -m; GPU = local rank")
    return out


def _cpu_rank_placement(a: CaptureAnalysis, run_dir: Path | None) -> pd.DataFrame:
    """Ranks on CPU: from what Phase 3's live capture recorded while the engine ran
    (``<run>/phase3/rank_processes.json``, ``measure.rank_processes``), for a capture inside this run only (its
    case folders: ``cases/<case>/profiles``)."""
    if run_dir is None:
        return pd.DataFrame()
    rec = Path(run_dir).resolve() / "phase3" / RANK_PROCESSES
    if not rec.is_file() or not Path(a.capture.trace_dir).resolve().is_relative_to(Path(run_dir).resolve()):
        return pd.DataFrame()
    r = a.ranks
    if r is None or r.height == 0 or "rank" not in r.columns:
        return pd.DataFrame()
    ids = {int(row["rank"]): {k: int(row[k]) for k in ("tp", "pp") if row.get(k) is not None}
           for row in r.iter_rows(named=True) if row.get("rank") is not None}
    return cpu_placement_from(json.loads(rec.read_text()), ids)


def placement_finding(a: CaptureAnalysis, placement: pd.DataFrame) -> str | None:
    """The finding when the slow rank(s) — the slow-rank verdict's rank, or the ranks of the slow pipeline stage —
    share a NIC, a NUMA node or a PCIe switch."""
    pl_ = placement
    if pl_.empty:
        return None
    slow = [a.slow_rank["slow_rank"]] if a.slow_rank.get("slow_rank") is not None else []
    stage = a.slow_rank.get("slow_stage")
    if stage is not None and a.ranks is not None and "pp" in a.ranks.columns:
        slow += [int(r) for r, s in zip(a.ranks["rank"], a.ranks["pp"]) if r is not None and s == stage]
    return shared_placement(pl_, dict.fromkeys(slow))


def ceiling_table(a: CaptureAnalysis, run_dir: Path | None = None, phase_dir: Path | None = None
                  ) -> tuple[pd.DataFrame, str]:
    """The capture's collectives against the communication ceiling (``analyse.ceiling``): the curves of this
    run's Phase 5 (``phase5/gloo_sweep.csv`` for ranks on CPU, ``phase5/nccl_tests.csv`` otherwise) when it ran,
    else — for the recorded H200 sample — the nccl-tests log
    recorded beside its traces; without either, the engine's side alone. Written as ``collectives_vs_ceiling.csv``
    (Phase 5 puts its own curves beside it)."""
    curves, source = pd.DataFrame(), ""
    p5 = Path(run_dir) / "phase5" / "nccl_tests.csv" if run_dir is not None else None
    gloo = Path(run_dir) / "phase5" / "gloo_sweep.csv" if run_dir is not None else None
    log = Path(a.capture.trace_dir).parent / "nccl_tests.log"
    if a.rops and all(r.device == "cpu" for r in a.rops):       # gloo collectives: only the gloo sweep compares
        if gloo is not None and gloo.is_file():
            curves, source = pd.read_csv(gloo), "this run's Phase 5 gloo sweep"
    elif p5 is not None and p5.is_file():
        curves, source = pd.read_csv(p5), "this run's Phase 5"
    elif log.is_file():
        curves, source = runs_frame(parse_file(log)), f"the nccl-tests log beside the traces ({log.name})"
    t = collectives_vs_ceiling(comm_ops(a.rops), curves, a.comm_by_collective)
    if phase_dir is not None and not t.empty:
        t.to_csv(Path(phase_dir) / "collectives_vs_ceiling.csv", index=False)
    return t, source
