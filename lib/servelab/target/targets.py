"""Reading and validating targets: ``load_target('local')`` → :class:`~servelab.target.spec.Target`."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import yaml

from servelab.core.params import ParamError, did_you_mean, reject_unknown
from servelab.core.paths import project_root
from servelab.target.engines import ADAPTERS, engine_for
from servelab.target.spec import Node, Target

ENGINES = set(ADAPTERS)


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
    engine_for(target.engine).validate_launch(target.launch, source)
    return target
