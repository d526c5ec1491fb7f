"""The multi-token-prediction module on the last stage (DeepSeek-V3 technical report, section 2.2: each MTP module
is an embedding-side RMSNorm, a hidden-side RMSNorm, a projection [d, 2d] of their concatenation, one Transformer
block and the shared output head): DeepSeek-V3's tensors by name and shape from its config.json (hidden 7,168,
vocabulary 129,280, one MTP module), and the module's block built of the kinds of the model's last layer, which on
a hybrid model (seed 003's K3 proxy: KDA layers 0-2, MLA layer 3) is not the layer before it."""

from __future__ import annotations

import k3opt
from k3opt.cost.structure import structure_of


def test_deepseek_v3_mtp_module_tensors():
    st = structure_of(k3opt.load_model("deepseek-v3"))
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
