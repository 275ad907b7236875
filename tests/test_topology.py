"""Phase 4 memory / communication model against hand-derived numbers, the public DeepSeek-V3 and GLM-4.5 totals,
launch commands from the real engine adapters, and the measured comparison on real run directories."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from servelab.core.params import ParamError

from servelab.deploy.targets import load_target
from servelab.core.run import init_run, update_manifest
from servelab.analyse.topology import (GIB, Cluster, CommInputs, Layout, MemoryInputs, active_params, cluster_from_target,
                                       comm_summary, comm_table, engine_launch_settings, feasibility, kv_bytes_per_token,
                                       launch_commands, layout_problems, load_model_config, measured_comparison,
                                       memory_table, memory_figure, comm_figure, model_config_from_dict, param_summary,
                                       parse_layout, pp_partition, reference_layouts, stage_weights_bytes)

sys.path.insert(0, str(Path(__file__).parent))
from casefiles import write_cases  # noqa: E402

# dense GQA toy: hidden 64, 4 layers, 8 heads of 8, 2 KV heads, MLP 128, vocab 1000, untied, bf16
TOY = {"name": "toy", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
       "intermediate_size": 128, "vocab_size": 1000}


def test_dense_toy_parameters_by_hand():
    cfg = model_config_from_dict(TOY)
    # per layer: q 64·64 + k,v 2·(64·16) + o 64·64 = 10240; norms 2·64 = 128; MLP 3·64·128 = 24576
    per_layer = 10240 + 128 + 24576
    total = 4 * per_layer + 2 * 1000 * 64 + 64          # + embedding + lm_head + final norm
    ps = param_summary(cfg).set_index("component")
    assert ps.loc["total", "params"] == total == 267840
    assert ps.loc["attention", "params"] == 4 * 10240 and ps.loc["dense MLP", "params"] == 4 * 24576
    assert active_params(cfg) == total


def test_dense_toy_placement_tp2_and_pp2_by_hand():
    cfg = model_config_from_dict(TOY)
    # TP2: attention 4·10240/2, MLP 4·24576/2, embedding+head 2·64000/2 — ×2 bytes; norms 4·128+64 replicated
    w = stage_weights_bytes(cfg, Layout(tp=2), range(4), True, True)
    assert sum(w.values()) == (4 * 10240 / 2 + 4 * 24576 / 2 + 64000 + 4 * 128 + 64) * 2 == 268416
    # TP1+PP2: stage 0 = layers 0-1 + embedding, stage 1 = layers 2-3 + lm_head + final norm
    assert pp_partition(4, 2) == [range(0, 2), range(2, 4)]
    s0 = stage_weights_bytes(cfg, Layout(tp=1, pp=2), range(0, 2), True, False)
    s1 = stage_weights_bytes(cfg, Layout(tp=1, pp=2), range(2, 4), False, True)
    assert sum(s0.values()) == (2 * 34944 + 64000) * 2 == 267776
    assert sum(s1.values()) == (2 * 34944 + 64000 + 64) * 2 == 267904
    # the remainder of an uneven split goes to the stages before the last (vLLM/SGLang get_pp_indices)
    assert [len(r) for r in pp_partition(61, 2)] == [31, 30]
    assert [len(r) for r in pp_partition(10, 4)] == [2, 3, 3, 2]


def test_gqa_kv_bytes_by_hand():
    cfg = model_config_from_dict(TOY)
    # 4 layers × (K+V) × 2 heads × 8 dims × 2 bytes = 256 B per token; TP2 splits the heads, TP4 keeps one head each
    assert kv_bytes_per_token(cfg, Layout(tp=1), 4) == 256
    assert kv_bytes_per_token(cfg, Layout(tp=2), 4) == 128
    assert kv_bytes_per_token(cfg, Layout(tp=4), 4) == 128
    assert kv_bytes_per_token(cfg, Layout(tp=1), 4, "fp8_e4m3") == 128


def test_tp16_and_tp8pp2_hold_w_over_16_each():
    """Layout B (docs/method.md#topology): TP16 keeps W/16 per GPU; TP8+PP2 keeps (W/2)/8 = W/16. Exact for the sharded weights."""
    cfg = model_config_from_dict({**TOY, "hidden_size": 128, "num_attention_heads": 16, "num_key_value_heads": 16,
                                  "num_hidden_layers": 8, "intermediate_size": 256, "vocab_size": 4096})
    W = param_summary(cfg).set_index("component").loc["total", "params"] * 2
    norms = (8 * 2 * 128 + 128) * 2                  # replicated RMSNorm weights, bytes
    tp16 = stage_weights_bytes(cfg, Layout(tp=16), range(8), True, True)
    assert sum(tp16.values()) - tp16["replicated"] == pytest.approx((W - norms) / 16)
    st = pp_partition(8, 2)
    pp = [stage_weights_bytes(cfg, Layout(tp=8, pp=2), st[s], s == 0, s == 1) for s in (0, 1)]
    sharded = [sum(w.values()) - w["replicated"] for w in pp]
    assert sum(sharded) / 2 == pytest.approx((W - norms) / 16)
    # with the real DeepSeek-V3 shape both layouts are within 3 % of W/16 (MLA down-projections are replicated)
    ds = load_model_config("deepseek-v3")
    cl = Cluster("2x8", 2, 8)
    feas = feasibility(memory_table(ds, reference_layouts(cl), cl, MemoryInputs(gpu_memory_gib=95.6))).set_index("layout")
    w16 = param_summary(ds).set_index("component").loc["total", "gib"] / 16
    assert feas.loc["TP16", "weights_gib"] == pytest.approx(w16, rel=0.03)
    assert feas.loc["TP8+PP2", "weights_gib"] == pytest.approx(w16, rel=0.05)


def test_public_model_totals():
    ds = load_model_config("deepseek-v3")
    assert param_summary(ds).set_index("component").loc["total", "params"] / 1e9 == pytest.approx(671, rel=0.005)
    assert active_params(ds) / 1e9 == pytest.approx(37, rel=0.03)
    glm = load_model_config("glm-4.5")
    # the model card's 355B includes the MTP layer (not counted here): the main model is ≈ 353B
    assert param_summary(glm).set_index("component").loc["total", "params"] / 1e9 == pytest.approx(355, rel=0.01)
    assert active_params(glm) / 1e9 == pytest.approx(32, rel=0.06)
    # MLA KV per token: 61 layers × (512 + 64) elements × 1 byte (fp8)
    assert kv_bytes_per_token(ds, Layout(tp=16), 61, "fp8_e4m3") == 61 * 576


def test_hf_config_json_and_bad_configs(tmp_path):
    import yaml
    raw = yaml.safe_load((load_model_config.__globals__["models_dir"]() / "deepseek-v3.yaml").read_text())
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**raw, "model_type": "deepseek_v3", "rope_scaling": {"factor": 40}}))
    assert param_summary(load_model_config(str(p))).iloc[-1]["params"] == \
        param_summary(load_model_config("deepseek-v3")).iloc[-1]["params"]
    with pytest.raises(ParamError, match="lacks 'vocab_size'"):
        model_config_from_dict({k: v for k, v in TOY.items() if k != "vocab_size"}, "x.json")
    with pytest.raises(ParamError, match="unknown weight dtype 'fp9'"):
        model_config_from_dict({**TOY, "weight_dtype": "fp9"})
    with pytest.raises(ParamError, match="unknown model config 'deepseek-v9'.*did you mean 'deepseek-v3'"):
        load_model_config("deepseek-v9")


