"""M3 — the topology sequence of ``docs/method.md#topology`` answered, not "some measured CSV exists": Phase 4 run
for real on measured runs (``phase4.run``: feasibility, measured comparison, verdicts), Phase 3's per-stage view
from real pipeline captures (``data/samples/sglang-cpu-pp2``: stage 1 slow; ``h200x2-pp2``: balanced)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from servelab.analyse.trace.analysis import analyse, write_tables
from servelab.core import run as runlib
from servelab.deploy.engines import engine_for
from servelab.deploy.targets import load_target
from servelab.phases.context import PhaseContext
from servelab.phases import phase4_topology as phase4
from servelab.report.milestones import m3

sys.path.insert(0, str(Path(__file__).parent))
from casefiles import write_cases  # noqa: E402


def measured_run(run_id: str, settings: dict, tps: float, cases: tuple[str, ...], nodes: int = 2) -> None:
    """A run measured with one layout on the reference cluster: its launch plans (one per node) and case summaries."""
    t = load_target("example-2node")
    t.launch = {**t.launch, **settings}
    plans = engine_for("sglang").launch_plans(t, 30000)[:nodes]
    rdir = runlib.init_run(run_id, "example-2node")
    runlib.update_manifest(rdir, launch={"settings": t.launch, "env": {},
                                         "plans": [{"node": p.node, "command": p.shell(), "port": p.port}
                                                   for p in plans]})
    write_cases(rdir, [{"case_id": c, "repeat": i, "output_tps": tps * (k + 1) + i, "p95_ttft_ms": 100.0,
                        "p95_tpot_ms": 20.0 + k, "p95_e2e_ms": 3000.0, "valid": True}
                       for k, c in enumerate(cases) for i in range(3)])


def phase4_run(run_id: str, runs: list[str]) -> Path:
    rdir = runlib.init_run(run_id, "example-2node")
    (rdir / "phase4").mkdir()
    params = phase4.Params.resolve(given={"model_config": "deepseek-v3", "cluster_target": "example-2node",
                                          "gpu_memory_gib": 141.0, "runs": runs}, phase_file_values=False)
    ctx = PhaseContext(phase="phase4", run_id=run_id, run_dir=rdir, phase_dir=rdir / "phase4", params=params,
                       target=load_target("example-2node"), started=runlib.now_iso())
    phase4.run(ctx)
    return rdir


def stage_view(rdir: Path, samples: Path, capture: str, tmp: Path) -> None:
    a = analyse(samples / capture / "traces", cache_dir=tmp / capture)
    write_tables(a, rdir / "phase3")
    runlib.update_manifest(rdir, phases={"phase3": {"status": "success", "from_samples": False}})


FULL = ("D1", "D2_c16", "D2_c32", "D2_c64")


def test_m3_before_phase4_is_not_started(outputs):
    ms = m3(runlib.init_run("m3-none", "example-2node"))
    assert ms.status == "not started" and len(ms.checks) == 7


def test_m3_model_only_answers_feasibility_and_nothing_else(outputs):
    rdir = phase4_run("m3-model", [])
    checks = {c.check: c for c in m3(rdir).checks}
    assert checks["layouts' memory feasibility assessed"].status == "pass"
    assert "TP8+PP2 fits" in checks["layouts' memory feasibility assessed"].detail
    rest = [c for k, c in checks.items() if k != "layouts' memory feasibility assessed"]
    assert all(c.status == "not measured" and "no layout measured" in c.detail for c in rest)


def test_m3_answers_the_test_order_for_the_pipeline_layout(outputs, samples, tmp_path):
    measured_run("m3-tp16", {"tp_size": 16}, 100.0, FULL)
    measured_run("m3-pp2", {"tp_size": 8, "pp_size": 2}, 110.0, FULL)
    rdir = phase4_run("m3-full", ["m3-tp16", "m3-pp2"])
    ms = m3(rdir)
    c = {x.check: x for x in ms.checks}
    assert c["baseline layout kept and measured"].status == "pass"
    assert c["baseline layout kept and measured"].detail.startswith("baseline TP16;")
    assert c["smoke test: each layout loads and serves"].status == "pass"
    d1 = c["C=1 decode latency per layout"]
    assert d1.status == "pass" and "TP16 20.00 ms" in d1.detail and "TP8+PP2 20.00 ms" in d1.detail
    thr = c["decode throughput at C=16/32/64 per layout"]           # the cluster scale's decode concurrencies
    assert thr.status == "pass" and "C=64: TP16 401.0 tok/s, TP8+PP2 441.0 tok/s" in thr.detail
    # two nodes and no rail traffic per layout: not answered yet, with what would answer it and the model's numbers
    x = c["cross-node traffic per layout"]
    assert x.status == "not measured" and "2 nodes" in x.detail and "modelled per decode step" in x.detail
    # a pipeline layout measured, no per-stage view yet: the capture to make is named
    st = c["pipeline stages balanced"]
    assert st.status == "not measured" and "capture the TP8+PP2 layout in Phase 3" in st.detail
    stage_view(rdir, samples, "sglang-cpu-pp2", tmp_path)
    st = {x.check: x for x in m3(rdir).checks}["pipeline stages balanced"]
    assert st.status == "pass" and st.detail.startswith("answered: stage 1 holds the pipeline back")
    stage_view(rdir, samples, "h200x2-pp2", tmp_path)
    st = {x.check: x for x in m3(rdir).checks}["pipeline stages balanced"]
    assert st.status == "pass" and st.detail.startswith("answered: balanced")
    assert m3(rdir).status == "not met"                   # cross-node traffic is still not measured
    # Phase 2 run on each layout's run: its rails' transmit rate per case (the columns Phase 2's summary writes)
    for rid, gbps in (("m3-tp16", 38.5), ("m3-pp2", 1.25)):
        (outputs / rid / "phase2").mkdir()
        (outputs / rid / "phase2" / "telemetry_summary.csv").write_text(
            "case,collector,metric,head_status,head_n,head_mean,worker_status,worker_n,worker_mean\n"
            f"hw-P3,rdma,rdma_tx_gbps,ok,5,{gbps * 3},ok,5,{gbps * 3}\n"
            f"hw-D2_c16,rdma,rdma_tx_gbps,ok,5,{gbps},ok,5,{gbps}\n"
            "hw-D2_c16,mpstat,cpu_busy_pct,ok,5,50,ok,5,50\n")
    x = {x.check: x for x in m3(rdir).checks}["cross-node traffic per layout"]
    assert x.status == "pass" and "TP16 38.50 Gbit/s (rdma_tx_gbps over hw-D2_c16)" in x.detail
    assert "TP8+PP2 1.25 Gbit/s" in x.detail
    assert m3(rdir).status == "met"


def test_m3_names_what_the_sequence_misses(outputs):
    measured_run("m3b-tp16", {"tp_size": 16}, 100.0, ("D1", "D2_c16"), nodes=1)
    measured_run("m3b-pp2", {"tp_size": 8, "pp_size": 2}, 110.0, ("D2_c16",), nodes=1)
    rdir = phase4_run("m3-gaps", ["m3b-tp16", "m3b-pp2"])
    c = {x.check: x for x in m3(rdir).checks}
    assert c["C=1 decode latency per layout"].status == "not measured"
    assert c["C=1 decode latency per layout"].detail.startswith("D1 not measured on TP8+PP2")
    thr = c["decode throughput at C=16/32/64 per layout"]
    assert thr.status == "not measured" and "D2_c32 on TP16, TP8+PP2" in thr.detail and "measure_cases" in thr.detail
    x = c["cross-node traffic per layout"]                # one node: nothing crosses nodes, said as such
    assert x.status == "pass" and x.detail.startswith("the measured layouts ran on one node")


@pytest.mark.parametrize("samples_flag", [True])
def test_a_stage_view_from_recorded_samples_answers_nothing(outputs, samples, tmp_path, samples_flag):
    measured_run("m3c-tp16", {"tp_size": 16}, 100.0, FULL)
    measured_run("m3c-pp2", {"tp_size": 8, "pp_size": 2}, 110.0, FULL)
    rdir = phase4_run("m3-samples", ["m3c-tp16", "m3c-pp2"])
    stage_view(rdir, samples, "sglang-cpu-pp2", tmp_path)
    runlib.update_manifest(rdir, phases={"phase3": {"status": "success", "from_samples": samples_flag}})
    st = {x.check: x for x in m3(rdir).checks}["pipeline stages balanced"]
    assert st.status == "not measured" and st.detail.startswith("Phase 3 read recorded sample data")
