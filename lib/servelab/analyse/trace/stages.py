"""Pipeline stages: each stage's GPU time per step, the stretches where one stage holds the pipeline back,
and the SendRecv wait that stage causes on the others.

Why a view of its own: the slow-rank verdict (:mod:`ranks`) compares ranks that run the same collectives and
the same steps together — TP peers inside one stage. Pipeline stages share no collective and end their steps
at different times by design, so a stage that spends 3× longer per step than the next is invisible there.

Method (every number comes from the GPU ops attributed to a step window, see ``docs/metrics.md#stages``):

- a *pipeline* is the set of ranks of one DP replica (and one profile stage); its *stages* are the PP ranks;
- per stage and step (steps matched across stages by name and occurrence, as :func:`ranks.step_skew` does):
  ``gpu_ms`` = union of the stage rank's non-communication kernels in that step (the slowest rank of the stage
  when a stage has several TP ranks), ``sendrecv_ms`` = union of its NCCL SendRecv kernels in that step — a
  SendRecv kernel spins until its peer stage is ready, so it is the wait, not work;
- per step: the *holding* stage has the largest ``gpu_ms``; ``stage_ratio`` = its ``gpu_ms`` / the median
  ``gpu_ms`` of the other stages (two stages: slowest / fastest);
- a *stretch* is a maximal run of consecutive steps with the same verdict: "stage s holds it back"
  (``stage_ratio`` ≥ ``ratio_threshold``) or "balanced". A holding stretch of at least ``min_steps`` steps names
  a slow stage; the other stages' SendRecv time over that stretch is the wait it causes, compared with their
  median SendRecv per step in balanced steps of the same window kind (``baseline``).
"""
from __future__ import annotations

import numpy as np
import polars as pl

from servelab.analyse.trace import intervals as iv
from servelab.analyse.trace.nccl import parse_comm_name
from servelab.analyse.trace.ops import KERNEL_CATS, RankOps

RATIO_THRESHOLD = 1.5      # a stage ≥ 1.5× the others' GPU time per step holds the pipeline back
MIN_STEPS = 3              # a stretch shorter than this names nobody (one slow step is noise, not a stage)

STEP_SCHEMA = {"pipeline": pl.String, "stage": pl.Int64, "ranks": pl.String, "step": pl.Int64, "name": pl.String,
               "kind": pl.String, "gpu_ms": pl.Float64, "sendrecv_ms": pl.Float64}


def _pipelines(rops: list[RankOps]) -> dict[str, dict[int, list[RankOps]]]:
    """pipeline label → PP stage → ranks; only pipelines with at least two stages."""
    out: dict[str, dict[int, list[RankOps]]] = {}
    for r in rops:
        i = r.trace.identity
        if i.pp is None:
            continue
        label = ",".join(f"{k}{v}" for k, v in (("dp", i.dp), ("", i.stage)) if v is not None) or "all"
        out.setdefault(label, {}).setdefault(int(i.pp), []).append(r)
    return {k: v for k, v in out.items() if len(v) > 1}


def _rank_steps(r: RankOps) -> pl.DataFrame:
    """Per step window of one rank: compute (non-communication kernels) and SendRecv time, both unions (ms)."""
    k = r.ops.filter(pl.col("cat").is_in(list(KERNEL_CATS)) & pl.col("window").is_not_null())
    w = r.windows.select("window", "name", "kind").sort("window")
    if k.height == 0 or w.height == 0:
        return pl.DataFrame()
    names = k["name"].unique().to_list()
    sr = {n: parse_comm_name(n)["collective"] == "SendRecv" for n in names}
    k = k.with_columns(pl.col("name").replace_strict(sr, return_dtype=pl.Boolean).alias("_sr"))

    def per_window(sel: pl.DataFrame) -> dict[int, float]:
        g, s, e = iv.union_grouped(sel["window"].to_numpy(), sel["ts_ns"].to_numpy(), sel["end_ns"].to_numpy())
        if g.size == 0:
            return {}
        u, inv = np.unique(g, return_inverse=True)
        tot = np.bincount(inv, weights=(e - s))
        return {int(a): float(b) / 1e6 for a, b in zip(u, tot)}

    comp = per_window(k.filter(pl.col("cls") != "communication"))
    send = per_window(k.filter(pl.col("_sr")))
    return (w.with_columns(pl.col("window").replace_strict(comp, default=0.0, return_dtype=pl.Float64).alias("gpu_ms"),
                           pl.col("window").replace_strict(send, default=0.0, return_dtype=pl.Float64)
                           .alias("sendrecv_ms"))
            .with_columns(pl.int_range(pl.len()).over("name").alias("occurrence")))


