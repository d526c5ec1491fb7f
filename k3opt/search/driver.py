"""The best-first branch and bound over frames and nodes: `plan()`."""

from __future__ import annotations

import heapq
import itertools
import math
import signal
import time as _time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from k3opt.cost.coefficients import Shape, coefficients
from k3opt.cost.evaluate import Evaluation, evaluate
from k3opt.inputs.errors import InfeasibleJobError
from k3opt.inputs.labels import degrees_text
from k3opt.inputs.presets import load_cluster, load_model
from k3opt.inputs.specs import GIB, ClusterSpec, FsdpLifecycle, Job, ModelSpec, Recompute
from k3opt.search.bounds import (
    frame_dp_bound,
    frame_estimate,
    frame_lower_bound,
    group_frame_bound,
    group_node_bound,
    lift_group_bound,
    node_lower_bound,
    tight_node_bound,
)
from k3opt.search.frames import (
    ActMode,
    Frame,
    allocated_capacity_bytes,
    enumerate_frames,
    frame_of,
    frame_shape,
    layout_of,
    lifecycles,
    sharding_group,
)
from k3opt.search.front import build_front, ranked_time_limit
from k3opt.search.incumbents import (
    SeedState,
    candidate_splits,
    frame_incumbent,
    incumbents,
    seed,
    spread,
    visiting_order,
)
from k3opt.search.lp_bound import contiguous_fits
from k3opt.search.node_model import solve_frame
from k3opt.search.policy import POLICY
from k3opt.search.prefetch import Prefetch
from k3opt.search.ranking import ranked_coefficients
from k3opt.search.result import OpenBound, Plan, PlanItem

# ------------------------------------------------------------------------------------- driver


def _key(ev: Evaluation) -> tuple[float, int]:
    """Plans rank by the achievable step time (the roofline without a rates file), ties to the lower peak."""
    return (ev.step.rank_time_s, ev.peak_bytes)


ProgressFn = Callable[[int, int, float], None]


class _CtrlC:
    """Ctrl-C during a search sets a flag instead of raising, so the driver returns the best so far: checked between
    heuristic frames, between nodes and after each CP-SAT slice (CP-SAT is told not to catch SIGINT itself). Off
    the main thread, where no handler can be installed, Ctrl-C raises KeyboardInterrupt as usual."""

    def __init__(self) -> None:
        self.flag = False
        self._prev = None

    def __enter__(self) -> _CtrlC:
        try:
            self._prev = signal.signal(signal.SIGINT, self._handler)
        except ValueError:
            self._prev = None
        return self

    def _handler(self, *_: object) -> None:
        self.flag = True

    def __exit__(self, *_: object) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)









DEFAULT_GAP = 0.01
"""Relative gap at which the search stops and reports OPTIMAL: 1%, far below the cost model's own error."""

LINE_ROUNDING = 1e-8
"""Relative: a bound program told to stop at the pruning line returns a hair under it once it has shown the line
reached (lp_bound.granular_stage: the stop x (1 - 1e-9)), so a bound this close under the line counts as at it.
Without it such a node stayed open and was solved by CP-SAT, and a plan proven to the gap reported FEASIBLE."""


