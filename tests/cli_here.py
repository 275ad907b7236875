"""``servelab ...`` run through ``servelab.cli.main`` in the test's own process: the same parsing, checks and messages
as the command, without an interpreter start and the imports per call. The tests that need the real process (its
exit status and its whole stderr, signals) start it with ``subprocess``."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from servelab.cli import main


def run_cli(*args: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
            ) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``servelab *args`` with its outputs under ``tmp_path/outputs``."""
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "outputs"))
    old = signal.getsignal(signal.SIGTERM)          # main() turns SIGTERM into Ctrl-C for the phase it runs
    try:
        code = main(list(args))
    finally:
        signal.signal(signal.SIGTERM, old)
    out = capsys.readouterr()
    return code, out.out, out.err
