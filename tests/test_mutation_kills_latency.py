"""NCCL's per-call latency (the alpha term, k3opt.cost.coefficients.collective_latency) on a layout whose three groups
sit differently on B200's 8-GPU NVLink domains: EP8 inside one domain, dense FSDP 16 over two, expert FSDP 2 with
its two members in different domains. Each call costs NCCL's ring latency (constraints/rates/b200.toml, from
NVIDIA/nccl src/graph/tuning.cc): base 8.4 us + 3.4 us per NVLink hop + 14.0 us per network hop."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates

US = 1e-6
EP8 = (8.4 + 7 * 3.4) * US                  # 8 ranks in one domain: 7 NVLink hops, on NVLink
DENSE16 = (8.4 + 14 * 3.4 + 1 * 14.0) * US  # 16 ranks, 8 per domain: 14 NVLink hops + 1 network hop, on the NIC
EXPERT2 = (8.4 + 1 * 14.0) * US             # 2 ranks, 1 per domain: 1 network hop, on the NIC


def _delta(**fields) -> tuple[dict, dict]:
    """(per-microbatch, per-update) seconds the latency adds to the achievable NVLink / NIC arrays of Qwen3-30B-A3B
    on 32 B200 GPUs: PP2, EP8 x expert FSDP 2 (16 ranks a stage), dense FSDP 16, full recompute."""
    base = dict(gpus=32, pp=2, ep=8, dense_fsdp=16, expert_fsdp=2, microbatches=8, context=4096, split=[24, 24],
                recompute="full", domain_gpus_used=8)
    lay = k3opt.make_layout(**{**base, **fields})
    m, c = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    r = load_rates("b200")
    a = coefficients(Shape.of(lay), m, c, rates=r)
    b = coefficients(Shape.of(lay), m, c, rates=r.model_copy(update={"collective_base_latency_us": None}))
    return ({k: a.achievable[k] - b.achievable[k] for k in ("nvlink", "nic")},
            {k: a.update_achievable[k] - b.update_achievable[k] for k in ("nvlink", "nic")})


def test_per_microbatch_calls_of_an_moe_layer_and_the_head():
    """Gradients reduce-scattered every microbatch (both groups shard them): an MoE layer pays 2 routing-map
    all-gathers over EP8 (full recompute runs the forward twice) on NVLink, and one reduce-scatter in each FSDP
    group on the NIC; the head edge (dense only, no router) pays the dense reduce-scatter alone."""
    mb, _ = _delta()
    assert mb["nvlink"][5] == pytest.approx(2 * EP8, rel=1e-12, abs=0)
    assert mb["nic"][5] == pytest.approx(DENSE16 + EXPERT2, rel=1e-12, abs=0)
    last = len(mb["nic"]) - 1
    assert mb["nvlink"][last] == 0.0
    assert mb["nic"][last] == pytest.approx(DENSE16, rel=1e-12, abs=0)


def test_per_update_parameter_all_gathers():
    """Per update each group all-gathers its parameters once: dense 16 and expert 2, both on the NIC."""
    _, up = _delta()
    assert up["nic"][5] == pytest.approx(DENSE16 + EXPERT2, rel=1e-12, abs=0)
    assert not up["nvlink"].any()


def test_accumulated_gradients_move_the_reduce_scatters_to_the_update():
    """Accumulate lifecycle: the routing maps stay per microbatch; both reduce-scatters join the all-gathers once
    per update."""
    mb, up = _delta(fsdp_lifecycle="accumulate")
    assert mb["nvlink"][5] == pytest.approx(2 * EP8, rel=1e-12, abs=0)
    assert not mb["nic"].any()
    assert up["nic"][5] == pytest.approx(2 * (DENSE16 + EXPERT2), rel=1e-12, abs=0)


def test_an_expert_group_sharding_nothing_all_reduces_once_per_update():
    """expert_sharding = no_shard: no expert all-gather and no per-microbatch expert reduce-scatter; one all-reduce
    per update, two ring passes. One routing-map all-gather per MoE layer without full recompute."""
    mb, up = _delta(expert_sharding="no_shard", recompute="selective")
    assert mb["nvlink"][5] == pytest.approx(EP8, rel=1e-12, abs=0)
    assert mb["nic"][5] == pytest.approx(DENSE16, rel=1e-12, abs=0)
    assert up["nic"][5] == pytest.approx(DENSE16 + 2 * EXPERT2, rel=1e-12, abs=0)



def test_an_expert_group_on_the_distributed_optimizer_reduces_its_whole_buffer_once():
    """expert_sharding = optim: the expert gradients stay whole, so no reduce-scatter per microbatch; per update
    the parameter all-gather and one reduce-scatter of the whole buffer (one ring pass)."""
    mb, up = _delta(expert_sharding="optim")
    assert mb["nic"][5] == pytest.approx(DENSE16, rel=1e-12, abs=0)
    assert up["nic"][5] == pytest.approx(DENSE16 + 2 * EXPERT2, rel=1e-12, abs=0)
