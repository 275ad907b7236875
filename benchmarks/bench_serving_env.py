"""Build the reference client SGLang ``bench_serving`` 0.5.9 in its own venv, and a HF tokenizer for a GGUF.

SGLang's ``bench_serving`` is a *reference* for conformance tests and the client-overhead benchmark only;
servelab never imports it. 0.5.9 is the last release whose ``sglang.bench_serving`` is self-contained
(0.5.23's shim imports ``sglang.srt``, which needs torch/zmq/triton): ``pip install --no-deps sglang==0.5.9``
plus the packages it imports (see ``BENCH_PACKAGES``). The venv lives in ``<servelab cache>/bench-serving/``
and is built once (file lock against concurrent builds); ``ok`` marks a finished build.

bench_serving needs a local HF tokenizer directory. For a GGUF model we build one from the vocabulary stored in
the GGUF (PyPI ``gguf`` reads it; a ``tokenizers`` Unigram model with the GGUF's scores and byte fallback,
SentencePiece-style "\u2581" spaces and BOS) — ``transformers``' own GGUF import needs torch, which this venv
does not have. For the tiny test model (one token per character) the ids equal llama-server's ``/tokenize``
exactly (checked by the tests); for larger SPM vocabularies it is an approximation. No hub is contacted.

    python benchmarks/bench_serving_env.py            # build the venv, print its python
    python benchmarks/bench_serving_env.py MODEL.gguf OUT_DIR   # also convert a GGUF tokenizer
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
from servelab.core.paths import cache_root  # noqa: E402

SGLANG_VERSION = "0.5.9"
BENCH_PACKAGES = ["aiohttp", "numpy", "pybase64", "requests", "datasets", "pillow", "tqdm", "transformers",
                  "ipython", "gguf", "sentencepiece", "protobuf"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


class BenchEnvError(RuntimeError):
    """The reference client's venv or tokenizer could not be built (the message says which step)."""


def venv_dir() -> Path:
    return cache_root() / "bench-serving" / f"sglang-{SGLANG_VERSION}"


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 1200) -> None:
    with open(log, "ab") as f:
        f.write(("\n$ " + " ".join(argv) + "\n").encode())
        f.flush()
        p = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                           env={**os.environ, **(env or {})})
    if p.returncode != 0:
        raise BenchEnvError(f"step failed: {' '.join(argv)} (log {log}):\n{log.read_text(errors='replace')[-2000:]}")


def ensure_bench_serving() -> Path:
    """The python of a venv holding ``sglang.bench_serving`` 0.5.9 (built on first call, ~1-3 min)."""
    d = venv_dir()
    py = d / "bin" / "python"
    if (d / "ok").exists() and py.exists():
        return py
    d.parent.mkdir(parents=True, exist_ok=True)
    log = d.parent / f"build-sglang-{SGLANG_VERSION}.log"
    with open(d.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / "ok").exists() and py.exists():
            return py
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", "--clear", str(d)], log)
        _run([str(py), "-m", "pip", "install", "-q", "--no-deps", f"sglang=={SGLANG_VERSION}"], log)
        _run([str(py), "-m", "pip", "install", "-q", *BENCH_PACKAGES], log)
        _run([str(py), "-c", "import sglang.bench_serving"], log, env=OFFLINE_ENV)
        (d / "ok").write_text(SGLANG_VERSION + "\n")
    return py


CONVERT = """
import sys
from pathlib import Path
import gguf
from tokenizers import Tokenizer, decoders, normalizers, processors
from tokenizers.models import Unigram
from transformers import PreTrainedTokenizerFast
r = gguf.GGUFReader(sys.argv[1])
def field(name):
    f = r.fields[name]
    return [f.parts[i] for i in f.data]
toks = [bytes(x).decode("utf-8", errors="replace") for x in field("tokenizer.ggml.tokens")]
scores = [float(x[0]) for x in field("tokenizer.ggml.scores")]
def scalar(name, default):
    return int(field(name)[0][0]) if name in r.fields else default
bos, eos, unk = scalar("tokenizer.ggml.bos_token_id", 1), scalar("tokenizer.ggml.eos_token_id", 2), scalar("tokenizer.ggml.unknown_token_id", 0)
add_prefix = bool(scalar("tokenizer.ggml.add_space_prefix", 1))
tk = Tokenizer(Unigram([(t, s) for t, s in zip(toks, scores)], unk_id=unk, byte_fallback=True))
norm = [normalizers.Replace(" ", "\u2581")]
if add_prefix:
    norm.insert(0, normalizers.Prepend("\u2581"))
tk.normalizer = normalizers.Sequence(norm)
tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                               + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
tk.post_processor = processors.TemplateProcessing(single=f"{toks[bos]} $A", pair=f"{toks[bos]} $A $B",
                                                  special_tokens=[(toks[bos], bos)])
fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=toks[bos], eos_token=toks[eos], unk_token=toks[unk])
fast.save_pretrained(sys.argv[2])
print(len(fast))
"""


def ensure_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> Path:
    """A HF tokenizer directory converted from the tokenizer inside ``gguf_path`` (cached in ``out_dir``)."""
    out_dir = Path(out_dir)
    if (out_dir / "tokenizer_config.json").exists():
        return out_dir
    py = ensure_bench_serving()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log = out_dir.parent / f"convert-{out_dir.name}.log"
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    _run([str(py), "-c", CONVERT, str(gguf_path), str(tmp)], log, env=OFFLINE_ENV, timeout=600)
    os.replace(tmp, out_dir)
    return out_dir


if __name__ == "__main__":
    print(ensure_bench_serving())
    if len(sys.argv) == 3:
        print(ensure_gguf_tokenizer(Path(sys.argv[1]), Path(sys.argv[2])))


def bench_serving_argv(py: Path, base_url: str, model: str, tokenizer: Path, input_len: int, output_len: int,
                       num_prompts: int, concurrency: int, out_file: Path, backend: str = "vllm",
                       extra: list[str] | None = None) -> list[str]:
    """The argv of one ``sglang.bench_serving`` run on fixed-length ``random-ids`` prompts (range ratio 1)."""
    return [str(py), "-m", "sglang.bench_serving", "--backend", backend, "--base-url", base_url, "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random-ids", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "1.0", "--num-prompts",
            str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--output-file", str(out_file), "--disable-tqdm", *(extra or [])]


def run_bench_serving(argv: list[str], out_file: Path, timeout_s: float = 600, cpu_list: str | None = None
                      ) -> dict:
    """Run bench_serving (optionally pinned with ``taskset -c``); returns the last JSONL object it appended."""
    cmd = (["taskset", "-c", cpu_list] if cpu_list else []) + argv
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **OFFLINE_ENV})
    if p.returncode != 0:
        raise BenchEnvError(f"bench_serving failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    import json
    lines = [ln for ln in Path(out_file).read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1])
