"""A node proven only to the plan's relative gap against its own model's objective goes back to be solved exactly.
An interleaved node's model can price its layout under that layout's replayed time: CP-SAT then calls the node
OPTIMAL once its bound is within 1% of that objective, which can leave the bound under the plan's line (on the
default job at 300 s, the PP4 VP4 EP64 eFSDP2 dFSDP64 node: bound 20.826 s, line 20.861 s), and the plan then
held that bound for good."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.search.driver import _Entry, _open_bounds, _Search  # noqa: PLC2701


def _searched() -> _Search:
    s = _Search(k3opt.load_job("k3-512-4k"), None, None, top=1, time_limit=60.0, workers=1, pareto=False,
                pareto_step_gib=1.0, progress=None, gap=0.01)
    s.first_pass()
    return s


def test_a_node_proven_to_its_own_gap_under_the_line_is_solved_again_exactly(monkeypatch):
    s = _searched()
    best = s._kth()
    assert best is not None
    f = best.layout
    frame = next(fr for fr in s.best_of if s.best_of[fr] is best)
    rc, lc = f.recompute, f.fsdp_lifecycle
    under = best.rank_time_s * 0.97  # 3% under the best: under the 1% line
    e = _Entry(under, 0.0, 10**9, frame, rc, lc, 2)
    s._after_slice(e, under, "OPTIMAL", best)
    again = [x for x in s.queue if x.frame == frame and x.recompute == rc and x.lifecycle == lc and x.exact]
    assert len(again) == 1 and again[0].bound == under and again[0].attempt == 3
    assert s.residual == float("inf")

    # Its next slice asks CP-SAT for the optimum, not the gap.
    seen = {}

    def fake_solve(*args, **kwargs):
        seen["gap"] = kwargs["relative_gap"]
        raise RuntimeError("stop here")

    monkeypatch.setattr("k3opt.search.driver.solve_frame", fake_solve)
    with pytest.raises(RuntimeError, match="stop here"):
        s._solve(again[0], under, best)
    assert seen["gap"] == 0.0

    # Solved exactly, its bound is what it is: left behind (the plan's bound), not queued again.
    s._after_slice(again[0], under, "OPTIMAL", best)
    assert s.residual == under
    # and a FEASIBLE plan names it as what holds its bound, though it is no longer in the queue
    n, holding = _open_bounds([*s.queue, *s.solved_under], best, 0.01, s.frame_tightened, s.tightened,
                              frozenset(e.seq for e in s.solved_under))
    assert holding is not None and holding.bound_s == under
    assert "solved to optimality by CP-SAT, its model's bound under the line" in holding.kind


def test_a_node_proven_at_the_line_is_left_behind_as_before():
    s = _searched()
    best = s._kth()
    frame = next(fr for fr in s.best_of if s.best_of[fr] is best)
    at_line = best.rank_time_s * 0.995  # within the 1% gap of the best: it closes the node
    e = _Entry(at_line, 0.0, 10**9, frame, best.layout.recompute, best.layout.fsdp_lifecycle, 2)
    s._after_slice(e, at_line, "OPTIMAL", best)
    assert s.residual == at_line and not [x for x in s.queue if x.exact]


def test_without_a_layout_to_measure_against_a_node_proven_to_its_gap_is_left_behind():
    """With no top-th layout yet (a front region's search before its first layout) there is no line: the gap
    against the node's own objective is all there is, and re-solving exactly cost the default job's front its
    proven second point within 60 s."""
    s = _searched()
    best = s._kth()
    frame = next(fr for fr in s.best_of if s.best_of[fr] is best)
    s.best_of.clear()
    under = best.rank_time_s * 0.97
    e = _Entry(under, 0.0, 10**9, frame, best.layout.recompute, best.layout.fsdp_lifecycle, 2)
    s._after_slice(e, under, "OPTIMAL", best)
    assert s.residual == under and not [x for x in s.queue if x.exact]
