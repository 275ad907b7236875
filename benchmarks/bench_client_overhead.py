"""How much does the *client* distort what it measures? servelab's client vs SGLang bench_serving 0.5.9.

Target: ``benchmarks/paced_sse_server.py`` — every stream gets one token every ``ITL_MS`` on an absolute schedule,
each chunk carries ``server_ts_ns`` (its wall-clock write time), and one loop writes every due chunk in a stable
order, so the server's own gap error stays in the tens of µs on a quiet core (an asyncio server with a timer per
stream jittered by milliseconds at 512 streams, more than the 1 ms asked of the client). The server is pinned
to one core, the client under test to another (``taskset``), one client at a time, in the same run.

Three readers (``--clients``): servelab's client; SGLang bench_serving 0.5.9 (the peer); and the **floor**, a bare
epoll reader (``FLOOR_CHILD``: one recv and one clock read per readiness, nothing parsed until the wave is over)
— what no client on this core can beat, so the error it sees is the server's, the kernel's and the machine's.
The machine's own stalls are probed on both cores before and after (``machine_stalls``: a loop that only reads
the clock; every gap over 0.2 ms is time the core was taken away — on a 2-vCPU VM that is milliseconds a
second, and every reader's timestamps inherit it).

Per client and concurrency (one wave of C streams × ``tokens`` chunks):
- ITL error vs the server's schedule: ``|observed gap − ITL_MS|`` p50 / p99 / max, over every chunk gap
  (bench_serving: its ``--output-details`` ITL lists; ours: the same gaps from the raw records);
- achieved chunks/s = chunks received / (first send → last chunk) and the fraction of the offered rate;
- client CPU: CPU seconds of the client process (``wait4`` rusage) minus those of an idle run (1 stream,
  1 token) of the same client, so interpreter start-up and imports are not counted; µs per chunk (both
  include computing their ITL lists and writing them out: bench_serving's ``--output-details``, our gaps);
  and the CPU of the run itself (``client_run_cpu_us_per_chunk``: process time around our ``run_requests``
  and the gaps, the floor's reads and its parsing, bench_serving's one ``asyncio.run``), which carries no
  start-up noise; ours and the floor: the CPU of the reads alone (``client_read_cpu_us_per_chunk``: the
  window while the wave was read, before any event is parsed) — what competes with the next read for the core;
- ours and the floor: delivery lag = receive wall time − ``server_ts_ns`` (same machine, same clock) p50/p99, and
  server lag (``server_ts`` vs its own schedule) to show whether the *server* kept up.
- ours and the floor: the client's own share of the gap error, ``client_own_itl_error_ms`` = |its gap − the
  server's gap between the same two writes| in the steady state: what the client adds, the paced server's own
  lateness left out; and the server's own, ``server_itl_error_ms`` = |server gap − ITL| over the same gaps.
The server's own CPU time is reported too: a saturated server invalidates the comparison.
``--transport`` picks servelab's HTTP transport (``auto``, the product's default: its own for http://; ``aiohttp``;
``raw``). ``--start spread`` sends a wave's streams as Poisson arrivals at C per ITL (both clients) instead of all
at once, so their chunks are not phase-aligned.

    python benchmarks/bench_client_overhead.py --concurrency 256 512 --out /tmp/overhead.json

Each (client, C) pair runs ``--repeats`` times, interleaved with the order alternating, and the ratios use
the medians: a 2-core machine shared with other jobs stalls now and then (our ``server_schedule_lag_ms``
shows when the *server* was the one stalled; the 1-minute load average is recorded per run).
Writes a JSON result (per concurrency: each reader's medians, bench_serving / servelab and servelab / floor
ratios) and prints each reader's median p99 error.
``--clients servelab`` runs ours alone (e.g. to compare two versions of the client on one server).

``--server-script`` runs another paced server with the same arguments (e.g. an asyncio one, with
``--server-loop spin|uvloop|asyncio`` choosing its event loop) to compare targets.

**The accurate ceiling** (``--ceiling``, issue #15): per client, the highest offered chunk rate (streams × 1/ITL)
at which p99 |gap − ITL| ≤ 1 ms in the steady state AND ≥ 99 % of the offered chunks arrive within the run. The
steady state is every gap that starts once all streams have had their first chunk: while hundreds of
connections open, the loop is busy with their requests and headers for tens of ms (both clients; measured
~70 ms for 512 sends here), which is the connection ramp, not the chunk rate; the p99 over all gaps, ramp
included, is recorded beside it (``itl_error_ms``). A stream's chunk is
within the run when it arrives within (tokens − 1) × ITL + one ITL of that stream's first chunk (the same
count from bench_serving's ITL lists). Server on ``--server-cpu``, client on ``--client-cpu``. The stream count climbs
the ladder 16, 32, … 2048 (each point one wave of ``--point-s`` seconds of paced chunks, a failing point tried
once more) until a point fails, then ``--refine`` bisection steps between the last pass and the first fail.
Each point records streams, offered and achieved chunks/s, the fraction within the run, p99 error, CPU µs per
chunk (the run itself, and the whole process minus one idle run per client) and the server's CPU; the JSON goes to ``--out`` and a plotly
figure of the scaling curves (streams → CPU per chunk and p99 error, both clients, failing points hollow) to
the same name with ``.html``. ``--save-ceiling`` also writes servelab's ceiling, with this command, the date
and the machine, to ``client_ceiling.json`` in the servelab cache of this machine (``SERVELAB_CACHE``), which a
case's integrity check on this machine compares its chunk rate with (``docs/metrics.md#integrity``). The final measurement, on a quiet machine (nothing else
running; 3-5 minutes):

    python benchmarks/bench_client_overhead.py --ceiling --save-ceiling \
        --out benchmarks/results/client_ceiling_$(date +%Y%m%d).json

The reference client needs a python that imports ``sglang.bench_serving`` 0.5.9 and a tokenizer directory; by
default ``bench_serving_env.py`` builds both from the package registry. On a machine without one,
``--bench-serving-python`` and ``--bench-serving-tokenizer`` take them ready-made (``benchmarks/results/client_*_20261202_h200host*.json``
record in their ``note`` how they were made there).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PACED_SERVER = ROOT / "benchmarks" / "paced_sse_server.py"


def cpu_of(pid: int) -> float:
    """utime + stime of a running process (s), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_child(argv: list[str], timeout_s: float = 600) -> tuple[float, str]:
    """Run a process to completion; return (its CPU seconds from wait4 rusage, stdout)."""
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout_s:
                p.kill()
                raise TimeoutError(f"{argv[:4]} timed out")
            time.sleep(0.02)
        out.seek(0)
        text = out.read().decode(errors="replace")
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{argv[:6]} failed:\n{text[-3000:]}")
        return ru.ru_utime + ru.ru_stime, text


