"""Ray against Dask distributed, the two existing engines servelab could hand per-rank trace work to — measured
on this machine, each in a fresh process, one command, one JSON:

    .venv/bin/python benchmarks/bench_cluster_engines.py [--workers 2] [--tasks 2000]
                                                         [--out benchmarks/results/cluster_engines_DATE.json]

Per engine (both on loopback, one worker process per CPU slot, nothing else running):

- ``start_s``: from nothing to a client that sees every worker ready — Dask: ``dask scheduler`` + ``--workers``
  ``dask worker`` processes (each with its nanny, one thread); Ray: ``ray start --head`` with ``--workers`` CPUs,
  then ``ray.init(address=...)`` and one task per worker (Ray starts its worker processes lazily);
- ``roundtrip_us``: one no-op task submitted and its result awaited, median of 200 in a row;
- ``bulk_us_per_task``: ``--tasks`` no-op tasks submitted at once, wall / tasks;
- ``idle_mb``: resident memory (RSS, psutil) of every process the engine started, after the tasks, idle 2 s —
  split into the control processes (scheduler; GCS, raylet, agents) and each worker (Dask: worker + its nanny;
  Ray: one ``ray::IDLE`` worker process);
- ``pinned``: a task pinned to one named worker/node runs there (Dask ``workers=[addr], allow_other_workers=False``
  and a worker resource; Ray ``NodeAffinitySchedulingStrategy(node_id, soft=False)``): checked, not assumed;
- ``install_mb``: the installed size of the engine's own packages in this environment.

Every process an engine starts is stopped at the end (Dask: its process groups; Ray: ``ray stop --force``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pids: list[int]) -> float:
    import psutil
    total = 0
    for p in pids:
        try:
            total += psutil.Process(p).memory_info().rss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


def _tree(pid: int) -> list[int]:
    import psutil
    try:
        p = psutil.Process(pid)
        return [p.pid, *[c.pid for c in p.children(recursive=True)]]
    except psutil.Error:
        return []


def _site_mb(*names: str) -> float:
    import importlib.util
    total = 0
    for n in names:
        spec = importlib.util.find_spec(n)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root, _, files in os.walk(list(spec.submodule_search_locations)[0]):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return round(total / 2**20, 1)


def noop(x=None):
    return x


def where_dask():
    from distributed import get_worker
    return get_worker().address


def bench_dask(workers: int, tasks: int) -> dict:
    from distributed import Client
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    procs = []
    t0 = time.perf_counter()
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", str(port), "--dashboard-address", ":0", "--no-show"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                      env=env))
        for i in range(workers):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", addr, "--host",
                                           "127.0.0.1", "--nthreads", "1", "--name", f"w{i}", "--resources",
                                           f"node-{i}=1", "--dashboard-address", ":0", "--no-dashboard"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True, env=env))
        client = Client(addr, timeout=60)
        client.wait_for_workers(workers, timeout=60)
        start_s = time.perf_counter() - t0
        rt = []
        for i in range(200):
            s = time.perf_counter()
            client.submit(noop, i, pure=False).result()
            rt.append(time.perf_counter() - s)
        s = time.perf_counter()
        client.gather(client.map(noop, range(tasks), pure=False))
        bulk = (time.perf_counter() - s) / tasks
        info = client.scheduler_info()["workers"]
        names = {w["name"]: a for a, w in info.items()}
        target = names["w1" if workers > 1 else "w0"]
        ran_at = client.submit(where_dask, workers=[target], allow_other_workers=False, pure=False).result()
        ran_res = client.submit(where_dask, resources={f"node-{workers - 1}": 1}, pure=False).result()
        time.sleep(2)
        sched = _tree(procs[0].pid)
        per_worker = [_rss_mb(_tree(p.pid)) for p in procs[1:]]
        client.close()
        return {"start_s": round(start_s, 3), "roundtrip_us": round(statistics.median(rt) * 1e6, 1),
                "roundtrip_p90_us": round(sorted(rt)[int(0.9 * len(rt))] * 1e6, 1),
                "bulk_us_per_task": round(bulk * 1e6, 1), "tasks": tasks,
                "idle_mb": {"control": _rss_mb(sched), "per_worker": per_worker,
                            "total": round(_rss_mb(sched) + sum(per_worker), 1)},
                "pinned": {"by_address": ran_at == target, "by_resource": ran_res == names[f"w{workers - 1}"]},
                "pin_api": "client.submit(fn, workers=[address], allow_other_workers=False) or "
                           "resources={'node-X': 1} offered by that node's workers (--resources)",
                "install_mb": _site_mb("dask", "distributed", "tornado", "zict", "tblib", "partd", "locket"),
                "versions": {"dask": __import__("dask").__version__,
                             "distributed": __import__("distributed").__version__}}
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _is_ray(p, tmp: Path) -> bool:
    cmd = " ".join(p.info["cmdline"] or [])
    return (p.info["name"] or "") in ("gcs_server", "raylet") or "ray::" in cmd or \
        (p.info["name"] or "").startswith("ray::") or str(tmp) in cmd


def bench_ray(workers: int, tasks: int) -> dict:
    import psutil
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"rb{os.getpid()}"     # Ray's socket paths must stay short
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    before = {p.pid for p in psutil.process_iter()}
    t0 = time.perf_counter()
    try:
        subprocess.run([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                        "--num-cpus", str(workers), "--include-dashboard", "false", "--disable-usage-stats",
                        "--temp-dir", str(tmp)], check=True, capture_output=True, env=env, timeout=120)

        @ray.remote(num_cpus=1)
        def rnoop(x=None):
            return x

        @ray.remote(num_cpus=1)
        def rwhere():
            return ray.get_runtime_context().get_node_id()

        ray.init(address=f"127.0.0.1:{port}", logging_level="ERROR", log_to_driver=False)
        ray.get([rnoop.remote(i) for i in range(workers)])
        start_s = time.perf_counter() - t0
        rt = []
        for i in range(200):
            s = time.perf_counter()
            ray.get(rnoop.remote(i))
            rt.append(time.perf_counter() - s)
        s = time.perf_counter()
        ray.get([rnoop.remote(i) for i in range(tasks)])
        bulk = (time.perf_counter() - s) / tasks
        node = ray.nodes()[0]["NodeID"]
        ran = ray.get(rwhere.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote())
        time.sleep(2)
        me = os.getpid()
        started = [p for p in psutil.process_iter(["pid", "name", "cmdline"])      # Ray's own processes only
                   if p.pid not in before and p.pid != me and _is_ray(p, tmp)]
        wk = [p for p in started if "ray::" in " ".join(p.info["cmdline"] or []) or
              (p.info["name"] or "").startswith("ray::")]
        ctl = [p for p in started if p not in wk]
        per_worker = [_rss_mb([p.pid]) for p in wk]
        doc = {"start_s": round(start_s, 3), "roundtrip_us": round(statistics.median(rt) * 1e6, 1),
               "roundtrip_p90_us": round(sorted(rt)[int(0.9 * len(rt))] * 1e6, 1),
               "bulk_us_per_task": round(bulk * 1e6, 1), "tasks": tasks,
               "idle_mb": {"control": _rss_mb([p.pid for p in ctl]), "per_worker": per_worker,
                           "control_processes": sorted({(p.info["name"] or "?") for p in ctl}),
                           "total": round(_rss_mb([p.pid for p in ctl]) + sum(per_worker), 1)},
               "pinned": {"by_node_id": ran == node},
               "pin_api": "fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)) or a "
                          "custom resource per node (ray start --resources)",
               "install_mb": _site_mb("ray"), "versions": {"ray": ray.__version__}}
        ray.shutdown()
        return doc
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, env=env, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["dask", "ray"], help="(internal) measure one engine in this process")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--label", default="", help="where it ran, e.g. vm-2cores")
    ap.add_argument("--engines", default="dask,ray", help="which to measure (a machine without Ray: dask)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         f"cluster_engines_{time.strftime('%Y%m%d')}.json"))
    a = ap.parse_args()
    if a.engine:
        fn = bench_dask if a.engine == "dask" else bench_ray
        print(json.dumps(fn(a.workers, a.tasks)))
        return 0
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "label": a.label,
           "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                                    "platform": platform.platform()},
           "workers": a.workers, "results": {}}
    for engine in a.engines.split(","):
        la = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--engine", engine, "--workers", str(a.workers), "--tasks",
                            str(a.tasks)], capture_output=True, text=True, timeout=900)
        res = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-2000:]}
        res["process_s"] = round(time.perf_counter() - t0, 2)
        res["loadavg_1m"] = [round(la, 2), round(os.getloadavg()[0], 2)]
        doc["results"][engine] = res
        print(engine, json.dumps(res), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
