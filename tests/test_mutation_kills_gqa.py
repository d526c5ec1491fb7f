"""The GQA softmax block (Llama 3, Qwen3) itemized by hand from the published configs: every tensor (name, shape,
optimizer, count, routed, active copies) and every saved-for-backward item, with the optional Q/K/V biases and
the AdamW assignment by name that no shipped preset uses."""

from __future__ import annotations

import k3opt
from k3opt.cost.structure import Structure

M, A = "muon", "adamw"


def _qwen3_30b_variant(tmp_path, extra: str = "", bias: bool = False) -> k3opt.ModelSpec:
    text = (k3opt.inputs.presets.preset_dir("model") / "qwen3-30b-a3b.toml").read_text()
    if bias:
        text = text.replace("qk_norm = true", "qk_norm = true\nattention_bias = true")
    path = tmp_path / "variant.toml"
    path.write_text(text + extra)
    return k3opt.load_model(path)


def test_qwen3_gqa_block_inventory_from_the_config():
    """Qwen/Qwen3-30B-A3B config.json: hidden 2048, 32 query heads and 4 KV heads of 128, per-head q/k RMSNorm,
    no attention bias. q = 32 x 128 = 4096, kv = 4 x 128 = 512 ([out, in] as in the checkpoint)."""
    st = Structure(k3opt.load_model("qwen3-30b-a3b"))
    blk = st.layers[7][0]
    assert (blk.name, blk.kind) == ("layer7.gqa", "gqa")
    got = [(t.name, t.shape, t.optimizer, t.count, t.routed, t.active_per_token) for t in blk.tensors]
    assert got == [
        ("gqa.q_proj", (4096, 2048), M, 1, False, 1), ("gqa.k_proj", (512, 2048), M, 1, False, 1),
        ("gqa.v_proj", (512, 2048), M, 1, False, 1), ("gqa.o_proj", (2048, 4096), M, 1, False, 1),
        ("gqa.q_norm", (128,), A, 1, False, 0), ("gqa.k_norm", (128,), A, 1, False, 0)]
    # Saved for backward, per token: the pre-attention RMSNorm (input d BF16, rstd 1 FP32, output d BF16 feeding
    # the GEMMs), q / k / v after the norms (4096, 512, 512 BF16), the attention output (4096 BF16, the o_proj
    # input), the softmax log-sum-exp (one FP32 per query head: 32), and q / k before their RMSNorm.
    saved = [(s.name, s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable, s.role)
             for s in blk.saved]
    assert saved == [
        ("attn_norm_input", 2048, 2, False, False, ""), ("attn_norm_rstd", 1, 4, False, False, ""),
        ("attn_norm_output", 2048, 2, True, True, ""),
        ("gqa_q", 4096, 2, False, False, ""), ("gqa_k", 512, 2, False, False, ""),
        ("gqa_v", 512, 2, False, False, ""), ("gqa_attn_output", 4096, 2, True, False, ""),
        ("gqa_softmax_lse", 32, 4, False, False, ""),
        ("gqa_q_pre_norm", 4096, 2, False, False, ""), ("gqa_k_pre_norm", 512, 2, False, False, "")]


def test_llama3_gqa_block_has_no_norms_and_no_bias():
    """meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 64 heads, 8 KV heads of 128, no qk-norm or bias:
    q = 8192, kv = 1024; 3 x 64 x (128 + 128) causal score/value FLOPs per token per document token."""
    blk = Structure(k3opt.load_model("llama3-70b")).layers[0][0]
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
        model = _qwen3_30b_variant(tmp_path, extra=f'\n[optimizer]\nadamw_matrices = ["{name}"]\n')
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
