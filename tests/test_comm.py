"""Placement under Megatron's tp-cp-ep-dp-pp order and the two-level collective split (seed 002; the hardware
notes' 512 = 7.1 NVL72 racks warning)."""

from __future__ import annotations

import pytest

from k3opt import comm


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


def test_members_per_domain_are_counted_per_group():
    """Four pairs of ranks, each pair inside one 4-GPU domain (two pairs per domain): every member sees 2 of its
    group in its domain, not the 4 ranks of two groups sharing it."""
    import numpy as np

    assert comm._min_members_per_domain(np.array([[6, 7], [4, 5], [3, 0], [1, 2]]), 4) == 2
    assert comm._min_members_per_domain(np.array([[0, 4], [1, 5]]), 4) == 1


def test_a_single_stage_pipeline_is_inside_its_domain():
    pl = comm.placement(8, 1, 1, 8, 1, 8, 72)
    assert pl.pipeline_in_domain and pl.pp_hop_in_domain == (True,) and pl.ep_local == 8
