"""Engine-side profile capture for Phase 3: start/stop the engine's torch profiler around a benchmark case,
wait for every rank's trace to be complete, and collect the traces from every node into the case folder.

The capture rules of ``docs/method.md#profiling`` are built in:

- a capture covers 5 to 32 engine steps after warm-up (``ProfileScenario`` refuses other windows); by default
  ``DEFAULT_STEPS`` = 10, the top of the 5–10 steps the method's first pass captures of P3, D2 and M1
  (``docs/method.md#evidence-actions``);
- four scenarios, each bound to the benchmark case it profiles: ``decode_control`` (1K→1K, C=32, skip 2
  steps once decode is active, capture N), ``mixed_treatment`` (same background, 2 pure decode steps,
  then a 128K→1 prefill is injected; N + ``MIXED_EXTRA_STEPS`` steps in all, at most 32: room for the request to
  reach the engine and for its prefill chunks) and ``long_prefill`` (128K→1, C=1, N steps from the first
  chunk) and ``prefix_hit`` (a long shared prefix sent once to warm the cache, then C requests sharing it — a
  high prefix-cache hit rate — captured, N steps from the first chunk);
- traces are collected from every node (SSH ``get`` for remote nodes, a copy locally) into
  ``cases/<case>/profiles/<node>/`` under the engine's own file names, so rank identity is preserved
  (SGLang ``…-TP-3[-DP-0-PP-1-EP-3].trace.json.gz``, vLLM ``…rank3.<ns>.pt.trace.json.gz``);
- a profiled case is marked in its ``meta.json`` (``profiled: true``, ``valid_for_comparison: false``):
  its performance numbers are never compared with clean runs;
- each node's clock offset to the client (this machine), as the run's preflight measured it, is written beside
  the traces (``cases/<case>/clock.json``, :func:`case_clock_record`), so the one-clock join of a case
  (``analyse.trace.stalls``) can put a remote node's trace on the client's clock without the run manifest.

Engine facts this relies on (checked against the engines' sources; vLLM also against a real server):

- **SGLang** ``POST /start_profile`` takes ``output_dir, start_step, num_steps, activities,
  profile_by_stage, with_stack, record_shapes, profile_prefix``; with ``num_steps`` it stops by itself.
  ``start_step`` is an *absolute* scheduler forward count, clamped to "the next step" — on a warmed-up
  server it does not skip anything. Skipping steps after a trigger is therefore done by when the
  caller triggers (or by passing an absolute ``start_step`` it knows); the session says so in ``notes``.
- **vLLM** (0.32) ``POST /start_profile`` takes an optional body ``{profile_prefix, delay_iterations,
  max_iterations}`` (a per-session step window: ``delay_iterations`` steps are skipped, then exactly
  ``max_iterations`` steps are recorded and the worker trace is written); the endpoint exists only with a
  ``--profiler-config``, and traces land in its ``torch_profiler_dir`` on each node: one
  ``<prefix>_rank<N>.<ns>.pt.trace.json.gz`` per worker plus the API server's
  ``<prefix>_<host>_<pid>.async_llm.<ns>.pt.trace.json.gz``, written at ``/stop_profile``.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from servelab.deploy.engines import ProfileError, profile_file
from servelab.core.run import CommandRecord, now_iso, record_command, write_json_atomic, read_manifest
from servelab.deploy.server import http_json
from servelab.measure import expert_record

SCENARIOS = ("decode_control", "mixed_treatment", "long_prefill", "prefix_hit")
AUTO_STOP_GRACE_S = 20.0       # an engine that stops by itself gets this long to write its trace after the workload
STEP_WINDOW = (5, 32)           # docs/method.md#profiling-lessons: capture only 5 to 32 engine steps after warm-up
DEFAULT_STEPS = 10              # the method's first pass captures 5–10 steps of P3, D2 and M1: the top of that range
# the mixed capture's steps beyond the window: its 2 pure decode steps before the injection, and 20 for the injected
# request to reach the engine and be prefilled (a 128K prompt in 8K chunks is 16 steps) before decode is seen again
MIXED_EXTRA_STEPS = 22
TRIGGERS = ("decode_active", "before_first_chunk")
CASE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,95}$")


class CaptureError(RuntimeError):
    """A profile could not be started, its traces did not appear or are broken, or the input is invalid."""


# ---------------------------------------------------------------- scenarios

@dataclass(frozen=True)
class ProfileScenario:
    """One Phase 3 capture, bound to the benchmark case whose workload it runs.

    ``skip_steps`` engine steps are skipped after the trigger, then ``num_steps`` steps are captured.
    ``trigger`` says when the caller sends ``start_profile``: ``decode_active`` (all ``concurrency``
    streams are decoding) or ``before_first_chunk`` (before the long prompt is sent). For the mixed
    scenario a ``inject_isl_tokens → inject_osl_tokens`` request is injected after
    ``inject_after_steps`` captured decode steps. Token counts are exact workload lengths.
    """
    name: str
    case_id: str
    isl_tokens: int
    osl_tokens: int
    concurrency: int
    num_steps: int
    skip_steps: int = 0
    trigger: str = "decode_active"
    inject_isl_tokens: int = 0
    inject_osl_tokens: int = 0
    inject_after_steps: int = 0
    prefix_tokens: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        if self.name not in SCENARIOS:
            raise CaptureError(f"profile scenario '{self.name}' is not one of {SCENARIOS}")
        if not CASE_ID_RE.match(self.case_id or ""):
            raise CaptureError(f"scenario {self.name}: case_id {self.case_id!r} must be 1-96 characters of "
                               f"letters, digits and . _ = + - (it names a folder)")
        lo, hi = STEP_WINDOW
        if not lo <= self.num_steps <= hi:
            raise CaptureError(f"scenario {self.name} ({self.case_id}): num_steps={self.num_steps} is outside the "
                               f"capture window of {lo}-{hi} engine steps (docs/method.md#profiling-lessons)")
        for key in ("isl_tokens", "osl_tokens", "concurrency"):
            if getattr(self, key) < 1:
                raise CaptureError(f"scenario {self.name}: {key} must be >= 1, got {getattr(self, key)}")
        if self.skip_steps < 0 or self.inject_after_steps < 0:
            raise CaptureError(f"scenario {self.name}: skip_steps and inject_after_steps must be >= 0")
        if self.trigger not in TRIGGERS:
            raise CaptureError(f"scenario {self.name}: trigger '{self.trigger}' is not one of {TRIGGERS}")
        if self.name == "mixed_treatment" and self.inject_isl_tokens < 1:
            raise CaptureError("scenario mixed_treatment needs inject_isl_tokens (the injected long prefill)")
        if self.name == "prefix_hit" and not 0 < self.prefix_tokens < self.isl_tokens:
            raise CaptureError(f"scenario prefix_hit needs 0 < prefix_tokens < isl_tokens (the shared prefix), got "
                               f"prefix_tokens={self.prefix_tokens}, isl_tokens={self.isl_tokens}")
        if self.inject_after_steps >= self.num_steps:
            raise CaptureError(f"scenario {self.name}: inject_after_steps={self.inject_after_steps} leaves no "
                               f"captured step after the injection (num_steps={self.num_steps})")

    @property
    def profiled_case_id(self) -> str:
        """Folder id for the profiled run: never the clean case's own folder."""
        return f"{self.case_id}--profile-{self.name}"

    @property
    def profile_prefix(self) -> str:
        """Trace file prefix (valid for vLLM: starts alphanumeric, only letters, digits, ``._-``)."""
        return re.sub(r"[^A-Za-z0-9._-]", "-", f"{self.case_id}.{self.name}")[:128]


