"""The client's raw transport (``measure.http_stream``) against the real llama-server: the same records as the aiohttp
transport, the chunked framing undone byte for byte with each byte's read time, the same error kinds, and bad input
refused before anything is sent."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.http_stream import (StreamResponse, dechunk, post_stream, quickack_once, request_head,
                                          split_url)
from servelab.measure.workload import build_text_workload, build_workload, request_body
from servelab.deploy.hosts import free_port


def test_bad_input_is_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="not a valid HTTP header"):
        request_head("127.0.0.1", 80, "/v1/completions", {"X-Request-ID": "a\r\nX-Evil: 1"}, 2)
    with pytest.raises(ValueError, match="not a valid HTTP header"):
        request_head("127.0.0.1", 80, "/", {"Bad:Name": "v"}, 0)
    with pytest.raises(ValueError, match="plain http"):
        split_url("https://127.0.0.1:8443/v1/completions")
    with pytest.raises(ValueError, match="transport 'raw' speaks plain http:// only"):
        ClientConfig("https://example.invalid", "m", transport="raw")
    with pytest.raises(ValueError, match="unknown transport 'h2'"):
        ClientConfig("http://127.0.0.1:1", "m", transport="h2")
    assert ClientConfig("https://example.invalid", "m", transport="auto").raw is False
    assert ClientConfig("http://127.0.0.1:1", "m", transport="auto").raw is True
    head = request_head("127.0.0.1", 8000, "/v1/completions?x=1", {"Authorization": "Bearer k", "Host": "evil"}, 5)
    assert head.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Length: 5\r\n")
    assert b"Host: evil" not in head and head.endswith(b"Authorization: Bearer k\r\n\r\n")


def cfg(srv, **kw):
    return ClientConfig(srv.base_url, "tiny", extra_body={"cache_prompt": False}, **kw)


@pytest.mark.slow
def test_raw_and_aiohttp_transports_give_the_same_records(tiny_server, pool, tok):
    wl = build_workload("t", 12, 48, 21, pool, seed=3)
    runs = {t: run_requests(wl.requests, cfg(tiny_server, transport=t), concurrency=6) for t in ("aiohttp", "raw")}
    for a, r in zip(runs["aiohttp"].records, runs["raw"].records):
        assert r.ok and a.ok
        assert r.chunk_text == a.chunk_text and r.usage == a.usage and r.finish_reason == a.finish_reason == "length"
        assert len(r.chunk_ns) == 22 and r.done_ns is not None and r.http_status == 200
        assert r.send_ns < r.headers_ns <= r.chunk_ns[0] <= r.chunk_ns[-1] <= r.done_ns <= r.end_ns
    # chat: the usage in its own choices-less chunk, as with aiohttp
    chat = build_text_workload("chat", 2, 30, 5, tok, seed=2)
    for r in run_requests(chat.requests, cfg(tiny_server, api="chat", transport="raw"), concurrency=2).records:
        assert r.ok and r.completion_tokens == 5 and r.chunk_choices[-1] is False and r.usage_ns == r.chunk_ns[-1]


@pytest.mark.slow
def test_dechunk_keeps_every_payload_byte_with_the_read_that_delivered_it(tiny_server, pool):
    spec = build_workload("d", 1, 20, 9, pool, seed=5).requests[0]
    body = request_body(spec, "llamacpp", "completions", "tiny", {"cache_prompt": False})
    ts, data, resp = [], [], StreamResponse()
    import json
    asyncio.run(post_stream(tiny_server.base_url + "/v1/completions", json.dumps(body).encode(),
                            {"Content-Type": "application/json"}, ts, data, 60.0, True, resp))
    assert resp.status == 200 and resp.chunked and resp.headers["content-type"].startswith("text/event-stream")
    raw = b"".join(data)
    # the payload and each payload byte's offset in the raw body, by an independent reading of the chunked coding
    payload, offsets, p = b"", [], 0
    while True:
        eol = raw.index(b"\r\n", p)
        size = int(raw[p:eol], 16)
        if size == 0:
            break
        payload += raw[eol + 2:eol + 2 + size]
        offsets += range(eol + 2, eol + 2 + size)
        p = eol + 2 + size + 2
    assert payload.count(b"data: ") == 11 and payload.rstrip().endswith(b"data: [DONE]")
    out_ts, out = dechunk(ts, data)
    assert b"".join(out) == payload and out_ts == sorted(out_ts)
    # the same bytes re-cut into k-byte reads (read i at time i): each payload byte keeps its read's time
    for k in (1, 2, 3, 7, 64):
        cut = [raw[i:i + k] for i in range(0, len(raw), k)]
        t2, d2 = dechunk(list(range(len(cut))), cut)
        expected: dict[int, bytes] = {}
        for b, off in zip(payload, offsets):
            expected[off // k] = expected.get(off // k, b"") + bytes([b])
        assert dict(zip(t2, d2)) == expected and len(t2) == len(expected)


def one_shot(specs, reply: bytes):
    """Send ``specs[0]`` through the raw transport to a loopback server that accepts once, reads the request,
    writes ``reply`` and closes; returns the record."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        c, _ = srv.accept()
        c.recv(65536)
        if reply:
            c.sendall(reply)
        c.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        return run_requests(specs, ClientConfig(f"http://127.0.0.1:{srv.getsockname()[1]}", "tiny",
                                                transport="raw")).records[0]
    finally:
        t.join(5)
        srv.close()


