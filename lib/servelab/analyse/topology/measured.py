"""Measured runs of each layout next to the model: TTFT / TPOT / TPS per case, and a verdict per layout that
refuses a conclusion when more than the layout changed between the runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from servelab.analyse.topology.layout import Layout
from servelab.measure.abtest import compare_cases, diff_manifests, load_run, read_case_summaries


def layout_of_manifest(manifest: dict[str, Any]) -> Layout:
    """The layout a run used, from its manifest's ``launch.settings``."""
    la = (manifest.get("launch") or {}).get("settings") or {}
    lay = Layout(tp=int(la.get("tp_size", 1)), pp=int(la.get("pp_size", 1)), dp=int(la.get("dp_size", 1)),
                 ep=int(la.get("ep_size", 1)), dp_attention=bool(la.get("dp_attention", False)))
    return lay


def measured_comparison(runs: Sequence[str | Path], feas: pd.DataFrame | None = None,
                        comm: pd.DataFrame | None = None, k: float = 2.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measured TTFT / TPOT / TPS per layout and case from run summaries, next to the modelled memory and comm.

    The first run is the baseline (on a cluster the method's reference is TP16, ``docs/method.md#topology``).
    Returns ``(table, verdicts)``: ``table`` one row per run × case (means over repeats, CV of output TPS);
    ``verdicts`` one row per layout: ``recommended`` (faster outside the noise band on output TPS in most shared
    cases and no latency regression outside noise), ``not recommended`` (slower or a latency regression outside
    noise, or does not fit), ``no evidence`` (all changes within noise), ``invalid — no conclusion`` (every shared
    case has an INVALID repeat), ``confounded — no conclusion`` (the manifests differ in more than the layout —
    its launch keys and its label —, see :func:`servelab.measure.abtest.diff_manifests`), with the evidence as text.
    """
    refs = [load_run(r) for r in runs]
    if not refs:
        return pd.DataFrame(), pd.DataFrame()
    per_run = []
    for ref in refs:
        lay = layout_of_manifest(ref.manifest)
        s = read_case_summaries(ref.run_dir).frame
        agg = s.groupby("case_id").agg(repeats=("repeat", "nunique"),
                                       **{c: (c, "mean") for c in ("output_tps", "p95_ttft_ms", "p95_tpot_ms")
                                          if c in s.columns})
        if "output_tps" in s.columns:
            agg["cv_output_tps_pct"] = s.groupby("case_id")["output_tps"].agg(
                lambda v: 100 * v.std(ddof=1) / v.mean() if len(v) > 1 and v.mean() else np.nan)
        if "valid" in s.columns:
            agg["all_valid"] = s.groupby("case_id")["valid"].agg(lambda v: bool(v.fillna(False).all()))
        agg = agg.reset_index()
        agg.insert(0, "layout", lay.label)
        agg.insert(1, "run_id", ref.run_id)
        per_run.append((ref, lay, s, agg))
    table = pd.concat([a for *_, a in per_run], ignore_index=True)
    if feas is not None and not feas.empty:
        table = table.merge(feas[["layout", "weights_gib", "need_gib", "verdict"]].rename(
            columns={"weights_gib": "model_weights_gib_per_gpu", "need_gib": "model_need_gib_per_gpu",
                     "verdict": "model_verdict"}), on="layout", how="left")
    if comm is not None and not comm.empty:
        table = table.merge(comm[["layout", "cross_node_mib_per_step"]].rename(
            columns={"cross_node_mib_per_step": "model_cross_node_mib_per_step"}), on="layout", how="left")
    base_ref, base_lay, base_s, _ = per_run[0]
    verdicts = [{"layout": base_lay.label, "run_id": base_ref.run_id, "verdict": "baseline",
                 "evidence": "the first run given is the baseline (on a cluster the method's reference is TP16)"}]
    # the layout is the variable: its launch keys, and the label a measured layout's record carries (``layout``)
    layout_keys = ["layout"] + ["launch.settings." + k for k in ("tp_size", "pp_size", "dp_size", "ep_size",
                                                                  "dp_attention")]
    for ref, lay, s, _ in per_run[1:]:
        diff = diff_manifests([base_ref, ref], layout_keys)
        confounds = diff[diff["status"] == "confound"]["key"].tolist() if not diff.empty else []
        if confounds:   # docs/method.md#one-variable: only the layout may change between the compared runs
            verdicts.append({"layout": lay.label, "run_id": ref.run_id, "verdict": "confounded — no conclusion",
                             "evidence": "besides the layout these changed: " + ", ".join(confounds[:12])})
            continue
        cmp = compare_cases(base_s, s, k=k)
        fits = True
        if feas is not None and not feas.empty and lay.label in set(feas["layout"]):
            fits = feas.set_index("layout").loc[lay.label, "verdict"] == "fits"
        tps = cmp[cmp["metric"] == "output_tps"]
        lat = cmp[cmp["metric"].isin(["p95_ttft_ms", "p95_tpot_ms"])]
        better = int((tps["verdict"] == "better").sum())
        worse_tps = int((tps["verdict"] == "worse").sum())
        worse_lat = lat[lat["verdict"] == "worse"]
        invalid = int((tps["verdict"] == "invalid").sum())
        ev = [f"output TPS: {better} better / {worse_tps} worse / "
              f"{int((tps['verdict'] == 'within noise').sum())} within noise"
              + (f" / {invalid} INVALID (a repeat of either side failed its validity checks)" if invalid else "")
              + f" of {len(tps)} cases"]
        ev += [f"{r.case_id} {r.metric} {r.delta_pct:+.1f} % (band ±{r.noise_band_pct:.1f} %)" for r in worse_lat.itertuples()]
        if not fits:
            verdict = "not recommended"
            ev.insert(0, "the memory model says it does not fit")
        elif worse_tps or len(worse_lat):
            verdict = "not recommended"
        elif len(tps) and better > len(tps) / 2:
            verdict = "recommended"
        elif len(tps) and invalid == len(tps):
            verdict = "invalid — no conclusion"
        else:
            verdict = "no evidence"
        verdicts.append({"layout": lay.label, "run_id": ref.run_id, "verdict": verdict, "evidence": "; ".join(ev)})
    return table, pd.DataFrame(verdicts)