# What both child readers write for the parent, from each stream's chunk times (perf ns, ``times``), the server's
# stamps of the same chunks (``srvs``) and the stream's perf → wall offset (``wall_offsets``); also given: ``first``
# (the first send), ``cpu_run`` (None: up to the end of this, from ``cpu0``), ``cpu_window`` (CPU seconds while the
# wave was being read: the reads alone, no parsing after), ``completed``, ``event_loop``, ``transport``, ``tokens``,
# ``itl_ms``, ``out``.
WAVE_SUMMARY = r"""
gaps, lag, srv_lag, n, last, within, starts = [], [], [], 0, 0, 0, []
for ts, srv, wall_offset in zip(times, srvs, wall_offsets):
    if ts:   # chunks within the stream's run: by its first chunk + (tokens - 1) ITL + one ITL
        within += sum(t - ts[0] <= tokens * itl_ms * 1e6 for t in ts)
    n += len(ts)
    last = max([last, *ts])
    gaps += [(b - a) / 1e6 for a, b in zip(ts, ts[1:])]
    starts.append(ts[0] if ts else None)
    lag += [(t + wall_offset - s) / 1e6 for t, s in zip(ts, srv) if s]
    if srv and srv[0]:
        srv_lag += [(s - (srv[0] + i * itl_ms * 1e6)) / 1e6 for i, s in enumerate(srv)]
steady_from = max((x for x in starts if x is not None), default=0)   # every stream has had its first chunk
steady = [(b - a) / 1e6 for ts in times for a, b in zip(ts, ts[1:]) if a >= steady_from]
# the same without each stream's last gap: when a wave's streams all end in one tick, every completion's work on the
# loop (the request's task resuming, its connection closed) delays the last chunks of the streams still running
steady_but_last = [(b - a) / 1e6 for ts in times for a, b in zip(ts[:-1], ts[1:-1]) if a >= steady_from]
# the client's own share of a steady gap's error: its gap minus the server's gap between the same two writes
own = [abs((ts[k] - ts[k - 1]) - (sv[k] - sv[k - 1])) / 1e6 for ts, sv in zip(times, srvs)
       for k in range(1, len(ts)) if ts[k - 1] >= steady_from and sv[k] and sv[k - 1]]
# the server's own gap error over the same steady gaps: what a perfect client would measure
srv_err = [abs((sv[k] - sv[k - 1]) / 1e6 - itl_ms) for ts, sv in zip(times, srvs)
           for k in range(1, len(ts)) if ts[k - 1] >= steady_from and sv[k] and sv[k - 1]]
cpu_run = time.process_time() - cpu0 if cpu_run is None else cpu_run
json.dump({"client_own_gap_error": own, "server_gap_error": srv_err, "cpu_run_s": cpu_run, "cpu_window_s": cpu_window,
           "gaps": gaps, "steady_gaps": steady, "steady_gaps_but_last": steady_but_last, "lag": lag, "srv_lag": srv_lag,
           "chunks": n, "window_s": (last - first) / 1e9, "completed": completed, "within": within,
           "event_loop": event_loop, "transport": transport}, open(out, "w"))
"""


OURS_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.workload import build_workload
url, c, tokens, itl_ms, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
transport = sys.argv[7] if len(sys.argv) > 7 else "auto"
spread = len(sys.argv) > 8 and sys.argv[8] == "spread"
quickack = not (len(sys.argv) > 9 and sys.argv[9] == "off")
wl = build_workload("ovh", c, 16, tokens, list(range(1000, 1100)), seed=1)
import time
import aiohttp  # noqa: F401  (imported by run_async on first use: not the run's CPU)
try:
    import uvloop  # noqa: F401
except ImportError:
    pass
cpu0 = time.process_time()
run = run_requests(wl.requests, ClientConfig(url, "m", engine="sglang", keep_fields=("server_ts_ns",),
                                              transport=transport, tcp_quickack=quickack),
                   concurrency=c, loop="auto",     # uvloop where installed, as measured
                   **({"rate_rps": c * 1000.0 / itl_ms, "arrival": "poisson", "seed": 1} if spread else {}))
times = [[r.chunk_ns[i] for i, t in enumerate(r.chunk_text) if t] for r in run.records]
srvs = [[r.chunk_extra[i].get("server_ts_ns") for i, t in enumerate(r.chunk_text) if t] for r in run.records]
wall_offsets = [r.wall_offset_ns for r in run.records]
first = min(r.send_ns for r in run.records)
cpu_run = None          # ours: the run and the gaps below (time.process_time() - cpu0 at the end)
cpu_window = run.client_cpu_s    # the run's window: sends and reads, before any record is parsed
completed = sum(r.ok for r in run.records)
event_loop = getattr(run, "event_loop", "") or "asyncio"
""" + WAVE_SUMMARY


# The floor: the least a reader can do — non-blocking sockets on one epoll, one recv per readiness and one
# perf_counter_ns per recv, nothing parsed until the wave is over (then each event gets the time of the read that
# completed it, as ours does). No HTTP client, no asyncio. What it measures is the server, the kernel and this
# machine's own stalls (a vCPU descheduled for milliseconds shows in every client alike): no client on this core
# can do better, so it is the physical floor of the error in the same run.
FLOOR_CHILD = r"""
import bisect, gc, json, random, re, select, socket, sys, time
url, c, tokens, itl_ms, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
spread = len(sys.argv) > 6 and sys.argv[6] == "spread"
host, port = url.split("//", 1)[1].rsplit(":", 1)
port = int(port)
pc = time.perf_counter_ns
wall_offset = time.time_ns() - pc()
rng = random.Random(1)
at, t = [], 0.0
for _ in range(c):                      # spread: Poisson arrivals at C per ITL, as the clients' --start spread
    at.append(t)
    t += rng.expovariate(c * 1000.0 / itl_ms) if spread else 0.0
