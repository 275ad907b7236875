"""Across ranks: clock alignment by matched collectives, step skew, slow rank, PP stage overlap.

Real H200 TP=2 traces (one node, one clock), the same traces with a synthetic clock offset on a second
"node", and HTA's two sampled ranks of a 128-rank job. Ground truth is computed here from the JSON."""
from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from plain import plain_trace

from servelab.analyse.trace import ranks as R
from servelab.analyse.trace.load import load_capture
from servelab.analyse.trace.ops import prepare_rank


@pytest.fixture(scope="module")
def h200(h200x2: Path, tmp_path_factory: pytest.TempPathFactory):
    d = h200x2 / "traces"
    return load_capture(d, cache_dir=tmp_path_factory.mktemp("c"))


def _shifted(trace, shift_ns: int, node: str, **ident):
    ev = trace.events.with_columns(pl.col("ts_ns") + shift_ns)
    return dataclasses.replace(trace, frame=ev,
                               identity=dataclasses.replace(trace.identity, node=node, **ident))


def test_single_node_alignment_is_tight(h200):
    rops = [prepare_rank(t) for t in h200.ranks]
    al = R.align_ranks(rops)
    assert al.alignment_ok
    assert al.offsets_ns == {0: 0, 1: 0}            # one node: nothing is shifted
    assert al.residual_us < 5                        # both ranks read one clock
    m = al.matches.row(0, named=True)
    assert m["matches"] == 656 and m["shift"] == 0   # every all-reduce kernel matched


def test_node_clock_offset_is_recovered(h200):
    """Rank 1 moved to a 'node' whose clock runs 5.123 ms ahead: the node offset comes back within 5 µs
    and the aligned step skew equals the unshifted one."""
    base = [prepare_rank(t) for t in h200.ranks]
    shift = 5_123_000
    moved = [prepare_rank(dataclasses.replace(h200.ranks[0], identity=dataclasses.replace(
        h200.ranks[0].identity, node="nodeA"))), prepare_rank(_shifted(h200.ranks[1], shift, "nodeB"))]
    al = R.align_ranks(moved)
    assert al.alignment_ok
    assert abs(al.offsets_ns[1] - shift) < 5_000 and al.offsets_ns[0] == 0
    skew_moved = R.step_skew(moved, al)
    skew_base = R.step_skew(base, R.align_ranks(base))
    diff = (skew_moved["end_skew_us"] - skew_base["end_skew_us"]).abs().max()
    assert diff < 10


def test_unmatched_noise_is_flagged(h200):
    """Jitter the comm kernels of one rank by ±2 ms: the match spread explodes; across nodes alignment is
    refused, on one node (shared clock) it is kept but the note says the kernels do not end together."""
    rnd = random.Random(7)
    t1 = h200.ranks[1]
    ev = t1.events.with_row_index("_i")
    is_comm = (pl.col("cat") == "kernel") & pl.col("name").cast(pl.String).str.starts_with("nccl")
    idx = ev.filter(is_comm)["_i"].to_list()
    noise = {i: rnd.randint(-2_000_000, 2_000_000) for i in idx}
    ev = ev.with_columns(pl.col("ts_ns") + pl.col("_i").replace_strict(noise, default=0)).drop("_i")
    noisy = dataclasses.replace(t1, frame=ev)
    same_node = R.align_ranks([prepare_rank(h200.ranks[0]), prepare_rank(noisy)])
    assert same_node.alignment_ok and same_node.offsets_ns == {0: 0, 1: 0}
    assert any("disagrees" in n for n in same_node.notes)
    other_node = dataclasses.replace(noisy, identity=dataclasses.replace(noisy.identity, node="nodeB"))
    al = R.align_ranks([prepare_rank(h200.ranks[0]), prepare_rank(other_node)])
    assert not al.alignment_ok and any("unreliable" in n for n in al.notes)


def test_step_skew_matches_plain_json(h200x2: Path, h200):
    """End skew per step = |GPU end of rank 0 − rank 1| from Kineto's gpu_user_annotation spans."""
    ends = []
    for f in ("20261129203606-TP-0.trace.json.gz", "20261129203606-TP-1.trace.json.gz"):
        doc = plain_trace(h200x2 / "traces" / f)
        b = doc["baseTimeNanoseconds"]
        ends.append({e["name"]: b + round((e["ts"] + e["dur"]) * 1000) for e in doc["traceEvents"]
                     if e.get("cat") == "gpu_user_annotation" and not e["name"].startswith("nccl")})
    rops = [prepare_rank(t) for t in h200.ranks]
    sk = R.step_skew(rops, R.align_ranks(rops))
    assert sk.height == 41
    for row in sk.iter_rows(named=True):
        want = abs(ends[0][row["name"]] - ends[1][row["name"]]) / 1e3
        assert row["end_skew_us"] == pytest.approx(want, abs=0.005), row["name"]


