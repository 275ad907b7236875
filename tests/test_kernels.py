"""Phase 6: ncu CSV import on real H200 captures (data/samples/ncu, made with ncu 2025.3.1 on the device machine),
on small hand-made CSVs that follow the layouts documented in the Nsight Compute CLI guide ("--csv", "--page
details|raw", "--print-units"), the ncu command builder, and the kernel ranking from real Kineto traces.

Ground truth: FLOPs of the profiled GEMMs follow from the shapes in data/samples/ncu/ncu_toy_layer.py
(2·M·N·K); durations and counters are re-read from the CSV with the plain csv module; trace totals are
recomputed from the raw JSON with a brute-force interval loop."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pandas as pd
import pytest
from plain import plain_trace

from servelab.analyse.kernels import (KernelTableError, NcuFormatError, NcuSpec, default_repro_argv, derived_metrics,
                                      function_base, kernel_table_from_trace, ncu_command, ncu_import_command,
                                      peaks_table, planned_ncu_commands, rank_kernels, read_ncu_csv, roofline,
                                      roofline_figure, stall_reasons, suspect_of, to_base_unit, top_kernels,
                                      top_kernels_figure)
from servelab.deploy.targets import load_target

NCU = Path(__file__).resolve().parents[1] / "data" / "samples" / "ncu"


def sample(name: str) -> Path:
    p = NCU / name
    if not p.is_file():
        pytest.skip(f"real ncu capture {p} not present (made by data/samples/ncu/capture.sh on an H200)")
    return p


def raw_column(path: Path, kernel_id: str, column: str) -> float:
    """Independent reader: the raw page's value of ``column`` for kernel ``kernel_id`` (csv module only)."""
    lines = path.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    col = rows[0].index(column)
    row = next(r for r in rows[2:] if r[0] == kernel_id)
    return float(row[col].replace(",", ""))


# ---------------------------------------------------------------- real captures

def test_real_raw_page_flops_match_gemm_shapes():
    path = sample("h200_toy_layer_raw.csv")
    rep = read_ncu_csv(path)
    assert rep.layout == "raw" and len(rep.kernels) == 27
    d = derived_metrics(rep).set_index("id")
    # the toy layer (ncu_toy_layer.py): 4096 tokens × hidden 4096 → qkv 3·16·128 = 6144, up 2·7168 = 14336
    assert d.loc[1, "function"].startswith("nvjet_sm90")
    assert d.loc[1, "flops_bf16_tensor"] == 2 * 4096 * 4096 * 6144
    # up-projection N = 14336 on 320-wide tiles (nvjet ..._320x128_...): 45 tiles = 14400 columns are executed, and
    # the tensor counter counts the executed MMA work, padding included (+0.45 % over 2·M·N·K)
    assert d.loc[8, "function"].startswith("nvjet_sm90_tst_320x128")
    assert d.loc[8, "flops_bf16_tensor"] == 2 * 4096 * 4096 * 14400
    assert d.loc[11, "flops_bf16_tensor"] == 2 * 4096 * 4096 * 7168        # down-projection, 128-wide tiles: exact
    assert d.loc[5, "flops_bf16_tensor"] == 2 * 4096 * 2048 * 4096          # o-projection: 16·128 → 4096
    assert d.loc[1, "duration_ns"] == raw_column(path, "1", "gpu__time_duration.sum")
    assert d.loc[1, "dram_bytes"] == raw_column(path, "1", "dram__bytes_read.sum") + \
        raw_column(path, "1", "dram__bytes_write.sum")
    assert d.loc[1, "registers_per_thread"] == raw_column(path, "1", "launch__registers_per_thread")
    assert d.loc[1, "tensor_pipe_pct"] > 80 and d.loc[0, "tensor_pipe_pct"] < 1
    roof = roofline(d.reset_index()).set_index("id")
    assert roof.loc[1, "bound"] == "compute" and roof.loc[0, "bound"] == "memory"
    # achieved = flops / time, recomputed here
    assert roof.loc[11, "achieved_tflops"] == pytest.approx(2 * 4096 * 4096 * 7168 / (d.loc[11, "duration_ns"] * 1e-9)
                                                           / 1e12)
    st = stall_reasons(rep)
    first = st[st["id"] == 0].iloc[0]
    assert first["reason"] == "long_scoreboard" and "selected" not in set(st["reason"])
    assert first["value"] == raw_column(path, "0", "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio")
    assert len(roofline_figure(roof.reset_index()).data) >= 2