body = json.dumps({"model": "m", "prompt": list(range(1000, 1016)), "max_tokens": tokens, "stream": True,
                   "ignore_eos": True}).encode()
req = (b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
       b"Connection: close\r\n\r\n" % (host.encode(), port, len(body))) + body
ep = select.epoll()
socks, stream_of = {}, {}                # by descriptor (reused once closed); reads, sends by stream
reads, send_ns = [[] for _ in range(c)], [0] * c
buf = bytearray(65536)
view = memoryview(buf)
gc.disable()
cpu0 = time.process_time()
t0 = pc()
pending = list(range(c))
open_ = 0
while pending or open_:
    now = pc()
    while pending and t0 + at[pending[0]] * 1e9 <= now:
        i = pending.pop(0)
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(req)
        s.setblocking(False)
        send_ns[i] = pc()
        socks[s.fileno()], stream_of[s.fileno()] = s, i
        ep.register(s.fileno(), select.EPOLLIN)
        open_ += 1
    timeout = 0 if pending else 1.0
    for fd, _ in ep.poll(timeout):
        try:
            k = socks[fd].recv_into(buf)         # into one preallocated buffer: no allocation of a large bytes
        except BlockingIOError:
            continue
        if k:
            reads[stream_of[fd]].append((pc(), bytes(view[:k])))
        else:
            ep.unregister(fd)
            socks.pop(fd).close()
            open_ -= 1
cpu_window = time.process_time() - cpu0    # the reads; cpu_run (None) adds the parsing below, as ours
cpu_run = None
TS = re.compile(rb'"server_ts_ns":(\d+)')
times, srvs = [], []
for rd in reads:
    raw = b"".join(d for _, d in rd)
    ends = []
    acc = 0
    for _, d in rd:
        acc += len(d)
        ends.append(acc)
    ts, srv = [], []
    for m in TS.finditer(raw):
        e = raw.find(b"\n\n", m.end())
        if e < 0:
            break
        ts.append(rd[min(bisect.bisect_right(ends, e + 1), len(rd) - 1)][0])   # the read holding its last byte
        srv.append(int(m.group(1)))
    times.append(ts)
    srvs.append(srv)
wall_offsets = [wall_offset] * c
first = min(send_ns)
completed = sum(1 for t in times if len(t) == tokens)
event_loop, transport = "epoll", "bare sockets"
""" + WAVE_SUMMARY


# The machine's own stalls on a core: a loop that only reads the clock, pinned there; any gap between two reads
# longer than 0.2 ms is time the core was taken away (a hypervisor descheduling the vCPU, an interrupt storm).
# Whatever a client does, its timestamps inherit these.
STALL_PROBE = r"""
import json, sys, time
pc, end, gaps = time.perf_counter_ns, time.perf_counter_ns() + float(sys.argv[1]) * 1e9, []
last = pc()
while last < end:
    now = pc()
    if now - last > 200_000:
        gaps.append((now - last) / 1e6)
    last = now
print(json.dumps({"seconds": float(sys.argv[1]), "stalls_over_0_2ms": len(gaps), "stalled_ms": sum(gaps),
                  "longest_ms": max(gaps, default=0.0), "over_1ms": sum(g > 1 for g in gaps)}))
