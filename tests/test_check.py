"""The run's facts and its consistency check (``servelab check``): each contradiction of issue 32 planted in a run
folder — two values for one fact, M4 passing beside a regression, a verdict on one request, a headline stating an
unsettled answer as a number, a stale cross-reference, a placeholder in a command, reprs, ``nan``, exponent
notation, a unit-less header — and the check reports it; the same run without the plant reports nothing."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from servelab.cli import main
from servelab.core import facts as fx
from servelab.core.run import init_run, record_command, CommandRecord, update_manifest
from servelab.report import answers
from servelab.report.archive import write_run_index
from servelab.report.check import check_run
from servelab.report.milestones import milestones

sys.path.insert(0, str(Path(__file__).parent))
from test_correctness import ab_run, record  # noqa: E402
from servelab.measure.abtest import ab_compare, write_ab_tables  # noqa: E402

CLEAN_PAGE = """<html><body><section class="servelab-findings"><ul><li>Max output TPS 63.6 tok/s (D2_c8, n=32).</li>
</ul></section><table><tr><th>case</th><th>TTFT P50 (ms)</th><th>output TPS (tok/s)</th></tr>
<tr><td>D2_c8</td><td>12.5</td><td>1,120</td></tr></table>
<div class="servelab-commands"><div class="servelab-cmd servelab-cmd-reproduce"><span>REPRODUCE</span>
servelab run phase1 --target local-tiny --run-id r</div></div></body></html>"""


def rules(found) -> set[str]:
    return {f.rule for f in found}


def page(rdir: Path, phase: str, body: str) -> Path:
    p = rdir / phase / "report.html"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(body)
    return p


def test_sample_rules_decide_validity_in_one_place():
    assert fx.make("x", 1.0, samples=1, kind="throughput").validity == fx.INDICATIVE
    assert fx.make("x", 1.0, samples=fx.MIN_SAMPLES["throughput"], kind="throughput").validity == fx.VALID
    assert fx.make("x", 1.0, samples=50, kind="throughput", source_valid=False).validity == fx.INVALID
    assert fx.make("x", -54.0, samples=1, kind="ab_verdict", unit="%").shown().endswith("indicative (n=1)")


def test_a_phase_rewrites_its_own_facts_only(outputs):
    rdir = init_run("facts", "local-tiny")
    fx.write_facts(rdir, "phase1", [fx.make("a", 1, phase="phase1"), fx.make("b", 2)])
    fx.write_facts(rdir, "phase9", [fx.make("c", 3)])
    fx.write_facts(rdir, "phase1", [fx.make("a", 5)])                 # a re-run states its own answers
    assert {f.name: f.value for f in fx.read_facts(rdir)} == {"a": 5, "c": 3}
    assert check_run(rdir) == []


def test_clean_page_has_no_findings_and_each_planted_flaw_is_found(outputs):
    rdir = init_run("pages", "local-tiny")
    page(rdir, "phase1", CLEAN_PAGE)
    assert check_run(rdir) == []
    plants = {
        "placeholder in a command": CLEAN_PAGE.replace("--run-id r", "--run-id r --env-file &lt;private run folder&gt;"),
        "exponent notation in a table": CLEAN_PAGE.replace("1,120", "1.12e+03"),
        "Python repr as a table cell": CLEAN_PAGE.replace("<td>12.5</td>", "<td>None</td>"),
        "Python repr in the findings": CLEAN_PAGE.replace("(D2_c8, n=32).", "(D2_c8); slow rank: None."),
        "nan in the findings": CLEAN_PAGE.replace("63.6", "nan"),
        "header without its unit": CLEAN_PAGE.replace("TTFT P50 (ms)", "TTFT"),
        "Python repr in a table caption": CLEAN_PAGE.replace("<table>", '<div class="servelab-caption">alignment ok: '
                                                             'True. Slow rank: None</div><table>'),
    }
    for rule, body in plants.items():
        page(rdir, "phase1", body)
        assert rule in rules(check_run(rdir)), rule
    page(rdir, "phase1", CLEAN_PAGE)
    assert check_run(rdir) == []


def test_a_stale_cross_reference_is_found_once_the_file_exists(outputs):
    rdir = init_run("stale", "local-tiny")
    page(rdir, "phase3", CLEAN_PAGE.replace("</ul>", "<li>KV near full: not evaluable: Phase 8 has not written "
                                                     "phase8/kv_usage.csv — run Phase 8.</li></ul>"))
    assert check_run(rdir) == []                       # true while Phase 8 has not run
    (rdir / "phase8").mkdir()
    (rdir / "phase8" / "kv_usage.csv").write_text("t,usage\n0,0.5\n")
    assert "stale cross-reference" in rules(check_run(rdir))


def test_the_run_order_wording_is_not_stale(outputs):
    """What Phase 3's action table says now (worded by run order) stays true after Phase 8 runs."""
    from servelab.analyse.trace.actions import _phase_table
    rdir = init_run("order", "local-tiny")
    _, why = _phase_table(rdir, "phase8/kv_usage.csv", "phase8", "its KV samples decide it")
    assert "had not written phase8/kv_usage.csv when this was computed" in why
    assert "<" not in why and "--target local-tiny --run-id order" in why
    page(rdir, "phase3", CLEAN_PAGE.replace("</ul>", f"<li>{why}</li></ul>"))
    (rdir / "phase8").mkdir()
    (rdir / "phase8" / "kv_usage.csv").write_text("t,usage\n0,0.5\n")
    assert check_run(rdir) == []


