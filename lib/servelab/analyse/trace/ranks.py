"""Across ranks: clock alignment by matched collectives, straggler / end-time skew, PP stage overlap.

Clock model: ranks on one node share a clock; each node n has an unknown offset o_n. The k-th collective
kernel of a communication group ends at (nearly) the same instant on every member (the last transfer
completes everywhere), so for matched kernels ``end_r − end_ref`` estimates ``o_node(r) − o_node(ref)``.
We take the median over matches per rank (robust to the odd late kernel), fit one offset per node (median
of its ranks), and report each rank's residual (its own estimate minus its node's) and the spread of the
per-match differences — a large residual or spread means the matching or the clock model is wrong, and
cross-rank overlap numbers should not be trusted (``alignment_ok`` is False).

Matching: within a group of ranks that run the same collective sequence (same TP group: equal DP/PP
identity; for SendRecv: equal DP/TP identity across PP stages; without identity: all ranks), kernels of
one family (the kernel name) are matched by order. Profilers start a few kernels apart on different ranks,
so the order shift that makes end times most consistent (smallest MAD) is searched; among near-equal
shifts the one with the smallest offset wins (clocks are assumed closer than one step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from servelab.analyse.trace import intervals as iv
from servelab.analyse.trace.nccl import parse_comm_name
from servelab.analyse.trace.ops import KERNEL_CATS, RankOps

MAX_SHIFT = 64


@dataclass
class Alignment:
    """Per-rank clock offsets (ns) to subtract, and the evidence."""
    offsets_ns: dict[int, int]
    table: pl.DataFrame
    matches: pl.DataFrame
    residual_us: float | None
    alignment_ok: bool
    notes: list[str] = field(default_factory=list)


def _family(name: str) -> str:
    p = parse_comm_name(name)
    return (p["collective"] or "") + "|" + name.split("(")[0]


def comm_seq(r: RankOps) -> pl.DataFrame:
    """The rank's collective kernels in start order: family (collective and kernel name), collective, ts_ns, end_ns,
    seq — what the cross-rank matching reads of a rank (made with its timeline, on the worker that holds it)."""
    c = r.ops.filter((pl.col("cls") == "communication") & pl.col("cat").is_in(list(KERNEL_CATS))).sort("ts_ns")
    if c.height == 0:
        return pl.DataFrame(schema={"family": pl.String, "collective": pl.String, "ts_ns": pl.Int64,
                                    "end_ns": pl.Int64, "seq": pl.Int64})
    fam = {n: _family(n) for n in c["name"].unique().to_list()}
    return c.select(pl.col("name").replace_strict(fam, return_dtype=pl.String).alias("family"),
                    pl.col("name").replace_strict(fam, return_dtype=pl.String).str.split("|").list.first()
                    .alias("collective"), "ts_ns", "end_ns", "seq")


def _best_shift(a_end: np.ndarray, b_end: np.ndarray, max_shift: int = MAX_SHIFT) -> tuple[int, float, float, int]:
    """Shift s so that b[i+s] matches a[i]; returns (shift, median diff, MAD, matches)."""
    cands = []
    for s in range(-min(max_shift, a_end.size - 1), min(max_shift, b_end.size - 1) + 1):
        ia0, ib0 = (0, s) if s >= 0 else (-s, 0)
        n = min(a_end.size - ia0, b_end.size - ib0)
        if n < max(3, min(a_end.size, b_end.size) // 2):
            continue
        d = b_end[ib0:ib0 + n] - a_end[ia0:ia0 + n]
        med = float(np.median(d))
        mad = float(np.median(np.abs(d - med)))
        cands.append((s, med, mad, n))
    if not cands:
        return 0, float("nan"), float("nan"), 0
    min_mad = min(c[2] for c in cands)
    tol = max(1.5 * min_mad, min_mad + 2_000)  # within 1.5× or 2 µs of the best spread
    near = [c for c in cands if c[2] <= tol]
    best = min(near, key=lambda c: (abs(c[1]), abs(c[0])))
    return best


def _groups(rops: list[RankOps], sendrecv: bool) -> list[list[RankOps]]:
    ids = [r.trace.identity for r in rops]
    if all(i.pp is None for i in ids) and all(i.dp is None for i in ids) and len({i.stage for i in ids}) <= 1:
        return [rops]
    keyf = (lambda i: (i.dp, i.tp)) if sendrecv else (lambda i: (i.dp, i.pp, i.stage))
    out: dict[tuple, list[RankOps]] = {}
    for r in rops:
        out.setdefault(keyf(r.trace.identity), []).append(r)
    return [g for g in out.values() if len(g) > 1]


def match_collectives(rops: list[RankOps], seqs: dict[int, pl.DataFrame] | None = None) -> pl.DataFrame:
    """Pairwise matches (reference rank = lowest rank of each group): family, ref_rank, rank, shift,
    matches, offset_us (median end difference), mad_us, plus the per-match arrays for stragglers. ``seqs``: each
    rank's :func:`comm_seq` where already made."""
    seqs = seqs if seqs is not None else {r.rank: comm_seq(r) for r in rops}
    rows = []
    for is_sr in (False, True):
        for grp in _groups(rops, is_sr):
            ref = min(grp, key=lambda r: r.rank)
            fams = seqs[ref.rank].filter((pl.col("collective") == "SendRecv") == is_sr)["family"].unique(
                maintain_order=True).to_list()
            for fam in fams:
                a = seqs[ref.rank].filter(pl.col("family") == fam)
                for r in grp:
                    if r.rank == ref.rank:
                        continue
                    b = seqs[r.rank].filter(pl.col("family") == fam)
                    if a.height < 3 or b.height < 3:
                        continue
                    paired = _by_seq(a, b, "end_ns")
                    if paired is not None:
                        end_b, hit = paired
                        d = end_b[hit] - a["end_ns"].to_numpy()[hit]
                        shift, n = 0, d.size
                        med = float(np.median(d)) if n else float("nan")
                        mad = float(np.median(np.abs(d - med))) if n else float("nan")
                    else:
                        shift, med, mad, n = _best_shift(a["end_ns"].to_numpy(), b["end_ns"].to_numpy())
                    rows.append({"family": fam, "sendrecv": is_sr, "ref_rank": ref.rank, "rank": r.rank,
                                 "shift": shift, "matches": n, "offset_us": med / 1e3, "mad_us": mad / 1e3})
    return pl.DataFrame(rows, schema={"family": pl.String, "sendrecv": pl.Boolean, "ref_rank": pl.Int64,
                                      "rank": pl.Int64, "shift": pl.Int64, "matches": pl.Int64,
                                      "offset_us": pl.Float64, "mad_us": pl.Float64})


