"""Shell entry for Phase 5 on a GPU machine.

    python -m servelab.analyse.nccl run --bin-dir nccl-tests/build -g 2 --out /tmp/nccl [--debug] [-b 8K -e 64M]
    python -m servelab.analyse.nccl parse /tmp/nccl/all_reduce.log ...
    python -m servelab.analyse.nccl info /tmp/nccl/all_reduce_info.log
    python -m servelab.analyse.nccl gate --require NET/IB,GDRDMA --hcas mlx5_0,mlx5_3 rank*.log

``run`` writes one log per collective and ``nccl_tests.csv`` (every row parsed) into ``--out``; exit
status 1 when a run failed, was truncated or validated wrong. ``gate`` exits 3 when it refuses.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servelab.deploy.nccl_gate import check_gate
from servelab.deploy.nccl_info import parse_info_files, transport_table
from servelab.analyse.nccl.perf_log import parse_file, runs_frame, runs_table
from servelab.analyse.nccl.perf_tests import DEFAULT_COLLECTIVES, run_tests
from servelab.deploy.hosts import LocalHost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m servelab.analyse.nccl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run nccl-tests collectives locally")
    r.add_argument("--bin-dir", default="")
    r.add_argument("-g", "--gpus", type=int, default=1)
    r.add_argument("-b", "--min-bytes", default="8K")
    r.add_argument("-e", "--max-bytes", default="64M")
    r.add_argument("-f", "--factor", type=int, default=2)
    r.add_argument("--collectives", default=",".join(DEFAULT_COLLECTIVES))
    r.add_argument("--debug", action="store_true", help="NCCL_DEBUG=INFO (not for performance numbers)")
    r.add_argument("--timeout", type=float, default=600)
    r.add_argument("--out", type=Path, default=Path("nccl_tests"))
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

    if a.cmd == "run":
        res = run_tests(LocalHost(), a.out, a.collectives.split(","), a.bin_dir, a.gpus, a.min_bytes, a.max_bytes,
                        a.factor, debug=a.debug, timeout_s=a.timeout)
        runs = [x.run for x in res]
        runs_frame(runs).to_csv(a.out / "nccl_tests.csv", index=False)
        print(runs_table(runs).to_string(index=False))
        return 0 if all(x.ok for x in runs) else 1
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
