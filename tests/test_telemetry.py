"""Phase 2 telemetry: real sysstat runs on this machine, the real H200 nvidia-smi capture, the
documented-format DCGM/ethtool/RDMA samples, fail-closed behaviour, windows and summaries."""
from __future__ import annotations

import csv
import datetime as dt
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from contexts import phase_ctx  # noqa: E402
from servelab.deploy.hosts import LocalHost as BaseLocalHost
from servelab.measure.telemetry import collectors as C
from servelab.analyse.telemetry.frames import make_frame
from servelab.analyse.telemetry.load import load_case_telemetry
from servelab.analyse.telemetry.parse_dcgm import parse_dcgm_dmon
from servelab.analyse.telemetry.parse_net import (ethtool_rates, increments, parse_ethtool_blocks, parse_ethtool_s,
                                          parse_rdma_blocks, rdma_rates)
from servelab.analyse.telemetry.parse_smi import parse_smi_csv
from servelab.measure.telemetry.runner import (NOT_PRESENT, OK, PROBE_FAILED, NodePlan, RequiredCollectorError,
                                       read_statuses, start_telemetry)
from servelab.analyse.telemetry.summary import answer_questions, compare_cases, summarize_case, write_metric_csvs
from servelab.analyse.telemetry.windows import CaseWindow, coverage, slice_window

HAVE_SYSSTAT = all(shutil.which(b) for b in ("mpstat", "pidstat", "sar", "numastat"))
needs_sysstat = pytest.mark.skipif(not HAVE_SYSSTAT, reason="Debian package sysstat (and numactl) not installed")


# ---------------------------------------------------------------- the real local host, tracking its handles

class LocalHost(BaseLocalHost):
    """servelab.deploy.hosts.LocalHost that remembers every background handle (to prove none is left running)."""

    def __init__(self):
        super().__init__("local")
        self.handles = []

    def start(self, argv, log_path, env=None, cwd=None):
        h = super().start(argv, log_path, env=env, cwd=cwd)
        self.handles.append(h)
        return h


