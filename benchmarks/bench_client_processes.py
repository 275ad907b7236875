"""The accurate client ceiling from N client processes (``measure.multiclient``) against one process, same run:

    python benchmarks/bench_client_processes.py [--processes 1,2,4,8] [--client-cpus 0-7] [--server-cpus 8-15]
                                                [--out benchmarks/results/client_processes_DATE.json]

Target: ``paced_sse_server.py`` (one token per stream every ``--itl-ms``, each chunk stamped), ``--server-cpus``
servers sharing one port (``--reuse-port``: the kernel deals the connections out), each pinned to its own core, so
the server side is the same for every client count and outlasts the clients. The rule is the one of
``bench_client_overhead.py --ceiling`` (``docs/metrics.md#integrity``): a point passes when the steady-state p99
|observed gap − ITL| ≤ 1 ms (≥ 100 gaps; steady: gaps that start once every stream had its first chunk) and
≥ 99 % of the offered chunks arrive within the run (a stream's chunk counts within (tokens − 1) × ITL + one ITL of
its first chunk) — computed here over the merged records of all processes.

Configurations, each point a fresh child process tree:

- ``single``: the product's one-process path, ``run_requests`` in one process pinned to the first client core;
- ``processes_N``: ``run_requests_multi(..., clients=N, cpus=first N client cores)``: one wave split over N
  processes, one start instant, records merged.

Per configuration the streams per process climb ``--ladder``; each rung is ``--waves`` waves (one child process
runs them back to back) and the **median** wave decides it (median steady p99 |gap − ITL| and median fraction
within the run against the rule; the spread — min and max over the waves — is recorded beside it), so one short
host stall no longer decides a rung. The ladder stops after ``--stop-after`` failing rungs in a row (default 2:
a stall only ever adds error, so a stalled period can fail a rung the client passes, and on the 16-core host such
periods lasted the three waves of a rung — 2026-12-06: a rung at 0.4 ms median in one repeat, 1.5 ms in the next);
the ceiling is the highest passing rung's offered chunks/s below them, and the failing rungs under it are listed
(``rungs_failed_below_ceiling``). No passing rung is reported as such (ceiling ``null``), never as a ceiling of 0;
``first_rung_failed`` says whether the first did. With ``--quiet-probes K`` each wave runs between two probes
of the host — a wave of the bare epoll reader (``bench_client_overhead.py``'s floor: no HTTP client, no event
loop) at ``--probe-streams`` on the first client core, judged by the same rule — retried up to K times before the
wave until the host is quiet; a wave whose probe after it is not quiet is run again, and the rung is decided on
the waves between two quiet probes (a rung with none is undecided, neither pass nor fail). Every wave keeps its
probes, so the host's jitter is in the file beside what the client did. The whole ladder (every configuration) runs ``--repeats`` times in one result file;
``summary`` gives per configuration the ceiling of each repeat, their median and spread (max − min over the
median: the repeats agree when it is ≤ 15 %), and ``ratio_to_single`` the median over repeats of the ratio of a
configuration's ceiling to ``single``'s in the same repeat, with its min and max, also over N (aim: ≥ 0.8 × N up
to the cores). Each wave records its load average and the servers' CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))
sys.path.insert(0, str(ROOT / "benchmarks"))             # bench_client_overhead's floor reader, for the probes
PACED = ROOT / "benchmarks" / "paced_sse_server.py"
RULE = {"max_p99_itl_error_ms": 1.0, "min_fraction_within_run": 0.99, "min_steady_gaps": 100}


def cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def evaluate(records: list, streams: int, tokens: int, itl_ms: float) -> dict:
    """The ceiling rule over one merged run's records (token chunks only)."""
    import numpy as np
    per = [[t for t, x in zip(r.chunk_ns, r.chunk_text) if x] for r in records]
    firsts = [ts[0] for ts in per if ts]
    if not firsts:
        return {"passes": False, "note": "no chunk received"}
    ramp_end = max(firsts)
    steady = [abs((b - a) / 1e6 - itl_ms) for ts in per for a, b in zip(ts, ts[1:]) if a >= ramp_end]
    within = sum(sum(t - ts[0] <= tokens * itl_ms * 1e6 for t in ts) for ts in per if ts)
    n_chunks = sum(len(ts) for ts in per)
    t0 = min(r.send_ns for r in records if r.send_ns)
    t1 = max(max(ts) for ts in per if ts)
    p99 = float(np.percentile(steady, 99)) if steady else None
    frac = within / (streams * tokens)
    ok = bool(steady and len(steady) >= RULE["min_steady_gaps"] and p99 <= RULE["max_p99_itl_error_ms"]
              and frac >= RULE["min_fraction_within_run"])
    return {"streams": streams, "offered_chunks_per_s": streams * 1000.0 / itl_ms,
            "achieved_chunks_per_s": n_chunks / ((t1 - t0) / 1e9), "chunks": n_chunks,
            "steady_gaps": len(steady), "steady_p99_itl_error_ms": p99,
            "steady_p50_itl_error_ms": float(np.percentile(steady, 50)) if steady else None,
            "fraction_within_run": frac, "completed": sum(r.ok for r in records), "passes": ok}


