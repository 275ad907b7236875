"""Soak: does the client leak over a long Phase 1-style search? Memory, file descriptors, requests lost.

Target: the local tiny llama-server (``local-tiny``: 32 slots), started and stopped by servelab's tracker. For
``--duration-s`` (600 by default, the bounded 10 minutes) it runs Phase 1 search points one after another — the
concurrency ladder of ``measure.search.ladder(--step, --max-concurrency)``, climbed and then started again, each
point a real case (``measure.case.run_case``: sized to ``--point-s`` seconds, its records streamed to its case
folder; the folders are removed at the end) — at up to the highest concurrency the target takes (its slot count). Every ``--sample-s`` seconds a
thread samples this process (the client): RSS (``/proc/self/statm``) and open file descriptors
(``/proc/self/fd``). After each point, the requests the client issued (the case summary's ``integrity.sizing.issued``,
counted in the client's memory) and the records on disk (``requests.jsonl``, measure role) are compared.

Result (``--out``, JSON): the samples; per point its concurrency, issued, recorded and completed; and the verdicts
— RSS growth from the first quarter's median to the last quarter's median (MiB and %), FD growth (last − first
sample), and whether every issued request was recorded. The floor to compare with is the first quarter itself:
a client that does not leak has the same RSS and FDs at the end as after its warm-up.

    python benchmarks/bench_soak.py --duration-s 600 --out benchmarks/results/soak_<date>.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from servelab.deploy.hosts import ProcessTracker
from servelab.deploy.server import start_server, stop_server
from servelab.deploy.targets import load_target
from servelab.measure import case as cs
from servelab.measure.records import read_records
from servelab.measure.search import ladder

PAGE = os.sysconf("SC_PAGE_SIZE")


def sample() -> dict:
    rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {"t_s": time.monotonic(), "rss_mib": rss_pages * PAGE / 2**20, "fds": len(os.listdir("/proc/self/fd"))}


def sampler(out: list, stop: threading.Event, every_s: float) -> None:
    while not stop.is_set():
        out.append(sample())
        stop.wait(every_s)


def quarter_medians(values: list[float]) -> tuple[float, float]:
    q = max(1, len(values) // 4)
    return statistics.median(values[:q]), statistics.median(values[-q:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--point-s", type=float, default=10.0)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--step", type=int, default=8)
    ap.add_argument("--max-concurrency", type=int, default=0, help="0: the target's slot count")
    ap.add_argument("--target", default="local-tiny")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load_target(args.target)
    top = args.max_concurrency or int(target.launch.get("parallel") or 32)
    steps = ladder(args.step, top)
    work = Path(tempfile.mkdtemp(prefix="servelab-soak-"))
    samples: list[dict] = []
    points: list[dict] = []
    stop = threading.Event()
    t0 = time.monotonic()
    with ProcessTracker() as tracker:
        srv = start_server(target, work / "server", tracker, health_timeout_s=120)
        try:
            env = cs.make_env(srv, work / "run")
            th = threading.Thread(target=sampler, args=(samples, stop, args.sample_s), daemon=True)
            th.start()
            k = 0
            while time.monotonic() - t0 < args.duration_s:
                c = steps[k % len(steps)]
                k += 1
                case = cs.CaseSpec(f"S{k}_c{c}", "search", "decode", 64, 32, c, 2 * c, False,
                                   min_window_s=args.point_s / 2, min_duration_s=args.point_s)
                res = cs.run_case(env, case)
                summary = json.loads((res.case_dir / "summary.json").read_text())
                issued = ((summary.get("integrity") or {}).get("sizing") or {}).get("issued")
                recorded = len([r for r in read_records(res.case_dir / "requests.jsonl") if r.role == "measure"])
                points.append({"case": case.case_id, "concurrency": c, "issued": issued, "recorded": recorded,
                               "completed": summary["counts"].get("completed"), "status": res.status,
                               "elapsed_s": round(time.monotonic() - t0, 1)})
        finally:
            stop.set()
            stop_server(srv, tracker)
            shutil.rmtree(work, ignore_errors=True)
    rss = [s["rss_mib"] for s in samples]
    fds = [s["fds"] for s in samples]
    r0, r1 = quarter_medians(rss)
    f0, f1 = quarter_medians([float(f) for f in fds])
    result = {
        "what": "client soak: RSS, open FDs and issued vs recorded requests over a bounded Phase 1-style search",
        "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["python", "benchmarks/bench_soak.py", *sys.argv[1:]],
        "target": args.target, "duration_s": round(time.monotonic() - t0, 1), "ladder": steps,
        "highest_concurrency": top, "points": points,
        "samples": [{**s, "t_s": round(s["t_s"] - t0, 2), "rss_mib": round(s["rss_mib"], 2)} for s in samples],
        "verdict": {"rss_first_quarter_median_mib": round(r0, 2), "rss_last_quarter_median_mib": round(r1, 2),
                    "rss_growth_pct": round(100 * (r1 - r0) / r0, 2) if r0 else None,
                    "fds_first_quarter_median": f0, "fds_last_quarter_median": f1,
                    "fds_growth": f1 - f0,
                    "issued_total": sum(p["issued"] or 0 for p in points),
                    "recorded_total": sum(p["recorded"] for p in points),
                    "every_issued_request_recorded": all(p["issued"] == p["recorded"] for p in points)},
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_1m_end": os.getloadavg()[0]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    v = result["verdict"]
    print(f"{len(points)} points, {v['recorded_total']} of {v['issued_total']} issued requests recorded; RSS "
          f"{v['rss_first_quarter_median_mib']} → {v['rss_last_quarter_median_mib']} MiB; FDs {f0} → {f1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
