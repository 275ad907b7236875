"""The correctness check of an A/B (``servelab.measure.correctness``) on greedy outputs real engines returned
(``tests/data/greedy``, README there): llama.cpp with a setting that leaves the numerics alone (``-b 32``) and one
that does not (``--rope-freq-base 1000``), and SGLang against vLLM on the same tiny model; then the A/B that
carries it (``abtest.ab_compare``, its risk question) and M4, which fails on a change that alters greedy outputs."""
from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

from servelab.core.run import init_run, update_manifest, write_json_atomic
from servelab.deploy.engines import engine_for
from servelab.measure import correctness as cx
from servelab.measure.abtest import ab_compare, write_ab_tables
from servelab.report.milestones import milestones

sys.path.insert(0, str(Path(__file__).parent))
from casefiles import write_cases  # noqa: E402

DATA = Path(__file__).parent / "data" / "greedy"


def load(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


# ---------------------------------------------------------------- the comparison on real outputs

def test_a_setting_that_keeps_the_numerics_leaves_every_prompt_identical():
    rows = cx.compare_greedy(load("llamacpp_a"), load("llamacpp_b_batch32"), "batch_size=32")
    assert list(rows["status"]) == ["identical"] * len(cx.PROMPTS)
    assert (rows["matched_tokens"] == cx.MAX_TOKENS).all() and (rows["compared_by"] == "token ids").all()
    verdict, detail = cx.correctness_verdict(rows)
    assert verdict == "no regression" and detail.startswith("8 of 8 prompts identical token for token")


def test_a_setting_that_changes_greedy_output_is_a_regression_at_the_token_where_it_parts():
    a, b = load("llamacpp_a"), load("llamacpp_b_rope1000")
    rows = cx.compare_greedy(a, b, "rope")
    differ = rows[rows["status"] == "differs"]
    assert len(differ) >= 1
    # recomputed by hand from the two files: the first position where the token ids part
    for r in differ.itertuples():
        ia = next(o for o in a["outputs"] if o["prompt"] == r.prompt)["token_ids"]
        ib = next(o for o in b["outputs"] if o["prompt"] == r.prompt)["token_ids"]
        k = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
        assert r.first_difference == k and r.matched_tokens == k
        assert f"(id {ia[k]})" in r.token_a and f"(id {ib[k]})" in r.token_b
        # the log-probabilities before that token moved (rope base changes every attention score) but not past 0.1
        assert 0 < r.max_logprob_drift < cx.LOGPROB_TOL
    verdict, detail = cx.correctness_verdict(rows)
    assert verdict == "regression" and f"{len(differ)} of 8 prompts differ" in detail
    summ = cx.greedy_summary(rows).iloc[0]
    assert (summ["verdict"], summ["differ"], summ["identical"]) == ("regression", len(differ), 8 - len(differ))


def test_sglang_and_vllm_on_the_same_model_agree_token_for_token():
    rows = cx.compare_greedy(load("sglang_a"), load("vllm_a"), "vllm")
    assert list(rows["status"]) == ["identical"] * 8
    assert rows["max_logprob_drift"].max() < 1e-4            # two engines, two kernels: tiny drift, no flip
    # a tolerance below that drift calls the same outputs a logprob drift: the tolerance is the parameter
    tight = cx.compare_greedy(load("sglang_a"), load("vllm_a"), "vllm", tol=1e-9)
    assert set(tight["status"]) == {"logprob drift"} and cx.correctness_verdict(tight)[0] == "regression"


def test_what_decides_nothing_says_why():
    a, b = load("llamacpp_a"), copy.deepcopy(load("llamacpp_b_batch32"))
    b["outputs"][0]["stable"] = False                         # B's two answers to prompt 0 differed
    b["outputs"][1]["error"] = "HTTP 500: boom"
    rows = cx.compare_greedy(a, b, "B")
    assert list(rows["status"][:2]) == ["unstable on B", "error on B"]
    verdict, detail = cx.correctness_verdict(rows)
    assert verdict == "not decidable" and "6 of 8 prompts identical" in detail
    assert cx.correctness_verdict(cx.compare_greedy(a, None, "B"))[0] == "not measured"
    assert cx.correctness_verdict(pd.DataFrame())[0] == "not measured"
    view = cx.prompts_view(rows)
    assert "⏎" in view["prompt"].iloc[1] and "\n" not in "".join(view["prompt"])


@pytest.mark.parametrize("engine,body,expect", [
    ("sglang", {"choices": [{"text": "ab", "token_ids": [5, 6], "finish_reason": "length",
                             "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0]}}]},
     {"token_ids": [5, 6], "tokens": ["a", "b"], "logprobs": [-0.5, -1.0], "finish_reason": "length"}),
    ("vllm", {"choices": [{"text": "ab", "finish_reason": "length", "logprobs": None}]},
     {"token_ids": None, "tokens": None, "logprobs": None}),
    ("llamacpp", {"content": "QV", "tokens": [308, 313], "stop_type": "limit",
                  "completion_probabilities": [{"id": 308, "token": "Q", "logprob": -0.589},
                                               {"id": 313, "token": "V", "logprob": -0.757}]},
     {"token_ids": [308, 313], "tokens": ["Q", "V"], "logprobs": [-0.589, -0.757], "finish_reason": "limit"}),
    # with a draft model llama.cpp reports probability 1 for accepted draft tokens: not the model's, none kept
    ("llamacpp", {"content": "tW", "tokens": [343, 314], "stop_type": "limit", "timings": {"draft_n": 8},
                  "completion_probabilities": [{"id": 343, "token": "t", "logprob": -0.227},
                                               {"id": 314, "token": "W", "logprob": 0.0}]},
     {"token_ids": [343, 314], "logprobs": None}),
])
def test_each_engine_reads_its_own_answer(engine, body, expect):
    """The answer shapes the real engines returned (``greedy_outputs.json`` keeps what each adapter read from them)."""
    eng = engine_for(engine)
    out = eng.greedy_output(body)
    assert {k: out[k] for k in expect} == expect
    req = eng.greedy_body("m", "hi", 8)
    assert req["temperature"] == 0.0 and req.get("max_tokens", req.get("n_predict")) == 8
    assert eng.greedy_path == ("/completion" if engine == "llamacpp" else "/v1/completions")


# ---------------------------------------------------------------- the A/B and M4

def record(rdir: Path, phase: str, name: str, extra_args: list[str], tps: list[float], greedy: str | None) -> Path:
    """A launch variant's run-like record as ``write_run_record`` leaves it (manifest, cases, greedy outputs)."""
    rec = rdir / phase / "ab" / name
    write_json_atomic(rec / "manifest.json", {
        "schema_version": 1, "run_id": f"{rdir.name}-{name}", "target": "local-tiny", "engine": {"name": "llamacpp"},
        "model": {"model": "tiny"}, "launch": {"plans": [{"node": "local", "command": "llama-server " + " ".join(
            extra_args), "port": 0}], "env": {}, "settings": {"parallel": 32, "extra_args": extra_args}}})
    write_cases(rec, [{"case_id": "I7", "repeat": i, "output_tps": v, "p95_ttft_ms": 100.0, "p95_tpot_ms": 20.0,
                       "valid": True} for i, v in enumerate(tps)], phase=phase)
    if greedy:
        shutil.copy(DATA / f"{greedy}.json", rec / cx.OUTPUTS_FILE)
    return rec


def ab_run(outputs: Path, name: str, b_greedy: str, b_tps: list[float], keep: str = "") -> Path:
    rdir = init_run(name, "local-tiny")
    a = record(rdir, "phase7", "A", [], [100, 101, 99], "llamacpp_a")
    b = record(rdir, "phase7", "B", ["-x"], b_tps, b_greedy)
    ab = ab_compare([a, b], "extra_args", answers={"keep": keep} if keep else None)
    write_ab_tables(ab, rdir / "phase7")
    return rdir


def test_the_ab_carries_the_correctness_check_into_its_risk_question(outputs):
    rdir = ab_run(outputs, "ab-rope", "llamacpp_b_rope1000", [120, 121, 119])
    corr = pd.read_csv(rdir / "phase7" / "ab_correctness.csv")
    assert set(corr["b_run"]) == {"ab-rope-B"} and (corr["status"] == "differs").any()
    q = pd.read_csv(rdir / "phase7" / "ab_questions.csv")
    risk = q[q["question"].str.startswith("6.")]["answer"].iloc[0]
    assert "greedy outputs, ab-rope-B against ab-rope-A: regression" in risk


def test_m4_fails_when_b_changes_greedy_output_even_with_a_gain(outputs):
    rdir = ab_run(outputs, "m4-rope", "llamacpp_b_rope1000", [120, 121, 119])       # +20 % output TPS
    m4 = milestones(rdir)[3]
    checks = {c.check.split(" (")[0]: c for c in m4.checks}
    assert checks["reproduced without the profiler"].status == "pass"
    corr = checks["no correctness regression"]
    assert corr.status == "fail" and "phase7 m4-rope-B: regression" in corr.detail and "differ" in corr.detail
    gain = m4.checks[-1]
    assert gain.status == "fail" and "a gain, but not with the same greedy outputs" in gain.detail
    assert "+20.0 %" in gain.detail and m4.status == "not met"
    assert "phase7/ab_correctness.csv" in corr.tables


def test_m4_is_met_by_a_gain_with_identical_greedy_outputs(outputs):
    rdir = ab_run(outputs, "m4-ok", "llamacpp_b_batch32", [120, 121, 119])
    m4 = milestones(rdir)[3]
    assert m4.status == "met", [(c.check, c.status, c.detail) for c in m4.checks]
    assert "no regression" in m4.checks[3].detail and "output TPS (no goodput: no SLO set) +20.0 %" in m4.checks[4].detail


def test_m4_below_ten_percent_needs_a_written_exclusion(outputs):
    rdir = ab_run(outputs, "m4-small", "llamacpp_b_batch32", [105, 106, 104])      # +5 %: outside noise, < 10 %
    m4 = milestones(rdir)[3]
    assert m4.status == "not met" and "no ≥ 10 % gain" in m4.checks[4].detail and "ab_keep" in m4.checks[4].detail
    rdir = ab_run(outputs, "m4-excl", "llamacpp_b_rope1000", [105, 106, 104],
                  keep="no: the decode step is not launch-bound, so the batch budget cannot touch it")
    m4 = milestones(rdir)[3]
    assert m4.status == "met" and "written exclusion" in m4.checks[4].detail and "launch-bound" in m4.checks[4].detail
    assert m4.checks[3].detail.startswith("not required: the direction is excluded")


def test_m4_without_greedy_outputs_is_not_measured_and_a_profiled_side_is_refused(outputs):
    rdir = ab_run(outputs, "m4-none", None, [120, 121, 119])
    m4 = milestones(rdir)[3]
    assert m4.checks[3].status == "not measured" and "recorded no greedy outputs" in m4.checks[3].detail
    rdir = ab_run(outputs, "m4-prof", "llamacpp_b_batch32", [120, 121, 119])
    man = rdir / "phase7" / "ab" / "B" / "manifest.json"
    m = json.loads(man.read_text())
    m["launch"]["settings"]["nvtx_markers"] = True
    man.write_text(json.dumps(m))
    update_manifest(rdir, phases={"phase7": {"status": "success"}})
    m4 = milestones(rdir)[3]
    assert m4.checks[2].status == "fail" and "B launched with nvtx_markers" in m4.checks[2].detail


def test_a_silent_or_failing_engine_is_recorded_not_waited_on(outputs):
    """Failure paths of the probe on loopback: a port nothing listens on (the first request fails at once and nothing
    more is sent) and a server answering HTTP 500 (every request tried, each error kept); either decides nothing."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    target = SimpleNamespace(engine="vllm", model="tiny-hf", served_model_name="tiny-hf")
    srv = SimpleNamespace(engine=engine_for("vllm"), base_url=f"http://127.0.0.1:{closed}", target=target,
                          auth_headers={})
    out = cx.greedy_probe(srv, timeout_s=5)
    errs = [o["error"] for o in out["outputs"]]
    assert "did not answer a request within 5 s" in errs[0] and all(e.startswith("not sent: ") for e in errs[1:])
    assert cx.correctness_verdict(cx.compare_greedy(load("vllm_a"), out))[0] == "not decidable"

    class Fail(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "boom"}')

        def log_message(self, *a):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fail)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        srv.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
        rdir = init_run("probe-500", "local-tiny")
        out = cx.greedy_probe(srv, prompts=cx.PROMPTS[:2], timeout_s=5, run_dir=rdir, phase="phase7")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [o["error"] for o in out["outputs"]] == ['HTTP 500: {\'error\': \'boom\'}; HTTP 500: {\'error\': \'boom\'}'] * 2
    from servelab.core.run import read_commands
    rec = read_commands(rdir, "phase7")
    assert len(rec) == 1 and rec[0].exit_code == 1 and rec[0].argv[:4] == ["curl", "-sS", "-X", "POST"]