def test_feasibility_verdicts_for_the_reference_cluster():
    ds = load_model_config("deepseek-v3")
    cl = cluster_from_target(load_target("example-2node"))
    assert (cl.nodes, cl.gpus_per_node) == (2, 8)
    lays = reference_layouts(cl) + [parse_layout("TP32"), parse_layout("TP16+EP7")]
    mem = MemoryInputs(gpu_memory_gib=95.6, mem_fraction=0.88, context_tokens=131072, concurrency=16,
                       kv_cache_dtype="fp8_e4m3")
    feas = feasibility(memory_table(ds, lays, cl, mem)).set_index("layout")
    budget = 95.6 * 0.88
    # TP16: every GPU holds the MLA latent of all 16 requests × 128K tokens, for all 61 layers
    kv16 = 16 * 131072 * 61 * 576 / GIB
    assert feas.loc["TP16", "kv_demand_gib"] == pytest.approx(kv16)
    need16 = feas.loc["TP16", "weights_gib"] + kv16
    assert need16 > budget
    assert feas.loc["TP16", "verdict"] == f"does not fit: needs {need16:.1f} GiB per GPU, has {budget:.1f} GiB"
    # TP8+PP2 halves the layers per GPU; DP2 attention halves the requests per group
    assert feas.loc["TP8+PP2", "verdict"] == "fits"
    assert feas.loc["TP16+DP2+EP16", "kv_demand_gib"] == pytest.approx(kv16 / 2)
    assert feas.loc["TP16+DP2+EP16", "verdict"] == "fits"
    assert feas.loc["TP32", "verdict"].startswith("invalid: needs 32 GPUs, the cluster has 16")
    assert "ep (7) must divide tp (16)" in feas.loc["TP16+EP7", "verdict"]
    # the layout's verdict is its worst stage's: GLM-4.5 TP4+PP2 — stage 1 (lm_head) already overflows on weights
    glm = feasibility(memory_table(load_model_config("glm-4.5"), [parse_layout("TP4+PP2")], cl, mem)).iloc[0]
    assert glm["verdict"] == f"does not fit: weights alone need {glm['weights_gib']:.1f} GiB per GPU, has {budget:.1f} GiB"
    assert glm["stage"] == 1
    one = feasibility(memory_table(ds, [Layout(tp=8)], Cluster("1x8", 1, 8), MemoryInputs(gpu_memory_gib=80)))
    assert one.iloc[0]["verdict"].startswith("does not fit: weights alone need")
    fig = memory_figure(feas.reset_index())
    assert len(fig.data) == 4


