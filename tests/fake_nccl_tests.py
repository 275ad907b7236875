#!/usr/bin/env python3
"""A stand-in for nccl-tests' ``<coll>_perf`` binaries that prints a REAL recorded nccl-tests log, unchanged.

Installed under a ``*_perf`` name (a symlink to this file), it reads its collective from that name, its rank count
from ``-g`` × ``OMPI_COMM_WORLD_SIZE`` (set by ``fake_mpirun.py``) and its setting from the environment, and
prints the recorded run of that collective it maps them to — it never makes a number up:

- 1 rank: the 1 × H200 sweep recorded with servelab's runner (``data/samples/h200x1-nccl-sweep/``), the run of
  exactly this collective and setting (``NCCL_ALGO``, ``NCCL_PROTO``), repeat 1, 2, 1, … on successive calls; with
  ``NCCL_DEBUG=INFO`` its env-check run of that setting;
- 2 ranks: the two recorded 2 × H200 runs — ``h200x2-device/nccl_tests_g2.log`` (B) for the baseline, for the
  first value of a swept variable (Ring, Simple, ``NCCL_CROSS_NIC=0``) and for GPU pair 0,1;
  ``h200x2/nccl_tests.log`` (A) for any other value or pair; with ``NCCL_DEBUG=INFO`` the recorded INFO run
  ``h200x2/nccl_info.log`` (an all-reduce, whatever collective was asked for). Which log stands for which setting is this
  fixture's choice: the numbers are real, their difference is the difference between two real runs, not an
  effect of the setting. What a test checks is that each run keeps its own log and the sweep table shows it;
- any other rank count, or no recorded run: a one-line failure on stderr and exit code 2, as a real failed run.

Every call appends its argv and the NCCL_* / CUDA_VISIBLE_DEVICES environment it saw to ``calls.jsonl`` in the
folder it is called from (the test's bin folder), where it also counts repeats.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "samples"
FIRST_VALUES = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_CROSS_NIC": "0"}


def section(text: str, coll: str) -> str:
    """The recorded run of ``coll`` in a log of several: from its version line to its ``concluded`` line."""
    start = text.index(f"# Collective test starting: {coll}_perf")
    start = text.rindex("# nccl-tests version", 0, start)
    end = text.index(f"# Collective test concluded: {coll}_perf", start)
    return text[start:text.index("\n", end) + 1] + "#\n"


def arg(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else default


def main() -> int:
    name = Path(sys.argv[0]).name
    m = re.fullmatch(r"(\w+)_perf", name)
    if not m:
        print(f"fake nccl-tests: called as {name}, not <collective>_perf", file=sys.stderr)
        return 2
    coll = m[1]
    argv = sys.argv[1:]
    ranks = int(arg(argv, "-g", "1")) * int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k == "CUDA_VISIBLE_DEVICES"}
    here = Path(sys.argv[0]).absolute().parent
    with open(here / "calls.jsonl", "a") as f:
        f.write(json.dumps({"binary": name, "argv": argv, "env": env, "ranks": ranks}) + "\n")
    swept = [(k, env[k]) for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_CROSS_NIC") if k in env]
    info = env.get("NCCL_DEBUG") == "INFO"
    if ranks == 1:
        setting = f"{swept[0][0]}_{swept[0][1]}" if swept else "baseline"
        pattern = f"env-check-*-{coll}-{setting}-r*.log" if info else f"node-*-{coll}-{setting}-r*.log"
        logs = sorted((SAMPLES / "h200x1-nccl-sweep" / "logs").glob(pattern))
        if not logs:
            print(f"fake nccl-tests: no recorded 1-rank run of {coll} with {setting}", file=sys.stderr)
            return 2
        counter = here / f"calls.{coll}.{setting}.n"
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        sys.stdout.write(logs[n % len(logs)].read_text())
        return 0
    if ranks == 2 and info:
        sys.stdout.write((SAMPLES / "h200x2" / "nccl_info.log").read_text())
        return 0
    if ranks == 2:
        first = all(FIRST_VALUES.get(k) == v for k, v in swept) and env.get("CUDA_VISIBLE_DEVICES", "0,1") == "0,1"
        path = SAMPLES / ("h200x2-device/nccl_tests_g2.log" if first else "h200x2/nccl_tests.log")
        sys.stdout.write(section(path.read_text(), coll))
        return 0
    print(f"fake nccl-tests: no recorded run with {ranks} ranks (recorded: 1 and 2)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
