"""Load from N client processes (measure/multiclient.py): the split is deterministic and complete; on the paced SSE
server and on the real tiny llama-server the merged records are the single process's requests (same prompts, same
tokens, medians within 5 %); a process that really fell behind (stopped by SIGSTOP mid-run) makes the case INVALID
naming that process; nothing is left running."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

from servelab.measure import case as cs
from servelab.measure import request_metrics as mx
from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.multiclient import plan, run_requests_multi, split
from servelab.measure.workload import build_workload, spec_source

POOL = list(range(1000, 1400))


@pytest.mark.parametrize("clients, n, conc, rate, sized", [(2, 10, 4, None, False), (3, 10, 4, None, False),
                                                           (4, 7, None, None, False), (3, 11, None, 5.0, False),
                                                           (3, 0, 5, None, True), (8, 10, 2, None, False)])
def test_plan_is_a_deterministic_complete_split(clients, n, conc, rate, sized):
    a = plan(clients, n, conc, rate, sized, min_requests=12, max_requests=100)
    assert a == plan(clients, n, conc, rate, sized, min_requests=12, max_requests=100)
    idx = sorted(i for p in a for i in p["indices"])
    assert idx == list(range(n))                                   # every request once, none twice
    if rate is None and conc:
        assert sum(p["concurrency"] for p in a) == conc and len(a) == min(clients, conc)
    if sized:
        assert sum(p["min_requests"] for p in a) >= 12
    assert split(10, 4) == [3, 3, 2, 2]


@pytest.fixture(scope="module")
def paced_server(paced_sse):
    return paced_sse(20.0)


def children_of_me() -> set[int]:
    """Running children, except multiprocessing's resource tracker (one per interpreter, started by the first spawn
    and ended with the interpreter: not a client process)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())}


@pytest.mark.slow
def test_two_processes_send_the_single_process_requests(paced_server):
    cfg = ClientConfig(paced_server, "m")
    wl = build_workload("mc", 12, 16, 10, POOL, seed=3)
    before = children_of_me()
    one = run_requests(wl.requests, cfg, concurrency=4)
    two = run_requests_multi(wl.requests, cfg, 2, concurrency=4)
    assert children_of_me() <= before                              # the client processes are gone
    assert [r.request_id for r in two.records] == [r.request_id for r in one.records]
    assert all(r.ok and r.completion_tokens == 10 for r in two.records)
    assert [r.prompt_tokens for r in two.records] == [r.prompt_tokens for r in one.records]
    assert len(two.processes) == 2 and {len(p.records) for p in two.processes} == {6}
    assert len({p.process for p in two.processes}) == 2 and all(p.loop_lag_ns for p in two.processes)
    assert two.sizing["clients"]["start_spread_ms"] < 50
    s1, s2 = (mx.summarize(r.records, r.duration_s, "vllm") for r in (one, two))
    assert s2["total_output_tokens"] == s1["total_output_tokens"] == 120
    for k in ("median_itl_ms", "median_tpot_ms"):
        assert abs(s2[k] - s1[k]) <= 0.05 * s1[k], k
    rec = mx.integrity(two)
    assert rec["clients"]["processes"] == 2 and len(rec["processes"]) == 2
    # a sized run: process k draws indices k, k+2, …: the same prompts as one process, by index
    src = {"name": "sz", "input_tokens": 16, "output_tokens": 4, "pool": POOL, "seed": 5}
    sized = run_requests_multi([], cfg, 2, concurrency=4, source=src, min_requests=10, min_duration_s=0.3)
    one_src = spec_source(**src)
    assert len(sized.records) >= 10 and sized.sizing["met"] and sized.duration_s >= 0.3
    assert len({r.index for r in sized.records}) == len(sized.records)
    assert all(r.expected_input_tokens == one_src(r.index).input_tokens for r in sized.records)
    # an open loop: one seeded schedule, split: the arrivals are the single process's, request by request
    op1 = run_requests(wl.requests, cfg, rate_rps=20.0, seed=9)
    op2 = run_requests_multi(wl.requests, cfg, 2, rate_rps=20.0, seed=9)
    off1 = [r.scheduled_ns - op1.window_start_ns for r in sorted(op1.records, key=lambda r: r.index)]
    per = {id(r): p for p in op2.processes for r in p.records}
    off2 = [r.scheduled_ns - per[id(r)].window_start_ns for r in sorted(op2.records, key=lambda r: r.index)] \
        if per else []
    assert off2 and all(abs(a - b) < 1e6 for a, b in zip(off1, off2))


