"""Phase 0 — freeze the environment: what exactly is running, on every node, before and after.

``run(ctx)`` is the phase: the preflight, the facts and the freeze before, the engine started inside one
``ProcessTracker`` (always stopped, even on failure or Ctrl-C), the facts and the freeze after; it returns the
tables the notebook shows. Raw probe outputs are written under ``<run>/phase0/raw/<node>/`` and the facts into
``manifest.json`` (hosts, engine, model).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from servelab.core.params import PhaseParams, param
from servelab.deploy import hosts as hostlib
from servelab.deploy.engines import engine_for
from servelab.deploy.facts import (NodeFreeze, collect_facts, engine_env, freeze_node, gguf_facts,
                                   nccl_env, port_snapshot, process_snapshot, snapshot_diff, weights_fingerprint)
from servelab.phases.context import PhaseContext
from servelab.core.run import read_manifest, redact, update_manifest, write_json_atomic
from servelab.deploy.preflight import PreflightFailed, PreflightReport, ensure_preflight, fingerprint
from servelab.deploy.attach import ATTACH_NOTE, endpoint_facts
from servelab.deploy.server import (connect_nodes, engine_info, http_json, http_text, is_healthy, plan_launch,
                                    rank_environments, start_server, stop_server, version_argv)
from servelab.report.banner import banner
from servelab.deploy.freeze_tables import (changes_table, freeze_notes, freeze_table, frozen_manifest, packages_table,
                                           state_table, weights_table)


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 0's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase0 --cell``); ``-p`` and ``params/phase0.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase0"
    start_engine: bool = param(True, "start the engine to record its live settings; False: the launch command is only planned")
    health_timeout_s: float = param(900.0, "how long to wait for the engine's health probe [above 0]")
    rehash_after: bool = param(False,
        "after the run, hash every model file again (default: only files whose size, mtime, ctime or inode "
        "changed)")


@dataclass
class Phase0Result:
    facts: pd.DataFrame
    launch: pd.DataFrame
    engine: pd.DataFrame
    model: pd.DataFrame
    settings: pd.DataFrame
    comm_env: pd.DataFrame
    processes_before: pd.DataFrame
    ports_before: pd.DataFrame
    processes_started: pd.DataFrame
    ports_opened: pd.DataFrame
    leftovers_after: pd.DataFrame
    rank_env: pd.DataFrame = field(default_factory=pd.DataFrame)
    server: dict[str, Any] = field(default_factory=dict)
    preflight: PreflightReport | None = None
    exposure: list[str] = field(default_factory=list)     # warnings: reachable head without a key, dev endpoints
    exposure_notes: list[str] = field(default_factory=list)   # loopback-only exposure (info)
    host_keys: pd.DataFrame = field(default_factory=pd.DataFrame)
    facts_after: pd.DataFrame = field(default_factory=pd.DataFrame)
    frozen_before: dict[str, NodeFreeze] = field(default_factory=dict)
    frozen_after: dict[str, NodeFreeze] = field(default_factory=dict)
    start_engine: bool = True

    def headline(self) -> dict[str, Any]:
        return headline(self)

    def findings(self) -> list[str]:
        return findings(self, self.start_engine)


def exposure_warnings(target: Any) -> list[str]:
    """What the target's head exposes, in sentences (``docs/method.md#exposure``): a non-loopback address without
    an API key, development/profiling endpoints, a key that can only travel on the command line."""
    return engine_for(target.engine).exposure_warnings(target, bool(target.api_key_env))


def exposure_banner(result: Phase0Result) -> Any:
    """The page's warning block for :func:`exposure_warnings` (an info note when there is nothing to warn of)."""
    if not result.exposure:
        return banner(" ".join(result.exposure_notes) or "The head listens on loopback only and mounts no "
                      "development endpoint.", "info", "Exposure")
    return banner(" ".join(result.exposure + result.exposure_notes), "warning", "Exposure: who can reach this engine")


def _kv(rows: dict[str, Any], key: str = "item") -> pd.DataFrame:
    return pd.DataFrame([{key: k, "value": "-" if v is None or v == "" else str(v)} for k, v in rows.items()])