"""


def stall_probe(cpu_list: str, seconds: float = 3.0) -> dict:
    """How much of ``seconds`` the core(s) ``cpu_list`` were taken away from a process spinning on the clock."""
    _, text = run_child(["taskset", "-c", cpu_list, sys.executable, "-c", STALL_PROBE, str(seconds)])
    return json.loads(text.strip().splitlines()[-1])


def pct(values: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(values, q)) if values else float("nan")


TRANSPORT = ["auto"]          # servelab's HTTP transport for this run (--transport)
START = ["burst"]                # how a wave's C streams start (--start)
QUICKACK = ["on"]                # servelab's ClientConfig.tcp_quickack (--quickack)
# bench_serving's python and tokenizer directory (--bench-serving-python / --bench-serving-tokenizer); None: the venv
# benchmarks/bench_serving_env.py builds and the tiny model's tokenizer converted from its GGUF
BENCH_SERVING: dict[str, str | None] = {"python": None, "tokenizer": None}


def run_ours(url: str, c: int, tokens: int, itl_ms: float, cpu_list: str, tmp: Path,
             idle_cpu: float | None = None) -> dict:
    """One wave of ``c`` streams through servelab's client (a child process pinned to ``cpu_list``); the idle run
    (1 stream, 1 token: start-up and imports) is measured unless ``idle_cpu`` is given."""
    base = ["taskset", "-c", cpu_list, sys.executable, "-c", OURS_CHILD, str(ROOT / "lib"), url]
    return _child_wave("servelab", base, [TRANSPORT[0], START[0], QUICKACK[0]], c, tokens, itl_ms, tmp, idle_cpu)


def run_floor(url: str, c: int, tokens: int, itl_ms: float, cpu_list: str, tmp: Path,
              idle_cpu: float | None = None) -> dict:
    """One wave of ``c`` streams read by the bare epoll reader (``FLOOR_CHILD``): the floor of the error."""
    base = ["taskset", "-c", cpu_list, sys.executable, "-c", FLOOR_CHILD, url]
    return _child_wave(FLOOR_NAME, base, [START[0]], c, tokens, itl_ms, tmp, idle_cpu)


FLOOR_NAME = "floor: bare epoll reader"
KEY = {"servelab": "servelab", "sglang bench_serving 0.5.9": "bench_serving", FLOOR_NAME: "floor"}


def _child_wave(client: str, base: list[str], tail: list[str], c: int, tokens: int, itl_ms: float, tmp: Path,
                idle_cpu: float | None) -> dict:
    out = tmp / f"{client.split(':')[0]}_{c}.json"
    if idle_cpu is None:
        idle_cpu, _ = run_child(base + ["1", "1", str(itl_ms), str(tmp / "idle.json"), *tail])
    cpu, _ = run_child(base + [str(c), str(tokens), str(itl_ms), str(out), *tail])
    d = json.loads(out.read_text())

    def dist(v: list[float]) -> dict:
        return {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99), "max": max(v, default=0.0)}
    return summarize(client, c, tokens, itl_ms, d["gaps"], d["chunks"], d["window_s"], cpu - idle_cpu,
                     d["completed"], within=d["within"], steady_gaps=d["steady_gaps"],
                     extra={"event_loop": d["event_loop"], "transport": d.get("transport"),
                            "client_own_itl_error_ms": dist(d["client_own_gap_error"]),
                            "steady_itl_error_ms_without_last_gaps": dist([abs(g - itl_ms)
                                                                           for g in d["steady_gaps_but_last"]]),
                            "server_itl_error_ms": dist(d["server_gap_error"]),
                            "idle_cpu_s": idle_cpu, **run_cpu(d["cpu_run_s"], d["chunks"]),
                            "client_read_cpu_us_per_chunk": 1e6 * d["cpu_window_s"] / d["chunks"] if d["chunks"]
                            else None,
                            "delivery_lag_ms": {k: v for k, v in dist(d["lag"]).items() if k != "n"},
                            "server_schedule_lag_ms": {k: v for k, v in dist(d["srv_lag"]).items() if k != "n"}})


# bench_serving 0.5.9 ends with GET /get_server_info and json() on a 200; a paced server has no such endpoint
# (another --server-script may stream on any path), so that one GET is answered 404 here, without a request.
# Nothing measured is touched.
BS_WRAPPER = r"""
import asyncio, atexit, os, runpy, sys, time, requests
_arun, _cpu = asyncio.run, [0.0]
def arun(main, **kw):            # bench_serving's one asyncio.run: sending, streaming, its metrics and output file
    t = time.process_time()
    try:
        return _arun(main, **kw)
    finally:
        _cpu[0] += time.process_time() - t
asyncio.run = arun
atexit.register(lambda: open(os.environ["BENCH_CPU_OUT"], "w").write(repr(_cpu[0])))
_get = requests.get
def get(url, *a, **k):
    if str(url).endswith("/get_server_info"):
        r = requests.models.Response()
        r.status_code = 404
        return r
    return _get(url, *a, **k)