def _cpu_times(pid: int) -> float:
    """utime+stime of a process in seconds, straight from /proc (independent of sysstat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[float, float]:
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals[:8]) - idle, sum(vals[:8])


BUSY = ("import hashlib,sys,threading,time\n"
        "time.sleep(float(sys.argv[1]))\n"
        "end=time.time()+float(sys.argv[2])\n"
        "buf=b'x'*(1<<20)\n"
        "def spin():\n"
        "    while time.time()<end: hashlib.sha256(buf).digest()\n"
        "t=threading.Thread(target=spin,name='hot-worker'); t.start(); t.join()\n"
        "time.sleep(60)\n")


# ---------------------------------------------------------------- nvidia-smi (real H200 capture)

def test_smi_real_capture_matches_plain_csv_reading(h200x2):
    path = h200x2 / "smi.csv"
    df = parse_smi_csv(path.read_text(), "h200")
    rows = list(csv.reader(path.open(), skipinitialspace=True))
    assert df.attrs["bad_lines"] == 0
    # ground truth with the csv module and datetime, not the parser
    for gpu in ("0", "1"):
        mine = [r for r in rows if r[0] == gpu]
        got = df[(df.metric == "power_w") & (df.device == f"gpu{gpu}")]
        assert len(got) == len(mine) == 1505
        assert got.value.max() == pytest.approx(max(float(r[6]) for r in mine))
        assert df[(df.metric == "util_gpu_pct") & (df.device == f"gpu{gpu}")].value.max() == max(int(r[2]) for r in mine)
    first = dt.datetime.strptime(rows[0][1], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=dt.timezone.utc)
    assert df.ts_ns.min() == int(first.timestamp() * 1e6) * 1000
    free = df[df.metric == "mem_free_mib"].value.min()
    assert free == min(int(r[5]) - int(r[4]) for r in rows)


def test_smi_header_units_and_na_values_are_missing_not_zero():
    text = ("index, timestamp, utilization.gpu [%], utilization.memory [%], memory.used [MiB], memory.total [MiB], "
            "power.draw [W], temperature.gpu, clocks.current.sm [MHz], clocks.current.memory [MHz], pstate\n"
            "0, 2026/11/29 20:35:52.828, 85 %, 40 %, 4096 MiB, 143771 MiB, [N/A], 38, 1980 MHz, 3201 MHz, P2\n")
    df = parse_smi_csv(text, "n")
    assert df.attrs["bad_lines"] == 1           # the header line
    assert set(df.metric) >= {"util_gpu_pct", "mem_used_mib", "pstate"}
    assert "power_w" not in set(df.metric)      # [N/A] is absent, never 0
    assert df[df.metric == "pstate"].value.item() == 2
    assert df[df.metric == "util_gpu_pct"].value.item() == 85


# ---------------------------------------------------------------- real sysstat around a real workload

@needs_sysstat
@pytest.mark.slow                     # real sysstat collectors around a 7 s workload
def test_real_collectors_around_a_cpu_bound_process(tmp_path):
    host = LocalHost()
    spawn = time.time()
    child = subprocess.Popen([sys.executable, "-c", BUSY, "1.0", "6.0"])    # busy from ~1 s to ~7 s
    try:
        specs = [C.mpstat(1.0), C.sar_net(1.0), C.pidstat(child.pid, 1.0),
                 C.numastat(child.pid, 1.0, python=sys.executable),
                 C.nvidia_smi(1.0, required=False), C.dcgm_dmon(1.0, python=sys.executable),
                 C.rdma_counters(None, python=sys.executable)]
        if shutil.which("ethtool") and Path("/sys/class/net/eth0").exists():
            specs.append(C.ethtool_stats(["eth0"], 1.0, python=sys.executable))
        session = start_telemetry(tmp_path, [NodePlan(host, specs)], grace_s=0.3)
        time.sleep(max(0.0, spawn + 2.5 - time.time()))
        t0, cpu0, m0 = time.time_ns(), _cpu_times(child.pid), _machine_busy()
        time.sleep(3.0)                                                      # the window: ~2.5 s to ~5.5 s
        t1, cpu1, m1 = time.time_ns(), _cpu_times(child.pid), _machine_busy()
        time.sleep(max(0.0, spawn + 7.2 - time.time()))
        assert session.check() == []
        result = session.stop()
    finally:
        child.kill()
        child.wait()
    assert result.ok, result.failures
    st = {s.collector: s for s in read_statuses(tmp_path)}
    for name in ("mpstat", "sar-net", "pidstat", "numastat"):
        assert st[name].status == OK, st[name]
        assert (tmp_path / "telemetry" / st[name].raw_file).stat().st_size > 0
    if not shutil.which("nvidia-smi"):
        assert st["nvidia-smi"].status == NOT_PRESENT and "nvidia-smi" in st["nvidia-smi"].reason
    if not Path("/sys/class/infiniband").exists():
        assert st["rdma"].status == NOT_PRESENT and "/sys/class/infiniband" in st["rdma"].reason
    assert all(not host.is_running(h) for h in host.handles)       # nothing left behind

    window = CaseWindow("cpu_hot", t0, t1)
    case = load_case_telemetry(tmp_path, "cpu_hot", window)
    inside = slice_window(case.samples, window)
    # pidstat's view of the process against its own CPU time read from /proc
    expected_pct = 100 * (cpu1 - cpu0) / ((t1 - t0) / 1e9)
    got = inside[inside.metric == "proc_cpu_pct"]
    assert len(got) >= 2
    assert got.value.mean() == pytest.approx(expected_pct, abs=20)
    threads = inside[inside.metric == "thread_cpu_pct"].groupby("device").value.mean()
    assert threads.idxmax() != f"python[{child.pid}]"                  # the spinning thread, not the main one
    assert threads.max() == pytest.approx(expected_pct, abs=20)
    # mpstat's machine busy against /proc/stat deltas over the same window
    busy = 100 * (m1[0] - m0[0]) / (m1[1] - m0[1])
    assert inside[inside.metric == "cpu_busy_pct"].value.mean() == pytest.approx(busy, abs=20)
    assert set(inside[inside.metric == "core_busy_pct"].device) == {f"cpu{i}" for i in range(os.cpu_count())}
    cov = coverage(case.samples, window)
    assert cov[cov.source == "mpstat"].covered.all()
    assert not inside[inside.source == "numastat"].empty
    if "ethtool" in st:
        assert st["ethtool"].status == OK
        assert not case.counters.empty and set(case.counters.device) == {"eth0"}

    summary = summarize_case(case)
    row = summary[summary.metric == "util_gpu_pct"].iloc[0]
    if not shutil.which("nvidia-smi"):
        assert row.head_status == NOT_PRESENT and row.head_n == 0 and np.isnan(row.head_mean)
    paths = write_metric_csvs(summary, tmp_path / "phase")
    text = (tmp_path / "phase" / "case_util_gpu_pct_summary.csv").read_text()
    assert ",-," in text and NOT_PRESENT in text or shutil.which("nvidia-smi")
    assert any(p.name == "case_cpu_busy_pct_summary.csv" for p in paths)
    q = answer_questions(case)
    assert q.set_index("question").loc["Do all rails carry traffic, and are they balanced?", "answer"] == "-"


@needs_sysstat
def test_required_collector_missing_fails_closed_before_the_case(tmp_path):
    host = LocalHost()
    specs = [C.mpstat(1.0), C.CollectorSpec("gpu-tool", ["no-such-tool-xyz", "--loop"], "x.txt", "smi",
                                            required=True, requires=["no-such-tool-xyz"])]
    with pytest.raises(RequiredCollectorError) as err:
        start_telemetry(tmp_path, [NodePlan(host, specs)], grace_s=0.2)
    assert "gpu-tool" in str(err.value) and "no-such-tool-xyz" in str(err.value) and "not found" in str(err.value)
    st = {s.collector: s for s in read_statuses(tmp_path)}
    assert st["gpu-tool"].status == NOT_PRESENT and st["gpu-tool"].missing_binary == "no-such-tool-xyz"
    assert st["mpstat"].started
    assert all(not host.is_running(h) for h in host.handles)       # mpstat was stopped again


@needs_sysstat
@pytest.mark.slow                  # a real collector left to exit by itself (2 s)
def test_required_collector_exiting_early_invalidates_the_case(tmp_path):
    host = LocalHost()
    quitter = C.mpstat(1.0)
    quitter.argv = ["mpstat", "-P", "ALL", "1", "1"]                 # exits by itself after one sample
    session = start_telemetry(tmp_path, [NodePlan(host, [quitter, C.sar_net(1.0)])], grace_s=0.2)
    time.sleep(2.0)
    assert [s.collector for s in session.check()] == ["mpstat"]
    result = session.stop()
    assert not result.ok
    assert result.failures[0].startswith("local/mpstat: early exit")
    st = {s.collector: s for s in read_statuses(tmp_path)}
    assert st["mpstat"].early_exit and st["mpstat"].exit_code == 0 and st["sar-net"].status == OK
    with pytest.raises(RequiredCollectorError):
        session.stop(raise_on_failure=True)


def test_sampler_files_mode_exits_3_when_nothing_exists(tmp_path):
    spec = C.rdma_counters(["mlx5_9"], python=sys.executable)
    p = subprocess.run(spec.argv, capture_output=True, text=True, timeout=20)
    assert p.returncode == 3 and "no file exists" in p.stdout


@needs_sysstat
def test_probe_failure_of_a_required_collector_names_the_probe(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(RequiredCollectorError, match=f"probe `test -d /proc/{dead.pid}` exited 1"):
        start_telemetry(tmp_path, [NodePlan(LocalHost(), [C.pidstat(dead.pid, 1.0)])], grace_s=0.1)
    assert read_statuses(tmp_path)[0].status == PROBE_FAILED


# ---------------------------------------------------------------- documented-format samples

def test_dcgm_sample_stamped_and_plain(samples):
    text = (samples / "telemetry" / "dcgm_dmon.txt").read_text()
    df = parse_dcgm_dmon(text, "n0")
    assert df.attrs["na_values"] == 6                                 # NVLink N/A on GPU 1, 3 samples x 2
    sm = df[(df.metric == "dcgm_sm_active_pct") & (df.device == "gpu0")].value.tolist()
    assert sm == pytest.approx([91.3, 90.2, 91.7])
    nvl = df[(df.metric == "nvlink_tx_GBps")]
    assert set(nvl.device) == {"gpu0"} and nvl.value.iloc[0] == pytest.approx(101.23456789)
    plain = "\n".join(line.split(" ", 1)[1] if " " in line else "" for line in text.splitlines())
    with pytest.raises(ValueError, match="start_ns"):
        parse_dcgm_dmon(plain, "n0")
    est = parse_dcgm_dmon(plain, "n0", interval_s=1.0, start_ns=10**18)
    assert est.attrs["estimated_ts"]
    assert sorted(est[est.device == "gpu1"].ts_ns.unique()) == [10**18 + k * 10**9 for k in (1, 2, 3)]


def test_ethtool_mlx5_rates_and_pause_increments(samples):
    text = (samples / "telemetry" / "ethtool_mlx5_rails.txt").read_text()
    c = parse_ethtool_blocks(text, "n0")
    r = ethtool_rates(c)
    tx = r[r.metric == "eth_rx_gbps"].groupby("device").value.mean()
    # rx_bytes_phy grows by 8.75e9 (+800) bytes per second on eth0: ground truth by hand
    assert tx["eth0"] == pytest.approx((8_750_000_000 + 800) * 8 / 1e9, rel=1e-3)
    assert tx["eth3"] == pytest.approx((8_625_000_000 + 800) * 8 / 1e9, rel=1e-3)
    inc = increments(c)
    bad = inc[inc.increment > 0]
    assert list(zip(bad.device, bad.counter)) == [("eth3", "rx_prio3_pause"), ("eth3", "rx_prio3_pause_duration")]
    assert bad.iloc[0].increment == 36 and bad.iloc[0].kind == "pause"
    # a window covering only the first two samples sees one step of 12
    t = sorted(c.ts_ns.unique())
    assert increments(c, t[0], t[1]).set_index(["device", "counter"]).loc[("eth3", "rx_prio3_pause"), "increment"] == 12


def test_ethtool_real_virtio_output(samples):
    counters = parse_ethtool_s((samples / "telemetry" / "ethtool_virtio_eth0_real.txt").read_text())
    assert "rx_kicks" in counters and "tx_kicks" in counters and "NIC statistics" not in " ".join(counters)


def test_rdma_counters_are_4_byte_words(samples):
    c = parse_rdma_blocks((samples / "telemetry" / "rdma_counters_2rails.txt").read_text(), "n0")
    assert set(c.device) == {"mlx5_0:1", "mlx5_3:1"}
    r = rdma_rates(c)
    tx = r[r.metric == "rdma_tx_gbps"].groupby("device").value.mean()
    assert tx["mlx5_0:1"] == pytest.approx(70.0) and tx["mlx5_3:1"] == pytest.approx(69.0)
    inc = increments(c)
    errs = inc[(inc.kind == "error") & (inc.increment > 0)]
    assert list(zip(errs.device, errs.counter, errs.increment)) == [("mlx5_3:1", "out_of_sequence", 6.0)]
    cong = inc[inc.kind == "congestion"].set_index(["device", "counter"])
    assert cong.loc[("mlx5_0:1", "np_cnp_sent"), "increment"] == 15


# ---------------------------------------------------------------- windows and summaries (pure logic)

def _frame(node, metric, pts, interval_ns=0, source="x"):
    return make_frame([(node, source, metric, "d0", ts, v, interval_ns) for ts, v in pts])


def test_window_uses_interval_midpoints():
    s = 10**9
    # 1 s averages stamped at 1..6 s describe (0,1], (1,2] ...; window [2.2 s, 4.6 s] holds mids 2.5, 3.5, 4.5
    f = _frame("a", "m", [(k * s, float(k)) for k in range(1, 7)], interval_ns=s)
    got = slice_window(f, CaseWindow("c", int(2.2 * s), int(4.6 * s)))
    assert got.value.tolist() == [3.0, 4.0, 5.0]
    g = _frame("a", "m", [(k * s, float(k)) for k in range(1, 7)])          # instantaneous readings
    assert slice_window(g, CaseWindow("c", int(2.2 * s), int(4.6 * s))).value.tolist() == [3.0, 4.0]
    with pytest.raises(ValueError):
        CaseWindow("bad", 5, 5)


def test_summary_head_worker_changes_and_dash(tmp_path):
    from servelab.analyse.telemetry.load import CaseTelemetry
    from servelab.measure.telemetry.runner import CollectorStatus
    s = 10**9
    statuses = [CollectorStatus("head", "mpstat", True, OK, started=True, raw_file="head/mpstat.txt"),
                CollectorStatus("w1", "mpstat", True, OK, started=True, raw_file="w1/mpstat.txt"),
                CollectorStatus("head", "nvidia-smi", False, NOT_PRESENT, reason="binary 'nvidia-smi' not found")]
    cases = []
    for cid, level in (("base", 10.0), ("mixed", 15.0)):
        f = pd.concat([_frame("head", "cpu_busy_pct", [(k * s, level + k) for k in range(1, 11)], s, "mpstat"),
                       _frame("w1", "cpu_busy_pct", [(k * s, 2 * level) for k in range(1, 11)], s, "mpstat")])
        cases.append(CaseTelemetry(cid, CaseWindow(cid, 2 * s, 8 * s), make_frame(f), pd.DataFrame(), statuses))
    summ = compare_cases(pd.concat([summarize_case(c) for c in cases], ignore_index=True))
    row = summ[(summ.case == "mixed") & (summ.metric == "cpu_busy_pct")].iloc[0]
    inside = [15.0 + k for k in range(3, 9)]                            # mids 2.5..7.5 s → k = 3..8
    assert row.head_n == 6 and row.head_mean == pytest.approx(np.mean(inside))
    assert row.head_p95 == pytest.approx(np.percentile(inside, 95)) and row.head_max == max(inside)
    assert row.worker_mean == 30.0 and row.worker_status == OK
    base_mean = np.mean([10.0 + k for k in range(3, 9)])
    assert row.head_mean_change_pct == pytest.approx(100 * (np.mean(inside) - base_mean) / base_mean)
    assert row.worker_mean_change_pct == pytest.approx(50.0)
    gpu = summ[(summ.case == "mixed") & (summ.metric == "power_w")].iloc[0]
    assert gpu.head_status == NOT_PRESENT and gpu.worker_status == "not configured" and np.isnan(gpu.head_mean)
    write_metric_csvs(summ, tmp_path)
    lines = (tmp_path / "case_power_w_summary.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[1].count(",-") >= 6 and NOT_PRESENT in lines[1]


@pytest.mark.slow                  # the probe records for 1.5 s by design
def test_smi_probe_end_to_end_with_a_stand_in_nvidia_smi(tmp_path, monkeypatch, h200x2):
    """A stand-in ``nvidia-smi`` on PATH replays recorded H200 rows with fresh UTC stamps; the probe must
    pass it exactly ``collectors.SMI_FIELDS`` and summarise what it printed."""
    rows = (h200x2 / "smi.csv").read_text().splitlines()[200:260]
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"""#!{sys.executable}
import datetime, os, sys, time
args = sys.argv[1:]
if args == ["-L"]:
    print("GPU 0: NVIDIA H200 (UUID: GPU-x)"); print("GPU 1: NVIDIA H200 (UUID: GPU-y)"); sys.exit(0)
