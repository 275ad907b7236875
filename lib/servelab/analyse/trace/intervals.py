"""Interval arithmetic on int64 ns arrays (numpy, vectorised): unions, covered length, complements.

An *interval set* is a pair of sorted arrays ``(starts, ends)`` of disjoint half-open intervals.
"""
from __future__ import annotations

import numpy as np


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge possibly overlapping intervals into a disjoint sorted set (touching intervals merge)."""
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    if s.size == 0:
        return s.copy(), e.copy()
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    run_max = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_max[:-1]
    idx = np.flatnonzero(new)
    last = np.append(idx[1:], s.size) - 1
    return s[idx], run_max[last]


def union_grouped(groups: np.ndarray, starts: np.ndarray, ends: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-group union: returns (group, start, end) of disjoint intervals, grouped and sorted."""
    g = np.asarray(groups, dtype=np.int64)
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    if s.size == 0:
        return g.copy(), s.copy(), e.copy()
    order = np.lexsort((s, g))
    g, s, e = g[order], s[order], e[order]
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    # running max of ends within each group: offset groups so that accumulate never crosses a group
    base = s.min()
    span = int(max(e.max(), s.max()) - base) + 1
    gi = np.cumsum(np.r_[0, g[1:] != g[:-1]])
    if span * (int(gi[-1]) + 1) < 2**62:
        shifted = (e - base) + gi * span
        run_max = np.maximum.accumulate(shifted) - gi * span + base
    else:  # pragma: no cover - only for absurd spans × group counts
        run_max = e.copy()
        for k in np.unique(gi):
            m = gi == k
            run_max[m] = np.maximum.accumulate(e[m])
    new[1:] = (g[1:] != g[:-1]) | (s[1:] > run_max[:-1])
    idx = np.flatnonzero(new)
    last = np.append(idx[1:], s.size) - 1
    return g[idx], s[idx], run_max[last]


def total(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length of a disjoint interval set."""
    return int(np.sum(np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)))


def covered_before(starts: np.ndarray, ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """For a disjoint sorted set, the covered length in (-inf, t] for every t (vectorised)."""
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    t = np.asarray(t, dtype=np.int64)
    if s.size == 0:
        return np.zeros(t.shape, dtype=np.int64)
    cum = np.concatenate(([0], np.cumsum(e - s)))
    k = np.searchsorted(s, t, side="right")          # intervals starting at or before t
    out = cum[np.maximum(k - 1, 0)]
    partial = np.where(k > 0, np.minimum(t, e[np.maximum(k - 1, 0)]) - s[np.maximum(k - 1, 0)], 0)
    return np.where(k > 0, out + np.maximum(partial, 0), 0)


def covered_in(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Covered length of the disjoint set inside each [a_i, b_i] (vectorised)."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    return np.maximum(covered_before(starts, ends, b) - covered_before(starts, ends, a), 0)


def intersection_length(a_starts: np.ndarray, a_ends: np.ndarray, b_starts: np.ndarray, b_ends: np.ndarray) -> int:
    """|A ∩ B| for two disjoint sorted sets."""
    return int(covered_in(b_starts, b_ends, a_starts, a_ends).sum())


def gaps(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The holes between consecutive intervals of a disjoint sorted set."""
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    return e[:-1].copy(), s[1:].copy()
