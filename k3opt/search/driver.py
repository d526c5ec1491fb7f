"""The best-first branch and bound over frames and nodes: `plan()`."""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import signal
import time as _time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NoReturn

from k3opt.cost.coefficients import Shape, coefficients, placement_of
from k3opt.cost.evaluate import Evaluation, evaluate
from k3opt.cost.ledger import layer_bytes
from k3opt.inputs.errors import InfeasibleJobError, SearchTimeoutError
from k3opt.inputs.labels import degrees_text, sharding_text
from k3opt.inputs.placement import domain_block, domains_held
from k3opt.inputs.presets import load_cluster, load_model
from k3opt.inputs.specs import (
    GIB,
    ClusterSpec,
    FsdpLifecycle,
    Job,
    ModelSpec,
    ParamGather,
    Recompute,
    trained_model,
)
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
    SHAPE_LIST_RULES,
    ActMode,
    Frame,
    allocated_capacity_bytes,
    blocking_lists,
    budget_line,
    chunk_least,
    enumerate_frames,
    fits,
    frame_of,
    frame_shape,
    layout_of,
    lifecycles,
    node_frame,
    peak_cap_bytes,
    policy_group,
    resolve_offload_sets,
    sharding_group,
)
from k3opt.search.front import Region, build_front, ranked_time_limit
from k3opt.search.incumbents import (
    SeedState,
    candidate_splits,
    cap_descent,
    frame_incumbent,
    incumbents,
    seed,
    split_climb,
    spread,
    visiting_order,
)
from k3opt.search.lp_bound import contiguous_fits
from k3opt.search.node_model import solve_frame
from k3opt.search.policy import POLICY
from k3opt.search.prefetch import Prefetch
from k3opt.search.progress import Progress, ProgressFn, Ticker
from k3opt.search.ranking import ranked_coefficients
from k3opt.search.result import LINE_ROUNDING, OpenBound, PlacementOption, Plan, PlanItem, within_gap

# ------------------------------------------------------------------------------------- driver


def _key(ev: Evaluation) -> tuple[float, int]:
    """Plans rank by the achievable step time (the roofline without a rates file), ties to the lower peak."""
    return (ev.step.rank_time_s, ev.peak_bytes)



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

def plan(job: Job, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None, top: int = 5,
         time_limit: float = 60.0, workers: int = 2, pareto: bool = False, pareto_step_gib: float = 1.0,
         progress: ProgressFn | None = None, gap: float = DEFAULT_GAP,
         refuse: Callable[[Frame], list[str]] | None = None) -> Plan:
    """Ranked layouts (best first, one per frame) and the Pareto front over (step time, worst-rank peak).

    Anytime best-first branch and bound. First, heuristic layouts of the frames with the lowest bounds, priced by
    evaluate(), are the incumbents (a fitting layout within seconds). Then frames enter a queue keyed by a lower
    bound on their step time; a popped frame is expanded into (recompute, lifecycle) nodes with tighter bounds; a
    popped node is solved by its CP-SAT model, hinted with a heuristic layout of that node, for a slice of the
    time (a node cut by its slice returns to the queue with CP-SAT's bound and a doubled slice). The seeding before
    the solves is split by a bounding pass over the queue (no solve, at most POLICY.bound_share of the limit), and
    its second part stops once the queue's least bound closes the search for the layouts found. With `workers` > 1
    (CP-SAT's threads) the pass's bound programs also run ahead in a forked process while the seeding runs
    (search/prefetch.py; Linux only), and stop when the solves start. The search stops when every node left has a
    bound within `gap` (relative) of the K-th best, and is then OPTIMAL; FEASIBLE when the time limit or Ctrl-C
    stopped it first. `Plan.gap` is always the proven gap of the best layout. Raises InfeasibleJobError with the
    smallest reachable peak when nothing fits. `refuse(frame)`: why a frame is left out (empty: it is searched),
    e.g. a launch target's degree rules (k3opt.launch.degree_refusals), so that only shapes it can run are ranked."""
    search = _Search(job, model, cluster, top=top, time_limit=time_limit, workers=workers, pareto=pareto,
                     pareto_step_gib=pareto_step_gib, progress=progress, gap=gap, refuse=refuse)
    search.execute()
    return search.finish()


class _Outcome(enum.Enum):
    """What the search did with an entry it took off the queue (`_Search.process`)."""

    PRUNED = "pruned"
    """It cannot improve its frame's ranked layout beyond the gap: left out, its bound kept in the residual."""
    REQUEUED = "requeued"
    """Back in the queue as a fresh entry with a tighter bound: its group's, its own, its node relaxation's."""
    INFEASIBLE = "infeasible"
    """Proven to hold no layout: an infinite bound, a peak bound over the budget, or no contiguous whole-layer fit."""
    EXPANDED = "expanded"
    """A shape replaced by those of its (recompute, lifecycle) nodes whose peak bound is within the budget."""
    WAITING = "waiting"
    """A node the bounding pass set aside for CP-SAT, with its tightened bound (back in the queue after the pass)."""
    SOLVED = "solved"
    """A node solved by CP-SAT for a slice; one cut by its slice is back with CP-SAT's bound and twice the time."""
    STOPPED = "stopped"
    """The time limit passed (the node back in the queue, unsolved) or Ctrl-C came during its solve: the search
    stops."""


@dataclass(frozen=True)
class _Line:
    """The pruning line of one step: the top-th layout k (None while fewer than top are at hand) less the gap."""

    k: PlanItem | None
    gap: float
    value: float | None
    """k's ranked step time x (1 - gap); inf without k; None with gap 0 (`closed` then compares with k itself)."""
    below: float | None
    """What an open entry's bound is under: the line less LINE_ROUNDING (None with gap 0)."""

    @classmethod
    def of(cls, k: PlanItem | None, gap: float) -> _Line:
        value = (k.rank_time_s * (1 - gap) if gap > 0 else None) if k is not None else math.inf
        return cls(k, gap, value, value * (1 - LINE_ROUNDING) if value is not None else None)

    @property
    def stop(self) -> float:
        """What the bound programs stop at: the line (inf without k, or with gap 0)."""
        return self.value if self.value is not None else math.inf

    def closed(self, t: float, m: float) -> bool:
        """Whether bounds (t s, m bytes) cannot displace k (`_closed`)."""
        return _closed(t, m, self.k, self.gap)

    def is_open(self, e: _Entry) -> bool:
        """Whether entry e may still displace k; it then holds for every lesser entry too."""
        return e.bound < self.below if self.below is not None else not self.closed(e.bound, e.peak)


