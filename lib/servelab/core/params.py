"""Parameters: targets (where to run) and phase parameters (what to run), validated before anything starts.

A phase's parameters are defined once, as a frozen dataclass (a :class:`PhaseParams` subclass named ``Params`` in
the phase's module): name, type, default, help and the rules written in the help (``[min 1]``). The notebook's
``parameters`` cell (papermill's contract) is that definition written out (:meth:`PhaseParams.cell_source`; a test
keeps them equal), ``servelab params`` prints it, ``-p`` is validated against it and the phase's code receives
one instance of it. Values are layered as: defaults < ``params/<phase>.yaml`` < ``-p key=value`` overrides.
A target is a YAML file under ``params/targets/``. Unknown keys are errors that name the closest key.

Checks that need more than one parameter or the file system — a folder, file, case, point or run a parameter
names — are **phase checks**: a function ``check(params) -> None`` registered for its phase with
:func:`phase_check` (``servelab.measure.param_checks`` holds them) that raises :class:`ParamError` with one line
saying what to do. :func:`run_phase_checks` runs them on the resolved parameters (with ``target``, the target's
name), from ``servelab run`` (before a run folder or a kernel exists) and from the notebook (``open_phase``), so
both refuse the same inputs the same way.
"""
from __future__ import annotations

import ast
import difflib
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

import yaml

from servelab.core.paths import project_root


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


# ---------------------------------------------------------------- phase parameters

PhaseCheck = Callable[[dict[str, Any]], None]
PHASE_CHECKS: dict[str, list[PhaseCheck]] = {}


def phase_check(phase: str) -> Callable[[PhaseCheck], PhaseCheck]:
    """Register ``check(params)`` for ``phase`` (``phase3``): it raises :class:`ParamError` (one line, what to do)
    on a value that names something missing; run by :func:`run_phase_checks` on the typed parameters."""
    def add(fn: PhaseCheck) -> PhaseCheck:
        checks = PHASE_CHECKS.setdefault(phase, [])
        if fn not in checks:
            checks.append(fn)
        return fn
    return add


def run_phase_checks(phase: str, params: dict[str, Any]) -> None:
    """Every check registered for ``phase`` on ``params`` (resolved, typed, ``target`` = the target's name)."""
    for fn in PHASE_CHECKS.get(phase.split("_")[0], []):
        fn(params)


def existing_path(value: str, name: str, kind: str = "dir", what: str = "", base: Path | None = None) -> Path:
    """``value`` (``~`` expanded; relative to ``base`` when given) as an existing folder (``kind="dir"``) or file;
    else :class:`ParamError` naming the parameter, the value as given and ``what`` it should hold."""
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    try:
        ok = path.is_dir() if kind == "dir" else path.is_file()
        exists = path.exists()
    except OSError as exc:          # a name too long for the filesystem, a loop of links...
        ok, exists = False, False
        kind_err = exc.strerror
    else:
        kind_err = ""
    if not ok:
        state = (f"is not a usable path ({kind_err})" if kind_err else "does not exist" if not exists
                 else f"is not a {'folder' if kind == 'dir' else 'file'}")
        hint = f" (give the {'folder' if kind == 'dir' else 'file'} {what})" if what else ""
        shown = value if "\n" not in str(value) and len(str(value)) <= 300 else repr(str(value))[:300]   # one line
        raise ParamError(f"{name}: {shown} {state}{hint}")
    return path


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type_name: str      # str | int | float | bool | list | dict
    default: Any
    help: str = ""

    @property
    def rules(self) -> list[tuple[str, str]]:
        """The constraints declared in the help comment: ``[min 1]``, ``[above 0]``, ``[max 1]``,
        ``[one of vllm, sglang]``, ``[items one of a, b]`` (every item of a list), ``[items min 1]``, ``[items max 1]``."""
        return [(m.group(1), m.group(2).strip()) for m in RULE_RE.finditer(self.help)]


# a constraint in a parameter's help comment; numbers without a [min]/[above] are never negative
RULE_RE = re.compile(r"\[(min|above|max|one of|items one of|items min|items max) ([^\]]+)\]")


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


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_rules(spec: ParamSpec, value: Any, where: str) -> None:
    """Raise :class:`ParamError` unless ``value`` meets the constraints of ``spec`` (see :attr:`ParamSpec.rules`).
    Every number must be finite and, unless a rule says otherwise, not negative."""
    rules = spec.rules
    bad = f"{where}: '{spec.name}'"
    if spec.type_name in ("int", "float"):
        if isinstance(value, float) and not math.isfinite(value):
            raise ParamError(f"{bad} must be a finite number, got {value!r}")
        if not any(k in ("min", "above") for k, _ in rules) and value < 0:
            raise ParamError(f"{bad} must be >= 0, got {value!r}  ({spec.help})")
    for kind, arg in rules:
        if kind in ("one of", "items one of"):
            choices = [c.strip() for c in re.split(r"[,|]", arg)]
            for v in (value if kind == "items one of" else [value]):
                if str(v) not in choices:
                    raise ParamError(f"{bad} {'items ' if kind.startswith('items') else ''}must be one of "
                                     f"{', '.join(choices)}, got {v!r}{did_you_mean(str(v), choices)}")
            continue
        limit = float(arg)
        items = value if kind.startswith("items") else [value]
        for v in items:
            if kind.startswith("items") and not _num(v):
                raise ParamError(f"{bad} must hold numbers, got {v!r}")
            if isinstance(v, float) and not math.isfinite(v):
                raise ParamError(f"{bad} must hold finite numbers, got {v!r}")
            if (kind.endswith("min") and v < limit) or (kind == "above" and v <= limit) \
                    or (kind.endswith("max") and v > limit):
                word = {"min": ">=", "above": ">", "max": "<="}[kind.split()[-1]]
                raise ParamError(f"{bad} {'items ' if kind.startswith('items') else ''}must be {word} {arg}, "
                                 f"got {v!r}  ({RULE_RE.sub('', spec.help).strip()})")


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