@pytest.mark.slow
def test_raw_transport_error_kinds(tiny_server, pool):
    too_long = build_workload("x", 1, 3000, 4, pool, seed=1).requests     # > 2048 tokens of a slot
    r = run_requests(too_long, cfg(tiny_server, transport="raw")).records[0]
    assert (r.error_kind, r.http_status, r.ok) == ("http", 400, False) and "HTTP 400: {" in r.error
    dead = ClientConfig(f"http://127.0.0.1:{free_port()}", "tiny", transport="raw")
    assert run_requests(too_long, dead).records[0].error_kind == "connection"
    slow = build_workload("s", 1, 16, 1500, pool, seed=2).requests
    r = run_requests(slow, cfg(tiny_server, transport="raw", timeout_s=0.05)).records[0]
    assert r.error_kind == "timeout" and not r.ok
    # a server that accepts, reads and closes without a response head: a connection error, not a hang
    r = one_shot(too_long, b"")
    assert r.error_kind == "connection" and "before a response head" in r.error
    # a server that dies mid-stream (one SSE chunk, then the connection closes without the terminal chunk): a
    # connection error, and the chunk that came is kept
    event = b'data: {"choices":[{"text":"a","index":0}]}\n\n'
    r = one_shot(too_long, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + b"%x\r\n" % len(event) + event + b"\r\n")
    assert (r.error_kind, r.http_status, r.ok) == ("connection", 200, False)
    assert "before the end of the chunked body" in r.error and r.chunk_text == ["a"]


def test_a_complete_response_costs_nothing_more_when_its_connection_closes(monkeypatch):
    """After the terminal chunk the response is done; its connection's close must not re-parse the body on the
    hot path (that took ~0.1 ms a stream and made the last chunks of a burst of completions late by ms)."""
    from servelab.measure import http_stream as hs
    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        ts: list[int] = []
        data: list[bytes] = []
        proto = hs._StreamProtocol(ts, data, done)

        class Transport:
            closed = False

            def close(self) -> None:
                self.closed = True
        proto.connection_made(Transport())
        event = b'data: {"choices":[{"text":"a","index":0}]}\n\n'
        proto.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        proto.data_received(b"%x\r\n%s\r\n" % (len(event), event))
        proto.data_received(b"0\r\n\r\n")
        assert done.done() and done.exception() is None and proto.transport.closed

        def no_parsing(raw: bytes) -> None:
            raise AssertionError("the body was parsed again when the connection closed")
        monkeypatch.setattr(hs, "_chunk_spans", no_parsing)
        proto.connection_lost(None)
        assert done.exception() is None
        assert len(data) == 2 and len(ts) == 2          # both body reads kept, for the parse after the wave
    finally:
        loop.close()


def _nagle_stream(quickack: bool, chunks: int = 30, itl_s: float = 0.01) -> list[float]:
    """A writer with Nagle on (no TCP_NODELAY, as a stock cpp-httplib) speaks first, the reader answers at once —
    which puts the reader's socket in Linux's delayed-ACK ("pingpong") mode — then the writer sends ``chunks`` small
    writes ``itl_s`` apart. Returns the reader's gaps between reads (ms)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()

    def writer() -> None:
        c, _ = ls.accept()
        with c:
            c.sendall(b"hello")
            c.recv(100)
            t0 = time.perf_counter()
            for i in range(1, chunks + 1):
                while time.perf_counter() < t0 + i * itl_s:
                    time.sleep(0.0005)
                c.send(b"data: %03d\n\n" % i)
    th = threading.Thread(target=writer)
    th.start()
    ts = []
    try:
        with socket.create_connection(ls.getsockname()) as s:
            s.recv(5)
            s.sendall(b"request")
            if quickack:
                assert quickack_once(s)
            while s.recv(4096):
                ts.append(time.perf_counter())
    finally:
        th.join()
        ls.close()
    return [(b - a) * 1e3 for a, b in zip(ts, ts[1:])]


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux's")
@pytest.mark.flaky(reruns=2, reruns_delay=1)     # a 20 ms stall of a shared 2-core machine would look like one
def test_one_quickack_after_the_request_keeps_every_ack_immediate():
    """What the client relies on (``http_stream.quickack_once``): set once after this side's last send, the
    kernel ACKs every later small segment at once, so a Nagle writer is never held for a delayed ACK (>= 40 ms);
    without it the same exchange stalls."""
    without = _nagle_stream(quickack=False)
    assert max(without) >= 38, f"the control did not stall (max gap {max(without):.1f} ms): not in delayed-ACK mode"
    once = _nagle_stream(quickack=True)
    assert max(once) < 30, f"a gap of {max(once):.1f} ms with one quick-ACK after the send"


def test_completions_are_handed_over_one_per_turn_of_the_loop(monkeypatch):
    """A wave's streams that end together: each complete response waits its turn in the run's CompletionQueue —
    one per turn of the loop, which polls the sockets between turns — and its connection's close in the meantime
    neither finishes it twice nor parses its body again."""
    from servelab.measure import http_stream as hs

    class Transport:
        closed = False

        def close(self) -> None:
            self.closed = True

    def no_parsing(raw: bytes) -> None:
        raise AssertionError("the body was parsed again when the connection closed")

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        queue = hs.CompletionQueue(loop)
        protos = []
        for _ in range(3):
            p = hs._StreamProtocol([], [], loop.create_future(), queue)
            p.connection_made(Transport())
            p.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
            p.data_received(b"ok")                        # complete: queued, not finished
            protos.append(p)
        monkeypatch.setattr(hs, "_chunk_spans", no_parsing)
        protos[2].connection_lost(None)                   # the server closed first: nothing to do yet
        seen = [sum(p.done.done() for p in protos)]
        for _ in range(3):
            await asyncio.sleep(0)                        # one turn of the loop
            seen.append(sum(p.done.done() for p in protos))
        assert all(p.done.exception() is None and p.transport.closed for p in protos)
        assert not queue.queue and not queue.scheduled
        return seen
    assert asyncio.run(main()) == [0, 1, 2, 3]
