"""Phase 5 runs nccl-tests: the run plan and its one-line refusals, the runner on a stand-in binary that prints real
recorded logs, and the real 1 × H200 sweep recorded with the runner (data/samples/h200x1-nccl-sweep/) read back:
per-run verdicts, the sweep table under the noise rule, the env check, the winners."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from contexts import phase_ctx  # noqa: E402
from servelab.analyse.nccl import sweep as sw
from servelab.core.params import ParamError
from servelab.deploy.hosts import LocalHost, ProcessTracker
from servelab.deploy.spec import Node
from servelab.measure import nccl_tests as nt

S = nt.PlanSettings

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fake_nccl_tests.py"
SWEEP = ROOT / "data" / "samples" / "h200x1-nccl-sweep"


def plain_rows(text: str) -> dict[int, list[str]]:
    """The size table of one nccl-tests log read with a plain split (independent of the parser): size → tokens."""
    return {int(t[0]): t for t in (l.split() for l in text.splitlines()) if len(t) >= 12 and t[0].isdigit()}


def fake_bin(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for c in nt.COLLECTIVES.values():
        (d / c).symlink_to(FAKE)
    return d


# ---------------------------------------------------------------- the real 1 x H200 sweep

def test_real_one_gpu_sweep_reads_back_run_by_run():
    data = sw.load_sweep(SWEEP)
    assert len(data.records) == 30 and (data.runs.status == "ok").all() and (data.runs.exit_code == 0).all()
    assert set(data.runs.ranks) == {1}
    for rec, run in zip(data.records, data.parsed):
        assert run.version == "2.19.6" and run.nccl_library == "22809"
        assert list(run.devices.gpu) == ["NVIDIA H200"] and rec["argv"][-1 if rec["scope"] != "env-check" else -5] == "1"
        text = (SWEEP / rec["log"]).read_text()
        plain = plain_rows(text)
        oop = run.rows[run.rows.placement == "out-of-place"].set_index("size_bytes")
        assert sorted(plain) == sorted(oop.index)
        for size, t in plain.items():
            assert oop.loc[size, "time_us"] == float(t[5]) and oop.loc[size, "busbw_gbps"] == float(t[7])
    ar = data.rows[(data.rows.collective == "all_reduce") & (data.rows.scope == "node")]
    assert (ar.busbw_gbps == 0).all()                                  # 2(n-1)/n = 0 at one rank
    sr = data.rows[data.rows.collective == "sendrecv"]
    assert (sr.busbw_gbps == sr.algbw_gbps).all() and sr.busbw_gbps.max() > 1000
    # the env-check runs are INFO runs: NCCL printed the variable it did read, never NCCL_ALGO / NCCL_PROTO
    info = data.texts["env-check-local-all_reduce-NCCL_ALGO_Tree-r1"]
    assert "NCCL_NVLS_ENABLE set by environment to 0." in info and "NCCL_ALGO" not in info.replace("NCCL_ALGO=", "")
    assert [(m["var"], m["val"]) for m in sw.ENV_SET_RE.finditer(info)] == [("NCCL_NVLS_ENABLE", "0")]


def test_real_one_gpu_sweep_table_noise_rule_env_check_and_winner():
    data = sw.load_sweep(SWEEP)
    t = sw.sweep_table(data).set_index(["collective", "size_bytes", "setting"])
    base = [plain_rows((SWEEP / f"logs/node-local-all_reduce-baseline-r{r}.log").read_text())[262144] for r in (1, 2)]
    ll = [plain_rows((SWEEP / f"logs/node-local-all_reduce-NCCL_PROTO_LL128-r{r}.log").read_text())[262144]
          for r in (1, 2)]
    tb, tl = [float(x[5]) for x in base], [float(x[5]) for x in ll]
    row = t.loc[("all_reduce", 262144, "NCCL_PROTO=LL128")]
    assert row.runs == 2 and row.time_us == pytest.approx(sum(tl) / 2)
    assert row.delta_time_pct == pytest.approx(100 * (sum(tl) - sum(tb)) / sum(tb))
    assert max(tl) < min(tb) and row.verdict == "faster"               # two repeats that happen not to overlap
    assert t.loc[("all_reduce", 33554432, "NCCL_ALGO=Tree")].verdict == "within noise"
    env = sw.env_check(data)
    assert list(env.verdict) == ["not reported by NCCL"] * 4 and set(env.setting) == {
        "NCCL_ALGO=Ring", "NCCL_ALGO=Tree", "NCCL_PROTO=Simple", "NCCL_PROTO=LL128"}
    msgs = pd.DataFrame({"scenario": ["decode C=32"], "collective": ["all_reduce"], "msg_bytes": [32 * 4096 * 2]})
    naive = sw.winners(sw.sweep_table(data), msgs)
    assert naive.best_setting.tolist() == ["NCCL_PROTO=LL128"]          # what the numbers alone would claim
    checked = sw.winners(sw.sweep_table(data), msgs, env)
    assert checked.best_setting.tolist() == ["baseline"]
    assert "NCCL_PROTO=LL128 looked faster but NCCL did not report reading it" in checked.verdict[0]


def test_env_check_reached_and_other_value():
    rec = {"run_id": "x", "scope": "env-check", "node": "n", "setting": "NCCL_PROTO=LL128", "variable": "NCCL_PROTO",
           "value": "LL128"}
    line = "vm:1:1 [0] NCCL INFO NCCL_PROTO set by environment to {}\n"
    for said, verdict in (("LL128", "reached NCCL"), ("Simple", "NCCL reported another value")):
        data = sw.SweepData(Path("."), [rec], [], pd.DataFrame(), pd.DataFrame(), {"x": line.format(said)})
        assert sw.env_check(data).verdict.tolist() == [verdict]
    cross = "vm:1:1 [0] NCCL INFO NCCL_CROSS_NIC set by environment to 1.\n"
    rec2 = {**rec, "setting": "NCCL_CROSS_NIC=1", "variable": "NCCL_CROSS_NIC", "value": "1"}
    data = sw.SweepData(Path("."), [rec2], [], pd.DataFrame(), pd.DataFrame(), {"x": cross})
    assert sw.env_check(data).verdict.tolist() == ["reached NCCL"]
    # two ranks logged INFO lines, one never said it read the variable: named (the A/B rank check, by pid)
    two = cross + "vm:2:2 [1] NCCL INFO Using network Socket\n"
    data = sw.SweepData(Path("."), [rec2], [], pd.DataFrame(), pd.DataFrame(), {"x": two})
    got = sw.env_check(data)
    assert got.verdict.tolist() == ["not reported by every rank"] and got.missing_on.tolist() == ["vm:2"]


# ---------------------------------------------------------------- the run plan and its refusals

def test_plan_scopes_ids_env_and_what_is_left_out():
    nodes = [Node("head", role="head", host="10.0.0.1", gpus=3), Node("worker", role="worker", host="10.0.0.2", gpus=3)]
    plan = nt.plan_runs(nodes, "/opt/nt/build", S(["all_reduce"], {"NCCL_ALGO": ["Ring", "Tree"], "NCCL_CROSS_NIC": [0, 1]},
                        repeats=2, launcher=["mpirun", "-np", "{nranks}", "-H", "{hosts}", "{env:-x}", "{cmd}"]),
                        env={"NCCL_IB_HCA": "mlx5_0", "HF_TOKEN": "hf_secret", "OMP_NUM_THREADS": "4",
                             "UCX_NET_PASSWORD": "pw"})
    scopes = pd.Series([r.scope for r in plan.runs]).value_counts().to_dict()
    # per node: (baseline + Ring + Tree) x 2 repeats; across: (baseline + 4 settings) x 2; p2p: 3 pairs per node
    assert scopes == {"node": 12, "cross-node": 10, "p2p": 6, "env-check": 6}
    assert len({r.run_id for r in plan.runs}) == len(plan.runs)
    assert all(r.env.get("NCCL_IB_HCA") == "mlx5_0" and "HF_TOKEN" not in r.env and "OMP_NUM_THREADS" not in r.env
               and "UCX_NET_PASSWORD" not in r.env and "pw" not in " ".join(r.argv) for r in plan.runs)
    assert not any(r.variable == "NCCL_CROSS_NIC" for r in plan.runs if r.scope == "node")
    tree = next(r for r in plan.runs if r.scope == "cross-node" and r.setting == "NCCL_ALGO=Tree")
    assert tree.argv[:5] == ["mpirun", "-np", "6", "-H", "10.0.0.1:3,10.0.0.2:3"]
    assert tree.argv[5:9] == ["-x", "NCCL_IB_HCA=mlx5_0", "-x", "NCCL_ALGO=Tree"]
    assert tree.argv[9:] == ["/opt/nt/build/all_reduce_perf", "-b", "8K", "-e", "64M", "-f", "2", "-g", "1"]
    pairs = [(r.node, r.env["CUDA_VISIBLE_DEVICES"]) for r in plan.runs if r.scope == "p2p"]
    assert pairs[:3] == [("head", "0,1"), ("head", "0,2"), ("head", "1,2")]
    one = nt.plan_runs([Node("solo", gpus=1)], "/b", S(["sendrecv"], {"NCCL_PROTO": ["LL128"]}, repeats=1))
    assert "P2P matrix of solo: one GPU, no pair" in one.skipped and "cross-node runs: the target has one node" in one.skipped
    none = nt.plan_runs(nodes, "/b", S(["all_reduce"], {}, repeats=1, p2p_matrix=False))
    assert any("no launcher template" in s for s in none.skipped)


@pytest.mark.parametrize("kwargs,message", [
    (dict(collectives=["allreduce"]), "unknown collective 'allreduce' (did you mean 'all_reduce'?)"),
    (dict(sweep=["NCCL_ALGO"]), "sweep entry 'NCCL_ALGO' must read VARIABLE=value1,value2"),
    (dict(sweep={"nccl_algo": ["Ring"]}), "sweep entry 'nccl_algo=Ring'"),
    (dict(min_bytes="8KB"), "size '8KB' is not an nccl-tests size"),
    (dict(min_bytes="64M", max_bytes="8K"), "max_bytes 8K is below min_bytes 64M"),
    (dict(repeats=0), "repeats must be ≥ 1"),
    (dict(launcher=["mpirun", "-np", "{nprocs}", "{cmd}"]), "unknown placeholder '{nprocs}'"),
    (dict(bin_dir=""), "no nccl-tests folder given"),
])
def test_bad_plan_is_one_line(kwargs, message):
    nodes = [Node("a", host="h1", gpus=2), Node("b", host="h2", gpus=2)]
    kwargs = dict(kwargs)
    bin_dir = kwargs.pop("bin_dir", "/b")
    with pytest.raises(nt.NcclPlanError) as e:
        nt.plan_runs(nodes, bin_dir, S(**kwargs))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_node_without_gpus_and_unknown_node_are_refused_before_anything(tmp_path):
    from servelab.phases import phase5_comm as phase5
    with pytest.raises(nt.NcclPlanError, match="node local declares no GPUs: set gpus: N"):
        nt.plan_runs([Node("local")], "/b")
    with pytest.raises(ParamError, match=r"node 'locl' is not a node of target local-tiny \(did you mean 'local'\?\)"):
        phase5.plan_runs(phase_ctx(tmp_path / "r1", "phase5", nccl_tests_bin="/b", nodes=["locl"]))
    with pytest.raises(ParamError, match="node local declares no GPUs"):     # a bin folder given: it would run, so
        phase5.plan_runs(phase_ctx(tmp_path / "r2", "phase5", nccl_tests_bin="/b"))     # GPUs must be declared
    ctx = phase_ctx(tmp_path / "r3", "phase5")
    planned = phase5.plan_runs(ctx)                     # no bin folder: planned only, one GPU assumed
    assert not planned.execute and "declares no GPUs" in planned.why_not_run and len(planned.table) == 22
    assert list(ctx.phase_dir.iterdir()) == [ctx.phase_dir / "nccl_plan.csv"]


def test_missing_binaries_are_found_before_any_run(tmp_path):
    bins = fake_bin(tmp_path / "bin")
    (bins / "alltoall_perf").unlink()
    plan = nt.plan_runs([Node("local", gpus=2)], str(bins), S(repeats=1, sweep={}))
    problems = nt.check_plan(plan, {"local": LocalHost()})
    assert problems == [f"node local: {bins}/alltoall_perf is not an executable file — build nccl-tests there, or "
                        "point nccl_tests_bin at its build folder"]
    plan2 = nt.plan_runs([Node("local", gpus=2)], str(tmp_path / "nowhere"), S(["all_reduce", "sendrecv"], {}, repeats=1))
    assert nt.check_plan(plan2, {"local": LocalHost()})[0].endswith("(nor 1 more) — build nccl-tests there, or point "
                                                                   "nccl_tests_bin at its build folder")
    assert not (bins / "calls.jsonl").exists()                     # nothing ran


# ---------------------------------------------------------------- the runner on the stand-in binary

def test_runner_on_the_stand_in_keeps_each_runs_real_log(tmp_path):
    """Locally, 2 GPUs: the baseline and NCCL_ALGO=Ring print the 2 x H200 log B, Tree prints A; the sweep table
    shows exactly those logs' numbers and their difference."""
    bins = fake_bin(tmp_path / "bin")
    plan = nt.plan_runs([Node("local", gpus=2)], str(bins), S(["all_reduce"], {"NCCL_ALGO": ["Ring", "Tree"]}, repeats=2))
    with ProcessTracker() as tracker:
        res = nt.execute(plan, {"local": LocalHost()}, tmp_path / "out", tracker)
    assert [r.exit_code for r in res] == [0] * len(plan.runs) == [0] * 9
    calls = [json.loads(l) for l in (bins / "calls.jsonl").read_text().splitlines()]
    assert [c["env"].get("NCCL_ALGO") for c in calls[:3]] == [None, "Ring", "Tree"]
    assert calls[-3]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and calls[-1]["env"]["NCCL_DEBUG"] == "INFO"
    data = sw.load_sweep(tmp_path / "out")
    t = sw.sweep_table(data).set_index(["collective", "size_bytes", "setting"])
    a = plain_rows((ROOT / "data/samples/h200x2/nccl_tests.log").read_text().split("all_gather_perf")[0])
    b = plain_rows((ROOT / "data/samples/h200x2-device/nccl_tests_g2.log").read_text().split("all_gather_perf")[0])
    size = 1048576
    assert t.loc[("all_reduce", size, "baseline")].time_us == float(b[size][5])
    assert t.loc[("all_reduce", size, "NCCL_ALGO=Ring")].delta_time_pct == 0
    tree = t.loc[("all_reduce", size, "NCCL_ALGO=Tree")]
    assert tree.time_us == float(a[size][5]) and tree.busbw_gbps == float(a[size][7])
    assert tree.delta_time_pct == pytest.approx(100 * (float(a[size][5]) - float(b[size][5])) / float(b[size][5]))
    assert tree.verdict == ("faster" if float(a[size][5]) < float(b[size][5]) else "slower")
    p2p = sw.p2p_matrix(data)
    assert p2p[["node", "gpu_a", "gpu_b"]].values.tolist() == [["local", 0, 1]]
    sr = plain_rows((ROOT / "data/samples/h200x2-device/nccl_tests_g2.log").read_text()
                    .split("Collective test starting: sendrecv_perf")[1])
    assert p2p.busbw_gbps[0] == float(sr[67108864][7]) and p2p.time_us[0] == float(sr[8192][5])
    assert set(sw.env_check(data).verdict) == {"not reported by NCCL"}   # the recorded INFO run set no NCCL_ALGO
    assert sorted(p.name for p in (tmp_path / "out" / "logs").iterdir()) == sorted(f"{r.run_id}.log" for r in plan.runs)


