"""The communication ceiling of an engine that runs on CPU: torch's gloo all-reduce and all-gather swept over
message sizes, the CPU counterpart of nccl-tests (docs/metrics.md#gloo-sweep).

One process per rank runs ``servelab/data/gloo_perf.py`` under the engine's own interpreter (the one with torch),
on this machine, through a :class:`~servelab.deploy.hosts.ProcessTracker` (stopped on success, failure, Ctrl-C);
the ranks meet on 127.0.0.1 and gloo's traffic stays on loopback. :func:`run_sweep` returns the rows in the
shape of nccl-tests' parsed curves (``analyse.nccl.perf_log.runs_frame``: collective, size_bytes, time_us,
algbw_gbps, busbw_gbps, placement ``out-of-place``), so the same placement (``msgsize.place_on_curves``) and the
same engine-vs-ceiling join (``analyse.ceiling``) read them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from servelab.deploy.hosts import LocalHost, ProcessTracker, free_port

COLLECTIVES = ("all_reduce", "all_gather")
LABEL = "gloo sweep (servelab data/gloo_perf.py)"
SCRIPT = Path(__file__).resolve().parents[1] / "data" / "gloo_perf.py"


class GlooSweepError(RuntimeError):
    """A rank failed or the sweep ran past its time (the message names the rank and its log)."""


@dataclass
class GlooSweep:
    """What ran and what it measured."""
    argv: list[list[str]]               # one command per rank
    env: dict[str, str]
    logs: list[Path]
    rows: pd.DataFrame = field(default_factory=pd.DataFrame)
    wall_s: float = 0.0
    exit_codes: list[int | None] = field(default_factory=list)


def sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """nccl-tests' ``-b min -e max -f factor`` sizes."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"gloo sweep sizes: need 1 <= min ({min_bytes}) <= max ({max_bytes}) and factor >= 2")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def plan(python: str, world: int, size_list: list[int], out_dir: Path, collectives: tuple[str, ...] = COLLECTIVES,
         iters: int = 20, warmup: int = 5) -> GlooSweep:
    """The commands (one per rank) and their environment; nothing starts."""
    if world < 2:
        raise ValueError(f"a gloo sweep needs at least 2 ranks (got {world})")
    bad = [c for c in collectives if c not in COLLECTIVES]
    if bad:
        raise ValueError(f"gloo sweep: unknown collective {bad[0]!r}; known: {', '.join(COLLECTIVES)}")
    script = str(SCRIPT)
    out_dir = Path(out_dir)
    common = ["--world", str(world), "--sizes", ",".join(map(str, size_list)), "--collectives",
              ",".join(collectives), "--iters", str(iters), "--warmup", str(warmup),
              "--out", str(out_dir / "gloo_sweep.jsonl")]
    argv = [[python, script, "--rank", str(r), *common] for r in range(world)]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return GlooSweep(argv, env, [out_dir / "logs" / f"rank{r}.log" for r in range(world)])


def run_sweep(sw: GlooSweep, tracker: ProcessTracker, timeout_s: float = 300.0) -> GlooSweep:
    """Start every rank (a free loopback port for their rendezvous), wait for all of them, read rank 0's rows.
    A rank that exits non-zero or a sweep past ``timeout_s`` stops every rank and raises
    :class:`GlooSweepError` naming the rank and the last line of its log."""
    host = LocalHost()
    sw.env = {**sw.env, "MASTER_PORT": str(free_port("127.0.0.1"))}
    out = Path(sw.argv[0][sw.argv[0].index("--out") + 1])
    out.unlink(missing_ok=True)
    t0 = time.monotonic()
    handles = [tracker.start(host, argv, log, env=sw.env, what=f"gloo sweep rank {r}")
               for r, (argv, log) in enumerate(zip(sw.argv, sw.logs))]
    try:
        while any(h.popen.poll() is None for h in handles):
            failed = [(r, h) for r, h in enumerate(handles) if h.popen.poll() not in (None, 0)]
            if failed or time.monotonic() - t0 > timeout_s:
                r, h = failed[0] if failed else (0, handles[0])
                why = f"exited with {h.popen.returncode}" if failed else f"still running after {timeout_s:.0f} s"
                raise GlooSweepError(f"gloo sweep rank {r} {why}: {_last_line(sw.logs[r])} (log {sw.logs[r]})")
            time.sleep(0.1)
        for r, h in enumerate(handles):
            if h.popen.returncode != 0:
                raise GlooSweepError(f"gloo sweep rank {r} exited with {h.popen.returncode}: "
                                     f"{_last_line(sw.logs[r])} (log {sw.logs[r]})")
    finally:
        for h in handles:
            tracker.stop(h)
        sw.exit_codes = [h.popen.returncode for h in handles]
    sw.wall_s = round(time.monotonic() - t0, 2)
    sw.rows = read_rows(out)
    return sw


def read_rows(path: Path) -> pd.DataFrame:
    """Rank 0's JSON lines as curve rows (``placement`` out-of-place, ``status`` ok / wrong results, ``label``)."""
    recs = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()] if Path(path).is_file() else []
    if not recs:
        raise GlooSweepError(f"the gloo sweep wrote no result ({path})")
    df = pd.DataFrame(recs)
    df["placement"] = "out-of-place"
    df["status"] = ["ok" if w == 0 else "wrong results" for w in df["wrong"]]
    df["label"] = LABEL
    return df


def _last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "empty log"