def plan(job: Job, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None, top: int = 5,
         time_limit: float = 60.0, workers: int = 2, pareto: bool = True, pareto_step_gib: float = 1.0,
         progress: ProgressFn | None = None, gap: float = DEFAULT_GAP) -> Plan:
    """Ranked layouts (best first, one per frame) and the Pareto front over (step time, worst-rank peak).

    Anytime best-first branch and bound. First, heuristic layouts of the frames with the lowest bounds, priced by
    evaluate(), are the incumbents (a fitting layout within seconds). Then frames enter a queue keyed by a lower
    bound on their step time; a popped frame is expanded into (recompute, lifecycle) nodes with tighter bounds; a
    popped node is solved by its CP-SAT model, hinted with a heuristic layout of that node, for a slice of the
    time (a node cut by its slice returns to the queue with CP-SAT's bound and a doubled slice). The seeding before
    the solves is split by a bounding pass over the queue (no solve, at most POLICY.bound_share of the limit), and its
    second part stops once the queue's least bound closes the search for the layouts found. With `workers` > 1
    (CP-SAT's threads) the pass's bound programs also run ahead in a forked process while the seeding runs
    (search/prefetch.py; Linux only), and stop when the solves start. The search stops
    when every node left has a bound within `gap` (relative) of the K-th best, and is then OPTIMAL; FEASIBLE when
    the time limit or Ctrl-C stopped it first. `Plan.gap` is always the proven gap of the best layout. Raises
    InfeasibleJobError with the smallest reachable peak when nothing fits."""
    t0 = _time.monotonic()
    total_limit = time_limit
    if pareto:
        time_limit = ranked_time_limit(time_limit)  # the Pareto front has the rest (search/front.py)
    model = model if isinstance(model, ModelSpec) else load_model(model or job.model)
    cluster = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or job.cluster)
    frames = [f for g in job.gpu_counts for f in enumerate_frames(job, model, g, cluster)]
    if not frames:
        raise InfeasibleJobError(
            f"no parallel shape satisfies the job's rules (gpus {job.gpus}, tokens_per_update "
            f"{job.tokens_per_update}, rows x context {job.rows} x {job.context}); make tokens_per_update a "
            "multiple of DP x rows x context for some PP, or give [search] microbatches"
        )
    caps = _Caps(job, model, cluster)
    hbm_line = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
    """No allocated budget exceeds HBM minus the reserve: a frame whose peak bound is above it needs no budget."""
    recs = job.search.recompute or list(Recompute)
    lcs = lifecycles(job)
    heap = _Queue()
    seq = itertools.count()
    min_peak_lb: tuple[float, Frame | None] = (math.inf, None)
    best_of: dict[Frame, PlanItem] = {}
    budget = min(5.0, max(1.0, 0.05 * time_limit))
    ctrl_c = _CtrlC().__enter__()
    first_layout_s: float | None = None
    # A first layout before bounding every shape: per (PP, VP) group, the shapes with the most EP and dense FSDP
    # first (the least memory per rank), so a fitting layout comes in seconds even when there are many shapes.
    unbounded = False
    walked: set[Frame] = set()
    """Frames the seeding walked through their configurations (search/incumbents.seed)."""
    configs: dict = {}
    """Per frame, the fastest layout the seeding priced under each configuration (search/incumbents.seed)."""
    lbs: dict[Frame, tuple[float, float]] = {}
    """frame_lower_bound of every frame bounded here, reused by the Pareto front."""
    estimates: dict[Frame, float] = {}
    """frame_estimate of every shape in the queue: the order the heuristics visit them in."""
    over_line: set[Frame] = set()
    """Frames skipped as dominated: their peak bound is over HBM minus the reserve, hence over every budget."""
    try:
        # Round-robin over the pipeline shapes (PP, VP), each by its most sharded shape first (the least memory per
        # rank), the pipeline shapes by that shape's bounds: those that can fit, by step-time bound. The first pass
        # has budget / 2: ordered by sharding alone, the default job's PP8 VP4 shape came 13th and was priced in
        # half the runs, and without its walk the search missed its 18.63-s layout (FEASIBLE at a 60-s limit).
        heads: dict[tuple[int, int], tuple[tuple, Frame]] = {}
        for f in frames:
            key = (-f.ep, -f.dense_fsdp, f.expert_fsdp, f.cp)
            if (f.pp, f.vp) not in heads or key < heads[(f.pp, f.vp)][0]:
                heads[(f.pp, f.vp)] = (key, f)
        for _, f in heads.values():
            lbs[f] = frame_lower_bound(job, f, model, cluster)
        rank = {pv: (lbs[f][1] > hbm_line, lbs[f][0]) for pv, (_, f) in heads.items()}
        quick = visiting_order([((rank[(f.pp, f.vp)], -f.ep, -f.dense_fsdp, f.expert_fsdp, f.cp), f)
                                for f in frames])
        best_of.update(incumbents(job, quick, model, cluster, top, min(budget / 2, POLICY.first_pass_s), t0 + budget,
                                  stop=lambda: ctrl_c.flag))
        if best_of:
            first_layout_s = _time.monotonic() - t0
        # Every shape's first bounds, one sharding group at a time, shared with a forked helper (search/prefetch.py:
        # the groups it has started are taken from it, the others computed here): at 8,192 GPUs this pass bounds
        # about 10,800 of the 28,224 shapes and took 9 s on one core while the other idled.
        by_group: dict[tuple, list[Frame]] = {}
        for f in _most_sharded_first(frames):
            by_group.setdefault(sharding_group(f), []).append(f)
        known = dict(lbs)
        first_tasks = [(("first", i), partial(_first_bounds, job=job, model=model, cluster=cluster, hbm_line=hbm_line,
                                              members=tuple(mem), known=known))
                       for i, mem in enumerate(by_group.values())]
        with Prefetch(first_tasks if workers > 1 else [], math.inf, deadline=t0 + time_limit,
                      stop=lambda: ctrl_c.flag) as sharing:
            for key, program in first_tasks:
                if ctrl_c.flag or (pareto and best_of and _time.monotonic() - t0 > time_limit):
                    if not best_of:
                        raise KeyboardInterrupt
                    # Ctrl-C (or, with the front, the ranked share of the time) while bounding: the shapes not
                    # bounded yet leave the bound at 0.
                    unbounded = True
                    break
                ahead = sharing.take(key)
                for f, lb, cap, estimate in ahead if ahead is not None else program(math.inf):
                    if lb is None:
                        over_line.add(f)  # dominated: a shape with more sharding of the same state is over the line
                        continue
                    lbs[f] = lb
                    t_lb, m_lb = lb
                    if m_lb < min_peak_lb[0]:
                        min_peak_lb = (m_lb, f)
                    if cap is not None:
                        caps[f] = cap
                    if estimate is not None:
                        heap.push(_Entry(t_lb, m_lb, next(seq), f, None, None, 0))
                        estimates[f] = estimate
    except BaseException:
        ctrl_c.__exit__()
        raise
    candidates = len(heap)
    members_of: dict[tuple, list[Frame]] = {}
    """The interleaved frames in the queue by `sharding_group`: a node's group bound covers all of them."""
    for f in estimates:
        if f.vp > 1:
            members_of.setdefault(sharding_group(f), []).append(f)
    group_bounds: dict[tuple, float] = {}
    """Group bounds by sharding group (a frame's) and by (sharding group, recompute, lifecycle) (a node's)."""
    unlifted: dict[tuple, dict] = {}
    """Per sharding group whose frame bound is not lifted yet (bounds.lift_group_bound), its nodes' own bounds."""
    solved = 0
    timed_out = interrupted = False
    size: dict[str, int] = {}
    residual = math.inf
    """The least bound of the nodes left behind: pruned within the gap, or solved only to the gap."""
    tightened: set = set()
    frame_tightened: set = set()
    contiguity_checked: set = set()
    """Interleaved nodes whose contiguous whole-layer fit was tested (lp_bound.contiguous_fits)."""
    base_slice = max(1.0, time_limit / 20)

    def kth() -> PlanItem | None:
        ranked = sorted(best_of.values(), key=lambda it: _key(it.evaluation))
        return ranked[top - 1] if len(ranked) >= top else None

    def stop_line(k: PlanItem | None) -> float:
        """What the bound programs stop at: the pruning line of the top-th layout k (inf without one, or gap 0)."""
        return k.rank_time_s * (1 - gap) if k is not None and gap > 0 else math.inf

    # The bound programs the bounding pass will need, on the second core while the heuristics run on this one.
    prefetch = Prefetch([], math.inf)
    try:
        prefetch = Prefetch(_pass_tasks(job, model, cluster, list(estimates), members_of, recs, lcs, lbs, caps,
                                        t0 + time_limit) if workers > 1 and not unbounded else [],
                            stop_line(kth()), deadline=t0 + time_limit, stop=lambda: ctrl_c.flag)
    except BaseException:
        ctrl_c.__exit__()
        raise

    current = math.inf
    share = {True: 0.0, False: 0.0}
    """Seconds spent on steps picked out of order (v = 1 first) and in queue order: each gets half."""
    last_pick: tuple[bool, float] | None = None
    dive: Frame | None = None
    """The v = 1 shape the last out-of-order pick expanded: the next pick continues with its nodes."""
    residual = 0.0 if unbounded else residual
    ready: list[_Entry] = []
    """Nodes the bounding pass left for CP-SAT, with their tightened bounds (back in the queue after it)."""
    try:
        if unbounded:
            raise KeyboardInterrupt
        # The front's seeding walks (search/incumbents.seed): the frames of the fastest layouts so far through
        # their configurations, after the helper process has started (it bounds while they walk).
        # 2 x budget from its start, not from the plan's: the walks of the three fastest shapes take about 4 s on
        # the default job, and a first pass that ran long used to cut the second walk short.
        best_of.update(seed(job, [], model, cluster, best_of, _time.monotonic() + 2 * budget, stop=lambda: ctrl_c.flag,
                            walked=walked, configs=configs, gain=POLICY.seed_gain * gap))
        if best_of and first_layout_s is None:
            first_layout_s = _time.monotonic() - t0
        prefetch.set_line(stop_line(kth()))
        # Frames whose persistent bytes leave a fifth of the budget for activations first, then by estimate.
        ordered = visiting_order([((e.peak > 0.8 * caps[e.frame], estimates[e.frame]), e.frame)
                                  for e in heap])
        # Without a fitting heuristic layout the phase ends at 30% of the limit (at least `budget` after the
        # bounds), leaving CP-SAT the time to find a layout or prove there is none.
        deadline = max(_time.monotonic() + budget, t0 + 0.3 * time_limit)
        rest = [e for e in ordered if e[1] not in best_of]
        # Only without a layout at hand, or while the fastest is far above the queue's least bound
        # (POLICY.round_robin_above): then the walks have not met the pipeline shapes that lead, and this pass's
        # round-robin over them does (at 8,192 and 32,768 GPUs the walks end at 32.4 s, 90% above the least bound,
        # and this pass finds 19.2-s layouts in its 3 s; on the default job the walks end 9.5% above it, at
        # 18.63 s, and the pass found nothing under 24 s).
        lead = min((it.rank_time_s for it in best_of.values()), default=math.inf)  # inf: no layout at hand
        near = bool(heap) and lead <= (1 + POLICY.round_robin_above) * heap.top().bound
        if not near:
            best_of.update(incumbents(job, rest, model, cluster, top, budget, deadline, stop=lambda: ctrl_c.flag))
        # Then the frames by estimate under the fastest configurations found (and walked when faster), those whose
        # bound is under the fastest so far: first until the seeding stalls for a short while (the layouts it finds
        # set the pruning line of the bounding pass below, and a lower line prunes sooner), then, after the pass,
        # for the rest of its share unless a layout it finds closes the search.
        seed_left = min(max(POLICY.seed_min_s, POLICY.seed_share * time_limit), 0.3 * time_limit)
        state = SeedState()

        def seeding(patience_min: float | None, done: Callable[[list[PlanItem]], bool] | None,
                    stall_top: int) -> None:
            nonlocal seed_left, first_layout_s
            start = _time.monotonic()
            # dict.fromkeys, not a set: the order of frames at equal estimates stays the queue's (a set's
            # depends on the hash seed).
            frames_left = sorted(dict.fromkeys(e.frame for e in heap), key=estimates.__getitem__)
            # Each frame's least bound in the queue: after the pass, its tightened node bounds.
            least: dict[Frame, float] = {}
            for e in heap:
                least[e.frame] = min(least.get(e.frame, math.inf), e.bound)

            def publish(fastest: list[PlanItem]) -> bool:
                prefetch.set_line(stop_line(fastest[top - 1] if len(fastest) >= top else None))
                return done is not None and done(fastest)

            best_of.update(seed(job, frames_left, model, cluster, best_of, start + seed_left,
                                stop=lambda: ctrl_c.flag, walked=walked, walk_first=False,
                                lower=lambda g: max(lbs[g][0], least.get(g, -math.inf)), top=stall_top,
                                gain=POLICY.seed_gain * gap, configs=configs, done=publish, patience_min=patience_min,
                                state=state))
            seed_left -= _time.monotonic() - start
            if best_of and first_layout_s is None:
                first_layout_s = _time.monotonic() - t0

        # The first part stalls on the fastest layout alone: with top > 1 the top-th keeps falling as siblings of
        # the fastest are priced, which the sibling pricing does at once (on the default job, top 5: the first part
        # ran the seeding's whole share, 9 s; now 3 s, and the sibling pricing takes the fifth from 22.1 to
        # 18.66 s, under the line the pass's bounds close).
        seeding(POLICY.first_patience_near_s if near else POLICY.first_patience_s, None, 1)
        if top > 1:
            best_of.update(spread(job, best_of, list(estimates), model, cluster,
                                  min(_time.monotonic() + budget, t0 + time_limit),
                                  most=max(top, POLICY.spread_sources), stop=lambda: ctrl_c.flag))

        def proven(fastest: list[PlanItem]) -> bool:
            """Whether the queue's least bound already closes the search for these layouts (fastest first)."""
            if len(fastest) < top or not heap:
                return len(fastest) >= top
            e = heap.top()
            return _closed(min(e.bound, residual), e.peak, fastest[top - 1], gap)

        # Without `top` layouts there is no line to bound against (and no proof to stop the seeding at): no pass,
        # the node models start at once.
        bounding_end = _time.monotonic() + (POLICY.bound_share * time_limit if kth() is not None else 0.0)
        for solving in (False, True):
            if solving:
                for e in ready:
                    heap.push(e)
                ready.clear()
                last_pick = None  # the seeding between is neither kind of step
                if timed_out or interrupted:
                    break
                if seed_left > 0 and not proven(sorted(best_of.values(), key=lambda it: _key(it.evaluation))):
                    seeding(None, proven, top)
                # The fastest layouts' configurations and splits priced on the shapes that differ from theirs in the
                # FSDP degrees and sharding policies only: their own seeding rarely reaches a split climbed on a
                # sibling. Run even when the bounds close the search: a sibling as fast and leaner ranks first (on
                # the default job the seeding's 18.631-s layout peaks at 138.5 GiB; the sibling pricing finds one as
                # fast at 110.0 GiB).
                best_of.update(spread(job, best_of, list(estimates), model, cluster,
                                      min(_time.monotonic() + budget, t0 + time_limit),
                                      most=max(top, POLICY.spread_sources), stop=lambda: ctrl_c.flag))
            while heap:
                least_entry = heap.top()
                k = kth()

                def closed(t: float, m: float, k: PlanItem | None = k) -> bool:
                    return _closed(t, m, k, gap)

                if closed(least_entry.bound, least_entry.peak):
                    break
                # The pruning line (what the bound programs stop at) and the one number `closed` compares with (the
                # picks below test the queue's entries against it).
                line = (k.rank_time_s * (1 - gap) if gap > 0 else None) if k is not None else math.inf
                prefetch.set_line(stop_line(k))
                open_below = line * (1 - LINE_ROUNDING) if line is not None else None
                remaining = time_limit - (_time.monotonic() - t0)
                if remaining <= 0:
                    timed_out = True
                    break
                if ctrl_c.flag:
                    interrupted = True
                    break
                now = _time.monotonic()
                if not solving and now >= bounding_end:
                    break
                if last_pick is not None:
                    share[last_pick[0]] += now - last_pick[1]
                picked, diving = None, False

                def is_open(e: _Entry, below: float | None = open_below) -> bool:
                    return e.bound < below if below is not None else not closed(e.bound, e.peak)

                if share[True] <= share[False]:
                    # Half of the time (bounding and solving alike), the first step included, goes to the best v = 1
                    # node: its bound is an exact program over the split, so it is proven fast, while a v > 1 node's
                    # mean bound keeps it first in the queue (and expanding interleaved shapes one by one could take
                    # the whole limit before any solve); the other half follows the queue, which raises the proven
                    # bound. The order changes which node is solved first, never the bound (the least over the queue).
                    # It dives: the shape expanded last goes on to its best node, and that node is solved once
                    # tightened, even when tightening lifted it above other nodes (its bound stays valid).
                    picked = heap.least_of(dive, is_open) if dive is not None else None
                    picked = picked or heap.least_one(is_open)
                    diving = picked is not None
                elif heap.top().attempt > 0:
                    # Queue order, first slices first: a node cut by its slice waits (with CP-SAT's bound) until every
                    # frame and node under the gap line has had its bounds and one slice, the least bound first; an
                    # interleaved node's CP-SAT bound often stalls, and its doubled slices would starve the rest.
                    picked = heap.least_fresh(is_open)
                last_pick = (diving, now)
                picked = picked or heap.top()
                heap.take(picked)
                t_lb, m_lb, f, rc, lc, attempt = (picked.bound, picked.peak, picked.frame, picked.recompute,
                                                  picked.lifecycle, picked.attempt)
                current = t_lb
                mine = best_of.get(f)
                if mine is not None and (t_lb > mine.rank_time_s or (
                        gap > 0 and t_lb >= mine.rank_time_s * (1 - gap) * (1 - LINE_ROUNDING))):
                    residual = min(residual, t_lb)
                    current = math.inf
                    continue  # this node cannot improve its frame (beyond the gap), and the frame is already ranked
                if rc is None and f.vp > 1 and f not in frame_tightened:
                    # The shape's FSDP variants first, as for nodes below (bounds.group_frame_bound).
                    group = sharding_group(f)
                    mem = members_of.get(group, [])
                    if group not in group_bounds:
                        ahead = prefetch.take(("frame", group)) if len(mem) > 1 else None
                        per_node: dict = {}
                        if ahead is not None:
                            group_bounds[group], per_node = ahead
                        elif len(mem) > 1:
                            group_bounds[group] = group_frame_bound(
                                job, tuple(mem), model, cluster, stop_at=line if line is not None else math.inf,
                                deadline=t0 + time_limit, per_node=per_node)
                        else:
                            group_bounds[group] = -math.inf
                        unlifted[group] = per_node
                    gb = group_bounds[group]
                    if gb <= t_lb + 1e-12 and group in unlifted and line is not None and math.isfinite(line):
                        # Under the line: the group's nodes by their group programs before any member's own bounds
                        # (bounds.lift_group_bound); each member's node, popped later, takes the programs' values.
                        ahead = prefetch.take(("lift", group))
                        value, lifted = ahead if ahead is not None else lift_group_bound(
                            job, tuple(mem), unlifted.pop(group), model, cluster, stop_at=line,
                            deadline=t0 + time_limit)
                        unlifted.pop(group, None)
                        for (r_, l_), v in lifted.items():
                            group_bounds.setdefault((group, r_, l_), v)
                        group_bounds[group] = gb = max(gb, value)
                    if gb > t_lb + 1e-12:
                        if math.isfinite(gb):
                            heap.push(_Entry(gb, m_lb, next(seq), f, None, None, 0))
                        current = math.inf
                        continue
                if rc is None and f not in frame_tightened:
                    frame_tightened.add(f)
                    ahead = prefetch.take(("dp", f))
                    ft, fm_ = ahead if ahead is not None else frame_dp_bound(
                        job, f, model, cluster, stop_at=line if line is not None else math.inf)
                    if ft > t_lb + 1e-12 or fm_ > m_lb:
                        if math.isfinite(ft) and fm_ <= caps[f]:
                            heap.push(_Entry(max(ft, t_lb), max(fm_, m_lb), next(seq), f, None, None, 0))
                        current = math.inf
                        dive = f if diving else dive
                        continue
                if rc is None:
                    ahead = prefetch.take(("nodes", f))
                    nodes = ahead if ahead is not None else _node_bounds(job, f, recs, lcs, model, cluster)
                    for (r_, l_), (nt, nm) in zip(itertools.product(recs, lcs), nodes, strict=True):
                        if nm <= caps[f]:
                            heap.push(_Entry(max(nt, t_lb), max(nm, m_lb), next(seq), f, r_, l_, 0))
                    current = math.inf
                    dive = f if diving else dive
                    continue
                if f.vp > 1 and (f, rc, lc) not in tightened:
                    # One program for the node of every FSDP variant of the shape first (bounds.group_node_bound): they
                    # sit at near-equal bounds, and one program over the least of their arrays often shows them all
                    # above the line. Each member popped below the group's bound goes back with it, unsolved.
                    group = sharding_group(f)
                    if (group, rc, lc) not in group_bounds:
                        mem = members_of.get(group, [])
                        ahead = prefetch.take(("node", group, rc, lc)) if len(mem) > 1 else None
                        group_bounds[(group, rc, lc)] = ahead if ahead is not None else group_node_bound(
                            job, tuple(mem), rc, lc, model, cluster, stop_at=line if line is not None else math.inf,
                            deadline=t0 + time_limit) if len(mem) > 1 else -math.inf
                    gb = group_bounds[(group, rc, lc)]
                    if gb > t_lb + 1e-12:
                        if math.isfinite(gb):
                            heap.push(_Entry(gb, m_lb, next(seq), f, rc, lc, 0))
                        current = math.inf
                        continue
                if _time.monotonic() - t0 > time_limit:
                    # The limit passed during the group's program (seconds at 8,192 GPUs): the node goes back with
                    # its bound, not on to its own relaxation, which ran the plan past the limit.
                    heap.push(_Entry(t_lb, m_lb, next(seq), f, rc, lc, attempt))
                    current = math.inf
                    timed_out = True
                    break
                if (f, rc, lc) not in tightened:
                    tightened.add((f, rc, lc))
                    # Past the pruning line the exact value is not needed: the node only has to be shown above it.
                    tight = tight_node_bound(job, f, rc, lc, model, cluster,
                                             stop_at=line if line is not None else math.inf)
                    if tight > t_lb + 1e-12:
                        if not (diving and math.isfinite(tight) and not closed(tight, m_lb)):
                            if math.isfinite(tight):
                                heap.push(_Entry(tight, m_lb, next(seq), f, rc, lc, 0))
                            current = math.inf
                            continue
                        t_lb = current = tight  # the dive solves it now, with its tightened bound
                if not solving:
                    # The bounding pass solves nothing: the node waits, with its tightened bound, for the seeding.
                    ready.append(_Entry(t_lb, m_lb, next(seq), f, rc, lc, attempt))
                    current = math.inf
                    dive = None
                    continue
                # The helper bounds on until the first CP-SAT solve, which takes both cores (the values it has
                # computed stay): at 8,192 GPUs the bounding after the seeding (15 s) solves nothing.
                prefetch.close()
                hint = frame_incumbent(job, f, model, cluster, recompute=rc, lifecycle=lc,
                                       deadline=t0 + time_limit) if attempt == 0 else None
                if hint is not None and (mine is None or _key(hint.evaluation) < _key(mine.evaluation)):
                    best_of[f] = mine = hint
                remaining = time_limit - (_time.monotonic() - t0)
                res, item = solve_frame(job, f, model, cluster, min(remaining, base_slice * 2 ** attempt), workers,
                                        recompute=rc, lifecycle=lc, relative_gap=gap,
                                        hint=(hint or mine).layout if (hint or mine) is not None else None)
                solved += 1
                dive = None
                if item is not None and res.shape is not None:
                    item = _rebalanced(job, f, res.shape, item, model, cluster)
                size = {"variables": max(size.get("variables", 0), res.variables),
                        "constraints": max(size.get("constraints", 0), res.constraints)}
                if item is not None and (mine is None or _key(item.evaluation) < _key(mine.evaluation)):
                    best_of[f] = item
                if best_of and first_layout_s is None:
                    first_layout_s = _time.monotonic() - t0
                node_bound = max(t_lb, res.bound_step_s)
                if ctrl_c.flag:
                    interrupted = True
                    residual = min(residual, node_bound)
                    break
                if res.status == "UNKNOWN" and f.vp > 1 and (f, rc, lc) not in contiguity_checked:
                    # No layout found in its slice: whole layers in contiguous chunks may not fit at all, which the
                    # relaxation (fractional, not contiguous) cannot see and CP-SAT's bound can take minutes to show
                    # (lp_bound.contiguous_fits). Once per node, for at most its next slice.
                    contiguity_checked.add((f, rc, lc))
                    left = time_limit - (_time.monotonic() - t0)
                    if left > 0 and contiguous_fits(job, f, rc, lc, model, cluster,
                                                    min(left, base_slice * 2 ** (attempt + 1))) is False:
                        current = math.inf
                        continue
                if res.status in ("FEASIBLE", "UNKNOWN"):
                    # Cut by its slice: back to the queue with CP-SAT's bound and twice the time.
                    heap.push(_Entry(node_bound, m_lb, next(seq), f, rc, lc, attempt + 1))
                elif res.status == "OPTIMAL" and item is not None and node_bound < item.rank_time_s:
                    residual = min(residual, node_bound)  # proven to the relative gap only
                current = math.inf
                if progress:
                    progress(solved, candidates, _time.monotonic() - t0)
    except KeyboardInterrupt:
        interrupted = True
        residual = min(residual, current)
    finally:
        for e in ready:
            heap.push(e)
        prefetch.close()
        ctrl_c.__exit__()
    if ctrl_c.flag:
        interrupted = True
    bound = min(heap.top().bound if heap else math.inf, residual)
    ranked = sorted(best_of.values(), key=lambda it: _key(it.evaluation))
    if not ranked:
        if interrupted:
            raise KeyboardInterrupt
        if timed_out or math.isfinite(bound):
            raise InfeasibleJobError(
                f"no layout found within the {time_limit:g} s time limit ({solved} candidate shapes solved); "
                "raise --time-limit")
        raise InfeasibleJobError(_infeasible_reason(job, model, cluster, min_peak_lb[1], min_peak_lb[0]))
    front, complete = (build_front(job, model, cluster, best_of, ranked, pareto_step_gib, t0, total_limit, workers,
                                          lower_bounds=lbs, over_line=over_line, estimates=estimates)
                       if pareto and not ctrl_c.flag and (unbounded or not interrupted)
                       else (ranked[:1] if interrupted else [], False))
    ranked = _with_front(ranked, front)
    top_items = ranked[:top]
    best_t = top_items[0].rank_time_s
    bound = min(bound, best_t)
    proven_gap = (best_t - bound) / best_t if best_t else 0.0
    k = ranked[min(top, len(ranked)) - 1].rank_time_s
    # gap > 0: bounds within LINE_ROUNDING under the line count as at it, so the proven gap may exceed `gap` by
    # as much: 1 - (1 - gap)(1 - LINE_ROUNDING) <= gap + LINE_ROUNDING.
    tol = LINE_ROUNDING if gap > 0 else 0.0
    done = not (timed_out or interrupted) and (bound >= k * (1 - gap) * (1 - tol) - 1e-12 or not heap)
    status = "OPTIMAL" if done and proven_gap <= gap + tol + 1e-12 else "FEASIBLE"
    open_shapes, holding = (0, None) if status == "OPTIMAL" else _open_bounds(
        heap, ranked[top - 1] if len(ranked) >= top else None, gap, frame_tightened, tightened)
    return Plan(job=job, status=status, layouts=top_items, pareto=front, bound=bound, gap=proven_gap,
                frames_total=len(frames), frames_solved=solved, solve_time_s=_time.monotonic() - t0,
                model_size=size, pareto_complete=complete, first_layout_s=first_layout_s,
                open_shapes=open_shapes, holding=holding)


