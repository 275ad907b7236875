"""Streaming benchmark client (asyncio + aiohttp) that keeps every chunk's arrival time.

What it measures, per request (all times ``time.perf_counter_ns()``; wall-clock ns derived from one
(perf, wall) anchor pair taken at the start of the run, so both clocks agree exactly):

- ``scheduled_ns``  when the request was due (open loop: its arrival time; closed loop: when a worker freed);
- ``ready_ns``      open loop: when the client's arrival timer actually fired (``ready - scheduled`` is the
                    client's own dispatch lag, before any wait for a slot); closed loop: equal to ``scheduled_ns``;
- ``dispatch_ns``   when it got a concurrency slot (open loop with a cap: ``dispatch - scheduled`` is the
                    client queue time, i.e. the coordinated-omission part a capped client hides);
- ``send_ns``       just before the HTTP POST; ``headers_ns`` when the response headers arrived;
- per SSE event: arrival time, text delta, whether it had a non-empty ``choices`` list, the server's token
  delta where the server gives one (SGLang ``meta_info``, vLLM continuous usage), finish reason;
- ``usage`` (prompt, completion, cached tokens) wherever it comes (the last choices chunk on llama.cpp
  completions, a separate ``choices: []`` chunk on vLLM/chat), ``[DONE]`` time (missing ``[DONE]`` is
  recorded, not an error), HTTP status, error and its kind (http | timeout | connection | stream).

Hot path: a read of the socket costs one ``perf_counter_ns()`` and two list appends — SSE parsing happens
after the run, so parsing never delays the timestamps of other streams. The loop is asyncio's own by default
(:data:`DEFAULT_LOOP`); uvloop on request (``loop="uvloop"`` / ``"auto"``: :func:`loop_factory`; the run records
which in ``ClientRun.event_loop``). One shared session, unlimited
connector, one connection per request, the open-file limit raised for thousands of streams, ``read_bufsize``
16 MiB (a 64 KiB buffer makes a 128K prompt client-bound).
Every request carries ``X-Request-ID`` for correlation with server logs.

Measurement integrity (``docs/metrics.md#integrity``): while the window is open a monitor task wakes every
``monitor_interval_s`` and records how late it woke (the client's own event-loop lag) and how many requests were
in flight (for the Little's-law check); both come back in the :class:`ClientRun`.

Sizing (``docs/case.md#sizing``, MLPerf LoadGen's ``min_duration`` / ``min_query_count`` rule): a closed-loop run
given ``make_spec`` keeps issuing requests at its concurrency until both ``min_requests`` were issued and
``min_duration_s`` has passed since the window opened, then waits for the requests in flight.
"""
from __future__ import annotations

import asyncio
import gc
import json
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np

try:
    from tqdm.auto import tqdm
except ImportError:                 # the progress bar is optional
    tqdm = None
try:
    import uvloop
except ImportError:                 # not on Windows: loop_factory says so when uvloop is asked for
    uvloop = None

from servelab.measure.http_stream import CompletionQueue, StreamResponse, dechunk, post_stream, quickack_once
from servelab.measure.records import ClientRun, RequestRecord
from servelab.measure.workload import RequestSpec, request_body

READ_BUFSIZE_BYTES = 16 * 1024 * 1024
API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}
TRANSPORTS = ("aiohttp", "raw", "auto")
T = TypeVar("T")


