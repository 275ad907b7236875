"""Per-slot state of a live llama.cpp server: ``GET /slots`` polled in a thread while a case runs.

Phase 7 reads the long request's prompt progress from it (prefill chunks), Phase 8 the KV tokens each slot
holds (llama.cpp exposes no KV gauge). Engines without the endpoint (``adapter.slots_path`` None) are not polled.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from servelab.deploy.server import RunningServer, http_json


@dataclass
class SlotsPoller:
    """Poll llama.cpp ``GET /slots`` every ``interval_s`` in a thread; one row per slot and sample.

    Columns: ``ts_ns`` (perf_counter), ``slot``, ``n_ctx``, ``is_processing``, ``id_task``, ``n_prompt_tokens``
    (tokens the slot's KV holds: prompt + generated so far), ``n_prompt_tokens_processed``,
    ``n_prompt_tokens_cache``, ``n_decoded``, ``n_predict``. A failed poll is a row in ``errors``, never a zero.
    """
    base_url: str
    interval_s: float = 0.1
    timeout_s: float = 2.0
    headers: dict[str, str] = field(default_factory=dict, repr=False)   # Authorization with an API key
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def poll_once(self) -> bool:
        t = time.perf_counter_ns()
        status, body = http_json(self.base_url + "/slots", timeout=self.timeout_s, headers=self.headers)
        if status != 200 or not isinstance(body, list):
            self.errors.append({"ts_ns": t, "status": status, "error": str(body)[:200]})
            return False
        for s in body:
            nt = (s.get("next_token") or [{}])[0] if isinstance(s.get("next_token"), list) else {}
            self.rows.append({"ts_ns": t, "slot": s.get("id"), "n_ctx": s.get("n_ctx"),
                              "is_processing": bool(s.get("is_processing")), "id_task": s.get("id_task"),
                              "n_prompt_tokens": s.get("n_prompt_tokens", 0),
                              "n_prompt_tokens_processed": s.get("n_prompt_tokens_processed"),
                              "n_prompt_tokens_cache": s.get("n_prompt_tokens_cache"),
                              "n_decoded": nt.get("n_decoded"),
                              "n_predict": (s.get("params") or {}).get("n_predict")})
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.poll_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def start(self) -> "SlotsPoller":
        self._thread = threading.Thread(target=self._loop, name="servelab-slots-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> pd.DataFrame:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + self.interval_s + 1)
        self.poll_once()
        return self.frame()

    def frame(self) -> pd.DataFrame:
        cols = ["ts_ns", "slot", "n_ctx", "is_processing", "id_task", "n_prompt_tokens", "n_prompt_tokens_processed",
                "n_prompt_tokens_cache", "n_decoded", "n_predict"]
        return pd.DataFrame(self.rows, columns=cols)


def has_slots_endpoint(srv: RunningServer) -> bool:
    """Does the engine expose per-slot state (``/slots``)? Asked of its adapter."""
    return srv.engine.slots_path is not None
