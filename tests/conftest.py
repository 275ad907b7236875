"""Shared fixtures: where the real data lives, and the real servers the integration tests start."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SERVELAB_SHARED", ROOT.parent / "shared"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data folder (``$SERVELAB_SHARED/data``, by default ``shared/data`` beside the checkout): our own
    H200 capture and third-party traces; skipped where absent."""
    d = SHARED / "data"
    if not d.is_dir():
        pytest.skip(f"shared data folder {d} is absent (tests read real fixtures from it; set SERVELAB_SHARED)")
    return d


@pytest.fixture(scope="session")
def thirdparty(shared_data: Path) -> Path:
    """``<shared data>/thirdparty``: real traces of public projects, read in place, never copied."""
    d = shared_data / "thirdparty"
    if not d.is_dir():
        pytest.skip(f"third-party trace folder {d} is absent")
    return d


@pytest.fixture(scope="session")
def samples() -> Path:
    """``data/samples``: the small real data shipped with the project."""
    return ROOT / "data" / "samples"


@pytest.fixture
def outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run directories of a test go to a temporary folder, never to the checkout's outputs/."""
    out = tmp_path / "outputs"
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(out))
    return out


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """The real llama-server, built from the llama-cpp-python sdist (cached; ~6 min the first time)."""
    from servelab.target.llamacpp_build import ensure_llama_server
    return ensure_llama_server()


@pytest.fixture(scope="session")
def tiny_server(llama_server_binary: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real llama-server with the tiny random model on 127.0.0.1 (32 slots), shared by a test session.

    Yields a ``servelab.target.server.RunningServer``; ``.base_url`` is the URL, ``.target`` the local-tiny target.
    """
    from servelab.target.hosts import ProcessTracker
    from servelab.target.targets import load_target
    from servelab.target.server import start_server, stop_server
    target = load_target("local-tiny")
    logs = tmp_path_factory.mktemp("tiny-server")
    with ProcessTracker() as tracker:
        srv = start_server(target, logs, tracker, health_timeout_s=60)
        yield srv
        stop_server(srv, tracker)