class _Search:
    """One `plan()` call: the job, its frames, the queue and the layouts found, the search's counters and the helper
    process, shared by its phases. `plan()` runs them in order: the first heuristic pass (`first_pass`), every
    shape's first bounds (`bound_shapes`), the helper's start (`start_helper`), the seeding, bounding pass and
    solves (`run`), and the Plan (`finish`)."""

    def __init__(self, job: Job, model: ModelSpec | str | None, cluster: ClusterSpec | str | None, *, top: int,
                 time_limit: float, workers: int, pareto: bool, pareto_step_gib: float,
                 progress: ProgressFn | None, gap: float, refuse: Callable[[Frame], list[str]] | None = None
                 ) -> None:
        self.t0 = _time.monotonic()
        self.job, self.top, self.workers, self.gap = job, top, workers, gap
        self.pareto, self.pareto_step_gib = pareto, pareto_step_gib
        self.ticker = Ticker(progress, self.t0)
        self.phase = "first layouts"
        self.total_limit = time_limit
        self.time_limit = ranked_time_limit(time_limit) if pareto else time_limit
        """The ranked search's share of the limit: with the front, the front has the rest (search/front.py)."""
        self.deadline = self.t0 + self.time_limit
        self.model = trained_model(job, model if isinstance(model, ModelSpec) else load_model(model or job.model))
        self.job = job = resolve_offload_sets(job, self.model)
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or job.cluster)
        self.refuse = refuse
        every = _frames(job, self.model, self.cluster)
        self.frames = every if refuse is None else [f for f in every if not refuse(f)]
        self.refused = set(every).difference(self.frames)
        """Frames `refuse` left out (the front leaves them out too)."""
        if refuse is not None and not self.frames:
            raise InfeasibleJobError(f"every parallel shape of the job is refused, e.g. {_frame_text(every[0])}: "
                                     f"{refuse(every[0])[0]}; widen [search] (ep, expert_fsdp, dense_fsdp, vp, cp) "
                                     "or drop the target")
        self.caps = _Caps(job, self.model, self.cluster)
        self.hbm_line = budget_line(job, self.cluster)
        """No allocated budget exceeds HBM minus the reserve (or the job's peak cap): a frame whose peak bound is
        above it needs no budget."""
        self.recs = job.search.recompute or list(Recompute)
        self.lcs = lifecycles(job)
        self.budget = min(POLICY.heuristic_max_s,
                          max(POLICY.heuristic_min_s, POLICY.heuristic_share * self.time_limit))
        """Seconds the heuristic passes and the sibling pricing get (the first pass half of it), the walks twice it."""
        self.base_slice = max(1.0, self.time_limit / POLICY.first_slices)
        """A node's first CP-SAT slice; each slice that cuts it doubles the next."""
        self.seed_left = min(max(POLICY.seed_min_s, POLICY.seed_share * self.time_limit),
                             POLICY.seed_max_share * self.time_limit)
        """Seconds left to the seeding's two parts (before and after the bounding pass)."""
        self.ctrl_c = _CtrlC()
        self.prefetch = Prefetch([], math.inf)
        """The helper process that runs the bounding pass's programs ahead (none until `start_helper`)."""
        self._init_state()

    def execute(self) -> None:
        """The phases before `finish`, in order, under the Ctrl-C handler: `first_pass`, `bound_shapes`,
        `start_helper`, `run`."""
        with self.ctrl_c:
            try:
                self.first_pass()
                self.bound_shapes()
            except KeyboardInterrupt:
                # Off the main thread Ctrl-C raises (_CtrlC): with a layout at hand the plan still returns it, its
                # bound 0 (shapes left unbounded).
                if not self.best_of:
                    raise
                self.unbounded = True
            self.start_helper()
            self.run()

    def _init_state(self) -> None:
        """The search's state before any phase: an empty queue, no layout, nothing bounded or solved."""
        self.queue = _Queue()
        self.seq = itertools.count()
        self.best_of: dict[Frame, PlanItem] = {}
        """The best layout found of each frame, filed under the layout's own frame (`_keep`)."""
        self.first_layout_s: float | None = None
        self.walked: set[Frame] = set()
        """Frames the seeding walked through their configurations (search/incumbents.seed)."""
        self.configs: dict = {}
        """Per frame, the fastest layout the seeding priced under each configuration (search/incumbents.seed)."""
        self.seed_state = SeedState()
        self.lbs: dict[Frame, tuple[float, float]] = {}
        """frame_lower_bound of every frame bounded here, reused by the Pareto front."""
        self.min_peak_lb: tuple[float, Frame | None] = (math.inf, None)
        self.estimates: dict[Frame, float] = {}
        """frame_estimate of every shape in the queue: the order the heuristics visit them in."""
        self.over_line: set[Frame] = set()
        """Frames skipped as dominated: their peak bound is over HBM minus the reserve, hence over every budget."""
        self.unbounded = False
        """Ctrl-C (or, with the front, the ranked share of the time) stopped `bound_shapes` with shapes unbounded."""
        self.candidates = 0
        self.members_of: dict[tuple, list[Frame]] = {}
        """The interleaved frames in the queue by `sharding_group`: a node's group bound covers all of them."""
        self.group_bounds: dict[tuple, float] = {}
        """Group bounds by sharding group (a frame's) and by (sharding group, recompute, lifecycle) (a node's)."""
        self.policy_members: dict[tuple, list[Frame]] = {}
        """The interleaved frames in the queue by `policy_group` (several sharding groups)."""
        self.unlifted: dict[tuple, dict] = {}
        """Per sharding group whose frame bound is not lifted yet (bounds.lift_group_bound), its nodes' own bounds."""
        self.frame_tightened: set[Frame] = set()
        self.tightened: set[tuple[Frame, Recompute, FsdpLifecycle]] = set()
        self.contiguity_checked: set[tuple[Frame, Recompute, FsdpLifecycle]] = set()
        """Interleaved nodes whose contiguous whole-layer fit was decided (lp_bound.contiguous_fits)."""
        self.ready: list[_Entry] = []
        """Nodes the bounding pass left for CP-SAT, with their tightened bounds (back in the queue after it)."""
        self.solved = 0
        self.shapes_bounded = 0
        """Shapes through `bound_shapes` (queued, or settled by their first bounds)."""
        self.size: dict[str, int] = {}
        self.timed_out = self.interrupted = False
        self.residual = math.inf
        """The least bound of the nodes left behind: pruned within the gap, or solved only to the gap."""
        self.solved_under: list[_Entry] = []
        """Nodes solved (to the gap, or exactly) whose bound stays in `residual`: a FEASIBLE plan names the one that
        holds its bound when it is the least."""
        self.current = math.inf
        """The bound of the entry being worked on (inf between entries): Ctrl-C leaves it in the residual."""
        self.share = {True: 0.0, False: 0.0}
        """Seconds spent on steps picked out of order (v = 1 first) and in queue order: each gets half."""
        self.last_pick: tuple[bool, float] | None = None
        self.dive: Frame | None = None
        """The v = 1 shape the last out-of-order pick expanded: the next pick continues with its nodes."""

    # -- small reads of the state

    def _stopped(self) -> bool:
        """Ctrl-C's flag: the heuristics stop on it (and report progress when they ask)."""
        self._tick()
        return self.ctrl_c.flag

    def _flag(self) -> bool:
        """Ctrl-C's flag alone: what the helper stops on."""
        return self.ctrl_c.flag

    def _tick(self, phase: str | None = None) -> None:
        """A progress snapshot to the caller when one is due (search/progress.py); a new phase forces one."""
        if phase is not None and phase != self.phase:
            self.phase = phase
            force = True
        else:
            force = False
        if self.ticker.due(force):
            self.ticker.send(self._snapshot)

    def _open_bound(self) -> float:
        """The least bound of what is still open: the queue's least entry, the nodes the bounding pass holds, the
        entry being worked on, and the bounds of the nodes left behind (`residual`)."""
        return min(self.queue.top().bound if self.queue else math.inf, self.residual, self.current,
                   min((e.bound for e in self.ready), default=math.inf))

    def _snapshot(self, elapsed: float, front_points: int = 0, front_settled: tuple[int, int] | None = None
                  ) -> Progress:
        """The search's state now: best layout, least open bound (once every shape is bounded), shapes settled."""
        best = min((it.rank_time_s for it in list(self.best_of.values())), default=None)
        bound = None
        if self.phase not in ("first layouts", "bounding shapes") and not self.unbounded:
            least = self._open_bound()
            bound = min(least, best) if best is not None else (least if math.isfinite(least) else None)
        total = len(self.frames)
        if front_settled is not None:
            settled, total = front_settled
        else:
            open_frames = {e.frame for e in self.queue} | {e.frame for e in self.ready}
            settled = max(0, self.shapes_bounded - len(open_frames))
        return Progress(self.phase, elapsed, best, bound, settled, total, self.solved, front_points)

    def _keep(self, *items: PlanItem) -> None:
        """Record each layout under its own frame (`frame_of`), the better of two for one frame staying: a frame
        with the EP overlap schedule runs its full-recompute nodes without it, so their layouts are its twin's
        shape, and every reader (the ranked list, the seeding's leads) looks a layout up by its own frame."""
        for it in items:
            g = frame_of(it.layout)
            mine = self.best_of.get(g)
            if mine is None or _key(it.evaluation) < _key(mine.evaluation):
                self.best_of[g] = it

    def _ranked(self) -> list[PlanItem]:
        return sorted(self.best_of.values(), key=lambda it: _key(it.evaluation))

    def _kth(self) -> PlanItem | None:
        ranked = self._ranked()
        return ranked[self.top - 1] if len(ranked) >= self.top else None

    def _stop_line(self, k: PlanItem | None) -> float:
        """What the bound programs stop at: the pruning line of the top-th layout k (inf without one, or gap 0)."""
        return _Line.of(k, self.gap).stop

    def _note_first_layout(self) -> None:
        if self.best_of and self.first_layout_s is None:
            self.first_layout_s = _time.monotonic() - self.t0

    def _push(self, bound: float, peak: float, f: Frame, rc: Recompute | None = None,
              lc: FsdpLifecycle | None = None, attempt: int = 0, exact: bool = False) -> None:
        self.queue.push(_Entry(bound, peak, next(self.seq), f, rc, lc, attempt, exact))

    def _requeue(self, e: _Entry, bound: float, peak: float | None = None) -> _Outcome:
        """e back in the queue as a fresh entry with a tighter `bound` (and `peak`); an infinite bound leaves it out."""
        if math.isfinite(bound):
            self._push(bound, e.peak if peak is None else peak, e.frame, e.recompute, e.lifecycle)
        self.current = math.inf
        return _Outcome.REQUEUED if math.isfinite(bound) else _Outcome.INFEASIBLE

    def _requeue_ready(self) -> None:
        for e in self.ready:
            self.queue.push(e)
        self.ready.clear()

    # -- the shapes' first bounds

    def first_pass(self) -> None:
        """A first layout before bounding every shape (incumbents.incumbents): round-robin over the pipeline shapes
        (PP, VP) and CP degrees, each by its most sharded shape first (the least memory per rank), so a fitting
        layout comes in seconds even when there are many shapes; the pipeline shapes by that shape's bounds: those
        that can fit, by step-time bound. A job listing several precisions or gradient dtypes has a head for each,
        and each pipeline shape's frames follow its heads' bounds: the faster precision's shapes come first."""
        # Ordered by sharding alone, the default job's leading pipeline shape (PP8 VP4) comes 13th, and without its
        # walk the search misses its fastest layout. The pass has half the budget, at most POLICY.first_pass_s.
        # K3 on 512 GB300 with BF16, FP8 and MXFP8 listed: with one head per (PP, VP), every head and the pass's
        # whole budget went to BF16 shapes (18.883 s); with a head per precision it starts at FP8 PP8 VP4 (17.597 s).
        heads: dict[tuple, tuple[tuple, Frame]] = {}
        d = self.cluster.nvlink_domain_gpus
        for f in self.frames:
            # Cached: the placement reads only the degrees, and tens of thousands of shapes share a few thousand.
            pl = placement_of(f.gpus, f.pp, f.cp, f.ep, f.expert_fsdp, f.dense_fsdp,
                              domain_block(f.domain_gpus_used, d))
            # Of the placements of one shape, the most local first (an EP group inside a rack, then the shard
            # groups, then the PP hops): the walks then start from a layout whose traffic stays on NVLink.
            key = (-f.ep, -f.dense_fsdp, f.expert_fsdp, f.cp, -pl.ep_local, -pl.dense_fsdp_local,
                   -pl.expert_fsdp_local, -sum(pl.pp_hop_in_domain))
            hk = _head_key(f)
            if hk not in heads or key < heads[hk][0]:
                heads[hk] = (key, f)
        for _, f in heads.values():
            self.lbs[f] = frame_lower_bound(self.job, f, self.model, self.cluster)
        rank = {hk: (self.lbs[f][1] > self.hbm_line, self.lbs[f][0]) for hk, (_, f) in heads.items()}
        quick = visiting_order([((rank[_head_key(f)], -f.ep, -f.dense_fsdp, f.expert_fsdp, f.cp), f)
                                for f in self.frames])
        # Its time counts from its own start, within the limit: on tens of thousands of shapes (Kimi K2 on 16 racks:
        # 48,615) listing them and bounding the heads took the whole budget from the search's start, and the pass
        # priced nothing.
        share = min(self.budget / 2, POLICY.first_pass_s)
        self._keep(*incumbents(self.job, quick, self.model, self.cluster, self.top, share,
                               min(max(self.t0 + self.budget, _time.monotonic() + share), self.deadline),
                               stop=self._stopped).values())
        self._note_first_layout()

    def bound_shapes(self) -> None:
        """Every shape's first bounds (`_first_bounds`), one sharding group at a time, shared with a forked helper
        (search/prefetch.py: the groups it has started are taken from it, the others computed here); the shapes
        whose peak bound is within their budget enter the queue."""
        # At 8,192 GPUs this pass bounds about 10,800 of the 28,224 shapes: seconds on one core, the other idle.
        by_group: dict[tuple, list[Frame]] = {}
        for f in _most_sharded_first(self.frames):
            by_group.setdefault(sharding_group(f), []).append(f)
        known = dict(self.lbs)
        tasks = [(("first", i), partial(_first_bounds, job=self.job, model=self.model, cluster=self.cluster,
                                        hbm_line=self.hbm_line, members=tuple(mem), known=known))
                 for i, mem in enumerate(by_group.values())]
        self._tick("bounding shapes")
        with Prefetch(tasks if self.workers > 1 else [], math.inf, deadline=self.deadline,
                      stop=self._flag) as sharing:
            for key, program in tasks:
                if self._bounding_cut():
                    break
                ahead = sharing.take(key)
                self._enqueue_shapes(ahead if ahead is not None else program(math.inf))
                self._tick()

    def _bounding_cut(self) -> bool:
        """Whether Ctrl-C or the time limit (with the front, the ranked share of the time) stops `bound_shapes`:
        the shapes not bounded yet leave the bound at 0 (`unbounded`). After Ctrl-C without a layout at hand it
        raises KeyboardInterrupt; a plan past its limit without one ends with SearchTimeoutError (`finish`)."""
        if self.ctrl_c.flag:
            if not self.best_of:
                raise KeyboardInterrupt
            self.unbounded = True
            return True
        # 48,615 shapes (Kimi K2 on 16 racks, every GPUs-per-rack size) take longer to bound than a short limit.
        if _time.monotonic() > self.deadline and (self.best_of or not self.pareto):
            self.timed_out = self.unbounded = True
            return True
        return False

    def _enqueue_shapes(self, rows: list[tuple[Frame, tuple[float, float] | None, int | None, float | None]]
                        ) -> None:
        """One sharding group's first bounds (`_first_bounds`) recorded, its shapes with an estimate queued."""
        self.shapes_bounded += len(rows)
        for f, lb, cap, estimate in rows:
            if lb is None:
                self.over_line.add(f)  # dominated: a shape with more sharding of the same state is over the line
                continue
            self.lbs[f] = lb
            t_lb, m_lb = lb
            if m_lb < self.min_peak_lb[0]:
                self.min_peak_lb = (m_lb, f)
            if cap is not None:
                self.caps[f] = cap
            if estimate is not None:
                self._push(t_lb, m_lb, f)
                self.estimates[f] = estimate

    def start_helper(self) -> None:
        """The bounding pass's programs (`_pass_tasks`) started in a forked process (with workers > 1 and every
        shape bounded): the helper bounds on the second core while the heuristics run on this one."""
        self.candidates = len(self.queue)
        for f in self.estimates:
            if f.vp > 1:
                self.members_of.setdefault(sharding_group(f), []).append(f)
                self.policy_members.setdefault(policy_group(f), []).append(f)
        tasks = (_pass_tasks(self.job, self.model, self.cluster, list(self.estimates), self.members_of, self.recs,
                             self.lcs, self.lbs, self.caps, self.deadline)
                 if self.workers > 1 and not self.unbounded else [])
        self.prefetch = Prefetch(tasks, self._stop_line(self._kth()), deadline=self.deadline, stop=self._flag)

    # -- the seeding, the bounding pass, the solves

    def run(self) -> None:
        """The seeding's walks and first part, the bounding pass, the seeding's second part, the CP-SAT solves.
        Ctrl-C ends it with the best so far (as does an unfinished `bound_shapes`); the nodes the pass left for
        CP-SAT go back to the queue, and the helper stops, however it ends."""
        self.residual = 0.0 if self.unbounded else self.residual
        try:
            if self.unbounded:
                raise KeyboardInterrupt
            self._tick("seeding")
            self._first_seeding()
            self._tick("bounding pass")
            self._bounding_pass()
            self._requeue_ready()
            self.last_pick = None  # the seeding between is neither kind of step
            if not (self.timed_out or self.interrupted):
                self._tick("seeding")
                self._second_seeding()
                self._tick("solving")
                self._search_queue(solving=True)
        except KeyboardInterrupt:
            self.interrupted = True
            self.residual = min(self.residual, self.current)
        finally:
            self._requeue_ready()
            self.prefetch.close()

    def _first_seeding(self) -> None:
        """The walks, the second heuristic pass when they end far from the queue's least bound, the seeding's first
        part (until it stalls on the fastest layout) and, with top > 1, the sibling pricing."""
        self._walk_fastest()
        near = self._round_robin()
        # Then the frames by estimate under the fastest configurations found (and walked when faster), those whose
        # bound is under the fastest so far: first until the seeding stalls for a short while (the layouts it finds
        # set the pruning line of the bounding pass, and a lower line prunes sooner), then, after the pass, for the
        # rest of its share unless a layout it finds closes the search.
        # The first part stalls on the fastest layout alone: with top > 1 the top-th keeps falling as siblings of
        # the fastest are priced, which the sibling pricing does at once (on the default job, top 5, it takes the
        # fifth layout from 22.1 to 18.66 s, under the line the pass's bounds close).
        self._seed_frames(POLICY.first_patience_near_s if near else POLICY.first_patience_s, None, 1)
        if self.top > 1:
            self._spread()

    def _walk_fastest(self) -> None:
        """The seeding's walks (search/incumbents.seed): the frames of the fastest layouts so far through their
        configurations, after the helper process has started (it bounds while they walk)."""
        # 2 x budget from the walks' start, not from the plan's: a first pass that ran long would cut the second
        # walk short (the walks of the three fastest shapes take seconds on the default job).
        self._keep(*seed(self.job, [], self.model, self.cluster, self.best_of,
                         _time.monotonic() + 2 * self.budget, stop=self._stopped, walked=self.walked,
                         configs=self.configs, gain=POLICY.seed_gain * self.gap).values())
        self._note_first_layout()
        self.prefetch.set_line(self._stop_line(self._kth()))

    def _round_robin(self) -> bool:
        """The second heuristic pass (incumbents.incumbents) over the frames not ranked yet, unless the fastest
        layout is within POLICY.round_robin_above of the queue's least bound: whether it was (`near`)."""
        # Frames whose persistent bytes leave room for activations (POLICY.roomy_share) first, then by estimate.
        roomy = POLICY.roomy_share
        ordered = visiting_order([((e.peak > roomy * self.caps[e.frame], self.estimates[e.frame]), e.frame)
                                  for e in self.queue])
        # Without a fitting heuristic layout the phase ends at POLICY.seed_max_share of the limit (at least `budget`
        # after the bounds), leaving CP-SAT the time to find a layout or prove there is none.
        deadline = max(_time.monotonic() + self.budget, self.t0 + POLICY.seed_max_share * self.time_limit)
        rest = [e for e in ordered if e[1] not in self.best_of]
        # Only without a layout at hand, or while the fastest is far above the queue's least bound: then the walks
        # have not met the pipeline shapes that lead, and this pass's round-robin over them does (at 8,192 and
        # 32,768 GPUs the walks end 90% above the least bound and this pass finds layouts 40% faster; on the
        # default job they end within 10% of it, and it finds none faster).
        lead = min((it.rank_time_s for it in self.best_of.values()), default=math.inf)  # inf: no layout at hand
        near = bool(self.queue) and lead <= (1 + POLICY.round_robin_above) * self.queue.top().bound
        if not near:
            self._keep(*incumbents(self.job, rest, self.model, self.cluster, self.top, self.budget, deadline,
                                   stop=self._stopped).values())
        return near

    def _seed_frames(self, patience_min: float | None, done: Callable[[list[PlanItem]], bool] | None,
                     stall_top: int) -> None:
        """The seeding (search/incumbents.seed) over the queue's frames by estimate, for the time it has left: it
        stalls on the top `stall_top` layouts after `patience_min` s, and stops once `done` holds for the layouts
        so far (fastest first); each frame's lower bound is its least in the queue (after the pass, tightened)."""
        start = _time.monotonic()
        # dict.fromkeys, not a set: the order of frames at equal estimates stays the queue's (a set's depends on
        # the hash seed).
        frames_left = sorted(dict.fromkeys(e.frame for e in self.queue), key=self.estimates.__getitem__)
        least: dict[Frame, float] = {}
        for e in self.queue:
            least[e.frame] = min(least.get(e.frame, math.inf), e.bound)
        self._keep(*seed(self.job, frames_left, self.model, self.cluster, self.best_of,
                         start + self.seed_left, stop=self._stopped, walked=self.walked, walk_first=False,
                         lower=lambda g: max(self.lbs[g][0], least.get(g, -math.inf)), top=stall_top,
                         gain=POLICY.seed_gain * self.gap, configs=self.configs,
                         done=partial(self._publish, done), patience_min=patience_min,
                         state=self.seed_state).values())
        self.seed_left -= _time.monotonic() - start
        self._note_first_layout()

    def _publish(self, done: Callable[[list[PlanItem]], bool] | None, fastest: list[PlanItem]) -> bool:
        """The seeding's stop test: the line of its layouts (fastest first) handed to the helper, then `done`."""
        self.prefetch.set_line(self._stop_line(fastest[self.top - 1] if len(fastest) >= self.top else None))
        return done is not None and done(fastest)

    def _proven(self, fastest: list[PlanItem]) -> bool:
        """Whether the queue's least bound already closes the search for these layouts (fastest first)."""
        if len(fastest) < self.top or not self.queue:
            return len(fastest) >= self.top
        e = self.queue.top()
        return _closed(min(e.bound, self.residual), e.peak, fastest[self.top - 1], self.gap)

    def _spread(self) -> None:
        """The fastest layouts' configurations and splits priced on their sibling shapes (incumbents.spread)."""
        self._keep(*spread(self.job, self.best_of, list(self.estimates), self.model, self.cluster,
                           min(_time.monotonic() + self.budget, self.deadline),
                           most=max(self.top, POLICY.spread_sources), stop=self._stopped).values())

    def _bounding_pass(self) -> None:
        """The queue's shapes and nodes bounded, no CP-SAT solve, for POLICY.bound_share of the limit."""
        # Without `top` layouts there is no line to bound against (and no proof to stop the seeding at): no pass,
        # the node models start at once.
        until = _time.monotonic() + (POLICY.bound_share * self.time_limit if self._kth() is not None else 0.0)
        self._search_queue(solving=False, until=until)

    def _second_seeding(self) -> None:
        """The seeding's second part, unless the queue's bounds already close the search, then the sibling
        pricing."""
        if self.seed_left > 0 and not self._proven(self._ranked()):
            self._seed_frames(POLICY.second_patience_s, self._proven, self.top)
        # The fastest layouts' configurations and splits priced on the shapes that differ from theirs in the FSDP
        # degrees and sharding policies only: their own seeding rarely reaches a split climbed on a sibling. Run
        # even when the bounds close the search: a sibling as fast and leaner ranks first (on the default job the
        # seeding's 18.631-s layout peaks at 138.5 GiB; the sibling pricing finds one as fast at 110.0 GiB).
        self._spread()
        if not self._proven(self._ranked()):
            self._climb_ranked()

    def _climb_ranked(self) -> None:
        """The ranked layouts' splits climbed once more (incumbents.split_climb, through sideways moves), fastest
        first, for POLICY.final_climb_s in all: the sibling pricing and the seeding's pricing by estimate bring
        layouts no climb has started from (K3 on 8 racks: a sibling's 21.211 s, which a climb through a sideways
        move takes to 21.072 s)."""
        until = min(self.deadline, _time.monotonic() + POLICY.final_climb_s)
        for it in self._ranked()[:self.top]:
            if _time.monotonic() >= until or self._stopped():
                break
            got = split_climb(self.job, it, self.model, self.cluster, until, stop=self._stopped,
                              min_gain=POLICY.seed_gain * self.gap, sideways=True)
            if _key(got.evaluation) < _key(it.evaluation):
                self._keep(got)

    def _search_queue(self, solving: bool, until: float = math.inf) -> None:
        """Entries taken off the queue and processed (`process`) until the queue's least entry is closed, the
        time limit passes or Ctrl-C comes, or (the bounding pass, `solving` False: no CP-SAT) `until`."""
        while self.queue:
            line = self._line_at_top()
            if line is None:
                break
            now = _time.monotonic()
            if not solving and now >= until:
                break
            entry, diving = self._pick(line, now)
            if self.process(entry, diving, line, solving) is _Outcome.STOPPED:
                break
            self._tick()

    def _line_at_top(self) -> _Line | None:
        """This step's pruning line, handed to the helper; None when the search stops here: the queue's least entry
        is closed against it, or the time limit has passed (`timed_out`), or Ctrl-C came (`interrupted`)."""
        least = self.queue.top()
        line = _Line.of(self._kth(), self.gap)
        if line.closed(least.bound, least.peak):
            return None
        self.prefetch.set_line(line.stop)
        if self.time_limit - (_time.monotonic() - self.t0) <= 0:
            self.timed_out = True
            return None
        if self.ctrl_c.flag:
            self.interrupted = True
            return None
        return line

    def _pick(self, line: _Line, now: float) -> tuple[_Entry, bool]:
        """The entry to work on, taken off the queue, and whether it is a dive (an out-of-order pick)."""
        if self.last_pick is not None:
            self.share[self.last_pick[0]] += now - self.last_pick[1]
        picked, diving = None, False
        if self.share[True] <= self.share[False]:
            # Half of the time (bounding and solving alike), the first step included, goes to the best v = 1 node:
            # its bound is an exact program over the split, so it is proven fast, while a v > 1 node's mean bound
            # keeps it first in the queue (and expanding interleaved shapes one by one could take the whole limit
            # before any solve); the other half follows the queue, which raises the proven bound. The order changes
            # which node is solved first, never the bound (the least over the queue). It dives: the shape expanded
            # last goes on to its best node, and that node is solved once tightened, even when tightening lifted it
            # above other nodes (its bound stays valid).
            picked = self.queue.least_of(self.dive, line.is_open) if self.dive is not None else None
            picked = picked or self.queue.least_one(line.is_open)
            diving = picked is not None
        elif self.queue.top().attempt > 0:
            # Queue order, first slices first: a node cut by its slice waits (with CP-SAT's bound) until every frame
            # and node under the gap line has had its bounds and one slice, the least bound first; an interleaved
            # node's CP-SAT bound often stalls, and its doubled slices would starve the rest.
            picked = self.queue.least_fresh(line.is_open)
        self.last_pick = (diving, now)
        picked = picked or self.queue.top()
        self.queue.take(picked)
        return picked, diving

    def process(self, e: _Entry, diving: bool, line: _Line, solving: bool) -> _Outcome:
        """One step on entry e, taken off the queue: pruned against its frame's layout, or a shape's bounds
        (`_process_shape`), or a node's bounds and solve (`_process_node`)."""
        self.current = e.bound
        # A node is pruned against the frame its layouts are filed under (an overlapped frame's full-recompute node
        # finds its twin's).
        mine = self.best_of.get(e.frame if e.recompute is None else node_frame(e.frame, e.recompute))
        if mine is not None and (e.bound > mine.rank_time_s or (
                self.gap > 0 and within_gap(mine.rank_time_s, e.bound, self.gap))):
            self.residual = min(self.residual, e.bound)
            self.current = math.inf
            return _Outcome.PRUNED  # it cannot improve its frame (beyond the gap), and the frame is already ranked
        if e.recompute is None:
            return self._process_shape(e, diving, line)
        return self._process_node(e, diving, line, solving, mine)

    def _process_shape(self, e: _Entry, diving: bool, line: _Line) -> _Outcome:
        """A shape: its sharding group's bound (interleaved shapes), then its own over whole layers
        (bounds.frame_dp_bound), each sending it back when above its bound; then its nodes replace it."""
        f = e.frame
        if f.vp > 1 and f not in self.frame_tightened:
            # First one program over the shape's FSDP *and* sharding-policy variants: where activations bind (K3 at
            # 16K context) it settles several sharding groups at once; where it stays under the shape's bound, the
            # sharding group's own program follows.
            pb = self._policy_group_bound(f, line)
            if pb > e.bound + 1e-12:
                return self._requeue(e, pb)
        if f.vp > 1 and f not in self.frame_tightened:
            # The shape's FSDP variants first, as for nodes below (bounds.group_frame_bound).
            gb = self._group_frame_bound(f, e.bound, line)
            if gb > e.bound + 1e-12:
                return self._requeue(e, gb)
        if f not in self.frame_tightened:
            self.frame_tightened.add(f)
            ahead = self.prefetch.take(("dp", f))
            ft, fm_ = ahead if ahead is not None else frame_dp_bound(self.job, f, self.model, self.cluster,
                                                                     stop_at=line.stop)
            if ft > e.bound + 1e-12 or fm_ > e.peak:
                fits = math.isfinite(ft) and fm_ <= self.caps[f]
                outcome = self._requeue(e, max(ft, e.bound) if fits else math.inf, max(fm_, e.peak))
                self.dive = f if diving else self.dive
                return outcome
        ahead = self.prefetch.take(("nodes", f))
        nodes = ahead if ahead is not None else _node_bounds(self.job, f, self.recs, self.lcs, self.model,
                                                             self.cluster)
        for (rc, lc), (nt, nm) in zip(itertools.product(self.recs, self.lcs), nodes, strict=True):
            if nm <= self.caps[f]:
                self._push(max(nt, e.bound), max(nm, e.peak), f, rc, lc)
        self.current = math.inf
        self.dive = f if diving else self.dive
        return _Outcome.EXPANDED

    def _policy_group_bound(self, f: Frame, line: _Line) -> float:
        """bounds.group_frame_bound over f's `policy_group` (-inf when it holds one sharding group only: that
        group's own program is the same and tighter)."""
        key = ("policy", policy_group(f))
        if key not in self.group_bounds:
            mem = self.policy_members.get(key[1], [])
            several = len({sharding_group(g) for g in mem}) > 1
            self.group_bounds[key] = group_frame_bound(
                self.job, tuple(mem), self.model, self.cluster, stop_at=line.stop, deadline=self.deadline
            ) if several else -math.inf
        return self.group_bounds[key]

    def _group_frame_bound(self, f: Frame, t_lb: float, line: _Line) -> float:
        """The bound of f's sharding group (bounds.group_frame_bound over its interleaved members; -inf for a
        member alone), lifted by the group's node programs once it is under f's bound and the line is finite."""
        group = sharding_group(f)
        mem = self.members_of.get(group, [])
        if group not in self.group_bounds:
            ahead = self.prefetch.take(("frame", group)) if len(mem) > 1 else None
            per_node: dict = {}
            if ahead is not None:
                self.group_bounds[group], per_node = ahead
            elif len(mem) > 1:
                self.group_bounds[group] = group_frame_bound(self.job, tuple(mem), self.model, self.cluster,
                                                             stop_at=line.stop, deadline=self.deadline,
                                                             per_node=per_node)
            else:
                self.group_bounds[group] = -math.inf
            self.unlifted[group] = per_node
        gb = self.group_bounds[group]
        if gb <= t_lb + 1e-12 and group in self.unlifted and math.isfinite(line.stop):
            gb = self._lift_group(group, mem, gb, line)
        return gb

    def _lift_group(self, group: tuple, mem: list[Frame], gb: float, line: _Line) -> float:
        """Under the line: the group's nodes by their group programs before any member's own bounds
        (bounds.lift_group_bound); each member's node, popped later, takes the programs' values."""
        ahead = self.prefetch.take(("lift", group))
        value, lifted = ahead if ahead is not None else lift_group_bound(
            self.job, tuple(mem), self.unlifted.pop(group), self.model, self.cluster, stop_at=line.stop,
            deadline=self.deadline)
        self.unlifted.pop(group, None)
        for (rc, lc), v in lifted.items():
            self.group_bounds.setdefault((group, rc, lc), v)
        self.group_bounds[group] = gb = max(gb, value)
        return gb

    def _process_node(self, e: _Entry, diving: bool, line: _Line, solving: bool, mine: PlanItem | None
                      ) -> _Outcome:
        """A node: its group's bound (interleaved shapes), then its own relaxation (bounds.tight_node_bound), each
        sending it back when above its bound (a dive goes on with a tightened bound under the line); then CP-SAT,
        or in the bounding pass the wait for it."""
        f, rc, lc = e.frame, e.recompute, e.lifecycle
        if f.vp > 1 and (f, rc, lc) not in self.tightened:
            gb = self._group_node_bound(f, rc, lc, line)
            if gb > e.bound + 1e-12:
                return self._requeue(e, gb)
        if _time.monotonic() - self.t0 > self.time_limit:
            # The limit passed during the group's program (seconds at 8,192 GPUs): the node goes back with its bound,
            # not on to its own relaxation, which would run the plan past the limit.
            self._push(e.bound, e.peak, f, rc, lc, e.attempt, e.exact)
            self.current = math.inf
            self.timed_out = True
            return _Outcome.STOPPED
        t_lb = e.bound
        if (f, rc, lc) not in self.tightened:
            self.tightened.add((f, rc, lc))
            # Past the pruning line the exact value is not needed: the node only has to be shown above it.
            tight = tight_node_bound(self.job, f, rc, lc, self.model, self.cluster, stop_at=line.stop,
                                     deadline=self.deadline)
            if tight > t_lb + 1e-12:
                if not (diving and math.isfinite(tight) and not line.closed(tight, e.peak)):
                    return self._requeue(e, tight)
                t_lb = self.current = tight  # the dive solves it now, with its tightened bound
        if not solving:
            # The bounding pass solves nothing: the node waits, with its tightened bound, for the seeding.
            self.ready.append(_Entry(t_lb, e.peak, next(self.seq), f, rc, lc, e.attempt, e.exact))
            self.current = math.inf
            self.dive = None
            return _Outcome.WAITING
        return self._solve(e, t_lb, mine)

    def _group_node_bound(self, f: Frame, rc: Recompute, lc: FsdpLifecycle, line: _Line) -> float:
        """One program for the node of every FSDP variant of the shape (bounds.group_node_bound; -inf for a member
        alone): they sit at near-equal bounds, and one program over the least of their arrays often shows them all
        above the line. Each member popped below the group's bound goes back with it, unsolved."""
        group = sharding_group(f)
        if (group, rc, lc) not in self.group_bounds:
            mem = self.members_of.get(group, [])
            ahead = self.prefetch.take(("node", group, rc, lc)) if len(mem) > 1 else None
            self.group_bounds[(group, rc, lc)] = ahead if ahead is not None else (
                group_node_bound(self.job, tuple(mem), rc, lc, self.model, self.cluster, stop_at=line.stop,
                                 deadline=self.deadline) if len(mem) > 1 else -math.inf)
        return self.group_bounds[(group, rc, lc)]

    def _solve(self, e: _Entry, t_lb: float, mine: PlanItem | None) -> _Outcome:
        """The node's CP-SAT model for a slice (base_slice x 2^attempt), hinted on its first slice with a heuristic
        layout of the node (a candidate under the top-th layout that misses the memory line repaired first,
        incumbents.fit_repair); its layout (rebalanced, `_rebalanced`) replaces its frame's when better."""
        f, rc, lc = e.frame, e.recompute, e.lifecycle
        # The helper bounds on until the first CP-SAT solve, which takes both cores (the values it has computed
        # stay): at 8,192 GPUs the bounding after the seeding solves nothing.
        self.prefetch.close()
        k = self._kth()
        hint = frame_incumbent(self.job, f, self.model, self.cluster, recompute=rc, lifecycle=lc,
                               deadline=self.deadline, repair_below=k.rank_time_s if k is not None else math.inf,
                               floor=t_lb) if e.attempt == 0 else None
        if hint is not None and (mine is None or _key(hint.evaluation) < _key(mine.evaluation)):
            self._keep(hint)
            mine = hint
        remaining = self.time_limit - (_time.monotonic() - self.t0)
        res, item = solve_frame(self.job, f, self.model, self.cluster,
                                min(remaining, self.base_slice * 2 ** e.attempt), self.workers,
                                recompute=rc, lifecycle=lc, relative_gap=0.0 if e.exact else self.gap,
                                hint=(hint or mine).layout if (hint or mine) is not None else None,
                                deadline=self.deadline)
        self.solved += 1
        self.dive = None
        if item is not None and res.shape is not None:
            item = _rebalanced(self.job, f, res.shape, item, self.model, self.cluster,
                               min(self.deadline, _time.monotonic() + POLICY.climb_min_s))
        self.size = {"variables": max(self.size.get("variables", 0), res.variables),
                     "constraints": max(self.size.get("constraints", 0), res.constraints)}
        if item is not None:
            self._keep(item)  # kept where faster than its frame's layout
        self._note_first_layout()
        return self._after_slice(e, max(t_lb, res.bound_step_s), res.status, item)

    def _after_slice(self, e: _Entry, node_bound: float, status: str, item: PlanItem | None) -> _Outcome:
        """What a slice's status does to the node of bound `node_bound`: Ctrl-C stops the search; a slice that found
        nothing has the node's contiguous whole-layer fit tested (until the test decides); a cut node goes back for a
        doubled slice."""
        f, rc, lc = e.frame, e.recompute, e.lifecycle
        if self.ctrl_c.flag:
            self.interrupted = True
            self.residual = min(self.residual, node_bound)
            return _Outcome.STOPPED
        if status == "UNKNOWN" and f.vp > 1 and (f, rc, lc) not in self.contiguity_checked:
            # No layout found in its slice: whole layers in contiguous chunks may not fit at all, which the
            # relaxation (fractional, not contiguous) cannot see and CP-SAT's bound can take minutes to show
            # (lp_bound.contiguous_fits), for at most its next slice. A check its time cut (undecided) is made
            # again after the node's next empty slice, with that slice's doubled time, as the slices are.
            left = self.time_limit - (_time.monotonic() - self.t0)
            fits = contiguous_fits(self.job, f, rc, lc, self.model, self.cluster,
                                   min(left, self.base_slice * 2 ** (e.attempt + 1))) if left > 0 else None
            if fits is not None:
                self.contiguity_checked.add((f, rc, lc))
            if fits is False:
                self.current = math.inf
                return _Outcome.INFEASIBLE
        if status in ("FEASIBLE", "UNKNOWN"):
            # Cut by its slice: back to the queue with CP-SAT's bound and twice the time.
            self._push(node_bound, e.peak, f, rc, lc, e.attempt + 1, e.exact)
        elif status == "OPTIMAL" and item is not None and node_bound < item.rank_time_s:
            k = self._kth()
            if not e.exact and k is not None and not _closed(node_bound, e.peak, k, self.gap):
                # Proven to the gap against its own model's objective, which prices its layout under its ranked
                # (replayed) time: CP-SAT stopped with a bound under the plan's line, and the node would hold the
                # plan's bound there for good. Back to the queue, to be solved to optimality.
                self._push(node_bound, e.peak, f, rc, lc, e.attempt + 1, exact=True)
            else:
                self.residual = min(self.residual, node_bound)  # proven to the relative gap only
                self.solved_under.append(replace(e, bound=node_bound))
        self.current = math.inf
        return _Outcome.SOLVED

    # -- the plan

    def finish(self) -> Plan:
        """The Plan: the ranked layouts with the front's, the proven bound (the least left in the queue, or left
        behind) and gap, the status, and what a FEASIBLE plan leaves open."""
        if self.ctrl_c.flag:
            self.interrupted = True
        bound = self._open_bound()
        ranked = self._ranked()
        if not ranked:
            self._raise_nothing_found(bound)
        front, complete = self._front(ranked, bound)
        if len(self.job.gpu_counts) == 1:
            front = _with_ranked_bound(front, bound)
        ranked = _with_front(ranked, front)
        top_items = ranked[:self.top]
        best_t = top_items[0].rank_time_s
        bound = min(bound, best_t)
        proven_gap = (best_t - bound) / best_t if best_t else 0.0
        status = self._status(ranked, bound, proven_gap)
        open_shapes, holding = (0, None) if status == "OPTIMAL" else _open_bounds(
            [*self.queue, *self.solved_under], ranked[self.top - 1] if len(ranked) >= self.top else None, self.gap,
            self.frame_tightened, self.tightened, frozenset(e.seq for e in self.solved_under))
        self._tick("done")
        return Plan(job=self.job, status=status, layouts=top_items, pareto=front, bound=bound, gap=proven_gap,
                    frames_total=len(self.frames), frames_solved=self.solved,
                    solve_time_s=_time.monotonic() - self.t0, model_size=self.size, pareto_complete=complete,
                    first_layout_s=self.first_layout_s, open_shapes=open_shapes, holding=holding,
                    placements=self._placements(top_items[0].layout.gpus))

    def _placements(self, gpus: int) -> list[PlacementOption]:
        """Each GPUs-per-domain choice at `gpus` GPUs: the best layout found under it and its shapes' least first
        bound (0 for a shape never bounded; a shape over the HBM line has no layout), best first."""
        best: dict[int | None, float] = {}
        bound: dict[int | None, float] = {}
        for f in self.frames:
            if f.gpus != gpus:
                continue
            u = f.domain_gpus_used
            b = math.inf if f in self.over_line else self.lbs.get(f, (0.0, 0.0))[0]
            bound[u] = min(bound.get(u, math.inf), b)
            if f in self.best_of:
                best[u] = min(best.get(u, math.inf), self.best_of[f].rank_time_s)
        d = self.cluster.nvlink_domain_gpus
        opts = [PlacementOption(gpus, u, domains_held(gpus, u, d), best.get(u), bound[u]) for u in bound]
        return sorted(opts, key=lambda o: (o.best_s is None, o.best_s or math.inf, o.bound_s))

    def _raise_nothing_found(self, bound: float) -> NoReturn:
        """No layout at all: KeyboardInterrupt after Ctrl-C; else InfeasibleJobError, with the time limit when the
        search did not finish, or with why nothing fits (`_infeasible_reason`) when it proved it."""
        if self.interrupted and not self.timed_out:
            raise KeyboardInterrupt
        if self.timed_out or math.isfinite(bound):
            raise SearchTimeoutError(
                f"no layout found within the {self.time_limit:g} s time limit ({self.solved} candidate shapes "
                "solved); raise --time-limit")
        raise InfeasibleJobError(_infeasible_reason(self.job, self.model, self.cluster, self.min_peak_lb[1],
                                                    self.min_peak_lb[0]))

    def _front(self, ranked: list[PlanItem], bound: float) -> tuple[list[PlanItem], bool]:
        """The Pareto front (search/front.py) and whether it is complete; after Ctrl-C, the best layout alone.
        `bound`: the ranked search's, a bound on every layout of every GPU count (the front's first region)."""
        if self.pareto and not self.ctrl_c.flag and (self.unbounded or not self.interrupted):
            self._tick("front")
            return build_front(self.job, self.model, self.cluster, self.best_of, ranked, self.pareto_step_gib,
                               self.t0, self.total_limit, self.workers, lower_bounds=self.lbs,
                               over_line=self.over_line | self.refused, estimates=self.estimates,
                               on_progress=self._front_tick,
                               regions=self._region, ranked_bound=bound, gap=self.gap)
        return (ranked[:1] if self.interrupted else [], False)

    def _region(self, gpus: int, cap: float, known: list[PlanItem], points: int) -> Region | None:
        """One region of the front (search/front.py): a ranked search (top 1) of `gpus` GPUs whose every rank's
        peak is at most `cap` bytes (inf: the job's own budget), by the front's deadline, started from the points
        `known` (the front's at these GPUs) under the cap, and from the leanest and the fastest over it brought under
        it (incumbents.cap_descent; `points`: the front's size, for the progress). Returns its best layouts, its bound
        (inf when it proved that nothing fits), whether it is proven to the gap and, when not, the bound that holds
        it (Plan.holding); None after Ctrl-C."""
        update: dict = {"gpus": gpus}
        own = peak_cap_bytes(self.job)
        if math.isfinite(cap):
            update["search"] = self.job.search.model_copy(
                update={"max_peak_gib": (cap if own is None else min(own, cap)) / GIB})
        job = self.job.model_copy(update=update)

        region = "every peak" if not math.isfinite(cap) else f"peak <= {cap / GIB:.2f} GiB"

        def forward(p: Progress) -> None:
            if self.ticker.due():
                self.ticker.send(lambda elapsed: replace(p, phase="front", elapsed_s=elapsed, front_points=points,
                                                         front_region=region))

        # Each region has at most its share of the limit, so that one hard region leaves time to the others; its
        # budgets (seeding, slices) scale with it as a plan's do.
        left = min(self.t0 + self.total_limit - _time.monotonic(), POLICY.front_region_share * self.total_limit)
        sub = _Search(job, self.model, self.cluster, top=1, time_limit=left, workers=self.workers, pareto=False,
                      pareto_step_gib=self.pareto_step_gib, progress=forward if self.ticker.fn else None,
                      gap=self.gap, refuse=self.refuse)
        # The front's points under the cap are its first incumbents, and points over it brought under it (the
        # region's fastest layout is often a faster point with a layer moved or a toggle flipped): the seeding need
        # not find them again. The leanest over the cap has the fewest bytes to shed; the fastest is the other start
        # (K3 PP8 VP4 under 108.96 GiB: 18.624 s at 108.72 GiB from the 18.631-s point at 109.96, where the leaner
        # points between them descend to 18.71 s and slower).
        for it in descent_starts([it for it in known if not fits(job, it.evaluation)], POLICY.region_descents):
            got = cap_descent(job, it, self.model, self.cluster, _time.monotonic() + POLICY.region_descent_s,
                              stop=sub._flag)
            known = known + ([got] if got is not None else [])
        for it in known:
            f = frame_of(it.layout)
            if fits(job, it.evaluation) and (f not in sub.best_of or _key(it.evaluation) < _key(
                    sub.best_of[f].evaluation)):
                sub.best_of[f] = it
        sub.execute()
        if sub.ctrl_c.flag:
            return None
        try:
            res = sub.finish()
        except InfeasibleJobError:
            proved = not (sub.timed_out or sub.interrupted) and math.isinf(sub._open_bound())
            return [], (math.inf if proved else 0.0), proved, None if proved else "no layout found under the cap"
        h = res.holding
        held = None if h is None else f"the {h.kind} of {h.shape} at {h.bound_s:.3f} s"
        return res.layouts, res.bound, res.status == "OPTIMAL", held

    def _front_tick(self, points: int, settled: int, total: int) -> None:
        """The front's progress: its points, and its frames settled (dominated or solved) out of those to prove."""
        if self.ticker.due():
            self.ticker.send(partial(self._snapshot, front_points=points, front_settled=(settled, total)))

    def _status(self, ranked: list[PlanItem], bound: float, proven_gap: float) -> str:
        """OPTIMAL when the search ended on its own with the bound within the gap of the top-th layout, or every
        queue entry closed against it, and the proven gap of the best within the gap; else FEASIBLE. A node left
        behind (the residual, under the bound) was left because it cannot improve its own frame's ranked layout
        beyond the gap, so it cannot displace the top-th beyond the gap either."""
        k_item = ranked[min(self.top, len(ranked)) - 1]
        k = k_item.rank_time_s
        # gap > 0: bounds within LINE_ROUNDING under the line count as at it (within_gap), so the proven gap may
        # exceed `gap` by as much: 1 - (1 - gap)(1 - LINE_ROUNDING) <= gap + LINE_ROUNDING.
        tol = LINE_ROUNDING if self.gap > 0 else 0.0
        closed = not self.queue or (len(ranked) >= self.top and _closed(self.queue.top().bound,
                                                                         self.queue.top().peak, k_item, self.gap))
        done = not (self.timed_out or self.interrupted) and (within_gap(k, bound, self.gap) or closed)
        return "OPTIMAL" if done and proven_gap <= self.gap + tol + 1e-12 else "FEASIBLE"


