"""The achievable-rate arrays (k3opt.cost.coefficients, at the measured fractions of a rates file) pinned per resource:
the tensor time of one MXFP8 MoE layer and of the LM head of Qwen3-30B-A3B on B200 derived GEMM by GEMM from
the config's shapes, every byte resource against the bytes of the peak roofline at the rates file's fractions
(constraints/rates/b200.toml: each fraction with its source there), and the achievable MFU."""

from __future__ import annotations

import numpy as np
import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates

# constraints/clusters/b200.toml (NVIDIA B200 datasheet): dense peaks and link rates per GPU.
BF16_PEAK, MXFP8_PEAK = 2250e12, 4500e12
HBM, NVLINK, NIC, HOST = 8000e9, 900e9, 50e9, 64e9
# constraints/rates/b200.toml: measured fractions of those peaks and HybridEP's all-to-all bandwidths.
DENSE_BF16, DENSE_MXFP8, GROUPED_MXFP8, ATTENTION = 0.716, 0.564, 0.534, 0.391
ATTENTION_BACKWARD = 0.333  # attention_core_backward: 0.391 x 1,208.6 / 1,418.1 (backward / forward TFLOP/s)
HBM_FRAC, NVLINK_FRAC, NIC_FRAC = 0.74, 0.65, 0.92
A2A_NVLINK, A2A_NIC = 533.4e9, 43.74e9


def _layout(**toggles) -> k3opt.Layout:
    """Qwen3-30B-A3B on B200 (8-GPU NVLink domains): EP16 spans two domains, so the all-to-all crosses the NIC
    too; full recompute (one more forward: 4/3 of the layer's FLOPs); activations offloaded to the host."""
    return k3opt.make_layout(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096,
                             split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8,
                             toggles={"activation_offload": True, "fused_cross_entropy": True, **toggles})


@pytest.fixture(scope="module")
def qwen_b200():
    """The coefficients without NCCL's per-call latency (its alpha terms are pinned in tests/test_rates.py), so that
    every link second here is bytes over a rate."""
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    # Without the measured shape table too: these GEMM-by-GEMM figures pin the cube-edge curve (the path a precision
    # without a table column takes); tests/test_gemm_shapes.py pins the table.
    # hbm_quantize too: every HBM byte here at the one copy fraction (tests/test_gemm_shapes.py pins the cast rate).
    bare = load_rates("b200").model_copy(update={"collective_base_latency_us": None, "gemm_shape": None,
                                                 "hbm_quantize": None})
    return coefficients(Shape.of(_layout()), model, cluster, rates=bare), model, cluster


def _size(m: float, out: int, inp: int) -> float:
    """The measured GEMM size curve of the rates file at the cube-equivalent edge (M out in)^(1/3)."""
    return float(load_rates("b200").size_factor(np.array([np.cbrt(m * out * inp)]))[0])


def test_mxfp8_moe_layer_tensor_time_gemm_by_gemm(qwen_b200):
    """One Qwen3-30B-A3B layer, T = 4,096 tokens per microbatch, 6 T out in FLOPs per GEMM:
    GQA q [4096, 2048], k and v [512, 2048], o [2048, 4096] in MXFP8 at 4,500 TF x 0.564 (dense);
    the router [128, 2048] stays BF16 at 2,250 TF x 0.716; the experts w1, w3 [768, 2048] and w2 [2048, 768],
    8 active per token, are grouped MXFP8 GEMMs at 4,500 TF x 0.534 whose M is the tokens one expert receives:
    T k e / E = 4096 x 8 x 16 / 128 = 4,096. Full recompute runs the forward again: x 4/3. The attention core,
    32 heads x (128 + 128) FLOPs per token per document token over 4,096 tokens per unit, runs its forward units (1,
    and 1 more recomputed) at BF16 x 0.391 and its 2 backward units at BF16 x 0.333."""
    cf, _, _ = qwen_b200
    T, m_expert = 4096, 4096 * 8 * 16 / 128
    dense = sum(6 * T * o * i / (MXFP8_PEAK * DENSE_MXFP8 * _size(T, o, i))
                for o, i in ((4096, 2048), (512, 2048), (512, 2048), (2048, 4096)))
    router = 6 * T * 128 * 2048 / (BF16_PEAK * DENSE_BF16 * _size(T, 128, 2048))
    experts = sum(6 * T * o * i * 8 / (MXFP8_PEAK * GROUPED_MXFP8 * _size(m_expert, o, i))
                  for o, i in ((768, 2048), (768, 2048), (2048, 768)))
    unit = T * 32 * 256 * 4096 / BF16_PEAK
    core = 2 * unit / ATTENTION + 2 * unit / ATTENTION_BACKWARD
    assert cf.achievable["tensor"][5] == pytest.approx((dense + router + experts) * 4 / 3 + core, rel=1e-12, abs=0)