requests.get = get
sys.argv = ["bench_serving", *sys.argv[1:]]
runpy.run_module("sglang.bench_serving", run_name="__main__")
"""


def run_bench_serving(url: str, c: int, tokens: int, itl_ms: float, cpu_list: str, tmp: Path,
                      idle_cpu: float | None = None) -> dict:
    import bench_serving_env as be
    from servelab.deploy.models import resolve_model
    py = BENCH_SERVING["python"] or be.ensure_bench_serving()
    tok = BENCH_SERVING["tokenizer"] or be.ensure_gguf_tokenizer(Path(resolve_model("tiny")), tmp / "tiny-tok")

    def argv(n: int, toks: int, out: Path) -> list[str]:
        rate = ["--request-rate", f"{n * 1000.0 / itl_ms:g}"] if START[0] == "spread" else []
        bs = be.bench_serving_argv(py, url, "m", tok, 16, toks, n, n, out,
                                   extra=["--warmup-requests", "0", "--output-details", *rate])
        return ["taskset", "-c", cpu_list, "env", *[f"{k}={v}" for k, v in be.OFFLINE_ENV.items()],
                f"BENCH_CPU_OUT={out}.cpu",
                bs[0], "-c", BS_WRAPPER, *bs[3:]]
    if idle_cpu is None:
        idle_cpu, _ = run_child(argv(1, 1, tmp / "bs_idle.jsonl"))
    out = tmp / f"bs_{c}.jsonl"
    out.unlink(missing_ok=True)                          # bench_serving appends: one line per run
    cpu, _ = run_child(argv(c, tokens, out))
    d = json.loads(out.read_text().splitlines()[-1])
    cpu_run = float(Path(f"{out}.cpu").read_text())
    gaps = [g * 1000 for per_req in d["itls"] for g in per_req]
    got = [itls for itls, ttft in zip(d["itls"], d.get("ttfts") or [1.0] * len(d["itls"])) if ttft]
    n_chunks = sum(len(x) + 1 for x in got)             # first chunk + one per gap, streams that got one
    # steady state, as for ours: gaps that start once every stream has had its first chunk (bench_serving's times
    # are relative to each request's send; its sends all leave in the same burst, so ttft + Σ itl is the clock)
    got_ttft = [t for itls, t in zip(d["itls"], d.get("ttfts") or [0.0] * len(d["itls"])) if t]
    steady_from = max(got_ttft, default=0.0)
    steady = []
    for itls, t in zip(d["itls"], d.get("ttfts") or []):
        if not t:
            continue
        for g in itls:
            if t >= steady_from:
                steady.append(g * 1000)
            t += g
    within = 0
    for per_req in got:                                  # the same "within the stream's run" count as ours
        cum, within = 0.0, within + 1
        for g in per_req:
            cum += g * 1000
            within += cum <= tokens * itl_ms
    reported = {k: d.get(k) for k in ("median_itl_ms", "p95_itl_ms", "p99_itl_ms", "output_throughput")}
    return summarize("sglang bench_serving 0.5.9", c, tokens, itl_ms, gaps, n_chunks, d["duration"], cpu - idle_cpu,
                     d["completed"], within=within, steady_gaps=steady,
                     extra={"idle_cpu_s": idle_cpu, "reported": reported, **run_cpu(cpu_run, n_chunks)})


def paired_waves(results: list[dict], c: int) -> dict:
    """Does servelab's client pass where the bare reader passes? Each repeat runs the two one after the other on
    the same cores, so a repeat's pair saw nearly the same machine: of the repeats whose floor wave met the 1 ms
    rule, how many of servelab's met it too — on a host whose cores stall now and then, the waves the floor
    fails say nothing about a client."""
    by_rep: dict[int, dict[str, bool]] = {}
    for r in results:
        if r["concurrency"] == c:
            by_rep.setdefault(r["repeat"], {})[KEY[r["client"]]] = passes(r)
    pairs = [v for v in by_rep.values() if "servelab" in v and "floor" in v]
    floor_ok = [v for v in pairs if v["floor"]]
    return {"paired_repeats": len(pairs), "repeats_floor_passes": len(floor_ok),
            "repeats_servelab_passes_where_floor_passes": sum(v["servelab"] for v in floor_ok)}


def run_cpu(cpu_s: float, n_chunks: int) -> dict:
    """CPU of the run itself (process time from the send of the first request to the written result, no start-up
    or imports): steadier than the whole process minus an idle run when a point has few chunks."""
    return {"client_run_cpu_s": cpu_s, "client_run_cpu_us_per_chunk": 1e6 * cpu_s / n_chunks if n_chunks else None}


def summarize(client: str, c: int, tokens: int, itl_ms: float, gaps: list[float], n_chunks: int, dur_s: float,
              cpu_s: float, completed: int, extra: dict, within: int | None = None,
              steady_gaps: list[float] | None = None) -> dict:
    err = [abs(g - itl_ms) for g in gaps]
    steady = [abs(g - itl_ms) for g in (steady_gaps or [])]
    offered = c * tokens / (tokens * itl_ms / 1000)
    rate = n_chunks / dur_s if dur_s > 0 else float("nan")
    return {"client": client, "concurrency": c, "tokens_per_stream": tokens, "completed": completed,
            "chunks": n_chunks, "window_s": dur_s, "chunks_per_s": rate, "offered_chunks_per_s": offered,
            "fraction_of_offered": rate / offered,
            "chunks_within_run": within, "fraction_within_run": within / (c * tokens) if within is not None else None,
            "steady_itl_error_ms": {"n": len(steady), "p50": pct(steady, 50), "p99": pct(steady, 99),
                                    "max": max(steady, default=0.0)},
            "itl_error_ms": {"p50": pct(err, 50), "p99": pct(err, 99),
                                                                     "max": max(err, default=0.0)},
            "observed_itl_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99)}, "client_cpu_s": cpu_s,
            "client_cpu_us_per_chunk": 1e6 * cpu_s / n_chunks if n_chunks else None, **extra}


# ---------------------------------------------------------------- the accurate ceiling (issue #15)

RULE = {"max_p99_itl_error_ms": 1.0, "min_fraction_within_run": 0.99}
LADDER = (16, 32, 64, 128, 256, 512, 1024, 2048)
CLIENTS = {"servelab": run_ours, "bench_serving": run_bench_serving, "floor": run_floor}
def ceiling_path() -> Path:
    """Where this machine's ceiling is kept: the servelab cache (a ceiling is the machine's, never packaged)."""
    from servelab.core.paths import cache_root
    from servelab.measure.request_metrics import CEILING_FILE
    return cache_root() / CEILING_FILE


def passes(r: dict) -> bool:
    """The accurate-ceiling rule: steady-state p99 |gap − ITL| ≤ 1 ms (from ≥ 100 gaps) and ≥ 99 % of offered
    chunks within the run."""
    steady = r["steady_itl_error_ms"]
    return (steady["n"] >= 100 and steady["p99"] <= RULE["max_p99_itl_error_ms"]
            and (r["fraction_within_run"] or 0.0) >= RULE["min_fraction_within_run"])


def sweep_ceiling(fn, url: str, args: argparse.Namespace, tokens: int, tmp: Path, srv_pid: int,
                  points: list[dict]) -> dict:
    """One client's ceiling: the coarse ladder upward until a point fails, then ``--refine`` bisection steps on
    the stream count between the last pass and the first fail. A failing point is tried once more (the machine
    stalls now and then; both tries are kept, either passing passes). Returns the ceiling row."""
    warm = fn(url, 1, 1, args.itl_ms, args.client_cpu, tmp)       # an idle run, then a second (warm) one
    idle = min(warm["idle_cpu_s"], warm["idle_cpu_s"] + warm["client_cpu_s"])   # the first may pay cold caches

    def point(c: int) -> bool:
        ok = False
        for attempt in range(1 + args.retries):
            s0, load0 = cpu_of(srv_pid), os.getloadavg()[0]
            r = fn(url, c, tokens, args.itl_ms, args.client_cpu, tmp, idle_cpu=idle)
            r.update(attempt=attempt, passes=passes(r), server_cpu_s=cpu_of(srv_pid) - s0,
                     loadavg_1m=[load0, os.getloadavg()[0]])
            points.append(r)
            print(json.dumps({k: r[k] for k in ("client", "concurrency", "attempt", "offered_chunks_per_s",
                                                "fraction_within_run", "steady_itl_error_ms", "client_run_cpu_us_per_chunk",
                                                "passes")}), flush=True)
            if r["passes"]:
                ok = True
                break
        return ok

    lo, hi = 0, None
    for c in (x for x in LADDER if x <= args.max_streams):
        if point(c):
            lo = c
        else:
            hi = c
            break
    for _ in range(args.refine):
        if hi is None or hi - lo <= max(1, lo // 16):
            break
        mid = (lo + hi) // 2 if lo else max(1, hi // 2)
        if mid in (lo, hi):
            break
        if point(mid):
            lo = mid
        else:
            hi = mid
    return {"client": warm["client"], "ceiling_streams": lo, "first_failing_streams": hi,
            "ceiling_chunks_per_s": lo * 1000.0 / args.itl_ms,
            "achieved_chunks_per_s_at_ceiling": next((r["chunks_per_s"] for r in reversed(points)
                                                      if r["client"] == warm["client"] and r["concurrency"] == lo
                                                      and r["passes"]), None),
            "capped_by_max_streams": hi is None}


def ceiling_figure(points: list[dict], ceilings: list[dict], itl_ms: float) -> object:
    """Streams → client CPU µs per chunk and p99 ITL error, one line per client; failing points hollow."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, subplot_titles=("client CPU per chunk, the run itself (µs)",
                                                        "p99 |gap − ITL| in steady state (ms)"))
    colors = {"servelab": "#1f77b4", "sglang bench_serving 0.5.9": "#d62728", FLOOR_NAME: "#7f7f7f"}
    for client in dict.fromkeys(r["client"] for r in points):
        rows = sorted((r for r in points if r["client"] == client), key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in rows]
        sym = ["circle" if r["passes"] else "circle-open" for r in rows]
        cl = next((c for c in ceilings if c["client"] == client), {})
        name = f"{client} (ceiling {cl.get('ceiling_chunks_per_s', 0):,.0f} chunks/s)"
        for col, y in ((1, [r["client_run_cpu_us_per_chunk"] for r in rows]),
                       (2, [r["steady_itl_error_ms"]["p99"] for r in rows])):
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=name, legendgroup=client,
                                     showlegend=col == 1, marker={"symbol": sym, "size": 9},
                                     line={"color": colors.get(client)}), row=1, col=col)
    fig.add_hline(y=RULE["max_p99_itl_error_ms"], line_dash="dash", row=1, col=2,
                  annotation_text="accurate-ceiling rule: 1 ms")
    fig.update_xaxes(type="log", title_text=f"paced streams (one chunk every {itl_ms:g} ms each)")
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(title="Client scaling on one pinned core (hollow: point fails the rule)", height=450)
    return fig