def test_a_run_past_its_timeout_is_stopped_and_recorded(tmp_path):
    bins = tmp_path / "bin"
    bins.mkdir()
    marker = f"servelab-test-hang-{tmp_path.name}"
    (bins / "all_reduce_perf").write_text(f"#!/bin/sh\necho started\nexec python3 -c 'import time; time.sleep(600)' {marker}\n")
    (bins / "all_reduce_perf").chmod(0o755)
    plan = nt.plan_runs([Node("local", gpus=1)], str(bins), S(["all_reduce"], {}, repeats=1, run_timeout_s=1.5))
    import subprocess
    import threading
    seen = []
    threading.Timer(0.8, lambda: seen.append(subprocess.run(["pgrep", "-f", marker], capture_output=True,
                                                            text=True).stdout.split())).start()
    with ProcessTracker() as tracker:
        [res] = nt.execute(plan, {"local": LocalHost()}, tmp_path / "out", tracker)
    assert seen and len(seen[0]) == 1                                 # it was running, under that marker
    assert res.exit_code == 124 and res.note == "stopped after its timeout of 1.5 s" and res.seconds < 15
    assert (tmp_path / "out" / res.log).read_text() == "started\n"
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip() == ""
    run = sw.load_sweep(tmp_path / "out").runs.iloc[0]
    assert run.status == "failed" and run.reason.startswith("stopped after its timeout of 1.5 s")


def test_recorded_sweep_folder_is_refused_with_one_line(tmp_path):
    with pytest.raises(sw.SweepFolderError, match="holds no runs.jsonl"):
        sw.load_sweep(tmp_path)
    (tmp_path / "runs.jsonl").write_text("{not json\n")
    with pytest.raises(sw.SweepFolderError, match=r"line 1 is not JSON"):
        sw.load_sweep(tmp_path)


def test_size_syntax():
    assert [nt.size_bytes(x) for x in ("8", "8K", "64M", "1G", "8k")] == [8, 8192, 64 * 2**20, 2**30, 8192]
    assert re.search("K, M or G", str(pytest.raises(nt.NcclPlanError, nt.size_bytes, "1.5M").value))
