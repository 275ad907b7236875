"""One-variable A/B discipline on real run directories (init_run / update_manifest in a temporary outputs folder).

Ground truth is written by hand in the tests: the manifests differ in exactly the keys set here, and the noise
verdicts follow from repeat values whose mean / sample std / CV are worked out in the comments.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from servelab.report import ab_figures
from servelab.report.ab_figures import ab_banner
from servelab.measure.abtest import (SummaryFormatError, ab_compare, classify_change, compare_cases, diff_manifests,
                             load_run, read_case_summaries, repeat_stats)
from servelab.deploy.engines import engine_for
from servelab.deploy.targets import load_target
from servelab.core.run import init_run, update_manifest

sys.path.insert(0, str(Path(__file__).parent))
from casefiles import write_cases  # noqa: E402


def make_run(run_id: str, launch_over: dict | None = None, env_over: dict | None = None,
             summary: list[dict] | None = None) -> "Path":
    """A run directory as Phase 0 + Phase 1 leave it: manifest (engine, model, launch plans/env/settings, hosts,
    phase params) and its case folders (one summary.json per case, one entry per repeat)."""
    t = load_target("example-2node")
    launch = {**t.launch, **(launch_over or {})}
    env = {**t.env, **(env_over or {})}
    t.launch, t.env = launch, env
    plans = engine_for("sglang").launch_plans(t, 30000)
    rdir = init_run(run_id, t.name)
    update_manifest(rdir, engine={"name": "sglang", "version": "0.5.9"},
                    model={"path": t.model, "sha256": "ab" * 32},
                    launch={"plans": [{"node": p.node, "command": p.shell(), "port": p.port, "log": f"/tmp/{run_id}/{p.node}.log"}
                                      for p in plans], "env": env, "settings": launch},
                    hosts={"node5": {"gpu_driver": "580.159.04", "gpu_query": f"0, H200, util for {run_id}"},
                           "node7": {"gpu_driver": "580.159.04"}},
                    phases={"phase1": {"status": "success", "params": {"run_id": run_id, "target": "example-2node",
                                                                        "repeats": 3}}})
    if summary is not None:
        write_cases(rdir, summary)
    return rdir


def rows(case: str, tps: list[float], tpot: list[float] | None = None, valid: bool = True) -> list[dict]:
    tpot = tpot or [50.0] * len(tps)
    return [{"case_id": case, "repeat": i, "output_tps": v, "p95_ttft_ms": 200.0, "p95_tpot_ms": tp,
             "p95_e2e_ms": 5000.0, "valid": valid} for i, (v, tp) in enumerate(zip(tps, tpot))]


def test_one_variable_ab_is_clean(outputs):
    a = make_run("ab-a", {"chunked_prefill_size": 8192}, summary=rows("D1", [100, 102, 98]) + rows("P1", [10, 10, 10]))
    b = make_run("ab-b", {"chunked_prefill_size": 4096}, summary=rows("D1", [110, 111, 109]) + rows("P1", [10, 10.2, 9.8]))
    ab = ab_compare([a, b], "chunked_prefill_size")
    diff = ab.differences
    declared = diff[diff["status"] == "declared"]
    assert declared["key"].tolist() == ["launch.settings.chunked_prefill_size"]
    assert declared.iloc[0]["ab-a"] == 8192 and declared.iloc[0]["ab-b"] == 4096
    # the launch commands differ only because of the declared setting
    cmd = diff[diff["key"].str.endswith(".command")]
    assert len(cmd) == 2 and set(cmd["status"]) == {"derived"}
    # timestamps, run ids, log paths and the GPU utilisation snapshot are volatile, not confounds
    assert not ab.confounded, diff[diff["status"] == "confound"]
    assert {"run_id", "created"} <= set(diff.loc[diff["status"] == "volatile", "key"])
    assert "hosts.node5.gpu_query" in set(diff.loc[diff["status"] == "volatile", "key"])
    q = ab.questions.set_index("question")["answer"]
    assert q.iloc[0] == "launch.settings.chunked_prefill_size: 8192 → 4096"
    assert q.iloc[2].startswith("nothing else")
    assert q.iloc[1] == "not answered" and q.iloc[4] == "not answered" and q.iloc[6] == "not answered"
    d1 = ab.comparison[(ab.comparison["case_id"] == "D1") & (ab.comparison["metric"] == "output_tps")].iloc[0]
    assert d1["verdict"] == "better" and d1["delta_pct"] == pytest.approx(10.0)
    assert "One-variable A/B" in ab_banner(ab).data


def test_confounded_ab_is_flagged_loudly(outputs):
    a = make_run("cf-a", {"chunked_prefill_size": 8192}, summary=rows("D1", [100, 102, 98]))
    b = make_run("cf-b", {"chunked_prefill_size": 4096, "kv_cache_dtype": "auto"}, {"NCCL_ALGO": "Ring"},
                 summary=rows("D1", [110, 111, 109]))
    ab = ab_compare([a, b], "chunked_prefill_size", answers={"why": "smaller chunks interleave decode", "keep": "yes"})
    conf = set(ab.confounds["key"])
    assert conf >= {"launch.settings.kv_cache_dtype", "launch.env.NCCL_ALGO"}
    # the commands now follow from undeclared settings too: confounds, and the note names them
    cmd = ab.differences[ab.differences["key"].str.endswith(".command")]
    assert set(cmd["status"]) == {"confound"} and cmd["note"].str.contains("kv_cache_dtype").all()
    assert ab.confounded
    html = ab_banner(ab).data
    assert "CONFOUNDED A/B" in html and "launch.env.NCCL_ALGO" in html
    q = ab.questions
    assert q.iloc[2]["answer"].startswith("CONFOUNDED")
    assert q.iloc[1]["answer"] == "smaller chunks interleave decode" and q.iloc[1]["source"] == "user"
    assert q.iloc[6]["answer"].startswith("cannot be decided") and "user: yes" in q.iloc[6]["answer"]


def test_accepted_difference_is_not_a_confound(outputs):
    a = make_run("ac-a", {"chunked_prefill_size": 8192}, summary=rows("D1", [1, 1]))
    b = make_run("ac-b", {"chunked_prefill_size": 4096}, {"NCCL_DEBUG": "INFO"}, summary=rows("D1", [1, 1]))
    ab = ab_compare([a, b], "chunked_prefill_size", accepted=["NCCL_DEBUG"])
    assert ab.differences.set_index("key").loc["launch.env.NCCL_DEBUG", "status"] == "accepted"
    # the launch commands changed because of the declared setting and the accepted env: derived, not confounds
    cmd = ab.differences[ab.differences["key"].str.endswith(".command")]
    assert set(cmd["status"]) == {"derived"} and cmd["note"].str.contains("NCCL_DEBUG").all()
    assert not ab.confounded
    assert not ab_compare([a, b], "chunked_prefill_size").differences.query("status == 'accepted'").shape[0]


def test_noise_rule_hand_computed():
    # A = 100, 102, 98: mean 100, sample std sqrt((0+4+4)/2) = 2, CV 2 %
    a = repeat_stats([100, 102, 98])
    assert (a["n"], a["mean"], a["std"], a["cv_pct"]) == (3, 100.0, 2.0, 2.0)
    # B = 101, 103, 99: mean 101 (+1 %), CV 1.98 %: band 2·2 = 4 % → within noise
    assert classify_change(a, repeat_stats([101, 103, 99]), True) == ("within noise", 4.0)
    # B = 110, 111, 109: +10 %, ranges [98, 102] and [109, 111] apart → better (TPS: higher is better)
    assert classify_change(a, repeat_stats([110, 111, 109]), True)[0] == "better"
    # the same numbers as a latency (lower is better) → worse
    assert classify_change(a, repeat_stats([110, 111, 109]), False)[0] == "worse"
    # k = 0.5: band 1 %; B = 101.5, 103, 104.5: +3 % > 1 % but B's min 101.5 < A's max 102 → ranges overlap → noise
    v, band = classify_change(a, repeat_stats([101.5, 103, 104.5]), True, k=0.5)
    assert v == "within noise" and band == pytest.approx(1.0)
    # one repeat: uncertainty unknown
    assert classify_change(a, repeat_stats([150]), True)[0] == "no repeats"
    assert math.isnan(repeat_stats([])["mean"])


def test_compare_cases_marks_invalid_and_latency_regressions(outputs):
    a = make_run("cc-a", summary=rows("D1", [100, 102, 98], [50, 51, 49]) + rows("D2", [5, 5, 5]))
    b = make_run("cc-b", summary=rows("D1", [100, 101, 99], [60, 61, 59]) + rows("D2", [9, 9, 9], valid=False))
    cmp = compare_cases(read_case_summaries(a), read_case_summaries(b)).set_index(["case_id", "metric"])
    # TPOT A: mean 50, CV 2 % → band 4 %; B: 60 (+20 %), ranges apart → worse
    assert cmp.loc[("D1", "p95_tpot_ms"), "verdict"] == "worse"
    assert cmp.loc[("D1", "p95_tpot_ms"), "delta_pct"] == pytest.approx(20.0)
    assert cmp.loc[("D1", "output_tps"), "verdict"] == "within noise"
    assert set(cmp.loc["D2", "verdict"]) == {"invalid"}
    fig = ab_figures.delta_figure(cmp.reset_index())
    assert len(fig.data) >= 3


def test_summary_reader_accepts_missing_metrics_and_says_so(outputs, tmp_path):
    d = tmp_path / "r1"
    write_cases(d, [{"case_id": "P1", "repeat": 0, "output_tps": 3.0}, {"case_id": "P1", "repeat": 1, "output_tps": 4.0}])
    s = read_case_summaries(d)
    assert s.missing == ["p95_ttft_ms", "p95_tpot_ms", "p95_e2e_ms"]
    assert any("metrics not in this run's summaries" in n for n in s.notes)
    assert s.frame["output_tps"].tolist() == [3.0, 4.0] and s.frame["valid"].all()
    # a summary that does not follow the case schema is refused by name, never half-read
    bad = d / "cases" / "P1" / "summary.json"
    bad.write_text(json.dumps({"repeats": [], "pooled": {}}))
    with pytest.raises(SummaryFormatError, match=r"P1/summary.json: not a servelab case summary.*missing key"):
        read_case_summaries(d)
    with pytest.raises(SummaryFormatError, match="no case summaries"):
        read_case_summaries(tmp_path)


def test_phase1_summaries_give_one_row_per_repeat_in_the_chosen_definition(tmp_path):
    """Phase 1's case summary: pooled metrics per definition, one entry per repeat; the reader takes the
    repeats in the asked definition, under our metric names (output_throughput → output_tps, p95_e2el_ms →
    p95_e2e_ms), valid from the case verdict."""
    from servelab.measure.case_record import CaseFolder, CaseSummary, verdict
    d = tmp_path / "p1"
    folder = CaseFolder(d, "D1", "phase1", "decode")
    folder.write_requests([])
    reps = [{dfn: {"output_throughput": v + (0.5 if dfn == "vllm" else 0), "p95_ttft_ms": 20.0, "p95_tpot_ms": 5.0,
                   "p95_e2el_ms": 900.0} for dfn in ("sglang", "vllm")} for v in (100.0, 101.0, 102.0)]
    folder.write_summary(CaseSummary("D1", "phase1", "decode", "success", verdict("VALID"), "vllm", reps[0],
                                     [{"repeat": i, "metrics": r} for i, r in enumerate(reps)]))
    s = read_case_summaries(d)
    assert s.frame["output_tps"].tolist() == [100.0, 101.0, 102.0]
    assert s.frame["p95_e2e_ms"].tolist() == [900.0] * 3 and s.frame["valid"].all()
    assert read_case_summaries(d, definition="vllm").frame["output_tps"].tolist() == [100.5, 101.5, 102.5]


def test_load_run_errors_name_the_directory(outputs, tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        load_run(tmp_path)
    a = make_run("lr-a")
    assert load_run("lr-a").run_dir == a
    with pytest.raises(ValueError, match="at least two runs"):
        ab_compare([a])


def test_diff_lists_every_difference_of_three_runs(outputs):
    runs = [make_run(f"tri-{i}", {"max_running_requests": m}) for i, m in enumerate((32, 64, 128))]
    diff = diff_manifests([load_run(r) for r in runs], "max_running_requests")
    row = diff.set_index("key").loc["launch.settings.max_running_requests"]
    assert (row["tri-0"], row["tri-1"], row["tri-2"], row["status"]) == (32, 64, 128, "declared")
    assert (diff["status"] != "confound").all()
