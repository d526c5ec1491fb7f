"""Under a low compute precision a GEMM input is saved as the quantized copy its GEMM's wgrad reads (Transformer
Engine), but a tensor that a BF16 GEMM also reads (the MoE router, the output layer) keeps its BF16 copy too."""

from __future__ import annotations

from dataclasses import replace

import pytest

import k3opt
from k3opt.cost.coefficients import Precision, saved_per_token
from k3opt.cost.structure import structure_of
from k3opt.inputs.specs import Toggles

QB = 1 + 1 / 32  # MXFP8: one byte plus one E8M0 scale per 32 elements


def _norm_output_bytes(model_name: str, layer: int | None, block_kind: str, name: str) -> float:
    st = structure_of(k3opt.load_model(model_name))
    blocks = st._layer(layer) if layer is not None else [st._head()]
    block = next(b for b in blocks if b.kind == block_kind)
    saved = next(s for s in block.saved if s.name == name)
    return saved_per_token(replace(block, saved=(saved,)), Toggles(), 128, Precision.MXFP8)[0]


@pytest.mark.parametrize(("model_name", "layer", "hidden", "expected_per_element"), [
    ("qwen3-30b-a3b", 5, 2048, 2.0),          # router only (no shared experts, no latent): BF16
    ("deepseek-v3", 10, 7168, 2.0 + QB),      # router (BF16) + the shared experts' quantized copy
    ("kimi-k3", 10, 7168, 2.0 + QB),          # router (BF16) + the latent down-projection's quantized copy
])
def test_moe_norm_output_keeps_bf16_for_the_router(model_name, layer, hidden, expected_per_element):
    got = _norm_output_bytes(model_name, layer, "moe", "mlp_norm_output")
    assert got == pytest.approx(hidden * expected_per_element, rel=1e-12)


def test_attention_norm_output_is_only_the_quantized_copy():
    # K3 layer 0's attention projections all run in MXFP8: 7168 x (1 + 1/32) B a token.
    st = structure_of(k3opt.load_model("kimi-k3"))
    block = st._layer(0)[0]
    saved = next(s for s in block.saved if s.name == "attn_norm_output")
    assert saved_per_token(replace(block, saved=(saved,)), Toggles(), 128, Precision.MXFP8)[0] == pytest.approx(
        7168 * QB, rel=1e-12)


def test_final_norm_output_stays_bf16_for_the_head():
    # The output layer stays BF16 (Megatron keeps it out of FP8): its input 2048 x 2 B a token on Qwen3-30B-A3B.
    assert _norm_output_bytes("qwen3-30b-a3b", None, "head", "final_norm_output") == 2048 * 2


def test_the_mtp_final_norm_output_stays_bf16_for_the_shared_head():
    # DeepSeek-V3's MTP module ends in the shared output layer, which stays BF16 (Megatron keeps it out of FP8):
    # its final norm output is kept as BF16 only, 7168 x 2 B a token, no quantized copy.
    st = structure_of(k3opt.load_model("deepseek-v3"))
    block = next(b for b in st.last if b.kind == "mtp")
    saved = next(s for s in block.saved if s.name == "mtp0_final_norm_output")
    assert saved_per_token(replace(block, saved=(saved,)), Toggles(), 128, Precision.MXFP8)[0] == 7168 * 2
