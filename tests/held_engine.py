"""Not collected by the suite (no ``test_`` file name): ``tests/test_signals.py`` runs it in a pytest of its own,
which holds the session's real engine fixture (``tiny_server``) in a test that waits, and then sends that pytest
SIGTERM. The marker file (``SERVELAB_HELD_MARKER``) tells it the engine is up and which pid and port it has."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest


@pytest.mark.slow
def test_holds_the_engine(tiny_server):
    port = tiny_server.port
    pids = [h.pid for h in tiny_server.handles.values()]
    Path(os.environ["SERVELAB_HELD_MARKER"]).write_text(json.dumps({"pids": pids, "port": port}))
    time.sleep(600)
