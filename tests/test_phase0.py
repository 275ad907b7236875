"""Phase 0 end to end, three equal ways (CLI, plain papermill, the library), rendered and seen in a browser."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.core.run import read_commands, read_manifest

sys.path.insert(0, str(Path(__file__).parent))
from browser import chromium, content_fraction, dom_text, screenshot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def llama_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-a", "llama-server"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def phase0_run(tmp_path_factory, llama_server_binary):
    out = tmp_path_factory.mktemp("outputs")
    os.environ["SERVELAB_OUTPUTS"] = str(out)
    try:
        before = llama_processes()
        rc = main(["run", "phase0", "--target", "local-tiny", "--run-id", "p0-cli"])
        after = llama_processes()
    finally:
        os.environ.pop("SERVELAB_OUTPUTS", None)
    return out / "p0-cli", rc, before, after


@pytest.mark.slow
def test_cli_run_writes_the_run_directory(phase0_run):
    rdir, rc, before, after = phase0_run
    assert rc == 0
    m = read_manifest(rdir)
    assert m["phases"]["phase0"]["status"] == "success"
    assert m["engine"]["name"] == "llamacpp" and "0c1e570" in m["engine"]["build_info"]
    assert len(m["model"]["sha256"]) == 64
    assert m["hosts"]["local"]["cpu_count"] == str(os.cpu_count())
    for f in ("phase0/notebook.ipynb", "phase0/report.html", "phase0/facts.csv", "index.html", "commands.jsonl"):
        assert (rdir / f).exists(), f
    labels = {(r.label, r.title) for r in read_commands(rdir, "phase0")}
    assert ("executed", "start llamacpp head on local") in labels and ("executed", "stop llamacpp on local") in labels


@pytest.mark.slow
def test_no_engine_left_running(phase0_run):
    rdir, rc, before, after = phase0_run
    start = next(r for r in read_commands(rdir, "phase0") if r.title.startswith("start llamacpp"))
    port = start.argv[start.argv.index("--port") + 1]
    ours = [line for line in after if f"--port {port} " in line + " "]
    assert ours == []                                  # the engine this run started is gone (others may run)
    m = read_manifest(rdir)
    assert m["phases"]["phase0"]["headline"]["leftover processes"] == 0
    facts = (rdir / "phase0" / "facts.csv").read_text()
    assert "gpu_list" in facts and "not present" in facts      # a CPU host: GPU facts absent, not failed


@pytest.mark.slow
def test_rendered_page_in_a_browser(phase0_run):
    if not chromium():
        pytest.skip("chromium not installed (Debian package chromium; `make system` installs it)")
    rdir = phase0_run[0]
    page = rdir / "phase0" / "report.html"
    html = page.read_text()
    assert "cdn.jsdelivr" not in html and "require.min.js" not in html      # offline page
    assert "EXECUTED" in html and "servelab-cmd-executed" in html
    png = screenshot(page, "phase0_report")
    assert content_fraction(png) > 0.03
    dom = dom_text(page)
    assert "Phase 0" in dom and "freeze the environment" in dom and "sha256" in dom
    assert "no SSH: the node is the machine servelab runs on" in dom     # the host-key table says why it has no key
    index = screenshot(rdir / "index.html", "run_index", height=800)
    assert content_fraction(index) > 0.01
    assert 'href="phase0/report.html"' in (rdir / "index.html").read_text()


@pytest.mark.slow
def test_plain_papermill_writes_into_the_same_contract(tmp_path):
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "out")}
    p = subprocess.run([str(VENV_BIN / "papermill"), str(ROOT / "notebooks" / "phase0_manifest.ipynb"),
                        str(tmp_path / "out.ipynb"), "-p", "run_id", "p0-pm", "-p", "target", "local-tiny",
                        "-p", "start_engine", "False"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rdir = tmp_path / "out" / "p0-pm"
    assert read_manifest(rdir)["phases"]["phase0"]["status"] == "success"
    recs = [r for r in read_commands(rdir, "phase0") if not r.title.startswith("freeze ")]   # less the freeze probes
    assert [r.label for r in recs] == ["planned"]          # engine not started: its launch is only planned


def test_typo_fails_before_any_side_effect(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "out"))
    rc = main(["run", "phase0", "--target", "local-tiny", "--run-id", "typo", "-p", "start_engin=false"])
    assert rc == 2
    assert "did you mean 'start_engine'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["run", "phase0", "--target", "local-tny"]) == 2
    assert main(["run", "phase42"]) == 2
    assert not (tmp_path / "out").exists()


def test_launch_setting_typo_names_the_closest(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "out"))
    assert main(["run", "phase0", "--target", "example-2node", "-p", "tp_sise=16"]) == 2
    assert "did you mean 'tp_size'" in capsys.readouterr().err
    assert main(["run", "phase0", "--target", "local-tiny", "-p", "tp_size=2"]) == 2   # llama.cpp: one process
    assert "must be 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_launch_override_is_applied_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "out"))
    assert main(["run", "phase0", "--target", "local-tiny", "--run-id", "ovr", "-p", "parallel=4",
                 "-p", "start_engine=false", "--no-render"]) == 0
    rdir = tmp_path / "out" / "ovr"
    assert read_manifest(rdir)["launch_overrides"] == {"phase0": {"parallel": 4}}
    planned = next(r for r in read_commands(rdir, "phase0") if r.label == "planned")
    assert planned.argv[planned.argv.index("-np") + 1] == "4"
