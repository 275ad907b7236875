"""Phase 7 on the real tiny llama-server: injection windows recomputed by hand from the raw records, the knob
sweep's run-like records through abtest (clean and deliberately confounded), a knob the engine ignores refused.

Ground truth is computed here from ``requests.jsonl`` with plain JSON and list arithmetic, never with the
functions under test; performance relations (is *during* worse than *before*?) are not asserted — the shared
2-core machine makes them noise — only what the windows must contain.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from servelab.measure.abtest import ab_compare
from servelab.analyse.interference import h4_evidence, rank_values, sweep_table, sweep_verdict
from servelab.measure.interference_case import InterferenceSpec, knob_sweep, measure_interference, run_variant
from servelab.phases.phase7_interference import default_spec, finish_case
from servelab.measure.case_record import SCHEMA_VERSION, validate_summary
from servelab.measure.launch_variants import check_knob_changes_command
from servelab.core.params import ParamError
from servelab.deploy.targets import load_target
from servelab.measure.workload import engine_tokenizer, token_pool


def small_spec(case_id: str = "I7", n: int = 2) -> InterferenceSpec:
    return InterferenceSpec(case_id=case_id, background_input_tokens=32, background_output_tokens=192,
                            concurrency=4, inject_input_tokens=1024, n_injections=n, window_steps=8)


def raw_records(case_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (case_dir / "requests.jsonl").read_text().splitlines() if line.strip()]


def token_times(r: dict) -> list[int]:
    """Times of the chunks that carry a token: choices chunks, without llama.cpp's final empty usage chunk."""
    t = [ns for ns, c in zip(r["chunk_ns"], r["chunk_choices"]) if c]
    texts = [x for x, c in zip(r["chunk_text"], r["chunk_choices"]) if c]
    if len(t) == r["completion_tokens"] + 1 and texts[-1] == "":
        t = t[:-1]
    return t