def _first_bounds(line: float, job: Job, model: ModelSpec, cluster: ClusterSpec, hbm_line: int,
                  members: tuple[Frame, ...], known: dict[Frame, tuple[float, float]]
                  ) -> list[tuple[Frame, tuple[float, float] | None, int | None, float | None]]:
    """The first bounds of one sharding group's shapes, most sharded first (`_most_sharded_first`): per shape
    (shape, frame_lower_bound, its allocated budget, frame_estimate), the bound None where a more sharded shape of
    the group is already over the HBM line (dominated), the budget None where the shape's peak bound is over that
    line (over every budget), the estimate None where the shape does not enter the queue (its peak bound over its
    budget). `known`: bounds already computed. (`line`: the Prefetch program's argument, unused.)"""
    over: list[Frame] = []
    out: list[tuple[Frame, tuple[float, float] | None, int | None, float | None]] = []
    for f in members:
        if any(g.expert_fsdp % f.expert_fsdp == 0 and g.dense_fsdp % f.dense_fsdp == 0 for g in over):
            out.append((f, None, None, None))
            continue
        lb = known.get(f) or frame_lower_bound(job, f, model, cluster)
        if lb[1] > hbm_line:
            over.append(f)
            out.append((f, lb, None, None))
            continue
        cap = allocated_capacity_bytes(job, f, model, cluster)
        # The estimate now, while the shape's coefficients are still in the build cache (thousands of shapes evict it).
        out.append((f, lb, cap, frame_estimate(job, f, model, cluster) if lb[1] <= cap else None))
    return out


