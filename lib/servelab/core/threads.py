"""How many threads a process's libraries may use: its share of the machine, set before they start.

polars, pyarrow and the BLAS behind numpy each size a thread pool to every core of the machine when they are first
imported, so N processes on N cores would run N × cores threads. A process that is one of several (a Dask worker, a
parse child) gets the variables below in its environment before it starts: polars reads ``POLARS_MAX_THREADS``
once, at import; Arrow sizes its CPU pool from ``OMP_NUM_THREADS``; OpenBLAS / MKL / OpenMP read theirs at load.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

THREAD_VARS = ("POLARS_MAX_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMEXPR_MAX_THREADS", "VECLIB_MAXIMUM_THREADS")
SHARE_VAR = "SERVELAB_THREADS"     # the share itself, for code in that process that sizes its own pools


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def thread_env(n: int) -> dict[str, str]:
    """The environment that holds a process's libraries to ``n`` threads (and records the share)."""
    n = max(1, int(n))
    return {**{v: str(n) for v in THREAD_VARS}, SHARE_VAR: str(n)}


def share() -> int:
    """This process's share of threads: what its starter set in ``SERVELAB_THREADS``, else every usable CPU."""
    try:
        return max(1, int(os.environ[SHARE_VAR]))
    except (KeyError, ValueError):
        return usable_cpus()


@contextmanager
def spawning_with(n: int) -> Iterator[None]:
    """Processes spawned inside this block start with :func:`thread_env` ``(n)`` (this process's environment is
    restored afterwards): spawned children copy the parent's environment when they start."""
    env = thread_env(n)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