def test_two_values_for_one_fact(outputs):
    rdir = init_run("twice", "local-tiny")
    fx.write_facts(rdir, "phase1", [fx.make(answers.MAX_TPS, 71.35, unit="tok/s", samples=32, kind="throughput")])
    assert check_run(rdir) == []
    fx.write_facts(rdir, "phase2", [fx.make(answers.MAX_TPS, 56.8, unit="tok/s", samples=32, kind="throughput")])
    found = [f for f in check_run(rdir) if f.rule == "same fact, different values"]
    assert found and "71.35" in found[0].detail and "56.8" in found[0].detail


def test_a_verdict_on_one_request(outputs):
    rdir = init_run("n1", "local-tiny")
    bad = fx.Fact("phase9:net_gain", -54.0, "%", "S9_ngram_c1", 1, fx.VALID, kind="ab_verdict")
    fx.write_facts(rdir, "phase9", [bad])
    assert "VALID below its sample rule" in rules(check_run(rdir))
    fx.write_facts(rdir, "phase9", [fx.make("phase9:net_gain", -54.0, unit="%", samples=1, kind="ab_verdict")])
    assert check_run(rdir) == []                       # recorded as the rule says: indicative, no contradiction
    (rdir / "phase9").mkdir()
    pd.DataFrame([{"case_id": "S9_off_c1_r0", "validity": "VALID", "completed": 1}]).to_csv(
        rdir / "phase9" / "points.csv", index=False)
    assert "VALID below its sample rule" in rules(check_run(rdir))


def test_a_headline_stating_an_unsettled_answer_as_a_number(outputs):
    rdir = init_run("head", "local-tiny")
    f = fx.make(answers.MAX_TPS, "unsettled: search 56.8 tok/s at C=8 vs matrix 71.35 tok/s at C=16", phase="phase1",
                kind="verdict")
    fx.write_facts(rdir, "phase1", [f])
    update_manifest(rdir, phases={"phase1": {"status": "success", "headline": {answers.MAX_TPS: f.value}}})
    assert check_run(rdir) == []
    update_manifest(rdir, phases={"phase1": {"status": "success", "headline": {answers.MAX_TPS: 71.35}}})
    assert "headline against its fact" in rules(check_run(rdir))


