"""Tables and findings as a page shows them: units in headers, precision, no index, escaped, CSV one click away."""
from __future__ import annotations

import base64
import re

import numpy as np
import pandas as pd

from servelab.report.perf_figures import latency_throughput
from servelab.report.findings import findings_html, format_value, headline_rows, split_unit
from servelab.report.tables import header, table_html

XSS = '<img src=x onerror="alert(1)">'


def test_units_come_from_the_key_suffix() -> None:
    assert split_unit("P1_p50_ttft_ms") == ("P1 P50 TTFT", "ms")
    assert split_unit("decode_busy_pct") == ("decode busy", "%")
    assert split_unit("D2_max_output_tps") == ("D2 max output", "tok/s")
    assert split_unit("case_id") == ("case id", "")
    assert header("p95_tpot_ms") == "P95 TPOT (ms)"
    assert header("status") == "status"


def test_values_have_sensible_precision_and_no_python_reprs() -> None:
    assert format_value(np.float64(279.977876)) == "280.0"
    assert format_value(6.091044587301589) == "6.09"
    assert format_value(0.0123456) == "0.0123"
    assert format_value(4649.006) == "4,649"
    assert format_value(None) == "—" and format_value(float("nan")) == "—"
    assert format_value(True) == "yes"
    rows = dict(headline_rows({"M1_p95_tpot_change_pct": np.float64(16.28538369137638), "slow_rank": None}))
    assert rows == {"M1 P95 TPOT change": "16.29 %", "slow rank": "—"}


def test_a_table_has_no_index_and_escapes_every_cell_and_header() -> None:
    df = pd.DataFrame({"kernel": [XSS, "ncclDevKernel_AllReduce"], "p95_tpot_ms": [220.360693, 1.5],
                       XSS: [1, 2]})
    out = table_html(df)
    assert XSS not in out and "&lt;img src=x onerror=" in out
    assert "<th></th>" not in out and ">0</th>" not in out            # no index column
    assert "<th>P95 TPOT (ms)</th>" in out and "<td>220.4</td>" in out
    assert 'style="max-width:100%;overflow-x:auto"' in out             # wide tables scroll


def test_the_full_table_is_one_click_away_as_csv() -> None:
    df = pd.DataFrame({"case_id": [f"c{i}" for i in range(500)], "ttft_ms": np.arange(500) * 1.25})
    out = table_html(df, max_rows=20)
    assert out.count("<tr>") == 21 and "first 20 of 500 rows" in out
    href = re.search(r'href="data:text/csv;base64,([^"]+)"', out).group(1)
    csv = base64.b64decode(href).decode()
    assert csv.splitlines()[0] == "case_id,ttft_ms" and len(csv.splitlines()) == 501


def test_a_labelled_index_becomes_a_column() -> None:
    df = pd.DataFrame({"busy_pct": [97.4, 93.5]}, index=pd.Index(["prefill", "decode"], name="window"))
    out = table_html(df)
    assert "<th>window</th>" in out and "<td>prefill</td>" in out


def test_findings_box_escapes_sentences_and_marks_samples() -> None:
    box = findings_html({"findings": [f"slowest kernel {XSS}"], "headline": {"ranks": 2}, "from_samples": True})
    assert XSS not in box and "slowest kernel &lt;img" in box
    assert "From recorded sample data" in box and "<th>ranks</th><td>2</td>" in box
    assert findings_html({}) == ""


def _ab(differences: pd.DataFrame, comparison: pd.DataFrame):
    from types import SimpleNamespace
    confounds = differences[differences["status"] == "confound"] if not differences.empty else differences
    return SimpleNamespace(variable=["launch.settings.batch_size"], differences=differences, confounds=confounds,
                           confounded=not confounds.empty, profiled_vs_clean=False, comparison=comparison,
                           runs=[SimpleNamespace(label="r-batch=2048", run_id="r")])


