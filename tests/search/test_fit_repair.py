"""incumbents.fit_repair: a layout over its GPUs brought under the memory line by moving layers, its configuration
kept, and the node hint that uses it. On the six-layer model at PP2 VP2 (no recompute, no toggles), enumerated
through evaluate() at a 1.0-GiB reserve: the fastest split, [1, 1, 3, 1] at 4.3619 s, is 0.42 GiB over; the fastest
that fits are [1, 2, 2, 1] and [1, 1, 2, 2] at 4.5112 s, one layer moved off the third chunk."""

from __future__ import annotations

import itertools
import math
import time
from types import SimpleNamespace

import pytest
from conftest import PP2_VP2_TOGGLES, contiguous_splits, pp2_vp2_memory_job

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import driver, enumerate_frames, incumbents
from k3opt.search.incumbents import fit_repair, frame_incumbent
from k3opt.search.policy import POLICY
from k3opt.search.result import PlanItem


def _layout(f, split: list[int], reserve: float) -> k3opt.Layout:  # noqa: ANN001 - a Frame
    return make_layout(gpus=8, pp=2, vp=2, ep=2, dense_fsdp=2, microbatches=f.microbatches, context=2048,
                       split=split, recompute="none", fsdp_lifecycle="per_microbatch", toggles={},
                       reserve_gib=reserve)


def _fitting(f, reserve: float, tiny, slow) -> list[tuple[float, list[int]]]:  # noqa: ANN001
    out = []
    for split in contiguous_splits(tiny.num_layers, 4):
        ev = k3opt.evaluate(_layout(f, split, reserve), model=tiny, cluster=slow)
        if ev.fits:
            out.append((ev.step.rank_time_s, split))
    return sorted(out)


def test_a_layout_over_its_gpus_is_moved_under_them(tiny, slow):
    job = pp2_vp2_memory_job(1.0)
    (f,) = enumerate_frames(job, tiny, 8)
    start = k3opt.evaluate(_layout(f, [1, 1, 3, 1], 1.0), model=tiny, cluster=slow)
    assert not start.fits
    best_t, _ = _fitting(f, 1.0, tiny, slow)[0]
    got = fit_repair(job, PlanItem(start.layout, start), tiny, slow, time.monotonic() + 30)
    assert got is not None and got.evaluation.fits
    assert got.rank_time_s == pytest.approx(best_t, abs=1e-6)
    lay = got.layout
    assert (lay.pp, lay.vp, lay.recompute, lay.fsdp_lifecycle, lay.toggles) == (2, 2, start.layout.recompute,
                                                                               start.layout.fsdp_lifecycle,
                                                                               start.layout.toggles)


def test_the_repair_passes_through_layouts_that_do_not_fit(tiny, slow):
    """From [3, 1, 1, 1] (1.55 GiB over at a 1.0-GiB reserve) no single move fits: [2, 2, 1, 1], [2, 1, 2, 1] and
    [2, 1, 1, 2] leave 0.67, 0.29 and 0.74 GiB under HBM against the 1.0 GiB reserved. Two moves reach the fastest
    fitting split, 4.5112 s."""
    job = pp2_vp2_memory_job(1.0)
    (f,) = enumerate_frames(job, tiny, 8)
    start = k3opt.evaluate(_layout(f, [3, 1, 1, 1], 1.0), model=tiny, cluster=slow)
    for one in ([2, 2, 1, 1], [2, 1, 2, 1], [2, 1, 1, 2]):
        assert not k3opt.evaluate(_layout(f, one, 1.0), model=tiny, cluster=slow).fits
    got = fit_repair(job, PlanItem(start.layout, start), tiny, slow, time.monotonic() + 30)
    assert got is not None and got.evaluation.fits
    assert got.rank_time_s == pytest.approx(_fitting(f, 1.0, tiny, slow)[0][0], abs=1e-6)


def test_no_split_fits_no_repair(tiny, slow):
    """At a 1.4-GiB reserve no split of this configuration fits (the leanest is 1.32 GiB under HBM): None."""
    job = pp2_vp2_memory_job(1.4)
    (f,) = enumerate_frames(job, tiny, 8)
    assert not _fitting(f, 1.4, tiny, slow)
    start = k3opt.evaluate(_layout(f, [1, 1, 3, 1], 1.4), model=tiny, cluster=slow)
    assert fit_repair(job, PlanItem(start.layout, start), tiny, slow, time.monotonic() + 30) is None


