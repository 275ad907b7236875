"""Conformance with SGLang ``bench_serving`` 0.5.9 (the reference client, in its own venv; never a dependency).

Two levels:

1. **Aggregation, exact.** Our client's raw records are reduced to bench_serving's per-request fields with
   SGLang's per-request rules written out here in plain Python (TTFT = first non-empty text chunk, ITL = gaps
   between non-empty text chunks, latency = last SSE line incl. ``[DONE]``, output_len = server
   ``completion_tokens``, prompt_len = dataset length) and fed to bench_serving's *own* ``calculate_metrics``.
   Every number it returns must equal ours under the ``sglang`` definition to 1e-9 relative: same TPOT filter,
   same pooled ITL, same numpy percentiles (linear) and std (ddof 0), same totals and throughputs.
2. **End to end, within tolerance.** bench_serving and our client each run the same workload shape against the
   same tiny llama-server, interleaved three times (32 requests, 64 prompt tokens as the server counts them,
   32 output tokens, concurrency 8). Counts must agree exactly in every run (completed, output tokens). The
   median over the three runs of each client's median TPOT, ITL and output throughput must be within a factor
   2.5 of the other's, median TTFT and E2E within a factor 6 (or, for all, within 5 ms) — for TTFT/E2E a
   check against unit and window slips only.
   Why so wide: the runs are sequential on a 2-core machine that also runs the server (and, in CI and
   development, other jobs); measured here, the *same* client's median TTFT ranged 30–310 ms and its median
   TPOT 0.8–39 ms across back-to-back runs whenever another process took a core. bench_serving also opens one HTTP session
   per request and sends text (re-tokenized by the server), we send token ids on a shared session. Our
   client runs here with ``tcp_quickack=False``, bench_serving's TCP behaviour (any default socket): a stock
   llama-server writes without TCP_NODELAY (the one built here sets it), and a client that delays its ACKs
   can then see ~40-200 ms Nagle stalls — a transport artifact, not a metric definition, so both clients get
   the same TCP behaviour for this comparison. Even so, bench_serving's
   median TTFT came out 1.5–4.2x ours at this shape (e.g. 28 vs 118 ms), which is why TTFT and E2E get the
   wider factor; the cause is on the client side of the request (it opens a session and a connection per
   request and sends a text prompt) and not settled here. Level 1
   is where exactness is proven; level 2 only catches gross disagreement (a unit slip, a wrong window, a
   definition mix-up such as E2E without the stream tail).
"""
from __future__ import annotations

import json
import sys
import subprocess
from pathlib import Path

import numpy as np
import pytest

from servelab.measure import request_metrics as mx
from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.workload import build_workload, engine_tokenizer, token_pool

sys.path.insert(0, str(Path(__file__).parent))
import benchmod  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """(module, venv python, tokenizer dir) — skipped with the reason if the reference venv cannot be built."""
    be = benchmod.load("bench_serving_env")
    try:
        py = be.ensure_bench_serving()
        from servelab.deploy.models import resolve_model
        tok = be.ensure_gguf_tokenizer(Path(resolve_model("tiny")), tmp_path_factory.mktemp("tok") / "tiny-tok")
    except Exception as exc:  # e.g. no PyPI access: this reference is optional, the library never needs it
        pytest.skip(f"SGLang bench_serving 0.5.9 venv or tokenizer could not be built: {exc}")
    return be, py, tok


