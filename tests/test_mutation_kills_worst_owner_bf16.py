"""Whole-tensor sharding with BF16 optimizer state and whole gradients (optim): the HBM check keeps the dense rank
owning the most bytes at 4 B master + 2 B Muon momentum (6 B) per Muon element and 4 + 2 x 2 B AdamW moments (8 B)
per AdamW element, the gradient buffer being whole and so not owned. On K3, a stage of layers 81-83 dealt over a
dense group of 16 has two candidate ranks about 16 KiB apart at those widths that trade places at any other
(7 B / 9 B, one byte more each): the widths, not the element count, decide. The ranks' (Muon, AdamW) element
counts are k3opt.cost.sharding's deal, pinned against the seed's tensor inventory in test_golden /
test_mutation_kills_sharding."""

from __future__ import annotations

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.cost.evaluate import _tensor_owned_state
from k3opt.cost.sharding import owned_per_rank, whole_params

IDX = (81, 82, 83)  # stage 1 of PP3 with split 81 / 3 / 9 (K3's 93 decoder layers)
MUON, ADAMW = 4 + 2, 4 + 2 * 2  # bytes per owned element: FP32 master + BF16 state (one momentum / two moments)


def _cf():
    lay = k3opt.make_layout(gpus=48, pp=3, ep=1, dense_fsdp=16, expert_fsdp=1, microbatches=3, context=4096,
                            split=[81, 3, 9], dense_sharding="optim", expert_sharding="optim",
                            optimizer_shard_granularity="tensor", optimizer_state_dtype="bf16")
    return coefficients(Shape.of(lay), k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72"))


def test_bf16_state_keeps_the_dense_rank_owning_the_most_bytes():
    cf = _cf()
    shares = owned_per_rank(cf.model_json, IDX, False, 16, 1)
    dense = max(shares, key=lambda s: MUON * s[0] + ADAMW * s[1])
    # The case is a near-tie: one more byte per element would keep another rank (so the widths are what is tested).
    assert max(shares, key=lambda s: (MUON + 1) * s[0] + (ADAMW + 1) * s[1]) != dense
    (expert,) = owned_per_rank(cf.model_json, IDX, True, 1, 1)  # expert FSDP 1: one rank owns every expert tensor
    got = _tensor_owned_state(cf, IDX)
    assert got["master"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    assert got["optimizer"] == 2 * (dense[0] + expert[0]) + 4 * (dense[1] + expert[1])
    # optim: the FP32 gradient buffer stays whole, every parameter of the stage (4 B each).
    assert got["grads"] == 4 * (whole_params(cf.model_json, IDX, False, 1) + whole_params(cf.model_json, IDX, True, 1))
