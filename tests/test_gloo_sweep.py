"""The gloo sweep (``measure.gloo_sweep``): a CPU engine's communication ceiling, in nccl-tests' conventions.

The live test runs two real gloo ranks with SGLang's own interpreter (torch from the SGLang-CPU venv) on loopback;
the failure test runs the rank script with this test's interpreter, which has no torch: a real rank that fails."""
from __future__ import annotations

import os
import sys

import pytest

from servelab.deploy.hosts import ProcessTracker
from servelab.measure import gloo_sweep as gs


def test_sizes_follow_nccl_tests_b_e_f():
    assert gs.sizes(64, 1024, 2) == [64, 128, 256, 512, 1024]
    assert gs.sizes(64, 1000, 4) == [64, 256]
    with pytest.raises(ValueError, match="factor"):
        gs.sizes(64, 32, 2)


def test_plan_names_every_rank_and_stays_on_loopback(tmp_path):
    p = gs.plan("/x/python", 3, [64, 128], tmp_path)
    assert [a[a.index("--rank") + 1] for a in p.argv] == ["0", "1", "2"]
    assert all(a[:2] == ["/x/python", str(gs.SCRIPT)] and a[a.index("--world") + 1] == "3" for a in p.argv)
    assert p.env["MASTER_ADDR"] == "127.0.0.1" and p.env["GLOO_SOCKET_IFNAME"] == "lo"
    with pytest.raises(ValueError, match="at least 2 ranks"):
        gs.plan("/x/python", 1, [64], tmp_path)
    with pytest.raises(ValueError, match="unknown collective 'alltoall'"):
        gs.plan("/x/python", 2, [64], tmp_path, collectives=("alltoall",))


@pytest.mark.slow
def test_a_rank_that_fails_is_named_and_every_rank_stopped(tmp_path):
    p = gs.plan(sys.executable, 2, [64], tmp_path)          # no torch here: each rank dies on its import
    with ProcessTracker() as tracker:
        with pytest.raises(gs.GlooSweepError, match=r"gloo sweep rank \d exited with 1: .*torch"):
            gs.run_sweep(p, tracker, timeout_s=60)
        assert tracker.running() == []


def test_wrong_results_are_reported_not_dropped(tmp_path):
    f = tmp_path / "gloo_sweep.jsonl"
    f.write_text('{"collective": "all_reduce", "size_bytes": 64, "nranks": 2, "time_us": 30.0, "algbw_gbps": 0.002,'
                 ' "busbw_gbps": 0.002, "wrong": 0}\n{"collective": "all_reduce", "size_bytes": 128, "nranks": 2,'
                 ' "time_us": 31.0, "algbw_gbps": 0.004, "busbw_gbps": 0.004, "wrong": 3}\n')
    rows = gs.read_rows(f)
    assert rows["status"].tolist() == ["ok", "wrong results"] and set(rows["placement"]) == {"out-of-place"}
    f.write_text("")
    with pytest.raises(gs.GlooSweepError, match="no result"):
        gs.read_rows(f)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_two_real_gloo_ranks_measure_all_reduce_and_all_gather(tmp_path):
    from servelab.deploy.sglang_cpu import ensure_sglang_cpu
    p = gs.plan(str(ensure_sglang_cpu()), 2, gs.sizes(64, 256 * 1024, 4), tmp_path, iters=10, warmup=2)
    with ProcessTracker() as tracker:
        p = gs.run_sweep(p, tracker, timeout_s=120)
    r = p.rows
    assert p.exit_codes == [0, 0]
    assert sorted(set(r["collective"])) == ["all_gather", "all_reduce"] and set(r["nranks"]) == {2}
    assert set(r["status"]) == {"ok"} and (r["time_us"] > 0).all()
    ar = r[r["collective"] == "all_reduce"]
    assert ar["size_bytes"].tolist() == [64, 256, 1024, 4096, 16384, 65536, 262144]
    # nccl-tests' conventions: algbw = size / time; busbw = algbw x 2(n-1)/n (all-reduce), (n-1)/n (all-gather)
    assert list(ar["algbw_gbps"] * 1e3) == pytest.approx(list(ar["size_bytes"] / ar["time_us"]), rel=1e-9)
    assert list(ar["busbw_gbps"]) == pytest.approx(list(ar["algbw_gbps"]), rel=1e-9)      # n = 2: factor 1
    ag = r[r["collective"] == "all_gather"]
    assert list(ag["busbw_gbps"]) == pytest.approx(list(ag["algbw_gbps"] / 2), rel=1e-9)
    # a larger message moves more bytes per second than the latency-bound smallest one
    assert ar["algbw_gbps"].iloc[-1] > ar["algbw_gbps"].iloc[0]