def test_no_fixed_slow_rank_on_h200_but_an_injected_one_is_found(h200):
    rops = [prepare_rank(t) for t in h200.ranks]
    al = R.align_ranks(rops)
    cs = R.collective_skew(rops, al)
    assert cs["collectives"].to_list() == [656, 656]
    assert R.slow_rank(cs, R.step_skew(rops, al), 2)["slow_rank"] is None
    # rank 1 delayed by 300 µs before every all-reduce: it arrives last everywhere
    t1 = h200.ranks[1]
    ev = t1.events.with_columns(
        pl.when((pl.col("cat") == "kernel") & pl.col("name").cast(pl.String).str.starts_with("nccl"))
        .then(pl.col("ts_ns") + 300_000).otherwise(pl.col("ts_ns")).alias("ts_ns"))
    slow = [rops[0], prepare_rank(dataclasses.replace(t1, frame=ev))]
    cs2 = R.collective_skew(slow, R.align_ranks(slow))
    verdict = R.slow_rank(cs2, None, 2)
    assert verdict["slow_rank"] == 1 and "arrives last" in verdict["evidence"]


def _skew_by_definition(rops, al) -> pl.DataFrame:
    """Collective skew one collective at a time, in plain Python: the k-th kernel of a family on the reference rank
    and each matched rank's kernel for it (its order shift applied); the last to start is the first of the latest
    in the order reference, then matched ranks."""
    seqs = {r.rank: R.comm_seq(r) for r in rops}
    starts: dict[tuple, dict[int, int]] = {}
    for row in al.matches.filter(~pl.col("sendrecv")).iter_rows(named=True):
        fam, ref, rk, s = row["family"], row["ref_rank"], row["rank"], row["shift"]
        a = seqs[ref].filter(pl.col("family") == fam)["ts_ns"].to_list()
        b = seqs[rk].filter(pl.col("family") == fam)["ts_ns"].to_list()
        ia0, ib0 = (0, s) if s >= 0 else (-s, 0)
        for i in range(min(len(a) - ia0, len(b) - ib0)):
            starts.setdefault((fam, ref, ia0 + i), {ref: a[ia0 + i] - al.offsets_ns[ref]})[rk] = \
                b[ib0 + i] - al.offsets_ns[rk]
    late = {r.rank: [] for r in rops}
    last = {r.rank: 0 for r in rops}
    caused = {r.rank: 0.0 for r in rops}
    both = [d for d in starts.values() if len(d) > 1]
    for d in both:
        t0 = min(d.values())
        lr = max(d, key=d.get)
        last[lr] += 1
        caused[lr] += (d[lr] - t0) / 1e6
        for rk, t in d.items():
            late[rk].append((t - t0) / 1e3)
    return pl.DataFrame([{"rank": rk, "collectives": len(v), "late_p50_us": float(np.median(v)),
                          "late_mean_us": float(np.mean(v)), "last_arrival_pct": 100 * last[rk] / len(both),
                          "wait_caused_ms": caused[rk]} for rk, v in late.items()]).sort("rank")


def test_collective_skew_is_the_per_collective_definition(h200):
    """Four ranks — the real pair and two copies whose all-reduce kernels start up to 80 µs late at random (ties
    with the reference kept on some) — give the per-collective plain-Python table: the same counts and last-arrival
    shares, the same latenesses to 1e-12 (sums in another order)."""
    rng = random.Random(36)
    rops = [prepare_rank(t) for t in h200.ranks]
    for k, t in enumerate(h200.ranks):
        nccl = (pl.col("cat") == "kernel") & pl.col("name").cast(pl.String).str.starts_with("nccl")
        delay = pl.Series([rng.choice([0, 0, rng.randrange(80_000)]) for _ in range(t.events.height)])
        ev = t.events.with_columns(pl.when(nccl).then(pl.col("ts_ns") + delay).otherwise(pl.col("ts_ns")))
        rops.append(prepare_rank(dataclasses.replace(t, frame=ev, identity=dataclasses.replace(t.identity,
                                                                                                rank=k + 2))))
    al = R.align_ranks(rops)
    got, want = R.collective_skew(rops, al), _skew_by_definition(rops, al)
    assert got["collectives"].to_list() == want["collectives"].to_list() == [656] * 4
    assert got.select("rank", "collectives", "last_arrival_pct").equals(
        want.select("rank", "collectives", "last_arrival_pct"))
    assert got["last_arrival_pct"].sum() == pytest.approx(100)
    for c in ("late_p50_us", "late_mean_us", "wait_caused_ms"):
        assert ((got[c] - want[c]).abs() <= 1e-12 * want[c].abs()).all(), c