def test_m4_cannot_pass_beside_a_recorded_regression(outputs):
    """Phase 7's change keeps greedy outputs and gains 20 %; Phase 9's speculative config changes them. M4 reads the
    recorded verdicts: its correctness check fails and names Phase 9's regression; an index that says otherwise (as
    the old M4 did) is a finding of the check."""
    rdir = ab_run(outputs, "m4-spec", "llamacpp_b_batch32", [120, 121, 119])
    answers.record_correctness(rdir, "phase7")
    assert milestones(rdir)[3].status == "met"
    a = record(rdir, "phase9", "off", [], [100, 101, 99], "llamacpp_a")
    b = record(rdir, "phase9", "ngram", ["--spec"], [60, 61, 59], "llamacpp_b_rope1000")
    write_ab_tables(ab_compare([a, b], "extra_args"), rdir / "phase9")
    got = answers.record_correctness(rdir, "phase9")
    assert [f.value for f in got] == ["regression"] and got[0].name == "correctness:phase9/m4-spec-ngram"
    m4 = milestones(rdir)[3]
    corr = m4.checks[3]
    assert m4.status == "not met" and corr.status == "fail" and "phase9/m4-spec-ngram: regression" in corr.detail
    write_run_index(rdir)
    assert check_run(rdir) == [] or "milestone against a recorded verdict" not in rules(check_run(rdir))
    index = rdir / "index.html"
    text = index.read_text()
    assert "fail</span> no correctness regression" in text
    index.write_text(text.replace("fail</span> no correctness regression", "pass</span> no correctness regression"))
    assert "milestone against a recorded verdict" in rules(check_run(rdir))


def test_servelab_check_exits_one_on_a_finding(outputs, capsys):
    rdir = init_run("cli", "local-tiny")
    assert main(["check", "cli"]) == 0
    assert "no contradictions" in capsys.readouterr().err
    record_command(rdir, CommandRecord(label="planned", argv=["nsys", "profile", "ENGINE_COMMAND"], phase="phase3"))
    page(rdir, "phase1", CLEAN_PAGE.replace("1,120", "1.47e+03"))
    assert main(["check", "cli"]) == 1
    err = capsys.readouterr().err
    assert "exponent notation in a table" in err and "1 finding(s)" in err
    assert json.loads((rdir / "check.json").read_text())["findings"][0]["rule"] == "exponent notation in a table"
    assert main(["check", "no-such-run"]) == 2


def test_a_fill_in_value_gets_its_own_line_not_a_placeholder(outputs):
    from servelab.report.commands import commands_html
    rdir = init_run("fill", "local-tiny")
    record_command(rdir, CommandRecord(label="planned", argv=["docker", "run", "--env-file", "ENV_FILE", "img"],
                                       phase="phase4"))
    out = commands_html(rdir, "phase4")
    assert "fill in: <code>ENV_FILE</code>" in out and "&lt;" not in out.split("servelab-fill-in")[0].split("</style>")[1]


@pytest.mark.parametrize("verdict,agree", [("agree", True), ("disagree", False)])
def test_one_max_tps_answer_or_unsettled(outputs, verdict, agree, monkeypatch):
    """The search and the matrix answer the max-TPS question together: one fact with its source, or unsettled."""
    from servelab.report import crosscheck as cc
    s = cc.Measurement("search_c8", "phase1", "Phase 1 search", 128, 128, 8, "{}", 56.8, 0.01, 32, "VALID", [])
    m = cc.Measurement("D2_c16", "phase1", "Phase 1 matrix", 128, 128, 16, "{}", 71.35 if not agree else 57.0, 0.01,
                       48, "VALID", [])
    monkeypatch.setattr(cc, "max_tps_question", lambda run_dir, ms=None: {
        "search": s, "matrix": m, "verdict": verdict, "why": "test", "question": "q", "stop": "", "stop_detail": ""})
    got = {f.name: f for f in answers.max_tps_facts(Path("."), [s, m])}
    if agree:
        assert got[answers.MAX_TPS].value == 57.0 and got[answers.MAX_TPS_C].value == 16
        assert "D2_c16" in got[answers.MAX_TPS].source and got[answers.MAX_TPS].validity == fx.VALID
    else:
        v = got[answers.MAX_TPS].value
        assert v.startswith("unsettled: search 56.8") and "71.3" in v and not got[answers.MAX_TPS].settled


