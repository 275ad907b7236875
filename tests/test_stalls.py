"""One clock: client chunk arrivals joined with the trace's engine steps (analyse/trace/stalls.py).

The main case is a real capture (data/samples/vllm-cpu-mixed: vLLM 0.32 on CPU, 8 decode streams and one injected
1536-token prefill, recorded by `servelab run phase3 --target local-vllm`); the hand-built cases check the rules
where the answer is known by construction.
"""
from __future__ import annotations

import polars as pl
import pytest

from servelab.analyse.trace import stalls as S
from servelab.analyse.trace.analysis import analyse
from servelab.analyse.trace.questions import q10
from servelab.core.paths import samples_root
from servelab.measure.records import RequestRecord, read_records

SAMPLE = samples_root() / "vllm-cpu-mixed"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    a = analyse(SAMPLE / "profiles", cache_dir=tmp_path_factory.mktemp("cache"))
    recs = read_records(SAMPLE / "requests.jsonl")
    return a, recs, S.one_clock(recs, a.windows)


def test_vllm_step_annotations_are_the_engine_steps(live):
    a, _, oc = live
    assert oc.steps.height == 32                       # the 32-step window asked of /start_profile
    # no GPU kernels on a CPU engine: the forward's torch ops inside each annotation are the step's device work
    assert set(oc.steps["span"]) == {"ops"}
    pre = oc.steps.filter(pl.col("prefill_tokens") > 0)
    assert pre.height == 1 and pre["name"][0] == "execute_context_1(1536)_generation_8(8)"
    assert (pre["prefill_tokens"][0], pre["prefill_reqs"][0], pre["decode_reqs"][0]) == (1536, 1, 8)
    # every step lies inside the client's drive: the trace is on the client's wall clock
    sends = [r.send_wall_ns for r in read_records(SAMPLE / "requests.jsonl") if r.role == "background"]
    ends = [r.end_ns + r.wall_offset_ns for r in read_records(SAMPLE / "requests.jsonl") if r.role == "background"]
    assert min(sends) < oc.steps["start_ns"].min() and oc.steps["end_ns"].max() < max(ends)


def test_stalls_of_the_mixed_capture_name_the_injected_prefill_step(live):
    _, recs, oc = live
    assert oc.p99_itl_ms is not None and oc.steady_gaps >= 40
    assert oc.p99_itl_ms < 38.0                          # below the prefill step: its stall stands out
    assert (oc.stalls["gap_ms"] > oc.p99_itl_ms).all()
    pre = oc.prefill_stalls
    background = {r.request_id for r in recs if r.role == "background"}
    # every one of the 8 decode streams stalled across the prefill step, and the table names that step
    assert set(pre["request_id"]) == background
    assert pre["longest_step"].str.starts_with("prefill 1536 tok (1 req) + 8 decode, ").all()
    assert pre["steps"].str.contains("execute_context_1(1536)_generation_8(8)", literal=True).all()
    prefill_ms = float(oc.steps.filter(pl.col("prefill_tokens") > 0)["dur_ms"][0])
    assert (pre["gap_ms"] >= prefill_ms).all()         # a stall lasts at least the step it waited for
    # the profiler's own pauses (start, trace writing) are seen by the client but not attributed
    assert oc.outside.height > 0 and float(oc.outside["gap_ms"].max()) > 10 * oc.p99_itl_ms


def test_ttft_split_of_the_injected_request_adds_up_and_respects_causality(live):
    _, _, oc = live
    inj = oc.ttft.filter(pl.col("role") == "inject").row(0, named=True)
    assert inj["identified"] and inj["input_tokens"] == 1536
    assert inj["queueing_ms"] >= 0 and inj["delivery_ms"] >= 0
    assert inj["queueing_ms"] + inj["prefill_ms"] + inj["delivery_ms"] == pytest.approx(inj["ttft_ms"], abs=0.01)
    assert inj["prefill_step"].startswith("prefill 1536 tok")
    # the background streams started before the capture: no prefill step of theirs is in the trace
    assert not oc.ttft.filter(pl.col("role") == "background")["identified"].any()
    assert oc.clock["causality_ok"] is True and oc.clock["min_delivery_ms"] == inj["delivery_ms"]


def test_q10_is_answered_from_the_one_clock_on_a_cpu_trace(live):
    a, _, oc = live
    assert not q10(a).answerable                        # no GPU kernels: the kernel-side answer has nothing
    ans = q10(a, oc)
    assert ans.answerable
    assert "8 decode stream(s) stalled" in ans.answer and "prefill 1536 tok (1 req) + 8 decode" in ans.answer
    assert "execute_context_1(1536)_generation_8(8)" in ans.evidence