def engine_settings(target_launch: dict[str, Any], engine: str, info: dict[str, Any]) -> pd.DataFrame:
    """The Phase 0 settings list (``docs/method.md#phase0``): configured value and, where the engine reports it,
    the live value."""
    adapter = engine_for(engine)
    topo = adapter.topology(target_launch)
    props = info.get("/props", {}) if isinstance(info.get("/props"), dict) else {}
    sinfo = info.get("/server_info", {}) if isinstance(info.get("/server_info"), dict) else {}
    models = info.get("/v1/models", {}) if isinstance(info.get("/v1/models"), dict) else {}
    meta = (models.get("data") or [{}])[0].get("meta", {}) if models.get("data") else {}
    spec = target_launch.get("spec") or {}
    implied = adapter.implied_settings(target_launch)     # what the engine's nature fixes, where nothing reports it
    rows = [
        ("topology TP/PP/DP/EP", f"{topo['tp']}/{topo['pp']}/{topo['dp']}/{topo['ep']}",
         f"{sinfo.get('tp_size', '-')}/{sinfo.get('pp_size', '-')}/{sinfo.get('dp_size', '-')}/{sinfo.get('ep_size', '-')}"
         if sinfo else implied.get("topology", "-")),
        ("attention backend", target_launch.get("attention_backend"), sinfo.get("attention_backend")),
        ("MoE runner / all-to-all backend", f"{target_launch.get('moe_runner_backend', '-')} / "
                                            f"{target_launch.get('moe_a2a_backend', '-')}", sinfo.get("moe_runner_backend")),
        ("GPU memory fraction", target_launch.get("mem_fraction"), sinfo.get("mem_fraction_static")),
        ("context limit (tokens)", target_launch.get("context_length"),
         sinfo.get("context_length") or (meta.get("n_ctx") and f"{meta.get('n_ctx')} per slot")),
        ("active request limit", target_launch.get("max_running_requests") or target_launch.get("parallel"),
         sinfo.get("max_running_requests") or props.get("total_slots")),
        ("KV cache dtype", target_launch.get("kv_cache_dtype", "auto"), sinfo.get("kv_cache_dtype")),
        ("CUDA graph", target_launch.get("cuda_graph", "engine default"),
         implied["cuda_graph"] if "cuda_graph" in implied else sinfo.get("disable_cuda_graph") is False if sinfo else None),
        ("chunked prefill size", target_launch.get("chunked_prefill_size", "engine default"),
         sinfo.get("chunked_prefill_size") or implied.get("chunked_prefill")),
        ("prefix cache", target_launch.get("prefix_cache", "engine default"),
         implied["prefix_cache"] if "prefix_cache" in implied else
         (not sinfo.get("disable_radix_cache")) if sinfo else None),
        ("speculative decoding", spec.get("algorithm", "off") if spec else "off",
         sinfo.get("speculative_algorithm") if sinfo else None),
        ("build / version", "-", props.get("build_info") or sinfo.get("version")),
    ]
    return pd.DataFrame([{"setting": s, "configured": "-" if c is None else str(c), "live": "-" if v is None else str(v)}
                         for s, c, v in rows])


def model_facts(model_path: str, is_local: bool, frozen: NodeFreeze | None = None) -> pd.DataFrame:
    """Model file or folder, size, sha256 and configuration (GGUF metadata or HF config.json). The checksums are
    the head node's (``frozen``, taken on the node by :func:`servelab.deploy.facts.freeze_node`): the file's sha256,
    or for a folder the number of files and one sha256 over every file's (the per-file list is the weights table)."""
    p = Path(model_path)
    rows: dict[str, Any] = {"path": model_path}
    files = frozen.weights if frozen is not None else pd.DataFrame()
    if len(files):
        rows["size_bytes"] = int(files["bytes"].sum())
        if p.suffix == ".gguf" or len(files) == 1 and not (is_local and p.is_dir()):
            rows["sha256"] = str(files["sha256"].iloc[0])
        else:
            rows["files"] = len(files)
            rows["files_sha256"] = weights_fingerprint(files)
        rows["checksum_s"] = frozen.weights_seconds
    elif frozen is not None and frozen.notes:
        rows["checksum"] = "; ".join(n for n in frozen.notes if "checksum" in n) or "-"
    if is_local and p.is_file() and p.suffix == ".gguf":
        for k, v in gguf_facts(p).items():
            if any(s in k for s in ("architecture", "name", "context_length", "embedding_length", "block_count",
                                    "head_count", "feed_forward_length", "file_type", "vocab_size", "expert",
                                    "tensor_count", "quantization")):
                rows[k] = v
    elif is_local and p.is_dir() and (p / "config.json").exists():
        cfg = json.loads((p / "config.json").read_text())
        rows.update({f"config.{k}": v for k, v in cfg.items() if not isinstance(v, (dict, list))})
    elif not is_local:
        rows["note"] = "the model lives on the nodes; its checksums were taken there (the weights table)"
    return _kv(rows, "field")


