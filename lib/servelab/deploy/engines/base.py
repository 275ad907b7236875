"""What every engine adapter knows: launch settings, launch command, endpoints, request bodies, metric names,
log markers, profiler requests and the names of the trace files the engine writes.

Launch settings live in a target's ``launch:`` mapping. Keys common to all engines are validated
here; each adapter adds its own. Commands are argv lists, never shell strings. Code outside
``engines/`` asks the adapter (``engine_for(target.engine)`` / ``srv.engine``) rather than testing an
engine's name.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from servelab.core.params import ParamError, reject_unknown
from servelab.deploy.container import ContainerSpec, container_spec, validate_docker
from servelab.core.redact import known_secrets, redact_argv, redact_env

# launch keys every engine understands (meaning documented per key)
COMMON_LAUNCH_KEYS: dict[str, str] = {
    "mode": "bare | docker",
    "tp_size": "tensor-parallel degree",
    "pp_size": "pipeline-parallel degree",
    "dp_size": "data-parallel degree (attention DP with dp_attention)",
    "ep_size": "expert-parallel degree",
    "dp_attention": "SGLang attention data parallelism",
    "mem_fraction": "GPU memory fraction for weights+KV",
    "context_length": "max context length (tokens)",
    "chunked_prefill_size": "prefill chunk size (tokens)",
    "max_prefill_tokens": "max prefill tokens per batch",
    "max_running_requests": "max concurrently running requests",
    "cuda_graph": "CUDA graphs on/off",
    "cuda_graph_max_bs": "largest captured CUDA-graph batch",
    "kv_cache_dtype": "KV cache dtype (auto, fp8_e4m3...)",
    "prefix_cache": "prefix/radix cache on/off",
    "spec": "speculative decoding: {algorithm, draft_model, num_steps, topk, num_draft_tokens}",
    "profiler_dir": "where the engine's torch profiler writes traces",
    "nvtx_markers": "layer-wise NVTX markers (profiling runs only)",
    "docker": "{image, name, gpus, devices, shm_size, extra_args, stop_grace_s, client} for mode=docker",
    "python": "python interpreter on the node (bare mode)",
    "extra_args": "list of further engine arguments, passed verbatim as argv items",
    "dist_port": "port for multi-node rendezvous",
    "bind_host": "address the server listens on (default: 127.0.0.1 for a local head, the head node's host over SSH)",
}


TOPOLOGY_KEYS = ("tp_size", "pp_size", "dp_size", "ep_size")
SECRET_DIR = "{servelab-secret-dir}"      # in a LaunchPlan's argv: the start's private folder of its secret_files


@dataclass
class LaunchPlan:
    """One node's engine process: argv, environment, and how to reach it."""
    node: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    health_path: str = "/health"
    role: str = "head"               # head | worker
    ready: str = "http"              # how to know it is up: http (health path) | tcp (port open) | none
    ready_port: int = 0              # for ready=tcp
    ready_host: str = ""
    container: ContainerSpec | None = None   # mode=docker: argv is its `docker run`, env goes in its env file
    # files holding secrets (name -> content), written mode 0600 into this start's private folder on the node and
    # removed at stop; argv names each as SECRET_DIR + "/" + name (start_server puts the folder's path there)
    secret_files: dict[str, str] = field(default_factory=dict, repr=False)

    def shell(self, known: Sequence[str] | None = None) -> str:
        """The command as one line for people (pages, tables, records), secrets redacted: secret-named variables,
        secret flags (``--api-key X``), ``known`` values (default: those of this plan's env and argv, and the
        process environment's). Never executed: processes are started from :attr:`argv` and :attr:`env`."""
        known = tuple(known_secrets(self.env, argv=self.argv) if known is None else known)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in redact_env(self.env, known).items())
        return f"{env} {shlex.join(redact_argv(self.argv, known))}".strip()

    def secret_values(self) -> tuple[str, ...]:
        """The secret values this plan carries (its env's and its argv's), for a literal scrub elsewhere."""
        return known_secrets(self.env, argv=self.argv, environ=False)


@dataclass
class ProfileRequest:
    """How to start the engine's profiler for one capture: the engine-side trace folder (the same path on every
    node), the ``POST /start_profile`` body, whether the engine stops by itself after the requested steps,
    and notes on how the request differs from what was asked."""
    folder: str
    body: dict[str, Any] | None
    auto_stop: bool
    notes: list[str] = field(default_factory=list)


