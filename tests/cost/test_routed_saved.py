"""The routed experts' saved tensors are flagged where they are built (structure.Saved.routed), and the memory-bound
kernels' traffic over a set of saved tensors has one expression (coefficients.memory_bound_kernel_bytes) that the
`vector` resource and the routed experts' compute share. Expected values are derived from the model shapes in the
comments."""

from __future__ import annotations

import numpy as np
import pytest

import k3opt
from k3opt.cost.coefficients import (
    Precision,
    Shape,
    coefficients,
    memory_bound_forward_share,
    memory_bound_kernel_bytes,
    saved_per_token,
)
from k3opt.cost.structure import structure_of
from k3opt.inputs.rates import load_rates
from k3opt.inputs.specs import Toggles

# constraints/clusters/b200.toml and constraints/rates/b200.toml
HBM, HBM_FRAC = 8000e9, 0.74


def _moe_block(model: str):
    st = structure_of(k3opt.load_model(model))
    return next(b for layer in st.layers for b in layer if b.kind == "moe")


def test_the_routed_flag_marks_exactly_the_routed_experts_saved_tensors():
    """Kimi K3's MoE block: the dispatched inputs, both SiTU variants of the experts, their activation outputs and
    their outputs are the routed experts'; the norms, the router, the latent projections, the combined latent and
    the shared experts are the pre-dispatch node's. No other block saves a routed tensor."""
    st = structure_of(k3opt.load_model("kimi-k3"))
    moe = _moe_block("kimi-k3")
    assert {s.name for s in moe.saved if s.routed} == {
        "moe_dispatched_inputs", "moe_expert_situ_fp32_copies", "moe_expert_situ_input", "moe_expert_act_output",
        "moe_expert_outputs"}
    assert {"moe_router_scores", "moe_combined_latent", "moe_shared_situ_input", "mlp_norm_output"} <= {
        s.name for s in moe.saved if not s.routed}
    others = [s.name for layer in st.layers for b in layer if b.kind != "moe" for s in b.saved if s.routed]
    others += [s.name for b in (*st.first, *st.last) for s in b.saved if s.routed]
    assert others == []


def test_routed_saved_bytes_of_kimi_k3_by_hand():
    """Kimi K3, k = 16 experts a token, latent dispatch width 3,584, expert width 3,072, BF16 compute:
    dispatched inputs 16 x 3584 x 2 = 114,688 B; naive SiTU six FP32 copies 6 x 16 x 3072 x 4 = 1,179,648 B (fused:
    the BF16 input 2 x 16 x 3072 x 2 = 196,608 B); activation outputs 16 x 3072 x 2 = 98,304 B; expert outputs
    16 x 3584 x 2 = 114,688 B. Naive: 1,507,328 B a token; fused: 524,288 B; with dispatch recompute and the
    backward rewrite as well (no dispatched copies, no expert outputs): 294,912 B."""
    moe = _moe_block("kimi-k3")
    bf = Precision.BF16
    assert saved_per_token(moe, Toggles(), 128, bf, routed=True)[0] == 1_507_328
    assert saved_per_token(moe, Toggles(fused_situ=True), 128, bf, routed=True)[0] == 524_288
    lean = Toggles(fused_situ=True, dispatch_recompute=True, moe_backward_rewrite=True)
    assert saved_per_token(moe, lean, 128, bf, routed=True)[0] == 294_912
    # the routed and the other tensors partition the block's saved set
    for tg in (Toggles(), Toggles(fused_situ=True), lean):
        parts = [saved_per_token(moe, tg, 128, bf, routed=r)[0] for r in (True, False)]
        assert sum(parts) == saved_per_token(moe, tg, 128, bf)[0]


def test_memory_bound_kernel_bytes_by_hand():
    """Two decoder layers and the two edges of 1,000 saved bytes each: 2 forward passes (written, read) + 3
    backward (read as a saved input, its gradient written and read) = 5,000 B each; under full recompute the
    layers replay their forward, its 2 passes again: 7,000 B (not the FLOP factor 4/3 x 5,000 = 6,666.67 B); the
    edges are not checkpointed and stay 5,000 B."""
    saved = np.full(4, 1000.0)
    assert list(memory_bound_kernel_bytes(saved, False)) == [5000.0] * 4
    assert list(memory_bound_kernel_bytes(saved, True)) == [7000.0, 7000.0, 5000.0, 5000.0]
    # the forward stage runs 2 of the 5 passes; under full recompute the replay runs in backward: 2 of 7
    assert memory_bound_forward_share(False) == pytest.approx(0.4, rel=1e-15)
    assert memory_bound_forward_share(True) == pytest.approx(2 / 7, rel=1e-15)


def test_routed_memory_bound_time_is_part_of_the_vector_resource():
    """Qwen3-30B-A3B on B200, BF16, T = 4,096: the routed experts' memory-bound time is 5 x 102,400 B a token (the
    routed saved bytes: dispatched inputs 8 x 2048 x 2, SwiGLU inputs 2 x 8 x 768 x 2, activation outputs
    8 x 768 x 2, expert outputs 8 x 2048 x 2) x 4,096 tokens at 8 TB/s x 0.74 = 0.35425 ms a layer; the layer's
    `vector` holds it and the rest of the layer's saved set, 5 x 8,804 B (norm input and output 2 x 2048 x 2,
    rstd 4, router scores 128 x 4, top-k weights 8 x 4 and indices 8 x 8) + attention's, so it is larger."""
    lay = k3opt.make_layout(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                            split=[48], recompute="none", precision="bf16")
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=load_rates("b200"))
    want = 5 * 102_400 * 4096 / (HBM * HBM_FRAC)
    assert want == pytest.approx(0.35425e-3, rel=1e-4)
    assert cf.moe_vector_achievable[5] == pytest.approx(want, rel=1e-12)
    moe = _moe_block("qwen3-30b-a3b")
    assert saved_per_token(moe, Toggles(), 128, Precision.BF16, routed=False)[0] == 8_804
    assert cf.achievable["vector"][5] > want + 5 * 8_804 * 4096 / (HBM * HBM_FRAC)
    assert cf.moe_vector_achievable[cf.first] == cf.moe_vector_achievable[cf.last] == 0.0