@pytest.mark.slow
def test_injection_windows_match_a_hand_computation(tiny_server, tmp_path):
    pool = token_pool(engine_tokenizer(tiny_server.base_url, "llamacpp", "/tokenize"))
    raw = measure_interference(tiny_server, tmp_path, small_spec(), pool, seed=3)
    cdir = tmp_path / "cases" / "I7"
    # the measurement writes the raw data only; the analysis adds the tables, the summary comes last
    assert (cdir / "requests.jsonl").is_file() and (cdir / "server" / "marks.json").is_file()
    assert not (cdir / "windows.csv").exists() and not (cdir / "summary.json").exists()
    res = finish_case(raw)
    # raw data is on disk, summaries beside it
    for f in ("requests.jsonl", "server/metrics_before.prom", "server/metrics_after.prom", "windows.csv",
              "injections.csv", "summary.json", "meta.json"):
        assert (cdir / f).is_file(), f
    summ = validate_summary(json.loads((cdir / "summary.json").read_text()))
    assert (summ["schema_version"], summ["phase"], summ["kind"]) == (SCHEMA_VERSION, "phase7", "interference")
    assert summ["verdict"]["status"] == res.verdict.verdict and len(summ["repeats"]) == 2       # one per injection
    # the wave's loop had its one loop-lag monitor: the integrity record is measured, in the summary, and judged
    integ = summ["integrity"]
    assert integ["loop_lag"]["n"] == res.integrity["loop_lag"]["n"] >= 5 and integ["requests"] > 2     # a 10 ms monitor
    assert integ["littles_law"]["samples"] == integ["loop_lag"]["n"] and integ["littles_law"]["mean_inflight"] > 1
    assert set(integ["reasons"]) <= set(res.verdict.reasons)
    assert [r for r in summ["verdict"]["reasons"] if r.startswith("client fell behind")] == \
        [r for r in integ["reasons"] if r.startswith("client fell behind")]
    assert [r["metrics"]["vllm"]["p95_tpot_ms"] for r in summ["repeats"]] == pytest.approx(
        list(res.injections["p95_tpot_during_ms"]), nan_ok=True)
    recs = raw_records(cdir)
    inj = sorted((r for r in recs if r["role"] == "inject"), key=lambda r: r["send_ns"])
    bg = [r for r in recs if r["role"] == "background" and r["http_status"] == 200 and not r["error_kind"]]
    assert len(inj) == 2 and all(r["prompt_tokens"] == 1024 and r["completion_tokens"] == 1 for r in inj)
    # every stream's first request is shortened by a step of OSL/C (no lockstep), the others are full length
    assert sorted(r["requested_output_tokens"] for r in bg)[:4] == [48, 96, 144, 192] and len(bg) >= 4
    assert all(r["completion_tokens"] == r["requested_output_tokens"] for r in bg)
    gaps = []
    for r in bg:
        t = token_times(r)
        assert len(t) == r["completion_tokens"]
        gaps += [(a, b) for a, b in zip(t, t[1:])]
    win = pd.read_csv(cdir / "windows.csv")
    n_side = 8 * 4
    for k, r in enumerate(inj):
        send, end = r["send_ns"], max(r["chunk_ns"])
        prev_end = max(inj[k - 1]["chunk_ns"]) if k else None
        next_send = inj[k + 1]["send_ns"] if k + 1 < len(inj) else None
        during = [(b - a) / 1e6 for a, b in gaps if a < end and b > send]
        before = sorted(((a, b) for a, b in gaps if b <= send and (prev_end is None or a >= prev_end)),
                        key=lambda g: (-g[1], -g[0]))[:n_side]
        after = sorted(((a, b) for a, b in gaps if a >= end and (next_send is None or b <= next_send)),
                       key=lambda g: (g[0], g[1]))[:n_side]
        for name, vals in (("during", during), ("before", [(b - a) / 1e6 for a, b in before]),
                           ("after", [(b - a) / 1e6 for a, b in after])):
            row = win[(win["injection"] == k) & (win["window"] == name)].iloc[0]
            assert row["n_gaps"] == len(vals), (k, name)
            if vals:
                assert row["p95_tpot_ms"] == pytest.approx(float(np.percentile(vals, 95)), rel=1e-9)
                assert row["max_tpot_ms"] == pytest.approx(max(vals), rel=1e-9)
        # the long request's TTFT is its first chunk minus its send
        ttft = (min(ns for ns, c in zip(r["chunk_ns"], r["chunk_choices"]) if c) - send) / 1e6
        row = win[(win["injection"] == k) & (win["window"] == "during")].iloc[0]
        assert row["inject_ttft_ms"] == pytest.approx(ttft, rel=1e-9)
    # the damage column is during minus before, per injection
    table = res.injections
    np.testing.assert_array_equal(table["p95_tpot_increase_ms"].astype(float),
                                  (table["p95_tpot_during_ms"] - table["p95_tpot_before_ms"]).astype(float))
    # steady = the latest first token of the four streams' first requests; valid windows start after it
    marks = json.loads((cdir / "server" / "marks.json").read_text())
    firsts = sorted(bg, key=lambda r: r["send_ns"])[:4]
    assert marks["steady_ns"] == max(token_times(r)[0] for r in firsts)
    valid = win[win["valid"]]
    assert (valid["start_s"] >= (marks["steady_ns"] - marks["t0_ns"]) / 1e9 - 1e-9).all()


def test_a_knob_the_engine_ignores_is_refused_before_anything_starts():
    t = load_target("local-tiny")
    with pytest.raises(ParamError, match="ignores launch.chunked_prefill_size"):
        check_knob_changes_command(t, "chunked_prefill_size", [4096, 2048])
    with pytest.raises(ParamError, match="not a launch setting"):
        check_knob_changes_command(t, "chunk_size", [1, 2])
    with pytest.raises(ParamError, match="at least two values"):
        check_knob_changes_command(t, "batch_size", [64])
    check_knob_changes_command(t, "batch_size", [2048, 32])          # -b is passed: accepted


