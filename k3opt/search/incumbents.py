"""Incumbents: feasible layouts within seconds, before any CP-SAT model is built.

For the frames with the lowest bounds, a few splits (min-max balanced on per-layer work, min-max balanced on a
rank's bytes with its in-flight counts, and the even layer count) under each recompute mode and three toggle
sets (none, the activation-saving toggles, every memory-saving toggle the job allows) are priced by the public
`evaluate()`. The fitting ones are the search's first answer, its incumbents for pruning, and the CP-SAT
solution hints of their frames. Nothing here is a cost: every number is evaluate()'s.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time as _time
from collections.abc import Callable, Iterator

import numpy as np

from k3opt.cost.achievable import chunk_work, rank_indices, rank_sums
from k3opt.cost.coefficients import Coefficients, Shape, busiest_layer_seconds
from k3opt.cost.evaluate import Evaluation, evaluate
from k3opt.cost.ledger import ALWAYS_HELD, layer_bytes
from k3opt.cost.schedule import chunk_times, replay_makespan
from k3opt.inputs.errors import K3optError
from k3opt.inputs.memo import Memo
from k3opt.inputs.presets import load_runtime
from k3opt.inputs.specs import ClusterSpec, FsdpLifecycle, Job, Layout, ModelSpec, Recompute, RuntimeSpec
from k3opt.inputs.toggles import TOGGLES, ToggleKind
from k3opt.inputs.toggles import names as toggle_names
from k3opt.search.frames import (
    ACT_TOGGLES,
    RANK_TOGGLES,
    ActMode,
    Frame,
    allocated_capacity_bytes,
    choices,
    chunk_least,
    fits,
    frame_of,
    frame_shape,
    layout_of,
    least_or_one,
    lifecycles,
    offload_sets,
    peak_cap_bytes,
    sharding_group,
)
from k3opt.search.policy import POLICY
from k3opt.search.ranking import ranked_coefficients as coefficients  # the ranked view (search/ranking.py)
from k3opt.search.result import PlanItem

LEAN = {Recompute.FULL: 0, Recompute.SELECTIVE: 1, Recompute.NONE: 2}
"""Recompute modes from the least saved memory to the most."""


MEMORY_TOGGLES = toggle_names(ToggleKind.RANK, memory_only=True)
"""Rank toggles that only save memory (at some time cost); the 'lean' toggle set turns on those allowed."""
STATE_TOGGLES = tuple(t for t in MEMORY_TOGGLES
                      if set(TOGGLES[t].changes) & {*ALWAYS_HELD, "grads", "grad_accum"})
"""Memory toggles that trade one persistent buffer for another: pipeline ZeRO-2's host gradients keep two GPU chunk
buffers in place of the gradient shard, leaner under an unsharded gradient buffer and fatter under a sharded one
(K3 PP8 VP4 dFSDP64 optim_grads: 19.5 -> 37.1 GiB of gradients on rank 0). So the lean sets are two, with and
without them (`lean_sets`)."""

VECTOR_ACT_TOGGLES = toggle_names(ToggleKind.ACTIVATION, vector_only=True)
"""Activation toggles whose only time is memory-bound traffic (FP8 saved sets, the fused SiTU-GLU, the MoE backward
rewrite), most of them cheaper on both counts: a heuristic family of their own (`toggle_sets`), apart from the
dispatch recompute, which replays a network pass. Without it the families had them only beside that replay: K3 FP8
PP8 VP1 on 512 GB300 priced 15.21 s where they alone give 14.53 s (the node's CP-SAT optimum)."""


def minmax_split(cost: np.ndarray, fixed: np.ndarray, mem: np.ndarray | None = None,
                 mem_fixed: np.ndarray | None = None, mem_cap: float = math.inf,
                 least: tuple[int, ...] = ()) -> list[int] | None:
    """Contiguous split of L layers into K chunks (at least least[j] layers each: `frames.chunk_least`, one when
    empty) minimizing max_j (fixed[j] + sum of cost[j, i] over chunk j's layers), optionally with every chunk's
    mem_fixed[j] + sum of mem[j, i] <= mem_cap; arrays of shape (K, L), non-negative. Bisection on the threshold
    with a greedy fill: each chunk takes the longest prefix that fits, which is optimal because a shorter remainder
    never hurts. None when the cap cannot hold."""
    K, L = cost.shape
    need = least_or_one(least, K)
    after = [sum(need[j + 1:]) for j in range(K)]
    pre_a = np.concatenate([np.zeros((K, 1)), np.cumsum(cost, axis=1)], axis=1)
    # The fill runs on Python floats (the same doubles): a scalar bisect is far cheaper than a numpy call.
    pre, fx = pre_a.tolist(), [float(x) for x in fixed]
    mpre = np.concatenate([np.zeros((K, 1)), np.cumsum(mem, axis=1)], axis=1).tolist() if mem is not None else None
    mfx = [float(x) for x in mem_fixed] if mem_fixed is not None else None

    def fill(limit: float) -> list[int] | None:
        start, out = 0, []
        for j in range(K):
            last = L - after[j]
            if j == K - 1:
                end = L
            else:
                room = limit - fx[j] + pre[j][start]
                end = bisect.bisect_right(pre[j], room) - 1
                if mpre is not None and mfx is not None:
                    mroom = mem_cap - mfx[j] + mpre[j][start]
                    end = min(end, bisect.bisect_right(mpre[j], mroom) - 1)
                end = min(max(end, start + need[j]), last)
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


def candidate_splits(cf: Coefficients, cap: float, least: tuple[int, ...] = ()) -> list[list[int]]:
    """Every split of `iter_candidate_splits`, in its order."""
    return list(iter_candidate_splits(cf, cap, least))


def iter_candidate_splits(cf: Coefficients, cap: float, least: tuple[int, ...] = ()) -> Iterator[list[int]]:
    """Work-balanced, work-balanced under a few memory lines, memory-balanced and even splits of the shape's
    chunks (distinct), each computed when asked for (pricing stops at the first that fits). A chunk's bytes here
    are its layers' persistent bytes plus their saved bytes times the chunk's peak in-flight count; the lines (a
    share of `cap`, per chunk of a rank) leave room for the rest. `least`: each chunk's least layers
    (`frames.chunk_least`; empty: one)."""
    L, K, p = cf.n_layers, cf.shape.chunks, cf.shape.pp
    work = busiest_layer_seconds(cf)
    edge_work = np.zeros(K)
    edge_work[0] += work[L]
    edge_work[K - 1] += work[L + 1]
    seen: list[list[int]] = []

    def new(s: list[int] | None) -> bool:
        if s is None or s in seen:
            return False
        seen.append(s)
        return True

    s = minmax_split(np.broadcast_to(work[:L], (K, L)), edge_work, least=least)
    if new(s):
        yield s
    persistent = layer_bytes(cf, ("master", "optimizer", "bf16_view", "grads", "grad_accum"))
    held = np.zeros(K)
    for j in range(K):
        r, k = j % p, j // p
        held[j] = max(c[k] for c in cf.compositions[r])
    mem = persistent[None, :L] + held[:, None] * cf.act[None, :L]
    edge_mem = np.zeros(K)
    edge_mem[0] += persistent[L] + held[0] * cf.act[L]
    edge_mem[K - 1] += persistent[L + 1] + held[K - 1] * cf.act[L + 1]
    for share in (0.95, 0.9, 0.8):
        s = minmax_split(np.broadcast_to(work[:L], (K, L)), edge_work, mem, edge_mem, share * cap / cf.shape.vp,
                         least=least)
        if new(s):
            yield s
    s = minmax_split(mem, edge_mem, least=least)
    if new(s):
        yield s
    s = [L // K + (1 if j < L % K else 0) for j in range(K)]
    if new(s):
        yield s


def rank_balanced_candidate(cf: Coefficients, least: tuple[int, ...] = ()) -> list[int] | None:
    """`rank_balanced_split` of an interleaved shape at its per-layer busiest-resource work (None for v = 1)."""
    if cf.shape.vp == 1:
        return None
    work = np.ascontiguousarray(busiest_layer_seconds(cf), dtype=float)
    split = _rank_split(work.tobytes(), cf.shape.pp, cf.shape.vp, tuple(least))
    return list(split) if split is not None else None


def _build_rank_split(work: bytes, p: int, v: int, least: tuple[int, ...]) -> tuple[int, ...] | None:
    """`rank_balanced_split` of the per-layer work given as its float64 bytes (the memo's key)."""
    split = rank_balanced_split(np.frombuffer(work, dtype=float), p, v, least)
    return tuple(split) if split is not None else None


# The seeding prices one shape under many configurations whose per-layer work repeats; a refinement is milliseconds.
_rank_split = Memo(_build_rank_split, maxsize=4096)


def rank_balanced_split(work: np.ndarray, p: int, v: int, least: tuple[int, ...] = ()) -> list[int] | None:
    """An interleaved split balanced per rank: each rank's layer count water-filled at the mean layer work `work`
    (per layer, the edges last: the embedding on rank 0, the head on rank p - 1), a tie going to the later rank
    (the earlier ranks hold more microbatches in flight); within a rank, each layer to the chunk whose work (its
    layers and its edge) stays least, a tie going to the later chunk (the fewest in flight): the head's chunk then
    holds fewer layers than the rank's others, which the replayed schedule rewards (DeepSeek-V3 PP8 VP4 on 512 B200
    at 8K, LM head and MTP head on the last chunk: 5.005 s spread by count, 4.584 s by work). Each chunk holds at
    least least[j] layers (one when empty); None when the chunks' least exceeds the layers."""
    L, K = len(work) - 2, p * v
    need = least_or_one(least, K)
    n = [sum(need[k * p + r] for k in range(v)) for r in range(p)]
    left = L - sum(n)
    if left < 0:
        return None
    w = float(np.mean(work[:L])) if L else 0.0
    edge = [float(work[L]) if r == 0 else 0.0 for r in range(p)]
    edge[p - 1] += float(work[L + 1])
    for _ in range(left):
        r = min(range(p), key=lambda q: ((n[q] + 1) * w + edge[q], -q))
        n[r] += 1
    split = list(need)
    chunk_edge = np.zeros(K)
    chunk_edge[0] += float(work[L])
    chunk_edge[K - 1] += float(work[L + 1])
    for r in range(p):
        extra = n[r] - sum(need[k * p + r] for k in range(v))
        for _ in range(extra):
            j = min(range(r, K, p), key=lambda g: ((split[g] + 1) * w + chunk_edge[g], -g))
            split[j] += 1
    return refine_rank_loads(split, work, p, need)


LOAD_TOL = 1e-9
"""Relative difference under which two rank loads of the refinement count as equal: the rounding of sums of
per-layer seconds, not a cost."""


def _rank_loads(split: list[int], work: np.ndarray, p: int) -> np.ndarray:
    """Each rank's sum of `work` (per layer, then the two edges) over what it holds (`achievable.rank_indices`)."""
    L = len(work) - 2
    return np.array([float(work[rank_indices(split, r, p, L)].sum()) for r in range(p)])


def _load_keys(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of rank loads: (slowest rank, ranks within LOAD_TOL of it, sum of squares), what the refinement
    lowers, in that order."""
    top = rows.max(axis=1)
    return top, (rows >= top[:, None] * (1 - LOAD_TOL)).sum(axis=1), (rows ** 2).sum(axis=1)


def _better(top: np.ndarray, cnt: np.ndarray, sq: np.ndarray, cur: tuple[float, int, float]) -> np.ndarray:
    """Which keys are below `cur` in its order, by more than LOAD_TOL where a load is compared."""
    same_top = np.abs(top - cur[0]) <= LOAD_TOL * cur[0]
    return ((top < cur[0] * (1 - LOAD_TOL)) | (same_top & (cnt < cur[1]))
            | (same_top & (cnt == cur[1]) & (sq < cur[2] * (1 - LOAD_TOL))))


def refine_rank_loads(split: list[int], work: np.ndarray, p: int, least: list[int]) -> list[int]:
    """`split` with its layers moved, one at a time, from a chunk to another while that lowers (slowest rank's
    load, ranks at it, sum of squared loads) over the actual layers: the water-fill counts each rank's layers at the
    mean layer work, but which layers a rank holds follows from every chunk before it, and where layer kinds differ
    the ranks' sums do too (K3 PP16 VP3 over 1,024 B200, 93 layers in 48 chunks, three of one layer: with them on
    ranks 0, 1 and 15 six ranks hold six of the heavier layers, 228.8 ms, and the step formula is 18.416 s; moved to
    ranks 11, 13 and 15 every rank of six holds a lighter one, 227.6 ms, and 18.265 s). Moving a layer from chunk a
    to chunk b shifts each boundary between them by one layer, so only the chunks a and b change size; sizes stay
    within the split's own range (the chunk granularity the water-fill chose, which the replay reads) and the last
    chunk, beside the head, never grows. At most K moves; the split is kept as it was unless its slowest rank is
    lighter after them."""
    K, L = len(split), len(work) - 2
    if K < 3 or L == 0:
        return split
    lo, hi = min(split), max(split)
    s = list(split)
    loads = _rank_loads(s, work, p)
    cur = tuple(float(x[0]) for x in _load_keys(loads[None, :]))
    first = cur[0]
    ranks = np.arange(K) % p
    for _ in range(K):
        ends = np.cumsum(s)
        # A left shift of boundary g (chunk g's last layer to chunk g + 1), and a right shift (chunk g + 1's first
        # layer to chunk g), as changes of the rank loads.
        left = np.zeros((K - 1, p))
        right = np.zeros((K - 1, p))
        g = np.arange(K - 1)
        wl, wr = work[ends[:-1] - 1], work[ends[:-1]]
        np.add.at(left, (g, ranks[:-1]), -wl)
        np.add.at(left, (g, ranks[1:]), wl)
        np.add.at(right, (g, ranks[:-1]), wr)
        np.add.at(right, (g, ranks[1:]), -wr)
        sizes = np.asarray(s)
        froms, tos, rows = [], [], []
        for a in range(K):
            if s[a] <= max(lo, least[a]):
                continue
            # b > a: boundaries a..b-1 shift left; b < a: boundaries b..a-1 shift right.
            for bs, moved in ((np.arange(a + 1, K), loads + np.cumsum(left[a:], axis=0)),
                              (np.arange(a - 1, -1, -1), loads + np.cumsum(right[:a][::-1], axis=0))):
                ok = (sizes[bs] < hi) & (bs != K - 1)
                froms.append(np.full(int(ok.sum()), a))
                tos.append(bs[ok])
                rows.append(moved[ok])
        allrows = np.concatenate(rows) if rows else np.zeros((0, p))
        if not len(allrows):
            break
        top, cnt, sq = _load_keys(allrows)
        good = np.flatnonzero(_better(top, cnt, sq, cur))
        if not len(good):
            break
        i = good[np.lexsort((sq[good], cnt[good], top[good]))[0]]
        a, b = int(np.concatenate(froms)[i]), int(np.concatenate(tos)[i])
        s[a] -= 1
        s[b] += 1
        loads = _rank_loads(s, work, p)
        cur = tuple(float(x[0]) for x in _load_keys(loads[None, :]))
    # Moves that only even out the ranks under an unchanged slowest one change the warm-up the replay reads and buy
    # no step (Kimi K2 PP16 VP3 over 1,024 B200: formula 2.858 s either way, replayed 3.083 s before, 3.183 s after).
    return s if cur[0] < first * (1 - LOAD_TOL) else list(split)


def toggle_sets(job: Job) -> list[tuple[dict[str, bool], dict[str, bool]]]:
    """(activation toggles, rank toggles): none on, the traffic-only activation toggles on (VECTOR_ACT_TOGGLES), every
    activation-saving one on, then the lean sets (`lean_sets`).
    A toggle the job requires is always on, one it forbids always off."""
    plain, act = _pick(job, set(), set()), _pick(job, set(ACT_TOGGLES), set())
    return _unique([plain, _pick(job, set(VECTOR_ACT_TOGGLES), set()), act, *lean_sets(job)[::-1]])


def lean_sets(job: Job) -> list[tuple[dict[str, bool], dict[str, bool]]]:
    """The lean toggle sets, the activation-saving toggles on with every memory-saving one, then with every one
    but those that trade persistent buffers (STATE_TOGGLES): either may be the leaner on a given shape."""
    return _unique([_pick(job, set(ACT_TOGGLES), set(MEMORY_TOGGLES)),
                    _pick(job, set(ACT_TOGGLES), set(MEMORY_TOGGLES) - set(STATE_TOGGLES))])


def _pick(job: Job, act: set[str], rank: set[str]) -> tuple[dict[str, bool], dict[str, bool]]:
    def pick(names: tuple[str, ...], want: set[str]) -> dict[str, bool]:
        out = {}
        for t in names:
            ch = choices(job, t)
            out[t] = (t in want and True in ch) or ch == [True]
        return out

    return pick(ACT_TOGGLES, act), pick(RANK_TOGGLES, rank)


def _unique(sets: list[tuple[dict[str, bool], dict[str, bool]]]) -> list[tuple[dict[str, bool], dict[str, bool]]]:
    out = []
    for st in sets:
        if st not in out:
            out.append(st)
    return out


def frame_incumbent(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec, better_than: float = math.inf,
                    recompute: Recompute | None = None, lifecycle: FsdpLifecycle | None = None,
                    deadline: float = math.inf, repair_below: float | None = None,
                    floor: float = math.inf) -> PlanItem | None:
    """The fastest fitting layout of frame f among the heuristic candidates (None when none fits). The leanest
    candidates (full recompute, each lean toggle set, memory-balanced split) are tried first: when neither fits,
    no other candidate of this family does either, and the frame is left to the exact search.
    `recompute` and `lifecycle` restrict the candidates to one node (without them: the first lifecycle only);
    pricing stops at the monotonic `deadline`. With `repair_below`, a candidate none of whose splits fits has its
    fastest split's layers moved until it fits (`fit_repair`, POLICY.fit_repair_s each) when that split ranks
    faster than `repair_below` and than the best found; misfits over that line too, for one repair's time in all,
    when `floor` (a proven lower bound on the node) is under it, since a repair can end below the misfit it starts
    from."""
    recs = [recompute] if recompute is not None else (job.search.recompute or list(Recompute))
    lcs = [lifecycle] if lifecycle is not None else lifecycles(job)[:1]
    sets = toggle_sets(job)
    order = sorted(recs, key=lambda rc: {Recompute.FULL: 0, Recompute.SELECTIVE: 1, Recompute.NONE: 2}[rc])
    best: PlanItem | None = None
    best_main = math.inf  # the least step of the others (not the per-rank split): the repairs' line
    cap = allocated_capacity_bytes(job, f, model, cluster)
    least = chunk_least(job, f)

    def keep(ev: Evaluation, extra: bool = False) -> None:
        nonlocal best, best_main
        key = (ev.step.rank_time_s, ev.peak_bytes)
        if key[0] < better_than and (best is None or key < (best.rank_time_s, best.peak_bytes)):
            best = PlanItem(ev.layout, ev)
        if not extra:
            best_main = min(best_main, key[0])

    def price(rc: Recompute, lc: FsdpLifecycle, act: dict[str, bool], rank: dict[str, bool],
              splits: list[list[int]] | None) -> bool:
        mode = ActMode(rc, *(act[t] for t in ACT_TOGGLES))
        shape = frame_shape(job, f, mode, lc, **rank)
        cf = coefficients(shape, model, cluster) if splits is None else None
        cand = splits if cf is None else iter_candidate_splits(cf, cap, least)
        # Interleaved: the step prices each rank's sum of its chunks, which the chunk-by-chunk balances leave uneven
        # where chunks hold one or two layers (Kimi K2 PP16 VP3, 61 layers in 48 chunks: four layers beside the LM
        # head on the last rank, 3.476 s; balanced per rank, 3.083 s). Priced beside them, not in their place: on
        # K3 PP8 VP4 the chunk balance replays faster, and under memory the capped balances fit faster.
        extra = rank_balanced_candidate(cf, least) if cf is not None else None
        fitted = False
        quick: Evaluation | None = None
        for split in cand:
            if _time.monotonic() > deadline:
                break
            ev = evaluate(layout_of(job, f, shape, split), model=model, cluster=cluster)
            if split == extra:
                extra = None
            if not fits(job, ev):
                quick = ev if quick is None or ev.step.rank_time_s < quick.step.rank_time_s else quick
                continue
            fitted = True
            keep(ev)
            break  # the splits come most work-balanced first: the first that fits stands for this candidate
        # A misfit of the others is repaired (below) even where this split fits: it may fit faster once moved.
        if not fitted and quick is not None and repairs:
            unfit.append(quick)
        if extra is not None and _time.monotonic() <= deadline:
            ev = evaluate(layout_of(job, f, shape, extra), model=model, cluster=cluster)
            if fits(job, ev):
                fitted = True
                keep(ev, extra=True)
        return fitted

    fixed = [list(job.search.split)] if job.search.split is not None else None
    unfit: list[Evaluation] = []
    repairs = repair_below is not None and fixed is None
    # Either lean set may be the leaner (STATE_TOGGLES): the frame is left to the exact search when neither fits.
    priced = []
    for act, rank in lean_sets(job):
        priced.append((order[0], lcs[0], act, rank))
        if price(order[0], lcs[0], act, rank, fixed):
            break
    else:
        return None
    for rc in order:
        for lc in lcs:
            for act, rank in sets:
                if (rc, lc, act, rank) not in priced:
                    price(rc, lc, act, rank, fixed)
    line = min(repair_below if repair_below is not None else math.inf, better_than)
    return _repair_misfits(job, unfit, model, cluster, best, best_main, line, floor, deadline)


def _repair_misfits(job: Job, unfit: list[Evaluation], model: ModelSpec, cluster: ClusterSpec,
                    best: PlanItem | None, best_main: float, line: float, floor: float, deadline: float
                    ) -> PlanItem | None:
    """`best` or a repaired misfit (`fit_repair`) faster than it, the misfits tried fastest first under
    min(`line`, the fastest candidate or repair so far that is not the per-rank split, `best_main`)."""
    # A faster candidate whose splits all miss the memory line may fit once layers move off its fullest rank
    # (Llama 3 70B PP8 VP4 on 64 B200 without offload: 16.78 s, where the candidates fit only with it, 34.8 s).
    # The misfits to repair are those under the others' best, not under the per-rank split's: a repair can end
    # faster than the misfit it starts from (the six-layer model's PP2 VP2 node: 5.050 s, unfit, to 4.912 s,
    # where the per-rank split gives 4.946 s).
    # A misfit's own time does not bound its repair's (Llama 3 70B PP8 VP4 on B200, at BF16 GEMMs of 0.578: the
    # fastest misfit ranks 18.14 s and repairs to 16.81 s, under a line of 17.87 s): while the node's floor is under
    # the line, misfits over it are repaired too, in their order, for one repair's time (POLICY.fit_repair_s) in all.
    over_left = POLICY.fit_repair_s
    for ev in sorted(unfit, key=lambda e: e.step.rank_time_s):
        cut = min(line, best_main)
        over = ev.step.rank_time_s >= cut
        if (over and not (floor < cut and over_left > 0)) or _time.monotonic() > deadline:
            break
        t_repair = _time.monotonic()
        fixed_item = fit_repair(job, PlanItem(ev.layout, ev), model, cluster,
                                min(deadline, t_repair + (over_left if over else POLICY.fit_repair_s)))
        if over:
            over_left -= _time.monotonic() - t_repair
        if fixed_item is not None and fixed_item.rank_time_s < cut:
            best_main = fixed_item.rank_time_s
            if best is None or fixed_item.rank_time_s < best.rank_time_s:
                best = fixed_item
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


# ------------------------------------------------------------------------------------- configuration walks


@dataclasses.dataclass(frozen=True)
class Config:
    recompute: Recompute
    lifecycle: FsdpLifecycle
    on: frozenset[str]
    """Toggles (activation and rank) switched on."""
    offload: tuple[str, ...] = ()
    """Offload modules (Layout.offload_modules)."""

    def shape(self, job: Job, f: Frame) -> Shape:
        """The cost model's shape of frame f under this configuration."""
        mode = ActMode(self.recompute, *(t in self.on for t in ACT_TOGGLES), offload=self.offload)
        return frame_shape(job, f, mode, self.lifecycle, **{t: t in self.on for t in RANK_TOGGLES})


def _price(job: Job, f: Frame, cfg: Config, model: ModelSpec, cluster: ClusterSpec, runtime: RuntimeSpec | None,
           cap: int, deadline: float, out: list[PlanItem], every_split: bool = False) -> tuple[float, int, bool] | None:
    """(ranked step s, peak bytes, fits) of configuration cfg of frame f on its heuristic splits (most
    work-balanced first, search/incumbents.candidate_splits): the fastest split that fits, else the leanest
    priced. Pricing stops at the first split that fits unless `every_split` (the leaner splits of a fitting
    configuration are points of the front too, at the cost of their evaluate() calls only); an interleaved shape's
    per-rank split (`rank_balanced_candidate`) is priced beside them, as `frame_incumbent` prices it. Every fitting
    evaluation is appended to `out`. None when the deadline passed before any split was priced."""
    shape = cfg.shape(job, f)
    splits, extra = [list(job.search.split or ())], None
    if job.search.split is None:
        cf = coefficients(shape, model, cluster)
        splits = candidate_splits(cf, cap, chunk_least(job, f))
        extra = rank_balanced_candidate(cf, chunk_least(job, f))
    fast: tuple[float, int, bool] | None = None
    lean: tuple[float, int, bool] | None = None

    def price(split: list[int]) -> bool:
        nonlocal fast, lean
        ev = evaluate(layout_of(job, f, shape, split), model=model, cluster=cluster, runtime=runtime)
        got = (ev.step.rank_time_s, ev.peak_bytes, fits(job, ev))
        if got[2]:
            out.append(PlanItem(ev.layout, ev))
            fast = got if fast is None or got < fast else fast
        elif lean is None or got[1] < lean[1]:
            lean = got
        return got[2]

    priced: list[list[int]] = []
    for split in splits:
        if _time.monotonic() > deadline:
            break
        priced.append(split)
        if price(split) and not every_split:
            break
    # Beside the others, not in their place: on K3 PP8 VP4 the chunk balance replays faster, and under memory the
    # capped balances fit where it does not (frame_incumbent). Without it the seeding priced DeepSeek-V3 PP8 VP4
    # EP8 on 512 B200 at 8K at 5.215 s, where the per-rank split gives 4.584 s.
    if extra is not None and extra not in priced and _time.monotonic() <= deadline:
        price(extra)
    return fast or lean


def frame_walk(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec, deadline: float,
               runtime: RuntimeSpec | None = None, start: Layout | None = None,
               without_offload: bool = False) -> list[PlanItem]:
    """`_walk` from the leanest configuration (or `start`); with `without_offload` (the seeding's walks of the
    fastest layouts' frames), where the offload is free and the leanest configuration without it fits, from that
    one too. A walk keeps the offload until its removal is the best trade of time per byte, and under the offload,
    dropping another saving (the dispatch recompute) adds host-link traffic instead of saving time, so it can end
    where the configurations without the offload are never met (Kimi K2 on 256 GB200, PP2 VP4: 7.530 s from the
    leanest, 7.245 s from the leanest without the offload). Every walk of the seeding given the second start costs
    the large jobs their seeding time (K3 on 4,096 GPUs with a 5-GiB reserve then ends FEASIBLE)."""
    out = _walk(job, f, model, cluster, deadline, runtime, start)
    if not without_offload or start is not None or choices(job, "activation_offload") != [False, True]:
        return out
    lean = _leanest(job)
    fitting: list[PlanItem] = []
    _price(job, f, dataclasses.replace(lean, on=lean.on - {"activation_offload"}), model, cluster, runtime,
           allocated_capacity_bytes(job, f, model, cluster), deadline, fitting)
    if fitting:
        first = min(fitting, key=lambda it: (it.rank_time_s, it.peak_bytes))
        out += [first] + _walk(job, f, model, cluster, deadline, runtime, first.layout)
    return out


def _leanest(job: Job) -> Config:
    """A walk's first configuration: the leanest recompute mode, the first lifecycle, every memory toggle the job
    allows on."""
    recs = sorted(job.search.recompute or list(Recompute), key=LEAN.__getitem__)
    return Config(recs[0], lifecycles(job)[0], frozenset(t for t in ACT_TOGGLES + RANK_TOGGLES
                                                         if True in choices(job, t)))


def _walk(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec, deadline: float,
          runtime: RuntimeSpec | None = None, start: Layout | None = None) -> list[PlanItem]:
    """Fitting layouts of frame f along a greedy walk from its leanest configuration (the leanest recompute mode,
    every free memory toggle on), each priced by evaluate() on the heuristic splits. While that does not fit, the
    toggle whose removal lowers the peak most is switched off; when none does, the frame is left to the exact
    search (as search/incumbents.frame_incumbent leaves it). Then each step moves to the fitting neighbour -- one
    toggle switched off, the recompute mode one step richer, or the other lifecycle -- that saves the most step
    time per byte added (the first one faster and no larger at once), until none is faster. A change that did
    not fit is not tried again further on, where more memory is in use. Every fitting layout priced is returned.
    Stops at the monotonic `deadline`. `start`: a fitting layout of f whose configuration the walk starts from
    instead (it then only climbs)."""
    recs = sorted(job.search.recompute or list(Recompute), key=LEAN.__getitem__)
    lcs = lifecycles(job)
    names = ACT_TOGGLES + RANK_TOGGLES
    required = frozenset(t for t in names if choices(job, t) == [True])
    cap = allocated_capacity_bytes(job, f, model, cluster)
    out: list[PlanItem] = []
    cur = config_of(start) if start is not None else _leanest(job)
    now = _price(job, f, cur, model, cluster, runtime, cap, deadline, out)
    while now is not None and not now[2]:
        # Some "memory" toggles hold more on some ranks (host gradient shards keep a second buffer under a
        # policy that does not shard gradients): switch off the one that lowers the peak most, while one does.
        best = None
        for x in sorted(cur.on - required):
            got = _price(job, f, dataclasses.replace(cur, on=cur.on - {x}), model, cluster, runtime, cap, deadline,
                         out)
            if got is not None and got[1] < now[1] and (best is None or got[1] < best[1][1]):
                best = (x, got)
        if best is None:
            return out
        cur, now = dataclasses.replace(cur, on=cur.on - {best[0]}), best[1]
    if now is None:
        return out
    tried: set[tuple] = set()
    while _time.monotonic() < deadline:
        t, m, _ = now
        i = recs.index(cur.recompute)
        # Rank toggles first (each adds its own time: host traffic, rebalancing), then the recompute mode, the
        # activation toggles and the lifecycle; a move that is faster and no larger is taken at once.
        offs = cur.on - required
        moves = [(("off", x), dataclasses.replace(cur, on=cur.on - {x})) for x in RANK_TOGGLES if x in offs]
        if i + 1 < len(recs):
            moves.append((("recompute", recs[i + 1]), dataclasses.replace(cur, recompute=recs[i + 1])))
            # With a rank toggle off at once: some hold more on some ranks (host gradient buffers, balancing), and
            # the richer recompute mode may fit only without one.
            moves += [(("recompute", recs[i + 1], "off", x), dataclasses.replace(cur, recompute=recs[i + 1],
                                                                             on=cur.on - {x}))
                      for x in RANK_TOGGLES if x in offs]
            # With an offload set at once (in place of the whole set's): the richer mode may fit only with part of
            # its saved set on the host.
            if not cur.offload and recs[i + 1] != Recompute.FULL:
                moves += [(("recompute", recs[i + 1], "offload", o),
                           dataclasses.replace(cur, recompute=recs[i + 1], on=cur.on - {"activation_offload"},
                                               offload=o)) for o in offload_sets(job)]
        moves += [(("off", x), dataclasses.replace(cur, on=cur.on - {x})) for x in ACT_TOGGLES if x in offs]
        moves += _offload_moves(job, cur, offs)
        moves += [(("lifecycle", lc), dataclasses.replace(cur, lifecycle=lc)) for lc in lcs if lc != cur.lifecycle]
        best = None
        for move, nb in moves:
            if move in tried:
                continue
            got = _price(job, f, nb, model, cluster, runtime, cap, deadline, out)
            if got is None:
                break
            nt, nm, nfits = got
            if not nfits:
                tried.add(move)
                continue
            if nt < t:
                key = (math.inf, t - nt) if nm <= m else ((t - nt) / (nm - m), 0.0)
                if best is None or key > best[0]:
                    best = (key, move, nb, got)
                if nm <= m:
                    break
        if best is None:
            break
        _, move, cur, now = best
        tried.add(move)
    return out


def _offload_moves(job: Job, cur: Config, offs: frozenset[str]) -> list[tuple[tuple, Config]]:
    """A walk's moves between offloads: from the whole saved set (the activation_offload toggle) to each module set
    the job searches, less traffic for more GPU bytes; from a module set to none."""
    if cur.offload:
        return [(("offload", ()), dataclasses.replace(cur, offload=()))]
    if "activation_offload" not in offs or cur.recompute == Recompute.FULL:
        return []
    return [(("offload", o), dataclasses.replace(cur, on=cur.on - {"activation_offload"}, offload=o))
            for o in offload_sets(job)]


def config_of(layout: Layout) -> Config:
    return Config(layout.recompute, layout.fsdp_lifecycle,
                  frozenset(t for t in ACT_TOGGLES + RANK_TOGGLES if getattr(layout.toggles, t)),
                  tuple(m.value for m in layout.offload_modules))


def price_configs(job: Job, f: Frame, configs: list[Config], model: ModelSpec, cluster: ClusterSpec,
                  deadline: float, runtime: RuntimeSpec | None = None, every_split: bool = True,
                  settled: list[Config] | None = None) -> list[PlanItem]:
    """The fitting layouts of frame f under each of `configs` (recompute, lifecycle, toggles; fastest first,
    leanest last), each on its heuristic splits (all, or up to the first that fits), priced by evaluate() until the
    monotonic `deadline`. The leanest is priced first: when it does not fit, the others are not tried. `settled`
    receives the configurations priced, or ruled out by the leanest's misfit, before the deadline."""
    cap = allocated_capacity_bytes(job, f, model, cluster)
    out: list[PlanItem] = []
    order = configs[-1:] + configs[:-1]
    for k, c in enumerate(order):
        got = _price(job, f, c, model, cluster, runtime, cap, deadline, out, every_split=every_split)
        if got is None:
            break
        if settled is not None and _time.monotonic() <= deadline:  # past it, a split may have gone unpriced
            settled.extend(order if k == 0 and not got[2] else [c])
        if k == 0 and not got[2]:
            break
    return out


def seed_library(front: list[PlanItem], leanest: Recompute, most: int = POLICY.library_configs) -> list[Config]:
    """The distinct configurations of the front's points, each followed by its variant under the `leanest`
    recompute mode (what a frame with more activation bytes needs), at most `most`, spread over the front from
    fastest to leanest."""
    configs: list[Config] = []
    for it in sorted(front, key=lambda it: it.rank_time_s):
        c = config_of(it.layout)
        configs += [c, dataclasses.replace(c, recompute=leanest)]
    configs = list(dict.fromkeys(configs))
    if len(configs) <= most:
        return configs
    return [configs[round(i * (len(configs) - 1) / (most - 1))] for i in range(most)]


def seed(job: Job, ordered: list[Frame], model: ModelSpec, cluster: ClusterSpec, found: dict[Frame, PlanItem],
         deadline: float, stop: Callable[[], bool] | None = None, walked: set[Frame] | None = None,
         walk_first: bool = True, lower: Callable[[Frame], float] | None = None, top: int | None = None,
         gain: float = 0.0, configs: dict[Frame, dict[Config, PlanItem]] | None = None,
         done: Callable[[list[PlanItem]], bool] | None = None, patience_min: float | None = None,
         state: SeedState | None = None) -> dict[Frame, PlanItem]:
    """The front's seeding aimed at the fastest layout (search/front.py seeds the trade-off the same way): the
    frames of the POLICY.walked_frames fastest layouts in `found` are walked through their configurations from the
    leanest (`frame_walk`: it reaches configurations the fixed toggle sets of `frame_incumbent` miss, such as one
    rank toggle kept on its own); then each frame of `ordered` is priced under the fastest configurations so far
    and their leanest-recompute variants (`price_configs`), and walked too when it beats the fastest so far; a
    frame whose fastest layout is within POLICY.climb_within of the fastest has its split climbed (`split_climb`).
    Returns the fastest fitting layout of each frame priced that is faster than its entry in `found`; every number
    is evaluate()'s. Stops at the monotonic `deadline` or when `stop()`.

    `walked`: frames walked already (updated); `walk_first`: False skips the first walks (their frames are still
    climbed); `lower`: a lower bound on a frame's ranked step time, to skip the frames that cannot beat the
    fastest so far. A frame is skipped when a frame of its `sharding_group` whose FSDP degrees are multiples of
    its own had no fitting layout here. `top`: with it, the seeding also stops once it has gone as long without a
    gain (the `top`-th fastest layout or the fastest lowered by more than `gain`, relative, or a layout added
    while fewer than `top` were at hand) as it took to make its last gain, and at least POLICY.patience_min_s
    (`_Patience`). `configs`: per frame, the fastest layout priced under each configuration (updated; the climbs
    start from several): pass one dict to every call, so that a frame walked in one call is climbed in the next
    from every configuration its walk priced. `done`: the seeding also stops once it holds for the layouts so
    far, fastest first (the driver's proof is met); `patience_min`: the stall stop's minimum (default
    POLICY.patience_min_s); `state`: where an earlier call stopped (updated): this call goes on from there (its
    `ordered` only drops frames), with its own stall stop."""
    return Seeder(job, ordered, model, cluster, found, deadline, stop=stop, walked=walked, walk_first=walk_first,
                  lower=lower, top=top, gain=gain, configs=configs, done=done, patience_min=patience_min,
                  state=state).run()


class Seeder:
    """One `seed` call: its inputs, the layouts it found (`out`), the per-configuration record (`configs`), the
    state it resumes from and leaves (`st`), the time its climbs and walks took, and its stall stop. The phases:
    walk the frames of the fastest layouts (`walk_leads`), climb their splits (`climb_leads`), then visit the
    queue (`visit_queue`: each frame priced under the fastest configurations, walked once per shape, climbed)."""

    def __init__(self, job: Job, ordered: list[Frame], model: ModelSpec, cluster: ClusterSpec,
                 found: dict[Frame, PlanItem], deadline: float, stop: Callable[[], bool] | None = None,
                 walked: set[Frame] | None = None, walk_first: bool = True,
                 lower: Callable[[Frame], float] | None = None, top: int | None = None, gain: float = 0.0,
                 configs: dict[Frame, dict[Config, PlanItem]] | None = None,
                 done: Callable[[list[PlanItem]], bool] | None = None, patience_min: float | None = None,
                 state: SeedState | None = None) -> None:
        self.job, self.ordered, self.model, self.cluster = job, ordered, model, cluster
        self.found, self.deadline, self.stop, self.done = found, deadline, stop, done
        self.walk_first, self.lower, self.gain = walk_first, lower, gain
        self.walked = walked if walked is not None else set()
        self.leanest = min(job.search.recompute or list(Recompute), key=LEAN.__getitem__)
        self.lcs = lifecycles(job)
        self.runtime = _runtime(job.runtime) if job.runtime is not None else None
        self.out: dict[Frame, PlanItem] = {}
        self.configs = configs if configs is not None else {}
        self.st = state if state is not None else SeedState()
        self.climbing = self.st.climbing
        entered = _time.monotonic()
        self.t_start = entered - self.st.seconds  # the climbs' share counts every call's time
        self.patience = _Patience(entered, top, gain, self.fastest(),
                                  POLICY.patience_min_s if patience_min is None else patience_min)
        self.climbed = self.st.climbed
        # The queue's visits (visit_queue): its clock, the walks' time, and the frames queued next.
        self.started = 0.0
        self.walking = 0.0
        self.first: list[Frame] = []
        """Frames one change away from one that set a new fastest layout (another VP, PP, FSDP degree...): next."""
        self.pos: dict[Frame, int] = {}
        self.near: Neighbours | None = None
        self.walked_keys: set[tuple] = set()

    # -- the layouts so far and the stop tests

    def best(self, f: Frame) -> PlanItem | None:
        """f's fastest layout found here, else its entry in `found`."""
        return self.out.get(f) or self.found.get(f)

    def keep(self, items: list[PlanItem]) -> None:
        """Record each layout under its frame and configuration, and as its frame's best when it is faster."""
        for it in items:
            f = frame_of(it.layout)
            per = self.configs.setdefault(f, {})
            c = config_of(it.layout)
            if c not in per or (it.rank_time_s, it.peak_bytes) < (per[c].rank_time_s, per[c].peak_bytes):
                per[c] = it
            mine = self.best(f)
            if mine is None or (it.rank_time_s, it.peak_bytes) < (mine.rank_time_s, mine.peak_bytes):
                self.out[f] = it

    def fastest(self) -> list[PlanItem]:
        """Every frame's best layout, fastest first (ties: the lower peak)."""
        return sorted({**self.found, **self.out}.values(), key=lambda it: (it.rank_time_s, it.peak_bytes))

    def over(self) -> bool:
        """The deadline passed, `stop()` (Ctrl-C), or `done` holds for the layouts so far."""
        return (_time.monotonic() >= self.deadline or (self.stop is not None and self.stop())
                or (self.done is not None and self.done(self.fastest())))

    def stalled(self) -> bool:
        """`over`, or the seeding has gone as long without a gain as its last gain took (`_Patience`)."""
        return self.over() or self.patience.out(self.fastest())

    def save(self, queue: list[Frame] | None = None) -> dict[Frame, PlanItem]:
        """Record the climbs' time and the time taken (and the frames left, when given) in the state."""
        self.st.climbing, self.st.seconds = self.climbing, _time.monotonic() - self.t_start
        if queue is not None:
            self.st.queue = queue
        return self.out

    # -- the phases

    def run(self) -> dict[Frame, PlanItem]:
        """Walk and climb the frames of the fastest layouts, then visit the queue; the layouts found."""
        leads = list(dict.fromkeys(frame_of(it.layout) for it in self.fastest()[:POLICY.walked_frames]))
        if not self.walk_leads(leads) or not self.climb_leads(leads):
            return self.save()
        return self.visit_queue()

    def walk_leads(self, leads: list[Frame]) -> bool:
        """Walk each frame of the fastest layouts not walked yet (unless `walk_first` is False); False when the
        seeding stopped."""
        for f in leads:
            if self.stalled():
                return False
            if self.walk_first and f not in self.walked:
                self.walked.add(f)
                self.keep(frame_walk(self.job, f, self.model, self.cluster, self.deadline, self.runtime,
                                     without_offload=True))
        return True

    def climb_leads(self, leads: list[Frame]) -> bool:
        """Climb the frames of the fastest layouts, the fastest after the walks first; False when the seeding
        stopped.

        Climbed in every call: an earlier call's deadline may have cut the climb of a frame it walked, and a walked
        frame is not visited again in the queue. After the walks, the fastest first: the climbs' share goes to the
        frame the walks made fastest (on the default job the PP8 VP3 shape leads before the walks and its climbs
        would take the share, leaving PP8 VP4, 18.72 s after its walk and 18.63 s once climbed, to the next
        call)."""
        for f in sorted(leads, key=lambda g: (self.best(g).rank_time_s, self.best(g).peak_bytes)):
            if self.stalled():
                return False
            self.climb(f)
        return True

    def visit_queue(self) -> dict[Frame, PlanItem]:
        """Visit the frames queued next, then those of `ordered` left, until the seeding stops; record where it
        stopped in the state."""
        st = self.st
        self.started = _time.monotonic() - st.queue_seconds
        self.walking = st.walking
        known = set(self.ordered)
        queue = [f for f in st.queue if f in known] if st.queue is not None else list(self.ordered)
        self.pos = {f: i for i, f in enumerate(self.ordered)}
        self.near = Neighbours(list(self.ordered))
        self.first = [f for f in st.first if f in known]
        # One walk per shape up to its FSDP degrees and sharding policies (`_walk_key`): its siblings are
        # priced under the configurations found, and `spread` prices the climbed split on them. At 8,192 GPUs
        # eight PP4 VP4 EP64 siblings, each at most 0.5% faster than the last, would take the seeding's time with
        # their walks, and PP8 VP4, 0.6 s faster (18.58 s against 19.14 s), would not be visited.
        self.walked_keys = {_walk_key(g) for g in self.walked}
        while self.first or queue:
            if self.stalled():
                break
            self.visit(self.first.pop(0) if self.first else queue.pop(0))
        st.first, st.walking, st.queue_seconds = self.first, self.walking, _time.monotonic() - self.started
        return self.save(queue)

    def visit(self, f: Frame) -> None:
        """Price frame f under the fastest configurations, walk it when its shape was not walked, climb it; a
        frame that set a new fastest layout queues its neighbours next."""
        if f in self.walked or f in self.st.visited:
            return
        self.st.visited.add(f)
        lead = self.fastest()
        if lead and self.lower is not None and self.lower(f) >= lead[0].rank_time_s:
            return
        group = self.st.misfits.setdefault(sharding_group(f), [])  # frames of f's group that did not fit here
        if any(g.expert_fsdp % f.expert_fsdp == 0 and g.dense_fsdp % f.dense_fsdp == 0 for g in group):
            # A shape that shards the same state over as many ranks or more did not fit: f holds at least its
            # persistent bytes and the same activations. At 8,192 GPUs a PP or VP whose activations never fit
            # has hundreds of FSDP variants, which would otherwise take the seeding's whole time.
            return
        # Whether f was priced in full here (a misfit is recorded only then).
        tried = self.walk_shape(f, self.price_under_lead(f, lead))
        self.climb(f)
        if self.best(f) is None and tried:
            group.append(f)
        new = self.fastest()
        if new and (not lead or new[0].rank_time_s < lead[0].rank_time_s):
            assert self.near is not None
            self.first = sorted((g for g in self.near(f) if g not in self.st.visited and g not in self.walked),
                                key=self.pos.__getitem__) + self.first

    def price_under_lead(self, f: Frame, lead: list[PlanItem]) -> bool:
        """Price f under the fastest configurations so far (`lead_library`); whether it was priced in full."""
        if not lead:
            return False
        self.keep(price_configs(self.job, f, self.lead_library(lead), self.model, self.cluster, self.deadline,
                                self.runtime, every_split=False))
        return not self.over()

    def lead_library(self, lead: list[PlanItem]) -> list[Config]:
        """The two fastest configurations under every lifecycle (an unsharded accumulation buffer that fits one
        frame may not fit another), then the fastest under the leanest recompute mode, priced first by
        price_configs: when it does not fit, the others are not tried."""
        lean = dataclasses.replace(config_of(lead[0].layout), recompute=self.leanest)
        return [c for c in dict.fromkeys(dataclasses.replace(config_of(it.layout), lifecycle=lc)
                                         for it in lead[:2] for lc in self.lcs) if c != lean] + [lean]

    def walk_shape(self, f: Frame, tried: bool) -> bool:
        """Walk f (from its leanest configuration, which reaches the richer recompute modes with offload) when no
        frame of its shape was walked and the walks have taken at most POLICY.seed_walk_share of the time so far:
        a walk finds the frame's own fast configurations, which the next frames are then priced under. Returns
        `tried`, or whether the walk priced f in full."""
        now = _time.monotonic()
        key = _walk_key(f)
        if (self.walking <= POLICY.seed_walk_share * (now - self.started)
                and key not in self.walked_keys):
            self.walked.add(f)
            self.walked_keys.add(key)
            self.keep(frame_walk(self.job, f, self.model, self.cluster, self.deadline, self.runtime))
            self.walking += _time.monotonic() - now
            tried = tried or not self.over()
        return tried

    def climb(self, f: Frame) -> None:
        """f's fastest layout so far, its split climbed (split_climb) when it is within POLICY.climb_within of the
        fastest and the climbs have taken less than POLICY.climb_share of the time so far; then, in that share, the
        fastest layouts of f's other configurations priced here (up to POLICY.climb_configs in all) that are within
        POLICY.climb_within too. The best configuration depends on the split: on the default job a PP8 VP4 shape is
        18.72 s without dispatch recompute and 19.01 s with it on the heuristic split, yet 18.63 s with it once its
        split is climbed (the same climb leaves the other configuration at 18.72 s)."""
        mine, lead = self.best(f), self.fastest()
        now = _time.monotonic()
        if (mine is None or not lead or mine.rank_time_s > lead[0].rank_time_s * (1 + POLICY.climb_within)
                or self.climbing > POLICY.climb_share * (now - self.t_start) or f in self.climbed):
            return
        self.climbed.add(f)
        for it in self.climb_starts(f, mine)[:POLICY.climb_configs]:
            now = _time.monotonic()
            if it.rank_time_s > lead[0].rank_time_s * (1 + POLICY.climb_within) or self.over():
                break
            # The climb's own deadline keeps the climbs within their share, whatever this one would take; each
            # configuration has at least POLICY.climb_min_s (the share is checked once per frame: a frame's climbs
            # may pass it by up to POLICY.climb_configs x POLICY.climb_min_s, within the seeding's deadline).
            share_left = max(POLICY.climb_share * (now - self.t_start) - self.climbing, 0.0) + POLICY.climb_min_s
            self.keep([split_climb(self.job, it, self.model, self.cluster, min(self.deadline, now + share_left),
                                   self.runtime, stop=self.stop, min_gain=self.gain)])
            self.climbing += _time.monotonic() - now

    def climb_starts(self, f: Frame, mine: PlanItem) -> list[PlanItem]:
        """f's fastest layout, then its fastest layout under each other configuration priced, fastest first, one
        per step time: configurations at the same step time as one kept differ in toggles that trade memory only
        (P2P Muon, the chunked cross entropy...), and their climbs would repeat it."""
        starts = [mine]
        for it in sorted(self.configs.get(f, {}).values(), key=lambda it: (it.rank_time_s, it.peak_bytes)):
            if all(abs(it.rank_time_s - s.rank_time_s) > 1e-9 * s.rank_time_s for s in starts):
                starts.append(it)
        return starts


@dataclasses.dataclass
class SeedState:
    """Where a `seed` call stopped, for a later call to go on from (the driver stops its second seeding for the
    bounding pass and resumes it after): the frames left in visiting order and those queued next, the frames
    visited, climbed and found not to fit, and the time taken and spent walking and climbing (the walks' and the
    climbs' shares count the calls together)."""

    queue: list[Frame] | None = None
    first: list[Frame] = dataclasses.field(default_factory=list)
    visited: set[Frame] = dataclasses.field(default_factory=set)
    climbed: set[Frame] = dataclasses.field(default_factory=set)
    misfits: dict[tuple, list[Frame]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    queue_seconds: float = 0.0
    climbing: float = 0.0
    walking: float = 0.0


def split_climb(job: Job, item: PlanItem, model: ModelSpec, cluster: ClusterSpec, deadline: float,
                runtime: RuntimeSpec | None = None, stop: Callable[[], bool] | None = None,
                min_gain: float = 0.0, sideways: bool = False) -> PlanItem:
    """A faster split of `item`'s layout, its frame and configuration kept (or `item`): local search by moves of
    one layer from a chunk of one of the two slowest ranks to a chunk of another rank (the chunks between shift by
    one layer), or of the same rank while the layout ranks by its replayed schedule. Candidates are screened by the
    ranked stage time their coefficients give (max over ranks and resources of achievable.rank_sums, what the
    search's model sums) and priced by evaluate(), least stage first; where those stop on a layout ranked by its
    replay, every move between two chunks is screened by the replay it gives and priced, least replay first;
    of the first that ranks faster and fits and the moves tied with it in the screen, the fastest is taken.
    Stops when no move improves, or a move gains less than `min_gain` (relative: the seeding passes its stall
    gain, a tenth of the search's gap), at the monotonic `deadline`, or when `stop()` (Ctrl-C). Moves that keep the
    slowest stage are screened in only when they do not raise it, so a layout ranked by its replayed schedule
    rather than its formula improves only as far as such moves reach. With `sideways`, where single moves stop on a
    layout its formula ranks, pairs of a sideways move and an improving one are tried (`_SplitClimb.escape`, about
    a second at K3 PP8 VP4: the driver's last climb of the ranked layouts, not the seeding's many climbs).
    The heuristic splits balance each layer's busiest resource, not each rank's; a rank bound by its host link
    or its NIC is balanced only here."""
    lay = item.layout
    if job.search.split is not None or lay.pp * lay.vp < 2:
        return item
    return _SplitClimb(job, item, model, cluster, deadline, runtime, stop, min_gain, sideways).run()


class _SplitClimb:
    """One split climb's state (`split_climb`): the layout's coefficients, the best layout and its split so far,
    and the rank loads of that split."""

    def __init__(self, job: Job, item: PlanItem, model: ModelSpec, cluster: ClusterSpec, deadline: float,
                 runtime: RuntimeSpec | None, stop: Callable[[], bool] | None, min_gain: float,
                 sideways: bool) -> None:
        self.job, self.model, self.cluster, self.runtime = job, model, cluster, runtime
        self.deadline, self.stop, self.min_gain, self.sideways = deadline, stop, min_gain, sideways
        self.lay = item.layout
        self.p, self.k = self.lay.pp, self.lay.pp * self.lay.vp
        self.cf = coefficients(Shape.of(self.lay), model, cluster)
        self.best, self.cur = item, list(self.lay.split)
        self.least = chunk_least(job, frame_of(self.lay))
        self.now = self.loads(self.cur)

    def loads(self, split: list[int]) -> list[float]:
        cf = self.cf
        return [max(rank_sums(cf, cf.time, cf.pp_seconds_per_byte, split, r).values()) for r in range(self.p)]

    def replayed(self, split: list[int], ld: list[float]) -> float:
        """The ranked step's pipeline part at the coefficients' rates (the rank-load screen's): the step formula's
        slots x stage, or the schedule replayed over each chunk's share of its rank's stage where that is longer,
        as evaluate() ranks it at the cluster's achievable rates."""
        cf, lay = self.cf, self.lay
        fwd, bwd = chunk_times(chunk_work(cf, cf.time, split), ld, self.p, lay.recompute == Recompute.FULL)
        return max(cf.slots * max(ld), replay_makespan(self.p, lay.vp, lay.microbatches, fwd, bwd))

    def over(self) -> bool:
        return _time.monotonic() >= self.deadline or (self.stop is not None and self.stop())

    def moves(self, by_replay: bool, base: list[int] | None = None, base_loads: list[float] | None = None,
              sideways: bool = False) -> list[tuple[tuple[float, ...], list[int]]] | None:
        """The screened moves of `base` (default: the current split; None past the deadline). Off the two slowest
        ranks' chunks, those that do not raise the slowest stage, by rank loads; a layout ranked by its replayed
        schedule also moves layers between the chunks of one rank (the rank loads stay, the replay's warm-up and
        drain change: Kimi K2 PP2 VP4, chunk 0 to chunk 6, both rank 0's, 7.174 -> 7.163 s). `by_replay`: every
        move between two chunks that the replay puts under the current one, by that replay (its chunks' places bind
        it, not its slowest rank). `sideways`: the moves off every other rank that do not raise the slowest stage
        (`escape`)."""
        p, k = self.p, self.k
        base = self.cur if base is None else base
        ld0 = self.now if base_loads is None else base_loads
        line = self.replayed(base, ld0) if by_replay else math.inf
        slowest = sorted(range(p), key=lambda r: -ld0[r])[:2]
        sources = range(p) if by_replay else [r for r in range(p) if r not in slowest] if sideways else slowest
        out: list[tuple[tuple[float, ...], list[int]]] = []
        for src in sources:
            for i in range(src, k, p):
                if base[i] <= self.least[i]:
                    continue
                for j in range(k):
                    if j == i or (j % p == src and not self.best.ranks_by_replay):
                        continue
                    s = base[:]
                    s[i] -= 1
                    s[j] += 1
                    ld = self.loads(s)
                    if by_replay:
                        screen = self.replayed(s, ld)
                        if screen < line * (1 - self.min_gain) - 1e-12 * line:
                            out.append(((screen, *sorted(ld, reverse=True)), s))
                    elif max(ld) <= max(ld0) * (1 + 1e-12):
                        out.append((tuple(sorted(ld, reverse=True)), s))
            if self.over():
                return None
        return out

    def take(self, cands: list[tuple[tuple[float, ...], list[int]]] | None, most: int | None = None
             ) -> tuple[float, ...] | None:
        """Prices the moves in screen order (at most `most` of them); the first that ranks faster and fits, and
        the moves tied with it in the screen, the fastest taken (they differ in the layers' kinds, their edges and
        the replayed order: K3 PP8 VP4, 18.84 s or 18.63 s for one layer moved from rank 4 to rank 5, from chunk 4
        or from chunk 28)."""
        taken: tuple[float, ...] | None = None
        for n, (key, s) in enumerate(sorted(cands or [], key=lambda c: c[0])):
            if self.over() or (taken is not None and not np.allclose(key, taken, rtol=1e-12, atol=0.0)) \
                    or n == most:
                break
            moved = self.lay.model_copy(update={"split": s})
            ev = evaluate(moved, model=self.model, cluster=self.cluster, runtime=self.runtime)
            if fits(self.job, ev) and (ev.step.rank_time_s, ev.peak_bytes) < (self.best.rank_time_s,
                                                                              self.best.peak_bytes):
                self.best, self.cur, taken = PlanItem(moved, ev), s, key
        return taken

    def escape(self) -> tuple[float, ...] | None:
        """Where single moves stop on a layout its formula ranks: a sideways move (off a rank that is not among
        the two slowest, the slowest stage kept) followed by a move off the two slowest ranks that lowers it, the
        pair priced by evaluate(). Moving a layer shifts the layers of every chunk between, so it changes which
        kinds of layer (KDA, MLA, the dense first one) the chunks between hold: K3 PP8 VP4 over 8 racks stops at
        21.211 s, where a layer moved off rank 3 onto rank 6 (sideways) and then one off the last chunk reach
        21.072 s, where the first such pair found gives 21.155 s. The sideways moves are tried in screen order,
        POLICY.sideways_moves of them at most, each with its first improving move that fits, and the fastest pair
        is taken."""
        side = self.moves(False, sideways=True)
        top = max(self.now)
        line = top * (1 - self.min_gain) - 1e-12 * top
        got: tuple[float, ...] | None = None
        for _, s1 in sorted(side or [], key=lambda c: c[0])[:POLICY.sideways_moves]:
            if self.over():
                break
            second = self.moves(False, s1, self.loads(s1))
            # take() keeps a pair only when it beats the best so far, so the fastest pair of all stands.
            got = self.take([c for c in second or [] if c[0][0] < line], POLICY.replay_moves_priced) or got
        return got

    def run(self) -> PlanItem:
        while not self.over():
            before = self.best.rank_time_s
            taken = self.take(self.moves(False))
            if (taken is None and self.best.rank_time_s > self.best.evaluation.step.formula_time_s
                    * (1 + self.min_gain) and not self.over()):
                # Where the rank-load moves stop, a layout its replay holds above its formula by more than a step's
                # gain tries every move by its replay (DeepSeek-V3 PP8 VP4 on 512 B200, 61 layers in 32 chunks: the
                # rank-load moves stop at 4.979 s, then two replay moves reach 4.531 s). The screen is evaluate()'s
                # pipeline term at the coefficients' rates, so its first moves fail mostly on memory or on the
                # rates: a few priced without a gain end the round (POLICY.replay_moves_priced).
                taken = self.take(self.moves(True), POLICY.replay_moves_priced)
            if taken is None and self.sideways and not self.best.ranks_by_replay and not self.over():
                taken = self.escape()
            if taken is None or self.best.rank_time_s > before * (1 - self.min_gain):
                return self.best
            self.now = list(self.loads(self.cur))
        return self.best


def cap_descent(job: Job, item: PlanItem, model: ModelSpec, cluster: ClusterSpec, deadline: float,
                runtime: RuntimeSpec | None = None, stop: Callable[[], bool] | None = None) -> PlanItem | None:
    """The fastest layout of `item`'s frame found under the job's peak cap (`frames.fits`) from `item`, a faster
    one over it: a greedy descent (`_descend`) from `item` and from each layout one free toggle away from it that
    is no slower (the descent's first change decides where it ends: on K3 PP8 VP4 under a 108.96-GiB cap,
    18.720 s from the layout itself, 18.624 s with fused cross-entropy off first). None when none reaches the cap
    by the monotonic `deadline`."""
    if fits(job, item.evaluation):
        return item
    if peak_cap_bytes(job) is None or not item.evaluation.fits:
        return None
    free = [t for t in ACT_TOGGLES + RANK_TOGGLES if choices(job, t) == [False, True]]
    least = chunk_least(job, frame_of(item.layout))
    # The flips that cost no step time start descents of their own; a slower flip is one of the descent's changes.
    flips = (_priced(_flipped(item.layout, t), model, cluster, runtime) for t in free)
    starts = [item] + [it for it in flips if it is not None and it.rank_time_s <= item.rank_time_s * (1 + 1e-9)]
    best: PlanItem | None = None
    for start in starts:
        if _time.monotonic() >= deadline or (stop is not None and stop()):
            break
        got = _descend(job, start, free, least, model, cluster, deadline, runtime, stop)
        if got is not None and (best is None or got.rank_time_s < best.rank_time_s):
            best = got
    return best


def fit_repair(job: Job, item: PlanItem, model: ModelSpec, cluster: ClusterSpec, deadline: float,
               runtime: RuntimeSpec | None = None, stop: Callable[[], bool] | None = None) -> PlanItem | None:
    """`item`'s layout brought under what a returned layout must meet (`frames.fits`) by moving layers, its
    configuration kept (`_descend` without toggle flips): the move off the fullest rank that adds the least ranked
    step time per byte of excess it removes, until it fits; then its split climbed. None when no move lowers the
    excess, or at the monotonic `deadline`."""
    if fits(job, item.evaluation):
        return item
    least = chunk_least(job, frame_of(item.layout))
    return _descend(job, item, [], least, model, cluster, deadline, runtime, stop, configs=False)


def _excess(job: Job, ev: Evaluation) -> float:
    """Bytes over what a returned layout must meet (`frames.fits`): each rank's device peak over its capacity and
    host bytes over the host memory, summed over the ranks, plus the worst ledger peak over the job's peak cap."""
    over = sum(max(0, r.device_bytes - r.capacity_bytes) + max(0, r.host_bytes - r.host_capacity_bytes)
               for r in ev.ranks)
    cap = peak_cap_bytes(job)
    return over + (max(0, ev.peak_bytes - cap) if cap is not None else 0)


def _flipped(lay: Layout, t: str) -> Layout:
    return lay.model_copy(update={"toggles": lay.toggles.model_copy(update={t: not getattr(lay.toggles, t)})})


def _priced(lay: Layout, model: ModelSpec, cluster: ClusterSpec, runtime: RuntimeSpec | None,
            any_fit: bool = False) -> PlanItem | None:
    """lay priced by evaluate() when it fits its GPUs, or (`any_fit`) whether or not it does; None when not, or
    when its toggles contradict."""
    try:
        ev = evaluate(lay, model=model, cluster=cluster, runtime=runtime)
    except K3optError:
        return None  # a toggle another one needs, switched off alone
    return PlanItem(lay, ev) if ev.fits or any_fit else None


def _descend(job: Job, item: PlanItem, free: list[str], least: list[int], model: ModelSpec, cluster: ClusterSpec,
             deadline: float, runtime: RuntimeSpec | None, stop: Callable[[], bool] | None, configs: bool = True
             ) -> PlanItem | None:
    """cap_descent's and fit_repair's greedy: one change at a time (`_descent_moves`: a free toggle flipped,
    another recompute mode or lifecycle, or a layer moved off a chunk of the fullest rank, to a later chunk of its
    own (fewer microbatches in flight) or of one of the two leanest ranks), each priced by evaluate(): the change
    that adds the least ranked step time per byte of excess (`_excess`) it removes is taken, until the layout fits;
    its split is then climbed (`split_climb`). A layout that fits its GPUs stays on layouts that do (the cap's
    descent); one that does not may pass through others that do not. None when no change lowers the excess, or at
    the deadline."""
    cur = item
    on_gpus = item.evaluation.fits
    while not fits(job, cur.evaluation):
        excess = _excess(job, cur.evaluation)
        best: tuple[tuple[float, float], PlanItem] | None = None
        for lay in _descent_moves(job, cur, free, least, configs):
            if _time.monotonic() >= deadline or (stop is not None and stop()):
                return None
            got = _priced(lay, model, cluster, runtime, any_fit=not on_gpus)
            if got is None:
                continue
            # Bytes removed beyond the excess buy nothing: a change that fits is priced per byte of the excess, so
            # a recompute mode that fits at once yields to layer moves that close the same excess at less time.
            dt, dm = got.rank_time_s - cur.rank_time_s, excess - _excess(job, got.evaluation)
            key = (dt / dm, got.rank_time_s) if dm > 0 else None
            if key is not None and (best is None or key < best[0]):
                best = (key, got)
        if best is None:
            return None
        cur = best[1]
    return split_climb(job, cur, model, cluster, deadline, runtime, stop)


def _descent_moves(job: Job, item: PlanItem, free: list[str], least: list[int], configs: bool = True
                   ) -> Iterator[Layout]:
    """`_descend`'s changes of item's layout: a free toggle flipped, another recompute mode or FSDP lifecycle
    (cap_descent's; not fit_repair's, `configs` False), or one layer moved off a chunk of the fullest rank (the
    worst peak; over the GPUs, the most bytes over its capacity) to a later chunk of its own rank or to a chunk of
    one of the two leanest ranks."""
    lay, ev = item.layout, item.evaluation
    if configs:
        for t in free:
            yield _flipped(lay, t)
        for rc in job.search.recompute or list(Recompute):
            if rc != lay.recompute:
                yield lay.model_copy(update={"recompute": rc})
        for lc in lifecycles(job):
            if lc != lay.fsdp_lifecycle:
                yield lay.model_copy(update={"fsdp_lifecycle": lc})
    p, k = lay.pp, lay.pp * lay.vp
    if job.search.split is not None or k < 2:
        return
    w = ev.worst_rank if ev.fits else max(ev.ranks, key=lambda r: r.device_bytes - r.capacity_bytes).rank
    lean = sorted((r for r in range(p) if r != w), key=lambda r: ev.ranks[r].peak_bytes)[:2]
    for i in range(w, k, p):
        if lay.split[i] <= least[i]:
            continue
        for j in [*range(i + p, k, p), *(c for r in lean for c in range(r, k, p))]:
            s = list(lay.split)
            s[i] -= 1
            s[j] += 1
            yield lay.model_copy(update={"split": s})


class _Patience:
    """When a seeding with a `top` has stalled: the search's pruning line is the `top`-th fastest layout, and a
    seeding that has gone as long without a gain as it took to make its last gain (at least POLICY.patience_min_s
    from its start) leaves the rest to the bounds and the node models. A gain lowers the `top`-th fastest layout
    or the fastest by more than `gain` (relative; small steps count once they add up to it), or adds a layout
    while there are fewer than `top`. Without the stop a long time limit gives the seeding its whole share, long
    after its last gain."""

    def __init__(self, start: float, top: int | None, gain: float, fastest: list[PlanItem],
                 least: float | None = None) -> None:
        self.start, self.top, self.gain = start, top, gain
        self.least = least
        self.ref = self._marks(fastest)
        self.last = start

    def _marks(self, fastest: list[PlanItem]) -> tuple[int, float, float]:
        """(layouts counted up to `top`, the `top`-th fastest step time, the fastest's); inf where absent."""
        n = min(len(fastest), self.top or 0)
        kth = fastest[self.top - 1].rank_time_s if self.top is not None and len(fastest) >= self.top else math.inf
        return n, kth, fastest[0].rank_time_s if fastest else math.inf

    def out(self, fastest: list[PlanItem]) -> bool:
        if self.top is None:
            return False
        now = _time.monotonic()
        n, kth, first = self._marks(fastest)
        n0, kth0, first0 = self.ref
        if n > n0 or kth < kth0 * (1 - self.gain) or first < first0 * (1 - self.gain):  # from none (inf) too
            # Each mark moves only on its own gain, so that steps below `gain` add up against a fixed reference.
            self.ref = (n, kth if kth < kth0 * (1 - self.gain) else kth0,
                        first if first < first0 * (1 - self.gain) else first0)
            self.last = now
        least = POLICY.patience_min_s if self.least is None else self.least
        return now - self.start >= least and now - self.last > self.last - self.start


def _walk_key(f: Frame) -> tuple:
    """What one walk stands for (`walk_shape`): `_siblings_key` and the EP overlap schedule. The twins with and
    without it are walked apart: where the overlap does not fit, the overlapped walk finds nothing its twin would."""
    return (*_siblings_key(f), f.ep_overlap)


def _siblings_key(f: Frame) -> tuple:
    """What `spread` keeps: a frame's shape and schedule but for its FSDP degrees and sharding policies."""
    return (f.gpus, f.pp, f.vp, f.cp, f.ep, f.microbatches, f.grad_dtype, f.precision, f.domain_gpus_used)


def spread(job: Job, found: dict[Frame, PlanItem], frames: list[Frame], model: ModelSpec, cluster: ClusterSpec,
           deadline: float, runtime: RuntimeSpec | None = None, within: float = POLICY.climb_within,
           most: int = POLICY.spread_sources, stop: Callable[[], bool] | None = None) -> dict[Frame, PlanItem]:
    """The fastest layouts in `found` (up to `most`, each within `within` of the fastest), their configuration and
    split priced by evaluate() on the frames of `frames` that differ from theirs in the FSDP degrees and sharding
    policies only: the split climbed on one frame is rarely reached on its siblings by their own heuristics (on
    the default job the fastest PP8 VP4 EP64 layout, dense FSDP 32, is 18.634 s; its configuration and split give
    the dense-FSDP-64 frames 18.624 s, against 18.72 s from their own seeding). A sibling that does not fit, or is
    more than `within` slower than its source, is priced again without the memory toggles that cost the source
    nothing (`_costs_nothing`). Returns, per frame, the fitting layout faster than its entry in `found`. Stops at
    the monotonic `deadline` or when `stop()` (Ctrl-C)."""
    runtime = runtime if runtime is not None else (_runtime(job.runtime) if job.runtime is not None else None)
    ranked = sorted(found.values(), key=lambda it: (it.rank_time_s, it.peak_bytes))
    if not ranked:
        return {}
    by_key: dict[tuple, list[Frame]] = {}
    for g in frames:
        by_key.setdefault(_siblings_key(g), []).append(g)
    out: dict[Frame, PlanItem] = {}
    for src in [it for it in ranked if it.rank_time_s <= ranked[0].rank_time_s * (1 + within)][:most]:
        f = frame_of(src.layout)
        split = list(src.layout.split)
        cfgs = [config_of(src.layout)]
        # A memory toggle that costs the source nothing can cost a sibling seconds (with other FSDP degrees its
        # traffic no longer hides), and ties in step time keep the leaner configuration, so the source carries such
        # toggles: a sibling slower than its source by more than `within` is priced without them too (at 8,192
        # GPUs the fastest layout found, eFSDP8 dFSDP128, is 18.76 s with or without the ZeRO-2 host gradients;
        # its eFSDP2 dFSDP64 sibling is 21.29 s with them, 18.58 s without).
        free = {x for x in MEMORY_TOGGLES if x in cfgs[0].on and choices(job, x) == [False, True]
                and _costs_nothing(job, src, f, dataclasses.replace(cfgs[0], on=cfgs[0].on - {x}), model, cluster,
                                   runtime, deadline)}
        if free:
            cfgs.append(dataclasses.replace(cfgs[0], on=cfgs[0].on - free))
        for g in by_key.get(_siblings_key(f), []):
            if g == f:
                continue
            for cfg in cfgs:
                if _time.monotonic() > deadline or (stop is not None and stop()):
                    return out
                ev = evaluate(layout_of(job, g, cfg.shape(job, g), split), model=model, cluster=cluster,
                              runtime=runtime)
                h = frame_of(ev.layout)  # g's twin when g runs the EP overlap and cfg a mode refusing it
                mine = out.get(h) or found.get(h)
                if fits(job, ev) and (mine is None or (ev.step.rank_time_s, ev.peak_bytes) < (mine.rank_time_s,
                                                                                       mine.peak_bytes)):
                    out[h] = PlanItem(ev.layout, ev)
                if fits(job, ev) and ev.step.rank_time_s <= src.rank_time_s * (1 + within):
                    break  # within `within` of its source: the source's toggles cost it little
    return out


def _costs_nothing(job: Job, src: PlanItem, f: Frame, cfg: Config, model: ModelSpec, cluster: ClusterSpec,
                   runtime: RuntimeSpec | None, deadline: float) -> bool:
    """Whether src's split of frame f under configuration cfg fits and is no slower than src (before the
    monotonic deadline)."""
    if _time.monotonic() > deadline:
        return False
    ev = evaluate(layout_of(job, f, cfg.shape(job, f), list(src.layout.split)), model=model, cluster=cluster,
                  runtime=runtime)
    return fits(job, ev) and ev.step.rank_time_s <= src.rank_time_s


def _build_runtime(name: str) -> RuntimeSpec:
    return load_runtime(name)


_runtime = Memo(_build_runtime, maxsize=16)


class Neighbours:
    """Frames one change away from a frame: one of PP, VP, CP, EP, expert FSDP, dense FSDP, the sharding pair,
    the gradient dtype or the precision (the microbatch count follows from them)."""

    _KEYS = 9

    def __init__(self, frames: list[Frame]) -> None:
        self.index: dict[tuple, list[Frame]] = {}
        for f in frames:
            for k in range(self._KEYS):
                self.index.setdefault(self._key(f, k), []).append(f)

    @staticmethod
    def _key(f: Frame, k: int) -> tuple:
        c = [f.pp, f.vp, f.cp, f.ep, f.expert_fsdp, f.dense_fsdp, (f.dense_sharding, f.expert_sharding),
             f.grad_dtype, f.precision]
        c[k] = None
        return (f.gpus, k, *c)

    def __call__(self, f: Frame) -> list[Frame]:
        return [g for k in range(self._KEYS) for g in self.index.get(self._key(f, k), []) if g != f]
