"""Peers side by side, live: SGLang's reference client ``bench_serving`` 0.5.9 (its own venv, as in
test_conformance.py) runs the shape of our Phase 1 case D2_c4 (64 → 64 tokens, concurrency 4, 4 prompts) against
the tiny llama-server; Phase 1 runs that case in the same test; ``servelab import`` brings the bench_serving file
into the run; Phase 1 re-runs with ``--resume`` (the case is loaded, not measured again) and its page shows the
peer's numbers beside ours under SGLang's definition — ours checked against an independent computation from
``requests.jsonl`` written out here with bench_serving's per-request rules."""
from __future__ import annotations

import hashlib
import html
import json
import sys
import re
from pathlib import Path

import numpy as np
import pytest

from servelab.cli import main
from servelab.measure import peer_compare as pc
from servelab.report.findings import format_value

sys.path.insert(0, str(Path(__file__).parent))
import benchmod  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
CASE = ["-p", 'cases=["D2_c4"]', "-p", "search=false"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """(module, venv python, tokenizer dir) — skipped with the reason if the reference venv cannot be built."""
    be = benchmod.load("bench_serving_env")
    try:
        py = be.ensure_bench_serving()
        from servelab.deploy.models import resolve_model
        tok = be.ensure_gguf_tokenizer(Path(resolve_model("tiny")), tmp_path_factory.mktemp("tok") / "tiny-tok")
    except Exception as exc:  # e.g. no PyPI access: the reference client is optional, the library never needs it
        pytest.skip(f"SGLang bench_serving 0.5.9 venv or tokenizer could not be built: {exc}")
    return be, py, tok


def sglang_by_hand(case_dir: Path) -> dict[str, float]:
    """bench_serving's per-request rules on our raw records (plain JSON, not our reader), then its aggregation."""
    recs = [json.loads(line) for line in (case_dir / "requests.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["role"] == "measure"]
    summ = json.loads((case_dir / "summary.json").read_text())
    dur = summ["metrics"]["sglang"]["duration_s"]
    ttft, lat, itl, tpot, outs = [], [], [], [], []
    for r in recs:
        assert r["http_status"] == 200 and not r["error_kind"]
        text = [t for t, x in zip(r["chunk_ns"], r["chunk_text"]) if x]
        first = (text[0] - r["send_ns"]) / 1e6
        last = (max(r["chunk_ns"] + [r["done_ns"] or 0]) - r["send_ns"]) / 1e6      # incl. usage event and [DONE]
        out = r["completion_tokens"]
        ttft.append(first)
        lat.append(last)
        itl += [(b - a) / 1e6 for a, b in zip(text, text[1:])]
        outs.append(out)
        if out > 1:
            tpot.append((last - first) / (out - 1))
    return {"median_ttft_ms": float(np.median(ttft)), "p99_ttft_ms": float(np.percentile(ttft, 99)),
            "mean_ttft_ms": float(np.mean(ttft)), "median_tpot_ms": float(np.median(tpot)),
            "p99_tpot_ms": float(np.percentile(tpot, 99)), "median_itl_ms": float(np.median(itl)),
            "p95_itl_ms": float(np.percentile(itl, 95)), "median_e2el_ms": float(np.median(lat)),
            "p90_e2el_ms": float(np.percentile(lat, 90)), "completed": len(recs),
            "total_output_tokens": sum(outs), "output_throughput": sum(outs) / dur}


LABELS = {"mean_ttft_ms": "TTFT mean (ms)", "median_ttft_ms": "TTFT p50 (ms)", "p99_ttft_ms": "TTFT p99 (ms)",
          "median_tpot_ms": "TPOT p50 (ms)", "p99_tpot_ms": "TPOT p99 (ms)", "median_itl_ms": "ITL p50 (ms)",
          "p95_itl_ms": "ITL p95 (ms)", "median_e2el_ms": "E2E p50 (ms)", "p90_e2el_ms": "E2E p90 (ms)",
          "completed": "completed requests", "total_output_tokens": "output tokens",
          "output_throughput": "output throughput (tok/s)"}


def page_table(page: str, header: str) -> tuple[list[str], dict[str, list[str]]]:
    """The rendered table whose header row holds ``header``: its headers and its rows by first cell."""
    for t in re.findall(r"<table.*?</table>", page, flags=re.S):
        heads = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", t, flags=re.S)]
        if header in heads:
            rows = {}
            for tr in re.findall(r"<tr>(.*?)</tr>", t.split("</thead>")[1], flags=re.S):
                cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", tr, flags=re.S)]
                rows[cells[0]] = cells
            return heads, rows
    raise AssertionError(f"no table with the header {header!r} on the page")


def test_bench_serving_beside_our_phase1_case(bench, tiny_server, outputs, tmp_path, capsys):
    be, py, tok_dir = bench
    # 1. Phase 1, our case D2_c4 (its page says no peer was imported, in one line)
    assert main(["run", "phase1", "--target", "local-tiny", "--run-id", "peers", *CASE]) == 0
    rdir = outputs / "peers"
    page = (rdir / "phase1" / "report.html").read_text()
    assert "Peers side by side" in page and "no peer result imported into this run" in page
    case_dir = rdir / "cases" / "D2_c4"
    raw = hashlib.sha256((case_dir / "requests.jsonl").read_bytes()).hexdigest()
    # 2. the reference client, same shape (our case is sized: as many prompts as it sent), on the tiny server
    sent = json.loads((case_dir / "summary.json").read_text())["counts"]["measured"]     # warm-up not counted
    assert sent >= 8                                                  # at least two waves of 4 (docs/case.md#sizing)
    out = tmp_path / "bench_serving_D2_c4.jsonl"
    theirs = be.run_bench_serving(be.bench_serving_argv(py, tiny_server.base_url, "tiny", tok_dir, 64, 64, sent, 4,
                                                        out, extra=["--extra-request-body", '{"cache_prompt": false}']),
                                  out)
    assert theirs["completed"] == sent and theirs["total_output_tokens"] == sent * 64
    # 3. import it into the run
    capsys.readouterr()
    assert main(["import", str(out), "--run-id", "peers"]) == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert said[0].startswith("sglang bench_serving: peers/files/bench_serving_D2_c4.jsonl — 64→64 tokens, "
                              f"concurrency 4, rate inf, {sent} prompts; {sent} requests completed → same shape as our "
                              "D2_c4")
    assert said[1].startswith("re-run phase 1 (servelab run phase1 --target local-tiny --run-id peers -p "
                              "'cases=[\"D2_c4\"]' -p search=false --resume)")
    assert (rdir / "peers" / "files" / out.name).read_bytes() == out.read_bytes()
    # 4. Phase 1 again with --resume: the case is loaded, not measured again; the notebook reads peers/
    assert main(["run", "phase1", "--target", "local-tiny", "--run-id", "peers", *CASE, "--resume"]) == 0
    assert json.loads((rdir / "phase1" / "phase1.json").read_text())["skipped_on_resume"] == ["D2_c4"]
    assert hashlib.sha256((case_dir / "requests.jsonl").read_bytes()).hexdigest() == raw
    # 5. the page: the peer's numbers beside ours, each column naming its definition
    page = (rdir / "phase1" / "report.html").read_text()
    assert "no peer result imported" not in page and "servelab import" in page        # the recorded command
    peer_col, ours_col = "D2_c4 · sglang bench_serving, sglang def.", "D2_c4 · ours, sglang def."
    heads, rows = page_table(page, ours_col)
    assert heads[:4] == ["metric", peer_col, ours_col, "D2_c4 · ours − sglang bench_serving (%)"]
    mine = sglang_by_hand(case_dir)
    recs, dur = pc.case_records(case_dir)
    ours = pc.summarize_as(recs, "sglang", dur)
    for key, label in LABELS.items():
        assert ours[key] == pytest.approx(mine[key], rel=1e-9, abs=1e-9), key        # independent computation
        cells = rows[label]
        assert cells[2] == format_value(mine[key]), (label, cells)
        want = theirs.get(key.replace("e2el", "e2e_latency"))
        assert cells[1] == format_value(want), (label, cells)                         # the peer's own number
    # our records in every peer's definition, and the note naming each difference
    heads, rows = page_table(page, "D2_c4 · ours, guidellm def.")
    assert heads == ["metric", *[f"D2_c4 · ours, {d} def." for d in pc.PEER_DEFINITIONS]]
    assert rows["TTFT p50 (ms)"][1] == format_value(mine["median_ttft_ms"])
    heads, rows = page_table(page, "aiperf (aiperf def.)")
    assert {"TTFT ends", "ITL", "E2E ends", "requests counted"} <= set(rows)
    assert "per token" in rows["ITL"][1] and "[DONE] excluded" in rows["E2E ends"][2]
