"""The benchmarks' paced SSE server (``benchmarks/paced_sse_server.py``), run for real on loopback: what a client
reads from it (chunked SSE, the usage chunk, ``[DONE]``), its schedule (never early), keep-alive, and its answers
to bad requests."""
from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servelab.deploy.hosts import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "benchmarks" / "paced_sse_server.py"
ITL_MS = 5.0


@pytest.fixture(scope="module")
def port(paced_sse):
    return int(paced_sse(ITL_MS).rsplit(":", 1)[1])


def stream(conn: http.client.HTTPConnection, n: int) -> tuple[int, list[dict], bytes, int]:
    """POST one completion of ``n`` tokens; (status, the JSON events, the raw body, wall ns before sending)."""
    body = json.dumps({"model": "m", "prompt": list(range(16)), "max_tokens": n, "stream": True})
    sent = time.time_ns()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()                                # http.client undoes the chunked coding
    assert resp.getheader("Transfer-Encoding") == "chunked" or resp.status != 200
    events = [json.loads(m) for m in re.findall(rb"^data: (\{.*\})$", raw, re.M)]
    return resp.status, events, raw, sent


def test_a_stream_is_n_paced_tokens_then_usage_and_done(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    status, events, raw, sent = stream(conn, 12)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    tokens, usage = events[:-1], events[-1]
    assert len(tokens) == 12 and all(e["choices"][0]["text"] == "a" for e in tokens)
    assert usage["usage"] == {"prompt_tokens": 16, "completion_tokens": 12, "total_tokens": 28}
    assert usage["choices"][0]["finish_reason"] == "length"
    # chunk i is due one ITL × i after the request was read (which is after it was sent): never early
    stamps = [e["server_ts_ns"] for e in tokens]
    for i, ts in enumerate(stamps, start=1):
        assert ts >= sent + i * ITL_MS * 1e6 - 0.2e6, (i, (ts - sent) / 1e6)
    assert stamps == sorted(stamps)
    # the same connection serves a second request (keep-alive), and other paths answer plainly
    status, events, _, _ = stream(conn, 3)
    assert status == 200 and len(events) == 4
    for path, code, body in (("/health", 200, b"ok"), ("/nothing", 404, b"not found")):
        conn.request("GET", path)
        r = conn.getresponse()
        assert (r.status, r.read()) == (code, body)
    conn.request("GET", "/v1/models")
    assert json.loads(conn.getresponse().read())["data"][0]["id"] == "m"
    conn.close()


def test_many_streams_at_once_each_get_all_their_tokens(port):
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(40)]
    body = json.dumps({"prompt": "x" * 40, "max_tokens": 6})
    for c in conns:
        c.request("POST", "/v1/completions", body=body)
    for c in conns:
        raw = c.getresponse().read()
        assert raw.count(b'"server_ts_ns"') == 6 and b'"prompt_tokens": 10' in raw
        c.close()


def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/completions", body=b"{not json")
    r = conn.getresponse()
    assert r.status == 400 and b"max_tokens" in r.read()
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    status, events, _, _ = stream(conn, 2)
    assert status == 200 and len(events) == 3
    conn.close()


def test_refuses_a_bad_itl_in_one_line():
    p = subprocess.run([sys.executable, str(SERVER), str(free_port()), "0"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "ITL_MS must be > 0" in p.stderr
