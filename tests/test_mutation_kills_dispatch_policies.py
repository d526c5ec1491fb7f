"""Link bytes and per-policy buffers of the cost model (k3opt.cost.coefficients) on layouts no golden test covers,
each figure derived from the configs' shapes: the hierarchical EP dispatcher (HybridEP / DeepEP) against the flat
all-to-all across two NVLink domains, context-parallel traffic on the NIC and on NVLink, an expert group that
shards nothing under expert FSDP 2, the accumulation buffer of a group whose gradients are not sharded, and the
optimizer-step gather of a one-rank group."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates

# Qwen/Qwen3-30B-A3B config.json: d 2048, q 32 x 128, kv 4 x 128, 128 experts [768, 2048], top 8, no latent.
DENSE = 2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 128 + 128 * 2048 + 2 * 2048  # q, o; k, v; q/k norms; router; norms
ROUTED = 128 * 3 * 768 * 2048
T = 4096
# constraints/clusters/b200.toml: NVLink 900 GB/s, NIC 50 GB/s per GPU; constraints/rates/b200.toml: HybridEP's
# measured all-to-all bandwidths inside a domain and across domains.
NVLINK, NIC = 900e9, 50e9
A2A_NVLINK, A2A_NIC = 533.4e9, 43.74e9


def _qwen(**fields) -> k3opt.Layout:
    """EP16 over two 8-GPU NVLink domains (B200 HGX), full recompute, T = 4,096 tokens per microbatch."""
    base = dict(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096, split=[24, 24],
                recompute="full", domain_gpus_used=8)
    return k3opt.make_layout(**{**base, **fields})


def _cf(lay: k3opt.Layout, model: str = "qwen3-30b-a3b", cluster: str = "b200", rates=None):
    return coefficients(Shape.of(lay), k3opt.load_model(model), k3opt.load_cluster(cluster), rates=rates)


@pytest.fixture(scope="module")
def bare_rates():
    """The b200 rates without NCCL's per-call latency, so that every link second is bytes over a rate."""
    return load_rates("b200").model_copy(update={"collective_base_latency_us": None})


