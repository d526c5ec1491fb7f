"""The fastest layouts' configurations and splits priced on their siblings (search/incumbents.spread): the frames
that differ only in FSDP degrees and sharding policies. Expected values are evaluate() of layouts written out by
hand (make_layout with the sibling's degrees and the source's split and toggles), not spread's own construction."""

from __future__ import annotations

import k3opt
from k3opt.search.frames import enumerate_frames, frame_of
from k3opt.search.incumbents import spread
from k3opt.search.result import PlanItem
from k3opt.specs import make_layout

TOGGLES = dict(fp8_activations=True, activation_offload=True)


def _layout(fe: int, fd: int, dense: str, vp: int, split: list[int], recompute: str) -> k3opt.Layout:
    return make_layout(gpus=8, pp=2, vp=vp, ep=2, expert_fsdp=fe, dense_fsdp=fd, microbatches=4 * 2 // 2,
                       context=2048, split=split, recompute=recompute, fsdp_lifecycle="per_microbatch",
                       toggles=TOGGLES, reserve_gib=2.4, dense_sharding=dense, expert_sharding="optim_grads_params")


def test_spread_prices_the_source_on_every_sibling(tiny, slow, pp2_job):
    job = pp2_job
    frames = enumerate_frames(job, tiny, 8)
    vp2 = [f for f in frames if f.vp == 2]
    # 3 dense x 2 expert FSDP degrees x 2 dense policies, less the two that coincide at dense FSDP 1.
    assert len(vp2) == 10 and any(f.vp == 1 for f in frames)
    split, rc = [1, 2, 2, 1], "full"
    src = _layout(2, 4, "optim_grads_params", 2, split, rc)
    src = src.model_copy(update={"microbatches": vp2[0].microbatches})
    ev = k3opt.evaluate(src, model=tiny, cluster=slow)
    assert ev.fits
    f = frame_of(ev.layout)
    got = spread(job, {f: PlanItem(ev.layout, ev)}, frames, tiny, slow, deadline=float("inf"))
    expected = {}
    for g in vp2:
        if g == f:
            continue
        lay = _layout(g.expert_fsdp, g.dense_fsdp, g.dense_sharding, 2, split, rc).model_copy(
            update={"microbatches": g.microbatches})
        e = k3opt.evaluate(lay, model=tiny, cluster=slow)
        if e.fits:
            expected[g] = e.step.rank_time_s
    assert expected and len(expected) < len(vp2) - 1  # some siblings do not fit at this reserve, some do
    assert {g: it.rank_time_s for g, it in got.items()} == expected
    # Only siblings: the VP1 frames (another split length) and the source's own frame are left alone.
    assert all(g.vp == 2 and g != f for g in got)
    for it in got.values():
        assert list(it.layout.split) == split and it.layout.recompute == rc
        assert it.layout.toggles.fp8_activations and it.layout.toggles.activation_offload


def test_spread_keeps_a_faster_entry_and_stops_at_its_deadline(tiny, slow, pp2_job):
    job = pp2_job
    frames = enumerate_frames(job, tiny, 8)
    vp2 = [f for f in frames if f.vp == 2]
    src = _layout(2, 4, "optim_grads_params", 2, [1, 2, 2, 1], "full").model_copy(
        update={"microbatches": vp2[0].microbatches})
    ev = k3opt.evaluate(src, model=tiny, cluster=slow)
    f = frame_of(ev.layout)
    first = spread(job, {f: PlanItem(ev.layout, ev)}, frames, tiny, slow, deadline=float("inf"))
    g, it = next(iter(first.items()))
    # A sibling entry at least as fast (its own layout, already priced) is not replaced.
    again = spread(job, {f: PlanItem(ev.layout, ev), g: it}, frames, tiny, slow, deadline=float("inf"))
    assert g not in again and again.keys() == first.keys() - {g}
    assert spread(job, {f: PlanItem(ev.layout, ev)}, frames, tiny, slow, deadline=-1.0) == {}
    assert spread(job, {}, frames, tiny, slow, deadline=float("inf")) == {}