@dataclass
class ClientConfig:
    """Where and how to send: base URL, API (completions | chat | generate), model name, engine, extras."""
    base_url: str
    model: str
    engine: str = "llamacpp"
    api: str = "completions"
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    request_id_prefix: str = "servelab"
    progress: bool = False
    keep_fields: tuple[str, ...] = ()        # top-level event fields kept per chunk (e.g. a server timestamp)
    tcp_quickack: bool = True                # no delayed ACKs on the response (http_stream.quickack_once)
    # the HTTP transport: "aiohttp"; "raw" (measure.http_stream: reads timestamped in the protocol's
    # data_received, plain http:// only); "auto": raw for http://, aiohttp for https://
    transport: str = "auto"
    # called with each record as soon as its request completes (parsed): a case streams its records to disk so
    # that what was received survives an interrupt (CaseFolder.stream_record); None: records only at the end
    on_record: Callable[["RequestRecord"], None] | None = field(default=None, compare=False, repr=False)
    headers: dict[str, str] = field(default_factory=dict, repr=False)   # e.g. Authorization (the API key)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport '{self.transport}'; one of {TRANSPORTS}")
        if self.transport == "raw" and not self.base_url.startswith("http://"):
            raise ValueError(f"transport 'raw' speaks plain http:// only, not '{self.base_url}'; use 'auto' or "
                             "'aiohttp' for https")

    @property
    def raw(self) -> bool:
        """Whether requests go through the raw transport (``measure.http_stream``)."""
        return self.transport == "raw" or (self.transport == "auto" and self.base_url.startswith("http://"))

    @property
    def url(self) -> str:
        if self.api not in API_PATHS:
            raise ValueError(f"unknown api '{self.api}'; one of {sorted(API_PATHS)}")
        return self.base_url.rstrip("/") + API_PATHS[self.api]


# ---------------------------------------------------------------- SSE parsing (after the run)

class ReadLog:
    """Raw socket reads of one response: arrival times and bytes in two flat lists.

    Two lists of ints/bytes rather than a list of tuples: neither ints nor bytes are tracked by Python's
    cyclic GC, so the hot path allocates nothing that makes the collector run (measured: tuples per read
    triggered collections that stalled a 512-stream run by tens of ms). Iterating yields (ns, bytes).
    """
    __slots__ = ("ts", "data", "chunked")

    def __init__(self) -> None:
        self.ts: list[int] = []
        self.data: list[bytes] = []
        self.chunked = False        # the raw transport's reads still carry the chunked framing (see body())

    def body(self) -> "ReadLog":
        """The reads with the chunked transfer coding undone (``measure.http_stream.dechunk``): done when the
        records are parsed, after the wave, never while other streams are still arriving."""
        if not self.chunked:
            return self
        out = ReadLog()
        out.ts, out.data = dechunk(self.ts, self.data)
        return out

    def append(self, item: tuple[int, bytes]) -> None:
        self.ts.append(item[0])
        self.data.append(item[1])

    def __iter__(self) -> Any:
        return iter(zip(self.ts, self.data))

    def __len__(self) -> int:
        return len(self.ts)

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        return self.ts[i], self.data[i]


def split_events(reads: Any) -> list[tuple[int, bytes]]:
    """Socket reads → (arrival ns, payload) per ``data:`` line; a line's time is the read that completed it."""
    events: list[tuple[int, bytes]] = []
    pending = b""
    for t, data in reads:
        buf = pending + data
        lines = buf.split(b"\n")
        pending = lines.pop()
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                events.append((t, line[5:].strip()))
    if pending.strip().startswith(b"data:"):
        events.append((reads[-1][0], pending.strip()[5:].strip()))
    return events


_decode = json.JSONDecoder().decode         # the C scanner without json.loads' encoding sniffing per event


