"""One rank's prepared tables, cached beside its Parquet event cache.

From the Parquet cache, reading a rank's events is the small part of an analysis: rebuilding the same
per-rank tables from millions of events costs more (on a 6.6 M-event rank: read 0.6 s, then the GPU op
table with classes and step windows 0.9 s, CPU thread busy 0.4 s, census 0.2 s). Those tables depend only on
the trace file, the rank number, the kernel rules, the step regex and the code that builds them, so they are
kept under a key made of all of these (the code as a hash of its source files: a changed rule or function
never reads a stale entry). A hit skips reading the event frame at all.

Layout: ``<event cache>.prepared/<key>/{ops,windows,runtime,cpu_threads,census}.parquet`` and ``meta.json``
(written last: an entry without it is incomplete and ignored). One entry per trace: writing a new key removes
the others. Every metric is still computed from these tables on each run.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from servelab.analyse.trace import metrics, ops, taxonomy, windows
from servelab.analyse.trace.load import RankTrace, cache_stamp
from servelab.analyse.trace.ops import RankOps
from servelab.analyse.trace.taxonomy import Rule

PREPARED_VERSION = 1
_TABLES = ("ops", "windows", "runtime", "cpu_threads", "census")


@dataclass
class Prepared:
    """A rank's op tables and the two tables that need its events (CPU thread busy, census); ``timeline``: its
    per-rank timeline tables when they were made where the rank was prepared (a cluster worker; never cached)."""
    rops: RankOps
    cpu_threads: pl.DataFrame
    census: pl.DataFrame | None
    timeline: dict[str, pl.DataFrame] | None = None


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    """A hash of the source files the prepared tables come from (read once per process)."""
    h = hashlib.sha256()
    for f in (ops.__file__, windows.__file__, taxonomy.__file__, metrics.__file__, __file__):
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def prepared_key(trace: RankTrace, rules: list[Rule], window_regex: str | None) -> str | None:
    """The cache key of ``trace``'s prepared tables, or None when the trace has no event cache."""
    if trace.cache_path is None:
        return None
    doc = {"v": PREPARED_VERSION, "stamp": cache_stamp(trace.path), "rank": trace.rank,
           "rules": [[r.cls, r.subclass, r.pattern, r.cat] for r in rules], "window_regex": window_regex,
           "code": _code_hash(), "polars": pl.__version__}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def _root(trace: RankTrace) -> Path:
    cp = Path(trace.cache_path)
    return cp.parent / f"{cp.name}.prepared"


def read_prepared(trace: RankTrace, key: str | None) -> Prepared | None:
    """The entry for ``key``, or None (no entry, an incomplete one, or an unreadable file: prepare again)."""
    if key is None:
        return None
    d = _root(trace) / key
    try:
        meta = json.loads((d / "meta.json").read_text())
        t = {name: pl.read_parquet(d / f"{name}.parquet") if name in meta["tables"] else None for name in _TABLES}
    except Exception:
        return None
    rops = RankOps(trace=trace, ops=t["ops"], windows=t["windows"], runtime=t["runtime"],
                   window_regex=meta["window_regex"], windows_found=meta["windows_found"],
                   device=meta.get("device", "gpu"))
    return Prepared(rops, t["cpu_threads"] if t["cpu_threads"] is not None else pl.DataFrame(), t["census"])


def write_prepared(trace: RankTrace, key: str | None, p: Prepared) -> bool:
    """Store ``p`` under ``key`` (atomically: a folder renamed into place) and remove the trace's other
    entries; False when it could not be written (the analysis goes on without)."""
    if key is None:
        return False
    root = _root(trace)
    tmp = root / f".{key}.tmp{os.getpid()}"
    frames = {"ops": p.rops.ops, "windows": p.rops.windows, "runtime": p.rops.runtime,
              "cpu_threads": p.cpu_threads, "census": p.census}
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        kept = []
        for name, df in frames.items():
            if df is not None and df.width:
                df.write_parquet(tmp / f"{name}.parquet", compression="lz4", statistics=False)
                kept.append(name)
        (tmp / "meta.json").write_text(json.dumps({"tables": kept, "window_regex": p.rops.window_regex,
                                                   "windows_found": p.rops.windows_found, "device": p.rops.device,
                                                   "version": PREPARED_VERSION}))
        shutil.rmtree(root / key, ignore_errors=True)
        os.replace(tmp, root / key)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    for other in root.iterdir():
        if other.name != key and not other.name.startswith("."):
            shutil.rmtree(other, ignore_errors=True)
    return True
