"""The quick matrix and the case runner on the real llama-server: files, warm-up/flush policy, M1, resume, crash."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pandas as pd
import pytest

from servelab.measure import case as cs
from servelab.measure import matrix as mt
from servelab.measure.case_record import SCHEMA_VERSION, validate_summary
from servelab.measure.records import read_records
from servelab.measure.mixed import m1_analysis, run_m1_case
from servelab.core.params import ParamError
from servelab.deploy.targets import load_target
from servelab.measure.matrix import dispatch_case
from servelab.measure.engine_metrics import named_deltas


def test_cluster_matrix_is_the_method_table():
    t = load_target("example-2node")                     # SGLang, context 131072
    m = {c.case_id: c for c in mt.quick_matrix(t)}
    assert list(m) == ["P1", "P2", "P3", "P4_c4", "P4_c16", "D1", "D2_c16", "D2_c32", "D2_c64", "D3_c16", "D4_c16",
                       "M1_control", "M1_treatment"]
    # long-output and long-context decode at D2's lowest concurrency: one length differs from D2_c16
    assert (m["D3_c16"].input_tokens, m["D3_c16"].output_tokens, m["D3_c16"].concurrency) == (1024, 4096, 16)
    assert (m["D4_c16"].input_tokens, m["D4_c16"].output_tokens, m["D4_c16"].concurrency) == (32768, 1024, 16)
    assert m["D4_c16"].num_prompts == m["D3_c16"].num_prompts == 32
    assert (m["P1"].input_tokens, m["P1"].output_tokens, m["P1"].concurrency) == (1024, 1, 1)
    assert m["P2"].input_tokens == 32768 and m["P4_c16"].input_tokens == 32768
    # 128K + 1 output token does not fit a 131072 context: clamped, and the case says why
    assert m["P3"].input_tokens == 131071 and "clamped from 131072" in m["P3"].notes[0]
    assert (m["D1"].input_tokens, m["D1"].output_tokens) == (1024, 1024)
    # sized (docs/case.md#sizing): concurrent cases at least two waves; concurrency-1 cases by prompt cost
    assert [m[f"D2_c{c}"].num_prompts for c in (16, 32, 64)] == [32, 64, 128]
    assert all(c.min_duration_s == c.min_window_s == 5.0 for c in m.values() if c.scenario != "M1")
    assert m["M1_control"].min_duration_s == 20.0                        # twice the injection delay
    assert (m["P1"].num_prompts, m["P2"].num_prompts, m["P3"].num_prompts, m["D1"].num_prompts) == (200, 8, 8, 8)
    tr = m["M1_treatment"]
    assert (tr.concurrency, tr.output_tokens, tr.inject_after_s, tr.inject_input_tokens) == (32, 1024, 10.0, 131071)
    assert m["M1_control"].inject_input_tokens == 0
    # warm-up policy: short prefill and decode points only
    assert {c.case_id for c in m.values() if c.warmup} == {"P1", "D1", "D2_c16", "D2_c32", "D2_c64", "D3_c16",
                                                           "M1_control", "M1_treatment"}


def test_local_matrix_is_sized_by_prompt_cost():
    m = {c.case_id: c for c in mt.quick_matrix(load_target("local"))}
    # many requests for the cheapest concurrency-1 prompt, fewer for the costlier ones, never fewer than 8
    assert [m[c].num_prompts for c in ("P1", "P2", "P3", "D1")] == [100, 28, 10, 11]
    assert [m[f"P4_c{c}"].num_prompts for c in (2, 4)] == [4, 8]
    assert all(c.min_duration_s == 0.5 for c in m.values() if c.scenario != "M1")
    # the phase parameters override both minimums; P1 keeps the count asked for
    m2 = {c.case_id: c for c in mt.quick_matrix(load_target("local"), min_duration_s=2.0, min_requests=300)}
    assert m2["P1"].num_prompts == 300 and m2["P3"].num_prompts == 29 and m2["D2_c4"].min_duration_s == 2.0
    assert mt.c1_requests(10**6, 1, 65, 100, 10) == mt.C1_MIN_REQUESTS
    assert mt.c1_requests(64, 1, 74, 5, 10) == 5                       # a minimum below the floor is kept
    with pytest.raises(ParamError, match="must be >= 0"):
        mt.quick_matrix(load_target("local"), min_duration_s=-1)


def test_local_matrix_fits_the_slots_and_filters():
    t = load_target("local")                             # 32768 context over 32 slots = 1024 per request
    ms = mt.quick_matrix(t)
    assert all(c.input_tokens + c.output_tokens <= 1024 for c in ms)
    assert all(c.inject_input_tokens + 1 <= 1024 for c in ms)
    assert [c.case_id for c in mt.quick_matrix(t, ["D2", "P1"])] == ["P1", "D2_c4", "D2_c8", "D2_c16"]
    long = {c.case_id: c for c in mt.quick_matrix(t, ["D3", "D4"])}
    assert [(c.input_tokens, c.output_tokens, c.concurrency) for c in long.values()] == [(64, 256, 4), (512, 64, 4)]
    with pytest.raises(ParamError, match="did you mean 'D1'"):
        mt.quick_matrix(t, ["D11"])


@pytest.fixture
def env(tiny_server, tmp_path):
    return cs.make_env(tiny_server, tmp_path / "run")


def small_cases() -> list[cs.CaseSpec]:
    return [cs.CaseSpec("P1", "P1", "prefill", 64, 1, 1, 1, True),
            cs.CaseSpec("P2", "P2", "prefill", 512, 1, 1, 1, False),
            cs.CaseSpec("D2_c4", "D2", "decode", 32, 40, 4, 4, True, min_window_s=10.0)]


@pytest.mark.slow
def test_matrix_files_policy_and_resume(env, tiny_server):
    mr = mt.run_matrix(env, small_cases(), case_runner=dispatch_case)
    assert [r.status for r in mr.results] == ["success"] * 3 and not mr.aborted and not mr.not_executed
    for r in mr.results:
        d = r.case_dir
        meta = json.loads((d / "meta.json").read_text())
        assert meta["status"] == "success"
        assert meta["cache_flush"]["method"].startswith("cache_prompt=false")       # llama.cpp: no flush endpoint
        assert (d / "requests.jsonl").stat().st_mtime_ns <= (d / "summary.json").stat().st_mtime_ns
        recs = read_records(d / "requests.jsonl")
        measured = [x for x in recs if x.role == "measure"]
        assert len(measured) == r.case.num_prompts
        assert all(x.prompt_tokens == r.case.input_tokens and x.completion_tokens == r.case.output_tokens
                   for x in measured)
        warm = [x for x in recs if x.role == "warmup"]
        assert len(warm) == (1 if r.case.warmup else 0)
        frame = pd.read_parquet(d / "server" / "metrics.parquet")
        deltas = named_deltas(frame, tiny_server.engine.metric_names)
        # the scraper starts after the warm-up: its delta is exactly the measured prompts
        assert deltas["prompt_tokens_total"] == sum(x.prompt_tokens for x in measured)
        summ = validate_summary(json.loads((d / "summary.json").read_text()))
        assert (summ["schema_version"], summ["phase"], summ["case_id"]) == (SCHEMA_VERSION, "phase1", r.case.case_id)
        assert set(summ["metrics"]) == {"sglang", "vllm"} and len(summ["repeats"]) == 1
        assert summ["metrics"]["vllm"]["total_output_tokens"] == r.case.num_prompts * r.case.output_tokens
        assert summ["verdict"]["status"] == r.verdict.verdict and summ["counts"]["measured"] == r.case.num_prompts
    v = {r.case.case_id: r.verdict for r in mr.results}
    assert v["P1"].verdict == "VALID", v["P1"].reasons
    assert v["D2_c4"].verdict == "INVALID" and "window too short" in v["D2_c4"].reasons[0]
    csv = pd.read_csv(env.run_dir / "summary.csv")
    assert len(csv) == 6 and set(csv["definition"]) == {"sglang", "vllm"}
    # resume: nothing re-runs (the server sees no new prompt tokens) ...
    before = _prompt_tokens(tiny_server)
    again = mt.run_matrix(env, small_cases(), resume=True, case_runner=dispatch_case)
    assert again.skipped == ["P1", "P2", "D2_c4"] and _prompt_tokens(tiny_server) == before
    # ... unless a raw file no longer re-parses
    (env.run_dir / "cases" / "P2" / "requests.jsonl").write_text("{broken\n")
    third = mt.run_matrix(env, small_cases(), resume=True, case_runner=dispatch_case)
    assert third.skipped == ["P1", "D2_c4"] and _prompt_tokens(tiny_server) == before + 512


def _prompt_tokens(srv) -> float:
    from servelab.measure.engine_metrics import parse_text
    from servelab.deploy.server import http_text
    return next(s["value"] for s in parse_text(http_text(srv.base_url + "/metrics")[1])
                if s["name"] == "llamacpp:prompt_tokens_total")


@pytest.mark.slow
def test_m1_injection_lands_in_the_window(env):
    base = dict(input_tokens=32, output_tokens=1500, concurrency=2, num_prompts=2, warmup=False)
    control = run_m1_case(env, cs.CaseSpec("M1_control", "M1", "mixed", **base))
    treat = run_m1_case(env, cs.CaseSpec("M1_treatment", "M1", "mixed", inject_input_tokens=1000,
                                         inject_after_s=0.3, **base))
    assert control.status == treat.status == "success"
    recs = read_records(treat.case_dir / "requests.jsonl")
    inj = [r for r in recs if r.role == "inject"]
    assert len(inj) == 1 and inj[0].prompt_tokens == 1000 and inj[0].completion_tokens == 1
    start = min(r.scheduled_ns for r in recs if r.role == "measure")
    assert abs((inj[0].scheduled_ns - start) / 1e9 - 0.3) < 0.001            # due exactly 0.3 s in
    assert 0 <= (inj[0].send_ns - inj[0].scheduled_ns) / 1e9 < 1.0           # sent then (client lag recorded)
    assert treat.summaries["vllm"]["completed"] == 2                     # the injection is not a background request
    assert treat.extra["injection"]["vllm"][0]["input_tokens"] == 1000
    summ = validate_summary(json.loads((treat.case_dir / "summary.json").read_text()))
    assert summ["kind"] == "mixed" and summ["details"]["extra"]["injection"]["vllm"][0]["input_tokens"] == 1000
    a = m1_analysis(control, treat)
    ab = a["ab"].set_index("metric")
    assert ab.loc["output_throughput", "control"] > 0 and ab.loc["output_throughput", "treatment"] > 0
    w = a["windows"].set_index(["run", "window"])["n"]
    tl = a["timeline"]
    t_end = a["inject_end_s"]
    assert t_end == pytest.approx((max(inj[0].chunk_ns) - start) / 1e9)
    for run in ("control", "treatment"):             # every ITL lands in exactly one window, split at the injection
        t = tl[tl["run"] == run]["t_s"]
        expect = {"before": int((t < a["inject_start_s"]).sum()),
                  "during": int(((t >= a["inject_start_s"]) & (t <= t_end)).sum()), "after": int((t > t_end).sum())}
        got = {k: int(w.get((run, k), 0)) for k in expect}
        assert got == expect and sum(got.values()) == 2 * 1500
    assert a["inject_start_s"] == pytest.approx((inj[0].send_ns - start) / 1e9)
    assert len(a["timeline"]) == 2 * 2 * 1500          # every choices-chunk gap of every background request


@pytest.mark.slow
def test_engine_crash_stops_the_run_and_resume_continues(tmp_path):
    """Kill the engine's process group while a case streams: ENGINE_CRASH, run stops, data kept, resume goes on."""
    from servelab.deploy.hosts import ProcessTracker
    from servelab.deploy.server import start_server, stop_server
    target = load_target("local-tiny")
    run_dir = tmp_path / "run"
    cases = [cs.CaseSpec("P1", "P1", "prefill", 64, 1, 1, 1, True),
             cs.CaseSpec("D1", "D1", "decode", 32, 2000, 2, 2, False),
             cs.CaseSpec("D2_c2", "D2", "decode", 32, 8, 2, 2, True)]
    with ProcessTracker() as tracker:
        srv = start_server(target, tmp_path / "log1", tracker, health_timeout_s=60)
        env = cs.make_env(srv, run_dir)

        def kill_when_streaming() -> None:
            # the gauge says a request is being served; 0.8 s later its tokens are streaming (~3k tok/s;
            # 2 × 2000 tokens last > 1 s even on an idle machine)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                from servelab.measure.engine_metrics import parse_text
                from servelab.deploy.server import http_text
                body = http_text(srv.base_url + "/metrics", timeout=2)[1]
                if any(x["name"] == "llamacpp:requests_processing" and x["value"] >= 1 for x in parse_text(body)):
                    break
                time.sleep(0.01)
            time.sleep(0.8)
            os.killpg(srv.head_handle.pid, signal.SIGKILL)

        def runner(e, case):
            if case.case_id == "D1":
                threading.Thread(target=kill_when_streaming, daemon=True).start()
            return dispatch_case(e, case)
        mr = mt.run_matrix(env, cases, case_runner=runner)
        assert mr.aborted.startswith("ENGINE_CRASH") and mr.not_executed == ["D2_c2"]
        meta = json.loads((run_dir / "cases" / "D1" / "meta.json").read_text())
        assert meta["status"] == "ENGINE_CRASH" and meta["healthy_after"] is False
        crashed = read_records(run_dir / "cases" / "D1" / "requests.jsonl")
        assert len(crashed) == 2 and any(r.error_kind in ("connection", "stream") or not r.ok for r in crashed)
        assert any(r.chunk_ns for r in crashed)                  # what streamed before the kill is kept
        assert cs.case_is_done(run_dir / "cases" / "P1", 1)      # finished case intact
        stop_server(srv, tracker)
        srv2 = start_server(target, tmp_path / "log2", tracker, health_timeout_s=60)
        env2 = cs.make_env(srv2, run_dir)
        mr2 = mt.run_matrix(env2, cases, resume=True, case_runner=dispatch_case)
        assert mr2.skipped == ["P1"] and not mr2.aborted
        assert [r.status for r in mr2.results] == ["success"] * 3
        stop_server(srv2, tracker)


