"""Engine adapters build the real launch commands of SGLang, vLLM and llama.cpp (argv lists, per node)."""
from __future__ import annotations

import json

import pytest

from servelab.target.engines import ADAPTERS, engine_for
from servelab.core.params import ParamError
from servelab.target.targets import load_target, target_from_dict


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_sglang_tp16_two_nodes_in_docker():
    t = load_target("example-2node")
    plans = engine_for("sglang").launch_plans(t, 30000)
    assert [p.node for p in plans] == ["node5", "node7"] and [p.role for p in plans] == ["head", "worker"]
    for rank, p in enumerate(plans):
        a = p.argv
        assert a[:2] == ["docker", "run"] and "--network" in a and flag(a, "--network") == "host"
        assert ["--device", "/dev/infiniband/uverbs3"] == a[a.index("/dev/infiniband/uverbs3") - 1:a.index("/dev/infiniband/uverbs3") + 1]
        assert "NCCL_IB_HCA=mlx5_0,mlx5_3" in a and "SGLANG_TORCH_PROFILER_DIR=/data/profile/sglang" in a
        i = a.index("sglang.launch_server")
        eng = a[i:]
        assert flag(eng, "--tp-size") == "16" and flag(eng, "--nnodes") == "2" and flag(eng, "--node-rank") == str(rank)
        assert flag(eng, "--dist-init-addr") == "174.1.51.5:50000"
        assert flag(eng, "--mem-fraction-static") == "0.88" and flag(eng, "--chunked-prefill-size") == "8192"
        assert flag(eng, "--kv-cache-dtype") == "fp8_e4m3" and "--enable-metrics" in eng
        assert "--disable-cuda-graph" not in eng and "--disable-radix-cache" not in eng


def test_sglang_topologies_and_spec():
    base = {"name": "x", "engine": "sglang", "model": "/m", "nodes": [{"name": "n"}]}
    t = target_from_dict({**base, "launch": {"tp_size": 8, "pp_size": 2, "cuda_graph": False, "prefix_cache": False,
                                             "nvtx_markers": True,
                                             "spec": {"algorithm": "EAGLE", "num_steps": 3, "topk": 1,
                                                      "num_draft_tokens": 4}}})
    a = engine_for("sglang").launch_plans(t, 1)[0].argv
    assert flag(a, "--pp-size") == "2" and "--disable-cuda-graph" in a and "--disable-radix-cache" in a
    assert "--enable-layerwise-nvtx-marker" in a and flag(a, "--speculative-algorithm") == "EAGLE"
    assert flag(a, "--speculative-num-draft-tokens") == "4"
    t = target_from_dict({**base, "launch": {"tp_size": 8, "dp_size": 2, "ep_size": 16, "dp_attention": True,
                                             "moe_a2a_backend": "deepep"}})
    a = engine_for("sglang").launch_plans(t, 1)[0].argv
    assert flag(a, "--dp-size") == "2" and flag(a, "--ep-size") == "16" and "--enable-dp-attention" in a
    assert flag(a, "--moe-a2a-backend") == "deepep"
    body = engine_for("sglang").start_profile_body(output_dir="/p", start_step=5, num_steps=10)
    assert body == {"output_dir": "/p", "activities": ["CPU", "GPU"], "profile_by_stage": False, "with_stack": False,
                    "record_shapes": True, "num_steps": 10, "start_step": 5}


def test_vllm_multi_node_and_profiler():
    t = target_from_dict({"name": "v", "engine": "vllm", "model": "/m", "served_model_name": "m",
                          "launch": {"tp_size": 8, "pp_size": 2, "mem_fraction": 0.9, "context_length": 8192,
                                     "chunked_prefill_size": 4096, "profiler_dir": "/prof", "dev_mode": True},
                          "env": {"NCCL_IB_HCA": "mlx5_0"},
                          "nodes": [{"name": "a", "kind": "ssh", "host": "10.0.0.1"},
                                    {"name": "b", "kind": "ssh", "host": "10.0.0.2", "role": "worker"}]})
    head, worker = engine_for("vllm").launch_plans(t, 8000)
    a = head.argv
    assert flag(a, "--tensor-parallel-size") == "8" and flag(a, "--pipeline-parallel-size") == "2"
    assert flag(a, "--gpu-memory-utilization") == "0.9" and flag(a, "--max-model-len") == "8192"
    assert flag(a, "--nnodes") == "2" and flag(a, "--node-rank") == "0" and flag(a, "--master-addr") == "10.0.0.1"
    assert "--headless" not in a and "--headless" in worker.argv and flag(worker.argv, "--node-rank") == "1"
    cfg = json.loads(flag(a, "--profiler-config"))
    assert cfg == {"profiler": "torch", "torch_profiler_dir": "/prof", "torch_profiler_with_stack": False}
    assert head.env["VLLM_SERVER_DEV_MODE"] == "1" and head.env["NCCL_IB_HCA"] == "mlx5_0"


def test_llamacpp_single_and_rpc_plans():
    t = load_target("local-tiny")
    (p,) = engine_for("llamacpp").launch_plans(t, 9000, binary="/b/llama-server", model_path="/m.gguf")
    assert p.argv[:3] == ["/b/llama-server", "-m", "/m.gguf"] and flag(p.argv, "-np") == "32" and "--metrics" in p.argv
    t2 = target_from_dict({"name": "two", "engine": "llamacpp", "model": "tiny", "launch": {"rpc_port": 50052},
                           "nodes": [{"name": "h", "kind": "ssh", "host": "127.0.0.2"},
                                     {"name": "w", "kind": "ssh", "host": "127.0.0.3", "role": "worker"}]})
    w, h = engine_for("llamacpp").launch_plans(t2, 9000, binary="llama-server", model_path="/m", rpc_binary="rpc")
    assert w.argv == ["rpc", "-H", "127.0.0.3", "-p", "50052", "-t", "2"] and w.ready == "tcp"
    assert flag(h.argv, "--rpc") == "127.0.0.3:50052"


def test_bad_launch_settings_are_rejected():
    base = {"name": "x", "engine": "sglang", "model": "/m"}
    with pytest.raises(ParamError, match="positive integer"):
        target_from_dict({**base, "launch": {"tp_size": 0}})
    with pytest.raises(ParamError, match="mem_fraction"):
        target_from_dict({**base, "launch": {"mem_fraction": 1.5}})
    with pytest.raises(ParamError, match="docker.image"):
        engine_for("sglang").launch_plans(target_from_dict({**base, "launch": {"mode": "docker"}}), 1)


def test_what_the_phases_ask_each_adapter_names_its_own_launch_settings():
    """Phase 7's default sweep and confounding setting are launch settings the engine knows (else the sweep
    would be refused before it starts)."""
    for name in ADAPTERS:
        a = engine_for(name)
        knob, values = a.interference_sweep
        assert knob in a.launch_keys() and len(values) >= 2, name
        assert a.confound_setting and set(a.confound_setting) <= a.launch_keys() - {knob}, name
