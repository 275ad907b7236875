"""The rank-reach check's rules, on real NCCL INFO output: a variable NCCL logged as read by a rank's process (joined by
pid) agrees or disagrees with the value the rank's environment holds; a rank without it is named. The live check on
two SGLang ranks is tests/test_env_reach_live.py."""
from __future__ import annotations

from pathlib import Path

from servelab.deploy.engines import engine_for
from servelab.measure.env_reach import MISSING, NCCL_OTHER, REACHED, EnvReach, nccl_env_lines, reach_table
from servelab.measure.launch_variants import env_changes, env_variable, with_launch
from servelab.deploy.targets import load_target

LOG = Path(__file__).parent / "data" / "nccl_public" / "nccl707_a100_header.log"


def test_nccl_set_by_environment_lines_are_joined_by_pid():
    said = nccl_env_lines(LOG.read_text())
    # "10-90-43-152:120890:121560 [0] NCCL INFO NCCL_SHM_DISABLE set by environment to 1."
    assert said[(120890, "NCCL_P2P_LEVEL")] == "LOC" and said[(120890, "NCCL_SHM_DISABLE")] == "1"
    procs = [{"node": "n0", "pid": 120890, "process": "python", "rank": "TP0",
              "env": {"NCCL_P2P_LEVEL": "LOC", "NCCL_SHM_DISABLE": "0"}},
             {"node": "n0", "pid": 120891, "process": "python", "rank": "TP1", "env": {"NCCL_SHM_DISABLE": "0"}},
             {"node": "n0", "pid": 120800, "process": "python", "rank": None, "env": {}}]      # no rank: not checked
    reach = reach_table(procs, {"NCCL_P2P_LEVEL": "LOC", "NCCL_SHM_DISABLE": "0"}, LOG.read_text())
    v = {(r.rank, r.variable): r.verdict for r in reach.table.itertuples()}
    assert v == {("TP0", "NCCL_P2P_LEVEL"): REACHED, ("TP0", "NCCL_SHM_DISABLE"): NCCL_OTHER,
                 ("TP1", "NCCL_P2P_LEVEL"): MISSING, ("TP1", "NCCL_SHM_DISABLE"): REACHED}
    assert not reach.ok and reach.failed_ranks == ["n0/TP0", "n0/TP1"]
    assert "NCCL_SHM_DISABLE=0 NCCL read another value on n0/TP0 (pid 120890, saw 0, NCCL says 1)" in reach.reason
    assert "NCCL_P2P_LEVEL=LOC missing on n0/TP1 (pid 120891)" in reach.reason
    back = EnvReach.from_json(reach.to_json())
    assert back.reason == reach.reason and not back.ok
    assert not reach_table([], {"X": "1"}).ok                           # nothing read is never a pass


def test_env_knobs_change_the_environment_and_the_ranks_are_named_by_the_adapter():
    assert env_variable("env.NCCL_ALGO") == env_variable("NCCL_ALGO") == "NCCL_ALGO"
    assert env_variable("chunked_prefill_size") is None
    t = with_launch(load_target("local-sglang"), {"tp_size": 2, "env.NCCL_PROTO": "Simple"})
    assert t.env["NCCL_PROTO"] == "Simple" and t.launch["tp_size"] == 2 and "NCCL_PROTO" not in t.launch
    assert env_changes({"tp_size": 2, "NCCL_ALGO": "Ring", "env.NCCL_PROTO": None}) == {"NCCL_ALGO": "Ring"}
    sg = engine_for("sglang")
    assert sg.rank_of_process("sglang::scheduler_TP1") == "TP1"
    assert sg.rank_of_process("sglang::scheduler_PP1_TP0") == "PP1_TP0"
    assert sg.rank_of_process("sglang::detokenizer") is None
    assert sg.rank_of_process("python -m sglang.launch_server --tp-size 2") is None
