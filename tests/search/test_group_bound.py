"""One bound for the node of every FSDP variant of an interleaved shape (bounds.group_node_bound): below every
layout of every member (enumerated through evaluate() on the six-layer model, and a known K3 layout), below each
member's own tight bound, and still tight; the search that uses it still proves the enumerated optimum."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from conftest import contiguous_splits

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import Dtype, FsdpLifecycle, Recompute, ShardingPolicy
from k3opt.search import tight_node_bound
from k3opt.search.bounds import frame_dp_bound, group_frame_bound, group_node_bound
from k3opt.search.frames import enumerate_frames, policy_group, sharding_group
from k3opt.search.prefetch import Prefetch

DATA = Path(__file__).parents[1] / "data"
ALLOWED = ("fp8_activations", "activation_offload")
LC = FsdpLifecycle.PER_MICROBATCH



def _job(reserve: float) -> k3opt.Job:
    """PP2 VP2 on 8 GPUs, EP2, expert FSDP 1-2 and dense FSDP 1-4: six frames of one sharding group."""
    return k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": reserve,
        "search": {"pp": [2], "vp": [2], "cp": [1], "ep": [2], "expert_fsdp": [1, 2], "dense_fsdp": [1, 2, 4],
                   "dense_sharding": ["optim_grads_params"], "expert_sharding": ["optim_grads_params"],
                   "recompute": ["none", "full"], "fsdp_lifecycle": ["per_microbatch"],
                   "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in ALLOWED]},
    })


def _enumerated(job, frames, tiny, slow) -> dict:
    """(frame, recompute) -> the least ranked step time of its fitting layouts (None when none fits)."""
    out: dict = {}
    for f, rc in itertools.product(frames, ("none", "full")):
        best = None
        for flags in itertools.product([False, True], repeat=len(ALLOWED)):
            for split in contiguous_splits(tiny.num_layers, 4):
                lay = make_layout(gpus=8, pp=2, vp=2, ep=2, expert_fsdp=f.expert_fsdp, dense_fsdp=f.dense_fsdp,
                                  microbatches=f.microbatches, context=2048, split=split, recompute=rc,
                                  fsdp_lifecycle=LC, toggles=dict(zip(ALLOWED, flags, strict=True)),
                                  reserve_gib=job.reserve_gib, dense_sharding="optim_grads_params",
                                  expert_sharding="optim_grads_params")
                ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                if ev.fits and (best is None or ev.step.rank_time_s < best):
                    best = ev.step.rank_time_s
        out[(f, Recompute(rc))] = best
    return out


@pytest.mark.parametrize("reserve", [1.5, 2.2])
def test_group_bound_below_every_member_and_tight(tiny, slow, reserve):
    job = _job(reserve)
    frames = enumerate_frames(job, tiny, 8)
    assert len(frames) == 6 and len({sharding_group(f) for f in frames}) == 1
    best = _enumerated(job, frames, tiny, slow)
    fitting = [t for t in best.values() if t is not None]
    assert fitting, "the test needs fitting layouts"
    for rc in (Recompute.NONE, Recompute.FULL):
        group = group_node_bound(job, tuple(frames), rc, LC, tiny, slow)
        own = [tight_node_bound(job, f, rc, LC, tiny, slow) for f in frames]
        assert group <= min(own) + 1e-9, (rc, group, own)  # it relaxes each member's own program
        times = [best[(f, rc)] for f in frames if best[(f, rc)] is not None]
        if times:
            assert group <= min(times) + 1e-9, (rc, group, min(times))
            # Tight: the members differ only in FSDP traffic and persistent bytes, which the least of their arrays
            # keeps within a few percent of the fastest member's optimum on this model.
            assert group >= 0.9 * min(times), (rc, group, min(times))
            # Against a pruning line the members whose own floors reach it are left out of the program: the value
            # stays below every layout of every member and at least the lesser of the exact bound and the line.
            for scale in (0.5, 0.99, 1.01, 1.2, 2.0):
                line = min(times) * scale
                got = group_node_bound(job, tuple(frames), rc, LC, tiny, slow, stop_at=line)
                assert min(group, line) * (1 - 1e-8) <= got <= min(times) + 1e-9, (rc, scale, got, group)


@pytest.mark.parametrize("reserve", [1.5, 2.2])
def test_group_frame_bound_below_every_member(tiny, slow, reserve):
    """The frame-level bound over the six variants (`group_frame_bound`): below each member's own frame bound and
    below every enumerated layout of every member, and above zero (it carries the mean load)."""
    job = _job(reserve)
    frames = enumerate_frames(job, tiny, 8)
    best = [t for t in _enumerated(job, frames, tiny, slow).values() if t is not None]
    group = group_frame_bound(job, tuple(frames), tiny, slow)
    own = [frame_dp_bound(job, f, tiny, slow)[0] for f in frames]
    assert 0 < group <= min(own) + 1e-9
    assert group <= min(best) + 1e-9


@pytest.mark.parametrize("reserve", [1.5, 2.2])
def test_a_group_frame_bound_lifted_by_its_node_programs_stays_below_every_layout(tiny, slow, reserve):
    """`lift_group_bound`: the frame bound of the six variants raised by the group program of its least node. The
    no-recompute node holds the frame bound (its mean load); its group program (memory rows, chunks, paths) is
    higher, and full recompute's own bound higher still, so against a line the lifted bound is the lesser of that
    program and the line. It stays below every enumerated layout of every member, and every node value it
    returns is that node's program stopped at the line."""
    from k3opt.search.bounds import lift_group_bound

    job = _job(reserve)
    frames = tuple(enumerate_frames(job, tiny, 8))
    best = _enumerated(job, frames, tiny, slow)
    fastest = min(t for t in best.values() if t is not None)
    per_node: dict = {}
    plain = group_frame_bound(job, frames, tiny, slow, per_node=per_node)
    assert set(per_node) == {(rc, LC) for rc in (Recompute.NONE, Recompute.FULL)}
    for (rc, _), bound in per_node.items():  # each node's own bound below each of that node's layouts
        assert bound <= min(t for (_, rc2), t in best.items() if rc2 == rc and t is not None) + 1e-9, rc
    assert min(per_node.values()) == plain == per_node[(Recompute.NONE, LC)]
    program = group_node_bound(job, frames, Recompute.NONE, LC, tiny, slow)
    assert plain < program < per_node[(Recompute.FULL, LC)]  # the premise: lifting the least node lifts the shape
    for scale in (0.9, 0.99, 1.01, 1.2):
        line = fastest * scale
        value, lifted = lift_group_bound(job, frames, per_node, tiny, slow, stop_at=line)
        assert min(program, line) * (1 - 1e-8) <= value <= fastest + 1e-9, (scale, value, program)
        assert set(lifted) == {(Recompute.NONE, LC)}
        assert lifted[(Recompute.NONE, LC)] == group_node_bound(job, frames, Recompute.NONE, LC, tiny, slow,
                                                                 stop_at=line)
    assert lift_group_bound(job, frames, per_node, tiny, slow, stop_at=math.inf) == (plain, {})


