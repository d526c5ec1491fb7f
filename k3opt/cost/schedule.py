"""Pipeline schedules: in-flight microbatches per rank, bubbles.

1F1B (seed 000; Megatron `schedules.py`): rank r holds min(M, p - r) unfinished forwards.
Interleaved 1F1B (Megatron `get_pp_rank_microbatches`): warmup 2(p - r - 1) + (v - 1) p, so the rank holds
min(2(p - r - 1) + (v - 1) p + 1, v M) chunk-microbatches at the end of warmup; which chunks they belong to
follows the schedule's order (groups of p microbatches per model chunk), and the steady state is simulated
forward by forward so that the worst mix of chunks is found, not assumed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from k3opt.inputs.memo import Memo


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


def _build_inflight_compositions(p: int, v: int, m: int, r: int) -> tuple[tuple[int, ...], ...]:
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


inflight_compositions = Memo(_build_inflight_compositions, maxsize=4096)


def composition_peak(compositions: Sequence[Sequence[int]]) -> int:
    """The most chunk-microbatches a rank holds at once over its in-flight compositions."""
    return max(sum(c) for c in compositions)


def peak_inflight(p: int, v: int, m: int, r: int) -> int:
    """Chunk-microbatches (microbatches when v = 1) rank r holds at its peak."""
    return composition_peak(inflight_compositions(p, v, m, r))


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


def schedule_slot_units(p: int, v: int, m: int) -> int:
    """v x `schedule_slots`, an integer (the node model's objective counts the step in v-ths): v M + p - 1."""
    return v * m + p - 1


BACKWARD_OVER_FORWARD = 2.0
"""Backward / forward time of a chunk: weight and input gradients are two matmuls per forward matmul
(Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters", SC21, section 3.5)."""


def backward_over_forward(full_recompute: bool) -> float:
    """Backward-stage / forward-stage time of a chunk's tensor-core work: BACKWARD_OVER_FORWARD, one more forward
    under full recompute (its replay runs in the backward stage): 2, or 3."""
    return BACKWARD_OVER_FORWARD + (1.0 if full_recompute else 0.0)


def offload_stall(forward_s: np.ndarray, backward_s: np.ndarray, copy_s: np.ndarray, offloaded: int) -> np.ndarray:
    """Per decoder layer, the seconds one microbatch's compute stream waits for Transformer Engine's CPU offload
    copies under its default schedule (transformer_engine/pytorch/cpu_offload.py, DefaultOffloadSynchronizer,
    L602-647 @ e7c550c5), N = `offloaded` of the L layers:
        layers 0..N-1 are copied out on one offload stream, each once its forward has run;
        the forward of layer L - N + i waits until layer i's copy out is done (at most L - N sets on the GPU);
        layer i's copy back is queued when the backward of layer L - N + i is done, and its backward waits for it.
    `copy_s`: per layer, the seconds of one direction's copy (saved bytes / host link). The stall is booked on the
    layer that waits, so its sum is what the microbatch's forward plus backward lengthen by."""
    n_layers = len(forward_s)
    stall = np.zeros(n_layers)
    if offloaded <= 0:
        return stall
    keep = n_layers - offloaded
    t = stream = 0.0
    out_done = np.zeros(offloaded)
    for j in range(n_layers):
        i = j - keep
        if 0 <= i < offloaded and out_done[i] > t:
            stall[j] += out_done[i] - t
            t = out_done[i]
        t += float(forward_s[j])
        if j < offloaded:
            stream = max(stream, t) + float(copy_s[j])
            out_done[j] = stream
    back_done = np.zeros(offloaded)
    for j in range(n_layers - 1, -1, -1):
        i = j - (keep - 1)                  # the reload queued just before layer j's backward
        if 0 <= i < offloaded:
            stream = max(stream, t) + float(copy_s[i])
            back_done[i] = stream
        if j < offloaded and back_done[j] > t:
            stall[j] += back_done[j] - t
            t = back_done[j]
        t += float(backward_s[j])
    return stall


def pipeline_order(p: int, v: int, m: int, r: int) -> list[tuple[bool, int, int]]:
    """Rank r's operations in Megatron's order (`schedules.py`): (is_forward, local chunk k, microbatch).

    Forwards go in groups of p microbatches per model chunk, chunk 0 first; backwards the same, last chunk first.
    Warmup: min(p - r - 1, M) forwards (1F1B), or 2(p - r - 1) + (v - 1)p (interleaved), capped at v M; then one
    forward and one backward alternate; the cooldown drains the backwards."""
    fwd, bwd = _chunk_orders(p, v, m)
    total = v * m
    warm = min(p - r - 1, m) if v == 1 else min(2 * (p - r - 1) + (v - 1) * p, total)
    ops = [(True, *fwd[q]) for q in range(warm)]
    for i in range(total - warm):
        ops += [(True, *fwd[warm + i]), (False, *bwd[i])]
    ops += [(False, *bwd[q]) for q in range(total - warm, total)]
    return ops


def _chunk_orders(p: int, v: int, m: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(local chunk, microbatch) of a rank's forwards and of its backwards in Megatron's order: groups of p
    microbatches per model chunk, chunk 0 first for forwards, last chunk first for backwards."""
    fwd, bwd = [], []
    for start in range(0, m, p):
        group = range(start, min(start + p, m))
        fwd += [(k, mb) for k in range(v) for mb in group]
        bwd += [(k, mb) for k in reversed(range(v)) for mb in group]
    return fwd, bwd


def ep_overlap_unpaired(p: int, v: int, m: int, r: int) -> tuple[list[int], list[int]]:
    """Local chunks of the forwards and of the backwards that Megatron's EP-overlap schedule runs without a partner
    on rank r (their all-to-all cannot hide under another microbatch's compute): the 2(p - r - 1) + (v - 1)p + 1
    warmup forwards (capped at v M) and as many cooldown backwards. With PP > 1 (which needs VP) Megatron's
    `get_pp_rank_microbatches` adds the one warmup forward to the interleaved count; under PP 1 (`combined_1f1b.py`)
    the first forward and the last backward run alone, which the same count gives (1)."""
    w = min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)
    fwd, bwd = _chunk_orders(p, v, m)
    return [k for k, _ in fwd[:w]], [k for k, _ in bwd[v * m - w:]]


def chunk_times(work: np.ndarray, stage_times: list[float] | np.ndarray, p: int, full_recompute: bool
                ) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per microbatch of every global chunk j (rank j mod p): rank r's stage time
    shared among its chunks by each chunk's busiest-resource work `work[j]`, then split forward : backward =
    1 : BACKWARD_OVER_FORWARD (one more forward under full recompute; SC21 section 3.5)."""
    k = len(work)
    total = np.zeros(k)
    for j in range(k):
        mine = work[j % p::p]
        share = work[j] / mine.sum() if mine.sum() > 0 else 1.0 / len(mine)
        total[j] = stage_times[j % p] * share
    beta = backward_over_forward(full_recompute)
    return total / (1 + beta), total * beta / (1 + beta)


def replay_makespan(p: int, v: int, m: int, forward_s: np.ndarray, backward_s: np.ndarray,
                    hop_s: np.ndarray | float = 0.0) -> float:
    """Makespan of one step's pipeline: the latest end of `replay_ops`. Equal chunks with M a multiple of p give
    (v M + p - 1) x (forward + backward) of a chunk: the textbook bubble (p - 1) / (v M) (seed 002).

    The same recurrence as `replay_ops` over its operations in a fixed dependency order (`_replay_graph`): an
    operation ends at max(its rank's previous end, its dependency's end + hop) + its time. evaluate() replays
    every layout it prices (the seeding prices thousands): this takes less than half the event loop's time
    (PP8 VP4 M64: 1.5 against 3.3 ms)."""
    if np.ndim(hop_s) == 0 and float(hop_s) == 0.0:
        return _replay_makespan_no_hops(p, v, m, forward_s, backward_s)
    return max(_replay_ends(p, v, m, forward_s, backward_s, hop_s)[1])


def _replay_makespan_no_hops(p: int, v: int, m: int, forward_s: np.ndarray, backward_s: np.ndarray) -> float:
    """`replay_makespan` without hops (what evaluate() asks for, twice per layout): the same recurrence over the
    same order, ends only (`_replay_steps`: a third less time than over the graph's arrays, which is the
    seeding's largest single cost per evaluate())."""
    if not len(forward_s) == len(backward_s) == p * v:
        raise ValueError(f"the replay needs p x v = {p * v} forward and backward chunk times, "
                         f"got {len(forward_s)} and {len(backward_s)}")
    times = [float(x) for x in forward_s] + [float(x) for x in backward_s]
    end = [0.0]  # end[0] = 0: the start for an operation with no predecessor of that kind
    add = end.append
    for a, b, w in _replay_steps(p, v, m):
        ta = end[a]
        tb = end[b]
        add((ta if ta > tb else tb) + times[w])
    return max(end)


def _build_replay_steps(p: int, v: int, m: int) -> tuple[tuple[int, int, int], ...]:
    """`_replay_graph` as (rank's previous, dependency, time index) per operation, the operations numbered from 1
    and 0 for none: the replay then appends each end in order. Python tuples iterate without boxing an integer
    per read, as the graph's 32-bit arrays do; kept for fewer shapes (a PP32 VP4 M128 schedule: about 4 MB)."""
    ops, rank_prev, dep, _, which = _replay_graph(p, v, m)
    return tuple((0 if a == ops else a + 1, 0 if b == ops else b + 1, w)
                 for a, b, w in zip(rank_prev, dep, which, strict=True))


_replay_steps = Memo(_build_replay_steps, maxsize=16)


def _replay_ends(p: int, v: int, m: int, forward_s: np.ndarray, backward_s: np.ndarray,
                 hop_s: np.ndarray | float = 0.0) -> tuple[list[float], list[float]]:
    """(start, end) of every operation of `_replay_graph`, in its order."""
    if not len(forward_s) == len(backward_s) == p * v:
        raise ValueError(f"the replay needs p x v = {p * v} forward and backward chunk times, "
                         f"got {len(forward_s)} and {len(backward_s)}")
    ops, rank_prev, dep, sender, which = _replay_graph(p, v, m)
    times = [float(x) for x in forward_s] + [float(x) for x in backward_s]
    hops = [float(h) for h in np.broadcast_to(np.asarray(hop_s, dtype=float), (p,))] + [0.0]
    end = [0.0] * (ops + 1)  # end[ops] = 0: the start for an operation with no predecessor of that kind
    start = [0.0] * ops
    for n, (a, b, h, w) in enumerate(zip(rank_prev, dep, sender, which, strict=True)):
        ta = end[a]
        tb = end[b] + hops[h]
        start[n] = t = ta if ta > tb else tb
        end[n] = t + times[w]
    del end[ops]
    return start, end


def _build_replay_graph(p: int, v: int, m: int) -> tuple[int, array, array, array, array]:
    """The operations of `replay_ops` in an order where each follows what it waits for (the order the event loop
    runs them in, which depends on the dependencies only, never on the times): their count N, then per operation
    the index of its rank's previous operation, of the operation it waits for (N for none), the rank the hop
    comes from (p for no hop) and its time's index in forward_s + backward_s. Kept as 32-bit arrays: a
    PP32 VP4 M128 schedule has 32,768 operations, and the search meets tens of (p, v, M)."""
    k_all = p * v
    orders = [_global_order(p, v, m, r) for r in range(p)]
    pos = [0] * p
    index: dict[tuple[bool, int, int], int] = {}
    seq: list[tuple[int, bool, int, int]] = []
    while len(seq) < sum(len(o) for o in orders):
        moved = False
        for r in range(p):
            order, i = orders[r], pos[r]
            while i < len(order):
                is_f, g, mb = order[i]
                need = ((True, g - 1, mb) if g > 0 else None) if is_f else (
                    (True, g, mb) if g == k_all - 1 else (False, g + 1, mb))
                if need is not None and need not in index:
                    break
                index[(is_f, g, mb)] = len(seq)
                seq.append((r, is_f, g, mb))
                i += 1
            moved |= i != pos[r]
            pos[r] = i
        if not moved:
            raise RuntimeError(f"pipeline order p={p} v={v} M={m} deadlocks")
    n_ops = len(seq)
    last = [n_ops] * p
    rank_prev, dep, sender, which = [], [], [], []
    for n, (r, is_f, g, mb) in enumerate(seq):
        rank_prev.append(last[r])
        last[r] = n
        if is_f:
            dep.append(index[(True, g - 1, mb)] if g > 0 else n_ops)
            sender.append((g - 1) % p if g > 0 else p)
        elif g == k_all - 1:
            dep.append(index[(True, g, mb)])
            sender.append(p)
        else:
            dep.append(index[(False, g + 1, mb)])
            sender.append((g + 1) % p)
        which.append(g if is_f else k_all + g)
    return n_ops, array("i", rank_prev), array("i", dep), array("i", sender), array("i", which)


_replay_graph = Memo(_build_replay_graph, maxsize=64)


def replay_ops(p: int, v: int, m: int, forward_s: np.ndarray, backward_s: np.ndarray,
               hop_s: np.ndarray | float = 0.0) -> list[tuple[int, bool, int, int, float, float]]:
    """(rank, forward?, global chunk, microbatch, start, end) of every operation of one step's pipeline: every
    rank runs its ops in Megatron's order (`pipeline_order`); a forward of global chunk g = k p + r waits for the
    forward of chunk g - 1 (plus the hop from its rank), a backward for the backward of chunk g + 1 (the last
    chunk: for its own forward). forward_s, backward_s: per global chunk; hop_s: per sending rank (or one value)."""
    k_all = p * v
    hop = [float(h) for h in np.broadcast_to(np.asarray(hop_s, dtype=float), (p,))]
    fwd_t = [float(x) for x in forward_s]
    bwd_t = [float(x) for x in backward_s]
    orders = [_global_order(p, v, m, r) for r in range(p)]
    pos = [0] * p
    free = [0.0] * p
    nan = float("nan")
    done_f = [[nan] * m for _ in range(k_all)]
    done_b = [[nan] * m for _ in range(k_all)]
    ops: list[tuple[int, bool, int, int, float, float]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r in range(p):
            order, i, t = orders[r], pos[r], free[r]
            n = len(order)
            while i < n:
                is_f, g, mb = order[i]
                if is_f:
                    ready = 0.0 if g == 0 else done_f[g - 1][mb] + hop[(g - 1) % p]
                else:
                    ready = done_f[g][mb] if g == k_all - 1 else done_b[g + 1][mb] + hop[(g + 1) % p]
                if ready != ready:  # NaN: the operation it waits for has not run yet
                    break
                begin = t if t > ready else ready
                t = begin + (fwd_t[g] if is_f else bwd_t[g])
                (done_f if is_f else done_b)[g][mb] = t
                ops.append((r, is_f, g, mb, begin, t))
                i += 1
            if i != pos[r]:
                remaining -= i - pos[r]
                pos[r], free[r] = i, t
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline order p={p} v={v} M={m} deadlocks")
    return ops


def _build_global_order(p: int, v: int, m: int, r: int) -> tuple[tuple[bool, int, int], ...]:
    """pipeline_order with the global chunk index g = k p + r in place of the local k."""
    return tuple((f, k * p + r, mb) for f, k, mb in pipeline_order(p, v, m, r))


_global_order = Memo(_build_global_order, maxsize=256)


def critical_path(p: int, v: int, m: int, forward_s: np.ndarray, backward_s: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(forward count, backward count) per global chunk of the operations on a longest path of `replay_ops`.

    The replay runs every rank's fixed order as early as its dependencies allow, so its makespan is the longest
    path through the operations (edges: the previous operation on the same rank, the microbatch's previous
    chunk); for ANY chunk times f', b', sum_g nF[g] f'[g] + nB[g] b'[g] is the length of that same path, hence a
    lower bound of the makespan at f', b' (hop time left out, which only lowers it)."""
    k_all = p * v
    ops, rank_prev, dep, _, which = _replay_graph(p, v, m)
    start, end = _replay_ends(p, v, m, forward_s, backward_s)
    n = max(range(ops), key=end.__getitem__)
    counts = np.zeros(2 * k_all, dtype=np.int64)  # forwards of each chunk, then backwards
    while n != ops:
        counts[which[n]] += 1
        before = rank_prev[n]
        # The rank was busy until this operation could start: the path goes on through the rank's previous
        # operation; else through the operation it waited for (none: the path starts here).
        n = before if before != ops and end[before] == start[n] else dep[n]
    return counts[:k_all], counts[k_all:]
