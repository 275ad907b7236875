"""The correctness check on a real engine, end to end through the CLI: Phase 7 on the tiny llama-server with the
one variable a setting that changes greedy output (``--rope-freq-base 1000``: every attention score moves). Each
value's engine answers the fixed prompts greedily before its case; the A/B's correctness check finds the prompts
whose outputs part, the page says so, and M4 fails on it."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from servelab.cli import main
from servelab.core.run import read_commands, read_manifest
from servelab.measure.correctness import OUTPUTS_FILE, PROMPTS
from servelab.report.milestones import milestones

pytestmark = pytest.mark.slow

VALUES = '[[], ["--rope-freq-base", "1000"]]'


def test_a_setting_that_changes_greedy_output_fails_the_check_and_m4(outputs, llama_server_binary):
    rc = main(["run", "phase7", "--target", "local-tiny", "--run-id", "rope", "-p", "knob=extra_args",
               "-p", f"values={VALUES}", "-p", "confound_demo=false", "-p", "n_injections=2",
               "-p", "inject_input_tokens=512", "-p", "background_output_tokens=64", "-p", "window_steps=8"])
    rdir = outputs / "rope"
    assert rc == 0, read_manifest(rdir)["phases"]["phase7"]
    recs = sorted((rdir / "phase7" / "ab").iterdir())
    assert len(recs) == 2
    outs = {r.name: json.loads((r / OUTPUTS_FILE).read_text()) for r in recs}
    for o in outs.values():                        # every prompt answered, twice, the same way each time
        assert [x["prompt"] for x in o["outputs"]] == list(PROMPTS) and o["temperature"] == 0.0
        assert all(x["stable"] and not x["error"] and len(x["token_ids"]) == 32 for x in o["outputs"])
    probes = [c for c in read_commands(rdir, "phase7") if c.title.startswith("greedy correctness probe")]
    assert len(probes) == 2 and all(c.label == "executed" and c.exit_code == 0 for c in probes)
    corr = pd.read_csv(rdir / "phase7" / "ab_correctness.csv")
    # recomputed from the two records: which prompts part, and where
    a, b = (outs[n]["outputs"] for n in sorted(outs, key=lambda n: "rope" in n))
    parts = {x["prompt"]: next((i for i, (p, q) in enumerate(zip(x["token_ids"], y["token_ids"])) if p != q), None)
             for x, y in zip(a, b)}
    assert any(v is not None for v in parts.values())              # the change does flip greedy tokens
    for r in corr.itertuples():
        assert (r.status == "differs") == (parts[r.prompt] is not None)
        if r.status == "differs":
            assert int(r.first_difference) == parts[r.prompt]
    q = pd.read_csv(rdir / "phase7" / "ab_questions.csv")
    assert ": regression (" in q[q["question"].str.startswith("6.")]["answer"].iloc[0]
    page = (rdir / "phase7" / "report.html").read_text()
    assert "Correctness: the same prompts, greedy" in page and "regression" in page
    findings = read_manifest(rdir)["phases"]["phase7"]["findings"]
    assert any(f.startswith("Greedy outputs of 8 fixed prompts") and ": regression —" in f for f in findings)
    m4 = milestones(rdir)[3]
    check = next(c for c in m4.checks if c.check.startswith("no correctness regression"))
    assert check.status == "fail" and ": regression — " in check.detail and m4.status == "not met"