def test_ab_findings_state_validity_and_the_verdict_per_metric() -> None:
    from servelab.report.findings import ab_findings
    comp = pd.DataFrame([{"case_id": "I7", "metric": "p95_tpot_ms", "b_run": "r-batch=32", "delta_pct": -42.0,
                          "noise_band_pct": 8.0, "verdict": "better"},
                         {"case_id": "I7", "metric": "output_tps", "b_run": "r-batch=32", "delta_pct": 1.5,
                          "noise_band_pct": 8.0, "verdict": "within noise"}])
    clean = pd.DataFrame({"key": ["launch.settings.batch_size"], "status": ["declared"]})
    valid, verdict = ab_findings(_ab(clean, comp), {"p95_tpot_ms": "P95 TPOT", "output_tps": "output TPS"})
    assert valid.startswith("The A/B is valid") and "launch.settings.batch_size" in valid
    assert "against r-batch=2048" in verdict and "P95 TPOT -42.0 % (better, noise band ±8.0 %)" in verdict
    assert "output TPS +1.5 % (within noise" in verdict
    confounded = pd.concat([clean, pd.DataFrame({"key": ["launch.settings.ubatch_size"], "status": ["confound"]})])
    assert ab_findings(_ab(confounded, comp))[0].startswith("The A/B is not valid")
    invalid = comp.assign(verdict="invalid")
    assert "INVALID side (r-batch=32)" in ab_findings(_ab(clean, invalid))[0]


def test_counts_ids_and_fractions_read_as_a_person_reads_them() -> None:
    """Counts as integers (never 8.00), ids / ports / pids without thousands separators, fractions as % (one unit
    per quantity), no repr of None / True / lists, headers in words with their unit; a value that is not whole
    never reads as a count."""
    from servelab.report.tables import display_frame
    df = pd.DataFrame({"case_id": ["a", "b"], "concurrency": [4.0, None], "port": [60599, 1234], "pid": [11084.0, 7.0],
                       "hit_rate": [0.203, 0.5], "d_drafts": [64.0, 3.0], "mean_accept_length": [3.98, 1.0],
                       "p95_ttft_ms": [1.0, 2.0], "ok": [True, None], "files": [["x", "y"], []],
                       "bytes_per_param": [1.000244, 2.0]})
    out = display_frame(df)
    assert list(out.columns) == ["case id", "concurrency", "port", "pid", "hit rate (%)", "d drafts",
                                 "mean accept length", "P95 TTFT (ms)", "ok", "files", "bytes per param"]
    assert out["concurrency"].tolist() == ["4", "—"] and out["d drafts"].tolist() == ["64", "3"]
    assert out["port"].tolist() == ["60599", "1234"] and out["pid"].tolist() == ["11084", "7"]
    assert out["hit rate (%)"].tolist() == ["20.30", "50.00"]
    assert out["P95 TTFT (ms)"].tolist() == ["1.00", "2.00"]            # a quantity with a unit keeps its decimals
    assert out["ok"].tolist() == ["yes", "—"] and out["files"].tolist() == ["x, y", "—"]
    assert out["bytes per param"].tolist() == ["1.00024", "2.00"]
    assert dict(headline_rows({"acceptance_rate": 0.5, "S9_net_gain_pct": -3.0})) == {
        "acceptance rate": "50.00 %", "S9 net gain": "-3.00 %"}


def test_a_wide_table_is_split_into_parts_that_fit_with_its_key_repeated() -> None:
    from servelab.report.tables import PAGE_WIDTH_PX, column_parts, display_frame
    df = pd.DataFrame({"case_id": [f"case_{i}" for i in range(3)],
                       **{f"p{i}_some_metric_ms": np.arange(3) * 1.5 + i for i in range(40)}})
    shown = display_frame(df)
    parts = column_parts(shown)
    assert len(parts) > 1 and all(p[0] == "case id" for p in parts)
    assert sorted({c for p in parts for c in p[1:]}) == sorted(shown.columns[1:])      # every column, once
    from servelab.report.tables import column_px
    assert all(sum(column_px(c, list(shown[c])) for c in p) <= PAGE_WIDTH_PX for p in parts)
    out = table_html(df)
    assert out.count("<table") == len(parts) and f"part 1 of {len(parts)}" in out
    narrow = pd.DataFrame({"a": [1], "b": [2]})
    assert table_html(narrow).count("<table") == 1 and "part 1" not in table_html(narrow)


