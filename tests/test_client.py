"""The streaming client against the real llama-server (tiny model: one SSE chunk per token)."""
from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from servelab.measure import request_metrics as mx
from servelab.measure.client import (READ_BUFSIZE_BYTES, ClientConfig, ReadLog, _send, arrival_offsets_s, parse_stream,
                                     run_requests)
from servelab.measure.records import RequestRecord, read_records, write_records
from servelab.deploy.hosts import free_port
from servelab.measure.workload import build_text_workload, build_workload

pytestmark = pytest.mark.slow            # every test here starts a real engine


def cfg(srv, **kw):
    return ClientConfig(srv.base_url, "tiny", extra_body={"cache_prompt": False}, **kw)


def test_completions_exact_chunks_usage_and_consistent_metrics(tiny_server, pool, tmp_path):
    wl = build_workload("c", 16, 64, 33, pool, seed=1)
    run = run_requests(wl.requests, cfg(tiny_server), concurrency=8)
    assert len(run.records) == 16 and all(r.ok for r in run.records)
    for r in run.records:
        # 33 one-token text chunks + the final choices chunk (text "", finish_reason, usage), then [DONE]
        assert sum(1 for t in r.chunk_text if t) == 33
        assert len(r.chunk_ns) == 34 and r.chunk_text[-1] == "" and all(r.chunk_choices)
        assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (64, 33, "length")
        assert r.done_ns is not None and r.cached_tokens == 0
        assert r.send_ns <= r.headers_ns <= r.chunk_ns[0] <= r.chunk_ns[-1] <= r.end_ns
        assert r.chunk_wall_ns[0] - r.send_wall_ns == r.chunk_ns[0] - r.send_ns
        # metrics from the raw record, recomputed here: vLLM TTFT + Σ ITL telescopes to its E2E
        m = mx.request_metrics(r, "vllm")
        assert m.ttft_ms == pytest.approx((r.chunk_ns[0] - r.send_ns) / 1e6)
        assert m.ttft_ms + sum(m.itl_ms) == pytest.approx(m.e2el_ms)
        assert len(m.itl_ms) == 33
        s = mx.request_metrics(r, "sglang")
        assert len(s.itl_ms) == 32 and s.e2el_ms >= m.e2el_ms
        assert s.e2el_ms == pytest.approx((max(r.done_ns, r.chunk_ns[-1]) - r.send_ns) / 1e6)
        assert len(mx.per_token_itl(r)) == 32
    summ = mx.summarize(run.records, run.duration_s, "vllm")
    assert summ["total_output_tokens"] == 16 * 33 and summ["total_input_tokens"] == 16 * 64
    assert summ["token_check"]["exact"] is True
    assert summ["output_throughput"] == pytest.approx(16 * 33 / run.duration_s)
    # raw records survive a JSONL round trip
    write_records(tmp_path / "r.jsonl", run.records)
    back = read_records(tmp_path / "r.jsonl")
    assert [b.chunk_ns for b in back] == [r.chunk_ns for r in run.records]


def test_chat_usage_in_separate_chunk(tiny_server, tok):
    wl = build_text_workload("chat", 3, 30, 6, tok, seed=2)
    run = run_requests(wl.requests, cfg(tiny_server, api="chat"), concurrency=3)
    for r in run.records:
        assert r.ok and r.completion_tokens == 6
        assert r.chunk_choices[-1] is False and r.usage_ns == r.chunk_ns[-1]   # choices: [] usage chunk
        assert sum(1 for t in r.chunk_text if t) == 6
        v, s = mx.request_metrics(r, "vllm"), mx.request_metrics(r, "sglang")
        assert v.ttft_ms <= s.ttft_ms          # vLLM fires on the role chunk, SGLang on the first text


async def _raw_reads(srv, spec):
    reads = ReadLog()
    rec = RequestRecord("raw", 0, "measure", spec.input_tokens, spec.output_tokens)
    c = cfg(srv)
    async with aiohttp.ClientSession(read_bufsize=READ_BUFSIZE_BYTES) as session:
        await _send(session, spec, c, rec, reads)
    return rec, reads


