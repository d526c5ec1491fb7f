"""The seeding's configurations carry over between its calls (search/incumbents.seed, `configs`): a frame walked in
one call is climbed in the next from every configuration priced for it, not only from its fastest layout. On the
default job the fastest PP8 VP4 shape's walk prices it at 18.72 s under one configuration and 19.01 s under
another; only the second climbs (to 18.63 s)."""

from __future__ import annotations

import math

import k3opt
import k3opt.search.incumbents as inc
from k3opt.inputs.presets import make_layout
from k3opt.search.frames import enumerate_frames, frame_of
from k3opt.search.result import PlanItem


def plan_item(job, m, recompute, tiny, slow) -> PlanItem:
    lay = make_layout(gpus=8, pp=2, vp=2, ep=2, expert_fsdp=2, dense_fsdp=4, microbatches=m, context=2048,
                      split=[1, 2, 2, 1], recompute=recompute, fsdp_lifecycle="per_microbatch",
                      toggles=dict(fp8_activations=True, activation_offload=True), reserve_gib=job.reserve_gib,
                      dense_sharding="optim", expert_sharding="optim_grads_params")
    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
    assert ev.fits
    return PlanItem(ev.layout, ev)


def test_a_later_call_climbs_every_configuration_priced_before(tiny, slow, pp2_job, monkeypatch, use_policy):
    job = pp2_job.model_copy(update={"reserve_gib": 1.0})  # room for the layout without recompute
    m = next(f for f in enumerate_frames(job, tiny, 8) if f.vp == 2).microbatches
    fast, slower = plan_item(job, m, "none", tiny, slow), plan_item(job, m, "full", tiny, slow)
    # 4.21 s without recompute, 4.89 s with full recompute (a replayed forward): distinct times, both kept.
    assert fast.rank_time_s < slower.rank_time_s
    f = frame_of(fast.layout)
    climbed: list[str] = []

    def record(job_, it, *a, **k):
        climbed.append(it.layout.recompute.value)
        return it

    monkeypatch.setattr(inc, "split_climb", record)
    use_policy(climb_within=0.5)  # both within reach of the fastest on this model
    configs = {f: {inc.config_of(it.layout): it for it in (fast, slower)}}
    inc.seed(job, [], tiny, slow, {f: fast}, math.inf, walk_first=False, configs=configs)
    assert sorted(climbed) == ["full", "none"]
    # Without the earlier call's configurations the climb starts from the frame's fastest layout only.
    climbed.clear()
    inc.seed(job, [], tiny, slow, {f: fast}, math.inf, walk_first=False)
    assert climbed == ["none"]


def test_the_driver_shares_one_record_between_its_seeding_calls(tiny, slow, pp2_job, monkeypatch):
    import k3opt.search.driver as driver

    seen: list[dict | None] = []
    real = driver.seed

    def spy(*a, **k):
        seen.append(k.get("configs"))
        return real(*a, **k)

    monkeypatch.setattr(driver, "seed", spy)
    k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, time_limit=20)
    # Two calls before the bounding pass's, a third after it unless its bounds close the search at once.
    assert len(seen) >= 2 and seen[0] is not None and all(c is seen[0] for c in seen)