def stage_steps(rops: list[RankOps]) -> pl.DataFrame:
    """One row per (pipeline, stage, step): GPU compute ms and SendRecv ms of the stage in that step (a stage of
    several ranks: the slowest rank's compute, the largest SendRecv). Empty without two PP stages."""
    parts = []
    for label, stages in _pipelines(rops).items():
        per_stage = {}
        for st, rs in stages.items():
            frames = [_rank_steps(r).with_columns(pl.lit(r.rank).alias("rank")) for r in rs]
            frames = [f for f in frames if f.height]
            if not frames:
                continue
            f = pl.concat(frames, how="vertical_relaxed")
            per_stage[st] = (f.group_by("name", "occurrence")
                             .agg(pl.col("window").min(), pl.col("kind").first(), pl.col("gpu_ms").max(),
                                  pl.col("sendrecv_ms").max())
                             .with_columns(pl.lit(st, dtype=pl.Int64).alias("stage"),
                                           pl.lit(",".join(str(r.rank) for r in sorted(rs, key=lambda r: r.rank)))
                                           .alias("ranks")))
        if len(per_stage) < 2:
            continue
        first = per_stage[min(per_stage)]
        common = first.select("name", "occurrence")
        for f in per_stage.values():
            common = common.join(f.select("name", "occurrence"), on=["name", "occurrence"])
        order = (common.join(first.select("name", "occurrence", "window"), on=["name", "occurrence"])
                 .sort("window").with_row_index("step").with_columns(pl.col("step").cast(pl.Int64))
                 .drop("window"))
        for f in per_stage.values():
            parts.append(f.join(order, on=["name", "occurrence"])
                         .select(pl.lit(label).alias("pipeline"), "stage", "ranks", "step", "name", "kind",
                                 "gpu_ms", "sendrecv_ms"))
    if not parts:
        return pl.DataFrame(schema=STEP_SCHEMA)
    return pl.concat(parts, how="vertical_relaxed").sort("pipeline", "step", "stage")


def step_verdicts(steps: pl.DataFrame, ratio_threshold: float = RATIO_THRESHOLD) -> pl.DataFrame:
    """Per (pipeline, step): the holding stage (largest GPU ms), ``stage_ratio`` (its GPU ms / median of the
    others), ``holds`` (the holding stage when the ratio ≥ ``ratio_threshold``, else null = balanced) and
    ``stretch`` (running number of the maximal run of equal ``holds`` within the pipeline)."""
    if steps.height == 0:
        return pl.DataFrame()
    rows = []
    for (pipe, step), g in steps.group_by("pipeline", "step", maintain_order=True):
        g = g.sort("gpu_ms", descending=True)
        top = g.row(0, named=True)
        others = g["gpu_ms"][1:]
        base = float(others.median()) if others.len() else float("nan")
        ratio = top["gpu_ms"] / base if base > 0 else None
        rows.append({"pipeline": pipe, "step": step, "name": top["name"], "kind": top["kind"],
                     "holding_stage": top["stage"], "stage_ratio": ratio,
                     "holds": top["stage"] if ratio is not None and ratio >= ratio_threshold else None})
    v = pl.DataFrame(rows, schema={"pipeline": pl.String, "step": pl.Int64, "name": pl.String, "kind": pl.String,
                                   "holding_stage": pl.Int64, "stage_ratio": pl.Float64, "holds": pl.Int64})
    v = v.sort("pipeline", "step")
    changed = (pl.col("holds").fill_null(-1) != pl.col("holds").fill_null(-1).shift(1).over("pipeline")).fill_null(True)
    return v.with_columns(changed.cast(pl.Int64).cum_sum().over("pipeline").alias("stretch"))


