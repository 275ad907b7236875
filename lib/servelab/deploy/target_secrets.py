"""The secrets a run's targets hold, kept out of its files: a target with ``-p`` launch overrides written into the run
with every secret as ``${NAME}`` (its values passed to the phase's kernel in the environment only), and the secret
values each run may have written somewhere — what the literal scrub of its files and pages replaces
(``docs/method.md#secrets``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from servelab.core.params import ParamError
from servelab.core.redact import is_secret_name, known_secrets, redact, redact_text, secret_argv_values
from servelab.core.run import read_manifest
from servelab.deploy.targets import load_target


def target_dict_with_launch(t: Any, launch_over: dict[str, Any]) -> dict[str, Any]:
    """The target as a dict with ``launch_over`` applied to its launch settings."""
    raw = dataclasses.asdict(t)
    raw.pop("source")
    raw["launch"] = {**raw["launch"], **launch_over}
    return raw


def derived_target(rdir: Path, target: str, launch_over: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """Write the target with ``-p`` launch overrides applied into the run directory; returns its path and the
    secrets it names.

    The file holds no secret: a secret ``env`` value (by name, or a value that carries one, e.g. a URL with a
    password) is written as ``${NAME}``, a secret launch argument as ``${SERVELAB_SECRET_ARG_<n>}``, and
    :func:`servelab.deploy.targets.load_target` resolves them from the environment. The returned mapping
    (``NAME`` → value) is what the phase's kernel gets in its environment; to load the file again later, export
    the same names (``docs/method.md#secrets``)."""
    t = load_target(target)
    raw = target_dict_with_launch(t, launch_over)
    known = t.secret_values()
    refs: dict[str, str] = {}
    for k, v in list(raw.get("env", {}).items()):
        if is_secret_name(k) or redact_text(str(v), known) != str(v):
            raw["env"][k] = "${%s}" % k
            refs[k] = str(v)

    def args(items: list[Any]) -> list[Any]:
        secret_vals = set(secret_argv_values(items))
        out = []
        for a in items:
            text = str(a)
            hit = next((sv for sv in secret_vals if sv and sv in text), None)
            if hit is None and redact_text(text, known) != text:
                hit = text
            if hit is not None:
                name = f"SERVELAB_SECRET_ARG_{sum(k.startswith('SERVELAB_SECRET_ARG_') for k in refs) + 1}"
                refs[name] = hit
                out.append(text.replace(hit, "${%s}" % name))
            else:
                out.append(a)
        return out

    launch = raw.get("launch") or {}
    if isinstance(launch.get("extra_args"), list):
        launch["extra_args"] = args(launch["extra_args"])
    if isinstance(launch.get("docker"), dict) and isinstance(launch["docker"].get("extra_args"), list):
        launch["docker"]["extra_args"] = args(launch["docker"]["extra_args"])
    known = known_secrets(values=refs.values(), environ=True) + known
    raw["description"] = redact_text(f"{t.description} [-p overrides: {redact(launch_over, known)}]", known)
    out = rdir / "targets" / f"{t.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# written by servelab run: the target with -p launch overrides; ${NAME} values come from the\n"
                   "# environment (secrets are never written here)\n" + yaml.safe_dump(raw, sort_keys=False))
    return str(out), refs


def launch_over_secrets(launch_over: dict[str, Any]) -> dict[str, str]:
    """Secret values passed as ``-p`` launch overrides (``-p extra_args=[--api-key,X]``)."""
    args = launch_over.get("extra_args") if isinstance(launch_over.get("extra_args"), list) else []
    return {str(i): v for i, v in enumerate(secret_argv_values(args))}


def run_secrets(target: str, extra: dict[str, str] | None = None) -> tuple[str, ...]:
    """Every secret value a phase on ``target`` may write somewhere (the target's, the process environment's,
    ``extra``'s) — what the literal scrub of its files replaces."""
    try:
        base = load_target(target).secret_values()
    except ParamError:
        base = known_secrets()
    return tuple(sorted({*base, *known_secrets(values=(extra or {}).values())}, key=lambda v: (-len(v), v)))


def recorded_run_secrets(rdir: Path) -> tuple[str, ...]:
    """The secret values of every target a run recorded (its manifest's target, each phase's and attempt's
    ``target`` parameter) and of the process environment — for ``servelab render`` and ``archive --zip``, which
    run after the phase. A target that no longer loads (a derived one whose ``${NAME}`` is not exported) gives
    what its file holds literally."""
    m = read_manifest(rdir)
    names = {str(m.get("target") or "")}
    names |= {str((e.get("params") or {}).get("target") or "") for e in (m.get("phases") or {}).values()}
    names |= {str((a.get("params") or {}).get("target") or "") for a in (m.get("attempts") or [])}
    found: set[str] = set(known_secrets())
    for name in sorted(n for n in names if n):
        try:
            found.update(load_target(name).secret_values())
        except ParamError:
            try:
                raw = yaml.safe_load(Path(name).read_text()) if Path(name).suffix else None
            except (OSError, yaml.YAMLError):
                raw = None
            if isinstance(raw, dict):
                launch = raw.get("launch") if isinstance(raw.get("launch"), dict) else {}
                found.update(known_secrets(raw.get("env") if isinstance(raw.get("env"), dict) else {},
                                           argv=launch.get("extra_args") or [], environ=False))
    return tuple(sorted(found, key=lambda v: (-len(v), v)))