def test_gpu_only_hypotheses_are_not_applicable_on_a_cpu_target(outputs):
    from servelab.report.ledger import ledger
    rdir = init_run("cpu", "local-tiny")
    assert set(ledger(rdir)["status"]) == {"open"}                 # Phase 0 recorded nothing: nothing ruled out
    update_manifest(rdir, hosts={"local": {"cpu_count": 2, "gpu_list": "-"}})
    st = ledger(rdir).set_index("id")
    assert {h: st.loc[h, "status"] for h in ("H1", "H2", "H3", "H7")} == dict.fromkeys(("H1", "H2", "H3", "H7"),
                                                                                       "not applicable")
    assert st.loc["H4", "status"] == "open" and "not applicable on this target" in st.loc["H1", "decided_by"]
    update_manifest(rdir, hosts={"local": {"cpu_count": 2, "gpu_list": "NVIDIA H200 (UUID: GPU-1)"}})
    assert ledger(rdir).set_index("id").loc["H1", "status"] == "open"


def test_phase4_names_the_model_the_run_target_serves():
    from types import SimpleNamespace
    from servelab.phases.phase4_topology import model_label
    cfg = SimpleNamespace(name="DeepSeek-V4-Pro", source="params/models/deepseek.yaml")
    cluster = SimpleNamespace(name="h200-cluster", model="/models/DeepSeek-V4-Pro")
    local = SimpleNamespace(name="local", model="/cache/gemma-3-270m-it-Q4_K_M.gguf", engine="llamacpp")
    text = model_label(cfg, cluster, local)
    assert "this run's target local serves gemma-3-270m-it-Q4_K_M.gguf (llamacpp)" in text
    assert "the target serves" not in text and "h200-cluster is planned here, not measured" in text


def test_an_interrupted_attempt_without_a_start_reads_cleanly_in_the_index(outputs):
    """The demo run interrupted in Phase 1 (its attempt has ``started: None``): the lessons table said 'None' — the
    check found it; the index now shows when it ended."""
    from servelab.core.run import edit_manifest
    rdir = init_run("lessons", "local-tiny")
    edit_manifest(rdir, lambda m: m.setdefault("attempts", []).append(
        {"phase": "phase1", "status": "interrupted", "started": None, "ended": "2026-12-03T14:26:53", "error": "",
         "not_executed": [], "params": {"target": "local"}}))
    write_run_index(rdir)
    assert check_run(rdir) == []
    assert "2026-12-03T14:26:53" in (rdir / "index.html").read_text()


def test_a_small_value_is_written_out_not_in_exponent_notation():
    """The ten-page run's Phase 1 table showed a CV of 6.51e-05 %; every page number goes through format_value."""
    from servelab.report.findings import format_value
    assert [format_value(v) for v in (6.51e-05, 0.203, 0.0123, -0.00042, 0.5)] == \
        ["0.0000651", "0.203", "0.0123", "-0.00042", "0.5"]


def test_a_prefill_case_is_never_cross_checked_on_its_output_tps():
    """768→1 measured twice (Phase 1 and Phase 2's replay) is no output-TPS question; 64→256 twice is one."""
    from servelab.report import crosscheck as cc
    prefill = [cc.Measurement(cid, ph, src, 768, 1, 1, "{}", tps, 0.05, 8, "VALID", [])
               for cid, ph, src, tps in (("P1", "phase1", "Phase 1 matrix", 0.188),
                                         ("hw-P1", "phase2", "Phase 2 (collectors on)", 0.5))]
    decode = [cc.Measurement(cid, ph, src, 64, 256, 4, "{}", tps, 0.01, 8, "VALID", [])
              for cid, ph, src, tps in (("D2_c4", "phase1", "Phase 1 matrix", 56.8),
                                        ("hw-D2_c4", "phase2", "Phase 2 (collectors on)", 80.0))]
    pairs = cc.same_question(Path("."), prefill + decode)
    assert list(pairs["a_case"]) == ["D2_c4"] and list(pairs["verdict"]) == ["disagree"]


