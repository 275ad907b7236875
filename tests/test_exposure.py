"""Exposure, without a server: the address each engine binds, how the API key reaches it (never argv where the
engine has a variable), the warnings a page shows, target validation; and the leftover sweep on this machine
(a killed owner's orphaned child found by its tag and stopped)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servelab.core.params import ParamError
from servelab.deploy.engines import engine_for
from servelab.deploy.hosts import LocalHost
from servelab.deploy.server import ServerError, plan_launch
from servelab.deploy.targets import target_from_dict


def cluster(engine: str, **extra) -> object:
    node = dict(kind="ssh", user="u", known_hosts="/dev/null")
    return target_from_dict({"name": "c", "engine": engine, "model": "/m", "api_host": "10.9.8.7",
                             "nodes": [dict(node, name="h", role="head", host="10.9.8.7"),
                                       dict(node, name="w", role="worker", host="10.9.8.8")], **extra})


@pytest.mark.parametrize("engine", ["sglang", "vllm", "llamacpp"])
def test_cluster_head_binds_its_own_address_not_every_interface(engine):
    t = cluster(engine)
    head = next(p for p in engine_for(engine).launch_plans(t, 30000) if p.role == "head")
    assert head.argv[head.argv.index("--host") + 1] == "10.9.8.7"
    assert "0.0.0.0" not in head.argv
    local = target_from_dict({"name": "l", "engine": engine, "model": "/m"})
    assert engine_for(engine).bind_host(local) == "127.0.0.1"
    wide = cluster(engine, launch={"bind_host": "0.0.0.0"})           # only when asked for
    assert engine_for(engine).bind_host(wide) == "0.0.0.0"


@pytest.mark.parametrize("engine,var", [("vllm", "VLLM_API_KEY"), ("llamacpp", "LLAMA_API_KEY")])
def test_the_key_goes_by_the_engines_variable_never_argv(engine, var):
    t = cluster(engine)
    plans = engine_for(engine).launch_plans(t, 30000)
    notes = engine_for(engine).apply_api_key(plans, "s3cret-key")
    head = next(p for p in plans if p.role == "head")
    assert head.env[var] == "s3cret-key" and notes == []
    assert all("s3cret-key" not in " ".join(p.argv) for p in plans)
    assert all(var not in p.env for p in plans if p.role != "head")
    assert "s3cret-key" not in head.shell()                             # what a page shows is redacted


def test_sglang_gets_the_key_in_a_private_config_file_never_argv():
    """SGLang reads no variable for its key; its ``--config`` YAML is merged into the arguments inside the process:
    the key goes into a mode-0600 file of the start's private folder (start_server writes it there and puts the
    folder's path in place of SECRET_DIR), so neither argv nor a page carries it."""
    from servelab.deploy.engines.base import SECRET_DIR
    t = cluster("sglang", api_key_env="SERVELAB_API_KEY")
    plans = engine_for("sglang").launch_plans(t, 30000)
    notes = engine_for("sglang").apply_api_key(plans, "s3cret-key")
    head = next(p for p in plans if p.role == "head")
    assert notes == [] and all("s3cret-key" not in " ".join(p.argv) for p in plans)
    assert head.argv[-2:] == ["--config", f"{SECRET_DIR}/servelab-api-key.yaml"]
    assert head.secret_files == {"servelab-api-key.yaml": "api-key: s3cret-key\n"}
    assert all(not p.secret_files for p in plans if p.role != "head")
    assert "s3cret-key" not in head.shell() and "s3cret-key" not in repr(head)
    warn = engine_for("sglang").exposure_warnings(t, True)
    assert not any("only on its command line" in w for w in warn)
    assert any("/flush_cache" in w and "/start_profile" in w for w in warn)