def parse_stream(rec: RequestRecord, reads: Any, api: str, keep: tuple[str, ...] = ()) -> None:
    """Fill a record's chunk lists, usage, finish reason and stream errors from its raw reads."""
    prev_text, prev_tokens = "", 0
    for t, payload in split_events(reads):
        if payload == b"[DONE]":
            rec.done_ns = t
            continue
        try:
            data = _decode(payload.decode())
        except (json.JSONDecodeError, UnicodeDecodeError):
            rec.error_kind, rec.error = "stream", f"undecodable SSE event: {payload[:200]!r}"
            continue
        if not isinstance(data, dict):
            continue
        if "error" in data and not data.get("choices"):
            rec.error_kind, rec.error = "stream", json.dumps(data["error"])[:500]
            continue
        tokens: int | None = None
        if api == "generate":
            full = data.get("text") or ""
            text, prev_text = full[len(prev_text):], full
            meta = data.get("meta_info") or {}
            if meta.get("completion_tokens") is not None:
                tokens = int(meta["completion_tokens"]) - prev_tokens
                prev_tokens = int(meta["completion_tokens"])
            fr = meta.get("finish_reason")
            if fr:
                rec.finish_reason = fr.get("type") if isinstance(fr, dict) else str(fr)
            rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
            rec.completion_tokens = meta.get("completion_tokens", rec.completion_tokens)
            rec.cached_tokens = meta.get("cached_tokens", rec.cached_tokens)
            has_choices = True
        else:
            choices = data.get("choices")
            has_choices = bool(choices)
            text = ""
            if has_choices:
                c = choices[0]
                if api == "chat":
                    delta = c.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
                else:
                    text = c.get("text") or ""
                if c.get("finish_reason"):
                    rec.finish_reason = c["finish_reason"]
            usage = data.get("usage")
            if usage:
                if has_choices and usage.get("completion_tokens") is not None:
                    # continuous usage (vLLM continuous_usage_stats): a per-chunk token delta
                    tokens = int(usage["completion_tokens"]) - prev_tokens
                    prev_tokens = int(usage["completion_tokens"])
                rec.usage, rec.usage_ns = usage, t
                rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    rec.cached_tokens = details["cached_tokens"]
        rec.chunk_ns.append(t)
        rec.chunk_text.append(text)
        rec.chunk_choices.append(has_choices)
        rec.chunk_tokens.append(tokens)
        if keep:
            rec.chunk_extra.append({k: data.get(k) for k in keep})
    # a continuous-usage delta only means something if every choices chunk had one
    if any(tok is None for tok, ch in zip(rec.chunk_tokens, rec.chunk_choices) if ch):
        rec.chunk_tokens = [None] * len(rec.chunk_tokens)


# ---------------------------------------------------------------- sending

async def _send_raw(spec: RequestSpec, cfg: ClientConfig, rec: RequestRecord, reads: ReadLog,
                    completions: CompletionQueue | None = None) -> None:
    """The raw transport (``measure.http_stream``): every read timestamped in the protocol's ``data_received``;
    the chunked framing is undone when the records are parsed (``ReadLog.body``), after the wave."""
    body = json.dumps(request_body(spec, cfg.engine, cfg.api, cfg.model, cfg.extra_body)).encode()
    headers = {"Content-Type": "application/json", "X-Request-ID": rec.request_id, **cfg.headers}
    resp = StreamResponse()
    pc = time.perf_counter_ns
    rec.send_ns = pc()
    try:
        await post_stream(cfg.url, body, headers, reads.ts, reads.data, cfg.timeout_s, cfg.tcp_quickack, resp,
                          completions)
    except TimeoutError:
        rec.error_kind, rec.error = "timeout", f"no complete response within {cfg.timeout_s} s"
    except OSError as exc:
        rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"[:500]
    finally:
        rec.end_ns = pc()
        reads.chunked = resp.chunked
    if resp.status:
        rec.headers_ns, rec.http_status = resp.headers_ns, resp.status
    if resp.status and resp.status != 200:
        rec.error_kind = "http"
        rec.error = f"HTTP {resp.status}: {b''.join(reads.body().data)[:500].decode(errors='replace')}"
        reads.ts.clear()
        reads.data.clear()
        reads.chunked = False


def import_aiohttp() -> Any:
    """The ``aiohttp`` module, imported on first use: about 0.2 s that a process which never streams over it (the
    command line answering ``servelab phases|targets|params``, a raw-transport run) does not pay. A caller about to
    open a measurement window calls this first, so that the import never lands inside the window."""
    import aiohttp
    return aiohttp


