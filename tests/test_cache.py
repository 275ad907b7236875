"""Phase 8 on the real tiny llama-server (cache_prompt on, an engine restart per point as the flush):
the hit-rate matrix achieves 0/20/50/80 % within docs/metrics.md#hit-rate's bound, counter deltas equal a hand computation from
the raw ``/metrics`` snapshots and per-request usage, a deliberately bad point is REJECTED, KV usage comes from
``/slots`` and the KV cache size from the startup log equals the model's arithmetic.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelab.analyse.memory import memory_breakdown
from servelab.analyse.prefix_cache import judge_point, kv_usage_series, tolerance
from servelab.deploy.engines import engine_for
from servelab.measure.hit_points import HitPoint, measure_hit_point
from servelab.phases.phase8_cache import judge_hit_point
from servelab.measure.launch_variants import serving, with_launch
from servelab.deploy.targets import load_target
from servelab.measure.workload import engine_tokenizer, token_pool

ISL = 256


def prom_value(text: str, name: str) -> float:
    """A plain-text read of one unlabelled sample (independent of servelab.measure.engine_metrics)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def matrix(llama_server_binary, tmp_path_factory):
    """The four target points plus the bad one, each on a freshly started engine (-lv 4 for its memory lines)."""
    run_dir = tmp_path_factory.mktemp("phase8")
    target = with_launch(load_target("local-tiny"), {"log_verbosity": 4})
    points = [HitPoint(r, ISL, 4, 4, 2) for r in (0.0, 0.2, 0.5, 0.8)]
    points.append(HitPoint(0.5, ISL, 4, 4, 2, cache_prompt=False, label="H8_hit50_bad"))
    out, logs = [], []
    for pt in points:
        with serving(target, run_dir / "logs" / pt.case_id) as srv:
            pool = token_pool(engine_tokenizer(srv.base_url, "llamacpp", "/tokenize"))
            out.append(judge_hit_point(measure_hit_point(srv, run_dir, pt, pool, seed=5, flush={"method": "restart"})))
            logs.append(Path(srv.log_paths["local"]).read_text())
    return run_dir, out, logs


@pytest.mark.slow
def test_matrix_hits_every_target_within_tolerance(matrix):
    _, res, _ = matrix
    tol = tolerance(1, ISL)
    assert tol == pytest.approx(0.005)                       # page 1 token: 1/256 < 0.5 pp
    for p in res[:4]:
        row = p.row
        assert row["verdict"] == "ACCEPTED", (p.point.case_id, row["reasons"])
        want = round(p.point.target_rate * ISL) / ISL
        assert row["counter_hit_rate"] == pytest.approx(want, abs=1e-12)
        assert row["usage_hit_rate"] == pytest.approx(want, abs=1e-12)
        assert abs(row["counter_hit_rate"] - p.point.target_rate) <= tol
        assert row["counter_window_matches_requests"] is True


@pytest.mark.slow
def test_counter_deltas_equal_a_hand_computation_from_raw_snapshots(matrix):
    run_dir, res, _ = matrix
    for p in res:
        srv_dir = run_dir / "cases" / p.point.case_id / "server"
        b, a = (srv_dir / "metrics_before.prom").read_text(), (srv_dir / "metrics_after.prom").read_text()
        name = "llamacpp:prompt_tokens_cached_total"
        d_cached = prom_value(a, name) - prom_value(b, name)
        d_prompt = prom_value(a, "llamacpp:prompt_tokens_total") - prom_value(b, "llamacpp:prompt_tokens_total")
        # llama.cpp's prompt_tokens_total excludes cached tokens: the total is their sum
        assert p.row["counter_cached_tokens"] == d_cached
        assert p.row["counter_prompt_tokens"] == d_prompt + d_cached
        raw = (run_dir / "cases" / p.point.case_id / "requests.jsonl").read_text()
        recs = [json.loads(x) for x in raw.splitlines()]
        measured = [r for r in recs if r["role"] == "measure"]
        assert len(measured) == 8 and {r["role"] for r in recs} <= {"measure", "prewarm"}
        usage_cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in measured)
        usage_prompt = sum(r["usage"]["prompt_tokens"] for r in measured)
        assert usage_prompt == 8 * ISL == d_prompt + d_cached   # the window holds exactly the measured requests
        assert p.row["usage_cached_tokens"] == usage_cached == d_cached


@pytest.mark.slow
def test_a_deliberately_bad_point_is_rejected_and_never_a_result(matrix):
    from servelab.analyse.prefix_cache import accepted_results, matrix_frame
    _, res, _ = matrix
    bad = res[4].row
    assert bad["verdict"] == "REJECTED"
    assert bad["counter_hit_rate"] == 0.0 and "misses the target 50%" in bad["reasons"]
    m = matrix_frame(res)
    assert "H8_hit50_bad" not in set(accepted_results(m)["case_id"])
    assert set(accepted_results(m)["case_id"]) == {"H8_hit00", "H8_hit20", "H8_hit50", "H8_hit80"}


