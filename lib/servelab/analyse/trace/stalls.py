"""One clock per case: the client's chunk arrivals and the engine's step windows from its trace on one timeline, and
what that join answers — which engine steps every client-observed stall overlapped, and how each request's TTFT
splits into queueing, prefill and delivery.

The clock. On one host the client and the engine read the same wall clock: the client keeps ``perf_counter_ns``
per socket read and one ``time.time_ns()`` anchor per drive (``wall = perf + wall_offset_ns``), the torch profiler
writes absolute event times (Kineto ``baseTimeNanoseconds`` + ``ts``, both on the system clock), which
``analyse.trace.load`` turns into ``ts_ns``. Nothing is shifted. Traces from another node are on that node's clock:
each is moved onto the client's by the node's offset the run's preflight measured (``cases/<case>/clock.json``,
:class:`ClockShift`: ``client time = node time − offset``), and the causality check is widened by that offset's
uncertainty; a node without a measured offset is not joined (the reason says so). What can still be off, and how
it is bounded:

- the perf→wall anchor is taken once per drive, so a clock slew during the drive (NTP at most 500 ppm: ≤ 0.5 ms per
  second of drive) shifts late chunks by that much;
- Kineto converts its approximate (TSC) clock to the system clock with a calibration of a few µs;
- the causality check measures the rest: a chunk cannot arrive before the end of the step that produced it, so the
  smallest ``delivery`` (first chunk − end of the request's prefill step) over the identified requests is a lower
  bound on the residual offset — negative means the clocks disagree by at least that much (``OneClock.clock``).

Steps are the trace's step annotations (``windows.DEFAULT_WINDOW_REGEX``: vLLM
``execute_context_<c>(<tokens>)_generation_<g>(<tokens>)``, SGLang ``step[EXTEND bs= toks=]`` …). A step spans its
GPU work when the trace has kernels, else its CPU annotation (a CPU engine computes inside it). Different engines'
names only differ in the patterns of :func:`step_content`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import polars as pl

# a client-observed stall: an inter-chunk gap above the steady-state P99 ITL of the decode streams
STEADY_ROLES = ("background",)          # the decode streams whose gaps outside any injection are the steady state
CLIENT_ROLES = ("background", "inject", "measure")
PERCENTILE = 99.0


def step_content(name: str) -> dict[str, int | None]:
    """What a step annotation says it computed: ``prefill_tokens``, ``prefill_reqs``, ``decode_reqs`` (None when
    the name does not say). vLLM ``execute_[<n>_]context_<c>(<toks>|sq<toks>..)_generation_<g>(..)``; SGLang
    ``step[EXTEND bs=<b> toks=<t>]`` / ``step[DECODE bs=<b>]`` / ``MIXED``; ``*prefill_chunk_<t>``."""
    m = re.search(r"context_(\d+)\((?:sq)?(\d+)", name)
    if m:
        g = re.search(r"generation_(\d+)", name)
        return {"prefill_reqs": int(m.group(1)), "prefill_tokens": int(m.group(2)),
                "decode_reqs": int(g.group(1)) if g else None}
    bs = re.search(r"\bbs=(\d+)", name)
    toks = re.search(r"\btoks=(\d+)", name)
    if re.search(r"EXTEND|MIXED|SPLIT_PREFILL", name):
        return {"prefill_reqs": int(bs.group(1)) if bs and "EXTEND" in name else None,
                "prefill_tokens": int(toks.group(1)) if toks else None, "decode_reqs": None}
    if re.search(r"DECODE|decode", name):
        return {"prefill_reqs": 0, "prefill_tokens": 0, "decode_reqs": int(bs.group(1)) if bs else None}
    chunk = re.search(r"prefill_chunk_(\d+)", name)
    if chunk:
        return {"prefill_reqs": 1, "prefill_tokens": int(chunk.group(1)), "decode_reqs": None}
    return {"prefill_reqs": None, "prefill_tokens": None, "decode_reqs": None}


def describe_step(row: dict[str, Any]) -> str:
    """``prefill 1536 tok (1 req) + 8 decode, 412.0 ms`` — a step as a stall table names it."""
    parts = []
    if row.get("prefill_tokens"):
        reqs = row.get("prefill_reqs")
        parts.append(f"prefill {row['prefill_tokens']} tok" + (f" ({reqs} req)" if reqs else ""))
    if row.get("decode_reqs"):
        parts.append(f"{row['decode_reqs']} decode")
    what = " + ".join(parts) or str(row.get("kind") or "step")
    return f"{what}, {row['dur_ms']:.1f} ms"


STEP_SCHEMA = {"rank": pl.Int64, "window": pl.Int64, "name": pl.String, "kind": pl.String, "start_ns": pl.Int64,
               "end_ns": pl.Int64, "dur_ms": pl.Float64, "span": pl.String, "prefill_tokens": pl.Int64,
               "prefill_reqs": pl.Int64, "decode_reqs": pl.Int64}


def engine_steps(windows: pl.DataFrame) -> pl.DataFrame:
    """Step windows (``analyse``'s ``windows`` frame, one rank or more) → one row per step on the wall clock:
    ``start_ns``/``end_ns`` of its device ops when it has any (GPU kernels; for an engine on CPU its forward's torch
    ops), else of its CPU annotation (``span`` says which: ``ops`` or ``annotation``), its
    duration and what its name says it computed. The ``whole trace`` fallback window is not a step."""
    if windows is None or windows.height == 0 or "cpu_start_ns" not in windows.columns:
        return pl.DataFrame(schema=STEP_SCHEMA)
    w = windows.filter(pl.col("name") != "whole trace")
    rows = []
    for r in w.iter_rows(named=True):
        gpu = r.get("gpu_start_ns") is not None and r.get("gpu_end_ns") is not None
        s, e = (r["gpu_start_ns"], r["gpu_end_ns"]) if gpu else (r["cpu_start_ns"], r["cpu_end_ns"])
        rows.append({"rank": r["rank"], "window": r["window"], "name": r["name"], "kind": r["kind"],
                     "start_ns": int(s), "end_ns": int(e), "dur_ms": (int(e) - int(s)) / 1e6,
                     "span": "ops" if gpu else "annotation", **step_content(str(r["name"]))})
    return pl.DataFrame(rows, schema=STEP_SCHEMA).sort("start_ns") if rows else pl.DataFrame(schema=STEP_SCHEMA)


def _content_arrivals(rec: Any) -> list[int]:
    """Wall-clock arrivals of a record's chunks that carried choices (token chunks; the usage-only tail excluded)."""
    wall = rec.chunk_wall_ns
    return [t for t, ch in zip(wall, rec.chunk_choices) if ch] if rec.chunk_choices else list(wall)


def client_gaps(records: Sequence[Any], roles: tuple[str, ...] = CLIENT_ROLES) -> pl.DataFrame:
    """Every inter-chunk gap the client saw: request_id, role, k (the chunk that ended the gap), prev_ns, arr_ns,
    gap_ms."""
    rows = []
    for r in records:
        if r.role not in roles or not r.ok:
            continue
        arr = _content_arrivals(r)
        for k in range(1, len(arr)):
            rows.append({"request_id": r.request_id, "role": r.role, "k": k, "prev_ns": arr[k - 1], "arr_ns": arr[k],
                         "gap_ms": (arr[k] - arr[k - 1]) / 1e6})
    schema = {"request_id": pl.String, "role": pl.String, "k": pl.Int64, "prev_ns": pl.Int64, "arr_ns": pl.Int64,
              "gap_ms": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def injection_windows(records: Sequence[Any]) -> list[tuple[int, int]]:
    """[send, first chunk] of every injected request (wall ns): its prefill; the steady state is measured outside."""
    out = []
    for r in records:
        if r.role == "inject":
            arr = _content_arrivals(r)
            out.append((r.send_wall_ns, arr[0] if arr else r.end_ns + r.wall_offset_ns))
    return out


def steady_p99(gaps: pl.DataFrame, injections: list[tuple[int, int]], span: tuple[int, int] | None = None,
               roles: tuple[str, ...] = STEADY_ROLES) -> tuple[float | None, int, str]:
    """P99 (linear interpolation) of the decode streams' gaps that do not overlap an injection's prefill and — with
    the traced ``span`` — end by its last step and do not contain its first step's start: the engine pauses while
    the profiler starts, and after the last traced step while it writes the trace and its tables (seconds on a CPU
    engine), which is no steady state. Returns (value, n, basis)."""
    g = gaps.filter(pl.col("role").is_in(list(roles)))
    for s, e in injections:
        g = g.filter(~((pl.col("prev_ns") < e) & (pl.col("arr_ns") > s)))
    basis = "decode-stream gaps outside the injection"
    if span is not None:
        g = g.filter((pl.col("arr_ns") <= span[1]) & ~((pl.col("prev_ns") <= span[0]) & (pl.col("arr_ns") >= span[0])))
        basis += ", up to the last traced step, the profiler's start pause left out"
    if g.height == 0:
        return None, 0, basis
    return float(np.percentile(g["gap_ms"].to_numpy(), PERCENTILE)), g.height, basis


def attribute_stalls(gaps: pl.DataFrame, steps: pl.DataFrame, threshold_ms: float) -> pl.DataFrame:
    """Every gap above ``threshold_ms`` that overlaps the traced steps, with the engine steps that overlapped it:
    ``steps`` (each named by what it computed and its duration, longest first), ``longest_step``, ``prefill_tokens``
    run during the gap, ``step_cover_pct`` (the share of the gap inside some step) and ``cause`` (``prefill`` when a
    step with prefill tokens overlapped, ``decode steps`` otherwise, ``no step`` when the engine ran none then).
    Gaps wholly before the first or after the last traced step cannot be attributed and are left out (count them
    with :func:`unattributed`)."""
    t_lo = int(steps["start_ns"].min()) if steps.height else None
    t_hi = int(steps["end_ns"].max()) if steps.height else None
    stalls = gaps.filter(pl.col("gap_ms") > threshold_ms).sort("prev_ns")
    stalls = stalls.filter((pl.col("prev_ns") < t_hi) & (pl.col("arr_ns") > t_lo)) if t_lo is not None \
        else stalls.head(0)
    rows = []
    for g in stalls.iter_rows(named=True):
        a, b = g["prev_ns"], g["arr_ns"]
        ov = steps.filter((pl.col("start_ns") < b) & (pl.col("end_ns") > a)) if steps.height else steps
        ov = ov.sort("dur_ms", descending=True)
        covered = 0
        if ov.height:
            iv = sorted((max(s, a), min(e, b)) for s, e in zip(ov["start_ns"], ov["end_ns"]))
            cur_s, cur_e = iv[0]
            for s, e in iv[1:]:
                if s > cur_e:
                    covered += cur_e - cur_s
                    cur_s, cur_e = s, e
                else:
                    cur_e = max(cur_e, e)
            covered += cur_e - cur_s
        named = [f"{describe_step(r)} [{r['name']}]" for r in ov.iter_rows(named=True)]
        pre = int(ov["prefill_tokens"].fill_null(0).sum()) if ov.height else 0
        cause = ("prefill" if pre > 0 else "decode steps") if ov.height else "no step (engine between steps)"
        rows.append({"request_id": g["request_id"], "role": g["role"], "chunk": g["k"], "gap_start_ns": a,
                     "gap_ms": round(g["gap_ms"], 3), "threshold_ms": round(threshold_ms, 3),
                     "steps_overlapping": ov.height, "longest_step": describe_step(ov.row(0, named=True)) if ov.height
                     else "", "longest_step_ms": round(float(ov["dur_ms"][0]), 3) if ov.height else None,
                     "prefill_tokens": pre, "step_cover_pct": round(100 * covered / (b - a), 1) if b > a else 0.0,
                     "cause": cause, "steps": "; ".join(named[:4]) + (f"; … {len(named) - 4} more" if len(named) > 4
                                                                        else "")})
    schema = {"request_id": pl.String, "role": pl.String, "chunk": pl.Int64, "gap_start_ns": pl.Int64,
              "gap_ms": pl.Float64, "threshold_ms": pl.Float64, "steps_overlapping": pl.Int64,
              "longest_step": pl.String, "longest_step_ms": pl.Float64, "prefill_tokens": pl.Int64,
              "step_cover_pct": pl.Float64, "cause": pl.String, "steps": pl.String}
    return pl.DataFrame(rows, schema=schema)


def unattributed(gaps: pl.DataFrame, steps: pl.DataFrame, threshold_ms: float) -> pl.DataFrame:
    """Gaps above ``threshold_ms`` wholly outside the traced steps (e.g. the engine paused while the profiler started
    or wrote its trace): seen by the client, not attributable from this trace."""
    big = gaps.filter(pl.col("gap_ms") > threshold_ms)
    if steps.height == 0:
        return big
    t_lo, t_hi = int(steps["start_ns"].min()), int(steps["end_ns"].max())
    return big.filter((pl.col("arr_ns") <= t_lo) | (pl.col("prev_ns") >= t_hi))


def ttft_split(records: Sequence[Any], steps: pl.DataFrame, roles: tuple[str, ...] = CLIENT_ROLES,
               tolerance_ns: int = 0) -> pl.DataFrame:
    """Each request's TTFT split where the trace identifies its prefill step(s): the last step carrying prefill
    tokens that started after the send and ended before the first chunk arrived, plus the earlier prefill-bearing
    steps after the send while their tokens add up to less than the prompt (chunked prefill).
    ``queueing`` = first prefill step start − send, ``prefill`` = its steps' span, ``delivery`` = first chunk − end of
    the last prefill step (detokenise, stream, network). ``identified`` is false (and the split empty) when no such
    step is in the trace; ``shared`` says how many requests' prefills the step carried (a batch prefill is each
    request's prefill). ``tolerance_ns`` (a shifted trace's offset uncertainty) widens the step's allowed span by that
    much on both sides: within it, a step may end after the first chunk (negative delivery)."""
    pre = steps.filter(pl.col("prefill_tokens").fill_null(0) > 0).sort("end_ns") if steps.height else steps
    rows = []
    for r in records:
        if r.role not in roles or not r.ok:
            continue
        arr = _content_arrivals(r)
        if not arr:
            continue
        send, first = r.send_wall_ns, arr[0]
        ttft = (first - send) / 1e6
        cand = pre.filter((pl.col("start_ns") >= send - tolerance_ns) & (pl.col("end_ns") <= first + tolerance_ns)) \
            if pre.height else pre
        base = {"request_id": r.request_id, "role": r.role, "input_tokens": r.prompt_tokens or r.expected_input_tokens,
                "ttft_ms": round(ttft, 3)}
        if cand.height == 0:
            rows.append({**base, "identified": False, "queueing_ms": None, "prefill_ms": None, "delivery_ms": None,
                         "prefill_steps": 0, "prefill_step": "", "shared": None})
            continue
        chosen = [cand.row(cand.height - 1, named=True)]
        toks = chosen[0]["prefill_tokens"] or 0
        need = r.prompt_tokens or r.expected_input_tokens
        for row in reversed(list(cand.head(cand.height - 1).iter_rows(named=True))):
            if toks >= need:
                break
            chosen.insert(0, row)
            toks += row["prefill_tokens"] or 0
        q = (chosen[0]["start_ns"] - send) / 1e6
        p = (chosen[-1]["end_ns"] - chosen[0]["start_ns"]) / 1e6
        d = (first - chosen[-1]["end_ns"]) / 1e6
        rows.append({**base, "identified": True, "queueing_ms": round(q, 3), "prefill_ms": round(p, 3),
                     "delivery_ms": round(d, 3), "prefill_steps": len(chosen),
                     "prefill_step": describe_step(chosen[-1]), "shared": chosen[-1].get("prefill_reqs")})
    schema = {"request_id": pl.String, "role": pl.String, "input_tokens": pl.Int64, "ttft_ms": pl.Float64,
              "identified": pl.Boolean, "queueing_ms": pl.Float64, "prefill_ms": pl.Float64, "delivery_ms": pl.Float64,
              "prefill_steps": pl.Int64, "prefill_step": pl.String, "shared": pl.Int64}
    return pl.DataFrame(rows, schema=schema)


CASE_CLOCK_FILE = "clock.json"       # written by ``measure.capture`` beside a profiled case's traces


@dataclass
class ClockShift:
    """How each traced node's times are moved onto the client's clock: ``offsets_ns[node]`` = node clock − client
    clock, ``uncertainty_ns[node]`` its bound; ``rank_nodes`` maps the trace's ranks to their node. ``refused`` (one
    line, what to do) when a node's offset was not measured: nothing is joined then."""
    offsets_ns: dict[str, int] = field(default_factory=dict)
    uncertainty_ns: dict[str, int] = field(default_factory=dict)
    rank_nodes: dict[int, str] = field(default_factory=dict)
    client: str = ""
    measured_at: str = ""
    refused: str = ""

    @property
    def shifted(self) -> bool:
        return any(self.offsets_ns.get(n) or self.uncertainty_ns.get(n) for n in set(self.rank_nodes.values()))

    @property
    def uncertainty_ms(self) -> float:
        """The widest uncertainty among the traced nodes (the causality check is widened by it)."""
        return max((self.uncertainty_ns.get(n, 0) for n in set(self.rank_nodes.values())), default=0) / 1e6

    def describe(self) -> str:
        """``client on local, traces from n2: shifted by -12.345 ms ± 0.210 ms (measured in preflight at …)`` (with
        several nodes: ``traces from n1, n2: n1 shifted by …; n2 shifted by …``)."""
        nodes = sorted(set(self.rank_nodes.values()))

        def by(n: str) -> str:
            return (f"shifted by {-self.offsets_ns.get(n, 0) / 1e6:+.3f} ms ± "
                    f"{self.uncertainty_ns.get(n, 0) / 1e6:.3f} ms")
        per = by(nodes[0]) if len(nodes) == 1 else "; ".join(f"{n} {by(n)}" for n in nodes)
        return (f"client on {self.client or 'the servelab machine'}, traces from {', '.join(nodes)}: {per} "
                f"(measured in preflight at {self.measured_at or 'an unrecorded time'}; client time = node time − "
                "the node's offset)")


def read_case_clock(case_dir: Path) -> dict[str, Any] | None:
    """A case's ``clock.json`` (each node's offset to the client, from the run's preflight), or None."""
    p = Path(case_dir) / CASE_CLOCK_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def clock_shift(case_dir: Path, rank_nodes: dict[int, str]) -> ClockShift:
    """The shift that puts the traces of ``rank_nodes`` (rank → node folder under ``profiles/``) on the client's
    clock, from the case's ``clock.json``. Without that file only traces from ``local`` (the client's own machine)
    are joined, unshifted; a node with no measured offset makes the whole join refused, with the reason."""
    rec = read_case_clock(case_dir)
    nodes = sorted(set(rank_nodes.values()))
    if rec is None:
        other = [n for n in nodes if n != "local"]
        refused = "" if not other else (
            f"traces from {', '.join(other)} but no clock offset of that node to the client was recorded with this "
            f"case ({CASE_CLOCK_FILE} missing): not joined — capture again with a run whose preflight measures the "
            "nodes' clocks (an SSH target: docs/method.md#preflight)")
        return ClockShift({n: 0 for n in nodes if n == "local"}, {n: 0 for n in nodes if n == "local"}, rank_nodes,
                          "local", "", refused)
    known = rec.get("nodes") or {}
    offs, uncs, missing = {}, {}, []
    for n in nodes:
        c = known.get(n) or {}
        if c.get("offset_ns") is None:
            missing.append(f"{n} ({c.get('reason') or 'not in ' + CASE_CLOCK_FILE})")
            continue
        offs[n], uncs[n] = int(c["offset_ns"]), int(c.get("uncertainty_ns") or 0)
    refused = "" if not missing else (
        f"no clock offset to the client was measured for {', '.join(missing)}: not joined — run with a target whose "
        "preflight measures the nodes' clocks (every node reachable over SSH when the run starts: "
        "docs/method.md#preflight), then capture again")
    return ClockShift(offs, uncs, rank_nodes, str(rec.get("client") or ""), str(rec.get("measured_at") or ""),
                      refused)


def shift_windows(windows: pl.DataFrame, shift: ClockShift) -> pl.DataFrame:
    """Step windows moved onto the client's clock: every time column of a rank minus its node's offset."""
    if windows is None or windows.height == 0 or not shift.offsets_ns:
        return windows
    by_rank = {r: shift.offsets_ns.get(n, 0) for r, n in shift.rank_nodes.items()}
    off = pl.col("rank").replace_strict(by_rank, default=0, return_dtype=pl.Int64)
    cols = [c for c in ("cpu_start_ns", "cpu_end_ns", "gpu_start_ns", "gpu_end_ns") if c in windows.columns]
    return windows.with_columns([(pl.col(c) - off).alias(c) for c in cols])


@dataclass
class OneClock:
    """One case on one timeline: engine steps, client gaps, the steady-state P99 ITL, the stalls with the steps they
    overlapped, the TTFT split, and the clock notes (``clock``: how the sides were put together, what bounds the
    residual offset)."""
    steps: pl.DataFrame
    gaps: pl.DataFrame
    p99_itl_ms: float | None
    steady_gaps: int
    stalls: pl.DataFrame
    ttft: pl.DataFrame
    clock: dict[str, Any] = field(default_factory=dict)
    t0_ns: int = 0
    steady_basis: str = ""
    outside: pl.DataFrame = field(default_factory=pl.DataFrame)

    @property
    def prefill_stalls(self) -> pl.DataFrame:
        return self.stalls.filter(pl.col("cause") == "prefill") if self.stalls.height else self.stalls


def one_clock(records: Sequence[Any], windows: pl.DataFrame, same_host: bool = True,
              shift: ClockShift | None = None) -> OneClock:
    """Join a case's client records (``RequestRecord`` with chunk arrivals) and its trace's step windows. With
    ``shift`` each rank's windows are first moved onto the client's clock by its node's measured offset, and the
    causality check allows that offset's uncertainty; a refused shift (or ``same_host=False`` without one) joins
    nothing."""
    refused = shift.refused if shift is not None else ("" if same_host else
                                                        "client and engine on different hosts: no shared clock; the "
                                                        "join is not valid")
    if shift is not None and not refused:
        windows = shift_windows(windows, shift)
    steps = engine_steps(windows)
    gaps = client_gaps(records)
    if refused:       # no shared clock: placing the two sides on one timeline would be made up
        records, gaps = [], gaps.head(0)
    span = (int(steps["start_ns"].min()), int(steps["end_ns"].max())) if steps.height else None
    p99, n, basis = steady_p99(gaps, injection_windows(records), span)
    stalls = attribute_stalls(gaps, steps, p99) if p99 is not None else attribute_stalls(gaps.head(0), steps, 0.0)
    outside = unattributed(gaps, steps, p99) if p99 is not None else gaps.head(0)
    unc = shift.uncertainty_ms if shift is not None and not refused and shift.shifted else 0.0
    split = ttft_split(records, steps, tolerance_ns=int(unc * 1e6))
    ident = split.filter(pl.col("identified")) if split.height else split
    min_delivery = float(ident["delivery_ms"].min()) if ident.height else None
    starts = ([int(steps["start_ns"].min())] if steps.height else []) + \
        [r.send_wall_ns for r in records if r.role in CLIENT_ROLES]
    t0 = min(starts) if starts else 0
    shifted = shift is not None and not refused and shift.shifted
    clock = {
        "shared_clock": not refused and not shifted,
        "joined": not refused,
        "method": (refused if refused else shift.describe() if shifted and shift is not None else
                   "client and engine on one host: client chunk times (perf_counter + one wall anchor per drive) and "
                   "trace times (Kineto baseTimeNanoseconds + ts) are both the system wall clock; nothing shifted"),
        "offsets_ms": ({n: round(v / 1e6, 3) for n, v in shift.offsets_ns.items()} if shifted and shift else {}),
        "uncertainty_ms": round(unc, 3),
        "measured_at": shift.measured_at if shifted and shift is not None else "",
        "steps": steps.height, "step_span": (steps["span"][0] if steps.height else None),
        "min_delivery_ms": min_delivery,
        # a first chunk cannot arrive before its prefill step ends; with shifted traces, only by more than the
        # measured offset's uncertainty is that a contradiction
        "causality_ok": None if min_delivery is None else min_delivery >= -unc,
        "bound": _bound(min_delivery, unc),
    }
    return OneClock(steps, gaps, p99, n, stalls, split, clock, t0, basis, outside)


def _bound(min_delivery: float | None, unc: float) -> str:
    """The causality check in words (``unc``: the shifted nodes' offset uncertainty, ms; 0 on one host)."""
    if min_delivery is None:
        return ("no request's prefill step identified" + (f" (a step counts when it ends no later than {unc:.3f} ms — "
                "the measured offset's uncertainty — after the first chunk)" if unc else "")
                + ": the offset cannot be bounded from this case")
    within = f" ± {unc:.3f} ms (the measured offset's uncertainty)" if unc else ""
    if min_delivery >= 0:
        return (f"every identified request's first chunk arrived after its prefill step ended (min delivery "
                f"{min_delivery:.3f} ms): the residual clock offset is below that plus the anchor drift"
                + (f", and within ± {unc:.3f} ms (the measured offset's uncertainty)" if unc else ""))
    if min_delivery >= -unc:
        return (f"a first chunk arrived {abs(min_delivery):.3f} ms before its prefill step ended on the shifted "
                f"clock, within the offset's uncertainty{within}: consistent; the residual offset lies in "
                f"[−{unc:.3f}, {min_delivery:.3f}] ms")
    return (f"a first chunk arrived {abs(min_delivery):.3f} ms BEFORE its prefill step ended: the clocks disagree by "
            f"at least that much" + (f", more than the measured offset's uncertainty{within}" if unc else ""))


def stall_summary(oc: OneClock) -> dict[str, Any]:
    """The numbers Q10 quotes: steady P99, stalls, how many overlapped prefill, the worst one and its longest step."""
    s = oc.stalls
    worst = s.sort("gap_ms", descending=True).row(0, named=True) if s.height else None
    return {"p99_itl_ms": oc.p99_itl_ms, "steady_gaps": oc.steady_gaps, "steady_basis": oc.steady_basis,
            "stalls": s.height, "prefill_stalls": oc.prefill_stalls.height, "worst": worst,
            "requests_stalled": s["request_id"].n_unique() if s.height else 0,
            "outside_trace": oc.outside.height,
            "outside_worst_ms": float(oc.outside["gap_ms"].max()) if oc.outside.height else None}


def mixed_window_problem(windows: pl.DataFrame, isl: int, inj: int) -> str:
    """Why a mixed capture (decode streams of ``isl``-token prompts, one injected ``inj``-token prefill) cannot show
    the injected prefill delaying decode, from its trace's step ``windows``; "" when it can, and when the step names
    say nothing of prefill tokens. The injected prefill must run inside the traced steps — a replacement background
    stream's short prefill there does not count — and with decode in flight: decode requests in its own step, or a
    decode step just before it. It misses the window when the engine runs all its steps (32, ~0.1 s on a CPU
    engine) before the request reaches it, and finds no decode when the background streams ended during a slow
    ``/start_profile`` — both on a loaded host."""
    steps = engine_steps(windows)
    if steps.height == 0 or steps.filter(pl.col("prefill_tokens").is_not_null()).height == 0:
        return ""
    # more prompt tokens per prefilled request in one step than a background prompt has: the injected prompt (a
    # chunked one too, one chunk per step)
    per_req = pl.col("prefill_tokens") / pl.col("prefill_reqs").fill_null(1).clip(lower_bound=1)
    has_decode = pl.col("decode_reqs").fill_null(0) > 0
    decode_step = has_decode | (pl.col("prefill_tokens") == 0)
    steps = steps.sort("rank", "start_ns").with_columns(
        injected=(per_req > isl).fill_null(False),
        with_decode=has_decode | decode_step.shift(1).over("rank").fill_null(False))
    hits = steps.filter(pl.col("injected"))
    if hits.filter(pl.col("with_decode")).height:
        return ""
    if hits.height:
        return (f"its injected {inj}-token prefill ran with no decode in flight (none in its step or the one before "
                "it: the background streams had ended), so it delayed nothing")
    small = steps.filter(pl.col("prefill_tokens") > 0).height
    return (f"its injected {inj}-token prefill ran outside the {steps.height} traced steps (the engine ran the "
            "whole window before the request reached it)"
            + (f"; {small} traced step(s) prefilled only background prompts of {isl} tokens" if small else ""))
