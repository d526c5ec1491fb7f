"""What a running search reports (search/progress.py): snapshots in phase order whose bound is a valid lower bound
on the optimum, on the small model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import k3opt
from k3opt.search.progress import Progress

DATA = Path(__file__).parent.parent / "data"

ORDER = ["first layouts", "bounding shapes", "seeding", "bounding pass", "seeding", "solving", "done"]
"""The driver's phases in the order plan() runs them (search/driver.plan; the seeding has two parts)."""


def _is_subsequence(seq: list[str], of: list[str]) -> bool:
    it = iter(of)
    return all(any(x == y for y in it) for x in seq)


def _job() -> k3opt.Job:
    return k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [1, 2], "vp": [1, 2], "cp": [1], "ep": [2, 4], "expert_fsdp": [1], "dense_fsdp": [1, 2],
                   "recompute": ["none", "full"], "fsdp_lifecycle": ["per_microbatch"],
                   "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES
                                      if t not in ("fp8_activations", "activation_offload")]},
    })


def test_snapshots_follow_the_phases_and_never_bound_above_the_optimum(tiny, slow, use_policy):
    use_policy(progress_interval_s=0.0)
    seen: list[Progress] = []
    plan = k3opt.plan(_job(), model=tiny, cluster=slow, top=1, gap=0, progress=seen.append)
    assert plan.status == "OPTIMAL"
    best = plan.layouts[0].rank_time_s
    assert seen, "no snapshot"
    phases = [p.phase for p in seen]
    assert phases[0] == "first layouts"
    runs = [ph for i, ph in enumerate(phases) if i == 0 or phases[i - 1] != ph]
    assert _is_subsequence(runs, ORDER), runs  # "front" is not in ORDER: plan() builds no front
    assert all(b.elapsed_s >= a.elapsed_s for a, b in zip(seen, seen[1:], strict=False))
    for p in seen:
        assert 0 <= p.shapes_settled <= p.shapes_total == plan.frames_total
        if p.bound_s is not None:
            # gap 0 proves `best` optimal: a snapshot's bound above it would have pruned the optimum.
            assert p.bound_s <= best * (1 + 1e-9), p
        if p.incumbent_s is not None:
            assert p.incumbent_s >= best * (1 - 1e-9)
    inc = [p.incumbent_s for p in seen if p.incumbent_s is not None]
    assert inc and all(b <= a for a, b in zip(inc, inc[1:], strict=False))  # the best so far only falls
    assert any(p.bound_s is not None for p in seen)
    done = seen[-1]
    assert done.phase == "done" and done.incumbent_s == best
    assert done.bound_s == pytest.approx(plan.bound, rel=1e-12)


def test_pareto_reports_the_front_phase(tiny, slow, use_policy):
    use_policy(progress_interval_s=0.0)
    seen: list[Progress] = []
    res = k3opt.pareto(_job(), model=tiny, cluster=slow, top=1, time_limit=30, progress=seen.append)
    front = [p for p in seen if p.phase == "front"]
    assert front and res.pareto
    assert max(p.front_points for p in front) >= 1
    assert all(p.shapes_settled <= p.shapes_total for p in front)
    # The regions' searches report under the front phase, each naming its peak cap, with its own bound.
    regions = [p for p in front if p.front_region]
    assert res.pareto_complete and regions
    assert all(re.fullmatch(r"every peak|peak <= \d+\.\d\d GiB", p.front_region) for p in regions)
    assert any("region peak <= " in p.line() for p in regions)


def test_plan_builds_no_front_and_pareto_does(tiny, slow):
    ranked = k3opt.plan(_job(), model=tiny, cluster=slow, top=1, gap=0)
    assert ranked.pareto == []
    both = k3opt.pareto(_job(), model=tiny, cluster=slow, top=1, time_limit=30, gap=0)
    assert both.pareto and both.layouts[0].rank_time_s == pytest.approx(ranked.layouts[0].rank_time_s)


def test_gap_and_line_are_derived_from_the_snapshot():
    p = Progress("solving", 12.0, incumbent_s=20.0, bound_s=19.0, shapes_settled=10, shapes_total=40,
                 models_solved=3)
    assert p.gap == pytest.approx(0.05)  # (20 - 19) / 20
    assert "best 20.000 s, bound 19.000 s, gap 5.00%, shapes settled 10/40, models solved 3" in p.line()
    assert Progress("seeding", 1.0, None, None, 0, 40, 0).gap is None
    assert "best none yet" in Progress("seeding", 1.0, None, None, 0, 40, 0).line()