# ---------------------------------------------------------------- the one definition of a phase's parameters

TYPE_NAMES = ("str", "int", "float", "bool", "list", "dict")
P = TypeVar("P", bound="PhaseParams")


def param(default: Any, help: str = "") -> Any:
    """One parameter of a :class:`PhaseParams` definition: its default and its help (the constraints in brackets,
    see :attr:`ParamSpec.rules`). Lists and dicts get a fresh copy per instance."""
    meta = {"help": help}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _literal(value: Any) -> str:
    """A default as the notebook's cell writes it: JSON-style strings and containers, Python's True/False."""
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


@dataclass(frozen=True)
class PhaseParams:
    """The parameters every phase has (``target``, ``run_id``: first in every cell); each phase's ``Params`` adds
    its own with :func:`param` (and may re-declare these two with its own help). Build one with :meth:`resolve`
    (validated), read its fields as attributes."""
    phase: ClassVar[str] = ""            # phase0 ... phase9, set by each phase's definition
    target: str = param("local", "params/targets/<name>.yaml")
    run_id: str = param("", "empty: a new run id, target-YYYYmmdd-HHMMSS")

    @classmethod
    def specs(cls) -> dict[str, ParamSpec]:
        """Name, type, default and help of every parameter, in the definition's order."""
        out: dict[str, ParamSpec] = {}
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()   # type: ignore[misc]
            type_name = str(f.type).split("[")[0]
            if type_name not in TYPE_NAMES:
                raise TypeError(f"{cls.__name__}.{f.name}: type {f.type} is not one of {TYPE_NAMES}")
            out[f.name] = ParamSpec(f.name, type_name, default, f.metadata.get("help", ""))
        return out

    @classmethod
    def cell_source(cls) -> str:
        """The notebook's ``parameters`` cell: one ``name: type = literal  # help`` line per parameter."""
        lines = []
        for s in cls.specs().values():
            line = f"{s.name}: {s.type_name} = {_literal(s.default)}"
            lines.append(f"{line}  # {s.help}" if s.help else line)
        return "\n".join(lines)

    @classmethod
    def resolve(cls: type[P], given: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                phase_file_values: bool = True) -> P:
        """Defaults < ``params/<phase>.yaml`` < ``given`` (values that differ from the defaults: a notebook's
        namespace, a test's keywords) < ``overrides`` (``-p``); every key known, typed and within its rules."""
        return cls(**resolve_values(cls.specs(), cls.phase, given, overrides, phase_file_values))

    def as_dict(self) -> dict[str, Any]:
        """The values by name, in the definition's order (for the manifest, ``params.json`` and the page)."""
        return asdict(self)

    def replace(self: P, **changes: Any) -> P:
        """A copy with ``changes`` (validated like ``-p``)."""
        return type(self).resolve(given={**self.as_dict(), **changes}, phase_file_values=False)


def resolve_values(specs: dict[str, ParamSpec], phase: str, given: dict[str, Any] | None = None,
                   overrides: dict[str, Any] | None = None, phase_file_values: bool = True) -> dict[str, Any]:
    """The layering of :meth:`PhaseParams.resolve` on plain specs."""
    resolved = {name: s.default for name, s in specs.items()}
    pf = phase_file(phase) if phase else None
    if phase_file_values and pf is not None and pf.exists():
        file_values = yaml.safe_load(pf.read_text()) or {}
        reject_unknown(file_values, set(specs), str(pf))
        for k, v in file_values.items():
            resolved[k] = coerce(specs[k], v, str(pf))
    for k, v in (given or {}).items():
        if k in specs and v != specs[k].default:
            resolved[k] = coerce(specs[k], v, f"{phase or 'phase'} parameters")
    if overrides:
        reject_unknown(overrides, set(specs), f"-p parameters of {phase}")
        for k, v in overrides.items():
            resolved[k] = coerce(specs[k], v, "-p")
    for k, v in resolved.items():
        check_rules(specs[k], v, f"{phase} parameters")
    return resolved