def descent_starts(above: list[PlanItem], n: int) -> list[PlanItem]:
    """The points over a region's cap its search first brings under it (at most n): the leanest (the fewest bytes to
    shed), then the fastest of the others."""
    lean = sorted(above, key=lambda it: it.peak_bytes)
    first = lean[:min(1, n)]
    return first + sorted(lean[len(first):], key=lambda it: it.rank_time_s)[:max(n - len(first), 0)]


def _frames(job: Job, model: ModelSpec, cluster: ClusterSpec) -> list[Frame]:
    """Every frame of the job's GPU counts; InfeasibleJobError when its rules leave none."""
    frames = [f for g in job.gpu_counts for f in enumerate_frames(job, model, g, cluster)]
    if not frames and job.search.param_gather and ParamGather.UPDATE not in job.search.param_gather:
        kept = job.model_copy(update={"search": job.search.model_copy(update={"param_gather": None})})
        # The degrees and tokens allow shapes, but the per-layer gather alone found no group to gather.
        if any(enumerate_frames(kept, model, g, cluster) for g in job.gpu_counts):
            raise InfeasibleJobError(
                "param_gather = [\"layer\"] leaves no shape: no optim_grads_params group of more than one rank "
                "holds parameters (a dense model has no expert group); add optim_grads_params to [search] "
                "dense_sharding or allow \"update\"")
    if not frames:
        blocking = blocking_lists(job, model, cluster)
        if blocking:
            named = " or ".join(f"[search] {k} = {v} ({SHAPE_LIST_RULES[k]})" for k, v in blocking)
            raise InfeasibleJobError(
                f"no parallel shape satisfies the job's rules on {job.gpus} GPUs: {named} alone excludes every "
                "shape the other rules allow; widen or drop it")
        raise InfeasibleJobError(
            f"no parallel shape satisfies the job's rules (gpus {job.gpus}, tokens_per_update "
            f"{job.tokens_per_update}, rows x context {job.rows} x {job.context}); make tokens_per_update a "
            "multiple of DP x rows x context for some PP, or give [search] microbatches"
        )
    return frames


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


