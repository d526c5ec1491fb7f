"""Placement under Megatron's tp-cp-ep-dp-pp order and the two-level collective split (seed 002; the hardware
notes' 512 = 7.1 NVL72 racks warning), and the link traffic each placement prices, figure by figure from the
configs' shapes: the hierarchical EP dispatcher against the flat all-to-all, an EP group split unevenly over
NVLink domains, context parallelism's bytes, stalls and buffers on either link, NCCL's per-call latency, and the
pipeline hop's rate."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

import k3opt
from k3opt.cost import comm
from k3opt.cost.coefficients import Shape, _context_parallel, coefficients
from k3opt.inputs.rates import load_rates


def test_ep64_on_72_gpu_domains_straddles_racks():
    """512 GPUs in whole 72-GPU domains: stage 1 (ranks 64..127) has 8 ranks in domain 0 and 56 in domain 1."""
    pl = comm.placement(512, 8, 1, 64, 1, 64, 72)
    assert pl.ep_local == 8
    assert comm.ep_cross_domain_copies(16, 64, pl.ep_local) == pytest.approx(14.0)


def test_ep64_on_64_gpu_blocks_stays_on_nvlink():
    pl = comm.placement(512, 8, 1, 64, 1, 64, 64)
    assert pl.ep_local == 64
    assert comm.ep_cross_domain_copies(16, 64, pl.ep_local) == 0
    assert not any(pl.pp_hop_in_domain)  # every stage is its own rack


def test_small_pipeline_inside_one_domain():
    pl = comm.placement(64, 8, 1, 8, 1, 8, 72)
    assert all(pl.pp_hop_in_domain) and pl.pipeline_in_domain


def test_hierarchical_split_limits():
    """a = n: all NVLink; a = 1: all NIC, S (1 - 1/n); in between the domain imports S (1 - a/n) once."""
    assert comm.hierarchical_split(1.0, 64, 64) == (pytest.approx(63 / 64), 0.0)
    assert comm.hierarchical_split(1.0, 64, 1) == (0.0, pytest.approx(63 / 64))
    nvl, nic = comm.hierarchical_split(1.0, 64, 8)
    assert nic == pytest.approx((1 / 8) * (1 - 8 / 64))
    assert nvl == pytest.approx(1 - 1 / 8)


def test_ep_exchanges_4_without_checkpointing_6_with():
    assert comm.ep_exchanges(False, False) == 4
    assert comm.ep_exchanges(True, False) == 6
    assert comm.ep_exchanges(False, True) == 5


def test_cp_volumes_from_the_shapes():
    """K3's MLA moves per-head K and V on TE's ring: 96 heads x (128 nope + 64 rope + 128 value) x 2 B = 61,440 B per
    token; a ring at C = 4 sends 3 (C - 1) = 9 local chunks per layer (forward C - 1, backward 2 (C - 1)). KDA's KCP
    exchanges one FP32 [96, 128, 256] tensor = 12 MiB per layer, gathered from C - 1 ranks in forward and backward."""
    from k3opt.cost import comm

    kv = comm.cp_mla_kv_bytes_per_token(96, 128 + 64, 128)
    assert kv == 61_440
    assert comm.cp_mla_ring_bytes(4, 8192, kv) == 9 * 8192 * 61_440
    assert comm.cp_mla_ring_bytes(1, 8192, kv) == 0
    state = comm.cp_kda_state_bytes(96, 128, 128)
    assert state == 12 * 2**20
    assert comm.cp_kda_allgather_bytes(4, state) == 2 * 3 * 12 * 2**20
    # GB200: 2,500 TFLOP/s dense BF16 over 900 GB/s NVLink -> the ring hides behind attention from 5,556 tokens.
    assert comm.cp_overlap_min_tokens(2500e12, 900e9) == pytest.approx(5555.6, abs=0.1)


def test_cp_prices_mla_and_kda_layers():
    """At 32K context with full recompute, CP = 2 (a pair of consecutive ranks, one NVLink domain) adds to an MLA
    layer's NVLink time the KV ring, 4 (C - 1) T x 61,440 B (forward, recompute forward, backward 2x) with T =
    16,384, and to a KDA layer the state all-gathers, 3 (C - 1) x 12 MiB. Both layers are MoE with the same EP and
    FSDP traffic pattern, so the change of (MLA - KDA) NVLink time from CP = 1 to CP = 2 is exactly the difference
    of those two: (4 x 16,384 x 61,440 - 3 x 12 MiB) / 900 GB/s."""
    import k3opt
    from k3opt.cost.coefficients import Shape, coefficients

    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    lays = {c: k3opt.inputs.presets.make_layout(gpus=512, pp=8, cp=c, ep=64, dense_fsdp=32, microbatches=8 * c,
                                       context=32768, split=[12] * 7 + [9], recompute="full", reserve_gib=4,
                                       domain_gpus_used=64) for c in (1, 2)}
    cf = {c: coefficients(Shape.of(lay), model, cluster) for c, lay in lays.items()}
    mla, kda = 3, 2
    assert mla in model.full_attention_layers and kda not in model.full_attention_layers
    assert cf[2].tokens == 16384 and cf[2].placement.cp_in_domain
    diff = {c: cf[c].time["nvlink"][mla] - cf[c].time["nvlink"][kda] for c in cf}
    want = (4 * 16384 * 61_440 - 3 * 12 * 2**20) / 900e9
    assert diff[2] - diff[1] == pytest.approx(want, rel=1e-6)
    assert not any("CP attention communication" in u for u in k3opt.evaluate(lays[2]).step.unpriced)


def test_members_per_domain_are_counted_per_group():
    """Four pairs of ranks, each pair inside one 4-GPU domain (two pairs per domain): every member sees 2 of its
    group in its domain, not the 4 ranks of two groups sharing it."""
    import numpy as np

    assert comm._min_members_per_domain(np.array([[6, 7], [4, 5], [3, 0], [1, 2]]), 4) == 2
    assert comm._min_members_per_domain(np.array([[0, 4], [1, 5]]), 4) == 1


def test_a_single_stage_pipeline_is_inside_its_domain():
    pl = comm.placement(8, 1, 1, 8, 1, 8, 72)
    assert pl.pipeline_in_domain and pl.pp_hop_in_domain == (True,) and pl.ep_local == 8


# Link bytes and per-policy buffers of the cost model (k3opt.cost.coefficients) on layouts no golden test covers, each
# figure derived from the configs' shapes: the hierarchical EP dispatcher (HybridEP / DeepEP) against the flat
# all-to-all across two NVLink domains, context-parallel traffic on the NIC and on NVLink, an expert group that shards
# nothing under expert FSDP 2, the accumulation buffer of a group whose gradients are not sharded, and the
# optimizer-step gather of a one-rank group.

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
    over 16) shards D. FP32 masters and gradients; Qwen3 trains every tensor with AdamW (its recipe), two FP32
    moments per owned parameter."""
    cf = _cf(_qwen(ep=8, expert_fsdp=2, expert_sharding="no_shard"))
    owned = DENSE / 16 + ROUTED / 8
    assert cf.master[5] == pytest.approx(4 * owned, rel=1e-12, abs=0)
    assert cf.grads[5] == pytest.approx(4 * owned, rel=1e-12, abs=0)
    assert cf.optimizer[5] == pytest.approx(8 * owned, rel=1e-12, abs=0)


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


