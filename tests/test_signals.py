"""Signals that always stop: no broad ``except`` in the library swallows an interrupt, and SIGTERM to a real
``servelab run`` mid-case and to a real pytest holding an engine ends each within 30 s, with the signal in the exit
status and no engine, zombie or listener left behind."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_dataloss import _running_case_with_records      # the case a phase is writing

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib" / "servelab"

# handlers that catch every exception and do not re-raise it where they stand, each with the reason it is right
ALLOWED_SWALLOWS = {
    ("measure/client.py", "target"): "a thread's body: the exception is handed to the caller's thread, re-raised there",
    ("measure/live_capture.py", "run_start"): "a thread's body: kept in `failed`, re-raised in the caller's thread",
    ("measure/multiclient.py", "_child"): "a client process's body: sent to the parent, which raises it, naming "
                                          "the process; the child ends right after",
    ("measure/matrix.py", "run_matrix"): "Ctrl-C stops the matrix and keeps what was measured (docs/method.md"
                                         "#case-policy); when a signal stopped it, the interrupt is raised again "
                                         "after summary.csv is written",
    ("cli.py", "main"): "the command's top: one line and the exit status 128 + signal",
}
BROAD = {"BaseException", "KeyboardInterrupt", "SystemExit", "GeneratorExit"}


def _names(node: ast.expr | None) -> set[str]:
    if node is None:
        return {"BaseException"}                   # a bare `except:`
    elts = node.elts if isinstance(node, ast.Tuple) else [node]
    return {e.attr if isinstance(e, ast.Attribute) else getattr(e, "id", "") for e in elts}


def _raises(body: list[ast.stmt]) -> bool:
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Raise):
                return True
    return False


def broad_swallows(root: Path) -> list[tuple[str, str, int]]:
    """(file, function, line) of every ``except`` catching BaseException / KeyboardInterrupt / SystemExit (or
    bare) whose body does not raise."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        funcs = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for h in ast.walk(tree):
            if isinstance(h, ast.ExceptHandler) and _names(h.type) & BROAD and not _raises(h.body):
                owner = min((f for f in funcs if f.lineno <= h.lineno <= (f.end_lineno or 0)),
                            key=lambda f: (f.end_lineno or 0) - f.lineno, default=None)
                out.append((str(path.relative_to(root)), owner.name if owner else "<module>", h.lineno))
    return out


def test_no_broad_except_swallows_an_interrupt():
    found = broad_swallows(LIB)
    bad = [f"{f}:{line} in {fn}()" for f, fn, line in found if (f, fn) not in ALLOWED_SWALLOWS]
    assert not bad, ("an `except` that catches KeyboardInterrupt/SystemExit and does not re-raise (a SIGTERM "
                     f"turned into KeyboardInterrupt dies there): {bad}")
    stale = set(ALLOWED_SWALLOWS) - {(f, fn) for f, fn, _ in found}
    assert not stale, f"allowed swallows that no longer exist (remove them from the list): {stale}"


def test_the_scan_finds_a_swallow(tmp_path):
    """The scan itself: a bare except, an `except BaseException` and an `except KeyboardInterrupt` that do not
    raise are found; ones that re-raise are not."""
    (tmp_path / "m.py").write_text(
        "def a():\n    try:\n        pass\n    except:\n        pass\n"
        "def b():\n    try:\n        pass\n    except (OSError, KeyboardInterrupt):\n        return 1\n"
        "def c():\n    try:\n        pass\n    except BaseException:\n        cleanup()\n        raise\n"
        "def d():\n    try:\n        pass\n    except Exception:\n        pass\n")
    assert [(fn, line) for _, fn, line in broad_swallows(tmp_path)] == [("a", 4), ("b", 9)]


# ---------------------------------------------------------------- the process table after a SIGTERM

def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _listening_ports(procs: list[psutil.Process]) -> set[int]:
    ports = set()
    for p in procs:
        try:
            ports |= {c.laddr.port for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return ports


def _left(pids: set[int], wait_s: float = 10.0) -> dict[int, str]:
    """Of ``pids``, those still in the process table (alive or zombie), after waiting up to ``wait_s`` for the
    system's reaper to take what its parents left: {pid: status}."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {}
        for pid in pids:
            try:
                left[pid] = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _listening_now(ports: set[int]) -> set[int]:
    return {c.laddr.port for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}


def _wait_for(cond, timeout_s: float, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"ended (status {proc.returncode}) before {what}: {err[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no {what} within {timeout_s:.0f} s")


@pytest.mark.slow
def test_sigterm_to_servelab_run_mid_case_stops_everything(tmp_path):
    """SIGTERM to the `servelab run` process alone (as a service manager or `kill PID` sends it) while a Phase 1
    case measures on the real llama-server: it exits with 128 + 15 within 30 s, its kernel and engine are gone (no
    zombie), nothing it listened on still listens; the case folder is resumable (INTERRUPTED)."""
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "servelab.cli", "run", "phase1", "--target", "local-tiny", "--run-id", "st",
            "-p", "repeats=3", "-p", "cases=D1"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    case = _wait_for(lambda: _running_case_with_records(tmp_path / "outputs" / "st" / "cases"), 300, proc,
                     "case with records on disk")
    tree = _tree(proc.pid)
    names = {p.pid: p.name() for p in tree}
    assert any("llama-server" in n for n in names.values()), names         # the engine is in the tree
    ports = _listening_ports(tree)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 30, f"took {took:.1f} s"
    assert "interrupted by SIGTERM" in err
    assert _left(set(names) - {proc.pid}) == {}, names
    assert ports and _listening_now(ports) == set()
    meta = json.loads((case / "meta.json").read_text())
    assert meta["status"] == "INTERRUPTED"


@pytest.mark.slow
def test_sigterm_to_pytest_holding_the_engine_fixture_stops_it(tmp_path):
    """SIGTERM to a real pytest whose test holds the session's llama-server fixture: the run ends within 30 s with
    128 + 15, the engine is stopped and reaped (no zombie), its port no longer listens."""
    marker = tmp_path / "held.json"
    env = {**os.environ, "SERVELAB_HELD_MARKER": str(marker), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             str(ROOT / "tests" / "held_engine.py")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    held = _wait_for(lambda: marker.is_file() and marker.read_text() and json.loads(marker.read_text()), 300, proc,
                     "engine held")
    tree = _tree(proc.pid)
    assert set(held["pids"]) <= {p.pid for p in tree}
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:] + err[-3000:]
    assert took < 30, f"took {took:.1f} s"
    assert _left({p.pid for p in tree} - {proc.pid}) == {}
    assert _listening_now({held["port"]}) == set()
