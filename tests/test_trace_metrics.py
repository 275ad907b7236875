"""Timeline metrics on real traces against ground truth computed here (plain json + gzip + Python
interval arithmetic) and against the independently computed facts in thirdparty/README.md."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from plain import plain_trace

from servelab.analyse.trace import exposed_comm as E
from servelab.analyse.trace import metrics as M
from servelab.analyse.trace import nccl as N
from servelab.analyse.trace.analysis import analyse
from servelab.analyse.trace.load import load_trace
from servelab.analyse.trace.ops import SYNC_REGEX, matches, prepare_rank

H200_TP0 = ("traces", "20261129203606-TP-0.trace.json.gz")


def _doc(path: Path) -> dict:
    return plain_trace(path)


def _ns(us: float) -> int:
    return round(us * 1000)


def _union(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(iv: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in iv)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    i = j = tot = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


@pytest.fixture(scope="module")
def h200_rank0(h200x2: Path, tmp_path_factory: pytest.TempPathFactory):
    path = h200x2.joinpath(*H200_TP0)
    trace = load_trace(path, cache_dir=tmp_path_factory.mktemp("c"))
    return path, _doc(path), prepare_rank(trace)


# ------------------------------------------------------------------------------- thirdparty README facts

README_FACTS = [
    # file, events, kernels, busy ms, window ms, launchers
    ("tracelens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz", 18221, 1465, 45.433, 49.653,
     {"cudaLaunchKernel": 860, "cudaLaunchKernelExC": 168, "cuLaunchKernel": 1, None: 436}),
    ("tracelens/sglang_decode/sglang_Qwen3-8B_decode.json.gz", 2058, 555, 9.760, 473.741,
     {"hipGraphLaunch": 544, "hipLaunchKernel": 10, "hipModuleLaunchKernel": 1}),
    ("tracelens/sglang_prefilldecode/sglang_Qwen3-8B_prefilldecode.json.gz", 60315, 527, 492.769, 987.276,
     {"hipLaunchKernel": 380, "hipExtModuleLaunchKernel": 145, "hipModuleLaunchKernel": 2}),
    ("hta/nccl_parser_config/nccl_data.json.gz", 40573, 2700, 155.215, 660.551,
     {"cudaLaunchKernel": 2550, "cudaLaunchKernelExC": 150}),
    ("hta/trace_filter/sampled_rank-0.json.gz", 4855, 1154, 547.303, 1222.818, {"cudaLaunchKernel": 1154}),
    ("hta/trace_filter/sampled_rank-1.json.gz", 4720, 1104, 575.496, 1231.182, {"cudaLaunchKernel": 1104}),
]


@pytest.mark.parametrize("rel, events, kernels, busy_ms, window_ms, launchers", README_FACTS,
                         ids=[Path(f[0]).name for f in README_FACTS])
def test_thirdparty_readme_facts(thirdparty: Path, tmp_path: Path, rel, events, kernels, busy_ms, window_ms,
                                 launchers):
    t = load_trace(thirdparty / rel, cache_dir=tmp_path)
    assert t.events.height == events
    r = prepare_rank(t)
    k = r.ops.filter(pl.col("cat") == "kernel")
    assert k.height == kernels
    busy = M.device_busy(r, cats=("kernel",))
    assert busy.height == 1
    assert busy["busy_ms"][0] == pytest.approx(busy_ms, abs=0.0015)
    assert busy["window_ms"][0] == pytest.approx(window_ms, abs=0.0015)
    got = dict(Counter(k["launcher"].to_list()))
    assert got == launchers


def test_sglang_decode_is_one_graph_window(thirdparty: Path, tmp_path: Path):
    """step[DECODE bs=32]: one decode window, bs parsed, 544 of its kernels from hipGraphLaunch."""
    a = analyse(thirdparty / "tracelens/sglang_decode", cache_dir=tmp_path)
    w = a.windows
    assert w["name"].to_list() == ["step[DECODE bs=32]"] and w["kind"].to_list() == ["decode"]
    assert w["bs"].to_list() == [32]
    g = a.graph.row(0, named=True)
    assert g["graph_ops"] == 544 and g["windows_graphed"] == 1
    assert "hipGraphLaunch" in g["launchers"]


def test_prefill_step_window_and_kind(thirdparty: Path, tmp_path: Path):
    a = analyse(thirdparty / "tracelens/sglang_prefilldecode", cache_dir=tmp_path)
    w = a.windows.row(0, named=True)
    assert w["name"] == "step[EXTEND bs=15 toks=15360]" and w["kind"] == "prefill"
    assert (w["bs"], w["toks"]) == (15, 15360)


# ------------------------------------------------------------------------------- H200 against plain json

def test_busy_union_matches_plain_python(h200_rank0):
    path, doc, r = h200_rank0
    base = doc["baseTimeNanoseconds"]
    ops = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    iv = [(base + _ns(e["ts"]), base + _ns(e["ts"]) + _ns(e["dur"])) for e in ops]
    want = _length(_union(iv))
    got = M.device_busy(r)
    assert round(got["busy_ms"][0] * 1e6) == want
    span = max(e for _, e in iv) - min(s for s, _ in iv)
    assert round(got["window_ms"][0] * 1e6) == span


def test_window_spans_equal_kineto_gpu_annotations(h200_rank0):
    """Our CPU-annotation → kernel projection reproduces Kineto's own gpu_user_annotation spans."""
    _, doc, r = h200_rank0
    base = doc["baseTimeNanoseconds"]
    gua = {e["name"]: (base + _ns(e["ts"]), base + _ns(e["ts"] + e["dur"]))
           for e in doc["traceEvents"] if e.get("cat") == "gpu_user_annotation" and not e["name"].startswith("nccl")}
    w = r.windows
    assert w.height == len(gua) == 41
    for row in w.iter_rows(named=True):
        s, e = gua[row["name"]]
        assert abs(row["gpu_start_ns"] - s) <= 2 and abs(row["gpu_end_ns"] - e) <= 2, row["name"]
    kinds = Counter(w["kind"].to_list())
    assert kinds == {"prefill": 4, "decode": 24, "mixed": 13}