def test_lm_head_tensor_time_with_fused_cross_entropy(qwen_b200):
    """The last edge: the untied LM head [151936, 2048] stays BF16 (6 T V d at 2,250 TF x 0.716, no recompute),
    and the fused cross-entropy recomputes the logits in backward: 2 T V d more at the same rate."""
    cf, _, _ = qwen_b200
    T, V, d = 4096, 151936, 2048
    head = 6 * T * V * d / (BF16_PEAK * DENSE_BF16 * _size(T, V, d)) + 2 * T * V * d / (BF16_PEAK * DENSE_BF16)
    assert cf.achievable["tensor"][cf.last] == pytest.approx(head, rel=1e-12, abs=0)
    assert cf.achievable["tensor"][cf.first] == 0.0  # the embedding is a lookup


def test_link_bytes_split_between_collectives_and_the_all_to_all(qwen_b200):
    """Every NVLink / NIC byte of the peak roofline (bytes = seconds x link peak) is either collective traffic
    at the link's measured fraction or EP all-to-all at HybridEP's measured bandwidth; host-link bytes run at
    the link peak (no measured fraction)."""
    cf, _, _ = qwen_b200
    a, t = cf.achievable, cf.time
    for res, peak, frac, a2a in (("nvlink", NVLINK, NVLINK_FRAC, A2A_NVLINK), ("nic", NIC, NIC_FRAC, A2A_NIC)):
        assert a[f"ep_{res}"][5] > 0 and a[res][5] > 0
        got = a[res] * peak * frac + a[f"ep_{res}"] * a2a
        np.testing.assert_allclose(got, t[res] * peak, rtol=1e-12, atol=0)
    assert a["ep_nic"][cf.last] == 0.0  # the head has no all-to-all
    assert a["host_link"][5] > 0
    np.testing.assert_allclose(a["host_link"], t["host_link"], rtol=1e-12, atol=0)


def test_per_update_times_at_the_measured_fractions(qwen_b200):
    """Per update: Newton-Schulz FLOPs at BF16 x 0.716, optimizer HBM traffic at x 0.74, the view refresh
    all-gather at the collective fractions; against the same work at the peaks."""
    cf, _, _ = qwen_b200
    for res, frac in (("tensor", DENSE_BF16), ("hbm", HBM_FRAC), ("nvlink", NVLINK_FRAC), ("nic", NIC_FRAC)):
        assert cf.update[res].sum() > 0, res
        np.testing.assert_allclose(cf.update_achievable[res], cf.update[res] / frac, rtol=1e-12, atol=0)


def test_host_gradient_shards_move_at_the_host_link_peak():
    """ZeRO-2 host gradients: the FP32 shard goes to the host once per update at the host-link peak."""
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    cf = coefficients(Shape.of(_layout(pipeline_zero2_host_grads=True)), model, cluster)
    assert cf.update["host_link"][5] > 0
    np.testing.assert_allclose(cf.update_achievable["host_link"], cf.update["host_link"], rtol=1e-12, atol=0)


