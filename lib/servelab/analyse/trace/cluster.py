"""Phase 3 over a cluster: each rank parsed, cached and reduced on the node that holds its file.

    from servelab.deploy.cluster import open_cluster
    from servelab.analyse.trace.cluster import analyse_on_cluster
    a = analyse_on_cluster(cluster, "/data/capture")       # the folder, as each node sees it

A worker on each node lists the node's trace folder; every rank file is then parsed into its Parquet cache
(beside the file, on that node), prepared (GPU op table, step windows, runtime calls, CPU thread busy, census) by a
worker pinned to that node, which also makes the rank's own timeline tables (gaps, per-window metrics, device
busy, decode interference, communication per collective, and its shares of the cross-rank tables — kernel
breakdown, top kernels, graph coverage, launch delays, merged exactly here:
:func:`~servelab.analyse.trace.analysis.rank_timeline`);
only those per-rank tables travel back (fetched together as workers finish them) — the rank's runtime API calls,
read only by its gaps, stay on its node. A worker uses its share of its node's cores
(:func:`servelab.deploy.cluster.worker_env`): its libraries' thread pools and, with more than one, its own parse
processes. The cross-rank steps (alignment, skew, PP, NCCL forensics, every table) run here on them, through
the same :func:`~servelab.analyse.trace.analysis.analyse` as a local capture, so the tables are the local
path's. A rank whose worker died (or failed otherwise) is submitted
once more; if that fails too, the rank is left out and listed in :attr:`CaptureAnalysis.placement` with the
reason (``status`` missing), never dropped silently.

A file name seen on several nodes is one file on shared storage: it is parsed once, on the first of them. When
the capture's files lie on more than one node, each rank's ``node`` is the node that holds it (the clock
alignment fits one offset per node); on one node the loader's own naming applies (per-node sub-folders or
``node0``).
"""
from __future__ import annotations

import atexit
import io
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import polars as pl

from servelab.analyse.trace import chunked
from servelab.analyse.trace import metrics as M
from servelab.analyse.trace import prepared as P
from servelab.analyse.trace.analysis import CaptureAnalysis, analyse, rank_timeline
from servelab.analyse.trace.decode import TraceFormatError
from servelab.analyse.trace.identity import RankIdentity, identity_from_name
from servelab.analyse.trace.load import Capture, RankTrace, _empty_events, find_trace_files, load_trace, looks_like_trace
from servelab.analyse.trace.ops import RankOps, prepare_rank
from servelab.analyse.trace.taxonomy import Rule, load_rules
from servelab.core import threads
from servelab.deploy.cluster import Cluster, worker_placement
from servelab.deploy.engines import engine_for

ATTEMPTS = 2                 # a rank is submitted at most twice (one retry)
NODE_GONE_S = 60.0           # a pending rank whose node has had no live worker this long is reported missing
POLL_S = 1.0


# ------------------------------------------------------------------------------------------ on the workers

def list_node_traces(trace_dir: str) -> dict[str, Any]:
    """On a worker: the trace files under ``trace_dir`` on this node (the loader's rules), or why none."""
    root = Path(trace_dir).expanduser()
    where = worker_placement()
    if not root.is_dir():
        return {"error": f"{root}: no such folder on this node", **where}
    try:
        files = find_trace_files(root)
    except (TraceFormatError, OSError) as exc:
        return {"error": str(exc), **where}
    return {"root": str(root), **where,
            "files": [{"path": str(p), "rel": str(p.relative_to(root)), "looks": looks_like_trace(p)} for p in files]}