def _open_bounds(heap: _Queue, k: PlanItem | None, gap: float, frame_tightened: set[Frame], tightened: set
                 ) -> tuple[int, OpenBound | None]:
    """(How many parallel shapes have an entry in the queue that does not close the search against the top-th
    layout k, the least such entry described): what a FEASIBLE plan leaves open."""
    open_entries = [e for e in heap if not _closed(e.bound, e.peak, k, gap)]
    if not open_entries:
        return 0, None
    least = min(open_entries)
    t_lb, f, rc, lc, attempt = least.bound, least.frame, least.recompute, least.lifecycle, least.attempt
    if rc is None:
        kind = ("shape bound over whole layers per rank (its recompute x lifecycle nodes not bounded yet)"
                if f in frame_tightened else "shape bound (not tightened to the shape's own layers yet)")
    elif attempt > 0:
        kind = (f"{rc.value} / {lc.value} node: CP-SAT's bound after {attempt} time slice"
                f"{'s' if attempt > 1 else ''}")
    elif (f, rc, lc) in tightened:
        kind = (f"{rc.value} / {lc.value} node: its {'linear relaxation' if f.vp > 1 else 'split programs'} (not "
                "solved yet)")
    else:
        kind = f"{rc.value} / {lc.value} node: its first bound (not tightened yet)"
    line = (k.rank_time_s * (1 - gap) if gap > 0 else k.rank_time_s) if k is not None else math.inf
    return len({e.frame for e in open_entries}), OpenBound(shape=_frame_text(f), bound_s=t_lb, kind=kind, line_s=line)