SCALES = {
    # name: (short ISL, OSL, decode C, long ISL)
    "cluster": (1024, 1024, 32, 131072),     # the reference cluster's lengths (docs/method.md#capture-scenarios)
    "local": (128, 256, 8, 1536),            # fits local-vllm's 2048-token context
}
# prefix_hit per scale: (ISL, shared prefix tokens, OSL, C) — a long context of which ~97 % is one cached prefix
PREFIX_HIT = {"cluster": (32768, 31744, 64, 8), "local": (1600, 1536, 16, 4)}


def mixed_steps(steps: int) -> int:
    """Engine steps the mixed capture holds for a window of ``steps``: ``steps`` + ``MIXED_EXTRA_STEPS``, at most the
    window's upper bound (32)."""
    return min(STEP_WINDOW[1], int(steps) + MIXED_EXTRA_STEPS)


def check_steps(steps: Any) -> int:
    """``steps`` as an engine-step count inside ``STEP_WINDOW``, or a ``CaptureError`` saying what to pass."""
    lo, hi = STEP_WINDOW
    if isinstance(steps, bool) or not isinstance(steps, int) or not lo <= steps <= hi:
        raise CaptureError(f"capture_steps={steps!r}: a capture holds {lo} to {hi} engine steps "
                           f"(docs/method.md#profiling-lessons); pass a whole number in that range, e.g. {DEFAULT_STEPS}")
    return steps


