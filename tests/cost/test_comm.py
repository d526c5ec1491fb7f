"""Placement under Megatron's tp-cp-ep-dp-pp order and the two-level collective split (seed 002; the hardware
notes' 512 = 7.1 NVL72 racks warning)."""

from __future__ import annotations

import pytest

from k3opt.cost import comm


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
