"""GEMM rate by shape: XLA's measured sm_100 matmul table (constraints/rates/gemm-shapes/xla-matmul-sm100.toml,
copied from tensorflow/tensorflow@a305421c third_party/xla/xla/backends/gpu/cost_model/matmul_interpolator_data.h,
key sm_100, b = 1), read relative to each class fraction's measured shape. Expected values are the table's own
numbers (TFLOP/s, C[m, n] = A[m, k] B[k, n]) and hand interpolation in log2 between its grid points."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients, fused_gemm_widths
from k3opt.inputs.errors import K3optError, SpecError
from k3opt.inputs.rates import load_gemm_table, load_rates
from k3opt.inputs.specs import Precision

# The table's FP8 (f8e4m3fn x f8e4m3fn -> bf16) figures used below, TFLOP/s at (m, n, k) (the header's FLOP/s / 1e12):
F8 = {
    (4096, 4096, 4096): 2764.982,  # 2764981863158106
    (2048, 4096, 4096): 2491.280,  # 2491280334106728
    (4096, 2048, 4096): 2499.435,  # 2499435394486069: gemm_grouped's reference (K 7,168 held at 4096)
    (2048, 2048, 2048): 1427.730,
    (2048, 1024, 2048): 985.084,
    (2048, 2048, 1024): 970.614,
    (1024, 2048, 2048): 979.468,
    (2048, 2048, 512): 503.631,
    (2048, 512, 2048): 567.517,
    (4096, 2048, 512): 871.278,
    (256, 256, 256): 6.920,
}
# constraints/clusters/b200.toml, constraints/rates/b200.toml
MXFP8_PEAK, GROUPED_MXFP8, DENSE_MXFP8, HBM, HBM_FRAC = 4500e12, 0.534, 0.564, 8000e9, 0.74


def test_the_table_holds_the_published_figures():
    tab = load_gemm_table("xla-matmul-sm100")
    for (m, n, k), tf in F8.items():
        assert tab.rate("f8e4m3fn", m, n, k) == pytest.approx(tf, abs=1e-9)
    assert tab.rate("bf16", 4096, 4096, 4096) == pytest.approx(1416.867, abs=1e-9)  # 1416867213789406


def test_interpolation_is_linear_in_log2_and_flat_beyond_the_grid():
    tab = load_gemm_table("xla-matmul-sm100")
    # m half-way (in log2) between 2048 and 4096: the mean of the two grid rates.
    assert tab.rate("f8e4m3fn", 2048 * 2 ** 0.5, 4096, 4096) == pytest.approx((2491.280 + 2764.982) / 2, abs=1e-9)
    # Beyond the grid each dimension is held at its end: 16384^3 reads 4096^3, 128 x 256 x 256 reads 256^3.
    assert tab.rate("f8e4m3fn", 16384, 16384, 16384) == pytest.approx(2764.982, abs=1e-9)
    assert tab.rate("f8e4m3fn", 128, 256, 256) == pytest.approx(6.920, abs=1e-9)


def test_each_class_reads_the_table_relative_to_its_own_measured_shape():
    """gemm_dense was measured at 16384^3 (read at 4096^3), gemm_grouped at K 7,168, N 2,048 (read at m 4096,
    n 2048, k 4096): at those shapes the factor is 1, so the class fraction is not reduced twice."""
    r = load_rates("b200")
    f = r.shape_factors(Precision.MXFP8, np.array([0, 1, 0]), np.array([16384, 4096, 2048]),
                        np.array([16384, 2048, 2048]), np.array([16384, 7168, 2048]))
    assert f.tolist() == pytest.approx([1.0, 1.0, 1427.730 / 2764.982], abs=1e-12)
    # NVFP4 has no column in the table: the caller keeps the cube-edge curve.
    assert r.shape_factors(Precision.NVFP4, np.array([0]), np.array([2048]), np.array([2048]),
                           np.array([2048])) is None


def test_megatron_fuses_qkv_and_gate_up():
    rows = [("gqa.q_proj", 4096), ("gqa.k_proj", 512), ("gqa.v_proj", 512), ("gqa.o_proj", 2048)]
    assert fused_gemm_widths(rows) == [5120, 5120, 5120, 2048]
    rows = [("moe.router", 128), ("moe.experts.w1", 768), ("moe.experts.w3", 768), ("moe.experts.w2", 2048)]
    assert fused_gemm_widths(rows) == [128, 1536, 1536, 2048]
    # MLA's projections stay separate even where two read the same input.
    rows = [("mla.q_a_proj", 1536), ("mla.q_b_proj", 24576), ("mla.kv_a_proj", 576)]
    assert fused_gemm_widths(rows) == [1536, 24576, 576]


def test_routed_expert_gemms_pass_by_pass_on_the_table():
    """Qwen3-30B-A3B, one layer's routed experts on 8 B200, MXFP8, no recompute, T = 4,096, EP8: each expert sees
    4,096 x 8 x 8 / 128 = 2,048 tokens. fc1 = w1 and w3 [768, 2048] fused into one 1,536-wide GEMM; fc2 = w2
    [2048, 768]. Each weight's 6 T out in x 8 FLOPs split in three passes of 2 T out in x 8, each at
    4,500 TF x 0.534 x table(pass) / table(4096, 2048, 4096) = 2,499.435, capped by one dense GEMM of the same
    shape, 4,500 TF x 0.564 x table(pass) / table(4096, 4096, 4096) = 2,764.982 (0.564 / 2,764.982 is the lesser:
    the cap binds on every pass):
      fc1 forward (m 2048, n 1536, k 2048), data gradient (2048, 2048, 1536), weight gradient (1536, 2048, 2048);
      fc2 forward (2048, 2048, 768), data gradient (2048, 768, 2048), weight gradient (2048, 768, 2048).
    1,536 and 768 sit log2(1.5) = 0.585 of the way from 1,024 to 2,048 and from 512 to 1,024. The memory-bound part
    is 5 x 80,576 B a token (tests/cost/test_achievable_terms.py) x 4,096 tokens at 8 TB/s x 0.74."""
    f = math.log2(1.5)
    fc1 = [F8[(2048, 1024, 2048)] + f * (F8[(2048, 2048, 2048)] - F8[(2048, 1024, 2048)]),   # 1,244.016
           F8[(2048, 2048, 1024)] + f * (F8[(2048, 2048, 2048)] - F8[(2048, 2048, 1024)]),   # 1,238.010
           F8[(1024, 2048, 2048)] + f * (F8[(2048, 2048, 2048)] - F8[(1024, 2048, 2048)])]   # 1,241.684
    fc2 = [F8[(2048, 2048, 512)] + f * (F8[(2048, 2048, 1024)] - F8[(2048, 2048, 512)]),     # 776.799
           F8[(2048, 512, 2048)] + f * (F8[(2048, 1024, 2048)] - F8[(2048, 512, 2048)]),     # 811.778
           F8[(2048, 512, 2048)] + f * (F8[(2048, 1024, 2048)] - F8[(2048, 512, 2048)])]
    pass_flops = 2 * 4096 * 768 * 2048 * 8          # one pass of one [768, 2048] weight: 103,079,215,104
    def seconds(x: float) -> float:
        return pass_flops / (MXFP8_PEAK * min(GROUPED_MXFP8 * x / F8[(4096, 2048, 4096)],
                                              DENSE_MXFP8 * x / F8[(4096, 4096, 4096)]))

    gemm = 2 * sum(seconds(x) for x in fc1) + sum(seconds(x) for x in fc2)
    assert seconds(1000.0) == pytest.approx(pass_flops / (MXFP8_PEAK * DENSE_MXFP8 * 1000.0 / 2764.982))
    vector = 5 * 80_576 * 4096 / (HBM * HBM_FRAC)
    lay = k3opt.make_layout(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                            split=[48], recompute="none", precision="mxfp8")
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=load_rates("b200"))
    assert cf.moe_compute_achievable[5] == pytest.approx(gemm + vector, rel=1e-6, abs=0)
    # The same GEMMs on the cube-edge curve alone (the rates without the table) would read one factor for all
    # three passes at (2048 x 768 x 2048)^(1/3): a different figure.
    cube = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                        rates=load_rates("b200").model_copy(update={"gemm_shape": None}))
    assert abs(cube.moe_compute_achievable[5] - cf.moe_compute_achievable[5]) > 1e-5


@pytest.mark.parametrize("precision, grad", [("mxfp8", None), ("fp8", "e5")])
def test_a_routed_gemm_under_its_dense_cap_runs_at_the_grouped_rate(precision, grad):
    """The same routed experts as in test_routed_expert_gemms_pass_by_pass_on_the_table with a grouped fraction of
    0.45 instead of 0.534: per pass the grouped rate 0.45 x table(pass) / 2,499.435 is now under the dense cap
    0.564 x table(pass) / 2,764.982 (0.45 / 2,499.435 = 1.800e-4 < 0.564 / 2,764.982 = 2.040e-4), so every pass runs
    at the grouped rate. Under the hybrid FP8 recipe the two gradient passes read the E5M2 column (as in
    test_fp8_gradient_gemms_read_the_e5m2_column), relative to the forward column's reference; MXFP8 reads E4M3."""
    f = math.log2(1.5)
    gt = E5 if grad == "e5" else F8
    fc1 = [F8[(2048, 1024, 2048)] + f * (F8[(2048, 2048, 2048)] - F8[(2048, 1024, 2048)]),
           gt[(2048, 2048, 1024)] + f * (gt[(2048, 2048, 2048)] - gt[(2048, 2048, 1024)]),
           gt[(1024, 2048, 2048)] + f * (gt[(2048, 2048, 2048)] - gt[(1024, 2048, 2048)])]
    fc2 = [F8[(2048, 2048, 512)] + f * (F8[(2048, 2048, 1024)] - F8[(2048, 2048, 512)]),
           gt[(2048, 512, 2048)] + f * (gt[(2048, 1024, 2048)] - gt[(2048, 512, 2048)]),
           gt[(2048, 512, 2048)] + f * (gt[(2048, 1024, 2048)] - gt[(2048, 512, 2048)])]
    pass_flops = 2 * 4096 * 768 * 2048 * 8

    def seconds(x: float) -> float:  # the grouped rate, under the cap (B200's FP8 and MXFP8 peaks are equal)
        return pass_flops / (MXFP8_PEAK * 0.45 * x / F8[(4096, 2048, 4096)])

    gemm = 2 * sum(seconds(x) for x in fc1) + sum(seconds(x) for x in fc2)
    r = load_rates("b200")
    prec = Precision(precision)
    slow = r.model_copy(update={"gemm_grouped": {**r.gemm_grouped, prec: r.gemm_grouped[prec].model_copy(
        update={"value": 0.45})}})
    lay = k3opt.make_layout(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                            split=[48], recompute="none", precision=precision)
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"), rates=slow)
    assert cf.moe_compute_achievable[5] - cf.moe_vector_achievable[5] == pytest.approx(gemm, rel=1e-6, abs=0)


