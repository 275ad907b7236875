"""The README's second way, followed literally: plain papermill, then `servelab render ID` makes the page."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_plain_papermill_then_render_gives_the_phase_page(tmp_path: Path) -> None:
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs")}
    work = tmp_path / "elsewhere"            # the user's own folder, not the project
    work.mkdir()
    pm = subprocess.run([str(BIN / "papermill"), str(ROOT / "notebooks" / "phase3_timeline.ipynb"), "out.ipynb",
                         "-p", "run_id", "PM1", "-p", "target", "local", "--no-progress-bar"],
                        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert pm.returncode == 0, pm.stderr[-2000:]
    assert (work / "out.ipynb").exists()
    manifest = json.loads((tmp_path / "outputs" / "PM1" / "manifest.json").read_text())
    assert manifest["phases"]["phase3"]["executed_notebook"] == str(work / "out.ipynb")
    res = subprocess.run([str(BIN / "servelab"), "render", "PM1"], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    page = tmp_path / "outputs" / "PM1" / "phase3" / "report.html"
    assert str(page) in res.stdout.splitlines()
    text = page.read_text()
    assert "Phase 3" in text and "status success" in text
    assert (tmp_path / "outputs" / "PM1" / "phase3" / "notebook.ipynb").exists()   # the executed copy is kept
    assert "phase3" in (tmp_path / "outputs" / "PM1" / "index.html").read_text()
