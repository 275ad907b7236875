"""Workloads with exact token counts: unique random prompts, exact output lengths, shared-prefix groups.

Input length is exact by construction where the engine accepts token-id prompts (``"prompt": [ids]`` on
llama.cpp, vLLM and SGLang ``/v1/completions``; ``input_ids`` on SGLang ``/generate``): no BOS is added to
an id prompt, so the server's ``usage.prompt_tokens`` equals ``len(ids)``. Chat requests need text; a text
prompt is built and then *verified* with the engine's tokenize endpoint until its count is exact.

Ids are drawn from a pool of ordinary vocabulary ids that the engine itself produced when tokenizing
random words (so no special/control/image token is ever sent). Every prompt starts with a block that
encodes its index in base ``len(pool)``: two prompts of a workload never share their first tokens, so the
prefix cache cannot help unless a shared-prefix group is asked for.

Output length is forced per engine: ``ignore_eos`` + ``max_tokens`` (llama.cpp, SGLang), ``min_tokens`` +
``max_tokens`` (vLLM). Achieved counts are checked against the server's ``usage`` by ``metrics``.
Everything is seeded (``numpy.random.default_rng``).
"""
from __future__ import annotations

import string
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from servelab.deploy.engines import engine_for
from servelab.deploy.server import http_json

TokenizeFn = Callable[[str, bool], list[int]]


class WorkloadError(ValueError):
    """A workload cannot be built as asked (e.g. an exact text length the tokenizer cannot reach)."""


@dataclass
class RequestSpec:
    """One request of a workload: its prompt (ids or text), exact lengths and its prefix group."""
    index: int
    input_tokens: int                  # expected prompt tokens as the server counts them (None-free: exact)
    output_tokens: int                 # requested = forced output length
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    group: int | None = None           # shared-prefix group, None = unique prompt
    shared_prefix_tokens: int = 0      # tokens shared with the other members of its group
    role: str = "measure"              # measure | warmup | inject | background

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        # keep raw files small: the prompt itself is reproducible from the seed
        d["prompt_ids_len"] = len(self.prompt_ids) if self.prompt_ids is not None else None
        d.pop("prompt_ids")
        d["prompt_text_chars"] = len(self.prompt_text) if self.prompt_text is not None else None
        d.pop("prompt_text")
        return d


@dataclass
class Workload:
    """A list of requests plus how it was made (seed, pool size, prefix layout)."""
    name: str
    requests: list[RequestSpec]
    seed: int
    pool_size: int
    prompt_kind: str                   # ids | text
    notes: list[str] = field(default_factory=list)

    @property
    def expected_input_tokens(self) -> int:
        return sum(r.input_tokens for r in self.requests)

    @property
    def expected_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)


# ---------------------------------------------------------------- engine tokenize endpoints

def tokenize_body(engine: str, text: str, add_special: bool) -> dict[str, Any]:
    """The body of the engine's tokenize endpoint (``EngineAdapter.tokenize_body``)."""
    return engine_for(engine).tokenize_body(text, add_special)


def engine_tokenizer(base_url: str, engine: str, tokenize_path: str, timeout_s: float = 60.0,
                     headers: dict[str, str] | None = None) -> TokenizeFn:
    """A ``tokenize(text, add_special) -> ids`` function backed by the running engine."""
    adapter = engine_for(engine)

    def tokenize(text: str, add_special: bool) -> list[int]:
        status, body = http_json(base_url + tokenize_path, adapter.tokenize_body(text, add_special),
                                 timeout=timeout_s, headers=headers)
        if status != 200 or not isinstance(body, dict) or "tokens" not in body:
            raise WorkloadError(f"{base_url}{tokenize_path}: tokenize failed (HTTP {status}): {str(body)[:200]}")
        toks = body["tokens"]
        # llama.cpp may return [{"id":..,"piece":..}] when with_pieces is set; we never set it
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in toks]
    return tokenize


def random_words(rng: np.random.Generator, n_words: int) -> str:
    """Seeded random 'words' of letters and digits, joined by spaces (ASCII, tokenizer-neutral)."""
    alphabet = np.array(list(string.ascii_letters + string.digits))
    lens = rng.integers(2, 9, size=n_words)
    idx = rng.integers(0, len(alphabet), size=int(lens.sum()))
    chars = alphabet[idx]
    out, pos = [], 0
    for n in lens:
        out.append("".join(chars[pos:pos + n]))
        pos += n
    return " ".join(out)