def _open_bounds(entries: Iterable[_Entry], k: PlanItem | None, gap: float, frame_tightened: set[Frame],
                 tightened: set, solved: frozenset[int] = frozenset()) -> tuple[int, OpenBound | None]:
    """(How many parallel shapes have an entry that does not close the search against the top-th layout k, the
    least such entry described): what a FEASIBLE plan leaves open. `entries`: the queue's, and the nodes solved
    whose bound stays under the line (their seqs in `solved`)."""
    open_entries = [e for e in entries if not _closed(e.bound, e.peak, k, gap)]
    if not open_entries:
        return 0, None
    least = min(open_entries)
    t_lb, f, rc, lc, attempt = least.bound, least.frame, least.recompute, least.lifecycle, least.attempt
    if rc is None:
        kind = ("shape bound over whole layers per rank (its recompute x lifecycle nodes not bounded yet)"
                if f in frame_tightened else "shape bound (not tightened to the shape's own layers yet)")
    elif least.seq in solved:
        kind = (f"{rc.value} / {lc.value} node: solved {'to optimality' if least.exact else 'to the gap'} by CP-SAT, "
                "its model's bound under the line")
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
    return f"{degrees_text(f)} {sharding_text(f)} {f.precision.value} on {f.gpus} GPUs"


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
    programs = _PassPrograms(job, model, cluster, recs, lcs, lbs, caps, deadline)
    groups = sorted(((g, tuple(m)) for g, m in members_of.items() if len(m) > 1),
                    key=lambda gm: min(lbs[f][0] for f in gm[1]))
    # The members of an interleaved group wait for every group program: one group program lifts tens of members at
    # once, and while the line is still the first heuristic layout's (twice the optimum at 8,192 GPUs) no member's
    # own program would stop early. At 8,192 GPUs, in frame-bound order, the helper spent most of its time on the
    # members' own programs and bounded few of the 93 groups under the final line.
    grouped = {f for _, mem in groups if mem[0].vp > 1 for f in mem}
    first: list[tuple[int, float, int, tuple, Callable[[float], object]]] = []
    for i, (group, mem) in enumerate(groups):
        first.append((0, min(lbs[f][0] for f in mem), i, ("frame", group),
                      partial(programs.group, group=group, mem=mem)))
    for i, (group, mem) in enumerate(groups):
        first.append((1, min(lbs[f][0] for f in mem), i, ("lift", group),
                      partial(programs.lift, group=group, mem=mem)))
    for i, f in enumerate(frames):
        tier = 2 * int(f in grouped)
        first.append((tier, lbs[f][0], len(groups) + 2 * i, ("dp", f), partial(programs.dp, f=f)))
        first.append((tier, lbs[f][0], len(groups) + 2 * i + 1, ("nodes", f), partial(programs.nodes, f=f)))
    first.sort(key=lambda x: x[:3])
    tasks = [(key, program) for _, _, _, key, program in first]
    for group, mem in groups:
        for rc in recs:
            for lc in lcs:
                tasks.append((("node", group, rc, lc), partial(programs.node, group=group, mem=mem, rc=rc, lc=lc)))
    return tasks


