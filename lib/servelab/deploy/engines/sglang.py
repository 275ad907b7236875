"""SGLang adapter: ``python -m sglang.launch_server`` (bare or in docker), multi-node, profiling, metrics.

Flag names, metric names, log lines and trace names are those SGLang 0.5.23 really uses (the ``local-sglang``
target runs it on this machine's CPU: ``servelab.deploy.sglang_cpu``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from servelab.deploy.engines.base import EngineAdapter, LaunchPlan, ProfileError, ProfileRequest, docker_plan
from servelab.deploy.spec import Target
from servelab.core.params import ParamError

# trace files of SGLang's profiler: ``[prefix-]{profile_id}-TP-{tp}[-DP-{dp}][-PP-{pp}][-EP-{ep}][-{stage}]
# .trace.json.gz`` per rank, ``merged-….trace.json.gz`` (every rank in one file), ``…-TP-{tp}-memory….pickle``.
# _RANK_NAME (trace_identity, for the analyser) reads the profile id too; _RANK_FILE (profile_file, for
# collecting a capture) needs only the ranks and takes any suffix of letters, digits, '_' or '.' as the stage.
_RANK_NAME = re.compile(
    r"^(?:(?P<prefix>.+)-)?(?P<profile_id>[^-]+)-TP-(?P<tp>\d+)(?:-DP-(?P<dp>\d+))?(?:-PP-(?P<pp>\d+))?"
    r"(?:-EP-(?P<ep>\d+))?(?:-(?P<stage>[A-Za-z_]+))?\.trace\.json(?:\.gz)?$")
_RANK_FILE = re.compile(r"-TP-(?P<tp>\d+)(?:-DP-(?P<dp>\d+))?(?:-PP-(?P<pp>\d+))?(?:-EP-(?P<ep>\d+))?"
                        r"(?:-(?P<stage>[A-Za-z0-9_.]+))?\.trace\.json(?:\.gz)?$")
_MEMORY_FILE = re.compile(r"-TP-(?P<tp>\d+)-memory.*\.pickle$")
_MERGED_FILE = re.compile(r"^merged-.*\.trace\.json(?:\.gz)?$")
MERGED_PREFIX = "merged-"


class SGLangAdapter(EngineAdapter):
    name = "sglang"
    engine_package = "sglang"
    extra_launch_keys = {
        "attention_backend": "--attention-backend", "moe_runner_backend": "--moe-runner-backend",
        "moe_a2a_backend": "--moe-a2a-backend (deepep...)", "disable_overlap_schedule": "--disable-overlap-schedule",
        "trust_remote_code": "--trust-remote-code", "enable_metrics": "--enable-metrics (default on)",
        "hicache_ratio": "--hicache-ratio", "page_size": "--page-size",
        "device": "--device (cpu: SGLANG_USE_CPU_ENGINE=1 and one core per rank, SGLANG_CPU_OMP_THREADS_BIND)",
        "dtype": "--dtype", "max_total_tokens": "--max-total-tokens (the KV pool; on CPU it sizes itself from free RAM)",
        "sleep_on_idle": "--sleep-on-idle (an idle scheduler otherwise spins a core)",
        "cpu_threads_bind": "SGLANG_CPU_OMP_THREADS_BIND: the cores of each rank, '|'-separated (device cpu)",
        "expert_distribution_recorder_mode": "--expert-distribution-recorder-mode (stat | stat_approx | per_pass | "
                                             "per_token): MoE models; Phase 3 records expert counts per capture",
        "expert_distribution_recorder_buffer_size": "--expert-distribution-recorder-buffer-size (forward passes kept; "
                                                    "SGLang's default 1000, -1 unbounded)",
        "expert_record_dir": "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR: the recorder's dump folder on every node "
                             "(default <profiler_dir>/expert-distribution)",
    }
    positive_int_keys = (*EngineAdapter.positive_int_keys, "max_total_tokens")
    health_path = "/health"
    flush_cache_path = "/flush_cache"
    # SGLang reads no variable for its key; --api-key on the command line would be visible in ps. Its --config YAML
    # file is merged into the arguments inside the process: the key goes there, in a mode-0600 file in this start's
    # private folder, removed at stop. SGLang also prints every server argument at start (api_key included): its
    # log is written in that private folder too and copied back redacted (server.start_server).
    api_key_config = ("--config", "servelab-api-key.yaml", "api-key: {key}\n")
    logs_api_key = True
    # a TERM to every process kills the scheduler first; the server then sleeps 5 s for "crash diagnostics" and is
    # killed at the grace's end. A TERM to the server alone shuts it down with its children in ~5 s.
    term_leader_first = True
    start_profile_path = "/start_profile"
    stop_profile_path = "/stop_profile"
    # SGLang 0.5.23 http_server.py: GET or POST, no body; /dump_… writes a torch.save file into
    # SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (default /tmp): mode stat → one file from rank 0,
    # ``expert_distribution_recorder_<time>.pt`` (counts summed over ranks); per_pass/per_token → one file per rank,
    # ``expert_distribution_recorder_<time>_<rank>.pt``. The recorder exists only with --expert-distribution-recorder-mode.
    expert_record_paths = {"start": "/start_expert_distribution_record", "stop": "/stop_expert_distribution_record",
                           "dump": "/dump_expert_distribution_record"}
    expert_record_dir_env = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"
    expert_dump_file = r"^expert_distribution_recorder_\d+(?:\.\d+)?(?:_\d+)?\.pt$"
    version_paths = ("/server_info", "/get_server_info", "/model_info")
    tokenize_path = "/v1/tokenize"
    metric_names = {
        "running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
        "kv_usage": "sglang:token_usage", "kv_used_tokens": "sglang:num_used_tokens",
        "prompt_tokens_total": "sglang:prompt_tokens_total", "generation_tokens_total": "sglang:generation_tokens_total",
        "cached_tokens_total": "sglang:cached_tokens_total", "requests_total": "sglang:num_requests_total",
        "gen_throughput": "sglang:gen_throughput", "cache_hit_rate": "sglang:cache_hit_rate",
        "spec_accept_length": "sglang:spec_accept_length", "spec_accept_rate": "sglang:spec_accept_rate",
        "retracted": "sglang:num_retracted_reqs", "ttft_seconds": "sglang:time_to_first_token_seconds",
        "itl_seconds": "sglang:inter_token_latency_seconds", "e2e_seconds": "sglang:e2e_request_latency_seconds",
        "queue_seconds": "sglang:queue_time_seconds", "is_cuda_graph": "sglang:is_cuda_graph",
        # seen on SGLang 0.5.23: a per-request TPOT histogram, and the memory gauges of its pools
        "tpot_seconds": "sglang:request_time_per_output_token_seconds",
        "weight_memory_gb": "sglang:weight_memory_usage_gb", "kv_memory_gb": "sglang:kv_cache_memory_usage_gb",
        "graph_memory_gb": "sglang:graph_memory_usage_gb", "kv_pool_tokens": "sglang:max_total_num_tokens",
    }
    # seen on SGLang 0.5.23 (set once at start by its scheduler's emit_constants, one series per tp/pp rank; its
    # "GB" is 2^30 bytes) and the pool gauges its scheduler updates at its log interval
    memory_series = {
        "weights_gib": ("sglang:weight_memory_usage_gb", "last", 1.0),
        "kv_pool_gib": ("sglang:kv_cache_memory_usage_gb", "last", 1.0),
        "graphs_gib": ("sglang:graph_memory_usage_gb", "last", 1.0),          # one series per phase label: summed
        "kv_pool_tokens": ("sglang:max_total_num_tokens", "last", 1.0),
        "kv_used_peak_tokens": ("sglang:kv_used_tokens", "max", 1.0),
        "kv_free_min_tokens": ("sglang:kv_available_tokens", "min", 1.0),
        "kv_usage_peak_pct": ("sglang:token_usage", "max", 100.0),
    }
    memory_log_lines = (
        ("weights_gib", r"Load weight end\..*mem usage=(?P<gb>-?[\d.]+) GB", 1.0, "sum", "max"),
        ("kv_pool_tokens", r"KV Cache is allocated\..*?#tokens: (?P<tokens>\d+)", 1.0, "sum", "max"),
        ("kv_pool_gib", r"KV Cache is allocated\..*K size: (?P<k>[\d.]+) GB, V size: (?P<v>[\d.]+) GB", 1.0, "sum",
         "max"),
        ("graphs_gib", r"Capture cuda graph end\..*mem usage=(?P<gb>-?[\d.]+) GB", 1.0, "sum", "max"),
    )
    interference_sweep = ("chunked_prefill_size", (8192, 4096, 2048))
    confound_setting = {"cuda_graph_max_bs": 8}
    log_markers = {
        "ready": r"The server is fired up and ready to roll",
        "weights_loaded": r"Load weight end\..*mem usage=(?P<mem_gb>-?[\d.]+) GB",
        "kv_allocated": r"KV Cache is allocated\..*?#tokens: (?P<tokens>\d+)",
        "cuda_graph": r"Capture cuda graph end\..*mem usage=(?P<mem_gb>-?[\d.]+) GB",
        # "Decode out of memory happened." is a retraction (scheduler_log), not an OOM
        "oom": r"(CUDA out of memory|OutOfMemoryError|(?<!Decode )out of memory)",
        "crash": r"(Traceback \(most recent call last\)|Received sigquit|SIGKILL|Child process unexpectedly failed)",
    }

    # scheduler lines at the log interval (--decode-log-interval, default every 40 decode steps; every prefill
    # batch): "Prefill batch." (mid-2025) and "Prefill batch," (later); "token usage" became "full token usage"
    # with hybrid (SWA/mamba) pools. Fields are read as "key: number" pairs, so new fields do not break parsing.
    log_steps_note = ("SGLang's `Prefill batch` lines give a batch's new tokens but a time to the second and no "
                      "duration: stalls are attributed from the profiler trace in Phase 3")
    scheduler_log = {"prefill_batch": r"Prefill batch[.,]", "decode_batch": r"Decode batch[.,]",
                     # KV pool full during decode: requests retracted (back to the queue), not a crash
                     "retract": r"Decode out of memory happened\."}
    scheduler_fields = {"running_req": "running", "queue_req": "queued", "token_usage": "kv_usage",
                        "full_token_usage": "kv_usage", "new_seq": "new_seqs", "new_token": "new_tokens",
                        "cached_token": "cached_tokens", "token": "kv_tokens", "pending_token": "pending_tokens",
                        "gen_throughput_token_s": "gen_tps", "input_throughput_token_s": "input_tps",
                        "retracted_reqs": "retracted", "new_token_ratio": "new_token_ratio_before"}
    log_time = ("wall", r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\]", "%Y-%m-%d %H:%M:%S")
    log_time_note = "SGLang stamps each line with the server's local time to the second"
    serverside_series = ("running", "waiting", "kv_usage", "retracted")
    histogram_series = ("ttft_seconds", "queue_seconds", "itl_seconds", "tpot_seconds", "e2e_seconds")

    trace_name_hints = (r"-TP-\d+",)
    trace_skip_dirs = ("graph_capture_profile",)      # CUDA-graph capture traces, not serving steps
    trace_profile_id_shared = True

    def gloo_python(self, target: Any) -> str | None:
        """SGLang on this machine's CPU (``device: cpu``, local nodes, not attached): its venv's interpreter."""
        if (str(target.launch.get("device", "")) != "cpu" or target.attached
                or not all(n.kind == "local" for n in target.nodes)):
            return None
        from servelab.deploy.sglang_cpu import SGLANG_CPU_PYTHON, ensure_sglang_cpu
        py = target.launch.get("python") or SGLANG_CPU_PYTHON
        return str(ensure_sglang_cpu()) if py == SGLANG_CPU_PYTHON else str(py)

    def resolve_launch(self, target: Target, port: int) -> tuple[list[LaunchPlan], str]:
        """A local target naming the CPU build (``launch.python: sglang-cpu`` or ``model: tiny-hf``) gets it
        installed/generated first (``sglang_cpu``); anything else launches as configured."""
        if target.is_local:
            from servelab.deploy.sglang_cpu import needs_sglang_cpu, resolve_sglang_cpu
            if needs_sglang_cpu(target.model, target.launch):
                model, launch = resolve_sglang_cpu(target.model, target.launch)
                return self.launch_plans(dataclasses.replace(target, model=model, launch=launch), port), model
        return self.launch_plans(target, port), target.model

    @staticmethod
    def cpu_threads_bind(launch: dict[str, Any], ranks: int) -> str:
        """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU ranks: ``launch.cpu_threads_bind`` as given, else one
        core per rank (``0|1``), wrapping around this machine's cores (SGLang otherwise asserts that ranks <=
        NUMA nodes)."""
        if launch.get("cpu_threads_bind"):
            return str(launch["cpu_threads_bind"])
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))

    @staticmethod
    def expert_record_dir(launch: dict[str, Any]) -> str:
        """Where the expert-distribution recorder's dumps go on each node: ``launch.expert_record_dir``, else
        ``<launch.profiler_dir>/expert-distribution``, else "" (SGLang's own default, /tmp)."""
        if launch.get("expert_record_dir"):
            return str(launch["expert_record_dir"])
        return str(Path(launch["profiler_dir"]) / "expert-distribution") if launch.get("profiler_dir") else ""

    def launch_plans(self, target: Target, port: int) -> list[LaunchPlan]:
        """One plan per node: the same server argv plus ``--nnodes/--node-rank/--dist-init-addr``."""
        la = target.launch
        t = self.topology(la)
        py = la.get("python", "python3")
        base = [py, "-m", "sglang.launch_server", "--model-path", target.model, "--host", self.bind_host(target),
                "--port", str(port), "--tp-size", str(t["tp"])]
        if target.served_model_name:
            base += ["--served-model-name", target.served_model_name]
        if t["pp"] > 1:
            base += ["--pp-size", str(t["pp"])]
        if t["dp"] > 1:
            base += ["--dp-size", str(t["dp"])]
        if t["ep"] > 1:
            base += ["--ep-size", str(t["ep"])]
        if la.get("dp_attention"):
            base += ["--enable-dp-attention"]
        opt = {"mem_fraction": "--mem-fraction-static", "context_length": "--context-length",
               "chunked_prefill_size": "--chunked-prefill-size", "max_prefill_tokens": "--max-prefill-tokens",
               "max_running_requests": "--max-running-requests", "cuda_graph_max_bs": "--cuda-graph-max-bs",
               "kv_cache_dtype": "--kv-cache-dtype", "attention_backend": "--attention-backend",
               "moe_runner_backend": "--moe-runner-backend", "moe_a2a_backend": "--moe-a2a-backend",
               "hicache_ratio": "--hicache-ratio", "page_size": "--page-size", "device": "--device",
               "dtype": "--dtype", "max_total_tokens": "--max-total-tokens",
               "expert_distribution_recorder_mode": "--expert-distribution-recorder-mode",
               "expert_distribution_recorder_buffer_size": "--expert-distribution-recorder-buffer-size"}
        for key, flag in opt.items():
            if la.get(key) is not None:
                base += [flag, str(la[key])]
        if la.get("cuda_graph") is False:
            base += ["--disable-cuda-graph"]
        if la.get("prefix_cache") is False:
            base += ["--disable-radix-cache"]
        if la.get("disable_overlap_schedule"):
            base += ["--disable-overlap-schedule"]
        if la.get("trust_remote_code"):
            base += ["--trust-remote-code"]
        if la.get("sleep_on_idle"):
            base += ["--sleep-on-idle"]
        if la.get("enable_metrics", True):
            base += ["--enable-metrics"]
        if la.get("nvtx_markers"):
            base += ["--enable-layerwise-nvtx-marker"]
        spec = la.get("spec") or {}
        if spec:
            base += ["--speculative-algorithm", str(spec["algorithm"])]
            for key, flag in (("draft_model", "--speculative-draft-model-path"),
                              ("num_steps", "--speculative-num-steps"), ("topk", "--speculative-eagle-topk"),
                              ("num_draft_tokens", "--speculative-num-draft-tokens")):
                if spec.get(key) is not None:
                    base += [flag, str(spec[key])]
        base += [str(a) for a in la.get("extra_args", [])]
        env = dict(target.env)
        # SGLang titles its ranks with setproctitle ("sglang::scheduler_TP1"), which by default zeroes the process's
        # original environment block: /proc/<pid>/environ of a rank would then read empty and no check could see
        # what the rank started with (docs/method.md#rank-env). SPT_NOENV keeps the block; the title still fits.
        env.setdefault("SPT_NOENV", "1")
        if la.get("profiler_dir"):
            env["SGLANG_TORCH_PROFILER_DIR"] = str(la["profiler_dir"])
        if la.get("expert_distribution_recorder_mode") and self.expert_record_dir(la):
            env[self.expert_record_dir_env] = self.expert_record_dir(la)
        if la.get("device") == "cpu":
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            if t["tp"] * t["pp"] > 1 or la.get("cpu_threads_bind"):
                env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", self.cpu_threads_bind(la, t["tp"] * t["pp"]))
        plans = []
        nnodes = len(target.nodes)
        head = target.head
        for rank, node in enumerate([head] + [n for n in target.nodes if n is not head]):
            argv = list(base)
            if nnodes > 1:
                argv += ["--nnodes", str(nnodes), "--node-rank", str(rank),
                         "--dist-init-addr", f"{head.host}:{la.get('dist_port', 50000)}"]
            plan = LaunchPlan(node=node.name, argv=argv, env=dict(env), port=port, health_path=self.health_path,
                              role="head" if rank == 0 else "worker", ready="http" if rank == 0 else "none")
            if la.get("mode") == "docker":
                plan = docker_plan(plan, la, f"servelab-sglang-{node.name}", node.gpus)
            plans.append(plan)
        return plans

    def speculation_unsupported(self, target: Any) -> str:
        """On CPU SGLang cannot speculate: its speculative workers need sgl-kernel's CPU helpers (NGRAM imports
        ``sgl_kernel.speculative.reconstruct_indices_from_tree_mask``, EAGLE/STANDALONE call
        ``fill_accept_out_cache_loc_cpu`` ...), and no CPU build of sgl-kernel is published — seen with SGLang
        0.5.23 and ``--speculative-algorithm NGRAM``: the scheduler dies at start on that import."""
        if target.launch.get("device") == "cpu":
            return ("SGLang on CPU cannot speculate: its speculative workers need sgl-kernel's CPU helpers "
                    "(sgl_kernel.speculative.reconstruct_indices_from_tree_mask for NGRAM, fill_accept_out_cache_loc_cpu "
                    "for EAGLE/STANDALONE), and no CPU build of sgl-kernel is published (SGLang 0.5.23's scheduler "
                    "dies at start on that import); run Phase 9 on a GPU target")
        return ""

    def spec_launch_changes(self, target: Any, draft: str | None, num_draft_tokens: int, draft_min: int = 0,
                            synth_rates: Any = ()) -> dict[str, Any]:
        """``launch.spec`` for Phase 9's on/off comparison: a draft model served as SGLang's ``STANDALONE`` draft
        (``self`` = the target's own model), ``num_draft_tokens`` drafted per step in a chain (topk 1)."""
        if draft is None:
            return {"spec": None}
        if synth_rates:
            raise ParamError("synthetic acceptance rates (synth_rates) exist in llama.cpp only")
        if draft.startswith("random:"):
            raise ParamError(f"draft {draft!r}: random drafts are generated for llama.cpp's tiny GGUF only; give "
                             "SGLang a draft model path (or self)")
        path = target.model if draft == "self" else draft
        return {"spec": {"algorithm": "STANDALONE", "draft_model": path, "num_steps": int(num_draft_tokens),
                         "topk": 1, "num_draft_tokens": int(num_draft_tokens) + 1}}

    def one_batch_bench_argv(self, target: Any, batch_size: int = 1, input_len: int = 1024,
                             output_len: int = 8) -> list[str]:
        """``sglang.bench_one_batch``: no server, one static batch."""
        la = dict(getattr(target, "launch", {}) or {})
        model = getattr(target, "model", "MODEL")
        tp = int(la.get("tp_size", 1))
        argv = [la.get("python", "python3"), "-m", "sglang.bench_one_batch", "--model-path", model,
                "--batch-size", str(batch_size), "--input-len", str(input_len), "--output-len", str(output_len),
                "--tp-size", str(tp)]
        if la.get("trust_remote_code"):
            argv.append("--trust-remote-code")
        return argv

    def start_profile_body(self, output_dir: str, start_step: int | None = None, num_steps: int | None = 10,
                           activities: tuple[str, ...] = ("CPU", "GPU"), profile_by_stage: bool = False,
                           with_stack: bool = False, record_shapes: bool = True, profile_prefix: str | None = None,
                           merge_profiles: bool | None = None, profile_stages: list[str] | None = None,
                           ) -> dict[str, Any]:
        """Body of ``POST /start_profile``. ``with_stack`` defaults off: it was pathological on a production
        build (``docs/method.md#profiling-lessons``).
        ``start_step`` is an absolute forward count in SGLang (clamped to the next step), not "skip N"."""
        body: dict[str, Any] = {"output_dir": output_dir, "activities": list(activities),
                                "profile_by_stage": profile_by_stage, "with_stack": with_stack,
                                "record_shapes": record_shapes}
        if num_steps is not None:
            body["num_steps"] = int(num_steps)
        if start_step is not None:
            body["start_step"] = int(start_step)
        if profile_prefix:
            body["profile_prefix"] = profile_prefix
        if merge_profiles is not None:
            body["merge_profiles"] = bool(merge_profiles)
        if profile_stages:
            body["profile_stages"] = list(profile_stages)
        return body

    def profile_request(self, launch: dict[str, Any], out_dir: str | None, *, case_dir_name: str, prefix: str,
                        skip_steps: int, num_steps: int, **opts: Any) -> ProfileRequest:
        """SGLang writes where the body's ``output_dir`` says: ``out_dir``, else ``<launch.profiler_dir>/
        <case_dir_name>``. With ``num_steps`` it stops by itself. ``start_step`` is an absolute forward count,
        so a skip of ``skip_steps`` is the caller's to apply by triggering later (said in the notes)."""
        base = out_dir or (str(Path(launch["profiler_dir"]) / case_dir_name) if launch.get("profiler_dir") else None)
        if not base:
            raise ProfileError("SGLang needs an output folder: pass out_dir or set launch.profiler_dir")
        folder = str(base)
        notes = []
        kw = {"num_steps": num_steps, "profile_prefix": prefix, **opts}
        if skip_steps and "start_step" not in opts:
            notes.append(f"SGLang start_step is an absolute forward count; the scenario's skip of "
                         f"{skip_steps} steps is applied by triggering later, not by start_step")
        body = self.start_profile_body(output_dir=folder, **kw)
        return ProfileRequest(folder, body, bool(body.get("num_steps")), notes)

    def profile_file(self, file_name: str) -> dict[str, Any] | None:
        """``merged-….trace.json.gz`` → merged; ``…-TP-<n>-memory….pickle`` → memory; a per-rank trace → worker
        with ``rank_key`` ``TP-<n>[-DP-<n>][-PP-<n>][-EP-<n>]`` (and ``stage`` for profile_by_stage files)."""
        if _MERGED_FILE.search(file_name):
            return {"kind": "merged"}
        m = _MEMORY_FILE.search(file_name)
        if m:
            return {"kind": "memory", "engine": self.name, "tp": int(m.group("tp"))}
        m = _RANK_FILE.search(file_name)
        if not m:
            return None
        ids: dict[str, Any] = {k: int(v) for k, v in m.groupdict().items() if v is not None and k != "stage"}
        key = "-".join(f"{k.upper()}-{ids[k]}" for k in ("tp", "dp", "pp", "ep") if k in ids)
        out = {"kind": "worker", "engine": self.name, "rank_key": key, **ids}
        if m.group("stage"):
            out["stage"] = m.group("stage")
        return out

    def trace_identity(self, file_name: str) -> dict[str, Any] | None:
        """A per-rank trace: profile id (with its prefix), tp/dp/pp/ep and the profile_by_stage stage (lower
        case); a merged trace: role ``merged`` (every rank in one file, no clock alignment)."""
        if file_name.startswith(MERGED_PREFIX):
            return {"role": "merged"}
        m = _RANK_NAME.match(file_name)
        if not m:
            return None
        out: dict[str, Any] = {k: int(m[k]) for k in ("tp", "dp", "pp", "ep") if m[k] is not None}
        out.update(engine=self.name, source="filename",
                   profile_id=m["profile_id"] if not m["prefix"] else f"{m['prefix']}-{m['profile_id']}",
                   stage=m["stage"].lower() if m["stage"] else None)
        return out
