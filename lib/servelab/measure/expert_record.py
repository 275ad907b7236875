"""The engine's expert-distribution recorder around a Phase 3 capture (MoE models): started just before the
profiler, stopped and dumped just after the profiler's window, the dump files collected into
``cases/<case>/expert-distribution/<node>/`` beside a record of what was done (``expert_record.json``).

Only when the engine has a recorder (``EngineAdapter.expert_record_paths``: SGLang) and the target started it
(``launch.expert_distribution_recorder_mode``); otherwise nothing is sent and the capture is unchanged. Each POST is
recorded as an executed command. The window is the profiler's, give or take the HTTP round trips: the recorder has
no step count of its own, so it counts the forward passes from its start to its stop (the record says how many).
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from servelab.core.run import CommandRecord, now_iso, record_command, write_json_atomic
from servelab.deploy.server import http_json

RECORD_FILE = "expert_record.json"
FOLDER = "expert-distribution"


@dataclass
class ExpertRecording:
    """One recording: the engine-side folder, the files there before it, what each request answered."""
    mode: str
    engine_dir: str
    before: dict[str, set[str]]
    started: str = ""
    stopped: str = ""
    status: dict[str, int] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""


def _post(srv: Any, path: str, title: str, run_dir: Path | None, phase: str) -> int:
    url = srv.base_url + path
    start = now_iso()
    status, resp = http_json(url, body=None, method="POST", timeout=120, headers=getattr(srv, "auth_headers", None))
    if run_dir is not None:
        record_command(run_dir, CommandRecord(
            label="executed", argv=["curl", "-sS", "-X", "POST", url], phase=phase, title=title, host="local",
            start=start, end=now_iso(), exit_code=0 if status == 200 else 1,
            note=f"sent by servelab.measure.expert_record (urllib), curl equivalent; HTTP {status}"
                 + ("" if status == 200 else f": {str(resp)[:200]}")))
    return status


Lister = Callable[[Any, str], dict[str, Any]]     # (host, folder) → {file name: listing}: capture.list_trace_dir


def _listing(srv: Any, folder: str, lister: Lister) -> dict[str, set[str]]:
    return {node: set(lister(srv.hosts[node], folder)) for node in srv.hosts}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def begin(srv: Any, lister: Lister, run_dir: Path | None = None, phase: str = "") -> ExpertRecording | None:
    """Start the recorder (None when the engine or the target has none). A failed start is kept in the recording's
    ``error`` — the capture goes on without counts — never raised. ``lister`` lists a folder on a node."""
    eng, la = srv.engine, srv.target.launch
    paths = getattr(eng, "expert_record_paths", None)
    mode = la.get(getattr(eng, "expert_record_mode_key", ""), None)
    if not paths or not mode:
        return None
    rec = ExpertRecording(str(mode), eng.expert_record_dir(la) or "/tmp", {})
    try:
        rec.before = _listing(srv, rec.engine_dir, lister)
        rec.started = now_iso()
        rec.status["start"] = _post(srv, paths["start"], "start the expert-distribution recorder", run_dir, phase)
        if rec.status["start"] != 200:
            rec.error = f"POST {paths['start']} answered HTTP {rec.status['start']}"
    except (OSError, RuntimeError, ValueError) as e:
        rec.error = f"starting the expert-distribution recorder failed: {e}"
    return rec


def end(srv: Any, rec: ExpertRecording | None, case_dir: Path, lister: Lister, run_dir: Path | None = None,
        phase: str = "") -> dict[str, Any] | None:
    """Stop and dump the recorder, collect the new dump files into ``case_dir/expert-distribution/<node>/`` and
    write ``expert_record.json`` there (the record, also returned)."""
    if rec is None:
        return None
    eng = srv.engine
    paths = eng.expert_record_paths
    pattern = re.compile(eng.expert_dump_file)
    dest_root = Path(case_dir) / FOLDER
    if not rec.error:
        try:
            rec.status["stop"] = _post(srv, paths["stop"], "stop the expert-distribution recorder", run_dir, phase)
            rec.stopped = now_iso()
            rec.status["dump"] = _post(srv, paths["dump"], "dump the expert-distribution record", run_dir, phase)
            if rec.status["dump"] != 200:
                rec.error = f"POST {paths['dump']} answered HTTP {rec.status['dump']}"
            else:
                _collect(srv, rec, pattern, dest_root, Path(case_dir), lister)
        except (OSError, RuntimeError, ValueError) as e:
            rec.error = f"stopping/dumping the expert-distribution recorder failed: {e}"
    out = {**asdict(rec), "before": {k: sorted(v) for k, v in rec.before.items()},
           "endpoints": paths, "engine_dir_env": eng.expert_record_dir_env}
    dest_root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(dest_root / RECORD_FILE, out)
    return out


def _collect(srv: Any, rec: ExpertRecording, pattern: re.Pattern, dest_root: Path, case_dir: Path,
             lister: Lister) -> None:
    for node, host in srv.hosts.items():
        new = [f for n, f in lister(host, rec.engine_dir).items()
               if pattern.match(n) and n not in rec.before.get(node, set())]
        dest_dir = dest_root / node
        for f in new:
            dest_dir.mkdir(parents=True, exist_ok=True)
            src = f"{rec.engine_dir.rstrip('/')}/{f.name}"
            dest = dest_dir / f.name
            if getattr(host, "kind", "local") == "local":
                shutil.copyfile(src, dest)
            else:
                host.get(src, dest)
            rec.files.append({"node": node, "source": src, "file": str(dest.relative_to(case_dir)),
                              "size_bytes": dest.stat().st_size, "sha256": _sha256(dest)})
    if not rec.files:
        rec.error = (f"the dump wrote no new expert_distribution_recorder_*.pt into {rec.engine_dir} on any node "
                     f"(before: {json.dumps({k: len(v) for k, v in rec.before.items()})} files)")
