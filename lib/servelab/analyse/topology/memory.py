"""Memory per GPU of each layout: weights by component and pipeline stage, KV cache per token and for the
requested load, the budget, and the feasibility verdict to act on before launching."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from servelab.analyse.topology.layout import Cluster, Layout, layout_problems, pp_partition
from servelab.analyse.topology.model import GIB, KV_DTYPE_BYTES, ModelConfig, dtype_bytes, layer_params


@dataclass(frozen=True)
class MemoryInputs:
    gpu_memory_gib: float
    mem_fraction: float = 0.88
    context_tokens: int = 131072
    concurrency: int = 16
    kv_cache_dtype: str = "auto"
    reserve_gib: float = 0.0       # taken off the budget (activations / CUDA graphs outside mem_fraction)


def stage_weights_bytes(cfg: ModelConfig, lay: Layout, layers: range, first: bool, last: bool) -> dict[str, float]:
    """Bytes of weights one GPU of a pipeline stage holds, by component."""
    wb = dtype_bytes(cfg.weight_dtype)
    eb = dtype_bytes(cfg.expert_dtype or cfg.weight_dtype)
    xb = dtype_bytes(cfg.embedding_dtype)
    out = {"attention": 0.0, "dense_mlp": 0.0, "shared_experts": 0.0, "routed_experts": 0.0, "replicated": 0.0,
           "embedding": 0.0}
    for i in layers:
        p = layer_params(cfg, i)
        out["attention"] += p.attn_sharded / lay.attn_tp * wb
        out["replicated"] += p.attn_replicated * wb + (p.norms + p.router) * xb
        out["dense_mlp"] += p.dense_mlp / lay.tp * wb
        out["shared_experts"] += p.shared_experts / lay.tp * wb
        out["routed_experts"] += p.routed_experts / lay.tp * eb
    emb = cfg.vocab_size * cfg.hidden_size
    if first:
        out["embedding"] += emb / lay.tp * xb
    if last:
        out["embedding"] += (0 if cfg.tie_word_embeddings and lay.pp == 1 else emb) / lay.tp * xb
        out["replicated"] += cfg.hidden_size * xb
    return out


def kv_bytes_per_token(cfg: ModelConfig, lay: Layout, n_layers: int, kv_dtype: str = "auto") -> float:
    """KV-cache bytes one GPU stores per token for ``n_layers`` layers (MLA latent replicated; GQA split)."""
    b = dtype_bytes(kv_dtype, KV_DTYPE_BYTES, "KV cache dtype")
    if cfg.is_mla:
        return n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * b
    heads = max(1, math.ceil(cfg.kv_heads / lay.attn_tp))
    return n_layers * 2 * heads * cfg.hd * b


def memory_table(cfg: ModelConfig, layouts: Sequence[Layout], cluster: Cluster, mem: MemoryInputs) -> pd.DataFrame:
    """Per layout and pipeline stage: weights per GPU (expert / non-expert), KV bytes per token, KV demand for
    ``concurrency`` requests of ``context_tokens``, budget, token capacity and the verdict.

    Units: GiB, bytes per token, tokens. ``verdict`` is ``fits``, ``does not fit: needs X GiB per GPU, has Y GiB``
    or ``invalid: <reason>``; the layout's verdict is its worst stage's.
    """
    rows = []
    budget = mem.gpu_memory_gib * mem.mem_fraction - mem.reserve_gib
    for lay in layouts:
        problems = layout_problems(cfg, lay, cluster)
        stages = pp_partition(cfg.num_hidden_layers, lay.pp) if lay.pp <= cfg.num_hidden_layers else [range(0)]
        for s, layers in enumerate(stages):
            w = stage_weights_bytes(cfg, lay, layers, s == 0, s == len(stages) - 1)
            expert = w["routed_experts"]
            weights = sum(w.values())
            kvpt = kv_bytes_per_token(cfg, lay, len(layers), mem.kv_cache_dtype)
            tokens_per_group = mem.context_tokens * math.ceil(mem.concurrency / max(lay.groups, 1))
            kv_demand = tokens_per_group * kvpt
            free = budget * GIB - weights
            cap_tokens = int(free // kvpt) if free > 0 and kvpt > 0 else 0
            need = (weights + kv_demand) / GIB
            if problems:
                verdict = "invalid: " + "; ".join(problems)
            elif weights / GIB > budget:
                verdict = f"does not fit: weights alone need {weights / GIB:.1f} GiB per GPU, has {budget:.1f} GiB"
            elif need > budget:
                verdict = f"does not fit: needs {need:.1f} GiB per GPU, has {budget:.1f} GiB"
            else:
                verdict = "fits"
            rows.append({"layout": lay.label, "stage": s, "gpus": lay.gpus, "layers": len(layers),
                         "attn_tp": lay.attn_tp, "groups": lay.groups,
                         "weights_nonexpert_gib": (weights - expert) / GIB, "weights_expert_gib": expert / GIB,
                         "weights_gib": weights / GIB, "kv_bytes_per_token": kvpt,
                         "kv_demand_gib": kv_demand / GIB, "budget_gib": budget, "need_gib": need,
                         "kv_capacity_tokens_per_group": cap_tokens,
                         "max_concurrency_at_context": (cap_tokens // mem.context_tokens) * lay.groups
                         if mem.context_tokens else None,
                         "verdict": verdict})
    return pd.DataFrame(rows)


def feasibility(memory: pd.DataFrame) -> pd.DataFrame:
    """One row per layout: its worst stage (most memory needed) with the verdict to act on before launching."""
    idx = memory.groupby("layout", sort=False)["need_gib"].idxmax()
    worst = memory.loc[idx].copy()       # its verdict is the layout's: structural problems hit every stage alike
    cap = memory.groupby("layout", sort=False)["kv_capacity_tokens_per_group"].min()
    worst["kv_capacity_tokens_per_group"] = worst["layout"].map(cap)
    keep = ["layout", "gpus", "attn_tp", "groups", "stage", "weights_nonexpert_gib", "weights_expert_gib", "weights_gib",
            "kv_bytes_per_token", "kv_demand_gib", "need_gib", "budget_gib", "kv_capacity_tokens_per_group",
            "max_concurrency_at_context", "verdict"]
    return worst[keep].reset_index(drop=True)
