"""The achievable tensor time of K3's chunked delta-rule scan (KDA layers), derived from the config's shapes and
the measured attention-kernel fractions of constraints/rates/gb200-nvl72.toml."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates


def test_kda_scan_flops_run_at_the_attention_kernels_rates():
    """K3's KDA layer 0 has no softmax attention; its chunked delta-rule scan, 3 x 96 heads x (64 x (4 + 3) x 128 +
    6 x 128 x 128) = 44,826,624 FLOPs per token (fwd + bwd; fla chunk_kda, chunk 64, head dim 128), runs as the
    attention core: its forward third at BF16 2,500 TF x 0.391, its backward two thirds at x 0.333. Halving both
    measured fractions adds exactly that time again (T = 4,096, no recompute) and leaves the GEMMs alone."""
    lay = k3opt.make_layout(gpus=64, pp=1, ep=64, dense_fsdp=64, expert_fsdp=1, microbatches=1, context=4096,
                            split=[93], recompute="none")
    m, c = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    r = load_rates("gb200-nvl72")
    slow = r.model_copy(update={
        "attention_core": r.attention_core.model_copy(update={"value": 0.391 / 2}),
        "attention_core_backward": r.attention_core_backward.model_copy(update={"value": 0.333 / 2})})
    a = coefficients(Shape.of(lay), m, c, rates=r).achievable["tensor"]
    b = coefficients(Shape.of(lay), m, c, rates=slow).achievable["tensor"]
    core = 4096 * 3 * 96 * (64 * 7 * 128 + 6 * 128 * 128)
    added = core / 3 / (2500e12 * 0.391) + core * 2 / 3 / (2500e12 * 0.333)
    assert b[0] - a[0] == pytest.approx(added, rel=1e-9, abs=0)
    assert b[-1] == a[-1]  # the LM head: GEMMs only