def test_every_point_summary_follows_the_case_schema(matrix):
    """ACCEPTED is the summary's VALID, REJECTED its INVALID with the same reasons; one place for the verdict."""
    from servelab.measure.case_record import SCHEMA_VERSION, validate_summary
    run_dir, res, _ = matrix
    for p in res:
        s = validate_summary(json.loads((run_dir / "cases" / p.point.case_id / "summary.json").read_text()))
        assert (s["schema_version"], s["phase"], s["kind"]) == (SCHEMA_VERSION, "phase8", "prefix_cache")
        assert s["verdict"]["status"] == ("VALID" if p.row["verdict"] == "ACCEPTED" else "INVALID")
        assert "; ".join(s["verdict"]["reasons"]) == p.row["reasons"]
        assert "verdict" not in s["details"]["row"] and s["counts"]["measure"] == 8
        assert s["metrics"]["vllm"]["p50_ttft_ms"] == pytest.approx(p.row["p50_ttft_ms"])


def test_judge_point_rule():
    tol = tolerance(16, 1024)                                 # vLLM block 16 at ISL 1024: 1.5625 pp
    assert tol == pytest.approx(16 / 1024)
    assert judge_point(0.5, 0.49, 0.49, tol, 8, 8)[0] == "ACCEPTED"
    assert judge_point(0.5, 0.48, 0.49, tol, 8, 8)[0] == "REJECTED"
    v, reasons = judge_point(0.5, 0.5, None, tol, 0, 8)
    assert v == "REJECTED" and "second source missing" in reasons[0]
    assert judge_point(0.2, 0.2, 0.2, tolerance(1, 100), 7, 8)[0] == "REJECTED"   # one request did not report


@pytest.mark.slow
def test_kv_usage_comes_from_slots_token_counts(matrix):
    _, res, _ = matrix
    p = res[2]
    slots = p.slots
    assert not slots.empty
    last = slots[slots["ts_ns"] == slots["ts_ns"].max()]
    held_by_hand = last["n_prompt_tokens"].sum() / last["n_ctx"].sum()
    kv = kv_usage_series(slots, None, "llamacpp", {}, p.t0_ns, "x")
    assert set(kv["metric"]) == {"kv_active", "kv_held"}
    assert kv[kv["metric"] == "kv_held"]["value"].iloc[-1] == pytest.approx(held_by_hand)
    assert ((kv["value"] >= 0) & (kv["value"] <= 1)).all()
    # after the point, at least the four groups' slots hold a whole prompt each
    assert last["n_prompt_tokens"].sum() >= 4 * ISL


@pytest.mark.slow
def test_kv_cache_size_in_the_log_equals_the_model_arithmetic(matrix):
    _, _, logs = matrix
    mem = memory_breakdown(logs[0], engine_for("llamacpp"))
    kv = mem[mem["component"] == "KV cache"].iloc[0]
    # tiny model: 2 layers, 4 KV heads x 16 dims = 64 per token per layer, f16, context 65536, K and V
    expected_mib = 2 * 65536 * 64 * 2 * 2 / 2**20
    assert kv["mib"] == pytest.approx(expected_mib) and "2 layers" in kv["detail"]
    assert "not exposed" in memory_breakdown("no such lines", engine_for("llamacpp"))["detail"].iloc[0]


@pytest.mark.slow
def test_a_point_whose_client_loop_stalled_is_rejected_with_the_integrity_reason(tiny_server, tmp_path, monkeypatch):
    """Phase 8's loop (every group's requests side by side in one asyncio loop) has one loop-lag monitor: a point
    whose loop is blocked on purpose for 300 ms is REJECTED (summary INVALID) with the client's reason, and the page's
    matrix row says the client did not keep up."""
    import time

    from servelab.analyse.prefix_cache import matrix_frame
    from servelab.measure.case_record import validate_summary
    from servelab.measure import hit_points
    real = hit_points.run_async
    blocked: list[bool] = []

    async def slowed(*a, **kw):
        if not blocked:                    # the first request: hold the whole loop, as a blocking callback would
            blocked.append(True)
            time.sleep(0.3)
        assert kw.get("monitor_interval_s", 0) is None     # no per-request monitor: the loop's one does the work
        return await real(*a, **kw)

    monkeypatch.setattr(hit_points, "run_async", slowed)
    pool = token_pool(engine_tokenizer(tiny_server.base_url, "llamacpp", "/tokenize"))
    pt = HitPoint(0.0, ISL, 4, 4, 2, label="H8_stalled")
    res = judge_hit_point(measure_hit_point(tiny_server, tmp_path / "run", pt, pool, seed=5, flush={"method": "none"}))
    assert blocked
    row = res.row
    assert row["verdict"] == "REJECTED" and row["client_kept_up"] == "no" and row["loop_lag_max_ms"] >= 280
    assert "client fell behind: its event loop stalled" in row["reasons"]
    s = validate_summary(json.loads((tmp_path / "run" / "cases" / pt.case_id / "summary.json").read_text()))
    assert s["verdict"]["status"] == "INVALID"
    assert any(r.startswith("client fell behind: its event loop stalled") for r in s["verdict"]["reasons"])
    assert "; ".join(s["verdict"]["reasons"]) == row["reasons"]        # each reason once
    assert s["integrity"]["ok"] is False and s["integrity"]["loop_lag"]["max_ms"] >= 280
    m = matrix_frame([res])
    assert m.loc[0, "client_kept_up"] == "no" and "event loop stalled" in m.loc[0, "reasons"]