def test_converted_tokenizer_matches_the_server(bench, tiny_server):
    be, py, tok = bench
    text = "Hello world, 42 tokens?"
    out = subprocess.run([str(py), "-c", "import sys,json;from transformers import AutoTokenizer;"
                          f"print(json.dumps(AutoTokenizer.from_pretrained(sys.argv[1]).encode({text!r})))", str(tok)],
                         capture_output=True, text=True, env={**be.OFFLINE_ENV, "PATH": "/usr/bin:/bin"}, check=True)
    ours = engine_tokenizer(tiny_server.base_url, "llamacpp", "/tokenize")(text, True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ours


CALC = r"""
import json, sys
import sglang.bench_serving as bs
from transformers import AutoTokenizer
d = json.load(open(sys.argv[1]))
tok = AutoTokenizer.from_pretrained(sys.argv[2])
bs.args = type("A", (), {"plot_throughput": False})()
rows, outs = [], []
for r in d["requests"]:
    rows.append(bs.DatasetRow(prompt="", prompt_len=r["prompt_len"], output_len=r["output_len"]))
    o = bs.RequestFuncOutput(success=r["success"], latency=r["latency"], ttft=r["ttft"], itl=r["itl"],
                             prompt_len=r["prompt_len"], output_len=r["output_len"], start_time=r["start"])
    outs.append(o)
m, _ = bs.calculate_metrics(rows, outs, d["duration"], tok, "vllm")
print(json.dumps(m.__dict__))
"""


def test_aggregation_equals_bench_serving_calculate_metrics(bench, tiny_server, tmp_path):
    be, py, tok_dir = bench
    pool = token_pool(engine_tokenizer(tiny_server.base_url, "llamacpp", "/tokenize"))
    wl = build_workload("conf", 24, 48, 20, pool, seed=21)
    run = run_requests(wl.requests, ClientConfig(tiny_server.base_url, "tiny", extra_body={"cache_prompt": False}),
                       concurrency=6)
    reqs = []
    for r in run.records:
        text = [i for i, t in enumerate(r.chunk_text) if t]
        last = max([*r.chunk_ns, r.done_ns or 0])
        reqs.append({"success": r.ok, "ttft": (r.chunk_ns[text[0]] - r.send_ns) / 1e9,
                     "itl": [(r.chunk_ns[b] - r.chunk_ns[a]) / 1e9 for a, b in zip(text, text[1:])],
                     "latency": (last - r.send_ns) / 1e9, "output_len": r.completion_tokens,
                     "prompt_len": r.expected_input_tokens, "start": r.send_ns / 1e9})
    (tmp_path / "in.json").write_text(json.dumps({"requests": reqs, "duration": run.duration_s}))
    p = subprocess.run([str(py), "-c", CALC, str(tmp_path / "in.json"), str(tok_dir)], capture_output=True, text=True,
                       env={**be.OFFLINE_ENV, "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    theirs = json.loads(p.stdout.strip().splitlines()[-1])
    ours = mx.summarize(run.records, run.duration_s, "sglang")
    pairs = {"completed": "completed", "total_input": "total_input_tokens", "total_output": "total_output_tokens",
             "request_throughput": "request_throughput", "input_throughput": "input_throughput",
             "output_throughput": "output_throughput", "total_throughput": "total_token_throughput"}
    for m in ("ttft", "tpot", "itl"):
        for st in ("mean", "median", "std", "p99"):
            pairs[f"{st}_{m}_ms"] = f"{st}_{m}_ms"
    pairs.update(p95_itl_ms="p95_itl_ms", max_itl_ms="max_itl_ms", mean_e2e_latency_ms="mean_e2el_ms",
                 median_e2e_latency_ms="median_e2el_ms", std_e2e_latency_ms="std_e2el_ms",
                 p90_e2e_latency_ms="p90_e2el_ms", p99_e2e_latency_ms="p99_e2el_ms")
    for k_theirs, k_ours in pairs.items():
        assert ours[k_ours] == pytest.approx(theirs[k_theirs], rel=1e-9, abs=1e-9), (k_theirs, k_ours)
    assert theirs["completed"] == 24 and theirs["total_output"] == 24 * 20


@pytest.mark.flaky(reruns=2, reruns_delay=5)   # timing under CPU contention (2 shared cores): see pyproject
def test_end_to_end_against_bench_serving(bench, tiny_server, tmp_path):
    be, py, tok_dir = bench
    pool = token_pool(engine_tokenizer(tiny_server.base_url, "llamacpp", "/tokenize"))
    # (their key, our key, allowed factor): see the module docstring for why these bounds
    keys = (("median_ttft_ms", "median_ttft_ms", 6.0), ("median_e2e_latency_ms", "median_e2el_ms", 6.0),
            ("median_tpot_ms", "median_tpot_ms", 2.5), ("median_itl_ms", "median_itl_ms", 2.5),
            ("output_throughput", "output_throughput", 2.5))
    theirs_runs, ours_runs = [], []
    for i in range(3):            # interleaved, so a stall of the shared machine hits both clients alike
        out = tmp_path / f"bs{i}.jsonl"
        theirs = be.run_bench_serving(be.bench_serving_argv(py, tiny_server.base_url, "tiny", tok_dir, 64, 32, 32, 8,
                                                            out, extra=["--extra-request-body",
                                                                        '{"cache_prompt": false}']), out)
        # the server saw BOS + 63 tokens from bench_serving; we send 64 ids (no BOS is added to an id prompt)
        wl = build_workload("e2e", 32, 64, 32, pool, seed=5 + i)
        # same TCP behaviour as bench_serving (no quick ACK): see the module docstring
        run = run_requests(wl.requests, ClientConfig(tiny_server.base_url, "tiny", extra_body={"cache_prompt": False},
                                                     tcp_quickack=False), concurrency=8)
        ours = mx.summarize(run.records, run.duration_s, "sglang")
        assert theirs["completed"] == ours["completed"] == 32
        assert theirs["total_output_tokens"] == ours["total_output_tokens"] == 32 * 32
        assert ours["token_check"]["exact"]
        theirs_runs.append(theirs)
        ours_runs.append(ours)
    for k_theirs, k_ours, factor in keys:
        a = float(np.median([o[k_ours] for o in ours_runs]))
        b = float(np.median([t[k_theirs] for t in theirs_runs]))
        ratio = max(a, b) / max(min(a, b), 1e-9)
        assert ratio <= factor or abs(a - b) <= 5.0, (k_ours, a, b)
