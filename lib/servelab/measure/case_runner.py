"""The one case runner: the skeleton every measured case of every phase runs through (``docs/case.md``).

A phase supplies its wave (what it sends) and its summary (what it concludes); :class:`CaseRun` owns the rest,
in this order:

1. the case folder (:class:`servelab.measure.case_record.CaseFolder`: ``meta.json`` ``running``) and the health
   check — an engine that is unhealthy before the case closes the folder ``ENGINE_CRASH`` and raises
   :class:`EngineCrash`, before anything is sent;
2. where the engine log excerpt starts (:meth:`CaseRun.mark_log` moves it);
3. inside ``with case:`` — the warm-up (:meth:`CaseRun.warm_up`), the cache flush (:meth:`CaseRun.flush`), the
   server-side instruments (:meth:`CaseRun.watch`: the ``/metrics`` scraper, the slots poller) and the counter
   window (:meth:`CaseRun.open_window`: a ``/metrics`` snapshot and the engine's CPU time), then the phase's wave;
   every record reaches ``requests.jsonl`` as its request completes (:meth:`CaseRun.client_config`);
4. leaving the block: the instruments stopped, the window closed, and the raw data written **first** —
   ``requests.jsonl`` (fsynced), ``server/`` (metrics, snapshots, slots, scrape errors), the log excerpt with its
   clock. An exception in the block is recorded (:attr:`CaseRun.error`: the case goes on to its summary, which
   says it failed); Ctrl-C keeps what was received, writes an ``INTERRUPTED`` summary and re-raises;
5. :meth:`CaseRun.close` — the phase's summary (validated) and ``meta.json`` closed with the final status.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from servelab.deploy.server import RunningServer, health_problem, http_json, log_clock
from servelab.measure.case_record import CaseFolder, CaseSummary
from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.records import RequestRecord
from servelab.measure.engine_metrics import Scraper
from servelab.measure.request_metrics import VLLM_BENCH
from servelab.measure.launch_variants import Snapshot, metrics_snapshot, server_cpu_s
from servelab.measure.slots import SlotsPoller, has_slots_endpoint
from servelab.measure.workload import build_workload

ENGINE_CRASH = "ENGINE_CRASH"
UNHEALTHY = "engine unhealthy before the case started"
WARMUP_INDEX = 10**6                       # warm-up request indices start here: never those of measured requests


class EngineCrash(RuntimeError):
    """The engine lost health during or before a case: the run must stop."""


# ---------------------------------------------------------------- server side: flush, log

def flush_cache(srv: RunningServer, timeout_s: float = 60.0) -> dict[str, Any]:
    """Flush the prefix cache the engine's way; say exactly what was done (never silently nothing)."""
    path = srv.engine.flush_cache_path
    if path is None:
        return {"method": "cache_prompt=false on every request", "flushed": False,
                "reason": f"{srv.target.engine} has no cache flush endpoint; its per-slot prompt cache is "
                          "bypassed per request instead"}
    deadline = time.monotonic() + timeout_s
    status, body = 0, None
    while time.monotonic() < deadline:
        status, body = http_json(srv.base_url + path, {}, timeout=timeout_s, headers=srv.auth_headers)
        if status == 200:
            return {"method": f"POST {path}", "flushed": True, "status": status}
        if status != 400:          # SGLang answers 400 while requests are still running: wait for idle
            break
        time.sleep(0.5)
    return {"method": f"POST {path}", "flushed": False, "status": status, "reason": str(body)[:300]}


def head_log(srv: RunningServer) -> tuple[str, str]:
    """(head node, path of its engine log)."""
    head = srv.target.head.name
    return head, srv.log_paths.get(head, "")


def read_log_since(srv: RunningServer, offset: int) -> tuple[str, int]:
    """The head engine log from byte ``offset``; returns (text, new offset). Empty if unreadable."""
    head, path = head_log(srv)
    if not path:
        return "", offset
    try:
        data = srv.hosts[head].read_file(path)
    except Exception:
        return "", offset
    return data[offset:].decode(errors="replace"), len(data)


def settled_log_offset(srv: RunningServer, quiet_s: float = 0.1, timeout_s: float = 2.0) -> int:
    """The engine log's length once it stopped growing for ``quiet_s`` (llama.cpp logs from a background
    thread: a request's last line can land a few ms after its response)."""
    _, off = read_log_since(srv, 0)
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        time.sleep(quiet_s)
        _, new = read_log_since(srv, 0)
        if new == off:
            break
        off = new
    return off


def log_events(text: str, markers: dict[str, str], keys: tuple[str, ...] = ("oom", "crash")) -> dict[str, list[str]]:
    """Lines of ``text`` that match the adapter's log markers (``oom``, ``crash`` ...), at most 20 per key."""
    out: dict[str, list[str]] = {}
    for k in keys:
        rx = markers.get(k)
        if not rx:
            continue
        pat = re.compile(rx)
        hits = [ln for ln in text.splitlines() if pat.search(ln)]
        if hits:
            out[k] = hits[:20]
    return out


