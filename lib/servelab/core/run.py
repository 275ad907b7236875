"""Runs: ids, the run directory contract, ``manifest.json`` and ``commands.jsonl``.

A run is one investigation (``outputs/<run_id>/``); each phase executed with the same id adds its
folder. Every command is recorded with one of three labels (``docs/method.md#commands``):

- ``executed``  ran in this run (host, cwd, argv, env diff, start/end, exit code, log path);
- ``reproduce`` an equivalent command a reader can re-run;
- ``planned``   not executed; rendered as such and never evidence.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from servelab import __version__
from servelab.core.params import ParamError
from servelab.core.paths import outputs_root, project_root
# one redaction routine for every writer lives in servelab.core.redact; its names stay importable from here
from servelab.core.redact import (REDACTED, SECRET_NAME_RE, SECRET_VALUE_RES, is_secret_name,  # noqa: F401
                                  known_secrets, redact, redact_argv, redact_env, redact_html, redact_text)

SCHEMA_VERSION = 1
LABELS = ("executed", "reproduce", "planned")
# values a planned command cannot know: written as these names in the command, each explained on a separate "fill in"
# line under it (report.commands) — never a <placeholder> inside the command
FILL_IN = {"ENV_FILE": "a file of the target's env, mode 0600, outside outputs/ (servelab writes one per start)",
           "ENGINE_COMMAND": "the engine's launch command (Phase 0's manifest and commands.jsonl record it)",
           "REPRO_COMMAND": "a one-batch reproduction on the engine, model and GPU the kernels were recorded on "
                            "(Phase 6's repro parameter fills it in)"}
MANIFEST_LOCK = ".manifest.lock"     # flock'ed around every manifest update
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# ---------------------------------------------------------------- ids and directories

def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="milliseconds")


UNSUPPORTED = "unsupported"      # a phase's status when its target cannot do what it measures (said why, one line)


class PhaseUnsupported(RuntimeError):
    """Raised by a phase before it starts anything when its target cannot do what the phase measures (e.g.
    speculative decoding on an engine build without it); the message says why in one line. ``servelab run`` and
    ``servelab demo`` record the phase as ``unsupported`` with that line (not as a failure)."""


def new_run_id(name: str = "run") -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"
    return f"{safe}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def validate_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise ParamError(f"invalid run id '{run_id}': use letters, digits, '.', '_' and '-' (max 128)")
    return run_id


def run_dir(run_id: str) -> Path:
    return outputs_root() / validate_run_id(run_id)


def git_state(root: Path | None = None) -> dict[str, Any]:
    root = root or project_root()
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return {"commit": commit or None, "dirty": dirty if commit else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


# ---------------------------------------------------------------- manifest

def manifest_path(rdir: Path) -> Path:
    return rdir / "manifest.json"


def read_manifest(rdir: Path) -> dict[str, Any]:
    p = manifest_path(rdir)
    return json.loads(p.read_text()) if p.exists() else {}


def write_json_atomic(path: Path, obj: Any, known: Any = None) -> None:
    """``obj`` as JSON at ``path``, secrets redacted (:func:`servelab.core.redact.redact`: values under secret
    names, secret argv, ``known`` values — default the process environment's — and secret shapes), all or
    nothing: written to a temp file of its own (unique name in the same folder, so concurrent writers never share
    one), fsynced, then ``os.replace``d over ``path``; the folder is fsynced too so the rename itself survives a
    crash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(redact(obj, known), indent=2, default=str, ensure_ascii=False)
    tmp = unique_temp(path)
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def unique_temp(path: Path) -> Path:
    """A temp file name beside ``path`` that no other writer uses (process, thread, random part); created with
    the usual permissions (``open(..., "x")``), unlike ``mkstemp``'s 0600."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive ``fcntl.flock`` on ``lock_path`` (created if missing) for one read-modify-write."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def manifest_lock(rdir: Path) -> contextlib.AbstractContextManager[None]:
    """:func:`file_lock` on ``<run>/.manifest.lock``, held around every read-modify-write of ``manifest.json``
    (phases, the CLI and a re-run may update the same run's manifest at the same time)."""
    return file_lock(Path(rdir) / MANIFEST_LOCK)


def merge_table(path: Path, frame: Any, keys: list[str]) -> Any:
    """Write ``frame`` into the CSV table at ``path`` merged by ``keys``: a row of ``frame`` replaces the row with
    the same keys, every other row already there is kept (a later invocation that ran only some cases does not
    drop the others). Locked and atomic; returns the merged frame."""
    import pandas as pd
    path = Path(path)
    with file_lock(path.with_name(f".{path.name}.lock")):
        old = None
        if path.is_file() and path.stat().st_size:
            try:
                old = pd.read_csv(path, dtype={k: str for k in keys}, keep_default_na=False, na_values=[""])
            except (ValueError, pd.errors.ParserError):
                old = None                                    # unreadable: replaced by what was measured now
        new = frame.copy()
        for k in keys:
            if k in new.columns:
                new[k] = new[k].astype(str)
        if old is not None and all(k in old.columns for k in keys) and not old.empty:
            have = set(map(tuple, new[keys].itertuples(index=False, name=None))) if not new.empty else set()
            kept = old[[tuple(r) not in have for r in old[keys].itertuples(index=False, name=None)]]
            merged = pd.concat([kept, new], ignore_index=True) if not new.empty else kept
            merged = merged[list(dict.fromkeys([*old.columns, *new.columns]))]
        else:
            merged = new
        tmp = unique_temp(path)
        try:
            with open(tmp, "x", encoding="utf-8", newline="") as f:
                merged.to_csv(f, index=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return merged


def init_run(run_id: str, target_name: str) -> Path:
    """Create (or reopen) a run directory and its manifest header."""
    rdir = run_dir(run_id)
    rdir.mkdir(parents=True, exist_ok=True)
    with manifest_lock(rdir):
        _init_manifest(rdir, run_id, target_name)
    return rdir


def _init_manifest(rdir: Path, run_id: str, target_name: str) -> None:
    m = read_manifest(rdir)
    if not m:
        m = {
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "tool": {"name": "servelab", "version": __version__, **git_state()},
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "created": now_iso(),
            "target": target_name,
            "phases": {},
            "hosts": {},
            "security": [],
        }
        write_json_atomic(manifest_path(rdir), m)


def update_manifest(rdir: Path, **sections: Any) -> dict[str, Any]:
    """Merge top-level sections into the manifest (dicts merge one level deep); secrets redacted. The
    read-modify-write holds :func:`manifest_lock`, so concurrent updates never lose one another's keys."""
    sections = {k: redact(v) for k, v in sections.items()}
    with manifest_lock(rdir):
        m = read_manifest(rdir)
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(m.get(key), dict):
                m[key].update(value)
            elif isinstance(value, list) and isinstance(m.get(key), list):
                m[key].extend(v for v in value if v not in m[key])
            else:
                m[key] = value
        m["updated"] = now_iso()
        write_json_atomic(manifest_path(rdir), m)
    return m


def edit_manifest(rdir: Path, edit: Any) -> dict[str, Any]:
    """``edit(manifest)`` (changes it in place) applied under :func:`manifest_lock` and written atomically: for
    an update that depends on what the manifest holds now (a phase entry amended rather than replaced)."""
    with manifest_lock(rdir):
        m = read_manifest(rdir)
        edit(m)
        m = redact(m)
        m["updated"] = now_iso()
        write_json_atomic(manifest_path(rdir), m)
    return m


# ---------------------------------------------------------------- commands

@dataclass
class CommandRecord:
    """One command of a phase, with its label (executed / reproduce / planned)."""
    label: str
    argv: list[str]
    phase: str = ""
    title: str = ""
    host: str = "local"
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)   # only what differs from the inherited environment
    start: str | None = None
    end: str | None = None
    exit_code: int | None = None
    log: str | None = None
    note: str = ""

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        return f"{env} {cmd}".strip()


def record_command(rdir: Path, rec: CommandRecord, unique: bool = False) -> CommandRecord:
    """Append a command to ``commands.jsonl`` (secrets redacted); long ones also go to ``*_cmd.txt``.

    ``unique``: not appended again when the same label, phase and argv are already recorded (a ``reproduce``
    line written each time a phase runs into the same run)."""
    if rec.label not in LABELS:
        raise ValueError(f"command label must be one of {LABELS}, not '{rec.label}'")
    known = known_secrets(rec.env, argv=rec.argv)
    rec.argv = redact_argv([str(a) for a in rec.argv], known)
    rec.env = redact_env(rec.env, known)
    rec.title, rec.cwd, rec.note = (redact_text(x, known) for x in (rec.title, rec.cwd, rec.note))
    rec.log = redact_text(rec.log, known) if rec.log else rec.log
    if unique and any(r.label == rec.label and r.argv == rec.argv for r in read_commands(rdir, rec.phase)):
        return rec
    rdir.mkdir(parents=True, exist_ok=True)
    with open(rdir / "commands.jsonl", "a") as f:
        f.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
    text = rec.shell()
    if len(text) > 160 and rec.title:
        slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{rec.phase}_{rec.label}_{rec.title}").strip("_").lower()
        (rdir / "commands").mkdir(exist_ok=True)
        (rdir / "commands" / f"{slug}_cmd.txt").write_text(text + "\n")
    return rec


def read_commands(rdir: Path, phase: str | None = None) -> list[CommandRecord]:
    p = rdir / "commands.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        if line.strip():
            rec = CommandRecord(**json.loads(line))
            if phase is None or rec.phase == phase:
                out.append(rec)
    return out


# ---------------------------------------------------------------- progress

PROGRESS_FILE = "progress.jsonl"


def progress_path(rdir: Path, phase: str) -> Path:
    """``<run>/<phase>/progress.jsonl``: the progress events of a phase, one JSON object a line."""
    return Path(rdir) / phase / PROGRESS_FILE


def emit_progress(rdir: Path, phase: str, message: str, **fields: Any) -> None:
    """Append one progress event ``{"t", "phase", "message", ...fields}`` to :func:`progress_path`.

    Library code never prints: a long step says where it is here, and ``servelab run`` / ``servelab demo`` print
    each event as one line while the phase runs. Progress is a courtesy, never a result: a write that fails is
    ignored."""
    try:
        path = progress_path(rdir, phase)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"t": now_iso(), "phase": phase, "message": message, **fields}, default=str,
                               ensure_ascii=False) + "\n")
    except OSError:
        pass


def human_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``: a duration for a progress line."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def failure_reason(exc: BaseException) -> str:
    """One line saying why a phase failed: the notebook's own exception (type and message), not papermill's
    banner. Papermill's error carries the kernel's ``ename``/``evalue``."""
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        text = f"{ename}: {evalue}" if evalue else str(ename)
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc).strip() else type(exc).__name__
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return first[:500]
