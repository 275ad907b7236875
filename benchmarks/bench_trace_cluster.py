"""Phase 3 of a many-rank capture on a Dask cluster against the single-process streaming path, same run, one JSON:

    .venv/bin/python benchmarks/bench_trace_cluster.py [--ranks 64] [--rank-mb 4] [--workers 1,4,8]
                                                      [--one-core-per-worker] [--no-local]
                                                      [--out benchmarks/results/trace_cluster_DATE.json]

The capture is synthesised in a temporary folder (deleted afterwards) from our real 2 × H200 TP=2 ranks
(``data/samples/h200x2/traces``) as ``bench_trace_scale.py`` does: each real rank's events replicated in time
until its gzip is ``--rank-mb``, then ``--ranks`` ranks made by prefixing a re-ranked, clock-shifted header to one
of the two real bodies (content real, re-ranked and shifted).

Each configuration runs in a fresh process, cold (a new, empty cache folder: every rank parsed, its Parquet cache
and prepared tables written), and computes every table of Phase 3 plus the ten questions:

- ``local``: ``analyse(folder, keep_events=False)`` — the single-process streaming path (ranks parsed one after
  another, each over the loader's own pool of parse processes: one per usable core, each child one thread);
- ``cluster_<N>``: a Dask cluster of N workers on this machine (``deploy.cluster``, ``local:N``), each with its
  share of the cores (cores // N threads for its libraries, and as many parse processes; ``worker_threads`` is
  what the workers' pools really had), then ``analyse_on_cluster``: each rank parsed and reduced by one worker,
  the cross-rank steps in the controller. ``start_s`` is the cluster's start (scheduler + workers ready),
  ``wall_s`` the analysis alone, ``wall_with_start_s`` both.

``--one-core-per-worker`` measures scale-out instead: the N workers pinned to N cores of their own (the machine's
second to N+1-th; every core at N = cores), so each sees one core (one library thread, parsing single-threaded) and
1 worker is one core; the controller moves to the first core once they started. ``--no-local`` skips ``local``.

Figures: ``speedup_vs_local``, ``fraction_of_linear_vs_1_worker`` (wall of 1 worker / wall of N / N; the aim is
≥ 0.8 at 8 workers, ≥ 0.6 at 16), ``cluster_1_over_local`` (aim ≤ 1.15) and ``wall_with_start_over_local``.

Memory: peak RSS of the controller (ru_maxrss) and of each worker process (its own ru_maxrss, asked over Dask at the
end), and for ``local`` the controller plus its largest parse child. Wall and the load average beside every run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "lib"))
from bench_trace_scale import copies_for, make_rank, write_rank_body  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "data" / "samples" / "h200x2" / "traces"


def _mb(kb: float) -> float:
    return round(kb / 1024, 1)


def worker_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def worker_threads() -> dict:
    """On a worker: the thread pools its libraries actually have (polars, Arrow) and its share."""
    import polars as pl
    import pyarrow as pa
    return {"polars": pl.thread_pool_size(), "arrow": pa.cpu_count(), "share": os.environ.get("SERVELAB_THREADS")}


def run_local(folder: str, cache: str) -> dict:
    from servelab.analyse.trace import analyse, ten_questions
    t0 = time.perf_counter()
    a = analyse(folder, cache=True, cache_dir=cache, keep_events=False)
    q = ten_questions(a)
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "timings_s": {k: round(v, 2) for k, v in a.timings_s.items()},
            "controller_cpu_s": {k: round(v, 2) for k, v in a.cpu_s.items()},
            "ranks": len(a.rops), "events": int(a.ranks["events"].sum()), "answered": int(q["answerable"].sum()),
            "peak_controller_mb": _mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
            "peak_largest_child_mb": _mb(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)}


def run_cluster(folder: str, cache: str, workers: int, logs: str, pinned: bool = False) -> dict:
    from servelab.analyse.trace import ten_questions
    from servelab.analyse.trace.cluster import analyse_on_cluster
    from servelab.deploy.cluster import open_cluster
    from servelab.deploy.hosts import ProcessTracker
    cores = sorted(os.sched_getaffinity(0))
    if pinned:      # N workers on N cores of their own (each one core: nproc there is N), the controller on another
        os.sched_setaffinity(0, set(cores[1:workers + 1] if workers < len(cores) else cores))
    with ProcessTracker() as tracker:
        t0 = time.perf_counter()
        c = open_cluster(f"local:{workers}", tracker, logs)
        start = time.perf_counter() - t0
        if pinned and workers < len(cores):
            os.sched_setaffinity(0, {cores[0]})
        try:
            t0 = time.perf_counter()
            a = analyse_on_cluster(c, folder, cache_dir=cache)
            q = ten_questions(a)
            wall = time.perf_counter() - t0
            peaks = sorted(_mb(v) for v in c.client.run(worker_peak).values())
            pools = list(c.client.run(worker_threads).values())
        finally:
            c.close()
    per = a.placement["reduce_s"].drop_nulls()
    return {"start_s": round(start, 2), "wall_s": round(wall, 2), "wall_with_start_s": round(start + wall, 2),
            "worker_threads": pools[0] if all(p == pools[0] for p in pools) else pools,
            "timings_s": {k: round(v, 2) for k, v in a.timings_s.items()}, "ranks": len(a.rops),
            "controller_cpu_s": {k: round(v, 2) for k, v in a.cpu_s.items()},
            "missing": int((a.placement["status"] == "missing").sum()), "events": int(a.ranks["events"].sum()),
            "answered": int(q["answerable"].sum()), "reduce_s_per_rank": {"median": round(float(per.median()), 2),
                                                                           "max": round(float(per.max()), 2)},
            "peak_controller_mb": _mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
            "peak_worker_mb": {"max": peaks[-1], "median": peaks[len(peaks) // 2], "all": peaks}}


def measure(kind: str, *args: str) -> dict:
    la = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "lib"), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--run", kind, *args], capture_output=True, text=True, env=env,
                       timeout=3600)
    res = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": (p.stderr or p.stdout)[-3000:]}
    res.update(process_s=round(time.perf_counter() - t0, 2), loadavg_1m=[round(la, 2), round(os.getloadavg()[0], 2)])
    print(f"  {kind:8s} {(args[2] if len(args) > 2 else ''):3s} " + (f"wall {res['wall_s']:7.2f} s" if "wall_s" in res else
                                                     res["error"][-400:]) + f"  load {res['loadavg_1m']}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs="+", help="(internal) one configuration in this process")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rank-mb", type=float, default=4.0, help="gzip MB of each synthetic rank")
    ap.add_argument("--workers", default="16,8,4,2,1", help="cluster sizes, run in this order (the slowest last)")
    ap.add_argument("--one-core-per-worker", action="store_true",
                    help="scale-out: N workers pinned to N cores of their own (one core each: their thread pools "
                         "and parsing single-threaded), the controller on the first core; default: N workers share "
                         "every core (cores // N each)")
    ap.add_argument("--no-local", action="store_true", help="skip the single-process run")
    ap.add_argument("--label", default="", help="where it ran")
    ap.add_argument("--work-dir", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"trace_cluster_{time.strftime('%Y%m%d')}.json"))
    a = ap.parse_args()
    if a.run:
        kind, *rest = a.run
        res = run_local(*rest) if kind == "local" else run_cluster(rest[0], rest[1], int(rest[2]), rest[3],
                                                                   rest[4:] == ["pinned"])
        print(json.dumps(res))
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-trace-cluster-", dir=a.work_dir or None))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        from servelab.analyse.trace import _scan  # noqa: F401
        scanner = True
    except ImportError:
        scanner = False
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "label": a.label, "scanner_compiled": scanner,
           "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "nproc": os.cpu_count(),
           "machine": {"python": platform.python_version(), "platform": platform.platform()}, "runs": {}}

    def save() -> None:
        out.write_text(json.dumps(doc, indent=1) + "\n")
    try:
        src = sorted(SRC.glob("*.trace.json.gz"))
        t0 = time.perf_counter()
        n = copies_for(src[0], a.rank_mb, work)
        bodies = [write_rank_body(s, work / f"body{i}.gz", n) for i, s in enumerate(src)]
        cap = work / "capture"
        cap.mkdir()
        stem = src[0].name.split("-TP-")[0]
        for k in range(a.ranks):
            make_rank(bodies[k % 2]["header"], work / f"body{k % 2}.gz", cap / f"{stem}-TP-{k}.trace.json.gz",
                      k, a.ranks, k * 37_000)
        doc["capture"] = {"ranks": a.ranks, "replicas_per_rank": n,
                          "gz_mb": round(sum(p.stat().st_size for p in cap.iterdir()) / 2**20, 1),
                          "json_mb": round(sum(bodies[k % 2]["json_mb"] for k in range(a.ranks)), 1),
                          "events": sum(bodies[k % 2]["events"] for k in range(a.ranks)),
                          "synth_s": round(time.perf_counter() - t0, 1)}
        print("capture", doc["capture"], flush=True)
        save()
        doc["workers_cores"] = ("one core each, pinned; the controller on its own core" if a.one_core_per_worker
                                else "every core shared, cores // N each")
        if not a.no_local:
            doc["runs"]["local"] = measure("local", str(cap), str(work / "cache-local"))
            save()
        for w in [int(x) for x in a.workers.split(",") if x]:
            doc["runs"][f"cluster_{w}"] = measure("cluster", str(cap), str(work / f"cache-{w}"), str(w),
                                                  str(work / f"logs-{w}"), *(["pinned"] if a.one_core_per_worker
                                                                             else []))
            save()
        base = doc["runs"].get("local", {}).get("wall_s")
        doc["speedup_vs_local"] = {k: round(base / r["wall_s"], 2) for k, r in doc["runs"].items()
                                   if base and r.get("wall_s")}
        one = doc["runs"].get("cluster_1", {}).get("wall_s")
        # the targets: N workers against 1 worker, as a fraction of linear (N×); 1 worker against local
        doc["fraction_of_linear_vs_1_worker"] = {k: round(one / r["wall_s"] / int(k.split("_")[1]), 2)
                                                 for k, r in doc["runs"].items()
                                                 if one and k.startswith("cluster_") and r.get("wall_s")}
        doc["cluster_1_over_local"] = round(one / base, 2) if one and base else None
        doc["wall_with_start_over_local"] = {k: round(r["wall_with_start_s"] / base, 2) for k, r in doc["runs"].items()
                                             if base and r.get("wall_with_start_s")}
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