def capture_scenarios(scale: str = "cluster", decode_case: str = "D2-c32", mixed_case: str = "M1-treatment",
                      prefill_case: str = "P3", prefix_case: str = "H8-prefix",
                      steps: int = DEFAULT_STEPS) -> list[ProfileScenario]:
    """The four Phase 3 scenarios (``docs/method.md#capture-scenarios``), each bound to its benchmark case id.

    ``scale`` ``cluster`` uses the reference lengths (1K→1K at C=32, 128K→1); ``local`` shrinks them for
    a CPU engine with a 2048-token context. Pass the case ids the benchmark matrix uses. ``steps`` (5–32) is the
    window of the decode, long-prefill and prefix-hit captures; the mixed one holds :func:`mixed_steps` of it.
    """
    if scale not in SCALES:
        raise CaptureError(f"scale '{scale}' is not one of {sorted(SCALES)}")
    n = check_steps(steps)
    nm = mixed_steps(n)
    isl, osl, conc, long_isl = SCALES[scale]
    p_isl, p_prefix, p_osl, p_conc = PREFIX_HIT[scale]
    return [
        ProfileScenario("decode_control", decode_case, isl, osl, conc, num_steps=n, skip_steps=2,
                        trigger="decode_active",
                        description=f"{isl}->{osl}, C={conc}: once decode is active skip 2 steps, capture {n}"),
        ProfileScenario("mixed_treatment", mixed_case, isl, osl, conc, num_steps=nm, skip_steps=0,
                        trigger="decode_active", inject_isl_tokens=long_isl, inject_osl_tokens=1,
                        inject_after_steps=2,
                        description=f"{isl}->{osl}, C={conc} background: 2 pure decode steps, then inject "
                                    f"{long_isl}->1; {nm} steps in all"),
        ProfileScenario("long_prefill", prefill_case, long_isl, 1, 1, num_steps=n, skip_steps=0,
                        trigger="before_first_chunk",
                        description=f"{long_isl}->1, C=1: {n} steps from the first chunk"),
        ProfileScenario("prefix_hit", prefix_case, p_isl, p_osl, p_conc, num_steps=n, skip_steps=0,
                        trigger="before_first_chunk", prefix_tokens=p_prefix,
                        description=f"{p_isl}->{p_osl}, C={p_conc} sharing one {p_prefix}-token prefix (sent once "
                                    f"before the capture to warm the cache: ~{100 * p_prefix // p_isl}% hit rate); "
                                    f"{n} steps from the first chunk"),
    ]


# ---------------------------------------------------------------- trace file names

def trace_identity(file_name: str) -> dict[str, Any]:
    """What a trace file's name says: ``kind`` (worker | frontend | merged | memory | table | other) and,
    for rank files, ``rank_key`` plus the parallel ranks the name carries (``tp``, ``dp``, ``pp``, ``ep``,
    ``rank``; ``stage`` for SGLang profile_by_stage files)."""
    return profile_file(file_name)


# ---------------------------------------------------------------- files on a node

@dataclass(frozen=True)
class RemoteFile:
    """A file in an engine-side trace folder: name, size (bytes) and modification time (epoch seconds)."""
    name: str
    size_bytes: int
    mtime_s: float