def _under(line: float, t: float) -> bool:
    """Whether bound t is under the pruning line (LINE_ROUNDING under it counts as at it)."""
    return t < line * (1 - LINE_ROUNDING)


class _PassPrograms:
    """The bounding pass's programs (`_pass_tasks`), each given the current pruning line: a program returns its
    bound, or None when the line already shows it needless. The values one program computes are read by the later
    ones run in the same process (the helper, or the driver while it waits for the helper)."""

    def __init__(self, job: Job, model: ModelSpec, cluster: ClusterSpec, recs: list[Recompute],
                 lcs: list[FsdpLifecycle], lbs: dict[Frame, tuple[float, float]], caps: _Caps,
                 deadline: float) -> None:
        self.job, self.model, self.cluster = job, model, cluster
        self.recs, self.lcs, self.lbs, self.caps, self.deadline = recs, lcs, lbs, caps, deadline
        self.frame_value: dict[tuple, float] = {}
        """Per group, its frame bound (bounds.group_frame_bound, lifted by bounds.lift_group_bound)."""
        self.node_bounds: dict[tuple, dict[tuple[Recompute, FsdpLifecycle], float]] = {}
        """Per group, its nodes' own bounds from its group program (bounds.group_frame_bound's `per_node`)."""
        self.node_value: dict[tuple, float] = {}
        """The group node programs the lift programs ran (bounds.lift_group_bound)."""
        self.dp_value: dict[Frame, float] = {}

    def group(self, line: float, group: tuple, mem: tuple[Frame, ...]
              ) -> tuple[float, dict[tuple[Recompute, FsdpLifecycle], float]] | None:
        """The group's frame bound and its nodes' own bounds (bounds.group_frame_bound)."""
        if not any(_under(line, self.lbs[f][0]) for f in mem):
            return None
        per_node: dict[tuple[Recompute, FsdpLifecycle], float] = {}
        self.frame_value[group] = group_frame_bound(self.job, mem, self.model, self.cluster, stop_at=line,
                                                    deadline=self.deadline, per_node=per_node)
        self.node_bounds[group] = per_node
        return self.frame_value[group], dict(per_node)

    def lift(self, line: float, group: tuple, mem: tuple[Frame, ...]
             ) -> tuple[float, dict[tuple[Recompute, FsdpLifecycle], float]] | None:
        """The group's frame bound lifted by its node programs, and their values (bounds.lift_group_bound)."""
        if not math.isfinite(line):
            return None
        if group not in self.node_bounds and self.group(line, group, mem) is None:
            return None  # (the driver took the group's program before this process reached it)
        if not _under(line, self.frame_value[group]):
            return None
        value, lifted = lift_group_bound(self.job, mem, self.node_bounds[group], self.model, self.cluster,
                                         stop_at=line, deadline=self.deadline)
        self.frame_value[group] = max(self.frame_value[group], value)
        self.node_value.update({(group, *node): v for node, v in lifted.items()})
        return value, lifted

    def dp(self, line: float, f: Frame) -> tuple[float, float] | None:
        """The frame's own bound over whole layers (bounds.frame_dp_bound)."""
        if not _under(line, max(self.lbs[f][0], self.frame_value.get(sharding_group(f), -math.inf))):
            return None
        t, m = frame_dp_bound(self.job, f, self.model, self.cluster, stop_at=line)
        self.dp_value[f] = t
        return t, m

    def node(self, line: float, group: tuple, mem: tuple[Frame, ...], rc: Recompute, lc: FsdpLifecycle
             ) -> float | None:
        """The group's bound of node (rc, lc) (bounds.group_node_bound), or its lift program's value."""
        if not _under(line, self.frame_value.get(group, -math.inf)):
            return None
        if (group, rc, lc) in self.node_value:
            return self.node_value[(group, rc, lc)]
        nodes = [node_lower_bound(self.job, f, rc, lc, self.model, self.cluster) for f in mem]
        if not any(_under(line, max(nt, self.dp_value.get(f, -math.inf))) and nm <= self.caps[f]
                   for (nt, nm), f in zip(nodes, mem, strict=True)):
            return None
        return group_node_bound(self.job, mem, rc, lc, self.model, self.cluster, stop_at=line,
                                deadline=self.deadline)

    def nodes(self, line: float, f: Frame) -> list[tuple[float, float]] | None:
        """The frame's node bounds (`_node_bounds`)."""
        if not _under(line, max(self.lbs[f][0], self.dp_value.get(f, -math.inf))):
            return None
        return _node_bounds(self.job, f, self.recs, self.lcs, self.model, self.cluster)