def descendants(procs: pd.DataFrame, roots: dict[str, int]) -> pd.DataFrame:
    """The processes we started: each node's root pid and everything below it (by ppid) — not whatever
    else happened to start on the machine meanwhile."""
    keep = []
    for node, root in roots.items():
        sub = procs[procs["node"] == node]
        children: dict[int, list[int]] = {}
        for pid, ppid in zip(sub["pid"], sub["ppid"]):
            children.setdefault(int(ppid), []).append(int(pid))
        todo, seen = [int(root)], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo += children.get(pid, [])
        keep += [(node, pid) for pid in seen]
    mask = [(n, int(p)) in set(keep) for n, p in zip(procs["node"], procs["pid"])]
    return procs[mask].reset_index(drop=True)


def preflight(ctx: PhaseContext) -> PreflightReport:
    """The preflight on every node (``docs/method.md#preflight``), run afresh — Phase 0 freezes the environment —
    and recorded in ``manifest["preflight"]`` (the later phases of this run reuse it) and ``preflight.csv``.
    Returns the report even when a required check failed: the page shows the table, then :func:`run` refuses
    to go on."""
    if ctx.target.attached and not ctx.target.nodes_given:      # no node of its own to check
        return PreflightReport(ctx.target.name, fingerprint(ctx.target), [])
    hosts = connect_nodes(ctx.target)
    try:
        try:
            report = ensure_preflight(ctx.target, hosts, run_dir=ctx.run_dir, phase=ctx.phase, force=True)
        except PreflightFailed as exc:
            report = exc.report
    finally:
        for h in hosts.values():
            h.close()
    assert report is not None
    report.table.to_csv(ctx.phase_dir / "preflight.csv", index=False)
    return report


def _record_freeze_commands(ctx: PhaseContext, frozen: NodeFreeze) -> None:
    for r in frozen.commands or []:
        what = ("image" if "image" in r.argv and "inspect" in r.argv else "packages" if "-c" in r.argv and
                any("metadata.distributions" in str(a) for a in r.argv) else
                f"model files ({'list' if 'list' in r.argv else 'sha256'})" if any("hashlib" in str(a) for a in r.argv)
                else "executable sha256" if "servelab-sha256" in r.argv else "engine version")
        ctx.log_command("executed", r.argv, title=f"freeze {frozen.moment}: {what} on {frozen.node}", host=frozen.node,
                    exit_code=r.exit_code, start=r.start, end=r.end)


def freeze_nodes(ctx: PhaseContext, nodes: dict[str, Any], plans: list[Any], model_path: str, moment: str,
                 before: dict[str, NodeFreeze] | None = None, rehash: bool = False) -> dict[str, NodeFreeze]:
    """:func:`servelab.deploy.facts.freeze_node` on every node of the launch ``plans`` (raw outputs under
    ``raw/<node>/freeze-<moment>/``, every probe recorded as an executed command)."""
    adapter = engine_for(ctx.target.engine)
    out: dict[str, NodeFreeze] = {}
    for plan in plans:
        host = nodes[plan.node]
        out[plan.node] = freeze_node(host, engine_env(plan, adapter), adapter, model_path, moment,
                                     previous=(before or {}).get(plan.node), rehash=rehash, run_id=ctx.run_id,
                                     raw_dir=ctx.phase_dir / "raw" / plan.node / f"freeze-{moment}")
        _record_freeze_commands(ctx, out[plan.node])
    return out


