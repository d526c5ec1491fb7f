"""The model's tensors and saved-for-backward items (k3opt.cost.structure), block by block, itemized by hand from the
published configs: every tensor (name, shape, optimizer, count, routed, active copies) and every saved item of the
GQA softmax block (Llama 3, Qwen3), with the optional Q/K/V biases and the AdamW assignment by name that no shipped
preset uses; a GQA + KDA hybrid; DeepSeek-V3's MoE block with its router bias; what autograd keeps in a Qwen3 MoE
block; and the multi-token-prediction module."""

from __future__ import annotations

from muon_variants import under_muon

import k3opt
from k3opt.cost.structure import Structure, structure_of

M, A = "muon", "adamw"


def _qwen3_30b_variant(tmp_path, extra: str = "", bias: bool = False) -> k3opt.ModelSpec:
    """The Qwen3-30B-A3B preset under Muon (its recipe trains with AdamW), `extra` lines in its [optimizer] table."""
    text = (k3opt.inputs.presets.preset_dir("model") / "qwen3-30b-a3b.toml").read_text()
    text = text[:text.index("[optimizer]")] + '[optimizer]\nname = "muon"\n' + extra
    if bias:
        text = text.replace("qk_norm = true", "qk_norm = true\nattention_bias = true")
    path = tmp_path / "variant.toml"
    path.write_text(text)
    return k3opt.load_model(path)


def test_qwen3_gqa_block_inventory_from_the_config():
    """Qwen/Qwen3-30B-A3B config.json: hidden 2048, 32 query heads and 4 KV heads of 128, per-head q/k RMSNorm,
    no attention bias. q = 32 x 128 = 4096, kv = 4 x 128 = 512 ([out, in] as in the checkpoint)."""
    st = Structure(under_muon("qwen3-30b-a3b"))
    blk = st.layers[7][0]
    assert (blk.name, blk.kind) == ("layer7.gqa", "gqa")
    got = [(t.name, t.shape, t.optimizer, t.count, t.routed, t.active_per_token) for t in blk.tensors]
    assert got == [
        ("gqa.q_proj", (4096, 2048), M, 1, False, 1), ("gqa.k_proj", (512, 2048), M, 1, False, 1),
        ("gqa.v_proj", (512, 2048), M, 1, False, 1), ("gqa.o_proj", (2048, 4096), M, 1, False, 1),
        ("gqa.q_norm", (128,), A, 1, False, 0), ("gqa.k_norm", (128,), A, 1, False, 0)]
    # Saved for backward, per token: the pre-attention RMSNorm (input d BF16, rstd 1 FP32, output d BF16 feeding
    # the GEMMs), q / k / v after the norms (4096, 512, 512 BF16), the attention output (4096 BF16, kept by the
    # core), the o_proj's own copy of it (a GEMM input: bytes only in a low precision or FP8 storage), the softmax
    # log-sum-exp (one FP32 per query head: 32), and q / k before their RMSNorm.
    saved = [(s.name, s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable, s.role)
             for s in blk.saved]
    assert saved == [
        ("attn_norm_input", 2048, 2, False, False, ""), ("attn_norm_rstd", 1, 4, False, False, ""),
        ("attn_norm_output", 2048, 2, True, True, ""),
        ("gqa_q", 4096, 2, False, False, ""), ("gqa_k", 512, 2, False, False, ""),
        ("gqa_v", 512, 2, False, False, ""), ("gqa_attn_output", 4096, 2, False, False, ""),
        ("gqa_o_proj_input_copy", 4096, 2, True, False, ""), ("gqa_softmax_lse", 32, 4, False, False, ""),
        ("gqa_q_pre_norm", 4096, 2, False, False, ""), ("gqa_k_pre_norm", 512, 2, False, False, "")]


def test_llama3_gqa_block_has_no_norms_and_no_bias():
    """meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 64 heads, 8 KV heads of 128, no qk-norm or bias:
    q = 8192, kv = 1024; 3 x 64 x (128 + 128) causal score/value FLOPs per token per document token."""
    blk = Structure(under_muon("llama3-70b")).layers[0][0]
    assert [(t.name, t.shape, t.optimizer) for t in blk.tensors] == [
        ("gqa.q_proj", (8192, 8192), M), ("gqa.k_proj", (1024, 8192), M), ("gqa.v_proj", (1024, 8192), M),
        ("gqa.o_proj", (8192, 8192), M)]
    assert [s.name for s in blk.saved][-1] == "gqa_softmax_lse"
    assert blk.attention_flops_per_token_per_doc_token == 3 * 64 * 256


