"""An environment-variable A/B that proves itself, live: a real SGLang with two tensor-parallel ranks on this CPU
(``local-sglang -p tp_size=2``) started with ``NCCL_ALGO`` set, the variable read back from each rank's
``/proc/<pid>/environ`` (SGLang titles its ranks ``sglang::scheduler_TP0/1``); then the same start with the variable
withheld from rank 1 (``tests/env_withheld/sitecustomize.py`` takes it out of the launcher's environment while the
second scheduler starts), which the check must name, and the A/B over the two records must be INVALID naming it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from servelab.deploy.targets import load_target
from servelab.measure.abtest import ab_compare
from servelab.measure.env_reach import read_reach
from servelab.measure.launch_variants import env_changes, serving, with_launch, write_run_record

pytestmark = pytest.mark.slow
WITHHELD = Path(__file__).parent / "env_withheld"


def _serve(target, changes, tmp: Path, tag: str):
    t = with_launch(target, changes, tag)
    # waits for health (polled); the bound is the phases' own start timeout: two SGLang ranks on a loaded 2-core box
    with serving(t, tmp / tag / "logs", health_timeout_s=900.0, greedy=False, check_env=env_changes(changes)) as srv:
        rec = write_run_record(tmp / tag / "record", f"env-{tag}", t, srv, [("x", None, "nothing measured here")])
    return rec


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_env_variable_reaches_both_ranks_and_a_withheld_one_is_named(tmp_path):
    base = load_target("local-sglang")
    a = _serve(base, {"tp_size": 2, "env.NCCL_ALGO": "Ring"}, tmp_path, "ring")
    ok = read_reach(a)
    assert ok is not None and ok.ok, ok.table.to_string() if ok else "no check written"
    ranks = ok.table.set_index("rank")
    assert sorted(ranks.index) == ["TP0", "TP1"] and set(ranks["seen"]) == {"Ring"}
    assert ranks.loc["TP0", "pid"] != ranks.loc["TP1", "pid"]

    planted = {"tp_size": 2, "env.NCCL_ALGO": "Tree", "env.PYTHONPATH": str(WITHHELD),
               "env.SERVELAB_TEST_WITHHOLD": "NCCL_ALGO"}
    b = _serve(base, planted, tmp_path, "tree-withheld")
    miss = read_reach(b)
    assert miss is not None and not miss.ok
    assert miss.failed_ranks == ["local/TP1"], miss.table.to_string()
    assert "NCCL_ALGO=Tree missing on local/TP1" in miss.reason
    seen = miss.table[miss.table["variable"] == "NCCL_ALGO"].set_index("rank")["seen"].to_dict()
    assert seen == {"TP0": "Tree", "TP1": "-"}

    ab = ab_compare([a, b], "NCCL_ALGO")
    kind, title, text = ab.verdict_notice()
    assert title.startswith("INVALID A/B") and "local/TP1" in text and "NCCL_ALGO=Tree" in text
    assert ab.env_failures == [f"{ab.runs[1].label}: {miss.reason}"]
