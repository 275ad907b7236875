"""Shell entry for Phase 5's logs on any machine (running nccl-tests is ``python -m servelab.measure.nccl_tests``).

    python -m servelab.analyse.nccl parse /tmp/nccl/logs/node-local-all_reduce-baseline-r1.log ...
    python -m servelab.analyse.nccl sweep /tmp/nccl            # a folder written by servelab.measure.nccl_tests
    python -m servelab.analyse.nccl info /tmp/nccl/all_reduce_info.log
    python -m servelab.analyse.nccl gate --require NET/IB,GDRDMA --hcas mlx5_0,mlx5_3 rank*.log

``parse`` and ``sweep`` exit 1 when a run failed, was truncated or validated wrong; ``gate`` exits 3 when it
refuses.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servelab.deploy.nccl_gate import check_gate
from servelab.deploy.nccl_info import parse_info_files, transport_table
from servelab.analyse.nccl.perf_log import parse_file, runs_table
from servelab.analyse.nccl.sweep import env_check, load_sweep, sweep_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m servelab.analyse.nccl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="the runs, the sweep table and the env check of a runs folder")
    s.add_argument("folder", type=Path)
    p = sub.add_parser("parse", help="parse nccl-tests logs")
    p.add_argument("logs", nargs="+", type=Path)
    i = sub.add_parser("info", help="transports per rank from NCCL INFO logs")
    i.add_argument("logs", nargs="+", type=Path)
    g = sub.add_parser("gate", help="judge INFO logs against a transport gate")
    g.add_argument("--require", default="NET/IB,GDRDMA")
    g.add_argument("--hcas", default="")
    g.add_argument("--expected-ranks", type=int, default=None)
    g.add_argument("logs", nargs="+", type=Path)
    a = ap.parse_args(argv)

    if a.cmd == "sweep":
        data = load_sweep(a.folder)
        print(data.runs[["run_id", "ranks", "exit_code", "peak_busbw_gbps", "small_msg_time_us", "status"]]
              .to_string(index=False))
        t = sweep_table(data)
        print(t[t.setting != "baseline"][["scope", "node", "collective", "size_bytes", "setting", "time_us",
                                          "delta_time_pct", "verdict"]].to_string(index=False))
        print(env_check(data).to_string(index=False))
        return 0 if (data.runs.status == "ok").all() else 1
    if a.cmd == "parse":
        runs = [run for path in a.logs for run in parse_file(path)]
        print(runs_table(runs).to_string(index=False))
        return 0 if all(x.ok for x in runs) else 1
    info = parse_info_files(a.logs)
    if a.cmd == "info":
        print(f"NCCL {info.version or '?'}; nodes {info.nnodes}; env {info.env}; notes {info.notes}")
        print(transport_table(info).to_string(index=False))
        return 0
    gate = {"require": [x for x in a.require.split(",") if x], "required_hcas": [x for x in a.hcas.split(",") if x]}
    if a.expected_ranks:
        gate["expected_ranks"] = a.expected_ranks
    v = check_gate(gate, info)
    print(v.message)
    return 0 if v.passed else 3


if __name__ == "__main__":
    sys.exit(main())