def test_attention_bias_adds_q_k_v_vectors(tmp_path):
    """attention_bias = true (Qwen2-style): a bias of the projection's output width on q (4096), k and v (512)."""
    blk = Structure(_qwen3_30b_variant(tmp_path, bias=True)).layers[0][0]
    got = [(t.name, t.shape, t.optimizer, t.active_per_token) for t in blk.tensors]
    assert got == [
        ("gqa.q_proj", (4096, 2048), M, 1), ("gqa.k_proj", (512, 2048), M, 1), ("gqa.v_proj", (512, 2048), M, 1),
        ("gqa.o_proj", (2048, 4096), M, 1), ("gqa.q_bias", (4096,), A, 0), ("gqa.k_bias", (512,), A, 0),
        ("gqa.v_bias", (512,), A, 0), ("gqa.q_norm", (128,), A, 0), ("gqa.k_norm", (128,), A, 0)]
    # 2 x 4096 x 2048 + 2 x 512 x 2048 (q, o; k, v) + 4096 + 2 x 512 (biases) + 2 x 128 (q/k norms)
    assert blk.params() == 2 * 4096 * 2048 + 2 * 512 * 2048 + 4096 + 1024 + 256


def test_adamw_matrices_move_each_gqa_projection_by_name(tmp_path):
    """optimizer.adamw_matrices names the GQA projections as k3opt.cost.structure spells them; each named one moves
    to AdamW, the others stay on Muon."""
    for name in ("gqa.q_proj", "gqa.k_proj", "gqa.v_proj", "gqa.o_proj"):
        model = _qwen3_30b_variant(tmp_path, extra=f'adamw_matrices = ["{name}"]\n')
        blk = Structure(model).layers[0][0]
        assert {t.name: t.optimizer for t in blk.tensors if t.is_matrix} == {
            n: (A if n == name else M) for n in ("gqa.q_proj", "gqa.k_proj", "gqa.v_proj", "gqa.o_proj")}


def test_attention_residuals_add_their_scores_before_the_gqa_items(tmp_path):
    """A GQA model with Block Attention Residuals (as K3 has): the attention sub-layer also keeps the FP32 scores
    over the bank's representatives, 9 per token with bank_representatives = 9, named after the sub-layer."""
    extra = "\n[attn_res]\nblock_size = 12\nbank_representatives = 9\n"
    blk = Structure(_qwen3_30b_variant(tmp_path, extra=extra)).layers[0][0]
    assert [(s.name, s.values_per_token, s.bytes_per_value) for s in blk.saved][:5] == [
        ("attn_norm_input", 2048, 2), ("attn_norm_rstd", 1, 4), ("attn_norm_output", 2048, 2),
        ("attn_attn_res_scores", 9, 4), ("gqa_q", 4096, 2)]


# A hybrid model whose softmax layers are GQA and the rest KDA (the pattern of Qwen3-Next's gated-DeltaNet hybrids;
# ModelSpec accepts [gqa] with [kda]): only the layers in full_attention_layers get GQA. Built from seed 003's K3
# 4-layer proxy (KDA layers 0-2, softmax layer 3) with its [mla] table swapped for Qwen3-30B-A3B's [gqa] table.

def _hybrid() -> k3opt.ModelSpec:
    data = k3opt.load_model("kimi-k3-4layer-proxy").model_dump()
    data.update(name="k3-proxy-gqa", mla=None, gqa={"num_heads": 32, "num_kv_heads": 4, "head_dim": 128,
                                                   "qk_norm": True})
    return k3opt.ModelSpec.model_validate(data)