def list_trace_dir(host: Any, path: str) -> dict[str, RemoteFile]:
    """Regular files directly in ``path`` on ``host`` (empty if the folder does not exist yet)."""
    if getattr(host, "kind", "local") == "local":
        p = Path(path)
        if not p.is_dir():
            return {}
        out = {}
        for e in p.iterdir():
            if e.is_file() and not e.name.startswith("."):
                st = e.stat()
                out[e.name] = RemoteFile(e.name, st.st_size, st.st_mtime)
        return out
    res = host.run(["find", path, "-maxdepth", "1", "-type", "f", "-printf", r"%s\t%T@\t%f\n"], timeout=60)
    if res.exit_code != 0:
        if "No such file" in res.stderr:
            return {}
        raise CaptureError(f"{host.name}: cannot list {path}: {res.stderr.strip() or res.stdout.strip()}")
    out = {}
    for line in res.stdout.splitlines():
        parts = line.split("\t", 2)
        if len(parts) == 3 and not parts[2].startswith("."):
            out[parts[2]] = RemoteFile(parts[2], int(parts[0]), float(parts[1]))
    return out


def local_file_complete(path: Path) -> tuple[bool, str]:
    """Whether a finished trace file reads to its end: gzip streams fully (CRC checked), JSON ends with
    ``}``. Returns (ok, reason)."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                while f.read(1 << 22):
                    pass
            return True, ""
        if path.name.endswith(".json"):
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 64))
                tail = f.read().rstrip()
            return (tail.endswith(b"}"), "" if tail.endswith(b"}") else "JSON does not end with '}'")
        return True, ""
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def file_complete(host: Any, path: str) -> tuple[bool, str]:
    """``local_file_complete`` on the node itself (``gzip -t`` / ``tail -c`` over SSH)."""
    if getattr(host, "kind", "local") == "local":
        return local_file_complete(Path(path))
    if path.endswith(".gz"):
        res = host.run(["gzip", "-t", path], timeout=600)
        return res.exit_code == 0, (res.stderr.strip() if res.exit_code else "")
    if path.endswith(".json"):
        res = host.run(["tail", "-c", "64", path], timeout=60)
        ok = res.exit_code == 0 and res.stdout.rstrip().endswith("}")
        return ok, "" if ok else "JSON does not end with '}'"
    return True, ""


# ---------------------------------------------------------------- sessions

@dataclass
class ProfileSession:
    """One profiling session on a running server: what was asked, where traces go, what existed before."""
    engine: str
    scenario: ProfileScenario
    base_url: str
    trace_dirs: dict[str, str]                     # node -> engine-side folder on that node
    expect_ranks: dict[str, int]                   # node -> worker rank traces expected there
    request_body: dict[str, Any] | None
    auto_stop: bool                                # the engine stops by itself after num_steps
    started: str = ""
    started_ns: int = 0
    start_status: int = 0
    start_response: Any = None
    stopped: str = ""
    stopped_ns: int = 0
    stop_status: int | None = None
    stop_response: Any = None
    before: dict[str, dict[str, RemoteFile]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("before")
        return d


def _expected_ranks(srv: Any) -> dict[str, int]:
    """Worker rank traces per node: the engine's world size spread evenly over the target's nodes."""
    nodes = [n.name for n in srv.target.nodes]
    per_node = max(1, srv.engine.world_size(srv.target.launch) // max(1, len(nodes)))
    return {n: per_node for n in nodes}


def _record(run_dir: Path | None, phase: str, title: str, url: str, body: Any, start: str, status: int,
            note: str) -> None:
    if run_dir is None:
        return
    argv = ["curl", "-sS", "-X", "POST", url]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body, separators=(",", ":"))]
    record_command(run_dir, CommandRecord(label="executed", argv=argv, phase=phase, title=title, host="local",
                                          start=start, end=now_iso(), exit_code=0 if status == 200 else 1,
                                          note=f"sent by servelab.measure.capture (urllib), curl equivalent; HTTP {status}"
                                               f"{'; ' + note if note else ''}"))


def start_profile(srv: Any, scenario: ProfileScenario, out_dir: str | None = None, *,
                  trace_dirs: dict[str, str] | None = None, expect_ranks: dict[str, int] | int | None = None,
                  run_dir: Path | None = None, phase: str = "", timeout_s: float = 120.0,
                  **opts: Any) -> ProfileSession:
    """Send ``POST /start_profile`` for ``scenario`` to a running SGLang or vLLM server.

    ``out_dir`` is the engine-side trace folder (on every node). SGLang: default
    ``<launch.profiler_dir>/<profiled case id>``; ``opts`` go to ``SGLangAdapter.start_profile_body``
    (``start_step`` = an absolute forward count, ``activities``, ``profile_by_stage``, ``with_stack``…).
    vLLM: the folder is fixed by the server's ``--profiler-config`` (``launch.profiler_dir``); a different
    ``out_dir`` is an error. ``trace_dirs`` overrides the folder per node as seen from the node's host
    (e.g. a docker bind mount). The files already in the folders are remembered so that only this
    session's files are collected. Raises ``CaptureError`` on a refused request.
    """
    engine = srv.engine
    if not engine.can_profile:
        raise CaptureError(f"engine '{engine.name}' has no profiler endpoint (profiling needs SGLang or vLLM)")
    nodes = [n.name for n in srv.target.nodes]
    try:
        req = engine.profile_request(srv.target.launch, out_dir, case_dir_name=scenario.profiled_case_id,
                                     prefix=scenario.profile_prefix, skip_steps=scenario.skip_steps,
                                     num_steps=scenario.num_steps, **opts)
    except ProfileError as exc:
        raise CaptureError(str(exc)) from exc
    folder, body, auto_stop, notes = req.folder, req.body, req.auto_stop, list(req.notes)
    dirs = {n: (trace_dirs or {}).get(n, folder) for n in nodes}
    if isinstance(expect_ranks, int):
        expected = {n: expect_ranks for n in nodes}
    else:
        expected = {**_expected_ranks(srv), **(expect_ranks or {})}
    before = {n: list_trace_dir(srv.hosts[n], dirs[n]) for n in nodes}
    session = ProfileSession(engine.name, scenario, srv.base_url, dirs, expected, body, auto_stop,
                             before=before, notes=notes)
    url = srv.base_url + engine.start_profile_path
    session.started, session.started_ns = now_iso(), time.time_ns()
    status, resp = http_json(url, body=body if body is not None else {}, method="POST", timeout=timeout_s,
                             headers=getattr(srv, "auth_headers", None))
    session.start_status, session.start_response = status, resp
    _record(run_dir, phase, f"start profile {scenario.name} ({scenario.case_id})", url, body, session.started,
            status, "")
    if status != 200:
        raise CaptureError(f"POST {url} answered HTTP {status}: {str(resp)[:500]}")
    return session


def stop_profile(srv: Any, session: ProfileSession, *, force: bool = False, run_dir: Path | None = None,
                 phase: str = "", timeout_s: float = 900.0) -> ProfileSession:
    """End the session: ``POST /stop_profile`` (vLLM always — its API-server trace is written then; SGLang
    only without ``num_steps`` or with ``force``, since a stop during a step-limited capture cuts it short).

    The long timeout is deliberate: writing a GPU trace takes seconds to minutes.
    """
    url = srv.base_url + srv.engine.stop_profile_path
    session.stopped = now_iso()
    if session.auto_stop and not force:
        session.stop_status = None
        session.notes.append(f"no /stop_profile sent: the engine stops after num_steps="
                             f"{session.request_body.get('num_steps') if session.request_body else '?'}")
        session.stopped_ns = time.time_ns()
        return session
    status, resp = http_json(url, body=None, method="POST", timeout=timeout_s, headers=getattr(srv, "auth_headers", None))
    session.stopped_ns = time.time_ns()
    session.stop_status, session.stop_response = status, resp
    _record(run_dir, phase, f"stop profile {session.scenario.name} ({session.scenario.case_id})", url, None,
            session.stopped, status, "")
    if status != 200 and not (session.auto_stop and "not in progress" in str(resp)):
        raise CaptureError(f"POST {url} answered HTTP {status}: {str(resp)[:500]}")
    return session


# ---------------------------------------------------------------- waiting and collecting

@dataclass
class TraceWait:
    """Result of waiting for a session's traces: per node the complete new files, and what is missing."""
    ready: dict[str, list[RemoteFile]]
    missing_ranks: dict[str, int]                   # node -> expected worker traces not seen
    broken: dict[str, dict[str, str]]               # node -> {file: reason} (unreadable after settling)
    waited_s: float
    timed_out: bool

    @property
    def complete(self) -> bool:
        return not self.timed_out and not any(self.missing_ranks.values()) and not any(self.broken.values())