def child(url: str, kind: str, n: int, per_process: int, tokens: int, itl_ms: float, cpus: list[int],
          waves: int = 1) -> list[dict]:
    from servelab.measure.client import ClientConfig, run_requests
    from servelab.measure.multiclient import run_requests_multi
    from servelab.measure.workload import build_workload
    streams = n * per_process
    wl = build_workload("cp", streams, 16, tokens, list(range(1000, 1100)), seed=1)
    cfg = ClientConfig(url, "m", engine="sglang")
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if kind == "single":
        os.sched_setaffinity(0, {cpus[0]})
    outs = []
    for _ in range(waves):
        la = os.getloadavg()[0]
        if kind == "single":
            run = run_requests(wl.requests, cfg, concurrency=streams, loop="auto")
            procs = 1
        else:
            run = run_requests_multi(wl.requests, cfg, n, concurrency=streams, loop="auto", cpus=cpus[:n])
            procs = len(run.processes)
        out = evaluate(run.records, streams, tokens, itl_ms)
        out.update(processes=procs, client_cpu_s=run.client_cpu_s, event_loop=run.event_loop,
                   start_spread_ms=(run.sizing.get("clients") or {}).get("start_spread_ms"),
                   loadavg_1m=[round(la, 2), round(os.getloadavg()[0], 2)])
        outs.append(out)
    return outs


def probe(a, url: str) -> dict:
    """One wave of ``a.probe_streams`` streams read by the bare epoll reader (``bench_client_overhead.FLOOR_CHILD``,
    no HTTP client, no event loop) on the first client core: whether the host is quiet right now — what this
    reader sees of the rule is the server's, the kernel's and the machine's own jitter, which every client
    inherits."""
    from bench_client_overhead import run_floor
    import tempfile
    tokens = max(2, round(a.point_s * 1000 / a.itl_ms))
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        r = run_floor(url, a.probe_streams, tokens, a.itl_ms, str(cpu_list(a.client_cpus)[0]), Path(tmp),
                      idle_cpu=0.0)
    steady = r["steady_itl_error_ms"]
    ok = bool(steady["n"] >= RULE["min_steady_gaps"] and steady["p99"] <= RULE["max_p99_itl_error_ms"]
              and (r["fraction_within_run"] or 0.0) >= RULE["min_fraction_within_run"])
    return {"p99_itl_error_ms": round(steady["p99"], 3), "fraction_within_run": r["fraction_within_run"],
            "quiet": ok, "at": round(time.monotonic(), 1)}


def quiet_waves(argv: list[str], a, url: str) -> tuple[list[dict], str]:
    """``a.waves`` waves, each between two probes (:func:`probe`): before a wave the probe repeats (up to
    ``a.quiet_probes`` times, ``a.probe_wait_s`` apart) until the host is quiet; a wave whose probe after it is not
    quiet ran into a jittery spell and is run again (at most ``a.waves`` extra times in the rung). Every wave is
    kept, with its probes and ``host_quiet`` (both probes quiet): the rung is decided on the quiet ones."""
    waves: list[dict] = []
    extra = a.waves
    before = None
    while sum(w["host_quiet"] for w in waves) < a.waves and len(waves) < a.waves + extra:
        tries = []
        if before is None or not before["quiet"]:
            for _ in range(a.quiet_probes):
                before = probe(a, url)
                tries.append(before)
                if before["quiet"]:
                    break
                time.sleep(a.probe_wait_s)
        p = subprocess.run(argv + ["--waves", "1"], capture_output=True, text=True, timeout=360)
        if p.returncode != 0:
            return waves, p.stderr[-1500:]
        w = json.loads(p.stdout.strip().splitlines()[-1])[0]
        after = probe(a, url)
        w.update(probes_before=tries or [before], probe_after=after,
                 host_quiet=bool(before and before["quiet"] and after["quiet"]))
        waves.append(w)
        before = after
    return waves, ""


