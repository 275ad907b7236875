"""Phase 3 capture without a GPU engine: the capture scenarios (docs/method.md#capture-scenarios), trace names,
and the SGLang path end to end against a small HTTP stand-in that writes our real H200 SGLang-named traces
(TP-0, TP-1) slowly, on two "nodes" — one local, one reached through the remote code path (find / gzip -t / get).

The vLLM path runs against a real vLLM in tests/test_vllm_cpu.py.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from servelab.measure import capture as cap
from servelab.deploy.engines.vllm import vllm_start_profile_body
from servelab.deploy.hosts import LocalHost
from servelab.deploy.targets import target_from_dict
from servelab.deploy.server import RunningServer


class RemoteLikeHost(LocalHost):
    """A node taken through capture's remote code path (``find``, ``gzip -t``, ``tail``, ``get``), run here."""
    kind = "ssh"


# ---------------------------------------------------------------- scenarios

def test_capture_scenarios_match_the_method_table():
    dc, mx, lp, ph = cap.capture_scenarios("cluster", decode_case="D2-c32", mixed_case="M1-treatment", prefill_case="P3")
    # docs/method.md#capture-scenarios: decode control 1K->1K C=32, skip 2, capture N = 10 (the first pass's 5-10)
    assert cap.DEFAULT_STEPS == 10
    assert (dc.name, dc.case_id, dc.isl_tokens, dc.osl_tokens, dc.concurrency, dc.skip_steps, dc.num_steps,
            dc.trigger) == ("decode_control", "D2-c32", 1024, 1024, 32, 2, 10, "decode_active")
    # mixed treatment: same background, 2 pure decode steps, then 128K->1 injected, N + 22 = 32 steps in all
    assert (mx.isl_tokens, mx.osl_tokens, mx.concurrency, mx.inject_isl_tokens, mx.inject_osl_tokens,
            mx.inject_after_steps, mx.num_steps) == (1024, 1024, 32, 131072, 1, 2, 32)
    # long prefill: 128K->1, C=1, N steps from the first chunk
    assert (lp.isl_tokens, lp.osl_tokens, lp.concurrency, lp.num_steps, lp.skip_steps, lp.trigger) == \
        (131072, 1, 1, 10, 0, "before_first_chunk")
    # prefix hit: a long context, ~97 % of it one shared prefix warmed before the capture
    assert (ph.name, ph.trigger, ph.num_steps) == ("prefix_hit", "before_first_chunk", 10)
    assert ph.prefix_tokens / ph.isl_tokens > 0.9 and ph.isl_tokens >= 32768
    assert "capture 10" in dc.description and "32 steps in all" in mx.description
    local = cap.capture_scenarios("local")
    assert [s.name for s in local] == ["decode_control", "mixed_treatment", "long_prefill", "prefix_hit"]
    assert all(s.isl_tokens + s.osl_tokens <= 2048 for s in local)
    assert local[1].inject_isl_tokens + 1 <= 2048


@pytest.mark.parametrize("steps,mixed", [(5, 27), (8, 30), (10, 32), (16, 32), (32, 32)])
def test_capture_steps_set_every_window_and_the_mixed_one_keeps_room_for_its_prefill(steps, mixed):
    dc, mx, lp, ph = cap.capture_scenarios("local", steps=steps)
    assert (dc.num_steps, lp.num_steps, ph.num_steps) == (steps, steps, steps)
    assert mx.num_steps == mixed == cap.mixed_steps(steps)
    # after the 2 decode steps and the injection's room, the mixed window still holds decode steps (at most 32)
    assert mx.num_steps - mx.inject_after_steps >= min(steps, 32 - cap.MIXED_EXTRA_STEPS) + 20
    assert f"{mixed} steps in all" in mx.description


@pytest.mark.parametrize("steps", [4, 33, 0, 10.0, True, "10"])
def test_capture_steps_outside_5_to_32_are_refused_with_what_to_pass(steps):
    with pytest.raises(cap.CaptureError, match=r"capture_steps=.*5 to 32 engine steps.*e\.g\. 10"):
        cap.capture_scenarios("local", steps=steps)


@pytest.mark.parametrize("steps,ok", [(4, False), (5, True), (10, True), (32, True), (33, False)])
def test_step_window_is_5_to_32(steps, ok):
    make = lambda: cap.ProfileScenario("decode_control", "D1", 1024, 1024, 1, num_steps=steps)  # noqa: E731
    if ok:
        assert make().num_steps == steps
    else:
        with pytest.raises(cap.CaptureError, match="5-32"):
            make()


