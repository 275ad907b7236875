"""Concurrency search: stop rules on scripted point results, then a real search on the tiny llama-server."""
from __future__ import annotations

from pathlib import Path

import pytest

from servelab.measure import case as cs
from servelab.measure import request_metrics as mx
from servelab.measure.matrix import dispatch_case
from servelab.measure.search import STOP_REASONS, SearchConfig, concurrency_search, ladder


def test_ladder_is_add_step():
    assert ladder(16, 64) == [1, 16, 32, 48, 64]
    assert ladder(4, 10) == [1, 4, 8]
    assert ladder(1, 3) == [1, 2, 3]


class Scripted:
    """A runner returning made-up point results: tps / p95 TTFT / p95 TPOT per concurrency, or a status."""

    def __init__(self, table: dict[int, tuple], status: dict[int, str] | None = None):
        self.table, self.status, self.calls = table, status or {}, []

    def __call__(self, env, case):
        c = case.concurrency
        self.calls.append(c)
        st = self.status.get(c, cs.SUCCESS)
        if st == cs.ENGINE_CRASH:
            raise cs.EngineCrash(f"C={c} gone")
        tps, ttft, tpot = self.table[c]
        s = {"output_throughput": tps, "total_token_throughput": 2 * tps, "p95_ttft_ms": ttft, "p50_ttft_ms": ttft,
             "p99_ttft_ms": ttft, "p95_tpot_ms": tpot, "p50_tpot_ms": tpot, "p99_tpot_ms": tpot,
             "median_tok_per_s_per_user": 1000 / tpot, "p95_e2el_ms": None}
        res = cs.CaseResult(case, st, Path("/nonexistent"), {"vllm": s, "sglang": s}, verdict=mx.Verdict("VALID"))
        if st == cs.OOM:
            res.log_events = {"oom": ["failed to allocate 1 GiB"]}
        return res


class Env:
    def __init__(self, slo=None):
        self.slo = slo or mx.SLO()


def cfg(**kw):
    return SearchConfig(input_tokens=8, output_tokens=8, step=16, max_concurrency=64, **kw)


def test_saturation_stop_and_three_answers():
    r = Scripted({1: (100, 10, 5), 16: (800, 20, 8), 32: (820, 60, 12)})
    res = concurrency_search(Env(mx.SLO(ttft_ms=50, tpot_ms=10)), cfg(stop_on_slo=False), runner=r)
    assert res.stop_reason == "TPS_SATURATED" and r.calls == [1, 16, 32]
    assert res.max_successful_concurrency == 32
    assert res.max_tps_concurrency == 32
    assert res.max_under_slo_concurrency == 16        # 32 misses both SLOs
    f = res.frontier()
    assert f["meets_slo"].tolist() == [True, True, False]


def test_regression_fallback_probes_the_midpoint():
    r = Scripted({1: (100, 1, 1), 16: (800, 1, 1), 32: (1000, 1, 1), 48: (700, 1, 1), 40: (900, 1, 1)})
    res = concurrency_search(Env(), cfg(), runner=r)
    assert res.stop_reason == "TPS_REGRESSION" and r.calls == [1, 16, 32, 48, 40]
    assert [p.role for p in res.points][-1] == "fallback"
    assert res.max_tps_concurrency == 32 and res.max_successful_concurrency == 48
    assert res.max_under_slo_concurrency is None       # no SLO given: not the same number as the others


@pytest.mark.parametrize("slo,reason", [(mx.SLO(ttft_ms=15), "TTFT_SLO_EXCEEDED"),
                                        (mx.SLO(tpot_ms=6), "TPOT_SLO_EXCEEDED")])
def test_slo_stops(slo, reason):
    r = Scripted({1: (100, 10, 5), 16: (800, 20, 8), 32: (1600, 30, 9)})
    res = concurrency_search(Env(slo), cfg(), runner=r)
    assert res.stop_reason == reason and r.calls == [1, 16]
    assert res.max_under_slo_concurrency == 1 and res.max_successful_concurrency == 16