def _numbered(r, drop: int = 0):
    """The rank with sequence numbers on its collective kernels (0, 1, 2 … in start order, as PyTorch numbers a
    group's collectives), the first ``drop`` of them removed (a profiler that started late on this rank)."""
    comm = (pl.col("cls") == "communication") & pl.col("cat").is_in(list(R.KERNEL_CATS))
    ops = r.ops.sort("ts_ns").with_columns(
        pl.when(comm).then(comm.cast(pl.Int64).cum_sum() - 1).otherwise(None).alias("seq"))
    return dataclasses.replace(r, ops=ops.filter(~(comm & (pl.col("seq") < drop))))


def test_a_rank_that_lost_its_first_collectives_is_paired_by_sequence_number(h200):
    """Rank 1 of the real pair lost its first three all-reduces; with sequence numbers both the matching and the
    skew pair collective k of rank 0 with collective k of rank 1 — the skew is that of the 653 collectives both
    have, computed here from their starts (paired by position, every collective would be three off)."""
    full = [prepare_rank(t) for t in h200.ranks]
    lost = [_numbered(full[0]), _numbered(full[1], drop=3)]
    al = R.align_ranks(lost)
    assert al.matches["matches"].to_list() == [653]
    got = R.collective_skew(lost, al)
    seq = [R.comm_seq(r) for r in lost]
    t = np.column_stack([seq[0]["ts_ns"].to_numpy()[3:] - al.offsets_ns[0], seq[1]["ts_ns"].to_numpy() -
                         al.offsets_ns[1]])
    assert (seq[1]["seq"].to_numpy() == np.arange(3, 656)).all()
    gap = (t - t.min(axis=1, keepdims=True)) / 1e3
    last = t.argmax(axis=1)
    assert got["collectives"].to_list() == [653, 653]
    for j in (0, 1):
        row = got.row(j, named=True)
        assert row["late_p50_us"] == pytest.approx(float(np.median(gap[:, j])), rel=1e-12)
        assert row["late_mean_us"] == pytest.approx(float(np.mean(gap[:, j])), rel=1e-12)
        assert row["last_arrival_pct"] == pytest.approx(100 * float((last == j).mean()), rel=1e-12)