def token_pool(tokenize: TokenizeFn, seed: int = 0, n_words: int = 4000) -> list[int]:
    """Distinct ordinary vocabulary ids: what the engine produced for random words (no special tokens)."""
    rng = np.random.default_rng(seed)
    ids = tokenize(random_words(rng, n_words), False)
    pool = sorted(set(ids))
    if len(pool) < 2:
        raise WorkloadError(f"token pool too small ({len(pool)} distinct ids) — is the tokenize endpoint sane?")
    return pool


# ---------------------------------------------------------------- prompts

def unique_head(index: int, pool: list[int], width: int) -> list[int]:
    """``index`` written in base ``len(pool)`` with ``width`` digits, most significant digit last.

    The least significant digit comes first so that consecutive prompts differ in their very first token.
    """
    base = len(pool)
    out = []
    for _ in range(width):
        out.append(pool[index % base])
        index //= base
    return out


def head_width(n_requests: int, pool_size: int) -> int:
    width, cap = 1, pool_size
    while cap < n_requests:
        width += 1
        cap *= pool_size
    return width


def id_prompts(n: int, input_tokens: int, pool: list[int], rng: np.random.Generator, start_index: int = 0,
               prefix_groups: int = 0, prefix_tokens: int = 0) -> list[tuple[list[int], int | None]]:
    """``n`` token-id prompts of exactly ``input_tokens`` ids: (ids, group).

    Without groups every prompt is ``unique_head + random ids``. With ``prefix_groups`` > 0 and
    ``prefix_tokens`` > 0 request i belongs to group ``i % prefix_groups`` and starts with that group's
    ``prefix_tokens`` random ids (identical within the group), followed by a unique head and random ids.
    """
    if input_tokens < 1:
        raise WorkloadError(f"input_tokens must be >= 1, got {input_tokens}")
    if prefix_tokens >= input_tokens and prefix_groups:
        raise WorkloadError(f"prefix_tokens ({prefix_tokens}) must be < input_tokens ({input_tokens})")
    pool_arr = np.asarray(pool, dtype=np.int64)
    width = min(head_width(start_index + n, len(pool)), input_tokens - (prefix_tokens if prefix_groups else 0))
    groups = [pool_arr[rng.integers(0, len(pool), size=prefix_tokens)].tolist()
              for _ in range(prefix_groups)] if prefix_groups and prefix_tokens else []
    out: list[tuple[list[int], int | None]] = []
    for i in range(n):
        g = (i % prefix_groups) if groups else None
        prefix = groups[g] if g is not None else []
        head = unique_head(start_index + i, pool, width)
        rest = input_tokens - len(prefix) - len(head)
        body = pool_arr[rng.integers(0, len(pool), size=rest)].tolist() if rest > 0 else []
        ids = (prefix + head + body)[:input_tokens]
        out.append((ids, g))
    return out


def exact_text(tokenize: TokenizeFn, n_tokens: int, rng: np.random.Generator, add_special: bool = True,
               lead: str = "") -> str:
    """A text whose token count (as the engine counts it, with ``add_special``) is exactly ``n_tokens``.

    Random words are tokenized once; the text is then cut by binary search on the character count and
    finished with single-character edits, each verified by the tokenize endpoint.
    """
    words = lead + random_words(rng, max(8, n_tokens))
    while len(tokenize(words, add_special)) < n_tokens:
        words += " " + random_words(rng, max(8, n_tokens))
    lo, hi = len(lead) + 1, len(words)   # count(words[:hi]) >= n_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenize(words[:mid], add_special)) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    text = words[:lo].rstrip()
    for _ in range(64):
        count = len(tokenize(text, add_special))
        if count == n_tokens:
            return text
        text = text[:-1] if count > n_tokens else text + " " + string.ascii_lowercase[int(rng.integers(0, 26))]
    raise WorkloadError(f"could not build a text of exactly {n_tokens} tokens")


