"""Peer tools' results beside ours: importing them into a run, matching them to our cases by workload shape, and
our own raw records re-expressed under each peer's metric definition.

Four definitions (``docs/metrics.md#peer-definitions``), all computed from the same ``requests.jsonl``:

``sglang``, ``vllm``
    exactly as :mod:`servelab.measure.request_metrics` (SGLang ``bench_serving``, ``vllm bench serve``);
``aiperf``
    NVIDIA AIPerf: TTFT = first *content* response (non-empty text) − request start; request latency = last
    content response − start (usage-only chunks and ``[DONE]`` excluded); inter-chunk latency = gaps between
    content responses (our ITL column); AIPerf's "inter-token latency" = (latency − TTFT) / (OSL − 1) (our
    TPOT column); the window runs from the first request's start to the last content response (per repeat);
``guidellm``
    guidellm: TTFT = first iteration with text − request start; request latency = request end (the stream
    read up to ``[DONE]``; the stream close when ``[DONE]`` is missing) − start; its "inter-token latency" =
    (last text iteration − first text iteration) / (output tokens − 1) (our TPOT column), aggregated
    **token-weighted** (weight output tokens − 1); no per-chunk ITL; percentiles are the inverse of the
    weighted CDF without interpolation (nearest rank).

What we cannot reproduce is said, not hidden: AIPerf counts OSL by tokenizing the text on the client unless run
with ``--use-server-token-count`` (we use the server's ``usage``); guidellm's throughputs are means of
time-weighted rate distributions (we show totals over the window).

Shape matching (:func:`match`): a peer row and one of our Phase 1 cases have the same shape when the input and
output lengths per request agree within :data:`LEN_TOLERANCE` (max of 1 token and 2 %: tools count a BOS or a
prefix token differently), the concurrency is equal (a peer without a concurrency limit and with an infinite
request rate sends all its prompts at once: concurrency = prompts), the request rate is infinite or absent
(Phase 1 runs closed loops), and the number of prompts equals our case's prompts per wave or over all its
repeats. Matrix cases are preferred; concurrency-search points of the same shape are listed as alternatives.

A run's imported files live in ``<run>/peers/``: the originals, verbatim, under ``files/``, and the normalized
table ``peer_results.csv`` / ``peer_results.json`` (rebuilt from ``files/`` on every import).
"""
from __future__ import annotations

import hashlib
import json
import math
import shlex
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from servelab.core.run import now_iso, write_json_atomic, read_commands, read_manifest
from servelab.measure import peer_results as pr
from servelab.measure import request_metrics as mx
from servelab.measure.records import RequestRecord, read_records
from servelab.measure.case_record import read_summaries, read_summary

SGLANG, VLLM = mx.SGLANG_BENCH, mx.VLLM_BENCH          # the two definitions of our own numbers
PEER_DEFINITIONS = (SGLANG, VLLM, "aiperf", "guidellm")
TOOLS = {SGLANG: "sglang bench_serving", VLLM: "vllm bench serve", "aiperf": "aiperf", "guidellm": "guidellm"}
STATS = ("mean", "median", "p90", "p95", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}
SCALARS = ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
           "output_throughput", "total_token_throughput")
SCALAR_NAMES = {"completed": "completed requests", "failed": "failed requests", "duration_s": "window (s)",
                "total_input_tokens": "input tokens", "total_output_tokens": "output tokens",
                "request_throughput": "request throughput (req/s)", "output_throughput": "output throughput (tok/s)",
                "total_token_throughput": "total token throughput (tok/s)"}
LEN_TOLERANCE = {"abs_tokens": 1.0, "rel": 0.02}
PEERS_DIR = "peers"

