"""The front's gap filling (search/front._Fill) against exhaustive enumeration through evaluate() on a space small
enough to enumerate: started from a layout that is not on the front, the filling run until no candidate is left
returns the enumerated front. Deterministic: no time limit, no wall-clock assertion."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import enumerate_frames
from k3opt.search.front import _Facts, _Fill, _non_dominated
from k3opt.search.result import PlanItem

DATA = Path(__file__).parents[1] / "data"
ALLOWED = ("fp8_activations", "p2p_muon")
FORBIDDEN = [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in ALLOWED]
MIB = 2**20


@pytest.fixture(scope="module")
def space():
    """The six-layer test model on 8 GPUs, PP2: EP 2 or 4, dense FSDP 1 or 2, the dense optimizer state sharded
    alone (optim) or with the gradients (optim_grads); every layout of it through evaluate()."""
    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "rows": 1, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2], "vp": [1], "cp": [1], "ep": [2, 4], "expert_fsdp": [1], "dense_fsdp": [1, 2],
                   "dense_sharding": ["optim", "optim_grads"], "forbid_toggles": FORBIDDEN},
    })
    frames = enumerate_frames(job, tiny, 8)
    layouts = []
    for f in frames:
        for rc, lc, flags in itertools.product(Recompute, FsdpLifecycle,
                                               itertools.product([False, True], repeat=len(ALLOWED))):
            for first in range(1, tiny.num_layers):  # every split of the layers over the two stages
                lay = make_layout(
                    gpus=f.gpus, pp=f.pp, vp=f.vp, cp=f.cp, ep=f.ep, expert_fsdp=f.expert_fsdp,
                    dense_fsdp=f.dense_fsdp, microbatches=f.microbatches, rows=1, context=2048,
                    split=[first, tiny.num_layers - first], recompute=rc, fsdp_lifecycle=lc,
                    toggles=dict(zip(ALLOWED, flags, strict=True)), reserve_gib=1.5,
                    dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding, grad_dtype=f.grad_dtype,
                    precision=f.precision)
                ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                if ev.fits:
                    layouts.append(PlanItem(lay, ev))
    assert layouts, "the test space must contain layouts that fit"
    return job, tiny, slow, frames, layouts


def _front(items):
    """(step s, peak bytes) of the layouts no other is at least as fast and as lean as (one strictly), by pairwise
    comparison."""
    pts = {(it.rank_time_s, it.peak_bytes) for it in items}
    return sorted(p for p in pts if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in pts))


def test_fill_from_a_dominated_layout_reaches_the_enumerated_front(space):
    """The fastest layout that keeps the whole dense gradient buffer (optim) is dominated: the same layout with
    the gradients sharded (optim_grads, one sharding change away) is as fast and leaner. The ranked search can
    return such a layout, and the seeding used to return it as a front point; the filling prices its frame's
    neighbours and its configuration's and ends on the enumerated front."""
    job, tiny, slow, frames, layouts = space
    want = _front(layouts)
    optim = [it for it in layouts if it.layout.dense_sharding == "optim"]
    start = min(optim, key=lambda it: (it.rank_time_s, it.peak_bytes))
    assert (start.rank_time_s, start.peak_bytes) not in want, "the start is off the front"
    assert len(want) >= 2, "the front has a trade-off to find"

    fill = _Fill(job, tiny, slow, None, frames, _Facts(), set(), lambda f: True)
    points = [start]
    steps = 0
    while (found := fill.step(points, MIB, math.inf, lambda f, t, m: False)) is not None:
        steps += 1
        for it in found:  # each point is the public evaluate()'s figures for its layout
            ev = k3opt.evaluate(it.layout, model=tiny, cluster=slow)
            assert ev.fits and ev.step.rank_time_s == it.rank_time_s and ev.peak_bytes == it.peak_bytes
        points = _non_dominated(points + found)
    assert steps > 0
    assert _front(points) == want


def test_fill_stops_when_every_frame_is_dominated(space):
    """A candidate whose frame bound a point found dominates is not priced: with every frame dominated the
    filling has nothing to do."""
    job, tiny, slow, frames, layouts = space
    start = min(layouts, key=lambda it: (it.rank_time_s, it.peak_bytes))
    fill = _Fill(job, tiny, slow, None, frames, _Facts(), set(), lambda f: True)
    assert fill.step([start], MIB, math.inf, lambda f, t, m: True) is None
    assert not fill.priced


def test_deeper_pipeline_keeps_the_shards_per_rank():
    """The filling's step between pipeline depths: PP2 EP4 dense-FSDP4 on 8 GPUs goes to PP4 EP2 dense-FSDP2 (each
    rank holds the same expert and dense shards of a layer, for half the layers), every other field equal; a
    frame with other degrees is not one such step."""
    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "rows": 1, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2, 4], "vp": [1], "cp": [1], "ep": [2, 4], "expert_fsdp": [1], "dense_fsdp": [1, 2, 4],
                   "dense_sharding": ["optim"], "forbid_toggles": FORBIDDEN},
    })
    frames = enumerate_frames(job, tiny, 8)
    fill = _Fill(job, tiny, slow, None, frames, _Facts(), set(), lambda f: True)

    def frame(pp, ep, dense_fsdp):
        (f,) = [f for f in frames if (f.pp, f.ep, f.dense_fsdp, f.expert_sharding) == (pp, ep, dense_fsdp, "optim")]
        return f

    assert fill.deeper(frame(2, 4, 4)) == [frame(4, 2, 2)]
    assert fill.deeper(frame(4, 2, 2)) == [frame(2, 4, 4)]
    assert fill.deeper(frame(2, 4, 1)) == []  # PP4 EP2 with half a dense shard does not exist


def test_price_configs_settles_only_what_it_priced_before_its_deadline(space):
    """A configuration counts as priced on a frame (so the gap filling skips it) only when price_configs priced it
    before its deadline: with the deadline already past nothing is settled and nothing is returned; with no
    deadline every configuration is settled, and each fitting layout returned is one of them on that frame."""
    from k3opt.search.incumbents import config_of, price_configs

    job, tiny, slow, frames, layouts = space
    f = frames[0]
    configs = list(dict.fromkeys(config_of(it.layout) for it in layouts))[:3]
    late: list = []
    assert price_configs(job, f, configs, tiny, slow, deadline=-math.inf, settled=late) == []
    assert late == []
    done: list = []
    found = price_configs(job, f, configs, tiny, slow, deadline=math.inf, settled=done)
    assert set(done) == set(configs)
    assert all(config_of(it.layout) in configs for it in found)