def run(ctx: PhaseContext) -> Phase0Result:
    """Phase 0's entry (the phase contract), from the notebook's parameters (``ctx.params``): the preflight this run
    recorded for the target (the notebook's :func:`preflight` step; run here when it has not run) — a failed required
    check stops here, before anything starts; on an attached server :func:`attached_phase0`; else every node's facts
    and freeze before (:func:`_take_before`), the engine started, recorded and stopped — only planned without
    ``start_engine`` (:func:`_run_engine`), the facts, the freeze and the processes left after (:func:`_take_after`),
    then the tables and the manifest (:func:`_write`)."""
    p = ctx.params
    rec = read_manifest(ctx.run_dir).get("preflight") or {}
    pre = (PreflightReport.from_manifest(rec) if rec.get("fingerprint") == fingerprint(ctx.target) and rec.get("checks")
           else preflight(ctx))
    if not pre.passed:
        raise PreflightFailed(pre)
    if ctx.target.attached:
        return attached_phase0(ctx, pre)
    before = _take_before(ctx)
    engine = _run_engine(ctx, p, before)
    result = _take_after(ctx, p, pre, before, engine)
    _write(ctx, result, before, engine)
    return result


@dataclass
class _Before:
    """The nodes (connected; :func:`_take_after` closes them) and what Phase 0 took on them before the engine."""
    nodes: dict[str, Any]
    security: list[dict[str, Any]]
    host_keys: list[dict[str, Any]]
    facts: pd.DataFrame
    plans: list[Any]                 # the resolved launch: interpreter, image, model path per node
    model_path: str
    frozen: dict[str, NodeFreeze]
    processes: pd.DataFrame
    ports: pd.DataFrame


@dataclass
class _Engine:
    """What the engine step recorded: the engine started, asked and stopped — or only its launch planned."""
    model_path: str
    processes_started: pd.DataFrame
    ports_opened: pd.DataFrame
    info: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=lambda: {"started": False})
    launch_rows: list[dict[str, Any]] = field(default_factory=list)
    rank_env: pd.DataFrame = field(default_factory=pd.DataFrame)


def _take_before(ctx: PhaseContext) -> _Before:
    """Connect every node: its facts, the launch plan, the freeze, the process and port tables."""
    raw = ctx.phase_dir / "raw"
    nodes = {n.name: hostlib.connect(n) for n in ctx.target.nodes}
    security = [{"node": h.name, "accepted_new_host_key": k} for h in nodes.values()
                for k in getattr(h, "accepted_keys", [])]
    host_keys = [dict(h.host_key, phase=ctx.phase) for h in nodes.values() if getattr(h, "host_key", None)]
    facts = pd.concat([collect_facts(h, raw_dir=raw / name) for name, h in nodes.items()], ignore_index=True)
    plans, model_path = plan_launch(ctx.target)
    frozen = freeze_nodes(ctx, nodes, plans, model_path, "before")
    procs = pd.concat([process_snapshot(h) for h in nodes.values()], ignore_index=True)
    ports = pd.concat([port_snapshot(h) for h in nodes.values()], ignore_index=True)
    return _Before(nodes, security, host_keys, facts, plans, model_path, frozen, procs, ports)


def _run_engine(ctx: PhaseContext, p: Params, before: _Before) -> _Engine:
    """``start_engine``: the engine started inside a ``ProcessTracker`` (stopped even on failure or Ctrl-C), its
    version, endpoints, rank environments, processes and ports recorded, stopped; else its launch only planned."""
    target, nodes = ctx.target, before.nodes
    out = _Engine(before.model_path, pd.DataFrame(columns=before.processes.columns),
                  pd.DataFrame(columns=before.ports.columns))
    with hostlib.ProcessTracker() as tracker:
        if p.start_engine:
            srv = start_server(target, ctx.phase_dir / "logs", tracker, run_dir=ctx.run_dir, phase=ctx.phase,
                               health_timeout_s=p.health_timeout_s, hosts=nodes)
            out.model_path = srv.model_path
            out.info = engine_info(srv)
            version_cmd = version_argv(srv)
            if version_cmd:
                v = nodes[target.head.name].run(version_cmd, timeout=30)
                out.info["version"] = (v.stdout + v.stderr).strip()
                ctx.log_command("executed", version_cmd, title="engine version",
                            exit_code=v.exit_code, start=v.start, end=v.end)
            out.rank_env = rank_environments(srv)
            procs_during = pd.concat([process_snapshot(h) for h in nodes.values()], ignore_index=True)
            ports_during = pd.concat([port_snapshot(h) for h in nodes.values()], ignore_index=True)
            out.processes_started = descendants(procs_during, {n: h.pid for n, h in srv.handles.items()})
            out.ports_opened = snapshot_diff(before.ports, ports_during, ["node", "port"])
            out.server = {"started": True, "base_url": srv.base_url, "ready_s": round(srv.ready_s, 3),
                          "healthy_before_stop": is_healthy(srv), "logs": srv.log_paths}
            out.launch_rows = [{"node": pl.node, "command": pl.shell(), "port": pl.port, "log": srv.log_paths[pl.node]}
                               for pl in srv.plans]
            out.server.update(stop_server(srv, tracker, run_dir=ctx.run_dir, phase=ctx.phase))
        else:
            for pl in before.plans:
                ctx.log_command("planned", pl.argv, title=f"start {target.engine} on {pl.node}", host=pl.node,
                            env=pl.env)
                out.launch_rows.append({"node": pl.node, "command": pl.shell(), "port": pl.port, "log": "-"})
    return out