def reduce_rank(path: str, node: str, fallback_rank: int, extra_rules: Sequence[Any] | None = None,
                window_regex: str | None = None, cache: bool = True, cache_dir: str | None = None) -> dict[str, Any]:
    """On a worker of the node holding ``path``: parse the rank (Parquet cache beside it), prepare its tables
    (cached too) and return them with its identity, metadata and counts — never its events."""
    t0 = time.perf_counter()
    rules = load_rules(extra_rules)
    n = threads.share()           # this worker's share of its node (deploy.cluster.worker_env)
    big = n > 1 and chunked.json_size_hint(Path(path)) >= chunked.PARALLEL_MIN_BYTES
    tr = load_trace(path, cache=cache, cache_dir=cache_dir, node=node, workers=n,
                    executor=_parse_pool(n) if big else None, events=not cache)
    if tr.identity.rank is None:           # as the local loader does: TP index, else the file's order
        tr.identity.rank = tr.identity.tp if tr.identity.tp is not None else fallback_rank
        tr.identity.source = tr.identity.source or "file order"
    key = P.prepared_key(tr, rules, window_regex) if cache else None
    hit = P.read_prepared(tr, key)
    if hit is None:
        rops = prepare_rank(tr, rules, window_regex)
        hit = P.Prepared(rops, M.cpu_thread_busy(rops), M.event_census(tr))
        P.write_prepared(tr, key, hit)
    if tr.n_events is None:
        ev = tr.events
        n_events, n_kernels = ev.height, int((ev["cat"] == "kernel").sum())
    else:
        n_events, n_kernels = tr.n_events, tr.n_kernels
    r = hit.rops
    tl = rank_timeline(r)          # per-rank: made here, in parallel, not in the controller one rank at a time
    return {"identity": asdict(tr.identity), "meta": tr.meta, "load_s": tr.load_s, "from_cache": tr.from_cache,
            "cache_path": str(tr.cache_path) if tr.cache_path else "", "n_events": n_events, "n_kernels": n_kernels,
            # the runtime calls serve only the rank's gaps (made here, in its timeline): their schema travels, not rows
            "ops": _pack(r.ops), "windows": _pack(r.windows), "runtime": r.runtime.clear(),
            "window_regex": r.window_regex, "windows_found": r.windows_found, "cpu_threads": _pack(hit.cpu_threads),
            "census": hit.census, "timeline": {k: _pack(v) for k, v in tl.items()},
            "reduce_s": time.perf_counter() - t0, "threads": pl.thread_pool_size(), **worker_placement()}


PACK_MIN_BYTES = 1 << 18       # a table above this (in memory) travels packed; a smaller one pickled as it is


def _pack(df: pl.DataFrame) -> Any:
    return Packed(df) if df.estimated_size() > PACK_MIN_BYTES else df


class Packed:
    """A big table on its way from a worker: Arrow IPC, zstd-compressed. A rank's op table is mostly repeated names
    and empty integer columns — 1.48 MB pickled for a real H200 rank of 5,418 ops, 64 KB so (its gaps 501 → 36 KB),
    and what the controller spends receiving a rank grows with its bytes (framing, TLS, copies). Reading IPC back
    costs about 0.4–1 ms a table whatever its size, against 0.02 ms to unpickle a small one, so only tables above
    :data:`PACK_MIN_BYTES` are packed (a real rank's whole result: 12.4 ms to read with every table packed, 3.7 ms
    with the big ones only, 1.0 ms unpacked — for 157 KB, 261 KB and 2.1 MB). Types (categorical names included)
    come back as they left."""

    __slots__ = ("data",)

    def __init__(self, df: pl.DataFrame) -> None:
        buf = io.BytesIO()
        df.write_ipc(buf, compression="zstd")
        self.data = buf.getvalue()

    def frame(self) -> pl.DataFrame:
        return pl.read_ipc(io.BytesIO(self.data))


_POOL: dict[int, Any] = {}


def _parse_pool(n: int):
    """This worker's parse processes (started once, reused for every rank it parses; None: parse here)."""
    if n not in _POOL:
        _POOL[n] = chunked.spawn_pool(n)
        if _POOL[n] is not None:
            atexit.register(_POOL[n].shutdown, wait=False, cancel_futures=True)
    return _POOL[n]


# ------------------------------------------------------------------------------------------ here

class RemoteRankTrace(RankTrace):
    """A rank parsed on another node: its per-rank tables are here (its runtime calls empty: they served its
    timeline there), its events stay in the Parquet cache there."""

    parsed_on: str = ""

    def reload_events(self, columns: list[str] | None = None) -> pl.DataFrame:
        raise TraceFormatError(f"{self.path.name} was parsed on node {self.parsed_on}; its events stay in the "
                               f"Parquet cache there ({self.cache_path or 'not cached'}) — analyse it on that node")


def _unpacked(r: dict[str, Any]) -> dict[str, Any]:
    """A rank's result with its tables read back (``Packed`` → polars)."""
    out = {k: v.frame() if isinstance(v, Packed) else v for k, v in r.items()}
    out["timeline"] = {k: v.frame() if isinstance(v, Packed) else v for k, v in r["timeline"].items()}
    return out


def _pin(cluster: Cluster, host: str) -> dict[str, Any]:
    """Dask's placement arguments that keep a task on the workers of one host (never elsewhere)."""
    return {"workers": [host], "allow_other_workers": False, "pure": False}


