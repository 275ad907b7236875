"""Both metric definitions on hand-built records; every expected value is worked out by hand below."""
from __future__ import annotations

import pytest

from servelab.measure import request_metrics as mx
from servelab.measure.records import RequestRecord

MS = 1_000_000  # ns per ms


def rec_completions() -> RequestRecord:
    """llama.cpp completions shape: 3 text chunks, a final empty choices chunk with usage, then [DONE].

    send 1000 ms; text at +10, +30, +60; final choices chunk (text "") at +70; [DONE] at +75.
    """
    s = 1000 * MS
    return RequestRecord("a", 0, "measure", expected_input_tokens=5, requested_output_tokens=3,
                         scheduled_ns=s, dispatch_ns=s, send_ns=s, end_ns=s + 76 * MS, http_status=200,
                         chunk_ns=[s + 10 * MS, s + 30 * MS, s + 60 * MS, s + 70 * MS],
                         chunk_text=["a", "b", "c", ""], chunk_choices=[True, True, True, True],
                         chunk_tokens=[None] * 4, done_ns=s + 75 * MS, prompt_tokens=5, completion_tokens=3,
                         finish_reason="length")


def rec_chat() -> RequestRecord:
    """Chat shape: role chunk (+5), "x" (+20), "y" (+50), finish chunk "" (+60), usage-only chunk (+65), [DONE] (+70).

    The workload expected 6 prompt tokens, the server counted 7 (a mismatch to report). Queued 4 ms.
    """
    s = 2000 * MS
    return RequestRecord("b", 1, "measure", expected_input_tokens=6, requested_output_tokens=2, api="chat",
                         scheduled_ns=s - 4 * MS, dispatch_ns=s, send_ns=s, end_ns=s + 71 * MS, http_status=200,
                         chunk_ns=[s + 5 * MS, s + 20 * MS, s + 50 * MS, s + 60 * MS, s + 65 * MS],
                         chunk_text=["", "x", "y", "", ""], chunk_choices=[True, True, True, True, False],
                         chunk_tokens=[None] * 5, done_ns=s + 70 * MS, usage_ns=s + 65 * MS, prompt_tokens=7,
                         completion_tokens=2)


def rec_failed() -> RequestRecord:
    s = 2500 * MS
    return RequestRecord("c", 2, "measure", expected_input_tokens=5, requested_output_tokens=3, scheduled_ns=s,
                         dispatch_ns=s, send_ns=s, end_ns=s + MS, http_status=500, error="HTTP 500", error_kind="http")


def test_sglang_definition_per_request():
    a = mx.request_metrics(rec_completions(), "sglang")
    assert a.ttft_ms == pytest.approx(10)            # first non-empty text
    assert a.itl_ms == pytest.approx([20, 30])       # text chunks only
    assert a.e2el_ms == pytest.approx(75)            # includes the [DONE] tail
    assert a.tpot_ms == pytest.approx((75 - 10) / 2)
    b = mx.request_metrics(rec_chat(), "sglang")
    assert b.ttft_ms == pytest.approx(20)            # the empty role chunk does not count
    assert b.itl_ms == pytest.approx([30])
    assert b.e2el_ms == pytest.approx(70)
    assert b.tpot_ms == pytest.approx(50)
    assert b.input_tokens == 6                       # dataset length, not the server's 7


def test_vllm_definition_per_request():
    a = mx.request_metrics(rec_completions(), "vllm")
    assert a.ttft_ms == pytest.approx(10)
    assert a.itl_ms == pytest.approx([20, 30, 10])   # every choices chunk, incl. the empty final one
    assert a.e2el_ms == pytest.approx(70)            # last choices chunk; [DONE] excluded
    assert a.tpot_ms == pytest.approx(30)
    b = mx.request_metrics(rec_chat(), "vllm")
    assert b.ttft_ms == pytest.approx(5)             # the role chunk has choices → TTFT
    assert b.itl_ms == pytest.approx([15, 30, 10])   # usage-only chunk (choices []) excluded
    assert b.e2el_ms == pytest.approx(60)
    assert b.tpot_ms == pytest.approx(55)
    assert b.input_tokens == 7                       # server truth
    assert b.queue_time_ms == pytest.approx(4)


