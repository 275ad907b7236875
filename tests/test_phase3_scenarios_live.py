"""Phase 3 on a real SGLang (CPU, ``local-sglang``) captured at a point of a real Phase 1 run (``capture_at``):
TP=2 with every scenario analysed and shown on its own, and PP=2 with the pipeline's send/recv counted as
exposed communication. The commands are the ones whose figures are quoted in the branch's report:

    servelab run phase1 --target local-tiny --run-id p1 -p 'cases=["D2_c4"]' -p search=false
    servelab run phase5 --target local-sglang --run-id tp2 -p tp_size=2 -p max_bytes=4M
    servelab run phase3 --target local-sglang --run-id tp2 -p tp_size=2 -p capture_at=p1:D2_c4
    servelab run phase5 --target local-sglang --run-id tp2 -p tp_size=2 -p max_bytes=4M
    servelab run phase3 --target local-sglang --run-id pp2 -p pp_size=2 -p capture_at=p1:D2_c4 \\
        -p 'scenarios=[decode_control, long_prefill]'

The ``check_*`` functions read a run folder only."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.measure.records import read_records

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")]
SCENARIOS = ("long_prefill", "decode_control", "prefix_hit", "mixed_treatment")


def rows(path) -> list[dict]:
    return list(csv.DictReader(open(path)))


def check_scenarios(rdir: Path, names: tuple[str, ...]) -> list[dict]:
    """A section, tables and ten answers per captured scenario, each bound to the Phase 1 case."""
    ph = rdir / "phase3"
    compare = rows(ph / "scenarios" / "trace_scenario_compare.csv")
    assert [r["scenario"] for r in compare] == list(names) and all(not r["note"] for r in compare)
    page = (ph / "report.html").read_text()
    for r in compare:
        d = ph / "scenarios" / r["scenario"]
        assert r["case"] == f"D2_c4-profile--profile-{r['scenario']}" and (rdir / "cases" / r["case"]).is_dir()
        q = rows(d / "trace_questions.csv")
        assert [x["id"] for x in q] == [f"Q{i}" for i in range(1, 11)]
        assert {x["capture"] for x in q} == {f"{r['scenario']} ({r['case']})"}
        assert {x["rank"] for x in rows(d / "trace_ranks.csv")} == {"0", "1"} and int(r["ranks"]) == 2
        assert float(r["median_step_ms"]) > 0
        assert f'id="scenario-{r["scenario"]}"' in page and r["case"] in page
    return compare


def check_tp2(rdir: Path) -> None:
    check_scenarios(rdir, SCENARIOS)
    ph = rdir / "phase3"
    q1 = rows(ph / "trace_questions.csv")[0]          # the page's Q1: prefill and decode from their own captures
    pre, dec = q1["answer"].split(" | ")
    assert pre.startswith("prefill (from long_prefill (D2_c4-profile--profile-long_prefill))")
    assert dec.startswith("decode (from decode_control (D2_c4-profile--profile-decode_control))")
    top = rows(ph / "scenarios" / "long_prefill" / "trace_top_kernels.csv")
    assert [t for t in top if t["kind"] == "prefill"][0]["kernel"] in pre


def check_pp2(rdir: Path) -> None:
    check_scenarios(rdir, ("long_prefill", "decode_control"))
    for sc in ("decode_control", "long_prefill"):
        d = rdir / "phase3" / "scenarios" / sc
        summary = rows(d / "trace_summary.csv")
        exposed = sum(float(r["exposed_comm_ms"]) for r in summary)
        cbc = rows(d / "trace_comm_by_collective.csv")
        assert exposed > 0 and {r["collective"] for r in cbc} == {"SendRecv"}
        assert sum(float(r["exposed_ms"]) for r in cbc) == pytest.approx(exposed, rel=1e-6)
        q2 = {r["id"]: r for r in rows(d / "trace_questions.csv")}["Q2"]
        assert q2["answerable"] == "true"
        for k in {r["kind"] for r in summary}:         # Q2's number per kind is the summary's, over the ranks
            ms = sum(float(r["exposed_comm_ms"]) for r in summary if r["kind"] == k)
            assert f"{k}: {ms:,.2f} ms exposed" in q2["answer"]


def check_gloo_ceiling(rdir: Path) -> None:
    """The engine's gloo collectives against the gloo sweep Phase 5 measured on this machine, on both pages."""
    sweep = rows(rdir / "phase5" / "gloo_sweep.csv")
    assert {r["collective"] for r in sweep} == {"all_reduce", "all_gather"} and {r["nranks"] for r in sweep} == {"2"}
    assert {r["status"] for r in sweep} == {"ok"} and all(float(r["busbw_gbps"]) > 0 for r in sweep)
    for table in ("phase3/collectives_vs_ceiling.csv", "phase5/engine_vs_ceiling.csv"):
        t = rows(rdir / table)
        placed = [r for r in t if r["ceiling busbw (GB/s)"] not in ("", "nan")]
        assert {r["collective"] for r in placed} >= {"all_reduce"}, t
        assert all(float(r["share of ceiling (%)"]) > 0 for r in placed)
    assert "this run&#x27;s Phase 5 gloo sweep" in (rdir / "phase3" / "report.html").read_text() or \
        "this run's Phase 5 gloo sweep" in (rdir / "phase3" / "report.html").read_text()
    p5 = json.loads((rdir / "manifest.json").read_text())["phases"]["phase5"]
    assert any("gloo ceiling measured here" in f for f in p5.get("findings", [])), p5.get("findings")


