#!/usr/bin/env python3
"""A stand-in for ``mpirun`` in the cross-node nccl-tests test: ``fake_mpirun.py -np N -H h1:p,h2:p [-x K=V]...
CMD...`` records its own argv in ``calls.jsonl`` beside CMD's binary (the test's bin folder) and runs CMD once (as rank 0, which is the rank that prints
nccl-tests' output) with ``OMPI_COMM_WORLD_SIZE=N`` and every ``-x`` variable set. It starts no process on the
other hosts: the test checks what the launcher was given, not MPI."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def main() -> int:
    argv = sys.argv[1:]
    env, i, np_, hosts = dict(os.environ), 0, "1", ""
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "-x":
            k, _, v = argv[i + 1].partition("=")
            env[k] = v
        elif argv[i] == "-np":
            np_ = argv[i + 1]
        elif argv[i] == "-H":
            hosts = argv[i + 1]
        i += 2
    with open(os.path.join(os.path.dirname(os.path.abspath(argv[i])), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"launcher": "fake_mpirun", "argv": argv, "np": np_, "hosts": hosts}) + "\n")
    env["OMPI_COMM_WORLD_SIZE"] = np_
    return subprocess.run(argv[i:], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
