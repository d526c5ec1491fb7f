"""Incumbents: feasible layouts within seconds, before any CP-SAT model is built.

For the frames with the lowest bounds, a few splits (min-max balanced on per-layer work, min-max balanced on a
rank's bytes with its in-flight counts, and the even layer count) under each recompute mode and three toggle
sets (none, the activation-saving toggles, every memory-saving toggle the job allows) are priced by the public
`evaluate()`. The fitting ones are the search's first answer, its incumbents for pruning, and the CP-SAT
solution hints of their frames. Nothing here is a cost: every number is evaluate()'s.
"""

from __future__ import annotations

import bisect
import math
import time as _time
from collections.abc import Callable, Iterator

import numpy as np

from k3opt.coefficients import Coefficients
from k3opt.evaluate import evaluate
from k3opt.search.frames import (
    ACT_TOGGLES,
    RANK_TOGGLES,
    ActMode,
    Frame,
    _choices,
    allocated_capacity_bytes,
    frame_shape,
    layout_of,
    lifecycles,
)
from k3opt.search.ranking import ranked_coefficients as coefficients  # the ranked view (search/ranking.py)
from k3opt.search.result import PlanItem
from k3opt.specs import ClusterSpec, FsdpLifecycle, Job, ModelSpec, Recompute

MEMORY_TOGGLES = ("activation_offload", "pipeline_zero2_host_grads", "p2p_muon", "fused_cross_entropy",
                  "balance_activations")
"""Rank toggles that only save memory (at some time cost); the 'lean' toggle set turns on those allowed."""


def minmax_split(cost: np.ndarray, fixed: np.ndarray, mem: np.ndarray | None = None,
                 mem_fixed: np.ndarray | None = None, mem_cap: float = math.inf) -> list[int] | None:
    """Contiguous split of L layers into K chunks (>= 1 layer each) minimizing max_j (fixed[j] + sum of cost[j, i]
    over chunk j's layers), optionally with every chunk's mem_fixed[j] + sum of mem[j, i] <= mem_cap; arrays of
    shape (K, L), non-negative. Bisection on the threshold with a greedy fill: each chunk takes the longest
    prefix that fits, which is optimal because a shorter remainder never hurts. None when the cap cannot hold."""
    K, L = cost.shape
    pre_a = np.concatenate([np.zeros((K, 1)), np.cumsum(cost, axis=1)], axis=1)
    # The fill runs on Python floats (the same doubles): a scalar bisect is far cheaper than a numpy call.
    pre, fx = pre_a.tolist(), [float(x) for x in fixed]
    mpre = np.concatenate([np.zeros((K, 1)), np.cumsum(mem, axis=1)], axis=1).tolist() if mem is not None else None
    mfx = [float(x) for x in mem_fixed] if mem_fixed is not None else None

    def fill(limit: float) -> list[int] | None:
        start, out = 0, []
        for j in range(K):
            last = L - (K - j - 1)
            if j == K - 1:
                end = L
            else:
                room = limit - fx[j] + pre[j][start]
                end = bisect.bisect_right(pre[j], room) - 1
                if mpre is not None and mfx is not None:
                    mroom = mem_cap - mfx[j] + mpre[j][start]
                    end = min(end, bisect.bisect_right(mpre[j], mroom) - 1)
                end = min(max(end, start + 1), last)
            if fx[j] + pre[j][end] - pre[j][start] > limit:
                return None
            if mpre is not None and mfx is not None and mfx[j] + mpre[j][end] - mpre[j][start] > mem_cap:
                return None
            out.append(end - start)
            start = end
        return out

    lo = float(max(fixed.max(), 0.0))
    hi = float(fixed.max() + pre_a[:, -1].max())
    best = fill(hi)
    for _ in range(40):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = 0.5 * (lo + hi)
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def candidate_splits(cf: Coefficients, cap: float) -> list[list[int]]:
    """Every split of `iter_candidate_splits`, in its order."""
    return list(iter_candidate_splits(cf, cap))


