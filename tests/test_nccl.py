"""Phase 5: nccl-tests and NCCL INFO parsing on the real 2 x H200 logs, the transport gate, the runner's
argv/launcher handling, and the model's message sizes on the measured curves."""
from __future__ import annotations

import re
import stat
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from servelab.deploy.hosts import LocalHost
from servelab.deploy.nccl_gate import GateRefused, check_gate, enforce_gate, validate_gate
from servelab.deploy.nccl_info import classify_transport, parse_info, transport_table
from servelab.analyse.nccl.msgsize import from_trace, model_message_sizes, place_on_curves
from servelab.analyse.nccl.perf_log import parse_log, parse_run, runs_frame, runs_table
from servelab.deploy.spec import Node
from servelab.measure.nccl_tests import PlanSettings, execute, launch_argv, perf_argv, plan_runs


@pytest.fixture(scope="module")
def h200(h200x2) -> Path:
    return h200x2


def _rows_of(text: str, marker: str) -> list[list[str]]:
    """Data rows of one run, read with a plain split (independent of the parser)."""
    part = text.split(marker, 1)[1].split("# Avg bus bandwidth", 1)[0]
    return [l.split() for l in part.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\w+", l)]


# ---------------------------------------------------------------- nccl-tests output

def test_real_nccl_tests_log_all_five_collectives(h200):
    text = (h200 / "nccl_tests.log").read_text()
    runs = parse_log(text)
    assert [r.collective for r in runs] == ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"]
    for r in runs:
        assert r.status == "ok" and r.nranks == 2 and r.version == "2.19.6" and r.nccl_library == "22809"
        assert list(r.devices.gpu) == ["NVIDIA H200", "NVIDIA H200"]
        assert sorted(r.rows.size_bytes.unique()) == [8192 * 2 ** k for k in range(16)] == r.expected_sizes
        # nccl-tests' own footer is the mean of every busbw it printed (out-of-place and in-place)
        assert r.rows.busbw_gbps.mean() == pytest.approx(r.avg_busbw_gbps, abs=0.01)
        plain = _rows_of(text, f"Collective test starting: {r.collective}_perf")
        got = r.rows[r.rows.placement == "in-place"].set_index("size_bytes")
        for row in plain:
            assert got.loc[int(row[0]), "time_us"] == float(row[9]) and got.loc[int(row[0]), "busbw_gbps"] == float(row[11])
    a2a = runs[3].rows
    assert a2a[a2a.placement == "in-place"].wrong.isna().all()           # N/A: not validated
    assert (a2a[a2a.placement == "out-of-place"].wrong == 0).all()
    table = runs_table(runs)
    assert table.set_index("collective").loc["all_reduce", "peak_busbw_gbps"] == 301.10


def test_info_lines_interleaved_in_table_rows_are_cut_out(h200):
    text = (h200 / "nccl_info.log").read_text()
    [run] = parse_log(text)
    assert run.status == "ok" and run.info_lines > 800
    assert sorted(run.rows.size_bytes.unique()) == [8192 * 4 ** k for k in range(7)]
    assert len(run.rows) == 14 and run.avg_busbw_gbps == 75.1444
    assert run.rows.busbw_gbps.mean() == pytest.approx(75.1444, abs=0.01)
    big = run.rows[(run.rows.size_bytes == 33554432)].set_index("placement")
    assert big.loc["out-of-place", "busbw_gbps"] == 241.20 and big.loc["in-place", "busbw_gbps"] == 243.89


def test_truncated_failed_and_wrong_runs_say_why(h200):
    text = (h200 / "nccl_tests.log").read_text()
    first = text.split("# Collective test concluded: all_reduce_perf", 1)[0]
    cut = first.split("     4194304")[0]                             # stop after 2 MB: 9 of 16 sizes
    r = parse_run(cut)
    assert r.status == "truncated"
    assert "no '# Avg bus bandwidth' footer" in r.reason and "last size 2097152 B" in r.reason
    assert "7 of 16 expected sizes missing" in r.reason
    f = parse_run(cut, exit_code=1)
    assert f.status == "failed" and "exit code 1" in f.reason
    f2 = parse_run(cut + "vm: Test NCCL failure common.cu:1005 'unhandled cuda error'\n")
    assert f2.status == "failed" and "Test NCCL failure" in f2.reason
    bad = re.sub(r"(\n\s+65536\s+16384\s+float\s+sum\s+-1\s+\S+\s+\S+\s+\S+\s+)0", r"\g<1>3", first + "\n")
    w = parse_run(bad)
    assert w.status == "wrong results" and "65536" in w.reason
    assert parse_run("").status == "truncated"


# ---------------------------------------------------------------- NCCL INFO

def test_real_info_log(h200):
    text = (h200 / "nccl_info.log").read_text()
    info = parse_info(text)
    assert info.version == "2.28.9+cuda13.0" and info.nnodes == 1
    assert list(info.ranks["rank"]) == [0, 1] and list(info.ranks.cuda_dev) == [0, 1]
    assert set(info.ranks.host) == {"vm"} and info.ranks.complete.all()
    n_channel_lines = len(re.findall(r"NCCL INFO Channel \d+/\d+ : \d+\[\d+\] -> \d+\[\d+\] via", text))
    assert len(info.channels) == n_channel_lines == 48
    assert set(info.channels.transport) == {"P2P/direct"} and not info.channels.gdrdma.any()
    assert info.network == {"vm:1499": "Socket"}
    assert "NET/IB : No device found." in info.notes
    tu = info.tuning.set_index("bytes")
    assert tu.loc[8192, "calls"] == text.count("AllReduce: 8192 Bytes -> ")
    assert (tu.loc[tu.index <= 1048576, "proto"] == "LL").all() and (tu.loc[tu.index > 1048576, "proto"] == "SIMPLE").all()
    t = transport_table(info)
    assert list(t.transports) == ["P2P/direct ×24", "P2P/direct ×24"] and (t.net_connections == 0).all()


def test_classify_transport_strings():
    assert classify_transport("NET/IB/0/GDRDMA") == ("NET/IB", True, 0)
    assert classify_transport("NET/IB/5/GDRDMA/Shared") == ("NET/IB", True, 5)
    assert classify_transport("NET/Socket/1") == ("NET/Socket", False, 1)
    assert classify_transport("P2P/CUMEM/read") == ("P2P/CUMEM", False, None)
    assert classify_transport("P2P/IPC") == ("P2P/IPC", False, None)
    assert classify_transport("P2P/direct pointer") == ("P2P/direct", False, None)
    assert classify_transport("SHM/direct/direct") == ("SHM", False, None)


# ---------------------------------------------------------------- the gate

TWO_RAIL_GATE = {"required_hcas": ["mlx5_0", "mlx5_3"], "require": ["NET/IB", "GDRDMA"]}


def test_gate_refuses_the_real_single_node_log_and_says_what_it_found(h200):
    info = parse_info((h200 / "nccl_info.log").read_text())
    v = check_gate(TWO_RAIL_GATE, info)
    assert not v.passed and v.verdict == "REFUSED"
    assert "no NET channel in any rank (only P2P/direct ×48)" in v.message
    assert "NET/IB : No device found." in v.message and "network module loaded: Socket" in v.message
    assert "rank 0 (vm, cudaDev 0): P2P/direct ×24" in v.message and "rank 1 (vm, cudaDev 1)" in v.message
    with pytest.raises(GateRefused, match="REFUSED"):
        enforce_gate(TWO_RAIL_GATE, info)
    none = check_gate({}, info)
    assert none.passed and not none.configured and none.verdict == "no gate configured"


def _multinode_log(gdr: bool = True, hcas_b: tuple[str, ...] = ("mlx5_0", "mlx5_3"), socket: bool = False,
                   ranks: tuple[int, ...] = (0, 1, 2, 3)) -> str:
    """A 2-node x 2-GPU INFO log CONSTRUCTED from NCCL's format strings (src/init.cc, src/transport/net.cc,
    src/transport/net_ib) — no real multi-node INFO log was available to copy (see the report)."""
    out = []
    for host, pid, base in (("nodeA", 100, 0), ("nodeB", 200, 2)):
        names = ("mlx5_0", "mlx5_3") if host == "nodeA" else hcas_b
        using = " ".join(f"[{i}]{n}:1/RoCE" for i, n in enumerate(names))
        for dev in (0, 1):
            rank = base + dev
            if rank not in ranks:
                continue
            p = f"{host}:{pid}:{pid + 10 + dev} [{dev}] NCCL INFO"
            out.append(f"{p} NET/IB : Using {using} [RO]; OOB eth0:192.0.2.{base + 1}<0>")
            out.append(f"{p} Using network {'Socket' if socket else 'IB'}")
            out.append(f"{p} ncclCommInitRankConfig comm 0x{rank:x}0 rank {rank} nranks 4 cudaDev {dev} nvmlDev {dev} "
                       f"busId {dev}000 commId 0xabc - Init COMPLETE")
            peer = (rank + 2) % 4
            nic = dev % len(names)
            via = f"NET/Socket/{nic}" if socket else f"NET/IB/{nic}" + ("/GDRDMA" if gdr else "")
            out.append(f"{p} Channel 00/0 : {rank}[{dev}] -> {peer}[{dev}] [send] via {via}")
            out.append(f"{p} Channel 00/0 : {peer}[{dev}] -> {rank}[{dev}] [receive] via {via}")
            out.append(f"{p} Channel 01/0 : {rank}[{dev}] -> {base + 1 - dev}[{1 - dev}] via P2P/CUMEM/read")
    return "\n".join(out) + "\n"


def test_gate_passes_and_refuses_constructed_multinode_logs():
    ok = check_gate(TWO_RAIL_GATE, parse_info(_multinode_log()))
    assert ok.passed and ok.message.startswith("PASS") and "4 rank(s) on 2 host(s)" in ok.message
    t = ok.per_rank.set_index("rank")
    assert t.loc[2, "hcas"] == "mlx5_0" and t.loc[3, "hcas"] == "mlx5_3" and (t.gdrdma_connections == 2).all()

    nogdr = check_gate(TWO_RAIL_GATE, parse_info(_multinode_log(gdr=False)))
    assert not nogdr.passed and "8 of 8 NET/IB channel(s) lack GDRDMA" in nogdr.message
    assert check_gate({"require": ["NET/IB"]}, parse_info(_multinode_log(gdr=False))).passed

    one_rail = check_gate(TWO_RAIL_GATE, parse_info(_multinode_log(hcas_b=("mlx5_0",))))
    assert not one_rail.passed and "host nodeB uses mlx5_0 on NET/IB, missing required mlx5_3" in one_rail.message

    sock = check_gate(TWO_RAIL_GATE, parse_info(_multinode_log(socket=True)))
    assert not sock.passed and "use NET/Socket instead of NET/IB" in sock.message

    missing = check_gate(TWO_RAIL_GATE, parse_info(_multinode_log(ranks=(0, 1, 2))))
    assert not missing.passed and "no INFO lines for rank(s) 3 of 4" in missing.message


def test_gate_config_is_validated():
    with pytest.raises(ValueError, match="did you mean 'required_hcas'"):
        validate_gate({"required_hca": ["mlx5_0"]})
    with pytest.raises(ValueError, match="unknown transport 'GDR'"):
        validate_gate({"require": ["GDR"]})
    assert validate_gate({"required_hcas": ["mlx5_0"]})["require"] == ["NET/IB"]


# ---------------------------------------------------------------- runner

def test_argv_and_launcher_template_substitute_per_element():
    argv = perf_argv("all_reduce", "/opt/nccl-tests/build", gpus=8)
    assert argv == ["/opt/nccl-tests/build/all_reduce_perf", "-b", "8K", "-e", "64M", "-f", "2", "-g", "8"]
    tpl = ["mpirun", "-np", "{nranks}", "-H", "{hosts}", "-x", "NCCL_IB_HCA={hca}", "{cmd}", "--tag={nnodes}"]
    got = launch_argv(perf_argv("alltoall", gpus=1), tpl, nnodes=2, ppn=8, hosts=["node 5", "node7"],
                      values={"hca": "mlx5_0,mlx5_3"})
    assert got[:7] == ["mpirun", "-np", "16", "-H", "node 5:8,node7:8", "-x", "NCCL_IB_HCA=mlx5_0,mlx5_3"]
    assert got[7:-1] == perf_argv("alltoall", gpus=1) and got[-1] == "--tag=2"
    assert launch_argv(["x"], ["srun", "-N", "{nnodes}"], nnodes=2) == ["srun", "-N", "2", "x"]
    with pytest.raises(ValueError, match=r"unknown placeholder '\{nprocs\}'"):
        launch_argv(["x"], ["mpirun", "-np", "{nprocs}"])
    with pytest.raises(ValueError, match="did you mean 'all_reduce'"):
        perf_argv("allreduce")


def test_execute_records_logs_and_verdicts(tmp_path, h200):
    """Stand-in binaries replay the recorded output (all_reduce) and die mid-table (all_gather); a missing binary
    fails with 127. Each run's log and record are written by the runner, the verdicts by the parser."""
    from servelab.analyse.nccl.sweep import load_sweep
    from servelab.deploy.hosts import ProcessTracker
    text = (h200 / "nccl_tests.log").read_text()
    ar = text.split("# Collective test concluded: all_reduce_perf", 1)[0] + "# Collective test concluded: all_reduce_perf\n"
    ag = text.split("# Collective test starting: all_gather_perf", 1)[1].split("     1048576")[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body, code in (("all_reduce_perf", ar, 0), ("all_gather_perf", "# Collective test starting: all_gather_perf"
                                                                              + ag, 1)):
        (bin_dir / f"{name}.txt").write_text(body)
        script = bin_dir / name
        script.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write(open({str(bin_dir / (name + '.txt'))!r}).read())\n"
                          f"sys.stdout.write(' '.join(sys.argv[1:]) + '\\n')\nsys.exit({code})\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    plan = plan_runs([Node("local", gpus=2)], str(bin_dir), PlanSettings(["all_reduce", "all_gather", "sendrecv"], sweep=[],
                                                                         repeats=1, p2p_matrix=False, env_check=False))
    (bin_dir / "sendrecv_perf").unlink(missing_ok=True)
    seen = []
    with ProcessTracker() as tracker:
        res = execute(plan, {"local": LocalHost()}, tmp_path / "out", tracker, on_result=seen.append)
    assert [r.exit_code for r in res] == [0, 1, 127] and len(seen) == 3
    assert res[0].run.argv == [str(bin_dir / "all_reduce_perf"), "-b", "8K", "-e", "64M", "-f", "2", "-g", "2"]
    assert (tmp_path / "out" / res[0].log).read_text().endswith("-b 8K -e 64M -f 2 -g 2\n")
    data = load_sweep(tmp_path / "out")
    assert list(data.runs.status) == ["ok", "failed", "failed"]
    assert "exit code 1" in data.runs.reason[1] and "exit code 127" in data.runs.reason[2]


