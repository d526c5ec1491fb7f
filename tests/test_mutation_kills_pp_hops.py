"""The pipeline hop's seconds per byte at the achievable rates (Coefficients.pp_seconds_per_byte_achievable): a hop
whose ranks all stay inside an NVLink domain moves at the NVLink peak x the measured collective fraction, any
other at the NIC peak x its fraction. Figures from constraints/clusters/b200.toml (NVIDIA B200 datasheet) and
constraints/rates/b200.toml (each fraction with its source there)."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates

NVLINK, NIC = 900e9, 50e9            # B/s per GPU and direction
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