# How each definition is built, aspect by aspect: the note under the page's tables (docs/metrics.md says the same)
DEFINITION_NOTES: dict[str, dict[str, str]] = {
    "TTFT starts": {d: "request send (just before the HTTP POST)" for d in PEER_DEFINITIONS},
    "TTFT ends": {SGLANG: "first event with non-empty text (0 if none)",
                  VLLM: "first event with a non-empty choices list (its text may be empty)",
                  "aiperf": "first content response (non-empty text)",
                  "guidellm": "first stream line that carried text"},
    "ITL": {SGLANG: "gap between consecutive text events, one per event (per token on SGLang's native API)",
            VLLM: "gap between consecutive choices events, one per event, never per token",
            "aiperf": "its inter-chunk latency: gap between consecutive content responses, one per chunk",
            "guidellm": "not reported (its 'inter-token latency' is a per-request TPOT)"},
    "TPOT": {SGLANG: "(E2E − TTFT) / (output tokens − 1), one per request",
             VLLM: "(E2E − TTFT) / (output tokens − 1), one per request",
             "aiperf": "its 'inter-token latency': (latency − TTFT) / (OSL − 1), one per request",
             "guidellm": "its 'inter-token latency': (last text − first text) / (output tokens − 1), weighted by "
                         "output tokens − 1 (token-weighted)"},
    "E2E ends": {SGLANG: "last SSE line received, incl. the usage event and [DONE]: the stream tail counts",
                 VLLM: "last choices event: usage-only event and [DONE] excluded",
                 "aiperf": "last content response: usage-only chunks and [DONE] excluded",
                 "guidellm": "request end: the stream read up to [DONE] (the close without it): the tail counts"},
    "output tokens": {SGLANG: "server usage; requested length when absent",
                      VLLM: "server usage; vLLM re-tokenizes the text when absent (we count text events)",
                      "aiperf": "client-side tokenization of the text (ours: server usage, as with "
                                "--use-server-token-count)",
                      "guidellm": "server usage; text iterations when absent"},
    "requests counted": {SGLANG: "HTTP 200 and no error (a stream without text counts, TTFT 0)",
                         VLLM: "HTTP 200, no error and at least one choices event",
                         "aiperf": "valid records (no error); TTFT needs a content response (AIPerf's TTFT "
                                   "percentiles also take failed requests that streamed content; ours do not)",
                         "guidellm": "successful requests (errored and incomplete ones apart)"},
    "percentiles": {SGLANG: "numpy linear interpolation", VLLM: "numpy linear interpolation",
                    "aiperf": "numpy linear interpolation",
                    "guidellm": "inverse of the (weighted) CDF, no interpolation (nearest rank)"},
    "throughput window": {SGLANG: "benchmark wall time (dispatch loop start → all done)",
                          VLLM: "benchmark wall time (dispatch loop start → all done)",
                          "aiperf": "first request start → last response (per repeat, summed)",
                          "guidellm": "means of time-weighted rate distributions (ours: totals / our window)"},
}


class PeerImportError(ValueError):
    """A file cannot be imported into a run (the one-line message names the file and what was expected)."""


# ---------------------------------------------------------------- our records under a peer's definition

def _ms(ns: float) -> float:
    return ns / 1e6


