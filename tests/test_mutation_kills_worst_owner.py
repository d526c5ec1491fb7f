"""Whole-tensor sharding: the HBM check keeps the data-parallel rank owning the most bytes, and which rank that is
depends on the byte widths of what it owns. On seed 003's 4-layer proxy, a stage holding layer 1 alone, dealt over
a dense group of 3 ranks, has two candidate ranks that trade places: one owns a little more Muon, the other more
AdamW. The expected states are built from the ranks' (Muon, AdamW) element counts (k3opt.cost.sharding's deal, pinned
against the seed's tensor inventory in test_golden / test_mutation_kills_sharding) and the widths of each state."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.cost.evaluate import _tensor_owned_state
from k3opt.cost.sharding import owned_per_rank, whole_params

# Bytes per owned element: FP32 master 4 + FP32 Muon momentum 4 (AdamW: two FP32 moments, 8) + the FP32 gradient
# shard 4 where the policy shards gradients (optim_grads), nothing where the gradient buffer is whole (optim).
WIDTHS = {"optim_grads": (4 + 4 + 4, 4 + 8 + 4), "optim": (4 + 4, 4 + 8)}


def _cf(policy: str):
    """Proxy on 9 GPUs: PP3 with split 1 / 1 / 2, dense FSDP 3 (one rank per dp index), EP 1, expert FSDP 1."""
    lay = k3opt.make_layout(gpus=9, pp=3, ep=1, dense_fsdp=3, expert_fsdp=1, microbatches=3, context=4096,
                            split=[1, 1, 2], dense_sharding=policy, expert_sharding=policy,
                            optimizer_shard_granularity="tensor")
    model = k3opt.load_model("kimi-k3-4layer-proxy")
    return coefficients(Shape.of(lay), model, k3opt.load_cluster("gb200-nvl72"))


def _worst(policy: str) -> tuple[int, int]:
    cf = _cf(policy)
    wm, wa = WIDTHS[policy]
    return max(owned_per_rank(cf.model_json, (1,), False, 3, 1), key=lambda s: wm * s[0] + wa * s[1])


def test_the_two_candidate_ranks_trade_places_between_policies():
    """12 B / 16 B per Muon / AdamW element (optim_grads) keep the rank with more Muon; 8 B / 12 B (optim) the rank
    with more AdamW: the widths, not the element count alone, decide."""
    a, b = _worst("optim_grads"), _worst("optim")
    assert a != b
    assert a[0] > b[0] and a[1] < b[1]


@pytest.mark.parametrize("policy", ["optim_grads", "optim"])
def test_stage_state_is_the_worst_owners(policy):
    """Stage 1 (layer 1) of the layout: master 4 B and state 4 B (Muon) / 8 B (AdamW) per element of the worst
    dense rank plus the lone expert rank's whole share; gradients: the owned elements under optim_grads, the whole
    stage's parameters under optim (4 B each)."""
    cf = _cf(policy)
    wm, wa = WIDTHS[policy]
    dense = max(owned_per_rank(cf.model_json, (1,), False, 3, 1), key=lambda s: wm * s[0] + wa * s[1])
    (expert,) = owned_per_rank(cf.model_json, (1,), True, 1, 1)
    got = _tensor_owned_state(cf, (1,))
    assert got["master"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    assert got["optimizer"] == 4 * (dense[0] + expert[0]) + 8 * (dense[1] + expert[1])
    if policy == "optim_grads":
        assert got["grads"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    else:
        assert got["grads"] == 4 * (whole_params(cf.model_json, (1,), False, 1) + whole_params(cf.model_json, (1,),
                                                                                                True, 1))


@pytest.mark.parametrize("group", [12, 24])
def test_k3_stage_of_three_layers_keeps_the_owner_of_the_most_bytes(group):
    """K3, a stage holding layers 1-3 (PP3, split 1 / 3 / 89), dense FSDP 12 and 24 under optim_grads: near-ties
    between ranks whose Muon and AdamW shares differ, settled by 12 B per Muon and 16 B per AdamW element."""
    lay = k3opt.make_layout(gpus=3 * group, pp=3, ep=1, dense_fsdp=group, expert_fsdp=1, microbatches=3,
                            context=4096, split=[1, 3, 89], dense_sharding="optim_grads",
                            expert_sharding="optim_grads", optimizer_shard_granularity="tensor")
    cf = coefficients(Shape.of(lay), k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72"))
    idx = (1, 2, 3)
    dense = max(owned_per_rank(cf.model_json, idx, False, group, 1), key=lambda s: 12 * s[0] + 16 * s[1])
    (expert,) = owned_per_rank(cf.model_json, idx, True, 1, 1)
    got = _tensor_owned_state(cf, idx)
    assert got["master"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    assert got["optimizer"] == 4 * (dense[0] + expert[0]) + 8 * (dense[1] + expert[1])