async def _send(session: Any, spec: RequestSpec, cfg: ClientConfig, rec: RequestRecord, reads: ReadLog,
                completions: CompletionQueue | None = None) -> None:
    if cfg.raw:
        return await _send_raw(spec, cfg, rec, reads, completions)
    aiohttp = import_aiohttp()
    body = json.dumps(request_body(spec, cfg.engine, cfg.api, cfg.model, cfg.extra_body)).encode()
    headers = {"Content-Type": "application/json", "X-Request-ID": rec.request_id, **cfg.headers}
    pc = time.perf_counter_ns
    rec.send_ns = pc()
    try:
        async with session.post(cfg.url, data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            rec.headers_ns = pc()
            rec.http_status = resp.status
            if resp.status != 200:
                rec.error_kind = "http"
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
            else:
                if cfg.tcp_quickack and resp.connection is not None and resp.connection.transport is not None:
                    quickack_once(resp.connection.transport)      # the request is written: see quickack_once
                # the per-read path: readany directly (no async iterator object per read), one clock read,
                # two appends; an empty read is the end of the body
                ts_append, data_append, readany = reads.ts.append, reads.data.append, resp.content.readany
                while data := await readany():
                    ts_append(pc())
                    data_append(data)
    except asyncio.TimeoutError:
        rec.error_kind, rec.error = "timeout", f"no complete response within {cfg.timeout_s} s"
    except (aiohttp.ClientError, OSError) as exc:
        rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"[:500]
    rec.end_ns = pc()


def _new_record(spec: RequestSpec, cfg: ClientConfig, repeat: int, wall_offset_ns: int) -> RequestRecord:
    return RequestRecord(request_id=f"{cfg.request_id_prefix}-{spec.role}-{repeat}-{spec.index}", index=spec.index,
                         role=spec.role, expected_input_tokens=spec.input_tokens,
                         requested_output_tokens=spec.output_tokens, api=cfg.api, repeat=repeat, group=spec.group,
                         wall_offset_ns=wall_offset_ns)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or tqdm is None:
        return None
    return tqdm(total=total, desc="requests", leave=False)


def arrival_offsets_s(n: int, rate_rps: float, kind: str, seed: int) -> np.ndarray:
    """Open-loop arrival times (s from the window start): Poisson (exponential gaps) or constant."""
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    if kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate_rps, size=n)
        return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
    if kind == "constant":
        return np.arange(n) / rate_rps
    raise ValueError(f"arrival kind must be 'poisson' or 'constant', not '{kind}'")


