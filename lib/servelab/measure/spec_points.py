"""Phase 9's measurement: the speculative configs, each served once with its launch changes, and every point (a
config at one concurrency, one repeat) measured raw through the case runner.

:func:`measure_spec_point` runs one point through :class:`servelab.measure.case_runner.CaseRun` — warm-up, flush,
``/metrics`` snapshot, ``concurrency`` decode requests, snapshot — and returns what it recorded
(:class:`RawSpecPoint`) with the case still open: the phase judges it (the row and the case summary are
:mod:`servelab.analyse.speculative`'s) and closes the case. :func:`measure_configs` serves each config
(:func:`launch_changes`) and measures its points, the judging step a callable the phase hands in, and writes each
served config's run-like record for the A/B.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from servelab.core.facts import MIN_SAMPLES
from servelab.core.params import ParamError
from servelab.core.paths import path_slug
from servelab.core.run import read_manifest
from servelab.core.scope import RunScope
from servelab.deploy.engines import engine_for
from servelab.deploy.server import RunningServer
from servelab.measure import request_metrics as mx
from servelab.measure.case import case_seed
from servelab.measure.case_runner import CaseRun, Warmup
from servelab.measure.client import run_requests
from servelab.measure.launch_variants import Snapshot, serving, with_launch, write_run_record
from servelab.measure.records import ClientRun, RequestRecord
from servelab.measure.workload import build_workload, engine_tokenizer, token_pool

# how long a freshly started engine (one per config) may take to answer its health check
HEALTH_TIMEOUT_S = 300.0


@dataclass
class SpecConfig:
    """One speculative setting. ``draft`` None = speculation off (the baseline). ``as_served``: an attached server
    measured with whatever it was launched with (servelab changes nothing there); whether it speculates is read
    from its counters, not declared."""
    label: str
    draft: str | None = None            # "self" | "random:<seed>" (tiny only) | a GGUF path
    num_draft_tokens: int = 3
    draft_min: int = 0
    synth_rates: list[float] = field(default_factory=list)   # llama.cpp --spec-synth-rates (benchmarking only)
    as_served: bool = False

    AS_SERVED: ClassVar[str] = "as served"

    @property
    def enabled(self) -> bool:
        return self.draft is not None


def launch_changes(cfg: SpecConfig, target: Any) -> dict[str, Any]:
    """Launch settings for ``cfg`` on ``target``, built by its engine adapter (llama.cpp: extra argv items, see
    ``LlamaCppAdapter.spec_launch_changes``; the other engines refuse: set ``launch.spec`` on two targets and
    A/B their runs)."""
    return engine_for(target.engine).spec_launch_changes(target, cfg.draft, cfg.num_draft_tokens, cfg.draft_min,
                                                         cfg.synth_rates)


@dataclass(frozen=True)
class PointShape:
    """The shape of every point: the concurrencies, prompt and output lengths and repeats (the scale's where the
    parameters leave 0 / empty)."""
    concurrencies: list[int]
    input_tokens: int
    output_tokens: int
    repeats: int


# ---------------------------------------------------------------- one point: a config at one concurrency

@dataclass
class RawSpecPoint:
    """What one point recorded, before it is judged: the case (still open: the judge closes it with its summary),
    the records and the client run, the counter window's snapshots, the engine's CPU seconds at both ends, the
    engine log excerpt of the measured requests, the error the block recorded ("" when none), the case id and the
    id its repeats share (``repeat_of``)."""
    case: CaseRun
    config: SpecConfig
    concurrency: int
    repeat: int
    definition: str
    records: list[RequestRecord]
    run: ClientRun | None
    before: Snapshot | None
    after: Snapshot | None
    cpu: tuple[float | None, float | None]
    log_text: str
    error: str
    case_id: str
    repeat_of: str


@dataclass
class SpecPoint:
    """One judged point: its row (the points table's) beside the raw data it came from."""
    config: SpecConfig
    concurrency: int
    repeat: int
    case_dir: Path
    row: dict[str, Any]
    records: list[RequestRecord]
    before: Snapshot | None
    after: Snapshot | None


def measure_spec_point(srv: RunningServer, run_dir: Path, cfg: SpecConfig, concurrency: int, input_tokens: int,
                       output_tokens: int, pool: list[int], seed: int = 0, repeat: int = 0,
                       definition: str = mx.VLLM_BENCH, case_id: str = "", phase: str = "phase9") -> RawSpecPoint:
    """Warm-up, flush, snapshot, ``concurrency`` decode requests, snapshot; the raw data written, the case left open.

    The measured requests use the same seed in every config, so speculation on and off decode the same prompts.
    Written through the case runner (:class:`servelab.measure.case_runner.CaseRun`): one folder per
    repeat, ``repeat_of`` = the config at this concurrency (``S9_<config>_c<C>``).
    """
    cid = case_id or f"S9_{path_slug(cfg.label)}_c{concurrency}_r{repeat}"
    case = CaseRun(srv, run_dir, cid, phase, "speculative", {
        "config": asdict(cfg), "concurrency": concurrency, "repeat": repeat, "engine": srv.target.engine,
        "launch": srv.target.launch, "definition": definition}, definition=definition, settle_log=True)
    run = None
    with case:
        ccfg = case.client_config()
        case.warm_up(case.client_warmup(ccfg, pool, Warmup(1, input_tokens, min(output_tokens, 8),
                                                           case_seed(seed, f"S9-warmup-c{concurrency}", repeat))))
        case.flush()
        # the same prompts for every config (seed independent of the config)
        # at least the sample-size rule's requests (core.facts.MIN_SAMPLES): one request is no throughput point
        wl = build_workload(cid, max(concurrency, MIN_SAMPLES["throughput"]), input_tokens, output_tokens, pool,
                            seed=case_seed(seed, f"S9-c{concurrency}", repeat))
        case.mark_log()                   # the excerpt holds the measured requests' lines only (the row reads them)
        case.open_window(server_cpu=True)
        run = run_requests(wl.requests, ccfg, concurrency=concurrency, repeat=repeat)
        case.add(run.records)
    return RawSpecPoint(case, cfg, concurrency, repeat, definition, case.records, run, case.before, case.after,
                        case.cpu, case.log_text, case.error, cid,
                        case_id or f"S9_{path_slug(cfg.label)}_c{concurrency}")


# ---------------------------------------------------------------- every config served once

@dataclass
class ConfigRuns:
    """What the configs measured: every point's row, the configs that did not run (label → reason), and each
    served config's run-like record for the A/B."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    records: list[Path] = field(default_factory=list)


def measure_configs(scope: RunScope, configs: list[SpecConfig], shape: PointShape,
                    judge: Callable[[RawSpecPoint], SpecPoint], seed: int = 0,
                    definition: str = mx.VLLM_BENCH) -> ConfigRuns:
    """Each config served once with its launch changes, its points measured and judged (``judge``), its run-like
    record written; a config whose launch cannot be built or that cannot serve is recorded with its reason, the
    others go on. An ``as_served`` config is the target itself, unchanged (an attached server: ``serving``
    attaches to it and stops nothing)."""
    out = ConfigRuns()
    parent = read_manifest(scope.run_dir)
    for cfg in configs:
        try:
            served = scope.target if cfg.as_served else with_launch(scope.target, launch_changes(cfg, scope.target),
                                                                    cfg.label)
        except ParamError as exc:
            out.errors[cfg.label] = str(exc)
            continue
        rows, srv, error = measure_config(scope, cfg, served, shape, judge, seed, definition)
        if error:
            out.errors[cfg.label] = error
        out.rows += rows
        # every point enters the A/B as S9_c<C> (the same case on every side), its repeats from its summaries
        cases = [(f"S9_c{r['concurrency']}", scope.run_dir / "cases" / r["case_id"], "") for r in rows]
        out.records.append(write_run_record(scope.phase_dir / "ab" / path_slug(cfg.label),
                                            f"{parent.get('run_id', 'run')}-{path_slug(cfg.label)}", served, srv,
                                            cases or [("S9", None, out.errors.get(cfg.label, "no point ran"))],
                                            parent))
    return out


def measure_config(scope: RunScope, cfg: SpecConfig, served: Any, shape: PointShape,
                   judge: Callable[[RawSpecPoint], SpecPoint], seed: int = 0, definition: str = mx.VLLM_BENCH
                   ) -> tuple[list[dict[str, Any]], RunningServer | None, str]:
    """One config served: every concurrency and repeat of ``shape`` measured on it and judged (``judge``). Returns
    the rows (those before a failure too), the server (None when it never came up) and the error ("" when none)."""
    rows: list[dict[str, Any]] = []
    srv_ref = None
    try:
        with serving(served, scope.phase_dir / "server", scope.run_dir, scope.phase, HEALTH_TIMEOUT_S) as srv:
            srv_ref = srv
            pool = token_pool(engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path,
                                               headers=srv.auth_headers), seed=seed)
            for c in shape.concurrencies:
                for rep in range(shape.repeats):
                    raw = measure_spec_point(srv, scope.run_dir, cfg, c, shape.input_tokens, shape.output_tokens,
                                             pool, seed=seed, repeat=rep, definition=definition, phase=scope.phase)
                    rows.append(judge(raw).row)
    except Exception as exc:  # a config that cannot serve is recorded; the others go on
        return rows, srv_ref, f"{type(exc).__name__}: {exc}"
    return rows, srv_ref, ""