def _client_children() -> list[psutil.Process]:
    """This process's running client processes (spawned by multiprocessing). A child that ends while it is looked at
    is skipped, not an error: the helper keeps watching for the ones of the case it waits for."""
    kids = []
    for p in psutil.Process().children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                kids.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return kids


def _has_tcp(p: psutil.Process) -> bool:
    try:
        return bool(p.net_connections(kind="tcp"))
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _zombie_children() -> list[int]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _stop_one_child(stop_s: float, hold_s: float, out: list) -> None:
    """SIGSTOP the second client process for ``hold_s``, ``stop_s`` after it opened its first connection to the
    server (inside its measurement window): it really falls behind."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = sorted(_client_children(), key=lambda p: p.pid)   # the client processes, in start order
        if len(kids) >= 2 and _has_tcp(kids[1]):
            time.sleep(stop_s)
            os.kill(kids[1].pid, signal.SIGSTOP)
            time.sleep(hold_s)
            os.kill(kids[1].pid, signal.SIGCONT)
            out.append(kids[1].pid)
            return
        time.sleep(0.01)


@pytest.mark.slow
def test_a_process_that_fell_behind_makes_the_case_invalid_naming_it(tiny_server, tmp_path):
    """A Phase 1 case with clients=2 on the real engine: the same requests and token counts as clients=1, one
    requests.jsonl, each process's integrity recorded (the medians within 5 % are checked on the paced server above,
    whose timing is fixed: a shared 2-core machine moves a real engine's medians by more than that between runs);
    and a case where one process is stopped for 300 ms mid-run is INVALID, the reason naming that process."""
    case = cs.CaseSpec("D1_c2", "D1", "decode", 32, 48, 2, 16, False)
    res, summ = {}, {}
    for n in (1, 2):
        env = cs.make_env(tiny_server, tmp_path / f"run{n}", clients=n)
        res[n] = cs.run_case(env, case)
        summ[n] = json.loads((res[n].case_dir / "summary.json").read_text())
        assert res[n].status == "success"
        assert _zombie_children() == []                    # every client process of the case was reaped
    m1, m2 = (summ[n]["metrics"]["vllm"] for n in (1, 2))
    assert m1["completed"] == m2["completed"] == 16 and m1["failed"] == m2["failed"] == 0
    assert m1["total_output_tokens"] == m2["total_output_tokens"] == 16 * 48
    assert m1["total_input_tokens"] == m2["total_input_tokens"]
    ids = [sorted(json.loads(x)["request_id"].rsplit("-", 1)[1] for x in (res[n].case_dir / "requests.jsonl")
                  .read_text().splitlines() if json.loads(x)["role"] == "measure") for n in (1, 2)]
    assert ids[0] == ids[1]                                                # the same request indices
    integ = summ[2]["integrity"]
    assert integ["clients"]["processes"] == 2 and len(integ["processes"]) == 2
    recs = [json.loads(x) for x in (res[2].case_dir / "requests.jsonl").read_text().splitlines()]
    assert len([r for r in recs if r["role"] == "measure"]) == 16            # merged into the one case folder
    meta = json.loads((res[2].case_dir / "meta.json").read_text())
    assert meta["case_env"]["clients"] == 2
    # one process stopped mid-run: it really fell behind
    stopped: list[int] = []
    th = threading.Thread(target=_stop_one_child, args=(0.5, 0.3, stopped), daemon=True)
    th.start()
    slow = cs.CaseSpec("D1_c2_slow", "D1", "decode", 32, 48, 2, 16, False, min_window_s=0.2, min_duration_s=4.0)
    env = cs.make_env(tiny_server, tmp_path / "run-slow", clients=2)
    r = cs.run_case(env, slow)
    th.join(30)
    assert stopped
    assert _zombie_children() == []
    s = json.loads((r.case_dir / "summary.json").read_text())
    assert s["verdict"]["status"] == "INVALID"
    named = [x for x in s["verdict"]["reasons"] if x.startswith(f"client process 2 of 2 (pid {stopped[0]})")]
    assert named and "fell behind" in named[0]
