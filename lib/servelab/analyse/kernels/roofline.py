"""Roofline: each GPU's ceilings as data with their source (spec sheet and measured here), and every profiled
kernel placed against them (precision, arithmetic intensity, achieved rate, bound, fraction of the roof)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Peak:
    gpu: str
    quantity: str        # dram_bytes_per_s | fp32 | fp16 | fp64 | bf16_tensor | fp16_tensor | fp8_tensor
    value: float         # bytes/s or flop/s, dense (no structured sparsity)
    kind: str            # spec | measured
    source: str


GPU_PEAKS: tuple[Peak, ...] = (
    Peak("H200", "dram_bytes_per_s", 4.8e12, "spec", "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e"),
    Peak("H200", "bf16_tensor", 989e12, "spec", "NVIDIA H200 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with "
                                                "sparsity, i.e. ~989 TFLOPS dense"),
    Peak("H200", "fp16_tensor", 989e12, "spec", "NVIDIA H200 datasheet (SXM): FP16 Tensor Core 1,979 TFLOPS sparse / 2"),
    Peak("H200", "fp8_tensor", 1979e12, "spec", "NVIDIA H200 datasheet (SXM): FP8 Tensor Core 3,958 TFLOPS sparse / 2"),
    Peak("H200", "fp32", 67e12, "spec", "NVIDIA H200 datasheet (SXM): FP32 67 TFLOPS"),
    Peak("H200", "fp64", 34e12, "spec", "NVIDIA H200 datasheet (SXM): FP64 34 TFLOPS"),
    Peak("H200", "fp16", 134e12, "spec", "derived: 2 x FP32 (GH100 runs packed half2 at twice the FP32 rate; "
                                         "NVIDIA H100 architecture whitepaper)"),
    Peak("H200", "bf16_tensor", 805e12, "measured", "best observed: the 4096x4096x7168 bf16 GEMM of "
                                                    "data/samples/ncu/h200_toy_layer_raw.csv (ncu, clocks unlocked); "
                                                    "a lower bound of the real ceiling"),
    Peak("H200", "dram_bytes_per_s", 3.68e12, "measured", "best observed: the bf16 elementwise kernel of "
                                                          "data/samples/ncu/h200_toy_layer_raw.csv (dram__bytes / "
                                                          "duration); a lower bound of the real ceiling"),
)


def peaks_table(gpu: str = "H200") -> pd.DataFrame:
    """The roofline ceilings of ``gpu`` with their sources (spec sheet and measured here)."""
    rows = [p.__dict__ for p in GPU_PEAKS if p.gpu == gpu]
    if not rows:
        known = sorted({p.gpu for p in GPU_PEAKS})
        raise ValueError(f"no roofline peaks for GPU '{gpu}'; known: {known}")
    df = pd.DataFrame(rows)
    df["display"] = [f"{v / 1e12:.2f} TB/s" if q == "dram_bytes_per_s" else f"{v / 1e12:.0f} TFLOP/s"
                     for q, v in zip(df["quantity"], df["value"])]
    return df


def _peak(gpu: str, quantity: str, kind: str) -> float:
    for p in GPU_PEAKS:
        if p.gpu == gpu and p.quantity == quantity and p.kind == kind:
            return p.value
    for p in GPU_PEAKS:
        if p.gpu == gpu and p.quantity == quantity:
            return p.value
    return math.nan


def roofline(derived: pd.DataFrame, gpu: str = "H200", kind: str = "spec",
             flops_override: dict[str, float] | None = None) -> pd.DataFrame:
    """Place each kernel on the roofline of ``gpu``: its dominant precision (the one with most flops),
    arithmetic intensity (flops / DRAM bytes), achieved flop/s (flops / duration), the attainable ceiling
    ``min(peak, bandwidth × intensity)``, whether it sits left (memory-bound) or right (compute-bound) of the
    ridge point, and the fraction of the ceiling reached.

    ``flops_override`` maps a function name to a flop count computed from shapes (e.g. ``2·M·N·K`` for a
    GEMM) where the counters are absent; such rows say ``flops_source = "override"``.
    """
    bw = _peak(gpu, "dram_bytes_per_s", kind)
    rows = []
    for _, r in derived.iterrows():
        precs = {c[len("flops_"):]: r[c] for c in derived.columns if c.startswith("flops_") and not pd.isna(r[c])}
        src = "counters"
        if flops_override and r["function"] in flops_override:
            precs = {"bf16_tensor": float(flops_override[r["function"]])}
            src = "override"
        prec, flops = (max(precs.items(), key=lambda t: t[1]) if precs else ("-", math.nan))
        dram, dur = r.get("dram_bytes", math.nan), r.get("duration_ns", math.nan)
        ai = flops / dram if dram and dram > 0 and not math.isnan(flops) else math.nan
        achieved = flops / (dur * 1e-9) if dur and dur > 0 and not math.isnan(flops) else math.nan
        peak = _peak(gpu, prec, kind) if prec != "-" else math.nan
        ridge = peak / bw if bw and not math.isnan(peak) else math.nan
        attainable = min(peak, bw * ai) if not (math.isnan(ai) or math.isnan(peak)) else math.nan
        rows.append({"id": r["id"], "function": r["function"], "precision": prec, "flops": flops,
                     "flops_source": src if prec != "-" else "none", "dram_bytes": dram, "duration_us": dur / 1e3,
                     "intensity_flop_per_byte": ai, "achieved_tflops": achieved / 1e12,
                     "dram_tb_per_s": (dram / (dur * 1e-9) / 1e12) if dur and dur > 0 else math.nan,
                     "peak_tflops": peak / 1e12, "ridge_flop_per_byte": ridge,
                     "attainable_tflops": attainable / 1e12,
                     "bound": ("-" if math.isnan(ai) or math.isnan(ridge) else
                               "memory" if ai < ridge else "compute"),
                     "pct_of_roof": 100.0 * achieved / attainable if attainable and not math.isnan(attainable) else math.nan})
    return pd.DataFrame(rows)
