"""Nsight Systems: the profile/stats command lines (docs/method.md#capture-scenarios) and the CSV report importer.

There is no nsys on this machine, so the CSV inputs below are written by hand from the column names
documented in the Nsight Systems analysis guide (the ``nsys stats`` reports);
the kernel names are real ones from our H200 trace."""
from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from servelab.analyse.trace import nsys
from servelab.measure import nsys_capture

KERN_SUM = """Generating SQLite file report.sqlite from report.nsys-rep
Processing [report.sqlite] with [/opt/nvidia/nsight-systems/reports/cuda_gpu_kern_sum.py]...

Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name
40.5,46578000,656,71003.0,8544.0,7648,28953322,1120000.5,ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)
17.3,31270000,120,260583.3,217238.0,130000,610000,90000.1,nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT
10.7,19361000,288,67225.7,67163.0,66000,69000,500.2,cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35_16x128x128
3.0,5479000,656,8352.1,8300.0,5000,12000,700.0,"void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>(int, float, c10::BFloat16 const*)"
"""

API_SUM = """Time (%),Total Time (ns),Num Calls,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name
55.0,12000000,842,14251.8,5000.0,3000,900000,40000.0,cudaLaunchKernel
20.0,4400000,28,157142.9,150000.0,120000,250000,30000.0,cudaGraphLaunch
"""

NVTX_SUM_US = """Time (%),Total Time (us),Instances,Avg (us),Med (us),Min (us),Max (us),StdDev (us),Style,Range
60.0,42804.0,208,205.8,150.0,100.0,900.0,80.0,PushPop,ncclAllReduce
40.0,28000.0,4,7000.0,7000.0,6000.0,8000.0,900.0,PushPop,prefill_step
"""


def test_profile_argv_matches_the_method():
    argv = nsys_capture.nsys_profile_argv(["vllm", "serve", "m", "--profiler-config.profiler", "cuda"], "/data/p/dsv4_tp16")
    assert argv[:2] == ["nsys", "profile"]
    for flag in ("--trace=cuda,nvtx,nccl", "--trace-fork-before-exec=true", "--cuda-graph-trace=node",
                 "--capture-range=cudaProfilerApi", "--capture-range-end=repeat"):
        assert flag in argv
    assert argv[argv.index("-o") + 1] == "/data/p/dsv4_tp16"
    assert argv[-5:] == ["vllm", "serve", "m", "--profiler-config.profiler", "cuda"]
    three = nsys_capture.nsys_profile_argv(["python", "-m", "sglang.launch_server"], "out-%n", repeat=3, repeat_mode="defer")
    assert "--capture-range-end=repeat:3:defer" in three
    assert nsys_capture.display(three).startswith("nsys profile --trace=cuda,nvtx,nccl")


@pytest.mark.parametrize("kw, msg", [
    (dict(capture_range="bogus"), "capture_range"), (dict(repeat=0), "repeat=0"),
    (dict(repeat_mode="later", repeat=2), "repeat_mode"), (dict(repeat_mode="defer"), "repeat=N"),
    (dict(capture_range_end="sometimes"), "capture_range_end"), (dict(cuda_graph_trace="edge"), "cuda_graph_trace"),
])
def test_profile_argv_rejects_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        nsys_capture.nsys_profile_argv(["app"], "o", **kw)
    with pytest.raises(ValueError, match="app_argv"):
        nsys_capture.nsys_profile_argv([], "o")


def test_stats_argv():
    argv = nsys_capture.nsys_stats_argv("/r/run1.nsys-rep")
    assert argv[:2] == ["nsys", "stats"] and "--format" in argv and argv[argv.index("--format") + 1] == "csv"
    assert argv[argv.index("--output") + 1] == "/r/run1" and argv[-1] == "/r/run1.nsys-rep"
    assert argv[argv.index("--report") + 1] == "cuda_gpu_kern_sum,cuda_api_sum,nvtx_sum"


def test_read_kernel_summary(tmp_path: Path):
    p = tmp_path / "run1_cuda_gpu_kern_sum.csv"
    p.write_text(KERN_SUM)
    df = nsys.read_stats_csv(p)
    assert df.columns[:9] == ["time_pct", "total_time_ns", "instances", "avg_ns", "med_ns", "min_ns", "max_ns",
                              "stddev_ns", "name"]
    assert df["total_time_ns"].to_list() == [46578000, 31270000, 19361000, 5479000]
    assert df["name"][3].startswith("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, ")
    k = nsys.kernel_summary(df)
    assert k["cls"].to_list() == ["communication", "gemm", "attention", "norm_rope"]
    bd = nsys.class_breakdown(df)
    assert bd["share_pct"].sum() == pytest.approx(100)
    assert bd.filter(pl.col("cls") == "communication")["total_ms"][0] == pytest.approx(46.578)


