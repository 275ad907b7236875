"""Write a tiny random-weight HF Qwen2-MoE and the same byte-level BPE tokenizer as ``make_tiny_hf.py`` into OUT_DIR.

Usage: <python with torch, transformers, tokenizers> make_tiny_moe_hf.py OUT_DIR [--seed N]

Run by ``servelab.deploy.models.make_tiny_moe_model`` with the sglang-cpu venv's interpreter. Nothing is downloaded.
Deterministic for a given seed.

- Tokenizer, embeddings and output layer: those of ``make_tiny_hf.py`` (imported from it): sampling never leaves
  printable ASCII and ``logit_bias {eos: 100}`` makes EOS near certain.
- Model: ``Qwen2MoeForCausalLM``, hidden 128, 2 layers, 2 heads of 64, float32; every layer's MLP is a sparse MoE
  block of 8 experts (SwiGLU, intermediate 64) with top-2 routing (top-k weights renormalised) and **no shared
  expert** (``shared_expert_intermediate_size`` 0). Why this shape, as seen with SGLang 0.5.23 on CPU:
  Qwen2-MoE because SGLang's expert-distribution recorder needs the model class to describe its expert layout
  (``get_model_config_for_expert_location``; Mixtral and OLMoE lack it and the recorder refuses them at start); no
  shared expert because SGLang applies Qwen2-MoE's shared-expert gate with a Triton kernel
  (``fused_gate_sigmoid_mul_add``) even on CPU, where Triton has no driver ("0 active drivers"). The routed
  experts take SGLang's torch path (``fused_moe_native.moe_forward_native``; its AMX backend is off).
- Router: random like every other weight, but with a larger spread (std 0.5) on the router's column 0, the residual
  dimension the embeddings hold at 1: that column acts as a fixed per-expert bias, so some experts are preferred
  for every token, as trained routers often are. How unevenly tokens actually land on experts is what SGLang's
  expert-distribution recorder measures; nothing here fixes the counts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))       # make_tiny_hf.py beside this file, also under python -P / -I
from make_tiny_hf import build_tokenizer, output_layers, random_weights, save_tokenizer, weights_sha256  # noqa: E402

HIDDEN, LAYERS, HEADS = 128, 2, 2
EXPERTS, TOP_K, MOE_FF, SHARED_FF = 8, 2, 64, 0
ROUTER_BIAS_STD = 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(args.seed)
    vocab, unk, bos, eos, allowed = save_tokenizer(tok, out)

    torch.manual_seed(args.seed)
    cfg = Qwen2MoeConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=MOE_FF, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False,
                         decoder_sparse_step=1, mlp_only_layers=[], num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         moe_intermediate_size=MOE_FF, shared_expert_intermediate_size=SHARED_FF, norm_topk_prob=True,
                         use_sliding_window=False, torch_dtype="float32")
    model = Qwen2MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        random_weights(model, g)
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight            # (experts, hidden): router logits = h @ gate.T
            gate[:, 0] = torch.randn(EXPERTS, generator=g) * ROUTER_BIAS_STD
        output_layers(model, g, allowed, eos)
    model.save_pretrained(out, safe_serialization=True)
    digest = weights_sha256(out)
    gen = hashlib.sha256(Path(__file__).read_bytes() + (HERE / "make_tiny_hf.py").read_bytes()).hexdigest()
    info = {"name": "servelab-tiny-random-qwen2-moe-hf", "seed": args.seed, "vocab_size": vocab, "bos_id": bos,
            "eos_id": eos, "unk_id": unk, "hidden_size": HIDDEN, "num_layers": LAYERS, "num_heads": HEADS,
            "head_dim": HIDDEN // HEADS, "num_experts": EXPERTS, "top_k": TOP_K, "moe_intermediate_size": MOE_FF,
            "router_bias_std": ROUTER_BIAS_STD,
            "parameters": sum(p.numel() for p in model.parameters()), "allowed_ids": allowed,
            "weights_sha256": digest, "generator_sha256": gen, "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    (out / "servelab.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
