"""An engine on CPU read like a GPU capture: real SGLang 0.5.23 traces of two ranks (``data/samples/sglang-cpu-tp2``,
``data/samples/sglang-cpu-pp2``, see their READMEs) hold no GPU kernel — the forward's torch ops are the device work
and torch's gloo collectives the communication (``analyse.trace.ops.cpu_device_ops``)."""
from __future__ import annotations

import gzip
import json
from math import prod

import polars as pl
import pytest

from conftest import SAMPLES, read_only_copy
from servelab.analyse.trace import chunked as C, decode as D
from servelab.analyse.trace.analysis import analyse
from servelab.analyse.trace.questions import ten_questions


@pytest.fixture(scope="module")
def tp2():
    return read_only_copy(SAMPLES / "sglang-cpu-tp2")


@pytest.fixture(scope="module")
def tp2_analysis(tp2, tmp_path_factory):
    return analyse(tp2 / "traces", cache_dir=tmp_path_factory.mktemp("cache"))


def raw_gloo(path) -> list[dict]:
    return [e for e in json.load(gzip.open(path))["traceEvents"] if str(e.get("name", "")).startswith("gloo:")]


def test_gloo_collectives_get_their_collective_args_on_both_decode_paths(tp2):
    """Every ``gloo:*`` annotation gets collective, elements of its first input and dtype — from the compiled
    scanner and from msgspec alike, equal to the raw event's ``Input Dims`` / ``Input type``."""
    path = sorted((tp2 / "traces").glob("*TP-0*"))[0]
    raw = raw_gloo(path)
    want = sorted((e["name"][5:], prod(e["args"]["Input Dims"][0]), e["ts"]) for e in raw)
    assert {w[0] for w in want} == {"all_reduce", "all_gather", "broadcast"}
    frames = {"msgspec": D._parse_serial(path)[0]}
    if C._native is not None:
        text = gzip.open(path).read()
        start = text.index(b"[", text.index(b'"traceEvents"'))
        end = text.rindex(b"]")
        got = C._scan_slice(text[start:end + 1])
        assert got is not None
        frames["scanner"] = got[0]
    for how, f in frames.items():
        g = (f.filter(pl.col("name").cast(pl.String).str.starts_with("gloo:"))
             .select(pl.col("coll").cast(pl.String), "in_nelems", pl.col("dtype").cast(pl.String)))
        assert g.height == len(raw), how
        assert sorted(zip(g["coll"], g["in_nelems"])) == sorted((w[0], w[1]) for w in want), how
        assert set(g["dtype"]) == {"float", "long"}, how       # "long int" normalised for the size table


def test_device_work_is_the_forward_and_communication_is_gloo(tp2_analysis):
    a = tp2_analysis
    assert [r.device for r in a.rops] == ["cpu", "cpu"] and all(r.windows.height == 8 for r in a.rops)
    dec = a.breakdown.filter(pl.col("kind") == "decode")
    assert {"gemm", "attention", "memory", "communication"} <= set(dec["cls"])
    cbc = a.comm_by_collective.filter(pl.col("kind") == "decode")
    assert set(zip(cbc["rank"], cbc["collective"])) == {(0, "AllReduce"), (1, "AllReduce"), (0, "AllGather"),
                                                         (1, "AllGather")}
    # the forward thread waits while gloo works: nothing overlaps on CPU, and the page says exposed = comm
    ov = a.overlap_table()
    assert (ov["comm_ms"] > 0).all() and (ov["compute_ms"] > 0).all()
    assert ov["exposed_comm_ms"].to_list() == pytest.approx(ov["comm_ms"].to_list(), rel=0.05)


def test_sizes_and_bandwidths_follow_nccl_tests_definitions(tp2_analysis):
    """all_reduce of [3, 128] float: S = 3·128·4 B; all_gather of [3, 192] float per rank: S = the gathered output,
    3·192·4·2 B (world 2); busbw = algbw × 2(n−1)/n resp. (n−1)/n."""
    n = tp2_analysis.nccl.filter(pl.col("subclass") == "gloo")
    by = {r["collective"]: r for r in n.iter_rows(named=True)}
    assert by["AllReduce"]["msg_bytes"] == 3 * 128 * 4 and by["AllGather"]["msg_bytes"] == 3 * 192 * 4 * 2
    assert by["Broadcast"]["msg_bytes"] == 8 and by["AllReduce"]["group_size"] == 2
    r = by["AllReduce"]
    assert r["busbw_p50_gbps"] == pytest.approx(r["algbw_p50_gbps"] * 2 * (2 - 1) / 2)