def test_crash_oom_and_max_reached():
    r = Scripted({1: (100, 1, 1), 16: (800, 1, 1)}, status={32: cs.ENGINE_CRASH})
    res = concurrency_search(Env(), cfg(), runner=r)
    assert res.stop_reason == "ENGINE_CRASH" and res.max_successful_concurrency == 16
    r = Scripted({1: (100, 1, 1), 16: (800, 1, 1)}, status={16: cs.OOM})
    res = concurrency_search(Env(), cfg(), runner=r)
    assert res.stop_reason == "OOM" and "failed to allocate" in res.stop_detail
    assert res.max_successful_concurrency == 1
    r = Scripted({1: (100, 1, 1), 16: (800, 1, 1), 32: (1600, 1, 1), 48: (2400, 1, 1), 64: (3200, 1, 1)})
    res = concurrency_search(Env(), cfg(), runner=r)
    assert res.stop_reason == "MAX_CONCURRENCY_REACHED" and res.max_tps_concurrency == 64
    assert set(STOP_REASONS) >= {p for p in ("OOM", "ENGINE_CRASH", "MAX_CONCURRENCY_REACHED")}


@pytest.mark.slow
def test_real_search_on_tiny_server(tiny_server, tmp_path):
    env = cs.make_env(tiny_server, tmp_path / "run", slo=mx.SLO(ttft_ms=10_000, tpot_ms=1_000))
    res = concurrency_search(env, SearchConfig(32, 24, step=4, max_concurrency=8, saturation_gain_pct=-1000,
                                               regression_pct=1000), runner=dispatch_case)
    assert res.stop_reason == "MAX_CONCURRENCY_REACHED"
    assert [p.concurrency for p in res.points] == [1, 4, 8]
    assert all(p.status == "success" and p.output_tps > 0 for p in res.points)
    assert res.max_successful_concurrency == 8 and res.max_under_slo_concurrency == 8
    best = max(res.points, key=lambda p: p.output_tps)
    assert res.max_tps_concurrency == best.concurrency
    assert (tmp_path / "run" / "cases" / "search_c8" / "requests.jsonl").exists()


@pytest.mark.slow
def test_search_points_are_sized_to_their_window(tiny_server, tmp_path):
    """A point on a fast server keeps issuing until its minimum window has passed: valid, not "window too short"."""
    import json
    env = cs.make_env(tiny_server, tmp_path / "run")
    res = concurrency_search(env, SearchConfig(8, 4, step=4, max_concurrency=4, saturation_gain_pct=-1000,
                                               regression_pct=1000, min_window_s=0.6), runner=dispatch_case)
    assert [p.concurrency for p in res.points] == [1, 4]
    for p in res.points:
        summ = json.loads((tmp_path / "run" / "cases" / p.case_id / "summary.json").read_text())
        assert summ["verdict"]["status"] == "VALID", summ["verdict"]
        assert summ["counts"]["completed"] > p.concurrency          # more than one wave was needed for 0.6 s


def test_a_search_point_from_one_request_is_invalid_and_decides_nothing():
    """Sized like a case (docs/case.md#sizing): the C=1 point must send as many requests as D1; one request is INVALID
    ("too few requests"), is kept in the frontier, marked, and neither stops the ladder nor answers max-TPS."""
    from servelab.measure.search import point_requests, search_case
    c = cfg(c1_requests=11)
    assert point_requests(c, 1) == 11 and point_requests(c, 16) == 32        # two waves, as the matrix's cases
    assert search_case(c, 1).num_prompts == 11

    class OneRequestAtC1(Scripted):
        def __call__(self, env, case):
            res = super().__call__(env, case)
            for s in res.summaries.values():
                s["completed"] = 1 if case.concurrency == 1 else case.num_prompts
            return res
    r = OneRequestAtC1({1: (900, 1, 1), 16: (800, 1, 1), 32: (790, 1, 1)})
    res = concurrency_search(Env(), c, runner=r)
    p1 = res.points[0]
    assert p1.verdict == "INVALID" and any(x.startswith("too few requests: 1 completed < 11") for x in p1.reasons)
    # C=1's 900 tok/s would have made C=16 a regression; an INVALID point decides nothing: the ladder went on
    assert r.calls == [1, 16, 32] and res.stop_reason == "TPS_SATURATED"
    assert res.max_tps_concurrency == 16
    f = res.frontier()
    assert f.loc[f["concurrency"] == 1, "validity"].item() == "INVALID"
    assert f.loc[f["concurrency"] == 1, "requests"].item() == 1


def test_no_valid_point_no_max_tps_answer():
    class AllInvalid(Scripted):
        def __call__(self, env, case):
            res = super().__call__(env, case)
            res.verdict = mx.Verdict("INVALID", ["client fell behind"])
            return res
    res = concurrency_search(Env(), cfg(), runner=AllInvalid({1: (1, 1, 1), 16: (2, 1, 1), 32: (3, 1, 1),
                                                             48: (4, 1, 1), 64: (5, 1, 1)}))
    assert res.max_tps_concurrency is None and res.max_successful_concurrency == 64