def _take_after(ctx: PhaseContext, p: Params, pre: PreflightReport, before: _Before, engine: _Engine) -> Phase0Result:
    """The processes the engine started that outlived its stop, the facts and the freeze again (``rehash_after``:
    every model file hashed again, not only those whose size, mtime, ctime or inode changed); the nodes closed;
    the tables the notebook shows."""
    target, nodes = ctx.target, before.nodes
    procs_after = pd.concat([process_snapshot(h) for h in nodes.values()], ignore_index=True)
    leftovers = snapshot_diff(before.processes, procs_after, ["node", "pid"])
    started_pids = set(zip(engine.processes_started["node"], engine.processes_started["pid"]))
    leftovers = leftovers[[(n, pid) in started_pids for n, pid in zip(leftovers["node"], leftovers["pid"])]]
    # a zombie has exited (its parent, the stopped engine, is gone and this machine's init has not reaped it yet):
    # it holds no memory, port or device, so it is not a process left running
    leftovers = leftovers[~leftovers["state"].astype(str).str.startswith("Z")]
    facts_after = pd.concat([collect_facts(h, raw_dir=ctx.phase_dir / "raw" / name / "after")
                             for name, h in nodes.items()], ignore_index=True)
    frozen_after = freeze_nodes(ctx, nodes, before.plans, engine.model_path, "after", before=before.frozen,
                                rehash=p.rehash_after)
    for h in nodes.values():
        h.close()
    return Phase0Result(
        facts=before.facts, launch=pd.DataFrame(engine.launch_rows, columns=["node", "command", "port", "log"]),
        engine=_kv(_engine_rows(target.engine, engine.info), "field"),
        model=model_facts(engine.model_path, target.is_local, before.frozen.get(target.head.name)),
        settings=engine_settings(target.launch, target.engine, engine.info), comm_env=nccl_env(target.env),
        processes_before=before.processes, ports_before=before.ports, processes_started=engine.processes_started,
        ports_opened=engine.ports_opened, leftovers_after=leftovers, rank_env=engine.rank_env, server=engine.server,
        preflight=pre, start_engine=p.start_engine, exposure=exposure_warnings(target),
        exposure_notes=engine_for(target.engine).exposure_notes(target, bool(target.api_key_env)),
        host_keys=pd.DataFrame(before.host_keys + [{"node": h.name, "host": "this machine", "key_type": "—", "sha256": "—",
                                                     "check": "no SSH: the node is the machine servelab runs on"}
                                                    for h in nodes.values() if getattr(h, "kind", "") == "local"],
                               columns=["node", "host", "key_type", "sha256", "check"]),
        facts_after=facts_after, frozen_before=before.frozen, frozen_after=frozen_after)


def _engine_rows(engine: str, info: dict[str, Any]) -> dict[str, Any]:
    """The engine as it reports itself: its version, ``/props`` and ``/server_info`` fields."""
    rows: dict[str, Any] = {"engine": engine}
    if "version" in info:
        rows["version"] = info["version"].splitlines()[0] if info["version"] else "-"
    props = info.get("/props") if isinstance(info.get("/props"), dict) else {}
    for k in ("build_info", "model_alias", "model_ftype", "total_slots", "bos_token", "eos_token"):
        if props.get(k) is not None:
            rows[k] = props[k]
    if props.get("chat_template") is not None:
        rows["chat_template"] = "present" if props["chat_template"] else "none (ChatML fallback)"
    sinfo = info.get("/server_info") if isinstance(info.get("/server_info"), dict) else {}
    for k in ("version", "model_path", "tp_size", "pp_size", "dp_size", "ep_size"):
        if sinfo.get(k) is not None:
            rows[f"server_info.{k}"] = sinfo[k]
    return rows