def _frame_text(f: Frame) -> str:
    """A parallel shape in the plan table's terms."""
    return (f"{degrees_text(f)} {f.dense_sharding.value}/{f.expert_sharding.value} grads={f.grad_dtype.value} "
            f"{f.precision.value} on {f.gpus} GPUs")


def _node_bounds(job: Job, f: Frame, recs: list[Recompute], lcs: list[FsdpLifecycle], model: ModelSpec,
                 cluster: ClusterSpec) -> list[tuple[float, float]]:
    """node_lower_bound of each of the frame's (recompute, lifecycle) nodes, in itertools.product(recs, lcs) order."""
    return [node_lower_bound(job, f, rc, lc, model, cluster) for rc, lc in itertools.product(recs, lcs)]


def _pass_tasks(job: Job, model: ModelSpec, cluster: ClusterSpec, frames: list[Frame],
                members_of: dict[tuple, list[Frame]], recs: list[Recompute], lcs: list[FsdpLifecycle],
                lbs: dict[Frame, tuple[float, float]], caps: _Caps, deadline: float
                ) -> list[tuple[tuple, Callable[[float], object]]]:
    """The bounding pass's programs (search/prefetch.py) in the order it needs them: the frame programs of the
    queue's `frames` (bounds.frame_dp_bound, then the node bounds it expands them into) and of their sharding groups
    (bounds.group_frame_bound) by least frame bound, then the groups' lifts by their node programs
    (bounds.lift_group_bound), then the members' own frame programs, then the groups' node programs
    (bounds.group_node_bound). A program whose frames or nodes are all at or above the line when it starts returns
    None: the pass would not need it."""
    frame_value: dict[tuple, float] = {}
    node_bounds: dict[tuple, dict[tuple[Recompute, FsdpLifecycle], float]] = {}
    """Per group, its nodes' own bounds from its group program (bounds.group_frame_bound's `per_node`)."""
    node_value: dict[tuple, float] = {}
    """The group node programs the lift programs ran (bounds.lift_group_bound)."""
    dp_value: dict[Frame, float] = {}
    groups = sorted(((g, tuple(m)) for g, m in members_of.items() if len(m) > 1),
                    key=lambda gm: min(lbs[f][0] for f in gm[1]))

    def under(line: float, t: float) -> bool:
        return t < line * (1 - LINE_ROUNDING)

    def group_program(line: float, group: tuple, mem: tuple[Frame, ...]
                      ) -> tuple[float, dict[tuple[Recompute, FsdpLifecycle], float]] | None:
        if not any(under(line, lbs[f][0]) for f in mem):
            return None
        per_node: dict[tuple[Recompute, FsdpLifecycle], float] = {}
        frame_value[group] = group_frame_bound(job, mem, model, cluster, stop_at=line, deadline=deadline,
                                               per_node=per_node)
        node_bounds[group] = per_node
        return frame_value[group], dict(per_node)

    def lift_program(line: float, group: tuple, mem: tuple[Frame, ...]
                     ) -> tuple[float, dict[tuple[Recompute, FsdpLifecycle], float]] | None:
        if not math.isfinite(line):
            return None
        if group not in node_bounds and group_program(line, group, mem) is None:
            return None  # (the driver took the group's program before this process reached it)
        if not under(line, frame_value[group]):
            return None
        value, lifted = lift_group_bound(job, mem, node_bounds[group], model, cluster, stop_at=line,
                                         deadline=deadline)
        frame_value[group] = max(frame_value[group], value)
        node_value.update({(group, *node): v for node, v in lifted.items()})
        return value, lifted

    def dp_program(line: float, f: Frame) -> tuple[float, float] | None:
        if not under(line, max(lbs[f][0], frame_value.get(sharding_group(f), -math.inf))):
            return None
        t, m = frame_dp_bound(job, f, model, cluster, stop_at=line)
        dp_value[f] = t
        return t, m

    def node_program(line: float, group: tuple, mem: tuple[Frame, ...], rc: Recompute,
                     lc: FsdpLifecycle) -> float | None:
        if not under(line, frame_value.get(group, -math.inf)):
            return None
        if (group, rc, lc) in node_value:
            return node_value[(group, rc, lc)]
        nodes = [node_lower_bound(job, f, rc, lc, model, cluster) for f in mem]
        if not any(under(line, max(nt, dp_value.get(f, -math.inf))) and nm <= caps[f]
                   for (nt, nm), f in zip(nodes, mem, strict=True)):
            return None
        return group_node_bound(job, mem, rc, lc, model, cluster, stop_at=line, deadline=deadline)

    def nodes_program(line: float, f: Frame) -> list[tuple[float, float]] | None:
        if not under(line, max(lbs[f][0], dp_value.get(f, -math.inf))):
            return None
        return _node_bounds(job, f, recs, lcs, model, cluster)

    # The members of an interleaved group wait for every group program: one group program lifts tens of members at
    # once, and while the line is still the first heuristic layout's (twice the optimum at 8,192 GPUs) no member's
    # own program would stop early. In one order (8,192 GPUs) the helper bounded 5 of the 93 groups under the final
    # line in 33 s and spent about 25 s of it on 270 members' own programs.
    grouped = {f for _, mem in groups if mem[0].vp > 1 for f in mem}
    first: list[tuple[int, float, int, tuple, Callable[[float], object]]] = []
    for i, (group, mem) in enumerate(groups):
        first.append((0, min(lbs[f][0] for f in mem), i, ("frame", group),
                      partial(group_program, group=group, mem=mem)))
    for i, (group, mem) in enumerate(groups):
        first.append((1, min(lbs[f][0] for f in mem), i, ("lift", group),
                      partial(lift_program, group=group, mem=mem)))
    for i, f in enumerate(frames):
        tier = 2 * int(f in grouped)
        first.append((tier, lbs[f][0], len(groups) + 2 * i, ("dp", f), partial(dp_program, f=f)))
        first.append((tier, lbs[f][0], len(groups) + 2 * i + 1, ("nodes", f), partial(nodes_program, f=f)))
    first.sort(key=lambda x: x[:3])
    tasks = [(key, program) for _, _, _, key, program in first]
    for group, mem in groups:
        for rc in recs:
            for lc in lcs:
                tasks.append((("node", group, rc, lc), partial(node_program, group=group, mem=mem, rc=rc, lc=lc)))
    return tasks