# An EP group split unevenly over NVLink domains: Qwen3-30B-A3B at EP16 on a GB200 rack with 10 GPUs of each domain
# used, so 10 EP ranks sit in one domain and 6 in the other. HybridEP sends a token over the NIC once to the one other
# domain if that domain's experts hold any of the token's 8 (DeepEP README, internode kernels): at most one NIC copy per
# token and exchange, with a hit probability between those of the two kinds of member. The cost model prices a domain as
# E a / e experts; this pins what holds whatever the split: one other domain, a probability in range.

A2A_NIC_GB200 = 43.74e9  # constraints/rates/gb200-nvl72.toml: HybridEP's measured all-to-all bandwidth across domains


def test_a_token_leaves_its_domain_at_most_once_when_the_domains_are_uneven():
    lay = k3opt.make_layout(gpus=16, pp=1, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=1, context=T,
                            split=[48], recompute="full", domain_gpus_used=10, dispatcher="hybridep")
    rates = load_rates("gb200-nvl72").model_copy(update={"collective_base_latency_us": None})
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("gb200-nvl72"),
                      rates=rates)
    per_copy = 6 * T * 2048 * 2  # 6 exchanges under full recompute x T x d 2,048 x 2 B (BF16)
    copies = cf.achievable["ep_nic"][5] * A2A_NIC_GB200 / per_copy  # NIC copies per token and exchange, MoE layer 5
    # 128 experts over 16 ranks, 8 each: a member of the 10 sees 6 x 8 = 48 experts in the other domain, a member
    # of the 6 sees 80; P(hit) = 1 - C(128 - x, 8) / C(128, 8).
    low, high = 1 - comb(128 - 48, 8) / comb(128, 8), 1 - comb(128 - 80, 8) / comb(128, 8)
    assert low <= copies <= high < 1


# Context parallelism's traffic, stall and buffers on both link kinds (TE's p2p KV ring for MLA, FLA KCP's state
# all-gather for KDA), each figure worked out from the layer shapes.

def test_cp_helpers_are_zero_without_cp():
    assert comm.cp_mla_ring_bytes(1, 4096, 61_440) == 0.0
    assert comm.cp_mla_ring_buffer_bytes(1, 4096, 61_440) == 0.0
    assert comm.cp_kda_allgather_bytes(1, 12 * 2**20) == 0.0
    # CP 4: the ring sends 3 (C - 1) T kv, buffers 4 T kv; KDA gathers 2 (C - 1) states.
    assert comm.cp_mla_ring_bytes(4, 4096, 61_440) == 9 * 4096 * 61_440
    assert comm.cp_mla_ring_buffer_bytes(4, 4096, 61_440) == 4 * 4096 * 61_440
    assert comm.cp_kda_allgather_bytes(4, 12 * 2**20) == 6 * 12 * 2**20


