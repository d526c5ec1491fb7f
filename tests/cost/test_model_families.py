"""Model families as data: each public preset's parameter total equals its published figure, derived here from
the publisher's own statement (named in each test), never from k3opt's formulas."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.structure import structure_of
from k3opt.inputs.errors import SpecError


def _params(name: str):
    return structure_of(k3opt.load_model(name)).params


def test_llama3_70b_exact_total_from_the_checkpoint_index():
    """meta-llama/Meta-Llama-3-70B model.safetensors.index.json: total_size 141,107,412,992 bytes, all BF16."""
    p = _params("llama3-70b")
    assert p.total == 141_107_412_992 // 2 == 70_553_706_496
    assert p.mtp == 0 and p.routed == 0


def test_deepseek_v3_main_model_671b_active_36_6b():
    """deepseek-ai/DeepSeek-V3 README_WEIGHTS.md: main model 'Total parameters: 671B', 'Activation parameters:
    36.6B (including 0.9B for the output Head)'; the MTP module is counted apart ('11.5B unique parameters')."""
    st = structure_of(k3opt.load_model("deepseek-v3"))
    p = st.params
    main = p.total - p.mtp
    assert round(main / 1e9) == 671
    mtp_active = sum(b.active_matrix_params for b in st.last if b.name.startswith("mtp"))
    assert round((p.active_matrix - mtp_active) / 1e9, 1) == 36.6
    # The MTP module: one MLA + MoE layer like the last one, plus enorm/hnorm/eh_proj [7168, 14336] and a norm.
    # 11.5B published (rounded); the layer alone is 11.51B, eh_proj adds 0.10B.
    assert 11.5e9 <= p.mtp <= 11.7e9


def test_kimi_k2_one_trillion_total_32b_activated():
    """Kimi K2 technical report (arXiv 2507.20534) abstract: 32 billion activated, 1 trillion total parameters."""
    p = _params("kimi-k2")
    assert round(p.total / 1e12) == 1
    assert round(p.active_matrix / 1e9) == 32


@pytest.mark.parametrize(("name", "total_b", "non_embedding_b", "activated_b", "digits"), [
    # Qwen model cards: 'Number of Parameters: 235B in total and 22B activated', 'Non-Embedding: 234B'
    ("qwen3-235b-a22b", 235, 234, 22, 0),
    # 'Number of Parameters: 30.5B in total and 3.3B activated', 'Non-Embedding: 29.9B'
    ("qwen3-30b-a3b", 30.5, 29.9, 3.3, 1),
])
def test_qwen3_totals_from_the_model_cards(name, total_b, non_embedding_b, activated_b, digits):
    m = k3opt.load_model(name)
    p = structure_of(m).params
    embedding = m.vocab_size * m.hidden_size
    assert round(p.total / 1e9, digits) == total_b
    # 'Non-Embedding' leaves out the input embedding and the untied output head.
    assert round((p.total - 2 * embedding) / 1e9, digits) == non_embedding_b
    # Qwen's 'activated' counts the input embedding too (3.35B for 30B-A3B is published as 3.3B: within one unit
    # of the last published digit).
    assert abs((p.active_matrix + embedding) / 1e9 - activated_b) < 10 ** -digits


def test_layer_kinds_are_read_from_the_file():
    ds = structure_of(k3opt.load_model("deepseek-v3"))
    assert [ds.layer_kind(i) for i in (0, 2, 3, 60)] == ["mla+dense", "mla+dense", "mla+moe", "mla+moe"]
    qw = structure_of(k3opt.load_model("qwen3-30b-a3b"))
    assert {qw.layer_kind(i) for i in range(48)} == {"gqa+moe"}
    ll = structure_of(k3opt.load_model("llama3-70b"))
    assert {ll.layer_kind(i) for i in range(80)} == {"gqa+dense"}
    # Qwen3-30B-A3B GQA layer: q 4096x2048, k and v 512x2048, o 2048x4096, q_norm and k_norm of 128.
    attn = qw.layers[0][0]
    assert attn.params() == 2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 128
    # Causal training score/value FLOPs per token per document token: 3 x 32 heads x (128 + 128).
    assert attn.attention_flops_per_token_per_doc_token == 3 * 32 * 256
    # DeepSeek-V3 MoE: no latent projections, 256 experts on the hidden state, one shared expert of 2048.
    moe = ds.layers[3][1]
    assert moe.params(routed=True) == 256 * 3 * 2048 * 7168
    assert moe.params(routed=False) == 3 * 2048 * 7168 + 256 * 7168 + 256  # shared + router + routing bias
    assert moe.active_matrix_params == (8 + 1) * 3 * 2048 * 7168 + 256 * 7168


def test_mtp_adds_a_head_pass_without_head_parameters():
    st = structure_of(k3opt.load_model("deepseek-v3"))
    mtp = [b for b in st.last if b.name.startswith("mtp")]
    proj = next(b for b in mtp if b.kind == "mtp")
    # eh_proj [7168, 14336] + the shared head's second pass [129280, 7168], with no parameters of its own
    assert proj.active_matrix_params == 7168 * 14336 + 129280 * 7168
    assert proj.params() == 7168 * 14336 + 3 * 7168
    assert sum(b.moe_layers for b in mtp) == 1


def test_both_softmax_tables_is_an_error(tmp_path):
    text = (k3opt.inputs.presets.preset_dir("model") / "deepseek-v3.toml").read_text()
    bad = tmp_path / "both.toml"
    bad.write_text(text + "\n[gqa]\nnum_heads = 8\nnum_kv_heads = 2\nhead_dim = 64\n")
    with pytest.raises(SpecError, match=r"\[mla\] or \[gqa\], not both"):
        k3opt.load_model(bad)


def test_gqa_heads_must_group(tmp_path):
    text = (k3opt.inputs.presets.preset_dir("model") / "llama3-70b.toml").read_text().replace("num_kv_heads = 8",
                                                                                       "num_kv_heads = 7")
    bad = tmp_path / "groups.toml"
    bad.write_text(text)
    with pytest.raises(SpecError, match="multiple of num_kv_heads"):
        k3opt.load_model(bad)


def test_cost_model_prices_the_mtp_module_and_its_moe_on_the_last_chunk():
    """DeepSeek-V3: the last chunk's edge carries the LM head and the MTP module (eh_proj, one MLA + MoE layer, a
    second pass through the shared head); its FLOPs and its EP traffic are priced from shapes."""
    from k3opt.cost.coefficients import Shape, coefficients

    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb200-nvl72")
    lay = k3opt.make_layout(gpus=256, pp=4, vp=4, ep=64, dense_fsdp=64, microbatches=64, context=4096,
                            split=[4] * 15 + [1], recompute="selective", fsdp_lifecycle="accumulate")
    cf = coefficients(Shape.of(lay), model, cluster)
    T, d, V, h = 4096, 7168, 129280, 128
    mla = 1536 * d + h * 192 * 1536 + 576 * d + h * 256 * 512 + d * h * 128
    moe_active = 256 * d + (8 + 1) * 3 * 2048 * d           # router + 8 routed and 1 shared expert
    head = V * d
    mtp = d * 2 * d + V * d + mla + moe_active               # eh_proj, shared-head pass, the layer
    attention = 3 * h * (192 + 128) * 4096                   # causal score/value per token, document 4096
    assert cf.tensor_flops[cf.last] == 6 * T * (head + mtp) + T * attention
    assert cf.moe[cf.last] == 1 and cf.time["nvlink"][cf.last] > 0   # its dispatch/combine is priced