assert args[0] == "--query-gpu={C.SMI_FIELDS}", args
assert args[1:] == ["--format=csv,noheader,nounits", "-lms", "200"], args
assert os.environ.get("TZ") == "UTC"
rows = {rows!r}
i = 0
while True:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    for _ in range(2):
        parts = rows[i % len(rows)].split(", ")
        parts[1] = now
        print(", ".join(parts), flush=True)
        i += 1
    time.sleep(0.2)
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    from servelab.analyse.telemetry.smi_probe import probe
    code, text = probe(tmp_path / "out", 1.5, 0.2)
    assert code == 0, text
    summary = pd.read_csv(tmp_path / "out" / "smi_summary.csv")
    power = summary[summary.metric == "power_w"].set_index("device")
    assert set(power.index) == {"gpu0", "gpu1"} and (power.n >= 5).all()
    replayed = [float(r.split(", ")[6]) for r in rows]
    assert min(replayed) <= power["mean"].min() and power["max"].max() <= max(replayed)


def test_smi_probe_without_nvidia_smi_fails_closed(tmp_path, monkeypatch):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    from servelab.analyse.telemetry.smi_probe import probe
    code, text = probe(tmp_path, 0.1, 1.0)
    assert code == 2 and "binary 'nvidia-smi' not found" in text


