"""A rank subset for a capture too large to analyse whole (``max_capture_gb``), chosen from the file names alone
(before any trace is parsed) and always said: every rank file gets a row with kept / left out and why.

Under the budget every rank is analysed. Over it, the kept ranks are:

- the representative ranks: the first and the last TP rank of each node within each pipeline stage (and DP
  replica) — ``(node, pp, dp)`` groups;
- every rank whose traffic crosses nodes: the members of a TP group (same ``pp``, ``dp``) whose ranks sit on more
  than one node (cross-node collectives), and the ranks of two neighbouring pipeline stages (same ``tp``, ``dp``,
  ``pp`` and ``pp + 1``) that sit on different nodes (cross-node send/recv);
- every rank file whose name carries no TP identity (nothing to choose by).

Everything else is left out, with the reason. Sizes are the files' sizes on disk (compressed)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import polars as pl

from servelab.analyse.trace.identity import identity_from_name
from servelab.analyse.trace.load import find_trace_files

GB = 1e9

_SCHEMA = {"file": pl.String, "node": pl.String, "tp": pl.Int64, "pp": pl.Int64, "dp": pl.Int64, "size_mb": pl.Float64,
           "kept": pl.Boolean, "why": pl.String}


def rank_files(trace_dir: str | Path, profile_id: str | None = None,
               nodes: dict[str, str] | None = None) -> list[dict]:
    """The capture's rank files (frontend and merged traces left out) with node (sub-folder, or ``nodes``' name),
    TP/PP/DP identity from the name and size."""
    root = Path(trace_dir)
    out = []
    for p in find_trace_files(root):
        ident = identity_from_name(p)
        if ident.role != "rank" or (profile_id is not None and ident.profile_id != profile_id):
            continue
        rel = str(p.parent.relative_to(root))
        node = rel if rel != "." else "node0"
        if nodes:
            node = nodes.get(node, nodes.get(p.name, node))
        out.append({"path": p, "file": str(p.relative_to(root)), "node": node, "tp": ident.tp,
                    "pp": ident.pp or 0, "dp": ident.dp or 0, "size": p.stat().st_size})
    return out


def plan_subset(trace_dir: str | Path, max_capture_gb: float, profile_id: str | None = None,
                nodes: dict[str, str] | None = None) -> tuple[set[Path] | None, pl.DataFrame]:
    """(the rank files to load — None: all of them — , one row per rank file: file, node, tp, pp, dp, size_mb,
    kept, why). ``max_capture_gb`` ≤ 0: no budget."""
    files = rank_files(trace_dir, profile_id, nodes)
    total = sum(f["size"] for f in files)
    if max_capture_gb <= 0 or total <= max_capture_gb * GB:
        why = (f"under the budget: {total / GB:.3f} GB ≤ max_capture_gb={max_capture_gb:g}" if max_capture_gb > 0
               else "no budget (max_capture_gb=0)")
        return None, _table(files, {f["file"]: why for f in files}, set(f["file"] for f in files))
    why: dict[str, list[str]] = defaultdict(list)
    named = [f for f in files if f["tp"] is not None]
    for f in files:
        if f["tp"] is None:
            why[f["file"]].append("no TP identity in its name")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for f in named:
        groups[(f["node"], f["pp"], f["dp"])].append(f)
    for (node, pp, dp), g in groups.items():
        g = sorted(g, key=lambda f: f["tp"])
        for f, which in (((g[0], "first"), (g[-1], "last")) if len(g) > 1 else ((g[0], "first and last"),)):
            why[f["file"]].append(f"representative: {which} TP rank of node {node}, stage {pp}" + (f", DP {dp}" if dp else ""))
    tp_groups: dict[tuple, list[dict]] = defaultdict(list)
    for f in named:
        tp_groups[(f["pp"], f["dp"])].append(f)
    for (pp, _dp), g in tp_groups.items():
        where = sorted({f["node"] for f in g})
        if len(where) > 1:
            for f in g:
                why[f["file"]].append(f"cross-node collectives: its TP group (stage {pp}) spans {', '.join(where)}")
    by_pos = {(f["tp"], f["dp"], f["pp"]): f for f in named}
    for (tp, dp, pp), f in by_pos.items():
        nxt = by_pos.get((tp, dp, pp + 1))
        if nxt is not None and nxt["node"] != f["node"]:
            for a, b in ((f, nxt), (nxt, f)):
                why[a["file"]].append(f"cross-node send/recv: stage {a['pp']} ↔ stage {b['pp']} on {b['node']}")
    kept = {f["file"] for f in files if why.get(f["file"])}
    over = f"{total / GB:.3f} GB over max_capture_gb={max_capture_gb:g}"
    reasons = {f["file"]: ("; ".join(why[f["file"]]) if f["file"] in kept else
                           f"left out: {over}; not a first/last TP rank of its node and stage, no cross-node traffic")
               for f in files}
    return {f["path"] for f in files if f["file"] in kept}, _table(files, reasons, kept)


def _table(files: list[dict], reasons: dict[str, str], kept: set[str]) -> pl.DataFrame:
    rows = [{"file": f["file"], "node": f["node"], "tp": f["tp"], "pp": f["pp"], "dp": f["dp"],
             "size_mb": round(f["size"] / 1e6, 3), "kept": f["file"] in kept, "why": reasons[f["file"]]}
            for f in sorted(files, key=lambda f: (f["node"], f["pp"], f["dp"], f["tp"] if f["tp"] is not None else -1))]
    return pl.DataFrame(rows, schema=_SCHEMA)
