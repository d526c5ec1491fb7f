"""What `plan()` returns: ranked items, the Pareto front, the proven bound and gap."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from k3opt.cost.evaluate import Evaluation
from k3opt.cost.ledger import ACTIVATION, OPTIMIZER, PERSISTENT
from k3opt.inputs.specs import GIB, TOGGLE_NAMES, Job, Layout

PROVEN_TOL = 1e-9
"""Relative: a front point whose bound is this close under its step time is proven (float rounding, not a gap)."""

LINE_ROUNDING = 1e-8
"""Relative: a bound program told to stop at the pruning line returns a hair under it once it has shown the line
reached (lp_bound.granular_stage: the stop x (1 - 1e-9)), so a bound this close under the line counts as at it.
Without it such a node would stay open and be solved by CP-SAT, and a plan proven to the gap would report
FEASIBLE."""


def within_gap(t: float, bound: float, gap: float) -> bool:
    """Whether a proven lower `bound` closes step time `t` to the relative `gap`: bound >= t (1 - gap), with
    LINE_ROUNDING under it counting as at it (PROVEN_TOL with gap 0)."""
    return bound >= t * (1 - gap) * (1 - (LINE_ROUNDING if gap > 0 else PROVEN_TOL)) - 1e-12


@dataclass(frozen=True)
class PlanItem:
    layout: Layout
    evaluation: Evaluation
    front_bound_s: float | None = None
    """On a Pareto point: a proven lower bound on the ranked step time of every layout of its GPU count in the
    peak range the point stands for (search/front.py); None elsewhere."""
    runs_on: tuple[str, ...] | None = None
    """The launch targets that can run the layout as priced (k3opt.launch.limits); None where not checked."""
    front_gap_allowed: float = 0.0
    """On a Pareto point: the search's relative gap, within which its bound proves it (`proven`)."""
    front_holding: str | None = None
    """On a Pareto point whose region's search ended short of the gap: the bound that held it (its shape and kind,
    as Plan.holding); None where proven or not searched."""
    front_cap_bytes: float | None = None
    """On a Pareto point: the cap of the peak range it stands for (inf for the fastest point of its GPU count, else
    the next faster point's peak, rounded down to the MiB, less the step); None elsewhere."""
    front_searched: bool = False
    """On a Pareto point: whether a ranked search ran under exactly its region's cap (the ranked search itself for
    the fastest). Unsearched, its bound is a wider region's or its shapes' bounds."""

    @property
    def step_time_s(self) -> float:
        return self.evaluation.step.step_time_s

    @property
    def rank_time_s(self) -> float:
        """The step time the plan ranks by: achievable when the cluster has a rates file, else the roofline."""
        return self.evaluation.step.rank_time_s

    @property
    def peak_bytes(self) -> int:
        return self.evaluation.peak_bytes

    @property
    def ranks_by_replay(self) -> bool:
        """The layout ranks by its replayed schedule, above the step formula (uneven interleaved chunks) by more than
        float rounding: what the node model minimizes is then below its ranked time."""
        return self.rank_time_s > self.evaluation.step.formula_time_s * (1 + 1e-9)

    @property
    def front_gap(self) -> float | None:
        """(ranked step - front_bound_s) / ranked step: 0 where the Pareto point is proven; None off the front."""
        if self.front_bound_s is None:
            return None
        return max(0.0, (self.rank_time_s - self.front_bound_s) / self.rank_time_s)

    @property
    def proven(self) -> bool:
        """A Pareto point no layout in its peak range beats by more than the search's gap: its front bound is
        within `front_gap_allowed` of its step time (`within_gap`; with gap 0, to PROVEN_TOL)."""
        return self.front_bound_s is not None and within_gap(self.rank_time_s, self.front_bound_s,
                                                             self.front_gap_allowed)


@dataclass(frozen=True)
class OpenBound:
    """Where a FEASIBLE plan's proof stopped: the least bound left in the search's queue (`Plan.bound`, unless a node
    was cut mid-solve), the parallel shape it belongs to and what kind of bound it is. A longer run starts there."""

    shape: str
    """The parallel shape: PP, VP, CP, EP, FSDP degrees, microbatches, sharding policies, gradient dtype, precision."""
    bound_s: float
    kind: str
    """Which bound: the shape's (before its nodes, one per recompute mode and lifecycle, are bounded) or one node's,
    and how far it was tightened (whole layers, the node's relaxation, CP-SAT slices)."""
    line_s: float
    """The line a bound must reach for the gap to close: the top-th layout's step time less the relative gap."""


@dataclass(frozen=True)
class PlacementOption:
    """One placement the search considered at a GPU count: GPUs used per NVLink domain (None: whole domains), the
    domains it holds, the best layout found under it (None: none priced) and the least bound of its shapes."""

    gpus: int
    domain_gpus_used: int | None
    domains_held: int
    best_s: float | None
    bound_s: float


@dataclass
class Plan:
    """What `plan()` returns: the status, the proven bound and gap, the ranked layouts, the Pareto front."""

    job: Job
    status: str
    layouts: list[PlanItem]
    pareto: list[PlanItem]
    bound: float
    """Lower bound on the best ranked step time (PlanItem.rank_time_s, s) over the whole space; equals the best when
    OPTIMAL."""
    gap: float
    """(best - bound) / best."""
    frames_total: int
    frames_solved: int
    solve_time_s: float
    model_size: dict[str, int] = field(default_factory=dict)
    pareto_complete: bool = False
    """True when every region of the front is proven to the gap, the one under the leanest point (no layout) too
    (search/front.py)."""
    first_layout_s: float | None = None
    """Seconds from the call to the first fitting layout (heuristic or solved); None if none was found."""
    open_shapes: int = 0
    """Parallel shapes with a bound still under `holding.line_s` when the search stopped (0 when OPTIMAL): what a
    longer run has to settle."""
    holding: OpenBound | None = None
    """The least bound left when the search stopped short of its gap (None when OPTIMAL)."""
    placements: list[PlacementOption] = field(default_factory=list)
    """The placements searched at the best layout's GPU count, best first: why the plan's placement was chosen."""

    def to_frame(self, which: str = "pareto") -> pd.DataFrame:
        """The CSV schema: one row per layout, every decision and every ledger term a column, units in names."""
        return plan_frame(self.pareto if which == "pareto" and self.pareto else self.layouts)


