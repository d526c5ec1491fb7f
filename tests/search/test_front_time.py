"""How the Pareto front spends its time (search/front.py): the ranked search counts as its GPU count's first region's
search and is not searched again, and the front's seeding stops once it stalls, leaving the rest to the regions."""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import k3opt
from k3opt.search import front
from k3opt.search.frames import frame_of
from k3opt.search.policy import POLICY

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def small():
    """The small model on 8 GPUs, PP2 EP2, and its ranked plan (proven: the shapes are few)."""
    job = k3opt.Job.model_validate(dict(
        model=str(DATA / "tiny-moe.toml"), cluster=str(DATA / "slow-cluster.toml"), gpus=8, context=2048,
        tokens_per_update=32768, reserve_gib=1.5,
        search=dict(pp=[2], ep=[2], vp=[1], expert_fsdp=[1])))
    plan = k3opt.plan(job, top=3, time_limit=60)
    assert plan.status == "OPTIMAL"
    model, cluster = k3opt.load_model(job.model), k3opt.load_cluster(job.cluster)
    return job, model, cluster, plan


def _build(small, ranked_bound: float):
    job, model, cluster, plan = small
    asked: list[tuple[int, float]] = []

    def regions(g: int, cap: float, known: list, points: int):
        asked.append((g, cap))
        return [], 0.0, True, None  # every other region: searched and proven (nothing faster under its cap)

    best_of = {frame_of(it.layout): it for it in plan.layouts}
    points, complete = front.build_front(job, model, cluster, best_of, list(plan.layouts), 1.0, time.monotonic(),
                                         60.0, 1, regions=regions, ranked_bound=ranked_bound, gap=0.01)
    return asked, points, complete


def test_an_unproven_ranked_search_is_not_searched_again(small):
    """The ranked search cut short of its gap (its bound 0 s here) was the first region's search: the regions asked
    for are the others, never (8 GPUs, no cap), and the front is not complete (that region stays open)."""
    asked, points, complete = _build(small, 0.0)
    assert (8, math.inf) not in asked
    assert points and not complete
    assert points[0].front_bound_s < points[0].rank_time_s * 0.99


def test_a_proven_ranked_search_leaves_the_front_complete(small):
    """With the ranked bound at the fastest layout's step time the first region is closed: the other regions
    proven (the stub), the front is complete."""
    _, _, _, plan = small
    asked, points, complete = _build(small, plan.layouts[0].rank_time_s)
    assert (8, math.inf) not in asked
    assert complete


@pytest.mark.parametrize("found_fast", [True, False])
def test_the_ranked_region_closes_on_a_faster_layout_found_later(small, monkeypatch, found_fast):
    """The ranked search's region holds only its slower layout (4.131 s; the plan proved 4.0025 s, 3.1% under it:
    open at 1%). One region under a cap is searched: when it returns the 4.0025-s layout, that layout is in every
    region above it too, so the ranked search's region closes and the front is complete; when it returns nothing,
    the ranked region stays open and the front is not complete."""
    job, model, cluster, plan = small
    fast, slow = plan.layouts[0], plan.layouts[-1]
    assert slow.rank_time_s > fast.rank_time_s * 1.01
    # Started now on the real clock (bound_rest and prove read it), with time to spare.
    search = front._FrontSearch(job, model, cluster, {frame_of(slow.layout): slow}, [slow], 1.0,  # noqa: SLF001
                                time.monotonic(), 10_000.0, 1, None, None, None, 0.01)
    search.facts.add_region(8, math.inf, plan.bound)
    assert search.bound_rest()
    asked = iter([(8, 0.5 * 2**30)])
    monkeypatch.setattr(search, "_open_region", lambda tried: next(asked, None))

    def regions(g: int, cap: float, known: list, points: int):
        return ([fast] if found_fast else []), 0.0, True, None

    assert search.prove(regions, {(8, math.inf)}) is found_fast


class _Clock:
    """A monotonic clock that moves one second at each reading."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        self.t += 1.0
        return self.t


def _seed_until(small, monkeypatch, change_at: set[int]) -> float:
    """Run the front's seeding on a clock moving 1 s a reading, visits doing nothing but, at the seconds of
    `change_at` (from the seeding's start), add a point 1 s faster than the fastest; the seconds it ran."""
    job, model, cluster, plan = small
    clock = _Clock()
    monkeypatch.setattr(front, "_time", clock)
    best_of = {frame_of(it.layout): it for it in plan.layouts}
    search = front._FrontSearch(job, model, cluster, best_of, list(plan.layouts), 1.0, clock.t, 10_000.0, 1,  # noqa: SLF001
                                None, None, None, 0.01)
    search.first = []
    search.idle = search._point_ids()  # noqa: SLF001 - nothing to fill
    f = frame_of(plan.layouts[0].layout)
    monkeypatch.setattr(search.visits, "pop", lambda: f)
    search.seen = set()

    def visit(g):
        if round(clock.t - search.started) in change_at:
            fastest = min(search.points, key=lambda it: it.rank_time_s)
            tps = fastest.evaluation.step.rank_tokens_per_s_per_gpu
            faster = SimpleNamespace(layout=fastest.layout, rank_time_s=fastest.rank_time_s - 1.0,
                                     peak_bytes=fastest.peak_bytes,
                                     evaluation=SimpleNamespace(step=SimpleNamespace(
                                         rank_tokens_per_s_per_gpu=2 * tps)))
            search.points = search.points + [faster]
            search.idle = search._point_ids()  # noqa: SLF001

    monkeypatch.setattr(search, "visit", visit)
    monkeypatch.setattr(search, "fits_bound", lambda g: True)
    start = search.started
    search.seed()
    return clock.t - start


def test_the_front_seeding_stops_once_stalled(small, monkeypatch):
    """The clock moves 1 s a reading and a visit every second. No change: it stops at its least patience
    (POLICY.front_patience_s, 10 s), not at its share of the 10,000 s. A change at 8 s: it goes on as long again
    without one, to 16 s; changes at 8 and 14 s: to 28 s (the loop sees a change at its next reading: slack)."""
    assert POLICY.front_patience_s == 10.0
    assert 10 <= _seed_until(small, monkeypatch, set()) <= 12
    assert 16 <= _seed_until(small, monkeypatch, {8}) <= 20
    assert 28 <= _seed_until(small, monkeypatch, {8, 14}) <= 32
