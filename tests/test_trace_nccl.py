"""NCCL forensics: kernel-name parsing across NCCL versions, nccl-tests bus-bandwidth factors, and the
per-collective table on real traces (sizes and bandwidths recomputed here from the JSON args)."""
from __future__ import annotations

import statistics
from pathlib import Path

import polars as pl
import pytest
from plain import plain_trace

from servelab.analyse.trace import nccl as N
from servelab.analyse.trace.load import load_capture, load_trace
from servelab.analyse.trace.ops import prepare_rank


@pytest.mark.parametrize("name, coll, dtype, algo, proto", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "AllReduce", "bf16", "RING", "LL"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "AllGather", None, "RING", "LL"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_TREE_LL(ncclDevKernelArgsStorage<4096ul>)", "ReduceScatter", "f32", "TREE",
     "LL"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "SendRecv", None, None, None),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "AllReduce", "float", "RING",
     "LL"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "SendRecv", "int8_t",
     "RING", "SIMPLE"),
    ("ncclAllReduceRingLLKernel_sum_f32", "AllReduce", "f32", "RING", "LL"),
    ("ncclSymkDevKernel_AllReduce_AGxLLMC_R_sum_bf16", "AllReduce", "bf16", None, None),
    ("cross_device_reduce_1stage<__nv_bfloat16, 8>", "AllReduce", None, None, None),
    ("deep_ep::internode_ll::dispatch<7168>", "Dispatch", None, None, None),
])
def test_parse_comm_names(name, coll, dtype, algo, proto):
    p = N.parse_comm_name(name)
    assert (p["collective"], p["name_dtype"], p["name_algo"], p["name_proto"]) == (coll, dtype, algo, proto)


def test_busbw_factors_are_nccl_tests():
    assert N.busbw_factor("AllReduce", 8) == pytest.approx(2 * 7 / 8)
    assert N.busbw_factor("AllGather", 16) == pytest.approx(15 / 16)
    assert N.busbw_factor("ReduceScatter", 4) == pytest.approx(3 / 4)
    assert N.busbw_factor("AllToAll", 2) == pytest.approx(1 / 2)
    assert N.busbw_factor("SendRecv", 2) == N.busbw_factor("Broadcast", 8) == 1.0
    assert N.busbw_factor("Unknown", 8) is None
    # nccl-tests convention for S: all-gather counts the gathered output
    assert N.message_bytes("AllGather", 1024, 8192, 2) == 16384
    assert N.message_bytes("AllReduce", 1024, 1024, 4) == 4096


def test_h200_forensics_against_json(h200x2: Path, tmp_path: Path):
    cap = load_capture(h200x2 / "traces", cache_dir=tmp_path)
    rops = [prepare_rank(t) for t in cap.ranks]
    f = N.forensics(rops)
    # ground truth: eager NCCL kernels with args, both ranks, grouped by message size
    durs: dict[int, list[float]] = {}
    no_args = 0
    for t in cap.ranks:
        doc = plain_trace(t.path)
        for e in doc["traceEvents"]:
            if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel"):
                a = e["args"]
                if "In msg nelems" in a:
                    assert a["dtype"] == "BFloat16" and a["Group size"] == 2
                    durs.setdefault(a["In msg nelems"] * 2, []).append(round(e["dur"] * 1000))
                else:
                    no_args += 1
    sized = f.filter(pl.col("msg_bytes").is_not_null())
    assert sorted(sized["msg_bytes"].to_list()) == sorted(durs)
    for row in sized.iter_rows(named=True):
        d = sorted(durs[row["msg_bytes"]])
        assert row["count"] == len(d)
        p50 = d[(len(d) + 1) // 2 - 1] if len(d) % 2 else None
        lo = d[0]
        assert row["min_us"] == pytest.approx(lo / 1e3)
        # AllReduce over 2 ranks: busbw = algbw × 2(n−1)/n = algbw
        assert row["busbw_best_gbps"] == pytest.approx(row["msg_bytes"] / lo, rel=1e-9)
        assert row["algbw_p50_gbps"] == pytest.approx(row["msg_bytes"] / (row["p50_us"] * 1e3), rel=1e-9)
        if p50 is not None:
            assert row["p50_us"] * 1e3 == pytest.approx(statistics.median_low(d), abs=1)
    unsized = f.filter(pl.col("msg_bytes").is_null())
    assert unsized["count"].sum() == no_args
    assert unsized["in_graph_pct"].to_list() == [100.0]      # the graph-replayed all-reduces carry no sizes


def test_hta_nccl_data_collectives(thirdparty: Path, tmp_path: Path):
    t = load_trace(thirdparty / "hta/nccl_parser_config/nccl_data.json.gz", cache_dir=tmp_path)
    f = N.forensics([prepare_rank(t)])
    counts = f.group_by("collective").agg(pl.col("count").sum())
    assert dict(counts.iter_rows()) == {"AllReduce": 15, "Broadcast": 6}
    ar = f.filter(pl.col("collective") == "AllReduce")
    assert set(ar["dtype"].to_list()) == {"Float"} and set(ar["group_size"].to_list()) == {2}
    assert (ar["busbw_best_gbps"] > 0).all()
