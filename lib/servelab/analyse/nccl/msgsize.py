"""The model's real collective message sizes, and where they fall on measured busbw-vs-size curves.

The 1 GiB all-reduce only shows large-message bandwidth; decode collectives are small and latency-bound, so
measure 8K–64M and compare with the model's own sizes (``docs/method.md#comm``, ``docs/metrics.md#message-sizes``).

Sizes follow nccl-tests' ``size`` convention (so they can be read off its curves):

- tensor-parallel all-reduce of a layer's output: ``tokens × hidden × dtype_bytes`` (the per-rank
  buffer), twice per layer (attention output and MLP/MoE output);
- vocab-parallel logits all-gather: ``sequences × vocab × dtype_bytes`` (the gathered total);
- expert-parallel all-to-all (dispatch and combine, each): ``tokens_per_rank × top_k × hidden × dtype_bytes``
  (an upper bound: tokens routed to experts on the same rank do not cross the network).

``from_trace`` accepts measured sizes (a frame with ``collective`` and ``msg_bytes``, e.g. from the
collective args of a Kineto trace) instead of the model estimate.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

COLLECTIVE_ALIASES = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "nccl:all_reduce": "all_reduce",
    "allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather",
    "nccl:all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "reducescatter": "reduce_scatter", "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "nccl:reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "alltoall", "all_to_all": "alltoall", "alltoall_base": "alltoall", "nccl:all_to_all": "alltoall",
    "sendrecv": "sendrecv", "send": "sendrecv", "recv": "sendrecv",
}


def normalise_collective(name: str) -> str:
    key = str(name).strip().lower().replace(" ", "_")
    return COLLECTIVE_ALIASES.get(key, COLLECTIVE_ALIASES.get(key.replace("_", ""), key))


def model_message_sizes(hidden_size: int, dtype_bytes: int, tokens_per_step: dict[str, int], tp: int,
                        num_layers: int | None = None, vocab_size: int | None = None,
                        sequences_per_step: dict[str, int] | None = None, ep: int = 1,
                        top_k: int = 0) -> pd.DataFrame:
    """Collective sizes per step for each scenario of ``tokens_per_step`` (e.g. ``{"decode C=32": 32,
    "prefill 4K": 4096}``; for EP the tokens one rank holds). Columns: scenario, collective, tokens, msg_bytes,
    calls_per_step, what."""
    if hidden_size <= 0 or dtype_bytes <= 0 or tp <= 0:
        raise ValueError("hidden_size, dtype_bytes and tp must be positive")
    rows = []
    for scenario, tokens in tokens_per_step.items():
        if tokens <= 0:
            raise ValueError(f"scenario '{scenario}': tokens per step must be positive, got {tokens}")
        if tp > 1:
            rows.append((scenario, "all_reduce", tokens, tokens * hidden_size * dtype_bytes,
                         2 * num_layers if num_layers else 2, "TP all-reduce of attention / MLP output"))
            if vocab_size:
                seqs = (sequences_per_step or {}).get(scenario, tokens)
                rows.append((scenario, "all_gather", seqs, seqs * vocab_size * dtype_bytes, 1,
                             "vocab-parallel logits gather"))
        if ep > 1 and top_k > 0:
            rows.append((scenario, "alltoall", tokens, tokens * top_k * hidden_size * dtype_bytes,
                         2 * num_layers if num_layers else 2, "EP dispatch + combine (upper bound)"))
    return pd.DataFrame(rows, columns=["scenario", "collective", "tokens", "msg_bytes", "calls_per_step", "what"])


def from_trace(frame: pd.DataFrame) -> pd.DataFrame:
    """Measured sizes from a trace (``collective``, ``msg_bytes``) → scenario ``trace``, one row per
    (collective, size) with the number of calls."""
    missing = {"collective", "msg_bytes"} - set(frame.columns)
    if missing:
        raise ValueError(f"trace collectives frame lacks column(s) {sorted(missing)}")
    f = frame.assign(collective=frame["collective"].map(normalise_collective),
                     msg_bytes=pd.to_numeric(frame["msg_bytes"], errors="coerce")).dropna(subset=["msg_bytes"])
    g = f.groupby(["collective", "msg_bytes"]).size().rename("calls_per_step").reset_index()
    return g.assign(scenario="trace", tokens=np.nan, what="measured in trace")[
        ["scenario", "collective", "tokens", "msg_bytes", "calls_per_step", "what"]]


def place_on_curves(sizes: pd.DataFrame, curves: pd.DataFrame, placement: str = "out-of-place") -> pd.DataFrame:
    """For each model message, the measured busbw and time at that size, interpolated linearly in
    log2(size) between the nccl-tests points of the same collective (NaN outside the measured range:
    never extrapolated), and the time per step = calls × time."""
    out = []
    for r in sizes.itertuples():
        c = curves[(curves.collective == r.collective) & (curves.placement == placement)].sort_values("size_bytes")
        c = c.groupby("size_bytes", as_index=False)[["busbw_gbps", "time_us"]].mean()
        x = np.log2(c.size_bytes.to_numpy(dtype=float)) if len(c) else np.array([])
        inside = len(c) > 0 and c.size_bytes.min() <= r.msg_bytes <= c.size_bytes.max()
        bw = float(np.interp(np.log2(r.msg_bytes), x, c.busbw_gbps)) if inside else np.nan
        t = float(np.interp(np.log2(r.msg_bytes), x, c.time_us)) if inside else np.nan
        out.append({**r._asdict(), "busbw_gbps": bw, "time_us": t,
                    "step_time_us": t * r.calls_per_step if t == t else np.nan,
                    "in_measured_range": bool(inside)})
    df = pd.DataFrame(out)
    return df.drop(columns=["Index"]) if "Index" in df else df
