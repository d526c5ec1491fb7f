"""What autograd keeps per token in one Qwen3-30B-A3B MoE block (Qwen/Qwen3-30B-A3B config.json: hidden 2,048, 128
experts of moe_intermediate_size 768, 8 per token, SwiGLU, no shared expert), item by item: (name, values per
token, bytes per value, GEMM input, recomputable, role)."""

from __future__ import annotations

import k3opt
from k3opt.cost.structure import structure_of

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
