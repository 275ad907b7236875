"""All ten phase pages and the run index of one run on the tiny target, read in headless Chromium as a reader would:
content drawn, plotly figures drawn, links resolve, findings first, no table clipped at 1400 px, no count printed
as ``N.00``, no Python repr, no placeholder in a command, where the numbers come from badged at the top, the index
opening with the run summary — and the findings consistent with the tables they cite. One run serves every test
of this module (the session's ``tiny_run``, shared with other modules). A screenshot per page lands in
test-artifacts/screenshots/."""
from __future__ import annotations

import csv
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from servelab.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TINY_RUN_PHASES  # noqa: E402
from browser import (assert_page_rules, chromium, command_problems, content_fraction, dom_text,  # noqa: E402
                     page_checks, screenshot, table_problems)

PHASES = TINY_RUN_PHASES


@pytest.fixture
def run_dir(tiny_run: Path) -> Path:
    return tiny_run


def _skip_without_chromium() -> None:
    if not chromium():
        pytest.skip("chromium not installed (Debian package chromium; `make system` installs it)")


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


@pytest.mark.slow
def test_every_page_renders_with_figures_and_live_links(run_dir):
    _skip_without_chromium()
    pages = [run_dir / "index.html", run_dir.parent / "index.html"] + sorted(run_dir.glob("phase*/report.html"))
    assert len(pages) == 2 + len(PHASES)
    for page in pages:
        name = page.parent.name if page.name == "report.html" else page.stem + ("_root" if page.parent != run_dir else "")
        png = screenshot(page, f"page_{name}", width=1400, height=1600)
        assert content_fraction(png) > 0.02, page
        html = page.read_text()
        for href in re.findall(r'href="([^"#:]+)(?:#[^"]*)?"', html):
            assert (page.parent / href).exists(), (page, href)           # every relative link resolves
        if page.name == "report.html" and "application/vnd.plotly.v1+json" in html:
            dom = dom_text(page)
            assert "main-svg" in dom, f"{page}: plotly figures did not draw"
        # offline: nothing is loaded from the network (plotly.js is inlined; strings inside it don't count)
        assert not re.search(r'<script[^>]+src="https?:', html) and not re.search(r'<link[^>]+href="https?:', html)


@pytest.mark.slow
def test_every_page_opens_with_findings_and_holds_no_reprs(run_dir):
    """In the browser, every phase page: the findings box first (non-empty), no ``np.float64(`` / ``{'`` /
    ``Timestamp(`` in its text, an executed or reproduce command in ``#commands``, no table cut off."""
    _skip_without_chromium()
    pages = sorted(run_dir.glob("phase*/report.html"))
    assert [p.parent.name for p in pages] == sorted(phase for phase, _ in PHASES)
    for page in pages:
        r = assert_page_rules(page)
        assert r["tables"] > 0, page


@pytest.mark.slow
def test_ten_pages_read_cleanly_and_say_where_their_numbers_come_from(run_dir):
    """At 1400 px, on all ten pages: no table clipped (wider than the page, scroll bar or not), no count shown as
    ``N.00``, no Python repr as a cell, in a header or a caption, no ``<placeholder>`` in a command; and every page
    with recorded sample data or a model says so at its top (a badge inside the findings box that opens it), the
    same sources as the run index shows."""
    _skip_without_chromium()
    m = _manifest(run_dir)
    problems = []
    for page in sorted(run_dir.glob("phase*/report.html")):
        r = page_checks(page, width=1400)
        problems += [f"{page.parent.name}: {p}" for p in table_problems(r) + command_problems(r)]
        kinds = {s["kind"] for s in m["phases"][page.parent.name].get("sources") or [{"kind": "live"}]}
        shown = {c.split("servelab-source-")[-1].split()[0] for c in r["sources"]}
        assert r["findings_first"] and kinds <= shown, (page.parent.name, kinds, shown)
    assert problems == [], "\n".join(problems)
    # the data the demo shows from elsewhere is badged: recorded H200 samples (3, 5, 6 and Phase 2's sample
    # section), Phase 4's model and Phase 5's message-size model
    kinds = {p: {s["kind"] for s in e.get("sources") or []} for p, e in m["phases"].items()}
    assert {"samples"} <= kinds["phase3"] and {"samples"} <= kinds["phase6"] and {"samples", "model"} <= kinds["phase5"]
    assert kinds["phase4"] == {"model"} and {"live", "samples"} <= kinds["phase2"] and kinds["phase1"] == {"live"}


