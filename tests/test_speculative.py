"""Phase 9 on the real tiny llama-server with real draft-model speculative decoding (``-md``):
the spec-decode counters move, acceptance / mean length / per-position acceptance equal a hand computation from
the raw ``/metrics`` snapshots, the window holds exactly the measured requests, the engine log agrees with the
counters, an independent random draft accepts (almost) nothing, and synthetic per-position rates come back.

What acceptance to expect with random weights, honestly: the model as its own draft decodes greedily exactly like
the target, so every draft token is accepted (1.0) — an upper bound by construction; an independent random model
of the same vocabulary agrees with the target about 1 time in 95 (printable-ASCII vocabulary), i.e. ~0.
"""
from __future__ import annotations

import re

import pandas as pd
import pytest

from servelab.deploy.targets import load_target
from servelab.analyse.speculative import net_gain
from servelab.phases import phase9_speculative as phase9_module
from servelab.phases.context import PhaseContext


def prom(text: str, name: str, labels: str = "") -> float:
    """A plain-text read of one sample (independent of servelab.measure.engine_metrics)."""
    key = name + (f"{{{labels}}}" if labels else "")
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[1])
    raise KeyError(key)


def per_pos(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$', text, re.M)}


@pytest.fixture(scope="module")
def phase9(llama_server_binary, tmp_path_factory):
    d = tmp_path_factory.mktemp("phase9")
    (d / "phase9").mkdir()
    params = phase9_module.Params.resolve(given={"drafts": ["self", "random:1"], "num_draft_tokens": 3,
                                                 "concurrencies": [1, 3], "output_tokens": 96,
                                                 "synth_rates": [0.9, 0.5]}, phase_file_values=False)
    ctx = PhaseContext(phase="phase9", run_id=d.name, run_dir=d, phase_dir=d / "phase9",
                       target=load_target("local-tiny"), params=params)
    return d, phase9_module.run(ctx)


@pytest.mark.slow
def test_every_config_and_concurrency_ran(phase9):
    _, res = phase9
    assert not res.errors, res.errors
    p = res.points
    assert set(p["config"]) == {"off", "draft=self n=3", "draft=random:1 n=3", "draft=self n=2 synthetic 0.9,0.5"}
    assert set(p["concurrency"]) == {1, 3}
    assert (p["window_matches_requests"]).all()
    # every real point VALID — unless this (shared) machine starved the client, which the point then says
    # (docs/metrics.md#integrity), never any other reason
    real = p[p["config"] != "draft=self n=2 synthetic 0.9,0.5"]
    for r in real.itertuples():
        assert r.validity == "VALID" or all(x.startswith(("client fell behind", "Little's law off"))
                                            for x in r.reasons.split("; ")), (r.config, r.reasons)
    # every speculative config has a net-gain row at every concurrency (never only C=1); the gain is a number
    # wherever that config and speculation-off both have a VALID point there — a gain is never computed from a
    # point the client starved: such a pair is "invalid" and says why
    valid = {(r.config, r.concurrency) for r in p.itertuples() if r.validity == "VALID"}
    pairs = {(c, k) for c in p["config"].unique() if c != "off" for k in (1, 3)}
    assert {(r.config, r.concurrency) for r in res.gain.itertuples()} == pairs
    for r in res.gain.itertuples():
        comparable = (r.config, r.concurrency) in valid and ("off", r.concurrency) in valid
        assert (r.verdict != "invalid") == comparable, (r.config, r.concurrency, r.reasons)
        assert (not pd.isna(r.net_gain_pct)) == comparable
        assert bool(r.reasons) == (not comparable)


def test_every_point_summary_follows_the_case_schema_and_feeds_the_ab(phase9):
    """One summary per point and repeat, in the case schema, the row's verdict as the summary's; each config's
    run-like record lists its points under S9_c<C>, so the A/B reads the same case on every side."""
    import json

    from servelab.measure.abtest import read_case_summaries
    from servelab.measure.case_record import SCHEMA_VERSION, read_summaries
    d, res = phase9
    sums = {s["case_id"]: s for s in read_summaries(d)}
    assert len(sums) == len(res.points)
    for r in res.points.itertuples():
        s = sums[r.case_id]
        assert (s["schema_version"], s["phase"], s["kind"]) == (SCHEMA_VERSION, "phase9", "speculative")
        assert s["verdict"]["status"] == r.validity and s["repeats"][0]["repeat"] == r.repeat
        assert s["repeat_of"] == r.case_id.rsplit("_r", 1)[0]
        assert s["metrics"]["vllm"]["output_throughput"] == pytest.approx(r.output_throughput)
    for rec in sorted((d / "phase9" / "ab").iterdir()):
        index = json.loads((rec / "cases.json").read_text())["cases"]
        assert {e["case_id"] for e in index} == {"S9_c1", "S9_c3"} and all(e["summary"] for e in index)
        frame = read_case_summaries(rec, "vllm").frame
        assert set(frame["case_id"]) == {"S9_c1", "S9_c3"} and frame["output_tps"].notna().all()


@pytest.mark.slow
def test_acceptance_equals_a_hand_computation_from_raw_snapshots(phase9):
    d, res = phase9
    spec = res.points[res.points["speculative"].astype(bool)]
    for _, row in spec.iterrows():
        srv = d / "cases" / row["case_id"] / "server"
        b, a = (srv / "metrics_before.prom").read_text(), (srv / "metrics_after.prom").read_text()
        drafts = prom(a, "llamacpp:spec_decode_num_drafts_total") - prom(b, "llamacpp:spec_decode_num_drafts_total")
        toks = prom(a, "llamacpp:spec_decode_num_draft_tokens_total") - \
            prom(b, "llamacpp:spec_decode_num_draft_tokens_total")
        acc = prom(a, "llamacpp:spec_decode_num_accepted_tokens_total") - \
            prom(b, "llamacpp:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and toks >= drafts                 # the counters moved in the window
        assert row["d_drafts"] == drafts and row["d_draft_tokens"] == toks and row["d_accepted"] == acc
        assert row["acceptance_rate"] == pytest.approx(acc / toks)
        assert row["mean_accept_length"] == pytest.approx(1 + acc / drafts)
        pa, pb = per_pos(a), per_pos(b)
        hand = [(pa[i] - pb.get(i, 0.0)) / drafts for i in sorted(pa)]
        assert row["per_position"] == pytest.approx(hand)
        assert row["log_matches_counters"] is True           # the engine log's per-request lines agree


@pytest.mark.slow
def test_self_draft_accepts_everything_and_a_random_draft_nothing(phase9):
    _, res = phase9
    p = res.points
    self_ = p[p["config"] == "draft=self n=3"]
    rnd = p[p["config"] == "draft=random:1 n=3"]
    assert (self_["acceptance_rate"] >= 0.95).all(), self_["acceptance_rate"].tolist()
    assert (self_["mean_accept_length"] > 3.5).all()
    assert (rnd["acceptance_rate"] <= 0.05).all() and (rnd["mean_accept_length"] < 1.1).all()
    # speculation off: the counters do not move
    off = p[p["config"] == "off"]
    assert (off["d_drafts"] == 0).all()


@pytest.mark.slow
def test_synthetic_per_position_rates_come_back(phase9):
    _, res = phase9
    rows = res.points[res.points["config"] == "draft=self n=2 synthetic 0.9,0.5"]
    drafts = rows["d_drafts"].sum()
    assert drafts >= 100
    # pooled over both concurrencies: Σ accepted at position i / Σ verification steps (std ≈ 0.05 at 100 drafts)
    pooled = [sum(r["per_position"][i] * r["d_drafts"] for _, r in rows.iterrows()) / drafts for i in (0, 1)]
    assert pooled[0] == pytest.approx(0.9, abs=0.12) and pooled[1] == pytest.approx(0.5, abs=0.15)


def test_net_gain_hand_built():
    pts = pd.DataFrame([
        {"config": "off", "concurrency": 1, "repeat": 0, "validity": "VALID", "output_throughput": 100.0,
         "p50_tpot_ms": 10.0, "p95_tpot_ms": 11.0, "step_ms": 10.0, "tokens_per_target_forward": 1.0},
        {"config": "spec", "concurrency": 1, "repeat": 0, "validity": "VALID", "output_throughput": 150.0,
         "p50_tpot_ms": 7.0, "p95_tpot_ms": 8.0, "step_ms": 18.0, "tokens_per_target_forward": 2.5,
         "acceptance_rate": 0.6, "mean_accept_length": 2.5},
        {"config": "spec", "concurrency": 4, "repeat": 0, "validity": "INVALID", "output_throughput": 999.0,
         "reasons": "1 request(s) failed: {'timeout': 1}"},
    ])
    g = net_gain(pts)
    assert list(zip(g["config"], g["concurrency"])) == [("spec", 1), ("spec", 4)]
    bad = g.iloc[1]                                          # an invalid point and a missing baseline: kept, no gain
    assert bad["verdict"] == "invalid" and pd.isna(bad["net_gain_pct"])
    assert bad["reasons"] == "spec at C=4: no VALID repeat (1 request(s) failed: {'timeout': 1}); off did not run at C=4"
    r = g.iloc[0]
    assert r["net_gain_pct"] == pytest.approx(50.0) and r["draft_overhead_ms_per_step"] == pytest.approx(8.0)
    assert r["verdict"] == "gain"


def test_findings_name_a_point_that_could_not_be_compared():
    """An invalid pair stays on the page: the findings give its reason instead of a number, and the winner comes
    from the comparable pairs only."""
    from servelab.phases.phase9_speculative import Phase9Result, findings
    gain = pd.DataFrame([
        {"config": "d", "concurrency": 1, "acceptance_rate": 0.5, "mean_accept_length": 2.0, "output_tps_off": 10.0,
         "output_tps_spec": 12.0, "net_gain_pct": 20.0, "verdict": "gain", "reasons": ""},
        {"config": "d", "concurrency": 4, "acceptance_rate": None, "mean_accept_length": None, "output_tps_off": None,
         "output_tps_spec": None, "net_gain_pct": None, "verdict": "invalid", "reasons": "d at C=4: no VALID repeat"},
    ])
    text = findings(Phase9Result([], pd.DataFrame(), gain, pd.DataFrame()))
    assert text[0] == ("d: acceptance 50.0 %, mean acceptance length 2.00; net output-TPS gain against off +20.0 % at "
                       "C=1, none at C=4 (d at C=4: no VALID repeat).")
    # no A/B, so no noise band: the best pair is said as a measurement, never as a verdict
    assert text[1].startswith("Measured, not yet a verdict: the best config is d at C=1 (+20.0 % output TPS")


def test_an_attached_server_as_served_has_its_own_side_and_no_gain():
    """No off point in the run (an attached server measured as served): a speculating config keeps its acceptance
    and throughput with verdict "no baseline"; a config whose drafts never moved has no row."""
    pts = pd.DataFrame([
        {"config": "as served", "speculative": True, "concurrency": 1, "repeat": 0, "validity": "VALID",
         "output_throughput": 40.0, "acceptance_rate": 0.75, "mean_accept_length": 3.25, "d_drafts": 10.0},
        {"config": "as served", "speculative": True, "concurrency": 4, "repeat": 0, "validity": "INVALID",
         "output_throughput": 1.0, "reasons": "2 request(s) failed", "d_drafts": 3.0},
    ])
    g = net_gain(pts)
    assert list(g["verdict"]) == ["no baseline", "no baseline"] and g["net_gain_pct"].isna().all()
    assert g.iloc[0]["acceptance_rate"] == 0.75 and g.iloc[0]["output_tps_spec"] == 40.0
    assert g.iloc[0]["reasons"] == "no speculation-off point in this run"
    assert g.iloc[1]["reasons"] == ("no speculation-off point in this run; as served at C=4: no VALID repeat "
                                    "(2 request(s) failed)")
    assert net_gain(pts.assign(speculative=False)).empty


@pytest.mark.parametrize("drafts, says", [
    ([12.0, 30.0], "As served, the server speculates: acceptance 75.0 % (mean acceptance length 3.25) at C=1, "
                   "75.0 % (mean acceptance length 3.25) at C=4 from its counters"),
    ([0.0, 0.0], "The server does not speculate: its draft counters did not move over 40 measured requests."),
    ([None, None], "it exposes no draft counter at its metrics endpoint, so no acceptance is measured."),
])
def test_an_attached_server_as_served_is_described_from_its_counters(drafts, says):
    from servelab.measure.spec_points import SpecConfig
    from servelab.phases.phase9_speculative import Phase9Result, findings
    pts = pd.DataFrame([
        {"config": "as served", "speculative": bool(d), "concurrency": c, "repeat": 0, "validity": "VALID",
         "completed": 20, "output_throughput": tps, "d_drafts": d, "acceptance_rate": 0.75 if d else None,
         "mean_accept_length": 3.25 if d else None}
        for d, c, tps in zip(drafts, (1, 4), (41.25, 120.0))])
    res = Phase9Result([SpecConfig(SpecConfig.AS_SERVED, as_served=True)], pts, net_gain(pts), pd.DataFrame())
    text = findings(res)
    assert says in text[0] and "output 41.2 tok/s at C=1, 120.0 tok/s at C=4" in text[0], text
    assert text[1].startswith("No net gain: a server servelab did not start is not restarted with speculation off")
    assert len(text) == 2                    # no "no A/B" or "no VALID pair" sentence beside it