def _new_files(session: ProfileSession, node: str, listing: dict[str, RemoteFile]) -> dict[str, RemoteFile]:
    old = session.before.get(node, {})
    return {k: v for k, v in listing.items() if k not in old or old[k] != v}


def worker_trace_written(srv: Any, session: ProfileSession) -> bool:
    """Whether every node of ``session`` holds a worker trace file that was not there when it started, listed where
    the engine writes (``session.trace_dirs``: the launch's profiler folder, or an attached server's own
    ``profile.trace_dir``; over SSH on a remote node) — the drive keeps its load on until then."""
    return all(any(trace_identity(name)["kind"] == "worker"
                   for name in _new_files(session, n, list_trace_dir(srv.hosts[n], folder)))
               for n, folder in session.trace_dirs.items())


def wait_for_traces(srv: Any, session: ProfileSession, timeout_s: float = 300.0, poll_s: float = 0.5,
                    settle_s: float = 1.0) -> TraceWait:
    """Poll every node's trace folder until each has its expected worker rank traces and every new file
    has kept its size for ``settle_s`` and reads to the end (gzip CRC / JSON close). Does not raise on a
    timeout: the result says what is missing, so a partial capture can still be kept and reported."""
    t0 = time.monotonic()
    nodes = list(session.trace_dirs)
    seen: dict[str, dict[str, tuple[RemoteFile, float]]] = {n: {} for n in nodes}   # file -> (state, since)
    verified: dict[str, dict[str, RemoteFile]] = {n: {} for n in nodes}
    broken: dict[str, dict[str, str]] = {n: {} for n in nodes}
    while True:
        now = time.monotonic()
        for n in nodes:
            host = srv.hosts[n]
            folder = session.trace_dirs[n]
            for name, f in _new_files(session, n, list_trace_dir(host, folder)).items():
                prev = seen[n].get(name)
                if prev is None or prev[0] != f:
                    seen[n][name] = (f, now)
                    verified[n].pop(name, None)
                    broken[n].pop(name, None)
                    continue
                if name in verified[n] or now - prev[1] < settle_s:
                    continue
                ok, why = file_complete(host, f"{folder.rstrip('/')}/{name}")
                if ok:
                    verified[n][name] = f
                    broken[n].pop(name, None)
                else:
                    broken[n][name] = why
        missing = {}
        for n in nodes:
            keys = {trace_identity(k).get("rank_key") for k in verified[n]
                    if trace_identity(k)["kind"] == "worker"}
            missing[n] = max(0, session.expect_ranks.get(n, 1) - len(keys - {None}))
        settled = all(set(verified[n]) == set(seen[n]) for n in nodes)
        elapsed = time.monotonic() - t0
        if (settled and not any(missing.values())) or elapsed > timeout_s:
            timed_out = elapsed > timeout_s and not (settled and not any(missing.values()))
            return TraceWait({n: sorted(verified[n].values(), key=lambda x: x.name) for n in nodes}, missing,
                             {n: b for n, b in broken.items() if b}, round(elapsed, 3), timed_out)
        time.sleep(poll_s)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class CollectedTrace:
    """One collected file: where it came from and where it is now, with its identity from the name."""
    node: str
    name: str
    source: str
    path: str                       # relative to the case folder
    size_bytes: int
    sha256: str
    kind: str
    identity: dict[str, Any]


