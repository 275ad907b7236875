"""The correctness check of an A/B: the same fixed prompts, greedy (temperature 0), on A and on B, the outputs
compared token for token — and the chosen tokens' log-probabilities where the engine returns them
(``docs/method.md#correctness``).

A change that makes the service faster must not change what it answers. Greedy decoding is deterministic for a
given model and numerics, so two engines that compute the same thing give the same tokens; a change that alters the
numerics (KV-cache or weight dtype, rope scaling, a different kernel that rounds differently) shows up as a token
that differs, or — before it flips a token — as a drift in the chosen tokens' log-probabilities.

- :func:`greedy_probe` sends each of :data:`PROMPTS` ``repeats`` times, one request at a time, to a running
  server (the engine adapter builds the request and reads the answer: SGLang and vLLM ``/v1/completions`` with
  ``logprobs: 1`` and ``return_token_ids``; llama.cpp ``/completion`` with ``n_probs`` and ``return_tokens``), and
  returns what came back (:data:`OUTPUTS_FILE` in a run-like record). The repeats tell whether the engine is
  deterministic on its own: a prompt whose repeats differ is ``unstable`` and decides nothing.
- :func:`compare_greedy` compares B's outputs with A's prompt by prompt: ``identical``, ``logprob drift`` (same
  tokens, a chosen token's log-probability moved by more than ``tol`` nats), ``differs`` (a token differs: the
  position and both tokens are given), or why the prompt decides nothing (``unstable on A``, ``error on B`` …).
- :func:`correctness_verdict` turns the rows into one verdict: ``no regression`` (every prompt identical),
  ``regression`` (a prompt differs or drifts), ``not decidable`` (no regression seen, but a prompt decided
  nothing) or ``not measured``.

Different outputs are not necessarily wrong answers; they say that the change is not numerically neutral, and that
an accuracy evaluation must accept it before it is kept.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from servelab.core.run import CommandRecord, now_iso, record_command, write_json_atomic
from servelab.deploy.server import http_json

# fixed, short and varied: they fit every model's context and a 2048-token llama.cpp slot with room to spare
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 17 multiplied by 23?\nA:",
    "Translate to German: The weather is nice today.\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "List the planets of the solar system in order from the Sun:",
    "In 1969, the first humans to walk on the Moon were",
)
MAX_TOKENS = 32            # tokens generated per prompt
REPEATS = 2                # each prompt this many times on the same server: is the engine deterministic on its own?
LOGPROB_TOL = 0.1          # nats: a chosen token's log-probability may move this much before it counts as drift
OUTPUTS_FILE = "greedy_outputs.json"
STATUSES = ("identical", "logprob drift", "differs", "unstable on A", "unstable on B", "error on A", "error on B",
            "missing on A", "missing on B")
VERDICTS = ("no regression", "regression", "not decidable", "not measured")


# ---------------------------------------------------------------- one side: send the prompts


def plain_number(x: float, sig: int) -> str:
    """``x`` to ``sig`` significant digits, written out (0.000057, never 5.7e-05: pages carry no exponent notation)."""
    return np.format_float_positional(float(x), precision=sig, unique=False, fractional=False, trim="-")

def _key(out: dict[str, Any]) -> list[Any] | None:
    """What identifies an output token for token: its ids where the engine returned them, else its token texts."""
    ids = out.get("token_ids")
    return list(ids) if ids else (list(out["tokens"]) if out.get("tokens") else None)


def greedy_probe(srv: Any, prompts: Sequence[str] = PROMPTS, max_tokens: int = MAX_TOKENS, repeats: int = REPEATS,
                 timeout_s: float = 120.0, run_dir: Path | None = None, phase: str = "") -> dict[str, Any]:
    """Send every prompt ``repeats`` times, greedily, one request at a time, to the running server ``srv`` and return
    what came back: per prompt its token ids (or token texts), the chosen tokens' log-probabilities (None where the
    engine returns none), text, finish reason, whether its repeats agreed, and any error. With ``run_dir`` the probe
    is recorded as an executed command (the curl equivalent of its first request)."""
    eng = srv.engine
    url = srv.base_url + eng.greedy_path
    model = srv.target.served_model_name or "default"
    started, t0 = now_iso(), time.perf_counter()
    outputs: list[dict[str, Any]] = []
    silent = ""                   # once the engine has not answered at all, nothing more is sent (no wait per prompt)
    for i, prompt in enumerate(prompts):
        runs: list[dict[str, Any]] = []
        for _ in range(max(1, int(repeats))):
            if silent:
                runs.append({"error": f"not sent: {silent}"})
                continue
            status, body = http_json(url, eng.greedy_body(model, prompt, int(max_tokens)), timeout=timeout_s,
                                     headers=srv.auth_headers)
            if status == 0:
                silent = f"the engine did not answer a request within {timeout_s:g} s (no connection or timeout)"
                runs.append({"error": silent})
                continue
            if status != 200:
                runs.append({"error": f"HTTP {status}: {str(body)[:300]}"})
                continue
            try:
                runs.append(eng.greedy_output(body))
            except (KeyError, TypeError, IndexError, ValueError) as exc:
                runs.append({"error": f"unreadable answer ({type(exc).__name__}: {exc}): {str(body)[:300]}"})
        first = runs[0]
        keys = [_key(r) for r in runs if not r.get("error")]
        stable = len(keys) == len(runs) and all(k == keys[0] for k in keys)
        errors = [r["error"] for r in runs if r.get("error")]
        outputs.append({"index": i, "prompt": prompt, "token_ids": first.get("token_ids"),
                        "tokens": first.get("tokens"), "logprobs": first.get("logprobs"), "text": first.get("text"),
                        "finish_reason": first.get("finish_reason"), "logprobs_note": first.get("logprobs_note", ""),
                        "repeats": len(runs), "stable": stable,
                        "repeat_keys": [] if stable else list(keys), "error": "; ".join(errors)})
    out = {"engine": srv.target.engine, "model": srv.target.model, "served_model_name": model,
           "endpoint": eng.greedy_path, "max_tokens": int(max_tokens), "temperature": 0.0, "repeats": int(repeats),
           "started": started, "ended": now_iso(), "seconds": round(time.perf_counter() - t0, 3),
           "request_example": eng.greedy_body(model, prompts[0], int(max_tokens)) if prompts else {},
           "outputs": outputs}
    if run_dir is not None and prompts:
        argv = ["curl", "-sS", "-X", "POST", url, "-H", "Content-Type: application/json", "-d",
                json.dumps(out["request_example"], separators=(",", ":"))]
        bad = sum(1 for o in outputs if o["error"])
        record_command(Path(run_dir), CommandRecord(
            label="executed", argv=argv, phase=phase, title=f"greedy correctness probe ({len(prompts)} fixed prompts "
            f"× {int(repeats)}, temperature 0)", host="local", start=started, end=out["ended"],
            exit_code=0 if not bad else 1,
            note=f"sent by servelab.measure.correctness (urllib), one request at a time; curl equivalent of the first "
                 f"of {len(prompts) * max(1, int(repeats))} requests; {bad} prompt(s) with an error"))
    return out


def write_greedy(folder: Path, outputs: dict[str, Any]) -> Path:
    """``<folder>/greedy_outputs.json``."""
    path = Path(folder) / OUTPUTS_FILE
    write_json_atomic(path, outputs)
    return path


def read_greedy(folder: Path) -> dict[str, Any] | None:
    """The greedy outputs a run or record holds (None when it holds none)."""
    path = Path(folder) / OUTPUTS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- A against B

COLUMNS = ["b_run", "prompt", "status", "tokens_a", "tokens_b", "matched_tokens", "first_difference", "token_a",
           "token_b", "max_logprob_drift", "mean_logprob_drift", "compared_by", "detail"]


def _text_at(out: dict[str, Any], pos: int) -> str:
    toks = out.get("tokens") or []
    ids = out.get("token_ids") or []
    if pos < len(toks):
        return repr(str(toks[pos]))[1:-1] + (f" (id {ids[pos]})" if pos < len(ids) else "")
    if pos < len(ids):
        return f"id {ids[pos]}"
    return "(end of output)"


def _one(a: dict[str, Any] | None, b: dict[str, Any] | None, tol: float) -> dict[str, Any]:
    """One prompt's row: status, token counts, where the outputs part and the log-probability drift before that."""
    row: dict[str, Any] = {c: None for c in COLUMNS[2:]}
    for side, o in (("A", a), ("B", b)):
        if o is None:
            return {**row, "status": f"missing on {side}", "detail": f"{side} has no output for this prompt"}
    for side, o in (("A", a), ("B", b)):
        if o.get("error"):
            return {**row, "status": f"error on {side}", "detail": str(o["error"])[:300]}
    ka, kb = _key(a), _key(b)
    if ka is None or kb is None:
        side = "A" if ka is None else "B"
        return {**row, "status": f"error on {side}", "detail": f"{side} returned no tokens"}
    by = "token ids" if a.get("token_ids") and b.get("token_ids") else "token texts"
    if by == "token texts":
        ka, kb = list(a.get("tokens") or []), list(b.get("tokens") or [])
    row.update({"tokens_a": len(ka), "tokens_b": len(kb), "compared_by": by})
    for side, o in (("A", a), ("B", b)):
        if not o.get("stable", True):
            return {**row, "status": f"unstable on {side}",
                    "detail": f"{side}'s own repeats of this prompt differ: the engine is not deterministic here, so a "
                              "difference from the other side would prove nothing"}
    n = 0
    while n < min(len(ka), len(kb)) and ka[n] == kb[n]:
        n += 1
    row["matched_tokens"] = n
    la, lb = a.get("logprobs"), b.get("logprobs")
    if la and lb:
        d = [abs(float(x) - float(y)) for x, y in zip(la[:n], lb[:n]) if x is not None and y is not None
             and math.isfinite(float(x)) and math.isfinite(float(y))]
        if d:
            row["max_logprob_drift"], row["mean_logprob_drift"] = max(d), sum(d) / len(d)
    if n < len(ka) or n < len(kb):
        row.update({"status": "differs", "first_difference": n, "token_a": _text_at(a, n), "token_b": _text_at(b, n),
                    "detail": f"the outputs part at token {n} of {max(len(ka), len(kb))}: A {_text_at(a, n)}, "
                              f"B {_text_at(b, n)}"})
        return row
    drift = row["max_logprob_drift"]
    if drift is not None and drift > tol:
        row.update({"status": "logprob drift",
                    "detail": f"same {n} tokens, but a chosen token's log-probability moved by {plain_number(drift, 3)} nats "
                              f"(> {tol:g})"})
        return row
    why = "; ".join(dict.fromkeys(str(o.get("logprobs_note")) for o in (a, b) if o.get("logprobs_note")))
    row.update({"status": "identical",
                "detail": f"same {n} tokens" + (f"; log-probabilities within {plain_number(drift, 2)} nats" if drift is not None
                                                 else f"; no log-probabilities to compare{f' ({why})' if why else ''}")})
    return row