def _ensure_fd_room(streams: int) -> None:
    """Raise the soft open-file limit towards the hard one when ``streams`` sockets would not fit (a default soft
    limit of 1024 fails a 2048-stream run with EMFILE half-way); a hard limit too low is the caller's to fix."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = streams + 256                         # + the interpreter's own files
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


MONITOR_INTERVAL_S = 0.01                   # the loop-lag monitor's period (100 wake-ups a second)


async def watch_loop(interval_s: float, done: asyncio.Event, on_wake: Callable[[int, int], None]) -> None:
    """Wake every ``interval_s`` until ``done`` and call ``on_wake(now_ns, lag_ns)`` with how late each wake-up came:
    the time the loop could not run anything (a callback blocked it, parsing or another task hogged it, or the
    process did not get a core). A long stall counts once, not again for every period it swallowed. The one
    implementation of the loop-lag monitor: the client's own (per run) and ``measure.loop_monitor.LoopMonitor``
    (per phase loop)."""
    pc = time.perf_counter_ns
    step = int(interval_s * 1e9)
    due = pc() + step
    while not done.is_set():
        await asyncio.sleep(max(0.0, (due - pc()) / 1e9))
        now = pc()
        on_wake(now, max(0, now - due))
        due += step
        if due <= now:
            due = now + step


async def run_async(specs: list[RequestSpec], cfg: ClientConfig, concurrency: int | None = None,
                    rate_rps: float | None = None, arrival: str = "poisson", seed: int = 0, repeat: int = 0,
                    injections: list[tuple[float, RequestSpec]] | None = None,
                    on_window_start: Callable[[], None] | None = None,
                    make_spec: Callable[[int], RequestSpec] | None = None, min_requests: int = 0,
                    min_duration_s: float = 0.0, max_requests: int = 100_000,
                    monitor_interval_s: float | None = MONITOR_INTERVAL_S,
                    offsets_s: list[float] | None = None) -> ClientRun:
    """Send ``specs`` and return their records.

    - closed loop (``rate_rps`` None): ``concurrency`` workers, each sends its next request when the
      previous one finished (``concurrency`` None = all at once); with ``make_spec`` (index → spec) the workers
      go on past ``specs`` until both ``min_requests`` were issued and ``min_duration_s`` has passed since the
      window opened (never more than ``max_requests``), then the run waits for what is in flight;
    - open loop: arrivals at ``rate_rps`` (``arrival`` poisson | constant, seeded), optionally capped at
      ``concurrency`` in flight; the wait for a slot is recorded (``dispatch_ns - scheduled_ns``), the client's
      own lateness separately (``ready_ns - scheduled_ns``).
    ``injections``: (seconds after the window start, spec) sent on schedule outside the cap (Mixed A/B).
    ``on_window_start`` is called inside the running loop just after the window opens. ``monitor_interval_s``
    None: no loop-lag monitor (for a caller that runs many one-request runs side by side in one loop and would
    otherwise start a monitor for each). ``offsets_s``: the open loop's arrival times (s from the window start) drawn
    by the caller, one per spec (``measure.multiclient`` splits one schedule over processes).
    """
    aiohttp = import_aiohttp()
    if make_spec is not None and rate_rps is not None:
        raise ValueError("make_spec (a sized run) is for the closed loop only; an open-loop run sends its specs")
    if min_duration_s < 0 or min_requests < 0 or (monitor_interval_s is not None and monitor_interval_s <= 0):
        raise ValueError("min_duration_s and min_requests must be >= 0 and monitor_interval_s > 0 (or None)")
    wall_offset = time.time_ns() - time.perf_counter_ns()
    specs = list(specs)
    records = [_new_record(s, cfg, repeat, wall_offset) for s in specs]
    inj = [(off, s, _new_record(s, cfg, repeat, wall_offset)) for off, s in (injections or [])]
    reads: dict[int, ReadLog] = {id(r): ReadLog() for r in records + [r for _, _, r in inj]}
    bar = _progress(len(specs) + len(inj), cfg.progress)
    # force_close: llama-server (cpp-httplib) may close a kept-alive connection after a streamed response,
    # and a POST written into a closed socket fails ("Can not write request body"); one connection per
    # request (as SGLang bench_serving, which opens a session per request) costs ~0.1 ms on loopback.
    # the pool: no connection limit (a case's concurrency is the limit), and room for thousands of sockets
    _ensure_fd_room(len(records) + len(inj) if concurrency is None else concurrency + len(inj))
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, force_close=True)
    pc = time.perf_counter_ns
    parsed: set[int] = set()

    def finish(rec: RequestRecord) -> None:
        parse_stream(rec, reads[id(rec)].body(), cfg.api, cfg.keep_fields)
        if rec.http_status == 200 and not rec.error_kind and not rec.chunk_ns:
            rec.error_kind, rec.error = "stream", "HTTP 200 but no SSE event"
        parsed.add(id(rec))

    lag_ns: list[int] = []
    inflight_samples: list[int] = []
    # the raw transport's completions, one per turn of the loop (http_stream.CompletionQueue): a wave's streams
    # that end together do not delay the last chunks of the others
    completions = CompletionQueue(asyncio.get_running_loop())
    state = {"inflight": 0}
    async with aiohttp.ClientSession(connector=connector, read_bufsize=READ_BUFSIZE_BYTES,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(spec: RequestSpec, rec: RequestRecord) -> None:
            state["inflight"] += 1
            try:
                await _send(session, spec, cfg, rec, reads[id(rec)], completions)
            finally:
                state["inflight"] -= 1
            if cfg.on_record is not None:         # parsed now (not after the wave) and handed on at once
                finish(rec)
                cfg.on_record(rec)
            if bar is not None:
                bar.update(1)

        async def injected(off_s: float, spec: RequestSpec, rec: RequestRecord, t0: int) -> None:
            rec.scheduled_ns = t0 + int(off_s * 1e9)
            await asyncio.sleep(max(0.0, (rec.scheduled_ns - pc()) / 1e9))
            rec.ready_ns = rec.dispatch_ns = pc()
            await one(spec, rec)

        def wake(now: int, lag: int) -> None:
            lag_ns.append(lag)
            inflight_samples.append(state["inflight"])

        async def monitor(done: asyncio.Event) -> None:
            assert monitor_interval_s is not None
            await watch_loop(monitor_interval_s, done, wake)

        # no cyclic-GC pauses inside the window (restored below); the hot path allocates no tracked objects
        gc_was_enabled = gc.isenabled()
        gc.disable()
        done = asyncio.Event()
        mon: asyncio.Task[None] | None = None
        try:
            cpu0 = time.process_time()
            t0 = pc()
            mon = asyncio.create_task(monitor(done)) if monitor_interval_s is not None else None
            if on_window_start is not None:
                on_window_start()
            inj_tasks = [asyncio.create_task(injected(o, s, r, t0)) for o, s, r in inj]
            if rate_rps is None:
                min_ns = int(min_duration_s * 1e9)
                n0 = len(specs)
                next_i = 0

                def more(i: int) -> bool:
                    if i < n0:
                        return True
                    if make_spec is None or i >= max_requests:
                        return False
                    return i < min_requests or pc() - t0 < min_ns

                def take() -> tuple[RequestSpec, RequestRecord] | None:
                    nonlocal next_i
                    i = next_i
                    if not more(i):
                        return None
                    next_i += 1
                    if i >= len(specs):
                        assert make_spec is not None
                        spec = make_spec(i)
                        rec = _new_record(spec, cfg, repeat, wall_offset)
                        specs.append(spec)
                        records.append(rec)
                        reads[id(rec)] = ReadLog()
                        if bar is not None:
                            bar.total = len(specs) + len(inj)
                    return specs[i], records[i]

                async def worker() -> None:
                    while (item := take()) is not None:
                        spec, rec = item
                        rec.scheduled_ns = rec.ready_ns = rec.dispatch_ns = pc()
                        await one(spec, rec)

                if make_spec is not None:        # sized: the run lasts, whatever the minimum count
                    workers = concurrency or max(n0, min_requests, 1)
                else:
                    workers = min(concurrency or n0, n0) if n0 else 0
                await asyncio.gather(*(worker() for _ in range(workers)))
            else:
                n = len(specs)
                offsets = arrival_offsets_s(n, rate_rps, arrival, seed) if offsets_s is None else offsets_s
                sem = asyncio.Semaphore(concurrency) if concurrency else None
                tasks = []

                async def capped(spec: RequestSpec, rec: RequestRecord) -> None:
                    try:
                        await one(spec, rec)
                    finally:
                        if sem is not None:
                            sem.release()

                for i in range(n):
                    rec = records[i]
                    rec.scheduled_ns = t0 + int(offsets[i] * 1e9)
                    delay = (rec.scheduled_ns - pc()) / 1e9
                    if delay > 0:
                        await asyncio.sleep(delay)
                    rec.ready_ns = pc()
                    if sem is not None:
                        await sem.acquire()
                    rec.dispatch_ns = pc()
                    tasks.append(asyncio.create_task(capped(specs[i], rec)))
                await asyncio.gather(*tasks)
            await asyncio.gather(*inj_tasks)
            t1 = pc()
            cpu1 = time.process_time()
            done.set()
            if mon is not None:
                await mon
        finally:
            done.set()
            if mon is not None and not mon.done():
                mon.cancel()
            if gc_was_enabled:
                gc.enable()
    if bar is not None:
        bar.close()
    all_records = records + [r for _, _, r in inj]
    for rec in all_records:
        if id(rec) not in parsed:
            finish(rec)
    mode = "closed" if rate_rps is None else arrival
    sizing: dict[str, Any] = {}
    if make_spec is not None:
        dur = (t1 - t0) / 1e9
        sizing = {"min_duration_s": min_duration_s, "min_requests": min_requests, "issued": len(records),
                  "max_requests": max_requests, "duration_s": dur,
                  "met": len(records) >= min_requests and dur >= min_duration_s}
    return ClientRun(all_records, t0, t1, wall_offset, mode, concurrency, rate_rps, cpu1 - cpu0,
                     loop_lag_ns=lag_ns, inflight=inflight_samples, monitor_interval_s=monitor_interval_s or 0.0,
                     sizing=sizing, event_loop=loop_name())


# asyncio's loop unless asked: in one full test-suite run (fresh clone, 2 cores) a real SIGINT during a case was
# swallowed under uvloop three times in a row — not reproduced alone or under load; Ctrl-C must always stop a run
DEFAULT_LOOP = "asyncio"


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop the client runs on: ``auto`` = uvloop where installed, else asyncio's own; ``uvloop`` (an
    error if missing) or ``asyncio``. uvloop's libuv loop spends a fraction of asyncio's per wake-up and per read
    (measured in ``benchmarks/bench_client_overhead.py``), so chunk timestamps wait less behind other streams."""
    if kind not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"event loop must be 'auto', 'uvloop' or 'asyncio', not '{kind}'")
    if kind == "asyncio":
        return None
    if uvloop is None:
        if kind == "uvloop":
            raise ValueError("event loop 'uvloop' asked for but uvloop is not installed: pip install uvloop")
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    """The running loop's kind (``uvloop`` | ``asyncio``), recorded with each client run."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def _run_new_loop(coro_fn: Callable[[], Awaitable[T]], loop: str) -> T:
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(coro_fn())  # type: ignore[arg-type]


def run_sync(coro_fn: Callable[[], Awaitable[T]], loop: str = DEFAULT_LOOP) -> T:
    """Run a coroutine to completion from sync code on a new loop (``loop``: see :func:`loop_factory`), also inside
    Jupyter (whose loop is already running: the new loop runs in a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_new_loop(coro_fn, loop)
    box: dict[str, Any] = {}

    async def main() -> T:
        box["loop"], box["task"] = asyncio.get_running_loop(), asyncio.current_task()
        return await coro_fn()

    def target() -> None:
        try:
            box["value"] = _run_new_loop(main, loop)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    th = threading.Thread(target=target, name="servelab-client")
    th.start()
    try:
        th.join()
    except KeyboardInterrupt:
        # Ctrl-C lands in the caller's thread: cancel the requests still in flight rather than let them run on
        loop, task = box.get("loop"), box.get("task")
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:                  # the loop already closed
                pass
        th.join(timeout=10)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_requests(specs: list[RequestSpec], cfg: ClientConfig, loop: str = DEFAULT_LOOP, **kw: Any) -> ClientRun:
    """Synchronous wrapper of ``run_async`` (same arguments) on a new event loop (``loop``: :func:`loop_factory`)."""
    return run_sync(lambda: run_async(specs, cfg, **kw), loop=loop)
