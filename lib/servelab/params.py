"""Parameters: targets (where to run) and phase parameters (what to run), validated before anything starts.

A phase's parameters are the typed literals of its notebook's ``parameters`` cell (papermill's own
contract), layered as: notebook defaults < ``params/<phase>.yaml`` < ``-p key=value`` overrides.
A target is a YAML file under ``params/targets/``. Unknown keys are errors that name the closest key.
"""
from __future__ import annotations

import ast
import difflib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from servelab.paths import project_root


class ParamError(ValueError):
    """A parameter or target file is invalid; raised before any side effect."""


def did_you_mean(name: str, known: list[str] | set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def reject_unknown(given: dict, known: set[str], where: str) -> None:
    for key in given:
        if key not in known:
            raise ParamError(f"unknown key '{key}' in {where}{did_you_mean(key, known)}; "
                             f"known keys: {', '.join(sorted(known))}")


# ---------------------------------------------------------------- targets

@dataclass
class Node:
    """One machine of a target. ``kind`` is ``local`` or ``ssh``."""
    name: str
    kind: str = "local"
    role: str = "head"               # head | worker
    host: str = "127.0.0.1"
    port: int = 22
    user: str = ""
    key_file: str = ""
    known_hosts: str = ""            # default: ~/.ssh/known_hosts
    accept_new_host_key: bool = False  # explicit opt-in; recorded in the manifest
    gpus: int = 0
    netdevs: list[str] = field(default_factory=list)
    hcas: list[str] = field(default_factory=list)
    workdir: str = ""


@dataclass
class Target:
    """Where a phase runs: the engine, its model, its launch settings and its nodes."""
    name: str
    engine: str                       # llamacpp | sglang | vllm
    model: str                        # model key (gemma3-270m, tiny) or a path on the nodes
    description: str = ""
    served_model_name: str = ""
    api_host: str = "127.0.0.1"       # address the client uses to reach the head node's server
    port: int = 0                     # 0 = pick a free port (local targets)
    launch: dict[str, Any] = field(default_factory=dict)   # engine settings, see engines/*
    env: dict[str, str] = field(default_factory=dict)      # passed to the engine processes (NCCL_*...)
    nodes: list[Node] = field(default_factory=list)
    gate: dict[str, Any] = field(default_factory=dict)     # transport gate (Phase 5); empty = none
    preflight: dict[str, Any] = field(default_factory=dict)
    scale: str = "local"              # case length scale: local | cluster
    source: str = ""                  # the file it was read from

    @property
    def head(self) -> Node:
        heads = [n for n in self.nodes if n.role == "head"]
        return heads[0] if heads else self.nodes[0]

    @property
    def is_local(self) -> bool:
        return all(n.kind == "local" for n in self.nodes)


ENGINES = {"llamacpp", "sglang", "vllm"}


def targets_dir() -> Path:
    return project_root() / "params" / "targets"


def available_targets() -> list[str]:
    return sorted(p.stem for p in targets_dir().glob("*.yaml"))


def load_target(name_or_path: str) -> Target:
    """Read and validate a target by name (``params/targets/<name>.yaml``) or path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = targets_dir() / f"{name_or_path}.yaml"
        if not path.exists():
            known = available_targets()
            raise ParamError(f"unknown target '{name_or_path}'{did_you_mean(name_or_path, known)}; "
                             f"known targets: {', '.join(known)}")
    if not path.exists():
        raise ParamError(f"target file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ParamError(f"{path}: not valid YAML: {exc}") from exc
    return target_from_dict(raw, str(path))


def target_from_dict(raw: dict, source: str = "<dict>") -> Target:
    if not isinstance(raw, dict):
        raise ParamError(f"{source}: a target must be a mapping")
    known = {f.name for f in fields(Target)} - {"source"}
    reject_unknown(raw, known, source)
    for required in ("name", "engine", "model"):
        if required not in raw:
            raise ParamError(f"{source}: missing required key '{required}'")
    if raw["engine"] not in ENGINES:
        raise ParamError(f"{source}: engine '{raw['engine']}' is not one of {sorted(ENGINES)}"
                         f"{did_you_mean(str(raw['engine']), ENGINES)}")
    node_known = {f.name for f in fields(Node)}
    nodes = []
    for i, n in enumerate(raw.get("nodes") or [{"name": "local"}]):
        reject_unknown(n, node_known, f"{source}: nodes[{i}]")
        node = Node(**n)
        if node.kind not in ("local", "ssh"):
            raise ParamError(f"{source}: nodes[{i}].kind must be 'local' or 'ssh', not '{node.kind}'")
        if node.role not in ("head", "worker"):
            raise ParamError(f"{source}: nodes[{i}].role must be 'head' or 'worker', not '{node.role}'")
        nodes.append(node)
    if len({n.name for n in nodes}) != len(nodes):
        raise ParamError(f"{source}: node names must be unique")
    body = {k: v for k, v in raw.items() if k != "nodes"}
    body["env"] = {str(k): str(v) for k, v in (raw.get("env") or {}).items()}
    target = Target(**body, nodes=nodes, source=source)
    from servelab.engines import engine_for  # late: engines import params
    engine_for(target.engine).validate_launch(target.launch, source)
    return target


# ---------------------------------------------------------------- phase parameters

@dataclass(frozen=True)
class ParamSpec:
    name: str
    type_name: str      # str | int | float | bool | list | dict
    default: Any
    help: str = ""


def notebook_param_specs(notebook: Path) -> dict[str, ParamSpec]:
    """The names, types, defaults and help of a notebook's ``parameters`` cell.

    Reads the cell's source with ``ast``: each ``name: type = literal  # help`` line is one parameter.
    """
    nb = json.loads(Path(notebook).read_text())
    cells = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not cells:
        raise ParamError(f"{notebook}: no cell tagged 'parameters'")
    src = "".join(cells[0]["source"])
    lines = src.splitlines()
    for i, line in enumerate(lines, 1):
        if line.count("=") > 1:   # papermill's own parser skips such a line: the parameter would be invisible
            raise ParamError(f"{notebook}: parameters cell line {i} has more than one '=' (write the help "
                             f"comment without '='): {line.strip()}")
    specs: dict[str, ParamSpec] = {}
    for stmt in ast.parse(src).body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name, ann, value = stmt.target.id, ast.unparse(stmt.annotation), stmt.value
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, ann, value = stmt.targets[0].id, "", stmt.value
        else:
            raise ParamError(f"{notebook}: the parameters cell must hold only `name: type = literal` lines")
        default = ast.literal_eval(value) if value is not None else None
        type_name = ann or type(default).__name__
        line = lines[stmt.lineno - 1]
        help_text = line.split("#", 1)[1].strip() if "#" in line else ""
        specs[name] = ParamSpec(name, type_name.split("[")[0], default, help_text)
    return specs


def coerce(spec: ParamSpec, value: Any, where: str) -> Any:
    """Convert a value (often a string from ``-p k=v``) to the parameter's declared type."""
    t = spec.type_name
    try:
        if t == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if t == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if t == "float":
            return float(value)
        if t == "str":
            return str(value)
        if t in ("list", "dict"):
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if t == "list" and isinstance(value, (str, int, float)):
                value = [value]
            if not isinstance(value, list if t == "list" else dict):
                raise ValueError(value)
            return value
    except (ValueError, TypeError, yaml.YAMLError):
        raise ParamError(f"{where}: '{spec.name}' must be {t}, got {value!r}") from None
    return value


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["tp=16", "trace_dir=/x"]`` → dict; ``key=value`` only."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ParamError(f"-p expects key=value, got '{item}'")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def phase_file(phase: str) -> Path:
    return project_root() / "params" / f"{phase}.yaml"


def resolve_phase_params(notebook: Path, phase: str, overrides: dict[str, Any] | None = None,
                         given: dict[str, Any] | None = None) -> dict[str, Any]:
    """Layer notebook defaults < ``params/<phase>.yaml`` < ``given`` (notebook namespace values that
    differ from the defaults) < ``overrides``; every key validated and typed."""
    specs = notebook_param_specs(notebook)
    resolved = {name: s.default for name, s in specs.items()}
    pf = phase_file(phase)
    if pf.exists():
        file_values = yaml.safe_load(pf.read_text()) or {}
        reject_unknown(file_values, set(specs), str(pf))
        for k, v in file_values.items():
            resolved[k] = coerce(specs[k], v, str(pf))
    for k, v in (given or {}).items():
        if k in specs and v != specs[k].default:
            resolved[k] = coerce(specs[k], v, "notebook parameters")
    if overrides:
        reject_unknown(overrides, set(specs), f"-p parameters of {phase}")
        for k, v in overrides.items():
            resolved[k] = coerce(specs[k], v, "-p")
    return resolved
