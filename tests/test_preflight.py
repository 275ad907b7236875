"""Fail-closed start, for real: the per-node preflight on two SSH 'nodes' (real sshd on 127.0.0.2 and 127.0.0.3)
and on this machine, and the NCCL transport gate enforced at the engine start of a real llama-server — plus the
gate's reading of real public NCCL INFO logs through the same function the engine start uses."""
from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest
import yaml

from servelab.core.params import ParamError
from servelab.core.run import init_run, read_commands, read_manifest
from servelab.deploy.hosts import LocalHost, ProcessTracker
from servelab.deploy.nccl_gate import GATE_ENV, GateRefused, gate_env, gate_from_folder, with_gate_env
from servelab.deploy.preflight import PreflightFailed, cached, ensure_preflight, run_preflight
from servelab.deploy.server import connect_nodes, start_server
from servelab.deploy.start_checks import GATE_LOG_DIR, after_healthy
from servelab.deploy.targets import target_from_dict

sys.path.insert(0, str(Path(__file__).parent))
from sshd import sshd_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = Path(__file__).parent / "data" / "nccl_public"        # real logs from public issues; origins in README.md
LOCAL_TINY = yaml.safe_load((ROOT / "params/targets/local-tiny.yaml").read_text())


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    yield from sshd_pair(tmp_path_factory)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def two_nodes(a, b, known: Path, work: Path, preflight: dict, name: str = "two-node-pf"):
    node = dict(kind="ssh", user="root", known_hosts=str(known))
    return target_from_dict({
        "name": name, "engine": "llamacpp", "model": "tiny", "served_model_name": "tiny", "api_host": "127.0.0.2",
        "launch": {"context_length": 4096, "parallel": 4, "threads": 1, "rpc_port": free_port("127.0.0.3")},
        "preflight": preflight,
        "nodes": [dict(node, name="head", role="head", host="127.0.0.2", port=a.port, key_file=str(a.client_key),
                       workdir=str(work / "head")),
                  dict(node, name="worker", role="worker", host="127.0.0.3", port=b.port, key_file=str(b.client_key),
                       workdir=str(work / "worker"))]})


def rows(report, check: str) -> dict:
    t = report.table
    return {r["node"]: r for r in t[t["check"] == check].to_dict(orient="records")}


def processes_with(arg: str) -> list[str]:
    """Command lines of llama-server / ggml-rpc-server processes that carry ``arg`` as one argument."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            argv = (p / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and ("llama-server" in argv[0] or "rpc-server" in argv[0]) and arg in argv:
            out.append(" ".join(argv))
    return out


# ---------------------------------------------------------------- bad input: before any side effect

def test_preflight_and_gate_keys_are_checked_when_the_target_is_read():
    base = {"name": "x", "engine": "llamacpp", "model": "tiny"}
    with pytest.raises(ParamError, match="unknown preflight key 'netdev' \\(did you mean 'netdevs'\\?\\)"):
        target_from_dict({**base, "preflight": {"netdev": ["lo"]}})
    with pytest.raises(ParamError, match="'ports_free' must list ports"):
        target_from_dict({**base, "preflight": {"ports_free": [70000]}})
    with pytest.raises(ParamError, match="gate 'require' must be a list"):
        target_from_dict({**base, "gate": {"require": "NET/IB"}})
    with pytest.raises(ParamError, match="unknown transport 'NET/XX'"):
        target_from_dict({**base, "gate": {"require": ["NET/XX"]}})
    t = target_from_dict({**base, "preflight": {"netdevs": True, "disk_free_gb": 1, "max_clock_offset_ms": 5}})
    assert t.preflight["netdevs"] is True


def test_a_gated_target_starts_with_nccl_info_and_an_ungated_one_unchanged():
    base = {"name": "x", "engine": "llamacpp", "model": "tiny", "env": {"NCCL_DEBUG": "WARN"}}
    plain = target_from_dict(base)
    assert with_gate_env(plain) is plain
    gated = with_gate_env(target_from_dict({**base, "gate": {"require": ["NET/IB"]}}))
    assert gated.env["NCCL_DEBUG"] == "INFO" and gated.env["NCCL_DEBUG_SUBSYS"] == GATE_ENV["NCCL_DEBUG_SUBSYS"]
    assert gate_env({"NCCL_DEBUG_SUBSYS": "TUNING"})["NCCL_DEBUG_SUBSYS"] == "TUNING,INIT,NET"
    assert gate_env({"NCCL_DEBUG_SUBSYS": "ALL"})["NCCL_DEBUG_SUBSYS"] == "ALL"


def test_start_check_snapshots_are_volatile_in_an_ab_manifest_diff(tmp_path):
    """Two runs' preflight (free disk, clock offsets, when) and gate records differ by nature: no A/B confound."""
    from servelab.measure.abtest import RunRef, diff_manifests
    a = {"launch": {"settings": {"parallel": 4}}, "preflight": {"when": "t1", "clock": {"w": {"offset_ms": 0.1}},
                                                               "checks": [{"detail": "78.3 GB free"}]},
         "gate": {"when": "t1", "logs": {"head": "/a/head.log"}}}
    b = {"launch": {"settings": {"parallel": 8}}, "preflight": {"when": "t2", "clock": {"w": {"offset_ms": -0.2}},
                                                               "checks": [{"detail": "77.9 GB free"}]},
         "gate": {"when": "t2", "logs": {"head": "/b/head.log"}}}
    d = diff_manifests([RunRef("a", tmp_path, a, "A"), RunRef("b", tmp_path, b, "B")], "parallel")
    status = dict(zip(d["key"], d["status"]))
    assert status.pop("launch.settings.parallel") == "declared" and set(status.values()) == {"volatile"}