def decide(waves: list[dict], streams: int) -> dict:
    """A rung from its waves: the median wave's p99 error and fraction within the run against the rule."""
    import numpy as np
    p99 = [w["steady_p99_itl_error_ms"] for w in waves if w.get("steady_p99_itl_error_ms") is not None]
    frac = [w.get("fraction_within_run", 0.0) for w in waves]
    gaps = [w.get("steady_gaps", 0) for w in waves]
    med_p99 = float(np.median(p99)) if len(p99) == len(waves) and p99 else None
    med_frac = float(np.median(frac)) if frac else 0.0
    ok = bool(med_p99 is not None and med_p99 <= RULE["max_p99_itl_error_ms"]
              and med_frac >= RULE["min_fraction_within_run"] and min(gaps) >= RULE["min_steady_gaps"])
    return {"streams": streams, "offered_chunks_per_s": waves[0].get("offered_chunks_per_s") if waves else None,
            "waves": len(waves), "waves_passing": sum(bool(w.get("passes")) for w in waves),
            "best_wave_passes": any(bool(w.get("passes")) for w in waves),
            "median_p99_itl_error_ms": med_p99, "p99_itl_error_ms_min_max": [min(p99), max(p99)] if p99 else None,
            "median_fraction_within_run": med_frac, "fraction_within_run_min_max": [min(frac), max(frac)],
            "passes": ok}


def ladder_run(name: str, n: int, ladder: list[int], a, url: str, servers: list) -> dict:
    """One configuration's ladder: rungs climbed until ``a.stop_after`` rungs in a row fail (the median of each
    rung's waves deciding it); the ceiling is the highest passing rung below them. A host stall can fail one rung
    the client would pass (it only ever adds error), so one failing rung does not end the ladder unless
    ``--stop-after 1``; each rung also records its best wave, the noise-free estimate of the same rule."""
    rungs, best, failed, in_a_row = [], None, None, 0
    t0 = time.monotonic()
    for per in ladder:
        s0 = server_cpu([p.pid for p in servers])
        argv = [sys.executable, __file__, "--child", url, "single" if name == "single" else "multi", str(n), str(per),
                "--itl-ms", str(a.itl_ms), "--point-s", str(a.point_s), "--client-cpus", a.client_cpus]
        if a.quiet_probes:
            waves, err = quiet_waves(argv, a, url)
        else:
            p = subprocess.run(argv + ["--waves", str(a.waves)], capture_output=True, text=True,
                               timeout=300 + 60 * a.waves)
            waves, err = (json.loads(p.stdout.strip().splitlines()[-1]), "") if p.returncode == 0 else \
                ([], p.stderr[-1500:])
        counted = [w for w in waves if w.get("host_quiet", True)] or waves
        r = decide(counted, n * per) if counted else {"streams": n * per, "passes": False, "error": err}
        r["waves_discarded_host_jitter"] = len(waves) - len(counted)
        # no wave between two quiet probes: the host never went quiet, the rung says nothing of the client
        r["undecided_host_jitter"] = bool(a.quiet_probes and waves and not any(w.get("host_quiet") for w in waves))
        r.update(per_process=per, server_cpu_s=round(server_cpu([p.pid for p in servers]) - s0, 2),
                 wave_results=waves)
        rungs.append(r)
        print(name, per, {k: r.get(k) for k in ("streams", "median_p99_itl_error_ms", "p99_itl_error_ms_min_max",
                                                 "median_fraction_within_run", "waves_passing", "passes", "error")},
              flush=True)
        if not r["passes"] and r["undecided_host_jitter"]:
            continue                        # neither a pass nor a fail: the next rung goes on
        if not r["passes"]:
            failed = failed or r
            in_a_row += 1
            if in_a_row >= a.stop_after:
                break
            continue
        best, failed, in_a_row = r, None, 0
    return {"processes": n, "ceiling_streams": best["streams"] if best else None,
            "ceiling_chunks_per_s": best["offered_chunks_per_s"] if best else None,
            "first_rung_failed": not rungs[0]["passes"], "capped_by_ladder": failed is None,
            "first_failing_streams": failed["streams"] if failed else None,
            "rungs_failed_below_ceiling": [r["streams"] for r in rungs if not r["passes"] and best
                                           and r["streams"] < best["streams"]],
            "elapsed_s": round(time.monotonic() - t0, 1), "rungs": rungs}


