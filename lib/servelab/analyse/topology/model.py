"""The model side of the topology model: HF config fields, parameter counts per layer and component, bytes per
weight by dtype (block-scale overhead included). Formulas in :mod:`servelab.analyse.topology`."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from servelab.core.params import ParamError, did_you_mean
from servelab.core.paths import project_root

GIB = 1024 ** 3

# bytes per parameter including block-scale overhead (see the package docstring)
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