# ---------------------------------------------------------------- message sizes

def test_model_sizes_on_the_real_curves(h200):
    curves = runs_frame(parse_log((h200 / "nccl_tests.log").read_text()))
    sizes = model_message_sizes(4096, 2, {"decode": 32, "prefill": 4096, "huge": 1 << 20}, tp=2, num_layers=8,
                                vocab_size=32000, sequences_per_step={"prefill": 1})
    ar = sizes[sizes.collective == "all_reduce"].set_index("scenario")
    assert ar.loc["decode", "msg_bytes"] == 32 * 4096 * 2 and ar.loc["decode", "calls_per_step"] == 16
    ag = sizes[sizes.collective == "all_gather"].set_index("scenario")
    assert ag.loc["prefill", "msg_bytes"] == 32000 * 2 and ag.loc["decode", "msg_bytes"] == 32 * 32000 * 2
    placed = place_on_curves(sizes, curves).set_index(["scenario", "collective"])
    # 262144 B is a measured point of the real all-reduce: the value is that row's (16.66 GB/s, 15.73 us)
    assert placed.loc[("decode", "all_reduce"), "busbw_gbps"] == pytest.approx(16.66)
    assert placed.loc[("decode", "all_reduce"), "step_time_us"] == pytest.approx(16 * 15.73)
    # 64000 B lies between 32768 and 65536 of all_gather: log-linear interpolation by hand
    lo, hi = 0.85, 1.74
    frac = (np.log2(64000) - 15) / 1.0
    assert placed.loc[("prefill", "all_gather"), "busbw_gbps"] == pytest.approx(lo + frac * (hi - lo))
    assert np.isnan(placed.loc[("huge", "all_reduce"), "busbw_gbps"])     # 8 GiB: never extrapolated
    assert not placed.loc[("huge", "all_reduce"), "in_measured_range"]