def test_recorded_device_capture_cut_to_the_workloads_own_windows(samples):
    d = samples / "h200x2-device"
    if not (d / "windows.txt").exists():
        pytest.skip("device capture not in data/samples")
    from servelab.phases.phase2_hardware import h200_sample_cases
    cases = h200_sample_cases()
    assert [c.case_id for c in cases] == ["cap_tp2pp1", "cap_tp1pp2", "nccl"]
    rows = list(csv.reader((d / "smi.csv").open(), skipinitialspace=True))
    marks = {}
    for line in (d / "windows.txt").read_text().splitlines():
        p = line.split()
        if len(p) == 3:
            marks[(p[0], p[1])] = float(p[2])
    for c in cases:
        lo, hi = marks[(c.case_id, "start")], marks[(c.case_id, "end")]
        mine = []
        for r in rows:
            t = dt.datetime.strptime(r[1], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=dt.timezone.utc).timestamp()
            if r[0] == "0" and lo <= t <= hi:
                mine.append(float(r[6]))
        got = slice_window(c.samples, c.window)
        got = got[(got.metric == "power_w") & (got.device == "gpu0")]
        assert len(got) == len(mine) > 50
        assert got.value.mean() == pytest.approx(np.mean(mine))
    summ = summarize_case(cases[2], catalog={"nvidia-smi": ["util_gpu_pct"]}).iloc[0]
    assert summ.head_max > 50                                          # nccl-tests busy on the GPUs


