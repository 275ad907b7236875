"""Load a trace or a whole capture: Kineto JSON(.gz) per rank → one columnar polars frame
(:mod:`servelab.analyse.trace.decode`, in parallel for big files: :mod:`servelab.analyse.trace.chunked`), cached as
zstd Parquet beside the trace (or under the user cache), invalidated by the file's size and mtime and the parser
version; a capture folder's trace files found, identified (:mod:`servelab.analyse.trace.identity`) and loaded, rank
by rank or several at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

try:  # ISA-L gunzip is ~1.6x faster than zlib (measured); zlib is the fallback
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover - isal is a declared dependency of the trace analyser
    import gzip as _gzip

from servelab.analyse.trace import chunked
from servelab.analyse.trace.decode import PARSER_VERSION, TraceFormatError, _SCHEMA
from servelab.analyse.trace.identity import RankIdentity, TRACE_SUFFIXES, _apply_distributed_info, identity_from_name
from servelab.core.paths import cache_root
from servelab.deploy.engines import engine_for, trace_name_hints, trace_skip_dirs

CACHE_DIRNAME = ".servelab_cache"


@dataclass
class RankTrace:
    """One rank's parsed trace: the event frame, the file's metadata and who wrote it.

    ``frame`` is the event frame in memory; ``None`` while it has not been read (a Parquet cache hit loaded
    with ``events=False``: the analysis found the rank's prepared tables in the cache and needs no events).
    :attr:`events` reads it then, so a caller always gets the full frame. ``n_events`` / ``n_kernels`` are set
    while the frame is not in memory (not read yet, or released by a streaming analysis)."""
    path: Path
    identity: RankIdentity
    frame: pl.DataFrame | None
    meta: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0
    from_cache: bool = False
    cache_path: Path | None = None
    n_events: int | None = None          # set while the event frame is not in memory
    n_kernels: int | None = None

    @property
    def events(self) -> pl.DataFrame:
        """The event frame (read from the Parquet cache on first use when it was not read at load; an empty
        frame once released)."""
        if self.frame is None:
            self.frame = self.reload_events()
            self.n_events = self.n_kernels = None
        return self.frame

    def release_events(self) -> None:
        """Drop the event frame (keeping its row and kernel counts): multi-rank analysis streams rank by rank
        and keeps only the per-rank tables; :meth:`reload_events` reads it back from the Parquet cache."""
        if self.n_events is None:
            ev = self.events
            self.n_events = ev.height
            self.n_kernels = int((ev["cat"] == "kernel").sum())
        self.frame = self.frame.clear() if self.frame is not None else _empty_events()

    def reload_events(self, columns: list[str] | None = None) -> pl.DataFrame:
        """The event frame (only ``columns`` when given): in memory, else from the Parquet cache, else parsed."""
        if self.n_events is None and self.frame is not None:
            return self.frame if columns is None else self.frame.select(columns)
        if self.cache_path is not None and Path(self.cache_path).exists():
            return pl.read_parquet(self.cache_path, columns=columns)
        frame = chunked.parse_trace(self.path)[0]
        return frame if columns is None else frame.select(columns)

    @property
    def rank(self) -> int:
        return self.identity.rank if self.identity.rank is not None else -1

    @property
    def label(self) -> str:
        return self.identity.label


def _empty_events() -> pl.DataFrame:
    return pl.DataFrame(schema=_SCHEMA)


def cache_path_for(path: Path, cache_dir: Path | None = None) -> Path:
    """``<trace dir>/.servelab_cache/<file>.v<N>.parquet``, or under ``cache_dir`` / the user cache when the
    trace folder is read-only (e.g. a shared data folder)."""
    name = f"{path.name}.v{PARSER_VERSION}.parquet"
    if cache_dir is not None:
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        return Path(cache_dir) / f"{digest}-{name}"
    local = path.parent / CACHE_DIRNAME
    if _writable(path.parent) and (not local.exists() or _writable(local)):
        return local / name
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    return cache_root() / "traces" / f"{digest}-{name}"


def _writable(d: Path) -> bool:
    """Writable for us *and* not marked read-only by its mode bits (root ignores the bits, we do not: a
    ``r-x`` shared data folder must stay untouched)."""
    try:
        return os.access(d, os.W_OK) and bool(d.stat().st_mode & 0o222)
    except OSError:
        return False


def cache_stamp(path: Path) -> dict[str, str]:
    """What makes a Parquet cache file valid for a trace: its size, mtime and the parser version."""
    st = path.stat()
    return {"size": str(st.st_size), "mtime_ns": str(st.st_mtime_ns), "parser": str(PARSER_VERSION)}


def _read_cache(cpath: Path, stamp: dict[str, str], events: bool = True
                ) -> tuple[pl.DataFrame | None, dict, int, int | None] | None:
    """(frame, trace metadata, events, kernels) from a valid cache file, else None. ``events=False`` reads the
    file's footer only (frame None; kernels None when an older cache did not record them)."""
    try:
        pmd = pq.read_metadata(cpath)
        md = pmd.metadata or {}
        if any(md.get(f"servelab.{k}".encode()) != v.encode() for k, v in stamp.items()):
            return None
        meta = json.loads(md[b"servelab.meta"])
        kernels = int(md[b"servelab.kernels"]) if b"servelab.kernels" in md else None
        if not events:
            return None, meta, pmd.num_rows, kernels
        return pl.read_parquet(cpath), meta, pmd.num_rows, kernels    # polars' reader: ~3× faster than pyarrow
    except Exception:  # stale/corrupt cache → parse the trace again
        return None


def _write_cache(cpath: Path, frame: pl.DataFrame, meta: dict, stamp: dict[str, str]) -> bool:
    """The frame as Parquet (zstd) with the stamp, the trace metadata and the kernel count in the file's
    key-value metadata; written to a temporary name and renamed. Polars' writer: 1.4 s for 6.6 M events where
    pyarrow's took 2.4 s (on this critical path of every cold load)."""
    try:
        cpath.parent.mkdir(parents=True, exist_ok=True)
        md = {f"servelab.{k}": v for k, v in stamp.items()}
        md["servelab.meta"] = json.dumps(meta, default=str)
        md["servelab.kernels"] = str(int((frame["cat"] == "kernel").sum()))    # not a stamp key
        tmp = cpath.with_suffix(f".tmp{os.getpid()}")
        try:
            frame.write_parquet(tmp, compression="zstd", statistics=False, metadata=md)
            os.replace(tmp, cpath)
        finally:
            tmp.unlink(missing_ok=True)
        return True
    except (OSError, pl.exceptions.PolarsError):
        return False


def load_trace(path: str | Path, *, cache: bool = True, cache_dir: str | Path | None = None,
               node: str | None = None, workers: int | None = None, executor=None,
               events: bool = True) -> RankTrace:
    """Load one rank's trace (Parquet cache hit when size+mtime+parser version match).

    The cache lives in ``.servelab_cache/`` next to the trace, or in ``cache_dir`` / the user cache
    directory when the trace folder is not writable. ``events=False``: on a cache hit the event frame is not
    read now (:attr:`RankTrace.events` reads it on first use); a parsed trace always keeps its frame.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"{path}: no such trace file")
    t0 = time.perf_counter()
    stamp = cache_stamp(path)
    cpath = cache_path_for(path, Path(cache_dir) if cache_dir else None) if cache else None
    hit = _read_cache(cpath, stamp, events) if cpath is not None and cpath.exists() else None
    n_events = n_kernels = None
    if hit is not None:
        frame, meta, rows, kernels = hit
        from_cache = True
        if frame is None:
            n_events = rows
            n_kernels = kernels if kernels is not None else \
                int((pl.read_parquet(cpath, columns=["cat"])["cat"] == "kernel").sum())
    else:
        frame, meta = chunked.parse_trace(path, workers=workers, executor=executor)
        from_cache = False
        if cpath is not None and not _write_cache(cpath, frame, meta, stamp):
            cpath = None
    ident = _apply_distributed_info(identity_from_name(path), meta.get("distributedInfo"))
    if node:
        ident.node = node
    return RankTrace(path=path, identity=ident, frame=frame, meta=meta, load_s=time.perf_counter() - t0,
                     from_cache=from_cache, cache_path=cpath, n_events=n_events, n_kernels=n_kernels)


SKIP_DIRS = (CACHE_DIRNAME, *trace_skip_dirs())   # our cache; engines' folders of non-serving traces


_TRACE_NAME_RE = re.compile("|".join((r"\.trace\.json", r"rank\d+", *trace_name_hints())), re.IGNORECASE)


def looks_like_trace(path: Path, peek_bytes: int = 1 << 20) -> bool:
    """Whether a ``*.json(.gz)`` file is a trace: a trace-like name, or ``"traceEvents"`` / a leading ``[`` in
    its first MiB. Other JSON files in a capture folder (``capture.json``, ``summary.json``) are set aside."""
    if _TRACE_NAME_RE.search(path.name):
        return True
    try:
        if path.name.endswith(".gz"):
            with _gzip.open(path, "rb") as f:
                head = f.read(peek_bytes)
        else:
            with open(path, "rb") as f:
                head = f.read(peek_bytes)
    except Exception:
        return True      # unreadable: let the loader report it with the file name
    return b'"traceEvents"' in head or head.lstrip()[:1] == b"["


def find_trace_files(trace_dir: str | Path) -> list[Path]:
    """Trace files under ``trace_dir`` (recursive): ``*.json`` / ``*.json.gz``, outside ``SKIP_DIRS`` (our cache
    folder and the engines' folders of capture-time traces, e.g. SGLang's ``graph_capture_profile/``)."""
    root = Path(trace_dir)
    if not root.is_dir():
        raise TraceFormatError(f"{root}: trace folder does not exist")
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).parts
        if not p.is_file() or any(d in rel[:-1] for d in SKIP_DIRS) or p.name.startswith("."):
            continue
        if p.name.endswith(TRACE_SUFFIXES):
            out.append(p)
    return out


def _cached(path: Path, cache: bool, cache_dir: str | Path | None) -> bool:
    if not cache:
        return False
    cpath = cache_path_for(path, Path(cache_dir) if cache_dir else None)
    return cpath.exists() and _read_cache(cpath, cache_stamp(path), events=False) is not None


def _load_one(path: Path, cache: bool, cache_dir: str | Path | None, node: str, events: bool = True) -> RankTrace:
    """Worker: parse one rank single-process (the pool already uses the CPUs)."""
    return load_trace(path, cache=cache, cache_dir=cache_dir, node=node, workers=1, events=events)


def _load_many(todo: list[tuple[Path, str]], cache: bool, cache_dir: str | Path | None, workers: int,
               done=None, events: bool = True) -> list[RankTrace]:
    """Ranks in order. Big ranks (≥ ``PARALLEL_MIN_BYTES`` of JSON each) are parsed one after another, each
    chunked over one shared pool of ``workers`` processes (memory: one rank's frame plus a few slices at a
    time); several smaller ranks are parsed one rank per worker process."""
    need = [p for p, _ in todo if not _cached(p, cache, cache_dir)]
    sizes = {p: chunked.json_size_hint(p) for p in need}
    if workers > 1 and need and max(sizes.values()) >= chunked.PARALLEL_MIN_BYTES:
        ex = chunked.spawn_pool(workers)
        if ex is not None:
            with ex:
                return [done(load_trace(p, cache=cache, cache_dir=cache_dir, node=node, workers=workers,
                                        executor=ex, events=events)) for p, node in todo]
    big = sum(sizes.values()) >= chunked.PARALLEL_MIN_BYTES
    if workers > 1 and len(need) > 1 and big:
        ex = chunked.spawn_pool(min(workers, len(todo)))
        if ex is not None:
            try:
                with ex:
                    futs = [ex.submit(_load_one, p, cache, cache_dir, node, events) for p, node in todo]
                    return [done(f.result()) for f in futs]
            except TraceFormatError:
                raise
            except Exception:  # a worker died (e.g. out of memory): load one by one below
                pass
    return [done(load_trace(p, cache=cache, cache_dir=cache_dir, node=node, workers=workers, events=events))
            for p, node in todo]


@dataclass
class Capture:
    """All rank traces of one capture plus the frontend traces that were set aside."""
    trace_dir: Path
    ranks: list[RankTrace]
    frontend: list[RankIdentity] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def identities(self) -> pl.DataFrame:
        """One row per rank: identity, events, kernels, load time and whether it came from the cache."""
        rows = []
        for t in self.ranks:
            d = asdict(t.identity)
            d["file"] = Path(d["file"]).name
            in_memory = t.n_events is None          # else: counted at load or at release, the frame not read
            d.update(events=t.events.height if in_memory else t.n_events,
                     kernels=int((t.events["cat"] == "kernel").sum()) if in_memory else t.n_kernels,
                     gpu=", ".join(sorted({str(p.get("name")) for p in t.meta.get("deviceProperties") or []
                                          if isinstance(p, dict)})) or None,
                     load_s=round(t.load_s, 3), from_cache=t.from_cache,
                     truncated=bool(t.meta.get("truncated")))        # cut mid-write: read up to where it ends
            rows.append(d)
        for f in self.frontend:
            d = asdict(f)
            d["file"] = Path(d["file"]).name
            rows.append(d)
        return pl.DataFrame(rows, infer_schema_length=None)


def load_capture(trace_dir: str | Path, *, profile_id: str | None = None, cache: bool = True,
                 cache_dir: str | Path | None = None, nodes: dict[str, str] | None = None,
                 workers: int | None = None, on_rank=None, events: bool = True,
                 only: set[Path] | None = None) -> Capture:
    """Load every rank trace of a capture folder (SGLang per-rank files or vLLM ``rank*.pt.trace.json.gz``).

    Frontend traces (vLLM ``async_llm``) are listed but not loaded as ranks. A folder holding several
    SGLang captures needs ``profile_id``. Node: ``nodes[<sub-folder>]`` or the sub-folder name when
    traces sit in per-node sub-folders, else ``node0``. Ranks are sorted by global rank.
    When several ranks must be parsed (no cache hit) and together hold ≥ ``PARALLEL_MIN_BYTES`` of JSON,
    they are parsed by ``workers`` processes, one rank each (default: this process's share of CPUs,
    :func:`~servelab.core.threads.share`); big ranks are parsed one after another, each chunked over the same
    processes. ``on_rank(trace)`` is called on each rank as soon
    as it is loaded (rank identity settled) — streaming analysis prepares it there and releases its events.
    ``events=False``: a rank found in the Parquet cache is loaded without its event frame, which
    :attr:`RankTrace.events` reads on first use (the analysis needs none when the rank's prepared tables are
    cached too). ``only``: load only these rank files (a rank subset, :mod:`~servelab.analyse.trace.subset`).
    """
    root = Path(trace_dir)
    files = find_trace_files(root)
    if not files:
        raise TraceFormatError(f"{root}: no *.json / *.json.gz trace files in this folder")
    idents = {p: identity_from_name(p) for p in files}
    ids = sorted({i.profile_id for i in idents.values()
                  if i.engine and i.profile_id and engine_for(i.engine).trace_profile_id_shared})
    if profile_id is None and len(ids) > 1:
        raise TraceFormatError(f"{root}: holds {len(ids)} SGLang captures ({', '.join(ids)}); "
                               f"pass profile_id= to choose one")
    frontend, skipped, todo = [], [], []
    merged = [p for p in files if idents[p].role == "merged"]
    if merged and len(merged) == len(files):
        raise TraceFormatError(f"{root}: only SGLang merged traces ({', '.join(p.name for p in merged)}); they hold "
                               "every rank in one file without clock alignment — analyse the per-rank "
                               "*-TP-<n>*.trace.json.gz files instead")
    for p in files:
        ident = idents[p]
        if p in merged or (profile_id is not None and ident.profile_id != profile_id) or not looks_like_trace(p):
            skipped.append(p.name)
            continue
        rel = p.parent.relative_to(root)
        node = str(rel) if str(rel) != "." else "node0"
        if nodes:
            node = nodes.get(node, nodes.get(p.name, node))
        if ident.role == "frontend":
            ident.node = node
            frontend.append(ident)
            continue
        if only is not None and p not in only:
            continue
        todo.append((p, node))
    order = {p: i for i, p in enumerate(sorted((p for p, _ in todo), key=str))}

    def done(t: RankTrace) -> RankTrace:
        if t.identity.rank is None:
            t.identity.rank = t.identity.tp if t.identity.tp is not None else order[t.path]
            t.identity.source = t.identity.source or "file order"
        if on_rank is not None:
            on_rank(t)
        return t

    ranks = _load_many(todo, cache, cache_dir, chunked.default_workers() if workers is None else max(1, int(workers)), done,
                       events)
    if not ranks:
        raise TraceFormatError(f"{root}: no rank traces found (frontend traces: "
                               f"{', '.join(Path(f.file).name for f in frontend) or 'none'}; set aside: "
                               f"{', '.join(skipped) or 'none'})")
    seen: dict[tuple, str] = {}
    for t in ranks:
        key = (t.identity.rank, t.identity.stage, t.identity.dp, t.identity.pp)
        if key in seen:
            raise TraceFormatError(f"{root}: {t.path.name} and {seen[key]} both claim rank {t.identity.rank}; "
                                   f"the folder mixes captures — pass profile_id= or split the folder")
        seen[key] = t.path.name
    ranks.sort(key=lambda t: (t.identity.stage or "", t.rank))
    return Capture(trace_dir=root, ranks=ranks, frontend=frontend, skipped=skipped)