def test_sizes_from_trace_collectives():
    tr = pd.DataFrame({"collective": ["AllReduce", "allreduce", "nccl:all_gather", "all_to_all"],
                       "msg_bytes": [262144, 262144, 1024, 4096]})
    got = from_trace(tr).set_index(["collective", "msg_bytes"])
    assert got.loc[("all_reduce", 262144), "calls_per_step"] == 2
    assert set(got.index.get_level_values(0)) == {"all_reduce", "all_gather", "alltoall"}
    with pytest.raises(ValueError, match="msg_bytes"):
        from_trace(pd.DataFrame({"collective": ["x"]}))


def test_cli_parse_and_gate_exit_codes(h200, capsys):
    from servelab.analyse.nccl.__main__ import main
    assert main(["parse", str(h200 / "nccl_tests.log")]) == 0
    assert "reduce_scatter" in capsys.readouterr().out
    assert main(["gate", "--hcas", "mlx5_0,mlx5_3", str(h200 / "nccl_info.log")]) == 3
    assert capsys.readouterr().out.startswith("REFUSED")
    assert main(["info", str(h200 / "nccl_info.log")]) == 0
    assert "P2P/direct ×24" in capsys.readouterr().out


def test_device_run_logs_8k_to_64m(samples):
    d = samples / "h200x2-device"
    if not (d / "nccl_tests_g2.log").exists():
        pytest.skip("device logs not in data/samples")
    runs = parse_log((d / "nccl_tests_g2.log").read_text())
    assert [r.collective for r in runs] == ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"]
    for r in runs:
        assert r.status == "ok" and r.expected_sizes == [8192 * 2 ** k for k in range(14)]
        assert sorted(r.rows.size_bytes.unique()) == r.expected_sizes
        assert r.rows.busbw_gbps.mean() == pytest.approx(r.avg_busbw_gbps, abs=0.01)
    info = parse_info((d / "nccl_info_g2.log").read_text())
    text = (d / "nccl_info_g2.log").read_text()
    assert len(info.channels) == len(re.findall(r"NCCL INFO Channel \d+/\d+ : .* via ", text))
    v = check_gate(TWO_RAIL_GATE, info)
    assert not v.passed and "no NET channel in any rank" in v.message