def _plan(listings: dict[str, dict], trace_dir: str, profile_id: str | None, cluster: Cluster
          ) -> tuple[list[dict], list[RankIdentity], list[str], list[str]]:
    """Which files are ranks (the local loader's selection rules), on which node; frontend traces, files set
    aside, and notes (folders missing on a node, files on shared storage)."""
    notes, seen, found = [], {}, []
    for host, lst in listings.items():
        name = cluster.node_name(host)
        if "error" in lst:
            notes.append(f"Node {name}: {lst['error']}.")
            continue
        for f in lst["files"]:
            if f["rel"] in seen:
                notes.append(f"{f['rel']} is on nodes {seen[f['rel']]} and {name} (shared storage): parsed once, on "
                             f"{seen[f['rel']]}.")
                continue
            seen[f["rel"]] = name
            found.append({**f, "host": host, "node_name": name})
    if not found:
        raise TraceFormatError(f"{trace_dir}: no *.json / *.json.gz trace files on any node of the cluster"
                               + (f" ({'; '.join(n.rstrip('.') for n in notes)})" if notes else ""))
    multi = len({f["host"] for f in found}) > 1
    idents = {f["path"] + "@" + f["host"]: identity_from_name(f["path"]) for f in found}
    ids = sorted({i.profile_id for i in idents.values()
                  if i.engine and i.profile_id and engine_for(i.engine).trace_profile_id_shared})
    if profile_id is None and len(ids) > 1:
        raise TraceFormatError(f"{trace_dir}: holds {len(ids)} SGLang captures ({', '.join(ids)}); "
                               f"pass profile_id= to choose one")
    merged = [k for k, i in idents.items() if i.role == "merged"]
    if merged and len(merged) == len(found):
        raise TraceFormatError(f"{trace_dir}: only SGLang merged traces; they hold every rank in one file without "
                               "clock alignment — analyse the per-rank *-TP-<n>*.trace.json.gz files instead")
    frontend, skipped, todo = [], [], []
    for f in found:
        k = f["path"] + "@" + f["host"]
        ident = idents[k]
        if k in merged or (profile_id is not None and ident.profile_id != profile_id) or not f["looks"]:
            skipped.append(Path(f["path"]).name)
            continue
        sub = str(Path(f["rel"]).parent)
        node = (f["node_name"] + (f"/{sub}" if sub != "." else "")) if multi else (sub if sub != "." else "node0")
        if ident.role == "frontend":
            ident.node = node
            frontend.append(ident)
            continue
        todo.append({**f, "node": node})
    order = {p: i for i, p in enumerate(sorted(t["path"] for t in todo))}
    for t in todo:
        t["fallback_rank"] = order[t["path"]]
    return todo, frontend, skipped, notes


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return "cancelled"
    text = str(exc).strip().splitlines()
    name = type(exc).__name__
    if name == "KilledWorker":
        return "the worker died while parsing it"
    return f"{name}: {text[0][:300] if text else ''}".rstrip(": ")