class ProfileError(ValueError):
    """A profiler request this engine cannot honour as asked (the message says what to change)."""


# rank / tp / pp / dp / ep followed by a number in a file name ("rank3", "tp_2", "dp-0"); not inside a word
NAME_RANK_TOKEN = re.compile(r"(?<![a-z])(rank|tp|pp|dp|ep)[-_]?(\d+)(?![0-9])", re.IGNORECASE)


# an engine process title naming its parallel rank: SGLang's "sglang::scheduler_TP1" / "..._PP0_TP1" (setproctitle),
# vLLM's "VllmWorker TP1" / "VLLM::Worker_TP0"; the rank part is returned ("TP1", "PP0_TP1")
RANK_TITLE = re.compile(r"(?:scheduler|worker)[\s_:-]*((?:(?:DP|PP|TP|EP)\d+_?)+)", re.IGNORECASE)


def name_rank_tokens(stem: str) -> dict[str, int]:
    """``{"rank": .., "tp": .., ...}`` from the parallel-rank tokens of a file name stem (later ones win)."""
    return {key.lower(): int(val) for key, val in NAME_RANK_TOKEN.findall(stem)}


def _check_argv(value: Any, where: str) -> None:
    """``extra_args`` is a list of argv items (strings or numbers), never one string."""
    if value is None:
        return
    if not isinstance(value, list):
        raise ParamError(f"{where} must be a list of argv items (e.g. [\"--flag\", \"value\"]), got {value!r}")
    for item in value:
        if not isinstance(item, (str, int, float)) or isinstance(item, bool):
            raise ParamError(f"{where} items must be strings or numbers, got {item!r}")


