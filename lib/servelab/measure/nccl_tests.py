"""Run nccl-tests on a target's nodes: per node, across nodes through a launcher template, the one-variable NCCL
environment sweeps and the intra-node P2P matrix (``docs/method.md#comm-runs``).

The run plan is made and checked first, nothing started: every run is an argv list (never a shell string) with the
environment it adds, the node it runs on and what it measures —

- ``node``: ``<coll>_perf -b 8K -e 64M -f 2 -g <gpus>`` on each node alone (one process, all its GPUs);
- ``cross-node``: the same through the launcher *template* on the head (one rank per GPU, ``-g 1``); the template
  is a list whose elements may hold placeholders, substituted element by element::

      ["mpirun", "-np", "{nranks}", "-H", "{hosts}", "{env:-x}", "{cmd}"]

  ``{cmd}`` (a whole element) is replaced by the test's argv, ``{env:-x}`` (a whole element) by ``-x K=V`` for
  each variable the run sets, ``{env}`` by ``K=V`` items; without ``{cmd}`` the argv is appended. Other
  placeholders: ``nranks``, ``nnodes``, ``ppn`` (ranks per node), ``hosts`` (``h1:ppn,h2:ppn``), ``binary``, and
  any extra ``values``. An unknown placeholder is an error that names it;
- ``sweep``: each value of each swept variable (``NCCL_ALGO=Ring,Tree``, ``NCCL_PROTO=Simple,LL128``,
  ``NCCL_CROSS_NIC=0,1,2``) as a one-variable change against the baseline, ``repeats`` times each (the baseline
  too), per node and across nodes. ``NCCL_CROSS_NIC`` only across nodes: within one node there is no NET
  channel for it to act on;
- ``p2p``: per node, ``sendrecv_perf -g 2`` with ``CUDA_VISIBLE_DEVICES=i,j`` for every GPU pair ``i < j`` — the
  bandwidth and latency matrix between the node's GPUs;
- ``env-check``: per setting, one short ``NCCL_DEBUG=INFO`` run whose log must say ``<VAR> set by environment to
  <value>`` — a variable that never reached NCCL changes nothing and proves nothing. Debug runs: their numbers
  are never used.

Every run starts as a tracked process (:class:`servelab.deploy.hosts.ProcessTracker`: stopped on timeout,
failure, Ctrl-C and SIGTERM; swept at the next start if the controller was killed) writing its log into a private
folder on its node; the log is copied into ``<out>/logs/<run_id>.log`` and one line appended to
``<out>/runs.jsonl`` (argv, env, node, start, end, exit code) before the next run starts. Parsing is
``servelab.analyse.nccl``'s.

Shell entry for a GPU machine (the one-node plan on this host)::

    python -m servelab.measure.nccl_tests --bin-dir nccl-tests/build -g 8 --out /tmp/nccl [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import re
import string
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from servelab.core.params import did_you_mean
from servelab.core.run import is_secret_name, now_iso
from servelab.deploy.hosts import LocalHost, ProcessTracker
from servelab.deploy.spec import Node

COLLECTIVES = {
    "all_reduce": "all_reduce_perf",
    "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf",
    "alltoall": "alltoall_perf",
    "sendrecv": "sendrecv_perf",
}
DEFAULT_COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"]
DEFAULT_SWEEP = ["NCCL_ALGO=Ring,Tree", "NCCL_PROTO=Simple,LL128", "NCCL_CROSS_NIC=0,1,2"]
CROSS_NODE_ONLY = {"NCCL_CROSS_NIC"}          # acts on NET channels only: no meaning within one node
# the target's environment that nccl-tests gets (the engine's communication settings, nothing else: no secrets)
COMM_ENV_PREFIXES = ("NCCL_", "UCX_", "GLOO_", "NVSHMEM_")
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,NET,GRAPH,TUNING"}
SCOPES = ("node", "cross-node", "p2p", "env-check")
SIZE_RE = re.compile(r"^(\d+)([KMG]?)$")
VAR_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
RC_WRAPPER = 'rc="$1"; shift; "$@"; echo $? > "$rc"'     # the exit code of the test, written beside its log


class NcclPlanError(ValueError):
    """A plan that cannot run (one line saying what to change); raised before anything starts."""


def size_bytes(text: str | int) -> int:
    """nccl-tests' size syntax: ``8K`` = 8192, ``64M``, ``1G`` (powers of 1024) or plain bytes."""
    m = SIZE_RE.match(str(text).strip().upper())
    if not m:
        raise NcclPlanError(f"size '{text}' is not an nccl-tests size: use bytes or a number with K, M or G (8K, 64M)")
    return int(m[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m[2]]


def perf_argv(collective: str, bin_dir: str = "", gpus: int = 1, min_bytes: str = "8K", max_bytes: str = "64M",
              factor: int = 2, extra: list[str] | None = None) -> list[str]:
    """``[<bin_dir>/<coll>_perf, -b, 8K, -e, 64M, -f, 2, -g, <gpus>, *extra]``."""
    if collective not in COLLECTIVES:
        raise NcclPlanError(f"unknown collective '{collective}'{did_you_mean(collective, set(COLLECTIVES))}; "
                            f"known: {', '.join(COLLECTIVES)}")
    if gpus < 1 or factor < 2:
        raise NcclPlanError(f"gpus must be ≥ 1 and factor ≥ 2 (got gpus={gpus}, factor={factor})")
    binary = f"{bin_dir.rstrip('/')}/{COLLECTIVES[collective]}" if bin_dir else COLLECTIVES[collective]
    return [binary, "-b", str(min_bytes), "-e", str(max_bytes), "-f", str(factor), "-g", str(gpus), *(extra or [])]


def launch_argv(cmd: list[str], launcher: list[str] | None = None, nnodes: int = 1, ppn: int = 1,
                hosts: list[str] | None = None, values: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> list[str]:
    """Wrap a test argv in the launcher template (see module doc); no template → the argv itself."""
    if not launcher:
        return list(cmd)
    hosts = hosts or []
    subst = {"nranks": str(nnodes * ppn), "nnodes": str(nnodes), "ppn": str(ppn),
             "hosts": ",".join(f"{h}:{ppn}" for h in hosts), "binary": cmd[0],
             **{k: str(v) for k, v in (values or {}).items()}}
    out: list[str] = []
    spliced = False
    for element in launcher:
        element = str(element)
        if element == "{cmd}":
            out.extend(cmd)
            spliced = True
            continue
        if element == "{env}" or element.startswith("{env:"):
            flag = element[5:-1] if element.startswith("{env:") and element.endswith("}") else ""
            for k, v in (env or {}).items():
                out.extend([flag, f"{k}={v}"] if flag else [f"{k}={v}"])
            continue
        names = [f for _, f, _, _ in string.Formatter().parse(element) if f is not None]
        unknown = [n for n in names if n not in subst]
        if unknown:
            raise NcclPlanError(f"launcher element '{element}' uses unknown placeholder '{{{unknown[0]}}}'; known: "
                                f"{', '.join('{' + k + '}' for k in sorted(subst))}, {{cmd}}, {{env}}, {{env:-x}}")
        out.append(element.format_map(subst))
    return out if spliced else out + list(cmd)


@dataclass(frozen=True)
class Setting:
    """One side of a one-variable A/B: the baseline (no variable) or ``variable=value``."""
    variable: str = ""
    value: str = ""

    @property
    def name(self) -> str:
        return f"{self.variable}={self.value}" if self.variable else "baseline"

    @property
    def env(self) -> dict[str, str]:
        return {self.variable: self.value} if self.variable else {}


def parse_sweep(specs: Iterable[str] | dict[str, Any]) -> list[Setting]:
    """``["NCCL_ALGO=Ring,Tree", ...]`` or ``{"NCCL_ALGO": ["Ring", "Tree"], ...}`` → the settings, baseline
    first."""
    if isinstance(specs, dict):
        specs = [f"{k}=" + ",".join(str(x) for x in (v if isinstance(v, (list, tuple)) else str(v).split(",")))
                 for k, v in specs.items()]
    out = [Setting()]
    seen: set[str] = set()
    for spec in specs:
        var, sep, vals = str(spec).partition("=")
        var = var.strip()
        values = [v.strip() for v in vals.split(",") if v.strip()]
        if not sep or not VAR_RE.match(var) or not values:
            raise NcclPlanError(f"sweep entry '{spec}' must read VARIABLE=value1,value2 (e.g. NCCL_ALGO=Ring,Tree)")
        if var in seen:
            raise NcclPlanError(f"sweep variable {var} is listed twice; give all its values in one entry")
        seen.add(var)
        out += [Setting(var, v) for v in dict.fromkeys(values)]
    return out


@dataclass
class PlannedRun:
    """One nccl-tests invocation of the run plan."""
    run_id: str
    scope: str                 # node | cross-node | p2p | env-check
    node: str                  # where argv runs (the head for cross-node runs)
    nodes: list[str]           # the nodes it measures
    collective: str
    setting: str               # baseline | VAR=value
    variable: str
    value: str
    repeat: int
    ranks: int
    argv: list[str]
    env: dict[str, str]        # what it adds to the node's environment
    pair: str = ""             # p2p: "i,j" (CUDA_VISIBLE_DEVICES)
    timeout_s: float = 300.0

    def binaries(self, bin_dir: str) -> list[str]:
        return [a for a in self.argv if bin_dir and a.startswith(bin_dir.rstrip("/") + "/")]


@dataclass
class NcclPlan:
    """Every run, in order, and the scopes left out with the reason."""
    runs: list[PlannedRun]
    bin_dir: str
    skipped: list[str] = field(default_factory=list)
    settings: list[Setting] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        return [{"run_id": r.run_id, "scope": r.scope, "node": r.node, "collective": r.collective, "setting": r.setting,
                 "repeat": r.repeat, "ranks": r.ranks, "pair": r.pair, "argv": r.argv, "env": r.env} for r in self.runs]


def comm_env(env: dict[str, str] | None) -> dict[str, str]:
    """The target's communication variables (``NCCL_*``, ``UCX_*``, ``GLOO_*``, ``NVSHMEM_*``) — the settings the
    engine runs with — and nothing else: never one whose name says secret (a launcher puts them in its argv)."""
    return {k: str(v) for k, v in (env or {}).items() if k.startswith(COMM_ENV_PREFIXES) and not is_secret_name(k)}


@dataclass(frozen=True)
class PlanSettings:
    """What to run, named as Phase 5's parameters name it: the collectives at the default setting, the sweep
    (``NCCL_ALGO=Ring``-style entries or ``{variable: [values]}``) over ``sweep_collectives``, ``repeats`` of each,
    the size range and step factor, the GPUs per node (0: each node's own), the launcher of cross-node runs and its
    ranks per node, which scopes (per node, cross-node, the GPU-pair matrix), the env check and each run's
    timeout. ``None`` collectives / sweep / sweep collectives: the defaults."""
    collectives: list[str] | None = None
    sweep: list[str] | dict[str, Any] | None = None
    sweep_collectives: list[str] | None = None
    repeats: int = 2
    min_bytes: str = "8K"
    max_bytes: str = "64M"
    step_factor: int = 2
    gpus: int = 0
    launcher: list[str] = field(default_factory=list)
    ppn: int = 0
    per_node: bool = True
    cross_node: bool = True
    p2p_matrix: bool = True
    env_check: bool = True
    run_timeout_s: float = 300.0


def plan_runs(nodes: list[Any], bin_dir: str, settings: PlanSettings | None = None, env: dict[str, str] | None = None,
              values: dict[str, Any] | None = None, gpus_default: int = 0) -> NcclPlan:
    """The whole plan of ``settings`` for ``nodes`` (``servelab.deploy.spec.Node``: ``name``, ``host``, ``role``,
    ``gpus``), checked as a whole; :class:`NcclPlanError` names the first problem. ``gpus_default`` is used for a
    node that declares none (planning only); ``env`` is the target's (only its communication variables are passed
    on)."""
    s = settings or PlanSettings()
    collectives, sweep, sweep_collectives, repeats = s.collectives, s.sweep, s.sweep_collectives, s.repeats
    min_bytes, max_bytes, factor, gpus, launcher, ppn = s.min_bytes, s.max_bytes, s.step_factor, s.gpus, s.launcher, s.ppn
    per_node, cross_node, p2p, env_check, timeout_s = s.per_node, s.cross_node, s.p2p_matrix, s.env_check, s.run_timeout_s
    if not bin_dir or not str(bin_dir).strip():
        raise NcclPlanError("no nccl-tests folder given: set nccl_tests_bin to the folder holding all_reduce_perf & co "
                            "on every node")
    if not nodes:
        raise NcclPlanError("the target has no nodes")
    if repeats < 1:
        raise NcclPlanError(f"repeats must be ≥ 1, got {repeats}")
    lo, hi = size_bytes(min_bytes), size_bytes(max_bytes)
    if hi < lo:
        raise NcclPlanError(f"max_bytes {max_bytes} is below min_bytes {min_bytes}")
    colls = list(collectives if collectives is not None else DEFAULT_COLLECTIVES)
    swept = list(sweep_collectives if sweep_collectives is not None else ["all_reduce"])
    for c in [*colls, *swept]:
        perf_argv(c)                                   # unknown name → one line
    settings = parse_sweep(sweep if sweep is not None else DEFAULT_SWEEP)
    base_env = comm_env(env)
    head = next((n for n in nodes if getattr(n, "role", "") == "head"), nodes[0])
    ngpu: dict[str, int] = {}
    for n in nodes:
        g = int(gpus or getattr(n, "gpus", 0) or gpus_default)
        if g < 1:
            raise NcclPlanError(f"node {n.name} declares no GPUs: set gpus: N on it in the target, or -p gpus=N")
        ngpu[n.name] = g
    args = dict(min_bytes=str(min_bytes), max_bytes=str(max_bytes), factor=int(factor))
    runs: list[PlannedRun] = []
    skipped: list[str] = []

    def add(scope: str, node: str, covered: list[str], coll: str, s: Setting, rep: int, ranks: int, argv: list[str],
            extra_env: dict[str, str], pair: str = "") -> None:
        rid = "-".join(x for x in (scope, node if scope != "cross-node" else "", coll,
                                   s.name.replace("=", "_"), f"gpus{pair.replace(',', '_')}" if pair else "",
                                   f"r{rep}") if x)
        runs.append(PlannedRun(re.sub(r"[^A-Za-z0-9_.-]+", "-", rid), scope, node, covered, coll, s.name, s.variable,
                               s.value, rep, ranks, argv, {**base_env, **extra_env}, pair, float(timeout_s)))

    def block(scope: str, node: str, covered: list[str], ranks: int, argv_for: Callable[[str, list[str], dict], list[str]],
              node_settings: list[Setting]) -> None:
        for rep in range(1, repeats + 1):
            for coll in colls:
                add(scope, node, covered, coll, Setting(), rep, ranks, argv_for(coll, [], {}), {})
            for s in node_settings[1:]:
                for coll in swept:
                    add(scope, node, covered, coll, s, rep, ranks, argv_for(coll, [], s.env), s.env)

    local_settings = [s for s in settings if s.variable not in CROSS_NODE_ONLY]
    if per_node:
        for n in nodes:
            block("node", n.name, [n.name], ngpu[n.name],
                  lambda c, extra, e, n=n: perf_argv(c, bin_dir, ngpu[n.name], extra=extra, **args), local_settings)
        if len(local_settings) < len(settings):
            skipped.append(f"{', '.join(sorted(CROSS_NODE_ONLY))} not swept within a node: it acts on NET channels, "
                           "which a single node does not use")
    if cross_node and len(nodes) > 1:
        if not launcher:
            skipped.append("cross-node runs: no launcher template given (e.g. launcher: [mpirun, -np, '{nranks}', -H, "
                           "'{hosts}', '{env:-x}', '{cmd}']); nccl-tests needs one process per rank across nodes")
        else:
            per = int(ppn or min(ngpu.values()))
            hosts = [n.host for n in nodes]
            block("cross-node", head.name, [n.name for n in nodes], per * len(nodes),
                  lambda c, extra, e: launch_argv(perf_argv(c, bin_dir, 1, extra=extra, **args), launcher, len(nodes),
                                                  per, hosts, values, env={**base_env, **e}), settings)
    elif cross_node:
        skipped.append("cross-node runs: the target has one node")
    if p2p:
        for n in nodes:
            if ngpu[n.name] < 2:
                skipped.append(f"P2P matrix of {n.name}: one GPU, no pair")
                continue
            for i in range(ngpu[n.name]):
                for j in range(i + 1, ngpu[n.name]):
                    add("p2p", n.name, [n.name], "sendrecv", Setting(), 1, 2,
                        perf_argv("sendrecv", bin_dir, 2, **args), {"CUDA_VISIBLE_DEVICES": f"{i},{j}"}, pair=f"{i},{j}")
    if env_check:
        for s in settings[1:]:
            where = [n for n in nodes if s.variable not in CROSS_NODE_ONLY] if per_node else []
            if s.variable in CROSS_NODE_ONLY or not where:
                if cross_node and len(nodes) > 1 and launcher:
                    per = int(ppn or min(ngpu.values()))
                    argv = launch_argv(perf_argv(swept[0] if swept else "all_reduce", bin_dir, 1, "8K", "8K", 2,
                                                 extra=["-n", "1", "-w", "1"]), launcher, len(nodes), per,
                                       [n.host for n in nodes], values, env={**base_env, **s.env, **DEBUG_ENV})
                    add("env-check", head.name, [n.name for n in nodes], swept[0] if swept else "all_reduce", s, 1,
                        per * len(nodes), argv, {**s.env, **DEBUG_ENV})
                continue
            for n in where:
                add("env-check", n.name, [n.name], swept[0] if swept else "all_reduce", s, 1, ngpu[n.name],
                    perf_argv(swept[0] if swept else "all_reduce", bin_dir, ngpu[n.name], "8K", "8K", 2,
                              extra=["-n", "1", "-w", "1"]), {**s.env, **DEBUG_ENV})
    if not runs:
        raise NcclPlanError("nothing to run: every scope is switched off or impossible here (" + "; ".join(skipped) + ")")
    ids = [r.run_id for r in runs]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup:
        raise NcclPlanError(f"two runs would share the id {dup}: node names must differ")
    return NcclPlan(runs, str(bin_dir), skipped, settings)


def check_plan(plan: NcclPlan, hosts: dict[str, Any], launcher: list[str] | None = None) -> list[str]:
    """Before anything runs: every binary the run plan uses is an executable file on every node it runs on (a
    cross-node run's on every node it covers), and the launcher is found on the head. One line per problem."""
    need: dict[str, set[str]] = {}
    for r in plan.runs:
        for node in (r.nodes if r.scope in ("cross-node", "env-check") else [r.node]):
            need.setdefault(node, set()).update(r.binaries(plan.bin_dir))
    problems = []
    for node, paths in need.items():
        if node not in hosts:
            problems.append(f"node {node}: not connected")
            continue
        res = hosts[node].run(["sh", "-c", 'for f; do [ -f "$f" ] && [ -x "$f" ] || echo "$f"; done', "check",
                               *sorted(paths)], timeout=60)
        missing = [x for x in res.stdout.split("\n") if x.strip()]
        if res.exit_code != 0:
            problems.append(f"node {node}: cannot check the nccl-tests binaries: {(res.stderr or res.stdout).strip()[:200]}")
        elif missing:
            problems.append(f"node {node}: {missing[0]} is not an executable file"
                            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + " — build nccl-tests there, or point nccl_tests_bin at its build folder")
    cross = [r for r in plan.runs if r.scope == "cross-node"]
    if cross and launcher:
        head = cross[0].node
        if head in hosts:
            res = hosts[head].run(["sh", "-c", 'command -v "$1"', "which", str(launcher[0])], timeout=60)
            if res.exit_code != 0:
                problems.append(f"node {head}: launcher '{launcher[0]}' not found on the head node")
    return problems


@dataclass
class RunResult:
    """What one planned run did: its exit code, times and the log copied back."""
    run: PlannedRun
    exit_code: int
    start: str
    end: str
    seconds: float
    log: str                  # relative to the output folder
    note: str = ""

    def record(self) -> dict[str, Any]:
        return {**asdict(self.run), "exit_code": self.exit_code, "start": self.start, "end": self.end,
                "seconds": round(self.seconds, 3), "log": self.log, "note": self.note}


def execute(plan: NcclPlan, hosts: dict[str, Any], out_dir: Path, tracker: Any, workdirs: dict[str, str] | None = None,
            on_result: Callable[[RunResult], None] | None = None,
            progress: Callable[[int, int, PlannedRun], None] | None = None, poll_s: float = 0.2) -> list[RunResult]:
    """Run the run plan in order, one run at a time. Each run is started through ``tracker`` on its node (its own
    process group, its log in a private folder there), stopped at its ``timeout_s``; its log is copied to
    ``out_dir/logs/<run_id>.log`` and its record appended to ``out_dir/runs.jsonl`` before the next starts. The
    private folders are removed at the end (or by the tracker's exit on Ctrl-C)."""
    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    private: dict[str, str] = {}
    results: list[RunResult] = []
    for k, r in enumerate(plan.runs):
        if progress:
            progress(k, len(plan.runs), r)
        host = hosts[r.node]
        if r.node not in private:
            private[r.node] = host.private_dir((workdirs or {}).get(r.node, ""))
            tracker.on_exit(f"nccl-tests folder on {r.node}",
                            lambda h=host, p=private[r.node]: h.remove_private_dir(p))
        log_remote, rc_remote = f"{private[r.node]}/{r.run_id}.log", f"{private[r.node]}/{r.run_id}.rc"
        start, t0, note = now_iso(), time.monotonic(), ""
        h = tracker.start(host, ["sh", "-c", RC_WRAPPER, "servelab-nccl-tests", rc_remote, *r.argv], log_remote,
                          env=r.env, what=f"nccl-tests {r.run_id}")
        while host.is_running(h):
            if time.monotonic() - t0 > r.timeout_s:
                note = f"stopped after its timeout of {r.timeout_s:g} s"
                break
            time.sleep(poll_s)
        tracker.stop(h)
        seconds = time.monotonic() - t0
        try:
            text = host.read_file(log_remote).decode("utf-8", "replace")
        except Exception as exc:  # noqa: BLE001 - the log is gone or unreadable: recorded, the run counts as failed
            text, note = "", (note + "; " if note else "") + f"log not readable: {exc}"
        try:
            code = int(host.read_file(rc_remote).decode().strip())
        except Exception:  # noqa: BLE001 - no exit code: stopped, or the wrapper never finished
            code = 124 if note.startswith("stopped") else 1
        log = Path("logs") / f"{r.run_id}.log"
        (out_dir / log).write_text(text)
        res = RunResult(r, code, start, now_iso(), seconds, str(log), note)
        with open(out_dir / "runs.jsonl", "a") as f:
            f.write(json.dumps(res.record()) + "\n")
        results.append(res)
        if on_result:
            on_result(res)
    for node in private:
        tracker.run_cleanup(f"nccl-tests folder on {node}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m servelab.measure.nccl_tests", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("-g", "--gpus", type=int, required=True)
    ap.add_argument("-b", "--min-bytes", default="8K")
    ap.add_argument("-e", "--max-bytes", default="64M")
    ap.add_argument("-f", "--factor", type=int, default=2)
    ap.add_argument("--collectives", default=",".join(DEFAULT_COLLECTIVES))
    ap.add_argument("--sweep-collectives", default="all_reduce")
    ap.add_argument("--sweep", action="append", help="VAR=v1,v2 (repeatable; default: " + " ".join(DEFAULT_SWEEP) + ")")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-p2p", action="store_true")
    ap.add_argument("--no-env-check", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    node = Node(name="local", kind="local", gpus=a.gpus)
    try:
        plan = plan_runs([node], str(Path(a.bin_dir).resolve()), PlanSettings(
            collectives=a.collectives.split(","), sweep=a.sweep if a.sweep is not None else DEFAULT_SWEEP,
            sweep_collectives=[c for c in a.sweep_collectives.split(",") if c], repeats=a.repeats,
            min_bytes=a.min_bytes, max_bytes=a.max_bytes, step_factor=a.factor, p2p_matrix=not a.no_p2p,
            env_check=not a.no_env_check, run_timeout_s=a.timeout))
        host = LocalHost()
        problems = check_plan(plan, {"local": host})
        if problems:
            raise NcclPlanError(problems[0])
    except NcclPlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "plan.json").write_text(json.dumps({"bin_dir": plan.bin_dir, "skipped": plan.skipped,
                                                 "runs": plan.rows()}, indent=1))
    with ProcessTracker() as tracker:
        res = execute(plan, {"local": host}, a.out, tracker,
                      on_result=lambda r: print(f"{r.run.run_id}: exit {r.exit_code} in {r.seconds:.1f} s", flush=True))
    return 0 if all(r.exit_code == 0 for r in res) else 1


if __name__ == "__main__":
    raise SystemExit(main())