@pytest.mark.slow
def test_sweep_records_are_one_variable_and_a_confounded_pair_is_flagged(llama_server_binary, tmp_path):
    target = load_target("local-tiny")
    spec = small_spec(n=1)
    spec.background_output_tokens = 128
    root, logs = tmp_path / "ab", tmp_path / "logs"
    points = knob_sweep(target, "batch_size", [2048, 64], spec, tmp_path, root, logs, finish_case, seed=1)
    assert [p.label for p in points] == ["batch_size=2048", "batch_size=64"]
    assert all(p.result is not None for p in points), [p.error for p in points]
    for p in points:
        m = json.loads((p.record_dir / "manifest.json").read_text())
        assert m["launch"]["settings"]["batch_size"] == p.value
        assert f"-b {p.value}" in m["launch"]["plans"][0]["command"]
        # the record names its case's summary.json, entered as I7 on every side of the A/B
        index = json.loads((p.record_dir / "cases.json").read_text())["cases"]
        assert [e["case_id"] for e in index] == ["I7"]
        summ = validate_summary(json.loads((p.record_dir / index[0]["summary"]).read_text()))
        assert summ["case_id"] == f"I7_batch_size={p.value}" and summ["repeat_of"] == "I7"
        s = pd.read_csv(p.record_dir / "summary.csv")
        assert list(s["case_id"]) == ["I7"] and list(s["repeat"]) == [0]
    ab = ab_compare([p.record_dir for p in points], "batch_size")
    assert not ab.confounded
    assert "launch.settings.batch_size" in set(ab.differences[ab.differences["status"] == "declared"]["key"])
    # the same knob change plus a second setting: the tool must refuse a conclusion
    _, conf_dir, err = run_variant(target, {"batch_size": 64, "ubatch_size": 8}, spec, tmp_path, root,
                                   "batch_size=64+ubatch_size=8", logs, finish_case, seed=1)
    assert not err
    cab = ab_compare([points[0].record_dir, conf_dir], "batch_size")
    assert cab.confounded
    assert "launch.settings.ubatch_size" in set(cab.confounds["key"])
    table = sweep_table(points)
    assert set(table["value"]) == {"batch_size=2048", "batch_size=64"}


def test_ranking_is_by_least_decode_damage_not_by_prefill_speed():
    t = pd.DataFrame([
        {"value": "b=2048", "p95_tpot_increase_ms": 900.0, "output_tps_drop_pct": 90.0, "long_request_ttft_ms": 100.0,
         "p95_tpot_during_ms": 1000.0, "valid": True},
        {"value": "b=32", "p95_tpot_increase_ms": 50.0, "output_tps_drop_pct": 40.0, "long_request_ttft_ms": 900.0,
         "p95_tpot_during_ms": 150.0, "valid": True},
        {"value": "b=8", "p95_tpot_increase_ms": 10.0, "output_tps_drop_pct": 10.0, "long_request_ttft_ms": 5000.0,
         "p95_tpot_during_ms": 110.0, "valid": False},
    ])
    r = rank_values(t)
    assert list(r["value"]) == ["b=32", "b=2048", "b=8"]       # the invalid one last, whatever its numbers
    assert list(r["rank"][:2]) == [1, 2] and r["rank"].iloc[2] is None
    text = sweep_verdict(r, baseline="b=2048")
    assert text.startswith("least damage to the decode SLO: b=32") and "900 ms vs 100 ms" in text


def test_h4_rule():
    inj = pd.DataFrame({"p95_tpot_before_ms": [10.0, 12.0], "p95_tpot_during_ms": [30.0, 13.0],
                        "p95_tpot_increase_ms": [20.0, 1.0], "valid": [True, True]})
    assert h4_evidence(inj)[0] == "supported"
    assert h4_evidence(inj.assign(p95_tpot_during_ms=[11.0, 12.0]))[0] == "refuted"
    assert h4_evidence(inj.assign(p95_tpot_during_ms=[30.0, 11.0]))[0] == "inconclusive"
    assert h4_evidence(inj.assign(valid=[False, False]))[0] == "inconclusive"


def test_default_spec_scales_and_clamps():
    local = default_spec(load_target("local"))
    assert (local.concurrency, local.inject_input_tokens, local.background_output_tokens) == (4, 192, 32)
    tiny = default_spec(load_target("local-tiny"))
    assert tiny.inject_input_tokens == 1536 and tiny.background_output_tokens == 256
    clamped = default_spec(load_target("local"), inject_input_tokens=5000)
    assert clamped.inject_input_tokens == 1023 and "clamped" in clamped.notes[0]
    with pytest.raises(ParamError, match="unknown interference setting"):
        default_spec(load_target("local"), injections=3)
