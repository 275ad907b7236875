"""Load + analysis time and peak memory: servelab.analyse.trace vs Holistic Trace Analysis, same traces, same run.

    .venv/bin/python benchmarks/bench_trace_vs_hta.py [--out FILE] [--big-mb 100] [--hta-big] [--skip-big]

Datasets (each tool runs in a fresh subprocess per dataset, so imports, caches and memory do not leak):

- ``h200x2``: our 2 × H200 TP=2 capture (``$SERVELAB_SHARED/data/h200x2-20261129/traces``, 2 ranks, ~32k events each);
- ``hta_nccl_data``: HTA's own A100 DDP trace (rank 0, 40.6k events, NCCL args);
- ``sglang_prefill``: TraceLens' SGLang MI300X prefill trace (60k events, 53k python_function);
- ``h200x2_x20``: the H200 pair with every rank's events replicated 20× in time (~630k events per rank);
- ``h200_100mb``: one H200 rank replicated until its gzip is ~``--big-mb`` MB (≈ 6 M events, ~1.7 GB JSON) —
  servelab only unless ``--hta-big`` (HTA needs minutes and many GB there).

Synthetic traces are written to a temporary folder at bench time (Kineto layout: one event per block, ids
and timestamps shifted per replica so correlations stay unique) and deleted afterwards.

What runs: servelab ``analyse()`` (parse every rank, all Phase 3 tables, the ten questions and the
evidence → action table), cold (no cache) and warm (Parquet cache hit); HTA ``TraceAnalysis(trace_dir)``
followed by ``get_temporal_breakdown``, ``get_comm_comp_overlap``, ``get_gpu_kernel_breakdown`` and
``get_idle_time_breakdown``. Peak memory is ru_maxrss of the worker process plus the largest of its
children (both tools parse with child processes). Results go to JSON (``--out``) and a printed table.
"""
from __future__ import annotations

import argparse
import gzip
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

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SERVELAB_SHARED", ROOT.parent / "shared")) / "data"


# ------------------------------------------------------------------------------------------- workers

def _peak_mb() -> dict[str, float]:
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"peak_self_mb": self_kb / 1024, "peak_children_mb": child_kb / 1024,
            "peak_mb": (self_kb + child_kb) / 1024}


def worker_ours(trace_dir: str, cache_dir: str) -> dict:
    t0 = time.perf_counter()
    from servelab.analyse.trace import analyse, evidence_actions, ten_questions
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    a = analyse(trace_dir, cache=bool(cache_dir), cache_dir=cache_dir or None)
    q = ten_questions(a)
    act = evidence_actions(a)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "import_s": t_import, "load_s": a.timings_s.get("load"),
            "analysis_s": wall - a.timings_s.get("load", 0.0),
            "events": int(sum(t.events.height for t in a.capture.ranks)),
            "ranks": len(a.rops), "from_cache": all(t.from_cache for t in a.capture.ranks),
            "answered": int(q["answerable"].sum()), "actions": act.height, **_peak_mb()}


def worker_hta(trace_dir: str) -> dict:
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    ta = TraceAnalysis(trace_dir=trace_dir)
    t_load = time.perf_counter() - t0
    ta.get_temporal_breakdown(visualize=False)
    ta.get_comm_comp_overlap(visualize=False)
    ta.get_gpu_kernel_breakdown(visualize=False)
    ta.get_idle_time_breakdown(visualize=False)
    wall = time.perf_counter() - t0
    events = int(sum(len(df) for df in getattr(ta.t, "traces", {}).values()))
    return {"wall_s": wall, "import_s": t_import, "load_s": t_load, "analysis_s": wall - t_load, "events": events,
            "ranks": len(getattr(ta.t, "traces", {})), **_peak_mb()}


# -------------------------------------------------------------------------------------- synthetic data