def test_stream_parsing_is_robust_to_splits_and_missing_done(tiny_server, pool):
    spec = build_workload("p", 1, 20, 12, pool, seed=9).requests[0]
    rec, reads = asyncio.run(_raw_reads(tiny_server, spec))
    full = RequestRecord("f", 0, "measure", 20, 12, send_ns=rec.send_ns)
    parse_stream(full, reads, "completions")
    assert full.done_ns is not None and full.completion_tokens == 12
    # the same bytes re-cut into 7-byte reads parse to the same events
    blob = b"".join(d for _, d in reads)
    cut = [(i, blob[i:i + 7]) for i in range(0, len(blob), 7)]
    again = RequestRecord("g", 0, "measure", 20, 12)
    parse_stream(again, cut, "completions")
    assert again.chunk_text == full.chunk_text and again.usage == full.usage
    # a stream that ends without [DONE] still yields its chunks; the absence is recorded, not an error
    tail = blob[: blob.rindex(b"data: [DONE]")]
    trunc = RequestRecord("h", 0, "measure", 20, 12, http_status=200)
    parse_stream(trunc, [(1, tail)], "completions")
    assert trunc.done_ns is None and trunc.completion_tokens == 12 and not trunc.error_kind
    assert mx.summarize([trunc], 1.0, "vllm")["missing_done"] == 1


def test_open_loop_records_queue_time(tiny_server, pool):
    offs = arrival_offsets_s(5, 10.0, "constant", 0)
    assert offs.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    p1, p2 = arrival_offsets_s(50, 100.0, "poisson", 7), arrival_offsets_s(50, 100.0, "poisson", 7)
    assert np.array_equal(p1, p2) and p1[0] == 0 and np.all(np.diff(p1) > 0)
    # 12 arrivals at 500 rps capped at 2 in flight: later requests wait for a slot (coordinated omission)
    wl = build_workload("o", 12, 32, 40, pool, seed=4)
    run = run_requests(wl.requests, cfg(tiny_server), concurrency=2, rate_rps=500.0, arrival="constant")
    assert run.mode == "constant" and all(r.ok for r in run.records)
    q = [(r.dispatch_ns - r.scheduled_ns) / 1e6 for r in run.records]
    assert max(q) > 5.0                     # queued behind the cap (each request streams 40 tokens)
    s = mx.summarize(run.records, run.duration_s, "vllm")
    assert s["max_queue_time_ms"] == pytest.approx(max(q))
    assert s["mean_e2el_incl_queue_ms"] > s["mean_e2el_ms"]


def test_error_kinds(tiny_server, pool):
    too_long = build_workload("x", 1, 3000, 4, pool, seed=1).requests     # > 2048 tokens of a slot
    run = run_requests(too_long, cfg(tiny_server))
    r = run.records[0]
    assert r.error_kind == "http" and r.http_status == 400 and not r.ok
    dead = ClientConfig(f"http://127.0.0.1:{free_port()}", "tiny")
    assert run_requests(too_long, dead).records[0].error_kind == "connection"
    slow = build_workload("s", 1, 16, 1500, pool, seed=2).requests
    r = run_requests(slow, cfg(tiny_server, timeout_s=0.05)).records[0]
    assert r.error_kind == "timeout"
    s = mx.summarize([r], 1.0, "vllm")
    assert s["timeouts"] == 1 and s["failed"] == 1


def test_runs_inside_a_running_event_loop(tiny_server, pool):
    """Jupyter already runs a loop: the sync wrapper must still work there."""
    wl = build_workload("j", 2, 16, 3, pool, seed=1)

    async def inside():
        return run_requests(wl.requests, cfg(tiny_server))
    run = asyncio.run(inside())
    assert all(r.ok and r.completion_tokens == 3 for r in run.records)


def test_event_loop_choice_is_recorded_and_both_loops_give_the_same_records(tiny_server, pool):
    """asyncio by default, uvloop on request (``auto``: where installed); the run says which it was timed on, and the
    records are the same either way (exact chunks, usage, [DONE]); a bad choice is one line before any request."""
    from servelab.measure.client import loop_factory
    uvloop = pytest.importorskip("uvloop")
    assert loop_factory("auto") is uvloop.new_event_loop and loop_factory("asyncio") is None
    with pytest.raises(ValueError, match="'auto', 'uvloop' or 'asyncio'"):
        loop_factory("trio")
    wl = build_workload("l", 4, 16, 9, pool, seed=1)
    runs = {name: run_requests(wl.requests, cfg(tiny_server), concurrency=4, loop=name)
            for name in ("auto", "asyncio", "uvloop")}
    assert {k: r.event_loop for k, r in runs.items()} == {"auto": "uvloop", "asyncio": "asyncio", "uvloop": "uvloop"}
    assert run_requests(wl.requests, cfg(tiny_server), concurrency=4).event_loop == "asyncio"      # the default
    for run in runs.values():
        assert all(r.ok and r.completion_tokens == 9 and sum(1 for t in r.chunk_text if t) == 9
                   and r.done_ns is not None for r in run.records)
    # inside a running loop (Jupyter) the client's own loop, in its thread, is still the one asked for
    async def inside():
        return run_requests(wl.requests, cfg(tiny_server), loop="uvloop")
    assert asyncio.run(inside()).event_loop == "uvloop"
