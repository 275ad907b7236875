"""Reading and validating targets: ``load_target('local')`` → :class:`~servelab.deploy.spec.Target`."""
from __future__ import annotations

import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from servelab.core.params import ParamError, did_you_mean, reject_unknown
from servelab.core.paths import project_root
from servelab.deploy.attach import validate_attach
from servelab.deploy.engines import ADAPTERS, engine_for
from servelab.deploy.nccl_gate import validate_gate
from servelab.deploy.preflight import validate_preflight
from servelab.deploy.slurm import engine_launch, validate_slurm
from servelab.deploy.spec import Node, Target

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
    return target_from_dict(resolve_env_refs(raw, str(path)), str(path))


ENV_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def resolve_env_refs(raw: Any, source: str, environ: Mapping[str, str] | None = None) -> Any:
    """``${NAME}`` in a target's ``env`` values and launch arguments (``extra_args``, ``docker.extra_args``) is
    the value of ``NAME`` in the caller's environment: a secret (``HF_TOKEN: ${HF_TOKEN}``) stays out of the file.
    An unset ``NAME`` is an error before anything starts."""
    if not isinstance(raw, dict):
        return raw
    environ = os.environ if environ is None else environ

    def sub(value: Any, where: str) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value

        def one(m: re.Match[str]) -> str:
            if m.group(1) not in environ:
                raise ParamError(f"{source}: {where} refers to ${{{m.group(1)}}}, which is not set: "
                                 f"export {m.group(1)}=... before running (the file keeps secrets out by naming them)")
            return environ[m.group(1)]
        return ENV_REF_RE.sub(one, value)

    out = dict(raw)
    if isinstance(raw.get("env"), dict):
        out["env"] = {k: sub(v, f"env.{k}") for k, v in raw["env"].items()}
    if isinstance(raw.get("launch"), dict):
        launch = dict(raw["launch"])
        if isinstance(launch.get("extra_args"), list):
            launch["extra_args"] = [sub(a, "launch.extra_args") for a in launch["extra_args"]]
        docker = launch.get("docker")
        if isinstance(docker, dict) and isinstance(docker.get("extra_args"), list):
            launch["docker"] = {**docker, "extra_args": [sub(a, "launch.docker.extra_args")
                                                         for a in docker["extra_args"]]}
        out["launch"] = launch
    return out


_TYPES = {"str": str, "int": int, "bool": bool, "dict": dict, "list": list, "float": (int, float)}


def check_field_types(raw: dict, cls: type, where: str) -> None:
    """Each key's value has the type its dataclass field declares (``port: int``, ``launch: dict``...)."""
    for f in fields(cls):
        if f.name not in raw or raw[f.name] is None and f.name not in ("launch", "env", "nodes", "gate", "preflight", "profile"):
            continue
        want = _TYPES.get(str(f.type).split("[")[0])
        v = raw[f.name]
        if v is None:
            continue
        if want is not None and (not isinstance(v, want) or (want is int and isinstance(v, bool))):
            raise ParamError(f"{where}: '{f.name}' must be {str(f.type).split('[')[0]}, got {v!r}")


def target_from_dict(raw: dict, source: str = "<dict>") -> Target:
    if not isinstance(raw, dict):
        raise ParamError(f"{source}: a target must be a mapping")
    known = {f.name for f in fields(Target)} - {"source", "nodes_given"}
    reject_unknown(raw, {*known, "nodes_given"} if "nodes_given" in raw else known, source)
    attached = bool(raw.get("endpoint"))
    if attached:
        validate_attach(raw, source)
        raw = {**raw, "model": raw.get("model") or raw["served_model_name"]}
    for required in ("name", "engine", "model"):
        if required not in raw:
            raise ParamError(f"{source}: missing required key '{required}'")
    check_field_types(raw, Target, source)
    if raw.get("scale", "local") not in ("local", "cluster"):
        raise ParamError(f"{source}: scale must be 'local' or 'cluster', not {raw['scale']!r}")
    if isinstance(raw.get("port"), int) and not 0 <= raw["port"] <= 65535:
        raise ParamError(f"{source}: port must be 0..65535, got {raw['port']}")
    if raw.get("api_key_env") and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(raw["api_key_env"])):
        raise ParamError(f"{source}: api_key_env is the NAME of an environment variable holding the key (e.g. "
                         f"SERVELAB_API_KEY), not the key itself")
    if raw["engine"] not in ENGINES:
        raise ParamError(f"{source}: engine '{raw['engine']}' is not one of {sorted(ENGINES)}"
                         f"{did_you_mean(str(raw['engine']), ENGINES)}")
    node_known = {f.name for f in fields(Node)}
    nodes = []
    for i, n in enumerate(raw.get("nodes") or [{"name": "local"}]):
        if not isinstance(n, dict):
            raise ParamError(f"{source}: nodes[{i}] must be a mapping, got {n!r}")
        reject_unknown(n, node_known, f"{source}: nodes[{i}]")
        if "name" not in n:
            raise ParamError(f"{source}: nodes[{i}] has no 'name'")
        check_field_types(n, Node, f"{source}: nodes[{i}]")
        node = Node(**n)
        if node.kind not in ("local", "ssh"):
            raise ParamError(f"{source}: nodes[{i}].kind must be 'local' or 'ssh', not '{node.kind}'")
        if node.role not in ("head", "worker"):
            raise ParamError(f"{source}: nodes[{i}].role must be 'head' or 'worker', not '{node.role}'")
        nodes.append(node)
    if len({n.name for n in nodes}) != len(nodes):
        raise ParamError(f"{source}: node names must be unique")
    body = {k: v for k, v in raw.items() if k not in ("nodes", "nodes_given")}
    body["nodes_given"] = bool(raw.get("nodes")) or not attached if "nodes_given" not in raw else raw["nodes_given"]
    body["env"] = {str(k): str(v) for k, v in (raw.get("env") or {}).items()}
    for key in ("launch", "gate", "preflight", "profile"):
        body[key] = body.get(key) or {}
    try:
        validate_gate(body["gate"])
    except ValueError as exc:
        raise ParamError(f"{source}: gate: {exc}") from None
    validate_preflight(body["preflight"], source)
    target = Target(**body, nodes=nodes, source=source)
    validate_slurm(target.launch, source)
    engine_for(target.engine).validate_launch(engine_launch(target.launch), source)
    return target