def compare_greedy(a: dict[str, Any] | None, b: dict[str, Any] | None, b_run: str = "B",
                   tol: float = LOGPROB_TOL) -> pd.DataFrame:
    """B's greedy outputs against A's, one row per prompt (matched by its text); ``COLUMNS``. Either side without
    outputs gives one row saying so."""
    if a is None or b is None:
        side = "A" if a is None else "B"
        return pd.DataFrame([{**{c: None for c in COLUMNS}, "b_run": b_run, "prompt": "(all)",
                              "status": f"missing on {side}",
                              "detail": f"{side} recorded no greedy outputs ({OUTPUTS_FILE}): the correctness probe did "
                                        "not run on it"}], columns=COLUMNS)
    pa = {o["prompt"]: o for o in a.get("outputs", [])}
    pb = {o["prompt"]: o for o in b.get("outputs", [])}
    notes = []
    if a.get("max_tokens") != b.get("max_tokens"):
        notes.append(f"A asked {a.get('max_tokens')} tokens, B {b.get('max_tokens')}")
    rows = []
    for prompt in list(dict.fromkeys([*pa, *pb])):
        r = _one(pa.get(prompt), pb.get(prompt), tol)
        if notes:
            r["detail"] = f"{r['detail']}; {'; '.join(notes)}"
        rows.append({"b_run": b_run, "prompt": prompt, **r})
    return pd.DataFrame(rows, columns=COLUMNS)