def _closed(t: float, m: float, k: PlanItem | None, gap: float) -> bool:
    """Whether a node of bounds (t s, m bytes) cannot displace the top-th layout k: at or above k's step time less
    the relative gap (LINE_ROUNDING under it counts as at it), or with gap 0 slower, or as fast and no leaner."""
    return k is not None and (t >= k.rank_time_s * (1 - gap) * (1 - LINE_ROUNDING) if gap > 0 else
                              (t > k.rank_time_s or (t == k.rank_time_s and m >= k.peak_bytes)))


def _with_front(ranked: list[PlanItem], front: list[PlanItem]) -> list[PlanItem]:
    """The ranked layouts with the front's points in them: the front searches on after the ranked share of the
    time and may find a faster layout of a frame (or of a frame the ranked search never solved). One per frame,
    best first; the search's bound stays a lower bound of every layout, so the gap is taken after this."""
    best: dict[Frame, PlanItem] = {}
    for it in [*ranked, *(PlanItem(p.layout, p.evaluation) for p in front if p.evaluation.fits)]:
        f = frame_of(it.layout)
        if f not in best or _key(it.evaluation) < _key(best[f].evaluation):
            best[f] = it
    return sorted(best.values(), key=lambda it: _key(it.evaluation))


@dataclass(frozen=True, order=True, slots=True)
class _Entry:
    """A queue entry: a shape (recompute and lifecycle None) or one of its (recompute, lifecycle) nodes, with lower
    bounds on every layout it stands for. Entries order by (bound, peak, seq): the least step-time bound first, ties
    to the least peak bound, then to the earlier push (seq is unique, so no two entries tie)."""

    bound: float
    """Lower bound on the ranked step time (s)."""
    peak: float
    """Lower bound on the worst-rank peak (bytes)."""
    seq: int
    """Push order: the last tie-break, and the entry's identity in the queue."""
    frame: Frame = field(compare=False)
    recompute: Recompute | None = field(compare=False)
    lifecycle: FsdpLifecycle | None = field(compare=False)
    attempt: int = field(compare=False)
    """CP-SAT slices that cut this node so far: its next slice is the base slice x 2^attempt."""


