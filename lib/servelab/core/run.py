"""Runs: ids, the run directory contract, ``manifest.json`` and ``commands.jsonl``.

A run is one investigation (``outputs/<run_id>/``); each phase executed with the same id adds its
folder. Every command is recorded with one of three labels (``docs/method.md#commands``):

- ``executed``  ran in this run (host, cwd, argv, env diff, start/end, exit code, log path);
- ``reproduce`` an equivalent command a reader can re-run;
- ``planned``   not executed; rendered as such and never evidence.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servelab import __version__
from servelab.core.params import ParamError
from servelab.core.paths import outputs_root, project_root
# one redaction routine for every writer lives in servelab.core.redact; its names stay importable from here
from servelab.core.redact import (REDACTED, SECRET_NAME_RE, SECRET_VALUE_RES, is_secret_name,  # noqa: F401
                                  known_secrets, redact, redact_argv, redact_env, redact_html, redact_text)

SCHEMA_VERSION = 1
LABELS = ("executed", "reproduce", "planned")
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# ---------------------------------------------------------------- ids and directories

def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="milliseconds")


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
    """Write ``obj`` as JSON (replace atomically), secrets redacted (:func:`servelab.core.redact.redact`: values
    under secret names, secret argv, ``known`` values — default the process environment's — and secret shapes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(redact(obj, known), indent=2, default=str, ensure_ascii=False))
    os.replace(tmp, path)


def init_run(run_id: str, target_name: str) -> Path:
    """Create (or reopen) a run directory and its manifest header."""
    rdir = run_dir(run_id)
    rdir.mkdir(parents=True, exist_ok=True)
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
    return rdir


def update_manifest(rdir: Path, **sections: Any) -> dict[str, Any]:
    """Merge top-level sections into the manifest (dicts merge one level deep); secrets redacted."""
    m = read_manifest(rdir)
    for key, value in sections.items():
        value = redact(value)
        if isinstance(value, dict) and isinstance(m.get(key), dict):
            m[key].update(value)
        elif isinstance(value, list) and isinstance(m.get(key), list):
            m[key].extend(v for v in value if v not in m[key])
        else:
            m[key] = value
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