def ab_greedy(runs: Sequence[tuple[str, Path]], tol: float = LOGPROB_TOL) -> pd.DataFrame:
    """Every run after the first (``(label, folder)``) against the first: :func:`compare_greedy` rows, ``b_run`` the
    label of B."""
    if len(runs) < 2:
        return pd.DataFrame(columns=COLUMNS)
    a = read_greedy(runs[0][1])
    parts = [compare_greedy(a, read_greedy(folder), label, tol) for label, folder in runs[1:]]
    return pd.concat(parts, ignore_index=True)


def correctness_verdict(rows: pd.DataFrame) -> tuple[str, str]:
    """``(verdict, detail)`` of one B against A from its :func:`compare_greedy` rows (one of :data:`VERDICTS`)."""
    if rows is None or rows.empty:
        return "not measured", "no greedy outputs compared"
    st = rows["status"].astype(str)
    if st.str.startswith("missing").all():
        return "not measured", str(rows["detail"].iloc[0])
    n = len(rows)
    bad = rows[st.isin(["differs", "logprob drift"])]
    if not bad.empty:
        first = bad.iloc[0]
        return "regression", (f"{int((st == 'differs').sum())} of {n} prompts differ, "
                              f"{int((st == 'logprob drift').sum())} drift: {str(first['prompt'])[:40]!r} — "
                              f"{first['detail']}")
    same = int((st == "identical").sum())
    if same == n:
        drift = pd.to_numeric(rows["max_logprob_drift"], errors="coerce").max()
        return "no regression", (f"{n} of {n} prompts identical token for token"
                                 + (f" (log-probabilities within {plain_number(drift, 2)} nats)" if drift == drift else ""))
    other = rows[st != "identical"]
    return "not decidable", (f"{same} of {n} prompts identical, {len(other)} decide nothing: "
                             + "; ".join(f"{s} ({int((other['status'] == s).sum())})" for s in
                                         dict.fromkeys(other["status"])))