@pytest.mark.slow
def test_the_index_opens_with_the_run_summary(run_dir):
    """The run index opens with the run summary (target, engine, model, hardware, where the client ran, which
    phases measured live and which show recorded samples or a model, and the run-level verdicts with evidence
    links); the host-bound verdict is there exactly when Phase 0's core count and Phase 2's CPU use say so."""
    _skip_without_chromium()
    index = run_dir / "index.html"
    html = index.read_text()
    head = html.split("<h1>", 1)[1]
    assert head.split("</h1>", 1)[1].startswith("<section class='summary' id='run-summary'>")
    r = page_checks(index, width=1400)
    assert [t for t in r["grid"] if t["clipped"]] == []
    summary = r["text"].split("Run summary", 1)[1].split("Investigation ledger", 1)[0]
    for label in ("target", "engine", "model", "hardware", "client", "measured live", "recorded sample data",
                  "model only"):
        assert label in summary, label
    assert "llamacpp" in summary and "tiny" in summary and "same host as the engine" in summary
    m = _manifest(run_dir)
    cores = int(next(iter(m["hosts"].values()))["cpu_count"])
    busy = [float(x["head_mean"]) for x in csv.DictReader(open(run_dir / "phase2" / "case_cpu_busy_pct_summary.csv"))
            if x["head_mean"] not in ("", "-")]
    stalls = [s for s in run_dir.glob("cases/*/summary.json")
              if "client fell behind" in " ".join(json.loads(s.read_text())["verdict"]["reasons"])]
    expect = cores <= 8 and (any(b >= 90 for b in busy) or bool(stalls))
    assert ("latency and throughput figures of this run are bounded by the host" in summary) == expect, \
        (cores, busy, len(stalls))
    # every cross-check that disagrees is a run-level verdict, with both numbers
    from servelab.report import crosscheck
    for text in crosscheck.findings(run_dir):
        assert " ".join(text.split()) in " ".join(summary.split()), text


@pytest.mark.slow
def test_findings_agree_with_the_tables_they_cite(run_dir):
    """Invariants between what a page says and the table it rests on: a kernel label a verdict denies is not in the
    table it cites; Phase 6 says when it ranks another capture than Phase 3's; Phase 3 flags a window kind whose
    exposed communication is one step's wait; Phase 8 calls no hit rate a winning value; Phase 9 never says
    'does not pay' next to 'no change is a verdict yet'; Phase 1's headline numbers come from VALID cases and every
    search point that completed fewer requests than its size is INVALID."""
    m = _manifest(run_dir)
    ev = [json.loads(x) for x in (run_dir / "evidence.jsonl").read_text().splitlines() if x.strip()]
    # Phase 6: the denied suspect labels are absent from kernels_ranked.csv
    ranked = list(csv.DictReader(open(run_dir / "phase6" / "kernels_ranked.csv")))
    denials = [e for e in ev if e["phase"] == "phase6" and (e.get("numbers") or {}).get("denied_suspects")]
    for e in denials:
        assert not {r["suspect"] for r in ranked} & set(e["numbers"]["denied_suspects"]), e["summary"]
        assert "phase6/kernels_ranked.csv" in e["tables"]
    text = {p.parent.name: " ".join(page_checks(p)["findings_text"].split()) for p in run_dir.glob("phase*/report.html")}
    from servelab.phases.phase6_kernels import same_capture
    p6 = m["phases"]["phase6"]["headline"]["kernel source"]
    src6 = next(str(p) for p in Path(__file__).resolve().parents[1].glob(f"data/samples/**/{p6}"))
    differs = not same_capture(src6, m["phases"]["phase3"]["headline"]["from_trace_dir"])
    assert ("Not the capture of Phase 3" in text["phase6"]) == differs
    # Phase 3: the flagged step is in trace_windows.csv with most of its kind's exposed communication
    if "Flag:" in text["phase3"]:
        step = re.search(r"— (\S+) holds", text["phase3"]).group(1)
        rows = list(csv.DictReader(open(run_dir / "phase3" / "trace_windows.csv")))
        kind = next(r["kind"] for r in rows if r["name"] == step)
        mine = sum(float(r["exposed_comm_ms"]) for r in rows if r["name"] == step)
        total = sum(float(r["exposed_comm_ms"]) for r in rows if r["kind"] == kind)
        assert mine >= 0.5 * total
        assert any(k.startswith(f"{kind}_exposed_comm_without_") for k in m["phases"]["phase3"]["headline"])
    assert "winning value" not in text["phase8"]
    assert not ("does not pay" in text["phase9"] and "no change is a verdict yet" in text["phase9"])
    # Phase 1: a P1 / D1 number in the headline comes from a VALID case with its sample count beside it
    h1 = m["phases"]["phase1"]["headline"]
    for cid, metric in (("P1", "ttft"), ("D1", "tpot")):
        verdict = json.loads((run_dir / "cases" / cid / "summary.json").read_text())["verdict"]["status"]
        assert (f"{cid}_p50_{metric}_ms" in h1) == (verdict == "VALID"), (cid, verdict, h1)
    search = json.loads((run_dir / "phase1" / "search.json").read_text())
    for p in search["points"]:
        if p["completed"] is not None and p["completed"] < p["required"]:
            assert p["verdict"] == "INVALID" and any("too few requests" in r for r in p["reasons"]), p
    best = search["max_tps_concurrency"]
    assert best is None or next(p for p in search["points"] if p["concurrency"] == best)["verdict"] == "VALID"


