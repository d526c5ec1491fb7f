"""Megatron's fine-grained activation offloading by module (Layout.offload_modules), on the 4-layer K3 proxy:
layer 0 KDA + dense FFN, layers 1-2 KDA + MoE, layer 3 MLA + MoE (constraints/models/kimi-k3-4layer-proxy.toml).
Expected bytes from the proxy's shapes in the comments: top-16 of 896 experts, expert FFN 3,072, latent 3,584;
MLA 96 heads, q_lora 1,536, kv_lora 512, rope 64, nope 128, v 128; hidden 7,168; T = 4,096 tokens a microbatch.
What each module's scope saves: megatron/core/transformer/moe/experts.py L929-1037 and multi_latent_attention.py
L343-465 @ d98e8a64."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.inputs.errors import LayoutError

T = 4096
MOE_ACT = 2 * 16 * 3072 * 2  # the fused SiTU-GLU's BF16 [16 rows, 2 x 3,072] input a token: 196,608 B
EXPERT_FC1 = 16 * 3584 * 2   # the 16 dispatched BF16 latent copies a token: 114,688 B
# The MLA core's q and k (96 x (128 + 64)), v and output (96 x 128) in BF16, the FP32 softmax statistics: 123,264 B.
CORE_ATTN = (2 * 96 * 192 + 2 * 96 * 128) * 2 + 96 * 4
# qkv_linear under selective recompute keeps the norm's input and statistic and the two down-projections' outputs
# (their normed copies are recomputed): 7,168 x 2 + 4 + 1,536 x 2 + 576 x 2 = 18,564 B; without recompute the
# three normed outputs (7,168, 1,536 and 512 wide) are kept too: + 18,432 B.
QKV_SELECTIVE = 7168 * 2 + 4 + 1536 * 2 + 576 * 2
QKV_NONE = QKV_SELECTIVE + (7168 + 1536 + 512) * 2
GIB = 2**30


def _layout(**update) -> k3opt.Layout:
    data = dict(name="proxy", model="kimi-k3-4layer-proxy", cluster="gb200-nvl72", gpus=8, pp=1, ep=8,
                expert_fsdp=1, dense_fsdp=8, microbatches=1, context=T, split=[4], recompute="none",
                fsdp_lifecycle="accumulate", toggles={"fused_situ": True})
    data.update(update)
    return k3opt.make_layout(**data)


def _rank(**update) -> k3opt.RankEvaluation:
    return k3opt.evaluate(_layout(**update)).ranks[0]


@pytest.mark.parametrize(("modules", "recompute", "per_token"), [
    (["moe_act"], "none", 3 * MOE_ACT),                  # three MoE layers
    (["moe_act"], "selective", 3 * MOE_ACT),             # the activation's input is not recomputed
    (["expert_fc1", "moe_act"], "none", 3 * (EXPERT_FC1 + MOE_ACT)),
    (["core_attn"], "none", CORE_ATTN),                  # the one MLA layer; KDA layers have no offload hooks
    (["qkv_linear"], "none", QKV_NONE),
    (["qkv_linear"], "selective", QKV_SELECTIVE),
    (["core_attn"], "selective", CORE_ATTN),             # k3opt's selective set keeps q, k, v and the output
    (["core_attn", "moe_act"], "none", CORE_ATTN + 3 * MOE_ACT),  # layer 3 offloads from both of its blocks
])
def test_the_modules_saved_tensors_go_to_the_host(modules: list[str], recompute: str, per_token: int):
    """PP1, M 1: one microbatch in flight. The offloaded bytes leave the GPU's activations and wait on the host."""
    kept, off = _rank(recompute=recompute), _rank(recompute=recompute, offload_modules=modules)
    assert off.host_bytes - kept.host_bytes == pytest.approx(per_token * T, rel=1e-12)
    assert kept.ledger["activations"] - off.ledger["activations"] == pytest.approx(per_token * T, rel=1e-12)


def test_what_megatron_recompute_modules_drop_is_not_offloaded():
    """mla_up_proj discards q, k and v after the core reads them (recomputed in backward): core_attn then offloads
    the output and the statistics only, 96 x 128 x 2 + 96 x 4 = 24,960 B a token."""
    kept = _rank(recompute="selective", recompute_modules=["mla_up_proj"])
    off = _rank(recompute="selective", recompute_modules=["mla_up_proj"], offload_modules=["core_attn"])
    assert off.host_bytes - kept.host_bytes == pytest.approx((96 * 128 * 2 + 96 * 4) * T, rel=1e-12)