def test_hierarchical_dispatcher_crosses_the_nic_once_per_domain(bare_rates):
    """HybridEP at EP16, a = 8 EP ranks per domain: a token's payload (6 exchanges under full recompute x T x
    d 2048 x 2 B = 100,663,296 B per copy) reaches the other domain once if that domain's 64 of 128 experts hold
    any of its 8 (P = 1 - C(64, 8) / C(128, 8)), then every remote rank copy, k (1 - 1/e) = 7.5, rides NVLink.
    The peak roofline's NVLink bytes add the routing-map all-gathers (2 under full recompute x T x 128 experts
    x (a - 1) = 7 peers) and the per-microbatch FP32 gradient reduce-scatter of the dense weights inside the
    domain, 4 D (1 - 1/8); the NIC adds the map from the 8 peers outside and (4 D / 8)(1 - 8/16)."""
    cf = _cf(_qwen(dispatcher="hybridep"), rates=bare_rates)
    per_copy = 6 * T * 2048 * 2
    hit = 1 - comb(64, 8) / comb(128, 8)
    ep_nvl, ep_nic = per_copy * 8 * (1 - 1 / 16), per_copy * (16 // 8 - 1) * hit
    assert cf.achievable["ep_nvlink"][5] * A2A_NVLINK == pytest.approx(ep_nvl, rel=1e-12, abs=0)
    assert cf.achievable["ep_nic"][5] * A2A_NIC == pytest.approx(ep_nic, rel=1e-12, abs=0)
    rmap = 2 * T * 128
    nvl = ep_nvl + rmap * 7 + 4 * DENSE * (1 - 1 / 8)
    nic = ep_nic + rmap * 8 + 4 * DENSE / 8 * (1 - 8 / 16)
    assert cf.time["nvlink"][5] * NVLINK == pytest.approx(nvl, rel=1e-12, abs=0)
    assert cf.time["nic"][5] * NIC == pytest.approx(nic, rel=1e-12, abs=0)


def test_flat_all_to_all_sends_each_cross_domain_copy_over_the_nic(bare_rates):
    """Without a hierarchical dispatcher every copy goes straight to its rank: k (1 - a/e) = 8 x 1/2 = 4 copies
    leave the domain, k (1 - 1/e) - 4 = 3.5 stay on NVLink."""
    cf = _cf(_qwen(), rates=bare_rates)
    per_copy = 6 * T * 2048 * 2
    assert cf.achievable["ep_nvlink"][5] * A2A_NVLINK == pytest.approx(3.5 * per_copy, rel=1e-12, abs=0)
    assert cf.achievable["ep_nic"][5] * A2A_NIC == pytest.approx(4 * per_copy, rel=1e-12, abs=0)


def _k3_cp2(domain: int | None) -> k3opt.Layout:
    """K3, CP 2 on 2 GPUs (no other parallelism), 8,192 context = T 4,096 local tokens, no recompute."""
    return k3opt.make_layout(gpus=2, pp=1, cp=2, ep=1, dense_fsdp=1, expert_fsdp=1, microbatches=1, context=8192,
                             split=[93], recompute="none", domain_gpus_used=domain)


def test_context_parallel_traffic_on_the_nic_when_a_cp_pair_spans_domains():
    """One GPU per NVLink domain: the CP pair talks over the NIC (50 GB/s on GB200). KDA layer 0: FLA KCP's state
    all-gather, forward and backward, 2 (C - 1) x 4 H K (K + V) = 2 x 4 x 96 x 128 x 256 B = 25,165,824 B,
    received as a stall of the compute stream; its gather buffer C x state = 25,165,824 B joins the layer's
    working set next to the two BF16 [T, d] gradient streams (2 x 4096 x 7168 x 2 B). MLA layer 3: TE's ring
    sends 3 (C - 1) T h (d_qk + d_v) 2 B = 3 x 4096 x 96 x 320 x 2 = 754,974,720 B. Nothing else crosses a link:
    EP 1, FSDP 1, one stage."""
    cf = _cf(_k3_cp2(1), "kimi-k3", "gb200-nvl72")
    state = 4 * 96 * 128 * 256
    assert cf.time["nic"][0] * NIC == pytest.approx(2 * state, rel=1e-12, abs=0)
    assert cf.time["nic"][3] * NIC == pytest.approx(3 * 4096 * 96 * 320 * 2, rel=1e-12, abs=0)
    assert not cf.time["nvlink"].any()
    assert cf.working_set[0] == pytest.approx(2 * 4096 * 7168 * 2 + 2 * state, rel=1e-12, abs=0)


def test_context_parallel_traffic_on_nvlink_inside_a_domain():
    """The same pair inside one 72-GPU domain: the same bytes on NVLink (900 GB/s), none on the NIC."""
    cf = _cf(_k3_cp2(None), "kimi-k3", "gb200-nvl72")
    assert cf.time["nvlink"][0] * NVLINK == pytest.approx(2 * 4 * 96 * 128 * 256, rel=1e-12, abs=0)
    assert cf.time["nvlink"][3] * NVLINK == pytest.approx(3 * 4096 * 96 * 320 * 2, rel=1e-12, abs=0)
    assert not cf.time["nic"].any()


def test_expert_group_sharding_nothing_keeps_whole_expert_masters_under_expert_fsdp_2():
    """expert_sharding = no_shard at EP8 x expert FSDP 2: every rank holds the masters, momentum and gradients of
    its EP shard's experts whole, E / e = 603,979,776 / 8, not / (e f_e); the dense group (optim_grads_params
    over 16) shards D. FP32 masters and gradients, FP32 Muon momentum (one state per Muon weight; Qwen3's
    layer holds only norms on AdamW: q/k norms 2 x 128 + input / post norms 2 x 2048, two FP32 moments each)."""
    cf = _cf(_qwen(ep=8, expert_fsdp=2, expert_sharding="no_shard"))
    adamw = 2 * 128 + 2 * 2048
    own_muon, own_adam = (DENSE - adamw) / 16 + ROUTED / 8, adamw / 16
    assert cf.master[5] == pytest.approx(4 * (own_muon + own_adam), rel=1e-12, abs=0)
    assert cf.grads[5] == pytest.approx(4 * (DENSE / 16 + ROUTED / 8), rel=1e-12, abs=0)
    assert cf.optimizer[5] == pytest.approx(4 * own_muon + 8 * own_adam, rel=1e-12, abs=0)


@pytest.mark.parametrize(("dense", "expert", "buffer"), [
    ("optim", "optim_grads", 4 * ROUTED / 16),    # dense gradients whole: no separate accumulation buffer
    ("optim_grads", "optim", 4 * DENSE),          # expert gradients whole
    ("optim_grads", "optim_grads", 4 * (DENSE + ROUTED / 16)),
])
def test_accumulation_buffer_only_for_groups_with_sharded_gradients(dense, expert, buffer):
    """Accumulate lifecycle: an unsharded FP32 buffer of the group's weights (D, or E / e) only where the
    gradients are otherwise sharded; a group whose gradient buffer is already whole accumulates in place."""
    cf = _cf(_qwen(fsdp_lifecycle="accumulate", dense_sharding=dense, expert_sharding=expert))
    assert cf.grad_accum[5] == pytest.approx(buffer, rel=1e-12, abs=0)


@pytest.mark.parametrize(("gpus", "fsdp", "gathered"), [(2, 1, 0.0), (4, 2, 2 * DENSE)])
def test_tensor_granularity_step_gather_of_a_one_rank_group_is_empty(gpus, fsdp, gathered):
    """optim sharding at tensor granularity: receive buffers for the BF16 weights of a sharded group (2 B x D);
    a dense FSDP group of one rank owns everything and gathers nothing. EP 1, experts on optim over one rank."""
    lay = k3opt.make_layout(gpus=gpus, pp=2, ep=1, dense_fsdp=fsdp, expert_fsdp=1, microbatches=2, context=4096,
                            split=[24, 24], dense_sharding="optim", expert_sharding="optim",
                            optimizer_shard_granularity="tensor")
    cf = _cf(lay)
    np.testing.assert_array_equal(cf.step_gather[:48], np.full(48, gathered))
