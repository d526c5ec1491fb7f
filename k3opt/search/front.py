"""The Pareto front over (ranked step time, worst-rank peak), and over GPU count when a job lists several
(tokens/s per GPU, GPUs, peak); the step time is the ranked one (achievable when the cluster has rates,
search/ranking.py), the peak the ledger's worst-rank peak (`Evaluation.peak_bytes`, the live tensors the search
caps per rank).

Anytime, within the time limit (plan() gives the ranked search POLICY.front_ranked_share of it first):

1. Seed (POLICY.front_seed_share of the front's time at most; it stops once it has gone as long without changing
   the front as its last change took, POLICY.front_patience_s at least): frames are visited round-robin over
   (PP, VP) groups, each group by the driver's estimate (`_Visits`), the ranked search's frames first and the
   frames next to one that adds to the front queued too (`Neighbours`); frames whose bounds a point found
   dominates are skipped. Each is
   priced by `evaluate()` under the configurations (recompute mode, FSDP lifecycle, toggles) of the front so far
   on every heuristic split of search/incumbents.py (`price_configs`; the first frame under every heuristic
   family of search/incumbents.toggle_sets too). A frame that adds to the front is walked through its own
   configurations (`frame_walk`, POLICY.front_walk_share of the seeding time in all): each step takes the change
   that buys the most time per byte, so the walk finds the fast configurations the other frames are then priced
   under. After the ranked search's frames, the gap filling (`_Fill`, POLICY.front_fill_share of the time while
   frames are left to visit) takes turns with the visits: the point beside the widest peak gap of the front so
   far has its configuration priced on the frames one change from its frame (another sharding policy, FSDP
   degree, VP, PP...), then its frame under its configuration one change away, towards the gap first. A point
   the ranked search returns is often dominated by its own layout one sharding change away (the same step, tens
   of GiB leaner), which the visits reach late. Every fitting layout priced is a candidate point.
2. Prove, region by region: the region of a point is every layout whose peak is at most the next faster point's
   peak less the step (every layout for the fastest), and under the leanest point the region that should be
   empty. The first region whose bound does not close its point to the search's gap (or, below the leanest, that
   is not shown empty) gets the ranked search itself (search/driver.py) under the region's cap, `[search]
   max_peak_gib`, started from the points under it and from the next faster point brought under the cap
   (search/incumbents.cap_descent): its best layout joins the front and its bound covers every layout under the
   cap. Its relaxations, node models and seeding are the ranked search's, so a region is proven the way a plan is.
   The ranked search itself was the first region's search (of the GPU count of its fastest layout): like any
   region's search that its share of the time cut short, it is not repeated. When every region is proven the front
   is complete (`Plan.pareto_complete`).

The points are the non-dominated layouts found, kept at least one epsilon step apart in peak (fastest first).
Each returned point carries `front_bound_s`: a proven lower bound on the ranked step time of every layout of its
GPU count whose peak is at most the next faster point's peak minus the step (no cap for the fastest point) --
the region the point stands for. It comes from the frame bounds (`frame_lower_bound`, reused from the driver)
and the regions' searches; the point is `proven` when its gap `(t - bound) / t` is within the search's.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time as _time
from collections.abc import Callable, Iterable, Iterator

from k3opt.inputs.presets import load_runtime
from k3opt.inputs.specs import GIB, MIB, ClusterSpec, Job, Layout, ModelSpec, Recompute, RuntimeSpec
from k3opt.search.bounds import frame_estimate, frame_lower_bound
from k3opt.search.frames import (
    ACT_TOGGLES,
    RANK_TOGGLES,
    Frame,
    allocated_capacity_bytes,
    budget_line,
    choices,
    enumerate_frames,
    frame_of,
    lifecycles,
)
from k3opt.search.incumbents import (
    LEAN,
    Config,
    Neighbours,
    config_of,
    frame_walk,
    price_configs,
    seed_library,
    toggle_sets,
)
from k3opt.search.policy import POLICY
from k3opt.search.result import PlanItem, within_gap


def ranked_time_limit(time_limit: float) -> float:
    """The ranked search's share of a `k3opt.pareto` time limit (POLICY.front_ranked_share)."""
    return POLICY.front_ranked_share * time_limit