def test_out_in_forward_and_back_in_backward_over_the_host_link():
    """2 x 3 x 196,608 B x 4,096 per microbatch at GB200's 200 GB/s host link: 24.16 ms."""
    kept, off = _rank(), _rank(offload_modules=["moe_act"])
    extra = off.time_s["host_link"] - kept.time_s["host_link"]
    assert extra == pytest.approx(2 * 3 * MOE_ACT * T / 200e9, rel=1e-9)


def test_the_running_layer_and_the_prefetched_one_hold_their_offloaded_part():
    """Without recompute and with the accumulate lifecycle, a layer's backward transient is its two BF16 gradient
    streams (2 x 7,168 x 2 B a token, the same in every layer) plus, under offload, the reloaded part: two copies
    (offload_resident_layers = 2) of an MoE layer's moe_act input, 2 x 196,608 B x 4,096 = 1.5 GiB."""
    kept, off = _rank(), _rank(offload_modules=["moe_act"])
    assert kept.ledger["recompute_working_set"] == 0
    assert off.ledger["recompute_working_set"] == pytest.approx(2 * MOE_ACT * T, rel=1e-12)
    three = _rank(offload_modules=["moe_act"], offload_resident_layers=3)
    assert three.ledger["recompute_working_set"] == pytest.approx(3 * MOE_ACT * T, rel=1e-12)


def test_a_module_the_model_lacks_is_refused():
    lay = _layout(model="llama3-70b", gpus=8, ep=1, split=[80], recompute="selective", toggles={},
                  offload_modules=["expert_fc1"])
    with pytest.raises(LayoutError, match="offload_modules 'expert_fc1' offloads nothing in llama3-70b: it has no "
                                          "routed experts; drop it"):
        k3opt.evaluate(lay)


@pytest.mark.parametrize(("fmt", "line"), [
    ("megatron-lm", "--offload-modules expert_fc1 moe_act"),
    ("megatron-bridge", "'model.offload_modules=[expert_fc1,moe_act]'"),
])
def test_the_exports_name_the_modules(fmt: str, line: str):
    text = k3opt.to_launch(_layout(offload_modules=["expert_fc1", "moe_act"]), fmt).text
    assert line in text and "fine" in text and "activation" in text and "offloading" in text


# The dispatched inputs' 16 x 3,584 elements a token, in a quantized copy: one byte each plus the scales.
DISPATCHED = 16 * 3584


@pytest.mark.parametrize(("precision", "fp8_activations", "block", "per_token"), [
    # MXFP8 (OCP MX v1.0): one E8M0 scale byte per 32 elements, whatever the FP8 block: 57,344 x 33/32 = 59,136 B.
    ("mxfp8", False, 128, 3 * DISPATCHED * (1 + 1 / 32)),
    # BF16 GEMMs with the saved set in FP8: one FP32 scale per fp8_block_size elements, 57,344 x (1 + 4/64).
    ("bf16", True, 64, 3 * DISPATCHED * (1 + 4 / 64)),
    ("bf16", False, 64, 3 * DISPATCHED * 2),            # BF16 saved set: two bytes an element
])
def test_expert_fc1_offloads_the_saved_copy_in_its_own_format(precision: str, fp8_activations: bool, block: int,
                                                             per_token: float):
    """expert_fc1 sends fc1's saved input to the host in the form the layer keeps it, in each of the three MoE
    layers."""
    common = dict(precision=precision, fp8_block_size=block,
                  toggles={"fused_situ": True, "fp8_activations": fp8_activations})
    kept, off = _rank(**common), _rank(offload_modules=["expert_fc1"], **common)
    assert off.host_bytes - kept.host_bytes == pytest.approx(per_token * T, rel=1e-12)


def test_expert_fc1_under_per_tensor_fp8_is_refused_with_its_fix():
    with pytest.raises(LayoutError, match=r"offload_modules 'expert_fc1' with precision = \"fp8\": Megatron then "
                                          r"offloads fc1's BF16 input rather than its FP8 copy \(moe/experts.py "
                                          r"L281-284\), which k3opt does not price; use mxfp8 or drop expert_fc1"):
        k3opt.evaluate(_layout(precision="fp8", offload_modules=["expert_fc1"]))


def test_an_attention_module_on_a_model_without_megatron_attention_is_refused():
    """The proxy with every layer KDA (no full-attention layer): KDA has no offload hooks, so core_attn offloads
    nothing there."""
    proxy = k3opt.load_model("kimi-k3-4layer-proxy")
    kda_only = proxy.model_copy(update={"name": "kda-only", "full_attention_layers": []})
    with pytest.raises(LayoutError, match="offload_modules 'core_attn' offloads nothing in kda-only: none of its "
                                          r"decoder layers has that module with Megatron's offload hooks \(KDA "
                                          r"layers have none\); drop it"):
        k3opt.evaluate(_layout(offload_modules=["core_attn"]), model=kda_only)