def align_ranks(rops: list[RankOps], max_residual_us: float = 50.0,
                seqs: dict[int, pl.DataFrame] | None = None) -> Alignment:
    """Estimate per-rank and per-node clock offsets from matched collectives (see module docstring).

    Collectives (all-reduce, all-gather, ...) are used first; SendRecv pairs only link ranks that share no
    collective (PP stages), because NCCL may complete a buffered send before the matching receive ends.
    On a single node nothing is shifted: the estimates are reported as a check of the matching."""
    nodes = {r.rank: r.trace.identity.node for r in rops}
    multi_node = len(set(nodes.values())) > 1
    m = match_collectives(rops, seqs)
    notes: list[str] = []
    if m.height == 0:
        tbl = pl.DataFrame({"rank": [r.rank for r in rops], "node": [nodes[r.rank] for r in rops]})
        notes.append("no collective kernels matched across ranks; clocks assumed aligned")
        return Alignment({r.rank: 0 for r in rops}, tbl, m, None, not multi_node, notes)
    est: dict[int, float] = {min(nodes): 0.0}
    used = []
    for sendrecv in (False, True):
        edges = (m.filter(pl.col("sendrecv") == sendrecv).group_by("ref_rank", "rank")
                 .agg(pl.col("offset_us").median().alias("offset_us"), pl.col("mad_us").median().alias("mad_us"),
                      pl.col("matches").sum().alias("matches")))
        before = set(est)
        for _ in range(len(rops)):
            for row in edges.iter_rows(named=True):
                a, b = row["ref_rank"], row["rank"]
                if a in est and b not in est:
                    est[b] = est[a] + row["offset_us"]
                elif b in est and a not in est:
                    est[a] = est[b] - row["offset_us"]
        if edges.height:
            used.append(edges.with_columns(pl.lit(sendrecv).alias("sendrecv")))
        if sendrecv and set(est) - before:
            notes.append("ranks linked only by SendRecv (pipeline stages): a buffered send can end before its "
                         "receive, so these offsets are rough")
    edges = pl.concat(used) if used else pl.DataFrame()
    missing = [r.rank for r in rops if r.rank not in est]
    if missing:
        notes.append(f"ranks {missing} share no matched collective with the others; offset 0 assumed")
    for k in missing:
        est[k] = 0.0
    ref_node = nodes[min(nodes)]
    node_off: dict[str, float] = {}
    for n in sorted(set(nodes.values())):
        vals = [est[r] for r in est if nodes.get(r) == n]
        node_off[n] = float(np.median(vals)) if multi_node else 0.0
    base = node_off.get(ref_node, 0.0)
    node_off = {n: v - base for n, v in node_off.items()}
    rows = []
    for r in rops:
        own = est[r.rank]
        e = edges.filter(pl.col("rank") == r.rank) if edges.height else edges
        rows.append({"rank": r.rank, "node": nodes[r.rank], "matches": int(e["matches"].sum()) if e.height else 0,
                     "via": ("sendrecv" if e.height and e["sendrecv"].all() else "collectives") if e.height else "-",
                     "rank_offset_us": own, "node_offset_us": node_off[nodes[r.rank]],
                     "residual_us": own - node_off[nodes[r.rank]],
                     "match_mad_us": float(e["mad_us"].median()) if e.height else None})
    tbl = pl.DataFrame(rows)
    resid = float(np.max(np.abs(tbl["residual_us"].to_numpy()))) if tbl.height else None
    spread = tbl["match_mad_us"].drop_nulls()
    worst_mad = float(spread.max()) if spread.len() else 0.0
    consistent = resid is not None and resid <= max_residual_us and worst_mad <= max_residual_us
    offsets = {r.rank: int(round(node_off[nodes[r.rank]] * 1e3)) if multi_node else 0 for r in rops}
    if multi_node:
        ok = consistent
        if not ok:
            notes.append(f"alignment residual {resid:.1f} µs / match spread {worst_mad:.1f} µs exceed "
                         f"{max_residual_us:.0f} µs: cross-node timing numbers are unreliable")
    else:
        ok = True
        notes.append("single node: ranks share one clock, no offset applied (estimates shown as a check)")
        if not consistent:
            notes.append(f"the matched-kernel estimate disagrees with the shared clock by up to {resid:.0f} µs "
                         f"(spread {worst_mad:.0f} µs): those kernels do not end together, so they would not "
                         f"align a multi-node capture")
    return Alignment(offsets, tbl, m, resid, ok, notes)