class _Queue:
    """The search's queue of entries (`_Entry`), least first, with the two picks the driver makes out of order: the
    least v = 1 entry (of one frame, for a dive) and the least entry not yet cut by a slice. Each is its own heap
    over the same entries (a taken entry is dropped from each when it reaches its top), so a pick costs a heap
    operation, not a scan of tens of thousands of entries. The heaps hold (bound, peak, seq, entry): the entries'
    order, compared as plain tuples."""

    def __init__(self) -> None:
        self._all: list[tuple[float, float, int, _Entry]] = []
        self._ones: list[tuple[float, float, int, _Entry]] = []
        self._fresh: list[tuple[float, float, int, _Entry]] = []
        self._of: dict[Frame, list[_Entry]] = {}
        self._alive: set[int] = set()

    def push(self, e: _Entry) -> None:
        item = (e.bound, e.peak, e.seq, e)
        heapq.heappush(self._all, item)
        self._alive.add(e.seq)
        if e.frame.vp == 1:
            heapq.heappush(self._ones, item)
            self._of.setdefault(e.frame, []).append(e)
        if e.attempt == 0:
            heapq.heappush(self._fresh, item)

    def take(self, e: _Entry) -> None:
        self._alive.remove(e.seq)

    def _least(self, h: list[tuple[float, float, int, _Entry]]) -> _Entry | None:
        while h and h[0][2] not in self._alive:
            heapq.heappop(h)
        return h[0][3] if h else None

    def top(self) -> _Entry:
        e = self._least(self._all)
        if e is None:
            raise IndexError("the queue is empty")
        return e

    def least_one(self, is_open: Callable[[_Entry], bool]) -> _Entry | None:
        """The least v = 1 entry, if open (`is_open` holds for an entry when it holds for a greater one)."""
        e = self._least(self._ones)
        return e if e is not None and is_open(e) else None

    def least_of(self, f: Frame, is_open: Callable[[_Entry], bool]) -> _Entry | None:
        """The least open entry of v = 1 frame f."""
        mine = self._of.get(f, [])
        mine[:] = [e for e in mine if e.seq in self._alive]
        return min((e for e in mine if is_open(e)), default=None)

    def least_fresh(self, is_open: Callable[[_Entry], bool]) -> _Entry | None:
        """The least entry not cut by a slice yet (attempt 0), if open."""
        e = self._least(self._fresh)
        return e if e is not None and is_open(e) else None

    def __bool__(self) -> bool:
        return self._least(self._all) is not None

    def __len__(self) -> int:
        return len(self._alive)

    def __iter__(self) -> Iterator[_Entry]:
        return (item[3] for item in self._all if item[2] in self._alive)