def client_config(srv: RunningServer, run_dir: Path, case_id: str, *, api: str = "completions",
                  timeout_s: float = 600.0, progress: bool = False, extra_body: dict[str, Any] | None = None
                  ) -> ClientConfig:
    """The client of a case against ``srv``: request ids ``<run>-<case>-…``, the API key's headers, and — where the
    engine has no flush endpoint — its per-request cache switch off (no reuse, request by request), unless
    ``extra_body`` says otherwise."""
    extra: dict[str, Any] = {}
    if srv.engine.flush_cache_path is None and srv.engine.request_cache_switch:
        extra[srv.engine.request_cache_switch] = False
    extra.update(extra_body or {})
    return ClientConfig(srv.base_url, srv.target.served_model_name or "default", engine=srv.target.engine, api=api,
                        extra_body=extra, timeout_s=timeout_s, request_id_prefix=f"{Path(run_dir).name}-{case_id}",
                        progress=progress, headers=srv.auth_headers)


@dataclass
class Warmup:
    """A warm-up before the measurement: ``requests`` requests of ``input_tokens → output_tokens`` (role
    ``warmup``, indices from :data:`WARMUP_INDEX`) sent at ``concurrency``, prompts from ``seed``."""
    requests: int
    input_tokens: int
    output_tokens: int
    seed: int
    concurrency: int = 1


# ---------------------------------------------------------------- the case