def test_spread_replaces_a_slower_entry_and_keeps_a_strictly_faster_one(tiny, slow, pp2_job):
    """Sibling entries priced by hand: dense FSDP 4 with split 2+2+1+1 is faster than the source's 1+2+2+1 on that
    frame (5.014 s against 5.084 s when measured), so it stays; dense FSDP 2 with split 2+1+1+2 is slower than
    1+2+2+1 there (5.509 s against 5.194 s), so the source's split replaces it."""
    job = pp2_job
    frames = enumerate_frames(job, tiny, 8)
    m = next(f for f in frames if f.vp == 2).microbatches
    src = k3opt.evaluate(_layout(2, 4, "optim_grads_params", 2, [1, 2, 2, 1], "full").model_copy(
        update={"microbatches": m}), model=tiny, cluster=slow)
    fast = k3opt.evaluate(_layout(1, 4, "optim_grads_params", 2, [2, 2, 1, 1], "full").model_copy(
        update={"microbatches": m}), model=tiny, cluster=slow)
    slow_entry = k3opt.evaluate(_layout(1, 2, "optim_grads_params", 2, [2, 1, 1, 2], "full").model_copy(
        update={"microbatches": m}), model=tiny, cluster=slow)
    same_split_fast = k3opt.evaluate(_layout(1, 4, "optim_grads_params", 2, [1, 2, 2, 1], "full").model_copy(
        update={"microbatches": m}), model=tiny, cluster=slow)
    same_split_slow = k3opt.evaluate(_layout(1, 2, "optim_grads_params", 2, [1, 2, 2, 1], "full").model_copy(
        update={"microbatches": m}), model=tiny, cluster=slow)
    assert all(e.fits for e in (src, fast, slow_entry, same_split_fast, same_split_slow))
    assert fast.step.rank_time_s < same_split_fast.step.rank_time_s
    assert slow_entry.step.rank_time_s > same_split_slow.step.rank_time_s
    found = {frame_of(e.layout): PlanItem(e.layout, e) for e in (src, fast, slow_entry)}
    got = spread(job, found, frames, tiny, slow, deadline=float("inf"))
    assert frame_of(fast.layout) not in got
    g = frame_of(slow_entry.layout)
    assert list(got[g].layout.split) == [1, 2, 2, 1]
    assert got[g].rank_time_s == same_split_slow.step.rank_time_s
    # Ctrl-C: the stop flag ends the pricing before the first sibling.
    assert spread(job, found, frames, tiny, slow, deadline=float("inf"), stop=lambda: True) == {}


def test_the_driver_bounds_the_sibling_pricing_by_its_time_limit(tiny, slow, pp2_job, monkeypatch):
    """The plan's call of spread: its deadline is within the plan's time limit (never the full `budget` past it) and
    it gets the Ctrl-C flag as its stop (not set in a plain run)."""
    import time

    import k3opt.search.driver as driver

    calls: list[tuple[float, object]] = []
    real = driver.spread

    def spy(*a, **k):
        calls.append((a[5], k.get("stop")))
        return real(*a, **k)

    monkeypatch.setattr(driver, "spread", spy)
    # A 2-s limit (a 1-s budget per heuristic phase): the seeding after the bounding pass (none here, so that the
    # seeding's second part runs) is made to end 0.2 s before the limit, where the pricing's own 1-s budget alone
    # would run 0.8 s past it.
    limit = 2.0
    real_seed = driver.seed
    monkeypatch.setattr(driver, "BOUND_SHARE", 0.0)
    monkeypatch.setattr(driver, "FIRST_PATIENCE_S", 0.0)  # the first part stops at once: the second always runs
    seen_done: list[bool] = []

    def slow_seed(*a, **k):
        out = real_seed(*a, **k)
        if k.get("done") is not None:
            seen_done.append(True)
            time.sleep(max(0.0, before + limit - 0.2 - time.monotonic()))
        return out

    monkeypatch.setattr(driver, "seed", slow_seed)
    before = time.monotonic()
    k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, pareto=False, time_limit=limit)
    assert len(calls) == 1 and seen_done
    deadline, stop = calls[0]
    assert before < deadline <= before + limit + 0.05  # plan() starts its clock a few ms after `before`
    assert callable(stop) and stop() is False
