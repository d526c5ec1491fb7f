"""The fastest layouts' configurations and splits priced on their siblings (search/incumbents.spread): the frames
that differ only in FSDP degrees and sharding policies. Expected values are evaluate() of layouts written out by
hand (make_layout with the sibling's degrees and the source's split and toggles), not spread's own construction."""

from __future__ import annotations

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.search.frames import enumerate_frames, frame_of
from k3opt.search.incumbents import spread
from k3opt.search.result import PlanItem

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


def test_the_driver_bounds_the_sibling_pricing_by_its_time_limit(tiny, slow, pp2_job, monkeypatch, use_policy):
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
    use_policy(bound_share=0.0)
    use_policy(first_patience_s=0.0)  # the first part stops at once: the second always runs
    seen_done: list[bool] = []

    def slow_seed(*a, **k):
        out = real_seed(*a, **k)
        if k.get("done") is not None:
            seen_done.append(True)
            time.sleep(max(0.0, before + limit - 0.2 - time.monotonic()))
        return out

    monkeypatch.setattr(driver, "seed", slow_seed)
    before = time.monotonic()
    k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, time_limit=limit)
    assert len(calls) == 1 and seen_done
    deadline, stop = calls[0]
    assert before < deadline <= before + limit + 0.05  # plan() starts its clock a few ms after `before`
    assert callable(stop) and stop() is False


def _k3_8192(fe: int, fd: int, zero2: bool) -> k3opt.Layout:
    """K3 at 8,192 GPUs (the default job's 32,768 tokens per GPU per update), PP8 VP4 EP64 M64, optim / optim
    sharding, selective recompute, offload on: the layout the 8,192-GPU search found first (eFSDP8 dFSDP128, its
    split and toggles), with the FSDP degrees and the ZeRO-2 host gradients toggle given."""
    return make_layout(
        gpus=8192, pp=8, vp=4, ep=64, expert_fsdp=fe, dense_fsdp=fd, microbatches=64, context=4096, rows=1,
        split=[3] * 28 + [2, 3, 2, 2], recompute="selective", fsdp_lifecycle="per_microbatch",
        toggles=dict(fp8_activations=True, activation_offload=True, balance_activations=True,
                     moe_backward_rewrite=True, dispatch_recompute=True, fused_situ=True,
                     pipeline_zero2_host_grads=zero2, fused_cross_entropy=True),
        reserve_gib=4.0, domain_gpus_used=64, dense_sharding="optim", expert_sharding="optim",
        runtime="megatron-te-hybridep-gb200")


def test_spread_prices_a_sibling_without_the_memory_toggles_its_source_gets_for_free(tilus_bf16_cluster):
    """A memory toggle that costs the source nothing can cost a sibling seconds. K3 at 8,192 GPUs, at the BF16 GEMM
    rate this scenario was found at (`tilus_bf16_cluster`; at the shipped, slower rate the sibling's host traffic
    hides too): eFSDP8 dFSDP128
    takes the same step with or without the ZeRO-2 host gradients (its host traffic hides) and keeps them, being
    leaner; on the eFSDP2 dFSDP64 sibling they add seconds. The sibling is priced without them too, at its own
    evaluate() time under the source's split (18.58 s against 18.76 s for the source when measured)."""
    base = k3opt.load_job("k3-512-4k")
    model, cluster = k3opt.load_model(base.model), tilus_bf16_cluster
    job = k3opt.Job.model_validate({**base.model_dump(), "gpus": 8192, "tokens_per_update": 32768 * 8192})
    src = k3opt.evaluate(_k3_8192(8, 128, True), model=model, cluster=cluster)
    src_off = k3opt.evaluate(_k3_8192(8, 128, False), model=model, cluster=cluster)
    on = k3opt.evaluate(_k3_8192(2, 64, True), model=model, cluster=cluster)
    off = k3opt.evaluate(_k3_8192(2, 64, False), model=model, cluster=cluster)
    # The premise: free on the source (same step, less memory), seconds on the sibling, which fits without it.
    assert src.fits and src_off.fits and src_off.step.rank_time_s == src.step.rank_time_s
    assert src.peak_bytes < src_off.peak_bytes
    assert off.fits and off.step.rank_time_s < src.step.rank_time_s
    assert not on.fits or on.step.rank_time_s > 1.1 * off.step.rank_time_s
    f, g = frame_of(src.layout), frame_of(off.layout)
    got = spread(job, {f: PlanItem(src.layout, src)}, [f, g], model, cluster, deadline=float("inf"))
    assert set(got) == {g}
    assert not got[g].layout.toggles.pipeline_zero2_host_grads
    assert got[g].rank_time_s == off.step.rank_time_s


def test_seed_walks_one_frame_per_shape_and_prices_its_siblings(tiny, slow, pp2_job, monkeypatch, use_policy):
    """The seeding walks one frame per shape up to the FSDP degrees and sharding policies (`_siblings_key`); the
    siblings are priced under the configurations found, not walked. At 8,192 GPUs eight walks of PP4 VP4 EP64
    siblings took the seeding's time and the faster PP8 VP4 shape was never visited. With no time share on the walks
    (every frame visited may walk), the six-layer model's frames are walked once per (VP) shape."""
    import math

    import k3opt.search.incumbents as inc

    frames = enumerate_frames(pp2_job, tiny, 8)
    walks: list = []
    priced: list = []
    real_walk, real_price = inc.frame_walk, inc.price_configs

    def walk(job, f, *a, **k):
        walks.append(f)
        return real_walk(job, f, *a, **k)

    def price(job, f, *a, **k):
        priced.append(f)
        return real_price(job, f, *a, **k)

    monkeypatch.setattr(inc, "frame_walk", walk)
    monkeypatch.setattr(inc, "price_configs", price)
    use_policy(seed_walk_share=math.inf)
    vp2 = [f for f in frames if f.vp == 2]
    src = _layout(2, 4, "optim_grads_params", 2, [1, 2, 2, 1], "full").model_copy(
        update={"microbatches": vp2[0].microbatches})
    ev = k3opt.evaluate(src, model=tiny, cluster=slow)
    inc.seed(pp2_job, frames, tiny, slow, {frame_of(ev.layout): PlanItem(ev.layout, ev)}, math.inf,
             walk_first=False)
    keys = [inc._siblings_key(f) for f in walks]
    assert len(keys) == len(set(keys)) == len({inc._siblings_key(f) for f in frames}) == 2
    assert len(set(priced)) > len(walks)  # the siblings of the walked frames are priced all the same