def test_a_fitting_layout_is_returned_as_it_is(tiny, slow):
    job = pp2_vp2_memory_job(1.0)
    (f,) = enumerate_frames(job, tiny, 8)
    ev = k3opt.evaluate(_layout(f, [1, 2, 2, 1], 1.0), model=tiny, cluster=slow)
    item = PlanItem(ev.layout, ev)
    assert fit_repair(job, item, tiny, slow, time.monotonic() + 30) is item


def test_the_enumerated_fits_are_what_the_docstring_says(tiny, slow):
    job = pp2_vp2_memory_job(1.0)
    (f,) = enumerate_frames(job, tiny, 8)
    fits = _fitting(f, 1.0, tiny, slow)
    assert fits[0][0] == pytest.approx(4.5112, abs=1e-4)
    assert sorted(s for t, s in fits if abs(t - fits[0][0]) < 1e-9) == [[1, 1, 2, 2], [1, 2, 2, 1]]
    assert not any(s == [1, 1, 3, 1] for _, s in fits)


def test_the_node_hint_repairs_a_faster_candidate(tiny, slow):
    """frame_incumbent with `repair_below` (what the driver passes on a node's first slice): at a 2.2-GiB reserve
    the no-recompute node's heuristic candidates give 4.946 s (the split balanced per rank; the others 5.147 s);
    with their misfits repaired, 4.912 s ([1, 1, 3, 1], from a 5.050-s misfit: a repair can end faster than where
    it starts). Neither is under the node's enumerated optimum over every split and setting of its toggles
    (4.362 s: [1, 1, 3, 1] with offload)."""
    job = pp2_vp2_memory_job(2.2)
    (f,) = enumerate_frames(job, tiny, 8)
    plain = frame_incumbent(job, f, tiny, slow, recompute=Recompute.NONE, lifecycle=FsdpLifecycle.PER_MICROBATCH)
    fixed = frame_incumbent(job, f, tiny, slow, recompute=Recompute.NONE, lifecycle=FsdpLifecycle.PER_MICROBATCH,
                            repair_below=math.inf)
    assert plain is not None and fixed is not None and fixed.evaluation.fits
    assert fixed.rank_time_s < plain.rank_time_s - 0.03
    best = math.inf
    for flags in itertools.product([False, True], repeat=len(PP2_VP2_TOGGLES)):
        toggles = dict(zip(PP2_VP2_TOGGLES, flags, strict=True))
        for split in contiguous_splits(tiny.num_layers, 4):
            lay = make_layout(gpus=8, pp=2, vp=2, ep=2, dense_fsdp=2, microbatches=f.microbatches, context=2048,
                              split=split, recompute="none", fsdp_lifecycle="per_microbatch", toggles=toggles,
                              reserve_gib=2.2)
            ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
            if ev.fits:
                best = min(best, ev.step.rank_time_s)
    assert best == pytest.approx(4.3619, abs=1e-4)
    assert fixed.rank_time_s >= best - 1e-9


def test_the_node_floor_lets_a_misfit_over_the_line_be_repaired(tiny, slow):
    """A misfit's own time does not bound its repair's: on the node above, two misfits at 4.500 s find no fitting
    split, and one at 5.050 s repairs to 4.912 s. Under a line of 5.0 s (the driver's top-th layout) that one is
    repaired only when the node's proven floor is under the line: with the node's enumerated optimum, 4.362 s, as
    the floor the hint is 4.912 s; with no floor, or a floor of 5.1 s over the line, it stays the per-rank split's
    4.946 s."""
    job = pp2_vp2_memory_job(2.2)
    (f,) = enumerate_frames(job, tiny, 8)

    def hint(floor: float) -> float:
        it = frame_incumbent(job, f, tiny, slow, recompute=Recompute.NONE, lifecycle=FsdpLifecycle.PER_MICROBATCH,
                             repair_below=5.0, floor=floor)
        assert it is not None and it.evaluation.fits
        return it.rank_time_s

    assert hint(math.inf) == pytest.approx(4.946, abs=1e-3)
    assert hint(5.1) == pytest.approx(4.946, abs=1e-3)
    assert hint(4.362) == pytest.approx(4.912, abs=1e-3)


class _Clock:
    """A monotonic clock that moves only when a repair runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _misfit(t: float) -> SimpleNamespace:
    """What `_repair_misfits` reads of a misfit's Evaluation: its ranked time and its layout."""
    return SimpleNamespace(step=SimpleNamespace(rank_time_s=t), layout=f"split at {t}")