def check_cpu_placement(rdir: Path, ranks: int) -> None:
    """Each rank's process, cores and NUMA node, read while the engine ran, beside the per-rank tables."""
    rec = json.loads((rdir / "phase3" / "rank_processes.json").read_text())
    assert len(rec["ranks"]) == ranks and all(r["cpus_allowed"] for r in rec["ranks"]) and rec["numa"]["local"]
    assert all(r["title"].startswith("sglang::scheduler") for r in rec["ranks"])
    page = (rdir / "phase3" / "report.html").read_text()
    assert "NUMA node" in page and "CPU cores" in page and "— (CPU)" in page


def check_capture_at(rdir: Path, isl: int, osl: int, conc: int) -> None:
    cdir = rdir / "cases" / "D2_c4-profile--profile-decode_control"
    meta = json.loads((cdir / "meta.json").read_text())
    spec = meta["scenario_spec"]
    assert (spec["isl_tokens"], spec["osl_tokens"], spec["concurrency"]) == (isl, osl, conc)
    assert meta["bound_case_id"] == "D2_c4-profile"
    bg = [r for r in read_records(cdir / "requests.jsonl") if r.role == "background"]
    assert len(bg) >= conc and {r.expected_input_tokens for r in bg} == {isl}
    page = (rdir / "phase3" / "report.html").read_text()
    assert 'href="../../p1/phase1/report.html"' in page and "Phase 1 case D2_c4 of run p1" in page


def test_phase3_at_a_phase1_point_tp2_and_pp2(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    assert main(["run", "phase1", "--target", "local-tiny", "--run-id", "p1", "-p", 'cases=["D2_c4"]',
                 "-p", "search=false"]) == 0
    case = {r["case_id"]: r for r in rows(tmp_path / "p1" / "summary.csv")}["D2_c4"]
    point = int(case["input_len"]), int(case["output_len"]), int(case["concurrency"])
    assert main(["run", "phase3", "--target", "local-sglang", "--run-id", "tp2", "-p", "capture_at=p1:D9"]) == 2
    assert not (tmp_path / "tp2").exists()                 # an unknown point: nothing made
    gloo = ["run", "phase5", "--target", "local-sglang", "--run-id", "tp2", "-p", "tp_size=2", "-p", "max_bytes=4M"]
    assert main(gloo) == 0                                  # the ceiling first: Phase 3's page places on it
    assert main(["run", "phase3", "--target", "local-sglang", "--run-id", "tp2", "-p", "tp_size=2",
                 "-p", "capture_at=p1:D2_c4"]) == 0
    assert main(gloo) == 0                                  # and Phase 5's page places Phase 3's collectives
    check_tp2(tmp_path / "tp2")
    check_gloo_ceiling(tmp_path / "tp2")
    check_cpu_placement(tmp_path / "tp2", 2)
    check_capture_at(tmp_path / "tp2", *point)
    assert main(["run", "phase3", "--target", "local-sglang", "--run-id", "pp2", "-p", "pp_size=2",
                 "-p", "capture_at=p1:D2_c4", "-p", "scenarios=[decode_control, long_prefill]"]) == 0
    check_pp2(tmp_path / "pp2")
    check_cpu_placement(tmp_path / "pp2", 2)
    check_capture_at(tmp_path / "pp2", *point)
