"""Attached targets: a server already running (started by Kubernetes, Slurm or a team's own scripts) that servelab
measures through its URL and never starts, restarts or stops.

A target with ``endpoint:`` and no ``launch:`` is attached (:func:`validate_attach` checks it when it is read).
:func:`attach_server` is what ``deploy.server.start_server`` does for it: connect to the declared ``nodes`` (for
facts, collectors and traces; none by default), wait for the endpoint's health probe, and return a
``RunningServer`` with no process handles, so that every phase's stop, liveness and clean-up paths have nothing of
its own to stop. :func:`endpoint_facts` is what Phase 0 can read from the outside and what it could not know;
:func:`phase_refusal` is the one line a phase that needs a restart gives on an attached target, before anything
starts.
"""
from __future__ import annotations

import time
import urllib.parse
from typing import Any, Mapping

from servelab.core.params import ParamError

ATTACH_NOTE = "attached: servelab started nothing and stops nothing there"
PROFILE_KEYS = {"trace_dir"}


def validate_attach(raw: Mapping[str, Any], source: str) -> None:
    """An attached target's own rules, before anything starts: an http(s) URL with a host, no launch settings
    (servelab launches nothing there), no ``port`` (the URL has it), a served model name, known ``profile`` keys."""
    url = str(raw.get("endpoint") or "")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ParamError(f"{source}: endpoint must be an http(s) URL like http://10.0.0.5:30000, got {url!r}")
    if parsed.username or parsed.password:
        raise ParamError(f"{source}: endpoint must not carry credentials; put the key in the variable api_key_env "
                         f"names")
    if parsed.query or parsed.fragment or parsed.path not in ("", "/"):
        raise ParamError(f"{source}: endpoint is the server's base URL (scheme, host, port), got {url!r}")
    if raw.get("launch"):
        raise ParamError(f"{source}: a target with an endpoint is attached: servelab starts nothing there, so it "
                         f"has no 'launch' (remove it, or remove 'endpoint' to let servelab launch the engine)")
    if raw.get("port"):
        raise ParamError(f"{source}: an attached target takes its port from 'endpoint', not 'port'")
    if not raw.get("served_model_name"):
        raise ParamError(f"{source}: an attached target needs 'served_model_name': the model name the server "
                         f"answers to (GET {url.rstrip('/')}/v1/models lists it)")
    mp = str(raw.get("metrics_path") or "")
    if mp and mp != "none" and not mp.startswith("/"):
        raise ParamError(f"{source}: metrics_path is a path like /metrics (or 'none'), got {mp!r}")
    prof = raw.get("profile") or {}
    if not isinstance(prof, dict):
        raise ParamError(f"{source}: profile must be a mapping like {{trace_dir: /shared/traces}}")
    unknown = set(prof) - PROFILE_KEYS
    if unknown:
        raise ParamError(f"{source}: unknown key(s) {sorted(unknown)} in profile; known: {sorted(PROFILE_KEYS)}")


def base_url(target: Any) -> str:
    return str(target.endpoint).rstrip("/")


def endpoint_port(target: Any) -> int:
    p = urllib.parse.urlsplit(target.endpoint)
    return p.port or (443 if p.scheme == "https" else 80)


def metrics_path(target: Any, engine: Any) -> str:
    """The attached server's Prometheus path: the target's ``metrics_path``, else the engine's; "" for none."""
    mp = str(getattr(target, "metrics_path", "") or "")
    if mp == "none":
        return ""
    return mp or str(engine.metrics_path or "")


# Phases that change how the server runs: (reason) when they cannot run on an attached target with these params
def phase_refusal(target: Any, phase: str, params: Mapping[str, Any], engine: Any) -> str:
    """The one line saying why ``phase`` cannot run on the attached ``target`` with ``params``; "" when it can."""
    if not getattr(target, "attached", False):
        return ""
    key = phase.split("_")[0]
    lead = f"{key} cannot run on the attached target {target.name} ({target.endpoint}): "
    tail = " — servelab never restarts a server it did not start; run it on a target servelab launches"
    if key == "phase4" and params.get("measure_layouts"):
        return lead + "measure_layouts restarts the engine once per layout" + tail + \
            " (or leave measure_layouts empty: the model, feasibility and measured runs need no restart)"
    if key == "phase5" and not target.nodes_given:
        return lead + "nccl-tests run on the target's nodes and this target declares none (add nodes:)"
    if key == "phase7":
        return lead + "its knob sweep restarts the engine once per value" + tail
    if key == "phase8" and not engine.flush_cache_path:
        return lead + (f"{target.engine} has no cache-flush endpoint, so every hit-rate point restarts the engine"
                       + tail)
    if key == "phase9" and (params.get("drafts") or params.get("synth_rates")):
        return lead + "each draft or synthetic-rate config is a restart with other launch settings" + tail + \
            " (or leave drafts and synth_rates empty: Phase 9 measures an attached server as served)"
    return ""


