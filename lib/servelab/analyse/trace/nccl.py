"""NCCL / communication forensics from trace kernels: collective, dtype, message size, duration statistics
and algbw/busbw (nccl-tests definitions) where the trace carries message sizes.

Kernel names tell the *specialised* kernel (``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``), not the runtime
algorithm/protocol (NCCL ≥ 2.19; ``docs/metrics.md#nccl-forensics``) — the ``name_algo``/``name_proto``
columns are reported as such. Sizes exist only for torch c10d collectives (``In msg nelems`` args);
SGLang/vLLM pynccl and custom all-reduce kernels, and kernels replayed from CUDA graphs, carry none.
"""
from __future__ import annotations

import re

import polars as pl

from servelab.analyse.trace.ops import RankOps

# nccl-tests doc/PERFORMANCE.md: busbw = algbw × factor(n)
BUSBW_FACTORS = {
    "AllReduce": lambda n: 2 * (n - 1) / n,
    "ReduceScatter": lambda n: (n - 1) / n,
    "AllGather": lambda n: (n - 1) / n,
    "AllToAll": lambda n: (n - 1) / n,
    "Broadcast": lambda n: 1.0,
    "Reduce": lambda n: 1.0,
    "SendRecv": lambda n: 1.0,
}

DTYPE_BYTES = {
    # torch dtype names as written in Kineto args
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "int8": 1, "byte": 1,
    "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    # NCCL kernel-name types
    "f32": 4, "f64": 8, "f16": 2, "bf16": 2, "i8": 1, "u8": 1, "i32": 4, "u32": 4, "i64": 8, "u64": 8,
    "f8e4m3": 1, "f8e5m2": 1, "int8_t": 1, "uint8_t": 1, "int32_t": 4, "uint32_t": 4, "int64_t": 8,
    "uint64_t": 8,
}

_COLL_FROM_ARGS = (
    (r"all_?reduce", "AllReduce"), (r"all_?gather", "AllGather"), (r"reduce_?scatter", "ReduceScatter"),
    (r"all_?to_?all", "AllToAll"), (r"broadcast", "Broadcast"), (r"send|recv", "SendRecv"), (r"^_?reduce", "Reduce"),
)
_NAME_RE = re.compile(
    r"(?:ncclDevKernel|ncclKernel|ncclSymk?DevKernel)_(?P<coll>[A-Za-z]+?)(?:_(?P<rest>[A-Za-z0-9_]+))?(?:\(|$)")
_LEGACY_RE = re.compile(r"^nccl(?P<coll>AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|SendRecv)"
                        r"(?P<algo>Ring|Tree|CollNet)?(?P<proto>LL128|LL|Simple)?Kernel_(?P<op>[a-z]+)_(?P<ty>\w+)")
_TYPES = sorted((k for k in DTYPE_BYTES if "_" not in k or k.endswith("_t")), key=len, reverse=True)


def parse_comm_name(name: str) -> dict[str, str | None]:
    """Collective, dtype, algorithm and protocol *as written in the kernel name* (not the runtime choice)."""
    out: dict[str, str | None] = {"collective": None, "name_dtype": None, "name_algo": None, "name_proto": None}
    m = _NAME_RE.search(name)
    if m:
        coll = m["coll"]
        out["collective"] = {"Sendrecv": "SendRecv"}.get(coll, coll)
        rest = (m["rest"] or "").split("_")
        for tok in rest:
            if tok in ("RING", "TREE", "NVLS", "NVLSTREE", "COLLNET", "PAT", "COLLNETDIRECT", "COLLNETCHAIN"):
                out["name_algo"] = tok
            elif tok in ("LL", "LL128", "SIMPLE"):
                out["name_proto"] = tok
        tail = "_".join(rest)
        for ty in _TYPES:
            if re.search(rf"(?:^|_){re.escape(ty)}(?:_|$)", tail):
                out["name_dtype"] = ty
                break
        return out
    m = _LEGACY_RE.search(name)
    if m:
        out.update(collective=m["coll"], name_algo=(m["algo"] or "").upper() or None,
                   name_proto=(m["proto"] or "").upper() or None, name_dtype=m["ty"])
        return out
    low = name.lower()
    for rx, coll in _COLL_FROM_ARGS:
        if re.search(rx, low):
            out["collective"] = coll
            break
    if "cross_device_reduce" in low or "allreduce_fusion" in low or "multimem_all_reduce" in low:
        out["collective"] = "AllReduce"
    if "deep_ep" in low:
        out["collective"] = "Dispatch" if "dispatch" in low else ("Combine" if "combine" in low else "DeepEP")
    return out


def collective_from_args(coll: str | None) -> str | None:
    if not coll:
        return None
    low = coll.lower()
    for rx, name in _COLL_FROM_ARGS:
        if re.search(rx, low):
            return name
    return coll


def dtype_bytes(dtype: str | None) -> int | None:
    if not dtype:
        return None
    return DTYPE_BYTES.get(dtype.lower().replace("torch.", "").replace("c10::", ""))


def message_bytes(collective: str | None, in_nelems: int | None, out_nelems: int | None,
                  elem_bytes: int | None) -> int | None:
    """nccl-tests' S (bytes): AllGather uses the gathered (output) size, the others the input size."""
    if elem_bytes is None or collective is None:
        return None
    n = out_nelems if collective == "AllGather" else in_nelems
    if n is None or n < 0:
        return None
    return int(n) * elem_bytes


