"""The embedded default engine for real: llama-server built from the llama-cpp-python sdist + the tiny model."""
from __future__ import annotations

import json
import urllib.request

import pytest

from servelab.deploy import llamacpp_build
from servelab.deploy.models import write_tiny_gguf, file_digest
from servelab.deploy.server import http_json, http_text


def test_tiny_model_is_deterministic(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf")
    b = write_tiny_gguf(tmp_path / "b.gguf")
    assert file_digest(a) == file_digest(b) and a.stat().st_size > 100_000


def test_build_names_missing_tools(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda t: None if t == "ninja" else "/usr/bin/" + t)
    with pytest.raises(llamacpp_build.BuildError, match="missing ninja"):
        llamacpp_build.ensure_llama_server()
    assert not (tmp_path / "llama-server" / f"llama-cpp-python-{llamacpp_build.LLAMA_CPP_PYTHON_VERSION}"
                / "llama-server").exists()


@pytest.mark.slow
def test_health_tokenize_and_exact_lengths(tiny_server):
    base = tiny_server.base_url
    assert http_json(base + "/health")[0] == 200
    text = "hello servelab"
    status, tok = http_json(base + "/tokenize", {"content": text, "add_special": True})
    assert status == 200 and len(tok["tokens"]) == len(text) + 2   # BOS + space prefix + one token per char
    for max_tokens in (1, 7, 64):
        status, body = http_json(base + "/v1/completions", {"prompt": text, "max_tokens": max_tokens,
                                                             "ignore_eos": True, "cache_prompt": False})
        assert status == 200
        assert body["usage"]["completion_tokens"] == max_tokens
        assert body["usage"]["prompt_tokens"] == len(tok["tokens"])
        assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_streaming_one_chunk_per_token(tiny_server):
    req = urllib.request.Request(tiny_server.base_url + "/v1/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": [1, 300, 301, 302], "max_tokens": 20, "stream": True,
                                                  "ignore_eos": True}).encode())
    chunks, usage = [], None
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices") and obj["choices"][0].get("text"):
                chunks.append(obj["choices"][0]["text"])
            usage = obj.get("usage") or usage
    assert len(chunks) == 20 and usage["completion_tokens"] == 20 and usage["prompt_tokens"] == 4


@pytest.mark.slow
def test_metrics_and_slots(tiny_server):
    status, text = http_text(tiny_server.base_url + "/metrics")
    assert status == 200
    for name in ("prompt_tokens_total", "generation_tokens_total", "running", "waiting"):
        assert tiny_server.engine.metric_names[name] in text
    status, slots = http_json(tiny_server.base_url + "/slots")
    assert status == 200 and len(slots) == 32