# ------------------------------------------------------------------------------------- the front


Region = tuple[list[PlanItem], float, bool, str | None]
"""What one region's search returns: its best layouts, its proven bound on every layout of the GPU count under
the cap (inf: none fits), whether the bound closes the best to the gap, and where its proof stopped when it does
not (the shape and kind of bound that holds it, `OpenBound`)."""

RegionSearch = Callable[[int, float, list[PlanItem], int], "Region | None"]
"""regions(gpus, cap bytes (inf: no cap), the points found at these GPUs, the front's size): the ranked search
under the cap (driver._Search._region); None when Ctrl-C stopped it."""


class _Facts:
    """What is proven: each frame's bounds (step time, peak), and per GPU count, from the ranked searches under a
    peak cap, 'every layout of these GPUs with peak <= cap takes at least bound s'."""

    def __init__(self) -> None:
        self.frame: dict[Frame, tuple[float, float]] = {}
        self.region: dict[int, list[tuple[float, float]]] = {}
        self.holding: dict[tuple[int, float], str] = {}
        """Per region searched short of its gap, (GPU count, cap): where its proof stopped."""

    def add_region(self, gpus: int, cap_bytes: float, bound_s: float, holding: str | None = None) -> None:
        """A ranked search under `cap_bytes` (inf: the ranked search itself) proved `bound_s` for its region."""
        self.region.setdefault(gpus, []).append((cap_bytes, bound_s))
        if holding is not None:
            self.holding[(gpus, cap_bytes)] = holding

    def searched(self, gpus: int, cap_bytes: float) -> bool:
        """Whether a ranked search ran under exactly this region's cap."""
        return any(c == cap_bytes for c, _ in self.region.get(gpus, []))

    def region_bound(self, gpus: int, cap_bytes: float) -> float:
        """The best region bound that covers the cap: from a search under a cap at least as high."""
        return max([0.0] + [b for c, b in self.region.get(gpus, []) if c >= cap_bytes])


def build_front(job: Job, model: ModelSpec, cluster: ClusterSpec, best_of: dict[Frame, PlanItem],
                ranked: list[PlanItem], step_gib: float, t0: float, time_limit: float, workers: int,
                lower_bounds: dict[Frame, tuple[float, float]] | None = None, over_line: set[Frame] | None = None,
                estimates: dict[Frame, float] | None = None,
                on_progress: Callable[[int, int, int], None] | None = None,
                regions: RegionSearch | None = None, ranked_bound: float = 0.0, gap: float = 0.0
                ) -> tuple[list[PlanItem], bool]:
    """The front (see the module docstring) from the ranked search's layouts (`ranked`, `best_of`), by the
    monotonic deadline t0 + time_limit. Returns its points, fastest first per GPU count, each with its
    `front_bound_s`, and whether it is complete (every region proven to `gap`; False when the time limit cut it
    short). `lower_bounds`: the frame_lower_bound of frames already bounded (by the driver), not computed again;
    `over_line`: frames whose peak bound the driver showed over HBM minus the reserve (no layout of theirs
    fits: left out, as a bound would leave them); `estimates`: the driver's frame_estimate of the frames it
    queued, the order the seeding visits them in; `on_progress(points, regions proven, regions known)` is called
    as it moves; `regions`: the ranked search under a cap (without it the front is seeded only, and not complete);
    `ranked_bound`: the ranked search's bound, which holds for every layout (the first region of each GPU count)."""
    search = _FrontSearch(job, model, cluster, best_of, ranked, step_gib, t0, time_limit, workers, lower_bounds,
                          over_line, estimates, gap)
    search.on_progress = on_progress
    for g in job.gpu_counts:
        search.facts.add_region(g, math.inf, ranked_bound)
    search.seed()
    # The ranked search was the first region's search of the GPU count of its fastest layout (its bound is that
    # region's): like any region's search cut by its share of the time, it is not repeated. A second search would
    # start from scratch with less time than the first had.
    searched = {(ranked[0].layout.gpus, math.inf)} if ranked else set()
    complete = search.bound_rest() and regions is not None and search.prove(regions, searched)
    return search.finish(), complete


