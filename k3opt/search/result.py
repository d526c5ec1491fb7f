"""What `plan()` returns: ranked items, the Pareto front, the proven bound and gap."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3opt.evaluate import Evaluation
from k3opt.specs import (
    Job,
    Layout,
)


@dataclass(frozen=True)
class PlanItem:
    layout: Layout
    evaluation: Evaluation
    front_bound_s: float | None = None
    """On a Pareto point: a proven lower bound on the ranked step time of every layout of its GPU count in the
    peak range the point stands for (search/front.py); None elsewhere."""

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
    def front_gap(self) -> float | None:
        """(ranked step - front_bound_s) / ranked step: 0 where the Pareto point is proven; None off the front."""
        if self.front_bound_s is None:
            return None
        return max(0.0, (self.rank_time_s - self.front_bound_s) / self.rank_time_s)


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
    """True when every frame was either dominated by its bounds or solved down to its last epsilon step."""
    first_layout_s: float | None = None
    """Seconds from the call to the first fitting layout (heuristic or solved); None if none was found."""
    open_shapes: int = 0
    """Parallel shapes with a bound still under `holding.line_s` when the search stopped (0 when OPTIMAL): what a
    longer run has to settle."""
    holding: OpenBound | None = None
    """The least bound left when the search stopped short of its gap (None when OPTIMAL)."""

    def to_frame(self, which: str = "pareto"):  # noqa: ANN201 - pandas DataFrame
        """The CSV schema: one row per layout, every decision and every ledger term a column, units in names."""
        from k3opt.report import plan_frame

        return plan_frame(self.pareto if which == "pareto" and self.pareto else self.layouts)