def test_long_decode_compares_with_d2_at_the_same_concurrency():
    def row(cid, scen, isl, osl, c, tpot, valid="VALID"):
        return {"case_id": cid, "scenario": scen, "input_len": isl, "output_len": osl, "concurrency": c,
                "validity": valid, "p50_tpot_ms": tpot, "output_throughput": 100.0 / tpot}
    frame = pd.DataFrame([row("D2_c4", "D2", 64, 64, 4, 10.0), row("D3_c4", "D3", 64, 256, 4, 12.5),
                          row("D4_c4", "D4", 512, 64, 4, 15.0, "INVALID")])
    t = mt.long_decode_table(frame).set_index("case")
    assert t.loc["D3_c4", "TPOT change (%)"] == pytest.approx(25.0) and t.loc["D3_c4", "D2 case"] == "D2_c4"
    assert pd.isna(t.loc["D4_c4", "TPOT change (%)"]) and t.loc["D4_c4", "note"] == "D4_c4 INVALID: not compared"
    text = mt.long_decode_sentence(mt.long_decode_table(frame))
    assert "D3_c4 (long output, 64 → 256) P50 TPOT 12.50 ms vs D2_c4 10.00 ms (+25 %)" in text
    assert "D4_c4 (long context) D4_c4 INVALID: not compared" in text
    assert mt.long_decode_sentence(mt.long_decode_table(frame.iloc[:1])) is None


def test_phase2_replays_points_of_the_targets_own_scale():
    """Phase 2's default replay names cases that exist at the target's scale (a cluster has no D2_c8)."""
    from servelab.phases.phase2_hardware import engine_case_ids
    assert engine_case_ids(load_target("local")) == ["P3", "P4_c4", "D2_c8", "D3_c4", "D4_c4", "M1_control",
                                                     "M1_treatment"]
    cluster = engine_case_ids(load_target("example-2node"))
    assert cluster == ["P3", "P4_c16", "D2_c32", "D3_c16", "D4_c16", "M1_control", "M1_treatment"]
    assert {c.case_id for c in mt.quick_matrix(load_target("example-2node"), cluster)} == set(cluster)