def test_read_api_and_nvtx_with_units(tmp_path: Path):
    api = tmp_path / "r_cuda_api_sum.csv"
    api.write_text(API_SUM)
    a = nsys.read_stats_csv(api)
    assert dict(zip(a["name"], a["calls"])) == {"cudaLaunchKernel": 842, "cudaGraphLaunch": 28}
    nv = tmp_path / "r_nvtx_sum.csv"
    nv.write_text(NVTX_SUM_US)
    n = nsys.read_stats_csv(nv)
    assert n["total_time_ns"].to_list() == [42_804_000, 28_000_000]      # µs → ns
    assert n["style"].to_list() == ["PushPop", "PushPop"]
    nccl = nsys.nccl_ranges(n)
    assert nccl["name"].to_list() == ["ncclAllReduce"] and nccl["avg_us"][0] == pytest.approx(205.8)
    both = nsys.read_stats_dir(tmp_path)
    assert set(both) == {"cuda_api_sum", "nvtx_sum"}


def test_bad_reports_name_the_file(tmp_path: Path):
    p = tmp_path / "x_cuda_gpu_kern_sum.csv"
    p.write_text("Time (%),Total Time (ns),Instances,Name\n1,2,3,k\n")
    with pytest.raises(nsys.NsysReportError) as e:
        nsys.read_stats_csv(p)
    assert str(p) in str(e.value) and "Avg" in str(e.value)
    q = tmp_path / "y_cuda_api_sum.csv"
    q.write_text(API_SUM.replace("842", "lots"))
    with pytest.raises(nsys.NsysReportError, match="non-numeric"):
        nsys.read_stats_csv(q)
    r = tmp_path / "z.csv"
    r.write_text(API_SUM)
    with pytest.raises(nsys.NsysReportError, match="unknown nsys report"):
        nsys.read_stats_csv(r)
    s = tmp_path / "w_nvtx_sum.csv"
    s.write_text("just some text\n")
    with pytest.raises(nsys.NsysReportError, match="header"):
        nsys.read_stats_csv(s)


def test_phase3_without_nsys_dir_says_how_to_make_the_csvs():
    from servelab.phases import phase3_timeline as phase3
    box = phase3.nsys_view(None).data
    assert "nsys_dir is empty" in box and "nsys stats --report cuda_gpu_kern_sum,cuda_api_sum,nvtx_sum --format csv" in box
    assert "nsys profile --trace=cuda,nvtx,nccl" in box and "-p nsys_dir=" in box


@pytest.mark.slow
def test_phase3_imports_nsys_stats_next_to_the_trace(outputs, tmp_path: Path):
    """Phase 3 with ``-p nsys_dir=``: the documented reports above imported, the nsys kernels matched to the
    recorded H200 trace by function name (the truncated cuDNN name is not in it), the classes on both sides."""
    import pandas as pd

    from servelab.cli import main
    d = tmp_path / "nsys"
    d.mkdir()
    for name, text in (("run1_cuda_gpu_kern_sum.csv", KERN_SUM), ("run1_cuda_api_sum.csv", API_SUM),
                       ("run1_nvtx_sum.csv", NVTX_SUM_US)):
        (d / name).write_text(text)
    assert main(["run", "phase3", "--target", "local-tiny", "--run-id", "nsys", "-p", f"nsys_dir={d}"]) == 0
    p3 = outputs / "nsys" / "phase3"
    k = pd.read_csv(p3 / "nsys_kernels.csv")
    assert k["function"].tolist()[:2] == ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                                          "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"]
    assert k["in_trace"].tolist() == [True, True, False, True] and k["trace_ms"].iloc[:2].gt(0).all()
    assert k["nsys_ms"].iloc[0] == pytest.approx(46.578)
    c = pd.read_csv(p3 / "nsys_classes.csv").set_index("cls")
    assert c.loc["communication", "nsys_share_pct"] == pytest.approx(45.36, abs=0.01)
    assert c["trace_share_pct"].sum() == pytest.approx(100) and pd.isna(c.loc["memory", "nsys_ms"])
    page = (p3 / "report.html").read_text()
    assert "Nsight Systems stats imported" in page and "cuda_api_sum (2 rows)" in page
    bad = tmp_path / "empty"
    bad.mkdir()
    assert main(["run", "phase3", "--target", "local-tiny", "--run-id", "nsys-bad", "-p", f"nsys_dir={bad}",
                 "--no-render"]) != 0
    from servelab.core.run import read_manifest
    err = read_manifest(outputs / "nsys-bad")["phases"]["phase3"]["error"]
    assert "NsysReportError" in err and "cuda_gpu_kern_sum.csv" in err, err


