"""One case run again as a new attempt (``servelab case``), and the reproduce command of every Phase 1 case on its
page: copied from the page, run, it lands a new attempt beside the untouched first one."""
from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from servelab.cli import main
from servelab.core import run as runlib
from servelab.measure import case as cs
from servelab.measure import request_metrics as mx
from servelab.measure.case_record import read_summary
from servelab.measure.case_rerun import read_recipe

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- what servelab case refuses, in one line

def _case_folder(rdir: Path, folder: str, meta: dict) -> None:
    (rdir / "cases" / folder).mkdir(parents=True)
    (rdir / "cases" / folder / "meta.json").write_text(json.dumps(meta))


def test_a_case_that_cannot_be_rerun_is_one_line_and_exit_2(outputs: Path, capsys: pytest.CaptureFixture) -> None:
    rdir = runlib.init_run("r1", "local-tiny")
    spec = {"case_id": "hw-P3", "scenario": "P3", "kind": "prefill", "input_tokens": 8, "output_tokens": 1,
            "concurrency": 1, "num_prompts": 1, "warmup": False}
    _case_folder(rdir, "hw-P3", {"case_id": "hw-P3", "phase": "phase2", "case": spec})
    _case_folder(rdir, "I7", {"case_id": "I7", "phase": "phase7"})
    for argv, want in ((["case", "nope", "P1"], "no run 'nope'"),
                       (["case", "r1", "hw-P33"], "no case 'hw-P33' in run 'r1' (did you mean 'hw-P3'?)"),
                       (["case", "r1", "hw-P3"], "is a phase2 case: re-running one case is not supported yet"),
                       (["case", "r1", "I7"], "is a phase7 case: re-running one case is not supported yet")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("servelab: error: ") and want in err[0], err
    assert sorted(p.name for p in (rdir / "cases").iterdir()) == ["I7", "hw-P3"]      # nothing written


def test_a_case_written_before_case_env_is_rebuilt_from_its_meta_and_the_phase_params(outputs: Path) -> None:
    rdir = runlib.init_run("r2", "local-tiny")
    runlib.update_manifest(rdir, phases={"phase1": {"params": {"target": "local-tiny", "slo_ttft_ms": 500.0,
                                                               "slo_tpot_ms": 0.0}}})
    spec = {"case_id": "D2_c4", "scenario": "D2", "kind": "decode", "input_tokens": 64, "output_tokens": 64,
            "concurrency": 4, "num_prompts": 4, "warmup": True, "notes": ["clamped"], "min_window_s": 0.5}
    _case_folder(rdir, "D2_c4", {"case_id": "D2_c4", "phase": "phase1", "case": spec, "repeats": 3, "seed": 7,
                                 "api": "completions"})
    _case_folder(rdir, "D2_c4@a2", {"case_id": "D2_c4@a2", "phase": "phase1", "case": spec, "repeats": 3,
                                    "seed": 7, "api": "completions"})
    r = read_recipe("r2", "D2_c4@a2")
    assert (r.case_id, r.folder, r.phase, r.target_name) == ("D2_c4", "D2_c4@a2", "phase1", "local-tiny")
    assert r.target == "local-tiny"                       # the name: load_target finds params/targets/
    assert r.spec == cs.CaseSpec(**spec)
    assert r.env_kw == {"repeats": 3, "seed": 7, "api": "completions", "slo": mx.SLO(ttft_ms=500.0), "phase": "phase1"}
    assert r.notes and "older servelab" in r.notes[0]
    assert cs.split_attempt("D2_c4@a12") == ("D2_c4", 12) and cs.attempt_folder("D2_c4", 1) == "D2_c4"


# ---------------------------------------------------------------- the command copied from the Phase 1 page

def _hashes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _reproduce_commands(page: str) -> dict[str, str]:
    """title → command text of every REPRODUCE block of a rendered page."""
    blocks = re.findall(r'<div class="servelab-cmd servelab-cmd-reproduce">.*?<b>(.*?)</b>.*?</small>\n(.*?)</div>',
                        page, flags=re.S)
    return {html.unescape(t): html.unescape(c).strip() for t, c in blocks}


@pytest.mark.slow
@pytest.mark.flaky(reruns=2, reruns_delay=5)   # timing under CPU contention (2 shared cores): see pyproject
def test_the_reproduce_command_on_the_phase1_page_lands_a_new_valid_attempt(tmp_path: Path,
                                                                            llama_server_binary: Path) -> None:
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONPATH": str(ROOT / "lib")}
    run = subprocess.run([sys.executable, "-m", "servelab.cli", "run", "phase1", "--target", "local-tiny",
                          "--run-id", "rp", "-p", 'cases=["P1","D1"]', "-p", "search=false"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    # the terminal said where the matrix was while papermill ran it
    progress = [ln for ln in run.stderr.splitlines() if ln.startswith("phase1: ")]
    assert progress[0] == "phase1: case 1 of 2: P1 … (0 s elapsed)", run.stderr[-2000:]
    assert progress[1].startswith("phase1: case 2 of 2: D1 … (") and "left)" in progress[1]
    assert progress[2].startswith("phase1: matrix done: 2 of 2 cases")
    rdir = tmp_path / "outputs" / "rp"
    cmds = _reproduce_commands((rdir / "phase1" / "report.html").read_text())
    assert cmds["re-run case P1"] == "servelab case rp P1" and cmds["re-run case D1"] == "servelab case rp D1"
    first = rdir / "cases" / "D1"
    before = _hashes(first)
    # exactly the command of the page, run by the environment's `servelab` (this tree first on PYTHONPATH)
    argv = shlex.split(cmds["re-run case D1"])
    script = Path(sys.executable).parent / argv[0]
    argv = [str(script), *argv[1:]] if script.exists() else [sys.executable, "-m", "servelab.cli", *argv[1:]]
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout.strip().splitlines()
    assert out == ["D1@a2: VALID (success)", str(rdir / "cases" / "D1@a2")], res.stdout + res.stderr
    attempt = rdir / "cases" / "D1@a2"
    summ = read_summary(attempt / "summary.json")                                # schema-valid
    first_summ = read_summary(first / "summary.json")
    assert summ["verdict"] == {"status": "VALID", "reasons": []} and summ["status"] == "success"
    assert (summ["case_id"], summ["repeat_of"], summ["phase"]) == ("D1@a2", "D1", "phase1")
    assert summ["details"]["attempt"] == {"n": 2, "of": "D1", "first": "cases/D1"}
    assert summ["details"]["case"] == first_summ["details"]["case"]              # the same matrix point
    # a sized case (docs/case.md#sizing): both attempts send at least the point's count (D1: 11 locally)
    want = summ["details"]["case"]["num_prompts"]
    assert want == 11 and summ["counts"]["measured"] >= want and first_summ["counts"]["measured"] >= want
    assert _hashes(first) == before                                             # the first attempt untouched
    meta = json.loads((attempt / "meta.json").read_text())
    assert (meta["attempt"], meta["target"]["name"], meta["case_env"]["seed"]) == (2, "local-tiny", 0)
    with socket.socket() as s:                                                  # the engine was stopped
        assert s.connect_ex(("127.0.0.1", urlparse(meta["base_url"]).port)) != 0
    # the re-run is an executed command of Phase 1, on its page rendered again
    recs = runlib.read_commands(rdir, "phase1")
    ran = [r for r in recs if r.label == "executed" and r.argv[:2] == ["servelab", "case"]]
    assert len(ran) == 1 and ran[0].argv == ["servelab", "case", "rp", "D1"] and ran[0].exit_code == 0
    assert "re-run case D1 as attempt 2 (D1@a2)" in (rdir / "phase1" / "report.html").read_text()
    # once more: the next attempt, both earlier ones kept
    again = subprocess.run(argv + ["--no-render"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.splitlines()[0] == "D1@a3: VALID (success)"
    assert _hashes(first) == before and (attempt / "summary.json").is_file()
