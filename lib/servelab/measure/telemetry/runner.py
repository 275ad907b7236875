"""Start a case's collectors on every node, stop them after, and fail closed when a required one breaks.

Raw output lands in ``<case_dir>/telemetry/<node>/<raw_name>``, next to one
``<collector>.status.json`` per collector and a ``clock.json`` per node (the node clock's offset from
this machine's, measured around a ``date +%s%N`` call, so samples can be put on the client's clock).

The host objects are duck-typed (the interface of ``servelab.deploy.hosts``)::

    host.name
    host.run(argv, env=None, cwd=None, timeout=None) -> Result(exit_code, stdout, stderr)
    host.start(argv, log_path, env=None, cwd=None) -> Handle      # background, own process group
    host.stop(handle)                                              # may return the exit code
    host.is_running(handle) -> bool
    host.read_file(path) -> bytes

A collector is ``ok`` when it started, was still running when the case ended and wrote output.
Otherwise its status says why: ``not present`` (a binary is missing), ``probe failed``, ``failed to
start``, ``early exit``, ``no output``. A required collector in any of those states fails the case
with ``RequiredCollectorError`` (at start: before the case begins; at stop: the case is invalid).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from servelab.core.run import redact, write_json_atomic
from servelab.measure.telemetry.collectors import CollectorSpec

OK = "ok"
NOT_PRESENT = "not present"
NOT_CONFIGURED = "not configured"
PROBE_FAILED = "probe failed"
FAILED_TO_START = "failed to start"
EARLY_EXIT = "early exit"
NO_OUTPUT = "no output"


class Host(Protocol):  # pragma: no cover - documentation of the duck type
    name: str

    def run(self, argv: list[str], env: dict | None = None, cwd: str | None = None,
            timeout: float | None = None) -> Any: ...

    def start(self, argv: list[str], log_path: str, env: dict | None = None, cwd: str | None = None) -> Any: ...

    def stop(self, handle: Any) -> Any: ...

    def is_running(self, handle: Any) -> bool: ...

    def read_file(self, path: str) -> bytes: ...


class RequiredCollectorError(RuntimeError):
    """A required collector is missing or died: the case must not start / is invalid."""

    def __init__(self, message: str, statuses: list["CollectorStatus"]):
        super().__init__(message)
        self.statuses = statuses


@dataclass
class CollectorStatus:
    """What happened to one collector on one node during one case."""
    node: str
    collector: str
    required: bool
    status: str
    reason: str = ""
    parser: str = ""
    raw_file: str = ""               # relative to <case_dir>/telemetry/
    argv_display: str = ""
    env: dict[str, str] = field(default_factory=dict)
    started: bool = False
    start_ns: int | None = None
    stop_ns: int | None = None
    exit_code: int | None = None
    early_exit: bool = False
    missing_binary: str | None = None
    running_at_stop: bool | None = None
    raw_bytes: int = 0
    interval_s: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def failed_required(self) -> bool:
        return self.required and self.status != OK


@dataclass
class NodePlan:
    """The collectors of one node for one case; ``remote_dir`` is where they write on that node
    (default: the local telemetry folder for a local host; on a remote one a private folder made for this
    case — ``host.private_dir(workdir)``, mode 0700 under the node's workdir or ``$TMPDIR`` — copied back with
    ``host.read_file`` and removed when the case stops)."""
    host: Any
    specs: list[CollectorSpec]
    node: str = ""
    remote_dir: str | None = None
    workdir: str = ""                # where a remote node's private folder goes ("" = its $TMPDIR)

    def __post_init__(self) -> None:
        self.node = self.node or getattr(self.host, "name", "local")


@dataclass
class _Running:
    plan: NodePlan
    spec: CollectorSpec
    status: CollectorStatus
    handle: Any = None
    remote_path: str = ""
    local_path: Path = Path()


@dataclass
class TelemetryResult:
    """The statuses of every collector of a case, and whether the case may be used."""
    statuses: list[CollectorStatus]
    telemetry_dir: Path

    @property
    def ok(self) -> bool:
        return not any(s.failed_required for s in self.statuses)

    @property
    def failures(self) -> list[str]:
        return [f"{s.node}/{s.collector}: {s.status} — {s.reason}" for s in self.statuses if s.failed_required]


def telemetry_dir(case_dir: Path) -> Path:
    return Path(case_dir) / "telemetry"


def _exit_code(result: Any) -> int:
    for attr in ("exit_code", "returncode", "rc"):
        if hasattr(result, attr):
            return int(getattr(result, attr))
    if isinstance(result, tuple):
        return int(result[0])
    return int(result)


def _text(b: Any) -> str:
    if b is None:
        return ""
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b)


def _tail(text: str, n: int = 300) -> str:
    text = " ".join(text.strip().split())
    return text[-n:]


def measure_clock_offset(host: Any) -> dict[str, Any]:
    """Node clock minus this machine's clock, in ns, from one ``date +%s%N`` round trip."""
    t0 = time.time_ns()
    try:
        res = host.run(["date", "+%s%N"], timeout=15)
    except Exception as exc:  # noqa: BLE001 - any host failure means: offset unknown
        return {"offset_ns": 0, "rtt_ns": None, "measured": False, "reason": f"date failed: {exc}"}
    t1 = time.time_ns()
    out = _text(getattr(res, "stdout", "")).strip()
    if _exit_code(res) != 0 or not out.isdigit():
        return {"offset_ns": 0, "rtt_ns": t1 - t0, "measured": False, "reason": f"date printed {out[:40]!r}"}
    return {"offset_ns": int(out) - (t0 + t1) // 2, "rtt_ns": t1 - t0, "measured": True, "reason": ""}


def _which(host: Any, binary: str, cache: dict[str, bool]) -> bool:
    if binary not in cache:
        # fixed script, the binary is a positional parameter: no shell string is ever built from data
        res = host.run(["sh", "-c", 'command -v -- "$1" >/dev/null', "sh", binary], timeout=15)
        cache[binary] = _exit_code(res) == 0
    return cache[binary]


def _write_status(tdir: Path, st: CollectorStatus) -> None:
    write_json_atomic(tdir / st.node / f"{st.collector}.status.json", redact(asdict(st)))


@dataclass
class TelemetrySession:
    """Collectors running for one case. ``check()`` during the case, ``stop()`` after it."""
    case_dir: Path
    running: list[_Running]
    skipped: list[CollectorStatus]
    private_dirs: list[tuple[Any, str]] = field(default_factory=list)   # (host, folder): removed at stop

    @property
    def telemetry_dir(self) -> Path:
        return telemetry_dir(self.case_dir)

    def check(self) -> list[CollectorStatus]:
        """Required collectors that are no longer running (the caller should abort the case)."""
        dead = []
        for r in self.running:
            if r.spec.required and r.handle is not None and not r.plan.host.is_running(r.handle):
                dead.append(r.status)
        return dead

    def stop(self, raise_on_failure: bool = False) -> TelemetryResult:
        """Stop every collector, copy raw files back, write the statuses; fail closed on request."""
        tdir = self.telemetry_dir
        for r in self.running:
            st = r.status
            host = r.plan.host
            try:
                st.running_at_stop = bool(host.is_running(r.handle))
            except Exception:  # noqa: BLE001
                st.running_at_stop = False
            try:
                ret = host.stop(r.handle)
            except Exception as exc:  # noqa: BLE001
                ret = None
                st.reason = f"stop failed: {exc}"
            st.stop_ns = time.time_ns()
            code = ret if isinstance(ret, int) else getattr(r.handle, "exit_code", None)
            if code is None:
                code = getattr(r.handle, "returncode", None)
            st.exit_code = code
            data = b""
            try:
                if str(r.local_path) != r.remote_path:
                    data = host.read_file(r.remote_path)
                    r.local_path.write_bytes(data)
                else:
                    data = r.local_path.read_bytes() if r.local_path.exists() else b""
            except Exception as exc:  # noqa: BLE001
                st.reason = (st.reason + "; " if st.reason else "") + f"raw file not readable: {exc}"
            st.raw_bytes = len(data)
            if not st.running_at_stop:
                st.early_exit = True
                st.status = EARLY_EXIT
                st.reason = (f"exited before the case ended (exit code {st.exit_code}); "
                             f"last output: {_tail(_text(data[-2000:]))!r}")
            elif not data.strip():
                st.status = NO_OUTPUT
                st.reason = "running until the end but wrote nothing"
            else:
                st.status = OK
            _write_status(tdir, st)
        for host, folder in self.private_dirs:      # the raw files are copied back: the node keeps nothing
            try:
                host.remove_private_dir(folder)
            except Exception:  # noqa: BLE001 - a node gone at the end keeps its folder; never hides the results
                pass
        self.private_dirs = []
        statuses = self.skipped + [r.status for r in self.running]
        result = TelemetryResult(statuses, tdir)
        if raise_on_failure and not result.ok:
            raise RequiredCollectorError("required telemetry failed: " + "; ".join(result.failures), statuses)
        return result


def start_telemetry(case_dir: Path, plans: list[NodePlan], grace_s: float = 1.0) -> TelemetrySession:
    """Check, probe and start every collector of every node for a case (fail-closed).

    Raises ``RequiredCollectorError`` — after stopping what had started and writing every status —
    when a required collector is missing, fails its probe, cannot start or dies within ``grace_s``.
    Whatever else breaks while starting (a node gone, Ctrl-C, SIGTERM) also stops the collectors already
    started and removes the nodes' private folders before it propagates.
    """
    tdir = telemetry_dir(case_dir)
    session = TelemetrySession(Path(case_dir), [], [])
    try:
        _start_all(session, plans, tdir)
        if session.running and grace_s > 0:
            time.sleep(grace_s)
    except BaseException:
        session.stop()
        raise
    running, skipped = session.running, session.skipped
    dead = [r for r in running if not r.plan.host.is_running(r.handle)]
    failed_now = [s for s in skipped if s.required] + [r.status for r in dead if r.spec.required]
    for s in skipped:
        _write_status(tdir, s)
    if failed_now:
        result = session.stop()
        reasons = "; ".join(f"{s.node}/{s.collector}: {s.status} — {s.reason}"
                            for s in result.statuses if s.failed_required)
        raise RequiredCollectorError(f"required telemetry could not start, the case does not begin: {reasons}",
                                     result.statuses)
    return session


def _start(host: Any, spec: CollectorSpec, path: str) -> Any:
    """``host.start`` naming what it starts (for the node's pid record), where the host takes that name."""
    try:
        return host.start(spec.argv, path, env=spec.env or None, what=f"collector {spec.name}")
    except TypeError as exc:
        if "what" not in str(exc):
            raise
        return host.start(spec.argv, path, env=spec.env or None)


def _start_all(session: TelemetrySession, plans: list[NodePlan], tdir: Path) -> None:
    """Probe and start every collector of every node into ``session``; a required collector that cannot start
    ends the loop (the caller stops what started: collectors 0..k-1)."""
    running, skipped = session.running, session.skipped
    for plan in plans:
        ndir = tdir / plan.node
        ndir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(ndir / "clock.json", measure_clock_offset(plan.host))
        remote_dir = plan.remote_dir
        if remote_dir is None and getattr(plan.host, "kind", "local") != "local":
            remote_dir = plan.host.private_dir(plan.workdir)     # mode 0700, a fresh name per case
            session.private_dirs.append((plan.host, remote_dir))
        elif remote_dir:
            plan.host.run(["mkdir", "-p", "--", remote_dir], timeout=30)
        remote_dir = remote_dir or str(ndir)
        cache: dict[str, bool] = {}
        for spec in plan.specs:
            st = CollectorStatus(node=plan.node, collector=spec.name, required=spec.required, status="",
                                 parser=spec.parser, raw_file=f"{plan.node}/{spec.raw_name}",
                                 argv_display=spec.display(), env=dict(spec.env), interval_s=spec.interval_s,
                                 options=dict(spec.options))
            missing = [b for b in spec.requires if not _which(plan.host, b, cache)]
            if missing:
                st.status, st.missing_binary = NOT_PRESENT, missing[0]
                st.reason = f"binary '{missing[0]}' not found on {plan.node}"
                skipped.append(st)
                continue
            absent = next((pr for pr in spec.presence
                           if _exit_code(plan.host.run(pr, env=spec.env or None, timeout=30)) != 0), None)
            if absent:
                st.status = NOT_PRESENT
                st.reason = f"`{' '.join(absent)}` failed on {plan.node}: the hardware or driver is not there"
                skipped.append(st)
                continue
            failed_probe = None
            for probe in spec.probes:
                res = plan.host.run(probe, env=spec.env or None, timeout=30)
                if _exit_code(res) != 0:
                    failed_probe = (probe, res)
                    break
            if failed_probe:
                probe, res = failed_probe
                st.status = PROBE_FAILED
                st.reason = (f"probe `{' '.join(probe)}` exited {_exit_code(res)}: "
                             f"{_tail(_text(getattr(res, 'stderr', '')) or _text(getattr(res, 'stdout', '')))}")
                skipped.append(st)
                continue
            remote_path = f"{remote_dir.rstrip('/')}/{spec.raw_name}"
            local_path = ndir / spec.raw_name
            if local_path.exists():        # a re-run case starts from an empty raw file (hosts append)
                local_path.unlink()
            try:
                st.start_ns = time.time_ns()
                handle = _start(plan.host, spec, remote_path)
            except Exception as exc:  # noqa: BLE001
                st.status, st.reason = FAILED_TO_START, f"{type(exc).__name__}: {exc}"
                skipped.append(st)
                if spec.required:
                    return
                continue
            st.started = True
            running.append(_Running(plan, spec, st, handle, remote_path, local_path))


def read_statuses(case_dir: Path) -> list[CollectorStatus]:
    """Every ``*.status.json`` of a case, in node and collector order."""
    out = []
    for p in sorted(telemetry_dir(case_dir).glob("*/*.status.json")):
        raw = json.loads(p.read_text())
        out.append(CollectorStatus(**{k: v for k, v in raw.items() if k in CollectorStatus.__dataclass_fields__}))
    return out


def read_clock(case_dir: Path, node: str) -> dict[str, Any]:
    p = telemetry_dir(case_dir) / node / "clock.json"
    return json.loads(p.read_text()) if p.exists() else {"offset_ns": 0, "measured": False}