def _closed(t: float, m: float, k: PlanItem | None, gap: float) -> bool:
    """Whether a node of bounds (t s, m bytes) cannot displace the top-th layout k: at or above k's step time less
    the relative gap (LINE_ROUNDING under it counts as at it), or with gap 0 slower, or as fast and no leaner."""
    return k is not None and (within_gap(k.rank_time_s, t, gap) if gap > 0 else
                              (t > k.rank_time_s or (t == k.rank_time_s and m >= k.peak_bytes)))


def _with_ranked_bound(front: list[PlanItem], bound: float) -> list[PlanItem]:
    """Each front point's bound at least the ranked search's: with one GPU count that bound holds for every layout
    (the ranked step time is the front's), so also for those at a point's peak or less."""
    return [p if p.front_bound_s is None else
            replace(p, front_bound_s=min(p.rank_time_s, max(p.front_bound_s, bound))) for p in front]


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
    exact: bool = field(default=False, compare=False)
    """Solve the node's model to optimality rather than to the plan's relative gap (`_Search._after_slice`)."""


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


def _rebalanced(job: Job, f: Frame, shape: Shape, item: PlanItem, model: ModelSpec, cluster: ClusterSpec,
                deadline: float) -> PlanItem:
    """The node's layout, or a better one of the same configuration: when its replayed schedule ranks it above the
    step formula the node model minimized (uneven interleaved chunks), the heuristic splits of that configuration
    (search/incumbents.candidate_splits: work-balanced, memory-balanced, even) are priced with evaluate() too, and
    the best of them, if it still ranks by its replay, has its split climbed (incumbents.split_climb, whose moves
    within a rank change the replay alone) until the monotonic `deadline`."""
    if not item.ranks_by_replay:
        return item
    best = item
    for split in candidate_splits(ranked_coefficients(shape, model, cluster),
                                  allocated_capacity_bytes(job, f, model, cluster), chunk_least(job, f)):
        ev = evaluate(layout_of(job, f, shape, split), model=model, cluster=cluster)
        if fits(job, ev) and _key(ev) < _key(best.evaluation):
            best = PlanItem(ev.layout, ev)
    if best.ranks_by_replay:
        best = split_climb(job, best, model, cluster, deadline)
    return best