def _write(ctx: PhaseContext, result: Phase0Result, before: _Before, engine: _Engine) -> None:
    """``engine_info.json``, the facts, settings, model, freeze and change tables; the manifest's sections."""
    target, facts = ctx.target, result.facts
    write_json_atomic(ctx.phase_dir / "engine_info.json", redact(engine.info))
    facts.to_csv(ctx.phase_dir / "facts.csv", index=False)
    result.settings.to_csv(ctx.phase_dir / "settings.csv", index=False)
    result.model.to_csv(ctx.phase_dir / "model.csv", index=False)
    result.facts_after.to_csv(ctx.phase_dir / "facts_after.csv", index=False)
    for name, table in (("frozen", freeze_table), ("packages", packages_table), ("weights", weights_table),
                        ("state_before_after", state_table), ("changes", changes_table)):
        table(result).to_csv(ctx.phase_dir / f"{name}.csv", index=False)
    changes = changes_table(result)
    hosts_section = {n: {r["fact"]: r["value"] for _, r in facts[facts["node"] == n].iterrows()} for n in before.nodes}
    update_manifest(ctx.run_dir, hosts=hosts_section, security=before.security, host_keys=before.host_keys,
                    exposure=result.exposure, engine={"name": target.engine, **_engine_rows(target.engine, engine.info)},
                    model={r["field"]: r["value"] for _, r in result.model.iterrows()},
                    launch={"plans": engine.launch_rows, "env": target.env, "settings": target.launch},
                    rank_env=engine.rank_env.to_dict(orient="records"), frozen=frozen_manifest(result.frozen_before),
                    frozen_changes=[f"{r.node}: {r.what} {r.before} -> {r.after}"
                                    for r in changes[changes["kind"] == "frozen"].itertuples()])


def attached_phase0(ctx: PhaseContext, preflight: PreflightReport | None) -> Phase0Result:
    """Phase 0 on an attached server (``deploy.attach``): nothing started or stopped; what its endpoints say about
    it, the declared nodes' facts and process tables before and after, and one row per fact it could not know."""
    target = ctx.target
    nodes = {n.name: hostlib.connect(n) for n in target.nodes} if target.nodes_given else {}
    raw = ctx.phase_dir / "raw"
    empty = pd.DataFrame(columns=["node", "group", "fact", "value", "status"])

    def facts(sub: str) -> pd.DataFrame:
        return pd.concat([collect_facts(h, raw_dir=raw / n / sub) for n, h in nodes.items()], ignore_index=True) \
            if nodes else empty
    try:
        before, procs_before = facts(""), [process_snapshot(h) for h in nodes.values()]
        with hostlib.ProcessTracker() as tracker:
            srv = start_server(target, ctx.phase_dir / "logs", tracker, run_dir=ctx.run_dir, phase=ctx.phase,
                               hosts=nodes)
            info, unknown = endpoint_facts(srv, http_json, http_text)
            server = {"started": False, "attached": target.endpoint, "ready_s": round(srv.ready_s, 3),
                      "healthy": is_healthy(srv), "unknown": unknown}
            stop_server(srv, tracker, run_dir=ctx.run_dir, phase=ctx.phase)
        after = facts("after")
    finally:
        for h in nodes.values():
            h.close()
    pb = pd.concat(procs_before, ignore_index=True) if procs_before else pd.DataFrame(columns=["node", "pid"])
    ctx.notes += [f"{ATTACH_NOTE} ({target.endpoint})"] + [f"not known: {u['fact']} — {u['why']}" for u in unknown]
    props = info.get("/props") if isinstance(info.get("/props"), dict) else {}
    sinfo = info.get("/server_info") if isinstance(info.get("/server_info"), dict) else {}
    eng = {"engine": target.engine, "endpoint": target.endpoint,
           "version": props.get("build_info") or sinfo.get("version") or "not reported",
           **{f"not known: {u['fact']}": u["why"] for u in unknown}}
    result = Phase0Result(
        facts=before, launch=pd.DataFrame(columns=["node", "command", "port", "log"]), engine=_kv(eng, "field"),
        model=_kv({"served_model_name": target.served_model_name, "path": props.get("model_path") or
                   sinfo.get("model_path") or "not reported"}, "field"),
        settings=engine_settings({}, target.engine, info), comm_env=nccl_env({}), processes_before=pb,
        ports_before=pd.DataFrame(), processes_started=pd.DataFrame(columns=pb.columns),
        ports_opened=pd.DataFrame(), leftovers_after=pd.DataFrame(columns=pb.columns), server=server, preflight=preflight,
        facts_after=after)
    write_json_atomic(ctx.phase_dir / "engine_info.json", redact(info))
    before.to_csv(ctx.phase_dir / "facts.csv", index=False)
    result.settings.to_csv(ctx.phase_dir / "settings.csv", index=False)
    update_manifest(ctx.run_dir, engine={"name": target.engine, "attached": target.endpoint},
                    not_known=unknown, hosts={n: {r["fact"]: r["value"] for _, r in before[before["node"] == n].iterrows()}
                                              for n in nodes})
    return result