# ---------------------------------------------------------------- preflight on this machine

def test_local_preflight_required_and_advisory_and_not_applicable(tmp_path, outputs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t = target_from_dict({**LOCAL_TINY, "preflight": {"netdevs": ["lo", "eth9"], "ports_free": [port],
                                                          "disk_free_gb": 0.001, "gpus_idle": True}})
        rep = run_preflight(t, {"local": LocalHost("local")}, tmp_path / "not-yet" / "made")
    assert not rep.passed
    assert rows(rep, "netdevs up")["local"]["result"] == "failed"
    assert "eth9: no such device (/sys/class/net/eth9 missing)" in rows(rep, "netdevs up")["local"]["detail"]
    p = rows(rep, "ports free")["local"]
    assert p["result"] == "failed" and p["required"] == "yes" and f"{port} in use" in p["detail"]
    d = rows(rep, "disk free")["local"]
    assert d["result"] == "ok" and d["required"] == "yes" and "not yet created" in d["detail"]
    h = rows(rep, "hcas up")["local"]
    assert h["result"] == "n/a" and h["required"] == "no"             # no HCA declared, none required
    if shutil.which("nvidia-smi") is None:
        g = rows(rep, "gpus idle")["local"]
        assert g["result"] == "n/a" and "gpus: 0" in g["detail"]      # required, but nothing to check: not a failure
        assert "gpus" not in rep.reason
    assert rows(rep, "clock offset")["local"]["result"] == "n/a"        # the head is the reference clock
    assert "\n" not in rep.reason and "eth9" in rep.reason and str(port) in rep.reason
    assert set(rep.table["result"]) <= {"ok", "failed", "n/a"}


SMI = Path(__file__).parent / "data" / "nvidia_smi_h200"      # real nvidia-smi output of an H200; origin in README.md


class RecordedSmiHost(LocalHost):
    """This machine, except that ``nvidia-smi`` answers with what a real H200 node printed (``SMI``)."""

    def __init__(self, state: str):
        super().__init__("gpu-node")
        self.state = state

    def run(self, argv, env=None, cwd=None, timeout=60):
        if argv[0] != "nvidia-smi":
            return super().run(argv, env, cwd, timeout)
        what = "query_gpu" if argv[1].startswith("--query-gpu=") else "compute_apps"
        return super().run(["cat", str(SMI / f"{what}_{self.state}.csv")], timeout=timeout)


def test_gpus_visible_and_idle_from_real_h200_output():
    from servelab.deploy.preflight import check_gpus
    t = target_from_dict({"name": "g", "engine": "llamacpp", "model": "tiny", "preflight": {"gpus_idle": True},
                          "nodes": [{"name": "gpu-node", "gpus": 1}]})
    vis, idle = check_gpus(RecordedSmiHost("idle"), t, t.nodes[0])
    assert (vis.result, vis.required) == ("ok", True) and "1 visible (NVIDIA H200)" in vis.detail
    assert idle.result == "ok" and "no compute process" in idle.detail and "0 MiB" in idle.detail
    vis, idle = check_gpus(RecordedSmiHost("busy"), t, t.nodes[0])
    assert vis.result == "ok" and idle.result == "failed"
    assert idle.detail == "1 compute process(es) hold GPUs: pid 552 /opt/torch/.venv/bin/python3 (4614 MiB)"
    eight = target_from_dict({"name": "g", "engine": "llamacpp", "model": "tiny", "preflight": {"gpus_idle": True},
                              "nodes": [{"name": "gpu-node", "gpus": 8}]})
    vis, _ = check_gpus(RecordedSmiHost("idle"), eight, eight.nodes[0])
    assert vis.result == "failed" and vis.detail == "1 GPU(s) visible, the node declares 8"


# ---------------------------------------------------------------- preflight on two SSH nodes

@pytest.mark.slow
def test_two_ssh_nodes_pass_with_lo_and_state_their_clock_offset_with_its_uncertainty(nodes, tmp_path, outputs):
    a, b, known = nodes
    t = two_nodes(a, b, known, tmp_path, {"netdevs": ["lo"], "max_clock_offset_ms": 1000})
    rdir = init_run("pf-lo", t.name)
    hosts = connect_nodes(t)
    try:
        rep = ensure_preflight(t, hosts, run_dir=rdir, phase="phase0")
        again = ensure_preflight(t, hosts, run_dir=rdir, phase="phase1")
    finally:
        for h in hosts.values():
            h.close()
    assert rep.passed and not rep.reused, rep.reason
    net = rows(rep, "netdevs up")
    assert {n: (r["required"], r["result"]) for n, r in net.items()} == {"head": ("yes", "ok"), "worker": ("yes", "ok")}
    assert "lo administratively up" in net["worker"]["detail"]
    clock = rows(rep, "clock offset")
    assert clock["head"]["result"] == "n/a"
    assert clock["worker"]["result"] == "ok" and "±" in clock["worker"]["detail"] and "vs head" in clock["worker"]["detail"]
    off, unc = rep.clock["worker"]["offset_ms"], rep.clock["worker"]["uncertainty_ms"]
    # both "nodes" are this machine: the true offset is 0, and the stated uncertainty must cover it
    assert unc > 0 and abs(off) <= unc
    if shutil.which("nvidia-smi") is None:
        assert {r["result"] for r in rows(rep, "gpus visible").values()} == {"n/a"}
    m = read_manifest(rdir)["preflight"]
    assert m["passed"] and m["phase"] == "phase0" and m["fingerprint"] == rep.fingerprint
    assert len(m["checks"]) == len(rep.checks) and m["clock"]["worker"]["uncertainty_ms"] == unc
    assert again.reused and again.phase == "phase0" and cached(rdir, t) is not None     # phase 1 does not repeat it


@pytest.mark.slow
def test_a_missing_rail_refuses_the_start_before_any_engine(nodes, tmp_path, outputs, llama_server_binary):
    a, b, known = nodes
    t = two_nodes(a, b, known, tmp_path, {"netdevs": ["lo", "eth9"]})
    rdir = init_run("pf-eth9", t.name)
    rpc = str(t.launch["rpc_port"])
    with ProcessTracker() as tracker:
        with pytest.raises(PreflightFailed) as ei:
            start_server(t, tmp_path / "logs", tracker, run_dir=rdir, phase="phase1", health_timeout_s=60)
        assert tracker.entries == []                                  # nothing was started on any node
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("preflight refused to start on target 'two-node-pf'")
    assert "head: netdevs up — eth9: no such device" in msg and "worker: netdevs up — eth9: no such device" in msg
    m = read_manifest(rdir)["preflight"]
    assert m["passed"] is False and m["reason"] == msg
    assert not [r for r in read_commands(rdir) if r.label == "executed" and r.title.startswith("start")]
    assert not (tmp_path / "head" / "logs").exists() and not (tmp_path / "worker" / "logs").exists()
    assert processes_with(rpc) == []
    assert cached(rdir, t) is None                                    # a refusal is checked again next time


@pytest.mark.slow
def test_a_port_in_use_on_a_node_is_found_by_a_bind_test_there(nodes, tmp_path):
    a, b, known = nodes
    with socket.socket() as busy:
        busy.bind(("127.0.0.3", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t = two_nodes(a, b, known, tmp_path, {"ports_free": [port]})
        hosts = connect_nodes(t)
        rep = run_preflight(t, hosts)
        busy.close()
        free = run_preflight(t, hosts)
    for h in hosts.values():
        h.close()
    w = rows(rep, "ports free")["worker"]
    assert w["result"] == "failed" and w["required"] == "yes" and f"{port} in use" in w["detail"]
    assert "bind test" in w["detail"] and not rep.passed and f"worker: ports free — {port} in use" in rep.reason
    assert rows(free, "ports free")["worker"]["result"] == "ok" and free.passed


@pytest.mark.slow
def test_the_gate_reads_every_nodes_log_over_ssh_and_names_the_offending_ranks(nodes, tmp_path, outputs):
    """Each SSH node's engine log is fetched (SFTP) the way the engine start fetches it: the head's log is the
    public IBext one (NVIDIA/nccl#1453), the worker's the public NET/Socket one (NVIDIA/nccl#952)."""
    a, b, known = nodes
    t = two_nodes(a, b, known, tmp_path, {})
    t = target_from_dict({**{k: getattr(t, k) for k in ("name", "engine", "model")},
                          "nodes": [vars(n) for n in t.nodes], "gate": {"require": ["NET/IB", "GDRDMA"]}})
    rdir = init_run("gate-ssh", t.name)
    hosts = connect_nodes(t)
    try:
        ok = after_healthy(t, hosts, {"head": str(PUBLIC / "nccl1453_tagged_ibext.log"),
                                      "worker": str(PUBLIC / "nccl1453_tagged_ibext.log")},
                           tmp_path / "ok", rdir, "phase1")
        with pytest.raises(GateRefused) as ei:
            after_healthy(t, hosts, {"head": str(PUBLIC / "nccl1453_tagged_ibext.log"),
                                     "worker": str(PUBLIC / "nccl952_redacted_host.log")},
                          tmp_path / "bad", rdir, "phase1")
        with pytest.raises(GateRefused, match="engine log not collected from worker"):
            after_healthy(t, hosts, {"head": str(PUBLIC / "nccl1453_tagged_ibext.log"),
                                     "worker": str(tmp_path / "no-such.log")}, tmp_path / "gone", rdir, "phase1")
    finally:
        for h in hosts.values():
            h.close()
    assert ok.passed
    assert "NET/Socket instead of NET/IB (ranks 15)" in str(ei.value)
    assert (tmp_path / "bad" / GATE_LOG_DIR / "worker.log").read_bytes() == \
        (PUBLIC / "nccl952_redacted_host.log").read_bytes()
    assert read_manifest(rdir)["gate"]["passed"] is False


# ---------------------------------------------------------------- the transport gate

def test_the_gate_passes_a_real_public_ibext_log_read_the_way_the_engine_start_reads_it(tmp_path, outputs):
    """NVIDIA/nccl#1453 (origin in tests/data/nccl_public/README.md): channels via NET/IBext_v8/…/GDRDMA."""
    t = target_from_dict({"name": "gated", "engine": "llamacpp", "model": "tiny",
                          "gate": {"require": ["NET/IB", "GDRDMA"]}})
    rdir = init_run("gate-pass", t.name)
    v = after_healthy(t, {"local": LocalHost("local")}, {"local": str(PUBLIC / "nccl1453_tagged_ibext.log")},
                      tmp_path / "logs", rdir, "phase1")
    assert v.passed and v.verdict == "PASS" and "NET/IB + GDRDMA proven" in v.message
    g = read_manifest(rdir)["gate"]
    assert g["passed"] and g["verdict"] == "PASS" and not g["engine_stopped"] and g["phase"] == "phase1"
    copied = Path(g["logs"]["local"])
    assert copied.parent == tmp_path / "logs" / GATE_LOG_DIR and copied.read_bytes() == \
        (PUBLIC / "nccl1453_tagged_ibext.log").read_bytes()
    assert gate_from_folder(t.gate, copied.parent).passed


def test_the_gate_refuses_a_real_socket_fallback_log_and_says_so(tmp_path, outputs):
    """NVIDIA/nccl#952: inter-node channels on NET/Socket."""
    t = target_from_dict({"name": "gated", "engine": "llamacpp", "model": "tiny", "gate": {"require": ["NET/IB"]}})
    rdir = init_run("gate-socket", t.name)
    with pytest.raises(GateRefused) as ei:
        after_healthy(t, {"local": LocalHost("local")}, {"local": str(PUBLIC / "nccl952_redacted_host.log")},
                      tmp_path / "logs", rdir, "phase1")
    assert "NET/Socket instead of NET/IB" in str(ei.value) and "\n" not in str(ei.value)
    g = read_manifest(rdir)["gate"]
    assert g["passed"] is False and g["engine_stopped"] and g["verdict"] == "REFUSED"
    assert {r["rank"] for r in g["per_rank"]} == {10, 12, 15}


def test_an_older_starts_nccl_lines_in_the_same_log_prove_nothing(tmp_path, outputs):
    """A node's log is appended to across starts: only what this start wrote (from the size before it) is read."""
    from servelab.deploy.start_checks import log_size
    t = target_from_dict({"name": "gated", "engine": "llamacpp", "model": "tiny", "gate": {"require": ["NET/IB"]}})
    log = tmp_path / "llamacpp_local.log"
    host = LocalHost("local")
    assert log_size(host, log) == 0
    log.write_bytes((PUBLIC / "nccl1453_tagged_ibext.log").read_bytes())      # an earlier start that passed
    before = log_size(host, log)
    assert before == log.stat().st_size > 0
    with log.open("a") as f:
        f.write("main: server is listening on http://127.0.0.1:8080 - starting the main loop\n")
    rdir = init_run("gate-offset", t.name)
    assert after_healthy(t, {"local": host}, {"local": str(log)}, tmp_path / "all", rdir, "phase1").passed
    with pytest.raises(GateRefused, match="no rank printed NCCL INFO lines"):
        after_healthy(t, {"local": host}, {"local": str(log)}, tmp_path / "new", rdir, "phase1", {"local": before})
    assert (tmp_path / "new" / GATE_LOG_DIR / "local.log").read_text().startswith("main: server is listening")


def test_an_empty_rank_log_folder_is_refused(tmp_path):
    assert not gate_from_folder({"require": ["NET/IB"]}, tmp_path).passed
    assert gate_from_folder({}, tmp_path).verdict == "no gate configured"


@pytest.mark.slow
def test_a_gated_local_engine_without_nccl_lines_is_stopped_fail_closed(tmp_path, outputs, llama_server_binary,
                                                                        capsys):
    """llama.cpp prints no NCCL line: the engine starts with NCCL_DEBUG=INFO, becomes healthy, the gate finds no
    rank's INFO lines, the engine is stopped and Phase 1 fails with that reason — terminal, manifest, page; Phase 5
    of the same run shows the same verdict."""
    from servelab.cli import main
    path = tmp_path / "local-tiny-gated.yaml"
    path.write_text(yaml.safe_dump({**LOCAL_TINY, "name": "local-tiny-gated", "gate": {"require": ["NET/IB"]}}))
    rc = main(["run", "phase1", "--target", str(path), "--run-id", "gated"])
    out = capsys.readouterr().out
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith("phase1: failed — GateRefused: REFUSED") and "no rank printed NCCL INFO lines" in first
    rdir = outputs / "gated"
    m = read_manifest(rdir)
    assert "no rank printed NCCL INFO lines" in m["phases"]["phase1"]["error"]
    assert m["gate"]["passed"] is False and m["gate"]["engine_stopped"] and m["gate"]["phase"] == "phase1"
    start = next(r for r in read_commands(rdir, "phase1") if r.title.startswith("start llamacpp"))
    assert start.env["NCCL_DEBUG"] == "INFO" and start.env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    port = start.argv[start.argv.index("--port") + 1]
    assert processes_with(port) == []                                 # the engine was stopped
    assert not (rdir / "cases").exists() or not any((rdir / "cases").iterdir())   # nothing measured
    page = (rdir / "phase1" / "report.html").read_text()
    banner = page[page.index('class="servelab-failed"'):][:3000]
    assert "no rank printed NCCL INFO lines" in banner
    assert main(["run", "phase5", "--target", str(path), "--run-id", "gated"]) == 0
    p5 = (rdir / "phase5" / "report.html").read_text()
    assert "stopped by the gate" in p5 and "no rank printed NCCL INFO lines" in p5


@pytest.mark.slow
def test_phase0_shows_the_preflight_table_and_stops_before_the_engine(tmp_path, outputs, llama_server_binary, capsys):
    from servelab.cli import main
    path = tmp_path / "local-tiny-eth9.yaml"
    path.write_text(yaml.safe_dump({**LOCAL_TINY, "name": "local-tiny-eth9", "preflight": {"netdevs": ["lo", "eth9"]}}))
    rc = main(["run", "phase0", "--target", str(path), "--run-id", "pf0"])
    out = capsys.readouterr().out
    assert rc == 1 and "phase0: failed — PreflightFailed: preflight refused" in out and "eth9" in out.splitlines()[0]
    rdir = outputs / "pf0"
    m = read_manifest(rdir)
    assert m["preflight"]["passed"] is False and "eth9" in m["phases"]["phase0"]["error"]
    assert not [r for r in read_commands(rdir, "phase0") if r.title.startswith("start llamacpp")]
    page = (rdir / "phase0" / "report.html").read_text()
    assert "eth9" in page[page.index('class="servelab-failed"'):][:3000]
    assert "eth9: no such device" in page and "lo administratively up" in page        # the table is on the page
    assert (rdir / "phase0" / "preflight.csv").exists()


@pytest.mark.slow
def test_the_preflight_clock_offset_of_an_ssh_node_lands_where_the_one_clock_join_reads_it(nodes, tmp_path, outputs):
    import json

    import polars as pl

    from servelab.analyse.trace.stalls import CASE_CLOCK_FILE, clock_shift, shift_windows
    from servelab.core.run import update_manifest, write_json_atomic
    from servelab.measure.capture import case_clock_record
    a, b, known = nodes
    t = two_nodes(a, b, known, tmp_path, {}, name="two-node-clock")
    rdir = init_run("pf-clock", t.name)
    hosts = connect_nodes(t)
    try:
        rep = ensure_preflight(t, hosts, run_dir=rdir, phase="phase3")
    finally:
        for h in hosts.values():
            h.close()
    m = read_manifest(rdir)["preflight"]
    vs = {n: m["clock"][n]["vs_client"] for n in ("head", "worker")}
    # both sshd "nodes" are this machine: offset 0 within the stated uncertainty, measured over a real round trip
    assert all(v["uncertainty_ns"] > 0 and abs(v["offset_ns"]) <= v["uncertainty_ns"] for v in vs.values()), vs
    # the capture writes it beside the case's traces …
    case = tmp_path / "cases" / "M1-profile--profile-mixed_treatment"
    (case / "profiles" / "worker").mkdir(parents=True)
    write_json_atomic(case / CASE_CLOCK_FILE, case_clock_record(rdir, t))
    rec = json.loads((case / CASE_CLOCK_FILE).read_text())
    assert rec["measured_at"] == rep.when and rec["client"] == "the servelab machine"
    assert {n: rec["nodes"][n]["offset_ns"] for n in vs} == {n: v["offset_ns"] for n, v in vs.items()}
    # … and the join reads it from there (no manifest needed) and moves each rank by its node's offset
    sh = clock_shift(case, {0: "head", 1: "worker"})
    assert not sh.refused and sh.offsets_ns == {n: v["offset_ns"] for n, v in vs.items()}
    assert sh.uncertainty_ms == max(v["uncertainty_ns"] for v in vs.values()) / 1e6
    w = pl.DataFrame({"rank": [0, 1], "cpu_start_ns": [10**18, 10**18], "cpu_end_ns": [10**18 + 5, 10**18 + 5]})
    assert shift_windows(w, sh)["cpu_start_ns"].to_list() == [10**18 - vs["head"]["offset_ns"],
                                                              10**18 - vs["worker"]["offset_ns"]]
    # a manifest without the node's offset to the client: the case records why, and the join refuses with what to do
    m["clock"]["worker"].pop("vs_client")
    update_manifest(rdir, preflight=m)
    write_json_atomic(case / CASE_CLOCK_FILE, case_clock_record(rdir, t))
    sh = clock_shift(case, {0: "head", 1: "worker"})
    assert sh.refused.startswith("no clock offset to the client was measured for worker (the run's preflight has no "
                                 "offset to the client for this node")
    assert "run with a target whose preflight measures the nodes' clocks" in sh.refused