@pytest.mark.parametrize("agree", [True, False])
def test_the_max_tps_answer_is_said_once_in_phase1s_findings(agree, monkeypatch):
    """Unsettled, the maximum names both sides with their concurrencies once; settled, the value and its C."""
    from servelab.phases.phase1_perf_map import answers_sentence
    from servelab.report import crosscheck as cc
    s = cc.Measurement("search_c8", "phase1", "Phase 1 search", 128, 128, 8, "{}", 56.8, 0.01, 32, "VALID", [])
    m = cc.Measurement("D2_c16", "phase1", "Phase 1 matrix", 128, 128, 16, "{}", 71.35 if not agree else 57.0, 0.01,
                       48, "VALID", [])
    monkeypatch.setattr(cc, "max_tps_question", lambda run_dir, ms=None: {
        "search": s, "matrix": m, "verdict": "agree" if agree else "disagree", "why": "test", "question": "q",
        "stop": "", "stop_detail": ""})
    text = answers_sentence(answers.max_tps_facts(Path("."), [s, m]), 8, "no SLO")
    if agree:
        assert "max output TPS 57.0" in text and "at concurrency 16" in text, text
    else:
        assert text.count("unsettled") == 1 and "max output TPS and its concurrency unsettled: search 56.8" in text, text


def test_an_invalid_case_unmarked_and_one_number_shown_twice_are_found(outputs):
    """A row of an INVALID case in a table with no validity column, and the same P95 of one case in two tables with
    values their shown precision cannot both round from (issue 32: "the same P95 shown as 2,036 and 2,039.69")."""
    rdir = init_run("tables", "local-tiny")
    (rdir / "cases" / "D2_c8").mkdir(parents=True)
    (rdir / "cases" / "D2_c8" / "summary.json").write_text(json.dumps({"case_id": "D2_c8",
                                                                       "verdict": {"status": "INVALID"}}))
    page(rdir, "phase1", CLEAN_PAGE)
    assert rules(check_run(rdir)) == {"INVALID case without a mark"}
    marked = CLEAN_PAGE.replace("<th>case</th>", "<th>case</th><th>validity</th>").replace(
        "<td>D2_c8</td>", "<td>D2_c8</td><td>INVALID</td>")
    page(rdir, "phase1", marked)
    assert check_run(rdir) == []
    second = ('<table><tr><th>case</th><th>validity</th><th>TTFT P50 (ms)</th></tr>'
              '<tr><td>D2_c8</td><td>INVALID</td><td>{}</td></tr><tr><td>D2_c8</td><td>INVALID</td><td>1</td></tr>'
              '</table>')
    one_row = second.replace("<tr><td>D2_c8</td><td>INVALID</td><td>1</td></tr>", "")
    for shown, found in (("12.54", False), ("13", False), ("12.6", True), ("14", True)):
        page(rdir, "phase1", marked.replace("</body>", one_row.format(shown) + "</body>"))
        assert ("one number, two values" in rules(check_run(rdir))) == found, shown
    # a key that names two rows of one table (per-request rows, say) compares nothing
    page(rdir, "phase1", marked.replace("</body>", second.format("99") + "</body>"))
    assert check_run(rdir) == []


@pytest.mark.parametrize("source, says", [("as served", "points of the attached server as served (S9_c1: "),
                                          ("baseline", "baseline (S9_c1: ")])
def test_phase9_points_without_a_twin_are_said_so_in_a_grammatical_sentence(source, says, monkeypatch):
    """Phase 9's points alone in the run: 'the points … have no measurement', 'the baseline … has none'."""
    from servelab.report import crosscheck as cc
    src = cc.AS_SERVED if source == "as served" else cc.SOURCE["phase9"]
    ms = [cc.Measurement(f"S9_c{c}", "phase9", src, 32, 64, c, "{}", 40.0, 0.01, 8, "VALID", []) for c in (1, 4)]
    monkeypatch.setattr(cc, "measurements", lambda run_dir: ms)
    monkeypatch.setattr(cc, "max_tps_question", lambda run_dir, ms=None: None)
    text, = cc.findings(Path("."))
    verb = "have" if source == "as served" else "has"
    assert says in text and f") {verb} no measurement of the same shape" in text, text