def headline(result: Phase0Result) -> dict[str, Any]:
    """The key numbers the manifest and the run index keep: nodes, engine start time, leftover processes."""
    return {"nodes": result.facts["node"].nunique(), "engine_ready_s": result.server.get("ready_s"),
            "leftover processes": len(result.leftovers_after)}


def verdict(result: Phase0Result) -> tuple[str, str]:
    """(status, why): Phase 0 fails when the frozen environment (image, engine, packages, model files) changed
    between before and after, or when a process the engine started outlived its stop."""
    left = result.leftovers_after
    changed = changes_table(result)
    changed = changed[changed["kind"] == "frozen"]
    if not changed.empty:
        what = "; ".join(f"{r.node} {r.what}: {str(r.before)[:40]} -> {str(r.after)[:40]}"
                         for r in changed.head(3).itertuples())
        return "failed", (f"the frozen environment changed while Phase 0 ran ({len(changed)} item(s)): {what} — "
                          "find what modified it, then run Phase 0 again")
    if left.empty:
        return "success", ""
    what = ", ".join(f"{r.node} pid {r.pid} ({str(r.command)[:60]})" for r in left.head(3).itertuples())
    return "failed", f"{len(left)} process(es) the engine started were still running after it stopped: {what}"


def freeze_findings(result: Phase0Result) -> list[str]:
    """The freeze in sentences: per node the engine, its commit, its packages, the model's checksum and how long
    hashing took; what changed between before and after; what could not be read."""
    out = []
    for node, f in result.frozen_before.items():
        e = f.engine
        parts = []
        if f.image is not None:
            parts.append(f"image {f.image.get('name')} ({str(f.image.get('id') or 'not on the node')[:19]})")
        eng = " ".join(x for x in (e.get("distribution") or e.get("name", ""), e.get("version", "")) if x)
        src = str(e.get("commit_source") or "-")
        parts.append(f"engine {eng or 'version not read'}, "
                     + (f"commit {e['commit'][:12]} (from {src})" if e.get("commit") else
                        "commit " + (src if src.startswith("not recorded") else f"not recorded ({src})")))
        if len(f.packages):
            parts.append(f"{len(f.packages)} Python packages read with {e.get('executable') or 'its interpreter'}")
        if len(f.weights):
            hashed = f.weights[f.weights["how"] == "hashed"]
            busy = float(hashed["seconds"].sum()) if len(hashed) else 0.0
            rate = hashed["bytes"].sum() / 2**20 / busy if busy >= 1.0 else None     # a rate only where it means one
            parts.append(f"{len(f.weights)} model file(s), {f.weights_bytes / 2**20:,.1f} MiB, sha256 "
                         f"{weights_fingerprint(f.weights)[:12]}…, hashed on the node in {f.weights_seconds:.2f} s"
                         + (f" ({rate:,.0f} MiB/s)" if rate else ""))
        out.append(f"Frozen on {node}: " + "; ".join(parts) + ".")
    if result.frozen_after:
        ch = changes_table(result)
        frozen, state = ch[ch["kind"] == "frozen"], ch[ch["kind"] == "state"]
        out.append(("Nothing frozen changed between before and after (image, engine, packages, model files)"
                    if frozen.empty else f"{len(frozen)} frozen item(s) CHANGED between before and after: "
                    + ", ".join(f"{r.node} {r.what}" for r in frozen.head(5).itertuples()))
                   + ("; GPU, container and network state identical." if state.empty else
                      "; state that differs after the run: " + ", ".join(sorted({f"{r.node} {r.what}"
                                                                                  for r in state.itertuples()})) + "."))
    out += [f"Not read: {n}" for n in freeze_notes(result)]
    return out