@pytest.mark.slow
def test_the_consistency_check_reports_nothing(run_dir, monkeypatch):
    """``servelab check`` over the whole run (every page and fact): no finding. One answer per question in the facts
    (Phase 1's max output TPS, its concurrency and the max concurrency under the SLO, each with its source or
    "unsettled"), the index's headline states them as recorded, and M4 agrees with every recorded correctness
    verdict."""
    from servelab.core.facts import read_facts
    from servelab.report.check import check_run
    found = check_run(run_dir)
    assert found == [], "\n".join(f.line() for f in found)
    names = [f.name for f in read_facts(run_dir)]
    assert len(names) == len(set(names))
    assert {"max_output_tps", "max_tps_concurrency", "max_under_slo_concurrency"} <= set(names)
    # every number a phase's headline states is one of those facts (the check would report one that is not)
    for phase, e in json.loads((run_dir / "manifest.json").read_text())["phases"].items():
        if e.get("status") == "success":
            assert set(e.get("headline_facts") or {}) == set(e.get("headline") or {}), phase
            assert set(e["headline_facts"].values()) <= set(names), phase
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(run_dir.parent))
    assert main(["check", run_dir.name]) == 0


@pytest.mark.slow
def test_an_invalid_p1_is_never_put_forward(run_dir, tmp_path):
    """The issue's run: P1 INVALID because the client fell behind (the reason a Gemma run on this 2-core host gave).
    Phase 1's headline and findings built from this run's real case folders, with P1's verdict INVALID, name P1 as
    not a result and show none of its numbers; nor does the run index built from them."""
    from servelab.core.facts import plain
    from servelab.core.run import edit_manifest
    from servelab.deploy.targets import load_target
    from servelab.measure import request_metrics as mx
    from servelab.measure.case import load_case_result
    from servelab.measure.matrix import MatrixResult, quick_matrix
    from servelab.phases.phase1_perf_map import Phase1Result, findings
    from servelab.report.archive import write_run_index
    from servelab.report.findings import format_value
    copy = tmp_path / "pages"
    shutil.copytree(run_dir, copy)
    specs = quick_matrix(load_target("local-tiny"), ["P1", "D1", "D2_c4"])
    results = [load_case_result(c, copy / "cases" / c.case_id) for c in specs]
    p1 = results[0]
    assert p1.case.case_id == "P1" and p1.summaries
    p50 = p1.summaries["vllm"]["p50_ttft_ms"]
    shown = {f"{format_value(p50)} ms", f"{p50:.2f} ms"}                # how a P50 TTFT of P1 would read
    p1.verdict = mx.Verdict("INVALID", ["client fell behind: its event loop stalled 313.7 ms (worst of 19833 samples, "
                                        "> 100 ms)"])
    res = Phase1Result(MatrixResult(results, [], []), "vllm")
    head, found = res.headline(), findings(res, copy)
    assert "P1_p50_ttft_ms" not in head and "not a result: P1 INVALID" in head["P1_p50_ttft"]
    said = " ".join(found)
    assert "P1 P50 TTFT" not in said and "INVALID (never shown as results): P1" in said
    assert not any(v in said for v in shown), (shown, said)
    edit_manifest(copy, lambda m: m["phases"]["phase1"].update(headline=plain(head), findings=found))
    index = write_run_index(copy).read_text()
    row = index.split('<tr><td><a href="phase1/report.html">phase1</a>', 1)[1].split("</tr>", 1)[0]
    assert "not a result: P1 INVALID" in row and not any(v in row.replace("<b>", "").replace("</b>", "")
                                                         for v in shown), row