def test_prefix_hit_needs_a_shared_prefix_shorter_than_the_prompt():
    with pytest.raises(cap.CaptureError, match="prefix_tokens"):
        cap.ProfileScenario("prefix_hit", "H8", 1600, 16, 4, num_steps=16)
    with pytest.raises(cap.CaptureError, match="prefix_tokens"):
        cap.ProfileScenario("prefix_hit", "H8", 1600, 16, 4, num_steps=16, prefix_tokens=1600)


def test_scenario_rejects_bad_input_and_never_reuses_the_clean_case_folder():
    with pytest.raises(cap.CaptureError, match="not one of"):
        cap.ProfileScenario("decode", "D1", 8, 8, 1, num_steps=16)
    with pytest.raises(cap.CaptureError, match="case_id"):
        cap.ProfileScenario("decode_control", "../D1", 8, 8, 1, num_steps=16)
    with pytest.raises(cap.CaptureError, match="inject_isl_tokens"):
        cap.ProfileScenario("mixed_treatment", "M1", 8, 8, 4, num_steps=32)
    s = cap.ProfileScenario("decode_control", "D2_c=32", 8, 8, 4, num_steps=16)
    assert s.profiled_case_id != s.case_id and s.profiled_case_id.startswith(s.case_id)
    # vLLM's own rule for profile_prefix (vllm/config/profiler.py), restated here
    p = s.profile_prefix
    assert 1 <= len(p) <= 128 and p[0].isalnum() and all(c.isalnum() or c in "._-" for c in p)


# ---------------------------------------------------------------- names

@pytest.mark.parametrize("name,expected", [
    ("20261129203606-TP-1.trace.json.gz", {"kind": "worker", "rank_key": "TP-1", "tp": 1}),
    ("D2.decode-1764.5-TP-3-DP-0-PP-1-EP-3.trace.json.gz",
     {"kind": "worker", "rank_key": "TP-3-DP-0-PP-1-EP-3", "tp": 3, "dp": 0, "pp": 1, "ep": 3}),
    ("1764.5-TP-0-EXTEND.trace.json.gz", {"kind": "worker", "rank_key": "TP-0", "tp": 0, "stage": "EXTEND"}),
    ("merged-1764.5.trace.json.gz", {"kind": "merged"}),
    ("1764.5-TP-2-memory.pickle", {"kind": "memory", "tp": 2}),
    ("D2-c4.decode_control_rank0.1795988865687799679.pt.trace.json.gz",
     {"kind": "worker", "rank_key": "rank0", "rank": 0}),
    ("dp0_pp1_tp3_dcp0_ep3_rank11.1795988865687799679.pt.trace.json.gz",
     {"kind": "worker", "rank_key": "rank11", "rank": 11, "tp": 3, "pp": 1, "dp": 0, "ep": 3, "dcp": 0}),
    ("D2-c4.decode_control_vm_21007.async_llm.1795988871347811260.pt.trace.json.gz", {"kind": "frontend"}),
    ("D2-c4.decode_control_rank0.profiler_out.txt", {"kind": "table"}),
    ("notes.md", {"kind": "other"}),
])
def test_trace_identity_from_engine_file_names(name, expected):
    got = cap.trace_identity(name)
    assert {k: got.get(k) for k in expected} == expected


# ---------------------------------------------------------------- SGLang end to end (HTTP stand-in)