def collect_profiles(srv: Any, session: ProfileSession, case_dir: Path, wait: TraceWait,
                     remove_source: bool = False) -> list[CollectedTrace]:
    """Copy the session's complete files from each node into ``case_dir/profiles/<node>/<file name>``
    (SSH ``get`` for remote nodes, a local copy otherwise) and check each copy (size, readable to the end)."""
    out: list[CollectedTrace] = []
    for node, files in wait.ready.items():
        host = srv.hosts[node]
        dest_dir = Path(case_dir) / "profiles" / node
        dest_dir.mkdir(parents=True, exist_ok=True)
        for f in files:
            src = f"{session.trace_dirs[node].rstrip('/')}/{f.name}"
            dest = dest_dir / f.name
            tmp = dest.with_name(dest.name + ".part")
            if getattr(host, "kind", "local") == "local":
                shutil.copyfile(src, tmp)
            else:
                host.get(src, tmp)
            size = tmp.stat().st_size
            if size != f.size_bytes:
                tmp.unlink(missing_ok=True)
                raise CaptureError(f"{node}:{src}: copied {size} bytes, the node listed {f.size_bytes}")
            tmp.replace(dest)
            ok, why = local_file_complete(dest)
            if not ok:
                raise CaptureError(f"{node}:{src}: the collected copy {dest} is not readable to the end: {why}")
            ident = trace_identity(f.name)
            out.append(CollectedTrace(node, f.name, src, str(dest.relative_to(case_dir)), size, _sha256(dest),
                                      ident["kind"], ident))
            if remove_source:
                if getattr(host, "kind", "local") == "local":
                    Path(src).unlink(missing_ok=True)
                else:
                    host.run(["rm", "-f", src], timeout=60)
    return out


