"""AIPerf exports with missing or odd fields (`servelab import`): one clear line naming the file and the field,
never a traceback. Every case starts from the real AIPerf 0.13.0 export in tests/data/peer_results."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.measure.peer_results import ImportFormatError, import_file
from fuzz import examples

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "tests" / "data" / "peer_results" / "aiperf_0.13.0_profile_export_aiperf.json"


def _real() -> dict:
    return json.loads(REAL.read_text())


def _write(tmp_path: Path, obj: dict, name: str = "profile_export_aiperf.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return p


def _set(obj: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(obj)
    *path, last = dotted.split(".")
    cur = out
    for k in path:
        cur = cur[k]
    if value is DELETE:
        cur.pop(last, None)
    else:
        cur[last] = value
    return out


DELETE = object()

# (what is changed, new value) → None: still imported (with what the row must then say), or the words of the error
ACCEPTED = [
    ("time_to_first_token.avg", None, {"mean_ttft_ms": None}),                 # null stat: missing, not 0
    ("time_to_first_token.p99", DELETE, {"p99_ttft_ms": None}),
    ("time_to_first_token.avg", "296.5", {"mean_ttft_ms": 296.5}),             # a numeric string
    ("request_latency.unit", "s", {"mean_e2el_ms": pytest.approx(572.7183186249999 * 1000)}),
    ("request_latency.unit", "NS", {"mean_e2el_ms": pytest.approx(572.7183186249999 * 1e-6)}),
    ("inter_chunk_latency", DELETE, {"mean_itl_ms": None}),
    ("inter_chunk_latency", None, {"mean_itl_ms": None}),
    ("goodput", {"unit": "requests/sec", "avg": None}, {"request_goodput": None}),
    ("error_summary", [{"count": 2, "error_details": {"code": 500}}], {"failed": 2.0}),
    ("error_summary", [{"count": "3"}], {"failed": 3.0}),
    ("benchmark_duration.avg", None, {"duration_s": None}),
    ("input_config", DELETE, {"concurrency": None}),
]

REFUSED = [
    ("time_to_first_token.avg", "fast", "time_to_first_token.avg is the string 'fast', not a number"),
    ("time_to_first_token.p50", [1, 2], "time_to_first_token.p50 is list"),
    ("time_to_first_token.p95", {"v": 1}, "time_to_first_token.p95 is dict"),
    ("time_to_first_token.avg", True, "time_to_first_token.avg is bool"),
    ("time_to_first_token.unit", DELETE, "time_to_first_token has values but no unit"),
    ("time_to_first_token.unit", "", "time_to_first_token has values but no unit"),
    ("inter_token_latency.unit", "fortnights", "inter_token_latency has unit 'fortnights'"),
    ("request_latency", 572.7, "request_latency is float, expected an object"),
    ("request_throughput", "6.8", "request_throughput is str, expected an object"),
    ("request_throughput.avg", "n/a", "request_throughput.avg is the string 'n/a'"),
    ("completed_request_count.avg", {}, "completed_request_count.avg is dict"),
    ("error_summary", {"count": 1}, "error_summary is dict, expected list"),
    ("error_summary", ["boom"], "error_summary[0] is str, expected an object"),
    ("error_summary", [{"count": "many"}], "error_summary[0].count is the string 'many'"),
    ("input_config", "x", "input_config is str, expected dict"),
]


@pytest.mark.parametrize("field,value,expect", ACCEPTED, ids=[f"{a[0]}={a[1]!r}"[:60] for a in ACCEPTED])
def test_odd_but_readable_fields_are_imported(tmp_path, field, value, expect):
    row = import_file(_write(tmp_path, _set(_real(), field, value))).iloc[0].to_dict()
    for k, v in expect.items():
        got = row[k]
        if v is None:
            assert got is None or got != got, (k, got)                       # None or NaN: missing
        else:
            assert got == v, (k, got)


@pytest.mark.parametrize("field,value,words", REFUSED, ids=[f"{r[0]}={r[1]!r}"[:60] for r in REFUSED])
def test_malformed_fields_are_one_line_naming_file_and_field(tmp_path, field, value, words):
    p = _write(tmp_path, _set(_real(), field, value))
    with pytest.raises(ImportFormatError) as err:
        import_file(p)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{p}: ") and words in msg, msg


def test_the_real_export_still_imports_unchanged(tmp_path):
    row = import_file(REAL).iloc[0]
    assert row["tool"] == "aiperf" and row["completed"] == 16 and row["mean_ttft_ms"] == pytest.approx(296.1699035)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False)
                           | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=6)
TAGS = ["time_to_first_token", "inter_token_latency", "inter_chunk_latency", "request_latency", "request_throughput",
        "output_token_throughput", "total_token_throughput", "benchmark_duration", "completed_request_count",
        "request_count", "total_isl", "total_osl", "input_sequence_length", "output_sequence_length", "goodput",
        "error_summary", "input_config"]
KEYS = [None, "unit", "avg", "p50", "p90", "p95", "p99"]


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tag=st.sampled_from(TAGS), key=st.sampled_from(KEYS), value=JSON_VALUES)
def test_any_value_in_any_aiperf_field_is_a_row_or_one_line(tmp_path, tag, key, value):
    obj = _real()
    if key is None or not isinstance(obj.get(tag), dict):
        obj[tag] = value
    else:
        obj[tag][key] = value
    p = _write(tmp_path, obj, "h.json")
    try:
        df = import_file(p)
    except ImportFormatError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(f"{p}: ")
    else:
        assert len(df) == 1 and df.iloc[0]["tool"] == "aiperf"


def test_servelab_import_of_a_malformed_export_is_one_line_and_writes_nothing(tmp_path):
    from servelab.core import run as runlib
    out = tmp_path / "outputs"
    env = {**os.environ, "SERVELAB_OUTPUTS": str(out)}
    rdir = out / "r1"
    rdir.mkdir(parents=True)
    runlib.write_json_atomic(rdir / "manifest.json", {"schema_version": 1, "run_id": "r1", "phases": {}})
    bad = _write(tmp_path, _set(_real(), "time_to_first_token.unit", DELETE))
    before = sorted(p.relative_to(rdir) for p in rdir.rglob("*"))
    res = subprocess.run([sys.executable, "-m", "servelab.cli", "import", str(bad), "--run-id", "r1"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [x for x in res.stderr.strip().splitlines() if x]
    assert len(lines) == 1 and "time_to_first_token has values but no unit" in lines[0] and "Traceback" not in res.stderr
    assert sorted(p.relative_to(rdir) for p in rdir.rglob("*")) == before