class _StubSGLang(BaseHTTPRequestHandler):
    """Answers /start_profile like SGLang with num_steps: 200, then writes each rank's trace in two
    parts 0.6 s apart (a file that is still growing must not be collected)."""

    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"null")
        srv = self.server
        srv.calls.append((self.path, body))
        if self.path == "/start_profile":
            threading.Thread(target=srv.write_traces, args=(body,), daemon=True).start()
            self._reply(200, b"Start profiling.\n")
        elif self.path == "/stop_profile":
            self._reply(400, b'{"detail":"Profiling is not in progress. Call /start_profile first."}')
        else:
            self._reply(404, b"")

    def _reply(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def sglang_stub(h200x2: Path, tmp_path: Path):
    traces = h200x2 / "traces"
    real = {0: traces / "20261129203606-TP-0.trace.json.gz", 1: traces / "20261129203606-TP-1.trace.json.gz"}
    worker_dir = tmp_path / "node1-profiles"
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StubSGLang)
    httpd.calls = []
    httpd.truncate = False

    def write_traces(body):
        dirs = {0: Path(body["output_dir"]), 1: worker_dir}
        for rank, d in dirs.items():
            d.mkdir(parents=True, exist_ok=True)
            data = real[rank].read_bytes()
            if httpd.truncate and rank == 1:
                data = data[: len(data) - 4096]
            out = d / f"{body['profile_prefix']}-1764.25-TP-{rank}.trace.json.gz"
            with open(out, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                time.sleep(0.6)
                f.write(data[len(data) // 2:])

    httpd.write_traces = write_traces
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    prof = tmp_path / "node0-profiles"
    target = target_from_dict({
        "name": "two-node-stub", "engine": "sglang", "model": "/models/x",
        "launch": {"tp_size": 2, "profiler_dir": str(prof)},
        "nodes": [{"name": "node0", "kind": "local", "role": "head"},
                  {"name": "node1", "kind": "ssh", "role": "worker", "host": "127.0.0.1"}]})
    port = httpd.server_address[1]
    srv = RunningServer(target, f"http://127.0.0.1:{port}", port, [], {}, {"node0": LocalHost("node0"),
                        "node1": RemoteLikeHost("node1")}, {}, "/models/x", "", 0.0)
    yield srv, httpd, real, worker_dir
    httpd.shutdown()
    httpd.server_close()


def _scenario() -> cap.ProfileScenario:
    return cap.ProfileScenario("decode_control", "D2-c32", 1024, 1024, 32, num_steps=16, skip_steps=2)


def test_sglang_capture_collects_every_rank_from_every_node(sglang_stub, tmp_path: Path):
    srv, httpd, real, worker_dir = sglang_stub
    sc = _scenario()
    head_dir = Path(srv.target.launch["profiler_dir"]) / sc.profiled_case_id
    head_dir.mkdir(parents=True)
    old = head_dir / "old-1700.0-TP-0.trace.json.gz"           # an earlier session's file: not ours
    shutil.copyfile(real[0], old)
    case_dir = tmp_path / "run" / "cases" / sc.profiled_case_id
    case_dir.mkdir(parents=True)
    (case_dir / "meta.json").write_text(json.dumps({"case_id": sc.profiled_case_id, "status": "success",
                                                    "invalid_reasons": ["too few requests"]}))
    run_dir = tmp_path / "run"

    res = cap.capture(srv, sc, case_dir, lambda start: start(), trace_dirs={"node1": str(worker_dir)},
                      wait_timeout_s=30, run_dir=run_dir, phase="phase3", start_step=120,
                      activities=("CPU", "GPU"))

    # the request SGLang received, and no /stop_profile: num_steps stops it by itself
    assert [c[0] for c in httpd.calls] == ["/start_profile"]
    body = httpd.calls[0][1]
    assert body == {"output_dir": str(head_dir), "activities": ["CPU", "GPU"], "profile_by_stage": False,
                    "with_stack": False, "record_shapes": True, "num_steps": 16, "start_step": 120,
                    "profile_prefix": sc.profile_prefix}
    # every rank, from its node, byte-identical, under the engine's own name; the old file left behind
    assert res.wait.complete and res.wait.missing_ranks == {"node0": 0, "node1": 0}
    got = {(f.node, f.identity["rank_key"]): case_dir / f.path for f in res.files}
    assert sorted(got) == [("node0", "TP-0"), ("node1", "TP-1")]
    for (node, key), path in got.items():
        rank = int(key.split("-")[1])
        assert path.parent == case_dir / "profiles" / node
        assert re.fullmatch(rf"{re.escape(sc.profile_prefix)}-1764\.25-TP-{rank}\.trace\.json\.gz", path.name)
        assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(real[rank].read_bytes()).digest()
    assert not (case_dir / "profiles" / "node0" / old.name).exists()
    # the case is marked, its earlier reasons kept; the HTTP calls are in the command log
    meta = json.loads((case_dir / "meta.json").read_text())
    assert meta["status"] == "success" and meta["profiled"] is True and meta["valid_for_comparison"] is False
    assert meta["invalid_reasons"][0] == "too few requests" and meta["invalid_reasons"][1].startswith("profiler")
    assert meta["profile"]["worker_traces"] == 2 and cap.is_profiled(case_dir)
    cmds = [json.loads(x) for x in (run_dir / "commands.jsonl").read_text().splitlines()]
    assert [c["label"] for c in cmds] == ["executed"] and cmds[0]["argv"][:4] == ["curl", "-sS", "-X", "POST"]
    assert json.loads(cmds[0]["argv"][-1]) == body
    assert "skip of" not in " ".join(res.session.notes)         # an absolute start_step was given
    # each node's clock offset to the client is recorded beside the traces: the local head is this machine (0 ± 0);
    # the SSH worker's comes from the run's preflight, which this run never recorded: null, with the reason
    clock = json.loads((case_dir / "clock.json").read_text())
    assert clock["client"] == "node0" and clock["nodes"]["node0"]["offset_ns"] == 0
    assert clock["nodes"]["node1"] == {"offset_ns": None, "uncertainty_ns": None,
                                       "reason": "the run's manifest has no preflight"}


def test_truncated_trace_is_reported_not_collected(sglang_stub, tmp_path: Path):
    srv, httpd, real, worker_dir = sglang_stub
    httpd.truncate = True
    sc = _scenario()
    session = cap.start_profile(srv, sc, trace_dirs={"node1": str(worker_dir)})
    assert "start_step" not in session.request_body
    assert "skip of 2 steps" in " ".join(session.notes)        # SGLang start_step is absolute: said so
    session = cap.stop_profile(srv, session)
    wait = cap.wait_for_traces(srv, session, timeout_s=2, poll_s=0.1, settle_s=0.5)
    assert wait.timed_out and not wait.complete
    assert wait.missing_ranks == {"node0": 0, "node1": 1}
    assert list(wait.broken) == ["node1"]
    files = cap.collect_profiles(srv, session, tmp_path / "case", wait)
    assert [(f.node, f.identity["rank_key"]) for f in files] == [("node0", "TP-0")]
    ok, why = cap.local_file_complete(next(worker_dir.iterdir()))
    assert not ok and why


def test_failed_drive_still_stops_the_profiler(sglang_stub, tmp_path: Path):
    srv, httpd, _, worker_dir = sglang_stub

    def drive(start):
        start()
        raise RuntimeError("client died")

    with pytest.raises(RuntimeError, match="client died"):
        cap.capture(srv, _scenario(), tmp_path / "c", drive, trace_dirs={"node1": str(worker_dir)})
    assert [c[0] for c in httpd.calls] == ["/start_profile", "/stop_profile"]
    with pytest.raises(cap.CaptureError, match="without calling start"):
        cap.capture(srv, _scenario(), tmp_path / "c", lambda start: None)


# ---------------------------------------------------------------- refusals before any request

def _srv(engine: str, launch: dict) -> RunningServer:
    t = target_from_dict({"name": "x", "engine": engine, "model": "/m", "launch": launch})
    return RunningServer(t, "http://127.0.0.1:9", 9, [], {}, {"local": LocalHost()}, {}, "/m", "", 0.0)


def test_refusals_name_the_problem(tmp_path: Path):
    sc = _scenario()
    with pytest.raises(cap.CaptureError, match="profiler_dir"):
        cap.start_profile(_srv("vllm", {}), sc)
    with pytest.raises(cap.CaptureError, match="torch_profiler_dir"):
        cap.start_profile(_srv("vllm", {"profiler_dir": str(tmp_path / "a")}), sc, out_dir=str(tmp_path / "b"))
    with pytest.raises(cap.CaptureError, match="no profiler endpoint"):
        cap.start_profile(_srv("llamacpp", {}), sc)
    with pytest.raises(cap.CaptureError, match="output folder"):
        cap.start_profile(_srv("sglang", {}), sc)


def test_vllm_body_is_the_step_window():
    assert vllm_start_profile_body("D2.decode_control", 2, 16) == {
        "profile_prefix": "D2.decode_control", "delay_iterations": 2, "max_iterations": 16}
    assert vllm_start_profile_body(None, 0, None) == {}


def test_clean_case_is_not_profiled(tmp_path: Path):
    (tmp_path / "meta.json").write_text(json.dumps({"case_id": "D1", "status": "success"}))
    assert not cap.is_profiled(tmp_path)
    assert not cap.is_profiled(tmp_path / "missing")