def test_a_long_dump_is_an_excerpt_and_a_file_beside_the_page(tmp_path) -> None:
    df = pd.DataFrame({"t_s": np.arange(210) * 0.01, "line": [f"slot {i} released" for i in range(210)]})
    df.attrs["caption"] = "scheduler lines"
    out = table_html(df, files_dir=tmp_path / "tables")
    assert out.count("<tr>") == 1 + 12 and "first 12 of 210 rows" in out
    href = re.search(r'href="(tables/[^"]+\.csv)"', out).group(1)
    assert href.startswith("tables/scheduler-lines-") and "data:text/csv" not in out
    assert len((tmp_path / href).read_text().splitlines()) == 211
    short = df.head(30)
    assert table_html(short).count("<tr>") == 31                       # a table of up to 40 rows is shown whole


def test_row_numbers_are_never_a_column_but_labels_are() -> None:
    df = pd.DataFrame({"reason": ["a", "b", "c"], "share_pct": [1.0, 2.0, 3.0]}).iloc[[2, 0]]   # a filter's index
    assert "<th>index</th>" not in table_html(df) and "<td>2</td>" not in table_html(df)
    side = pd.DataFrame({"vllm": [1.5]}, index=["mean_ttft_ms"])        # unnamed labels: kept, as "item"
    assert "<th>item</th>" in table_html(side) and "<td>mean_ttft_ms</td>" in table_html(side)


def test_two_results_of_one_question_agree_only_within_their_noise() -> None:
    """report.crosscheck.compare: Δ within 2 combined standard errors agrees, beyond disagrees, an INVALID side is
    never compared (and its number is not a result)."""
    from servelab.report.crosscheck import Measurement, compare

    def m(case, tps, rel_se, verdict="VALID"):
        return Measurement(case, "phase1", "Phase 1 matrix", 64, 64, 4, "{}", tps, rel_se, 20, verdict, [])
    assert compare(m("D2_c4", 100.0, 0.05), m("search_c4", 108.0, 0.05))["verdict"] == "agree"     # 8 < 2×7.4
    far = compare(m("D2_c4", 4082.0, 0.043), m("search_c4", 362.5, 0.27))
    assert far["verdict"] == "disagree" and round(far["delta_pct"]) == -91
    bad = compare(m("D2_c8", 63.6, 0.05), m("hw-D2_c8", 44.5, 0.05, "INVALID"))
    assert bad["verdict"] == "not compared" and "hw-D2_c8 is INVALID" in bad["why"] and bad["delta_pct"] is None


def test_the_matrix_figure_of_a_run_that_measured_no_case_says_so() -> None:
    """A matrix stopped before its first case (the engine or a node lost) has an empty frame: its figure says
    so instead of failing the phase on a missing column."""
    assert "no case measured" in latency_throughput(pd.DataFrame()).layout.title.text


def test_a_statistic_after_the_unit_goes_before_it():
    """A ledger number such as ``p95_tpot_increase_ms_mean`` reads with its unit in the header: a whole value in it
    (976.0 ms, seen under load) is a time, not a count printed with decimals."""
    from servelab.report.tables import header
    assert header("p95_tpot_increase_ms_mean") == "P95 TPOT increase mean (ms)"
    assert header("ttft_ms_p95") == "TTFT P95 (ms)"
    assert header("p95_tpot_ms") == "P95 TPOT (ms)" and header("tokens_total") == "tokens total"