def plan_frame(items: list[PlanItem]) -> pd.DataFrame:
    """One row per layout: every decision and every ledger term a column, units in the column names.
    Ledger columns are the worst rank's (the rank that sets the peak)."""
    rows = []
    for rank, it in enumerate(items, start=1):
        lay, ev = it.layout, it.evaluation
        worst = ev.ranks[ev.worst_rank]
        row: dict = {
            "rank": rank, "gpus": lay.gpus, "pp": lay.pp, "vp": lay.vp, "cp": lay.cp, "ep": lay.ep,
            "expert_fsdp": lay.expert_fsdp, "dense_fsdp": lay.dense_fsdp, "microbatches": lay.microbatches,
            "rows": lay.rows, "context_tokens": lay.context, "split_layers": " ".join(map(str, lay.split)),
            "recompute": lay.recompute.value, "fsdp_lifecycle": lay.fsdp_lifecycle.value,
            "dense_sharding": lay.dense_sharding.value, "expert_sharding": lay.expert_sharding.value,
            "optimizer_shard_granularity": lay.optimizer_shard_granularity.value,
            "grad_dtype": lay.grad_dtype.value, "optimizer_state_dtype": ev.layout.optimizer_state_dtype.value,
            "param_gather": lay.param_gather.value, "fp8_param_gather": lay.fp8_param_gather,
            "runtime": ev.runtime.name if ev.runtime is not None else "",
            "gpus_per_domain": ev.gpus_per_domain, "domains_held": ev.domains_held, "gpus_held": ev.gpus_held,
            "ranked_tokens_per_s_per_gpu_held": ev.tokens_per_s_per_gpu_held,
            "runs_on": "" if getattr(it, "runs_on", None) is None else " ".join(it.runs_on) or "none",
        }
        row.update({f"toggle_{t}": getattr(lay.toggles, t) for t in TOGGLE_NAMES})
        row["offload_modules"] = " ".join(m.value for m in lay.offload_modules)
        s = ev.step
        row.update({
            "step_time_s": s.step_time_s, "serial_step_time_s": s.serial_step_time_s,
            "tokens_per_update": s.tokens_per_update, "tokens_per_s": s.tokens_per_s,
            "tokens_per_s_per_gpu": s.tokens_per_s_per_gpu, "mfu_pct": 100 * s.mfu,
            "precision": lay.precision.value,
            "achievable_step_time_s": s.achievable_step_time_s,
            "achievable_schedule_step_time_s": s.achievable_schedule_step_time_s,
            "schedule_step_time_s": s.schedule_step_time_s,
            "achievable_tokens_per_s_per_gpu": s.achievable_tokens_per_s_per_gpu,
            "achievable_mfu_pct": None if s.achievable_mfu is None else 100 * s.achievable_mfu,
            "achievable_binding_resource": s.achievable_binding,
            "ranked_step_time_s": s.rank_time_s,
            "ranked_tokens_per_s": s.tokens_per_update / s.rank_time_s,
            "ranked_tokens_per_s_per_gpu": s.rank_tokens_per_s_per_gpu,
            "ranked_mfu_pct": 100 * s.mfu * s.step_time_s / s.rank_time_s,  # MFU scales as 1 / step time
            "bubble_overhead_pct": 100 * s.bubble_overhead, "binding_resource": s.binding,
            "slowest_rank": s.slowest_rank, "worst_rank": ev.worst_rank,
            "peak_gib": ev.peak_bytes / GIB, "peak_allocated_gib": ev.peak_allocated_bytes / GIB,
            "peak_reserved_gib": ev.peak_reserved_bytes / GIB, "peak_device_gib": ev.peak_device_bytes / GIB,
            "capacity_gib": ev.capacity_bytes / GIB,
            "headroom_gib": ev.headroom_bytes / GIB, "host_gib_max": max(r.host_bytes for r in ev.ranks) / GIB,
        })
        for key in PERSISTENT + ACTIVATION + OPTIMIZER:
            row[f"{key}_gib"] = worst.ledger[key] / GIB
        row.update({f"rank{r.rank}_peak_gib": r.peak_bytes / GIB for r in ev.ranks})
        for kind in ("allocated", "reserved", "device"):
            row.update({f"rank{r.rank}_{kind}_gib": getattr(r, f"{kind}_bytes") / GIB for r in ev.ranks})
        rows.append(row)
    return pd.DataFrame(rows)


def front_frame(points: list[PlanItem]) -> pd.DataFrame:
    """The Pareto CSV: plan_frame's columns plus each point's proven front bound, its gap and whether it is
    proven (no layout of any frame at the point's peak or less is faster: its front bound is its step time)."""
    df = plan_frame(points)
    if len(df):
        df["front_bound_s"] = [it.front_bound_s for it in points]
        df["front_gap_pct"] = [100 * (it.front_gap or 0.0) for it in points]
        df["proven"] = [it.proven for it in points]
        df["front_holding"] = [it.front_holding or "" for it in points]
        df["front_cap_gib"] = [(it.front_cap_bytes or math.inf) / GIB for it in points]
        df["front_searched"] = [it.front_searched for it in points]
    return df