def run_ceiling(args: argparse.Namespace, url: str, srv_pid: int) -> dict:
    tokens = max(2, round(args.point_s * 1000 / args.itl_ms))
    points: list[dict] = []
    ceilings = []
    with tempfile.TemporaryDirectory() as td:
        for name in args.clients:
            ceilings.append(sweep_ceiling(CLIENTS[name], url, args, tokens, Path(td), srv_pid, points))
    ours = next((c for c in ceilings if c["client"] == "servelab"), None)
    theirs = next((c for c in ceilings if KEY[c["client"]] == "bench_serving"), None)
    floor = next((c for c in ceilings if KEY[c["client"]] == "floor"), None)
    ratio = (ours["ceiling_chunks_per_s"] / theirs["ceiling_chunks_per_s"]
             if ours and theirs and theirs["ceiling_chunks_per_s"] else None)
    of_floor = (ours["ceiling_chunks_per_s"] / floor["ceiling_chunks_per_s"]
                if ours and floor and floor["ceiling_chunks_per_s"] else None)
    return {"mode": "ceiling", "rule": RULE, "ladder": list(LADDER), "tokens_per_stream": tokens,
            "ceilings": ceilings, "ceiling_ratio_servelab_over_bench_serving": ratio,
            "ceiling_ratio_servelab_over_floor": of_floor, "machine_limited": machine_limited(ours, floor),
            "points": points}


def machine_limited(ours: dict | None, floor: dict | None) -> str | None:
    """Why these ceilings are the machine's, not the clients' — when the bare reader, which does the least any
    reader can, got no higher than servelab's client (its cores stalled at any load) — or None."""
    if ours is None or floor is None or floor["ceiling_streams"] > ours["ceiling_streams"]:
        return None
    return (f"the bare reader's ceiling ({floor['ceiling_streams']} streams) is not above servelab's "
            f"({ours['ceiling_streams']}): this machine's stalls, not the clients, set these ceilings")


def ceiling_record(out: dict, args: argparse.Namespace, command: str) -> dict:
    """The data file ``servelab.measure.request_metrics.measured_client_ceiling`` reads (servelab's client only)."""
    ours = next(c for c in out["ceilings"] if c["client"] == "servelab")
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    loops = {r.get("event_loop") for r in out["points"] if r["client"] == "servelab"}
    return {"chunks_per_s": ours["ceiling_chunks_per_s"], "streams": ours["ceiling_streams"],
            "itl_ms": args.itl_ms, "rule": RULE, "measured": time.strftime("%Y-%m-%d"), "command": command,
            "machine": {"cpu_model": cpu_model, "nproc": os.cpu_count(), "client_cpu": args.client_cpu,
                        "server_cpu": args.server_cpu},
            "event_loop": sorted(x for x in loops if x), "capped_by_max_streams": ours["capped_by_max_streams"],
            "bench_serving_chunks_per_s": next((c["ceiling_chunks_per_s"] for c in out["ceilings"]
                                                if KEY[c["client"]] == "bench_serving"), None),
            "floor_chunks_per_s": next((c["ceiling_chunks_per_s"] for c in out["ceilings"]
                                        if KEY[c["client"]] == "floor"), None)}


SERVER_LOOP = "import runpy, sys, uvloop; uvloop.install(); sys.argv = sys.argv[1:]; " \
              "runpy.run_path(sys.argv[0], run_name='__main__')"