def test_every_headline_number_is_a_recorded_fact_and_the_pages_show_the_fact(outputs):
    """A phase closes with its headline: every number becomes a fact (a plain value ``<phase>/<key>`` with the unit
    its key names; a value given as a fact keeps its source, samples and validity), the manifest says which fact each
    key is, and the index shows the fact. A headline number with no fact behind it, or a manifest number that is not
    its fact's, is a finding; a re-run replaces the phase's earlier facts."""
    from servelab.phases import phase4_topology as phase4
    from servelab.phases.context import finish_phase, phase_context
    ctx = phase_context(phase4.Params(target="local-tiny", run_id="heads"))
    accept = fx.make("phase4/acceptance_rate", 0.9, samples=3, kind="acceptance_rate", source="S9_x")
    entry = finish_phase(ctx, headline={"layouts": 3, "p95_tpot_ms": 12.5, "acceptance_rate": accept})
    got = {f.name: f for f in fx.read_facts(ctx.run_dir)}
    assert got["phase4/p95_tpot_ms"].unit == "ms" and got["phase4/p95_tpot_ms"].value == 12.5
    assert got["phase4/layouts"].value == 3 and "local-tiny" in got["phase4/layouts"].source
    assert got["phase4/acceptance_rate"].validity == fx.INDICATIVE         # 3 proposals: below the rule of 20
    assert entry["headline"]["acceptance_rate"] == "0.9 (S9_x, n=3), indicative (n=3)"
    assert entry["headline_facts"] == {"layouts": "phase4/layouts", "p95_tpot_ms": "phase4/p95_tpot_ms",
                                       "acceptance_rate": "phase4/acceptance_rate"}
    assert check_run(ctx.run_dir) == []
    write_run_index(ctx.run_dir)
    assert "indicative (n=3)" in (ctx.run_dir / "index.html").read_text()

    # the fact is what the pages show: the index follows facts.jsonl, and the check sees the manifest disagree
    lines = (ctx.run_dir / fx.FACTS_FILE).read_text().replace('"value": 12.5', '"value": 99.5')
    (ctx.run_dir / fx.FACTS_FILE).write_text(lines)
    write_run_index(ctx.run_dir)
    assert "99.50 ms" in (ctx.run_dir / "index.html").read_text()
    found = check_run(ctx.run_dir)
    assert [(f.rule, f.detail) for f in found] == [
        ("headline against its fact", "p95_tpot_ms = 12.5, the recorded fact: 99.5")]

    # a headline number nobody recorded
    update_manifest(ctx.run_dir, phases={"phase4": {**entry, "headline": {**entry["headline"], "p95_tpot_ms": 99.5,
                                                                           "cases": 7}}})
    found = check_run(ctx.run_dir)
    assert [(f.where, f.rule) for f in found] == [("phase4 headline", "a headline number without a recorded fact")]
    assert "cases = 7" in found[0].detail

    # a re-run states its own headline: the key it no longer has is gone from the facts
    ctx2 = phase_context(phase4.Params(target="local-tiny", run_id="heads"))
    finish_phase(ctx2, headline={"layouts": 2})
    assert {f.name: f.value for f in fx.read_facts(ctx.run_dir)} == {"phase4/layouts": 2}
    assert check_run(ctx.run_dir) == []


def test_a_finding_that_states_another_number_than_its_fact(outputs):
    """Phase 1's findings name the P50 TTFT of P1 with the number its fact records (as the demo's page words it); a
    sentence that names the same label with another number — a second answer to one question — is a finding."""
    rdir = init_run("said", "local-tiny")
    fx.write_facts(rdir, "phase1", [fx.make("phase1/P1_p50_ttft_ms", 145.583, unit="ms", samples=100,
                                            kind="percentile"),
                                    fx.make("phase1/cases", 13)])
    said = ("13 of 13 cases VALID. P1 P50 TTFT (prefill floor) 145.58 ms, P50 (n=100), D1 P50 TPOT (single stream) "
            "16.89 ms, P50 (n=11).")
    box = '<section class="servelab-findings"><ul><li>{}</li></ul></section>'
    page(rdir, "phase1", box.format(said))
    assert check_run(rdir) == []
    page(rdir, "phase1", box.format(said + " Later: P1 P50 TTFT 139.2 ms."))
    found = [f for f in check_run(rdir) if f.rule == "a finding against its fact"]
    assert len(found) == 1 and "139.2" in found[0].detail and "phase1/P1_p50_ttft_ms = 145.583" in found[0].detail
