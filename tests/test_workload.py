"""Exact-length workloads against the real llama-server (tiny model): the server's own counts are the truth."""
from __future__ import annotations

import numpy as np
import pytest

from servelab.measure.client import ClientConfig, run_requests
from servelab.deploy.server import http_json
from servelab.measure.workload import (RequestSpec, WorkloadError, build_text_workload, build_workload, exact_text, request_body)


@pytest.mark.slow
def test_pool_holds_only_ordinary_tokens(pool, tiny_server):
    # tiny vocab: 0-2 special, 3-258 byte tokens, 259-353 printable ASCII; random words are letters/digits/space
    assert pool and min(pool) >= 259 and max(pool) <= 353
    status, body = http_json(tiny_server.base_url + "/detokenize", {"tokens": pool})
    assert status == 200 and set(body["content"]) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                          "0123456789 ")


@pytest.mark.slow
def test_id_prompts_are_exact_unique_and_seeded(pool, tiny_server):
    wl = build_workload("w", 12, 50, 7, pool, seed=3)
    ids = [r.prompt_ids for r in wl.requests]
    assert all(len(x) == 50 for x in ids)
    assert len({tuple(x) for x in ids}) == 12
    assert len({x[0] for x in ids}) == 12                       # first tokens differ: no prefix reuse
    assert [r.prompt_ids for r in build_workload("w", 12, 50, 7, pool, seed=3).requests] == ids
    assert [r.prompt_ids for r in build_workload("w", 12, 50, 7, pool, seed=4).requests] != ids
    # the server agrees on every count (usage), with no BOS added to an id prompt
    cfg = ClientConfig(tiny_server.base_url, "tiny", extra_body={"cache_prompt": False})
    run = run_requests(wl.requests, cfg, concurrency=4)
    assert [r.prompt_tokens for r in run.records] == [50] * 12
    assert [r.completion_tokens for r in run.records] == [7] * 12


@pytest.mark.slow
def test_exact_text_is_verified_by_the_engine(tok, tiny_server):
    rng = np.random.default_rng(0)
    for n in (5, 37, 200):
        text = exact_text(tok, n, rng)
        status, body = http_json(tiny_server.base_url + "/tokenize", {"content": text, "add_special": True})
        assert status == 200 and len(body["tokens"]) == n
    wl = build_text_workload("t", 3, 40, 4, tok, seed=1)
    run = run_requests(wl.requests, ClientConfig(tiny_server.base_url, "tiny", extra_body={"cache_prompt": False}))
    assert [r.prompt_tokens for r in run.records] == [40, 40, 40]   # server usage, BOS included


@pytest.mark.slow
def test_shared_prefix_groups(pool):
    wl = build_workload("g", 6, 40, 1, pool, seed=5, prefix_groups=2, target_prefix_hit_rate=0.5)
    reqs = wl.requests
    assert all(r.shared_prefix_tokens == 20 and len(r.prompt_ids) == 40 for r in reqs)
    g0 = [r.prompt_ids for r in reqs if r.group == 0]
    g1 = [r.prompt_ids for r in reqs if r.group == 1]
    assert len(g0) == len(g1) == 3
    assert all(x[:20] == g0[0][:20] for x in g0) and all(x[:20] == g1[0][:20] for x in g1)
    assert g0[0][:20] != g1[0][:20]
    assert len({tuple(x[20:]) for x in g0 + g1}) == 6               # suffixes unique
    with pytest.raises(WorkloadError):
        build_workload("g", 2, 10, 1, pool, seed=0, prefix_groups=1, target_prefix_hit_rate=1.0)


def test_request_bodies_force_exact_output_per_engine():
    spec = RequestSpec(0, 3, 9, prompt_ids=[5, 6, 7])
    ll = request_body(spec, "llamacpp", "completions", "m", {"cache_prompt": False})
    assert ll["ignore_eos"] is True and ll["max_tokens"] == 9 and ll["prompt"] == [5, 6, 7]
    assert ll["stream_options"] == {"include_usage": True} and ll["cache_prompt"] is False
    vl = request_body(spec, "vllm", "completions", "m")
    assert vl["min_tokens"] == vl["max_tokens"] == 9 and "ignore_eos" not in vl
    gen = request_body(spec, "sglang", "generate", "m")
    assert gen["input_ids"] == [5, 6, 7] and gen["sampling_params"]["max_new_tokens"] == 9
    assert gen["sampling_params"]["ignore_eos"] is True
    with pytest.raises(WorkloadError, match="chat"):
        request_body(spec, "llamacpp", "chat", "m")