# The paced server's timers: epoll (asyncio) and libuv (uvloop) both wait in whole milliseconds, so a chunk due
# at t is written anywhere in [t, t + ~1 ms] — measured, server_schedule_lag p99 0.9 ms at 16 streams, about the
# whole 1 ms budget of the ceiling's rule, while the client's own delivery lag was 0.3 ms. "spin": asyncio with an
# epoll selector that waits 1 ms less than asked and then polls without blocking until the timer is due, so the
# schedule holds to microseconds; the server's core (its own, pinned) is busy while it spins, so its CPU time
# then says nothing about its load.
SERVER_SPIN = r"""
import asyncio, runpy, selectors, sys, time
class SpinEpoll(selectors.EpollSelector):
    def select(self, timeout=None):
        if timeout is None or timeout <= 0:
            return super().select(timeout)
        if timeout > 0.002:
            return super().select(timeout - 0.001)      # wake early; the loop asks again with what is left
        end = time.monotonic() + timeout
        while True:
            ev = super().select(0)
            if ev or time.monotonic() >= end:
                return ev
class Policy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        return asyncio.SelectorEventLoop(SpinEpoll())
asyncio.set_event_loop_policy(Policy())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--server-cpu", default="1")
    ap.add_argument("--client-cpu", default="0")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; ratios use the medians")
    ap.add_argument("--out", default="bench_client_overhead.json")
    ap.add_argument("--server-script", type=Path, default=PACED_SERVER,
                    help="the paced server (default: benchmarks/paced_sse_server.py; another script must take the same "
                         "PORT ITL_MS arguments and stamp server_ts_ns the same way)")
    ap.add_argument("--server-loop", choices=("own", "spin", "uvloop", "asyncio"), default="own",
                    help="own: run the script as it is; for an asyncio server script: its event loop (spin: asyncio "
                         "with timers held to µs, see SERVER_SPIN)")
    ap.add_argument("--ceiling", action="store_true", help="find each client's accurate ceiling (see the docstring)")
    ap.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=["servelab", "bench_serving", "floor"],
                    help="the readers, run in this order (floor: the bare epoll reader, see FLOOR_CHILD)")
    ap.add_argument("--point-s", type=float, default=2.0, help="--ceiling: seconds of paced chunks per point")
    ap.add_argument("--refine", type=int, default=3, help="--ceiling: bisection steps after the ladder")
    ap.add_argument("--retries", type=int, default=1, help="--ceiling: tries more for a failing point")
    ap.add_argument("--max-streams", type=int, default=LADDER[-1])
    ap.add_argument("--transport", choices=("auto", "aiohttp", "raw"), default="auto",
                    help="servelab client's HTTP transport (ClientConfig.transport)")
    ap.add_argument("--quickack", choices=("on", "off"), default="on",
                    help="servelab's client: no delayed ACKs on the response (on: the product's default, one "
                         "setting per request, see measure.http_stream.quickack_once) or leave ACKs to the kernel")
    ap.add_argument("--start", choices=("burst", "spread"), default="burst",
                    help="burst: a wave's C streams all sent at once (phase-aligned: every ITL the server writes C "
                         "chunks at the same instant); spread: Poisson arrivals at C per ITL, both clients")
    ap.add_argument("--save-ceiling", action="store_true",
                    help="--ceiling: keep servelab's ceiling in this machine's servelab cache, for the cases' verdicts")
    ap.add_argument("--bench-serving-python", default=None,
                    help="a python that imports sglang.bench_serving 0.5.9 (default: the venv bench_serving_env.py "
                         "builds from the package registry, for a machine without one)")
    ap.add_argument("--bench-serving-tokenizer", default=None,
                    help="bench_serving's tokenizer directory (default: converted from the tiny model's GGUF)")
    ap.add_argument("--ceiling-path", type=Path, default=None, help=argparse.SUPPRESS)  # tests
    args = ap.parse_args()
    if args.save_ceiling and not (args.ceiling and "servelab" in args.clients):
        ap.error("--save-ceiling needs --ceiling with the servelab client")
    args.ceiling_path = args.ceiling_path or ceiling_path()
    TRANSPORT[0], START[0], QUICKACK[0] = args.transport, args.start, args.quickack
    BENCH_SERVING.update(python=args.bench_serving_python, tokenizer=args.bench_serving_tokenizer)
    if not args.server_script.is_file():
        ap.error(f"the paced server {args.server_script} is missing")
    import resource                                       # thousands of sockets in the server and the clients
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2 * args.max_streams + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard == resource.RLIM_INFINITY
                                                    else min(hard, 2 * args.max_streams + 256), hard))
    from servelab.deploy.hosts import free_port, wait_port_free
    port = free_port()
    server = {"uvloop": [sys.executable, "-c", SERVER_LOOP], "spin": [sys.executable, "-c", SERVER_SPIN],
              "asyncio": [sys.executable], "own": [sys.executable]}[args.server_loop]
    srv = subprocess.Popen(["taskset", "-c", args.server_cpu, *server, str(args.server_script), str(port),
                            str(args.itl_ms)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        from servelab.deploy.server import http_json
        for _ in range(100):
            if http_json(url + "/health", timeout=1)[0] == 200:
                break
            time.sleep(0.05)
        stalls = {"before": {"client_core": stall_probe(args.client_cpu), "server_core": stall_probe(args.server_cpu)}}
        if args.ceiling:
            command = "python benchmarks/bench_client_overhead.py " + " ".join(sys.argv[1:])
            out = run_ceiling(args, url, srv.pid)
            stalls["after"] = {"client_core": stall_probe(args.client_cpu), "server_core": stall_probe(args.server_cpu)}
            out["machine_stalls"] = stalls
            out.update(tool="benchmarks/bench_client_overhead.py --ceiling", command=command, itl_ms=args.itl_ms,
                       server_loop=args.server_loop, when=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       start=args.start, servelab_transport=args.transport, servelab_quickack=args.quickack,
                       nproc=os.cpu_count(), pinning={"server_cpu": args.server_cpu, "client_cpu": args.client_cpu})
            Path(args.out).write_text(json.dumps(out, indent=2))       # the numbers first, then the figure
            html = Path(args.out).with_suffix(".html")
            ceiling_figure(out["points"], out["ceilings"], args.itl_ms).write_html(str(html), include_plotlyjs=True)
            for c in out["ceilings"]:
                print(f"{c['client']}: accurate ceiling {c['ceiling_chunks_per_s']:,.0f} chunks/s "
                      f"({c['ceiling_streams']} streams; first failing {c['first_failing_streams']})")
            if out["ceiling_ratio_servelab_over_bench_serving"]:
                print(f"servelab / bench_serving = {out['ceiling_ratio_servelab_over_bench_serving']:.2f}x")
            if out["machine_limited"]:
                print(out["machine_limited"])
            ours = next(c for c in out["ceilings"] if c["client"] == "servelab") if args.save_ceiling else None
            if ours is not None and out["machine_limited"]:
                print(f"not written {args.ceiling_path}: {out['machine_limited']} — measure on a quiet machine")
            elif ours is not None and not ours["ceiling_streams"]:
                print(f"not written {args.ceiling_path}: servelab's client met the rule at no point "
                      f"(first failing at {ours['first_failing_streams']} streams) — is the machine quiet?")
            elif ours is not None:
                args.ceiling_path.parent.mkdir(parents=True, exist_ok=True)
                args.ceiling_path.write_text(json.dumps(ceiling_record(out, args, command), indent=2) + "\n")
                print(f"written {args.ceiling_path}")
            print(f"written {args.out} and {html}")
            return
        with tempfile.TemporaryDirectory() as td:
            tmp = Path(td)
            for rep in range(args.repeats):
                for c in args.concurrency:
                    order = tuple(CLIENTS[n] for n in args.clients)
                    order = order if rep % 2 == 0 else order[::-1]
                    for fn in order:           # alternate who goes first: drift of the machine hits both
                        s0, load0 = cpu_of(srv.pid), os.getloadavg()[0]
                        r = fn(url, c, args.tokens, args.itl_ms, args.client_cpu, tmp)
                        r.update(repeat=rep, server_cpu_s=cpu_of(srv.pid) - s0, loadavg_1m=[load0, os.getloadavg()[0]])
                        results.append(r)
                        print(json.dumps({k: r[k] for k in ("client", "concurrency", "repeat", "chunks_per_s",
                                                            "itl_error_ms", "client_cpu_us_per_chunk")}), flush=True)
        stalls["after"] = {"client_core": stall_probe(args.client_cpu), "server_core": stall_probe(args.server_cpu)}
    finally:
        srv.terminate()
        srv.wait(10)
        wait_port_free("127.0.0.1", port, 5)
    import numpy as np

    def med(client: str, c: int, get) -> float:
        vals = [get(r) for r in results if r["client"] == client and r["concurrency"] == c]
        return float(np.median(vals)) if vals else float("nan")
    ratios = []
    present = {KEY[r["client"]]: r["client"] for r in results}
    for c in args.concurrency:
        row = {"concurrency": c, "repeats": args.repeats}
        for key, client in present.items():
            for name, get in (("p99_itl_error_ms", lambda r: r["itl_error_ms"]["p99"]),
                              ("p50_itl_error_ms", lambda r: r["itl_error_ms"]["p50"]),
                              ("p99_steady_itl_error_ms", lambda r: r["steady_itl_error_ms"]["p99"]),
                              ("chunks_per_s", lambda r: r["chunks_per_s"]),
                              ("client_cpu_us_per_chunk", lambda r: r["client_cpu_us_per_chunk"]),
                              ("client_run_cpu_us_per_chunk", lambda r: r["client_run_cpu_us_per_chunk"]),
                              ("client_read_cpu_us_per_chunk",
                               lambda r: r.get("client_read_cpu_us_per_chunk") or float("nan"))):
                row[f"{key}_median_{name}"] = med(client, c, get)
            row[f"{key}_waves_passing"] = sum(passes(r) for r in results if r["client"] == client
                                              and r["concurrency"] == c)
        if "servelab" in present and "floor" in present:
            row.update(paired_waves(results, c))
        if "servelab" in present and "bench_serving" in present:
            row["p99_itl_error_ratio_bench_serving_over_servelab"] = \
                row["bench_serving_median_p99_itl_error_ms"] / max(row["servelab_median_p99_itl_error_ms"], 1e-9)
            row["cpu_per_chunk_ratio_bench_serving_over_servelab"] = \
                row["bench_serving_median_client_cpu_us_per_chunk"] / max(row["servelab_median_client_cpu_us_per_chunk"], 1e-9)
            row["run_cpu_per_chunk_ratio_bench_serving_over_servelab"] = \
                row["bench_serving_median_client_run_cpu_us_per_chunk"] / max(
                    row["servelab_median_client_run_cpu_us_per_chunk"], 1e-9)
            row["chunks_per_s_ratio_servelab_over_bench_serving"] = \
                row["servelab_median_chunks_per_s"] / max(row["bench_serving_median_chunks_per_s"], 1e-9)
        if "servelab" in present and "floor" in present:    # how far above what no client here can beat
            row["p99_itl_error_ratio_servelab_over_floor"] = \
                row["servelab_median_p99_itl_error_ms"] / max(row["floor_median_p99_itl_error_ms"], 1e-9)
        ratios.append(row)
    out = {"tool": "benchmarks/bench_client_overhead.py", "itl_ms": args.itl_ms, "tokens": args.tokens,
           "machine_stalls": stalls,
           "pinning": {"server_cpu": args.server_cpu, "client_cpu": args.client_cpu}, "results": results,
           "ratios": ratios, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "nproc": os.cpu_count(),
           "start": args.start, "servelab_transport": args.transport, "servelab_quickack": args.quickack,
           "command": "python benchmarks/bench_client_overhead.py " + " ".join(sys.argv[1:])}
    Path(args.out).write_text(json.dumps(out, indent=2))
    for r in ratios:
        parts = [f"{k} {r[f'{k}_median_p99_itl_error_ms']:.2f} ms ({r[f'{k}_waves_passing']}/{args.repeats} waves "
                 f"<= 1 ms)" for k in present]
        paired = (f"; servelab passed {r['repeats_servelab_passes_where_floor_passes']} of the "
                  f"{r['repeats_floor_passes']} repeats the floor passed" if "paired_repeats" in r else "")
        print(f"C={r['concurrency']}: median p99 |gap - ITL|: " + ", ".join(parts) + paired
              + (f"; CPU of the run per chunk bench_serving/servelab = "
                 f"{r['run_cpu_per_chunk_ratio_bench_serving_over_servelab']:.2f}x"
                 if "run_cpu_per_chunk_ratio_bench_serving_over_servelab" in r else ""))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
