"""Prometheus parsing and scraping on the real llama-server's /metrics; deltas checked against client usage."""
from __future__ import annotations

import math

import pytest

from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.engine_metrics import (PrometheusParseError, Scraper, counter_deltas, gauge_series, named_deltas,
                                 parse_text)
from servelab.deploy.server import http_text
from servelab.measure.workload import build_workload, engine_tokenizer, token_pool


@pytest.mark.slow
def test_parse_real_metrics_body(tiny_server):
    status, text = http_text(tiny_server.base_url + "/metrics")
    assert status == 200
    samples = parse_text(text)
    names = {s["name"] for s in samples}
    for series in tiny_server.engine.metric_names.values():
        if series.startswith("llamacpp:spec"):
            continue
        assert series in names, series
    types = {s["name"]: s["type"] for s in samples}
    assert types["llamacpp:prompt_tokens_total"] == "counter"
    assert types["llamacpp:requests_processing"] == "gauge"


def test_parse_labels_escapes_and_errors():
    body = ('# TYPE x_seconds histogram\nx_seconds_bucket{le="0.5",model="a\\"b"} 3\nx_seconds_sum 1.5\n'
            'x_seconds_count 3\nup NaN\nbig +Inf 1700000000000\n')
    s = parse_text(body)
    assert s[0]["labels"] == {"le": "0.5", "model": 'a"b'} and s[0]["type"] == "histogram"
    assert s[1]["type"] == "histogram" and math.isnan(s[3]["value"]) and s[4]["value"] == math.inf
    with pytest.raises(PrometheusParseError, match="line 2"):
        parse_text("ok 1\nthis is not a sample\n")


@pytest.mark.slow
def test_scrape_during_load_counter_deltas_match_usage(tiny_server):
    tok = engine_tokenizer(tiny_server.base_url, "llamacpp", tiny_server.engine.tokenize_path)
    wl = build_workload("m", 12, 100, 300, token_pool(tok), seed=11)
    scraper = Scraper(tiny_server.base_url + "/metrics", interval_s=0.05, timeout_s=10.0)
    scraper.start()                # its first sample is taken before start() returns
    run = run_requests(wl.requests, ClientConfig(tiny_server.base_url, "tiny", extra_body={"cache_prompt": False}),
                       concurrency=6)
    frame = scraper.stop()
    assert not scraper.errors and frame["ts_ns"].nunique() >= 3      # ~1 s of load sampled every 50 ms
    d = named_deltas(frame, tiny_server.engine.metric_names)
    # the server counted exactly what our requests' usage says (no other traffic on this fixture meanwhile)
    assert d["prompt_tokens_total"] == sum(r.prompt_tokens for r in run.records) == 1200
    assert d["generation_tokens_total"] == sum(r.completion_tokens for r in run.records) == 12 * 300
    assert d["cached_tokens_total"] == 0
    cd = counter_deltas(frame)
    assert not cd["reset"].any()
    g = gauge_series(frame, tiny_server.engine.metric_names, ("running",))
    assert set(g["metric"]) == {"running"} and g["value"].max() >= 1


def test_failed_scrape_is_recorded_not_zero():
    from servelab.deploy.hosts import free_port
    s = Scraper(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=0.5)
    assert s.scrape_once() is False
    assert s.errors and s.errors[0]["status"] == 0 and s.frame().empty


def test_a_counter_series_created_inside_the_window_counts_from_zero():
    """SGLang creates ``sglang:cached_tokens_total{cache_source="device"}`` at its first prefix-cache hit: absent
    from the first scrape, present in the last — its whole value was counted inside the window."""
    import pandas as pd
    rows = [{"ts_ns": 1, "wall_ns": 1, "name": "sglang:prompt_tokens_total", "labels": "", "value": 100.0, "type": "counter"},
            {"ts_ns": 2, "wall_ns": 2, "name": "sglang:prompt_tokens_total", "labels": "", "value": 6500.0, "type": "counter"},
            {"ts_ns": 2, "wall_ns": 2, "name": "sglang:cached_tokens_total", "labels": 'cache_source="device"',
             "value": 6144.0, "type": "counter"}]
    d = counter_deltas(pd.DataFrame(rows)).set_index("name")["delta"]
    assert d["sglang:prompt_tokens_total"] == 6400.0 and d["sglang:cached_tokens_total"] == 6144.0