def test_hbm_bound_kernels_scale_with_the_hbm_fraction(qwen_b200):
    """Halving the measured HBM fraction doubles the weight-traffic and memory-bound kernel times exactly and
    leaves the GEMM and link times alone."""
    cf, model, cluster = qwen_b200
    rates = load_rates("b200").model_copy(update={"gemm_shape": None, "hbm_quantize": None})  # as the fixture's
    half = rates.model_copy(update={"hbm": rates.hbm.model_copy(update={"value": HBM_FRAC / 2})})
    slow = coefficients(Shape.of(_layout()), model, cluster, rates=half)
    for res in ("hbm", "vector"):
        assert cf.achievable[res][5] > 0
        np.testing.assert_allclose(slow.achievable[res], 2 * cf.achievable[res], rtol=1e-12, atol=0)
    np.testing.assert_allclose(slow.update_achievable["hbm"], 2 * cf.update_achievable["hbm"], rtol=1e-12)
    np.testing.assert_array_equal(slow.achievable["tensor"], cf.achievable["tensor"])
    # The weight-side traffic alone: HBM bytes of the peak roofline = weight traffic + memory-bound kernels'.
    assert cf.achievable["hbm"][5] * HBM * HBM_FRAC < cf.time["hbm"][5] * HBM


def test_achievable_mfu_is_model_flops_over_the_bf16_peak():
    """MFU = model FLOPs per token x tokens/s / (GPUs x BF16 peak); tokens/s = tokens per update / step."""
    lay = _layout()
    ev = k3opt.evaluate(lay, model="qwen3-30b-a3b", cluster="b200")
    st = ev.step
    # Tokens per update: 8 microbatches x 4,096 tokens x 16 data-parallel replicas (dense FSDP 16 = 32 / PP 2).
    tps = 8 * 4096 * 16 / st.achievable_step_time_s
    assert st.achievable_tokens_per_s_per_gpu == pytest.approx(tps / 32, rel=1e-12, abs=0)
    # The peak-bound MFU has the same model FLOPs per token: MFU = F x (tokens/s per GPU) / BF16 peak.
    flops_per_token = st.mfu * BF16_PEAK / st.tokens_per_s_per_gpu
    assert st.achievable_mfu == pytest.approx(flops_per_token * (tps / 32) / BF16_PEAK, rel=1e-14, abs=0)
    # Without an EP overlap schedule the all-to-all over the NIC (43.74 GB/s for ~0.44 s of the stage's bytes)
    # is exposed and binds the stage.
    assert st.achievable_binding == "ep_all_to_all (exposed)" and st.achievable_exposed_ep_s > 0
    assert st.rates == "b200"


def test_an_expert_gemm_sees_t_k_e_over_e_tokens():
    """The routed GEMM's M is the tokens one expert receives, T k e / E: at EP16 4096 x 8 x 16 / 128 = 4,096, at
    EP8 (one 8-GPU domain) 2,048. Only the experts' size factors change, so the layer's achievable tensor time
    moves by the three expert GEMMs re-read on the measured size curve (x 4/3 for full recompute)."""
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    ep8 = k3opt.make_layout(gpus=16, pp=2, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=8, context=4096,
                            split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8)
    cube = load_rates("b200").model_copy(update={"gemm_shape": None})  # the cube-edge curve's path
    t8 = coefficients(Shape.of(ep8), model, cluster, rates=cube).achievable["tensor"][5]
    t16 = coefficients(Shape.of(_layout()), model, cluster, rates=cube).achievable["tensor"][5]
    T = 4096
    diff = sum(6 * T * o * i * 8 / (MXFP8_PEAK * GROUPED_MXFP8) * (1 / _size(2048, o, i) - 1 / _size(4096, o, i))
               for o, i in ((768, 2048), (768, 2048), (2048, 768))) * 4 / 3
    assert diff > 0
    assert t8 - t16 == pytest.approx(diff, rel=1e-9, abs=0)
