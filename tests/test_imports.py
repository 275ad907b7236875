"""Peer result files (real outputs, tests/data/peer_results/README.md) into one table; ours out with vLLM keys."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelab.measure import peer_results as im
from servelab.measure import request_metrics as mx
from servelab.measure.records import RequestRecord

DATA = Path(__file__).parent / "data" / "peer_results"


def raw(name: str) -> dict:
    text = (DATA / name).read_text()
    return json.loads(text.splitlines()[0]) if name.endswith(".jsonl") else json.loads(text)


def test_sglang_jsonl():
    obj = raw("sglang_bench_serving_0.5.9.jsonl")
    df = im.import_file(DATA / "sglang_bench_serving_0.5.9.jsonl")
    r = df.iloc[0]
    assert (r["tool"], r["definition"]) == ("sglang bench_serving", "sglang")
    assert r["completed"] == 16 and r["concurrency"] == 4
    assert r["total_input_tokens"] == 16 * 63 and r["total_output_tokens"] == 512
    assert r["median_e2el_ms"] == obj["median_e2e_latency_ms"]          # their e2e_latency is our e2el
    assert r["total_token_throughput"] == obj["total_throughput"]
    assert r["p90_e2el_ms"] == obj["p90_e2e_latency_ms"] and r["p95_itl_ms"] == obj["p95_itl_ms"]
    assert r["failed"] is None or r["failed"] != r["failed"]             # sglang has no 'failed' key


def test_vllm_json():
    obj = raw("vllm_bench_serve_0.32.0.json")
    r = im.import_file(DATA / "vllm_bench_serve_0.32.0.json").iloc[0]
    assert (r["tool"], r["definition"]) == ("vllm bench serve", "vllm")
    assert (r["completed"], r["failed"]) == (16, 0)
    assert r["total_output_tokens"] == 528          # vLLM re-tokenized: llama.cpp's usage is in a choices chunk
    assert r["p95_tpot_ms"] == obj["p95_tpot_ms"] and r["median_itl_ms"] == obj["median_itl_ms"]
    assert r["request_rate"] == float("inf") and r["concurrency"] == 4


def test_aiperf_json_maps_its_itl_to_tpot():
    obj = raw("aiperf_0.13.0_profile_export_aiperf.json")
    r = im.import_file(DATA / "aiperf_0.13.0_profile_export_aiperf.json").iloc[0]
    assert (r["tool"], r["definition"]) == ("aiperf", "aiperf")
    assert r["completed"] == 16 and r["concurrency"] == 4 and r["failed"] == 0
    assert r["mean_tpot_ms"] == pytest.approx(obj["inter_token_latency"]["avg"])     # AIPerf ITL = vLLM TPOT
    assert r["p99_itl_ms"] == pytest.approx(obj["inter_chunk_latency"]["p99"])        # chunk gaps = vLLM ITL
    assert r["median_e2el_ms"] == pytest.approx(obj["request_latency"]["p50"])
    assert r["total_input_tokens"] == obj["total_isl"]["avg"]


def test_guidellm_json():
    obj = raw("guidellm_0.8.1_benchmarks.json")
    r = im.import_file(DATA / "guidellm_0.8.1_benchmarks.json").iloc[0]
    m = obj["benchmarks"][0]["metrics"]
    assert (r["tool"], r["definition"]) == ("guidellm", "guidellm")
    assert (r["completed"], r["failed"]) == (16, 0) and r["concurrency"] == 4
    assert r["total_output_tokens"] == 512
    assert r["median_e2el_ms"] == pytest.approx(1000 * m["request_latency"]["successful"]["median"])   # s → ms
    assert r["p95_tpot_ms"] == pytest.approx(m["inter_token_latency_ms"]["successful"]["percentiles"]["p95"])
    assert r["duration_s"] == pytest.approx(obj["benchmarks"][0]["duration"])


def test_one_table_and_our_export_round_trip(tmp_path):
    files = sorted(DATA.glob("*.json*"))
    table = im.import_files(files)
    assert list(table.columns) == im.COLUMNS
    assert set(table["definition"]) == {"sglang", "vllm", "aiperf", "guidellm"}
    # ours, written with vLLM keys, comes back through the vLLM reader with its definition named
    s = 1000 * 1_000_000
    rec = RequestRecord("a", 0, "measure", 5, 3, send_ns=s, end_ns=s + 80_000_000, http_status=200,
                        chunk_ns=[s + 10_000_000, s + 30_000_000, s + 60_000_000, s + 70_000_000],
                        chunk_text=["a", "b", "c", ""], chunk_choices=[True] * 4, chunk_tokens=[None] * 4,
                        done_ns=s + 75_000_000, prompt_tokens=5, completion_tokens=3)
    for d in mx.DEFINITIONS:
        summ = mx.summarize([rec], 2.0, d)
        path = im.write_vllm_json(tmp_path / f"ours_{d}.json", summ)
        back = im.import_file(path).iloc[0]
        assert (back["tool"], back["definition"]) == ("servelab", d)
        assert back["median_e2el_ms"] == pytest.approx(75 if d == "sglang" else 70)
        assert back["total_token_throughput"] == pytest.approx(4.0)
        keys = json.loads(path.read_text())
        assert {"p99_ttft_ms", "mean_e2el_ms", "total_token_throughput", "completed", "failed"} <= set(keys)


def test_unknown_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(im.ImportFormatError, match="x.json"):
        im.import_file(bad)
    with pytest.raises(im.ImportFormatError, match="no such file"):
        im.import_file(tmp_path / "missing.json")
