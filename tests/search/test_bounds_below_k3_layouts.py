"""Every search bound of a frame lies below the ranked step time of real K3 layouts of that frame, on the
shipped GB200 rates (where the activation toggles lower the elementwise kernels' time, so the mode without
toggles is not the least work). The layouts are the kind the anytime Pareto front finds: interleaved, selective
recompute with FP8 activations, fused SiTU, the MoE backward rewrite and activation offload (host-link-bound)."""

from __future__ import annotations

import itertools
import math

import pytest

import k3opt
from k3opt.cost.coefficients import coefficients
from k3opt.inputs.specs import FsdpLifecycle, Layout, Recompute
from k3opt.search import bounds
from k3opt.search.frames import ACT_TOGGLES, ActMode, Frame, frame_of, frame_shape
from k3opt.search.ranking import coarse_work_floor, ranked_coefficients, work_floor

TOGGLES = {"fp8_activations": True, "activation_offload": True, "moe_backward_rewrite": True, "fused_situ": True}


def _layout(vp: int, split: list[int]) -> Layout:
    return Layout(gpus=512, pp=8, vp=vp, cp=1, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, rows=1,
                  context=4096, split=split, recompute="selective", toggles=TOGGLES, dense_sharding="optim_grads",
                  expert_sharding="optim", reserve_gib=4.0, domain_gpus_used=64,
                  runtime="megatron-te-hybridep-gb200")


@pytest.mark.parametrize(("vp", "split"), [
    (3, [3] + [4] * 22 + [2]),          # 93 layers in 24 chunks
    (2, [5, 5] + [6] * 13 + [5]),       # 93 layers in 16 chunks
    (4, [2] + [3] * 30 + [1]),          # 93 layers in 32 chunks
])
def test_every_bound_is_below_an_interleaved_k3_layout(vp: int, split: list[int]) -> None:
    job = k3opt.load_job("k3-512-4k")
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    lay = _layout(vp, split)
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    assert ev.fits
    ranked = ev.step.rank_time_s
    f = frame_of(lay)
    assert bounds.frame_lower_bound(job, f, model, cluster)[0] <= ranked
    assert bounds.frame_dp_bound(job, f, model, cluster)[0] <= ranked
    assert bounds.node_lower_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model,
                                   cluster)[0] <= ranked
    assert bounds.tight_node_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model,
                                   cluster) <= ranked


# Every activation toggle, offload, each recompute mode and VP1-VP4 on the frame of the layouts above (even splits:
# 93 layers over 8 VP chunks). Which of them fit the 4 GiB reserve was read from evaluate(); the test asserts it.
SETS = {
    "plain": {},
    "fp8": {"fp8_activations": True},
    "offload": {"activation_offload": True},
    "situ_rewrite": {"fused_situ": True, "moe_backward_rewrite": True},
    "dispatch": {"dispatch_recompute": True},
    "all": TOGGLES,
}
FITTING = {Recompute.FULL: list(SETS), Recompute.SELECTIVE: ["all"]}