def stage_stretches(steps: pl.DataFrame, ratio_threshold: float = RATIO_THRESHOLD,
                    min_steps: int = MIN_STEPS) -> pl.DataFrame:
    """One row per (pipeline, stretch, window kind, stage): the per-stage table of the page.

    Columns: pipeline, stretch, first_step, last_step, steps (of this kind in the stretch), kind, verdict
    ("stage s holds the pipeline back" / "balanced" / "short" when a holding run has < ``min_steps`` steps),
    stage, ranks, role (holds back / waits / -), gpu_ms_per_step (median), stage_ratio (median over the
    stretch's steps of this kind), sendrecv_ms_per_step (mean), sendrecv_ms (total over the stretch),
    baseline_sendrecv_ms_per_step (the stage's median in balanced steps of this kind), excess_sendrecv_ms
    (total − baseline × steps, at least 0: the wait the holding stage causes; only on the waiting stages' rows)."""
    v = step_verdicts(steps, ratio_threshold)
    if v.height == 0:
        return pl.DataFrame()
    span = v.group_by("pipeline", "stretch").agg(pl.col("step").min().alias("first_step"),
                                                  pl.col("step").max().alias("last_step"),
                                                  pl.len().alias("stretch_steps"), pl.col("holds").first())
    j = steps.join(v.select("pipeline", "step", "stretch", "stage_ratio", "holds"), on=["pipeline", "step"])
    base = (j.filter(pl.col("holds").is_null()).group_by("pipeline", "kind", "stage")
            .agg(pl.col("sendrecv_ms").median().alias("baseline_sendrecv_ms_per_step")))
    t = (j.group_by("pipeline", "stretch", "kind", "stage")
         .agg(pl.col("ranks").first(), pl.len().alias("steps"), pl.col("step").min().alias("_first"),
              pl.col("gpu_ms").median().alias("gpu_ms_per_step"), pl.col("stage_ratio").median(),
              pl.col("sendrecv_ms").mean().alias("sendrecv_ms_per_step"),
              pl.col("sendrecv_ms").sum())
         .join(span, on=["pipeline", "stretch"])
         .join(base, on=["pipeline", "kind", "stage"], how="left"))
    long_enough = pl.col("stretch_steps") >= min_steps
    t = t.with_columns(
        pl.when(pl.col("holds").is_null()).then(pl.lit("balanced"))
        .when(~long_enough).then(pl.lit("short"))
        .otherwise(pl.format("stage {} holds the pipeline back", pl.col("holds"))).alias("verdict"),
        pl.when(pl.col("holds").is_null() | ~long_enough).then(pl.lit("-"))
        .when(pl.col("stage") == pl.col("holds")).then(pl.lit("holds back"))
        .otherwise(pl.lit("waits")).alias("role"),
        pl.when(pl.col("holds").is_not_null() & long_enough & (pl.col("stage") != pl.col("holds")))
        .then((pl.col("sendrecv_ms") - pl.col("baseline_sendrecv_ms_per_step").fill_null(0.0) * pl.col("steps"))
              .clip(lower_bound=0.0))
        .alias("excess_sendrecv_ms"))
    return (t.sort("pipeline", "stretch", "_first", "stage")
            .select("pipeline", "stretch", "first_step", "last_step", "kind", "steps", "verdict", "stage", "ranks",
                    "role", "gpu_ms_per_step", "stage_ratio", "sendrecv_ms_per_step", "sendrecv_ms",
                    "baseline_sendrecv_ms_per_step", "excess_sendrecv_ms"))


