"""Attached targets (``deploy.attach``): a server started by someone else, measured through its URL; servelab starts,
restarts and stops nothing there.

The live tests start a real llama-server themselves, outside servelab (``subprocess``, its own process group, an API
key read from a mode-0600 file), and point an attached target at it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from cli_here import run_cli
from servelab.core.params import ParamError
from servelab.deploy.hosts import free_port
from servelab.deploy.server import http_json
from servelab.deploy.targets import load_target, target_from_dict

ROOT = Path(__file__).resolve().parents[1]
KEY = "attach-test-key-5f0c2d"


def attach_yaml(tmp_path: Path, endpoint: str, **extra: object) -> Path:
    body = {"name": "attached-tiny", "engine": "llamacpp", "endpoint": endpoint, "served_model_name": "tiny",
            **extra}
    p = tmp_path / "attached-tiny.yaml"
    p.write_text(yaml.safe_dump(body))
    return p


# ---------------------------------------------------------------- reading the target

@pytest.mark.parametrize("change, says", [
    ({"endpoint": "127.0.0.1:8080"}, "endpoint must be an http(s) URL"),
    ({"launch": {"parallel": 4}}, "has no 'launch'"),
    ({"port": 8080}, "takes its port from 'endpoint'"),
    ({"served_model_name": ""}, "needs 'served_model_name'"),
    ({"endpoint": "http://user:pw@127.0.0.1:1"}, "must not carry credentials"),
    ({"endpoint": "http://127.0.0.1:1/v1"}, "base URL"),
    ({"metrics_path": "metrics"}, "metrics_path is a path"),
    ({"profile": {"dir": "/x"}}, "unknown key(s) ['dir'] in profile"),
])
def test_an_attached_target_is_checked_when_read(change: dict, says: str) -> None:
    raw = {"name": "a", "engine": "sglang", "endpoint": "http://127.0.0.1:30000", "served_model_name": "m", **change}
    with pytest.raises(ParamError) as exc:
        target_from_dict(raw, "a.yaml")
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_the_shipped_attach_target_reads_as_attached_without_nodes() -> None:
    t = load_target("attach")
    assert t.attached and not t.nodes_given and t.launch == {} and t.model == t.served_model_name == "tiny"
    launched = load_target("local-tiny")
    assert not launched.attached and launched.nodes_given


@pytest.mark.parametrize("phase, params, says", [
    ("phase7", [], "its knob sweep restarts the engine once per value"),
    ("phase8", [], "llamacpp has no cache-flush endpoint"),
    ("phase9", ["-p", 'drafts=["self"]'], "each draft or synthetic-rate config is a restart"),
    ("phase4", ["-p", 'measure_layouts=["TP1"]'], "measure_layouts restarts the engine once per layout"),
    ("phase1", ["-p", "parallel=4"], "its launch settings are not servelab's to change"),
])
def test_a_phase_that_needs_a_restart_fails_in_one_line_before_anything(tmp_path: Path, monkeypatch, capsys,
                                                                        phase: str, params: list, says: str) -> None:
    """Nothing listens at the endpoint: the refusal comes from the target and the phase alone, before any probe,
    run folder or kernel."""
    t = attach_yaml(tmp_path, f"http://127.0.0.1:{free_port()}")
    code, out, err = run_cli("run", phase, "--target", str(t), *params, tmp_path=tmp_path,
                             monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], err
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow          # waits the 10 s the check gives a server to answer
def test_an_endpoint_that_does_not_answer_is_one_line_before_anything(tmp_path: Path, monkeypatch, capsys) -> None:
    t = attach_yaml(tmp_path, f"http://127.0.0.1:{free_port()}")
    code, _, err = run_cli("run", "phase1", "--target", str(t), tmp_path=tmp_path, monkeypatch=monkeypatch,
                           capsys=capsys)
    assert code == 2
    line, = err.strip().splitlines()
    assert "does not answer /health (no connection for 10 s)" in line and "starts nothing" in line
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------- a server started by the test

def _procs() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time in ticks, executable) of every live process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            exe = os.readlink(d / "exe")
        except OSError:
            continue
        if stat[0] != "Z":
            out[int(d.name)] = (int(stat[1]), stat[19], exe)
    return out


def _descendants(root: int, table: dict[int, tuple[int, str, str]]) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _watch(run: subprocess.Popen, binary: Path) -> tuple[list[int], threading.Event]:
    """While ``run`` runs: every process of its tree running ``binary`` (an engine servelab would have started)."""
    seen: list[int] = []
    done = threading.Event()

    def loop() -> None:
        while not done.wait(0.1):
            table = _procs()
            seen.extend(p for p in _descendants(run.pid, table) if table[p][2] == str(binary) and p not in seen)
    threading.Thread(target=loop, daemon=True).start()
    return seen, done


@contextlib.contextmanager
def _outside(binary: Path, tmp_path: Path, *extra: str):
    """A llama-server with the tiny model, started here (not by servelab), with an API key from a 0600 file and
    ``extra`` arguments; stopped (its process group) when the block ends."""
    from servelab.deploy.models import tiny_model
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY)
    keyfile.chmod(0o600)
    port = free_port()
    log = open(tmp_path / "outside-server.log", "wb")
    proc = subprocess.Popen([str(binary), "-m", str(tiny_model()), "--host", "127.0.0.1", "--port",
                             str(port), "-np", "8", "-c", "16384", "-t", "1", "--metrics", "--api-key-file",
                             str(keyfile), *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while http_json(url + "/health", timeout=2)[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "outside-server.log").read_text()
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        log.close()


@pytest.fixture
def outside_server(llama_server_binary: Path, tmp_path: Path):
    with _outside(llama_server_binary, tmp_path) as server:
        yield server


@pytest.fixture
def outside_drafting_server(llama_server_binary: Path, tmp_path: Path):
    """The same server launched by its owner with speculative decoding: the model as its own draft (greedy decoding
    then accepts every drafted token), 3 tokens drafted per step."""
    from servelab.deploy.models import tiny_model
    with _outside(llama_server_binary, tmp_path, "-md", str(tiny_model()), "--spec-type", "draft-simple",
                  "--spec-draft-n-max", "3") as server:
        yield server


def _cli(tmp_path: Path, *args: str, key: str = KEY) -> subprocess.Popen:
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONPATH": str(ROOT / "lib"),
           "ATTACH_TEST_KEY": key, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "servelab.cli", "run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_phase1_on_an_attached_server_measures_and_starts_or_stops_nothing(outside_server, tmp_path: Path,
                                                                          llama_server_binary: Path) -> None:
    proc, url = outside_server
    before = _procs()[proc.pid]
    t = attach_yaml(tmp_path, url, api_key_env="ATTACH_TEST_KEY")
    run = _cli(tmp_path, "phase1", "--target", str(t), "--run-id", "att", "-p", 'cases=["P1","D1"]',
               "-p", "search=false")
    started, done = _watch(run, llama_server_binary)
    out, err = run.communicate(timeout=900)
    done.set()
    assert run.returncode == 0, out + err[-3000:]
    assert started == []                                    # no engine in servelab's process tree at any time
    assert _procs().get(proc.pid) == before                 # the test's server: the same process, never restarted
    assert proc.poll() is None and http_json(url + "/health")[0] == 200
    rdir = tmp_path / "outputs" / "att"
    summary = {r["case_id"]: r for r in
               (json.loads((rdir / "cases" / c / "summary.json").read_text()) for c in ("P1", "D1"))}
    assert {c: s["verdict"]["status"] for c, s in summary.items()} == {"P1": "VALID", "D1": "VALID"}
    manifest = json.loads((rdir / "manifest.json").read_text())
    assert manifest["attached"]["endpoint"] == url
    assert manifest["phases"]["phase1"]["status"] == "success"
    cmds = [json.loads(ln) for ln in (rdir / "commands.jsonl").read_text().splitlines()]
    assert not [c for c in cmds if c.get("label") == "executed" and "llama-server" in " ".join(map(str, c["argv"]))]
    # the key went as a header and never into what was written
    text = "".join(p.read_text(errors="replace") for p in rdir.rglob("*") if p.is_file() and p.suffix in
                   (".json", ".jsonl", ".csv", ".html", ".ipynb", ".txt", ".log"))
    assert KEY not in text
    page = (rdir / "phase1" / "report.html").read_text()
    assert "attached: servelab started nothing and stops nothing there" in page


@pytest.mark.slow
@pytest.mark.parametrize("key_env, key, says", [
    ("ATTACH_TEST_KEY", "not-the-key", "answered HTTP 401 to POST /tokenize: it refuses the key in ATTACH_TEST_KEY"),
    ("", "", "it needs an API key: set api_key_env"),
])
def test_a_wrong_or_missing_key_is_one_line_before_anything(outside_server, tmp_path: Path, key_env: str, key: str,
                                                             says: str) -> None:
    _, url = outside_server
    t = attach_yaml(tmp_path, url, **({"api_key_env": key_env} if key_env else {}))
    run = _cli(tmp_path, "phase1", "--target", str(t), "--run-id", "bad", key=key)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 2, out + err[-2000:]
    line, = err.strip().splitlines()
    assert says in line
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_server_that_dies_mid_case_stops_the_phase_with_its_reason(outside_server, tmp_path: Path,
                                                                      llama_server_binary: Path) -> None:
    """The matrix runs P1 then D1; the server's owner kills it while P1 measures: P1 is ENGINE_CRASH, D1 is not
    executed, the phase fails saying so in one line, and nobody restarts the server."""
    proc, url = outside_server
    t = attach_yaml(tmp_path, url, api_key_env="ATTACH_TEST_KEY")
    run = _cli(tmp_path, "phase1", "--target", str(t), "--run-id", "die", "-p", 'cases=["P1","D1"]',
               "-p", "repeats=3", "-p", "search=false")
    cases = tmp_path / "outputs" / "die" / "cases"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (cases / "P1" / "requests.jsonl").exists():
        assert run.poll() is None, run.communicate()
        time.sleep(0.1)
    started, done = _watch(run, llama_server_binary)
    os.killpg(proc.pid, signal.SIGKILL)                   # the server's owner pulls it mid-case
    proc.wait(30)
    out, err = run.communicate(timeout=600)
    done.set()
    assert run.returncode == 1, out + err[-2000:]
    manifest = json.loads((tmp_path / "outputs" / "die" / "manifest.json").read_text())
    p1 = manifest["phases"]["phase1"]
    summary = json.loads((cases / "P1" / "summary.json").read_text())
    assert summary["status"] == "ENGINE_CRASH" and summary["verdict"]["status"] == "INVALID", summary["verdict"]
    assert p1["status"] == "failed" and p1["not_executed"] == ["D1"] and not (cases / "D1").exists(), p1
    assert p1["error"].startswith("ENGINE_CRASH: P1") and "\n" not in p1["error"], p1["error"]
    assert started == [] and proc.pid not in _procs()      # nobody restarted it
    assert "Traceback" not in err


@pytest.mark.slow
def test_phase0_on_an_attached_server_says_what_it_read_and_what_it_could_not_know(outside_server,
                                                                                   tmp_path: Path) -> None:
    _, url = outside_server
    t = attach_yaml(tmp_path, url, api_key_env="ATTACH_TEST_KEY")
    run = _cli(tmp_path, "phase0", "--target", str(t), "--run-id", "p0")
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, out + err[-3000:]
    rdir = tmp_path / "outputs" / "p0"
    info = json.loads((rdir / "phase0" / "engine_info.json").read_text())
    assert info["/props"]["total_slots"] == 8 and info["metrics"]["status"] == 200
    assert info["/v1/models"]["data"][0]["id"]
    manifest = json.loads((rdir / "manifest.json").read_text())
    unknown = {u["fact"] for u in manifest["not_known"]}
    assert {"launch command and its settings", "node facts (CPU, GPU, driver, network, clock)"} <= unknown
    assert manifest["engine"]["attached"] == url


@pytest.mark.slow
def test_phase9_on_an_attached_server_measures_it_as_served(outside_drafting_server, tmp_path: Path,
                                                            llama_server_binary: Path) -> None:
    """A server its owner launched with a draft model: Phase 9 measures it as served (one config, no restart), reads
    that it speculates and its acceptance from the counters, and says why there is no net gain."""
    proc, url = outside_drafting_server
    before = _procs()[proc.pid]
    t = attach_yaml(tmp_path, url, api_key_env="ATTACH_TEST_KEY")
    run = _cli(tmp_path, "phase9", "--target", str(t), "--run-id", "p9", "-p", "concurrencies=[1,4]",
               "-p", "input_tokens=32", "-p", "output_tokens=64")
    started, done = _watch(run, llama_server_binary)
    out, err = run.communicate(timeout=900)
    done.set()
    assert run.returncode == 0, out + err[-3000:]
    assert started == [] and _procs().get(proc.pid) == before      # nothing started, the server never restarted
    rdir = tmp_path / "outputs" / "p9"
    points = pd.read_csv(rdir / "phase9" / "points.csv")
    assert set(points["config"]) == {"as served"} and sorted(points["concurrency"]) == [1, 4]
    assert (points["validity"] == "VALID").all(), points[["concurrency", "reasons"]].to_dict("records")
    assert points["speculative"].all() and (points["d_drafts"] > 0).all()
    assert (points["acceptance_rate"] >= 0.95).all(), points["acceptance_rate"].tolist()   # its own draft: all
    gain = pd.read_csv(rdir / "phase9" / "net_gain.csv")
    assert set(gain["verdict"]) == {"no baseline"} and gain["net_gain_pct"].isna().all()
    page = (rdir / "phase9" / "report.html").read_text()
    assert "As served, the server speculates: acceptance" in page and "No net gain: a server servelab did not" in page
    assert json.loads((rdir / "manifest.json").read_text())["phases"]["phase9"]["status"] == "success"


@pytest.mark.slow
def test_phase2_on_an_attached_server_samples_the_node_and_says_what_it_cannot_follow(outside_server,
                                                                                      tmp_path: Path) -> None:
    """The declared node's machine-wide collectors run around the replayed case; the per-process ones cannot (the
    engine's pid is not servelab's to know) and the plan says so instead of listing them as required."""
    proc, url = outside_server
    t = attach_yaml(tmp_path, url, api_key_env="ATTACH_TEST_KEY",
                    nodes=[{"name": "local", "kind": "local", "role": "head"}])
    run = _cli(tmp_path, "phase2", "--target", str(t), "--run-id", "p2", "-p", 'cases=["D1"]',
               "-p", "show_h200_sample=false")
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, out + err[-3000:]
    assert proc.poll() is None
    rdir = tmp_path / "outputs" / "p2"
    summary = json.loads((rdir / "cases" / "hw-D1" / "summary.json").read_text())
    assert summary["verdict"]["status"] == "VALID", summary["verdict"]
    assert summary["details"]["server_deltas"]["generation_tokens_total"] > 0        # its /metrics, read
    status = {p.name.split(".")[0]: json.loads(p.read_text())["status"]
              for p in (rdir / "cases" / "hw-D1" / "telemetry" / "local").glob("*.status.json")}
    assert status["mpstat"] == "ok" and status["sar-net"] == "ok", status
    assert "pidstat" not in status
    page = (rdir / "phase2" / "report.html").read_text()
    assert "attached target: servelab did not start the engine, so it has no pid to follow" in page
