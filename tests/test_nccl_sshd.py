"""Phase 5 runs nccl-tests on a target's nodes for real: two SSH nodes (real sshd on 127.0.0.2 and 127.0.0.3), the
whole phase through ``servelab run``, a stand-in nccl-tests binary that prints real recorded logs
(tests/fake_nccl_tests.py) and a stand-in launcher for the cross-node runs (tests/fake_mpirun.py). The sweep table,
the P2P matrix and every run's command, environment and log come out of the phase folder; a bad binary folder
fails in one line before anything runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from sshd import sshd_pair  # noqa: E402
from test_nccl_runs import fake_bin, plain_rows  # noqa: E402

pytestmark = pytest.mark.slow            # starts sshd and runs the phase notebook

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = [sys.executable, str(ROOT / "tests" / "fake_mpirun.py"), "-np", "{nranks}", "-H", "{hosts}", "{env:-x}",
            "{cmd}"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    yield from sshd_pair(tmp_path_factory)


def write_target(a, b, known: Path, d: Path) -> Path:
    node = dict(kind="ssh", user="root", known_hosts=str(known), gpus=2)
    t = {"name": "two-node-nccl", "engine": "llamacpp", "model": "tiny", "served_model_name": "tiny",
         "api_host": "127.0.0.2", "env": {"NCCL_IB_HCA": "mlx5_0,mlx5_3", "NCCL_SOCKET_IFNAME": "lo",
                                          "HF_TOKEN": "hf_" + "x" * 30},
         "launch": {"context_length": 4096},
         "nodes": [dict(node, name="head", role="head", host="127.0.0.2", port=a.port, key_file=str(a.client_key),
                        workdir=str(d / "head")),
                   dict(node, name="worker", role="worker", host="127.0.0.3", port=b.port, key_file=str(b.client_key),
                        workdir=str(d / "worker"))]}
    p = d / "two-node-nccl.yaml"
    p.write_text(yaml.safe_dump(t))
    return p


def servelab(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SERVELAB_OUTPUTS": str(out)}
    return subprocess.run([sys.executable, "-m", "servelab.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_phase5_runs_the_sweep_on_two_ssh_nodes(nodes, tmp_path):
    a, b, known = nodes
    target = write_target(a, b, known, tmp_path)
    bins = fake_bin(tmp_path / "bin")
    res = servelab("run", "phase5", "--target", str(target), "--run-id", "nccl-sshd",
                   "-p", f"nccl_tests_bin={bins}", "-p", "collectives=[all_reduce, sendrecv]",
                   "-p", "sweep={NCCL_ALGO: [Ring, Tree], NCCL_CROSS_NIC: ['0', '1']}", "-p", "ppn=1",
                   "-p", "launcher=" + json.dumps(LAUNCHER), out=tmp_path / "outputs")
    assert res.returncode == 0, res.stdout + res.stderr
    ph = tmp_path / "outputs" / "nccl-sshd" / "phase5"
    recs = [json.loads(l) for l in (ph / "nccl_runs" / "runs.jsonl").read_text().splitlines()]
    scopes = pd.Series([r["scope"] for r in recs]).value_counts().to_dict()
    # per node (head, worker): (2 collectives + Ring + Tree) x 2 repeats; across: (2 + 4 settings) x 2; one GPU
    # pair per node; env check: Ring and Tree on each node, CROSS_NIC 0 and 1 across the nodes
    assert scopes == {"node": 16, "cross-node": 12, "p2p": 2, "env-check": 6}
    assert all(r["exit_code"] == 0 for r in recs)
    assert {r["node"] for r in recs} == {"head", "worker"}
    assert all(r["node"] == "head" for r in recs if r["scope"] == "cross-node")
    # every call reached its node over SSH with the target's NCCL variables, never its secret
    calls = [json.loads(l) for l in (bins / "calls.jsonl").read_text().splitlines()]
    binaries = [c for c in calls if "binary" in c]
    assert len(binaries) == len(recs)
    assert all(c["env"].get("NCCL_IB_HCA") == "mlx5_0,mlx5_3" for c in binaries)
    assert not any("HF_TOKEN" in json.dumps(c) for c in calls)
    launched = [c for c in calls if c.get("launcher")]
    assert len(launched) == 14 and {c["hosts"] for c in launched} == {"127.0.0.2:1,127.0.0.3:1"}
    tree = next(c for c in launched if "NCCL_ALGO=Tree" in c["argv"])
    assert tree["argv"][tree["argv"].index("NCCL_ALGO=Tree") - 1] == "-x" and tree["np"] == "2"
    nic = [c for c in binaries if "NCCL_CROSS_NIC" in c["env"]]
    assert len(nic) == 6 and all(c["ranks"] == 2 and c["argv"][c["argv"].index("-g") + 1] == "1" for c in nic)
    # each run's command, environment and log kept: executed commands per node, logs equal to the real ones
    cmds = [json.loads(l) for l in (tmp_path / "outputs" / "nccl-sshd" / "commands.jsonl").read_text().splitlines()]
    ex = [c for c in cmds if c["phase"] == "phase5" and c["label"] == "executed" and c["title"].startswith("nccl-tests")]
    assert len(ex) == len(recs) and {c["host"] for c in ex} == {"head", "worker"}
    assert all(Path(c["log"]).is_file() and c["exit_code"] == 0 and "HF_TOKEN" not in c["env"] for c in ex)
    tree_run = next(r for r in recs if r["scope"] == "node" and r["node"] == "worker" and r["setting"] == "NCCL_ALGO=Tree")
    real_a = (ROOT / "data/samples/h200x2/nccl_tests.log").read_text()
    log = (ph / "nccl_runs" / tree_run["log"]).read_text()
    assert log.startswith("# nccl-tests version") and log.rstrip("#\n") in real_a
    # the sweep table: the real numbers of the log each setting printed, and their difference
    sweep = pd.read_csv(ph / "nccl_sweep.csv")
    a = plain_rows(real_a.split("all_gather_perf")[0])
    bdev = plain_rows((ROOT / "data/samples/h200x2-device/nccl_tests_g2.log").read_text().split("all_gather_perf")[0])
    for scope, node in (("node", "head"), ("node", "worker"), ("cross-node", "head")):
        s = sweep[(sweep.scope == scope) & (sweep.node == node) & (sweep.collective == "all_reduce")
                  & (sweep.size_bytes == 262144)].set_index("setting")
        assert s.loc["baseline", "time_us"] == float(bdev[262144][5])
        assert s.loc["NCCL_ALGO=Tree", "time_us"] == float(a[262144][5])
        assert s.loc["NCCL_ALGO=Tree", "delta_time_pct"] == pytest.approx(
            100 * (float(a[262144][5]) - float(bdev[262144][5])) / float(bdev[262144][5]))
    assert "NCCL_CROSS_NIC=1" in set(sweep[sweep.scope == "cross-node"].setting)
    assert "NCCL_CROSS_NIC=1" not in set(sweep[sweep.scope == "node"].setting)
    p2p = pd.read_csv(ph / "nccl_p2p.csv")
    assert p2p[["node", "gpu_a", "gpu_b"]].values.tolist() == [["head", 0, 1], ["worker", 0, 1]]
    # the page: opens with what ran, shows the sweep table and the P2P matrix, nothing labelled as recorded sweep
    page = (ph / "report.html").read_text()
    assert "nccl-tests ran 36 times on head, worker" in page
    assert "NCCL_ALGO=Tree busbw (GB/s)" in page and "The P2P matrix" in page
    assert "1 x NVIDIA H200 (NCCL 2.28.9" not in page
    # the node folders were private and are gone; nothing left running
    assert not list((tmp_path / "head").glob("servelab-*")) and not list((tmp_path / "worker").glob("servelab-*"))
    assert subprocess.run(["pgrep", "-f", str(bins)], capture_output=True).stdout == b""


def test_phase5_bad_binary_folder_fails_in_one_line_before_any_run(nodes, tmp_path):
    a, b, known = nodes
    target = write_target(a, b, known, tmp_path)
    res = servelab("run", "phase5", "--target", str(target), "--run-id", "nccl-bad",
                   "-p", f"nccl_tests_bin={tmp_path / 'nowhere'}", out=tmp_path / "outputs")
    assert res.returncode != 0
    line = next(l for l in res.stdout.splitlines() + res.stderr.splitlines() if l.startswith("phase5: failed"))
    assert f"node head: {tmp_path / 'nowhere'}/all_gather_perf is not an executable file (nor 4 more)" in line
    ph = tmp_path / "outputs" / "nccl-bad" / "phase5"
    assert not (ph / "nccl_runs").exists()
    manifest = json.loads((tmp_path / "outputs" / "nccl-bad" / "manifest.json").read_text())
    assert "is not an executable file" in manifest["phases"]["phase5"]["error"]