def test_smi_user_saved_csv_own_field_order_units_in_header_and_values():
    text = ("timestamp, name, pci.bus_id, temperature.gpu, utilization.gpu [%], memory.used [MiB], index, power.draw [W]\n"
            "2023/06/01 10:00:00.123, NVIDIA A100-SXM4-80GB, 00000000:07:00.0, 34, 26 %, 1234 MiB, 0, 61.50 W\n"
            "2023/06/01 10:00:00.123, NVIDIA A100-SXM4-80GB, 00000000:0B:00.0, 35, 0 %, 4 MiB, 1, [N/A]\n")
    df = parse_smi_csv(text, "n")
    util = df[df.metric == "util_gpu_pct"].set_index("device").value
    assert util.to_dict() == {"gpu0": 26.0, "gpu1": 0.0}
    assert df[(df.metric == "mem_used_mib") & (df.device == "gpu0")].value.item() == 1234
    assert df[df.metric == "power_w"].device.tolist() == ["gpu0"]           # [N/A] stays missing
    assert df[df.metric == "temp_c"].value.tolist() == [34.0, 35.0]
    assert "reason" not in df.attrs


def test_smi_input_that_yields_nothing_says_why_in_one_line():
    assert "empty" in parse_smi_csv("", "n").attrs["reason"]
    r = parse_smi_csv("index, utilization.gpu [%]\n0, 5 %\n", "n").attrs["reason"]
    assert "timestamp" in r and "\n" not in r
    r = parse_smi_csv("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "n").attrs["reason"]
    assert "none of 1 line(s)" in r


def test_rdma_presence_needs_a_port_with_counters():
    """The presence check of the all-HCA RDMA collector passes exactly where a port has counters (a node with the
    class folder but no port counters has nothing to sample: ``not present``, not an early exit)."""
    import glob
    rc = subprocess.run(C.RDMA_PRESENCE, capture_output=True).returncode
    assert (rc == 0) == bool(glob.glob("/sys/class/infiniband/*/ports/*/counters/port_xmit_data"))
    assert C.rdma_counters(None).presence == [C.RDMA_PRESENCE]


def test_a_collector_that_did_not_run_is_never_executed(tmp_path, monkeypatch):
    """Phase 2's commands section after a real case: the collector that started is ``executed``; the one whose
    binary is not found is ``planned`` with why it did not run (never EXECUTED)."""
    from servelab.core.run import init_run, read_commands
    from servelab.phases.phase2_hardware import log_collectors
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "outputs"))
    rdir = init_run("collectors", "local-tiny")
    cdir = rdir / "cases" / "idle"
    host = LocalHost()
    specs = [C.CollectorSpec("sleeper", [sys.executable, "-c", "import time; print(1, flush=True); time.sleep(30)"],
                             "s.txt", "smi", required=False),
             C.CollectorSpec("gpu-tool", ["no-such-tool-xyz", "--loop"], "x.txt", "smi", required=False,
                             requires=["no-such-tool-xyz"])]
    session = start_telemetry(cdir, [NodePlan(host, specs, node="local")], grace_s=0.2)
    session.stop()
    log_collectors(phase_ctx(rdir, "phase2"), "idle", cdir, [("local", specs)])
    got = {r.title: r for r in read_commands(rdir, "phase2")}
    assert got["idle sleeper"].label == "executed"
    missing = got["idle gpu-tool (not run)"]
    assert missing.label == "planned" and "no-such-tool-xyz' not found" in missing.note
    assert not any(r.label == "executed" and "gpu-tool" in r.title for r in got.values())
