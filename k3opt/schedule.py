"""Pipeline schedules: in-flight microbatches per rank, bubbles.

1F1B (seed 000; Megatron `schedules.py`): rank r holds min(M, p - r) unfinished forwards.
Interleaved 1F1B (Megatron `get_pp_rank_microbatches`): warmup 2(p - r - 1) + (v - 1) p, so the rank holds
min(2(p - r - 1) + (v - 1) p + 1, v M) chunk-microbatches at the end of warmup; which chunks they belong to
follows the schedule's order (groups of p microbatches per model chunk), and the steady state is simulated
forward by forward so that the worst mix of chunks is found, not assumed.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def inflight_1f1b(p: int, m: int, r: int) -> int:
    """Unfinished forwards on rank r under 1F1B: min(M, p - r) (seed 000)."""
    return min(m, p - r)


def inflight_interleaved(p: int, v: int, m: int, r: int) -> int:
    """Chunk-microbatches on rank r at the end of interleaved warmup: min(2(p-r-1) + (v-1)p + 1, vM)."""
    return min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)


def _forward_chunk(q: np.ndarray, p: int, v: int) -> np.ndarray:
    """Model chunk of the q-th forward on a rank: microbatches go in groups of p per chunk."""
    return (q // p) % v


def _backward_chunk(q: np.ndarray, p: int, v: int) -> np.ndarray:
    """Model chunk of the q-th backward: the same grouping, last chunk first."""
    return v - 1 - (q // p) % v


@lru_cache(maxsize=4096)
def inflight_compositions(p: int, v: int, m: int, r: int) -> tuple[tuple[int, ...], ...]:
    """Cached :func:`_compositions` (a plain function, so that mutation testing reaches its body)."""
    return _compositions(p, v, m, r)


def _compositions(p: int, v: int, m: int, r: int) -> tuple[tuple[int, ...], ...]:
    """Every distinct vector (held chunk-microbatches per local chunk k = 0..v-1) rank r passes through.

    The activation peak of rank r is the maximum over these vectors of sum_k count_k * bytes(chunk k).
    For v = 1 the single vector is (min(M, p - r),)."""
    if v == 1:
        return ((inflight_1f1b(p, m, r),),)
    total = v * m
    warm = inflight_interleaved(p, v, m, r)
    q = np.arange(total)
    fwd = np.zeros((total + 1, v), dtype=np.int64)
    np.add.at(fwd, (q + 1, _forward_chunk(q, p, v)), 1)
    fwd = np.cumsum(fwd, axis=0)  # fwd[n, k]: forwards of chunk k among the first n
    bwd = np.zeros((total + 1, v), dtype=np.int64)
    np.add.at(bwd, (q + 1, _backward_chunk(q, p, v)), 1)
    bwd = np.cumsum(bwd, axis=0)
    states = set()
    # Steady state: after warm + t forwards, t backwards are done (one forward, then one backward).
    for t in range(total - warm + 1):
        states.add(tuple(int(x) for x in fwd[warm + t] - bwd[t]))
    return tuple(sorted(states))


def peak_inflight(p: int, v: int, m: int, r: int) -> int:
    """Chunk-microbatches (microbatches when v = 1) rank r holds at its peak."""
    return max(sum(c) for c in inflight_compositions(p, v, m, r))


def bubble_overhead(p: int, v: int, m: int) -> float:
    """(p - 1) / (v M): bubble time over useful scheduled work (seed 002: 10.94% at PP8, M64)."""
    return (p - 1) / (v * m)


def bubble_fraction(p: int, v: int, m: int) -> float:
    """Bubble share of the compute-plus-bubble interval: ((p-1)/v) / (M + (p-1)/v) (seed 002: 7/71)."""
    b = (p - 1) / v
    return b / (m + b)


def schedule_slots(p: int, v: int, m: int) -> float:
    """Step = slots x the slowest rank's per-microbatch time: M + (p - 1)/v (1F1B: M + p - 1)."""
    return m + (p - 1) / v
