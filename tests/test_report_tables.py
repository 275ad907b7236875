"""Tables and findings as a page shows them: units in headers, precision, no index, escaped, CSV one click away."""
from __future__ import annotations

import base64
import re

import numpy as np
import pandas as pd

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