def _rates_text() -> str:
    from k3opt.inputs.presets import preset_dir

    return (preset_dir("rates") / "b200.toml").read_text()


def test_unknown_table_or_column_is_one_clear_error(tmp_path):
    text = _rates_text()
    cases = {
        "table": (text.replace('table = "xla-matmul-sm100"', 'table = "no-such-table"'), "no-such-table"),
        "column": (text.replace('mxfp8 = "f8e4m3fn"', 'mxfp8 = "f4e2m1"'), "f4e2m1"),
        "reference": (text.replace("grouped_reference = [4096, 2048, 7168]", "grouped_reference = [4096, 2048]"),
                      "grouped_reference"),
    }
    for name, (body, needle) in cases.items():
        bad = tmp_path / f"{name}.toml"
        bad.write_text(body)
        with pytest.raises(SpecError, match=needle):
            load_rates(str(bad))


def test_malformed_table_is_one_clear_error(tmp_path):
    bad = tmp_path / "t.toml"
    bad.write_text('name = "t"\nunit = "TFLOP/s"\nsource = "x"\ngrid = [256, 512]\n[tflops]\nbf16 = [[[1.0, 2.0]]]\n')
    with pytest.raises(K3optError, match="2 x 2 x 2"):
        load_gemm_table(str(bad))
    with pytest.raises(K3optError, match="unknown GEMM shape table"):
        load_gemm_table("nothing-here")