def analyse_on_cluster(cluster: Cluster, trace_dir: str, *, window_regex: str | None = None, top_n: int = 10,
                       extra_rules: Sequence[Rule | Sequence[str] | dict] | None = None, min_gap_us: float = 0.0,
                       cache: bool = True, cache_dir: str | None = None, profile_id: str | None = None
                       ) -> CaptureAnalysis:
    """Every table of Phase 3 for the capture under ``trace_dir`` on the cluster's nodes (the same path on
    each), each rank parsed and reduced on its node. ``a.placement``: one row per rank file — where it was
    parsed, attempts, status (parsed / missing) and the reason of a missing one. ``{node}`` in ``trace_dir``
    stands for each node's name (``/data/{node}/capture``), for nodes that keep their traces at other paths."""
    client = cluster.client
    t_start, c_start = time.perf_counter(), time.process_time()
    hosts = cluster.nodes()
    if not hosts:
        raise TraceFormatError(f"the cluster at {cluster.address} has no workers")
    lfuts = {h: client.submit(list_node_traces, trace_dir.replace("{node}", cluster.node_name(h)),
                              key=f"servelab-list-{h}-{uuid.uuid4().hex[:8]}", **_pin(cluster, h)) for h in hosts}
    listings = {h: f.result(timeout=300) for h, f in lfuts.items()}
    todo, frontend, skipped, notes = _plan(listings, trace_dir, profile_id, cluster)
    rules_spec = list(extra_rules) if extra_rules else None

    def submit(i: int, attempt: int):
        t = todo[i]
        return client.submit(reduce_rank, t["path"], t["node"], t["fallback_rank"], rules_spec, window_regex, cache,
                             cache_dir, key=f"servelab-rank-{i}-a{attempt}-{uuid.uuid4().hex[:8]}",
                             **_pin(cluster, t["host"]))

    pending = {submit(i, 1): (i, 1) for i in range(len(todo))}
    results: dict[int, dict] = {}
    failures: dict[int, list[str]] = {}
    gone_since: dict[str, float] = {}
    checked = time.monotonic()
    fetch_s = fetch_cpu = 0.0
    while pending:
        done = [f for f in pending if f.done()]
        if not done:
            time.sleep(0.05)
        fin = [f for f in done if f.status == "finished"]
        t0, c0 = time.perf_counter(), time.process_time()
        got = {f: _unpacked(r) for f, r in zip(fin, client.gather(fin))} if fin else {}  # together, from all workers
        fetch_s, fetch_cpu = fetch_s + time.perf_counter() - t0, fetch_cpu + time.process_time() - c0
        for fut in done:
            i, attempt = pending.pop(fut)
            if fut in got:
                results[i] = {**got[fut], "attempts": attempt}
                continue
            exc = fut.exception() if fut.status == "error" else None
            failures.setdefault(i, []).append(_reason(exc))
            if attempt < ATTEMPTS and not isinstance(exc, TraceFormatError):
                pending[submit(i, attempt + 1)] = (i, attempt + 1)
        if not done and time.monotonic() - checked > POLL_S:    # a node without live workers never runs its ranks
            checked = time.monotonic()
            live = set(cluster.nodes())
            now = time.monotonic()
            for fut, (i, _attempt) in list(pending.items()):
                h = todo[i]["host"]
                if h in live:
                    gone_since.pop(h, None)
                    continue
                if now - gone_since.setdefault(h, now) > NODE_GONE_S:
                    fut.cancel()
                    pending.pop(fut)
                    failures.setdefault(i, []).append(f"no live worker on node {cluster.node_name(h)} for "
                                                      f"{NODE_GONE_S:.0f} s")
    t_reduce, c_reduce = time.perf_counter() - t_start, time.process_time() - c_start
    rows, traces, tables = [], [], []
    for i, t in enumerate(todo):
        r = results.get(i)
        row = {"file": Path(t["path"]).name, "node": cluster.node_name(t["host"]), "host": t["host"],
               "rank": None, "status": "parsed" if r else "missing",
               "attempts": r["attempts"] if r else len(failures.get(i, [])),
               "worker": r["worker"] if r else "", "hostname": r["hostname"] if r else "",
               "reduce_s": round(r["reduce_s"], 3) if r else None, "from_cache": r["from_cache"] if r else None,
               "reason": "; ".join(failures.get(i, [])) if not r else
               ("; ".join(f"attempt {k + 1}: {x}" for k, x in enumerate(failures.get(i, []))) or "")}
        if r:
            ident = RankIdentity(**r["identity"])
            row["rank"] = ident.rank
            tr = RemoteRankTrace(path=Path(t["path"]), identity=ident, frame=_empty_events(), meta=r["meta"],
                                 load_s=r["load_s"], from_cache=r["from_cache"],
                                 cache_path=Path(r["cache_path"]) if r["cache_path"] else None,
                                 n_events=r["n_events"], n_kernels=r["n_kernels"])
            tr.parsed_on = row["node"]
            rops = RankOps(trace=tr, ops=r["ops"], windows=r["windows"], runtime=r["runtime"],
                           window_regex=r["window_regex"], windows_found=r["windows_found"])
            traces.append(tr)
            tables.append(P.Prepared(rops, r["cpu_threads"], r["census"], r["timeline"]))
        rows.append(row)
    placement = pl.DataFrame(rows, infer_schema_length=None).sort("status", "rank", "file", nulls_last=True)
    if not traces:
        why = "; ".join(f"{x['file']} on {x['node']}: {x['reason']}" for x in rows)
        raise TraceFormatError(f"{trace_dir}: no rank could be parsed on the cluster ({why})")
    seen: dict[tuple, str] = {}
    for tr in traces:
        key = (tr.identity.rank, tr.identity.stage, tr.identity.dp, tr.identity.pp)
        if key in seen:
            raise TraceFormatError(f"{trace_dir}: {tr.path.name} and {seen[key]} both claim rank {tr.identity.rank}; "
                                   f"the folder mixes captures — pass profile_id= or split the folder")
        seen[key] = tr.path.name
    order = sorted(range(len(traces)), key=lambda k: (traces[k].identity.stage or "", traces[k].rank))
    cap = Capture(trace_dir=Path(trace_dir), ranks=[traces[k] for k in order], frontend=frontend, skipped=skipped)
    a = analyse(cap, window_regex=window_regex, top_n=top_n, extra_rules=extra_rules, min_gap_us=min_gap_us,
                cache=cache, prepared_tables=[tables[k] for k in order])
    a.placement = placement
    a.cluster_notes = notes
    # cluster_fetch: of cluster_reduce, the time the controller spent fetching the ranks' tables from the workers
    a.timings_s = {"cluster_reduce": t_reduce, "cluster_fetch": fetch_s, **a.timings_s}
    a.cpu_s = {"cluster_reduce": c_reduce, "cluster_fetch": fetch_cpu, **a.cpu_s}
    return a