def test_only_the_full_attention_layers_are_gqa():
    st = structure_of(_hybrid())
    assert [st.attention_kind(i) for i in range(4)] == ["kda", "kda", "kda", "gqa"]
    shapes = [{t.name: t.shape for b in layer for t in b.tensors} for layer in st.layers]
    for i in (0, 1, 2):
        # KDA: 96 heads x 128 = 12,288 wide projections of d = 7,168; no GQA tensor.
        assert shapes[i]["kda.q_proj"] == (12288, 7168)
        assert not any(name.startswith("gqa.") for name in shapes[i])
    # GQA: q 32 heads x 128 = 4,096, k and v 4 KV heads x 128 = 512, o back to d.
    assert (shapes[3]["gqa.q_proj"], shapes[3]["gqa.k_proj"], shapes[3]["gqa.o_proj"]) == (
        (4096, 7168), (512, 7168), (7168, 4096))
    assert not any(name.startswith("kda.") for name in shapes[3])


# DeepSeek-V3's MoE block, tensor by tensor, against its config.json (deepseek-ai/DeepSeek-V3, as
# constraints/models/deepseek-v3.toml copies it): hidden 7,168, 256 routed experts (8 per token) of
# moe_intermediate_size 2,048, one shared expert of 2,048, and the noaux_tc router's e_score_correction_bias, one value
# per expert, kept under AdamW like every vector and never multiplied by a token.

def test_deepseek_v3_moe_block_inventory():
    st = structure_of(under_muon("deepseek-v3"))
    layer = st.layers[3]  # layers 0-2 are dense (first_k_dense_replace = 3): layer 3 is the first MoE layer
    moe = [(t.name, t.shape, t.optimizer, t.count, t.routed, t.active_per_token)
           for b in layer for t in b.tensors if t.name.startswith("moe.")]
    assert moe == [
        ("moe.router", (256, 7168), "muon", 1, False, 1),
        ("moe.router_bias", (256,), "adamw", 1, False, 0),
        ("moe.experts.w1", (2048, 7168), "muon", 256, True, 8),
        ("moe.experts.w3", (2048, 7168), "muon", 256, True, 8),
        ("moe.experts.w2", (7168, 2048), "muon", 256, True, 8),
        ("moe.shared_gate", (2048, 7168), "muon", 1, False, 1),
        ("moe.shared_up", (2048, 7168), "muon", 1, False, 1),
        ("moe.shared_down", (7168, 2048), "muon", 1, False, 1),
    ]


def test_a_router_without_bias_has_no_bias_tensor():
    st = structure_of(k3opt.load_model("qwen3-30b-a3b"))  # Qwen3 MoE: softmax top-k router, no correction bias
    names = [t.name for b in st.layers[0] for t in b.tensors]
    assert "moe.router" in names and "moe.router_bias" not in names


# What autograd keeps per token in one Qwen3-30B-A3B MoE block (Qwen/Qwen3-30B-A3B config.json: hidden 2,048, 128
# experts of moe_intermediate_size 768, 8 per token, SwiGLU, no shared expert), item by item: (name, values per token,
# bytes per value, GEMM input, recomputable, role).

BF16, FP32, INT64 = 2, 4, 8


def test_qwen3_moe_block_saved_items():
    st = structure_of(k3opt.load_model("qwen3-30b-a3b"))
    (moe,) = [b for b in st.layers[0] if b.kind == "moe"]
    got = [(s.name, s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable, s.role) for s in moe.saved]
    assert got == [
        ("mlp_norm_input", 2048, BF16, False, False, ""),            # RMSNorm input [d]
        ("mlp_norm_rstd", 1, FP32, False, False, ""),                # one reciprocal RMS a token
        ("mlp_norm_output", 2048, BF16, True, True, ""),             # the router's and dispatch's input
        ("moe_router_scores", 128, FP32, False, False, ""),          # one score per expert
        ("moe_topk_weights", 8, FP32, False, False, ""),             # k = 8
        ("moe_topk_indices", 8, INT64, False, False, ""),
        ("moe_dispatched_inputs", 8 * 2048, BF16, True, False, "dispatch_copy"),  # k copies of the token
        ("moe_expert_swiglu_input", 2 * 8 * 768, BF16, False, False, ""),  # fused SwiGLU keeps [k, 2 f]
        ("moe_expert_act_output", 8 * 768, BF16, True, True, ""),    # down_proj's input [k, f]
        ("moe_expert_outputs", 8 * 2048, BF16, False, False, "expert_output"),  # k outputs before the combine
    ]