def test_mxfp8_cast_kernels_run_at_their_measured_rate():
    """The cast kernels (BF16 read, row- and column-wise MXFP8 copies written: 2 + 2 x (1 + 1/32) = 4.0625 B per
    element) run at 0.651 of 8 TB/s (constraints/rates/b200.toml [hbm_quantize]), the other streaming kernels at
    0.74. Qwen3-30B-A3B on 8 B200, EP8, MXFP8, T = 4,096, one layer:
      per microbatch, X and dY of every quantized GEMM, a fused GEMM's input once (Megatron's linear_qkv and the
      gated linear_fc1 are one TransformerEngine linear each): linear_qkv (2048 + 4096 + 512 + 512) + o (4096 + 2048)
      + 8 active experts x (fc1 (2048 + 2 x 768) + fc2 (768 + 2048)) = 64,512 elements a token:
      64,512 x 4.0625 x 4,096 = 1,073,479,680 B;
      per update, the layer's weights once: q, k, v, o 18,874,368 + 128 x 3 x 768 x 2048 / 8 = 75,497,472 routed
      = 94,371,840 elements x 4.0625 = 383,385,600 B."""
    lay = k3opt.make_layout(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                            split=[48], recompute="none", precision="mxfp8")
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    cast = coefficients(Shape.of(lay), model, cluster, rates=load_rates("b200"))
    copy = coefficients(Shape.of(lay), model, cluster,
                        rates=load_rates("b200").model_copy(update={"hbm_quantize": None}))
    extra = 1 / (HBM * 0.651) - 1 / (HBM * HBM_FRAC)
    assert cast.achievable["vector"][5] - copy.achievable["vector"][5] == pytest.approx(1_073_479_680 * extra,
                                                                                     rel=1e-9, abs=0)
    assert cast.update_achievable["hbm"][5] - copy.update_achievable["hbm"][5] == pytest.approx(
        383_385_600 * extra, rel=1e-9, abs=0)
    # The peak roofline counts the same bytes at the HBM peak either way.
    assert cast.time["hbm"][5] == copy.time["hbm"][5]
    # BF16 quantizes nothing: the rate changes nothing.
    bf = lay.model_copy(update={"precision": "bf16"})
    a = coefficients(Shape.of(bf), model, cluster, rates=load_rates("b200"))
    b = coefficients(Shape.of(bf), model, cluster, rates=load_rates("b200").model_copy(update={"hbm_quantize": None}))
    assert a.achievable["vector"][5] == b.achievable["vector"][5]


