"""Phase 0 — freeze the environment: what exactly is running, on every node, before and after.

``run_phase0`` does the whole phase inside one ``ProcessTracker`` (the engine is always stopped, even
on failure or Ctrl-C) and returns the tables the notebook shows. Raw probe outputs are written under
``<run>/phase0/raw/<node>/`` and the facts into ``manifest.json`` (hosts, engine, model).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.deploy import hosts as hostlib
from servelab.deploy.engines import engine_for
from servelab.deploy.facts import (NodeFreeze, freeze_summary, collect_facts, engine_env, freeze_node, gguf_facts,
                                   nccl_env, port_snapshot, process_snapshot, snapshot_diff, weights_fingerprint)
from servelab.phases.context import PhaseContext, log_command
from servelab.core.run import read_manifest, redact, update_manifest, write_json_atomic
from servelab.deploy.preflight import PreflightFailed, PreflightReport, ensure_preflight, fingerprint
from servelab.deploy.attach import ATTACH_NOTE, endpoint_facts
from servelab.deploy.server import (connect_nodes, engine_info, http_json, http_text, is_healthy, plan_launch,
                                    rank_environments, start_server, stop_server, version_argv)
from servelab.report.banner import banner


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
    Returns the report even when a required check failed: the page shows the table, then :func:`run_phase0`
    refuses to go on."""
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
        log_command(ctx, "executed", r.argv, title=f"freeze {frozen.moment}: {what} on {frozen.node}", host=frozen.node,
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
    """Phase 0's entry (the phase contract): the preflight this run recorded for the target (the notebook's
    :func:`preflight` step; run here when it has not run), then :func:`run_phase0` with the ``start_engine`` and
    ``health_timeout_s`` and ``rehash_after`` parameters."""
    rec = read_manifest(ctx.run_dir).get("preflight") or {}
    pre = (PreflightReport.from_manifest(rec) if rec.get("fingerprint") == fingerprint(ctx.target) and rec.get("checks")
           else preflight(ctx))
    return run_phase0(ctx, start_engine=ctx.params["start_engine"], health_timeout_s=ctx.params["health_timeout_s"],
                      preflight=pre, rehash_after=ctx.params["rehash_after"])


def run_phase0(ctx: PhaseContext, start_engine: bool = True, health_timeout_s: float = 900.0,
               preflight: PreflightReport | None = None, rehash_after: bool = False) -> Phase0Result:
    """Collect the Phase 0 facts on every node; freeze the engine's image, packages, commit and the model's
    checksums; start the engine, record how it runs, stop it, verify cleanup; take the facts and the freeze again
    after (``rehash_after``: hash every model file again, not only those whose size, mtime, ctime or inode changed).
    A ``preflight`` report with a failed required check stops here, before anything is started."""
    if preflight is not None and not preflight.passed:
        raise PreflightFailed(preflight)
    if ctx.target.attached:
        return attached_phase0(ctx, preflight)
    target = ctx.target
    raw = ctx.phase_dir / "raw"
    nodes = {n.name: hostlib.connect(n) for n in target.nodes}
    security = [{"node": h.name, "accepted_new_host_key": k} for h in nodes.values()
                for k in getattr(h, "accepted_keys", [])]
    host_keys = [dict(h.host_key, phase=ctx.phase) for h in nodes.values() if getattr(h, "host_key", None)]
    facts = pd.concat([collect_facts(h, raw_dir=raw / name) for name, h in nodes.items()], ignore_index=True)
    plans, model_path = plan_launch(target)        # the resolved launch: interpreter, image, model path per node
    frozen_before = freeze_nodes(ctx, nodes, plans, model_path, "before")
    procs_before = pd.concat([process_snapshot(h) for h in nodes.values()], ignore_index=True)
    ports_before = pd.concat([port_snapshot(h) for h in nodes.values()], ignore_index=True)
    launch_rows, info, server_info = [], {}, {"started": False}
    rank_env = pd.DataFrame()
    procs_started = pd.DataFrame(columns=procs_before.columns)
    ports_opened = pd.DataFrame(columns=ports_before.columns)
    with hostlib.ProcessTracker() as tracker:
        if start_engine:
            srv = start_server(target, ctx.phase_dir / "logs", tracker, run_dir=ctx.run_dir, phase=ctx.phase,
                               health_timeout_s=health_timeout_s, hosts=nodes)
            model_path = srv.model_path
            info = engine_info(srv)
            version_cmd = version_argv(srv)
            if version_cmd:
                v = nodes[target.head.name].run(version_cmd, timeout=30)
                info["version"] = (v.stdout + v.stderr).strip()
                log_command(ctx, "executed", version_cmd, title="engine version",
                            exit_code=v.exit_code, start=v.start, end=v.end)
            rank_env = rank_environments(srv)
            procs_during = pd.concat([process_snapshot(h) for h in nodes.values()], ignore_index=True)
            ports_during = pd.concat([port_snapshot(h) for h in nodes.values()], ignore_index=True)
            procs_started = descendants(procs_during, {n: h.pid for n, h in srv.handles.items()})
            ports_opened = snapshot_diff(ports_before, ports_during, ["node", "port"])
            server_info = {"started": True, "base_url": srv.base_url, "ready_s": round(srv.ready_s, 3),
                           "healthy_before_stop": is_healthy(srv), "logs": srv.log_paths}
            launch_rows = [{"node": p.node, "command": p.shell(), "port": p.port, "log": srv.log_paths[p.node]}
                           for p in srv.plans]
            server_info.update(stop_server(srv, tracker, run_dir=ctx.run_dir, phase=ctx.phase))
        else:
            for p in plans:
                log_command(ctx, "planned", p.argv, title=f"start {target.engine} on {p.node}", host=p.node,
                            env=p.env)
                launch_rows.append({"node": p.node, "command": p.shell(), "port": p.port, "log": "-"})
    procs_after = pd.concat([process_snapshot(h) for h in nodes.values()], ignore_index=True)
    leftovers = snapshot_diff(procs_before, procs_after, ["node", "pid"])
    started_pids = set(zip(procs_started["node"], procs_started["pid"]))
    leftovers = leftovers[[(n, p) in started_pids for n, p in zip(leftovers["node"], leftovers["pid"])]]
    # a zombie has exited (its parent, the stopped engine, is gone and this machine's init has not reaped it yet):
    # it holds no memory, port or device, so it is not a process left running
    leftovers = leftovers[~leftovers["state"].astype(str).str.startswith("Z")]
    facts_after = pd.concat([collect_facts(h, raw_dir=raw / name / "after") for name, h in nodes.items()],
                            ignore_index=True)
    frozen_after = freeze_nodes(ctx, nodes, plans, model_path, "after", before=frozen_before, rehash=rehash_after)
    for h in nodes.values():
        h.close()

    engine_rows = {"engine": target.engine}
    if "version" in info:
        engine_rows["version"] = info["version"].splitlines()[0] if info["version"] else "-"
    props = info.get("/props") if isinstance(info.get("/props"), dict) else {}
    for k in ("build_info", "model_alias", "model_ftype", "total_slots", "bos_token", "eos_token"):
        if props.get(k) is not None:
            engine_rows[k] = props[k]
    if props.get("chat_template") is not None:
        engine_rows["chat_template"] = "present" if props["chat_template"] else "none (ChatML fallback)"
    sinfo = info.get("/server_info") if isinstance(info.get("/server_info"), dict) else {}
    for k in ("version", "model_path", "tp_size", "pp_size", "dp_size", "ep_size"):
        if sinfo.get(k) is not None:
            engine_rows[f"server_info.{k}"] = sinfo[k]

    result = Phase0Result(
        facts=facts, launch=pd.DataFrame(launch_rows, columns=["node", "command", "port", "log"]),
        engine=_kv(engine_rows, "field"),
        model=model_facts(model_path, target.is_local, frozen_before.get(target.head.name)),
        settings=engine_settings(target.launch, target.engine, info), comm_env=nccl_env(target.env),
        processes_before=procs_before, ports_before=ports_before, processes_started=procs_started,
        ports_opened=ports_opened, leftovers_after=leftovers, rank_env=rank_env, server=server_info,
        preflight=preflight, start_engine=start_engine,
        exposure=exposure_warnings(target),
        exposure_notes=engine_for(target.engine).exposure_notes(target, bool(target.api_key_env)),
        host_keys=pd.DataFrame(host_keys + [{"node": h.name, "host": "this machine", "key_type": "—", "sha256": "—",
                                              "check": "no SSH: the node is the machine servelab runs on"}
                                             for h in nodes.values() if getattr(h, "kind", "") == "local"],
                               columns=["node", "host", "key_type", "sha256", "check"]),
        facts_after=facts_after, frozen_before=frozen_before, frozen_after=frozen_after)
    write_json_atomic(ctx.phase_dir / "engine_info.json", redact(info))
    facts.to_csv(ctx.phase_dir / "facts.csv", index=False)
    result.settings.to_csv(ctx.phase_dir / "settings.csv", index=False)
    result.model.to_csv(ctx.phase_dir / "model.csv", index=False)
    facts_after.to_csv(ctx.phase_dir / "facts_after.csv", index=False)
    for name, table in (("frozen", freeze_table), ("packages", packages_table), ("weights", weights_table),
                        ("state_before_after", state_table), ("changes", changes_table)):
        table(result).to_csv(ctx.phase_dir / f"{name}.csv", index=False)
    changes = changes_table(result)
    hosts_section = {n: {r["fact"]: r["value"] for _, r in facts[facts["node"] == n].iterrows()} for n in nodes}
    update_manifest(ctx.run_dir, hosts=hosts_section, security=security, host_keys=host_keys,
                    exposure=result.exposure,
                    engine={"name": target.engine, **{k: v for k, v in engine_rows.items()}},
                    model={r["field"]: r["value"] for _, r in result.model.iterrows()},
                    launch={"plans": launch_rows, "env": target.env, "settings": target.launch},
                    rank_env=rank_env.to_dict(orient="records"), frozen=frozen_manifest(result.frozen_before),
                    frozen_changes=[f"{r.node}: {r.what} {r.before} -> {r.after}"
                                    for r in changes[changes["kind"] == "frozen"].itertuples()])
    return result


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


# ---------------------------------------------------------------- the freeze, before and after

STATE_FACTS = ("gpu_query", "gpu_list", "gpu_driver", "gpu_topology", "nccl_library", "containers", "docker",
               "rdma_devices", "netdevs", "addresses")


def _changed(a: Any, b: Any) -> str:
    return "same" if str(a) == str(b) else "CHANGED"


def _freeze_items(f: NodeFreeze) -> dict[str, str]:
    e, w = f.engine, f.weights
    eng = " ".join(x for x in (e.get("distribution") or e.get("name", ""), e.get("version", "")) if x)
    items = {}
    if f.image is not None:
        items["image"] = str(f.image.get("name") or "-")
        items["image id"] = str(f.image.get("id") or "not on the node")
        items["image digest"] = ", ".join(f.image.get("digests") or []) or "-"
    items.update({
        "engine": eng or "-",
        "engine commit": e.get("commit") or "-",
        "commit from": e.get("commit_source") or "-",
        "runs as": f"Python {e['python']} {e.get('executable', '')}" if e.get("python") else
                   (e.get("executable") or "-"),
        **({"executable sha256": e["executable_sha256"]} if e.get("executable_sha256") else {}),
        "packages": f"{len(f.packages)} distributions" if len(f.packages) else "-",
        "model files": f"{len(w)} files, {f.weights_bytes / 2**20:,.1f} MiB" if len(w) else "-",
        "weights sha256": weights_fingerprint(w) or "-",
    })
    return items


def freeze_table(result: Phase0Result) -> pd.DataFrame:
    """Per node: image, image id, engine, its commit (and where it comes from), interpreter, package count, model
    files and one sha256 over every model file — before the engine started and after it stopped."""
    rows = []
    for node, before in result.frozen_before.items():
        after = result.frozen_after.get(node)
        b, a = _freeze_items(before), _freeze_items(after) if after is not None else {}
        for item, v in b.items():
            rows.append({"node": node, "item": item, "before": v, "after": a.get(item, "not taken"),
                         "changed": _changed(v, a.get(item, "not taken")) if after is not None else "-"})
    return pd.DataFrame(rows, columns=["node", "item", "before", "after", "changed"])


def packages_table(result: Phase0Result) -> pd.DataFrame:
    """Every Python distribution the engine's interpreter sees, one row per package, a version column per node
    before and after, where it was installed from; changed rows first."""
    frames = []
    for node, before in result.frozen_before.items():
        for moment, f in (("before", before), ("after", result.frozen_after.get(node))):
            if f is None or f.packages.empty:
                continue
            frames.append(f.packages.assign(col=f"{node} {moment}"))
    if not frames:
        return pd.DataFrame({"note": ["no Python packages read: a compiled engine, or its interpreter could not be "
                                      "run (see the notes under the freeze table)"]})
    allp = pd.concat(frames, ignore_index=True)
    wide = allp.pivot_table(index="package", columns="col", values="version", aggfunc="first").reset_index()
    cols = [c for c in dict.fromkeys(allp["col"]) if c in wide.columns]
    src = allp.drop_duplicates("package").set_index("package")
    wide["installed from"] = wide["package"].map(src["installed_from"])
    wide["commit"] = wide["package"].map(src["commit"]).replace("", "-")
    wide["changed"] = wide[cols].astype(str).nunique(axis=1).map(lambda n: "same" if n <= 1 else "CHANGED")
    wide = wide[["package", *cols, "installed from", "commit", "changed"]].fillna("absent")
    wide.columns.name = None
    wide = wide.assign(_same=wide["changed"].eq("same"), _name=wide["package"].str.lower())
    out = wide.sort_values(["_same", "_name"]).drop(columns=["_same", "_name"]).reset_index(drop=True)
    out.attrs["max_rows"] = len(out)          # the page lists every package (the method asks for all of them)
    return out


def weights_table(result: Phase0Result) -> pd.DataFrame:
    """Every model file per node: size, sha256 before and after, how long hashing it took and how the after value
    was obtained (hashed again, or unchanged size/mtime/ctime/inode since it was hashed)."""
    rows = []
    for node, before in result.frozen_before.items():
        after = result.frozen_after.get(node)
        amap = {r.file: r for r in after.weights.itertuples()} if after is not None and len(after.weights) else {}
        for r in before.weights.itertuples():
            a = amap.get(r.file)
            rows.append({"node": node, "file": r.file, "size (MiB)": r.bytes / 2**20, "sha256 before": r.sha256,
                         "hashed in (s)": r.seconds, "sha256 after": a.sha256 if a is not None else "absent",
                         "after": a.how if a is not None else "file gone",
                         "changed": _changed(r.sha256, a.sha256) if a is not None else "CHANGED"})
        for f, a in amap.items():
            if f not in set(before.weights["file"]):
                rows.append({"node": node, "file": f, "size (MiB)": a.bytes / 2**20, "sha256 before": "absent",
                             "hashed in (s)": None, "sha256 after": a.sha256, "after": "new file",
                             "changed": "CHANGED"})
    if not rows:
        notes = [n for f in result.frozen_before.values() for n in (f.notes or []) if "checksum" in n]
        return pd.DataFrame({"note": notes or ["no model file was hashed"]})
    out = pd.DataFrame(rows)
    out.attrs["max_rows"] = len(out)          # every model file's checksum on the page
    return out


def state_table(result: Phase0Result) -> pd.DataFrame:
    """GPU, container and network state per node (the facts of :data:`STATE_FACTS`) before the engine started and
    after it stopped."""
    if result.facts_after.empty:
        return pd.DataFrame(columns=["node", "fact", "before", "after", "changed"])
    key = ["node", "fact"]
    b = result.facts[result.facts["fact"].isin(STATE_FACTS)].set_index(key)
    a = result.facts_after[result.facts_after["fact"].isin(STATE_FACTS)].set_index(key)
    rows = []
    for k in b.index:
        bv = b.loc[k, "value"] if b.loc[k, "status"] == "ok" else b.loc[k, "status"]
        av = (a.loc[k, "value"] if a.loc[k, "status"] == "ok" else a.loc[k, "status"]) if k in a.index else "not taken"
        rows.append({"node": k[0], "group": b.loc[k, "group"], "fact": k[1], "before": bv, "after": av,
                     "changed": _changed(bv, av)})
    return pd.DataFrame(rows, columns=["node", "group", "fact", "before", "after", "changed"])


def changes_table(result: Phase0Result) -> pd.DataFrame:
    """Everything that differs between before and after: frozen items, packages and model files (``frozen``: each
    is a failure of the freeze) and GPU, container and network state (``state``: shown, judged by the reader)."""
    rows = []
    ft = freeze_table(result)
    for r in ft[ft["changed"] == "CHANGED"].itertuples():
        rows.append({"kind": "frozen", "node": r.node, "what": r.item, "before": r.before, "after": r.after})
    pt = packages_table(result)
    if "changed" in pt.columns:
        for _, r in pt[pt["changed"] == "CHANGED"].iterrows():
            for node in result.frozen_before:
                if f"{node} before" in r and str(r[f"{node} before"]) != str(r.get(f"{node} after")):
                    rows.append({"kind": "frozen", "node": node, "what": f"package {r['package']}",
                                 "before": r[f"{node} before"], "after": r.get(f"{node} after", "absent")})
    wt = weights_table(result)
    if "changed" in wt.columns:
        for _, r in wt[wt["changed"] == "CHANGED"].iterrows():
            rows.append({"kind": "frozen", "node": r["node"], "what": f"model file {r['file']}",
                         "before": r["sha256 before"], "after": r["sha256 after"]})
    st = state_table(result)
    for r in st[st["changed"] == "CHANGED"].itertuples():
        rows.append({"kind": "state", "node": r.node, "what": r.fact, "before": r.before, "after": r.after})
    return pd.DataFrame(rows, columns=["kind", "node", "what", "before", "after"])


def frozen_manifest(frozen: dict[str, NodeFreeze]) -> dict[str, Any]:
    """What the manifest keeps of the freeze (taken before the engine started), per node: image and image id,
    engine, commit, interpreter, every package's version and every model file's sha256 — the keys the A/B guard
    (:func:`servelab.measure.abtest.diff_manifests`) compares between runs."""
    return {node: freeze_summary(f) for node, f in frozen.items()}


def freeze_notes(result: Phase0Result) -> list[str]:
    """What the freeze could not read, per node and moment, in sentences."""
    return [f"{f.node} ({f.moment}): {n}" for fr in (result.frozen_before, result.frozen_after)
            for f in fr.values() for n in (f.notes or [])]


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