# The multi-token-prediction module on the last stage (DeepSeek-V3 technical report, section 2.2: each MTP module is an
# embedding-side RMSNorm, a hidden-side RMSNorm, a projection [d, 2d] of their concatenation, one Transformer block and
# the shared output head): DeepSeek-V3's tensors by name and shape from its config.json (hidden 7,168, vocabulary
# 129,280, one MTP module), and the module's block built of the kinds of the model's last layer, which on a hybrid model
# (seed 003's K3 proxy: KDA layers 0-2, MLA layer 3) is not the layer before it.

def test_deepseek_v3_mtp_module_tensors():
    st = structure_of(under_muon("deepseek-v3"))
    (proj,) = [b for b in st.last if b.kind == "mtp"]
    assert [(t.name, t.shape, t.optimizer, t.count) for t in proj.tensors] == [
        ("mtp.enorm", (7168,), "adamw", 1),
        ("mtp.hnorm", (7168,), "adamw", 1),
        ("mtp.eh_proj", (7168, 2 * 7168), "muon", 1),
        ("mtp.final_norm", (7168,), "adamw", 1),
        ("mtp.shared_head", (129280, 7168), "adamw", 0),  # the LM head's weights, shared: no parameters of its own
    ]


def test_deepseek_v3_mtp_module_per_token():
    """Per token: eh_proj and the shared head each run once (one active copy; the norms none), and autograd keeps
    the two normed inputs concatenated ([2d] BF16, eh_proj's input) and the module's final RMSNorm (input [d],
    reciprocal RMS, output [d]: the head's input)."""
    st = structure_of(k3opt.load_model("deepseek-v3"))
    (proj,) = [b for b in st.last if b.kind == "mtp"]
    assert [t.active_per_token for t in proj.tensors] == [0, 0, 1, 0, 1]
    assert [(s.name, s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable, s.role)
            for s in proj.saved] == [
        ("mtp0_norm_outputs", 2 * 7168, 2, True, False, ""),
        ("mtp0_final_norm_input", 7168, 2, False, False, ""),
        ("mtp0_final_norm_rstd", 1, 4, False, False, ""),
        ("mtp0_final_norm_output", 7168, 2, True, True, ""),
    ]


def test_mtp_block_repeats_the_last_layer_of_a_hybrid_model():
    data = k3opt.load_model("kimi-k3-4layer-proxy").model_dump()
    data.update(name="k3-proxy-mtp", mtp={"num_layers": 1})
    st = structure_of(k3opt.ModelSpec.model_validate(data))
    assert [(b.name, b.kind) for b in st.last if b.name.startswith("mtp")] == [
        ("mtp0.proj", "mtp"), ("mtp0.mla", "mla"), ("mtp0.moe", "moe"), ("mtp0.vectors", "vectors")]


def test_the_mtp_projection_follows_adamw_matrices_by_name():
    """A model listing mtp.eh_proj in [optimizer] adamw_matrices keeps that matrix under AdamW (8 B of FP32 moments
    per element instead of Muon's 4 B momentum); the other MTP matrices stay as they were."""
    data = k3opt.load_model("deepseek-v3").model_dump()
    data.update(name="deepseek-v3-adamw-eh", optimizer={"adamw_matrices": ["mtp.eh_proj"]})
    st = structure_of(k3opt.ModelSpec.model_validate(data))
    (proj,) = [b for b in st.last if b.kind == "mtp"]
    assert {t.name: t.optimizer for t in proj.tensors}["mtp.eh_proj"] == "adamw"


def test_the_adamw_presets_train_every_tensor_with_adamw():
    """DeepSeek-V3, Qwen3 and Llama 3 pretrain with Adam in Megatron-Bridge (recipes/common.py _pretrain_common ->
    recipes/utils/optimizer_utils.py), Kimi K2 and K3 with Muon: a preset's [optimizer] name says which."""
    for name in ("deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "llama3-70b"):
        st = structure_of(k3opt.load_model(name))
        assert {t.optimizer for blocks in (*st.layers, st.first, st.last) for b in blocks for t in b.tensors} == {A}
        assert st.params.muon == 0, name
    for name in ("kimi-k3", "kimi-k2"):
        assert structure_of(k3opt.load_model(name)).params.muon > 0, name