def test_a_relative_table_path_is_read_beside_the_rates_file(tmp_path, monkeypatch):
    """A user's rates file naming its own table by a relative path (`table = "tables/mine.toml"`) reads the table
    from the rates file's folder, whatever the working directory; the same table under a shipped name reads the same
    figures (the copy below is byte for byte the shipped one, so any (m, n, k) reads alike)."""
    from k3opt.inputs.presets import preset_dir

    folder = tmp_path / "site" / "rates"
    (folder / "tables").mkdir(parents=True)
    shipped = preset_dir("rates") / "gemm-shapes" / "xla-matmul-sm100.toml"
    (folder / "tables" / "mine.toml").write_text(shipped.read_text())
    (folder / "mine.toml").write_text(_rates_text().replace('table = "xla-matmul-sm100"',
                                                            'table = "tables/mine.toml"'))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = load_rates(str(folder / "mine.toml"))
    assert Path(r.gemm_shape.table) == (folder / "tables" / "mine.toml").resolve()
    f = r.shape_factors(Precision.MXFP8, np.array([0]), np.array([2048]), np.array([2048]), np.array([2048]))
    assert f.tolist() == pytest.approx([1427.730 / 2764.982], abs=1e-12)
    # A table that is not beside the file is one clear error that names the path it looked for.
    (folder / "tables" / "mine.toml").unlink()
    load_gemm_table.cache_clear()
    with pytest.raises(SpecError, match="tables/mine.toml"):
        load_rates(str(folder / "mine.toml"))


# The table's E5M2 x E4M3 figures (f8e5m2xf8e4m3fn -> bf16), TFLOP/s at (m, n, k), the header's FLOP/s / 1e12:
E5 = {
    (2048, 2048, 2048): 1425.715,  # 1425715284979253
    (2048, 2048, 1024): 969.081,   # 969081068592057
    (1024, 2048, 2048): 983.280,   # 983280058608058
    (2048, 512, 2048): 544.356,    # 544355804309252
    (2048, 1024, 2048): 990.423,   # 990422528767439
    (4096, 4096, 4096): 2784.420,  # 2784419640842787
}