@pytest.mark.parametrize("reserve", [1.5, 2.2])
def test_each_node_bound_a_group_frame_bound_files_is_below_each_members_own(tiny, slow, reserve):
    """`group_frame_bound`'s `per_node` under every recompute mode and both lifecycles (nodes settled by the
    least so far among them, and, against a line under them all, by their coarse floors): each node's value is at
    most each member's own tight bound of that node (which relaxes that member's node), and their least is the
    frame bound."""
    job = _job(reserve)
    job = job.model_copy(update={"search": job.search.model_copy(update={"fsdp_lifecycle": None,
                                                                         "recompute": None})})
    frames = tuple(enumerate_frames(job, tiny, 8))
    own = {(rc, lc): min(tight_node_bound(job, f, rc, lc, tiny, slow) for f in frames)
           for rc in Recompute for lc in FsdpLifecycle}
    exact = group_frame_bound(job, frames, tiny, slow)
    for line in (math.inf, 0.5 * exact):
        per_node: dict = {}
        plain = group_frame_bound(job, frames, tiny, slow, stop_at=line, per_node=per_node)
        assert set(per_node) == set(own)
        assert min(per_node.values()) == plain
        for node, bound in per_node.items():
            assert bound <= own[node] + 1e-9, (node, line, bound, own[node])


