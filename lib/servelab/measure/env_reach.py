"""Did an environment variable reach every rank? The check an environment-variable A/B passes before it compares.

A setting given to the engine's launcher can be lost on the way to the ranks (a container's ``-e NCCL_…`` that the
engine's worker spawn drops, ``docs/method.md#rank-env``); an A/B over such a variable compares two identical
configurations and proves nothing. :func:`env_reach` reads, on every node, the environment each engine process
started with (``/proc/<pid>/environ``, :func:`servelab.deploy.server.engine_processes`) and, where the engine's
log holds NCCL INFO lines (``<host>:<pid>:<tid> [<dev>] NCCL INFO NCCL_ALGO set by environment to Ring``), what
NCCL itself read, joined to the process by its pid. One row per rank × variable:

- ``reached`` — the rank's environment holds the value (and NCCL, where it logged the variable, read the same);
- ``MISSING`` — the variable is not in the rank's environment;
- ``DIFFERENT`` — it holds another value;
- ``NCCL read another value`` — the environment holds it but NCCL logged another.

A rank is a process the engine adapter names one (``EngineAdapter.rank_of_process``: SGLang's
``sglang::scheduler_TP1``), or — where no process names a rank (llama.cpp) — the node's engine process. The check
``ok`` only when every rank of every node reached every variable; otherwise :attr:`EnvReach.reason` names each
rank that did not, and the A/B that carries it (:mod:`servelab.measure.abtest`) is INVALID.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.run import write_json_atomic
from servelab.deploy.nccl_info import ENV_RE, PREFIX_RE
from servelab.deploy.server import engine_processes

REACHED, MISSING, DIFFERENT, NCCL_OTHER = "reached", "MISSING", "DIFFERENT", "NCCL read another value"
COLUMNS = ["node", "rank", "pid", "process", "variable", "expected", "seen", "nccl_says", "verdict"]
FILE = "env_reach.json"


@dataclass
class EnvReach:
    """The check's rows (:data:`COLUMNS`) and the notes of nodes that could not be read."""
    variables: dict[str, str]
    table: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.table.empty and bool((self.table["verdict"] == REACHED).all()) and not self.notes

    @property
    def failed_ranks(self) -> list[str]:
        bad = self.table[self.table["verdict"] != REACHED]
        return list(dict.fromkeys(f"{r.node}/{r.rank}" for r in bad.itertuples()))

    @property
    def reason(self) -> str:
        """One line: empty when ok, else which variable missed which rank (and why)."""
        if self.ok:
            return ""
        if self.table.empty:
            return "; ".join(self.notes) or "no engine process could be read"
        bad = self.table[self.table["verdict"] != REACHED]
        parts = [f"{r.variable}={r.expected} {r.verdict.lower() if r.verdict != NCCL_OTHER else r.verdict} on "
                 f"{r.node}/{r.rank} (pid {r.pid}{'' if r.seen == '-' else f', saw {r.seen}'}"
                 f"{'' if r.nccl_says == '-' else f', NCCL says {r.nccl_says}'})" for r in bad.itertuples()]
        return "; ".join(parts + self.notes)

    def to_json(self) -> dict[str, Any]:
        return {"variables": self.variables, "ok": self.ok, "reason": self.reason, "notes": self.notes,
                "rows": self.table.to_dict("records")}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EnvReach":
        return cls(dict(d.get("variables") or {}), pd.DataFrame(d.get("rows") or [], columns=COLUMNS),
                   list(d.get("notes") or []))


def nccl_env_lines(text: str) -> dict[tuple[int, str], str]:
    """``{(pid, variable): value}`` from NCCL INFO ``<VAR> set by environment to <value>`` lines."""
    out: dict[tuple[int, str], str] = {}
    for line in text.splitlines():
        m = PREFIX_RE.search(line)
        if m is None or m["level"] != "INFO":
            continue
        e = ENV_RE.match(m["msg"].strip())
        if e is not None:
            out[(int(m["pid"]), e["key"])] = e["val"].strip().rstrip(".")
    return out


def reach_table(processes: list[dict[str, Any]], variables: dict[str, str], nccl_text: str = "",
                notes: list[str] | None = None) -> EnvReach:
    """The check over processes as :func:`servelab.deploy.server.engine_processes` returns them (each with
    ``node, pid, process, rank, env``); only ranks count, and only the checked variables are kept."""
    said = nccl_env_lines(nccl_text)
    rows = []
    for p in processes:
        if not p.get("rank"):
            continue
        for var, want in variables.items():
            got = (p.get("env") or {}).get(var)
            nccl = said.get((int(p["pid"]), var))
            verdict = (MISSING if got is None else DIFFERENT if got != str(want) else
                       NCCL_OTHER if nccl is not None and nccl != str(want) else REACHED)
            rows.append({"node": p["node"], "rank": p["rank"], "pid": int(p["pid"]), "process": p.get("process", ""),
                         "variable": var, "expected": str(want), "seen": "-" if got is None else got,
                         "nccl_says": "-" if nccl is None else nccl, "verdict": verdict})
    notes = list(notes or [])
    if processes and not rows:
        notes.append("no engine process was identified as a rank")
    return EnvReach({k: str(v) for k, v in variables.items()}, pd.DataFrame(rows, columns=COLUMNS), notes)


def env_reach(srv: Any, variables: dict[str, str]) -> EnvReach:
    """Check a running engine: every rank's ``/proc/<pid>/environ`` on every node, and the NCCL INFO lines of the
    engine logs this machine holds."""
    procs, notes = engine_processes(srv)
    text = ""
    for path in (getattr(srv, "log_paths", {}) or {}).values():
        if path and Path(path).is_file():
            text += Path(path).read_text(errors="replace")
    return reach_table(procs, variables, text, notes)


def write_reach(folder: Path, reach: EnvReach) -> Path:
    path = Path(folder) / FILE
    write_json_atomic(path, reach.to_json())
    return path


def read_reach(folder: Path) -> EnvReach | None:
    """The check a run-like record holds, or ``None`` where none was made (the variable is no environment variable)."""
    p = Path(folder) / FILE
    return EnvReach.from_json(json.loads(p.read_text())) if p.is_file() else None