def test_fp8_gradient_gemms_read_the_e5m2_column():
    """The hybrid FP8 recipe (Megatron-Bridge fp8 = "hybrid") holds dY in E5M2: its data gradient dY W and weight
    gradient dY^T X read the table's E5M2 x E4M3 column, relative to the forward column's reference (the class
    fractions were measured E4M3 x E4M3). MXFP8 is E4M3 in every pass (fp8 = "e4m3"): its gradients read f8e4m3fn."""
    tab = load_gemm_table("xla-matmul-sm100")
    for (m, n, k), tf in E5.items():
        assert tab.rate("f8e5m2xf8e4m3fn", m, n, k) == pytest.approx(tf, abs=1e-9)
    r = load_rates("b200")
    one = (np.array([0]), np.array([2048]), np.array([2048]), np.array([2048]))
    assert r.shape_factors(Precision.FP8, *one, gradient=True).tolist() == pytest.approx([1425.715 / 2764.982])
    assert r.shape_factors(Precision.FP8, *one).tolist() == pytest.approx([1427.730 / 2764.982])
    assert r.shape_factors(Precision.MXFP8, *one, gradient=True).tolist() == pytest.approx([1427.730 / 2764.982])
    # Qwen3-30B-A3B's routed experts at FP8 on 8 B200 as in test_routed_expert_gemms_pass_by_pass_on_the_table:
    # the forward passes read F8, both gradient passes E5 (interpolated the same way), the dense cap binding.
    f = math.log2(1.5)
    fc1 = [F8[(2048, 1024, 2048)] + f * (F8[(2048, 2048, 2048)] - F8[(2048, 1024, 2048)]),
           E5[(2048, 2048, 1024)] + f * (E5[(2048, 2048, 2048)] - E5[(2048, 2048, 1024)]),   # 1,238.134
           E5[(1024, 2048, 2048)] + f * (E5[(2048, 2048, 2048)] - E5[(1024, 2048, 2048)])]   # 1,242.128
    fc2 = [F8[(2048, 2048, 512)] + f * (F8[(2048, 2048, 1024)] - F8[(2048, 2048, 512)]),
           E5[(2048, 512, 2048)] + f * (E5[(2048, 1024, 2048)] - E5[(2048, 512, 2048)]),     # 805.237
           E5[(2048, 512, 2048)] + f * (E5[(2048, 1024, 2048)] - E5[(2048, 512, 2048)])]
    pass_flops = 2 * 4096 * 768 * 2048 * 8

    def seconds(x: float) -> float:
        return pass_flops / (MXFP8_PEAK * min(GROUPED_MXFP8 * x / F8[(4096, 2048, 4096)],
                                              DENSE_MXFP8 * x / F8[(4096, 4096, 4096)]))

    gemm = 2 * sum(seconds(x) for x in fc1) + sum(seconds(x) for x in fc2)
    lay = k3opt.make_layout(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                            split=[48], recompute="none", precision="fp8")
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=load_rates("b200"))
    moe_gemm = cf.moe_compute_achievable[5] - cf.moe_vector_achievable[5]
    assert moe_gemm == pytest.approx(gemm, rel=1e-6, abs=0)


def test_a_gradient_column_needs_its_forward_column(tmp_path):
    bad = tmp_path / "r.toml"
    bad.write_text(_rates_text().replace('gradient_columns = { fp8 = "f8e5m2xf8e4m3fn" }',
                                         'gradient_columns = { nvfp4 = "f8e5m2xf8e4m3fn" }'))
    with pytest.raises(SpecError, match="gradient_columns name nvfp4"):
        load_rates(str(bad))
    bad.write_text(_rates_text().replace('gradient_columns = { fp8 = "f8e5m2xf8e4m3fn" }',
                                         'gradient_columns = { fp8 = "f8e5m2xf8e5m2" }'))
    with pytest.raises(SpecError, match="f8e5m2xf8e5m2"):
        load_rates(str(bad))


def test_a_fused_gemm_quantizes_its_input_once():
    """DeepSeek-V3's MoE layer, elements the cast kernels quantize per token, X and dY of each quantized GEMM:
    MLA q_a 7168 + 1536, q_b 1536 + 24576, kv_a 7168 + 576, kv_b 512 + 32768, o 16384 + 7168 (MLA's projections
    are separate linears: 99,392); the shared expert's linear_fc1 reads X once, 7168 + 2 x 2048, and its fc2
    2048 + 7168 (20,480); 8 routed experts x the same (163,840): 283,712. Per weight (X once for gate and once for
    up) it would be 7168 x 9 more: 348,224. The embedding stays BF16 and quantizes nothing."""
    from k3opt.cost.coefficients import cost_model

    model = k3opt.load_model("deepseek-v3")
    sa = cost_model(model, k3opt.load_cluster("b200")).static
    moe_layer = int(np.nonzero(sa.moe[:model.num_layers])[0][0])
    assert sa.q_elements[moe_layer] == 99_392 + 20_480 + 8 * 20_480
    assert sa.q_elements[model.num_layers] == 0