def test_real_details_page_agrees_with_raw_page_of_the_same_capture():
    raw = derived_metrics(read_ncu_csv(sample("h200_toy_layer_raw.csv"))).set_index("id")
    det_rep = read_ncu_csv(sample("h200_toy_layer_details.csv"))
    assert det_rep.layout == "details" and set(det_rep.kernels["id"]) == set(range(7))
    assert not det_rep.rules.empty and {"SOLBottleneck"} <= set(det_rep.rules["rule"])
    det = derived_metrics(det_rep).set_index("id")
    for q in ("duration_ns", "sm_throughput_pct", "dram_throughput_pct", "l2_hit_rate_pct", "achieved_occupancy_pct",
              "registers_per_thread", "shared_mem_dynamic_bytes", "block_threads", "grid_blocks"):
        assert det[q].tolist() == pytest.approx(raw.loc[det.index, q].tolist()), q
    # ncu's default units (auto-scaled by 1000s: us, Mbyte, Kbyte/block, Ghz) read back to base units
    auto = derived_metrics(read_ncu_csv(sample("h200_toy_layer_details_autounits.csv"))).set_index("id")
    for q in ("duration_ns", "dram_bytes", "shared_mem_dynamic_bytes"):
        assert auto[q].tolist() == pytest.approx(det.loc[auto.index, q].tolist(), rel=2e-3), q


def test_real_direct_output_with_program_output_around_the_table():
    rep = read_ncu_csv(sample("h200_toy_direct_raw.csv"))
    assert any(n.startswith("==PROF== Connected") for n in rep.notes)
    assert rep.kernels["function"].tolist()[:2] == ["vectorized_layer_norm_kernel",
                                                     "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"]


def test_lead_capture_parses_both_pages():
    for name in ("ncu_raw.csv", "ncu_details.csv"):
        rep = read_ncu_csv(sample(name))
        d = derived_metrics(rep)
        assert len(d) == 6 and d["duration_ns"].gt(0).all() and d["achieved_occupancy_pct"].between(0, 100).all()


# ---------------------------------------------------------------- hand-made CSVs (documented layouts)

DETAILS = '''==PROF== Connected to process 7 (/usr/bin/python3)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"
"0","7","python3","h","void k<1>(float*)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","usecond","1.50",
"0","7","python3","h","void k<1>(float*)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","12.5",
"0","7","python3","h","void k<1>(float*)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Memory Workload Analysis","Memory Throughput","Gbyte/second","1,200.00",
"0","7","python3","h","void k<1>(float*)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","n/a",
"0","7","python3","h","void k<1>(float*)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","SpeedOfLight","","","","SOLBottleneck","OPT","Latency issues.","global","40.00"
==PROF== Disconnected from process 7
'''
RAW = '''"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","gpu__time_duration.sum","smsp__sass_thread_inst_executed_op_ffma_pred_on.sum"
"","","","","","","","","","","","Mbyte","msecond",""
"0","7","python3","h","axpy(float*)","1","7","(128, 1, 1)","(4, 1, 1)","0","9.0","2.00","0.01","1,000,000"
"1","7","python3","h","ncclDevKernel_AllReduce(x)","1","7","(128, 1, 1)","(4, 1, 1)","0","9.0","n/a","0.02","0"
'''


def test_handmade_details_layout(tmp_path):
    """Layout per the CLI guide: one row per kernel × metric, rule rows with an empty metric name."""
    rep = read_ncu_csv("details.csv", text=DETAILS)
    assert rep.layout == "details" and rep.notes == ["==PROF== Connected to process 7 (/usr/bin/python3)"]
    m = rep.metrics.set_index("metric")
    assert m.loc["Duration", "value_base"] == 1500.0 and m.loc["Duration", "unit_base"] == "ns"
    assert m.loc["Memory Throughput", "value_base"] == 1.2e12 and m.loc["Memory Throughput", "unit_base"] == "byte/s"
    d = derived_metrics(rep).iloc[0]
    assert d["duration_ns"] == 1500.0 and d["dram_throughput_pct"] == 12.5
    assert pd.isna(d["achieved_occupancy_pct"])                          # "n/a" is missing, never 0
    assert pd.isna(d["memory_throughput_pct"])                           # the MWA byte/s row is not the SOL %
    assert rep.rules.iloc[0][["rule", "speedup_pct"]].tolist() == ["SOLBottleneck", 40.0]