def collective_skew(rops: list[RankOps], alignment: Alignment | None = None,
                    seqs: dict[int, pl.DataFrame] | None = None) -> pl.DataFrame:
    """For matched collectives (order-matched within TP groups, after alignment): per rank, how late it
    arrives (kernel start − earliest start among the group) — the rank arriving last makes the others wait.

    Columns: rank, collectives, late_p50_us, late_mean_us, last_arrival_pct (share of collectives where this
    rank started last), wait_caused_ms (sum over collectives where it was last of (its start − earliest)).
    ``seqs``: each rank's :func:`comm_seq` where already made.

    One collective is the k-th kernel of a family on the group's reference rank and the kernels its matched ranks
    ran for it — the ones of the same sequence number where both ranks' kernels carry one (as the matching pairs
    them: a rank that lost its first kernels is paired by number, not by position), else the order shift applied:
    a row of a matrix with one column per rank (the reference first, then the matched ranks in the matches' order —
    the order that breaks a tie for the last to arrive)."""
    off = alignment.offsets_ns if alignment else {r.rank: 0 for r in rops}
    seqs = seqs if seqs is not None else {r.rank: comm_seq(r) for r in rops}
    m = alignment.matches if alignment is not None else match_collectives(rops, seqs)
    if m.height == 0:
        return pl.DataFrame()
    late: dict[int, list[np.ndarray]] = {r.rank: [] for r in rops}
    last: dict[int, int] = {r.rank: 0 for r in rops}
    caused: dict[int, float] = {r.rank: 0.0 for r in rops}
    total = 0
    mm = m.filter(~pl.col("sendrecv"))
    for (fam, ref), grp in mm.group_by("family", "ref_rank", maintain_order=True):
        fa = seqs[ref].filter(pl.col("family") == fam)
        a = fa["ts_ns"].to_numpy() - off.get(ref, 0)
        cols, have, ranks = [a], [np.ones(a.size, bool)], [ref]
        for rk, s in zip(grp["rank"].to_list(), grp["shift"].to_list()):
            fb = seqs[rk].filter(pl.col("family") == fam)
            paired = _by_seq(fa, fb, "ts_ns")
            if paired is not None:
                c, h = paired
                c[h] -= off.get(rk, 0)
            else:
                b = fb["ts_ns"].to_numpy() - off.get(rk, 0)
                c, h = np.zeros(a.size, np.int64), np.zeros(a.size, bool)
                ia0, ib0 = (0, s) if s >= 0 else (-s, 0)
                n = max(0, min(a.size - ia0, b.size - ib0))
                c[ia0:ia0 + n], h[ia0:ia0 + n] = b[ib0:ib0 + n], True
            cols.append(c)
            have.append(h)
            ranks.append(rk)
        t, ok = np.column_stack(cols), np.column_stack(have)     # integer ns: epoch times lose digits as floats
        keep = ok.sum(axis=1) >= 2                               # a collective needs two ranks
        t, ok = t[keep], ok[keep]
        if not t.shape[0]:
            continue
        total += t.shape[0]
        t0 = np.where(ok, t, np.iinfo(np.int64).max).min(axis=1)
        lr = np.where(ok, t, np.iinfo(np.int64).min).argmax(axis=1)   # the first of equal starts, in column order
        gap = t - t0[:, None]
        for j, rk in enumerate(ranks):
            late[rk].append(gap[ok[:, j], j] / 1e3)
            hit = lr == j
            last[rk] += int(hit.sum())
            caused[rk] += float((gap[hit, j] / 1e6).sum())
    if total == 0:
        return pl.DataFrame()
    rows = []
    for rk, parts in late.items():
        v = np.concatenate(parts) if parts else np.empty(0)
        rows.append({"rank": rk, "collectives": int(v.size), "late_p50_us": float(np.median(v)) if v.size else None,
                     "late_mean_us": float(np.mean(v)) if v.size else None,
                     "last_arrival_pct": 100 * last[rk] / total, "wait_caused_ms": caused[rk]})
    return pl.DataFrame(rows).sort("rank")