def shifted_event(e: dict, shift_us: float, id_offset: int) -> dict:
    """One real event of a copy of the body: timestamps shifted by ``shift_us``, correlation / External id / flow
    ids offset by ``id_offset`` so every copy keeps its own links (the content stays real)."""
    e2 = dict(e)
    if isinstance(e2.get("ts"), (int, float)) and isinstance(e2.get("pid"), int):
        e2["ts"] = round(e2["ts"] + shift_us, 3)
    a = e2.get("args")
    if isinstance(a, dict) and ("correlation" in a or "External id" in a):
        a = dict(a)
        for k in ("correlation", "External id"):
            if isinstance(a.get(k), int):
                a[k] += id_offset
        e2["args"] = a
    if isinstance(e2.get("id"), int):
        e2["id"] += id_offset
    return e2


def replicate_trace(src: Path, dst: Path, copies: int, level: int = 6) -> dict:
    """Write ``src``'s events ``copies`` times, shifted in time by the trace span per copy, with
    correlation / External id / flow ids offset so links stay unique; Kineto-like layout."""
    import msgspec
    doc = json.loads(gzip.decompress(src.read_bytes()))
    ev = doc["traceEvents"]
    ts = [e["ts"] for e in ev if isinstance(e.get("ts"), (int, float)) and isinstance(e.get("pid"), int)]
    span = max(ts) - min(ts) + 1000.0
    meta = [e for e in ev if e.get("ph") == "M"]
    body = [e for e in ev if e.get("ph") != "M"]
    enc = msgspec.json.Encoder()
    head = {k: v for k, v in doc.items() if k != "traceEvents"}

    def block(e: dict) -> bytes:
        return b"  {\n    " + enc.encode(e)[1:-1] + b"\n  }"

    n_events = len(meta)
    with gzip.open(dst, "wb", compresslevel=level) as f:
        f.write(json.dumps(head, indent=2)[:-2].encode() + b',\n  "traceEvents": [\n')
        f.write(b",\n".join(block(e) for e in meta))
        for i in range(copies):
            shift, off = i * span, i * 10_000_000
            out = []
            for e in body:
                out.append(block(shifted_event(e, shift, off)))
            n_events += len(out)
            f.write(b",\n" + b",\n".join(out))
        f.write(b"\n  ]\n}\n")
    return {"events": n_events, "gz_mb": dst.stat().st_size / 2**20}


def copies_for_gz_mb(src: Path, target_mb: float, probe_copies: int = 4) -> int:
    with tempfile.TemporaryDirectory() as d:
        probe = replicate_trace(src, Path(d) / "probe.json.gz", probe_copies)
    return max(1, round(target_mb / (probe["gz_mb"] / probe_copies)))


# ---------------------------------------------------------------------------------------------- driver

def run_worker(tool: str, trace_dir: Path, cache_dir: Path | None = None, timeout: int = 3600) -> dict:
    argv = [sys.executable, __file__, "--worker", tool, str(trace_dir)]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-2000:], "process_s": time.perf_counter() - t0}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(line)
    res["process_s"] = time.perf_counter() - t0
    return res


def datasets(work: Path, big_mb: float, skip_big: bool, only: set[str] | None = None) -> list[dict]:
    def want(name: str) -> bool:
        return not only or name in only

    h200 = SHARED / "h200x2-20261129" / "traces"
    tp = sorted(h200.glob("*.trace.json.gz"))
    out = [{"name": "h200x2", "dir": h200, "note": "2 ranks, real"}] if want("h200x2") else []
    for name, rel in (("hta_nccl_data", "thirdparty/hta/nccl_parser_config"),
                      ("sglang_prefill", "thirdparty/tracelens/sglang_prefilldecode")):
        if (SHARED / rel).is_dir() and want(name):
            out.append({"name": name, "dir": SHARED / rel, "note": "1 rank, real"})
    if want("h200x2_x20"):
        out += _x20(work, tp)
    if not skip_big and want("h200_100mb"):
        out += _big(work, tp, big_mb)
    return out


def _x20(work: Path, tp: list[Path]) -> list[dict]:
    x20 = work / "h200x2_x20"
    x20.mkdir(parents=True, exist_ok=True)
    info = [replicate_trace(p, x20 / p.name, 20) for p in tp]
    return [{"name": "h200x2_x20", "dir": x20, "note": f"2 ranks × {info[0]['events']:,} events, "
             f"{sum(i['gz_mb'] for i in info):.1f} MB gz total, synthetic"}]