def test_handmade_raw_layout_units_row_and_roofline(tmp_path):
    """Layout per the CLI guide: identity columns then metric columns; the second row holds the units."""
    p = tmp_path / "raw.csv"
    p.write_text(RAW)
    rep = read_ncu_csv(p)
    d = derived_metrics(rep).set_index("id")
    assert d.loc[0, "dram_bytes_read"] == 2e6 and d.loc[0, "duration_ns"] == 1e4
    assert d.loc[0, "flops_fp32"] == 2e6                                  # FFMA = 2 flops
    roof = roofline(d.reset_index()).set_index("id")
    # intensity 2e6 flop / 2e6 B = 1; achieved 2e6 / 10 µs = 0.2 TFLOP/s; roof min(67, 4.8·1) = 4.8 TFLOP/s
    assert roof.loc[0, "intensity_flop_per_byte"] == 1.0
    assert roof.loc[0, "achieved_tflops"] == pytest.approx(0.2)
    assert roof.loc[0, "attainable_tflops"] == pytest.approx(4.8) and roof.loc[0, "bound"] == "memory"
    assert roof.loc[0, "pct_of_roof"] == pytest.approx(0.2 / 4.8 * 100)
    gemm = roofline(d.reset_index(), flops_override={"axpy": 4e9}).set_index("id")
    assert gemm.loc[0, "flops_source"] == "override" and gemm.loc[0, "intensity_flop_per_byte"] == 2000.0


def test_unknown_layouts_fail_clearly(tmp_path):
    with pytest.raises(NcuFormatError, match=r"x.csv: no ncu CSV header.*ncu said: ==ERROR== ERR_NVGPUCTRPERM"):
        read_ncu_csv("x.csv", text="==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM - no permission\n")
    with pytest.raises(NcuFormatError, match="unknown ncu CSV layout"):
        read_ncu_csv("y.csv", text='"ID","Kernel Name","Foo"\n"0","k","1"\n')
    with pytest.raises(NcuFormatError, match="no kernel rows"):
        read_ncu_csv("z.csv", text=DETAILS.splitlines()[1] + "\n")
    with pytest.raises(NcuFormatError, match="no such ncu CSV file"):
        read_ncu_csv(tmp_path / "absent.csv")


@pytest.mark.parametrize("value,unit,expected", [
    (2.0, "Mbyte", (2e6, "byte")), (3.0, "us", (3000.0, "ns")), (3.0, "usecond", (3000.0, "ns")),
    (1.5, "msecond", (1.5e6, "ns")), (1.2, "Tbyte/s", (1.2e12, "byte/s")), (5.0, "byte/second", (5.0, "byte/s")),
    (1.98, "Ghz", (1.98e9, "hz")), (213.19, "Kbyte/block", (213190.0, "byte/block")), (7.0, "%", (7.0, "%")),
    (2.0, "Kinst", (2000.0, "inst")), (1.6, "cycle/nsecond", (1.6e9, "hz")),
])
def test_unit_scaling(value, unit, expected):
    v, u = to_base_unit(value, unit)
    assert (pytest.approx(v), u) == (pytest.approx(expected[0]), expected[1])


# ---------------------------------------------------------------- command builder

def test_ncu_command_argv():
    argv = ncu_command(["python3", "repro.py", "--bs", "1"],
                       NcuSpec(kernel_regex="nvjet_sm90", launch_skip=20, launch_count=3, sections=("SpeedOfLight",),
                               metrics=("dram__bytes.sum",), export="out/k1"))
    assert argv == ["ncu", "--target-processes", "all", "--kernel-name-base", "function", "--kernel-name",
                    "regex:nvjet_sm90", "--launch-skip", "20", "--launch-count", "3", "--section", "SpeedOfLight",
                    "--metrics", "dram__bytes.sum", "--clock-control", "none", "--export", "out/k1",
                    "--force-overwrite", "--csv", "--page", "raw", "--print-units", "base",
                    "python3", "repro.py", "--bs", "1"]
    assert "--profile-from-start" in ncu_command(["a"], NcuSpec(profile_from_start=False))
    assert ncu_import_command("r.ncu-rep", "details") == ["ncu", "--import", "r.ncu-rep", "--csv", "--page", "details",
                                                          "--print-units", "base"]
    with pytest.raises(ValueError, match="clock_control"):
        ncu_command(["a"], NcuSpec(clock_control="max"))
    with pytest.raises(ValueError, match="launch_count"):
        ncu_command(["a"], NcuSpec(launch_count=0))
    with pytest.raises(re.error):
        ncu_command(["a"], NcuSpec(kernel_regex="(unclosed"))
    with pytest.raises(ValueError, match="reproduction"):
        ncu_command([])


# ---------------------------------------------------------------- ranking

