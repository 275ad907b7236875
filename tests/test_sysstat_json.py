"""sysstat through its machine-readable output: mpstat ``-o JSON`` and ``sar -o`` + ``sadf -j``, parsed from real
captures (``data/samples/telemetry/sysstat_json``, commands in its README) and live under a non-C locale."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from servelab.measure.telemetry import collectors as C
from servelab.analyse.telemetry.parse_sysstat import (KBPS_TO_GBPS, json_hosts, parse_mpstat, parse_sar_net)

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "data" / "samples" / "telemetry" / "sysstat_json"
needs = pytest.mark.skipif(not all(shutil.which(b) for b in ("mpstat", "sar", "sadf")), reason="sysstat not installed")


def test_collectors_record_json():
    assert C.mpstat(1.0).argv == ["mpstat", "-P", "ALL", "-o", "JSON", "1"] and C.mpstat(1.0).raw_name == "mpstat.json"
    sar = C.sar_net(2.0)
    assert sar.argv[:2] == ["sh", "-c"] and sar.argv[-2:] == ["DEV,EDEV", "2"] and "sadf" in sar.requires
    # the page shows the command complete and pasteable: the script itself, its activity and interval
    import shlex
    shown = shlex.split(sar.display())
    shown = shown[shown.index("sh"):]                         # after the environment it runs with (TZ=UTC …)
    assert shown[:2] == ["sh", "-c"] and shown[2] == C.SAR_JSON_SCRIPT and shown[-2:] == ["DEV,EDEV", "2"]
    assert 'sadf -j "$f" -- -n "$a"' in sar.display() and "<" not in sar.display().replace("<<", "")


def test_mpstat_json_cut_by_sigterm_reads_every_complete_sample():
    text = (FIX / "mpstat_sigterm.json").read_text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)                                      # really cut: the runner stops mpstat with SIGTERM
    (host, entries), = json_hosts(text)
    assert host["nodename"] == "vm" and host["date"] == "2026-11-30" and len(entries) == text.count('"timestamp"')
    df = parse_mpstat(text, "n", 1.0)
    stamps = sorted(df.ts_ns.unique())
    assert len(stamps) == len(entries) and set(np.diff(stamps)) == {1_000_000_000}
    first = entries[0]["timestamp"]
    assert stamps[0] % 1_000_000_000 == 500_000_000                      # mid-second, as for text
    assert time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stamps[0] // 10**9)) == f"2026-11-30 {first}"
    allcpu = {r["cpu"]: r for r in entries[0]["cpu-load"]}
    busy = df[(df.metric == "cpu_busy_pct") & (df.ts_ns == stamps[0])].value.item()
    assert busy == pytest.approx(100 - allcpu["all"]["idle"])
    assert set(df[df.metric == "core_busy_pct"].device) == {"cpu0", "cpu1"}
    hot = df[df.metric == "hottest_core_busy_pct"].set_index("ts_ns").value
    cores = df[df.metric == "core_busy_pct"].groupby("ts_ns").value.max()
    assert (hot == cores).all()
    assert df[df.metric == "cpu_usr_pct"].value.iloc[0] == allcpu["all"]["usr"]


def test_sar_net_from_sadf_json():
    text = (FIX / "sar_net_sadf.json").read_text()
    doc = json.loads(text)                                     # sadf writes a whole document
    stats = doc["sysstat"]["hosts"][0]["statistics"]
    df = parse_sar_net(text, "n")
    assert "lo" not in set(df.device) and set(df.device) == {r["iface"] for r in stats[0]["network"]["net-dev"]} - {"lo"}
    assert df.ts_ns.nunique() == len(stats) and (df.interval_ns == 1_000_000_000).all()
    eth0 = next(r for r in stats[-1]["network"]["net-dev"] if r["iface"] == "eth0")
    got = df[(df.device == "eth0") & (df.metric == "net_rx_gbps")].sort_values("ts_ns").value.iloc[-1]
    assert got == pytest.approx(eth0["rxkB"] * KBPS_TO_GBPS)
    assert {"net_rxdrop_ps", "net_txerr_ps", "net_ifutil_pct"} <= set(df.metric)
    only = parse_sar_net(text, "n", netdevs=["lo"])
    assert set(only.device) == {"lo"}


def test_text_under_a_german_locale_breaks_and_json_does_not():
    """The same two samples recorded at the same moment: the text report's decimal commas read as missing, the
    JSON numbers are the values."""
    js = parse_mpstat((FIX / "mpstat_de_DE.json").read_text(), "n", 1.0)
    tx_text = (FIX / "mpstat_de_DE.txt").read_text()
    tx = parse_mpstat(tx_text, "n", 1.0)
    assert "84,00" in tx_text or "," in tx_text.splitlines()[3]
    assert tx[tx.metric == "cpu_busy_pct"].value.isna().all()
    busy = js[js.metric == "cpu_busy_pct"].value
    assert len(busy) == 2 and busy.between(0, 100).all()
    by_hand = [100 - float(line.split()[-1].replace(",", ".")) for line in tx_text.splitlines()
               if len(line.split()) > 2 and line.split()[1] == "all" and not line.startswith("Durchschn")]
    assert sorted(busy.round(2)) == sorted(round(x, 2) for x in by_hand[:2])


@needs
@pytest.mark.slow                  # mpstat measures two 1 s intervals by design
def test_live_json_is_the_same_under_a_non_c_locale(tmp_path):
    """mpstat run now under de_DE.UTF-8 (built with localedef into a temp LOCPATH): its text has decimal commas,
    its JSON parses to finite numbers in range."""
    if not shutil.which("localedef") or not Path("/usr/share/i18n/locales/de_DE").exists():
        pytest.skip("localedef or the de_DE locale source is not installed")
    loc = tmp_path / "loc"
    loc.mkdir()
    subprocess.run(["localedef", "-i", "de_DE", "-f", "UTF-8", str(loc / "de_DE.UTF-8")], check=True,
                   capture_output=True, timeout=120)
    env = {**os.environ, "LOCPATH": str(loc), "LC_ALL": "de_DE.UTF-8", "TZ": "UTC"}
    text = subprocess.run(["mpstat", "-P", "ALL", "1", "1"], env=env, capture_output=True, text=True,
                          timeout=30).stdout
    assert any("," in x for x in text.split()), "the locale did not take: no decimal comma in the text report"
    js = subprocess.run(["mpstat", "-P", "ALL", "-o", "JSON", "1", "1"], env=env, capture_output=True, text=True,
                        timeout=30).stdout
    df = parse_mpstat(js, "n", 1.0)
    assert df.value.notna().all() and df[df.metric == "cpu_busy_pct"].value.between(0, 100).all()
    assert set(df[df.metric == "core_busy_pct"].device) == {f"cpu{i}" for i in range(os.cpu_count())}


@needs
@pytest.mark.slow                  # real sar and mpstat collectors around a 3 s window
def test_the_sar_collector_leaves_json_and_no_temp_file(tmp_path):
    from servelab.analyse.telemetry.load import load_case_telemetry
    from servelab.measure.telemetry.runner import NodePlan, start_telemetry
    from servelab.deploy.hosts import LocalHost
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    spec = C.sar_net(1.0)
    spec.env = {**spec.env, "TMPDIR": str(tmpdir)}
    session = start_telemetry(tmp_path, [NodePlan(LocalHost(), [spec, C.mpstat(1.0)])], grace_s=0.3)
    time.sleep(3.2)
    result = session.stop()
    assert result.ok, result.failures
    raw = next((tmp_path / "telemetry").rglob("sar_net.json")).read_text()
    assert json.loads(raw)["sysstat"]["hosts"][0]["statistics"]
    assert list(tmpdir.iterdir()) == []                        # the binary file is removed after sadf
    case = load_case_telemetry(tmp_path, "c")
    assert {"sar-net", "mpstat"} <= set(case.samples.source) and not case.parse_notes