# ---------------------------------------------------------------- marking the case

def mark_profiled(case_dir: Path, session: ProfileSession, files: list[CollectedTrace],
                  wait: TraceWait | None = None) -> dict[str, Any]:
    """Write ``profiles/capture.json`` and mark ``meta.json``: ``profiled: true``,
    ``valid_for_comparison: false`` with the reason, and the benchmark case it is bound to."""
    case_dir = Path(case_dir)
    capture = {"session": session.summary(), "files": [asdict(f) for f in files],
               "wait": None if wait is None else {"waited_s": wait.waited_s, "timed_out": wait.timed_out,
                                                  "missing_ranks": wait.missing_ranks, "broken": wait.broken,
                                                  "complete": wait.complete}}
    write_json_atomic(case_dir / "profiles" / "capture.json", capture)
    meta_path = case_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"case_id": case_dir.name}
    reason = (f"profiler attached ({session.engine} torch profiler, scenario {session.scenario.name}): "
              f"performance numbers are not comparable with clean runs")
    reasons = [r for r in meta.get("invalid_reasons", []) if not r.startswith("profiler attached")]
    meta.update({
        "profiled": True,
        "valid_for_comparison": False,
        "invalid_reasons": reasons + [reason],
        "bound_case_id": session.scenario.case_id,
        "profile": {"scenario": session.scenario.name, "engine": session.engine,
                    "num_steps": session.scenario.num_steps, "skip_steps": session.scenario.skip_steps,
                    "started": session.started, "stopped": session.stopped,
                    "worker_traces": sum(1 for f in files if f.kind == "worker"), "files": len(files),
                    "complete": None if wait is None else wait.complete, "capture": "profiles/capture.json"},
    })
    write_json_atomic(meta_path, meta)
    return meta


def is_profiled(case_dir: Path) -> bool:
    """True when a case folder holds a profiled run (its numbers must not be compared with clean runs)."""
    p = Path(case_dir) / "meta.json"
    return p.exists() and bool(json.loads(p.read_text()).get("profiled"))


# ---------------------------------------------------------------- one call

@dataclass
class CaptureResult:
    session: ProfileSession
    wait: TraceWait
    files: list[CollectedTrace]
    meta: dict[str, Any]
    drive_result: Any = None

    @property
    def worker_traces(self) -> list[CollectedTrace]:
        return [f for f in self.files if f.kind == "worker"]


CASE_CLOCK_FILE = "clock.json"


def case_clock_record(run_dir: Path | None, target: Any) -> dict[str, Any]:
    """Each node's clock minus the client's (this machine's), for a case's ``clock.json``: a ``local`` node is this
    machine (0, exactly); an SSH node's offset, uncertainty (half the shortest ``date +%s%N`` round trip) and round
    trip come from the run's preflight (``manifest["preflight"]["clock"][node]["vs_client"]``, measured when the
    run's first engine started). A node without one gets ``offset_ns: null`` and the reason; the join then refuses
    that node's traces (``docs/metrics.md#one-clock``)."""
    pre: dict[str, Any] = {}
    if run_dir is not None:
        pre = read_manifest(Path(run_dir)).get("preflight") or {}
    same = pre.get("target") == getattr(target, "name", None)
    measured = (pre.get("clock") or {}) if same else {}
    nodes: dict[str, Any] = {}
    for node in target.nodes:
        if node.kind == "local":
            nodes[node.name] = {"offset_ns": 0, "uncertainty_ns": 0, "rtt_ns": 0, "how": "same machine as the client"}
            continue
        vs = (measured.get(node.name) or {}).get("vs_client")
        if vs and vs.get("offset_ns") is not None:
            nodes[node.name] = {k: vs.get(k) for k in ("offset_ns", "uncertainty_ns", "rtt_ns", "how")}
            continue
        why = ("no run folder, so no preflight was recorded" if run_dir is None else
               f"the run's preflight is for target '{pre.get('target')}'" if pre and not same else
               "the run's manifest has no preflight" if not pre else
               (measured.get(node.name) or {}).get("error") or "the run's preflight has no offset to the client for "
               "this node (recorded by an older servelab)")
        nodes[node.name] = {"offset_ns": None, "uncertainty_ns": None, "reason": why}
    client = next((n.name for n in target.nodes if n.kind == "local"), "")
    return {"client": client or "the servelab machine", "client_node": client or None, "source": "preflight",
            "measured_at": pre.get("when", "") if same else "", "target": getattr(target, "name", ""),
            "note": "offset_ns = node clock − client clock; node time − offset_ns = client time", "nodes": nodes}