def comm_ops(rops: list[RankOps]) -> pl.DataFrame:
    """All communication ops of all ranks with parsed collective, dtype, bytes and group size.

    Columns: rank, kind, window, name, subclass, collective, dtype, elem_bytes, msg_bytes, group_size, ts_ns,
    end_ns, dur_ns, graph, pg_name, seq.
    """
    parts = [r.ops.filter(pl.col("cls") == "communication") for r in rops]
    parts = [p for p in parts if p.height]
    if not parts:
        return pl.DataFrame()
    ops = pl.concat(parts, how="vertical_relaxed")
    names = ops["name"].unique().to_list()
    parsed = pl.DataFrame([{"name": n, **parse_comm_name(n)} for n in names],
                          schema={"name": pl.String, "collective": pl.String, "name_dtype": pl.String,
                                  "name_algo": pl.String, "name_proto": pl.String})
    world = {r.rank: (r.trace.meta.get("distributedInfo") or {}).get("world_size") for r in rops}
    ops = ops.join(parsed.with_columns(pl.col("name").cast(ops.schema["name"])), on="name", how="left")
    colls = {c: collective_from_args(c) for c in ops["coll"].drop_nulls().unique().to_list()}
    ops = ops.with_columns(
        pl.coalesce(pl.col("coll").replace_strict(colls, default=None, return_dtype=pl.String), "collective")
        .alias("collective"),
        pl.coalesce("dtype", "name_dtype").alias("dtype"))
    sizes = {d: dtype_bytes(d) for d in ops["dtype"].drop_nulls().unique().to_list()}
    ops = ops.with_columns(pl.col("dtype").replace_strict(sizes, default=None, return_dtype=pl.Int64)
                           .alias("elem_bytes"))
    ops = ops.with_columns(
        pl.coalesce("group_size", pl.col("rank").replace_strict(world, default=None, return_dtype=pl.Int64))
        .alias("group_size"),
        pl.col("group_size").is_not_null().alias("group_from_args"))
    # nccl-tests' S: all-gather counts the gathered output (a gloo all-gather records only its input: input × group),
    # the others the input
    gathered = pl.coalesce("out_nelems", pl.col("in_nelems") * pl.col("group_size"))
    ops = ops.with_columns(
        pl.when(pl.col("collective") == "AllGather").then(gathered).otherwise(pl.col("in_nelems"))
        .mul(pl.col("elem_bytes")).alias("msg_bytes"))
    return ops.select("rank", "kind", "window", pl.col("name").cast(pl.String), "subclass", "collective", "dtype",
                      "elem_bytes", "msg_bytes", "group_size", "group_from_args", "ts_ns", "end_ns", "dur_ns", "graph",
                      "pg_name", "seq", "name_algo", "name_proto")


def busbw_factor(collective: str | None, n: int | None) -> float | None:
    f = BUSBW_FACTORS.get(collective or "")
    if f is None or not n or n < 1:
        return None
    return f(n)


def forensics(rops: list[RankOps]) -> pl.DataFrame:
    """Per (collective, kernel, dtype, message size, group size): count, ranks, in-graph share, duration
    statistics (µs; nearest-rank quantiles) and bandwidth in GB/s (1e9 B/s) at the median and at the
    fastest instance: algbw = bytes / time, busbw = algbw × nccl-tests factor(n). Kernel time includes
    waiting for late peers, so these are lower bounds of the link's bandwidth."""
    ops = comm_ops(rops)
    if ops.height == 0:
        return pl.DataFrame()
    keys = ["collective", "subclass", "name", "dtype", "msg_bytes", "group_size"]
    g = (ops.group_by(keys)
         .agg(pl.len().alias("count"), pl.col("rank").n_unique().alias("ranks"),
              (100 * pl.col("graph").mean()).alias("in_graph_pct"),
              (pl.col("dur_ns").sum() / 1e6).alias("total_ms"),
              (pl.col("dur_ns").quantile(0.5, "nearest") / 1e3).alias("p50_us"),
              (pl.col("dur_ns").quantile(0.95, "nearest") / 1e3).alias("p95_us"),
              (pl.col("dur_ns").min() / 1e3).alias("min_us"), (pl.col("dur_ns").max() / 1e3).alias("max_us"),
              pl.col("kind").drop_nulls().unique().sort().str.join(",").alias("kinds"),
              pl.col("name_algo").first(), pl.col("name_proto").first()))
    g = g.with_columns(
        pl.struct("collective", "group_size").map_elements(lambda s: busbw_factor(s["collective"], s["group_size"]),
                                                           return_dtype=pl.Float64).alias("_f"))
    g = g.with_columns(
        (pl.col("msg_bytes") / (pl.col("p50_us") * 1e3)).alias("algbw_p50_gbps"),
        (pl.col("msg_bytes") / (pl.col("min_us") * 1e3)).alias("algbw_best_gbps"))
    g = g.with_columns((pl.col("algbw_p50_gbps") * pl.col("_f")).alias("busbw_p50_gbps"),
                       (pl.col("algbw_best_gbps") * pl.col("_f")).alias("busbw_best_gbps")).drop("_f")
    return (g.with_columns((pl.col("msg_bytes") / 2**20).alias("msg_mib"))
            .sort("total_ms", descending=True)
            .select("collective", "subclass", "name", "dtype", "msg_bytes", "msg_mib", "group_size", "count", "ranks",
                    "kinds", "in_graph_pct", "total_ms", "p50_us", "p95_us", "min_us", "max_us", "algbw_p50_gbps",
                    "busbw_p50_gbps", "algbw_best_gbps", "busbw_best_gbps", "name_algo", "name_proto"))
