"""Compute precision as a layout field: per-precision dense peaks (datasheet), which GEMMs run in it, the
quantized saved inputs and weight copies with their block scales, and bad input; then, each figure derived from
the published configs' shapes, which matrices Transformer Engine quantizes (K3, DeepSeek-V3 with its MTP module),
the quantized GEMM FLOPs at the MXFP8 peak, the cached weight copies and their requantization each update, and one
Qwen3-30B-A3B MXFP8 layer's HBM bytes split into the weight side and the memory-bound kernels between the GEMMs."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients, quantized_gemm
from k3opt.cost.structure import structure_of
from k3opt.inputs.rates import load_rates
from k3opt.inputs.specs import Precision


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
    # Selective recompute keeps the non-recomputable GEMM input of attention, its output [T, 64 x 128]: the core
    # keeps O in BF16 either way, and under MXFP8 the output projection keeps its own copy at 1 + 1/32 bytes (one
    # E8M0 per 32 elements) besides.
    assert mx.act[5] - bf.act[5] == pytest.approx(T * 8192 * (1 + 1 / 32))
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


# The low-precision GEMMs and the HBM traffic around them, each figure derived from the published configs' shapes: which
# matrices Transformer Engine runs in the compute precision (K3, DeepSeek-V3 with its MTP module), the quantized GEMM
# FLOPs and cached weight copies on the MTP edge, and one Qwen3-30B-A3B MXFP8 layer's HBM bytes split into the weight
# side (streamed inside the GEMMs) and the memory-bound kernels between them (the activation bytes and the quantize
# traffic).

# MXFP8: 1 byte per element plus one E8M0 scale per 32 elements (OCP MX spec): 1 + 1/32 B.
QB = 1 + 1 / 32
# constraints/clusters/b200.toml: HBM 8,000 GB/s; constraints/rates/b200.toml: HBM measured fraction 0.74.
HBM, HBM_FRAC = 8000e9, 0.74


def _quantized_names(blocks) -> list[str]:
    return [t.name for b in blocks for t in b.tensors if quantized_gemm(b, t)]


def test_k3_layer_quantizes_its_decoder_projections_only():
    """K3 layer 0 (KDA + dense FFN): every linear projection of the decoder with an active copy per token runs in
    the compute precision, beta_proj included (an AdamW matrix, still a GEMM); the Attention-Residual projections
    [1, d] have no active copy (a per-block weighted sum, not a token GEMM) and stay out; so do the embedding (a
    lookup), the vision tower and projector (image tokens are not priced per text token) and the LM head."""
    st = structure_of(k3opt.load_model("kimi-k3"))
    assert _quantized_names(st.layers[0]) == [
        "kda.q_proj", "kda.k_proj", "kda.v_proj", "kda.g_proj", "kda.o_proj", "kda.f_a_proj", "kda.f_b_proj",
        "kda.beta_proj", "ffn.gate_proj", "ffn.up_proj", "ffn.down_proj"]
    vectors = st.layers[0][2]
    assert [t.name for t in vectors.tensors if t.is_matrix] == ["attn_res.mlp_proj"]  # [1, 7168], 0 active
    assert _quantized_names([vectors]) == []
    assert _quantized_names(st.first) == [] and _quantized_names(st.last) == []


def test_deepseek_mtp_module_quantizes_all_but_the_router_and_the_shared_head():
    """DeepSeek-V3's MTP module on the last edge: eh_proj, the MLA projections, the routed and shared experts run
    in the compute precision; the router and the second pass through the shared output head stay BF16."""
    st = structure_of(k3opt.load_model("deepseek-v3"))
    mtp = [b for b in st.last if b.name.startswith("mtp0.")]
    assert _quantized_names(mtp) == [
        "mtp.eh_proj", "mla.q_a_proj", "mla.q_b_proj", "mla.kv_a_proj", "mla.kv_b_proj", "mla.o_proj",
        "moe.experts.w1", "moe.experts.w3", "moe.experts.w2", "moe.shared_gate", "moe.shared_up",
        "moe.shared_down"]
    head = [b for b in st.last if b.kind == "head"]
    assert _quantized_names(head) == []


@pytest.fixture(scope="module")
def deepseek_mxfp8():
    lay = k3opt.make_layout(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=1, context=4096,
                            split=[61], recompute="full", precision="mxfp8")
    return coefficients(Shape.of(lay), k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb200-nvl72"))


def test_mtp_edge_quantized_gemm_flops_and_weight_copies(deepseek_mxfp8):
    """deepseek-ai/DeepSeek-V3 config.json, d = 7168, T = 4,096 tokens. Quantized active matrix parameters of the
    MTP module: eh_proj 7168 x 14336 = 102,760,448; MLA q_a 1536 x 7168 = 11,010,048, q_b 24576 x 1536 =
    37,748,736, kv_a 576 x 7168 = 4,128,768, kv_b 32768 x 512 = 16,777,216, o 7168 x 16384 = 117,440,512
    (187,105,280); shared expert 3 x 2048 x 7168 = 44,040,192; 8 routed experts x 3 x 2048 x 7168 = 352,321,536.
    The edge is not recomputed: 6 T x 686,227,456 FLOPs. A decoder layer (60: MLA + MoE) under full recompute:
    6 T x 583,467,008 x 4/3. Cached MXFP8 weight copies (row- and column-wise): 2 x (1 + 1/32) B x (the
    module's 333,905,920 non-routed weights + its 256 x 3 x 2048 x 7168 routed weights / EP 8)."""
    cf = deepseek_mxfp8
    T = 4096
    mla = 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512  # 187,105,280
    shared, routed_active = 3 * 2048 * 7168, 8 * 3 * 2048 * 7168
    mtp_active = 7168 * 14336 + mla + shared + routed_active
    assert cf.gemm_flops[cf.last] == pytest.approx(6 * T * mtp_active, rel=1e-12, abs=0)
    assert cf.gemm_flops[60] == pytest.approx(6 * T * (mla + shared + routed_active) * 4 / 3, rel=1e-12, abs=0)
    assert cf.gemm_flops[cf.first] == 0.0  # the embedding is a lookup
    nonrouted = 7168 * 14336 + mla + shared  # 333,905,920
    q_view = nonrouted + 256 * 3 * 2048 * 7168 / 8
    assert cf.quantized_weights[cf.last] == pytest.approx(2 * QB * q_view, rel=1e-12, abs=0)


def test_k3_layer_weight_copies_leave_the_attention_residual_projections_out():
    """K3 layer 0 in MXFP8: KDA q, k, v, g [12288, 7168] and o [7168, 12288] (5 x 88,080,384), f_a [128, 7168]
    917,504, f_b [12288, 128] 1,572,864, beta [96, 7168] 688,128; dense FFN 3 x 33792 x 7168 = 726,663,168; no
    routed weights. Cached copies: 2 x (1 + 1/32) B each."""
    lay = k3opt.load_layout("k3-gb200-512-reference").model_copy(update={"precision": Precision.MXFP8})
    cf = coefficients(Shape.of(lay), k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72"))
    weights = 5 * 12288 * 7168 + 128 * 7168 + 12288 * 128 + 96 * 7168 + 3 * 33792 * 7168  # 1,170,243,584
    assert cf.quantized_weights[0] == pytest.approx(2 * QB * weights, rel=1e-12, abs=0)


# ------------------------------------------------------------------ one Qwen3-30B-A3B layer in MXFP8 on B200
T = 4096
# Qwen/Qwen3-30B-A3B config.json: d 2048, q 32 x 128 = 4096, kv 4 x 128 = 512, 128 experts [768, 2048], top 8.
DENSE = 2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 128 + 128 * 2048 + 2 * 2048  # q, o; k, v; q/k norms; router; norms
ROUTED = 128 * 3 * 768 * 2048
EP, FSDP = 16, 16
VIEW = DENSE + ROUTED / EP                   # BF16 view elements: D + E / e
RESIDENT = DENSE / FSDP + ROUTED / EP        # optim_grads_params: D / f_d + E / (e f_e), f_e = 1
# Quantized GEMM operands per token, active copies x (in + out), a fused GEMM's input X once (Megatron runs q, k, v as
# one linear_qkv and gate, up as one linear_fc1, each quantizing its input once): linear_qkv, o, then 8 experts x
# (fc1 = w1 and w3, fc2 = w2).
Q_ELEMENTS = (2048 + 4096 + 512 + 512) + (4096 + 2048) + 8 * ((2048 + 768 + 768) + (768 + 2048))
# Saved bytes per token (items pinned by name for the GQA and the MoE block in test_structure.py), GEMM inputs at
# 1 + 1/32 B: attention: norm input 2 x 2048, rstd 4, norm output 2048 QB, q 2 x 4096, k, v 2 x 512 each,
# attention output 2 x 4096 (the core's O) + 4096 QB (the output projection's copy), LSE 32 x 4, q / k before
# their norms 2 x 4096, 2 x 512; MoE: norm input 2 x 2048,
# rstd 4, norm output 2 x 2048 (read only by the BF16 router: no shared experts, no latent), router scores
# 128 x 4, top-k weights 8 x 4, indices 8 x 8, dispatched inputs 8 x 2048 QB, SwiGLU input 8 x 2 x 768 x 2,
# activation output 8 x 768 QB, expert outputs 8 x 2048 x 2.
SAVED_PER_TOKEN = (2 * 2048 + 4 + 2048 * QB + 2 * 4096 + 2 * 2 * 512 + 2 * 4096 + 4096 * QB + 32 * 4
                   + 2 * 4096 + 2 * 512
                   + 2 * 2048 + 4 + 2048 * 2 + 128 * 4 + 8 * 4 + 8 * 8 + 8 * 2048 * QB + 8 * 2 * 768 * 2
                   + 8 * 768 * QB + 8 * 2048 * 2)


@pytest.fixture(scope="module")
def qwen_mxfp8():
    lay = k3opt.make_layout(gpus=32, pp=2, ep=EP, dense_fsdp=FSDP, expert_fsdp=1, microbatches=8, context=4096,
                            split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8)
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    return coefficients(Shape.of(lay), model, cluster, rates=load_rates("b200"))


def test_qwen3_layer_saved_bytes_in_mxfp8(qwen_mxfp8):
    """Full recompute: the layer's whole saved set (119,400 B per token) is its recompute working set; it keeps one
    BF16 [T, d] input."""
    assert qwen_mxfp8.recompute_ws[5] == pytest.approx(T * SAVED_PER_TOKEN, rel=1e-12, abs=0)
    assert qwen_mxfp8.act[5] == T * 2048 * 2


def test_qwen3_layer_weight_side_hbm_bytes(qwen_mxfp8):
    """Weight-side HBM bytes per microbatch: the BF16 view read once per pass (forward, recomputed forward, dgrad,
    wgrad: 4 under full recompute), the BF16 gradient written (1 x 2 B), the FP32 gradient shard read and written
    (2 x 4 B x resident elements, per-microbatch lifecycle): 10 x view + 8 x resident, at HBM x 0.74."""
    weights = 4 * 2 * VIEW + 2 * VIEW + 2 * 4 * RESIDENT  # 880,456,320
    assert qwen_mxfp8.achievable["hbm"][5] * HBM * HBM_FRAC == pytest.approx(weights, rel=1e-12, abs=0)


def test_qwen3_layer_memory_bound_kernel_bytes(qwen_mxfp8):
    """Memory-bound kernels between the GEMMs: 7 x the saved bytes (2 forward + 3 backward passes + the recomputed
    forward's 2) at HBM x 0.74, plus the quantize traffic, every operand X and dY read in BF16 and written row- and
    column-wise: T x 64,512 x (2 + 2 QB), at the measured MXFP8 cast rate, HBM x 0.651
    (constraints/rates/b200.toml [hbm_quantize])."""
    quantize = T * Q_ELEMENTS * (2 + 2 * QB)
    kernels = 7 * T * SAVED_PER_TOKEN
    seconds = kernels / (HBM * HBM_FRAC) + quantize / (HBM * 0.651)
    assert qwen_mxfp8.achievable["vector"][5] == pytest.approx(seconds, rel=1e-12, abs=0)


def test_qwen3_layer_peak_roofline_hbm_bytes(qwen_mxfp8):
    """The peak roofline's HBM bytes: weight side + saved activations written and read (the kept input and the
    recomputed set) + the quantize traffic, at the HBM peak."""
    weights = 4 * 2 * VIEW + 2 * VIEW + 2 * 4 * RESIDENT
    activations = 2 * (T * 2048 * 2 + T * SAVED_PER_TOKEN)
    quantize = T * Q_ELEMENTS * (2 + 2 * QB)
    assert qwen_mxfp8.time["hbm"][5] * HBM == pytest.approx(weights + activations + quantize, rel=1e-12, abs=0)


def test_qwen3_head_edge_hbm_bytes(qwen_mxfp8):
    """The last edge (final norm 2048 + untied LM head 151936 x 2048, dense AdamW): weight side 10 x view + 8 x
    view / 16; no quantized GEMM (the head stays BF16); saved: norm input 2 x 2048, rstd 4, output 2 x 2048
    (the BF16 head's wgrad reads it in BF16), not recomputed at the edge: kernels 5 x T x saved; plus the
    cross-entropy kernels of the one output head, T x vocab 151,936 x 22 B (TransformerEngine's fused cross
    entropy, on in the rates file's [loss_kernels]: 2 + (2 + 4) + (4 + 4) + (4 + 2) B)."""
    view = 2048 + 151936 * 2048
    weights = 10 * 2 * view / 2 + 8 * view / FSDP  # 4 passes + gradient write, 2 B each; FP32 shard r/w
    assert qwen_mxfp8.achievable["hbm"][qwen_mxfp8.last] * HBM * HBM_FRAC == pytest.approx(weights, rel=1e-12, abs=0)
    saved = 2 * 2048 + 4 + 2048 * 2
    assert qwen_mxfp8.achievable["vector"][qwen_mxfp8.last] * HBM * HBM_FRAC == pytest.approx(
        5 * T * saved + T * 151936 * 22, rel=1e-12, abs=0)


def test_accumulated_gradients_stream_the_whole_fp32_buffer():
    """Accumulate lifecycle: the FP32 gradient accumulation buffer is the whole view, read and written each
    microbatch: weight side 10 x view + 8 x view (not the resident shard)."""
    lay = k3opt.make_layout(gpus=32, pp=2, ep=EP, dense_fsdp=FSDP, expert_fsdp=1, microbatches=8, context=4096,
                            split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8,
                            fsdp_lifecycle="accumulate")
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=load_rates("b200"))
    assert cf.achievable["hbm"][5] * HBM * HBM_FRAC == pytest.approx(18 * VIEW, rel=1e-12, abs=0)


# How evaluate() prices a precision on Qwen3-30B-A3B on B200: Transformer Engine's cached row- and column-wise MXFP8
# weight copies of the rank, the quantized GEMMs at the MXFP8 peak, the copies requantized each update; and when the
# optimizer state becomes resident (lazy or eager allocation) on the same layout.

def _qwen_b200_mxfp8() -> k3opt.Layout:
    return k3opt.make_layout(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096,
                             split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8)


def test_mxfp8_cached_weight_copies_of_the_rank():
    """Qwen3-30B-A3B on B200 in MXFP8, PP 2 (24 layers per rank), EP 16: per layer the quantized GEMM weights
    are q, k, v, o (2 x 4096 x 2048 + 2 x 512 x 2048 = 18,874,368) and the 128 / 16 = 8 local experts
    (8 x 3 x 768 x 2048 = 37,748,736); the router and the LM head stay BF16. Transformer Engine caches a row-wise
    and a column-wise copy, each 1 B + one E8M0 scale byte per 32 elements: 2 x 33/32 B per parameter."""
    ev = k3opt.evaluate(_qwen_b200_mxfp8(), model="qwen3-30b-a3b", cluster="b200")
    per_layer = 2 * 4096 * 2048 + 2 * 512 * 2048 + 8 * 3 * 768 * 2048
    assert ev.ranks[0].ledger["quantized_weights"] == pytest.approx(24 * 2 * 33 / 32 * per_layer, abs=0.5)


def test_eager_optimizer_state_is_resident_before_the_first_step():
    """Without lazy_optimizer_state the optimizer state exists from the start: the resident set read before
    the first step is the whole persistent ledger (seed 003's lazy run leaves the Muon state out)."""
    lay = _qwen_b200_mxfp8()
    assert not lay.lazy_optimizer_state
    r0 = k3opt.evaluate(lay, model="qwen3-30b-a3b", cluster="b200").ranks[0]
    assert r0.counts["resident_before_first_step_bytes"] == r0.persistent_bytes
    lazy = lay.model_copy(update={"lazy_optimizer_state": True})
    r0 = k3opt.evaluate(lazy, model="qwen3-30b-a3b", cluster="b200").ranks[0]
    assert r0.counts["resident_before_first_step_bytes"] == r0.persistent_bytes - r0.ledger["optimizer"]


def _qwen_b200_coefficients(precision: str):
    lay = _qwen_b200_mxfp8().model_copy(update={"precision": precision})
    return coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"))


def test_peak_tensor_time_runs_the_quantized_gemms_at_the_mxfp8_peak():
    """Qwen3-30B-A3B layer on B200 in MXFP8, T = 4,096, full recompute (x 4/3): the quantized GEMMs (q, k, v, o:
    18,874,368 weights; 8 active experts x 3 x 768 x 2,048 = 37,748,736) at the 4,500 TF/s MXFP8 peak; the BF16
    router (128 x 2,048) and the attention core (3 x 32 x 256 x 4,096 per token) at the 2,250 TF/s BF16 peak."""
    cf = _qwen_b200_coefficients("mxfp8")
    T = 4096
    quantized = 6 * T * (2 * 4096 * 2048 + 2 * 512 * 2048 + 8 * 3 * 768 * 2048) * 4 / 3
    bf16 = (6 * T * 128 * 2048 + T * 3 * 32 * 256 * 4096) * 4 / 3
    assert cf.time["tensor"][5] == pytest.approx(bf16 / 2250e12 + quantized / 4500e12, rel=1e-13, abs=0)


def test_each_update_requantizes_the_cached_weight_copies():
    """Per update, MXFP8 reads every quantized weight of the layer in BF16 (2 B) and writes the row- and
    column-wise copies (2 x 33/32 B): q, k, v, o whole (dense weights are gathered: 18,874,368) and the rank's
    128 / 16 = 8 experts (8 x 3 x 768 x 2,048 = 37,748,736), at the 8,000 GB/s HBM peak, on top of BF16's."""
    q, b = _qwen_b200_coefficients("mxfp8"), _qwen_b200_coefficients("bf16")
    weights = 2 * 4096 * 2048 + 2 * 512 * 2048 + 8 * 3 * 768 * 2048
    assert q.update["hbm"][5] - b.update["hbm"][5] == pytest.approx(weights * (2 + 2 * 33 / 32) / 8000e9,
                                                                    rel=1e-12, abs=0)