def capture(srv: Any, scenario: ProfileScenario, case_dir: Path,
            drive: Callable[[Callable[[], ProfileSession]], Any], *, out_dir: str | None = None,
            wait_timeout_s: float = 300.0, run_dir: Path | None = None, phase: str = "",
            **opts: Any) -> CaptureResult:
    """Profile one scenario end to end: ``drive(start)`` runs the case's workload and calls ``start()`` when
    the scenario's trigger holds (e.g. all streams decoding); then stop, wait for every rank's trace,
    collect into ``case_dir/profiles/<node>/`` and mark the case profiled. A drive that never calls
    ``start()`` is an error; if the drive fails after starting, the profiler is still stopped."""
    holder: list[ProfileSession] = []
    experts: list[Any] = []          # the engine's expert-distribution recording (MoE), when it has one

    def start() -> ProfileSession:
        if holder:
            raise CaptureError("start() called twice in one capture")
        experts.append(expert_record.begin(srv, list_trace_dir, run_dir, phase))
        holder.append(start_profile(srv, scenario, out_dir, run_dir=run_dir, phase=phase, **opts))
        return holder[0]

    try:
        result = drive(start)
    except BaseException:
        if holder:
            try:
                stop_profile(srv, holder[0], force=True, run_dir=run_dir, phase=phase)
            except CaptureError:
                pass
        if experts:            # the recorder is stopped too (its record says what it got); never masks the error
            expert_record.end(srv, experts[0], Path(case_dir), list_trace_dir, run_dir, phase)
        raise
    if not holder:
        raise CaptureError(f"scenario {scenario.name}: the drive function returned without calling start()")
    session = stop_profile(srv, holder[0], run_dir=run_dir, phase=phase)
    if session.auto_stop:
        # the engine stops by itself after num_steps steps — unless the workload ended first (one long prompt
        # alone runs a handful of steps, and an idle engine runs none): then it is stopped, which writes the trace
        wait = wait_for_traces(srv, session, timeout_s=min(wait_timeout_s, AUTO_STOP_GRACE_S))
        if not any(wait.ready.values()):
            session.notes.append(f"the workload ended before num_steps={scenario.num_steps} steps ran: /stop_profile "
                                 f"sent after {AUTO_STOP_GRACE_S:.0f} s so that the engine writes the steps it traced")
            session = stop_profile(srv, session, force=True, run_dir=run_dir, phase=phase)
            wait = wait_for_traces(srv, session, timeout_s=wait_timeout_s)
    else:
        wait = wait_for_traces(srv, session, timeout_s=wait_timeout_s)
    if experts:
        expert_record.end(srv, experts[0], Path(case_dir), list_trace_dir, run_dir, phase)
    files = collect_profiles(srv, session, Path(case_dir), wait)
    meta = mark_profiled(Path(case_dir), session, files, wait)
    write_json_atomic(Path(case_dir) / CASE_CLOCK_FILE, case_clock_record(run_dir, srv.target))
    if not any(f.kind == "worker" for f in files):
        raise CaptureError(f"scenario {scenario.name}: no worker trace appeared in {session.trace_dirs} within "
                           f"{wait_timeout_s:.0f} s (missing {wait.missing_ranks}, broken {wait.broken}); note that an engine "
                           f"writes no worker trace when fewer than skip_steps={scenario.skip_steps} steps ran "
                           f"after the start — keep the workload running through the whole window")
    return CaptureResult(session, wait, files, meta, result)