def _linear_stats(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    s = mx.stats(list(values), prefix)
    return {f"{st}_{prefix}_ms": s.get(f"{st}_{prefix}_ms") for st in ("mean", "median", "std", "p50", "p90", "p95",
                                                                        "p99", "max")}


def weighted_nearest_stats(values: Sequence[float], weights: Sequence[float] | None, prefix: str
                           ) -> dict[str, float | None]:
    """guidellm's statistics of ``values``: weighted mean and std, and each percentile as the smallest value whose
    cumulative probability reaches it (duplicate values merged, zero weights dropped; median = p50)."""
    keys = ("mean", "median", "std", "p50", "p90", "p95", "p99", "max")
    vals = np.asarray(values, dtype=float)
    w = np.ones_like(vals) if weights is None else np.asarray(weights, dtype=float)
    if vals.size == 0:
        return {f"{k}_{prefix}_ms": None for k in keys}
    order = np.argsort(vals, kind="stable")
    uniq, inv = np.unique(vals[order], return_inverse=True)
    comb = np.zeros_like(uniq, dtype=float)
    np.add.at(comb, inv, w[order])
    keep = comb > 0
    uniq, comb = uniq[keep], comb[keep]
    if uniq.size == 0:
        return {f"{k}_{prefix}_ms": None for k in keys}
    prob = comb / comb.sum()
    cdf = np.cumsum(prob)

    def q(p: float) -> float:
        return float(uniq[min(int(np.searchsorted(cdf, p, side="left")), uniq.size - 1)])
    mean = float(np.sum(uniq * prob))
    out = {"mean": mean, "std": math.sqrt(float(np.sum((uniq - mean) ** 2 * prob))), "p50": q(0.5), "p90": q(0.9),
           "p95": q(0.95), "p99": q(0.99), "max": float(uniq[-1])}
    out["median"] = out["p50"]
    return {f"{k}_{prefix}_ms": out[k] for k in keys}


def _text_idx(rec: RequestRecord) -> list[int]:
    return [i for i, t in enumerate(rec.chunk_text) if t]


def _output_tokens(rec: RequestRecord, fallback: int) -> int:
    return int(rec.completion_tokens) if rec.completion_tokens is not None else fallback


def _input_tokens(rec: RequestRecord) -> int:
    return int(rec.prompt_tokens) if rec.prompt_tokens is not None else rec.expected_input_tokens


def _aiperf(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft, lat, icl, tpot = [], [], [], []
    tin = tout = 0
    windows: dict[int, list[int]] = {}
    for r in ok:
        idx = _text_idx(r)
        tin += _input_tokens(r)
        out = _output_tokens(r, len(idx))
        tout += out
        last = r.chunk_ns[idx[-1]] if idx else (r.chunk_ns[-1] if r.chunk_ns else r.end_ns)
        w = windows.setdefault(r.repeat, [r.send_ns, last])
        w[0], w[1] = min(w[0], r.send_ns), max(w[1], last)
        if not idx:
            continue
        t = _ms(r.chunk_ns[idx[0]] - r.send_ns)
        e = _ms(last - r.send_ns)
        ttft.append(t)
        lat.append(e)
        icl += [_ms(r.chunk_ns[b] - r.chunk_ns[a]) for a, b in zip(idx, idx[1:])]
        if len(idx) >= 2 and out > 1:
            tpot.append((e - t) / (out - 1))
    dur = sum(max(b - a, 1) for a, b in windows.values()) / 1e9 if windows else None
    out_d: dict[str, Any] = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": dur,
                             "total_input_tokens": tin, "total_output_tokens": tout}
    for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", icl), ("e2el", lat)):
        out_d.update(_linear_stats(v, m))
    return out_d


def _guidellm(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft, lat, itl, weights = [], [], [], []
    tin = tout = 0
    for r in ok:
        idx = _text_idx(r)
        out = _output_tokens(r, len(idx))
        tin += _input_tokens(r)
        tout += out
        end = r.done_ns if r.done_ns is not None else r.end_ns
        lat.append(_ms(end - r.send_ns))
        if idx:
            ttft.append(_ms(r.chunk_ns[idx[0]] - r.send_ns))
            if out > 1:
                itl.append(_ms(r.chunk_ns[idx[-1]] - r.chunk_ns[idx[0]]) / (out - 1))
                weights.append(out - 1)
    out_d: dict[str, Any] = {"completed": len(ok), "failed": len(records) - len(ok), "total_input_tokens": tin,
                             "total_output_tokens": tout}
    out_d.update(weighted_nearest_stats(ttft, None, "ttft"))
    out_d.update(weighted_nearest_stats(itl, weights, "tpot"))
    out_d.update({f"{k}_itl_ms": None for k in ("mean", "median", "std", "p50", "p90", "p95", "p99", "max")})
    out_d.update(weighted_nearest_stats(lat, None, "e2el"))
    return out_d


def summarize_as(records: Iterable[RequestRecord], definition: str, duration_s: float,
                 roles: tuple[str, ...] = ("measure",)) -> dict[str, Any]:
    """Our records (those whose role is in ``roles``) summarized under a peer's ``definition``: counts, token
    totals, throughputs and ``{mean,median,p50,p90,p95,p99,max}_{ttft,tpot,itl,e2el}_ms`` (ITL ``None`` where the
    peer reports none). ``duration_s`` is our measurement window; AIPerf's own window replaces it for ``aiperf``."""
    if definition not in PEER_DEFINITIONS:
        raise ValueError(f"unknown peer definition '{definition}'; one of {PEER_DEFINITIONS}")
    recs = [r for r in records if r.role in roles]
    if definition in mx.DEFINITIONS:
        out = dict(mx.summarize(recs, duration_s, definition, roles=roles))
    else:
        out = _aiperf(recs) if definition == "aiperf" else _guidellm(recs)
        out["definition"] = definition
        out["duration_s"] = out.get("duration_s") or duration_s
        d = out["duration_s"]
        out["request_throughput"] = out["completed"] / d
        out["output_throughput"] = out["total_output_tokens"] / d
        out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / d
    return out


# ---------------------------------------------------------------- our cases and their shapes

def phase1_cases(run_dir: str | Path) -> pd.DataFrame:
    """Our Phase 1 cases of a run that a peer could have run too (matrix points and search points; not the
    injected M1 treatment): case id, scenario, lengths, concurrency, prompts per wave, repeats, verdict, folder."""
    rows = []
    for s in read_summaries(run_dir, phase="phase1", errors=[]):
        c = (s.get("details") or {}).get("case") or {}
        if not c or c.get("inject_input_tokens"):
            continue
        reps = max(len(s.get("repeats") or []), 1)
        # prompts per wave as sent: a sized case (docs/case.md#sizing) may send more than its minimum count
        measured = (s.get("counts") or {}).get("measured")
        n = measured // reps if measured and measured % reps == 0 else c.get("num_prompts")
        rows.append({"case_id": s["case_id"], "scenario": c.get("scenario"), "input_len": c.get("input_tokens"),
                     "output_len": c.get("output_tokens"), "concurrency": c.get("concurrency"),
                     "num_prompts": n, "repeats": reps,
                     "validity": s["verdict"]["status"], "case_dir": str(Path(s["_path"]).parent)})
    cols = ["case_id", "scenario", "input_len", "output_len", "concurrency", "num_prompts", "repeats", "validity",
            "case_dir"]
    return pd.DataFrame(rows, columns=cols)


def _close(peer: Any, ours: Any) -> bool:
    if peer is None or ours is None or (isinstance(peer, float) and math.isnan(peer)):
        return False
    return abs(float(peer) - float(ours)) <= max(LEN_TOLERANCE["abs_tokens"], LEN_TOLERANCE["rel"] * float(ours))


def _val(x: Any) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def shape_mismatch(peer: dict[str, Any], case: dict[str, Any]) -> list[str]:
    """Why a peer row and one of our cases do not have the same shape ([] = they do)."""
    why = []
    rate = _val(peer.get("request_rate"))
    if rate is not None and not math.isinf(rate):
        why.append(f"open-loop request rate {rate:g}/s (Phase 1 runs closed loops)")
    prompts = _val(peer.get("num_prompts"))
    conc = _val(peer.get("concurrency"))
    if conc is None and prompts is not None:
        conc = prompts            # no limit and an infinite rate: every prompt at once
    for key, label in (("input_len", "input"), ("output_len", "output")):
        v = _val(peer.get(key))
        if v is None:
            why.append(f"{label} length not stated")
        elif not _close(v, case[key]):
            why.append(f"{label} {v:g} vs {case[key]} tokens")
    if conc is None:
        why.append("concurrency not stated")
    elif conc != case["concurrency"]:
        why.append(f"concurrency {conc:g} vs {case['concurrency']}")
    ours_n = {int(case["num_prompts"]), int(case["num_prompts"]) * int(case.get("repeats") or 1)}
    if prompts is None:
        why.append("number of prompts not stated")
    elif int(prompts) not in ours_n:
        why.append(f"{prompts:g} prompts vs {' or '.join(str(n) for n in sorted(ours_n))}")
    return why


def match(peers: pd.DataFrame, cases: pd.DataFrame) -> pd.DataFrame:
    """One row per peer row: its shape, the case it matches (``case_id``; a matrix case before a search point) and
    that case's verdict (an INVALID case is shown beside the peer, never as a result), other cases of the same
    shape (``also``) and, when nothing matches, the closest case and why not."""
    rows = []
    for i, p in peers.reset_index(drop=True).iterrows():
        pd_ = p.to_dict()
        hits, misses = [], []
        for _, c in cases.iterrows():
            why = shape_mismatch(pd_, c.to_dict())
            (misses if why else hits).append((c["case_id"], c["scenario"], why))
        hits.sort(key=lambda h: (h[1] == "search", h[0]))
        verdict = dict(zip(cases["case_id"], cases["validity"])) if "validity" in cases else {}
        nearest = min(misses, key=lambda m: len(m[2]), default=None)
        rows.append({"peer_row": i, "tool": p["tool"], "definition": p["definition"], "file": p["file"],
                     "run": p["run"], "input_len": p["input_len"], "output_len": p["output_len"],
                     "concurrency": p["concurrency"], "request_rate": p["request_rate"],
                     "num_prompts": p["num_prompts"], "completed": p["completed"],
                     "case_id": hits[0][0] if hits else None,
                     "case_verdict": verdict.get(hits[0][0]) if hits else None,
                     "also": ", ".join(h[0] for h in hits[1:]),
                     "why_unmatched": "" if hits else (f"closest {nearest[0]}: {'; '.join(nearest[2])}"
                                                       if nearest else "no Phase 1 case in this run")})
    cols = ["peer_row", "tool", "definition", "file", "run", "input_len", "output_len", "concurrency", "request_rate",
            "num_prompts", "completed", "case_id", "case_verdict", "also", "why_unmatched"]
    return pd.DataFrame(rows, columns=cols)


# ---------------------------------------------------------------- a run's imported files

def peers_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / PEERS_DIR


def validate_files(paths: Sequence[str | Path]) -> list[tuple[Path, pd.DataFrame]]:
    """Parse every file before anything is written; the first bad one raises ``PeerImportError`` (one line)."""
    out = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            raise PeerImportError(f"{path}: is a directory; expected {pr.EXPECTED}")
        try:
            table = pr.import_file(path)
        except pr.ImportFormatError as exc:
            raise PeerImportError(" ".join(str(exc).split())) from None
        if (table["tool"] == "servelab").any():
            raise PeerImportError(f"{path}: servelab's own export (summary_vllm_keys), not a peer tool's result; "
                                  f"expected {pr.EXPECTED}")
        if table.empty:
            raise PeerImportError(f"{path}: holds no benchmark; expected {pr.EXPECTED}")
        out.append((path, table))
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _index(pdir: Path) -> list[dict[str, Any]]:
    p = pdir / "peer_results.json"
    return json.loads(p.read_text()).get("imported", []) if p.exists() else []


def import_into_run(run_dir: str | Path, paths: Sequence[str | Path]) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """Validate every file, then copy each verbatim into ``<run>/peers/files/`` (a file already imported, same
    bytes, is not copied twice; a different file of the same name gets a numbered name) and rebuild the
    normalized table. Returns (the whole table, one entry per given file)."""
    checked = validate_files(paths)
    pdir = peers_dir(run_dir)
    fdir = pdir / "files"
    fdir.mkdir(parents=True, exist_ok=True)
    index = _index(pdir)
    by_sha = {e["sha256"]: e for e in index}
    added = []
    for path, table in checked:
        sha = _sha256(path)
        entry = by_sha.get(sha)
        again = entry is not None
        if entry is None:
            name, k = path.name, 1
            while (fdir / name).exists():
                k += 1
                name = f"{path.stem}-{k}{path.suffix}"
            shutil.copyfile(path, fdir / name)
            entry = {"file": f"{PEERS_DIR}/files/{name}", "original": str(path.resolve()), "sha256": sha,
                     "imported": now_iso(), "tools": sorted(set(table["tool"]))}
            index.append(entry)
            by_sha[sha] = entry
        added.append({**entry, "rows": len(table), "again": again, "table": table})
    table = rebuild_table(run_dir, index)
    return table, added


def rebuild_table(run_dir: str | Path, index: list[dict[str, Any]] | None = None) -> pd.DataFrame:
    """``peers/peer_results.csv`` and ``.json`` from the files under ``peers/files/`` (``file`` relative to the
    run directory)."""
    rdir = Path(run_dir)
    pdir = peers_dir(rdir)
    index = _index(pdir) if index is None else index
    frames = []
    for e in index:
        t = pr.import_file(rdir / e["file"])
        t["file"] = e["file"]
        frames.append(t)
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=pr.COLUMNS)
    table.to_csv(pdir / "peer_results.csv", index=False)
    def plain(v: Any) -> Any:          # JSON has no inf / NaN: an unlimited rate stays "inf", a missing value null
        if isinstance(v, float) and math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return None if isinstance(v, float) and math.isnan(v) else v
    rows = [{k: plain(v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in table.to_dict("records")]
    write_json_atomic(pdir / "peer_results.json", {"imported": index, "columns": list(table.columns), "rows": rows})
    return table


def load_peer_table(run_dir: str | Path) -> pd.DataFrame:
    """The normalized table of a run's imported peer results (empty when none were imported). Read back from the
    original files, so the table always follows the importer."""
    pdir = peers_dir(run_dir)
    index = _index(pdir)
    if not index:
        return pd.DataFrame(columns=pr.COLUMNS)
    frames = []
    for e in index:
        t = pr.import_file(Path(run_dir) / e["file"])
        t["file"] = e["file"]
        frames.append(t)
    return pd.concat(frames, ignore_index=True)


def _fmt(x: Any) -> str:
    v = _val(x)
    return "?" if v is None else ("inf" if math.isinf(v) else f"{v:g}")


def rerun_phase1(run_dir: str | Path) -> str:
    """The ``servelab run phase1 ... --resume`` line that re-runs Phase 1 into this run with the overrides it last
    ran with: its recorded ``reproduce`` command (the CLI's, which holds every ``-p``, before the notebook's)."""
    rdir = Path(run_dir)
    recs = [r for r in read_commands(rdir, "phase1")
            if r.label == "reproduce" and r.argv[:3] == ["servelab", "run", "phase1"]][::-1]
    recs.sort(key=lambda r: r.title != "run phase1 again into this run")      # stable: the latest CLI record first
    argv = list(recs[0].argv) if recs else ["servelab", "run", "phase1", "--run-id", rdir.name]
    if "resume=true" not in argv:
        argv.append("--resume")
    return shlex.join(argv)


def import_report(run_dir: str | Path, table: pd.DataFrame, added: list[dict[str, Any]]) -> list[str]:
    """What ``servelab import`` prints: one line per file (tool, shape, requests, the case of ours with its shape),
    then how to see them on the Phase 1 page."""
    rdir = Path(run_dir)
    cases = phase1_cases(rdir)
    matches = match(table, cases)
    lines = []
    for e in added:
        parts = []
        for _, row in e["table"].iterrows():
            m = matches[(matches["file"] == e["file"]) & (matches["run"] == row["run"])]
            case = m["case_id"].iloc[0] if not m.empty and pd.notna(m["case_id"].iloc[0]) else None
            rate = _fmt(row["request_rate"])
            rate = "" if rate == "?" else f", rate {rate}" + ("" if rate == "inf" else "/s")
            failed = _fmt(row["failed"])
            parts.append(f"{_fmt(row['input_len'])}→{_fmt(row['output_len'])} tokens, concurrency "
                         f"{_fmt(row['concurrency'])}{rate}, {_fmt(row['num_prompts'])} prompts; "
                         f"{_fmt(row['completed'])} requests completed"
                         + (f", {failed} failed" if failed not in ("?", "0") else "")
                         + (f" → same shape as our {case}" if case else
                            " → no Phase 1 case of this run has its shape" if not cases.empty else ""))
        lines.append(f"{', '.join(e['tools'])}: {e['file']}{' (already imported)' if e['again'] else ''} — "
                     + " | ".join(parts))
    if "phase1" in read_manifest(rdir).get("phases", {}):
        lines.append(f"re-run phase 1 ({rerun_phase1(rdir)}) to see them side by side: its measured cases are "
                     "loaded, not measured again")
    else:
        lines.append(f"run phase 1 into this run (servelab run phase1 --run-id {rdir.name}) to see them side by side")
    return lines


# ---------------------------------------------------------------- side by side

def case_records(case_dir: str | Path) -> tuple[list[RequestRecord], float]:
    """A case's raw records and its measurement window (``summary.json``: the pooled ``duration_s``)."""
    cdir = Path(case_dir)
    summ = read_summary(cdir / "summary.json")
    metrics = summ.get("metrics") or {}
    dur = next((m.get("duration_s") for m in metrics.values() if m.get("duration_s")), None)
    if not dur:
        raise ValueError(f"{cdir}: summary.json has no measurement window")
    return read_records(cdir / "requests.jsonl"), float(dur)


def ours_by_definition(case_dir: str | Path, definitions: Sequence[str] = PEER_DEFINITIONS) -> dict[str, dict[str, Any]]:
    """One case's measured records under each of ``definitions``."""
    recs, dur = case_records(case_dir)
    return {d: summarize_as(recs, d, dur) for d in definitions}


def metric_rows() -> list[tuple[str, str]]:
    """(key, label) of the rows of the side-by-side tables: latency statistics then counts and throughputs."""
    rows = [(f"{st}_{m}_ms", f"{METRIC_NAMES[m]} {'p50' if st == 'median' else st} (ms)")
            for m in METRICS for st in STATS]
    return rows + [(k, SCALAR_NAMES[k]) for k in SCALARS]


def _pct(a: Any, b: Any) -> float | None:
    a, b = _val(a), _val(b)
    if a is None or b is None or b == 0:
        return None
    return 100.0 * (a - b) / b


COUNT_KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens")


def _cells(summary: Any, keys: Sequence[str]) -> pd.Series:
    """Values in table order; counts that are whole numbers stay integers (shown without decimals)."""
    out = []
    for k in keys:
        v = _val(summary.get(k))
        out.append(int(v) if v is not None and k in COUNT_KEYS and v == int(v) else v)
    return pd.Series(out, dtype=object)


def side_by_side(peers: pd.DataFrame, matches: pd.DataFrame, cases: pd.DataFrame) -> pd.DataFrame:
    """Rows: TTFT/TPOT/ITL/E2E statistics, then counts and throughputs. For each matched pair three columns: the
    peer's own number (``<case> · <tool>, <definition> def.``), ours re-computed from our raw records under that
    peer's definition (``<case> · ours, <definition> def.``), and ours − peer in % of the peer's."""
    hit = matches[matches["case_id"].notna()]
    if hit.empty:
        return pd.DataFrame()
    dirs = dict(zip(cases["case_id"], cases["case_dir"]))
    dup = hit.duplicated(subset=["case_id", "tool"], keep=False)
    keys = [k for k, _ in metric_rows()]
    cache: dict[tuple[str, str], dict[str, Any]] = {}
    out = pd.DataFrame({"metric": [label for _, label in metric_rows()]})
    for (_, m), is_dup in zip(hit.iterrows(), dup):
        d, cid = m["definition"], m["case_id"]
        if (cid, d) not in cache:
            recs, dur = case_records(dirs[cid])
            cache[(cid, d)] = summarize_as(recs, d, dur)
        tag = f" [{Path(str(m['file'])).name}#{int(m['run'])}]" if is_dup else ""
        pv = _cells(peers.iloc[int(m["peer_row"])], keys)
        ov = _cells(cache[(cid, d)], keys)
        out[f"{cid} · {m['tool']}, {d} def.{tag}"] = pv
        out[f"{cid} · ours, {d} def.{tag}"] = ov
        out[f"{cid} · ours − {m['tool']} (%){tag}"] = pd.Series([_pct(o, p) for o, p in zip(ov, pv)], dtype=object)
    # a metric neither side reports (guidellm has no per-chunk ITL) is not a row
    values = out.drop(columns=["metric"])
    return out[values.notna().any(axis=1)].reset_index(drop=True)


def ours_in_every_definition(cases: pd.DataFrame, case_ids: Sequence[str]) -> pd.DataFrame:
    """Our records of ``case_ids`` re-expressed in every peer's definition: rows as :func:`side_by_side`, one
    column per case × definition (``<case>: ours, <definition> def.``)."""
    out = pd.DataFrame({"metric": [label for _, label in metric_rows()]})
    dirs = dict(zip(cases["case_id"], cases["case_dir"]))
    for cid in case_ids:
        for d, s in ours_by_definition(dirs[cid]).items():
            out[f"{cid} · ours, {d} def."] = _cells(s, [k for k, _ in metric_rows()])
    values = out.drop(columns=["metric"])
    return out[values.notna().any(axis=1)].reset_index(drop=True)


def definition_notes() -> pd.DataFrame:
    """Aspect × definition: when TTFT starts and ends, ITL per chunk or per token, TPOT, how E2E's tail counts,
    which output tokens and which requests count, the percentile method, the throughput window."""
    return pd.DataFrame([{"aspect": a, **{f"{TOOLS[d]} ({d} def.)": v[d] for d in PEER_DEFINITIONS}}
                         for a, v in DEFINITION_NOTES.items()])


# ---------------------------------------------------------------- peers side by side (read when the notebook runs)

def _import_hint(run_dir: Path) -> str:
    return (f"`servelab import FILE... --run-id {Path(run_dir).name}` brings SGLang bench_serving, `vllm bench serve`, "
            "AIPerf or guidellm result files into this run; then re-run this phase with `--resume`")


def _peers(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, str]:
    """(peer table, our cases, matches, problem): a ``peers/`` folder that cannot be read is a note on the page,
    never a failed phase."""
    try:
        peers = load_peer_table(run_dir)
        cases = phase1_cases(run_dir)
        return peers, cases, match(peers, cases), ""
    except (pr.ImportFormatError, OSError, ValueError, KeyError) as exc:
        empty = pd.DataFrame()
        return empty, empty, empty, f"{PEERS_DIR}/ of this run could not be read: {' '.join(str(exc).split())}"


def _whole(df: pd.DataFrame, cols: tuple[str, ...]) -> pd.DataFrame:
    """Counts and lengths that are whole numbers shown as integers."""
    out = df.copy()
    for c in cols:
        out[c] = pd.Series([int(v) if isinstance(v, float) and v == v and v == int(v) else v for v in out[c]],
                           index=out.index, dtype=object)
    return out


def peer_files(run_dir: Path) -> pd.DataFrame:
    """The peer result files imported into this run, one row per benchmark they hold: tool, shape, requests, the
    case of ours it matches (or the closest one and why not). One line saying how to import when there is none."""
    peers, _, matches, problem = _peers(run_dir)
    if problem:
        return pd.DataFrame({"peers": [problem]})
    if peers.empty:
        return pd.DataFrame({"peers": [f"no peer result imported into this run: {_import_hint(run_dir)}"]})
    return _whole(matches.drop(columns=["peer_row"]),
                  ("input_len", "output_len", "concurrency", "num_prompts", "completed"))


def peer_side_by_side(run_dir: Path) -> pd.DataFrame | None:
    """For each imported peer result matched to one of our cases: the peer's numbers, ours re-computed from our
    raw records under the peer's own definition, and the difference (None when nothing was imported)."""
    peers, cases, matches, problem = _peers(run_dir)
    if problem or peers.empty:
        return None
    if matches["case_id"].isna().all():
        return pd.DataFrame({"note": ["no imported peer result has the shape of a Phase 1 case of this run "
                                      "(the table above says why, file by file)"]})
    try:
        return side_by_side(peers, matches, cases)
    except (OSError, ValueError, KeyError) as exc:
        return pd.DataFrame({"note": [f"our records could not be read: {' '.join(str(exc).split())}"]})


def ours_in_peer_definitions(run_dir: Path) -> pd.DataFrame | None:
    """The matched cases' records in every peer's definition (sglang, vllm, aiperf, guidellm) — or, when no peer
    matched, the first case that ran; None when nothing was imported."""
    peers, cases, matches, problem = _peers(run_dir)
    if problem or peers.empty:
        return None
    if cases.empty:
        return pd.DataFrame({"note": ["no Phase 1 case ran in this run"]})
    ids = list(dict.fromkeys(matches["case_id"].dropna())) or [cases["case_id"].iloc[0]]
    try:
        return ours_in_every_definition(cases, ids)
    except (OSError, ValueError, KeyError) as exc:
        return pd.DataFrame({"note": [f"our records could not be read: {' '.join(str(exc).split())}"]})


def peer_definition_notes(run_dir: Path) -> pd.DataFrame | None:
    """Where the four definitions differ, aspect by aspect (None when nothing was imported)."""
    peers, _, _, problem = _peers(run_dir)
    if problem or peers.empty:
        return None
    return definition_notes()