# ------------------------------------------------------------------ real output: one H200, Nsight Systems 2023.4.4
# data/samples/nsys-h200-smoke (README there): `nsys profile` run on the GPU host, `nsys stats` and `nsys recipe`
# run on its report. The numbers asserted are those files' own (nothing here is invented).

H200 = Path(__file__).resolve().parents[1] / "data" / "samples" / "nsys-h200-smoke"


def test_real_stats_reports_import():
    d = nsys.read_stats_dir(H200 / "stats")
    assert sorted(d) == ["cuda_api_sum", "cuda_gpu_kern_sum", "cuda_gpu_trace", "nvtx_gpu_proj_sum", "nvtx_sum",
                         "osrt_sum"]
    k = d["cuda_gpu_kern_sum"]
    assert k["name"][0] == "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT" and k["instances"][0] == 12
    assert k["total_time_ns"][0] == 16330580
    assert d["cuda_gpu_trace"]["device"][0] == "NVIDIA H200 (0)"       # a name, not a number
    osrt = nsys.osrt_summary(d["osrt_sum"], top_n=3)
    assert osrt["name"].to_list() == ["poll", "pthread_cond_timedwait", "clock_nanosleep"]
    assert osrt.filter(pl.col("name") == "clock_nanosleep")["calls"][0] == 12      # the workload's 12 sleeps
    nccl = nsys.nccl_ranges(d["nvtx_sum"])
    assert nccl["name"].to_list() == ["NCCL:ncclAllReduce"] and nccl["instances"][0] == 24
    case = d["nvtx_sum"].filter(pl.col("name").str.starts_with("case:"))
    assert case["name"].to_list() == ["case:N1-h200-smoke"]                       # the capture names its case


def test_real_recipes_nccl_summary_utilisation_overlap():
    r = nsys.read_recipes(H200 / "recipes")
    assert sorted(r) == ["cuda_gpu_time_util_map", "gpu_time_util", "nccl_gpu_proj_sum", "nccl_gpu_time_util_map",
                         "nccl_sum"]
    s = nsys.nccl_summary(r["nccl_sum"])
    assert s.row(0, named=True)["collective"] == "ncclAllReduce" and s["calls"][0] == 24
    assert s["total_ms"][0] == pytest.approx(0.631383)
    g = nsys.nccl_summary(r["nccl_gpu_proj_sum"])
    assert g["calls"][0] == 12 and g["total_ms"][0] == pytest.approx(1.099008)    # the 12 NCCL kernels (AVG)
    u = nsys.gpu_utilisation(r["cuda_gpu_time_util_map"]).row(0, named=True)
    assert u["bins"] == 30 and u["util_mean_pct"] == pytest.approx(17.4133, abs=1e-3)
    assert u["bin_ms"] == pytest.approx(4.330593)
    n = nsys.gpu_utilisation(r["nccl_gpu_time_util_map"]).row(0, named=True)
    assert n["nccl_mean_pct"] == pytest.approx(0.84) and n["compute_mean_pct"] == pytest.approx(16.5667, abs=1e-3)
    o = nsys.nccl_overlap(r["nccl_gpu_time_util_map"]).row(0, named=True)
    assert o["bins_with_nccl"] == 12 and o["both_pct_sum"] == 0 and o["overlap_of_nccl_pct"] == 0
    low = r["gpu_time_util"]["analysis"]
    assert low["in_use_pct"].to_list() == [3.5, 20.0, 27.9] and "duration_ns" in low.columns


def test_recipe_folder_errors_name_it(tmp_path: Path):
    with pytest.raises(nsys.NsysReportError, match="not an nsys recipe output"):
        nsys.read_recipe(tmp_path)
    (tmp_path / "x.nsys-analysis").write_text('{"RecipeName": "nccl_sum"}')
    with pytest.raises(nsys.NsysReportError, match="recipe nccl_sum but none of"):
        nsys.read_recipe(tmp_path)


