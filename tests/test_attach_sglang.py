"""Phases 3 and 8 on an attached SGLang: a real SGLang with two tensor-parallel ranks on this CPU, started by the test
outside servelab (its profiler folder set by the test, as a deployment's own launch would). Phase 3 captures through
``/start_profile`` on the endpoint and analyses the traces read from ``profile.trace_dir``; Phase 8 empties the
server's prefix cache through its ``/flush_cache`` before each hit-rate point, never restarting it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from servelab.deploy.hosts import free_port
from servelab.deploy.server import http_json, plan_launch
from servelab.deploy.targets import load_target
from servelab.measure.launch_variants import with_launch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outside_sglang(tmp_path_factory: pytest.TempPathFactory):
    """SGLang TP=2 on 127.0.0.1, the command servelab would plan for local-sglang, started here with SGLang's own
    profiler folder variable pointing at ``<tmp>/traces``; one server for the module's tests (each its own run)."""
    tmp_path = tmp_path_factory.mktemp("outside-sglang")
    port = free_port()
    plans, _ = plan_launch(with_launch(load_target("local-sglang"), {"tp_size": 2}), port)
    plan = next(p for p in plans if p.role == "head")
    traces = tmp_path / "traces"
    traces.mkdir()
    log = open(tmp_path / "sglang.log", "wb")
    proc = subprocess.Popen(plan.argv, env={**os.environ, **plan.env, "SGLANG_TORCH_PROFILER_DIR": str(traces)},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while http_json(url + "/health", timeout=2)[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "sglang.log").read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield proc, url, traces
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_phase3_on_an_attached_sglang_captures_through_start_profile(outside_sglang, tmp_path: Path) -> None:
    proc, url, traces = outside_sglang
    target = tmp_path / "attached-sglang.yaml"
    target.write_text(yaml.safe_dump({"name": "attached-sglang", "engine": "sglang", "endpoint": url,
                                      "served_model_name": "tiny-hf", "profile": {"trace_dir": str(traces)},
                                      "nodes": [{"name": "local", "kind": "local", "role": "head"}]}))
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONPATH": str(ROOT / "lib")}
    run = subprocess.run([sys.executable, "-m", "servelab.cli", "run", "phase3", "--target", str(target),
                          "--run-id", "a3", "-p", "scenarios=[decode_control]"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert proc.poll() is None and http_json(url + "/health")[0] == 200       # still the test's own server
    rdir = tmp_path / "outputs" / "a3"
    manifest = json.loads((rdir / "manifest.json").read_text())
    assert manifest["phases"]["phase3"]["status"] == "success" and not manifest["phases"]["phase3"]["from_samples"]
    cmds = [json.loads(ln) for ln in (rdir / "commands.jsonl").read_text().splitlines()]
    assert any("/start_profile" in " ".join(c["argv"]) for c in cmds)
    assert not [c for c in cmds if c["title"].startswith("start sglang")]
    got = sorted(p.name for p in (rdir / "cases" / "D2-profile--profile-decode_control").rglob("*.trace.json.gz"))
    assert [t.rsplit("-TP-", 1)[1] for t in got] == ["0.trace.json.gz", "1.trace.json.gz"], got   # both ranks
    assert (rdir / "phase3" / "trace_analysis.json").is_file()                                      # analysed
    # the drive saw the server's trace where the server writes it (profile.trace_dir) and stopped its load then —
    # not at the end of its keep-alive bound, which it once ran out looking in the run's own folder
    marks = json.loads((rdir / "cases" / "D2-profile--profile-decode_control" / "summary.json").read_text())
    assert "trace_written" in marks["details"]["marks_wall_ns"], marks["details"]["marks_wall_ns"]
    assert list(traces.rglob("*.trace.json.gz")), "the server wrote where it was started to write"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_phase8_on_an_attached_sglang_flushes_through_its_endpoint(outside_sglang, tmp_path: Path) -> None:
    proc, url, _ = outside_sglang
    target = tmp_path / "attached-sglang.yaml"
    target.write_text(yaml.safe_dump({"name": "attached-sglang", "engine": "sglang", "endpoint": url,
                                      "served_model_name": "tiny-hf"}))
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONPATH": str(ROOT / "lib")}
    run = subprocess.run([sys.executable, "-m", "servelab.cli", "run", "phase8", "--target", str(target),
                          "--run-id", "a8", "-p", "rates=[0.0,0.5]", "-p", "bad_point=false"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert proc.poll() is None and http_json(url + "/health")[0] == 200       # the same server, never restarted
    rdir = tmp_path / "outputs" / "a8"
    matrix = pd.read_csv(rdir / "phase8" / "hit_rate_matrix.csv")
    assert sorted(matrix["target_rate"]) == [0.0, 0.5], matrix.columns.tolist()
    for case in ("H8_hit00", "H8_hit50"):
        summary = json.loads((rdir / "cases" / case / "summary.json").read_text())
        flush = summary["details"].get("flush") or json.loads((rdir / "cases" / case / "meta.json").read_text())[
            "flush"]
        assert flush["flushed"] and "/flush_cache" in json.dumps(flush), flush
    cmds = [json.loads(ln) for ln in (rdir / "commands.jsonl").read_text().splitlines()]
    assert not [c for c in cmds if c["title"].startswith("start sglang")]
    page = (rdir / "phase8" / "report.html").read_text()
    assert "attached" in page
