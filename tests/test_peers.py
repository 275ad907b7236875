"""Peers side by side: `servelab import`, shape matching, our records under each peer's definition, and the
Phase 1 section — on hand-built case folders (written through the same CaseFolder as the phases) and the real
peer result files of tests/data/peer_results. The live run against the reference client is test_peers_live.py."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from servelab.cli import main
from servelab.core.run import init_run, read_commands, read_manifest, update_manifest
from servelab.measure import peer_compare as pc
from servelab.measure import request_metrics as mx
from servelab.measure.case import CaseResult, CaseSpec, write_summary
from servelab.measure.case_record import CaseFolder
from servelab.measure.records import RequestRecord
from servelab.phases import phase1_perf_map as perf_map

DATA = Path(__file__).parent / "data" / "peer_results"
SGLANG = DATA / "sglang_bench_serving_0.5.9.jsonl"


# ---------------------------------------------------------------- hand-built records and cases

def stream(i: int, out: int = 4, gap_ms: int = 5, ttft_ms: int = 20, tail: bool = True, done: bool = True,
           role: str = "measure", repeat: int = 0, first_empty: bool = False) -> RequestRecord:
    """One llama.cpp-like stream: (an optional role-only first event,) ``out`` text events ``gap_ms`` apart, a
    final choices event without text carrying usage 1 ms later, ``[DONE]`` 1 ms after that."""
    s = 10**9 * (i + 1)
    t = [s + ttft_ms * 10**6 + k * gap_ms * 10**6 for k in range(out)]
    text = ["x"] * out
    if first_empty:
        t, text = [t[0] - 2 * 10**6] + t, [""] + text
    if tail:
        t, text = t + [t[-1] + 10**6], text + [""]
    return RequestRecord(f"r{i}", i, role, 64, out, repeat=repeat, send_ns=s, end_ns=t[-1] + 3 * 10**6,
                         http_status=200, chunk_ns=t, chunk_text=text, chunk_choices=[True] * len(t),
                         chunk_tokens=[None] * len(t), done_ns=t[-1] + 10**6 if done else None, prompt_tokens=64,
                         completion_tokens=out)


def write_case(run_dir: Path, case: CaseSpec, records: list[RequestRecord], window_s: float = 2.0) -> Path:
    folder = CaseFolder(run_dir, case.case_id, "phase1", "search" if case.scenario == "search" else case.kind,
                        {"case": asdict(case), "expected_measured": sum(r.role == "measure" for r in records)})
    folder.write_requests(records)
    summ = mx.both_definitions(records, window_s)
    res = CaseResult(case, "success", folder.dir, summ, [summ], verdict=mx.Verdict("VALID", []))
    write_summary(res, folder, records)
    folder.finish("success")
    return folder.dir


def d2_c4() -> CaseSpec:
    return CaseSpec("D2_c4", "D2", "decode", 64, 4, 4, 4, True)


def sglang_file(tmp: Path, name: str = "bs.jsonl", **over) -> Path:
    """The real bench_serving result, its shape set to ``over`` (the tiny server's D2_c4-like point by default)."""
    obj = json.loads(SGLANG.read_text().splitlines()[0])
    obj.update({"random_output_len": 4, "completed": 4, "max_concurrency": 4, "total_input_tokens": 4 * 63,
                "total_output_tokens": 16, **over})
    p = tmp / name
    p.write_text(json.dumps(obj) + "\n")
    return p


@pytest.fixture
def run(outputs: Path) -> Path:
    rdir = init_run("peers", "local-tiny")
    write_case(rdir, d2_c4(), [stream(i) for i in range(4)])
    return rdir


# ---------------------------------------------------------------- shapes and matching

def test_sample_files_state_their_shape():
    from servelab.measure import peer_results as pr
    rows = {r["tool"]: r for r in pr.import_files(sorted(DATA.glob("*.json*"))).to_dict("records")}
    for tool in ("sglang bench_serving", "aiperf", "guidellm"):
        r = rows[tool]
        assert (r["input_len"], r["output_len"], r["num_prompts"], r["concurrency"]) == (64, 32, 16, 4), tool
        assert r["shape_source"].startswith("input: stated; output: stated"), tool
    assert "prompts: from completed" in rows["sglang bench_serving"]["shape_source"]    # SGLang writes no count
    v = rows["vllm bench serve"]                     # vLLM states no lengths: what the totals say it achieved
    assert (v["input_len"], v["output_len"], v["num_prompts"]) == (1876 / 16, 33, 16)
    assert v["shape_source"] == "input: from totals; output: from totals; prompts: stated"


CASES = pd.DataFrame([
    {"case_id": "D1", "scenario": "D1", "input_len": 64, "output_len": 64, "concurrency": 1, "num_prompts": 1,
     "repeats": 1},
    {"case_id": "D2_c4", "scenario": "D2", "input_len": 64, "output_len": 64, "concurrency": 4, "num_prompts": 4,
     "repeats": 1},
    {"case_id": "search_c4", "scenario": "search", "input_len": 64, "output_len": 64, "concurrency": 4,
     "num_prompts": 4, "repeats": 1},
    {"case_id": "D2_c8", "scenario": "D2", "input_len": 64, "output_len": 64, "concurrency": 8, "num_prompts": 8,
     "repeats": 3},
    {"case_id": "P2", "scenario": "P2", "input_len": 1000, "output_len": 1, "concurrency": 1, "num_prompts": 1,
     "repeats": 1},
])


def peer(**kw) -> dict:
    base = {"tool": "sglang bench_serving", "definition": "sglang", "file": "f", "run": 0, "input_len": 64,
            "output_len": 64, "concurrency": 4, "request_rate": float("inf"), "num_prompts": 4, "completed": 4}
    return {**base, **kw}


@pytest.mark.parametrize("over, case, why", [
    ({}, "D2_c4", ""),                                                     # exact; the matrix case before search_c4
    ({"input_len": 63}, "D2_c4", ""),                                      # SGLang's 63 ids + BOS: within 1 token
    ({"input_len": 66}, None, "input 66 vs 64 tokens"),
    ({"output_len": 65.0}, "D2_c4", ""),                                   # vLLM's re-tokenized 33 for 32
    ({"request_rate": 2.0}, None, "open-loop request rate 2/s"),
    ({"request_rate": None}, "D2_c4", ""),                                 # a concurrency run states no rate
    ({"concurrency": None}, "D2_c4", ""),                                  # no limit, rate inf: all 4 at once
    ({"concurrency": 2}, None, "concurrency 2 vs 4"),
    ({"num_prompts": 16}, None, "16 prompts vs 4"),
    ({"concurrency": 8, "num_prompts": 8}, "D2_c8", ""),                   # prompts per wave ...
    ({"concurrency": 8, "num_prompts": 24}, "D2_c8", ""),                  # ... or over the 3 repeats
    ({"input_len": None}, None, "input length not stated"),
    ({"input_len": 1020, "output_len": 1, "concurrency": 1, "num_prompts": 1}, "P2", ""),   # 2 % of 1000
    ({"input_len": 1021, "output_len": 1, "concurrency": 1, "num_prompts": 1}, None, "input 1021 vs 1000"),
])
def test_shape_matching(over, case, why):
    m = pc.match(pd.DataFrame([peer(**over)]), CASES).iloc[0]
    assert (m["case_id"] if pd.notna(m["case_id"]) else None) == case
    assert why in m["why_unmatched"]
    if case is None:
        assert m["why_unmatched"].startswith("closest ")         # unmatched rows are listed with the reason
    if case == "D2_c4":
        assert m["also"] == "search_c4"                           # same shape, listed as the alternative


def test_every_peer_row_is_listed_even_without_cases():
    m = pc.match(pd.DataFrame([peer(), peer(run=1)]), CASES.iloc[0:0])
    assert len(m) == 2 and m["case_id"].isna().all()
    assert set(m["why_unmatched"]) == {"no Phase 1 case in this run"}


# ---------------------------------------------------------------- our records under each definition

def test_each_definition_on_one_stream():
    recs = [stream(i) for i in range(4)]           # TTFT 20, 4 text events 5 ms apart, empty choices +1, [DONE] +1
    s = {d: pc.summarize_as(recs, d, 2.0) for d in pc.PEER_DEFINITIONS}
    assert {d: s[d]["median_ttft_ms"] for d in s} == {d: 20.0 for d in s}
    # E2E: SGLang's and guidellm's include the stream tail ([DONE]), vLLM stops at the last choices event,
    # AIPerf at the last content response
    assert {d: s[d]["median_e2el_ms"] for d in s} == {"sglang": 37.0, "vllm": 36.0, "aiperf": 35.0, "guidellm": 37.0}
    assert s["sglang"]["median_tpot_ms"] == pytest.approx(17 / 3) and s["vllm"]["median_tpot_ms"] == pytest.approx(16 / 3)
    assert s["aiperf"]["median_tpot_ms"] == pytest.approx(5.0) and s["guidellm"]["median_tpot_ms"] == pytest.approx(5.0)
    # ITL: per text event, per choices event (the empty final one too), per content response, none
    assert s["vllm"]["mean_itl_ms"] == pytest.approx(16 / 4) and s["sglang"]["mean_itl_ms"] == 5.0
    assert s["aiperf"]["mean_itl_ms"] == 5.0 and s["guidellm"]["mean_itl_ms"] is None
    # sglang / vllm are exactly request_metrics'
    for d in mx.DEFINITIONS:
        ref = mx.summarize(recs, 2.0, d)
        assert all(s[d][k] == ref[k] for k in ("p99_ttft_ms", "mean_itl_ms", "p95_e2el_ms", "output_throughput"))
    # AIPerf's window: first request start → last content response (these 4 requests are 1 s apart)
    assert s["aiperf"]["duration_s"] == pytest.approx(3.035)
    assert s["aiperf"]["request_throughput"] == pytest.approx(4 / 3.035)
    assert s["guidellm"]["duration_s"] == 2.0 and s["guidellm"]["output_throughput"] == 8.0


def test_vllm_ttft_starts_at_a_role_only_event_and_guidellm_without_done_ends_at_the_close():
    r = stream(0, first_empty=True, done=False)
    s = {d: pc.summarize_as([r], d, 1.0) for d in pc.PEER_DEFINITIONS}
    assert s["vllm"]["median_ttft_ms"] == 18.0 and s["sglang"]["median_ttft_ms"] == 20.0
    assert s["aiperf"]["median_ttft_ms"] == 20.0 and s["guidellm"]["median_ttft_ms"] == 20.0
    assert s["guidellm"]["median_e2el_ms"] == pytest.approx((r.end_ns - r.send_ns) / 1e6)
    assert s["sglang"]["median_e2el_ms"] == 36.0          # last SSE line: the final choices event, no [DONE]


def test_guidellm_percentiles_are_nearest_rank_and_its_tpot_token_weighted():
    v = [1.0, 2.0, 3.0, 4.0]
    st = pc.weighted_nearest_stats(v, None, "x")
    assert (st["p50_x_ms"], st["median_x_ms"], st["p90_x_ms"], st["p99_x_ms"]) == (2.0, 2.0, 4.0, 4.0)
    assert float(np.percentile(v, 50)) == 2.5                        # what linear interpolation would say
    w = pc.weighted_nearest_stats([1.0, 10.0], [9, 1], "x")          # 9 gaps of 1 ms, 1 gap of 10 ms
    assert w["mean_x_ms"] == pytest.approx(1.9) and w["p90_x_ms"] == 1.0 and w["p95_x_ms"] == 10.0
    recs = [stream(0, out=10, gap_ms=1), stream(1, out=2, gap_ms=10)]
    g = pc.summarize_as(recs, "guidellm", 1.0)
    assert g["mean_tpot_ms"] == pytest.approx((9 * 1 + 1 * 10) / 10)                 # token-weighted
    assert pc.summarize_as(recs, "vllm", 1.0)["mean_tpot_ms"] != pytest.approx(g["mean_tpot_ms"])


def test_failed_requests_are_counted_apart():
    bad = stream(9)
    bad.http_status, bad.error_kind, bad.chunk_ns, bad.chunk_text, bad.chunk_choices = 500, "http", [], [], []
    for d in pc.PEER_DEFINITIONS:
        s = pc.summarize_as([stream(0), bad], d, 1.0)
        assert (s["completed"], s["failed"]) == (1, 1), d


# ---------------------------------------------------------------- servelab import

def test_import_copies_verbatim_writes_the_table_and_records_the_command(run, tmp_path, capsys):
    bs = sglang_file(tmp_path)
    files = [bs, *sorted(DATA.glob("*.json*"))]
    assert main(["import", *map(str, files), "--run-id", "peers"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == len(files) + 1                                   # one line per file, then what to do next
    assert out[0].startswith("sglang bench_serving: peers/files/bs.jsonl — 64→4 tokens, concurrency 4, rate inf, "
                             "4 prompts; 4 requests completed → same shape as our D2_c4")
    assert "→ no Phase 1 case of this run has its shape" in out[1]
    assert out[-1] == "run phase 1 into this run (servelab run phase1 --run-id peers) to see them side by side"
    pdir = run / "peers"
    for f in files:
        assert (pdir / "files" / f.name).read_bytes() == f.read_bytes()
    table = pd.read_csv(pdir / "peer_results.csv")
    assert len(table) == len(files) and set(table["file"]) == {f"peers/files/{f.name}" for f in files}
    js = json.loads((pdir / "peer_results.json").read_text())
    assert [e["file"] for e in js["imported"]] == [f"peers/files/{f.name}" for f in files]
    assert len(js["rows"]) == len(files) and js["imported"][0]["original"] == str(bs.resolve())
    rec = [r for r in read_commands(run, "phase1") if r.argv[:2] == ["servelab", "import"]]
    assert len(rec) == 1 and rec[0].label == "executed" and rec[0].exit_code == 0
    # the same file again is not a second row; another file of the same name is kept under a new name
    assert main(["import", str(bs), "--run-id", "peers"]) == 0
    assert "(already imported)" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    other = sglang_file(tmp_path / "other", max_concurrency=2)
    assert main(["import", str(other), "--run-id", "peers"]) == 0
    assert (pdir / "files" / "bs-2.jsonl").read_bytes() == other.read_bytes()
    assert len(pd.read_csv(pdir / "peer_results.csv")) == len(files) + 1


def _bad_files(tmp: Path) -> dict[str, Path]:
    (tmp / "unknown.json").write_text('{"hello": 1, "world": [2]}')
    (tmp / "notes.txt").write_text("not json at all\n")
    (tmp / "binary.bin").write_bytes(bytes(range(256)))
    (tmp / "a_dir").mkdir()
    ours = tmp / "summary_vllm_keys.jsonl"
    ours.write_text(json.dumps({"servelab_definition": "vllm", "completed": 1, "total_token_throughput": 1.0}) + "\n")
    (tmp / "empty.jsonl").write_text("\n")
    return {"unknown.json": tmp / "unknown.json", "notes.txt": tmp / "notes.txt", "binary.bin": tmp / "binary.bin",
            "a_dir": tmp / "a_dir", "summary_vllm_keys.jsonl": ours, "missing.json": tmp / "missing.json",
            "empty.jsonl": tmp / "empty.jsonl"}


@pytest.mark.parametrize("name, says", [("unknown.json", "unknown result format"), ("notes.txt", "not JSON"),
                                        ("binary.bin", "not a text file"), ("a_dir", "is a directory"),
                                        ("summary_vllm_keys.jsonl", "servelab's own export"),
                                        ("missing.json", "no such file"), ("empty.jsonl", "empty")])
def test_a_bad_file_is_one_line_and_nothing_is_written(run, tmp_path, capsys, name, says):
    bad = _bad_files(tmp_path)[name]
    good = sglang_file(tmp_path)
    before = (run / "commands.jsonl").read_text() if (run / "commands.jsonl").exists() else ""
    assert main(["import", str(good), str(bad), "--run-id", "peers"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"servelab: error: {bad}") and says in err[0], err
    assert "expected an SGLang bench_serving JSONL" in err[0]             # what would have been accepted
    assert not (run / "peers").exists()                                  # the good file was not copied either
    assert ((run / "commands.jsonl").read_text() if (run / "commands.jsonl").exists() else "") == before


def test_the_run_must_exist(outputs, tmp_path, capsys):
    assert main(["import", str(sglang_file(tmp_path)), "--run-id", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run 'nope'" in err[0]
    assert main(["import", str(sglang_file(tmp_path)), "--run-id", "../x"]) == 2
    assert "invalid run id" in capsys.readouterr().err
    assert not outputs.exists() or not any(outputs.iterdir())


def test_after_phase1_it_says_how_to_rerun_with_resume(run, tmp_path, capsys):
    from servelab.core.run import CommandRecord, record_command
    update_manifest(run, phases={"phase1": {"status": "success"}})
    record_command(run, CommandRecord("reproduce", ["servelab", "run", "phase1", "--target", "local-tiny", "--run-id",
                                                    "peers", "-p", 'cases=["D2_c4"]'], phase="phase1",
                                      title="run phase1 again into this run"))
    record_command(run, CommandRecord("reproduce", ["servelab", "run", "phase1", "--target", "local-tiny", "--run-id",
                                                    "peers", "-p", "repeats=1", "-p", "resume=true"], phase="phase1",
                                      title="re-run / resume this phase"))
    assert main(["import", str(sglang_file(tmp_path)), "--run-id", "peers"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("re-run phase 1 (servelab run phase1 --target local-tiny --run-id peers -p "
                           "'cases=[\"D2_c4\"]' --resume) to see them side by side")
    assert "phase1" in read_manifest(run)["phases"]


# ---------------------------------------------------------------- the Phase 1 section

def test_without_peers_the_section_is_one_line(run):
    t = pc.peer_files(run)
    assert t.shape == (1, 1) and t.iloc[0, 0].startswith("no peer result imported into this run: `servelab import "
                                                         "FILE... --run-id peers`")
    assert pc.peer_side_by_side(run) is None
    assert pc.ours_in_peer_definitions(run) is None and pc.peer_definition_notes(run) is None


def test_the_section_puts_the_peer_beside_ours_in_its_definition(run, tmp_path):
    pc.import_into_run(run, [sglang_file(tmp_path), DATA / "guidellm_0.8.1_benchmarks.json"])
    files = pc.peer_files(run)
    assert list(files["case_id"].fillna("")) == ["D2_c4", ""] and "peer_row" not in files
    side = pc.peer_side_by_side(run)
    cols = ["metric", "D2_c4 · sglang bench_serving, sglang def.", "D2_c4 · ours, sglang def.",
            "D2_c4 · ours − sglang bench_serving (%)"]
    assert list(side.columns) == cols
    row = side.set_index("metric").loc["TTFT p50 (ms)"]
    theirs = json.loads(SGLANG.read_text().splitlines()[0])["median_ttft_ms"]
    assert row.iloc[0] == theirs and row.iloc[1] == 20.0
    assert row.iloc[2] == pytest.approx(100 * (20.0 - theirs) / theirs)
    assert side.set_index("metric").loc["completed requests"].tolist()[:2] == [4, 4]      # counts stay integers
    every = pc.ours_in_peer_definitions(run)
    assert list(every.columns) == ["metric", *[f"D2_c4 · ours, {d} def." for d in pc.PEER_DEFINITIONS]]
    assert every.set_index("metric").loc["E2E p50 (ms)"].tolist() == [37.0, 36.0, 35.0, 37.0]
    notes = pc.peer_definition_notes(run)
    assert {"TTFT ends", "ITL", "E2E ends", "requests counted"} <= set(notes["aspect"])
    assert "stream tail" in notes.set_index("aspect").loc["E2E ends", "sglang bench_serving (sglang def.)"]


def test_resume_replays_stored_search_points(run):
    calls = []

    def runner(env, case):
        calls.append(case.case_id)
        return "measured"

    class Env:
        run_dir, repeats = run, 1
    skipped: list[str] = []
    wrapped = perf_map.resumable(runner, skipped)
    done = CaseSpec("search_c4", "search", "decode", 64, 4, 4, 4, True)
    write_case(run, done, [stream(i) for i in range(4)])
    res = wrapped(Env, done)
    assert res.status == "success" and res.summaries["vllm"]["completed"] == 4 and skipped == ["search_c4"]
    assert wrapped(Env, CaseSpec("search_c8", "search", "decode", 64, 4, 8, 8, True)) == "measured"
    assert calls == ["search_c8"]


def test_an_unreadable_peers_folder_is_a_note_not_a_failed_phase(run, tmp_path):
    pc.import_into_run(run, [sglang_file(tmp_path)])
    (run / "peers" / "files" / "bs.jsonl").unlink()
    t = pc.peer_files(run)
    assert t.shape == (1, 1) and t.iloc[0, 0].startswith("peers/ of this run could not be read: ")
    assert "bs.jsonl: no such file" in t.iloc[0, 0]
    assert pc.peer_side_by_side(run) is None and pc.ours_in_peer_definitions(run) is None


def test_the_json_table_keeps_an_unlimited_rate(run, tmp_path):
    pc.import_into_run(run, [sglang_file(tmp_path), DATA / "aiperf_0.13.0_profile_export_aiperf.json"])
    rows = json.loads((run / "peers" / "peer_results.json").read_text())["rows"]
    assert [r["request_rate"] for r in rows] == ["inf", None]          # sglang: inf; AIPerf states no rate
    assert rows[1]["failed"] == 0 and rows[0]["failed"] is None         # SGLang writes no 'failed'


def test_the_matched_case_carries_its_verdict(run, tmp_path):
    pc.import_into_run(run, [sglang_file(tmp_path)])
    assert pc.peer_files(run)["case_verdict"].tolist() == ["VALID"]