def _big(work: Path, tp: list[Path], big_mb: float) -> list[dict]:
    big = work / "h200_100mb"
    big.mkdir(parents=True, exist_ok=True)
    n = copies_for_gz_mb(tp[0], big_mb)
    t0 = time.perf_counter()
    bi = replicate_trace(tp[0], big / tp[0].name, n)
    return [{"name": "h200_100mb", "dir": big, "big": True,
             "note": f"1 rank, {n} copies, {bi['events']:,} events, {bi['gz_mb']:.1f} MB gz, synthetic "
                     f"(generated in {time.perf_counter() - t0:.0f} s)", "gz_mb": bi["gz_mb"], "events": bi["events"]}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["ours", "hta"])
    ap.add_argument("trace_dir", nargs="?")
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench" / "bench_trace_vs_hta.json"))
    ap.add_argument("--big-mb", type=float, default=100.0, help="gzip size of the synthetic big rank (MB)")
    ap.add_argument("--hta-big", action="store_true", help="also run HTA on the big synthetic rank")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--work-dir", default="", help="where synthetic traces go (default: a temporary folder)")
    ap.add_argument("--only", default="", help="comma-separated dataset names to run (default: all)")
    args = ap.parse_args()
    if args.worker == "ours":
        print(json.dumps(worker_ours(args.trace_dir, args.cache_dir)))
        return 0
    if args.worker == "hta":
        print(json.dumps(worker_hta(args.trace_dir)))
        return 0

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench-trace-"))
    results = []
    try:
        only = {s for s in args.only.split(",") if s}
        for ds in datasets(work, args.big_mb, args.skip_big, only):
            cache = work / f"cache-{ds['name']}"
            row = {"dataset": ds["name"], "note": ds["note"]}
            row["ours_cold"] = run_worker("ours", ds["dir"])
            row["ours_cold_cache_fill"] = run_worker("ours", ds["dir"], cache)      # parses and writes Parquet
            row["ours_warm"] = run_worker("ours", ds["dir"], cache)                 # reads the Parquet cache
            if not ds.get("big") or args.hta_big:
                row["hta"] = run_worker("hta", ds["dir"])
            if "hta" in row and "wall_s" in row["hta"] and "wall_s" in row["ours_cold"]:
                row["speedup_cold"] = row["hta"]["wall_s"] / row["ours_cold"]["wall_s"]
                row["speedup_warm"] = row["hta"]["wall_s"] / row["ours_warm"]["wall_s"]
                row["memory_ratio"] = row["hta"]["peak_mb"] / row["ours_cold"]["peak_mb"]
            results.append(row)
            _print_row(row)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    doc = {"benchmark": "servelab.analyse.trace vs HolisticTraceAnalysis", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
                    "loadavg_at_end": os.getloadavg()},
           "versions": _versions(), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nwritten {out}")
    return 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    v = {}
    for pkg in ("HolisticTraceAnalysis", "pandas", "polars", "msgspec", "isal", "pyarrow", "numpy"):
        try:
            v[pkg] = version(pkg)
        except PackageNotFoundError:
            v[pkg] = None
    return v


def _print_row(row: dict) -> None:
    def cell(r: dict | None) -> str:
        if not r:
            return "-"
        if "error" in r:
            return "ERROR: " + r["error"].strip().splitlines()[-1][:80]
        return f"{r['wall_s']:7.2f} s  {r['peak_mb']:7.0f} MB"
    print(f"\n{row['dataset']}: {row['note']}")
    print(f"  servelab cold  {cell(row.get('ours_cold'))}")
    print(f"  servelab warm  {cell(row.get('ours_warm'))}   (Parquet cache)")
    print(f"  HTA            {cell(row.get('hta'))}")
    if "speedup_cold" in row:
        print(f"  HTA / servelab: {row['speedup_cold']:.1f}× time cold, {row['speedup_warm']:.1f}× warm, "
              f"{row['memory_ratio']:.1f}× peak memory")


if __name__ == "__main__":
    sys.exit(main())