def check_phase(target: Any, phase: str, params: Mapping[str, Any], engine: Any) -> None:
    """Raise :class:`ParamError` with :func:`phase_refusal`'s line (before any run folder or kernel exists)."""
    why = phase_refusal(target, phase, params, engine)
    if why:
        raise ParamError(why)


def served_topology(info: Mapping[str, Any]) -> dict[str, int]:
    """The parallel sizes an attached server reports about itself (SGLang ``/server_info``: ``tp_size``...), as
    launch keys; {} when it reports none (then one rank per node is assumed where ranks are counted)."""
    sinfo = next((v for k, v in info.items() if k.endswith("server_info") and isinstance(v, dict)), {})
    return {k: int(sinfo[k]) for k in ("tp_size", "pp_size", "dp_size", "ep_size")
            if isinstance(sinfo.get(k), int) and not isinstance(sinfo.get(k), bool) and sinfo[k] > 0}


def wait_endpoint(url: str, path: str, timeout_s: float, headers: dict[str, str], http_json: Any) -> float:
    """Poll the attached server's health path until 200; the error says that servelab starts nothing there."""
    t0 = time.monotonic()
    last = 0
    while time.monotonic() - t0 < timeout_s:
        last, _ = http_json(url + path, timeout=2.0, headers=headers)
        if last == 200:
            return time.monotonic() - t0
        time.sleep(0.2)
    said = "no connection" if last == 0 else f"HTTP {last}"
    raise ParamError(f"the attached server {url} does not answer {path} ({said} for {timeout_s:.0f} s); servelab "
                     f"starts nothing on an attached target: start it (or port-forward it), then re-run")


def endpoint_facts(srv: Any, http_json: Any, http_text: Any) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """What Phase 0 can read from an attached server (its version and server-info endpoints, ``/v1/models``, the
    metrics page's presence) and, one row each, the facts it could not know from the outside with the reason."""
    engine, url, headers = srv.engine, srv.base_url, srv.auth_headers
    info: dict[str, Any] = {}
    unknown: list[dict[str, str]] = []
    for path in dict.fromkeys([*engine.version_paths, "/v1/models"]):
        status, body = http_json(url + path, timeout=10.0, headers=headers)
        if status == 200:
            info[path] = body
        else:
            unknown.append({"fact": f"GET {path}", "why": "no connection" if status == 0 else f"HTTP {status}"})
    mp = metrics_path(srv.target, engine)
    if mp:
        status, text = http_text(url + mp, timeout=10.0, headers=headers)
        info["metrics"] = {"path": mp, "status": status,
                           "families": len({ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")})
                           if status == 200 else 0}
        if status != 200:
            unknown.append({"fact": f"engine counters ({mp})",
                            "why": ("no connection" if status == 0 else f"HTTP {status}") +
                                   ": server-side metrics and counter deltas are not measured"})
    else:
        unknown.append({"fact": "engine counters", "why": "the target says metrics_path: none"})
    unknown.append({"fact": "launch command and its settings",
                    "why": "started outside servelab; only what the server reports about itself is recorded"})
    unknown.append({"fact": "engine process (pid, environment, packages, image)",
                    "why": "servelab did not start it" + ("" if srv.target.nodes_given else
                                                          " and the target declares no nodes")})
    if not srv.target.nodes_given:
        unknown.append({"fact": "node facts (CPU, GPU, driver, network, clock)",
                        "why": "the target declares no nodes: add nodes: (ssh) to record them"})
    return info, unknown


def check_attached(t: Any, phase: str, params: dict[str, Any], engine: Any, http_json: Any) -> None:
    """An attached target, before anything starts: a phase that would restart the server is refused in one line,
    the server must answer its health probe within 10 s and accept the target's key (or need none). ``http_json``:
    the server module's JSON request (deploy.server imports this module)."""
    check_phase(t, phase, params, engine)
    try:
        key = t.api_key()
    except ValueError as exc:
        raise ParamError(str(exc)) from None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = t.endpoint.rstrip("/")
    wait_endpoint(url, engine.health_path, 10.0, headers, http_json)
    status, _ = http_json(url + engine.tokenize_path, engine.tokenize_body("a", False), timeout=10.0, headers=headers)
    if status in (401, 403):        # the health path is often open to all: a key-checked call says more
        raise ParamError(f"{url} answered HTTP {status} to POST {engine.tokenize_path}: " +
                         (f"it refuses the key in {t.api_key_env}" if key else
                          "it needs an API key: set api_key_env in the target to the name of a variable holding it"))