@pytest.mark.parametrize("reserve", [0.25, 0.5])
def test_group_bound_below_each_member_under_a_runtime_and_every_variant_toggle(tiny, slow, reserve):
    """With a runtime the budget depends on the FSDP degrees (more communicators, more NCCL buffers: 0.64, 0.51
    and 0.20 GiB at dense FSDP 1, 2, 4 here), and with offload, balancing, ZeRO-2 host gradients, P2P Muon and
    the chunked cross entropy free every variant's merge is read: the group bound stays at or below each member's
    own bound on every node, and is finite where some member's is."""
    from k3opt.search.lp_bound import VARIANT_TOGGLES

    job = _job(reserve).model_copy(update={"runtime": "megatron-te-hybridep-gb200"})
    job = job.model_copy(update={"search": job.search.model_copy(update={
        "fsdp_lifecycle": None, "recompute": None,
        "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in (*ALLOWED, *VARIANT_TOGGLES)]})})
    frames = tuple(enumerate_frames(job, tiny, 8))
    assert len(frames) == 6
    finite = 0
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        group = group_node_bound(job, frames, rc, lc, tiny, slow)
        own = [tight_node_bound(job, f, rc, lc, tiny, slow) for f in frames]
        assert group <= min(own) + 1e-9, (rc, lc, group, own)
        finite += math.isfinite(min(own))
        assert math.isfinite(group) or not math.isfinite(min(own))
    assert finite


def test_group_bound_needs_one_schedule(tiny, slow):
    """Frames of different pipeline schedules (PP2 VP2 and PP2 VP3: other in-flight counts and slots) are not
    bounded at once: no bound (0.0) rather than a wrong one."""
    job = _job(1.5)
    wide = job.model_copy(update={"search": job.search.model_copy(update={"vp": [2, 3]})})
    frames = enumerate_frames(wide, tiny, 8)
    vp2 = next(f for f in frames if f.vp == 2)
    vp3 = next(f for f in frames if f.vp == 3)
    assert tight_node_bound(wide, vp2, Recompute.NONE, LC, tiny, slow) > 0
    assert group_node_bound(wide, (vp2, vp3), Recompute.NONE, LC, tiny, slow) == 0.0
    assert frame_dp_bound(wide, vp2, tiny, slow)[0] > 0
    assert group_frame_bound(wide, (vp2, vp3), tiny, slow) == 0.0


def test_group_bounds_give_none_past_their_deadline(tiny, slow):
    """Tens of members take seconds to build; past the search's deadline a group bound gives no bound (0.0)."""
    job = _job(1.5)
    frames = tuple(enumerate_frames(job, tiny, 8))
    assert group_node_bound(job, frames, Recompute.NONE, LC, tiny, slow) > 0
    assert group_node_bound(job, frames, Recompute.NONE, LC, tiny, slow, deadline=-math.inf) == 0.0
    assert group_frame_bound(job, frames, tiny, slow) > 0
    assert group_frame_bound(job, frames, tiny, slow, deadline=-math.inf) == 0.0


def test_a_group_node_bound_checks_its_deadline_member_by_member(tiny, slow, monkeypatch):
    """A deadline that passes while the members are tested (`lp_bound.lean_fits`, one program each) ends the group
    node program at the next member: no bound (0.0), no further member tested, no variant built. Checked once per
    step, a group of tens of members ran the 8,192-GPU plan a second or two past its time limit."""
    from types import SimpleNamespace

    from k3opt.search import lp_bound

    job = _job(1.5)
    frames = tuple(enumerate_frames(job, tiny, 8))
    assert len(frames) >= 3
    clock = [0.0]
    tested: list = []
    built: list = []
    real_fits, real_relaxed = lp_bound.lean_fits, lp_bound._relaxed

    def fits(job_, g, *a, **k):
        tested.append(g)
        clock[0] = 10.0  # the deadline (5.0) passes during the first member's test
        return real_fits(job_, g, *a, **k)

    def relaxed(*a, **k):
        built.append(a[1])
        return real_relaxed(*a, **k)

    monkeypatch.setattr(lp_bound, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(lp_bound, "lean_fits", fits)
    monkeypatch.setattr(lp_bound, "_relaxed", relaxed)
    assert group_node_bound(job, frames, Recompute.NONE, LC, tiny, slow, deadline=5.0) == 0.0
    assert len(tested) == 1 and not built


def test_plan_with_group_bounds_proves_the_enumerated_optimum(tiny, slow, monkeypatch):
    """The search bounds the six variants' nodes with group programs: its bound stays below the enumerated best,
    and it proves that best (OPTIMAL within a 1e-5 gap: GLOP's optimum is shaved by a relative 1e-6), with the
    layouts found by CP-SAT alone."""
    import k3opt.search.driver as driver

    calls: list[int] = []

    def counted(job, members, *a, **k):
        calls.append(len(members))
        return group_node_bound(job, members, *a, **k)

    monkeypatch.setattr(driver, "group_node_bound", counted)
    # Every program in this process, where the spy counts (search/prefetch would run some in another).
    monkeypatch.setattr(driver, "Prefetch", lambda tasks, line, **k: Prefetch([], line))
    # No heuristic layouts: CP-SAT finds them, so a group bound above a member's optimum would prune it.
    monkeypatch.setattr(driver, "incumbents", lambda *a, **k: {})
    monkeypatch.setattr(driver, "seed", lambda *a, **k: {})
    job = _job(1.5)
    frames = enumerate_frames(job, tiny, 8)
    best = min(t for t in _enumerated(job, frames, tiny, slow).values() if t is not None)
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=1e-5, time_limit=60)
    assert calls and max(calls) >= 2
    assert plan.bound <= best + 1e-9
    assert plan.status == "OPTIMAL"
    assert plan.layouts[0].rank_time_s == pytest.approx(best, abs=1e-9)


def test_group_bound_below_a_k3_layout_and_at_its_members_level(model, cluster):
    """K3 on 512 GB200 (the default job), PP8 VP4 EP64 M64 under the optim / optim policies: seven dense FSDP
    variants. Their group bound under selective recompute is below a fitting 18.63-s layout of the dFSDP64 member
    (split 3 x 28 + 2 + 3 + 2 + 2) and below that member's own bound, and within 1% of it."""
    job = k3opt.load_job("k3-512-4k")
    frames = [f for f in enumerate_frames(job, model, 512, cluster)
              if (f.pp, f.vp, f.ep, f.microbatches) == (8, 4, 64, 64) and f.dense_sharding == "optim"
              and f.expert_sharding == "optim" and f.grad_dtype == "fp32" and f.precision == "bf16"]
    members = tuple(f for f in frames if sharding_group(f) == sharding_group(frames[0]))
    assert len(members) >= 5
    mine = next(f for f in members if (f.expert_fsdp, f.dense_fsdp) == (1, 64))
    lay = make_layout(gpus=512, pp=8, vp=4, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, context=4096,
                      split=[3] * 28 + [2, 3, 2, 2], recompute="selective", reserve_gib=4.0,
                      domain_gpus_used=64, dense_sharding="optim", expert_sharding="optim",
                      runtime="megatron-te-hybridep-gb200",
                      toggles=dict(fp8_activations=True, activation_offload=True, moe_backward_rewrite=True,
                                   dispatch_recompute=True, fused_situ=True, p2p_muon=True,
                                   fused_cross_entropy=True))
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    assert ev.fits
    group = group_node_bound(job, members, Recompute.SELECTIVE, LC, model, cluster)
    own = tight_node_bound(job, mine, Recompute.SELECTIVE, LC, model, cluster)
    assert group <= own + 1e-9 and group <= ev.step.rank_time_s
    assert group >= 0.99 * own


def test_members_that_cannot_fit_are_left_out(tiny, slow, monkeypatch):
    """At reserve 2.4 GiB two of the six variants fit under no setting of recompute 'none' (their own bounds are
    inf): the group program builds no variant of theirs, and its bound is the one over the four that fit."""
    import k3opt.search.lp_bound as lp

    job = _job(2.4)
    frames = tuple(enumerate_frames(job, tiny, 8))
    rc = Recompute.NONE
    own = [tight_node_bound(job, f, rc, LC, tiny, slow) for f in frames]
    out = {f for f, o in zip(frames, own, strict=True) if not math.isfinite(o)}
    assert len(out) == 2
    built: set = set()
    real = lp._relaxed

    def seen(job, f, *a, **k):
        built.add(f)
        return real(job, f, *a, **k)

    monkeypatch.setattr(lp, "_relaxed", seen)
    group = group_node_bound(job, frames, rc, LC, tiny, slow)
    assert built and not built & out
    fitting = tuple(f for f in frames if f not in out)
    assert group == group_node_bound(job, fitting, rc, LC, tiny, slow)
    assert group <= min(own) + 1e-9
    # Every member out: no layout to bound.
    assert group_node_bound(job, tuple(out), rc, LC, tiny, slow) == math.inf


def _k3_8192_pp8_vp4_ep64(degrees: tuple[tuple[int, int], ...]) -> tuple:
    """(job, model, cluster, frames): the default job scaled to 8,192 GPUs (32,768 tokens per GPU per update) and
    its PP8 VP4 EP64 M64 frames (optim / optim sharding) of the given (expert FSDP, dense FSDP) degrees."""
    return _k3_8192(8, 4, 64, 64, "optim", degrees)


def _k3_8192(pp: int, vp: int, ep: int, microbatches: int, policy: str,
             degrees: tuple[tuple[int, int], ...]) -> tuple:
    """(job, model, cluster, frames): the default job scaled to 8,192 GPUs and its frames of these degrees, under
    one sharding policy for the dense and expert groups."""
    from k3opt.inputs.specs import ShardingPolicy
    from k3opt.search.frames import Frame

    base = k3opt.load_job("k3-512-4k")
    model = k3opt.load_model(base.model)
    cluster = k3opt.load_cluster(base.cluster)
    job = k3opt.Job.model_validate({**base.model_dump(), "gpus": 8192, "tokens_per_update": 32768 * 8192})
    members = tuple(Frame(pp=pp, vp=vp, cp=1, ep=ep, expert_fsdp=fe, dense_fsdp=fd, microbatches=microbatches,
                          gpus=8192, dense_sharding=ShardingPolicy(policy), expert_sharding=ShardingPolicy(policy),
                          domain_gpus_used=64) for fe, fd in degrees)
    return job, model, cluster, members


def test_a_group_bound_pairs_each_members_update_with_its_own_exchange():
    """K3 at 8,192 GPUs, PP8 VP4 EP64: more FSDP shards the Newton-Schulz update over more ranks (less update
    compute per rank) and grows the update's exchange past the stage-microbatch it hides under. A group's bound over
    eFSDP8 dFSDP1 and eFSDP16 dFSDP1024 (both fitting without offload) takes each member's update with that member's
    own exchange: it is the lesser member's own shape bound (18.74 s; 18.25 s before the layouts without offload
    were priced by their memory, `lp_bound.no_offload_bound`). Pairing the least update of one with the
    least exchange of the other gave 18.10 s, under both members."""
    job, model, cluster, members = _k3_8192_pp8_vp4_ep64(((8, 1), (16, 1024)))
    own = [frame_dp_bound(job, m, model, cluster)[0] for m in members]
    group = group_frame_bound(job, members, model, cluster)
    assert group <= min(own) + 1e-9
    assert group >= min(own) * (1 - 1e-3), (group, own)


def test_a_group_relaxation_floors_each_member_on_its_own_update():
    """The node relaxation of a group (`group_node_bound`) floors each variant at each member's own stage, update
    and exchange (`lp_bound._Arrays.updates`): K3 at 8,192 GPUs, PP8 VP4 EP64, selective per-microbatch node of
    eFSDP2 dFSDP64 (its own relaxation 18.46 s) and eFSDP8 dFSDP128 (18.64 s): the group's is the lesser, 18.46 s.
    Floored on the merged arrays alone (the least update of one member beside the least exchange of another) it
    was 18.36 s."""
    job, model, cluster, members = _k3_8192_pp8_vp4_ep64(((2, 64), (8, 128)))
    own = [tight_node_bound(job, m, Recompute.SELECTIVE, LC, model, cluster) for m in members]
    group = group_node_bound(job, members, Recompute.SELECTIVE, LC, model, cluster)
    # Within the relaxation's own shave (lp_bound.FEAS_TOL, 1e-6 relative): a variant's value is the larger of its
    # program's optimum, shaved, and its exact whole-layer floor, whichever the order of the solves reaches first.
    assert group <= min(own) * (1 + 1e-6)
    assert group >= min(own) * (1 - 1e-3), (group, own)


def test_the_k3_8192_shape_bound_pairs_the_layouts_without_offload_with_their_memory():
    """K3 at 8,192 GPUs, PP8 VP4 EP64 under optim sharding: eFSDP2 dFSDP64 must offload, eFSDP8 dFSDP128 fits
    without (its memory rows say so). The shape bound of the pair is the least of the offload's traffic floor and,
    for layouts without offload, `lp_bound.no_offload_bound`: rank 0 holds up to 39 chunk-microbatches in flight
    (rank 7: 25), so their layers pile onto the late ranks (over the whole group of 55, selective recompute: 27.8
    s). It stays below the eFSDP2 dFSDP64
    layout the search finds (20.951 s, evaluate()) and within 1% of it: that shape is proven without its nodes.
    Taking the no-offload member's mean load instead, as when its memory was left out, gave a bound 3.3% under."""
    job, model, cluster, members = _k3_8192_pp8_vp4_ep64(((2, 64), (8, 128)))
    layout = make_layout(
        gpus=8192, pp=8, vp=4, ep=64, expert_fsdp=2, dense_fsdp=64, microbatches=64, context=4096, rows=1,
        split=[3, 3, 3, 2] + [3] * 27 + [1], recompute="selective", fsdp_lifecycle="per_microbatch",
        toggles=dict(fp8_activations=True, activation_offload=True, balance_activations=True,
                     moe_backward_rewrite=True, dispatch_recompute=False, fused_situ=True, fused_cross_entropy=True),
        reserve_gib=4.0, domain_gpus_used=64, dense_sharding="optim", expert_sharding="optim",
        runtime="megatron-te-hybridep-gb200")
    ev = k3opt.evaluate(layout, model=model, cluster=cluster)
    assert ev.fits and ev.step.rank_time_s == pytest.approx(20.951, abs=1e-3)
    group = group_frame_bound(job, members, model, cluster)
    assert group <= ev.step.rank_time_s
    assert group >= 0.99 * ev.step.rank_time_s, group


def _one_lifecycle(job: k3opt.Job, lc: FsdpLifecycle) -> k3opt.Job:
    return job.model_copy(update={"search": job.search.model_copy(update={"fsdp_lifecycle": [lc]})})


def test_the_k3_8192_shape_bound_is_the_least_over_lifecycles_of_each_lifecycles_own():
    """K3 at 8,192 GPUs under optim_grads sharding. Every layout has one FSDP lifecycle, so a shape's bound over
    both is at least the lesser of its bounds over each alone (each lifecycle's work beside its own bytes).

    PP4 VP4 EP32 eFSDP4 dFSDP64: the accumulate lifecycle keeps an FP32 buffer of the rank's unsharded gradients
    beside its BF16 view, 6 B per parameter of the rank's layers. The four ranks' layers hold the dense parameters
    and 1/32 of the routed ones (57.19 G + 2,722.74 G / 32 = 142.28 G), so one rank holds at least 35.57 G, 213.4 GB
    at 6 B: over the 194.4-GB budget with nothing else counted. No accumulate layout fits: its bound is inf, and the
    shape's is that of the per-microbatch lifecycle (21.26 s). Taking the least work of either lifecycle gave
    less: the accumulate lifecycle's selective work (no layout of it fits).

    PP16 VP4 EP64 eFSDP8 dFSDP128: the per-microbatch lifecycle reduce-scatters every microbatch (mean load over
    30 s), the accumulate lifecycle holds the buffer, so the bytes that decide its memory rows are its own: 21.22 s,
    where the least work of one with the least bytes of the other gave less."""
    job, model, cluster, (f,) = _k3_8192(4, 4, 32, 32, "optim_grads", ((4, 64),))
    layout = make_layout(
        gpus=8192, pp=4, vp=4, ep=32, expert_fsdp=4, dense_fsdp=64, microbatches=32, context=4096, rows=1,
        split=[5, 5, 5, 7, 7] + [6] * 10 + [4], recompute="selective", fsdp_lifecycle="per_microbatch",
        toggles=dict(fp8_activations=True, activation_offload=True, moe_backward_rewrite=True, fused_situ=True,
                     p2p_muon=True, fused_cross_entropy=True),
        reserve_gib=4.0, domain_gpus_used=64, dense_sharding="optim_grads", expert_sharding="optim_grads",
        runtime="megatron-te-hybridep-gb200")
    ev = k3opt.evaluate(layout, model=model, cluster=cluster)
    assert ev.fits and ev.step.rank_time_s == pytest.approx(21.637, abs=1e-3)
    # The premise, from the evaluation's parameter counts: the rank holding the most layers cannot hold 6 B each.
    per_rank = (ev.params.total - ev.params.routed + ev.params.routed / 32) / 4
    assert 6 * per_rank > ev.capacity_bytes
    both = frame_dp_bound(job, f, model, cluster)[0]
    assert frame_dp_bound(_one_lifecycle(job, FsdpLifecycle.ACCUMULATE), f, model, cluster)[0] == math.inf
    assert both == pytest.approx(frame_dp_bound(_one_lifecycle(job, LC), f, model, cluster)[0], rel=1e-9)
    assert both <= ev.step.rank_time_s

    job, model, cluster, (f,) = _k3_8192(16, 4, 64, 128, "optim_grads", ((8, 128),))
    each = [frame_dp_bound(_one_lifecycle(job, lc), f, model, cluster)[0] for lc in FsdpLifecycle]
    assert frame_dp_bound(job, f, model, cluster)[0] == pytest.approx(min(each), rel=1e-9)


def test_one_program_over_the_sharding_policies_stays_below_every_layout(tiny, slow):
    """The driver's first program for an interleaved shape spans its sharding-policy and gradient-dtype variants
    too (frames.policy_group: several sharding groups): below every enumerated layout of every member."""
    job = _job(1.5)
    job = job.model_copy(update={"search": job.search.model_copy(update={
        "dense_sharding": [ShardingPolicy.OPTIM_GRADS_PARAMS, ShardingPolicy.OPTIM],
        "grad_dtype": [Dtype.FP32, Dtype.BF16]})})
    frames = enumerate_frames(job, tiny, 8)
    assert len({sharding_group(f) for f in frames}) == 4 and len({policy_group(f) for f in frames}) == 1
    best = None
    for f, rc in itertools.product(frames, ("none", "full")):
        for flags in itertools.product([False, True], repeat=len(ALLOWED)):
            for split in contiguous_splits(tiny.num_layers, 4):
                lay = make_layout(gpus=8, pp=2, vp=2, ep=2, expert_fsdp=f.expert_fsdp, dense_fsdp=f.dense_fsdp,
                                  microbatches=f.microbatches, context=2048, split=split, recompute=rc,
                                  fsdp_lifecycle=LC, toggles=dict(zip(ALLOWED, flags, strict=True)),
                                  reserve_gib=job.reserve_gib, dense_sharding=f.dense_sharding,
                                  expert_sharding=f.expert_sharding, grad_dtype=f.grad_dtype)
                ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                if ev.fits and (best is None or ev.step.rank_time_s < best):
                    best = ev.step.rank_time_s
    assert best is not None
    bound = group_frame_bound(job, tuple(frames), tiny, slow)
    assert 0 < bound <= best + 1e-9
    # no looser than the least of its sharding groups' own programs by more than the policies' spread
    groups = {}
    for f in frames:
        groups.setdefault(sharding_group(f), []).append(f)
    own = min(group_frame_bound(job, tuple(m), tiny, slow) for m in groups.values())
    assert bound <= own + 1e-9