def test_cp_across_domains_rides_the_nic():
    """K3, CP 2, T = 16,384 local tokens, full recompute, CP groups across NVLink domains (NIC, 50 GB/s).
    MLA layer 3: the ring carries full heads, 96 x (192 + 128) x 2 B = 61,440 B per token; sent = 3 (C - 1) T kv
    x 4/3 (recompute replays the forward ring) = 4 x 16,384 x 61,440 B; buffers 4 T kv; the stall is the
    transfer minus the attention it overlaps.
    KDA layer 2: state 12 MiB, 2 (C - 1) x 12 MiB x 3/2 = 36 MiB received, all of it a stall; buffer C x state."""
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    lay = k3opt.make_layout(gpus=512, pp=8, cp=2, ep=64, dense_fsdp=32, microbatches=16, context=32768,
                            split=[12] * 7 + [9], recompute="full", reserve_gib=4, domain_gpus_used=64)
    n = model.num_layers + 2
    mla_sent, kda_got = 4 * 16384 * 61_440, 3 * 12 * 2**20
    attn = np.zeros(n)
    attn[3] = 0.99 * mla_sent / 50e9 * 2500e12  # attention at 2,500 TF/s covering 99 % of the ring's transfer
    nvl, nic, stall, ws = _context_parallel(model, Shape.of(lay), 16384, cluster, False, attn, True)
    assert not nvl.any()
    assert nic[3] == mla_sent and nic[2] == kda_got
    assert ws[3] == 4 * 16384 * 61_440 and ws[2] == 2 * 12 * 2**20
    assert stall[3] == pytest.approx(mla_sent / 50e9 - attn[3] / 2500e12, rel=1e-12, abs=0)
    assert stall[2] == pytest.approx(kda_got / 50e9, rel=1e-14, abs=0)
    on_nvl = _context_parallel(model, Shape.of(lay), 16384, cluster, True, np.zeros(n), True)
    assert not on_nvl[1].any() and on_nvl[0][3] == mla_sent
    assert on_nvl[2][2] == pytest.approx(kda_got / 900e9, rel=1e-14, abs=0)


# NCCL's per-call latency (the alpha term, k3opt.cost.coefficients.collective_latency) on a layout whose three groups
# sit differently on B200's 8-GPU NVLink domains: EP8 inside one domain, dense FSDP 16 over two, expert FSDP 2 with its
# two members in different domains. Each call costs NCCL's ring latency (constraints/rates/b200.toml, from NVIDIA/nccl
# src/graph/tuning.cc): base 8.4 us + 3.4 us per NVLink hop + 14.0 us per network hop.

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


# The pipeline hop's seconds per byte at the achievable rates (Coefficients.pp_seconds_per_byte_achievable): a hop whose
# ranks all stay inside an NVLink domain moves at the NVLink peak x the measured collective fraction, any other at the
# NIC peak x its fraction. Figures from constraints/clusters/b200.toml (NVIDIA B200 datasheet) and
# constraints/rates/b200.toml (each fraction with its source there).

NVLINK_FRAC, NIC_FRAC = 0.65, 0.92   # collective_nvlink, collective_nic


def test_pipeline_hops_alternate_between_nvlink_and_the_nic_at_the_measured_fractions():
    """Qwen3-30B-A3B on 16 B200 GPUs in 8-GPU domains, PP4: each stage is 4 consecutive GPUs (tp-cp-ep-dp-pp
    order), so stages 0 and 1 share domain 0, stages 2 and 3 domain 1. Hops 0 -> 1 and 2 -> 3 stay on NVLink;
    1 -> 2 and the wrap-around 3 -> 0 cross domains, on the NIC."""
    lay = k3opt.make_layout(gpus=16, pp=4, ep=4, dense_fsdp=4, expert_fsdp=1, microbatches=8, context=4096,
                            split=[12, 12, 12, 12], domain_gpus_used=8)
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=load_rates("b200"))
    nvl, nic = 1 / (NVLINK * NVLINK_FRAC), 1 / (NIC * NIC_FRAC)  # 1.709e-12 and 2.174e-11 s/B
    assert cf.pp_seconds_per_byte_achievable == pytest.approx((nvl, nic, nvl, nic), rel=1e-12, abs=0)
    # The peak bound of the same hops: the links' peaks alone.
    assert cf.pp_seconds_per_byte == pytest.approx((1 / NVLINK, 1 / NIC, 1 / NVLINK, 1 / NIC), rel=1e-12, abs=0)


def test_ep_payload_counts_each_copy():
    # 4 exchanges x 4,096 tokens x 7,168 wide x 2 B x 2 copies = 469,762,048 B (seed 002's payload).
    assert comm.ep_payload_bytes(4, 4096, 7168, 2.0) == 469_762_048