def findings(result: Phase0Result, start_engine: bool = True) -> list[str]:
    """What Phase 0 found, in sentences for the page's findings box: engine, version, model, topology, the
    engine's start and cleanup, and what could not be verified."""
    eng = dict(zip(result.engine["field"], result.engine["value"])) if not result.engine.empty else {}
    model = dict(zip(result.model["field"], result.model["value"])) if not result.model.empty else {}
    sett = result.settings.set_index("setting") if not result.settings.empty else pd.DataFrame()
    out = []
    version = str(eng.get("version") or eng.get("build_info") or eng.get("server_info.version") or "")
    version = version.removeprefix("version:").strip()
    frozen = next(iter(result.frozen_before.values()), None)
    if not version and frozen is not None and frozen.engine.get("version"):
        version = f"{frozen.engine['version']} (its installed package; the engine was not asked)"
    version = version or "not reported"
    name = Path(str(model.get("path", "-"))).name
    size = model.get("size_bytes")
    detail = []
    if size not in (None, "-"):
        detail.append(f"{int(size) / 2**20:,.1f} MiB")
    if model.get("sha256") not in (None, "-"):
        detail.append(f"sha256 {str(model['sha256'])[:12]}…")
    elif model.get("files_sha256") not in (None, "-", ""):
        detail.append(f"{model.get('files')} files, sha256 over all {str(model['files_sha256'])[:12]}…")
    arch = model.get("general.architecture") or model.get("config.model_type")
    if arch:
        detail.append(f"architecture {arch}")
    out.append(f"Engine {eng.get('engine', '-')}, version {version}, serving the model {name}"
               + (f" ({', '.join(detail)})" if detail else "") + ".")
    nodes = sorted(result.facts["node"].unique()) if not result.facts.empty else []
    gpus = result.facts[(result.facts["fact"] == "gpu_list") & (result.facts["status"] == "ok")] \
        if not result.facts.empty else result.facts
    gpu_text = "no GPU" if gpus.empty else "GPUs on " + ", ".join(sorted(gpus["node"]))
    if "topology TP/PP/DP/EP" in sett.index:
        t = sett.loc["topology TP/PP/DP/EP"]
        out.append(f"Topology TP/PP/DP/EP {t['configured']} configured, {t['live']} live, on {len(nodes)} node(s) "
                   f"({', '.join(nodes)}; {gpu_text}).")
    if result.preflight is not None:
        pre = result.preflight
        adv = [c for c in pre.checks if not c.required and c.result == "failed"]
        req = [c for c in pre.checks if c.required]
        out.append(f"Preflight passed on {len({c.node for c in pre.checks})} node(s): "
                   + (f"{sum(c.result == 'ok' for c in req)} required check(s) ok" if req else
                      "no check required by the target (all advisory)")
                   + ("; advisory failures: " + "; ".join(f"{c.node} {c.check} — {c.detail}" for c in adv)
                      if adv else "") + ".")
    if result.server.get("started"):
        left = len(result.leftovers_after)
        out.append(f"The engine became healthy in {float(result.server.get('ready_s', 0.0)):.2f} s and was stopped; "
                   + ("no process it started was left running." if left == 0 else
                      f"{left} process(es) it started were still running afterwards."))
    elif not start_engine:
        out.append("The engine was not started (start_engine=false): its launch command is only planned and no "
                   "live setting was verified.")
    out += freeze_findings(result)
    unverified = [s for s, r in sett.iterrows() if str(r["live"]) in ("-", "None", "")] if not sett.empty else []
    absent = sorted(set(result.facts.loc[result.facts["status"] != "ok", "fact"])) if not result.facts.empty else []
    if unverified:
        out.append("Not verified (the running engine does not report them; configured value only): "
                   + ", ".join(unverified) + ".")
    if absent:
        out.append("Not present or failed on the nodes: " + ", ".join(absent) + ".")
    out += [f"Exposure: {w}" for w in result.exposure]
    if not result.rank_env.empty and "verdict" in result.rank_env.columns:
        bad = result.rank_env[result.rank_env["verdict"].isin(["MISSING", "DIFFERENT"])]
        if len(bad):
            out.append(f"{len(bad)} communication variable(s) did not reach the rank processes as asked "
                       f"(MISSING or DIFFERENT): " + ", ".join(sorted(set(bad["variable"]))) + ".")
    return out
