"""Multi-node for real: two SSH 'nodes' (real sshd on 127.0.0.2 and 127.0.0.3), llama.cpp's own multi-node
backend (ggml-rpc-server on the worker, llama-server --rpc on the head), started, checked and stopped
together — plus a node killed mid-run, a node unreachable at start and a wrong host key."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servelab.deploy.hosts import ProcessTracker
from servelab.deploy.targets import target_from_dict
from servelab.deploy.server import (ServerError, collect_logs, http_json, is_healthy, rank_environments, start_server,
                             stop_server)

sys.path.insert(0, str(Path(__file__).parent))
from sshd import sshd_pair  # noqa: E402

pytestmark = pytest.mark.slow            # every test here starts a real engine (and sshd)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, llama_server_binary):
    yield from sshd_pair(tmp_path_factory)


def two_node_target(a, b, known: Path, work: Path, worker_port: int | None = None, rpc_port: int = 0) -> object:
    import socket
    if not rpc_port:
        with socket.socket() as s:
            s.bind(("127.0.0.3", 0))
            rpc_port = s.getsockname()[1]
    node = dict(kind="ssh", user="root", key_file=str(a.client_key), known_hosts=str(known))
    return target_from_dict({
        "name": "two-node-tiny", "engine": "llamacpp", "model": "tiny", "served_model_name": "tiny",
        "api_host": "127.0.0.2", "env": {"NCCL_IB_HCA": "mlx5_0,mlx5_3", "NCCL_CROSS_NIC": "0"}, "launch": {"context_length": 4096, "parallel": 4, "threads": 1, "rpc_port": rpc_port},
        "nodes": [dict(node, name="head", role="head", host="127.0.0.2", port=a.port, workdir=str(work / "head")),
                  dict(node, name="worker", role="worker", host="127.0.0.3", port=worker_port or b.port,
                       key_file=str(b.client_key), workdir=str(work / "worker"))]})


def pgroup_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_two_nodes_serve_and_clean_up(nodes, tmp_path):
    a, b, known = nodes
    target = two_node_target(a, b, known, tmp_path)
    with ProcessTracker() as tracker:
        srv = start_server(target, tmp_path / "logs", tracker, health_timeout_s=60)
        assert [p.role for p in srv.plans] == ["worker", "head"]
        assert srv.plans[1].argv[srv.plans[1].argv.index("--rpc") + 1] == f"127.0.0.3:{target.launch['rpc_port']}"
        status, body = http_json(srv.base_url + "/v1/completions",
                                 {"prompt": "hello", "max_tokens": 12, "ignore_eos": True}, timeout=60)
        assert status == 200 and body["usage"]["completion_tokens"] == 12
        assert is_healthy(srv) and srv.node_status() == {"worker": True, "head": True}
        seen = rank_environments(srv)          # read over SSH from /proc/<pid>/environ on each node
        assert set(seen["node"]) == {"head", "worker"} and (seen["verdict"] == "ok").all()
        assert set(seen["variable"]) == {"NCCL_IB_HCA", "NCCL_CROSS_NIC"}
        pids = {n: h.pid for n, h in srv.handles.items()}
        info = stop_server(srv, tracker)
    cleanup = {r["node"]: r for r in info["cleanup"]}
    assert cleanup["head"]["process_gone"] and cleanup["head"]["port_free"]
    assert cleanup["worker"]["process_gone"] and cleanup["worker"]["port_free"]
    assert not any(pgroup_alive(p) for p in pids.values())
    logs = collect_logs(srv, tmp_path / "collected")
    head_log = Path(logs["head"]).read_text()
    # the head really placed the model on the worker node's RPC device
    assert f"RPC0[127.0.0.3:{target.launch['rpc_port']}] model buffer size" in head_log
    assert Path(logs["worker"]).exists()


def test_worker_killed_mid_run_is_detected_and_everything_stops(nodes, tmp_path):
    a, b, known = nodes
    target = two_node_target(a, b, known, tmp_path)
    with ProcessTracker() as tracker:
        srv = start_server(target, tmp_path / "logs", tracker, health_timeout_s=60)
        os.killpg(srv.handles["worker"].pid, signal.SIGKILL)      # the worker node's engine dies
        deadline = time.monotonic() + 10
        while is_healthy(srv) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_healthy(srv)
        assert srv.node_status()["worker"] is False
        head_pid = srv.handles["head"].pid
    # leaving the tracker stopped the head too; its log is still collectable
    assert not pgroup_alive(head_pid)
    assert Path(collect_logs(srv, tmp_path / "collected")["head"]).exists()


def test_unreachable_node_stops_before_anything_starts(nodes, tmp_path):
    a, b, known = nodes
    target = two_node_target(a, b, known, tmp_path, worker_port=1)
    before = subprocess.run(["pgrep", "-f", "two-node-unreach"], capture_output=True, text=True).stdout
    with ProcessTracker() as tracker:
        with pytest.raises(ServerError, match="nothing was started.*worker.*unreachable"):
            start_server(target, tmp_path / "logs", tracker, health_timeout_s=30)
        assert tracker.entries == []
    assert not (tmp_path / "head").exists() and before == ""


def test_wrong_host_key_refuses_the_cluster(nodes, tmp_path):
    a, b, known = nodes
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    fake = (tmp_path / "k.pub").read_text().split()
    bad = tmp_path / "known_hosts"
    bad.write_text(a.known_hosts.read_text() + f"[127.0.0.3]:{b.port} {fake[0]} {fake[1]}\n")
    target = two_node_target(a, b, bad, tmp_path)
    with ProcessTracker() as tracker:
        with pytest.raises(ServerError, match="worker.*does not match"):
            start_server(target, tmp_path / "logs", tracker, health_timeout_s=30)
        assert tracker.entries == []
