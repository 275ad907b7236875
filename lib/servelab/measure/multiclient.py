"""One load from N client processes: past one core's accurate ceiling without losing an exact percentile.

One process's client tops out at its accurate ceiling (``docs/metrics.md#integrity``: ~38 k chunks/s on one core of
the H200 host). :func:`run_requests_multi` sends the same run from N processes of this machine
(``docs/scaling.md#many-clients``):

- **one schedule, split deterministically**: closed loop — the concurrency is dealt out (process k gets
  ``C // N`` streams, the first ``C % N`` one more) and request i goes to the owner of slot ``i mod C``; sized
  runs — process k draws request indices k, k + N, k + 2N, … from the same seeded prompt source and issues its
  share of the minimum count; open loop — the seeded arrival times are drawn once here and request i (with its
  arrival time) goes to process ``i mod N``. The same request index is the same prompt whatever N is;
- **one start instant**: every process starts, imports and builds its share, reports ready, and then opens its
  window at the same wall-clock instant (sent to all once all are ready; the spread is recorded);
- **raw records merged**: every process returns its raw records (each chunk's arrival, CLOCK_MONOTONIC, shared by
  the processes of one machine); they are merged into one run, so the case folder holds one ``requests.jsonl``
  and every percentile is computed over all requests — exact, never a merge of histograms;
- **per-process integrity**: each process keeps its own loop-lag monitor and dispatch lag, and is judged
  against the one-core ceiling on its own (``ClientRun.processes``, ``request_metrics.integrity``): a process
  that fell behind makes the case INVALID, the reason naming that process.

Child processes are started with ``spawn`` (no state inherited from a Jupyter kernel), die with their parent
(parent-death signal), ignore Ctrl-C (the parent stops them) and are terminated on every exit of the call.
"""
from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace
from typing import Any

from servelab.measure.client import DEFAULT_LOOP, ClientConfig, arrival_offsets_s, import_aiohttp, run_async, run_sync
from servelab.measure.records import ClientRun
from servelab.measure.workload import RequestSpec, build_workload, spec_source

READY_TIMEOUT_S = 120.0
START_MARGIN_S = 0.3        # the shared instant: this long after the last process reported ready


class MultiClientError(RuntimeError):
    """A client process could not start or died before returning its records (one line, naming it)."""


