"""The memory layer (``servelab.analyse.memory``) on real engine output (``tests/data/memory``,
``tests/data/serverside``): each quantity from the source that holds it, checked against the raw numbers read here
by hand, and ``not exposed`` where the engine gives none."""
from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from servelab.analyse.memory import (case_memory, log_memory, memory_breakdown, memory_events, memory_table,
                                     metric_memory, scheduler_memory, trace_memory)
from servelab.deploy.engines import engine_for
from servelab.measure.engine_metrics import label_key, parse_text

DATA = Path(__file__).parent / "data"
MEM = DATA / "memory"
CASE = MEM / "sglang_cpu_case" / "D1"
GIB = 2**30


def _series(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame.loc[frame["name"] == name, "value"]


def test_sglang_case_from_its_metrics_and_start_up_log():
    frame = pd.read_parquet(CASE / "server" / "metrics.parquet")
    startup = (MEM / "sglang_cpu_startup.log").read_text()
    row = case_memory(CASE, startup_log=startup, definition="vllm")
    summary = json.loads((CASE / "summary.json").read_text())
    assert row["output_tps"] == summary["metrics"]["vllm"]["output_throughput"]
    # constants SGLang 0.5.23 sets once at start: one value in every scrape
    assert row["weights_gib"] == _series(frame, "sglang:weight_memory_usage_gb").iloc[0]
    assert row["kv_pool_tokens"] == 32768 == _series(frame, "sglang:max_total_num_tokens").max()
    assert row["kv_pool_gib"] == _series(frame, "sglang:kv_cache_memory_usage_gb").iloc[0] == pytest.approx(1 / 16, 1e-4)
    assert row["graphs_gib"] == 0.0
    # peaks over the case's scrapes
    assert row["kv_used_peak_tokens"] == _series(frame, "sglang:kv_used_tokens").max() == 115
    assert row["kv_held_peak_tokens"] == 32768 - _series(frame, "sglang:kv_available_tokens").min() == 6465
    # the gauge is rounded to 0.01 by SGLang (0.00 here): the peak against the pool comes from the token counts
    assert _series(frame, "sglang:token_usage").max() == 0.0
    assert row["kv_usage_peak_pct"] == pytest.approx(100 * 115 / 32768)
    assert row["sources"]["kv_used_peak_tokens"] == "sglang:kv_used_tokens (/metrics gauge, highest of the case's scrapes)"
    for k in ("workspace_peak_gib", "allocated_peak_gib", "reserved_peak_gib", "fragmentation_pct"):
        assert row[k] is None and k not in row["sources"]


def test_sglang_start_up_lines_and_scheduler_lines():
    sg = engine_for("sglang")
    startup = (MEM / "sglang_cpu_startup.log").read_text()
    got = log_memory(startup, sg)
    assert got["weights_gib"][0] == 0.0                          # "Load weight end. ... mem usage=0.00 GB."
    # on CPU the figure is a difference of free memory: another start of the same engine printed it negative
    earlier = log_memory((MEM / "sglang_cpu_startup_earlier.log").read_text(), sg)
    assert earlier["weights_gib"][0] == -0.03 and earlier["kv_pool_tokens"][0] == 32768
    assert got["kv_pool_tokens"][0] == 32768                     # "KV Cache is allocated. dtype: ..., #tokens: 32768"
    assert got["kv_pool_gib"][0] == pytest.approx(0.06)          # K size 0.03 GB + V size 0.03 GB
    assert got["kv_pool_tokens"][1].startswith('engine log: "KV Cache is allocated. dtype: torch.float32, #tokens: 32768')
    assert "graphs_gib" not in got                               # no CUDA graph on CPU
    excerpt = (CASE / "server" / "engine_log_excerpt.txt").read_text()
    by_hand = [int(m.group(1)) for m in re.finditer(r"Decode batch, .*?#token: (\d+)", excerpt)]
    sched = scheduler_memory(excerpt, sg)
    assert by_hand and sched["kv_used_peak_tokens"][0] == max(by_hand)
    # the memory breakdown of Phase 1/8 now reads the 0.5.23 KV line too (it carries the dtype before #tokens)
    mb = memory_breakdown(startup, sg).set_index("component")
    assert mb.loc["KV cache", "detail"] == "tokens=32768" and mb.loc["weights", "mib"] == 0.0


def _frame_from_prom(text: str) -> pd.DataFrame:
    """A scrape as the case scraper stores it (``engine_metrics.Scraper``: one row per sample)."""
    return pd.DataFrame([{"ts_ns": 1, "wall_ns": 1, "name": s["name"], "labels": label_key(s["labels"]),
                          "value": s["value"], "type": s["type"]} for s in parse_text(text)])


def test_vllm_pool_from_its_cache_config_labels_and_its_log():
    vl = engine_for("vllm")
    frame = _frame_from_prom((DATA / "serverside" / "vllm_cpu_metrics_under_load.prom").read_text())
    got = metric_memory(frame, vl)
    assert got["kv_pool_tokens"][0] == 524288 and got["kv_pool_gib"][0] == 1.0       # 1073741824 bytes
    assert got["kv_usage_peak_pct"][0] == pytest.approx(100 * 0.00146520146520146)
    log = log_memory((DATA / "serverside" / "vllm_cpu_server.log").read_text(), vl)
    assert log["kv_pool_tokens"][0] == 524288 and log["kv_pool_gib"][0] == 1.0       # "(1.0/16.59) GiB"
    assert "weights_gib" not in log and "workspace_peak_gib" not in log


def test_llamacpp_buffers_at_lv4_and_nothing_at_the_default_level():
    lc = engine_for("llamacpp")
    got = log_memory((MEM / "llamacpp_lv4_startup.log").read_text(), lc)
    assert got["weights_gib"][0] == pytest.approx(0.49 / 1024)            # CPU_Mapped model buffer size = 0.49 MiB
    assert got["kv_pool_gib"][0] == pytest.approx(2.00 / 1024)            # llama_kv_cache: size = 2.00 MiB
    assert got["kv_pool_tokens"][0] == 1024 * 4                           # 1024 cells, 4/4 seqs (= -c 4096)
    assert got["workspace_peak_gib"][0] == pytest.approx(2.01 / 1024)     # CPU compute buffer size = 2.01 MiB
    assert log_memory((DATA / "serverside" / "llamacpp_server.log").read_text(), lc) == {}


# the memory breakdown (Phase 1's and Phase 8's table) on each fixture, as the page shows it: component, device, MiB,
# detail (pinned from the breakdown as it was before it shared log_memory's reader)
BREAKDOWNS = {
    ("llamacpp", MEM / "llamacpp_lv4_startup.log"): [
        ("model (breakdown)", "Host", 0.0, "total 4 MiB"), ("context (breakdown)", "Host", 2.0, "total 4 MiB"),
        ("compute (breakdown)", "Host", 2.0, "total 4 MiB"), ("model buffer", "CPU_Mapped", 0.49, ""),
        ("KV cache", "-", 2.0, "1024 cells per sequence, 2 layers, 4/4 seqs, K f16 1.00 MiB, V f16 1.00 MiB"),
        ("output buffer", "CPU", 0.01, ""), ("compute buffer", "CPU", 2.01, "")],
    ("sglang", MEM / "sglang_cpu_startup.log"): [("weights", "-", 0.0, "mem_gb=0.00"),
                                                 ("KV cache", "-", None, "tokens=32768")],
    ("sglang", MEM / "sglang_cpu_startup_earlier.log"): [("weights", "-", -0.03 * 1024, "mem_gb=-0.03"),
                                                         ("KV cache", "-", None, "tokens=32768")],
    ("vllm", DATA / "serverside" / "vllm_cpu_server.log"): [("KV cache", "-", None, "tokens=524,288")],
    ("llamacpp", DATA / "serverside" / "llamacpp_server.log"): [
        ("all", "-", None, "not exposed in the engine log (llama.cpp prints it at -lv 4)")],
}


@pytest.mark.parametrize("engine,log", list(BREAKDOWNS), ids=[f"{e}-{p.stem}" for e, p in BREAKDOWNS])
def test_the_breakdown_and_the_quantities_read_the_same_start_up_lines(engine, log):
    """One reader of the start-up lines (``startup_lines``): the breakdown table is what it was, and where it and
    the memory layer's quantities name the same figure they give the same number."""
    adapter = engine_for(engine)
    text = log.read_text()
    mb = memory_breakdown(text, adapter)
    assert mb.columns.tolist() == ["component", "device", "mib", "detail", "line"]
    got = [(r.component, r.device, None if r.mib is None or pd.isna(r.mib) else r.mib, r.detail)
           for r in mb.itertuples()]
    assert got == [(c, d, pytest.approx(m) if m is not None else None, x) for c, d, m, x in BREAKDOWNS[(engine, log)]]
    assert all(line in text for line in mb["line"])
    q = log_memory(text, adapter)
    rows = mb.set_index("component")
    if "weights" in rows.index:                                          # SGLang: "mem usage=X GB"
        assert rows.loc["weights", "mib"] == pytest.approx(q["weights_gib"][0] * 1024)
    if "model buffer" in rows.index:                                     # llama.cpp: per device buffers, summed
        assert rows.loc[["model buffer"], "mib"].sum() == pytest.approx(q["weights_gib"][0] * 1024)
        assert rows.loc[["compute buffer"], "mib"].sum() == pytest.approx(q["workspace_peak_gib"][0] * 1024)
    if "KV cache" in rows.index:
        kv = rows.loc["KV cache"]
        if engine == "llamacpp":
            assert kv["mib"] == pytest.approx(q["kv_pool_gib"][0] * 1024)
            cells, seqs = re.match(r"(\d+) cells per sequence, .*?(\d+)/\d+ seqs", kv["detail"]).groups()
            assert int(cells) * int(seqs) == q["kv_pool_tokens"][0]
        else:
            assert float(kv["detail"].removeprefix("tokens=").replace(",", "")) == q["kv_pool_tokens"][0]
    if engine == "llamacpp" and "all" in rows.index:
        assert q == {}


def test_allocated_and_reserved_from_a_real_cuda_capture():
    trace = MEM / "cuda_memory_trace.json.gz"
    stats = json.loads((MEM / "memory_stats.json").read_text())["after_capture"]
    ev = memory_events(trace)
    assert len(ev) == 34 and set(ev["device_type"]) == {1}
    got = trace_memory([trace])
    # the events' highest totals are the allocator's own peaks over the capture
    assert got["allocated_peak_gib"][0] * GIB == stats["allocated_bytes.all.peak"] == 87072768
    assert got["reserved_peak_gib"][0] * GIB == stats["reserved_bytes.all.peak"] == 111149056
    raw = json.load(gzip.open(trace))["traceEvents"]
    at_peak = max((e["args"] for e in raw if e.get("name") == "[memory]"), key=lambda a: a["Total Allocated"])
    assert got["fragmentation_pct"][0] == pytest.approx(
        100 * (at_peak["Total Reserved"] - at_peak["Total Allocated"]) / at_peak["Total Reserved"])
    assert "device cuda:0" in got["fragmentation_pct"][1]


def test_table_beside_throughput_with_sources_and_not_exposed(tmp_path):
    """The SGLang case, and the same case with the CUDA capture placed as its profiled sibling
    (``<case>--profile-*``) to exercise the lookup of a case's captures."""
    cases = tmp_path / "cases"
    shutil.copytree(CASE, cases / "D1")
    shutil.copytree(CASE, cases / "D2")
    prof = cases / "D2--profile-decode" / "profiles" / "local"
    prof.mkdir(parents=True)
    shutil.copy(MEM / "cuda_memory_trace.json.gz", prof / "trace.json.gz")
    table, sources = memory_table([cases / "D1", cases / "D2", tmp_path / "nope"], "vllm",
                                  startup_log=(MEM / "sglang_cpu_startup.log").read_text())
    t = table.set_index("case")
    assert list(t.index) == ["D1", "D2"] and list(table.columns[:3]) == ["case", "output TPS (tok/s)", "validity"]
    # the recorded verdict beside the TPS (this real case's client fell behind): never an unmarked INVALID row
    assert (t["validity"] == "INVALID").all()
    assert t.loc["D1", "KV pool (tokens)"] == 32768 and t.loc["D1", "allocated peak (GiB)"] == "—"
    assert t.loc["D2", "reserved peak (GiB)"] == round(111149056 / GIB, 4)
    assert (t["workspace peak (GiB)"] == "not exposed").all()
    s = sources.set_index("quantity")["source"]
    assert s["workspace peak (GiB)"].startswith("not exposed by this engine")
    assert s["allocated peak (GiB)"].startswith("capture memory events: Total Allocated")
    assert s["KV pool (tokens)"] == "sglang:max_total_num_tokens (/metrics, set once at start)"
    none, _ = memory_table([tmp_path / "nope"])
    assert "no case folder" in none["note"].iloc[0]


def test_the_page_names_unexposed_quantities_once_instead_of_a_column_each():
    import pandas as pd
    from servelab.analyse.memory import page_view
    t = pd.DataFrame({"case": ["D1", "P1"], "output TPS (tok/s)": [50.0, 60.0], "weights (GiB)": [0.2, 0.2],
                      "KV pool (tokens)": ["not exposed"] * 2, "graphs (GiB)": ["not exposed"] * 2})
    v = page_view(t)
    assert v.columns.tolist() == ["case", "output TPS (tok/s)", "weights (GiB)"]
    assert v.attrs["caption"] == "Not exposed by this engine here: KV pool (tokens), graphs (GiB) (the sources table says why)."
    none = page_view(t.drop(columns=["weights (GiB)"]))
    assert none.columns.tolist() == ["note"] and "none of the memory quantities for these 2 cases" in none["note"][0]
    assert page_view(t.iloc[:, :3]).columns.tolist() == ["case", "output TPS (tok/s)", "weights (GiB)"]