# ---------------------------------------------------------------- rules, by construction

def _rec(rid: str, role: str, send_ms: float, chunks_ms: list[float], prompt: int = 100) -> RequestRecord:
    ms = 1_000_000
    return RequestRecord(request_id=rid, index=0, role=role, expected_input_tokens=prompt, requested_output_tokens=5,
                         http_status=200, send_ns=int(send_ms * ms), chunk_ns=[int(c * ms) for c in chunks_ms],
                         chunk_choices=[True] * len(chunks_ms), prompt_tokens=prompt, wall_offset_ns=10**18,
                         end_ns=int(chunks_ms[-1] * ms))


def _windows(steps: list[tuple[str, float, float]]) -> pl.DataFrame:
    ms = 1_000_000
    return pl.DataFrame({"rank": [0] * len(steps), "window": list(range(len(steps))), "name": [s[0] for s in steps],
                         "kind": ["x"] * len(steps), "cpu_start_ns": [10**18 + int(s[1] * ms) for s in steps],
                         "cpu_end_ns": [10**18 + int(s[2] * ms) for s in steps],
                         "gpu_start_ns": [None] * len(steps), "gpu_end_ns": [None] * len(steps)},
                        schema_overrides={"gpu_start_ns": pl.Int64, "gpu_end_ns": pl.Int64})


def test_a_gap_is_attributed_to_exactly_the_steps_it_overlaps():
    # decode steps every 10 ms; a 50 ms prefill step (chunk of 8192 tokens) at 100-150 ms
    steps = [("execute_context_0(0)_generation_2(2)", t, t + 8) for t in range(0, 100, 10)]
    steps += [("execute_context_1(8192)_generation_2(2)", 100, 150)]
    steps += [("execute_context_0(0)_generation_2(2)", t, t + 8) for t in range(150, 300, 10)]
    arrivals = [t + 9 for t in range(0, 100, 10)] + [151] + [t + 9 for t in range(160, 300, 10)]
    recs = [_rec("a", "background", -5, arrivals), _rec("b", "background", -5, [x + 0.5 for x in arrivals]),
            _rec("inj", "inject", 95, [152], prompt=8192)]
    oc = S.one_clock(recs, _windows(steps))
    assert oc.p99_itl_ms == pytest.approx(10.0)          # steady gaps are all 10 ms outside the injection
    assert set(oc.stalls["request_id"]) == {"a", "b"}
    row = oc.stalls.filter(pl.col("request_id") == "a").row(0, named=True)
    assert row["gap_ms"] == pytest.approx(52.0) and row["cause"] == "prefill" and row["prefill_tokens"] == 8192
    assert row["longest_step"] == "prefill 8192 tok (1 req) + 2 decode, 50.0 ms"
    inj = oc.ttft.filter(pl.col("request_id") == "inj").row(0, named=True)
    assert (inj["queueing_ms"], inj["prefill_ms"], inj["delivery_ms"]) == pytest.approx((5.0, 50.0, 2.0))


def test_chunked_prefill_is_split_over_its_chunks_and_other_hosts_are_not_joined():
    steps = [("step[EXTEND bs=1 toks=4096]", 10, 40), ("step[EXTEND bs=1 toks=4096]", 41, 71),
             ("step[DECODE bs=1]", 72, 75)]
    rec = _rec("r", "measure", 0, [80, 85], prompt=8192)
    split = S.ttft_split([rec], S.engine_steps(_windows(steps)))
    r = split.row(0, named=True)
    assert r["prefill_steps"] == 2 and (r["queueing_ms"], r["prefill_ms"], r["delivery_ms"]) == pytest.approx(
        (10.0, 61.0, 9.0))
    off = S.one_clock([rec], _windows(steps), same_host=False)
    assert off.stalls.height == 0 and off.ttft.height == 0 and "no shared clock" in off.clock["method"]


def test_step_content_reads_each_engines_step_names():
    assert S.step_content("execute_context_2(300)_generation_6(6)") == \
        {"prefill_reqs": 2, "prefill_tokens": 300, "decode_reqs": 6}
    assert S.step_content("execute_310_context_2(sq300sk300sqsq45000sqsk45000)_generation_6(sq6sk600sqsq6sqsk600)") == \
        {"prefill_reqs": 2, "prefill_tokens": 300, "decode_reqs": 6}
    assert S.step_content("step[EXTEND bs=3 toks=2048]")["prefill_tokens"] == 2048
    assert S.step_content("step[DECODE bs=32]") == {"prefill_reqs": 0, "prefill_tokens": 0, "decode_reqs": 32}
    assert S.step_content("mixed_prefill_chunk_8192")["prefill_tokens"] == 8192