def slow_stage(stretches: pl.DataFrame, steps: pl.DataFrame) -> dict:
    """The stage verdict: the stage that holds the pipeline back over the most steps (stretches of at least
    ``min_steps``), with its step ranges, its GPU ratio per window kind and the SendRecv wait on the others.

    Keys: slow_stage (int or None), ranks, stretches [(first, last), ...], steps, of_steps, ratio (median over
    its steps), wait_stage, wait_sendrecv_ms, excess_sendrecv_ms, by_kind {kind: (slow ms, other ms)},
    evidence (one sentence)."""
    out: dict = {"slow_stage": None, "evidence": ""}
    if stretches is None or stretches.height == 0:
        out["evidence"] = "a single pipeline stage (no PP identity in the trace names, or one stage)"
        return out
    total = int(steps["step"].n_unique())
    hold = stretches.filter(pl.col("role") == "holds back")
    if hold.height == 0:
        v = step_verdicts(steps)
        med = float(v["stage_ratio"].drop_nulls().median() or float("nan"))
        out["evidence"] = (f"no stage holds the pipeline back for {MIN_STEPS}+ consecutive steps: median stage "
                           f"ratio {med:.2f}× over {total} steps (threshold {RATIO_THRESHOLD:g}×)")
        return out
    per = hold.group_by("pipeline", "stage").agg(pl.col("steps").sum()).sort("steps", descending=True)
    best = per.row(0, named=True)
    pipe, st = best["pipeline"], best["stage"]
    mine = hold.filter((pl.col("pipeline") == pipe) & (pl.col("stage") == st))
    ranges = sorted({(r["first_step"], r["last_step"]) for r in mine.iter_rows(named=True)})
    in_stretch = pl.lit(False)
    for a, b in ranges:
        in_stretch = in_stretch | pl.col("step").is_between(a, b)
    s = steps.filter((pl.col("pipeline") == pipe) & in_stretch)
    v = step_verdicts(s).filter(pl.col("holds") == st)
    ratio = float(v["stage_ratio"].median())
    by_kind = {}
    for kind, g in s.group_by("kind", maintain_order=True):
        mine_ms = float(g.filter(pl.col("stage") == st)["gpu_ms"].median())
        other_ms = float(g.filter(pl.col("stage") != st)["gpu_ms"].median())
        by_kind[kind[0]] = (mine_ms, other_ms)
    waits = stretches.filter((pl.col("pipeline") == pipe) & (pl.col("role") == "waits")
                             & pl.col("first_step").is_in([a for a, _ in ranges]))
    wper = waits.group_by("stage").agg(pl.col("sendrecv_ms").sum(), pl.col("excess_sendrecv_ms").sum(),
                                       pl.col("baseline_sendrecv_ms_per_step").median()).sort("sendrecv_ms",
                                                                                              descending=True)
    w = wper.row(0, named=True) if wper.height else {"stage": None, "sendrecv_ms": 0.0, "excess_sendrecv_ms": 0.0,
                                                     "baseline_sendrecv_ms_per_step": None}
    rng = ", ".join(f"{a}–{b}" for a, b in ranges)
    kinds = "; ".join(f"{k} {m:.2f} vs {o:.2f} ms" for k, (m, o) in by_kind.items())
    out.update(slow_stage=st, pipeline=pipe, ranks=mine["ranks"][0], stretches=ranges, steps=int(best["steps"]),
               of_steps=total, ratio=ratio, by_kind=by_kind, wait_stage=w["stage"],
               wait_sendrecv_ms=float(w["sendrecv_ms"]), excess_sendrecv_ms=float(w["excess_sendrecv_ms"]),
               evidence=(f"pipeline stage {st} (rank {mine['ranks'][0]}) holds the pipeline back in steps {rng} "
                         f"({best['steps']} of {total} steps): {ratio:.2f}× the other stage's GPU time per step "
                         f"({kinds}); stage {w['stage']} waits {w['sendrecv_ms']:.1f} ms in SendRecv over those "
                         f"steps, {w['excess_sendrecv_ms']:.1f} ms more than in as many balanced steps"))
    return out