def test_rank_and_top_kernels_by_hand():
    frame = pd.DataFrame({
        "name": ["void gemm_a<1>(x)", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", "rms_norm_kernel(x)",
                 "flash_fwd_kernel(x)", "moe_align_block_size(x)", "gemm_a<1>(y)"],
        "class": ["gemm", "communication", "norm_rope", "attention", "moe", "gemm"],
        "total_dur_ns": [6_000_000, 5_000_000, 500_000, 3_000_000, 1_000_000, 1_000],
        "count": [100, 200, 1000, 50, 10, 1],
        "window": ["decode"] * 5 + ["prefill"],
    })
    r = rank_kernels(frame)
    dec = r[r["window"] == "decode"].set_index("function")
    # share of the decode window's 15.5 ms
    assert dec.loc["gemm_a", "share_pct"] == pytest.approx(600 / 15.5)
    assert dec.loc["rms_norm_kernel", "small_kernel"] and dec.loc["rms_norm_kernel", "mean_dur_us"] == 0.5
    assert not dec.loc["ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncu_suitable"]
    assert dec.loc["moe_align_block_size", "suspect"] == "MoE dispatch"
    top = top_kernels(frame, n=2)
    assert top[top["window"] == "decode"]["function"].tolist() == ["gemm_a", "flash_fwd_kernel"]
    # with the critical-path column the exposed time ranks, not the total
    exposed = frame.assign(exposed_dur_ns=[1_000, 5_000_000, 400_000, 3_000_000, 900_000, 1_000])
    t2 = top_kernels(exposed, n=2, window="decode")
    assert t2["function"].tolist() == ["flash_fwd_kernel", "moe_align_block_size"]
    assert (t2["ranked_by"] == "exposed_dur_ns").all()
    with pytest.raises(KernelTableError, match=r"lacks column\(s\) \['count'\]"):
        rank_kernels(frame.drop(columns=["count"]))
    assert len(top_kernels_figure(r).data) >= 3
    assert suspect_of("sm120_fp8_mqa_logits") == "NSA indexer / top-k"
    assert function_base("void at::native::(anonymous namespace)::foo<4>(int)") == "foo"


def test_planned_commands_and_repro():
    t = load_target("example-2node")
    app = default_repro_argv(t)
    assert app[:3] == ["python3", "-m", "sglang.bench_one_batch"] and app[app.index("--tp-size") + 1] == "16"
    frame = pd.DataFrame({"name": ["nvjet_sm90_tst_256x128(x)"], "total_dur_ns": [10], "count": [1],
                          "window": ["prefill"], "class": ["gemm"]})
    cmds = planned_ncu_commands(top_kernels(frame), app, launch_skip=5, launch_count=2, export_dir="/o")
    argv = cmds.iloc[0]["argv"]
    assert argv[argv.index("--kernel-name") + 1] == "regex:nvjet_sm90_tst_256x128"
    assert argv[argv.index("--launch-skip") + 1] == "5" and argv[-len(app):] == app
    assert peaks_table("H200").set_index(["quantity", "kind"]).loc[("dram_bytes_per_s", "spec"), "value"] == 4.8e12


# ---------------------------------------------------------------- kernel table from a real trace

def _independent_window_totals(path: Path) -> dict[str, int]:
    """Plain json: sum of kernel durations (µs → ns) per annotation kind, brute-force containment."""
    doc = plain_trace(path)
    evs = doc["traceEvents"] if isinstance(doc, dict) else doc
    ann = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in evs
           if e.get("cat") == "gpu_user_annotation" and re.search(r"_step_\d+$|prefill_chunk|^step\[", e["name"])]

    def kind(n: str) -> str:
        return "mixed" if "mixed" in n else "prefill" if ("prefill" in n or "EXTEND" in n) else "decode"
    out: dict[str, float] = {}
    for e in evs:
        if e.get("cat") != "kernel":
            continue
        w = next((kind(n) for s, t, n in ann if s <= e["ts"] < t), "unannotated")
        out[w] = out.get(w, 0.0) + e["dur"] * 1000
    return out


def test_kernel_table_from_real_traces(h200x2):
    for path in (h200x2 / "traces" / "20261129203606-TP-0.trace.json.gz",
                 NCU.parent / "h200x2-pp2" / "traces" / "20261129215256-TP-0-PP-0.trace.json.gz"):
        if not path.is_file():
            continue
        table = kernel_table_from_trace(path)
        got = table.groupby("window")["total_dur_ns"].sum().to_dict()
        want = _independent_window_totals(path)
        assert set(got) == set(want)
        for w in want:
            assert got[w] == pytest.approx(want[w], rel=1e-6, abs=int(table["count"].sum())), (path.name, w)
        top = top_kernels(table, n=3)
        assert (top["ncu_suitable"]).all() and top.groupby("window").size().max() <= 3