def test_ranks_are_matched_on_their_collectives(tp2_analysis):
    m = tp2_analysis.alignment.matches
    fams = dict(zip(m["family"], m["matches"]))
    assert fams["AllReduce|gloo:all_reduce"] == 40 and fams["AllGather|gloo:all_gather"] == 8
    sk = tp2_analysis.collective_skew
    assert set(sk["rank"]) == {0, 1} and sk["collectives"].sum() == 2 * 56
    assert tp2_analysis.slow_rank["evidence"].startswith("most frequent last arrival: rank ")


def test_questions_speak_of_the_cpu(tp2_analysis):
    q = {r["id"]: r for r in ten_questions(tp2_analysis).iter_rows(named=True)}
    assert q["Q2"]["answerable"] and "gloo" in q["Q2"]["evidence"]
    assert not q["Q5"]["answerable"] and "no CUDA graphs" in q["Q5"]["evidence"]
    assert "GPU" not in q["Q4"]["answer"] and q["Q6"]["answerable"]


def test_pipeline_stages_send_and_receive_through_gloo(tmp_path):
    pp = read_only_copy(SAMPLES / "sglang-cpu-pp2")
    a = analyse(pp / "traces", cache_dir=tmp_path)
    assert [r.trace.identity.pp for r in a.rops] == [0, 1] and all(r.device == "cpu" for r in a.rops)
    cbc = a.comm_by_collective
    assert set(cbc["collective"]) == {"SendRecv"} and set(cbc["rank"]) == {0, 1}
    assert a.slow_rank["slow_stage"] in (0, 1)          # the per-stage view judges the stages


def test_pipeline_send_recv_between_steps_is_communication_of_the_step_it_delays(tmp_path):
    """SGLang's PP send/recv runs between the ``step[...]`` annotations; each is given the step it delays
    (docs/metrics.md#point-to-point), so Q2 reports it — the same number as the window summary and the
    per-collective table — and the slow-stage verdict sees the other stage's wait."""
    pp = read_only_copy(SAMPLES / "sglang-cpu-pp2")
    a = analyse(pp / "traces", cache_dir=tmp_path)
    for r in a.rops:
        comm = r.ops.filter(pl.col("cls") == "communication")
        assert comm.height and comm["window"].null_count() == 0 and comm["attributed"].all()
        assert r.ops.filter(pl.col("cls") != "communication")["attributed"].sum() == 0
    dec = a.summary.filter(pl.col("kind") == "decode")
    exposed = float(dec["exposed_comm_ms"].sum())
    assert exposed > 100                                  # ~1.2 s of the 1.8 s in this capture
    cbc = a.comm_by_collective
    assert float(cbc["exposed_ms"].sum()) == pytest.approx(exposed, rel=1e-6)
    assert float(a.overlap_table()["exposed_comm_ms"].sum()) == pytest.approx(exposed, rel=1e-3)
    q2 = {r["id"]: r for r in ten_questions(a).iter_rows(named=True)}["Q2"]
    assert q2["answerable"] and q2["answer"].startswith(f"decode: {exposed:,.2f} ms exposed")
    assert f"decode/SendRecv {exposed:.2f} ms" in q2["evidence"]
    st = a.slow_rank["stage"]
    assert a.slow_rank["slow_stage"] == 1 and st["wait_stage"] == 0 and st["wait_sendrecv_ms"] > 100


def test_a_cached_cpu_capture_is_still_read_as_cpu(tp2, tmp_path):
    """The prepared tables of each rank are cached; a second analysis reads them back, and knows the rank was CPU."""
    first = analyse(tp2 / "traces", cache_dir=tmp_path)
    again = analyse(tp2 / "traces", cache_dir=tmp_path)
    assert [r.device for r in first.rops] == [r.device for r in again.rops] == ["cpu", "cpu"]
    q = {r["id"]: r for r in ten_questions(again).iter_rows(named=True)}
    assert not q["Q5"]["answerable"] and "GPU" not in q["Q4"]["answer"]
