"""Shared fixtures: the data the tests read, and the real servers the integration tests start.

Our own captures ship with the repository (``data/samples``); only third-party traces of public projects live
outside it and are read in place (``thirdparty``), their tests skipped where that folder is absent."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "data" / "samples"
CACHE_DIRNAME = ".servelab_cache"        # servelab.analyse.trace.load.CACHE_DIRNAME
# the one place outside the repository that tests read: third-party traces, never copied into it
THIRDPARTY = Path(os.environ.get("SERVELAB_SHARED", ROOT.parent / "shared")) / "data" / "thirdparty"


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in d.rglob("*") if p.is_file() and CACHE_DIRNAME not in p.parts):
        h.update(str(f.relative_to(d)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def read_only_copy(src: Path) -> Path:
    """``src`` copied once into a read-only folder under the system temp dir, reused while its content is the
    same: code that caches next to a trace caches elsewhere (never inside the repository), and the folder keeps
    one path so that cache is reused by the next session."""
    d = Path(tempfile.gettempdir()) / f"servelab-tests-{_digest(src)[:16]}" / src.name
    if d.is_dir():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{src.name}-", dir=d.parent))
    shutil.copytree(src, tmp / src.name, ignore=shutil.ignore_patterns(CACHE_DIRNAME))
    folders = [tmp / src.name, *(q for q in (tmp / src.name).rglob("*") if q.is_dir())]
    for q in folders:
        q.chmod(0o555)
    try:
        os.rename(tmp / src.name, d)               # atomic: a concurrent session may have made it first
    except OSError:
        for q in folders:
            q.chmod(0o755)
    shutil.rmtree(tmp, ignore_errors=True)
    return d


# fixtures that build or start the real engine: a test that uses one, directly or through another fixture, costs
# seconds to minutes and is ``slow`` even where its file forgot the marker (``pytest -m "not slow"`` stays quick)
ENGINE_FIXTURES = frozenset({"llama_server_binary", "tiny_server"})


def pytest_configure(config: pytest.Config) -> None:
    """The quick part (``-m "not slow"``) draws fewer generated inputs per property (``tests/fuzz.py``)."""
    import fuzz
    fuzz.QUICK = " ".join(str(config.getoption("markexpr") or "").split()) == "not slow"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def h200x2() -> Path:
    """Our own 2 x H200 capture shipped in ``data/samples/h200x2`` (torch-profiler traces, nccl-tests logs,
    nvidia-smi CSV), read through a read-only copy so that no trace cache is written into the repository."""
    src = SAMPLES / "h200x2"
    assert (src / "traces").is_dir(), f"{src} is part of the repository and must be present"
    return read_only_copy(src)


@pytest.fixture(scope="session")
def thirdparty() -> Path:
    """Real traces of public projects (HTA, TraceLens), read in place from ``$SERVELAB_SHARED/data/thirdparty``
    (default: ``data/thirdparty`` of a ``shared`` folder next to the checkout), never copied into the repository."""
    if not THIRDPARTY.is_dir():
        pytest.skip(f"third-party traces absent: {THIRDPARTY} "
                    "(set SERVELAB_SHARED to the folder that holds data/thirdparty)")
    return THIRDPARTY


@pytest.fixture(scope="session")
def samples() -> Path:
    """``data/samples``: the small real data shipped with the project."""
    return SAMPLES


@pytest.fixture
def outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run directories of a test go to a temporary folder, never to the checkout's outputs/."""
    out = tmp_path / "outputs"
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(out))
    return out


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """The real llama-server, built from the llama-cpp-python sdist (cached; ~6 min the first time)."""
    from servelab.deploy.llamacpp_build import ensure_llama_server
    return ensure_llama_server()


