"""Every captured scenario analysed on its own and side by side (``analyse.trace.scenarios``), on real recorded
captures standing in for a live run's scenarios: a prefill-and-decode H200 capture (``h200x2-tp2-graph``) as the
long prefill, an SGLang CPU decode-only capture (``sglang-cpu-tp2``) as the decode control, and vLLM's live
mixed-treatment case (``vllm-cpu-mixed``, with its client records) as the mixed treatment. The live run of all four
scenarios on one engine is ``tests/test_phase3_sglang.py``."""
from __future__ import annotations

import csv

import polars as pl
import pytest

from conftest import SAMPLES, read_only_copy
from servelab.analyse.trace.scenarios import analyse_scenarios, compare_findings, compare_table, split_q1


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    out = tmp_path_factory.mktemp("phase3") / "scenarios"
    caps = [{"scenario": "mixed_treatment", "case_id": "M1-profile--profile-mixed_treatment", "bound_case_id": "M1",
             "folder": read_only_copy(SAMPLES / "vllm-cpu-mixed") / "profiles"},
            {"scenario": "decode_control", "case_id": "D2-profile--profile-decode_control", "bound_case_id": "D2",
             "folder": read_only_copy(SAMPLES / "sglang-cpu-tp2") / "traces"},
            {"scenario": "long_prefill", "case_id": "P3-profile--profile-long_prefill", "bound_case_id": "P3",
             "folder": read_only_copy(SAMPLES / "h200x2-tp2-graph") / "traces"}]
    return analyse_scenarios(caps, out, cache_dir=tmp_path_factory.mktemp("cache")), out


def test_each_scenario_has_its_own_tables_and_ten_answers(views):
    vs, out = views
    assert [v.scenario for v in vs] == ["long_prefill", "decode_control", "mixed_treatment"]    # the page's order
    for v in vs:
        assert not v.error and v.analysis is not None
        rows = list(csv.DictReader(open(out / v.scenario / "trace_questions.csv")))
        assert [r["id"] for r in rows] == [f"Q{i}" for i in range(1, 11)]
        assert {r["capture"] for r in rows} == {f"{v.scenario} ({v.case_id})"}
        summary = pl.read_csv(out / v.scenario / "trace_summary.csv")
        assert summary["windows"].sum() == v.analysis.window_metrics.height > 0      # this scenario's own windows
        assert str(v.folder) in (out / v.scenario / "trace_analysis.json").read_text()
    kinds = {v.scenario: set(v.analysis.summary["kind"]) for v in vs}
    assert kinds["decode_control"] == {"decode"} and "prefill" in kinds["long_prefill"]
    mixed = next(v for v in vs if v.scenario == "mixed_treatment")
    assert mixed.clock is not None and (out / "mixed_treatment" / "trace_stalls.csv").is_file()   # its one clock
    assert not (out / "decode_control" / "trace_stalls.csv").exists()


def test_q1_answers_prefill_from_the_prefill_capture_and_decode_from_the_decode_capture(views):
    vs, _ = views
    q1 = split_q1(vs)
    pre, ctl = (next(v for v in vs if v.scenario == s) for s in ("long_prefill", "decode_control"))
    prefill_part, decode_part = q1["answer"].split(" | ")
    assert prefill_part.startswith(f"prefill (from {pre.label}):") and decode_part.startswith(f"decode (from {ctl.label}):")
    top_pre = pre.analysis.top_kernels.filter(pl.col("kind") == "prefill").sort("total_ms", descending=True)
    top_dec = ctl.analysis.top_kernels.filter(pl.col("kind") == "decode").sort("total_ms", descending=True)
    assert top_pre["kernel"][0] in prefill_part and top_dec["kernel"][0] in decode_part
    assert top_dec["kernel"][0] not in prefill_part           # a CPU op name never appears in the H200 prefill
    assert q1["capture"] == f"{pre.label} + {ctl.label}"
    assert split_q1([v for v in vs if v.scenario != "long_prefill"]) is None


def test_side_by_side_table_and_findings_come_from_each_scenarios_windows(views):
    vs, _ = views
    t = compare_table(vs)
    assert t["scenario"].to_list() == [v.scenario for v in vs]
    for v, r in zip(vs, t.iter_rows(named=True)):
        w = v.analysis.window_metrics
        assert r["median_step_ms"] == pytest.approx(float(w["gpu_span_ms"].median()), abs=1e-3)
        assert r["gap_pct"] == pytest.approx(100 * float(w["idle_ms"].sum()) / float(w["gpu_span_ms"].sum()), abs=0.01)
        assert r["top3_kernels"].count(" ms)") == 3
        steps = (v.analysis.top_kernels.filter(pl.col("kind") != "outside steps").group_by("kernel")
                 .agg(pl.col("total_ms").sum()).sort("total_ms", descending=True))
        assert r["top3_kernels"].startswith(f"{steps['kernel'][0]} (")       # from the step windows only
    f = compare_findings(vs)
    assert any(x.startswith("Injected prefill vs decode control:") for x in f)
    assert any(x.startswith("What decode spends that prefill does not") for x in f)


def test_the_page_has_one_block_per_scenario(views):
    from types import SimpleNamespace
    from servelab.report.scenario_section import scenario_sections, scenarios_table
    vs, _ = views
    page = scenario_sections(SimpleNamespace(scenarios=vs)).data
    for v in vs:
        block = page.split(f'<h3 id="scenario-{v.scenario}">')[1].split("<h3 ")[0]
        assert v.case_id in block and block.count("<table") == 5       # windows, top kernels, gaps, graphs, questions
        assert ("One clock:" in block) == (v.clock is not None)
    t = scenarios_table(SimpleNamespace(scenarios=vs))
    assert list(t["scenario"]) == [v.scenario for v in vs] and t.attrs["caption"].startswith("Injected prefill")