# --- real-world logs: any hostname, launcher tags, no init lines, old nccl-tests formats -------------------------

PUBLIC = Path(__file__).parent / "data" / "nccl_public"


def test_info_any_hostname_and_channels_without_init_lines_pass_the_gate():
    from servelab.deploy.nccl_gate import check_gate
    from servelab.deploy.nccl_info import parse_info
    head = (PUBLIC / "nccl707_a100_header.log").read_text()          # real: host 10-90-43-152, NCCL 2.7.6
    # channel lines in NCCL 2.7's format for that node (constructed: the issue excerpt kept here has none)
    chans = "".join(f"10-90-43-152:120890:121560 [{r}] NCCL INFO Channel 00 : {(r + 3) % 4}[0] -> {r}[0] [receive] "
                    f"via NET/IB/{r}/GDRDMA\n10-90-43-152:120890:121560 [{r}] NCCL INFO Channel 00 : {r}[0] -> "
                    f"{(r + 1) % 4}[0] [send] via NET/IB/{r}/GDRDMA\n" for r in range(4))
    info = parse_info(head + chans)
    assert info.version == "2.7.6+cuda11.1" and len(info.channels) == 8 and info.reason == ""
    assert sorted(info.channels["rank"].unique()) == [0, 1, 2, 3]
    assert set(info.channels.hca) == {"mlx5_8", "mlx5_9", "mlx5_10", "mlx5_11"}
    v = check_gate({"require": ["NET/IB", "GDRDMA"], "expected_ranks": 4}, info)
    assert v.passed, v.message
    assert any("no ncclCommInitRank" in n for n in info.notes)