def build_workload(name: str, n: int, input_tokens: int, output_tokens: int, pool: list[int], seed: int,
                   role: str = "measure", start_index: int = 0, prefix_groups: int = 0,
                   target_prefix_hit_rate: float = 0.0) -> Workload:
    """``n`` unique token-id prompts of exactly ``input_tokens`` tokens and ``output_tokens`` forced outputs.

    ``target_prefix_hit_rate`` (0–1) with ``prefix_groups`` > 0 gives every request a shared group prefix of
    ``round(rate · input_tokens)`` tokens (Phase 8): after the first request of a group is cached, the
    expected hit rate of the others is exactly that fraction.
    """
    if n < 0 or output_tokens < 0:
        raise WorkloadError(f"n and output_tokens must be >= 0 (got n={n}, output_tokens={output_tokens})")
    if not 0.0 <= target_prefix_hit_rate < 1.0:
        raise WorkloadError(f"target_prefix_hit_rate must be in [0, 1), got {target_prefix_hit_rate}")
    prefix_tokens = int(round(target_prefix_hit_rate * input_tokens)) if prefix_groups else 0
    rng = np.random.default_rng(seed)
    prompts = id_prompts(n, input_tokens, pool, rng, start_index, prefix_groups, prefix_tokens)
    reqs = [RequestSpec(index=start_index + i, input_tokens=len(ids), output_tokens=output_tokens,
                        prompt_ids=ids, group=g, shared_prefix_tokens=prefix_tokens if g is not None else 0,
                        role=role)
            for i, (ids, g) in enumerate(prompts)]
    notes = [f"{n} token-id prompts of {input_tokens} tokens from a pool of {len(pool)} engine ids, seed {seed}"]
    if prefix_tokens:
        notes.append(f"{prefix_groups} shared-prefix groups of {prefix_tokens} tokens "
                     f"(target hit rate {target_prefix_hit_rate:.0%})")
    return Workload(name, reqs, seed, len(pool), "ids", notes)


def spec_source(name: str, input_tokens: int, output_tokens: int, pool: list[int], seed: int,
                role: str = "measure", start_index: int = 0) -> Callable[[int], RequestSpec]:
    """An unbounded prompt source for a sized run (``docs/case.md#sizing``): ``source(i)`` is request ``i``, a unique
    token-id prompt of exactly ``input_tokens`` (its own seeded stream, so request ``i`` is the same whatever
    was asked before it) — the run draws as many as its minimum duration takes."""
    if input_tokens < 1 or output_tokens < 0:
        raise WorkloadError(f"input_tokens must be >= 1 and output_tokens >= 0 (got {input_tokens}, {output_tokens})")

    def source(i: int) -> RequestSpec:
        rng = np.random.default_rng([seed, i])
        ids, _ = id_prompts(1, input_tokens, pool, rng, start_index + i)[0]
        return RequestSpec(index=start_index + i, input_tokens=len(ids), output_tokens=output_tokens,
                           prompt_ids=ids, role=role)
    return source


def build_text_workload(name: str, n: int, input_tokens: int, output_tokens: int, tokenize: TokenizeFn,
                        seed: int, role: str = "measure", start_index: int = 0) -> Workload:
    """Text prompts verified to ``input_tokens`` tokens (with the engine's special tokens) by its tokenizer.

    For chat endpoints the chat template adds tokens on top; the achieved count is then checked against
    ``usage.prompt_tokens`` like everything else.
    """
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        text = exact_text(tokenize, input_tokens, rng, lead=f"{start_index + i} ")
        reqs.append(RequestSpec(index=start_index + i, input_tokens=input_tokens, output_tokens=output_tokens,
                                prompt_text=text, role=role))
    return Workload(name, reqs, seed, 0, "text",
                    [f"{n} text prompts verified to {input_tokens} tokens by the engine's tokenizer, seed {seed}"])


# ---------------------------------------------------------------- request bodies

def output_control(engine: str, output_tokens: int) -> dict[str, Any]:
    """Body fields that force exactly ``output_tokens`` tokens on ``engine`` (``EngineAdapter.output_control``)."""
    return engine_for(engine).output_control(output_tokens)


def request_body(spec: RequestSpec, engine: str, api: str, model: str, extra: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The JSON body for one request on ``api`` (``completions`` | ``chat`` | ``generate``).

    Streaming with ``stream_options.include_usage`` (usage may come in the last choices chunk — llama.cpp
    completions — or in a separate ``choices: []`` chunk — vLLM, chat); temperature 0.
    """
    extra = dict(extra or {})
    if api == "generate":
        sampling = {"max_new_tokens": spec.output_tokens, "ignore_eos": True, "temperature": 0.0}
        body: dict[str, Any] = {"sampling_params": sampling, "stream": True}
        if spec.prompt_ids is not None:
            body["input_ids"] = spec.prompt_ids
        else:
            body["text"] = spec.prompt_text
        body.update(extra)
        return body
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
            **output_control(engine, spec.output_tokens)}
    if api == "chat":
        if spec.prompt_text is None:
            raise WorkloadError(f"request {spec.index}: the chat API needs a text prompt (build_text_workload)")
        body["messages"] = [{"role": "user", "content": spec.prompt_text}]
        body["max_completion_tokens"] = spec.output_tokens
    elif api == "completions":
        body["prompt"] = spec.prompt_ids if spec.prompt_ids is not None else spec.prompt_text
    else:
        raise WorkloadError(f"unknown api '{api}' (completions | chat | generate)")
    body.update(extra)
    return body
