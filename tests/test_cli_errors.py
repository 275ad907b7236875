"""What a user sees when something is wrong: one line on the terminal, in the manifest and at the top of the
page — never a bare traceback."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_here import run_cli

ROOT = Path(__file__).resolve().parents[1]


def servelab(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs")}
    return subprocess.run([sys.executable, "-m", "servelab.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_bad_run_id_is_one_line_and_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_cli("run", "phase0", "--target", "local-tiny", "--run-id", "../../x", tmp_path=tmp_path,
                           monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2
    assert "Traceback" not in err
    assert err.strip().splitlines() == ["servelab: error: invalid run id '../../x': use letters, digits, "
                                        "'.', '_' and '-' (max 128)"]
    assert not (tmp_path / "outputs").exists()


def test_an_unknown_phase_is_one_line(tmp_path: Path) -> None:
    """Through the real command: the process prints that one line and exits 2."""
    res = servelab("run", "phase11", "--target", "local-tiny", tmp_path=tmp_path)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "unknown phase 'phase11'" in res.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_truncated_trace_fails_the_phase_with_one_line_everywhere(tmp_path: Path) -> None:
    """A real trace whose JSON is cut in half inside a whole gzip stream (unreadable; a gzip stream cut mid-write is
    read up to where it ends instead, tests/test_trace_load.py): the terminal, the manifest and the page's top say
    why in one line; the traceback is folded on the page."""
    src = next((ROOT / "data" / "samples" / "h200x2" / "traces").glob("*-TP-0.trace.json.gz"))
    traces = tmp_path / "traces"
    traces.mkdir()
    text = gzip.decompress(src.read_bytes())
    (traces / src.name).write_bytes(gzip.compress(text[: len(text) // 2]))
    res = servelab("run", "phase3", "--target", "local-tiny", "--run-id", "cut", "-p", f"trace_dir={traces}",
                   tmp_path=tmp_path)
    assert res.returncode == 1
    line = res.stdout.splitlines()[0]
    assert line.startswith("phase3: failed — TraceFormatError: ") and "truncated" in line
    assert "Traceback" not in res.stdout + res.stderr
    manifest = json.loads((tmp_path / "outputs" / "cut" / "manifest.json").read_text())
    error = manifest["phases"]["phase3"]["error"]
    assert line.endswith(error) and "\n" not in error
    page = (tmp_path / "outputs" / "cut" / "phase3" / "report.html").read_text()
    box = page.index('class="servelab-failed"')
    assert box < page.index("Phase 3")                              # the reason comes before the content
    assert "not valid JSON" in page[box:box + 600]
    assert '<details class="servelab-traceback">' in page
    index = (tmp_path / "outputs" / "cut" / "index.html").read_text()
    assert "not valid JSON" in index                                # the run index says why too


def _pids(name: str) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if name.encode() in (d / "cmdline").read_bytes():
                    out.add(int(d.name))
            except OSError:
                pass
    return out


@pytest.mark.slow
@pytest.mark.flaky(reruns=2, reruns_delay=5)   # timing under CPU contention (2 shared cores): see pyproject
def test_ctrl_c_mid_phase_is_one_line_and_leaves_nothing_running(tmp_path: Path) -> None:
    """Ctrl-C as a terminal sends it (SIGINT to the foreground process group) while Phase 1 measures: one
    'interrupted' line, no traceback (not even the kernel's), the phase marked interrupted, no engine left."""
    import signal
    import time
    before = _pids("llama-server")
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "servelab.cli", "run", "phase1", "--target", "local-tiny",
                             "--run-id", "cc", "-p", "repeats=3"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    cases = tmp_path / "outputs" / "cc" / "cases"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (cases.is_dir() and len(list(cases.iterdir())) >= 2):
        time.sleep(0.2)
    assert cases.is_dir(), "the phase never started measuring"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == ("servelab: interrupted; everything measured so far is kept in the "
                                            "run directory")
    assert "Traceback" not in err and "ZMQError" not in err
    manifest = json.loads((tmp_path / "outputs" / "cc" / "manifest.json").read_text())
    assert manifest["phases"]["phase1"]["status"] == "interrupted"
    time.sleep(1)
    assert _pids("llama-server") - before == set()
    assert (tmp_path / "outputs" / "cc" / "phase1" / "kernel.log").exists()