def test_pp_both_stages_busy_matches_interval_arithmetic(h200x2: Path, h200):
    """Label the two ranks as PP stages 0 and 1 and check both-busy / bubble against a plain-Python
    computation over the common wall window."""
    staged = [dataclasses.replace(t, identity=dataclasses.replace(t.identity, tp=0, pp=i))
              for i, t in enumerate(h200.ranks)]
    rops = [prepare_rank(t) for t in staged]
    pp = R.pp_overlap(rops, R.align_ranks(rops))
    unions, lo, hi = [], [], []
    for f in ("20261129203606-TP-0.trace.json.gz", "20261129203606-TP-1.trace.json.gz"):
        doc = plain_trace(h200x2 / "traces" / f)
        b = doc["baseTimeNanoseconds"]
        iv = sorted((b + round(e["ts"] * 1000), b + round(e["ts"] * 1000) + round(e["dur"] * 1000))
                    for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
        lo.append(iv[0][0])
        hi.append(max(e for _, e in iv))
        u = []
        for s, e in iv:
            if u and s <= u[-1][1]:
                u[-1][1] = max(u[-1][1], e)
            else:
                u.append([s, e])
        unions.append(u)
    w0, w1 = max(lo), min(hi)

    def clip(u):
        return [(max(s, w0), min(e, w1)) for s, e in u if min(e, w1) > max(s, w0)]

    a, c = clip(unions[0]), clip(unions[1])
    both = 0
    i = j = 0
    while i < len(a) and j < len(c):
        both += max(0, min(a[i][1], c[j][1]) - max(a[i][0], c[j][0]))
        if a[i][1] < c[j][1]:
            i += 1
        else:
            j += 1
    wall = w1 - w0
    row = pp.filter(pl.col("stage") == "all").row(0, named=True)
    assert row["both_busy_pct"] == pytest.approx(100 * both / wall, abs=1e-6)
    s0 = pp.filter(pl.col("stage") == "0").row(0, named=True)
    assert s0["bubble_pct"] == pytest.approx(100 - 100 * sum(e - s for s, e in a) / wall, abs=1e-6)
    assert R.pp_overlap([prepare_rank(t) for t in h200.ranks]).height == 0   # no PP identity → no table


def test_hta_rank_pair_matching_is_flagged(thirdparty: Path, tmp_path: Path):
    """HTA's two sampled ranks of a 128-rank job: their SendRecv kernels talk to different peers, so the
    end-time matching scatters and the analysis says so (one node: nothing is shifted)."""
    d = tmp_path / "pair"
    d.mkdir()
    for i in (0, 1):
        shutil.copyfile(thirdparty / f"hta/trace_filter/sampled_rank-{i}.json.gz", d / f"sampled_rank-{i}.json.gz")
    cap = load_capture(d, cache=False)
    assert [t.identity.world_size for t in cap.ranks] == [128, 128]
    rops = [prepare_rank(t) for t in cap.ranks]
    al = R.align_ranks(rops)
    assert al.matches["matches"].to_list() == [10]
    assert al.offsets_ns == {0: 0, 1: 0} and any("disagrees" in n for n in al.notes)
    sk = R.step_skew(rops, al)
    assert sk["name"].to_list() == ["ProfilerStep#551", "ProfilerStep#552"]
    assert R.slow_rank(R.collective_skew(rops, al), sk, 2)["slow_rank"] is None   # 2 steps are too few


# ------------------------------------------------------------------ the real PP2 capture (data/samples)

@pytest.fixture(scope="module")
def pp2(samples: Path, tmp_path_factory: pytest.TempPathFactory):
    d = samples / "h200x2-pp2" / "traces"
    if not d.is_dir():
        pytest.skip("data/samples/h200x2-pp2/traces is absent")
    return load_capture(d, cache_dir=tmp_path_factory.mktemp("pp"))


def test_pp2_identity_and_stage_overlap(pp2):
    """TP1 × PP2 on 2 × H200: stage identity from the file names; both-stages-busy and the bubbles against
    a plain-Python interval computation over the JSON."""
    assert [(t.identity.tp, t.identity.pp) for t in pp2.ranks] == [(0, 0), (0, 1)]
    rops = [prepare_rank(t) for t in pp2.ranks]
    al = R.align_ranks(rops)
    assert al.offsets_ns == {0: 0, 1: 0} and al.alignment_ok          # one node: one clock, nothing shifted
    assert any("SendRecv" in n for n in al.notes)                       # and it says why the estimate is off
    pp = R.pp_overlap(rops, al, compute_only=True)
    unions, lo, hi = [], [], []
    for t in pp2.ranks:
        doc = plain_trace(t.path)
        b = doc["baseTimeNanoseconds"]
        ops = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        lo.append(min(b + round(e["ts"] * 1000) for e in ops))
        hi.append(max(b + round(e["ts"] * 1000) + round(e["dur"] * 1000) for e in ops))
        comp = sorted((b + round(e["ts"] * 1000), b + round(e["ts"] * 1000) + round(e["dur"] * 1000))
                      for e in ops if e["cat"] == "kernel" and not e["name"].startswith("nccl"))
        u = []
        for s, e in comp:
            if u and s <= u[-1][1]:
                u[-1][1] = max(u[-1][1], e)
            else:
                u.append([s, e])
        unions.append(u)
    w0, w1 = max(lo), min(hi)
    a = [(max(s, w0), min(e, w1)) for s, e in unions[0] if min(e, w1) > max(s, w0)]
    c = [(max(s, w0), min(e, w1)) for s, e in unions[1] if min(e, w1) > max(s, w0)]
    both = sum(max(0, min(x[1], y[1]) - max(x[0], y[0])) for x in a for y in c)
    row = pp.filter(pl.col("stage") == "all").row(0, named=True)
    assert row["both_busy_pct"] == pytest.approx(100 * both / (w1 - w0), abs=1e-6)
    for st, u in (("0", a), ("1", c)):
        got = pp.filter(pl.col("stage") == st).row(0, named=True)
        assert got["bubble_pct"] == pytest.approx(100 - 100 * sum(e - s for s, e in u) / (w1 - w0), abs=1e-6)


def test_pp2_questions_know_about_stages(pp2):
    from servelab.analyse.trace.actions import evidence_actions
    from servelab.analyse.trace.analysis import analyse
    from servelab.analyse.trace.questions import ten_questions
    a = analyse(pp2)
    assert a.step_skew.height == 0                                   # stages are not compared with each other
    q = {r["id"]: r for r in ten_questions(a).iter_rows(named=True)}
    assert not q["Q6"]["answerable"] and "pipeline stage" in q["Q6"]["evidence"]
    assert q["Q7"]["answerable"] and q["Q7"]["answer"] == "no slow pipeline stage"   # judged per stage
    assert "SendRecv" in q["Q2"]["evidence"] and "pipeline wait" in q["Q2"]["evidence"]
    tp_row = evidence_actions(a).row(0, named=True)
    assert tp_row["status"] == "not triggered" and "SendRecv wait" in tp_row["measured"]
    sr = a.nccl.filter(pl.col("collective") == "SendRecv")
    assert set(sr["msg_bytes"].to_list()) == {262144, 16777216}      # bf16 [32,1,4096] and [1,2048,4096]
    assert (sr["busbw_best_gbps"] == sr["algbw_best_gbps"]).all()     # SendRecv factor 1