# ---------------------------------------------------------------- traces from another node, shifted by its offset

D_NS = 7_654_321_987          # the simulated node's clock runs 7.65 s ahead of the client's


def _remote_case(tmp_path, node: str = "n2", ahead_ns: int = D_NS):
    """The real capture as if its engine ran on ``node``: the node folder renamed and every trace written on a clock
    ``ahead_ns`` ahead of the client's (Kineto ``baseTimeNanoseconds`` moved by that much; event ``ts`` are relative
    to it)."""
    import gzip
    import json
    import shutil
    case = tmp_path / "case"
    shutil.copytree(SAMPLE, case)
    (case / "profiles" / "local").rename(case / "profiles" / node)
    for f in (case / "profiles" / node).glob("*.json.gz"):
        d = json.loads(gzip.open(f).read())
        d["baseTimeNanoseconds"] = int(d["baseTimeNanoseconds"]) + ahead_ns
        f.write_bytes(gzip.compress(json.dumps(d).encode()))
    return case


def _write_clock(case, node: str, offset_ns: int | None, unc_ns: int = 250_000):
    import json
    entry = {"offset_ns": offset_ns, "uncertainty_ns": unc_ns, "rtt_ns": 2 * unc_ns, "how": "test"} \
        if offset_ns is not None else {"offset_ns": None, "uncertainty_ns": None, "reason": "date +%s%N failed"}
    (case / S.CASE_CLOCK_FILE).write_text(json.dumps({"client": "local", "measured_at": "2026-11-30T20:00:00.000+00:00",
                                                      "nodes": {node: entry}}))


def _case_clock(case, tmp_path):
    from servelab.phases.phase3_timeline import case_clock
    return case_clock(case / "profiles", analyse(case / "profiles", cache_dir=tmp_path / "cache"))


def test_a_remote_nodes_trace_shifted_by_its_measured_offset_gives_the_local_attribution(live, tmp_path):
    _, _, local = live
    case = _remote_case(tmp_path)
    # without the node's offset the join is refused, saying what to do
    refused = _case_clock(case, tmp_path)
    assert not refused.clock["joined"] and refused.stalls.height == 0 and refused.ttft.height == 0
    assert "traces from n2" in refused.clock["method"] and "preflight" in refused.clock["method"]
    from servelab.phases.phase3_timeline import Phase3, stall_table
    a = analyse(case / "profiles", cache_dir=tmp_path / "cache")
    assert "client and trace not joined: traces from n2" in q10(a, refused).evidence        # said where it matters
    assert stall_table(Phase3(a, pl.DataFrame(), pl.DataFrame(), {}, refused))["note"][0].startswith(
        "one clock not joined: traces from n2")
    _write_clock(case, "n2", None)
    refused = _case_clock(case, tmp_path)
    assert not refused.clock["joined"] and "n2 (date +%s%N failed)" in refused.clock["method"]
    # with it, the stalls, the steps they overlapped and the TTFT split are the unshifted capture's
    _write_clock(case, "n2", D_NS, unc_ns=250_000)
    oc = _case_clock(case, tmp_path)
    assert oc.clock["joined"] and not oc.clock["shared_clock"]
    assert oc.steps.drop("rank").equals(local.steps.drop("rank"))
    assert oc.stalls.equals(local.stalls) and oc.stalls.height > 0
    assert oc.ttft.equals(local.ttft) and oc.p99_itl_ms == local.p99_itl_ms
    assert oc.clock["method"].startswith("client on local, traces from n2: shifted by -7654.322 ms ± 0.250 ms "
                                         "(measured in preflight at 2026-11-30T20:00:00.000+00:00")
    assert oc.clock["uncertainty_ms"] == 0.25 and oc.clock["causality_ok"] is True


