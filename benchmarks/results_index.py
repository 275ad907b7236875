"""The index of ``benchmarks/results/``: the latest figure of every benchmark, then every result file.

    python benchmarks/results_index.py            # rewrite benchmarks/results/README.md
    python benchmarks/results_index.py --check    # exit 1 if README.md is not what the results give

A result file is ``results/<benchmark>_<date>[_<label>].json`` as its script wrote it (``--out``); its time is the
``when`` (or ``date``) it records, else the date in its name. For each benchmark the latest result gives the
figure: the script's headline comparison, against its peer and its floor where the benchmark has them, read from
the file (nothing here is measured). ``tests/test_benchmark_results.py`` runs the check, so a result committed
without regenerating the index, or a benchmark this script does not know, fails the tests.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"
INDEX = RESULTS / "README.md"


def _f(v: Any, fmt: str = ".3g") -> str:
    """A number as ``fmt``; a list of numbers (repeats) as ``a / b / c``; ``—`` for none."""
    if v is None:
        return "—"
    if isinstance(v, (list, tuple)):
        return " / ".join(_f(x, fmt) for x in v)
    return format(v, fmt)


def _client_overhead(d: dict) -> str:
    r = max(d.get("ratios") or [{}], key=lambda x: x.get("concurrency") or 0)
    if "servelab_median_p99_itl_error_ms" not in r:
        return "no ratios recorded (a partial run: see its note)"
    out = (f"C={r.get('concurrency')}: median P99 ITL error servelab {_f(r.get('servelab_median_p99_itl_error_ms'))} ms, "
           f"floor {_f(r.get('floor_median_p99_itl_error_ms'))} ms")
    if r.get("bench_serving_median_p99_itl_error_ms") is not None:
        out += f", SGLang bench_serving {_f(r['bench_serving_median_p99_itl_error_ms'])} ms"
    return out


def _client_ceiling(d: dict) -> str:
    if isinstance(d.get("ceilings"), list):
        c = {x["client"]: x for x in d["ceilings"]}
        ours = c.get("servelab", {})
        return (f"servelab keeps up with {ours.get('ceiling_streams')} streams "
                f"({_f(ours.get('ceiling_chunks_per_s'), ',.0f')} chunks/s): "
                f"{_f(d.get('ceiling_ratio_servelab_over_floor'), '.2f')}× the floor's, "
                f"{_f(d.get('ceiling_ratio_servelab_over_bench_serving'), '.3g')}× SGLang bench_serving's")
    m = d.get("median") or (d.get("summary") or {})
    return "ceilings (chunks/s): " + ", ".join(f"{k} {_f(v, ',.0f')}" for k, v in sorted(m.items())
                                              if isinstance(v, (int, float)))


def _client_quickack(d: dict) -> str:
    on = [r for r in d.get("runs", []) if r.get("servelab_quickack") == "on"]
    off = [r for r in d.get("runs", []) if r.get("servelab_quickack") == "off"]

    def cpu(rs: list) -> str:
        v = sorted(x["ratios"][0].get("servelab_median_client_run_cpu_us_per_chunk") for x in rs if x.get("ratios"))
        return f"{_f(v[0], '.3g')}–{_f(v[-1], '.3g')}" if v else "—"
    return f"client CPU per chunk (the run): quick-ACK on {cpu(on)} µs, off {cpu(off)} µs ({len(on)} + {len(off)} runs)"


def _telemetry_overhead(d: dict) -> str:
    together = (d.get("default_set_together") or {}).get("collectors") or {}
    pct = sum(c.get("core_pct") or 0 for c in together.values())
    return (f"default set {pct:.2g} % of one core ({len(together)} collectors), "
            f"{_f(d.get('ratio_set_to_peer'), '.2g')}× sadc alone; target met: {'yes' if d.get('meets_target') else 'no'}")


def _trace_scale(d: dict) -> str:
    b = d.get("big_rank") or {}
    cold, floor = (b.get("ours_cold") or {}).get("wall_s"), (b.get("floor") or {}).get("wall_s")
    out = f"one {_f(b.get('gz_mb'), '.0f')} MB-gz rank: cold {_f(cold, '.3g')} s against a {_f(floor, '.3g')} s floor"
    cached = b.get("ours_cached_wall_s")
    if cached is not None:
        out += f", cached {_f(cached, '.2g')} s"
    cap = d.get("capture") or {}
    stream = (cap.get("ours_cold_stream") or {}).get("wall_s")
    if stream is not None:
        out += f"; {cap.get('ranks')} ranks cold {_f(stream, '.3g')} s"
    return out


def _trace_vs_hta(d: dict) -> str:
    rs = d.get("results") or []
    return "cold speed-up over HolisticTraceAnalysis: " + ", ".join(
        f"{r['dataset']} {_f(r.get('speedup_cold'), '.2g')}×" for r in rs)


def _client_processes(d: dict) -> str:
    if d.get("summary"):          # repeated ladders: each repeat's ceiling (— where its first rung failed)
        s, r = d["summary"], d.get("ratio_to_single") or {}
        return (f"ceiling (chunks/s) by client processes in {len(d.get('repeats') or [])} ladders "
                "(— first rung failed): " + "; ".join(
                    f"{k.replace('processes_', '')} {_f(v.get('ceilings_chunks_per_s'), ',.0f')} "
                    f"(median ratio to single {_f((r.get(k) or {}).get('median'), '.3g')}×)"
                    for k, v in s.items() if k != "single") + f"; single {_f(s['single'].get('ceilings_chunks_per_s'), ',.0f')}")
    c = {k: (v or {}).get("ceiling_chunks_per_s") for k, v in (d.get("configs") or {}).items()}
    r = d.get("ratio_to_single") or {}
    return "ceiling (chunks/s) by client processes: " + ", ".join(
        f"{k.replace('processes_', '')} {_f(c.get(k), ',.0f')} ({_f(r.get(k), '.3g')}× one)" for k in c)


def _cluster_engines(d: dict) -> str:
    return "; ".join(f"{eng}: start {_f(v.get('start_s'), '.2g')} s, round trip {_f(v.get('roundtrip_us'), ',.0f')} µs, "
                     f"{_f(v.get('bulk_us_per_task'), ',.0f')} µs per task in bulk"
                     for eng, v in sorted((d.get("results") or {}).items()))


def _trace_cluster(d: dict) -> str:
    cap, runs = d.get("capture") or {}, d.get("runs") or {}
    out = f"{cap.get('ranks')} ranks ({_f(cap.get('gz_mb'), '.0f')} MB gz)"
    if str(d.get("workers_cores", "")).startswith("one core"):
        out += ", one core per worker"
    if "local" in runs:
        out += f": local {_f(runs['local'].get('wall_s'), '.3g')} s"
    for k, v in sorted(((k, v) for k, v in runs.items() if k.startswith("cluster_")),
                       key=lambda kv: int(kv[0].removeprefix("cluster_"))):
        out += f", Dask cluster of {k.removeprefix('cluster_')} {_f(v.get('wall_s'), '.3g')} s"
        lin = (d.get("fraction_of_linear_vs_1_worker") or {}).get(k)
        if lin is not None and k != "cluster_1":
            out += f" ({_f(lin, '.2f')}× linear)"
    return out


def _soak(d: dict) -> str:
    v = d.get("verdict") or {}
    return (f"{_f(d.get('duration_s'), '.0f')} s up to C={d.get('highest_concurrency')}: "
            f"{v.get('recorded_total')} of {v.get('issued_total')} issued requests recorded; RSS "
            f"{_f(v.get('rss_first_quarter_median_mib'), '.1f')} → {_f(v.get('rss_last_quarter_median_mib'), '.1f')} MiB; "
            f"FDs {_f(v.get('fds_first_quarter_median'), '.0f')} → {_f(v.get('fds_last_quarter_median'), '.0f')}")


FIGURES: dict[str, tuple[str, Callable[[dict], str]]] = {
    "client_overhead": ("bench_client_overhead.py", _client_overhead),
    "client_ceiling": ("bench_client_overhead.py --ceiling", _client_ceiling),
    "client_quickack": ("bench_client_overhead.py", _client_quickack),
    "telemetry_overhead": ("bench_telemetry_overhead.py", _telemetry_overhead),
    "trace_scale": ("bench_trace_scale.py", _trace_scale),
    "trace_vs_hta": ("bench_trace_vs_hta.py", _trace_vs_hta),
    "client_processes": ("bench_client_processes.py", _client_processes),
    "cluster_engines": ("bench_cluster_engines.py", _cluster_engines),
    "trace_cluster": ("bench_trace_cluster.py", _trace_cluster),
    "soak": ("bench_soak.py", _soak),
}


NAME_RE = re.compile(rf"^(?P<bench>{'|'.join(FIGURES)})_(?:(?P<pre>[a-z0-9]+)_)?(?P<date>\d{{8}})(?P<label>[-_].+)?$")


def entry(path: Path) -> dict[str, Any]:
    """What the index says of one result file; ``ValueError`` for a name or benchmark it does not know."""
    m = NAME_RE.match(path.stem)
    if m is None:
        raise ValueError(f"{path.name}: not <benchmark>_<YYYYmmdd>[_label].json of a known benchmark "
                         f"({', '.join(FIGURES)}); add its figure to benchmarks/results_index.py")
    d = json.loads(path.read_text())
    when = str(d.get("when") or d.get("date") or "")
    day = f"{m['date'][:4]}-{m['date'][4:6]}-{m['date'][6:]}"
    when = when.replace("T", " ")[:16] if when.startswith(day[:4]) else day
    host = d.get("host") if isinstance(d.get("host"), dict) else d.get("machine") if isinstance(d.get("machine"), dict) \
        else {}
    cpus = d.get("nproc") or host.get("cpus")
    label = "_".join(x for x in (m["pre"], (m["label"] or "").lstrip("-_")) if x)
    return {"file": path.name, "bench": m["bench"], "when": when, "cpus": cpus, "label": label,
            "figure": FIGURES[m["bench"]][1](d)}


def render(results: Path = RESULTS) -> str:
    """The index as Markdown."""
    entries = sorted((entry(p) for p in results.glob("*.json")), key=lambda e: (e["bench"], e["when"], e["file"]))
    latest = {e["bench"]: e for e in entries}
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/results_index.py` from the JSON files of this folder (each written by its",
             "script's `--out`, with the command line and the machine inside); `tests/test_benchmark_results.py` checks",
             "that this page is current. The figure of each benchmark is read from its latest result; what the numbers",
             "mean and the earlier runs are discussed in `docs/metrics.md` (client), `docs/scaling.md` (trace) and",
             "`docs/method.md` (telemetry).", "",
             "## Latest figure per benchmark", "",
             "| benchmark | script | latest result | when | CPUs | figure |", "|---|---|---|---|---|---|"]
    for bench, e in sorted(latest.items()):
        lines.append(f"| {bench} | `benchmarks/{FIGURES[bench][0]}` | [`{e['file']}`]({e['file']}) | {e['when']} | "
                     f"{e['cpus'] or '—'} | {e['figure']} |")
    lines += ["", "## Every result", "", "| benchmark | when | file | label | CPUs |", "|---|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['bench']} | {e['when']} | [`{e['file']}`]({e['file']}) | {e['label'] or '—'} | "
                     f"{e['cpus'] or '—'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if results/README.md is not current")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        if not INDEX.exists() or INDEX.read_text() != text:
            print(f"{INDEX} is not current: run python benchmarks/results_index.py", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
