"""Run nccl-tests (``all_reduce_perf`` …) on a host, single-node or through the user's launcher.

The sweep of ``docs/method.md#comm``: ``<coll>_perf -b 8K -e 64M -f 2 -g N`` for all-reduce, all-gather, reduce-scatter, and
all-to-all when EP is used; sendrecv for point-to-point. Multi-node runs go through a launcher
*template* — a list whose elements may hold placeholders, substituted element by element (never a
shell string)::

    ["mpirun", "-np", "{nranks}", "-H", "{hosts}", "-x", "NCCL_DEBUG", "{cmd}"]

``{cmd}`` (a whole element) is replaced by the test's argv; without it the argv is appended.
Placeholders: ``nranks``, ``nnodes``, ``ppn`` (processes per node), ``hosts`` (``h1:ppn,h2:ppn``),
``binary``, and any extra ``values`` given. An unknown placeholder is an error that names it.
"""
from __future__ import annotations

import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from servelab.analyse.nccl.perf_log import NcclTestRun, parse_run
from servelab.core.params import did_you_mean

COLLECTIVES = {
    "all_reduce": "all_reduce_perf",
    "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf",
    "alltoall": "alltoall_perf",
    "sendrecv": "sendrecv_perf",
}
DEFAULT_COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"]
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH,TUNING"}


def perf_argv(collective: str, bin_dir: str = "", gpus: int = 1, min_bytes: str = "8K", max_bytes: str = "64M",
              factor: int = 2, extra: list[str] | None = None) -> list[str]:
    """``[<bin_dir>/<coll>_perf, -b, 8K, -e, 64M, -f, 2, -g, <gpus>, *extra]``."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective '{collective}'{did_you_mean(collective, set(COLLECTIVES))}; "
                         f"known: {', '.join(COLLECTIVES)}")
    if gpus < 1 or factor < 2:
        raise ValueError(f"gpus must be ≥ 1 and factor ≥ 2 (got gpus={gpus}, factor={factor})")
    binary = str(Path(bin_dir) / COLLECTIVES[collective]) if bin_dir else COLLECTIVES[collective]
    return [binary, "-b", str(min_bytes), "-e", str(max_bytes), "-f", str(factor), "-g", str(gpus), *(extra or [])]


def launch_argv(cmd: list[str], launcher: list[str] | None = None, nnodes: int = 1, ppn: int = 1,
                hosts: list[str] | None = None, values: dict[str, Any] | None = None) -> list[str]:
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
        names = [f for _, f, _, _ in string.Formatter().parse(element) if f is not None]
        unknown = [n for n in names if n not in subst]
        if unknown:
            raise ValueError(f"launcher element '{element}' uses unknown placeholder '{{{unknown[0]}}}'; "
                             f"known: {', '.join('{' + k + '}' for k in sorted(subst))}, {{cmd}}")
        out.append(element.format_map(subst))
    return out if spliced else out + list(cmd)


@dataclass
class PerfResult:
    """One executed nccl-tests command: what ran, where its output is, and the parsed run."""
    collective: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    exit_code: int
    start_ns: int
    end_ns: int
    run: NcclTestRun
    debug: bool = False
    notes: list[str] = field(default_factory=list)


def run_tests(host: Any, out_dir: Path, collectives: list[str] | None = None, bin_dir: str = "", gpus: int = 1,
              min_bytes: str = "8K", max_bytes: str = "64M", factor: int = 2, extra: list[str] | None = None,
              launcher: list[str] | None = None, nnodes: int = 1, ppn: int = 1, hosts: list[str] | None = None,
              env: dict[str, str] | None = None, debug: bool = False, timeout_s: float = 600,
              record: Callable[[PerfResult], None] | None = None) -> list[PerfResult]:
    """Run each collective on ``host`` (``host.run(argv, env=, timeout=)``), save ``<coll>.log`` under
    ``out_dir`` and parse it. ``debug=True`` adds ``NCCL_DEBUG=INFO`` (its numbers are not for
    performance claims: INFO logging stays out of formal results, ``docs/method.md#profiled-runs``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_env = {**(env or {}), **(DEBUG_ENV if debug else {})}
    results = []
    for coll in collectives or DEFAULT_COLLECTIVES:
        argv = launch_argv(perf_argv(coll, bin_dir, gpus, min_bytes, max_bytes, factor, extra), launcher, nnodes, ppn,
                           hosts)
        start = time.time_ns()
        try:
            res = host.run(argv, env=run_env or None, timeout=timeout_s)
            code = int(getattr(res, "exit_code", getattr(res, "returncode", 1)))
            text = _text(getattr(res, "stdout", "")) + _text(getattr(res, "stderr", ""))
        except FileNotFoundError as exc:
            code, text = 127, f"Test failure: {argv[0]} not found ({exc})\n"
        except Exception as exc:  # noqa: BLE001 - timeouts and transport errors are recorded, not raised
            code, text = 124 if "timeout" in type(exc).__name__.lower() else 1, f"Test failure: {type(exc).__name__}: {exc}\n"
        end = time.time_ns()
        log = out_dir / f"{coll}{'_info' if debug else ''}.log"
        log.write_text(text)
        r = PerfResult(coll, argv, run_env, log, code, start, end, parse_run(text, coll, code, str(log)), debug)
        results.append(r)
        if record:
            record(r)
    return results


def _text(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else (x or "")