def test_the_causality_check_allows_the_offsets_uncertainty_and_no_more(live, tmp_path):
    _, _, local = live
    md = local.clock["min_delivery_ms"]
    assert md is not None and md > 0
    case = _remote_case(tmp_path)
    # the recorded offset is wrong by (min delivery + 1 ms): the first chunk now lands 1 ms before its prefill ends
    wrong = D_NS - int((md + 1.0) * 1e6)
    _write_clock(case, "n2", wrong, unc_ns=2_000_000)          # ± 2 ms covers it
    oc = _case_clock(case, tmp_path)
    assert oc.clock["min_delivery_ms"] == pytest.approx(-1.0, abs=0.002)
    assert oc.clock["causality_ok"] is True and "within the offset's uncertainty" in oc.clock["bound"]
    _write_clock(case, "n2", wrong, unc_ns=500_000)            # ± 0.5 ms does not
    oc = _case_clock(case, tmp_path)
    # a step that ended 1 ms after the first chunk arrived cannot be its prefill within ± 0.5 ms: not identified,
    # so nothing vouches for the clocks
    assert oc.clock["causality_ok"] is not True
    inj = oc.ttft.filter(pl.col("role") == "inject").row(0, named=True)
    assert not inj["identified"]
    assert "no later than 0.500 ms" in oc.clock["bound"] and "cannot be bounded" in oc.clock["bound"]


def _renamed_step(tmp_path, old: str, new: str):
    """The real capture with one step annotation renamed in its trace (what the engine would have written had that
    step computed something else)."""
    import gzip
    import shutil
    case = tmp_path / "case"
    shutil.copytree(SAMPLE, case)
    renamed = 0
    for f in (case / "profiles").rglob("*.json.gz"):
        text = gzip.open(f).read().decode()
        renamed += text.count(old)
        f.write_bytes(gzip.compress(text.replace(old, new).encode()))
    assert renamed
    return case


def test_the_mixed_window_check_wants_the_injected_prefill_not_a_background_one(tmp_path):
    """A kept mixed capture must trace the injected 1536-token prefill; a replacement background stream's 128-token
    prefill in the window does not answer Q10, so that capture is refused (and captured again)."""
    from types import SimpleNamespace
    from servelab.measure.capture import capture_scenarios
    from servelab.phases.phase3_timeline import mixed_window_check
    mixed = capture_scenarios("local")[1]
    assert (mixed.name, mixed.isl_tokens, mixed.inject_isl_tokens) == ("mixed_treatment", 128, 1536)
    assert mixed_window_check(SimpleNamespace(scenario=mixed, profiles=SAMPLE / "profiles")) == ""
    step = "execute_context_1(1536)_generation_8(8)"
    for name, refused in [("execute_context_1(128)_generation_8(8)", True),       # a background prompt
                          ("execute_context_2(256)_generation_7(7)", True),       # two of them
                          ("execute_context_1(512)_generation_8(8)", False),      # a chunk of the injected one
                          ("execute_context_2(1664)_generation_7(7)", False)]:    # injected + background together
        case = _renamed_step(tmp_path / name, step, name)
        why = mixed_window_check(SimpleNamespace(scenario=mixed, profiles=case / "profiles"))
        assert (why != "") == refused, (name, why)
        if refused:
            assert why.startswith("its injected 1536-token prefill ran outside the 32 traced steps") \
                and "1 traced step(s) prefilled only background prompts of 128 tokens" in why
    # the prefill as a step of its own, decodes waiting on it (SGLang's EXTEND): a decode step just before it
    case = _renamed_step(tmp_path / "own-step", step, "execute_context_1(1536)_generation_0(0)")
    assert mixed_window_check(SimpleNamespace(scenario=mixed, profiles=case / "profiles")) == ""
    # a real capture on a loaded host: the background had ended during /start_profile, the prefill ran first, alone
    idle = samples_root() / "vllm-cpu-mixed-no-decode"
    first = analyse(idle / "profiles", cache_dir=tmp_path / "cache").windows.sort("cpu_start_ns")["name"][0]
    assert first == "execute_context_1(1536)_generation_0(0)"
    why = mixed_window_check(SimpleNamespace(scenario=mixed, profiles=idle / "profiles"))
    assert why.startswith("its injected 1536-token prefill ran with no decode in flight"), why
    recs = read_records(idle / "requests.jsonl")
    inject = next(r for r in recs if r.role == "inject")
    assert not [r for r in recs if r.role == "background" and r.send_wall_ns < inject.send_wall_ns
                and r.end_ns + r.wall_offset_ns > inject.send_wall_ns]       # the client saw it the same way
    other = SimpleNamespace(scenario=capture_scenarios("local")[0], profiles=SAMPLE / "profiles")
    assert mixed_window_check(other) == ""          # only the mixed scenario is checked