def test_info_fqdn_host_and_mpirun_tag_prefix():
    from servelab.deploy.nccl_info import parse_info
    text = ("[1,0]<stdout>:gpu-node.cluster.local:4242:4300 [0] NCCL INFO ncclCommInitRank comm 0x55aa rank 0 nranks 2 "
            "cudaDev 0 busId 7000 - Init COMPLETE\n"
            "[1,0]<stdout>:gpu-node.cluster.local:4242:4300 [0] NCCL INFO Channel 00/0 : 0[7000] -> 1[7000] [send] "
            "via NET/IB/0/GDRDMA\n")
    info = parse_info(text)
    assert info.ranks.host.tolist() == ["gpu-node.cluster.local"] and info.channels["rank"].tolist() == [0]


def test_info_real_tagged_ibext_and_redacted_host_logs():
    from servelab.deploy.nccl_gate import check_gate
    from servelab.deploy.nccl_info import parse_info, transport_table
    info = parse_info((PUBLIC / "nccl1453_tagged_ibext.log").read_text())
    assert len(info.channels) == 6 and set(info.channels.transport) == {"NET/IB"} and info.channels.gdrdma.all()
    assert info.channels["rank"].unique().tolist() == [0]
    assert check_gate({"require": ["NET/IB", "GDRDMA"]}, info).passed
    red = parse_info((PUBLIC / "nccl952_redacted_host.log").read_text())
    assert sorted(transport_table(red)["rank"]) == [10, 12, 15]