def _run_repairs(monkeypatch: pytest.MonkeyPatch, times: list[float], floor: float, line: float = 5.0,
                 best_main: float = 5.2, use: float = 0.6, out: list | None = None) -> list[tuple[float, float]]:
    """`_repair_misfits` over misfits ranked at `times` (in that order), each repair taking `use` x
    POLICY.fit_repair_s of the clock and ending 0.5 s under its misfit; returns (misfit, seconds it was given) per
    repair, in order (and appends what `_repair_misfits` returned to `out`)."""
    clock = _Clock()
    calls: list[tuple[float, float]] = []
    share = POLICY.fit_repair_s

    def repair(job, item, model, cluster, deadline):  # noqa: ANN001, ANN202 - fit_repair's signature
        t = item.evaluation.step.rank_time_s
        calls.append((t, deadline - clock.now))
        clock.now += use * share
        return SimpleNamespace(rank_time_s=t - 0.5)

    monkeypatch.setattr(incumbents, "_time", SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(incumbents, "fit_repair", repair)
    got = incumbents._repair_misfits(None, [_misfit(t) for t in times], None, None, None, best_main, line, floor,
                                     clock.now + 100 * share)
    if out is not None:
        out.append(got)
    return calls


def test_misfits_are_repaired_fastest_first_under_a_cut_that_falls_with_each_repair(monkeypatch):
    """Without a floor under the cut only misfits under it are repaired: cut = min(line 5.0, the others' best 5.2)
    = 5.0; the 4.0-s misfit repairs to 3.5 s, which lowers the cut to 3.5, so the 4.5-s one is not tried. Given in
    any order, the fastest goes first (4.5 first would repair to 4.0 and leave 4.0 over the cut)."""
    assert [t for t, _ in _run_repairs(monkeypatch, [4.5, 7.0, 4.0, 6.0, 5.5], floor=math.inf)] == [4.0]
    # A floor at the cut proves no layout under it: nothing over the cut is tried either.
    assert [t for t, _ in _run_repairs(monkeypatch, [4.5, 7.0, 4.0, 6.0, 5.5], floor=3.5)] == [4.0]


def test_repairs_over_the_cut_share_one_repairs_time(monkeypatch):
    """With the node's floor under the cut, misfits over it are repaired too, in their order, while one repair's
    time (POLICY.fit_repair_s, F) is left of their shared budget: 4.0 (under the cut, its own F), then 4.5 (over:
    given F, uses 0.6 F) and 5.5 (given the 0.4 F left, uses 0.6 F); the budget is then spent, 6.0 and 7.0 are not
    tried."""
    calls = _run_repairs(monkeypatch, [4.5, 7.0, 4.0, 6.0, 5.5], floor=1.0)
    share = POLICY.fit_repair_s
    assert [t for t, _ in calls] == [4.0, 4.5, 5.5]
    assert [s / share for _, s in calls] == pytest.approx([1.0, 1.0, 0.4])


def test_the_cut_is_strict_on_both_sides(monkeypatch):
    """A misfit ranked at the cut is over it (no floor: not tried), a repair that ends at the cut does not count (the
    5.5-s misfit, tried under a floor of 1.0, repairs to 5.0 = the cut: no layout returned), and a budget spent to
    exactly nothing ends the repairs over the cut (each taking half of F: 4.5 and 5.5 spend it, 6.0 is not tried)."""
    assert _run_repairs(monkeypatch, [6.0, 5.0], floor=math.inf) == []
    got: list = []
    assert [t for t, _ in _run_repairs(monkeypatch, [5.5], floor=1.0, out=got)] == [5.5]
    assert got == [None]
    assert [t for t, _ in _run_repairs(monkeypatch, [4.5, 7.0, 4.0, 6.0, 5.5], floor=1.0, use=0.5)] == [4.0, 4.5, 5.5]


def test_the_driver_hints_each_node_with_its_proven_floor(monkeypatch):
    """The driver passes a node's bound as the hint's floor (the repair rule above): on the 2.2-GiB job every node
    hinted gets a finite, positive floor at or under the job's enumerated optimum, 4.3619 s (the docstring of
    test_the_node_hint_repairs_a_faster_candidate), which the plan reaches."""
    floors: list[float] = []
    hint = driver.frame_incumbent

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - frame_incumbent's signature
        floors.append(kwargs["floor"])
        return hint(*args, **kwargs)

    monkeypatch.setattr(driver, "frame_incumbent", spy)
    plan = k3opt.plan(pp2_vp2_memory_job(2.2), top=1, time_limit=30)
    assert plan.layouts[0].rank_time_s == pytest.approx(4.3619, abs=1e-4)
    assert floors
    assert all(0 < fl <= 4.3619 for fl in floors)