def _even(vp: int) -> list[int]:
    k = 8 * vp
    return [93 // k + (1 if j < 93 % k else 0) for j in range(k)]


@pytest.fixture(scope="module")
def k3_specs():
    return k3opt.load_job("k3-512-4k"), k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")


@pytest.mark.parametrize("vp", [1, 2, 3, 4])
def test_every_bound_is_below_k3_layouts_under_each_toggle(vp: int, k3_specs) -> None:
    """Each bound lies below the step formula (the quantity the bounds bound; the ranked time is at least it) of
    every fitting layout of its node, and the frame's time bound (no memory test) below every layout of the
    frame, fitting or not, under each recompute mode and toggle set."""
    job, model, cluster = k3_specs
    evs = {}
    for rc in Recompute:
        for name, tg in SETS.items():
            lay = Layout(**{**_layout(vp, _even(vp)).model_dump(), "recompute": rc, "toggles": tg})
            evs[rc, name] = k3opt.evaluate(lay, model=model, cluster=cluster)
    f = frame_of(evs[Recompute.FULL, "plain"].layout)
    t_frame = bounds.frame_lower_bound(job, f, model, cluster)[0]
    assert t_frame <= min(ev.step.formula_time_s for ev in evs.values())
    t_dp = bounds.frame_dp_bound(job, f, model, cluster)[0]
    for rc, names in FITTING.items():
        node = [evs[rc, n] for n in names]
        if vp == 2 and rc == Recompute.SELECTIVE:
            assert not node[0].fits  # the even VP2 split is over the line under selective recompute
            continue
        assert all(ev.fits for ev in node)
        best = min(ev.step.formula_time_s for ev in node)
        lc = FsdpLifecycle.PER_MICROBATCH
        assert t_dp <= best
        assert bounds.node_lower_bound(job, f, rc, lc, model, cluster)[0] <= best
        assert bounds.tight_node_bound(job, f, rc, lc, model, cluster) <= best


@pytest.mark.parametrize("frame", [
    dict(pp=8, vp=1, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64),
    dict(pp=8, vp=3, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64),
    dict(pp=4, vp=2, ep=32, expert_fsdp=4, dense_fsdp=16, microbatches=32),
])
def test_work_floor_is_below_every_mode(frame: dict, k3_specs) -> None:
    """The work floor of a node (one recompute mode and lifecycle) and of a frame (every one) is at or below the
    ranked view of every activation mode it stands for, with each rank toggle on or off, array by array: the
    activation toggles lower the memory-bound kernels' time on the GB200 rates, so no single mode is the least."""
    job, model, cluster = k3_specs
    f = Frame(cp=1, gpus=512, domain_gpus_used=64, **frame)
    off = ActMode(Recompute.NONE, False, False, False, False)
    whole = work_floor(frame_shape(job, f, off, FsdpLifecycle.PER_MICROBATCH), model, cluster,
                       recomputes=tuple(Recompute), lifecycles=tuple(FsdpLifecycle))
    coarse = coarse_work_floor(frame_shape(job, f, off, FsdpLifecycle.PER_MICROBATCH), model, cluster)
    ranks = [{}, {"activation_offload": True}, {"balance_activations": True}, {"fused_cross_entropy": True},
             {"pipeline_zero2_host_grads": True}, {"p2p_muon": True}]
    for rc in Recompute:
        for lc in FsdpLifecycle:
            for rank in ranks:
                node = work_floor(frame_shape(job, f, ActMode(rc, False, False, False, False), lc, **rank), model,
                                  cluster)
                for flags in itertools.product([False, True], repeat=len(ACT_TOGGLES)):
                    view = ranked_coefficients(frame_shape(job, f, ActMode(rc, *flags), lc, **rank), model, cluster)
                    for res in view.time:
                        assert (node.time[res] <= view.time[res]).all(), (rc, lc, rank, flags, res)
                        assert (whole.time[res] <= view.time[res]).all(), (rc, lc, rank, flags, res)
                    for res in view.update:
                        assert (node.update[res] <= view.update[res]).all(), (rc, lc, rank, flags, res)
                        assert (whole.update[res] <= view.update[res]).all(), (rc, lc, rank, flags, res)
                    # The frame bound's floor: the tensor stream (GEMMs, kernels, exposed all-to-all) in sum.
                    assert coarse.time["tensor"].sum() <= view.time["tensor"].sum()
    # The floor keeps the kernels' time: it sits above the view without them (what the bounds used before).
    plain = ranked_coefficients(frame_shape(job, f, off, FsdpLifecycle.PER_MICROBATCH), model, cluster)
    raw = coefficients(frame_shape(job, f, off, FsdpLifecycle.PER_MICROBATCH), model, cluster)
    assert whole.time["tensor"].sum() > (plain.time["tensor"] - raw.achievable["vector"]).sum()


def test_seeding_finds_the_interleaved_k3_layout(k3_specs) -> None:
    """The plan's seeding (search/incumbents.seed, the front's walks): over PP8 VP1 and PP8 VP3 of the frame above,
    it reaches the VP3 layout the Pareto front finds (selective recompute with offload; its step from evaluate()
    here). On PP8 VP1 the heuristic set with every memory-saving toggle fits nothing (pipeline ZeRO-2's two chunk
    buffers outweigh the sharded gradients); the lean set without it does (test_lean_sets.py)."""
    from k3opt.search.incumbents import frame_incumbent, seed

    job, model, cluster = k3_specs
    target = k3opt.evaluate(_layout(3, [3] + [4] * 22 + [2]), model=model, cluster=cluster)
    assert target.fits
    f1 = frame_of(_layout(1, _even(1)))
    f3 = frame_of(target.layout)
    first = frame_incumbent(job, f1, model, cluster)
    assert first is not None and not first.layout.toggles.pipeline_zero2_host_grads
    out = seed(job, [f1, f3], model, cluster, {}, math.inf, walk_first=False)
    assert out[f1].evaluation.fits and out[f3].evaluation.fits
    assert out[f3].rank_time_s <= target.step.rank_time_s + 1e-9
    assert out[f3].layout.recompute == Recompute.SELECTIVE and out[f3].layout.toggles.activation_offload


def test_work_floor_is_below_every_mode_under_an_ep_overlap_schedule() -> None:
    """With the EP overlap schedule each all-to-all is exposed by max(0, exchange - its paired compute), which
    shrinks as the compute grows: Qwen3-30B-A3B on 32 B200 (EP32 over four 8-GPU nodes, DeepEP across the
    400 Gb/s NICs, where the exchange outlasts its partner), every recompute mode and activation-toggle set."""
    from dataclasses import replace

    from k3opt.cost.coefficients import Shape

    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    lay = k3opt.make_layout(gpus=32, pp=1, ep=32, dense_fsdp=32, expert_fsdp=1, microbatches=4, context=4096,
                            split=[48], recompute="none", precision="bf16", ep_overlap=True)
    base = replace(Shape.of(lay), toggles=lay.toggles.model_copy(update={t: False for t in ACT_TOGGLES}))
    assert base.ep_overlap
    floor = work_floor(base, model, cluster, recomputes=tuple(Recompute))
    for rc in Recompute:
        for flags in itertools.product([False, True], repeat=len(ACT_TOGGLES)):
            sh = replace(base, recompute=rc, toggles=base.toggles.model_copy(
                update=dict(zip(ACT_TOGGLES, flags, strict=True))))
            view = ranked_coefficients(sh, model, cluster)
            for res in view.time:
                assert (floor.time[res] <= view.time[res]).all(), (rc, flags, res)