def test_summaries_both_definitions():
    recs = [rec_completions(), rec_chat(), rec_failed()]
    s = mx.summarize(recs, 2.0, "sglang")
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["errors_by_kind"] == {"http": 1}
    assert s["total_input_tokens"] == 11 and s["total_output_tokens"] == 5
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(8.0)
    assert s["mean_itl_ms"] == pytest.approx((20 + 30 + 30) / 3)
    assert s["p90_e2el_ms"] == pytest.approx(70 + 0.9 * 5)          # [70, 75], linear
    assert s["p50_tpot_ms"] == pytest.approx((32.5 + 50) / 2)
    assert s["p90_tpot_ms"] == pytest.approx(32.5 + 0.9 * 17.5)
    assert s["definition"] == "sglang" and "linear" in s["percentile_method"]
    v = mx.summarize(recs, 2.0, "vllm")
    assert v["total_input_tokens"] == 12
    assert v["median_itl_ms"] == pytest.approx(17.5)                 # sorted 10,10,15,20,30,30
    assert v["p90_itl_ms"] == pytest.approx(30)
    assert v["mean_itl_ms"] == pytest.approx(115 / 6)
    assert v["p90_e2el_ms"] == pytest.approx(60 + 0.9 * 10)
    assert v["mean_tpot_ms"] == pytest.approx(42.5)
    assert v["max_itl_ms"] == pytest.approx(30)
    # the per-token ITL is definition-independent: 1 token per text chunk here
    assert v["mean_itl_per_token_ms"] == pytest.approx((20 + 30 + 30) / 3)
    assert v["itl_per_token_available"] is True


def test_goodput_follows_vllm_semantics():
    recs = [rec_completions(), rec_chat(), rec_failed()]
    slo = mx.SLO(ttft_ms=8, tpot_ms=60)
    v = mx.summarize(recs, 2.0, "vllm", slo)
    assert v["good_requests"] == 1 and v["request_goodput"] == pytest.approx(0.5)   # only b (TTFT 5 ms)
    s = mx.summarize(recs, 2.0, "sglang", slo)
    assert s["good_requests"] == 0                                                   # b's sglang TTFT is 20 ms
    one_token = rec_completions()
    one_token.completion_tokens = 1
    m = mx.request_metrics(one_token, "vllm")
    assert m.tpot_ms is None and mx.SLO(tpot_ms=0.001).good(m)   # ≤ 1 output token: TPOT counts as 0


def test_native_generate_itl_split_per_token():
    s = 0
    r = RequestRecord("d", 0, "measure", 4, 5, api="generate", send_ns=s, end_ns=60 * MS, http_status=200,
                      chunk_ns=[10 * MS, 40 * MS, 50 * MS], chunk_text=["ab", "cde", ""],
                      chunk_choices=[True, True, True], chunk_tokens=[2, 3, 0], completion_tokens=5, prompt_tokens=4)
    m = mx.request_metrics(r, "sglang")
    assert m.itl_ms == pytest.approx([10, 10, 10])        # 30 ms gap over 3 new tokens
    assert mx.per_token_itl(r) == pytest.approx([10, 10, 10])
    assert mx.request_metrics(r, "vllm").itl_ms == pytest.approx([30, 10])   # vLLM never splits


def test_token_check_reports_mismatch_and_fallbacks():
    recs = [rec_completions(), rec_chat()]
    tc = mx.token_check(recs)
    assert tc["checked"] == 2 and tc["mismatches"] == 1
    assert tc["examples"][0]["server_input"] == 7 and tc["examples"][0]["expected_input"] == 6
    no_usage = rec_completions()
    no_usage.completion_tokens = None
    assert mx.request_metrics(no_usage, "sglang").output_tokens_source == "requested"
    assert mx.request_metrics(no_usage, "vllm").output_tokens_source == "chunks"
    assert mx.request_metrics(no_usage, "vllm").output_tokens == 3
    assert mx.per_token_itl(no_usage) is None            # deltas unknown and no count to check against


def test_cv_and_validity():
    cv = mx.cv_across_repeats([{"output_throughput": 100.0}, {"output_throughput": 110.0},
                               {"output_throughput": 90.0}], keys=("output_throughput",))
    assert cv["output_throughput"]["std"] == pytest.approx(10.0)      # sample std of 100/110/90
    assert cv["output_throughput"]["cv_pct"] == pytest.approx(10.0)
    s = mx.summarize([rec_completions(), rec_chat(), rec_failed()], 2.0, "vllm")
    v = mx.validity(s, mx.ValidityRules(min_completed=3, min_window_s=5.0, max_cv_pct=3.0), profiler_attached=True,
                    cv=cv)
    assert v.verdict == "INVALID"
    text = " | ".join(v.reasons)
    for needle in ("too few completed", "window too short", "errors", "off target", "profiler", "CV"):
        assert needle in text, needle
    ok = mx.summarize([rec_completions()], 2.0, "vllm")
    assert mx.validity(ok, mx.ValidityRules()).verdict == "VALID"


def test_unknown_definition_is_rejected():
    with pytest.raises(ValueError, match="definition"):
        mx.request_metrics(rec_completions(), "guidellm")