# every phase on the tiny target, each as cheap as it can be while still showing its tables: Phase 1 with the cases
# the cross-checks need (D1 and D2_c4 against the search's C=1 and C=4) and a two-step search; Phase 2 with its
# collectors around one engine case (P1) sampled every second. One run (about five minutes on two cores) serves every test that reads a whole run.
TINY_RUN_PHASES = [
    ("phase0", []),
    ("phase1", ["-p", 'cases=["P1","D1","D2_c4","M1"]', "-p", "search=true", "-p", "search_max_concurrency=4"]),
    ("phase2", ["-p", "cases=[P1]", "-p", "interval_s=1"]), ("phase3", []), ("phase4", []),
    ("phase5", []), ("phase6", []), ("phase7", []), ("phase8", []), ("phase9", [])]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path) -> Path:
    """The run folder of all ten phases on local-tiny (:data:`TINY_RUN_PHASES`): Phase 0 through ``servelab demo``
    (the README's command path: prepare, run, end-of-run freeze, consistency check), the others through ``servelab
    run`` with their parameters, then ``servelab archive``. Shared by the session: tests read it, and copy it before
    changing anything."""
    from servelab.cli import main
    out = tmp_path_factory.mktemp("pages")
    old = os.environ.get("SERVELAB_OUTPUTS")
    os.environ["SERVELAB_OUTPUTS"] = str(out)
    try:
        assert main(["demo", "--target", "local-tiny", "--run-id", "pages", "--phases", "phase0"]) == 0
        for phase, extra in TINY_RUN_PHASES[1:]:
            assert main(["run", phase, "--target", "local-tiny", "--run-id", "pages", *extra]) == 0, phase
        assert main(["archive", "pages"]) == 0
    finally:
        if old is None:
            os.environ.pop("SERVELAB_OUTPUTS", None)
        else:
            os.environ["SERVELAB_OUTPUTS"] = old
    return out / "pages"


@pytest.fixture(scope="session")
def tiny_server(llama_server_binary: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real llama-server with the tiny random model on 127.0.0.1 (32 slots), shared by a test session.

    Yields a ``servelab.deploy.server.RunningServer``; ``.base_url`` is the URL, ``.target`` the local-tiny target.
    """
    from servelab.deploy.hosts import ProcessTracker
    from servelab.deploy.targets import load_target
    from servelab.deploy.server import start_server, stop_server
    target = load_target("local-tiny")
    logs = tmp_path_factory.mktemp("tiny-server")
    with ProcessTracker() as tracker:
        srv = start_server(target, logs, tracker, health_timeout_s=60)
        yield srv
        stop_server(srv, tracker)


@pytest.fixture(scope="session")
def paced_sse():
    """Start the benchmarks' paced SSE server (``benchmarks/paced_sse_server.py``, no spinning: tests share the
    cores): ``paced_sse(itl_ms)`` → its ``http://127.0.0.1:PORT`` base URL, one server per ITL for the session,
    all stopped at its end."""
    import subprocess
    import sys
    from servelab.deploy.hosts import free_port
    from servelab.deploy.server import wait_healthy
    procs: dict[float, tuple[subprocess.Popen, str]] = {}

    def start(itl_ms: float) -> str:
        if itl_ms not in procs:
            port = free_port()
            proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "paced_sse_server.py"), str(port),
                                     str(itl_ms), "--spin-ms", "0"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            procs[itl_ms] = proc, f"http://127.0.0.1:{port}"
            wait_healthy(procs[itl_ms][1], "/health", 20, alive=lambda: proc.poll() is None)
        return procs[itl_ms][1]
    try:
        yield start
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def tok(tiny_server):
    """The tiny server's tokenizer (``measure.workload.engine_tokenizer``)."""
    from servelab.measure.workload import engine_tokenizer
    return engine_tokenizer(tiny_server.base_url, "llamacpp", tiny_server.engine.tokenize_path)


@pytest.fixture(scope="session")
def pool(tok):
    """The tiny model's pool of ordinary tokens for exact-length prompts (``measure.workload.token_pool``)."""
    from servelab.measure.workload import token_pool
    return token_pool(tok)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A suite stopped by SIGTERM (turned into KeyboardInterrupt while an engine fixture's tracker is open) ends with
    128 + 15, as the process a shell saw killed by it, not pytest's plain "interrupted" (2)."""
    from servelab.core import signals
    if signals.received():
        session.exitstatus = signals.exit_status()
