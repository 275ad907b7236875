"""Phase 4 — parallel topology: memory and communication model, feasibility, launch commands, measured comparison.

The seeds' §9: TP16 baseline; TP8+PP2 (each node one pipeline stage, per-GPU weights ``(W/2)/8 = W/16`` like
TP16, only stage-boundary activations cross nodes); attention TP8/DP2 + MoE EP16 (attention replicated per DP
group, experts spread over all 16 GPUs; all-to-all instead of all-reduce). M3 (§15) asks for each layout's
memory, communication, TTFT, TPOT and TPS and the evidence for the recommended and rejected ones; before any
launch, the model says which layouts fit.

Notation (SGLang's flags, which the seeds' deployment uses): ``TP16+DP2+EP16`` is ``--tp-size 16 --dp-size 2
--enable-dp-attention --ep-size 16``: the TP group of a pipeline stage has ``tp`` GPUs; with DP attention the
attention runs as ``dp`` groups of ``tp/dp`` GPUs; experts are split over ``ep`` GPUs, each expert sharded
``tp/ep`` ways. ``PPn`` multiplies the GPU count by n. For vLLM the same layout is launched as
``tp/dp`` × ``dp`` with expert parallelism (:func:`engine_launch_settings`).

Model assumptions (stated so a reader can disagree):

- parameters: per layer from the HF config (GQA or MLA attention, dense SwiGLU MLP, routed + shared experts,
  router), embeddings and lm_head (untied unless ``tie_word_embeddings``), RMSNorm weights;
- placement: attention projections sharded over the attention-TP group, except MLA's down-projections
  (``q_a_proj``, ``kv_a_proj_with_mqa``) which SGLang keeps replicated; norms and the router replicated; dense
  MLP, shared experts, embeddings and lm_head sharded over the full TP group; routed experts over ``ep × tp/ep =
  tp`` GPUs; pipeline stages split layers as vLLM/SGLang's ``get_pp_indices`` (remainder to the stages before
  the last);
- bytes per weight: ``bf16`` 2, ``fp8`` 1 + fp32 scale per 128×128 block, ``nvfp4`` ½ + fp8 scale per 16,
  ``mxfp4`` ½ + e8m0 scale per 32, ``int4`` ½ + fp16 scale per 128;
- KV cache per token and layer: MLA ``kv_lora_rank + qk_rope_head_dim`` elements, replicated on every rank of
  the attention group; GQA ``2 · kv_heads · head_dim`` split over the attention group (at least one head per
  GPU); each attention group stores the KV of its own requests (requests split evenly over DP groups);
- memory budget per GPU: ``gpu_memory × mem_fraction`` holds weights + KV (SGLang's ``mem-fraction-static``);
- communication per step for ``tokens`` tokens (decode: one per running request): ring all-reduce of the hidden
  state after attention and after the FFN (``2(n−1)/n`` of the message sent per GPU), DP-attention ↔ TP FFN as
  all-gather + reduce-scatter (same volume), EP dispatch (``k`` copies of the hidden state per token, fp8 with
  per-128 scales) and combine (``k`` bf16 copies) with uniform routing, PP send of hidden + residual per stage
  boundary (sliced over the TP ranks). Cross-node traffic counts bytes leaving one node; the time estimate divides
  by the node's rail bandwidth — a lower bound, not a measurement.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import yaml

from servelab.core.params import ParamError, did_you_mean

from servelab.target.spec import Target

from servelab.target.targets import target_from_dict

GIB = 1024 ** 3

# bytes per parameter including block-scale overhead (see module docstring)
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0,
    "fp8": 1.0 + 4.0 / (128 * 128), "fp8_e4m3": 1.0 + 4.0 / (128 * 128), "int8": 1.0 + 2.0 / 128,
    "nvfp4": 0.5 + 1.0 / 16, "fp4": 0.5 + 1.0 / 16, "mxfp4": 0.5 + 1.0 / 32, "int4": 0.5 + 2.0 / 128,
}
KV_DTYPE_BYTES: dict[str, float] = {"auto": 2.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0,
                                    "fp8_e5m2": 1.0, "fp32": 4.0}


def dtype_bytes(name: str, table: dict[str, float] = DTYPE_BYTES, what: str = "weight dtype") -> float:
    key = str(name).lower()
    if key not in table:
        raise ParamError(f"unknown {what} '{name}'{did_you_mean(key, set(table))}; known: {', '.join(sorted(table))}")
    return table[key]


# ---------------------------------------------------------------- model config

@dataclass
class ModelConfig:
    """The HF ``config.json`` fields the model needs (plus the dtypes of the checkpoint)."""
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 0
    num_key_value_heads: int = 0            # 0 = num_attention_heads
    head_dim: int = 0                       # 0 = hidden_size / num_attention_heads
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0    # 0 = n_shared_experts × moe_intermediate_size
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_qk_norm: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0                   # > 0 = MLA (DeepSeek)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_nextn_predict_layers: int = 0
    weight_dtype: str = "bf16"
    expert_dtype: str = ""                  # "" = weight_dtype
    embedding_dtype: str = "bf16"
    source: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def layer_is_moe(self, i: int) -> bool:
        return self.is_moe and i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1) == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.layer_is_moe(i) for i in range(self.num_hidden_layers))


_HF_ALIASES = {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts",
               "torch_dtype": None, "shared_expert_intermediate_size": "shared_expert_intermediate_size"}


def model_config_from_dict(raw: dict[str, Any], source: str = "<dict>", **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from an HF ``config.json``-like mapping (other keys are ignored)."""
    if not isinstance(raw, dict):
        raise ParamError(f"{source}: a model config must be a mapping")
    known = {f.name for f in fields(ModelConfig)}
    body: dict[str, Any] = {}
    for k, v in {**raw, **overrides}.items():
        k2 = _HF_ALIASES.get(k, k)
        if k2 in known and v is not None:
            body[k2] = v
    if "num_experts" in raw and "n_routed_experts" not in raw:
        body["n_routed_experts"] = raw["num_experts"]
    if "qwen" in str(raw.get("model_type", "")).lower() and raw.get("shared_expert_intermediate_size"):
        body.setdefault("n_shared_experts", 1)
    body.setdefault("name", raw.get("name") or raw.get("_name_or_path") or Path(source).stem)
    for req in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if req not in body:
            raise ParamError(f"{source}: model config lacks '{req}' (HF config.json field)")
    body.setdefault("source", source)
    cfg = ModelConfig(**body)
    if not cfg.is_moe and cfg.intermediate_size <= 0:
        raise ParamError(f"{source}: a dense model needs intermediate_size")
    if cfg.is_moe and (cfg.moe_intermediate_size <= 0 or cfg.num_experts_per_tok <= 0):
        raise ParamError(f"{source}: a MoE model needs moe_intermediate_size and num_experts_per_tok")
    if cfg.is_moe and cfg.first_k_dense_replace > 0 and cfg.intermediate_size <= 0:
        raise ParamError(f"{source}: dense layers (first_k_dense_replace) need intermediate_size")
    if cfg.is_mla and (cfg.qk_rope_head_dim <= 0 or cfg.qk_nope_head_dim <= 0 or cfg.v_head_dim <= 0):
        raise ParamError(f"{source}: an MLA model needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
    for f in ("weight_dtype", "embedding_dtype"):
        dtype_bytes(getattr(cfg, f))
    if cfg.expert_dtype:
        dtype_bytes(cfg.expert_dtype)
    return cfg


def models_dir() -> Path:
    from servelab.core.paths import project_root
    return project_root() / "params" / "models"


def load_model_config(name_or_path: str, **overrides: Any) -> ModelConfig:
    """``params/models/<name>.yaml`` by name, or a path to an HF ``config.json`` / a YAML file."""
    p = Path(name_or_path)
    if not p.exists() and p.suffix not in (".json", ".yaml", ".yml"):
        p = models_dir() / f"{name_or_path}.yaml"
        if not p.exists():
            known = sorted(x.stem for x in models_dir().glob("*.yaml"))
            raise ParamError(f"unknown model config '{name_or_path}'{did_you_mean(name_or_path, known)}; "
                             f"known: {', '.join(known)} (or give a path to a config.json)")
    if not p.exists():
        raise ParamError(f"model config file not found: {p}")
    try:
        raw = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ParamError(f"{p}: not valid {p.suffix[1:].upper()}: {exc}") from exc
    return model_config_from_dict(raw or {}, str(p), **overrides)


# ---------------------------------------------------------------- parameter counts

@dataclass(frozen=True)
class LayerParams:
    """Parameter counts of one decoder layer, split by how they are placed on GPUs."""
    attn_sharded: int         # q/k/v/o (MLA: q_b, kv_b, o) — split over the attention-TP group
    attn_replicated: int      # MLA q_a_proj + kv_a_proj_with_mqa (replicated in SGLang)
    norms: int                # RMSNorm weights (replicated)
    dense_mlp: int            # dense SwiGLU MLP (layers before first_k_dense_replace, or dense models)
    shared_experts: int
    routed_experts: int
    router: int               # gate weight + correction bias (replicated)

    @property
    def total(self) -> int:
        return (self.attn_sharded + self.attn_replicated + self.norms + self.dense_mlp + self.shared_experts
                + self.routed_experts + self.router)


def layer_params(cfg: ModelConfig, i: int) -> LayerParams:
    """Parameters of layer ``i`` (see the module docstring for the formulas)."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    norms = 2 * H
    if cfg.is_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            q_rep, q_sh, norms = H * cfg.q_lora_rank, cfg.q_lora_rank * nh * qk, norms + cfg.q_lora_rank
        else:
            q_rep, q_sh = 0, H * nh * qk
        kv_rep = H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        kv_sh = cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        o = nh * cfg.v_head_dim * H
        norms += cfg.kv_lora_rank
        attn_sh, attn_rep = q_sh + kv_sh + o, q_rep + kv_rep
    else:
        hd, nkv = cfg.hd, cfg.kv_heads
        attn_sh = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
        if cfg.attention_bias:
            attn_sh += nh * hd + 2 * nkv * hd
        attn_rep = 0
        if cfg.use_qk_norm:
            norms += 2 * hd
    if cfg.layer_is_moe(i):
        shared_i = cfg.shared_expert_intermediate_size or cfg.n_shared_experts * cfg.moe_intermediate_size
        return LayerParams(attn_sh, attn_rep, norms, 0, 3 * H * shared_i,
                           cfg.n_routed_experts * 3 * H * cfg.moe_intermediate_size,
                           cfg.n_routed_experts * H + cfg.n_routed_experts)
    return LayerParams(attn_sh, attn_rep, norms, 3 * H * cfg.intermediate_size, 0, 0, 0)


def param_summary(cfg: ModelConfig) -> pd.DataFrame:
    """Total parameters by component (billions), expert vs non-expert, and checkpoint bytes (GiB)."""
    per = [layer_params(cfg, i) for i in range(cfg.num_hidden_layers)]
    wb = dtype_bytes(cfg.weight_dtype)
    eb = dtype_bytes(cfg.expert_dtype or cfg.weight_dtype)
    xb = dtype_bytes(cfg.embedding_dtype)
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    rows = [
        ("attention", sum(p.attn_sharded + p.attn_replicated for p in per), wb, "non-expert"),
        ("dense MLP", sum(p.dense_mlp for p in per), wb, "non-expert"),
        ("shared experts", sum(p.shared_experts for p in per), wb, "non-expert"),
        ("routed experts", sum(p.routed_experts for p in per), eb, "expert"),
        ("router", sum(p.router for p in per), xb, "non-expert"),
        ("norms", sum(p.norms for p in per) + cfg.hidden_size, xb, "non-expert"),
        ("embedding", embed, xb, "non-expert"),
        ("lm_head", head, xb, "non-expert"),
    ]
    df = pd.DataFrame(rows, columns=["component", "params", "bytes_per_param", "kind"])
    df["params_b"] = df["params"] / 1e9
    df["gib"] = df["params"] * df["bytes_per_param"] / GIB
    total = pd.DataFrame([{"component": "total", "params": df["params"].sum(), "bytes_per_param": np.nan,
                           "kind": "all", "params_b": df["params"].sum() / 1e9, "gib": df["gib"].sum()}])
    return pd.concat([df, total], ignore_index=True)


def active_params(cfg: ModelConfig) -> int:
    """Parameters used per token (routed experts counted ``num_experts_per_tok`` of ``n_routed_experts``)."""
    tot = 0
    for i in range(cfg.num_hidden_layers):
        p = layer_params(cfg, i)
        routed = p.routed_experts * cfg.num_experts_per_tok // cfg.n_routed_experts if cfg.is_moe else 0
        tot += p.total - p.routed_experts + routed
    emb = cfg.vocab_size * cfg.hidden_size
    return tot + emb + (0 if cfg.tie_word_embeddings else emb) + cfg.hidden_size


# ---------------------------------------------------------------- layouts and the cluster

@dataclass(frozen=True)
class Layout:
    """A parallel layout in SGLang's terms (see the module docstring)."""
    tp: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    dp_attention: bool = False
    name: str = ""

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [f"TP{self.tp}"] + ([f"PP{self.pp}"] if self.pp > 1 else []) + \
                ([f"DP{self.dp}"] if self.dp > 1 else []) + ([f"EP{self.ep}"] if self.ep > 1 else [])
        return "+".join(parts)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * (1 if self.dp_attention else self.dp)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def groups(self) -> int:
        """Attention groups (DP-attention groups or DP replicas) that split the requests."""
        return self.dp


def parse_layout(text: str) -> Layout:
    """``"TP16"``, ``"TP8+PP2"``, ``"TP16+DP2+EP16"`` (DP = attention DP inside the TP group), ``"TP8xPP2"``."""
    if isinstance(text, Layout):
        return text
    s = str(text).strip()
    parts = [p for p in re.split(r"[+X×,\s]+", s.upper()) if p]
    vals: dict[str, int] = {}
    for p in parts:
        m = re.fullmatch(r"(TP|PP|DP|EP)(\d+)", p)
        if not m:
            raise ParamError(f"layout '{text}': cannot read '{p}'; write e.g. TP16, TP8+PP2, TP16+DP2+EP16")
        if m.group(1) in vals:
            raise ParamError(f"layout '{text}': {m.group(1)} given twice")
        vals[m.group(1)] = int(m.group(2))
    if "TP" not in vals:
        raise ParamError(f"layout '{text}': needs a TP degree (TP1 for none)")
    return Layout(tp=vals["TP"], pp=vals.get("PP", 1), dp=vals.get("DP", 1), ep=vals.get("EP", 1),
                  dp_attention=vals.get("DP", 1) > 1, name=s)


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def cluster_from_target(target: Target, gpus_per_node: int = 0) -> Cluster:
    """Nodes × GPUs per node of a target (``gpus`` of its first node unless given). Reads the YAML only."""
    g = gpus_per_node or (target.nodes[0].gpus if target.nodes else 0)
    if g <= 0:
        raise ParamError(f"target '{target.name}' does not say how many GPUs its nodes have (nodes[].gpus); "
                         f"pass gpus_per_node")
    return Cluster(target.name, len(target.nodes) or 1, g)


def seed_layouts(cluster: Cluster) -> list[Layout]:
    """The seeds' three layouts for this cluster: TP over all GPUs, TP per node + PP over nodes, attention DP per
    node + EP over all GPUs."""
    g, n = cluster.gpus, cluster.nodes
    out = [Layout(tp=g, name=f"TP{g}")]
    if n > 1:
        out.append(Layout(tp=g // n, pp=n, name=f"TP{g // n}+PP{n}"))
        out.append(Layout(tp=g, dp=n, ep=g, dp_attention=True, name=f"TP{g}+DP{n}+EP{g}"))
    return out


def layout_problems(cfg: ModelConfig, lay: Layout, cluster: Cluster) -> list[str]:
    """Structural reasons a layout cannot run this model on this cluster (empty = none)."""
    p = []
    if min(lay.tp, lay.pp, lay.dp, lay.ep) < 1:
        p.append("degrees must be ≥ 1")
        return p
    if lay.gpus > cluster.gpus:
        p.append(f"needs {lay.gpus} GPUs, the cluster has {cluster.gpus}")
    if lay.dp_attention and lay.tp % lay.dp:
        p.append(f"DP attention needs tp ({lay.tp}) divisible by dp ({lay.dp})")
    if cfg.num_attention_heads % lay.attn_tp:
        p.append(f"{cfg.num_attention_heads} attention heads do not split over attention TP {lay.attn_tp}")
    if lay.ep > 1:
        if not cfg.is_moe:
            p.append("expert parallelism needs a MoE model")
        elif lay.tp % lay.ep:
            p.append(f"ep ({lay.ep}) must divide tp ({lay.tp})")
        elif cfg.n_routed_experts % lay.ep:
            p.append(f"{cfg.n_routed_experts} experts do not split over EP {lay.ep}")
    if lay.pp > cfg.num_hidden_layers:
        p.append(f"pp {lay.pp} > {cfg.num_hidden_layers} layers")
    return p


def pp_partition(num_layers: int, pp: int) -> list[range]:
    """Layer ranges per stage as vLLM/SGLang ``get_pp_indices``: equal split, remainder to the stages before the last."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


def engine_launch_settings(lay: Layout, engine: str) -> dict[str, Any]:
    """The target ``launch:`` keys that express ``lay`` for ``engine``."""
    if engine == "vllm":
        tp = lay.attn_tp if lay.dp_attention else lay.tp
        return {"tp_size": tp, "pp_size": lay.pp, "dp_size": lay.dp, "ep_size": lay.ep, "dp_attention": False}
    return {"tp_size": lay.tp, "pp_size": lay.pp, "dp_size": lay.dp, "ep_size": lay.ep,
            "dp_attention": bool(lay.dp_attention)}


# ---------------------------------------------------------------- memory

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


# ---------------------------------------------------------------- communication

@dataclass(frozen=True)
class CommInputs:
    tokens: int = 64                    # tokens in one step (decode: running requests; prefill: chunk size)
    act_bytes: float = 2.0              # bf16 activations
    dispatch_bytes: float = 1.0 + 4.0 / 128   # EP dispatch in fp8 with an fp32 scale per 128 (DeepEP)
    node_dedup: bool = False            # EP: a token crosses to a node once (DeepEP normal mode) vs once per expert
    internode_gbps_per_node: float = 800.0    # rails × line rate (seeds: 2 × 400G RoCE)


def _nodes_spanned(first_rank: int, size: int, gpn: int) -> int:
    return len({r // gpn for r in range(first_rank, first_rank + size)})


def comm_table(cfg: ModelConfig, lay: Layout, cluster: Cluster, comm: CommInputs) -> pd.DataFrame:
    """Collectives of one step (``comm.tokens`` tokens through every layer) for one layout.

    Columns: ``collective, group, group_size, spans_nodes, calls_per_step, message_bytes_per_token,
    message_bytes`` (one call), ``gpu_send_bytes_per_step`` (what one GPU sends), ``node_egress_bytes_per_step``
    (bytes leaving one node, the cross-node traffic).
    """
    H, T, gpn = cfg.hidden_size, comm.tokens, cluster.gpus_per_node
    rows: list[dict[str, Any]] = []
    tokens_group = T / max(lay.groups, 1)
    att_span = _nodes_spanned(0, lay.attn_tp, gpn)
    tp_span = _nodes_spanned(0, lay.tp, gpn)
    # a GPU runs the layers of its own pipeline stage: per-GPU counts come from the busiest stage
    stages = pp_partition(cfg.num_hidden_layers, lay.pp)
    attn_layers = max(len(s) for s in stages)
    dense_layers = max(sum(not cfg.layer_is_moe(i) for i in s) for s in stages)
    moe_layers = max(sum(cfg.layer_is_moe(i) for i in s) for s in stages)

    def ring(name: str, group: str, n: int, span: int, calls: int, per_token: float, tokens: float) -> None:
        if n <= 1 or calls == 0:
            return
        msg = per_token * tokens
        send = 2 * (n - 1) / n * msg
        rows.append({"collective": name, "group": group, "group_size": n, "spans_nodes": span,
                     "calls_per_step": calls, "message_bytes_per_token": per_token, "message_bytes": msg,
                     "gpu_send_bytes_per_step": send * calls,
                     "node_egress_bytes_per_step": (send if span > 1 else 0.0) * calls})

    ring("all-reduce (attention out)", f"attention TP{lay.attn_tp}", lay.attn_tp, att_span,
         attn_layers, H * comm.act_bytes, tokens_group)
    ffn_dp_gather = lay.dp_attention and lay.groups > 1
    ffn_name = "all-gather + reduce-scatter (DP attention ↔ TP FFN)" if ffn_dp_gather else "all-reduce (FFN out)"
    ring(ffn_name + " dense", f"TP{lay.tp}", lay.tp, tp_span, dense_layers, H * comm.act_bytes,
         T if ffn_dp_gather else tokens_group)
    if moe_layers:
        if lay.ep > 1:
            ep_span = _nodes_spanned(0, lay.ep, gpn)
            k = cfg.num_experts_per_tok
            remote = (lay.ep - 1) / lay.ep
            tokens_per_gpu = T / lay.ep
            if comm.node_dedup and ep_span > 1:
                cross_copies = (ep_span - 1) * (1 - (1 - 1 / ep_span) ** k)   # distinct remote nodes per token
            else:
                cross_copies = k * (ep_span - 1) / ep_span
            for name, per_copy in (("all-to-all dispatch (EP)", comm.dispatch_bytes), ("all-to-all combine (EP)",
                                                                                       comm.act_bytes)):
                send = tokens_per_gpu * k * remote * H * per_copy
                egress = (T / ep_span) * cross_copies * H * per_copy if ep_span > 1 else 0.0
                rows.append({"collective": name, "group": f"EP{lay.ep}", "group_size": lay.ep, "spans_nodes": ep_span,
                             "calls_per_step": moe_layers, "message_bytes_per_token": k * H * per_copy,
                             "message_bytes": tokens_per_gpu * k * H * per_copy,
                             "gpu_send_bytes_per_step": send * moe_layers,
                             "node_egress_bytes_per_step": egress * moe_layers})
        else:
            ring(ffn_name + " MoE", f"TP{lay.tp}", lay.tp, tp_span, moe_layers, H * comm.act_bytes,
                 T if ffn_dp_gather else tokens_group)
    if lay.pp > 1:
        per_token = 2 * H * comm.act_bytes           # hidden + residual
        msg = per_token * T
        stage_gpus = lay.tp
        boundary_cross = sum(1 for s in range(lay.pp - 1)
                             if ((s + 1) * stage_gpus - 1) // gpn != ((s + 1) * stage_gpus) // gpn)
        rows.append({"collective": "send/recv (PP stage boundary)", "group": f"PP{lay.pp}", "group_size": lay.pp,
                     "spans_nodes": _nodes_spanned(0, lay.gpus, gpn), "calls_per_step": lay.pp - 1,
                     "message_bytes_per_token": per_token, "message_bytes": msg,
                     "gpu_send_bytes_per_step": msg / stage_gpus * (lay.pp - 1),
                     "node_egress_bytes_per_step": msg if boundary_cross else 0.0})
    df = pd.DataFrame(rows, columns=["collective", "group", "group_size", "spans_nodes", "calls_per_step",
                                     "message_bytes_per_token", "message_bytes", "gpu_send_bytes_per_step",
                                     "node_egress_bytes_per_step"])
    df.insert(0, "layout", lay.label)
    return df


def comm_summary(tables: Sequence[pd.DataFrame], comm: CommInputs) -> pd.DataFrame:
    """Per layout: bytes one GPU sends per step, bytes leaving a node per step, and the cross-node time they
    need at the node's rail bandwidth (a lower bound from the model, never a measurement)."""
    rows = []
    for t in tables:
        if t.empty:
            continue
        egress = float(t["node_egress_bytes_per_step"].sum())
        rows.append({"layout": t["layout"].iloc[0], "tokens_per_step": comm.tokens,
                     "gpu_send_mib_per_step": t["gpu_send_bytes_per_step"].sum() / 2**20,
                     "cross_node_mib_per_step": egress / 2**20,
                     "cross_node_collectives_per_step": int(t.loc[t["node_egress_bytes_per_step"] > 0,
                                                                  "calls_per_step"].sum()),
                     "cross_node_ms_lower_bound": egress * 8 / (comm.internode_gbps_per_node * 1e9) * 1e3})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- launch commands

def layout_target(base: Target, lay: Layout) -> Target:
    """A copy of ``base`` whose launch settings express ``lay`` (validated like any target file)."""
    raw = asdict(base)
    raw.pop("source", None)
    raw["launch"] = {**base.launch, **engine_launch_settings(lay, base.engine)}
    if raw["launch"].get("docker", {}).get("name"):
        raw["launch"]["docker"] = {**raw["launch"]["docker"],
                                   "name": re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{raw['launch']['docker']['name']}-{lay.label}")}
    raw["name"] = f"{base.name}-{re.sub(r'[^A-Za-z0-9]+', '', lay.label.lower())}"
    return target_from_dict(raw, f"{base.source or base.name} with layout {lay.label}")


def launch_commands(base: Target, layouts: Sequence[Layout]) -> pd.DataFrame:
    """One row per layout and node: the engine adapter's launch argv for that layout (never executed here)."""
    from servelab.target.engines import engine_for
    rows = []
    for lay in layouts:
        t = layout_target(base, lay)
        for plan in engine_for(t.engine).launch_plans(t, t.port or 30000):
            rows.append({"layout": lay.label, "node": plan.node, "argv": plan.argv, "env": plan.env,
                         "command": plan.shell()})
    return pd.DataFrame(rows, columns=["layout", "node", "argv", "env", "command"])


# ---------------------------------------------------------------- measured comparison

def layout_of_manifest(manifest: dict[str, Any]) -> Layout:
    """The layout a run used, from its manifest's ``launch.settings``."""
    la = (manifest.get("launch") or {}).get("settings") or {}
    lay = Layout(tp=int(la.get("tp_size", 1)), pp=int(la.get("pp_size", 1)), dp=int(la.get("dp_size", 1)),
                 ep=int(la.get("ep_size", 1)), dp_attention=bool(la.get("dp_attention", False)))
    return lay


def measured_comparison(runs: Sequence[str | Path], feas: pd.DataFrame | None = None,
                        comm: pd.DataFrame | None = None, k: float = 2.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measured TTFT / TPOT / TPS per layout and case from run summaries, next to the modelled memory and comm.

    The first run is the baseline (the seeds keep TP16 as the reference). Returns ``(table, verdicts)``:
    ``table`` one row per run × case (means over repeats, CV of output TPS); ``verdicts`` one row per layout:
    ``recommended`` (faster outside the noise band on output TPS in most shared cases and no latency regression
    outside noise), ``not recommended`` (slower or a latency regression outside noise, or does not fit), ``no
    evidence`` (all changes within noise), ``confounded — no conclusion`` (the manifests differ in more than the
    layout keys, see :func:`servelab.measure.abtest.diff_manifests`), with the evidence as text.
    """
    from servelab.measure.abtest import compare_cases, diff_manifests, load_run, read_case_summaries
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
                 "evidence": "reference layout (seeds §9.1: TP16 stays the baseline)"}]
    layout_keys = ["launch.settings." + k for k in ("tp_size", "pp_size", "dp_size", "ep_size", "dp_attention")]
    for ref, lay, s, _ in per_run[1:]:
        diff = diff_manifests([base_ref, ref], layout_keys)
        confounds = diff[diff["status"] == "confound"]["key"].tolist() if not diff.empty else []
        if confounds:   # seeds §16: only the layout may change between the compared runs
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
        ev = [f"output TPS: {better} better / {worse_tps} worse / "
              f"{int((tps['verdict'] == 'within noise').sum())} within noise of {len(tps)} cases"]
        ev += [f"{r.case_id} {r.metric} {r.delta_pct:+.1f} % (band ±{r.noise_band_pct:.1f} %)" for r in worse_lat.itertuples()]
        if not fits:
            verdict = "not recommended"
            ev.insert(0, "the memory model says it does not fit")
        elif worse_tps or len(worse_lat):
            verdict = "not recommended"
        elif len(tps) and better > len(tps) / 2:
            verdict = "recommended"
        else:
            verdict = "no evidence"
        verdicts.append({"layout": lay.label, "run_id": ref.run_id, "verdict": verdict, "evidence": "; ".join(ev)})
    return table, pd.DataFrame(verdicts)


# ---------------------------------------------------------------- figures

def memory_figure(feas: pd.DataFrame) -> go.Figure:
    """Stacked bars per layout (worst stage): non-expert weights, expert weights, KV demand, against the budget."""
    fig = go.Figure()
    for col, name in (("weights_nonexpert_gib", "weights: non-expert"), ("weights_expert_gib", "weights: experts"),
                      ("kv_demand_gib", "KV cache demand")):
        fig.add_trace(go.Bar(x=feas["layout"], y=feas[col], name=name,
                             hovertemplate="%{x}<br>" + name + ": %{y:.1f} GiB<extra></extra>"))
    if not feas.empty:
        fig.add_trace(go.Scatter(x=feas["layout"], y=feas["budget_gib"], mode="lines+markers", name="budget "
                                 "(GPU memory × mem_fraction)", line=dict(dash="dash", color="black")))
    fig.update_layout(barmode="stack", title="Memory per GPU by layout (worst pipeline stage)",
                      yaxis_title="GiB per GPU", height=440)
    for _, r in feas.iterrows():
        if r["verdict"] != "fits":
            fig.add_annotation(x=r["layout"], y=r["need_gib"], text="does not fit" if "fit" in r["verdict"] else "invalid",
                               showarrow=False, yshift=12, font=dict(color="#c0392b"))
    return fig


def comm_figure(tables: Sequence[pd.DataFrame]) -> go.Figure:
    """Bytes per step by collective and layout: what one GPU sends, and what leaves a node (cross-node)."""
    df = pd.concat([t for t in tables if not t.empty], ignore_index=True) if tables else pd.DataFrame()
    fig = go.Figure()
    if df.empty:
        return fig
    palette = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d")
    for i, (coll, part) in enumerate(df.groupby("collective", sort=False)):
        color = palette[i % len(palette)]
        fig.add_trace(go.Bar(x=part["layout"], y=part["gpu_send_bytes_per_step"] / 2**20, name=coll,
                             offsetgroup="gpu", legendgroup=coll, marker_color=color,
                             hovertemplate="%{x}<br>" + coll + "<br>%{y:.2f} MiB sent per GPU<extra></extra>"))
        fig.add_trace(go.Bar(x=part["layout"], y=part["node_egress_bytes_per_step"] / 2**20, name=coll,
                             offsetgroup="node", legendgroup=coll, showlegend=False, marker_color=color,
                             marker_pattern_shape="/",
                             hovertemplate="%{x}<br>" + coll + "<br>%{y:.2f} MiB leaving a node<extra></extra>"))
    fig.update_layout(barmode="stack", title="Communication per step by layout: left bar = sent per GPU, "
                      "hatched = cross-node per node", yaxis_title="MiB per step", height=460)
    return fig


# ---------------------------------------------------------------- Phase 4 composition

@dataclass
class Phase4Result:
    model: ModelConfig
    cluster: Cluster
    params: pd.DataFrame
    memory: pd.DataFrame
    feasibility: pd.DataFrame
    comm: list[pd.DataFrame]
    comm_summary: pd.DataFrame
    launch: pd.DataFrame
    measured: pd.DataFrame = field(default_factory=pd.DataFrame)
    verdicts: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def comm_all(self) -> pd.DataFrame:
        return pd.concat(self.comm, ignore_index=True) if self.comm else pd.DataFrame()


def run_phase4(ctx: Any, model_config: str, cluster_target: str, layouts: Sequence[str] = (),
               gpu_memory_gib: float = 96.0, mem_fraction: float | None = None, context_tokens: int = 0,
               concurrency: int = 16, decode_tokens: int = 0, runs: Sequence[str] = (),
               internode_gbps_per_node: float = 800.0) -> Phase4Result:
    """Phase 4 in one call. Reads the cluster's target YAML (never connects), models every layout, records each
    layout's launch commands as ``planned`` (never executed here) and compares measured runs when given.

    Defaults from the cluster target: ``mem_fraction`` and ``context_tokens`` from its launch settings;
    ``decode_tokens`` = ``concurrency``. Writes ``feasibility.csv``, ``memory.csv``, ``comm.csv`` and
    ``launch_commands.csv`` in the phase folder.
    """
    from servelab.target.targets import load_target
    from servelab.phases.context import log_command
    cfg = load_model_config(model_config)
    base = load_target(cluster_target)
    cluster = cluster_from_target(base)
    lays = [parse_layout(x) for x in layouts] if layouts else seed_layouts(cluster)
    mem = MemoryInputs(gpu_memory_gib=gpu_memory_gib,
                       mem_fraction=mem_fraction if mem_fraction is not None else float(base.launch.get("mem_fraction", 0.88)),
                       context_tokens=context_tokens or int(base.launch.get("context_length", 32768)),
                       concurrency=concurrency, kv_cache_dtype=str(base.launch.get("kv_cache_dtype", "auto")))
    memory = memory_table(cfg, lays, cluster, mem)
    feas = feasibility(memory)
    comm_in = CommInputs(tokens=decode_tokens or concurrency, internode_gbps_per_node=internode_gbps_per_node)
    comms = [comm_table(cfg, lay, cluster, comm_in) for lay in lays]
    summary = comm_summary(comms, comm_in)
    valid = [lay for lay in lays if not layout_problems(cfg, lay, cluster)]
    launch = launch_commands(base, valid)
    for _, r in launch.iterrows():
        log_command(ctx, "planned", r["argv"], title=f"launch {r['layout']} on {r['node']}", host=r["node"],
                    env=r["env"], note="Phase 4 layout candidate; not executed by this notebook")
    res = Phase4Result(cfg, cluster, param_summary(cfg), memory, feas, comms, summary, launch)
    if runs:
        res.measured, res.verdicts = measured_comparison(runs, feas, summary)
        res.measured.to_csv(ctx.phase_dir / "measured.csv", index=False)
        res.verdicts.to_csv(ctx.phase_dir / "verdicts.csv", index=False)
    feas.to_csv(ctx.phase_dir / "feasibility.csv", index=False)
    memory.to_csv(ctx.phase_dir / "memory.csv", index=False)
    res.comm_all.to_csv(ctx.phase_dir / "comm.csv", index=False)
    summary.to_csv(ctx.phase_dir / "comm_summary.csv", index=False)
    launch.drop(columns=["argv", "env"]).to_csv(ctx.phase_dir / "launch_commands.csv", index=False)
    return res


def launch_table(res: Phase4Result) -> pd.DataFrame:
    """The planned launch commands per layout and node (recorded as ``planned``; never executed here)."""
    return res.launch[["layout", "node", "command"]].assign(label="planned (not executed)")


def measured_view(res: Phase4Result):
    """The measured comparison table, or a banner saying that no measurement exists yet."""
    from servelab.report.banner import banner
    if res.measured.empty:
        return banner("No measured run was given (parameter runs), so this page holds the model only: no layout is "
                      "recommended or rejected on evidence yet. Launch each feasible layout with the planned commands "
                      "above, run Phase 1 on it, and pass the run ids here (the TP16 baseline first).", "warning",
                      "No measurement exists yet")
    return res.measured


def verdicts_view(res: Phase4Result):
    """Recommended / not recommended per layout with the evidence, or the banner when nothing was measured."""
    return res.verdicts if not res.verdicts.empty else measured_view(res)