class _FrontSearch:
    """One `build_front` call: the points found, the frames' facts, and the seeding's state (the frames to visit,
    the gap filling, the time the walks and the filling took). Its steps: `seed` (visit frames and fill gaps),
    `bound_rest` (bound the frames not reached), `prove` (the ranked search under each region's cap), `finish`
    (thin the front to the step, each point with its proven bound)."""

    def __init__(self, job: Job, model: ModelSpec, cluster: ClusterSpec, best_of: dict[Frame, PlanItem],
                 ranked: list[PlanItem], step_gib: float, t0: float, time_limit: float, workers: int,
                 lower_bounds: dict[Frame, tuple[float, float]] | None, over_line: set[Frame] | None,
                 estimates: dict[Frame, float] | None, gap: float = 0.0) -> None:
        self.job, self.model, self.cluster, self.workers, self.gap = job, model, cluster, workers, gap
        self.deadline = t0 + time_limit
        self.step = max(1, int(round(step_gib * GIB / MIB))) * MIB
        self.points: list[PlanItem] = list(ranked) + [it for it in best_of.values() if it not in ranked]
        self.facts = _Facts()
        self.skip = over_line or set()
        self.frames = [f for g in job.gpu_counts for f in enumerate_frames(job, model, g, cluster)
                       if f not in self.skip]
        self.facts.frame.update((f, b) for f, b in (lower_bounds or {}).items() if f not in self.skip)
        self.line = budget_line(job, cluster)  # no allocated budget exceeds it
        # The seeding: the ranked search's frames first, then the frames the driver queued (with their estimates)
        # and the frames next to any that adds to the front, spread over the pipeline depths (_Visits).
        self.runtime = load_runtime(job.runtime) if job.runtime is not None else None
        self.on_progress: Callable[[int, int, int], None] | None = None
        self.started = _time.monotonic()
        self.seed_end = self.started + POLICY.front_seed_share * max(0.0, self.deadline - self.started)
        self.est = dict(estimates or {})
        self.first = list(dict.fromkeys(frame_of(it.layout)
                                        for it in sorted(self.points, key=lambda it: it.rank_time_s)))
        self.visits = _Visits()
        for f, e in self.est.items():
            self.visits.push(f, e)
        self.seen: set[Frame] = set()
        self.walking = 0.0
        self.leanest = min(job.search.recompute or list(Recompute), key=LEAN.__getitem__)
        # The heuristic families of search/incumbents.py (every recompute mode under no toggles, the
        # activation-saving ones, every memory-saving one), fastest first: the first frame is priced under all.
        recs = sorted(job.search.recompute or list(Recompute), key=LEAN.__getitem__, reverse=True)
        self.families = [Config(rc, lifecycles(job)[0], frozenset(t for t, on in {**act, **rank}.items() if on))
                         for rc in recs for act, rank in toggle_sets(job)]
        self.fill = _Fill(job, model, cluster, self.runtime, self.frames, self.facts, self.skip, self.fits_bound)
        self.filling = 0.0
        self.fill_from = self.started
        self.idle: set[int] | None = None
        """The points when the filling last had no candidate left (it resumes when the front changes)."""

    def fits_bound(self, f: Frame) -> bool:
        """The frame's peak bound is under its budget (True while it is not bounded)."""
        if f not in self.facts.frame:
            return True
        m_lb = self.facts.frame[f][1]
        return m_lb <= self.line and m_lb <= allocated_capacity_bytes(self.job, f, self.model, self.cluster)

    def dominated(self, f: Frame, t_lb: float, peak_cap: float) -> bool:
        """Some point found has at least the frame's best possible tokens/s per GPU, no more GPUs, and a
        peak no higher than peak_cap (with one GPU count: a step time no longer than the frame's bound)."""
        tps_ub = _tokens(self.job, f) / (t_lb * f.gpus) if t_lb > 0 else math.inf
        return any(p.evaluation.step.rank_tokens_per_s_per_gpu >= tps_ub and p.layout.gpus <= f.gpus
                   and p.peak_bytes <= peak_cap for p in self.points)

    def _point_ids(self) -> set[int]:
        return {id(p) for p in self.points}

    def report(self, settled: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(len(self.points), settled, total)

    # -- 1. seed

    def seed(self) -> None:
        """Until POLICY.front_seed_share of the time: visit the ranked search's frames, then take turns between the
        gap filling (POLICY.front_fill_share of the time since) and the queued frames; once no frame is left to
        visit, fill only, until nothing is left to fill either. It stops sooner once it has gone as long without
        changing the front (thinned to the step) as it took to make its last change, and at least
        POLICY.front_patience_s: the regions' searches have the rest."""
        marks, last = self._marks(), self.started
        while (now := _time.monotonic()) < self.seed_end:
            if (m := self._marks()) != marks:
                marks, last = m, now
            elif now - self.started >= POLICY.front_patience_s and now - last > last - self.started:
                break
            f: Frame | None
            if self.first:
                f = self.first.pop(0)
                if not self.first:
                    self.fill_from = _time.monotonic()  # the ranked search's frames priced: the filling starts
            elif (self.idle != self._point_ids()
                  and self.filling <= POLICY.front_fill_share * (_time.monotonic() - self.fill_from)):
                if self.fill_gap():
                    continue
                f = self.visits.pop()
            else:
                f = self.visits.pop()
            if f is None:
                if self.idle == self._point_ids():
                    break  # no frame left to visit and nothing left to fill
                self.filling = -math.inf  # no frame left to visit: filling only
                continue
            self.report(0, len(self.frames))
            if (f in self.seen or f in self.skip or not self.fits_bound(f)
                    or (f in self.facts.frame and self.dominated(f, *self.facts.frame[f]))):
                continue
            self.visit(f)

    def _marks(self) -> frozenset[tuple[int, float, int]]:
        """The front so far as the seeding's stall stop sees it: (GPUs, step time, peak) of its points thinned to
        the step."""
        return frozenset((p.layout.gpus, p.rank_time_s, p.peak_bytes)
                         for p in _thin(_non_dominated(self.points), self.step))

    def fill_gap(self) -> bool:
        """One step of the gap filling (`_Fill.step`); False, with the front recorded as `idle`, when every
        candidate around the front is priced or pruned."""
        now = _time.monotonic()
        found = self.fill.step(self.points, self.step, self.seed_end, self.dominated)
        self.filling += _time.monotonic() - now
        if found is not None:
            self.points = _non_dominated(self.points + found)
            return True
        self.idle = self._point_ids()
        return False

    def visit(self, f: Frame) -> None:
        """Price frame f under the front's configurations; walk it (frame_walk, for its own trade-off) when it adds
        to the front and the walks have taken less than POLICY.front_walk_share of the seeding time; queue its
        neighbours when it has a fitting layout."""
        self.seen.add(f)
        before = self._point_ids()
        library = (seed_library(self.points, self.leanest) if self.seen - {f}
                   else self.families + seed_library(self.points, self.leanest))
        settled: list[Config] = []
        found = price_configs(self.job, f, library, self.model, self.cluster, self.seed_end, self.runtime,
                              settled=settled)
        self.fill.priced.update((f, c) for c in settled)  # those cut by the seeding's deadline stay for the filling
        self.points = _non_dominated(self.points + found)
        now = _time.monotonic()
        allowed = POLICY.front_walk_share * (self.seed_end - self.started) - self.walking
        if any(id(p) not in before for p in self.points) and allowed > 0:
            fastest = min(found, key=lambda it: it.rank_time_s).layout if found else None
            found += frame_walk(self.job, f, self.model, self.cluster, min(self.seed_end, now + allowed),
                                self.runtime, fastest)
            self.points = _non_dominated(self.points + found)
            self.walking += _time.monotonic() - now
        if not found:
            self.visits.empty(f)
        else:
            self.queue_near(f)

    def queue_near(self, f: Frame) -> None:
        """Queue the frames one change from f not seen, skipped or queued yet, each bounded and estimated."""
        for g in self.fill.near(f):
            if g not in self.seen and g not in self.skip and g not in self.visits:
                if g not in self.facts.frame:
                    self.facts.frame[g] = frame_lower_bound(self.job, g, self.model, self.cluster)
                self.visits.push(g, self.est.get(g) or frame_estimate(self.job, g, self.model, self.cluster))

    # -- 2. bound the frames the driver did not reach (the proof needs every frame's bound)

    def bound_rest(self) -> bool:
        """frame_lower_bound of every frame not bounded yet; False when the deadline passed first."""
        for i, f in enumerate(self.frames):
            if f not in self.facts.frame:
                if i % 16 == 0 and _time.monotonic() > self.deadline:
                    return False
                self.facts.frame[f] = frame_lower_bound(self.job, f, self.model, self.cluster)
        return True

    # -- 3. prove: a ranked search under each region's cap, fastest region first

    def prove(self, regions: RegionSearch, searched: set[tuple[int, float]] | None = None) -> bool:
        """Until every region is proven or searched (`_open_region`): the ranked search under the first open
        region's cap, started from the points under it; the layouts it finds join the front, its bound covers the
        region. A region its search leaves unproven (its share of the time spent) stays so, and the next is
        searched; `searched`: regions (GPU count, cap) searched before (the ranked search's), not searched again.
        Whether every region was proven before the deadline."""
        tried: set[tuple[int, float]] = set(searched or ())
        complete = True
        while (region := self._open_region(tried)) is not None:
            g, cap = region
            if self.deadline - _time.monotonic() < POLICY.front_region_min_s:
                return False
            got = regions(g, cap, [p for p in self.points if p.layout.gpus == g], len(self.points))
            if got is None:
                return False  # Ctrl-C
            items, bound, exact, holding = got
            tried.add(region)
            self.points = _non_dominated(self.points + items)
            self.facts.add_region(g, cap, bound, None if exact else holding)
            complete = complete and exact
        # A region searched before is proven if its bound closes its fastest point, which a later region's search
        # may have found (a faster layout under a lower cap is in every region above it too).
        return complete and all(self._closed(g, cap) for g, cap in searched or ())

    def _open_region(self, tried: set[tuple[int, float]]) -> tuple[int, float] | None:
        """The first region (GPU count, cap), fastest point first, whose bound does not close its point to the gap,
        or, below the leanest point, that is not shown empty, and that has not been searched (`tried`: a search
        cut by its share of the time is not repeated, and one that proved its region may leave a point that the
        rounding of the cap moved). None when none is left."""
        for g in self.job.gpu_counts:
            cap = math.inf
            for it in _thin(_non_dominated(p for p in self.points if p.layout.gpus == g), self.step):
                if (g, cap) not in tried and not self._closed(g, cap):
                    return g, cap
                cap = _cap_below(it, self.step)
            if (g, cap) not in tried and math.isfinite(self.bound_at(g, cap)):
                return g, cap
        return None

    def _closed(self, g: int, cap: float) -> bool:
        """Whether region (g, cap) holds no point, or its bound closes its fastest point to the gap (the points are
        non-dominated, so the fastest under the cap is the thinned point the region stands for)."""
        inside = [p.rank_time_s for p in self.points if p.layout.gpus == g and p.peak_bytes <= cap]
        return not inside or within_gap(min(inside), self.bound_at(g, cap), self.gap)

    def bound_at(self, g: int, cap: float) -> float:
        """The least ranked step time of a layout of g GPUs with peak <= cap: the best region bound that covers
        the cap, or the least bound of the frames whose peak bound is under it (inf when no frame's is); 0 while a
        frame of g is not bounded."""
        frames = 0.0 if any(f not in self.facts.frame for f in self.frames if f.gpus == g) else min(
            (t for f, (t, m) in self.facts.frame.items() if f.gpus == g and m <= cap), default=math.inf)
        return max(frames, self.facts.region_bound(g, cap))

    # -- 4. the front

    def finish(self) -> list[PlanItem]:
        """The non-dominated points thinned to the step, each with its proven bound (`bound_at` its region: no cap
        for the fastest of its GPU count, else the next faster point's peak less the step), the gap that proves
        it, and where its region's search stopped when that search ended short of the gap."""
        out: list[PlanItem] = []
        caps: dict[int, float] = {}
        for it in _thin(_non_dominated(self.points), self.step):
            g = it.layout.gpus
            cap = caps.get(g, math.inf)
            bound = min(self.bound_at(g, cap), it.rank_time_s)
            out.append(dataclasses.replace(it, front_bound_s=bound, front_gap_allowed=self.gap,
                                           front_holding=self.facts.holding.get((g, cap)), front_cap_bytes=cap,
                                           front_searched=self.facts.searched(g, cap)))
            caps[g] = _cap_below(it, self.step)
        return out


class _Fill:
    """Targeted pricing around the front: a gap of the front (two consecutive points of one GPU count more than a
    step apart in peak, or the leanest point and the least frame peak bound) is filled by a layout whose peak falls
    in it and is faster than the leaner side -- which is found, if anywhere cheap, next to the points around it.
    Each `step` takes the point beside the widest gap and prices its next candidate by evaluate() on every
    heuristic split: first its configuration on the frames one change from its frame (`Neighbours`: another
    sharding policy, FSDP degree, VP, PP, EP...), then its frame under its configuration one change away (a toggle
    switched, another recompute mode, the other lifecycle), towards the gap first (`candidates`). A candidate
    whose frame bound a point found dominates is skipped."""

    def __init__(self, job: Job, model: ModelSpec, cluster: ClusterSpec, runtime: RuntimeSpec | None,
                 frames: list[Frame], facts: _Facts, skip: set[Frame], fits: Callable[[Frame], bool]) -> None:
        self.args = (job, model, cluster, runtime)
        self.frames, self.facts, self.skip, self.fits = frames, facts, skip, fits
        self.priced: set[tuple[Frame, Config]] = set()
        """(frame, configuration) pairs priced on every split already (by the visits or here)."""
        self.gens: dict[tuple[Frame, Config], Iterator[tuple[Frame, Config]]] = {}
        self.tries: dict[tuple[Frame, Config], int] = {}
        """Candidates priced around each point (its frame and configuration)."""
        self.retry: dict[tuple[Frame, Config], list[tuple[Frame, Config]]] = {}
        """Candidates each point's next ones wait for: a frame next to it under a configuration one memory-saving
        change from its own, when its own did not fit that frame."""
        self._near: Neighbours | None = None
        self._deeper: dict[tuple, list[Frame]] | None = None
        names = ACT_TOGGLES + RANK_TOGGLES
        self.free = [t for t in names if choices(job, t) == [False, True]]
        self.recs = sorted(job.search.recompute or list(Recompute), key=LEAN.__getitem__)
        self.lcs = lifecycles(job)

    def near(self, f: Frame) -> list[Frame]:
        if self._near is None:
            self._near = Neighbours(self.frames)
        return self._near(f)

    def deeper(self, f: Frame) -> list[Frame]:
        """The frames with twice or half f's pipeline depth and the same shards per rank (EP and dense FSDP
        scaled the other way, the rest equal): three changes at once that `near` does not reach, the step
        between pipeline depths a front usually takes."""
        if self._deeper is None:
            self._deeper = {}
            for g in self.frames:
                self._deeper.setdefault(self._depth_key(g), []).append(g)
        return [g for g in self._deeper.get(self._depth_key(f), []) if g.pp in (2 * f.pp, f.pp // 2)]

    @staticmethod
    def _depth_key(f: Frame) -> tuple:
        return (f.gpus, f.vp, f.cp, f.expert_fsdp, f.ep * f.pp, f.dense_fsdp * f.pp, f.dense_sharding,
                f.expert_sharding, f.grad_dtype, f.precision)

    def bound(self, f: Frame) -> tuple[float, float]:
        if f not in self.facts.frame:
            job, model, cluster, _ = self.args
            self.facts.frame[f] = frame_lower_bound(job, f, model, cluster)
        return self.facts.frame[f]

    def leaner(self, c: Config) -> list[Config]:
        """Configurations one memory-saving change from c: a toggle switched on, a leaner recompute mode."""
        i = self.recs.index(c.recompute) if c.recompute in self.recs else 0
        return ([dataclasses.replace(c, on=c.on | {t}) for t in self.free if t not in c.on]
                + [dataclasses.replace(c, recompute=r) for r in reversed(self.recs[:i])])

    def moves(self, c: Config, down: bool) -> list[Config]:
        """Configurations one change from c, the memory-saving ones (`leaner`) first when `down`, else the
        time-saving ones (a toggle off, a richer recompute mode, the other lifecycle) first."""
        i = self.recs.index(c.recompute) if c.recompute in self.recs else 0
        lean = self.leaner(c)
        rich = [dataclasses.replace(c, on=c.on - {t}) for t in self.free if t in c.on]
        rich += [dataclasses.replace(c, recompute=r) for r in self.recs[i + 1:]]
        other = [dataclasses.replace(c, lifecycle=lc) for lc in self.lcs if lc != c.lifecycle]
        return lean + rich + other if down else rich + other + lean

    def candidates(self, p: PlanItem, down: bool) -> Iterator[tuple[Frame, Config]]:
        """Point p's configuration on the frames one change from p's frame, those towards the gap first (down:
        another sharding policy, then a lower peak bound than p's peak, leanest bound first; up: a lower time bound
        than p's step, fastest bound first); then p's frame under p's configuration one change away (`moves`)."""
        f, c = frame_of(p.layout), config_of(p.layout)
        near = [g for g in dict.fromkeys(self.deeper(f) + self.near(f)) if g not in self.skip]
        if down:
            # Another sharding policy first: it keeps every degree, hence the compute, and trades gradient or
            # weight bytes for traffic (the frame's peak bound leaves gradients out, so it cannot rank this one).
            near.sort(key=lambda g: (dataclasses.replace(g, dense_sharding=f.dense_sharding,
                                                         expert_sharding=f.expert_sharding) != f, self.bound(g)[1]))
            toward = [g for g in near if self.bound(g)[1] < p.peak_bytes]
        else:
            near.sort(key=lambda g: self.bound(g)[0])
            toward = [g for g in near if self.bound(g)[0] < p.rank_time_s]
        for g in toward + [g for g in near if g not in toward]:
            yield g, c
        for m in self.moves(c, down):
            yield f, m

    def step(self, points: list[PlanItem], step: int, deadline: float,
             dominated: Callable[[Frame, float, float], bool]) -> list[PlanItem] | None:
        """The fitting layouts of the next candidate priced ([] when the deadline passed first); None when every
        candidate around the front is priced or dominated. The point beside the widest gap goes first, its width
        divided by one more than the candidates priced around it already (so one wide gap does not take all)."""
        job, model, cluster, runtime = self.args
        beside: list[tuple[float, int, PlanItem, bool]] = []
        for _, its in itertools.groupby(_thin(points, step), key=lambda it: it.layout.gpus):
            ps = list(its)
            for i, p in enumerate(ps):
                up = ps[i - 1].peak_bytes - p.peak_bytes if i else 0.0
                # Below the leanest point the gap is open; it counts as one step, so that the gaps between points
                # (where a layout is known to be possible on both sides) go first.
                down = p.peak_bytes - ps[i + 1].peak_bytes if i + 1 < len(ps) else float(step)
                tries = self.tries.get(self._key(p), 0)
                beside.append((-max(up, down) / (1 + tries), len(beside), p, down >= up))
        for _, _, p, down in sorted(beside, key=lambda b: b[:2]):
            key = self._key(p)
            gen = self.gens.setdefault(key, self.candidates(p, down))
            retry = self.retry.setdefault(key, [])
            while (nxt := retry.pop(0) if retry else next(gen, None)) is not None:
                g, c = nxt
                if (g, c) in self.priced or not self.fits(g) or dominated(g, *self.bound(g)):
                    continue
                if _time.monotonic() > deadline:
                    return []
                self.priced.add((g, c))
                self.tries[key] = self.tries.get(key, 0) + 1
                found = price_configs(job, g, [c], model, cluster, deadline, runtime)
                if not found and g != key[0] and c == key[1]:
                    # p's configuration does not fit the frame next to it: that frame under a leaner one next.
                    retry.extend((g, m) for m in self.leaner(c))
                return found
        return None

    @staticmethod
    def _key(p: PlanItem) -> tuple[Frame, Config]:
        return frame_of(p.layout), config_of(p.layout)


class _Visits:
    """Frames to seed, grouped by pipeline depth and virtual stages (the per-rank share of the model state and
    the activations in flight, the main memory levers); `pop` returns the best estimate of the group visited
    least (a visit counting VP times: pricing an interleaved shape splits and replays VP times the chunks), so the
    seeding spreads along the peak axis instead of spending itself on the many shapes of the pipeline that
    estimates lowest."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, int], list[tuple[float, int, Frame]]] = {}
        self.visits: dict[tuple[int, int], int] = {}
        self.queued: set[Frame] = set()
        self.order = itertools.count()

    def __contains__(self, f: Frame) -> bool:
        return f in self.queued

    def push(self, f: Frame, estimate: float) -> None:
        heapq.heappush(self.groups.setdefault((f.pp, f.vp), []), (estimate, next(self.order), f))
        self.queued.add(f)

    def pop(self) -> Frame | None:
        live = [g for g, q in self.groups.items() if q]
        if not live:
            return None
        g = min(live, key=lambda g: (self.visits.get(g, 0), self.groups[g][0]))
        self.visits[g] = self.visits.get(g, 0) + g[1]  # a visit costs about VP times a v = 1 one (chunks to split)
        return heapq.heappop(self.groups[g])[2]

    def empty(self, f: Frame) -> None:
        """Frame f had no fitting layout: its group counts two more visits (shallow pipelines hold too much
        state to fit at all, and the seeding should not keep returning to them)."""
        g = (f.pp, f.vp)
        self.visits[g] = self.visits.get(g, 0) + 2


def _tokens(job: Job, f: Frame) -> int:
    return f.gpus // (f.pp * f.cp) * f.microbatches * job.rows * job.context


def _fastest_of(points: Iterable[PlanItem], f: Frame) -> Layout | None:
    mine = [p for p in points if frame_of(p.layout) == f]
    return min(mine, key=lambda p: (p.rank_time_s, p.peak_bytes)).layout if mine else None


def _non_dominated(items: Iterable[PlanItem]) -> list[PlanItem]:
    """Layouts no other beats on tokens/s per GPU, GPU count and worst-rank peak at once (one of them strictly),
    one per distinct criterion. With one GPU count and fixed tokens per update this is the (step time, peak)
    front."""
    def crit(it: PlanItem) -> tuple[float, int, int]:
        return (-it.evaluation.step.rank_tokens_per_s_per_gpu, it.layout.gpus, it.peak_bytes)

    front: list[PlanItem] = []
    for it in sorted(items, key=crit):
        c = crit(it)
        if not any(all(a <= b for a, b in zip(crit(o), c, strict=True)) for o in front):
            front.append(it)
    return sorted(front, key=lambda it: (it.layout.gpus, it.rank_time_s))


def _thin(front: list[PlanItem], step: int) -> list[PlanItem]:
    """Per GPU count, fastest first: a point is kept when its peak is at least `step` under the last kept one's,
    the points whose regions (the peaks under the last kept one's less the step) are proven one by one."""
    out: list[PlanItem] = []
    for _, its in itertools.groupby(front, key=lambda it: it.layout.gpus):
        last = math.inf
        for it in its:
            if it.peak_bytes <= last - step:
                out.append(it)
                last = it.peak_bytes
    return out


def _cap_below(it: PlanItem, step: int) -> float:
    """The cap of the region under point `it`: its peak, rounded down to the MiB, less the step."""
    return float(it.peak_bytes // MIB * MIB - step)
