"""A fault of the fault matrix: the disk fills while a case writes.

A real ``servelab run phase1`` on the real llama-server (``local-tiny``) writes its run folder on a small
filesystem the test mounts (tmpfs, root only: skipped with the reason elsewhere); once the case has records on disk
the test fills that filesystem. The run must end with one line naming the full disk (no traceback), the engine
stopped, the case not marked done; with space again, ``--resume`` measures that case again and the run is whole."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_dataloss import _running_case_with_records      # the case a phase is writing

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB tmpfs at ``tmp_path/outputs`` for the test's duration (unmounted after, even on failure)."""
    mnt = tmp_path / "outputs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mounting a small filesystem needs root (mount -t tmpfs): {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(path: Path) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def _servelab(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "servelab.cli", "run", "phase1", "--target", "local-tiny",
                             "--run-id", "full", "-p", "cases=D1", "-p", "repeats=2", "-p", "search=false", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_a_full_disk_mid_case_is_one_line_and_resume_measures_the_case_again(small_fs):
    env = {**os.environ, "SERVELAB_OUTPUTS": str(small_fs), "PYTHONUNBUFFERED": "1"}
    proc = _servelab(env)
    deadline = time.monotonic() + 300
    case = None
    while case is None and time.monotonic() < deadline and proc.poll() is None:
        case = _running_case_with_records(small_fs / "full" / "cases")
        time.sleep(0.1)
    assert case is not None, proc.communicate()[1][-3000:]
    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    _fill(small_fs / "filler")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode not in (0, None), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "No space left on device" in err, err[-3000:]
    t0 = time.monotonic()                                     # the kernel and the engine are gone (no zombie)
    while any(psutil.pid_exists(pid) for pid in tree[1:]) and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert [pid for pid in tree[1:] if psutil.pid_exists(pid)] == []
    meta = json.loads((case / "meta.json").read_text()) if (case / "meta.json").is_file() else {}
    assert meta.get("status") != "success"                     # never marked done
    (small_fs / "filler").unlink()
    again = _servelab(env, "--resume")
    out, err = again.communicate(timeout=900)
    assert again.returncode == 0, err[-3000:]
    meta = json.loads((case / "meta.json").read_text())
    assert meta["status"] == "success", meta
    summary = (small_fs / "full" / "summary.csv").read_text()
    assert "D1" in summary