def test_info_that_yields_nothing_says_why_in_one_line():
    from servelab.deploy.nccl_gate import check_gate
    from servelab.deploy.nccl_info import parse_info
    assert "empty" in parse_info("").reason
    r = parse_info("hello\nworld\n").reason
    assert "none of 2 line(s)" in r and "\n" not in r
    assert "ncclCommInitRank" in parse_info((PUBLIC / "nccl707_a100_header.log").read_text()).reason
    assert r in check_gate({"require": ["NET/IB"]}, parse_info("hello\nworld\n")).message


OLD_TABLE = """# nThread 1 nGpus 4 minBytes 8 maxBytes 32 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid 120890 on 10-90-43-152 device  0 [0x87] A100-SXM4-40GB
#   Rank  1 Pid 120890 on 10-90-43-152 device  1 [0x8d] A100-SXM4-40GB
#
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
10-90-43-152:120890:120890 [0] NCCL INFO Launch mode Group/CGMD
           8             2   float     sum    40.12    0.00    0.00  0e+00    39.80    0.00    0.00  0e+00
          16             4   float     sum    39.90    0.00    0.00  0e+00    40.01    0.00    0.00  0e+00
          32             8   float     sum    40.30    0.00    0.00  0e+00    40.22    0.00    0.00  0e+00
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.00123
#
"""


def test_old_nccl_tests_table_no_group_error_column_and_mpirun_tags():
    from servelab.analyse.nccl.perf_log import parse_log
    for text in (OLD_TABLE, "".join(f"[1,0]<stdout>:{line}\n" for line in OLD_TABLE.splitlines())):
        (run,) = parse_log(text)
        assert run.status == "ok", run.reason
        assert run.nranks == 2 and run.devices.host.tolist() == ["10-90-43-152"] * 2
        assert sorted(run.rows.size_bytes.unique()) == [8, 16, 32] and len(run.rows) == 6


def test_nccl_tests_1x_table_bytes_n_op_res():
    from servelab.analyse.nccl.perf_log import parse_log
    text = ("# nThread 1 nGpus 2 minBytes 8 maxBytes 16 step: 2(factor) warmup iters: 5 iters: 20 validation: 1\n"
            "#                                          out-of-place                    in-place\n"
            "#      bytes             N    type      op     time  algbw  busbw      res     time  algbw  busbw      res\n"
            "            8             2   float     sum    10.00   0.00   0.00    0e+00    10.00   0.00   0.00    0e+00\n"
            "           16             4   float     sum    10.00   0.00   0.00    0e+00    10.00   0.00   0.00    0e+00\n"
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 0.001\n")
    (run,) = parse_log(text)
    assert run.status == "ok" and run.rows.redop.unique().tolist() == ["sum"] and len(run.rows) == 4


def test_nccl_tests_step_factor_one_and_non_nccl_tests_input_are_one_line_errors():
    from servelab.analyse.nccl.perf_log import NcclTestsFormatError, parse_log
    with pytest.raises(NcclTestsFormatError, match="factor of 1"):
        parse_log("# nThread 1 nGpus 8 minBytes 8 maxBytes 8589934592 step: 1(factor) warmup iters: 5 iters: 20\n")
    with pytest.raises(NcclTestsFormatError, match="no '# nThread"):
        parse_log("Segmentation fault\n")
    with pytest.raises(NcclTestsFormatError, match="empty"):
        parse_log("")