class EngineAdapter:
    """Base adapter. Subclasses fill the names and the launch builder."""

    name = "base"
    extra_launch_keys: dict[str, str] = {}
    health_path = "/health"
    metrics_path = "/metrics"
    tokenize_path = "/tokenize"
    flush_cache_path: str | None = None
    start_profile_path: str | None = None
    stop_profile_path: str | None = None
    # the engine's expert-distribution recorder (MoE models): its start/stop/dump paths (each a POST without a body),
    # the launch key that turns it on, the variable naming the folder its dump files go to, and their file names
    expert_record_paths: dict[str, str] | None = None
    expert_record_mode_key = "expert_distribution_recorder_mode"
    expert_record_dir_env = ""
    expert_dump_file = r"$^"
    version_paths: tuple[str, ...] = ()
    slots_path: str | None = None          # per-slot state (prompt progress, KV tokens held), polled while a case runs
    # the variable naming where the engine creates its IPC socket files (default: the node's temp folder, where
    # they outlive the process); start_server points it at a private folder per start and removes it at stop
    ipc_dir_env: str = ""
    # True: that private folder is also the process's TMPDIR (files the engine makes through ``tempfile`` that it
    # never removes: vLLM's torch.distributed FileStore ``vllm_dist_<uuid>``, one per start), with torch
    # inductor's cache pinned to where it is without this, so compiled kernels survive between starts
    private_tmp: bool = False
    # stop: SIGTERM to the server process alone first, letting it stop its own children (hosts.Handle)
    term_leader_first: bool = False
    metric_names: dict[str, str] = {}      # our name -> engine's Prometheus series name
    log_markers: dict[str, str] = {}       # event -> regex over the server log
    # Phase 7: the one-variable sweep that means something on this engine (first value = its default = the
    # baseline), and a second setting changed on purpose to show how a two-variable A/B is flagged
    interference_sweep: tuple[str, tuple[Any, ...]] = ("", ())
    confound_setting: dict[str, Any] = {}
    # Phase 8: prefix-cache granularity when launch.page_size is unset; the request-body flag that turns prefix
    # reuse off for one request (None = no such switch); startup-log lines of the memory breakdown as
    # (component, regex) and where the engine prints them
    default_page_tokens: int = 1
    request_cache_switch: str | None = None
    memory_log_patterns: tuple[tuple[str, str], ...] = ()
    memory_log_note: str = ""
    # the memory layer (analyse.memory, docs/metrics.md#memory), where the engine exposes it:
    # /metrics series: quantity -> (series, "last" | "max" | "min", scale to the quantity's unit)
    memory_series: dict[str, tuple[str, str, float]] = {}
    # an info metric whose labels carry memory settings: (series, {quantity: (label, scale)})
    memory_info: tuple[str, dict[str, tuple[str, float]]] | None = None
    # start-up log lines: (quantity, regex whose named groups are numbers, scale, "sum" | "product" of the groups,
    # "max" | "sum" over matching lines: per rank, or over a rank's devices and buffers)
    memory_log_lines: tuple[tuple[str, str, float, str, str], ...] = ()
    # the server-side layer of a case (docs/metrics.md#server-side): the engine's scheduler/batch log lines as
    # event -> regex (named groups are numeric fields; "key: number" pairs after the match are read too), how a
    # log line carries its time (kind "elapsed" = seconds since the process started, "wall" = the server's local
    # clock, "" = none; a regex with a ``ts`` group; a strptime format for "wall"), the canonical names of
    # scheduler fields, the gauges drawn under the client's timeline and the latency histograms it exposes
    scheduler_log: dict[str, str] = {}
    scheduler_fields: dict[str, str] = {}
    log_time: tuple[str, str, str] = ("", "", "")
    log_time_note: str = ""
    serverside_series: tuple[str, ...] = ("running", "waiting", "kv_usage")
    histogram_series: tuple[str, ...] = ()
    log_occupancy: tuple[str, str] | None = None     # (event taking a slot, event releasing it) in scheduler_log
    # Phase 9: the per-position accepted-draft-tokens series where ``metric_names`` has none
    spec_per_position_series: str = ""
    # trace files the engine's profiler writes (see trace_identity / profile_file)
    trace_name_hints: tuple[str, ...] = ()      # regexes: a file name matching one is a trace of this engine
    trace_skip_dirs: tuple[str, ...] = ()       # sub-folders of a trace folder that hold no serving-step traces
    trace_profile_id_shared = False             # every rank's file of one capture carries the same profile id

    def launch_keys(self) -> set[str]:
        return set(COMMON_LAUNCH_KEYS) | set(self.extra_launch_keys)

    # launch keys that must be a positive integer when set (each adapter may add its own)
    positive_int_keys: tuple[str, ...] = (*TOPOLOGY_KEYS, "context_length", "max_running_requests",
                                          "cuda_graph_max_bs", "max_prefill_tokens")

    @staticmethod
    def expert_record_dir(launch: dict[str, Any]) -> str:
        """Where the expert-distribution recorder writes its dumps on each node ("" when the engine has none)."""
        return ""

    def validate_launch(self, launch: dict[str, Any], source: str) -> None:
        if not isinstance(launch, dict):
            raise ParamError(f"{source}: launch must be a mapping, got {launch!r}")
        reject_unknown(launch, self.launch_keys(), f"{source}: launch ({self.name})")
        for key in self.positive_int_keys:
            v = launch.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ParamError(f"{source}: launch.{key} must be a positive integer, got {v!r}")
        if launch.get("mode", "bare") not in ("bare", "docker"):
            raise ParamError(f"{source}: launch.mode must be 'bare' or 'docker'")
        mf = launch.get("mem_fraction")
        if mf is not None and (not isinstance(mf, (int, float)) or isinstance(mf, bool) or not (0 < mf <= 1)):
            raise ParamError(f"{source}: launch.mem_fraction must be a number in (0, 1], got {mf!r}")
        _check_argv(launch.get("extra_args"), f"{source}: launch.extra_args")
        docker = launch.get("docker")
        if docker is not None:
            validate_docker(docker, source)
            _check_argv(docker.get("extra_args"), f"{source}: launch.docker.extra_args")
        spec = launch.get("spec")
        if spec:
            if not isinstance(spec, dict):
                raise ParamError(f"{source}: launch.spec must be a mapping {{algorithm, draft_model, ...}}, "
                                 f"got {spec!r}")
            if not isinstance(spec.get("algorithm"), str) or not spec["algorithm"].strip():
                raise ParamError(f"{source}: launch.spec needs 'algorithm' (e.g. EAGLE, NGRAM, draft)")

    def check_model(self, target: Any) -> None:
        """Raise :class:`ParamError` when the target's model surely does not exist, before anything starts.
        Default: nothing to check here (a hub id or a path on a remote node is the engine's to resolve)."""

    def topology(self, launch: dict[str, Any]) -> dict[str, int]:
        """{"tp": .., "pp": .., "dp": .., "ep": ..} from the launch settings (1 where unset)."""
        return {k[:2]: int(launch.get(k, 1)) for k in TOPOLOGY_KEYS}

    def gloo_python(self, target: Any) -> str | None:
        """The interpreter (with the engine's torch) that runs a gloo collective sweep like the engine's own
        collectives, where this engine's ranks talk through torch's gloo backend on this machine's CPU; None where
        they do not (their ceiling is nccl-tests')."""
        return None

    def world_size(self, launch: dict[str, Any]) -> int:
        t = self.topology(launch)
        return t["tp"] * t["pp"] * (t["dp"] if not launch.get("dp_attention") else 1)

    @staticmethod
    def bind_host(target: Any) -> str:
        """The narrowest address that serves the client: loopback for a local head, the head node's own address
        over SSH (never 0.0.0.0 unless ``launch.bind_host`` asks for it)."""
        head = target.head
        return str(target.launch.get("bind_host") or ("127.0.0.1" if head.kind == "local" else head.host))

    # --- API key (docs/method.md#exposure)
    # the variable the engine reads its API key from; "" = the engine takes it on its command line only
    api_key_env_var: str = ""
    api_key_flag: str = "--api-key"
    # or a file the engine reads its arguments from: (flag, file name, content with {key}) — see LaunchPlan.secret_files
    api_key_config: tuple[str, str, str] | None = None
    # the engine prints its API key into its own log (its arguments at start): with a key, the log is written in the
    # start's private folder and copied back redacted at stop (server.start_server)
    logs_api_key: bool = False

    def apply_api_key(self, plans: list[LaunchPlan], key: str) -> list[str]:
        """Give the head's plan the API key: through the engine's own variable where it has one (never in argv;
        in docker mode it goes into the container's mode-0600 env file), else as ``--api-key`` (visible in ``ps``
        on the node — said in the returned notes)."""
        notes: list[str] = []
        for plan in plans:
            if plan.role != "head":
                continue
            if self.api_key_env_var and plan.container is not None:     # docker: into the 0600 env file
                plan.container.env = {**plan.container.env, self.api_key_env_var: key}
            elif self.api_key_env_var:
                plan.env = {**plan.env, self.api_key_env_var: key}     # the head's own copy: workers share env
            elif self.api_key_config and plan.container is None:       # a 0600 file in the start's private folder
                flag, name, content = self.api_key_config
                plan.secret_files = {**plan.secret_files, name: content.format(key=key)}
                plan.argv += [flag, f"{SECRET_DIR}/{name}"]
            else:
                if plan.container is not None:
                    plan.container.engine_argv = [*plan.container.engine_argv, self.api_key_flag, key]
                    plan.argv = plan.container.run_argv()
                else:
                    plan.argv += [self.api_key_flag, key]
                notes.append(f"{self.name} takes its API key only as {self.api_key_flag}: the key is visible in the "
                             f"process list (ps) of {plan.node}")
        return notes

    def dev_endpoints(self, target: Any) -> list[str]:
        """Endpoints beyond serving that this launch mounts (profiling, cache flush, slot contents...)."""
        return [p for p in (self.flush_cache_path, self.start_profile_path, self.stop_profile_path) if p]

    @staticmethod
    def _loopback(host: str) -> bool:
        return host == "localhost" or host.startswith("127.") or host == "::1"

    def exposure_warnings(self, target: Any, api_key: bool) -> list[str]:
        """Sentences for the page's warning block (``docs/method.md#exposure``): a head reachable beyond this
        machine without an API key, development/profiling endpoints on such an address, a key that can only
        travel on the command line."""
        host = self.bind_host(target)
        out = []
        dev = self.dev_endpoints(target)
        if not self._loopback(host) and not api_key:
            out.append(f"The head listens on {host} (not loopback) without an API key: anyone who can reach that "
                       f"address can send requests" + (f" and call {', '.join(dev)}" if dev else "") +
                       ". Set api_key_env in the target (docs/method.md#exposure) or bind 127.0.0.1.")
        elif dev and not self._loopback(host):
            out.append(f"{self.name} mounts {', '.join(dev)} on {host} (behind the API key): development/profiling "
                       "endpoints that change the server's state; keep the address private.")
        if api_key and not self.api_key_env_var and not (self.api_key_config and target.launch.get("mode") != "docker"):
            out.append(f"{self.name} takes its API key only on its command line ({self.api_key_flag}): it is visible "
                       "in the process list of the head node.")
        return out

    def exposure_notes(self, target: Any, api_key: bool) -> list[str]:
        """What is exposed but only on loopback (an info note: every local user can still reach it)."""
        host = self.bind_host(target)
        dev = self.dev_endpoints(target)
        if self._loopback(host) and dev:
            return [f"The head listens on {host} only; it mounts {', '.join(dev)}" +
                    (" behind the API key" if api_key else "") + ", reachable by every user of that machine."]
        return []

    def rank_of_process(self, title: str) -> str | None:
        """The parallel rank an engine process serves, from its title (``/proc/<pid>/cmdline`` as set by the engine):
        ``TP1``, ``PP0_TP1`` …; ``None`` for a process that is no rank (launcher, tokenizer, detokenizer) or an
        engine that runs in one process."""
        m = RANK_TITLE.search(title or "")
        return m.group(1).rstrip("_").upper() if m else None

    def max_request_tokens(self, launch: dict[str, Any]) -> int | None:
        """Tokens one request may hold (prompt + output): the context length (None where unset)."""
        ctx = launch.get("context_length")
        return int(ctx) if ctx is not None else None

    def layout_launch_settings(self, layout: Any) -> dict[str, Any]:
        """The ``launch:`` keys that express a parallel layout (``tp, pp, dp, ep, dp_attention`` as in
        :class:`servelab.analyse.topology.Layout`). Default: SGLang's notation, attention DP inside the TP group."""
        return {"tp_size": layout.tp, "pp_size": layout.pp, "dp_size": layout.dp, "ep_size": layout.ep,
                "dp_attention": bool(layout.dp_attention)}

    def prefix_cache_counts(self, delta: Callable[[str], float | None]) -> tuple[float | None, float | None, str]:
        """(cached tokens, prompt tokens, formula) of a measurement window from counter deltas; ``delta(key)``
        is the delta of ``metric_names[key]``. Default (SGLang): Δcached_tokens / Δprompt_tokens."""
        return delta("cached_tokens_total"), delta("prompt_tokens_total"), "Δcached_tokens / Δprompt_tokens"

    def cache_study_launch_changes(self, launch: dict[str, Any], swa_full: bool = True
                                   ) -> tuple[dict[str, Any], list[str]]:
        """Launch changes the prefix-cache phase needs on this engine (memory lines in the log, reusable prefixes),
        with a note per change for the page. Default: none."""
        return {}, []

    def speculation_unsupported(self, target: Any) -> str:
        """Why Phase 9 cannot run speculative decoding on ``target`` (one line), or "" when it can: said before
        anything starts. Default: servelab builds no speculative launch for this engine."""
        return (f"servelab builds speculative-decoding launches for llama.cpp and SGLang, not {self.name}: set "
                "launch.spec on two targets and compare their runs with servelab.measure.abtest")

    def spec_launch_changes(self, target: Any, draft: str | None, num_draft_tokens: int, draft_min: int = 0,
                            synth_rates: Sequence[float] = ()) -> dict[str, Any]:
        """Launch settings that serve ``target`` with draft-model speculative decoding (``draft`` a draft key) or
        without it (``draft`` None), for Phase 9's on/off comparison. Only llama.cpp's are built here."""
        raise ParamError(f"phase 9 runs speculative decoding on llama.cpp; for {self.name} set launch.spec on "
                         "two targets and compare their runs with servelab.measure.abtest")

    def one_batch_bench_argv(self, target: Any, batch_size: int = 1, input_len: int = 1024,
                             output_len: int = 8) -> list[str]:
        """The engine's own single-batch benchmark of the target's model (the small reproduction ``ncu`` wraps),
        keeping the target's TP/PP so the kernels see the service's shapes."""
        raise ParamError(f"{self.name}: no single-batch benchmark is known for this engine")

    def resolve_launch(self, target: Any, port: int) -> tuple[list[LaunchPlan], str]:
        """(per-node launch plans, model path the engine loads). Engines whose local runs need artifacts
        (a built binary, an assembled model, a CPU build) resolve them here."""
        return self.launch_plans(target, port), target.model

    def prepare(self, target: Any, progress: Callable[[str], Any] = lambda _: None) -> str:
        """Build, install or assemble what a start of ``target`` needs on this machine, ahead of time (``servelab
        demo``/``build``); returns one line saying what is ready. Default: what :meth:`resolve_launch` resolves."""
        progress(f"{self.name}: preparing the target {getattr(target, 'name', '')} (the first time this installs or "
                 "builds what it needs; cached afterwards)")
        _, model = self.resolve_launch(target, 0)
        return f"{self.name} and model {model} ready"

    def launch_plans(self, target: Any, port: int) -> list[LaunchPlan]:
        raise NotImplementedError

    def version_command(self, argv: list[str]) -> list[str] | None:
        """The command that prints the engine's build/version, given a launch argv (its executable first);
        None where the version comes from an HTTP endpoint (``version_paths``) only."""
        return None

    # the engine's top-level Python module (its packages and commit are read with the interpreter that runs it,
    # Phase 0's freeze); None for a compiled engine
    engine_package: str | None = None

    def engine_python(self, argv: list[str]) -> str | None:
        """The interpreter that runs the engine, from its launch argv (``PY -m module ...``); None when the engine
        is not started through a Python interpreter."""
        if self.engine_package and len(argv) > 2 and argv[1] == "-m" and str(argv[2]).split(".")[0] == self.engine_package:
            return str(argv[0])
        return None

    def commit_from_version(self, text: str) -> str:
        """The source commit the engine's version output names (``version_command``); ``""`` where it names none."""
        return ""

    def implied_settings(self, launch: dict[str, Any]) -> dict[str, str]:
        """Live values of Phase 0 settings that follow from the engine itself when it has no server-info
        endpoint to report them. Keys: ``topology``, ``cuda_graph``, ``chunked_prefill``, ``prefix_cache``."""
        return {}

    # --- server-side log lines
    # what the engine's log allows for per-request timing (the Phase 1 M1 join, docs/metrics.md#m1-log-join)
    log_steps_note: str = ("this engine's log has no per-request or per-step timing: stalls are attributed from "
                           "the profiler trace in Phase 3")

    def log_prefills(self, lines: Any) -> list[dict[str, Any]] | None:
        """Each request's prefill as its log places it on the wall clock — ``[{"task", "start_ns", "end_ns",
        "prompt_tokens"}]`` from the parsed scheduler lines of a window (``analyse.serverside`` frame: ``event``,
        ``wall_ns`` and the fields) — or None where the log does not time prefills (``log_steps_note`` says why)."""
        return None

    def parse_scheduler_line(self, line: str) -> dict[str, Any] | None:
        """``{"event", field: number, ...}`` for a scheduler/batch line of this engine's log, None for any other
        line. Fields: the regex's named groups, then every ``key: number`` pair after the match, keys lower-cased
        with non-alphanumerics as ``_`` and renamed by ``scheduler_fields`` (e.g. ``#running-req`` → ``running``)."""
        for event, rx in self.scheduler_log.items():
            m = re.search(rx, line)
            if not m:
                continue
            fields: dict[str, Any] = {"event": event}
            for k, v in m.groupdict().items():
                if v is not None:
                    fields[self.scheduler_fields.get(k, k)] = _number(v)
            for k, v in _KEY_NUMBER.findall(line[m.start():]):
                key = re.sub(r"[^a-z0-9]+", "_", k.lower()).strip("_")
                fields.setdefault(self.scheduler_fields.get(key, key), _number(v))
            return fields
        return None

    def line_time(self, line: str) -> tuple[str, Any] | None:
        """The time a log line carries: ``("elapsed", seconds since the process started)``, ``("wall", naive
        datetime on the server's local clock)`` (year 1900 where the format has none), or None."""
        kind, rx, fmt = self.log_time
        if not kind:
            return None
        m = re.search(rx, line)
        if not m:
            return None
        ts = m.group("ts")
        if kind == "elapsed":
            parts = [int(p) for p in re.split(r"[.:]", ts)]
            minutes, sec, ms, us = ([0] * (4 - len(parts)) + parts)[-4:]
            return "elapsed", minutes * 60 + sec + ms / 1e3 + us / 1e6
        return "wall", dt.datetime.strptime(ts, fmt)

    # --- request bodies
    def tokenize_body(self, text: str, add_special: bool) -> dict[str, Any]:
        """The body of the engine's tokenize endpoint (``tokenize_path``)."""
        return {"prompt": text, "add_special_tokens": add_special}

    def output_control(self, output_tokens: int) -> dict[str, Any]:
        """Completion body fields that force exactly ``output_tokens`` tokens."""
        return {"max_tokens": output_tokens, "ignore_eos": True}

    # --- the greedy correctness probe of an A/B (measure.correctness): the same prompts, temperature 0, on A and B
    greedy_path = "/v1/completions"

    def greedy_body(self, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One greedy completion that returns the chosen tokens' ids and log-probabilities: OpenAI completions as
        SGLang and vLLM serve them (``logprobs: 1``; ``return_token_ids``, which both accept), no stream."""
        return {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0.0, "logprobs": 1,
                "return_token_ids": True, "stream": False}

    def greedy_output(self, body: Any) -> dict[str, Any]:
        """``token_ids`` (None where the engine returned none), ``tokens`` (texts), ``logprobs`` of the chosen tokens
        (None where none), ``text`` and ``finish_reason`` of one :meth:`greedy_body` answer."""
        ch = body["choices"][0]
        lp = ch.get("logprobs") or {}
        return {"token_ids": [int(t) for t in ch["token_ids"]] if ch.get("token_ids") is not None else None,
                "tokens": [str(t) for t in lp.get("tokens") or []] or None,
                "logprobs": [None if v is None else float(v) for v in lp.get("token_logprobs") or []] or None,
                "text": str(ch.get("text", "")), "finish_reason": ch.get("finish_reason")}

    # --- profiler (engines that support it override)
    @property
    def can_profile(self) -> bool:
        """Whether the engine has a torch profiler endpoint (``start_profile_path``)."""
        return self.start_profile_path is not None

    def start_profile_body(self, **kw: Any) -> dict[str, Any] | None:
        return None

    def profile_request(self, launch: dict[str, Any], out_dir: str | None, *, case_dir_name: str, prefix: str,
                        skip_steps: int, num_steps: int, **opts: Any) -> ProfileRequest:
        """The profiler request for one capture of ``num_steps`` steps after ``skip_steps``, files named with
        ``prefix``; ``out_dir`` is the asked engine-side folder (default: ``launch.profiler_dir`` or a
        ``case_dir_name`` folder under it). Raises ``ProfileError`` when the engine cannot do it."""
        raise ProfileError(f"engine '{self.name}' has no profiler endpoint")

    # --- trace files the profiler writes
    def profile_file(self, file_name: str) -> dict[str, Any] | None:
        """What a file in the engine's profiler folder is, from its name: ``kind`` (worker | frontend | merged |
        memory | table) and, for worker traces, ``rank_key`` plus the parallel ranks the name carries.
        None: not a file this engine names."""
        return None

    def trace_identity(self, file_name: str) -> dict[str, Any] | None:
        """The rank identity a trace file's name carries under this engine's naming rules (fields of
        ``analyse.trace.identity.RankIdentity``: engine, role, rank, tp, dp, pp, ep, stage, profile_id, source).
        None: the name does not follow this engine's rules."""
        return None


def docker_plan(plan: LaunchPlan, launch: dict[str, Any], base_name: str, node_gpus: int = 0) -> LaunchPlan:
    """``plan`` run in a container (``launch.mode: docker``): its argv becomes ``docker run`` (host network and IPC,
    ``--gpus`` where the node has GPUs, the devices; the environment by an env file, never by value), its
    environment moves into the container. ``deploy/container.py`` starts and stops it."""
    spec = container_spec(launch, plan.argv, plan.env, base_name, node_gpus)
    plan.argv, plan.env, plan.container = spec.run_argv(), {}, spec
    return plan


_KEY_NUMBER = re.compile(r"(#?[A-Za-z][A-Za-z0-9_\-/() ]*?):\s+([-+]?\d[\d,]*(?:\.\d+)?)(?![\w.])")


def _number(v: str) -> float | str:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return v


def json_arg(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
