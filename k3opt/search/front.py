"""The Pareto front over (tokens/s per GPU, GPUs, worst-rank peak) by epsilon-constraint solves; tokens/s per GPU
at the ranked step time (achievable when the cluster has rates, search/ranking.py)."""

from __future__ import annotations

import math
import time as _time
from collections.abc import Iterable

from k3opt.search.bounds import frame_lower_bound
from k3opt.search.frames import (
    Frame,
    act_modes,
    allocated_capacity_bytes,
    enumerate_frames,
    frame_of,
    lifecycles,
    undominated_modes,
)
from k3opt.search.node_model import FrameModel, _item
from k3opt.search.result import PlanItem
from k3opt.specs import (
    GIB,
    MIB,
    ClusterSpec,
    Job,
    Layout,
    ModelSpec,
)


def _pareto(job: Job, model: ModelSpec, cluster: ClusterSpec, best_of: dict[Frame, PlanItem],
            ranked: list[PlanItem], step_gib: float, t0: float, time_limit: float, workers: int,
            lower_bounds: dict[Frame, tuple[float, float]] | None = None, over_line: set[Frame] | None = None
            ) -> tuple[list[PlanItem], bool]:
    """Non-dominated (step time, worst-rank peak) layouts by epsilon-constraint solves per frame: minimize the
    step time (ties: the lower peak) under peak <= epsilon, then lower epsilon by the step. A frame is skipped,
    or its loop stopped, once a point found dominates its bounds (every further layout of it is dominated).
    Returns the front and whether it is complete (False when the time limit cut it short). `lower_bounds`: the
    frame_lower_bound of frames already bounded (by the driver), not computed again; `over_line`: frames whose
    peak bound the driver showed over HBM minus the reserve (over every budget: skipped, as a bound would skip
    them)."""
    points: list[PlanItem] = list(ranked)
    if _time.monotonic() - t0 > time_limit:
        return _non_dominated(points), False  # no time left to bound the frames, let alone solve one
    step_mib = max(1, int(round(step_gib * GIB / MIB)))
    frames = [f for g in job.gpu_counts for f in enumerate_frames(job, model, g, cluster)]
    known = lower_bounds or {}
    frames = [f for f in frames if f not in (over_line or set())]
    unsorted = []
    for i, f in enumerate(frames):
        if i % 64 == 0 and _time.monotonic() - t0 > time_limit:
            return _non_dominated(points), False
        unsorted.append((*(known[f] if f in known else frame_lower_bound(job, f, model, cluster)), f))
    bounds = sorted(unsorted)
    complete = True

    def dominated(f: Frame, t_lb: float, peak_cap: float) -> bool:
        """Some point found has at least the frame's best possible tokens/s per GPU, no more GPUs, and a
        peak no higher than peak_cap (with one GPU count: a step time no longer than the frame's bound)."""
        tps_ub = job_tokens(f) / (t_lb * f.gpus) if t_lb > 0 else math.inf
        return any(p.evaluation.step.rank_tokens_per_s_per_gpu >= tps_ub and p.layout.gpus <= f.gpus
                   and p.peak_bytes <= peak_cap for p in points)

    def job_tokens(f: Frame) -> int:
        return f.gpus // (f.pp * f.cp) * f.microbatches * job.rows * job.context

    for t_lb, m_lb, f in bounds:
        if m_lb > allocated_capacity_bytes(job, f, model, cluster) or dominated(f, t_lb, m_lb):
            continue
        if _time.monotonic() - t0 > time_limit:
            complete = False
            break
        have = best_of.get(f)
        cap = have.peak_bytes // MIB - step_mib if have else None
        # Each solve lowers the cap, so every later layout of the frame is no faster than the last one found
        # (t_seen) and holds at least the frame's peak bound: a point at least as fast with a peak no higher than
        # that bound dominates them all. (A point under the cap but above the bound does not.)
        t_seen = max(t_lb, have.step_time_s) if have else t_lb
        fm: FrameModel | None = None
        while True:
            if cap is not None and (cap * MIB < m_lb or dominated(f, t_seen, m_lb)):
                break
            remaining = time_limit - (_time.monotonic() - t0)
            if remaining <= 0:
                complete = False
                break
            if fm is None:
                modes = undominated_modes(job, f, act_modes(job), lifecycles(job), model, cluster)
                fm = FrameModel(job, f, model, cluster, modes=modes)
            res = fm.solve(remaining, workers, peak_cap_mib=cap)
            if res.status == "FEASIBLE" or res.status == "UNKNOWN":
                complete = False
            item = _item(job, f, fm, res, model, cluster)
            if item is None:
                break
            points.append(item)
            cap = item.peak_bytes // MIB - step_mib
            t_seen = max(t_seen, item.step_time_s)
    return _non_dominated(points), complete


def _frame_of(layout: Layout) -> Frame:
    return frame_of(layout)


def _non_dominated(items: Iterable[PlanItem]) -> list[PlanItem]:
    """Layouts no other beats on tokens/s per GPU, GPU count and worst-rank peak at once (one of them strictly).
    With one GPU count and fixed tokens per update this is the (step time, peak) front."""
    items = sorted(items, key=lambda it: (-it.evaluation.step.rank_tokens_per_s_per_gpu, it.layout.gpus, it.peak_bytes))

    def crit(it: PlanItem) -> tuple[float, int, int]:
        return (-it.evaluation.step.rank_tokens_per_s_per_gpu, it.layout.gpus, it.peak_bytes)

    front: list[PlanItem] = []
    for it in items:
        c = crit(it)
        if not any(all(a <= b for a, b in zip(crit(o), c, strict=True)) and crit(o) != c for o in front) \
                and all(crit(o) != c for o in front):
            front.append(it)
    return sorted(front, key=lambda it: (it.layout.gpus, it.rank_time_s))
