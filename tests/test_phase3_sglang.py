"""`servelab run phase3 --target local-sglang -p tp_size=2`: a real SGLang with two tensor-parallel ranks on this CPU
(torch's gloo collectives between them), captured live, analysed like a GPU capture — and a planted straggler: rank 1
is made slow on purpose, and the slow-rank verdict must name it.

How rank 1 is slowed: the test's target puts ``tests/straggler/`` on the engine's PYTHONPATH; its ``sitecustomize``
makes rank 1 sleep 100 ms before each torch collective (all-reduce, all-gather, broadcast: SGLang's tensor-parallel
collectives on CPU) while a flag file exists — the test creates it once the capture's warm-up is recorded (the decode
streams and the profiled steps follow) and removes it once the capture's traces are written (SGLang makes the trace
folder only then). Rank 1 then arrives last at every collective by 100 ms, more than this shared machine's
own scheduling noise (20 ms was not: ranks were late by up to 270 ms in both directions under load). Slowing the rank's CPU does not do it here: SGLang binds a rank to its cores only with Intel AMX or on arm64
(its log says "init_cpu_threads_env ... is disabled"), both cores of this shared machine are loaded alike, and a rank
stopped for most of every 2 ms (SIGSTOP/SIGCONT) still ran the tiny model's layers at full speed between its stops —
it arrived last at 38-64 % of the collectives from run to run; rank 0, which schedules and broadcasts for both, is
the later one when nothing is planted. The verdict rule (``analyse.trace.ranks.slow_rank``) needs one rank last at
>= 75 % of the matched collectives, late by >= 10 µs at the median.
"""
from __future__ import annotations

import csv
import json
import os
import threading
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.core.run import read_commands, read_manifest

pytestmark = pytest.mark.slow
STRAGGLER = Path(__file__).parent / "straggler"


def straggler_target(folder: Path, flag: Path) -> Path:
    """local-sglang with two TP ranks and the planted straggler's environment (a target file of the test's own)."""
    import yaml
    from conftest import ROOT
    doc = yaml.safe_load((ROOT / "params" / "targets" / "local-sglang.yaml").read_text())
    doc["name"] = "local-sglang-straggler"
    doc["env"] = {**doc.get("env", {}), "PYTHONPATH": str(STRAGGLER), "SERVELAB_TEST_STRAGGLER_FLAG": str(flag),
                  "SERVELAB_TEST_STRAGGLER_RANK": "1", "SERVELAB_TEST_STRAGGLER_DELAY_S": "0.1"}
    path = folder / "local-sglang-straggler.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_tp2_capture_names_the_planted_straggler(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    flag = tmp_path / "straggler-on"
    target = straggler_target(tmp_path, flag)
    commands = tmp_path / "tp2" / "commands.jsonl"
    profiles = tmp_path / "tp2" / "phase3" / "engine-profiles"
    stop = threading.Event()
    armed: list[bool] = []

    def arm() -> None:            # armed for the capture only: the engine's start and warm-up run at full speed
        while not stop.wait(0.02):
            if not armed and commands.is_file() and "warm-up before decode_control" in commands.read_text():
                flag.touch()
                armed.append(True)
            if armed and list(profiles.rglob("*.trace.json.gz")):
                flag.unlink()
                return
    armer = threading.Thread(target=arm, daemon=True)
    armer.start()
    try:
        code = main(["run", "phase3", "--target", str(target), "--run-id", "tp2", "-p", "tp_size=2",
                     "-p", "scenarios=[decode_control]"])
    finally:
        stop.set()
        armer.join()
    assert code == 0 and armed, "the capture ran with the straggler armed"
    rdir = tmp_path / "tp2"
    phase = read_manifest(rdir)["phases"]["phase3"]
    assert phase["status"] == "success" and not phase["from_samples"]
    starts = [r for r in read_commands(rdir, "phase3") if r.title.startswith("start sglang")]
    assert len(starts) == 1 and "--tp-size 2" in " ".join(starts[0].argv)
    assert starts[0].env.get("SGLANG_CPU_OMP_THREADS_BIND") == "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])
    case = rdir / "cases" / "D2-profile--profile-decode_control"
    traces = sorted(p.name for p in case.rglob("*.trace.json.gz"))
    assert [t.rsplit("-TP-", 1)[1] for t in traces] == ["0.trace.json.gz", "1.trace.json.gz"], traces
    tables = rdir / "phase3"
    comm = list(csv.DictReader(open(tables / "trace_comm_by_collective.csv")))
    ranks_with_allreduce = {r["rank"] for r in comm if r["collective"] == "AllReduce" and float(r["comm_ms"]) > 0}
    assert ranks_with_allreduce == {"0", "1"}, comm                    # per-rank communication from gloo
    skew = list(csv.DictReader(open(tables / "trace_collective_skew.csv")))
    assert {r["rank"] for r in skew} == {"0", "1"}
    verdict = json.loads((tables / "trace_analysis.json").read_text())["slow_rank"]
    assert verdict["slow_rank"] == 1, verdict
    page = (tables / "report.html").read_text()
    assert "rank 1" in page and "gloo" in page
