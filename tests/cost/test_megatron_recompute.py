"""Megatron's selective recompute by module (Layout.recompute_modules), and the attention output kept twice under
a low compute precision. Expected values are derived from DeepSeek-V3's config.json shapes in the comments:
hidden 7,168; 128 heads, q_lora_rank 1,536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; dense layers 0-2
with intermediate 18,432 (SwiGLU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import explain_refusal

import k3opt
from k3opt.cost.coefficients import Precision, Shape, coefficients, saved_per_token
from k3opt.cost.structure import structure_of
from k3opt.inputs.errors import LayoutError
from k3opt.inputs.rates import rates_for
from k3opt.inputs.specs import Recompute, Toggles

T = 8192  # MB-12: micro batch 2 x 4,096
MXFP8 = 1 + 1 / 32  # one E4M3 byte plus one E8M0 scale per 32 elements


def _layout(precision: str, recompute: str, modules: list[str]) -> k3opt.Layout:
    return k3opt.make_layout(
        gpus=256, pp=2, vp=8, ep=32, expert_fsdp=4, dense_fsdp=128, microbatches=16, rows=2, context=4096,
        split=[4] * 15 + [1], recompute=recompute, recompute_modules=modules, fsdp_lifecycle="accumulate",
        precision=precision, model="deepseek-v3", cluster="gb300-nvl72", toggles={"moe_backward_rewrite": True})


def _cf(precision: str, recompute: str, modules: list[str]):
    lay = _layout(precision, recompute, modules)
    return coefficients(Shape.of(lay), k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb300-nvl72"))


@pytest.mark.parametrize(("precision", "per_token"), [
    # q 128 x 192 + k 128 x 192 + v 128 x 128 = 65,536 BF16 values (131,072 B), the attention core's inputs; plus
    # the q / kv up-projections' normed inputs 1,536 + 512 = 2,048 values: BF16 4,096 B -> 135,168 B a token, or as
    # the up-projections' MXFP8 copies 2,048 x 33/32 = 2,112 B -> 133,184 B a token.
    ("bf16", 131_072 + 4_096),
    ("mxfp8", 131_072 + 2_112),
])
def test_mla_up_proj_drops_q_k_v_and_the_up_projections_inputs(precision: str, per_token: int) -> None:
    none = _cf(precision, "none", [])
    mod = _cf(precision, "selective", ["mla_up_proj"])
    layers = none.n_layers
    np.testing.assert_allclose(none.act[:layers] - mod.act[:layers], T * per_token)
    # The dropped set is what backward rebuilds for one layer at a time.
    np.testing.assert_allclose(mod.recompute_ws[:layers], T * per_token)


def test_mla_up_proj_replays_the_up_projection_gemms() -> None:
    """Forward of q_b (1,536 -> 24,576) and kv_b (512 -> 128 x 256 = 32,768) once more: 2 x (37,748,736 +
    16,777,216) = 109,051,904 FLOPs a token on every MLA layer, all in the compute precision."""
    none = _cf("mxfp8", "none", [])
    mod = _cf("mxfp8", "selective", ["mla_up_proj"])
    layers = none.n_layers
    np.testing.assert_allclose(mod.tensor_flops[:layers] - none.tensor_flops[:layers], T * 109_051_904, rtol=1e-12)
    np.testing.assert_allclose(mod.gemm_flops[:layers] - none.gemm_flops[:layers], T * 109_051_904, rtol=1e-12)
    assert mod.achievable["tensor"][0] > none.achievable["tensor"][0]


def test_the_replayed_up_projections_run_their_forward_once_more_at_the_achievable_rate() -> None:
    """The replayed forward of q_b (24,576 x 1,536) and kv_b (32,768 x 512) at the achievable rates: per weight
    2 T out in FLOPs at the MXFP8 peak x the dense GEMM fraction x the size factor at (T out in)^(1/3), the rates'
    cube-edge curve (the shape table left out, so one factor serves the pass), on every MLA layer."""
    cluster = k3opt.load_cluster("gb300-nvl72")
    rt = rates_for(cluster).model_copy(update={"gemm_shape": None})
    model = k3opt.load_model("deepseek-v3")
    none, mod = (coefficients(Shape.of(_layout("mxfp8", rc, mods)), model, cluster, rates=rt)
                 for rc, mods in (("none", []), ("selective", ["mla_up_proj"])))
    rate = cluster.dense_tflops(Precision.MXFP8) * 1e12 * rt.gemm("dense", Precision.MXFP8)

    def forward(out: int, inp: int) -> float:
        return 2 * T * out * inp / (rate * float(rt.size_factor(np.cbrt(float(T) * out * inp))))

    layers = none.n_layers
    np.testing.assert_allclose(mod.achievable["tensor"][:layers] - none.achievable["tensor"][:layers],
                               forward(24_576, 1_536) + forward(32_768, 512), rtol=1e-9)


def test_mlp_recomputes_only_the_dense_layers_mlp() -> None:
    """Dense layers 0-2 under MXFP8: norm rstd 4 B + the MLP's MXFP8 input copy 7,168 x 33/32 = 7,392 B + SwiGLU
    input 2 x 18,432 x 2 = 73,728 B + the down-projection's MXFP8 input 18,432 x 33/32 = 19,008 B = 100,132 B a
    token; the checkpoint keeps its input, the residual stream. MoE layers keep everything. Replay: the MLP's three
    GEMMs forward, 2 x 3 x 7,168 x 18,432 = 792,723,456 FLOPs a token."""
    none = _cf("mxfp8", "none", [])
    mod = _cf("mxfp8", "selective", ["mlp"])
    np.testing.assert_allclose(none.act[:3] - mod.act[:3], T * 100_132)
    np.testing.assert_allclose(none.act[3:none.n_layers] - mod.act[3:none.n_layers], 0.0)
    np.testing.assert_allclose(mod.tensor_flops[:3] - none.tensor_flops[:3], T * 792_723_456)


def test_both_modules_act_on_their_own_blocks() -> None:
    """[mla_up_proj, mlp]: a dense layer (0-2) drops both sets, 133,184 + 100,132 B a token under MXFP8, and replays
    both sets of GEMMs, 109,051,904 + 792,723,456 FLOPs a token; a MoE layer only the attention's."""
    none = _cf("mxfp8", "none", [])
    both = _cf("mxfp8", "selective", ["mla_up_proj", "mlp"])
    np.testing.assert_allclose(none.act[:3] - both.act[:3], T * (133_184 + 100_132), rtol=1e-12)
    np.testing.assert_allclose(none.act[3:61] - both.act[3:61], T * 133_184, rtol=1e-12)
    np.testing.assert_allclose(both.tensor_flops[:3] - none.tensor_flops[:3], T * (109_051_904 + 792_723_456),
                               rtol=1e-12)