def _by_seq(a: pl.DataFrame, b: pl.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The one pairing by sequence number (the matching's and the skew's): for each of ``a``'s kernels (the
    reference's, of one family), ``b``'s ``col`` of the same number — its first kernel of that number — and whether
    ``b`` has one. None where either side has a kernel without a number (then they are paired by order)."""
    if not b.height or a["seq"].null_count() or b["seq"].null_count():
        return None
    a_seq, b_seq = a["seq"].to_numpy(), b["seq"].to_numpy()
    order = np.argsort(b_seq, kind="stable")
    sb = b_seq[order]
    pos = np.minimum(np.searchsorted(sb, a_seq), sb.size - 1)
    hit = sb[pos] == a_seq
    c = np.zeros(a_seq.size, np.int64)
    c[hit] = b[col].to_numpy()[order[pos[hit]]]
    return c, hit


def step_skew(rops: list[RankOps], alignment: Alignment | None = None) -> pl.DataFrame:
    """Per step window (matched by name and occurrence) among ranks that execute the same step together —
    the same DP replica, PP stage and profile stage (pipeline stages end at different times by design):
    GPU end time of each rank after alignment; end_skew_us = latest − earliest end; last_rank; ``group``."""
    groups = _groups(rops, sendrecv=False)
    if len(groups) == 1 and len(groups[0]) < 2:
        return pl.DataFrame()
    out = [_step_skew_group(g, alignment) for g in groups if len(g) > 1]
    out = [o for o in out if o.height]
    return pl.concat(out, how="vertical_relaxed").sort("group", "window") if out else pl.DataFrame()


def _step_skew_group(rops: list[RankOps], alignment: Alignment | None) -> pl.DataFrame:
    off = alignment.offsets_ns if alignment else {r.rank: 0 for r in rops}
    ident = rops[0].trace.identity
    label = ",".join(f"{k}{getattr(ident, k)}" for k in ("dp", "pp") if getattr(ident, k) is not None) or "all"
    parts = []
    for r in rops:
        w = r.windows.filter(pl.col("gpu_end_ns").is_not_null()).sort("window")
        parts.append(w.select(pl.lit(r.rank).alias("rank"), "window", "name", "kind",
                              (pl.col("gpu_start_ns") - off.get(r.rank, 0)).alias("start_ns"),
                              (pl.col("gpu_end_ns") - off.get(r.rank, 0)).alias("end_ns"))
                     .with_columns(pl.int_range(pl.len()).over("name").alias("occurrence")))
    if len(parts) < 2:
        return pl.DataFrame()
    allw = pl.concat(parts, how="vertical_relaxed")
    g = (allw.group_by("name", "occurrence")
         .agg(pl.col("kind").first(), pl.col("window").min().alias("window"), pl.len().alias("ranks"),
              ((pl.col("end_ns").max() - pl.col("end_ns").min()) / 1e3).alias("end_skew_us"),
              ((pl.col("start_ns").max() - pl.col("start_ns").min()) / 1e3).alias("start_skew_us"),
              pl.col("rank").sort_by("end_ns").last().alias("last_rank"),
              pl.col("rank").sort_by("end_ns").first().alias("first_rank"))
         .filter(pl.col("ranks") > 1).sort("window").with_columns(pl.lit(label).alias("group")))
    return g


def slow_rank(coll_skew: pl.DataFrame, steps: pl.DataFrame, n_ranks: int,
              threshold_pct: float = 50.0, min_late_us: float = 10.0, min_samples: int = 5) -> dict:
    """A *fixed* slow rank: last to arrive at ≥ threshold_pct of matched collectives (at least twice the 1/n
    chance; 75 % for two ranks) with a median lateness ≥ ``min_late_us``, or last to finish ≥ that share of
    steps by ≥ ``min_late_us`` — each judged on at least ``min_samples`` collectives / steps. Returns a dict
    with the verdict and the evidence sentence."""
    out = {"slow_rank": None, "evidence": "", "threshold_pct": threshold_pct, "min_late_us": min_late_us}
    chance = 100.0 / max(n_ranks, 1)
    need = max(threshold_pct, 2 * chance) if n_ranks > 2 else threshold_pct + 25
    if coll_skew is not None and coll_skew.height:
        top = coll_skew.sort("last_arrival_pct", "rank", descending=[True, False], nulls_last=True).row(0, named=True)
        if top["last_arrival_pct"] is not None and top["last_arrival_pct"] >= need \
                and (top["late_p50_us"] or 0) >= min_late_us and top["collectives"] >= min_samples:
            out.update(slow_rank=top["rank"], evidence=(
                f"rank {top['rank']} arrives last at {top['last_arrival_pct']:.0f}% of {top['collectives']} matched "
                f"collectives (chance {chance:.0f}%), median lateness {top['late_p50_us']:.1f} µs"))
            return out
        if top["last_arrival_pct"] is not None:
            out["evidence"] = (f"most frequent last arrival: rank {top['rank']} at {top['last_arrival_pct']:.0f}% of "
                               f"{top['collectives']} collectives, median lateness {top['late_p50_us']:.1f} µs (a "
                               f"fixed slow rank needs ≥ {need:.0f}% and ≥ {min_late_us:g} µs)")
    if steps is not None and steps.height:
        # a tie goes to the lower rank (value_counts' order is not stable from run to run)
        vc = steps["last_rank"].value_counts().sort("count", "last_rank", descending=[True, False]).row(0)
        pct = 100 * vc[1] / steps.height
        med_skew = float(steps["end_skew_us"].median())
        if pct >= need and med_skew >= min_late_us and steps.height >= min_samples:
            out.update(slow_rank=vc[0], evidence=f"rank {vc[0]} finishes last in {pct:.0f}% of {steps.height} steps")
        else:
            out["evidence"] += (f"{'; ' if out['evidence'] else ''}last to finish a step: rank {vc[0]} in "
                                f"{pct:.0f}% of {steps.height} steps (median end skew {med_skew:.1f} µs"
                                f"{'' if steps.height >= min_samples else f'; fewer than {min_samples} steps'})")
    return out


def pp_overlap(rops: list[RankOps], alignment: Alignment | None = None, compute_only: bool = False) -> pl.DataFrame:
    """Pipeline-parallel stage overlap over the common wall window of all stages (after alignment).

    Per stage: busy_pct (union of its ranks' GPU ops / wall) and bubble_pct = 100 − busy_pct; plus a row
    ``all`` with both_busy_pct (every stage busy at once, / wall) and both_of_any_pct (/ time any stage is
    busy). ``compute_only`` counts only non-communication kernels (a spinning SendRecv looks busy)."""
    stages: dict[int, list[RankOps]] = {}
    for r in rops:
        if r.trace.identity.pp is not None:
            stages.setdefault(r.trace.identity.pp, []).append(r)
    if len(stages) < 2:
        return pl.DataFrame()
    off = alignment.offsets_ns if alignment else {r.rank: 0 for r in rops}
    unions = {}
    lo, hi = [], []
    for st, rs in sorted(stages.items()):
        s_list, e_list = [], []
        for r in rs:
            o = r.ops
            if compute_only:
                o = o.filter(pl.col("cat").is_in(list(KERNEL_CATS)) & (pl.col("cls") != "communication"))
            s_list.append(o["ts_ns"].to_numpy() - off.get(r.rank, 0))
            e_list.append(o["end_ns"].to_numpy() - off.get(r.rank, 0))
            lo.append(int(r.ops["ts_ns"].min()) - off.get(r.rank, 0))
            hi.append(int(r.ops["end_ns"].max()) - off.get(r.rank, 0))
        unions[st] = iv.union(np.concatenate(s_list), np.concatenate(e_list))
    w0, w1 = max(lo), min(hi)
    if w1 <= w0:
        return pl.DataFrame()
    wall = w1 - w0
    rows = []
    for st, (s, e) in unions.items():
        busy = int(iv.covered_in(s, e, np.array([w0]), np.array([w1]))[0])
        rows.append({"stage": str(st), "ranks": len(stages[st]), "wall_ms": wall / 1e6, "busy_ms": busy / 1e6,
                     "busy_pct": 100 * busy / wall, "bubble_pct": 100 - 100 * busy / wall})
    inter_s, inter_e = None, None
    for s, e in unions.values():
        cs, ce = _clip(s, e, w0, w1)
        if inter_s is None:
            inter_s, inter_e = cs, ce
        else:
            inter_s, inter_e = _intersect(inter_s, inter_e, cs, ce)
    any_s, any_e = iv.union(np.concatenate([_clip(s, e, w0, w1)[0] for s, e in unions.values()]),
                            np.concatenate([_clip(s, e, w0, w1)[1] for s, e in unions.values()]))
    both = iv.total(inter_s, inter_e)
    anyb = iv.total(any_s, any_e)
    rows.append({"stage": "all", "ranks": sum(len(v) for v in stages.values()), "wall_ms": wall / 1e6,
                 "busy_ms": both / 1e6, "busy_pct": 100 * both / wall, "bubble_pct": None,
                 "both_busy_pct": 100 * both / wall, "both_of_any_pct": 100 * both / anyb if anyb else None})
    return pl.DataFrame(rows, infer_schema_length=None).with_columns(pl.lit(compute_only).alias("compute_only"))


def _clip(s: np.ndarray, e: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    cs, ce = np.maximum(s, a), np.minimum(e, b)
    keep = ce > cs
    return cs[keep], ce[keep]


def _intersect(s1: np.ndarray, e1: np.ndarray, s2: np.ndarray, e2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Intersection of two disjoint sorted interval sets (as a disjoint sorted set)."""
    pts = np.concatenate([s1, e1, s2, e2])
    if pts.size == 0:
        return pts, pts
    delta = np.concatenate([np.ones(s1.size), -np.ones(e1.size), np.ones(s2.size), -np.ones(e2.size)])
    order = np.lexsort((delta, pts))      # ends before starts at the same instant
    pts, delta = pts[order], delta[order]
    depth = np.cumsum(delta)
    start_idx = np.flatnonzero((depth == 2) & np.r_[True, depth[:-1] < 2])
    end_idx = np.flatnonzero((depth < 2) & np.r_[False, depth[:-1] == 2])
    return pts[start_idx].astype(np.int64), pts[end_idx].astype(np.int64)