def test_communication_per_step_by_hand():
    ds = load_model_config("deepseek-v3")
    cl = Cluster("2x8", 2, 8)
    ci = CommInputs(tokens=64)
    H = 7168
    msg = 64 * H * 2                                              # one all-reduce of 64 bf16 hidden states
    tp16 = comm_table(ds, parse_layout("TP16"), cl, ci)
    assert set(tp16["message_bytes"]) == {msg}
    assert tp16["node_egress_bytes_per_step"].sum() == pytest.approx(2 * 15 / 16 * msg * (61 + 61))
    pp = comm_table(ds, parse_layout("TP8+PP2"), cl, ci)
    assert pp["node_egress_bytes_per_step"].sum() == 64 * 2 * H * 2      # hidden + residual at the one boundary
    # the busiest stage runs 31 layers: 31 attention all-reduces per GPU
    att = pp[pp["collective"].str.startswith("all-reduce (attention")].iloc[0]
    assert att["calls_per_step"] == 31 and att["spans_nodes"] == 1
    ep = comm_table(ds, parse_layout("TP16+DP2+EP16"), cl, ci).set_index("collective")
    # dispatch: 32 tokens per node × 8 experts × ½ on the other node × 7168 × (1 + 4/128) bytes, 58 MoE layers
    disp = ep.loc["all-to-all dispatch (EP)", "node_egress_bytes_per_step"]
    assert disp == pytest.approx(32 * 8 * 0.5 * H * (1 + 4 / 128) * 58)
    assert ep.loc["all-reduce (attention out)", "node_egress_bytes_per_step"] == 0
    dedup = comm_table(ds, parse_layout("TP16+DP2+EP16"), cl, CommInputs(tokens=64, node_dedup=True))
    d2 = dedup.set_index("collective").loc["all-to-all dispatch (EP)", "node_egress_bytes_per_step"]
    assert d2 == pytest.approx(32 * (1 - 0.5 ** 8) * H * (1 + 4 / 128) * 58)
    s = comm_summary([tp16, pp], ci).set_index("layout")
    assert s.loc["TP8+PP2", "cross_node_ms_lower_bound"] == pytest.approx(64 * 2 * H * 2 * 8 / 800e9 * 1e3)
    assert s.loc["TP16", "cross_node_mib_per_step"] > 100 * s.loc["TP8+PP2", "cross_node_mib_per_step"]
    assert len(comm_figure([tp16, pp]).data) == 2 * 4


def test_layout_parsing_and_engine_settings():
    lay = parse_layout("TP16+DP2+EP16")
    assert (lay.tp, lay.dp, lay.ep, lay.dp_attention, lay.attn_tp, lay.gpus) == (16, 2, 16, True, 8, 16)
    assert parse_layout("tp8xpp2").gpus == 16
    with pytest.raises(ParamError, match="cannot read 'MP4'"):
        parse_layout("TP8+MP4")
    assert engine_launch_settings(lay, "vllm")["tp_size"] == 8
    assert engine_launch_settings(lay, "sglang") == {"tp_size": 16, "pp_size": 1, "dp_size": 2, "ep_size": 16,
                                                     "dp_attention": True}
    assert layout_problems(load_model_config("glm-4.5"), parse_layout("TP16"), Cluster("c", 2, 8)) == []
    assert "do not split" in layout_problems(model_config_from_dict(TOY), Layout(tp=16), Cluster("c", 2, 8))[0]