def iter_candidate_splits(cf: Coefficients, cap: float) -> Iterator[list[int]]:
    """Work-balanced, work-balanced under a few memory lines, memory-balanced and even splits of the shape's
    chunks (distinct), each computed when asked for (pricing stops at the first that fits). A chunk's bytes here
    are its layers' persistent bytes plus their saved bytes times the chunk's peak in-flight count; the lines (a
    share of `cap`, per chunk of a rank) leave room for the rest."""
    L, K, p = cf.n_layers, cf.shape.chunks, cf.shape.pp
    work = np.max([cf.time[res] for res in cf.time], axis=0)
    edge_work = np.zeros(K)
    edge_work[0] += work[L]
    edge_work[K - 1] += work[L + 1]
    seen: list[list[int]] = []

    def new(s: list[int] | None) -> bool:
        if s is None or s in seen:
            return False
        seen.append(s)
        return True

    s = minmax_split(np.broadcast_to(work[:L], (K, L)), edge_work)
    if new(s):
        yield s
    persistent = cf.master + cf.optimizer + cf.bf16_view + cf.grads + cf.grad_accum
    held = np.zeros(K)
    for j in range(K):
        r, k = j % p, j // p
        held[j] = max(c[k] for c in cf.compositions[r])
    mem = persistent[None, :L] + held[:, None] * cf.act[None, :L]
    edge_mem = np.zeros(K)
    edge_mem[0] += persistent[L] + held[0] * cf.act[L]
    edge_mem[K - 1] += persistent[L + 1] + held[K - 1] * cf.act[L + 1]
    for share in (0.95, 0.9, 0.8):
        s = minmax_split(np.broadcast_to(work[:L], (K, L)), edge_work, mem, edge_mem, share * cap / cf.shape.vp)
        if new(s):
            yield s
    s = minmax_split(mem, edge_mem)
    if new(s):
        yield s
    s = [L // K + (1 if j < L % K else 0) for j in range(K)]
    if new(s):
        yield s


def toggle_sets(job: Job) -> list[tuple[dict[str, bool], dict[str, bool]]]:
    """(activation toggles, rank toggles): none on, the activation-saving ones on, every memory-saving one on.
    A toggle the job requires is always on, one it forbids always off."""
    def pick(names: tuple[str, ...], want: set[str]) -> dict[str, bool]:
        out = {}
        for t in names:
            ch = _choices(job, t)
            out[t] = (t in want and True in ch) or ch == [True]
        return out

    plain = (pick(ACT_TOGGLES, set()), pick(RANK_TOGGLES, set()))
    act = (pick(ACT_TOGGLES, set(ACT_TOGGLES)), plain[1])
    lean = (act[0], pick(RANK_TOGGLES, set(MEMORY_TOGGLES)))
    out = []
    for s in (plain, act, lean):
        if s not in out:
            out.append(s)
    return out


def frame_incumbent(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec, better_than: float = math.inf,
                    recompute: Recompute | None = None, lifecycle: FsdpLifecycle | None = None,
                    deadline: float = math.inf) -> PlanItem | None:
    """The fastest fitting layout of frame f among the heuristic candidates (None when none fits). The leanest
    candidate (full recompute, every memory-saving toggle, memory-balanced split) is tried first: when it does
    not fit, no other candidate of this family does either, and the frame is left to the exact search.
    `recompute` and `lifecycle` restrict the candidates to one node (without them: the first lifecycle only);
    pricing stops at the monotonic `deadline`."""
    recs = [recompute] if recompute is not None else (job.search.recompute or list(Recompute))
    lcs = [lifecycle] if lifecycle is not None else lifecycles(job)[:1]
    sets = toggle_sets(job)
    order = sorted(recs, key=lambda rc: {Recompute.FULL: 0, Recompute.SELECTIVE: 1, Recompute.NONE: 2}[rc])
    best: PlanItem | None = None
    cap = allocated_capacity_bytes(job, f, model, cluster)

    def price(rc: Recompute, lc: FsdpLifecycle, act: dict[str, bool], rank: dict[str, bool],
              splits: list[list[int]] | None) -> bool:
        nonlocal best
        mode = ActMode(rc, *(act[t] for t in ACT_TOGGLES))
        shape = frame_shape(job, f, mode, lc, **rank)
        cand = splits if splits is not None else iter_candidate_splits(coefficients(shape, model, cluster), cap)
        fitted = False
        for split in cand:
            if _time.monotonic() > deadline:
                break
            ev = evaluate(layout_of(job, f, shape, split), model=model, cluster=cluster)
            if not ev.fits:
                continue
            fitted = True
            key = (ev.step.rank_time_s, ev.peak_bytes)
            if key[0] < better_than and (best is None or key < (best.rank_time_s, best.peak_bytes)):
                best = PlanItem(ev.layout, ev)
            break  # the splits come most work-balanced first: the first that fits stands for this candidate
        return fitted

    fixed = [list(job.search.split)] if job.search.split is not None else None
    if not price(order[0], lcs[0], *sets[-1], fixed):
        return None
    for rc in order:
        for lc in lcs:
            for act, rank in sets:
                if (rc, lc, act, rank) == (order[0], lcs[0], *sets[-1]):
                    continue
                price(rc, lc, act, rank, fixed)
    return best


def visiting_order(ordered: list[tuple[tuple[bool, float], Frame]]) -> list[tuple[tuple[bool, float], Frame]]:
    """Round-robin over the (pp, vp) groups, each group by ascending key, the groups by their best key: the
    heuristics then see every pipeline shape early instead of the many frames of the one shape that bounds low."""
    groups: dict[tuple[int, int], list[tuple[tuple[bool, float], Frame]]] = {}
    for key, f in sorted(ordered, key=lambda e: e[0]):
        groups.setdefault((f.pp, f.vp), []).append((key, f))
    lists = sorted(groups.values(), key=lambda g: g[0][0])
    out = []
    for i in range(max((len(g) for g in lists), default=0)):
        out.extend(g[i] for g in lists if i < len(g))
    return out


def incumbents(job: Job, ordered: list[tuple[tuple[bool, float], Frame]], model: ModelSpec, cluster: ClusterSpec,
               top: int, budget_s: float, deadline: float, stop: Callable[[], bool] | None = None
               ) -> dict[Frame, PlanItem]:
    """Heuristic layouts of the frames in `ordered` (visited in that order), until `budget_s` has passed with at
    least one found, or the monotonic clock reaches `deadline`."""
    t0 = _time.monotonic()
    found: dict[Frame, PlanItem] = {}
    for _, f in ordered:
        now = _time.monotonic()
        if now >= deadline or (found and now - t0 >= budget_s) or (stop is not None and stop()):
            break
        item = frame_incumbent(job, f, model, cluster, deadline=min(deadline, t0 + budget_s) if found else deadline)
        if item is not None:
            found[f] = item
    return found
