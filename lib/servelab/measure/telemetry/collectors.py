"""Collector specs: what each Phase 2 collector runs on a node, as argv lists, and whether it is required.

A ``CollectorSpec`` is data only — the runner (``servelab.measure.telemetry.runner``) starts it for a case on a
host and stops it after. Every argv is a list (``shlex.join`` only for display). Sysstat tools and
nvidia-smi get ``TZ=UTC LC_ALL=C S_TIME_FORMAT=ISO`` so that their wall-clock stamps parse without
guessing the node's time zone or locale.

The field lists and commands (``docs/method.md#telemetry``):

- nvidia-smi query loop: ``index,timestamp,utilization.gpu,utilization.memory,memory.used,memory.total,
  power.draw,temperature.gpu,clocks.sm,clocks.mem,pstate`` as ``csv,noheader,nounits``, 1 s default;
- DCGM ``dcgmi dmon -e <field ids> -d <ms>``: SM active/occupancy, tensor active, DRAM active,
  PCIe TX/RX, NVLink TX/RX, graphics engine active, XID (ids from NVIDIA/DCGM ``dcgm_fields.h``);
- ``mpstat -P ALL -o JSON 1``, ``pidstat -t -p <pid> 1`` (``-H -h -u -r -w``: epoch stamps, one line per
  thread), ``numastat -p <pid>`` every 5 s, ``sar -n DEV,EDEV -o <file> 1`` turned into JSON by ``sadf -j`` when
  it stops, ``ethtool -S <netdev>`` every 1 s,
  RDMA port and hw counters under ``/sys/class/infiniband/<hca>/ports/<p>/``, optional ``perf stat``.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from servelab.core.params import did_you_mean

SMI_FIELDS = ("index,timestamp,utilization.gpu,utilization.memory,memory.used,memory.total,"
              "power.draw,temperature.gpu,clocks.sm,clocks.mem,pstate")

# DCGM field ids (NVIDIA/DCGM dcgmlib/dcgm_fields.h): profiling fields 1001-1012, device fields 203/230.
DCGM_FIELDS: dict[int, str] = {
    1001: "GRACT",   # DCGM_FI_PROF_GR_ENGINE_ACTIVE, ratio 0..1
    1002: "SMACT",   # DCGM_FI_PROF_SM_ACTIVE, ratio 0..1
    1003: "SMOCC",   # DCGM_FI_PROF_SM_OCCUPANCY, ratio 0..1
    1004: "TENSO",   # DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, ratio 0..1
    1005: "DRAMA",   # DCGM_FI_PROF_DRAM_ACTIVE, ratio 0..1
    1009: "PCITX",   # DCGM_FI_PROF_PCIE_TX_BYTES, bytes/s
    1010: "PCIRX",   # DCGM_FI_PROF_PCIE_RX_BYTES, bytes/s
    1011: "NVLTX",   # DCGM_FI_PROF_NVLINK_TX_BYTES, bytes/s
    1012: "NVLRX",   # DCGM_FI_PROF_NVLINK_RX_BYTES, bytes/s
    230: "XID",      # DCGM_FI_DEV_XID_ERRORS, last XID seen
}

SYSSTAT_ENV = {"TZ": "UTC", "LC_ALL": "C", "S_TIME_FORMAT": "ISO"}

RDMA_PORT_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
                      "port_xmit_wait", "port_xmit_discards", "port_rcv_errors", "symbol_error",
                      "link_downed", "link_error_recovery", "local_link_integrity_errors",
                      "excessive_buffer_overrun_errors", "port_rcv_remote_physical_errors")
RDMA_HW_COUNTERS = ("out_of_buffer", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err",
                    "rnr_nak_retry_err", "implied_nak_seq_err", "duplicate_request",
                    "req_transport_retries_exceeded", "roce_adp_retrans", "roce_adp_retrans_to",
                    "roce_slow_restart", "np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets",
                    "rx_icrc_encapsulated")


@dataclass
class CollectorSpec:
    """One collector on one node.

    ``argv`` runs in the background for the whole case (stdout+stderr go to ``raw_name``).
    ``requires`` are binaries that must exist on the node; ``presence`` are argvs that tell whether the
    hardware is there at all (``nvidia-smi -L``, ``test -d /sys/class/infiniband``: failing → ``not
    present``); ``probes`` must exit 0 before the collector starts (``dcgmi discovery -l``,
    ``test -d /proc/<pid>``: failing → ``probe failed``).
    ``required`` collectors fail the case (fail-closed) when missing, failing a probe or exiting early.
    """
    name: str
    argv: list[str]
    raw_name: str
    parser: str                      # smi | dcgm | mpstat | pidstat | numastat | sar_net | ethtool | rdma | perf
    required: bool = False
    requires: list[str] = field(default_factory=list)
    probes: list[list[str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    interval_s: float = 1.0
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)   # parser hints (e.g. perf start reference)
    presence: list[list[str]] = field(default_factory=list)

    def display(self) -> str:
        """The command as a reader would type it (the sampler's source shown by its file name)."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {shlex.join(display_argv(self.argv))}".strip()


def display_argv(argv: list[str]) -> list[str]:
    """argv for logs and pages, complete and pasteable: a ``python3 -c <sampler source> CONFIG`` is shown as the
    same program run from its file (``python3 …/sampler_program.py CONFIG``: the program reads its config from
    ``sys.argv[1]`` either way); everything else as it is."""
    if len(argv) > 2 and argv[1] == "-c" and "def run_files" in argv[2]:
        return [argv[0], str(Path(__file__).with_name("sampler_program.py")), *argv[3:]]
    return list(argv)


def _interval_arg(interval_s: float) -> str:
    if interval_s < 1 or int(interval_s) != interval_s:
        raise ValueError(f"sysstat intervals are whole seconds, got {interval_s}")
    return str(int(interval_s))


def sampler_source() -> str:
    """The source text of ``sampler_program.py`` (sent as ``python3 -c <source>``)."""
    return (Path(__file__).with_name("sampler_program.py")).read_text()


def sampler_argv(config: dict[str, Any], python: str = "python3") -> list[str]:
    return [python, "-c", sampler_source(), json.dumps(config, separators=(",", ":"))]


def nvidia_smi(interval_s: float = 1.0, required: bool = False) -> CollectorSpec:
    """The Phase 2 nvidia-smi query loop (``-lms`` so sub-second intervals work too)."""
    ms = int(round(interval_s * 1000))
    if ms < 100:
        raise ValueError(f"nvidia-smi interval must be ≥ 0.1 s, got {interval_s}")
    argv = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-lms", str(ms)]
    return CollectorSpec("nvidia-smi", argv, "nvidia_smi.csv", "smi", required, ["nvidia-smi"],
                         [], {"TZ": "UTC"}, interval_s,
                         "GPU/HBM utilisation, memory, power, temperature, SM/memory clocks, P-state",
                         presence=[["nvidia-smi", "-L"]])


def dcgm_dmon(interval_s: float = 1.0, fields: list[int] | None = None, required: bool = False,
              python: str = "python3") -> CollectorSpec:
    """``dcgmi dmon -e <ids> -d <ms>``, stamped line by line (dmon prints no time of its own)."""
    ids = list(fields or DCGM_FIELDS)
    dmon = ["dcgmi", "dmon", "-e", ",".join(str(i) for i in ids), "-d", str(int(round(interval_s * 1000)))]
    return CollectorSpec("dcgm", sampler_argv({"mode": "stamp", "argv": dmon}, python), "dcgm_dmon.txt", "dcgm",
                         required, [python, "dcgmi"], [["dcgmi", "discovery", "-l"]], {}, interval_s,
                         "DCGM SM active/occupancy, tensor active, DRAM active, PCIe and NVLink bytes/s, XID",
                         {"dmon_argv": dmon})


def mpstat(interval_s: float = 1.0, required: bool = True) -> CollectorSpec:
    """``mpstat -P ALL -o JSON``: sysstat's machine-readable output (numbers never in the node's locale)."""
    return CollectorSpec("mpstat", ["mpstat", "-P", "ALL", "-o", "JSON", _interval_arg(interval_s)], "mpstat.json",
                         "mpstat", required, ["mpstat"], [], dict(SYSSTAT_ENV), interval_s,
                         "per-core and whole-machine CPU utilisation")


# sar records its binary data file while the case runs; when the collector is stopped (SIGTERM to its process
# group) the file is turned into sysstat's JSON by sadf on the node, onto the collector's output, and removed.
# A fixed script: the activity and the interval are positional arguments, never part of a shell string.
SAR_JSON_SCRIPT = (
    'a=$1\n'
    'f=$(mktemp "${TMPDIR:-/tmp}/servelab-sar.XXXXXX") || exit 1\n'
    'sar -n "$a" -o "$f" "$2" >/dev/null 2>&1 &\n'
    'p=$!\n'
    'out() { trap - TERM INT; kill -TERM "$p" 2>/dev/null; wait "$p" 2>/dev/null; '
    'sadf -j "$f" -- -n "$a"; rm -f "$f"; exit 0; }\n'
    'trap out TERM INT\n'
    'wait "$p" 2>/dev/null\n'
    'out\n')


def pidstat(pid: int, interval_s: float = 1.0, required: bool = True) -> CollectorSpec:
    """Per-thread CPU, faults, memory and context switches of the engine process."""
    return CollectorSpec("pidstat", ["pidstat", "-H", "-h", "-t", "-u", "-r", "-w", "-p", str(int(pid)),
                                     _interval_arg(interval_s)], "pidstat.txt", "pidstat", required, ["pidstat"],
                         [["test", "-d", f"/proc/{int(pid)}"]], dict(SYSSTAT_ENV), interval_s,
                         "engine threads: %CPU, core, faults, RSS, context switches", {"pid": int(pid)})


def numastat(pid: int, interval_s: float = 5.0, required: bool = False, python: str = "python3") -> CollectorSpec:
    return CollectorSpec("numastat", sampler_argv({"mode": "commands", "interval_s": interval_s,
                                                   "commands": [["numastat", "-p", str(int(pid))]]}, python),
                         "numastat.txt", "numastat", required, [python, "numastat"],
                         [["test", "-d", f"/proc/{int(pid)}"]], {}, interval_s,
                         "engine memory per NUMA node (MB)", {"pid": int(pid)})


def sar_net(interval_s: float = 1.0, required: bool = True, netdevs: list[str] | None = None) -> CollectorSpec:
    """``sar -n DEV,EDEV``; ``netdevs`` (the node's rails) narrows what the summaries read (the raw file
    keeps every interface)."""
    return CollectorSpec("sar-net", sar_json_argv("DEV,EDEV", interval_s), "sar_net.json", "sar_net",
                         required, ["sar", "sadf"], [], dict(SYSSTAT_ENV), interval_s,
                         "per-netdev packets, throughput, errors and drops", {"netdevs": list(netdevs or [])})


def sar_json_argv(activity: str, interval_s: float) -> list[str]:
    """``sar -n <activity> -o <binary file> <s>`` for the case, ``sadf -j`` of that file when stopped (JSON)."""
    return ["sh", "-c", SAR_JSON_SCRIPT, "servelab-sar", activity, _interval_arg(interval_s)]


def ethtool_stats(netdevs: list[str], interval_s: float = 1.0, required: bool = False,
                  python: str = "python3") -> CollectorSpec:
    if not netdevs:
        raise ValueError("ethtool collector needs at least one netdev (the target node's 'netdevs')")
    cmds = [["ethtool", "-S", d] for d in netdevs]
    return CollectorSpec("ethtool", sampler_argv({"mode": "commands", "interval_s": interval_s, "commands": cmds},
                                                 python),
                         "ethtool.txt", "ethtool", required, [python, "ethtool"],
                         [["ethtool", "-S", d] for d in netdevs], {}, interval_s,
                         "NIC counters (bytes, RDMA vport bytes, discards, pauses, errors)", {"netdevs": list(netdevs)})


def rdma_counter_paths(hcas: list[str] | None, ports: list[int] | None = None) -> list[str]:
    """Counter files of the given HCAs/ports; ``None`` = every HCA and port (glob, expanded on the node)."""
    paths = []
    for hca in hcas or ["*"]:
        for port in ports or ([1] if hcas else ["*"]):
            base = f"/sys/class/infiniband/{hca}/ports/{port}"
            paths += [f"{base}/counters/{c}" for c in RDMA_PORT_COUNTERS]
            paths += [f"{base}/hw_counters/{c}" for c in RDMA_HW_COUNTERS]
    return paths


def rdma_counters(hcas: list[str] | None = None, ports: list[int] | None = None, interval_s: float = 1.0,
                  required: bool = False, python: str = "python3") -> CollectorSpec:
    """RDMA port and hw counters (``port_xmit_data``/``port_rcv_data`` count 4-byte words).

    ``hcas=None`` samples every HCA the node has; it is present where at least one port has counters.
    """
    probes = [["test", "-d", f"/sys/class/infiniband/{h}/ports/{p}/counters"] for h in hcas for p in (ports or [1])] \
        if hcas else []
    return CollectorSpec("rdma", sampler_argv({"mode": "files", "interval_s": interval_s,
                                               "files": rdma_counter_paths(hcas, ports)}, python),
                         "rdma_counters.txt", "rdma", required, [python], probes, {}, interval_s,
                         "RDMA port bytes/packets (x4 for data), errors, retransmits, congestion",
                         {"hcas": list(hcas or [])}, presence=[RDMA_PRESENCE])


# an RDMA port with counters, not just the class folder: a node can have /sys/class/infiniband without one (seen
# on a GPU node without RDMA ports), and sampling nothing is "not present", not a collector that died
RDMA_PRESENCE = ["sh", "-c", "ls /sys/class/infiniband/*/ports/*/counters/port_xmit_data >/dev/null 2>&1"]


def perf_stat(interval_s: float = 5.0, events: list[str] | None = None, required: bool = False) -> CollectorSpec:
    ev = events or ["task-clock", "context-switches", "cpu-migrations", "cycles", "instructions",
                    "cache-misses"]
    ms = int(round(interval_s * 1000))
    return CollectorSpec("perf-stat", ["perf", "stat", "-a", "-I", str(ms), "-x", ",", "-e", ",".join(ev)],
                         "perf_stat.csv", "perf", required, ["perf"], [], {"LC_ALL": "C"}, interval_s,
                         "whole-machine CPU counters (interval CSV; times relative to its start)")


def default_collectors(pid: int | None = None, netdevs: list[str] | None = None, hcas: list[str] | None = None,
                       gpus: int = 0, required: list[str] | None = None, interval_s: float = 1.0,
                       slow_interval_s: float = 5.0, perf: bool = False,
                       python: str = "python3") -> list[CollectorSpec]:
    """The collector set for one node (``docs/method.md#telemetry``).

    ``required`` names the collectors that fail a case when missing (default: the sysstat ones, plus
    nvidia-smi and DCGM when the node declares GPUs, plus ethtool/RDMA when it declares netdevs/HCAs — a
    silent collector hides a problem, so DCGM and every declared rail are mandatory).
    """
    if required is None:
        required = ["mpstat", "sar-net"] + (["pidstat"] if pid else [])
        if gpus:
            required += ["nvidia-smi", "dcgm"]
        if netdevs:
            required += ["ethtool"]
        if hcas:
            required += ["rdma"]
    specs = [nvidia_smi(interval_s), dcgm_dmon(interval_s, python=python), mpstat(interval_s),
             sar_net(interval_s, netdevs=netdevs)]
    if pid:
        specs += [pidstat(pid, interval_s), numastat(pid, slow_interval_s, python=python)]
    if netdevs:
        specs.append(ethtool_stats(netdevs, interval_s, python=python))
    specs.append(rdma_counters(hcas or None, interval_s=interval_s, python=python))
    if perf:
        specs.append(perf_stat(slow_interval_s))
    known = {s.name for s in specs}
    for name in required:
        if name not in known:
            raise ValueError(f"required collector '{name}' is not in this node's set{did_you_mean(name, known)}; "
                             f"known: {', '.join(sorted(known))}")
    for s in specs:
        s.required = s.name in required
    return specs
