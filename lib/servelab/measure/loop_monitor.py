"""One event-loop-lag monitor for a phase loop that drives many one-request client runs side by side (Phase 7's
background streams and injections, Phase 8's prefix groups), so their cases carry a measurement-integrity record
like every other case (``docs/metrics.md#integrity``).

``measure.client.run_async`` has its own monitor, one per call; such a phase calls it once per request, many at a
time, in one asyncio loop, and turns those monitors off (``monitor_interval_s=None``): one per request in flight
would cost the client more than it measures. Instead the phase opens one :class:`LoopMonitor` on its loop:

- it wakes every ``interval_s`` (the client's ``MONITOR_INTERVAL_S``) and records when and how late each wake-up
  came — the time the loop could run nothing;
- :meth:`client_run` turns the loop's records, its window and those samples into one ``ClientRun``, which
  ``request_metrics.integrity`` judges as it judges any client run: dispatch lag, loop lag, Little's law. The
  in-flight count at each wake-up is read from the records (sent at or before it, not yet ended): the span
  ``send → end`` that the client's own counter covers, and the latency Little's law compares it with;
- like the client's own window, the loop's runs with Python's cyclic garbage collector off (restored on exit): the
  one-request runs each switch it off for their window and back on at their end, which — runs overlapping — would
  otherwise let a collection pause the loop in the middle of the others' streams.
"""
from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from servelab.measure.client import MONITOR_INTERVAL_S, import_aiohttp, watch_loop
from servelab.measure.records import ClientRun


@dataclass
class LoopMonitor:
    """The loop-lag monitor of one asyncio loop: ``async with LoopMonitor() as mon:`` around the loop's requests,
    then ``mon.client_run(records)``."""
    interval_s: float = MONITOR_INTERVAL_S
    lag_ns: list[int] = field(default_factory=list)
    sample_ns: list[int] = field(default_factory=list)       # perf ns of each wake-up
    window_start_ns: int = 0
    window_end_ns: int = 0
    client_cpu_s: float = 0.0
    _task: asyncio.Task[None] | None = None
    _done: asyncio.Event | None = None
    _cpu0: float = 0.0
    _gc_was_enabled: bool = False

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"loop monitor interval must be > 0 s, got {self.interval_s!r}")

    def _wake(self, now: int, lag: int) -> None:
        self.lag_ns.append(lag)
        self.sample_ns.append(now)

    async def __aenter__(self) -> "LoopMonitor":
        # the client imports aiohttp on its first run: ~0.1 s that would block the loop inside the window (the
        # client's own monitor starts after it)
        import_aiohttp()
        self._done = asyncio.Event()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._cpu0 = time.process_time()
        self.window_start_ns = time.perf_counter_ns()
        self._task = asyncio.create_task(watch_loop(self.interval_s, self._done, self._wake))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.window_end_ns = time.perf_counter_ns()
        self.client_cpu_s = time.process_time() - self._cpu0
        if self._gc_was_enabled:
            gc.enable()
        if self._done is not None:
            self._done.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def client_run(self, records: Sequence[Any], concurrency: int | None = None, wall_offset_ns: int = 0) -> ClientRun:
        """The loop's records as one closed-loop ``ClientRun`` over the monitor's window, with its samples."""
        sent = np.sort(np.array([r.send_ns for r in records if r.send_ns], dtype=np.int64))
        ended = np.sort(np.array([r.end_ns for r in records if r.send_ns], dtype=np.int64))
        t = np.array(self.sample_ns, dtype=np.int64)
        inflight = (np.searchsorted(sent, t, side="right") - np.searchsorted(ended, t, side="right")).tolist()
        return ClientRun(list(records), self.window_start_ns, self.window_end_ns or time.perf_counter_ns(),
                         wall_offset_ns or (time.time_ns() - time.perf_counter_ns()), "closed", concurrency, None,
                         self.client_cpu_s, loop_lag_ns=list(self.lag_ns), inflight=[int(x) for x in inflight],
                         monitor_interval_s=self.interval_s)