def greedy_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per B: prompts compared, identical / differing / drifting / undecided, the first difference, the
    largest log-probability drift, the verdict and its detail."""
    out = []
    if rows is None or rows.empty:
        return pd.DataFrame(columns=["b_run", "prompts", "identical", "differ", "drift", "undecided",
                                     "max_logprob_drift", "verdict", "detail"])
    for b_run, g in rows.groupby("b_run", sort=False):
        st = g["status"].astype(str)
        verdict, detail = correctness_verdict(g)
        drift = pd.to_numeric(g["max_logprob_drift"], errors="coerce").max()
        out.append({"b_run": b_run, "prompts": len(g), "identical": int((st == "identical").sum()),
                    "differ": int((st == "differs").sum()), "drift": int((st == "logprob drift").sum()),
                    "undecided": int((~st.isin(["identical", "differs", "logprob drift"])).sum()),
                    "max_logprob_drift": None if drift != drift else float(drift), "verdict": verdict,
                    "detail": detail})
    return pd.DataFrame(out)


def prompts_view(rows: pd.DataFrame) -> pd.DataFrame:
    """The per-prompt rows for a page: the prompt on one line (newlines shown as ⏎, cut at 60 characters), its status,
    how many tokens matched, where and how the outputs part, the largest log-probability drift before that."""
    if rows is None or rows.empty:
        return pd.DataFrame({"note": ["no greedy outputs compared (neither side ran the correctness probe)"]})
    v = rows.copy()
    v["prompt"] = v["prompt"].astype(str).map(lambda t: (t.replace("\n", " ⏎ ")[:60] + ("…" if len(t) > 60 else "")))
    v = v.rename(columns={"max_logprob_drift": "max_logprob_drift_nats", "mean_logprob_drift": "mean_logprob_drift_nats"})
    return v[["b_run", "prompt", "status", "tokens_a", "tokens_b", "matched_tokens", "first_difference", "token_a",
              "token_b", "max_logprob_drift_nats", "compared_by", "detail"]]


def verdict_sentences(rows: pd.DataFrame, a_label: str) -> list[str]:
    """One sentence per B for a page's findings: its greedy outputs against A's, the verdict and why."""
    return [f"Greedy outputs of {r.prompts} fixed prompts, {r.b_run} against {a_label}: {r.verdict} — {r.detail}."
            for r in greedy_summary(rows).itertuples()]