def summarise(repeats: list[dict]) -> tuple[dict, dict]:
    """Per configuration: ceilings of every repeat, median and spread; ratios to ``single`` per repeat."""
    import numpy as np
    summary, ratios = {}, {}
    for name in repeats[0]:
        ceil = [r[name]["ceiling_chunks_per_s"] for r in repeats]
        got = [c for c in ceil if c is not None]
        med = float(np.median(got)) if got else None
        summary[name] = {"processes": repeats[0][name]["processes"], "ceilings_chunks_per_s": ceil,
                         "first_rung_failed": [r[name]["first_rung_failed"] for r in repeats],
                         "capped_by_ladder": [r[name]["capped_by_ladder"] for r in repeats],
                         "median_chunks_per_s": med,
                         "spread_over_median": round((max(got) - min(got)) / med, 3) if med else None,
                         "repeats_agree_within_15pct": bool(med and len(got) == len(ceil)
                                                            and (max(got) - min(got)) / med <= 0.15)}
        per = [r[name]["ceiling_chunks_per_s"] / r["single"]["ceiling_chunks_per_s"] for r in repeats
               if r[name]["ceiling_chunks_per_s"] and r["single"]["ceiling_chunks_per_s"]]
        n = repeats[0][name]["processes"]
        ratios[name] = {"per_repeat": [round(x, 2) for x in per], "median": round(float(np.median(per)), 2) if per
                        else None, "min": round(min(per), 2) if per else None, "max": round(max(per), 2) if per
                        else None, "median_over_n": round(float(np.median(per)) / n, 2) if per else None}
    return summary, ratios


def server_cpu(pids: list[int]) -> float:
    tot = 0.0
    for p in pids:
        f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        tot += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return tot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--processes", default="1,2,4,8")
    ap.add_argument("--ladder", default="384,512,640,768,896,1024", help="streams per process, climbed until a fail")
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--point-s", type=float, default=2.0, help="seconds of paced chunks per point")
    ap.add_argument("--client-cpus", default="0-7")
    ap.add_argument("--server-cpus", default="8-15")
    ap.add_argument("--spin-ms", type=float, default=1.0, help="the servers' spin before each due chunk (0 on a "
                                                                "shared machine)")
    ap.add_argument("--waves", type=int, default=3, help="waves per rung; the median decides it")
    ap.add_argument("--repeats", type=int, default=3, help="times the whole ladder runs (every configuration)")
    ap.add_argument("--stop-after", type=int, default=2, help="failing rungs in a row that end a ladder")
    ap.add_argument("--quiet-probes", type=int, default=0,
                    help="probe the host (bare epoll reader) before and after each wave, up to this many times "
                         "before it, and decide a rung on the waves between two quiet probes; 0: no probes")
    ap.add_argument("--probe-streams", type=int, default=128, help="streams of a probe")
    ap.add_argument("--probe-wait-s", type=float, default=2.0, help="pause after a probe that was not quiet")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         f"client_processes_{time.strftime('%Y%m%d')}.json"))
    a = ap.parse_args()
    tokens = max(2, round(a.point_s * 1000 / a.itl_ms))
    if a.child:
        url, kind, n, per = a.child[0], a.child[1], int(a.child[2]), int(a.child[3])
        print(json.dumps(child(url, kind, n, per, tokens, a.itl_ms, cpu_list(a.client_cpus), a.waves)))
        return 0
    import resource
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # a timeout stops the servers too (finally below)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from servelab.deploy.hosts import free_port
    from servelab.deploy.server import http_json
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, str(PACED), str(port), str(a.itl_ms),
                                 "--spin-ms", str(a.spin_ms), "--reuse-port"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for c in cpu_list(a.server_cpus)]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(["python", *sys.argv]), "label": a.label, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "nproc": os.cpu_count(), "machine": {"python": platform.python_version(), "platform": platform.platform()},
           "rule": RULE, "itl_ms": a.itl_ms, "tokens_per_stream": tokens, "client_cpus": a.client_cpus,
           "server_cpus": a.server_cpus, "servers": len(servers), "waves_per_rung": a.waves,
           "stop_after_failing_rungs": a.stop_after, "quiet_probes": a.quiet_probes,
           "probe_streams": a.probe_streams,
           "ladder_per_process": a.ladder}
    try:
        for _ in range(200):
            if http_json(url + "/health", timeout=1)[0] == 200:
                break
            time.sleep(0.05)
        ladder = [int(x) for x in a.ladder.split(",")]
        configs = [("single", 1)] + [(f"processes_{n}", n) for n in (int(x) for x in a.processes.split(","))]
        doc["repeats"] = []
        for _ in range(a.repeats):
            doc["repeats"].append({})
            for name, n in configs:
                doc["repeats"][-1][name] = ladder_run(name, n, ladder, a, url, servers)
                out.write_text(json.dumps(doc, indent=1) + "\n")
        doc["summary"], doc["ratio_to_single"] = summarise(doc["repeats"])
        out.write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            try:
                s.wait(10)
            except subprocess.TimeoutExpired:
                s.kill()
    print("summary", {k: (v["ceilings_chunks_per_s"], v["spread_over_median"]) for k, v in doc.get("summary", {}).items()})
    print("ratios", doc.get("ratio_to_single"))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
