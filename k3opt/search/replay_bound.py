"""Linear lower bounds of the replayed pipeline schedule, for the node model.

The replay (`schedule.replay_ops`) runs every rank's fixed Megatron order as early as dependencies allow, so its
makespan is the longest path through the operations; any one path, as counts (nF[g], nB[g]) of forwards and
backwards per global chunk g, gives  makespan >= sum_g nF[g] f_g + nB[g] b_g  for every split. The paths used:

- the classic ones: microbatch 0 forwards through chunks 0..g-1 (the chain that lets rank r start chunk g), rank
  r runs its order from the first operation of one chunk to the last operation of another, then that
  microbatch's chain drains (backwards g'-1..0). First forward of chunk r (local chunk 0) to the last backward of
  chunk r, on rank r, is the textbook bound sum_{s<r} c_s + M x rank r's stage time: (p - 1 + v M) c for equal
  chunks c (seed 002's bubble (p - 1) / (v M));
- the longest paths of the replay at sample splits (`schedule.critical_path`), and of the node's own solutions.

With f_g = c_g / (1 + beta), b_g = beta c_g / (1 + beta) (schedule.chunk_times: beta = BACKWARD_OVER_FORWARD, +1
under full recompute) a path is  sum_g a_g c_g,  a_g = (nF[g] + beta nB[g]) / (1 + beta); with several recompute
modes in one node, the least over their betas (a_g c_g with c_g >= 0 is monotone in beta). Coefficients are kept
as integers: `SCALE` a_g (SCALE = 12 = lcm(1 + 2, 1 + 3) makes both betas exact).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from k3opt.cost.schedule import BACKWARD_OVER_FORWARD, backward_over_forward, chunk_times, critical_path, pipeline_order
from k3opt.search.policy import POLICY

SCALE = 12
"""Integer scale of the path coefficients: 12 (nF + beta nB) / (1 + beta) is an integer for beta = 2 and 3."""


def seed_paths(p: int, v: int, m: int, layer_work: np.ndarray, beta: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """The paths an interleaved node's bounds start from: the classic ones and the longest at POLICY.sample_splits
    sample splits over `layer_work` (any nonnegative weights give valid paths)."""
    return classic_paths(p, v, m) + split_paths(p, v, m, layer_work,
                                                 sample_splits(len(layer_work), p * v, POLICY.sample_splits), beta)


def betas(full_recompute: Iterable[bool]) -> list[float]:
    """Backward / forward time ratios of the node's recompute modes (schedule.chunk_times)."""
    return sorted({backward_over_forward(full) for full in full_recompute})


def path_coefficients(nf: np.ndarray, nb: np.ndarray, beta_values: list[float]) -> np.ndarray:
    """SCALE x a_g per global chunk, the least over the betas, rounded down (a lower bound stays one)."""
    a = np.min([SCALE * (nf + b * nb) / (1.0 + b) for b in beta_values], axis=0)
    return np.floor(a + 1e-9).astype(np.int64)


def classic_paths(p: int, v: int, m: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rank r: from the first operation (forward or backward) of one local chunk to the last operation of
    another on rank r's order, with the chains before and after (module docstring). The first forward of a chunk
    waits for microbatch 0's forwards through the chunks before it; the first backward for the forwards of all
    chunks and the backwards of the chunks after it. After a last backward of chunk h the chain drains
    backwards h-1..0; after a last forward, forwards h+1.. and every backward. Microbatch-independent chains make
    the first (last) operation of each kind and chunk the strongest start (end)."""
    k_all = p * v
    out = []
    for r in range(p):
        order = pipeline_order(p, v, m, r)
        first: dict[tuple[bool, int], int] = {}
        last: dict[tuple[bool, int], int] = {}
        for i, (is_f, k, _) in enumerate(order):
            first.setdefault((is_f, k), i)
            last[(is_f, k)] = i
        for (fa, ka), i in first.items():
            g = ka * p + r
            for (fb, kb), j in last.items():
                if j < i:
                    continue
                h = kb * p + r
                nf = np.zeros(k_all, dtype=np.int64)
                nb = np.zeros(k_all, dtype=np.int64)
                if fa:
                    nf[:g] += 1
                else:
                    nf += 1
                    nb[g + 1:] += 1
                for is_f, k, _ in order[i:j + 1]:
                    (nf if is_f else nb)[k * p + r] += 1
                if fb:
                    nf[h + 1:] += 1
                    nb += 1
                else:
                    nb[:h] += 1
                out.append((nf, nb))
    return out


def split_paths(p: int, v: int, m: int, layer_work: np.ndarray, splits: Iterable[list[int] | tuple[int, ...]],
                beta: float = BACKWARD_OVER_FORWARD) -> list[tuple[np.ndarray, np.ndarray]]:
    """The replay's longest path at each split, over chunk times from `layer_work` (seconds per layer and
    microbatch, length L; any nonnegative weights give valid paths, the closer to the real chunk times the
    tighter): each chunk's work, its rank's total as the stage time (schedule.chunk_times)."""
    out = []
    for split in splits:
        edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
        work = np.array([layer_work[edges[j]:edges[j + 1]].sum() for j in range(p * v)])
        stages = [work[r::p].sum() for r in range(p)]
        fwd, bwd = chunk_times(work, stages, p, beta > BACKWARD_OVER_FORWARD)
        out.append(critical_path(p, v, m, fwd, bwd))
    return out


def sample_splits(n_layers: int, chunks: int, count: int, seed: int = 0) -> list[list[int]]:
    """Deterministic splits to seed the path set: the even split, splits with small early chunks and large last
    ones (what the step formula rewards: the early chunks hold the most microbatches in flight) and the reverse,
    and random ones."""
    rng = np.random.default_rng(seed)
    even = [n_layers // chunks + (1 if j < n_layers % chunks else 0) for j in range(chunks)]
    out = [even]
    for i in range(count):
        kind = i % 3
        if kind == 0:
            w = rng.random(chunks) ** 2 + 0.05
        elif kind == 1:
            w = np.linspace(0.2, 1.8, chunks) * (0.5 + rng.random(chunks))
        else:
            w = np.linspace(1.8, 0.2, chunks) * (0.5 + rng.random(chunks))
        out.append(_integer_split(n_layers, w))
    return out


def _integer_split(n_layers: int, weights: np.ndarray) -> list[int]:
    """At least one layer per chunk, the rest in proportion to `weights` (largest remainders)."""
    k = len(weights)
    rest = n_layers - k
    share = weights / weights.sum() * rest
    base = np.floor(share).astype(int)
    left = rest - int(base.sum())
    base[np.argsort(-(share - base))[:left]] += 1
    return [int(x) + 1 for x in base]


def unique_paths(paths: Iterable[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    seen: set[bytes] = set()
    out = []
    for nf, nb in paths:
        key = np.concatenate([nf, nb]).tobytes()
        if key not in seen:
            seen.add(key)
            out.append((nf, nb))
    return out


def undominated(rows: list[np.ndarray]) -> list[np.ndarray]:
    """The coefficient rows no other row matches or exceeds in every chunk (with c >= 0 those bound no higher);
    of equal rows, the first."""
    if not rows:
        return []
    a = np.unique(np.stack(rows), axis=0)
    ge = (a[:, None, :] >= a[None, :, :]).all(axis=2)  # ge[i, k]: row i >= row k everywhere
    np.fill_diagonal(ge, False)
    return [a[k] for k in range(len(a)) if not ge[:, k].any()]