def test_exposed_comm_and_gaps_match_plain_python(h200_rank0):
    """Per window: comm union, exposed comm (comm minus compute union) and idle time, recomputed here from
    the JSON with the window's kernels found by correlation → launch call inside the CPU annotation."""
    _, doc, r = h200_rank0
    ev = doc["traceEvents"]
    base = doc["baseTimeNanoseconds"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launch = {e["args"]["correlation"]: base + _ns(e["ts"]) for e in ev
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ann = [e for e in ev if e.get("cat") == "user_annotation" and not e["name"].startswith("nccl")]
    compute = _union([(base + _ns(e["ts"]), base + _ns(e["ts"]) + _ns(e["dur"])) for e in gpu
                      if e["cat"] == "kernel" and not e["name"].startswith("nccl")])
    all_ops = _union([(base + _ns(e["ts"]), base + _ns(e["ts"]) + _ns(e["dur"])) for e in gpu])
    wm = E.window_metrics(r)
    by_name = {row["name"]: row for row in wm.iter_rows(named=True)}
    checked = 0
    for a in ann:
        lo, hi = base + _ns(a["ts"]), base + _ns(a["ts"]) + _ns(a["dur"])
        mine = [e for e in gpu if lo <= launch.get(e["args"]["correlation"], -1) < hi]
        comm = _union([(base + _ns(e["ts"]), base + _ns(e["ts"]) + _ns(e["dur"])) for e in mine
                       if e["name"].startswith("nccl")])
        exposed = _length(comm) - _intersect(comm, compute)
        s0 = min(base + _ns(e["ts"]) for e in mine)
        s1 = max(base + _ns(e["ts"]) + _ns(e["dur"]) for e in mine)
        busy = _intersect(all_ops, [(s0, s1)])
        row = by_name[a["name"]]
        assert round(row["comm_ms"] * 1e6) == _length(comm), a["name"]
        assert round(row["exposed_comm_ms"] * 1e6) == exposed, a["name"]
        assert round(row["busy_ms"] * 1e6) == busy, a["name"]
        assert round(row["idle_ms"] * 1e6) == (s1 - s0) - busy, a["name"]
        checked += 1
    assert checked == 41


def test_gap_categories_follow_launch_times(h200_rank0):
    """Every gap: host_bound ⇔ the op ending it was launched (or still launching) after the GPU went idle."""
    _, doc, r = h200_rank0
    g = M.gap_intervals(r)
    ops = r.ops.sort("ts_ns")
    first_at = {row["ts_ns"]: row for row in ops.iter_rows(named=True)}
    assert g.height > 0
    for row in g.iter_rows(named=True):
        nxt = first_at[row["gap_end_ns"]]
        late = nxt["launch_ts_ns"] > row["gap_start_ns"] or (not nxt["graph"]
                                                              and nxt["launch_end_ns"] > row["gap_start_ns"])
        assert (row["category"] == "host_bound") == late
    # the injected prefill chunk is partly host-bound (> 10 ms of launch wait inside it)
    wm = E.window_metrics(r)
    chunk = wm.filter(pl.col("name") == "mixed_prefill_chunk_8192").row(0, named=True)
    assert chunk["host_bound_idle_ms"] > 10


def test_graph_coverage_on_h200(h200_rank0):
    _, doc, r = h200_rank0
    wm = E.window_metrics(r)
    pct = dict(zip(wm["name"].to_list(), wm["graph_op_pct"].to_list()))
    assert all(pct[f"decode_graph_step_{i}"] == 100.0 for i in range(16))
    assert all(pct[f"decode_eager_step_{i}"] == 0.0 for i in range(8))
    # independent: kernels whose correlation is a cudaGraphLaunch
    ev = doc["traceEvents"]
    graph_corr = {e["args"]["correlation"] for e in ev if e.get("name") == "cudaGraphLaunch"}
    n_graph = sum(1 for e in ev if e.get("cat") == "kernel" and e["args"]["correlation"] in graph_corr)
    assert int(r.ops["graph"].sum()) == n_graph == 3584


def test_top_kernels_and_breakdown_sum(h200_rank0):
    _, doc, r = h200_rank0
    top = M.top_kernels([r], top_n=3)
    assert top.filter(pl.col("kind") == "prefill")["kernel"][0].startswith("ncclDevKernel_AllReduce")
    bd = M.kernel_breakdown([r])
    total = bd["total_ms"].sum()
    ev = doc["traceEvents"]
    want = sum(_ns(e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")) / 1e6
    assert total == pytest.approx(want, abs=1e-6)
    for _kind, g in bd.group_by("kind"):
        assert g["share_pct"].sum() == pytest.approx(100.0)


def test_op_table_names_stay_categorical_and_tables_hand_out_strings(h200_rank0):
    """The op tables of every rank are kept in memory, so name / cat / launcher stay categorical (a code a row,
    not a ~230-byte kernel name); they still hold the trace's names, the tables built from them hand out
    plain strings, and a regex evaluated once per distinct name agrees with re.search on every row."""
    _, doc, r = h200_rank0
    assert [r.ops.schema[c] for c in ("name", "cat", "launcher")] == [pl.Categorical] * 3
    assert r.runtime.schema["name"] == pl.Categorical
    ev = doc["traceEvents"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert Counter(r.ops["name"].to_list()) == Counter(e["name"] for e in gpu)
    assert Counter(r.ops["cat"].to_list()) == Counter(e["cat"] for e in gpu)
    top = M.top_kernels([r], top_n=5)
    assert top.schema["name"] == pl.String and set(top["name"].to_list()) <= {e["name"] for e in gpu}
    comm = N.comm_ops([r])
    assert comm.schema["name"] == pl.String and comm["name"].str.contains("nccl").all()
    gaps = M.gap_intervals(r)
    assert set(gaps["next_op"].drop_nulls().to_list()) <= {e["name"] for e in gpu}
    names = r.runtime["name"].to_list()
    got = r.runtime.select(matches(r.runtime, "name", SYNC_REGEX))["name"].to_list()
    assert got == [bool(re.search(SYNC_REGEX, n)) for n in names] and 0 < sum(got) < len(got)


def test_interference_finds_the_injected_prefill(h200_rank0):
    _, _, r = h200_rank0
    it = M.decode_interference(r)
    worst = it.sort("delay_ms", descending=True).row(0, named=True)
    assert worst["name"] == "mixed_decode_step_4"
    assert worst["prefill_windows"] == "mixed_prefill_chunk_8192"
    w = r.windows.filter(pl.col("name").is_in(["mixed_decode_step_3", "mixed_decode_step_4"])).sort("window")
    assert worst["interval_ms"] == pytest.approx((w["gpu_end_ns"][1] - w["gpu_end_ns"][0]) / 1e6)
    assert worst["delay_ms"] > 10 * worst["baseline_ms"]


def test_user_regex_windows(h200_rank0):
    """A user window regex (only the graph decode steps) replaces the default."""
    _, _, r0 = h200_rank0
    r = prepare_rank(r0.trace, window_regex=r"^decode_graph_step_\d+$")
    assert r.windows.height == 16 and set(r.windows["kind"].to_list()) == {"decode"}
    assert int(r.ops.filter(pl.col("window").is_not_null()).height) == 16 * 128
    with pytest.raises(ValueError, match="invalid"):
        prepare_rank(r0.trace, window_regex="step[")


def test_no_annotations_gives_one_whole_trace_window(thirdparty: Path, tmp_path: Path):
    t = load_trace(thirdparty / "hta/trace_filter/sampled_rank-0.json.gz", cache_dir=tmp_path)
    r = prepare_rank(t, window_regex=r"^no such annotation$")
    assert not r.windows_found and r.windows["kind"].to_list() == ["all"]
    assert r.ops["window"].null_count() == 0


def test_comm_classification_is_broader_than_nccl():
    from servelab.analyse.trace.taxonomy import classify_names
    names = ["cross_device_reduce_1stage<__nv_bfloat16, 8>", "multimem_all_reduce_kernel<bf16>",
             "deep_ep::intranode::dispatch<8>", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
             "ncclSymkDevKernel_AllReduce_AGxLLMC_R_sum_bf16", "allreduce_fusion_kernel_oneshot_lamport<bf16>"]
    got = classify_names(names)
    assert set(got["cls"].to_list()) == {"communication"}
    assert re.search("custom", got["subclass"][0])


def test_comm_per_collective_is_the_per_window_union_summed(h200_rank0):
    """comm_by_collective (one grouped pass) against plain Python over the op table: per (window kind, collective)
    the union of its kernels in each step window, summed over the windows, and the part not under compute."""
    _, _, r = h200_rank0
    rows = r.ops.with_columns(pl.col("name").cast(pl.String)).to_dicts()
    compute = _union([(o["ts_ns"], o["end_ns"]) for o in rows
                      if o["cat"] == "kernel" and o["cls"] != "communication"])
    per: dict[tuple, dict] = {}
    for o in rows:
        if o["cls"] == "communication":
            key = (o["kind"] or "outside steps", N.parse_comm_name(o["name"])["collective"] or "other")
            per.setdefault(key, {}).setdefault(o["window"], []).append((o["ts_ns"], o["end_ns"]))
    want = {}
    for key, windows in per.items():
        unions = [_union(iv) for iv in windows.values()]
        total = sum(_length(u) for u in unions)
        want[key] = (sum(len(iv) for iv in windows.values()), total,
                     total - sum(_intersect(u, compute) for u in unions))
    got = {(x["kind"], x["collective"]): (x["ops"], round(x["comm_ms"] * 1e6), round(x["exposed_ms"] * 1e6))
           for x in M.comm_by_collective([r]).to_dicts()}
    assert got == want and len(want) >= 2, (got, want)


def test_cross_rank_tables_merged_from_each_ranks_share_equal_the_pooled_tables(h200x2: Path):
    """Each rank makes its share of the cross-rank tables (where it is: a cluster worker) and the controller merges
    them: the merged kernel breakdown, top kernels and launch delays equal one pooled group-by over
    every rank's rows — sums, counts, means, ranks per kernel and nearest-rank quantiles alike. Four ranks: the
    real pair and the pair again as ranks 2 and 3, their rows reversed (a share may not depend on row order), a third
    of their ops left out, the rest three times as long and launched 5 µs earlier (a mean of means or a median of
    medians would differ)."""
    from polars.testing import assert_frame_equal

    from servelab.analyse.trace.ops import RankOps
    a = analyse(h200x2 / "traces", cache=False)
    rops = list(a.rops)
    for r in a.rops:
        tr = type(r.trace)(path=r.trace.path, identity=type(r.trace.identity)(**{**vars(r.trace.identity),
                                                                                 "rank": r.rank + 2}),
                           frame=r.trace.frame, meta=r.trace.meta)
        ops = (r.ops.reverse().filter(pl.int_range(pl.len()) % 3 != 0)
               .with_columns(pl.lit(r.rank + 2).alias("rank"), pl.col("dur_ns") * 3, pl.col("launch_ts_ns") - 5000))
        rops.append(RankOps(trace=tr, ops=ops,
                            windows=r.windows, runtime=r.runtime, window_regex=r.window_regex,
                            windows_found=r.windows_found))
    pooled = pl.concat([r.ops for r in rops], how="vertical_relaxed").with_columns(
        pl.col("kind").fill_null("outside steps"))

    def same(x: pl.DataFrame, y: pl.DataFrame, keys: list[str]) -> None:
        assert x.height == y.height > 0
        assert_frame_equal(x.sort(keys).select(y.columns), y.sort(keys), check_dtypes=False, check_exact=False,
                           rel_tol=1e-12, abs_tol=1e-9)

    want = pooled.group_by("kind", "cls").agg((pl.col("dur_ns").sum() / 1e6).alias("total_ms"), pl.len().alias("ops"))
    same(M.kernel_breakdown(rops).drop("share_pct"), want, ["kind", "cls"])
    want = pooled.group_by("kind", "name").agg(pl.len().alias("count"), (pl.col("dur_ns").sum() / 1e6).alias("total_ms"),
                                               (pl.col("dur_ns").mean() / 1e3).alias("avg_us"),
                                               pl.col("rank").n_unique().alias("ranks"))
    got = M.top_kernels(rops, top_n=10**6).select("kind", pl.col("name").cast(pl.String), "count", "total_ms", "avg_us",
                                                   "ranks")
    same(got, want.with_columns(pl.col("name").cast(pl.String)), ["kind", "name"])
    assert set(got["ranks"].to_list()) >= {4}
    d = pooled.filter(pl.col("launch_ts_ns").is_not_null()).with_columns(
        pl.when(pl.col("graph")).then(pl.lit("graph")).otherwise(pl.lit("direct")).alias("launch"),
        (pl.col("ts_ns") - pl.col("launch_ts_ns")).alias("delay_ns"))
    want = d.group_by("kind", "launch").agg(pl.len().alias("ops"),
                                            (pl.col("delay_ns").quantile(0.5, "nearest") / 1e3).alias("p50_us"),
                                            (pl.col("delay_ns").quantile(0.95, "nearest") / 1e3).alias("p95_us"),
                                            (pl.col("delay_ns").max() / 1e3).alias("max_us"))
    same(M.launch_stats(rops), want, ["kind", "launch"])
