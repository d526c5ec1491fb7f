"""The shape peak bound counts the gradients a rank holds under every setting of pipeline ZeRO-2 host gradients:
the FP32 shard without it, two FP32 buffers of the rank's largest chunk with it. A bound that left them out
where ZeRO-2 is allowed would let shapes whose every layout is over HBM into the queue (DeepSeek-V3 on 1,024 H100:
the heuristic passes spent on shapes that fit nowhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import contiguous_splits

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import enumerate_frames
from k3opt.search.bounds import frame_lower_bound

DATA = Path(__file__).parents[1] / "data"
ZERO2 = "pipeline_zero2_host_grads"


@pytest.fixture(scope="module")
def tiny():
    return k3opt.load_model(str(DATA / "tiny-moe.toml"))


@pytest.fixture(scope="module")
def slow():
    return k3opt.load_cluster(str(DATA / "slow-cluster.toml"))


def _job(pp: list[int], vp: list[int]) -> k3opt.Job:
    others = [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t != ZERO2]
    return k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "rows": 1, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": pp, "vp": vp, "cp": [1], "ep": [2], "expert_fsdp": [1, 2], "dense_fsdp": [1, 4],
                   "dense_sharding": ["optim", "optim_grads"], "recompute": ["full"],
                   "fsdp_lifecycle": ["per_microbatch"], "forbid_toggles": others},
    })


def _layout(f, split, zero2: bool):
    return make_layout(model=str(DATA / "tiny-moe.toml"), cluster=str(DATA / "slow-cluster.toml"), gpus=f.gpus,
                       pp=f.pp, vp=f.vp, cp=f.cp, ep=f.ep, expert_fsdp=f.expert_fsdp, dense_fsdp=f.dense_fsdp,
                       microbatches=f.microbatches, rows=1, context=2048, split=split, recompute=Recompute.FULL,
                       fsdp_lifecycle=FsdpLifecycle.PER_MICROBATCH, toggles={ZERO2: zero2}, reserve_gib=1.5,
                       dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding,
                       grad_dtype=f.grad_dtype, precision=f.precision)


def _term(ev, key: str, ranks: int) -> float:
    """Mean over the pipeline ranks of one ledger term's bytes."""
    return sum(t.bytes for r in ev.ranks[:ranks] for t in r.terms if t.key == key) / ranks


HELD = ("master", "optimizer", "bf16_view", "quantized_weights")


def test_peak_bound_is_below_every_layout_with_and_without_zero2(tiny, slow):
    """Every split of every shape (PP2, VP 1 and 3), with ZeRO-2 host gradients on and off: the shape's peak bound
    is at most each layout's worst-rank peak, fitting or not."""
    job = _job([2], [1, 3])
    frames = enumerate_frames(job, tiny, 8)
    assert {f.vp for f in frames} == {1, 3}
    for f in frames:
        bound = frame_lower_bound(job, f, tiny, slow)[1]
        for z in (False, True):
            least = min(k3opt.evaluate(_layout(f, s, z), model=tiny, cluster=slow).peak_bytes
                        for s in contiguous_splits(tiny.num_layers, f.pp * f.vp))
            assert bound <= least + 1, (f, z, bound, least)


def test_peak_bound_at_vp1_holds_the_gradients_as_the_ledger_does(tiny, slow):
    """At VP 1 ZeRO-2's two buffers of the rank's one chunk hold twice its FP32 gradients, never less than the
    shard, so the bound holds the shard whether ZeRO-2 is allowed or not: the mean over ranks of the ledger's
    master, optimizer, BF16 view, quantized copies and gradients (evaluate() of any split without ZeRO-2; the
    per-rank terms move with the split, their sum does not)."""
    job = _job([2], [1])
    frames = enumerate_frames(job, tiny, 8)
    assert len(frames) >= 4
    for f in frames:
        ev = k3opt.evaluate(_layout(f, [3, 3], False), model=tiny, cluster=slow)
        mean = sum(_term(ev, t, f.pp) for t in (*HELD, "grads"))
        assert frame_lower_bound(job, f, tiny, slow)[1] == pytest.approx(mean, rel=1e-9), f


def test_zero2_bound_takes_two_buffers_of_the_mean_chunk(tiny, slow):
    """VP3 under `optim` with unsharded experts: each rank holds its whole FP32 gradients without ZeRO-2, and with
    it two buffers of its largest of three chunks, at least 2/3 of the rank's gradients (a chunk buffer is the
    chunk's FP32 gradients, whole). The bound is then the always-held bytes plus 2/3 of the gradients, both as the
    ledger counts them on a layout without ZeRO-2; and it stays under the layouts with ZeRO-2 on."""
    job = _job([2], [3])
    f = next(g for g in enumerate_frames(job, tiny, 8)
             if g.dense_sharding.value == "optim" and g.expert_fsdp == 1 and g.dense_fsdp == 1)
    without = k3opt.evaluate(_layout(f, [1] * 6, False), model=tiny, cluster=slow)
    held = sum(_term(without, t, f.pp) for t in HELD)
    grads = _term(without, "grads", f.pp)
    bound = frame_lower_bound(job, f, tiny, slow)[1]
    assert bound == pytest.approx(held + 2 / 3 * grads, rel=1e-9), (bound, held, grads)
    with_z = k3opt.evaluate(_layout(f, [1] * 6, True), model=tiny, cluster=slow)
    assert bound <= with_z.peak_bytes