def _head_key(f: Frame) -> tuple:
    """The first pass's head of f: its pipeline shape, context parallelism, precision and gradient dtype (the
    choices that set a shape's speed beside its degrees). CP has heads of its own because a head's peak bound
    counts no activations: at 32K context every CP1 head bounds under the HBM line and fits nothing, so with one
    head per (PP, VP) the pass would find no layout there and the first would wait for the round-robin pass."""
    return f.pp, f.vp, f.cp, f.precision, f.grad_dtype


def _most_sharded_first(frames: list[Frame]) -> list[Frame]:
    """Frames by descending expert x dense FSDP degree (stable otherwise). The peak bound of `frame_lower_bound`
    (the mean of master, optimizer, BF16 view and gradient bytes) only shrinks as either degree grows by a
    multiple (each state is divided by its shard count; tests/search/test_search.py checks it over every frame of the
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
    state = layer_bytes(cf, ("master", "grads", "optimizer")).sum() * (f.gpus // f.pp)
    state_text = f"{state / 2**40:,.2f} TiB" if state >= 2**40 else f"{state / GIB:,.1f} GiB"
    gpus = ", ".join(str(g) for g in job.gpu_counts)
    shape = (f"PP{f.pp} EP{f.ep} expert-FSDP{f.expert_fsdp} dense-FSDP{f.dense_fsdp}: "
             + ", ".join(f"{k} {v / GIB:,.1f}" for k, v in top) + " GiB per GPU")
    peak_cap = peak_cap_bytes(job)
    if peak_cap is not None and cap >= peak_cap:
        # The job's own cap is the budget that binds: raising it is the first fix.
        why = (f"the smallest worst-rank peak any layout can reach is at least {lb / GIB:,.1f} GiB (best shape "
               f"{shape})" if lb > cap else "every shape searched was proven over it once its activations, working "
               "sets and buffers are counted")
        return (f"no layout fits on {gpus} {cluster.name} GPUs under [search] max_peak_gib = "
                f"{job.search.max_peak_gib:g}: {why}; raise max_peak_gib or drop it")
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
