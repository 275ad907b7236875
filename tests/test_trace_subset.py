"""A capture over ``max_capture_gb`` (``analyse.trace.subset``): which ranks are kept (representative, cross-node
traffic), which are left out and why — chosen from the file names before anything is parsed; under the budget every
rank is analysed."""
from __future__ import annotations

import shutil

import polars as pl

from conftest import SAMPLES, read_only_copy
from servelab.analyse.trace.analysis import analyse
from servelab.analyse.trace.subset import plan_subset


def layout(tmp_path, tp_nodes: dict[int, str], pp: int = 2):
    """An SGLang capture folder of TP=len(tp_nodes) × PP=``pp`` rank files, each a copy of a real rank trace
    (``sglang-cpu-pp2``: the subset is chosen from names and sizes only), TP rank t of every stage on
    ``tp_nodes[t]`` (its sub-folder)."""
    src = sorted((SAMPLES / "sglang-cpu-pp2" / "traces").glob("*-TP-0-PP-0.trace.json.gz"))[0]
    pid = src.name.split("-TP-")[0]
    for s in range(pp):
        for t, node in tp_nodes.items():
            (tmp_path / node).mkdir(exist_ok=True)
            shutil.copy(src, tmp_path / node / f"{pid}-TP-{t}-PP-{s}.trace.json.gz")
    return tmp_path


def test_over_the_budget_keeps_first_and_last_tp_rank_per_node_and_stage(tmp_path):
    # TP=4 per stage on one node each; stage 0 on node-a, stage 1 on node-b: cross-node send/recv between stages
    folder = layout(tmp_path, {0: "node-a", 1: "node-a", 2: "node-a", 3: "node-a"})
    for f in (folder / "node-a").glob("*-PP-1.*"):
        (folder / "node-b").mkdir(exist_ok=True)
        f.rename(folder / "node-b" / f.name)
    only, table = plan_subset(folder, 1e-6)
    assert table.height == 8 and table["kept"].sum() == 8           # every rank sends across nodes: all kept
    assert all("cross-node send/recv" in w for w in table["why"])
    # the same ranks with both stages on one node: only the first and last TP rank of each stage are kept
    for f in (folder / "node-b").glob("*"):
        f.rename(folder / "node-a" / f.name)
    only, table = plan_subset(folder, 1e-6)
    kept = table.filter(pl.col("kept"))
    assert sorted(zip(kept["pp"], kept["tp"])) == [(0, 0), (0, 3), (1, 0), (1, 3)] and len(only) == 4
    assert all(w.startswith("representative: first TP rank of node node-a") or
               w.startswith("representative: last TP rank of node node-a") for w in kept["why"])
    dropped = table.filter(~pl.col("kept"))
    assert sorted(zip(dropped["pp"], dropped["tp"])) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(w.startswith("left out:") and "over max_capture_gb=1e-06" in w for w in dropped["why"])
    # under the budget: all analysed
    only, table = plan_subset(folder, 10.0)
    assert only is None and table["kept"].all() and table["why"][0].startswith("under the budget")


def test_a_tp_group_across_nodes_is_kept_whole(tmp_path):
    folder = layout(tmp_path, {0: "node-a", 1: "node-a", 2: "node-a", 3: "node-b", 4: "node-b", 5: "node-b"}, pp=1)
    only, table = plan_subset(folder, 1e-6)
    assert table["kept"].all() and all("cross-node collectives: its TP group (stage 0) spans node-a, node-b" in w
                                       for w in table["why"])


def test_the_analysis_says_which_ranks_it_analysed(tmp_path):
    pp = read_only_copy(SAMPLES / "sglang-cpu-pp2") / "traces"
    a = analyse(pp, cache_dir=tmp_path, max_capture_gb=1e-6)      # two stages, one TP rank each: both kept
    assert a.rank_subset["kept"].all() and len(a.rops) == 2
    assert all(w.startswith("representative: first and last TP rank of node node0, stage ") for w in a.rank_subset["why"])
    whole = analyse(pp, cache_dir=tmp_path)
    assert whole.rank_subset.height == 0 and len(whole.rops) == 2