class _Caps(dict):
    """Each frame's allocated budget (`allocated_capacity_bytes`), computed when first asked for."""

    def __init__(self, job: Job, model: ModelSpec, cluster: ClusterSpec) -> None:
        super().__init__()
        self._args = (job, model, cluster)

    def __missing__(self, f: Frame) -> int:
        job, model, cluster = self._args
        self[f] = allocated_capacity_bytes(job, f, model, cluster)
        return self[f]


def _rebalanced(job: Job, f: Frame, shape: Shape, item: PlanItem, model: ModelSpec, cluster: ClusterSpec
                ) -> PlanItem:
    """The node's layout, or a better one of the same configuration: when its replayed schedule ranks it above the
    step formula the node model minimized (uneven interleaved chunks), the heuristic splits of that configuration
    (search/incumbents.candidate_splits: work-balanced, memory-balanced, even) are priced with evaluate() too."""
    if item.rank_time_s <= item.evaluation.step.formula_time_s * (1 + 1e-9):
        return item
    best = item
    for split in candidate_splits(ranked_coefficients(shape, model, cluster),
                                  allocated_capacity_bytes(job, f, model, cluster)):
        ev = evaluate(layout_of(job, f, shape, split), model=model, cluster=cluster)
        if ev.fits and _key(ev) < _key(best.evaluation):
            best = PlanItem(ev.layout, ev)
    return best


def _most_sharded_first(frames: list[Frame]) -> list[Frame]:
    """Frames by descending expert x dense FSDP degree (stable otherwise). The peak bound of `frame_lower_bound`
    (the mean of master, optimizer, BF16 view and gradient bytes) only shrinks as either degree grows by a
    multiple (each state is divided by its shard count; tests/test_search.py checks it over every frame of the
    test job), so once a shape is over the HBM line every less-sharded shape of its group is too."""
    return sorted(frames, key=lambda f: -f.expert_fsdp * f.dense_fsdp)


def _infeasible_reason(job: Job, model: ModelSpec, cluster: ClusterSpec, f: Frame | None,
                       lb: float) -> str:
    """The smallest peak any layout could reach on its worst rank, against the capacity, with its terms; where that
    fits (the model state does), that the search proved every shape over the budget with its activations."""
    if f is None:
        return "no candidate shape"
    cap = allocated_capacity_bytes(job, f, model, cluster)
    base = ActMode(Recompute.FULL, True, True, True, True)
    cf = coefficients(frame_shape(job, f, base, FsdpLifecycle.PER_MICROBATCH), model, cluster)
    terms = {"master": cf.master.sum() / f.pp, "optimizer": cf.optimizer.sum() / f.pp,
             "bf16_view": cf.bf16_view.sum() / f.pp, "grads": cf.grads.sum() / f.pp}
    top = sorted(terms.items(), key=lambda kv: -kv[1])
    state = (cf.master + cf.grads + cf.optimizer).sum() * (f.gpus // f.pp)
    state_text = f"{state / 2**40:,.2f} TiB" if state >= 2**40 else f"{state / GIB:,.1f} GiB"
    gpus = ", ".join(str(g) for g in job.gpu_counts)
    shape = (f"PP{f.pp} EP{f.ep} expert-FSDP{f.expert_fsdp} dense-FSDP{f.dense_fsdp}: "
             + ", ".join(f"{k} {v / GIB:,.1f}" for k, v in top) + " GiB per GPU")
    if lb > cap:
        return (f"no layout fits on {gpus} {cluster.name} GPUs: the smallest worst-rank peak any layout can reach is "
                f"at least {lb / GIB:,.1f} GiB against {cap / GIB:,.1f} GiB usable (best shape {shape}; the model "
                f"state alone is {state_text}); use more GPUs or a larger-memory cluster")
    # The model state fits on some shape: what the search proved is that its activations, working sets and buffers
    # do not, on every shape and node it searched.
    return (f"no layout fits on {gpus} {cluster.name} GPUs: the model state fits (at least {lb / GIB:,.1f} of "
            f"{cap / GIB:,.1f} GiB usable on the leanest shape, {shape}), but every shape searched was proven over "
            f"the budget once its activations, working sets and buffers are counted; allow more recompute, "
            f"activation offload or FP8 activations in [search], shorten the microbatch (rows x context "
            f"{job.rows} x {job.context}), lower reserve_gib ({job.reserve_gib:g}), or use more GPUs")
