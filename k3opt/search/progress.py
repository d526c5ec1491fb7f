"""What a running search reports: a `Progress` snapshot (phase, incumbent, proven bound, gap, shapes settled),
handed to the caller's callback as the search moves, at most every POLICY.progress_interval_s."""

from __future__ import annotations

import math
import time as _time
from collections.abc import Callable
from dataclasses import dataclass

from k3opt.search.policy import POLICY


@dataclass(frozen=True)
class Progress:
    """One snapshot of a search. `bound_s` is a proven lower bound on the best layout's step time (None until
    every shape has its first bound); `gap` = (incumbent - bound) / incumbent when both exist. A shape is settled
    when no entry of it is left open in the queue (pruned, solved or over the HBM line)."""

    phase: str
    """first layouts | bounding shapes | seeding | bounding pass | solving | front | done (the plan's own bound)"""
    elapsed_s: float
    incumbent_s: float | None
    bound_s: float | None
    shapes_settled: int
    shapes_total: int
    models_solved: int
    front_points: int = 0
    front_region: str = ""
    """In the front phase, the region being proven (its peak cap): best, bound and shapes are its search's."""

    @property
    def gap(self) -> float | None:
        if self.incumbent_s is None or self.bound_s is None or not self.incumbent_s:
            return None
        return max(0.0, (self.incumbent_s - self.bound_s) / self.incumbent_s)

    def line(self) -> str:
        """One plain line: what a log shows."""
        inc = f"{self.incumbent_s:.3f} s" if self.incumbent_s is not None else "none yet"
        bnd = f"{self.bound_s:.3f} s" if self.bound_s is not None else "not yet"
        gap = f"{100 * self.gap:.2f}%" if self.gap is not None else "-"
        front = ""
        if self.phase == "front":
            front = f", front {self.front_points} points" + (f", region {self.front_region}" if self.front_region
                                                              else "")
        return (f"[{self.elapsed_s:6.1f} s] {self.phase}: best {inc}, bound {bnd}, gap {gap}, shapes settled "
                f"{self.shapes_settled}/{self.shapes_total}, models solved {self.models_solved}{front}")


ProgressFn = Callable[[Progress], None]
"""progress(snapshot): called on the search's thread as it moves, at most every POLICY.progress_interval_s; a
long CP-SAT slice may leave it silent for the slice (a display keeps its own clock)."""


class Ticker:
    """Rate-limits the snapshots: `due()` says whether the interval has passed, `send(p)` hands one over."""

    def __init__(self, fn: ProgressFn | None, t0: float) -> None:
        self.fn, self.t0 = fn, t0
        self.last = -math.inf

    def due(self, force: bool = False) -> bool:
        return self.fn is not None and (force or _time.monotonic() - self.last >= POLICY.progress_interval_s)

    def send(self, snapshot: Callable[[float], Progress]) -> None:
        """snapshot(elapsed) built and handed to the callback."""
        if self.fn is None:
            return
        now = _time.monotonic()
        self.last = now
        self.fn(snapshot(now - self.t0))