def test_dropped_gemm_inputs_under_fp8_storage_are_counted_at_their_block_scale() -> None:
    """BF16 compute with FP8 storage of GEMM inputs (1 byte + one FP32 scale per 128): mla_up_proj drops q, k, v
    (131,072 B BF16) and the two normed inputs 2,048 x (1 + 4 / 128) = 2,112 B."""
    lay = _layout("bf16", "selective", ["mla_up_proj"]).model_copy(update={"toggles": Toggles(
        moe_backward_rewrite=True, fp8_activations=True)})
    lay_none = lay.model_copy(update={"recompute": Recompute.NONE, "recompute_modules": []})
    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb300-nvl72")
    mod, none = (coefficients(Shape.of(x), model, cluster) for x in (lay, lay_none))
    np.testing.assert_allclose(none.act[:61] - mod.act[:61], T * (131_072 + 2_112), rtol=1e-12)


def test_the_attention_output_is_kept_by_the_core_and_quantized_by_the_output_projection() -> None:
    """The attention core keeps its BF16 output O for backward; the output projection, a GEMM in the compute
    precision, keeps its own MXFP8 copy. DeepSeek-V3 MLA: O is 128 x 128 = 16,384 values, 32,768 + 16,896 B.
    Llama 3 70B GQA: O is 64 x 128 = 8,192 values, 16,384 + 8,448 B. Under BF16 one tensor: 2 B a value."""
    for kind, model, values in (("mla", "deepseek-v3", 16_384), ("gqa", "llama3-70b", 8_192)):
        st = structure_of(k3opt.load_model(model))
        block = next(b for layer in st.layers for b in layer if b.kind == kind)
        only = frozenset({f"{kind}_attn_output", f"{kind}_o_proj_input_copy"})
        assert saved_per_token(block, Toggles(), 128, Precision.MXFP8, only=only)[0] == values * (2 + MXFP8)
        assert saved_per_token(block, Toggles(), 128, Precision.BF16, only=only)[0] == values * 2
        # FP8 storage of GEMM inputs (block 128) compresses the projection's copy, never the core's O.
        assert saved_per_token(block, Toggles(fp8_activations=True), 128, Precision.BF16, only=only)[0] == \
            values * (2 + 1 + 4 / 128)


def test_recompute_modules_need_selective_recompute_and_name_each_module_once() -> None:
    with pytest.raises(LayoutError, match='need recompute = "selective"'):
        _layout("mxfp8", "full", ["mla_up_proj"])
    with pytest.raises(LayoutError, match="twice"):
        _layout("mxfp8", "selective", ["mlp", "mlp"])
    with pytest.raises(LayoutError, match="recompute_modules"):
        _layout("mxfp8", "selective", ["core_attention"])
    assert _layout("mxfp8", "selective", ["mla_up_proj"]).recompute == Recompute.SELECTIVE


@pytest.mark.parametrize(("value", "words"), [
    ('["core_attention"]', "recompute_modules"),
    ('["mla_up_proj"]\nrecompute = "full"', 'need recompute = \\"selective\\"'),
])
def test_explain_refuses_a_bad_recompute_modules_in_one_line(tmp_path: Path, value: str, words: str) -> None:
    src = Path(k3opt.__file__).parents[1] / "layouts" / "measured" / "mb-12-deepseek-v3-gb300.toml"
    text = src.read_text().replace('recompute = "selective"\n', "")
    text = text.replace('recompute_modules = ["mla_up_proj"]', f"recompute_modules = {value}")
    assert "recompute" in explain_refusal(tmp_path, text)


def test_every_declared_name_is_a_tensor_of_its_block_kind() -> None:
    """A misspelt name in MEGATRON_RECOMPUTE would drop or replay nothing, silently: each saved name and each
    replayed weight must exist in a block of the module's kind in some shipped model (SwiGLU and SiTU variants of
    the dense MLP alike)."""
    from k3opt.cost.structure import MEGATRON_RECOMPUTE

    blocks = [b for name in ("deepseek-v3", "kimi-k3", "kimi-k2", "llama3-70b")
              for layer in structure_of(k3opt.load_model(name)).layers for b in layer]
    for module, mr in MEGATRON_RECOMPUTE.items():
        kind = [b for b in blocks if b.kind == mr.block_kind]
        assert kind, module
        saved = {s.name for b in kind for s in b.saved}
        weights = {t.name for b in kind for t in b.tensors}
        assert set(mr.saved) <= saved, (module, set(mr.saved) - saved)
        assert set(mr.replayed) <= weights, (module, set(mr.replayed) - weights)
