"""Placement beside the per-rank verdicts, from real outputs: a public 8-GPU/10-HCA ``nvidia-smi topo -m``
(tests/data/topo), our own 2 × H200 ``topo -m`` and NCCL INFO (data/samples/h200x2) and the Phase 3 analysis of our
H200 traces; two slow ranks behind one PCIe switch and NIC produce the finding, two on different NUMA nodes do not."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from servelab.analyse.topology.placement import (gpu_placement, parse_cpulist, parse_topo_m, shared_placement,
                                                 with_placement, cpu_placement)
from servelab.deploy.nccl_info import parse_info

ROOT = Path(__file__).resolve().parents[1]
TOPO8 = ROOT / "tests" / "data" / "topo" / "topo_m_8gpu_10nic.txt"
H200 = ROOT / "data" / "samples" / "h200x2"


def test_public_topo_m_gives_numa_nic_and_switch_per_gpu():
    t = parse_topo_m(TOPO8.read_text())
    g = t.gpus.set_index("gpu")
    assert list(g.index) == list(range(8)) and len(t.nics) == 10 and t.nics["NIC9"] == "mlx5_9"
    assert (g.loc[0, "numa"], g.loc[0, "cpu_affinity"]) == ("3", "48-63,176-191")
    assert g.loc[0, "nearest_nics"] == ["mlx5_0", "mlx5_1"] and g.loc[0, "nic_link"] == "PXB"
    assert g.loc[1, "switch"] == g.loc[0, "switch"] == "switch(mlx5_0,mlx5_1)"
    assert g.loc[6, "nearest_nics"] == ["mlx5_6", "mlx5_7"] and g.loc[6, "numa"] == "5"
    assert t.links[("GPU2", "NIC3")] == "PXB" and t.links[("GPU2", "NIC0")] == "SYS"


def test_our_h200_topo_and_nccl_info_place_each_rank():
    t = parse_topo_m((H200 / "env.txt").read_text())         # ANSI-underlined header, no NIC columns (a VM)
    assert t.gpus[["gpu", "numa", "cpu_affinity"]].values.tolist() == [[0, "0", "0-31"], [1, "0", "0-31"]]
    info = parse_info((H200 / "nccl_info.log").read_text())
    placed = gpu_placement({"vm": t}, {}, info).set_index("rank")
    assert placed.loc[0, ["node", "GPU", "PCI bus", "NUMA node"]].tolist() == ["vm", 0, "60", "0"]
    assert placed.loc[1, ["GPU", "PCI bus", "NIC"]].tolist() == [1, "70", "—"]
    assert placed.loc[1, "source"] == "nvidia-smi topo -m + NCCL INFO"


def test_two_slow_ranks_sharing_a_nic_are_a_finding():
    topo = {"node3": parse_topo_m(TOPO8.read_text())}
    placed = gpu_placement(topo, {r: ("node3", r) for r in range(8)})
    text = shared_placement(placed, [0, 1])
    assert text is not None and text.startswith("The slow ranks 0, 1 share NIC mlx5_0, mlx5_1 on node3; "
                                                "PCIe switch switch(mlx5_0,mlx5_1) on node3; NUMA node 3 on node3")
    assert shared_placement(placed, [0, 2]) is None                   # different NIC, switch and NUMA node
    assert shared_placement(placed, [4]) is None                      # one slow rank shares nothing
    verdicts = pd.DataFrame({"rank": [0, 1, 2], "late_pct": [80.0, 78.0, 5.0]})
    side = with_placement(verdicts, placed)
    assert side.columns[:2].tolist() == ["rank", "late_pct"] and side["NIC"].tolist()[:2] == ["mlx5_0, mlx5_1"] * 2
    assert side["NUMA node"].tolist() == ["3", "3", "1"]


def test_cpu_ranks_are_placed_from_proc_and_sys():
    import os
    placed = cpu_placement([{"rank": "TP0", "node": "local", "pid": os.getpid()}])
    row = placed.iloc[0]
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cpulist(row["CPU cores"]) == allowed
    assert row["NUMA node"] != "" and row["GPU"] == "— (CPU)"
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]


def test_phase3_places_the_h200_sample_ranks_beside_the_slow_rank_table(tmp_path):
    import polars as pl
    from servelab.analyse.trace.analysis import analyse
    from servelab.report.evidence_section import placement_finding, rank_placement
    from servelab.phases.phase3_timeline import Phase3, alignment_table
    p = Phase3(analyse(H200 / "traces", cache_dir=tmp_path / "c"), pl.DataFrame(), pl.DataFrame(), {})
    p.rank_placement = rank_placement(p.analysis)        # the sample's env.txt: our own topo -m of that machine
    assert p.rank_placement[["rank", "node", "GPU", "NUMA node", "CPU cores"]].values.tolist() == \
        [[0, "node0", 0, "0", "0-31"], [1, "node0", 1, "0", "0-31"]]
    t = alignment_table(p)
    assert {"NUMA node", "NIC", "PCIe switch"} <= set(t.columns) and t["NUMA node"].tolist() == ["0", "0"]
    assert placement_finding(p.analysis, p.rank_placement) is None      # no fixed slow rank in this capture


def test_cpu_ranks_from_the_facts_recorded_while_the_engine_ran():
    """Trace ranks matched to the engine's rank processes by their TP/PP coordinates (SGLang's titles), cores to
    NUMA nodes by the node's cpulists; the stage table reads the placement of its ranks as one value per column."""
    from servelab.analyse.topology.placement import cpu_placement_from, with_group_placement
    from servelab.measure.rank_processes import rank_identity
    assert rank_identity("PP1_TP0") == {"pp": 1, "tp": 0} and rank_identity("TP3") == {"tp": 3}
    record = {"numa": {"local": {"0": "0-3", "1": "4-7"}},
              "ranks": [{"rank": "PP0_TP0", "identity": {"pp": 0, "tp": 0}, "node": "local", "pid": 11,
                         "title": "sglang::scheduler_PP0_TP0", "cpus_allowed": "0-1"},
                        {"rank": "PP1_TP0", "identity": {"pp": 1, "tp": 0}, "node": "local", "pid": 12,
                         "title": "sglang::scheduler_PP1_TP0", "cpus_allowed": "4"}]}
    placed = cpu_placement_from(record, {0: {"pp": 0, "tp": 0}, 1: {"pp": 1, "tp": 0}, 2: {"pp": 2, "tp": 0}})
    assert placed[["rank", "NUMA node", "CPU cores"]].values.tolist() == [[0, "0", "0-1"], [1, "1", "4"]]
    assert placed["source"].iloc[1].startswith("sglang::scheduler_PP1_TP0 (pid 12)")
    stages = pd.DataFrame({"stage": [0, 1, 0], "ranks": ["0", "1", "0,1"]})
    side = with_group_placement(stages, placed)
    assert side["NUMA node"].tolist() == ["0", "1", "0 / 1"] and side["node"].tolist() == ["local"] * 3
    assert with_group_placement(stages, pd.DataFrame()) is stages