class CaseRun:
    """One measured case (module docstring): ``case = CaseRun(...)``; ``with case:`` warm-up, flush, instruments,
    the wave; then the phase's summary through :meth:`close`.

    ``measured_roles`` and ``definition`` say what an ``INTERRUPTED`` summary counts; ``interrupt_details`` is
    what it keeps in ``details``; ``settle_log``: the log excerpt ends once the log stopped growing (an engine that
    logs a request's last lines after its response)."""

    def __init__(self, srv: RunningServer, run_dir: str | Path, case_id: str, phase: str, kind: str,
                 meta: dict[str, Any] | None = None, *, definition: str = VLLM_BENCH,
                 measured_roles: tuple[str, ...] = ("measure",), interrupt_details: dict[str, Any] | None = None,
                 settle_log: bool = False) -> None:
        self.srv, self.run_dir = srv, Path(run_dir)
        self.definition, self.measured_roles = definition, measured_roles
        self.interrupt_details = interrupt_details
        self.settle_log = settle_log
        self.folder = CaseFolder(self.run_dir, case_id, phase, kind, meta)
        self.records: list[RequestRecord] = []
        self.error = ""
        self.scraper: Scraper | None = None
        self.poller: SlotsPoller | None = None
        self.scrape = pd.DataFrame()
        self.slots = pd.DataFrame()
        self.before: Snapshot | None = None
        self.after: Snapshot | None = None
        self.cpu: tuple[float | None, float | None] = (None, None)
        self.log_text = ""
        self._window = False
        self._server_cpu = False
        problem = health_problem(srv)
        if problem:
            self.folder.finish(ENGINE_CRASH, f"{UNHEALTHY}: {problem}")
            raise EngineCrash(f"{case_id}: {UNHEALTHY}: {problem}")
        self._log_off = read_log_since(srv, 0)[1]

    @property
    def case_id(self) -> str:
        return self.folder.case_id

    @property
    def dir(self) -> Path:
        return self.folder.dir

    @property
    def meta(self) -> dict[str, Any]:
        return self.folder.meta

    # -------------------------------------------------------- steps inside the block

    def client_config(self, cfg: ClientConfig | None = None, **kw: Any) -> ClientConfig:
        """The case's client (:func:`client_config` with ``kw``, or ``cfg``), each record streamed to
        ``requests.jsonl`` as its request completes (a Ctrl-C or a killed kernel keeps it)."""
        cfg = cfg or client_config(self.srv, self.run_dir, self.case_id, **kw)
        cfg.on_record = self.folder.stream_record
        return cfg

    def add(self, records: Sequence[RequestRecord]) -> None:
        """Records of the wave, in the order they go into ``requests.jsonl``."""
        self.records.extend(records)

    def warm_up(self, send: Callable[[], Sequence[RequestRecord]] | None, reason: str = "", **facts: Any
                ) -> list[RequestRecord]:
        """Send the warm-up (``send()`` returns its records; None: no warm-up, for ``reason``), keep its records and
        say in ``meta.json`` (``warmup``) how many there were, whether all succeeded, and ``facts``."""
        if send is None:
            self.folder.save_meta(warmup={"requests": 0, "reason": reason})
            return []
        recs = list(send())
        self.records.extend(recs)
        self.folder.save_meta(warmup={"requests": len(recs), "ok": all(r.ok for r in recs), **facts})
        return recs

    def client_warmup(self, cfg: ClientConfig, pool: list[int], w: Warmup) -> Callable[[], list[RequestRecord]]:
        """The sender of a :class:`Warmup` through the case's client (for :meth:`warm_up`)."""
        wl = build_workload(f"{self.case_id}-warmup", w.requests, w.input_tokens, w.output_tokens, pool, seed=w.seed,
                            role="warmup", start_index=WARMUP_INDEX)
        return lambda: run_requests(wl.requests, cfg, concurrency=w.concurrency).records

    def flush(self, how: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Flush the prefix cache (:func:`flush_cache`, or ``how()``); what was done goes into ``meta.json``
        (``cache_flush``)."""
        done = how() if how is not None else flush_cache(self.srv)
        self.folder.save_meta(cache_flush=done)
        return done

    def mark_log(self) -> None:
        """The engine log excerpt starts here (after the warm-up's lines, once the log has settled)."""
        self._log_off = settled_log_offset(self.srv) if self.settle_log else read_log_since(self.srv, 0)[1]

    def watch(self, scrape_interval_s: float | None = None, poll_interval_s: float | None = None,
              scrape_timeout_s: float = 2.0) -> None:
        """Start the series of the case: ``/metrics`` every ``scrape_interval_s`` and the engine's slots every
        ``poll_interval_s`` (where it has a slots endpoint); both stop when the block ends."""
        if poll_interval_s is not None and has_slots_endpoint(self.srv):
            self.poller = SlotsPoller(self.srv.base_url, interval_s=poll_interval_s, headers=self.srv.auth_headers)
        if scrape_interval_s is not None and self.srv.metrics_path:
            self.scraper = Scraper(self.srv.base_url + self.srv.metrics_path, interval_s=scrape_interval_s,
                                   timeout_s=scrape_timeout_s, headers=self.srv.auth_headers)
        if self.poller is not None:
            self.poller.start()
        if self.scraper is not None:
            self.scraper.start()

    def open_window(self, server_cpu: bool = False) -> None:
        """Open the counter window: a ``/metrics`` snapshot now and one when the block ends (``before``,
        ``after``), and with ``server_cpu`` the engine process's CPU seconds at both ends (``cpu``)."""
        self.before = metrics_snapshot(self.srv)
        self._window, self._server_cpu = True, server_cpu
        if server_cpu:
            self.cpu = (server_cpu_s(self.srv), None)

    # -------------------------------------------------------- the block

    def __enter__(self) -> "CaseRun":
        return self

    def _stop_instruments(self) -> None:
        if self.poller is not None:
            self.slots = self.poller.stop()
        if self.scraper is not None:
            self.scrape = self.scraper.stop() if self.scraper.running else self.scraper.frame()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            self._stop_instruments()
        finally:
            if isinstance(exc, KeyboardInterrupt):
                self._interrupted()
        if exc is not None and not isinstance(exc, Exception):
            return False                            # SystemExit and the like: not the case's to record
        if exc is not None:
            self.error = f"{type(exc).__name__}: {exc}"
        if self._window:
            self.after = metrics_snapshot(self.srv)
            if self._server_cpu:
                self.cpu = (self.cpu[0], server_cpu_s(self.srv))
        self._write_raw()
        return True

    def _interrupted(self) -> None:
        """Ctrl-C mid-case: what the server side recorded and the log are written, the streamed records kept and
        an ``INTERRUPTED`` summary written (``CaseFolder.interrupt``); the interrupt goes on, naming the case."""
        self.folder.close_stream()
        self.folder.write_metrics(self.scrape, scrape_errors=self.scraper.errors if self.scraper else None)
        self.folder.write_log_excerpt(read_log_since(self.srv, self._log_off)[0])
        self.folder.interrupt(definition=self.definition, details=self.interrupt_details,
                              measured_roles=self.measured_roles)
        raise KeyboardInterrupt(f"{self.case_id}: interrupted")

    def _write_raw(self) -> None:
        """Raw data first: the records (fsynced), the server side, the log excerpt with its clock."""
        self.folder.write_requests(self.records)
        self.folder.write_metrics(self.scrape, self.before, self.after,
                                  scrape_errors=self.scraper.errors if self.scraper else None)
        if not self.slots.empty:
            self.slots.to_parquet(self.dir / "server" / "slots.parquet")
        if self.settle_log:
            settled_log_offset(self.srv)              # the last requests' lines are written
        self.log_text = read_log_since(self.srv, self._log_off)[0]
        self.folder.write_log_excerpt(self.log_text, clock=log_clock(self.srv))

    # -------------------------------------------------------- after the block

    def reload_meta(self) -> None:
        """Take ``meta.json`` as it is on disk (a step that marked it itself, as a profile capture does)."""
        self.folder.meta = json.loads((self.dir / "meta.json").read_text())

    def close(self, summary: CaseSummary, status: str, error: str | None = None, **meta: Any) -> dict[str, Any]:
        """The phase's summary (``summary.json``, validated against the case schema), then ``meta.json`` closed with
        ``status``, ``error`` (default: the error recorded in the block) and ``meta``. Returns the summary."""
        obj = self.folder.write_summary(summary)
        self.folder.finish(status, self.error if error is None else error, **meta)
        return obj