def test_launch_commands_come_from_the_sglang_adapter():
    t = load_target("example-2node")
    lc = launch_commands(t, reference_layouts(cluster_from_target(t)))
    assert lc.groupby("layout").size().to_dict() == {"TP16": 2, "TP8+PP2": 2, "TP16+DP2+EP16": 2}
    pp = lc[lc["layout"] == "TP8+PP2"].iloc[0]["argv"]
    assert pp[pp.index("--tp-size") + 1] == "8" and pp[pp.index("--pp-size") + 1] == "2"
    ep = lc[lc["layout"] == "TP16+DP2+EP16"].iloc[1]["argv"]
    assert "--enable-dp-attention" in ep and ep[ep.index("--ep-size") + 1] == "16"
    assert ep[ep.index("--node-rank") + 1] == "1" and ep[0] == "docker"


def _run(run_id: str, settings: dict, tps: dict[str, list[float]], tpot: float = 50.0, env: dict | None = None,
         valid: bool = True, **manifest):
    rdir = init_run(run_id, "example-2node")
    update_manifest(rdir, launch={"settings": settings, "env": env or {}, "plans": []}, **manifest)
    rows = [{"case_id": c, "repeat": i, "output_tps": v, "p95_ttft_ms": 300.0, "p95_tpot_ms": tpot,
             "p95_e2e_ms": 9000.0, "valid": valid} for c, vals in tps.items() for i, v in enumerate(vals)]
    write_cases(rdir, rows)
    return rdir


def test_measured_comparison_recommends_with_evidence(outputs):
    base = _run("m-tp16", {"tp_size": 16}, {"D1": [100, 102, 98], "D2": [50, 51, 49]})
    pp = _run("m-pp", {"tp_size": 8, "pp_size": 2}, {"D1": [120, 121, 119], "D2": [60, 61, 59]})
    ep = _run("m-ep", {"tp_size": 16, "dp_size": 2, "ep_size": 16, "dp_attention": True},
              {"D1": [101, 99, 100], "D2": [50, 50.5, 49.5]}, tpot=70.0)
    table, verdicts = measured_comparison([base, pp, ep])
    v = verdicts.set_index("layout")
    assert v.loc["TP16", "verdict"] == "baseline"
    assert v.loc["TP8+PP2", "verdict"] == "recommended" and "2 better" in v.loc["TP8+PP2", "evidence"]
    # TPS within noise but p95 TPOT 50 → 70 ms (+40 %, repeats identical so the band is 0)... latency regression
    assert v.loc["TP16+DP2+EP16", "verdict"] == "not recommended"
    assert "p95_tpot_ms +40.0 %" in v.loc["TP16+DP2+EP16", "evidence"]
    # a layout run that also changed an NCCL variable is confounded: no verdict on the layout
    cf = _run("m-cf", {"tp_size": 8, "pp_size": 2, "chunked_prefill_size": 4096}, {"D1": [130, 131, 129]},
              env={"NCCL_ALGO": "Tree"})
    v2 = measured_comparison([base, cf])[1].set_index("run_id")
    assert v2.loc["m-cf", "verdict"] == "confounded — no conclusion"
    assert "launch.env.NCCL_ALGO" in v2.loc["m-cf", "evidence"] and "chunked_prefill_size" in v2.loc["m-cf", "evidence"]
    row = table[(table["layout"] == "TP8+PP2") & (table["case_id"] == "D1")].iloc[0]
    assert row["output_tps"] == pytest.approx(120.0) and row["repeats"] == 3


def test_a_measured_layouts_label_is_the_variable_and_invalid_cases_decide_nothing(outputs):
    """The records Phase 4's measure_layouts writes carry their layout's label (``layout: TP2``): that is the
    variable, not a confound. Cases with an INVALID repeat give no verdict and say so."""
    base = _run("l-tp1", {"tp_size": 1}, {"D1": [100, 101, 99]}, layout="TP1")
    tp2 = _run("l-tp2", {"tp_size": 2}, {"D1": [130, 131, 129]}, layout="TP2")
    v = measured_comparison([base, tp2])[1].set_index("run_id")
    assert v.loc["l-tp2", "verdict"] == "recommended", v.loc["l-tp2", "evidence"]
    bad = _run("l-tp2-bad", {"tp_size": 2}, {"D1": [130, 131, 129]}, valid=False, layout="TP2")
    v = measured_comparison([base, bad])[1].set_index("run_id")
    assert v.loc["l-tp2-bad", "verdict"] == "invalid — no conclusion"
    assert "1 INVALID" in v.loc["l-tp2-bad", "evidence"]
