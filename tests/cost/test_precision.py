"""Compute precision as a layout field: per-precision dense peaks (datasheet), which GEMMs run in it, the
quantized saved inputs and weight copies with their block scales, and bad input."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients


def test_gb200_dense_peaks_from_the_rack_datasheet(cluster):
    # NVL72 page, per rack with 2:4 sparsity: 360 PF BF16, 720 PF FP8, 1,440 PF FP4; dense = half, / 72 GPUs.
    assert cluster.dense_tflops("bf16") == 360e3 / 2 / 72
    assert cluster.dense_tflops("fp8") == cluster.dense_tflops("mxfp8") == 720e3 / 2 / 72
    assert cluster.dense_tflops("nvfp4") == 1440e3 / 2 / 72


def test_hopper_has_no_block_scaled_or_fp4_peaks():
    h100 = k3opt.load_cluster("h100-sxm")
    assert h100.dense_tflops("fp8") == 1979
    for p in ("mxfp8", "nvfp4"):
        with pytest.raises(k3opt.LayoutError, match="use bf16"):
            h100.dense_tflops(p)


def _llama(precision: str, **kw) -> k3opt.Layout:
    return k3opt.make_layout(gpus=64, dense_fsdp=64, microbatches=2, rows=2, context=8192, split=[80],
                             recompute="selective", precision=precision, **kw)


def test_linear_gemms_run_at_the_precision_peak_attention_stays_bf16():
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    bf, f8 = (coefficients(Shape.of(_llama(p)), model, cluster) for p in ("bf16", "fp8"))
    T = 2 * 8192
    # One Llama 3 70B layer's linear weights: q, o 8192^2; k, v 1024 x 8192; gate, up, down 28672 x 8192.
    linear = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192
    saved_s = 6 * T * linear * (1 / 2.5e15 - 1 / 5e15)
    assert bf.time["tensor"][5] - f8.time["tensor"][5] == pytest.approx(saved_s, rel=1e-12)
    assert f8.gemm_flops[5] == 6 * T * linear and bf.gemm_flops.sum() == 0
    # The output head (128,256 x 8192) stays BF16: same time at both precisions.
    assert f8.time["tensor"][bf.last] == pytest.approx(bf.time["tensor"][bf.last])


def test_mxfp8_saves_gemm_inputs_at_one_byte_plus_e8m0_scale_and_caches_weight_copies():
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    bf, mx = (coefficients(Shape.of(_llama(p)), model, cluster) for p in ("bf16", "mxfp8"))
    T = 2 * 8192
    # Selective recompute keeps the non-recomputable GEMM input of attention: its output [T, 64 x 128] goes from
    # 2 bytes to 1 + 1/32 bytes (one E8M0 per 32 elements).
    assert bf.act[5] - mx.act[5] == pytest.approx(T * 8192 * (2 - (1 + 1 / 32)))
    # Row- and column-wise MXFP8 copies of the layer's 855,638,016 linear weights, sharded by nothing (the
    # BF16 view is gathered): 2 x 1.03125 bytes each.
    linear = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192
    assert mx.quantized_weights[5] == pytest.approx(2 * (1 + 1 / 32) * linear)
    assert bf.quantized_weights.sum() == 0


def test_precision_is_checked_against_the_cluster():
    with pytest.raises(k3opt.LayoutError, match="no block-scaled"):
        k3opt.evaluate(_llama("mxfp8"), model="llama3-70b", cluster="h100-sxm")


def test_unknown_precision_and_job_default():
    with pytest.raises(k3opt.LayoutError, match="precision"):
        _llama("fp6")
    job = k3opt.load_job("k3-512-4k")
    assert [p.value for p in job.precisions] == ["bf16"]
