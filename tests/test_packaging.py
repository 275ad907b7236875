"""Packaging: a user's `pip install .` brings what servelab itself needs and no test or lint tool; the tests and the
lint are the `test` extra, which `make env` / `make test` install into the checkout's .venv."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every tool that only the tests and the lint use
TEST_TOOLS = {"pytest", "hypothesis", "pytest-rerunfailures", "pillow", "ruff", "import-linter"}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (``Pillow>=10; extra == "test"`` → ``pillow``)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pyproject_keeps_the_test_tools_in_the_test_extra():
    project = _pyproject()
    runtime = {_name(r) for r in project["dependencies"]}
    assert runtime & TEST_TOOLS == set()
    assert {_name(r) for r in project["optional-dependencies"]["test"]} >= TEST_TOOLS


def test_the_installed_metadata_says_the_same():
    """What pip recorded when it installed this checkout (``Requires-Dist``): the runtime requirements (no ``extra``
    marker) hold no test tool, each test tool is required only with ``extra == "test"`` — and the runtime list is
    pyproject's (an environment installed from an older pyproject fails here: run ``make env``)."""
    requires = metadata.requires("servelab") or []
    runtime = {_name(r) for r in requires if "extra ==" not in r}
    test = {_name(r) for r in requires if re.search(r"""extra\s*==\s*["']test["']""", r)}
    assert runtime == {_name(r) for r in _pyproject()["dependencies"]}, "stale install: run `make env`"
    assert runtime & TEST_TOOLS == set()
    assert test >= TEST_TOOLS


@pytest.mark.slow
def test_pip_install_in_a_fresh_venv_installs_no_test_tool(tmp_path):
    """`pip install .` resolved for real in a new, empty venv (``--dry-run --report``: everything it would install,
    transitive dependencies included, nothing installed): no test or lint tool among them."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    report = tmp_path / "report.json"
    res = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--dry-run", "--report", str(report), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    names = {_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert {"servelab", "pandas", "papermill", "paramiko"} <= names       # it did resolve the runtime
    assert names & TEST_TOOLS == set()