def test_docker_gets_the_key_in_its_env_file_never_in_argv():
    t = cluster("vllm", launch={"mode": "docker", "docker": {"image": "vllm/vllm-openai"}})
    plans = engine_for("vllm").launch_plans(t, 30000)
    engine_for("vllm").apply_api_key(plans, "s3cret")
    head = next(p for p in plans if p.role == "head")
    assert head.argv[:2] == ["docker", "run"] and "s3cret" not in " ".join(head.argv)
    assert head.container.env["VLLM_API_KEY"] == "s3cret" and "VLLM_API_KEY" not in head.env
    t = cluster("sglang", launch={"mode": "docker", "docker": {"image": "lmsysorg/sglang"}})
    plans = engine_for("sglang").launch_plans(t, 30000)
    notes = engine_for("sglang").apply_api_key(plans, "s3cret")      # in a container: --api-key, said so
    head = next(p for p in plans if p.role == "head")
    assert head.argv[-2:] == ["--api-key", "s3cret"] and head.container.engine_argv[-1] == "s3cret"
    assert notes and "visible in the process list" in notes[0]
    assert any("only on its command line" in w for w in engine_for("sglang").exposure_warnings(t, True))


def test_warnings_for_an_open_head_and_none_for_a_keyed_one():
    t = cluster("llamacpp")
    warn = engine_for("llamacpp").exposure_warnings(t, False)
    assert len(warn) == 1 and "10.9.8.7 (not loopback) without an API key" in warn[0] and "/slots" in warn[0]
    assert engine_for("llamacpp").exposure_warnings(t, True) == [
        "llamacpp mounts /slots (the prompts being served) on 10.9.8.7 (behind the API key): development/profiling "
        "endpoints that change the server's state; keep the address private."]
    local = target_from_dict({"name": "l", "engine": "vllm", "model": "/m"})
    assert engine_for("vllm").exposure_warnings(local, False) == []
    dev = target_from_dict({"name": "l", "engine": "vllm", "model": "/m", "launch": {"dev_mode": True}})
    assert "VLLM_SERVER_DEV_MODE" in engine_for("vllm").exposure_notes(dev, False)[0]


def test_api_key_env_is_a_name_and_must_be_set_before_anything_starts(monkeypatch):
    with pytest.raises(ParamError, match="NAME of an environment variable"):
        cluster("vllm", api_key_env="sk-abc def")
    t = target_from_dict({"name": "l", "engine": "llamacpp", "model": "/nonexistent.gguf",
                          "api_key_env": "SERVELAB_TEST_UNSET_KEY"})
    monkeypatch.delenv("SERVELAB_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ServerError, match="SERVELAB_TEST_UNSET_KEY, which is not set .*export"):
        plan_launch(t, 30000)


ORPHAN = """
import sys, time
sys.path.insert(0, sys.argv[1])
from servelab.deploy.hosts import LocalHost
h = LocalHost("here", state_dir=sys.argv[2])
h.run_id = "dead-run"
h.start(["sh", "-c", "sleep 300 & echo $! > " + sys.argv[3] + "; wait"], sys.argv[2] + "/x.log", what="demo")
time.sleep(300)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (this machine's init may never reap an orphan)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_killed_owners_orphan_is_found_by_its_tag_and_swept(tmp_path):
    """The owner is SIGKILLed; its child (the sh, with PDEATHSIG) dies, the grandchild (sleep) lives on in the
    group: the sweep finds it by the tag in its environment, stops it and says so."""
    state, pidfile = tmp_path / "state", tmp_path / "sleep.pid"
    owner = subprocess.Popen([sys.executable, "-c", ORPHAN, str(Path(__file__).parents[1] / "lib"), str(state),
                              str(pidfile)])
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    sleeper = int(pidfile.read_text())
    try:
        assert LocalHost("here", state_dir=str(state)).sweep() == []       # the owner lives: not a leftover
        owner.kill()                        # not waited for yet: a zombie until reaped — still a dead owner
        deadline = time.monotonic() + 10
        while running(owner.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(f"/proc/{owner.pid}").exists() and not running(owner.pid)
        time.sleep(0.3)
        assert running(sleeper)                                              # orphaned, still running
        rows = LocalHost("here", state_dir=str(state)).sweep(grace_s=2)
        assert len(rows) == 1
        row = rows[0]
        assert row["action"] == "stopped (TERM, then KILL)" and row["run_id"] == "dead-run" and row["what"] == "demo"
        assert row["processes"] == [sleeper] and row["node"] == "here"
        assert not running(sleeper)
        assert list((state / "pids").glob("*.json")) == []
        assert oct((state / "pids").stat().st_mode & 0o777) == "0o700"
    finally:
        owner.kill()
        owner.wait(10)
        try:
            os.kill(sleeper, 9)
        except ProcessLookupError:
            pass