def split(n: int, parts: int) -> list[int]:
    """``n`` dealt out to ``parts``: ``n // parts`` each, the first ``n % parts`` one more."""
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def plan(clients: int, n_specs: int, concurrency: int | None, rate_rps: float | None, sized: bool,
         min_requests: int = 0, max_requests: int = 100_000) -> list[dict[str, Any]]:
    """The deterministic split of one run over ``clients`` processes: per process its concurrency, the request
    indices (positions in the spec list) it sends, and its share of a sized run's minimum and maximum counts.
    Fewer processes than asked when there are fewer streams (closed loop) or requests than processes."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    if rate_rps is None:
        streams = concurrency or n_specs
        if sized:
            streams = concurrency or max(n_specs, min_requests, 1)
        n = max(1, min(clients, streams)) if streams else 1
        conc = split(streams, n) if streams else [0]
        slots = [k for k in range(n) for _ in range(conc[k])]
        owner = [slots[i % len(slots)] for i in range(n_specs)] if slots else [0] * n_specs
    else:
        n = max(1, min(clients, n_specs)) if n_specs else 1
        conc = split(concurrency, n) if concurrency else [None] * n
        owner = [i % n for i in range(n_specs)]
    total = sum(c or 0 for c in conc) or 1
    out = []
    for k in range(n):
        share = (conc[k] or 0) / total if rate_rps is None and total else 1.0 / n
        out.append({"process": k, "processes": n, "concurrency": conc[k],
                    "indices": [i for i in range(n_specs) if owner[i] == k],
                    "min_requests": math.ceil(min_requests * share) if sized else 0,
                    "max_requests": max(1, math.ceil(max_requests * share)) if sized else 0})
    return out


class _Strided:
    """Request ``j`` of process ``k`` of ``n`` in a sized run: index ``j·n + k`` of the shared seeded source."""

    def __init__(self, source: dict[str, Any], k: int, n: int):
        self.source, self.k, self.n = spec_source(**source), k, n

    def __call__(self, j: int) -> RequestSpec:
        return self.source(j * self.n + self.k)


def _pdeathsig() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child(conn: Any, job: dict[str, Any]) -> None:
    """One client process: build its share, report ready, wait for the shared instant, run, send the run back."""
    _pdeathsig()
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the parent's: it stops us
    try:
        if job.get("cpu") is not None:
            os.sched_setaffinity(0, {int(job["cpu"])})
        import_aiohttp()                  # imported before the window, not inside it
        kw = dict(job["kw"])
        if job.get("source") is not None:
            kw["make_spec"] = _Strided(job["source"], job["process"], job["processes"])
        conn.send(("ready", os.getpid()))
        start_wall_ns = conn.recv()

        async def go() -> ClientRun:
            await asyncio.sleep(max(0.0, (start_wall_ns - time.time_ns()) / 1e9))
            return await run_async(job["specs"], job["cfg"], **kw)
        run = run_sync(go, loop=job["loop"])
        run.process = job["label"].format(pid=os.getpid())
        conn.send(("done", run))
    except BaseException as exc:  # sent to the parent, which names this process in its one-line error
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        conn.close()


def run_requests_multi(specs: list[RequestSpec], cfg: ClientConfig, clients: int, *, concurrency: int | None = None,
                       rate_rps: float | None = None, arrival: str = "poisson", seed: int = 0, repeat: int = 0,
                       source: dict[str, Any] | None = None, min_requests: int = 0, min_duration_s: float = 0.0,
                       max_requests: int = 100_000, loop: str = DEFAULT_LOOP, cpus: list[int] | None = None,
                       ready_timeout_s: float = READY_TIMEOUT_S) -> ClientRun:
    """``run_requests`` from ``clients`` processes (see the module): the merged run, its ``processes`` each
    process's own run. ``source``: ``spec_source`` arguments of a sized closed-loop run (instead of ``make_spec``,
    which cannot cross a process boundary). ``cpus``: pin process k to ``cpus[k]``. ``cfg.on_record`` is called
    here on every merged record (the processes return theirs at the end of the run)."""
    sized = source is not None
    if sized and rate_rps is not None:
        raise ValueError("a sized run (source) is for the closed loop only")
    specs = list(specs)
    parts = plan(clients, len(specs), concurrency, rate_rps, sized, min_requests, max_requests)
    n = len(parts)
    offsets = arrival_offsets_s(len(specs), rate_rps, arrival, seed) if rate_rps is not None and specs else None
    child_cfg = replace(cfg, on_record=None, progress=False)
    jobs = []
    for p in parts:
        k = p["process"]
        kw: dict[str, Any] = {"concurrency": p["concurrency"], "repeat": repeat}
        if rate_rps is not None:
            kw.update(rate_rps=rate_rps / n, offsets_s=[float(offsets[i]) for i in p["indices"]])
        if sized:
            kw.update(min_requests=p["min_requests"], min_duration_s=min_duration_s, max_requests=p["max_requests"])
        cpu = cpus[k % len(cpus)] if cpus else None
        jobs.append({"process": k, "processes": n, "cfg": child_cfg, "specs": [specs[i] for i in p["indices"]],
                     "kw": kw, "source": source, "loop": loop, "cpu": cpu,
                     "label": f"client process {k + 1} of {n} (pid {{pid}}{f', cpu {cpu}' if cpu is not None else ''})"})
    ctx = mp.get_context("spawn")
    procs: list[tuple[Any, Any]] = []
    try:
        for job in jobs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(child, job), name=f"servelab-client-{job['process'] + 1}",
                               daemon=True)
            proc.start()
            child.close()
            procs.append((proc, parent))
        deadline = time.monotonic() + ready_timeout_s
        for k, (proc, conn) in enumerate(procs):
            msg = _receive(conn, proc, k, n, max(0.1, deadline - time.monotonic()), "start")
            if msg[0] != "ready":
                raise MultiClientError(f"client process {k + 1} of {n} failed to start: {msg[1]}")
        start_wall_ns = time.time_ns() + int(START_MARGIN_S * 1e9)
        for _, conn in procs:
            conn.send(start_wall_ns)
        runs = []
        for k, (proc, conn) in enumerate(procs):
            msg = _receive(conn, proc, k, n, None, "run")
            if msg[0] != "done":
                raise MultiClientError(f"client process {k + 1} of {n} failed: {msg[1]}")
            runs.append(msg[1])
    finally:
        _reap(procs)
    merged = merge_runs(runs, concurrency, rate_rps, start_wall_ns)
    if cfg.on_record is not None:
        for rec in merged.records:
            cfg.on_record(rec)
    return merged


def _reap(procs: list[tuple[Any, Any]], grace_s: float = 5.0) -> None:
    """Every client process ended and waited for (no zombie left behind): those still running get SIGTERM, then
    SIGKILL after ``grace_s``; a killed process is waited for until it is gone (SIGKILL cannot be refused)."""
    for proc, _ in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc, conn in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        conn.close()
        proc.close()


def _receive(conn: Any, proc: Any, k: int, n: int, timeout_s: float | None, what: str) -> tuple:
    """The next message of process k, or :class:`MultiClientError` when it died (or timed out) first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not conn.poll(0.05):
        if not proc.is_alive() and not conn.poll(0):
            raise MultiClientError(f"client process {k + 1} of {n} (pid {proc.pid}) died during its {what} "
                                   f"(exit code {proc.exitcode})")
        if deadline is not None and time.monotonic() > deadline:
            raise MultiClientError(f"client process {k + 1} of {n} (pid {proc.pid}) not ready within "
                                   f"{timeout_s:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise MultiClientError(f"client process {k + 1} of {n} (pid {proc.pid}) closed its pipe during its "
                               f"{what} (exit code {proc.exitcode})") from None


