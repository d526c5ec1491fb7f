"""DeepSeek-V3's MoE block, tensor by tensor, against its config.json (deepseek-ai/DeepSeek-V3, as
constraints/models/deepseek-v3.toml copies it): hidden 7,168, 256 routed experts (8 per token) of
moe_intermediate_size 2,048, one shared expert of 2,048, and the noaux_tc router's e_score_correction_bias, one
value per expert, kept under AdamW like every vector and never multiplied by a token."""

from __future__ import annotations

import k3opt
from k3opt.cost.structure import structure_of


def test_deepseek_v3_moe_block_inventory():
    st = structure_of(k3opt.load_model("deepseek-v3"))
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
