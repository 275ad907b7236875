"""The Slurm launcher (``deploy.slurm``): a real single-host Slurm (munged, slurmctld, slurmd from the Debian
packages, configured and started by the test in a temporary folder, bound to loopback) runs Phase 1 on the tiny
llama-server through it; the job is gone after success, after a failure and after SIGTERM to ``servelab run``, and
a job left by a killed controller is cancelled by the next start's sweep."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from servelab.core.params import ParamError
from servelab.deploy.slurm import engine_launch
from servelab.deploy.targets import target_from_dict
from slurm_cluster import missing, start_slurm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("launch, says", [
    ({"via": "pbs"}, "launch.via must be 'slurm'"),
    ({"partition": "gpu"}, "is a Slurm setting: add 'via: slurm'"),
    ({"via": "slurm", "srun_args": "--exclusive"}, "srun_args must be a list of strings"),
    ({"via": "slurm", "time_limit": 10}, "time_limit must be a string"),
    ({"via": "slurm", "paralel": 4}, "unknown key 'paralel'"),
])
def test_a_slurm_target_is_checked_when_read(launch: dict, says: str) -> None:
    with pytest.raises(ParamError) as exc:
        target_from_dict({"name": "s", "engine": "llamacpp", "model": "tiny", "launch": launch}, "s.yaml")
    assert says in str(exc.value)


def test_the_engine_sees_its_own_settings_only() -> None:
    t = target_from_dict({"name": "s", "engine": "llamacpp", "model": "tiny",
                          "launch": {"via": "slurm", "partition": "gpu", "srun_args": ["--exclusive"], "parallel": 4}})
    assert engine_launch(t.launch) == {"parallel": 4}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    gone = missing()
    assert not gone, f"Slurm is not installed ({', '.join(gone)}): `make system` installs it"
    s = start_slurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield s
    finally:
        s.stop()


def slurm_target(tmp_path: Path, partition: str, **launch: object) -> Path:
    body = yaml.safe_load((ROOT / "params" / "targets" / "local-tiny.yaml").read_text())
    body["name"] = "slurm-tiny"
    body["launch"] = {**body["launch"], "via": "slurm", "partition": partition, "time_limit": "30:00", **launch}
    p = tmp_path / "slurm-tiny.yaml"
    p.write_text(yaml.safe_dump(body))
    return p


def _run(tmp_path: Path, slurm, *args: str) -> subprocess.Popen:
    env = {**os.environ, **slurm.env, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONPATH": str(ROOT / "lib"),
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "servelab.cli", "run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _jobs_gone(slurm, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    return slurm.jobs()


@pytest.mark.slow
def test_phase1_runs_through_slurm_and_the_job_is_gone_after(slurm, tmp_path: Path, llama_server_binary: Path) -> None:
    t = slurm_target(tmp_path, slurm.partition)
    run = _run(tmp_path, slurm, "phase1", "--target", str(t), "--run-id", "sl", "-p", 'cases=["P1"]',
               "-p", "search=false")
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, out + err[-3000:]
    rdir = tmp_path / "outputs" / "sl"
    manifest = json.loads((rdir / "manifest.json").read_text())
    assert manifest["slurm"]["nodes"] == [slurm.node] and manifest["slurm"]["job_id"]
    summary = json.loads((rdir / "cases" / "P1" / "summary.json").read_text())
    assert summary["verdict"]["status"] == "VALID", summary["verdict"]
    cmds = (rdir / "commands.jsonl").read_text()
    assert "salloc" in cmds and "srun" in cmds and f"--jobid={manifest['slurm']['job_id']}" in cmds
    assert _jobs_gone(slurm) == []


@pytest.mark.slow
def test_a_failed_start_through_slurm_leaves_no_job(slurm, tmp_path: Path, llama_server_binary: Path) -> None:
    t = slurm_target(tmp_path, slurm.partition, extra_args=["--no-such-llama-flag"])
    run = _run(tmp_path, slurm, "phase1", "--target", str(t), "--run-id", "slf", "-p", 'cases=["P1"]',
               "-p", "search=false")
    out, err = run.communicate(timeout=900)
    assert run.returncode != 0, out + err[-2000:]
    manifest = json.loads((tmp_path / "outputs" / "slf" / "manifest.json").read_text())
    assert manifest["phases"]["phase1"]["status"] == "failed" and manifest["slurm"]["job_id"]
    assert _jobs_gone(slurm) == []


@pytest.mark.slow
def test_sigterm_to_servelab_run_cancels_the_job(slurm, tmp_path: Path, llama_server_binary: Path) -> None:
    t = slurm_target(tmp_path, slurm.partition)
    run = _run(tmp_path, slurm, "phase1", "--target", str(t), "--run-id", "slt", "-p", 'cases=["P1","D1"]',
               "-p", "repeats=3", "-p", "search=false")
    cases = tmp_path / "outputs" / "slt" / "cases"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (cases.is_dir() and any(cases.iterdir())):
        assert run.poll() is None, run.communicate()
        time.sleep(0.2)
    assert slurm.jobs(), "the job should be running while the phase measures"
    run.send_signal(signal.SIGTERM)
    run.communicate(timeout=300)
    assert _jobs_gone(slurm) == []


def _controller(slurm, tmp_path: Path, body: str) -> str:
    """A controller process that asks for an allocation (``deploy.slurm.allocate``), prints its job id, then does
    ``body`` and dies without cancelling anything (``os._exit``); returns the job id."""
    env = {**os.environ, **slurm.env, "PYTHONPATH": str(ROOT / "lib")}
    code = textwrap.dedent(f"""
        import os, signal, subprocess
        from pathlib import Path
        from servelab.deploy.slurm import allocate
        procs = []
        def start(argv, log):
            procs.append(subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        job = allocate({{"partition": "{slurm.partition}"}}, 1, "servelab-orphan", Path({str(tmp_path)!r}),
                       start=start, alive=lambda: procs[0].poll() is None)
        print(job.job_id, flush=True)
    """) + textwrap.dedent(body) + "\nos._exit(0)\n"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    return r.stdout.strip()


@pytest.mark.slow
def test_an_allocation_ends_with_the_process_that_asked_for_it(slurm, tmp_path: Path) -> None:
    """The controller is killed (as a SIGKILLed kernel): salloc's command ends with it, and so does the job."""
    job_id = _controller(slurm, tmp_path, "")
    assert _jobs_gone(slurm) == [], f"job {job_id} outlived its controller"


@pytest.mark.slow
def test_a_job_left_by_a_killed_controller_is_swept_at_the_next_start(slurm, tmp_path: Path) -> None:
    """salloc itself SIGKILLed with its controller: Slurm keeps the job; the next start's sweep cancels it."""
    job_id = _controller(slurm, tmp_path, "os.kill(procs[0].pid, signal.SIGKILL); procs[0].wait()")
    time.sleep(2)
    assert any(j.startswith(f"{job_id} ") for j in slurm.jobs()), slurm.jobs()
    env = {**os.environ, **slurm.env, "PYTHONPATH": str(ROOT / "lib")}
    sweep = subprocess.run([sys.executable, "-c", "import json; from servelab.deploy.slurm import sweep; "
                            "print(json.dumps(sweep()))"], env=env, capture_output=True, text=True, timeout=300)
    rows = json.loads(sweep.stdout)
    mine = [r for r in rows if r["what"] == f"job {job_id} (servelab-orphan)"]
    assert [r["action"] for r in mine] == ["scancel (was RUNNING)"], rows
    assert _jobs_gone(slurm) == []