def test_capture_bound_to_case_planned_then_executed(tmp_path: Path):
    from servelab.core.run import read_commands
    caps = nsys_capture.plan_nsys_captures("N1-h200-smoke", ["node-a", "node-b"], ["python3", "work.py"], "/data/nsys",
                                   trace=("cuda", "nvtx", "osrt"), capture_range_end="stop", sample="none")
    assert [c.report_file for c in caps] == ["/data/nsys/N1-h200-smoke.node-a.nsys-rep",
                                             "/data/nsys/N1-h200-smoke.node-b.nsys-rep"]
    assert caps[0].argv[caps[0].argv.index("-o") + 1] == "/data/nsys/N1-h200-smoke.node-a"
    nsys_capture.record_nsys_captures(tmp_path, "phase3", caps)
    nsys_capture.record_nsys_captures(tmp_path, "phase3", caps)          # planned lines are not repeated
    caps[0].status, caps[0].exit_code, caps[0].start, caps[0].end = "executed", 0, "t0", "t1"
    nsys_capture.record_nsys_captures(tmp_path, "phase3", caps[:1])
    recs = read_commands(tmp_path, "phase3")
    assert [(r.label, r.host) for r in recs] == [("planned", "node-a"), ("planned", "node-b"), ("executed", "node-a")]
    assert recs[2].exit_code == 0 and "N1-h200-smoke.node-a.nsys-rep" in recs[2].note
    with pytest.raises(ValueError, match="names the report file"):
        nsys_capture.plan_nsys_captures("bad id/..", ["n"], ["x"], "/d")
    # the sample's planned argv was made by this module and ran unchanged on the GPU host
    import json
    plan = json.loads((H200 / "planned.json").read_text())
    done = json.loads((H200 / "executed.json").read_text())
    assert done["executed_argv"] == plan["argv"] and done["rc"] == 0
    assert plan["argv"] == nsys_capture.nsys_profile_argv(["python3", "work.py", "--case", "N1-h200-smoke"], "N1-h200-smoke",
                                                  trace=("cuda", "nvtx", "osrt"), capture_range_end="stop",
                                                  sample="none", extra=["--cpuctxsw=none"])


def test_recipe_argv():
    assert nsys_capture.nsys_recipe_argv("nccl_sum", "r.nsys-rep", "out") == [
        "nsys", "recipe", "nccl_sum", "--input", "r.nsys-rep", "--output", "out", "--force-overwrite", "--csv"]
    assert "--csv" not in nsys_capture.nsys_recipe_argv("cuda_gpu_time_util_map", "r.nsys-rep", "out")
    with pytest.raises(ValueError, match="expected one of"):
        nsys_capture.nsys_recipe_argv("nope", "r", "o")


def test_phase3_section_shows_nccl_utilisation_overlap_osrt(tmp_path: Path):
    """Phase 3's Nsight Systems section on the real H200 folder (stats/ and recipes/ beside each other): the NCCL
    summary, GPU utilisation, overlap and OS-runtime tables written and shown (no trace kernels to match here)."""
    from types import SimpleNamespace

    import pandas as pd

    from servelab.phases import phase3_timeline as phase3
    ctx = SimpleNamespace(phase_dir=tmp_path)
    imp = phase3.nsys_import(ctx, SimpleNamespace(analysis=SimpleNamespace(rops=[])), str(H200), top_n=3)
    assert imp.recipes == ["cuda_gpu_time_util_map", "gpu_time_util", "nccl_gpu_proj_sum", "nccl_gpu_time_util_map",
                           "nccl_sum"]
    assert pd.read_csv(tmp_path / "nsys_nccl.csv")["calls"].tolist() == [24]
    assert pd.read_csv(tmp_path / "nsys_gpu_util.csv")["nccl_mean_pct"].tolist() == [0.84]
    assert pd.read_csv(tmp_path / "nsys_overlap.csv")["overlap_of_nccl_pct"].tolist() == [0]
    assert pd.read_csv(tmp_path / "nsys_osrt.csv")["name"].iloc[0] == "poll"
    page = phase3.nsys_view(imp).data
    for caption in ("NCCL summary (recipe nccl_sum", "GPU utilisation (recipe nccl_gpu_time_util_map",
                    "Communication/computation overlap", "OS runtime (osrt_sum"):
        assert caption in page
    assert "Some Nsight Systems reports missing" not in page