def merge_runs(runs: list[ClientRun], concurrency: int | None, rate_rps: float | None,
               start_wall_ns: int = 0) -> ClientRun:
    """One run from the processes' runs: every record (by request index), the window from the earliest start to
    the latest end (CLOCK_MONOTONIC is one clock for the processes of a machine), the CPU summed; ``processes``
    keeps each run (its monitor, its integrity); ``sizing`` the totals and the start spread."""
    records = sorted((r for run in runs for r in run.records), key=lambda r: (r.role, r.index))
    starts = [r.window_start_ns for r in runs]
    sizing: dict[str, Any] = {}
    if any(r.sizing for r in runs):
        sizing = {"min_duration_s": runs[0].sizing.get("min_duration_s"),
                  "min_requests": sum(r.sizing.get("min_requests", 0) for r in runs),
                  "issued": sum(r.sizing.get("issued", 0) for r in runs),
                  "max_requests": sum(r.sizing.get("max_requests", 0) for r in runs),
                  "duration_s": (max(r.window_end_ns for r in runs) - min(starts)) / 1e9,
                  "met": all(r.sizing.get("met", True) for r in runs)}
    wall_starts = [r.window_start_ns + r.wall_offset_ns for r in runs]
    if start_wall_ns:
        for r, w in zip(runs, wall_starts):         # judged with each process (request_metrics.integrity)
            r.sizing = {**r.sizing, "start_late_ms": max(0, w - start_wall_ns) / 1e6}
    sizing["clients"] = {"processes": len(runs), "start_spread_ms": (max(wall_starts) - min(wall_starts)) / 1e6,
                         "late_start_ms": max(0, max(wall_starts) - start_wall_ns) / 1e6 if start_wall_ns else None}
    return ClientRun(records, min(starts), max(r.window_end_ns for r in runs), runs[0].wall_offset_ns, runs[0].mode,
                     concurrency, rate_rps, client_cpu_s=sum(r.client_cpu_s for r in runs),
                     monitor_interval_s=runs[0].monitor_interval_s, sizing=sizing, event_loop=runs[0].event_loop,
                     processes=list(runs))


def multi_wave(env: Any, case: Any, cfg: ClientConfig, repeat: int, seed: int, sizing: dict[str, Any]) -> ClientRun:
    """A case's default wave (``measure.case.run_wave``) from ``env.clients`` processes: the same requests (the
    same seeded prompts, by index) as one process sends; ``sizing``: the case's ``sizing_kw``."""
    common = {"concurrency": case.concurrency, "repeat": repeat, "cpus": getattr(env, "client_cpus", None) or None}
    if sizing:
        src = {"name": case.case_id, "input_tokens": case.input_tokens, "output_tokens": case.output_tokens,
               "pool": list(env.pool), "seed": seed, "role": "measure"}
        return run_requests_multi([], cfg, env.clients, source=src, min_requests=sizing["min_requests"],
                                  min_duration_s=sizing["min_duration_s"], **common)
    wl = build_workload(case.case_id, case.num_prompts, case.input_tokens, case.output_tokens, env.pool, seed=seed)
    return run_requests_multi(wl.requests, cfg, env.clients, **common)
