"""How evaluate() uses the runtime items, the precision's cached weight copies, the lazy optimizer state and the
throughput rows, on figures worked out from the layer shapes and the runtime preset
(constraints/runtimes/megatron-te-hybridep-gb200.toml: 2 B per dispatched value, 4 B per routing probability)."""

from __future__ import annotations

import pytest

import k3opt

RUNTIME = "megatron-te-hybridep-gb200"


def _qwen_b200_mxfp8() -> k3opt.Layout:
    return k3opt.make_layout(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096,
                             split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8)


def _items(rank) -> dict[str, int]:
    return {i.key: i.bytes for i in rank.memory_items}


def test_hybridep_buffers_only_on_ranks_holding_moe_layers():
    """DeepSeek-V3, PP 2 split 3 / 58: rank 0 holds the three dense layers only (no EP all-to-all, no HybridEP
    buffer); rank 1 holds the MoE layers. Its buffer: T = 4,096 tokens x 8 EP ranks in one domain = 32,768
    tokens; x 7,168 (no latent: the hidden state is dispatched) x 2 B = 469,762,048 B, plus probabilities
    32,768 x (256 / 8 = 32 experts x 8 ranks) x 4 B = 33,554,432 B: 503,316,480 B."""
    lay = k3opt.make_layout(gpus=16, pp=2, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                            split=[3, 58], recompute="full")
    ev = k3opt.evaluate(lay, model="deepseek-v3", cluster="gb200-nvl72", runtime=RUNTIME)
    assert ev.ranks[0].counts["moe_layers"] == 0
    assert _items(ev.ranks[0])["hybridep_buffers"] == 0
    assert _items(ev.ranks[1])["hybridep_buffers"] == 32_768 * 7168 * 2 + 32_768 * 32 * 8 * 4 == 503_316_480
    # Split 4 / 57: rank 0 now holds layer 3, its one MoE layer, and the same buffer.
    one = k3opt.evaluate(lay.model_copy(update={"split": [4, 57]}), model="deepseek-v3", cluster="gb200-nvl72",
                         runtime=RUNTIME)
    assert one.ranks[0].counts["moe_layers"] == 1
    assert _items(one.ranks[0])["hybridep_buffers"] == 503_316_480


def test_hybridep_buffer_of_a_model_without_latent_moe():
    """Qwen3-30B-A3B measured layout (mb-20): 4 rows x 4,096 = 16,384 tokens x 8 EP ranks = 131,072 tokens;
    x 2,048 (the hidden size: Qwen3 has no latent) x 2 B + 131,072 x (128 / 8 = 16 experts x 8) x 4 B."""
    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml")
    ev = k3opt.evaluate(lay, runtime=RUNTIME)
    assert _items(ev.ranks[0])["hybridep_buffers"] == 131_072 * 2048 * 2 + 131_072 * 16 * 8 * 4 == 603_979_776


def test_to_dict_carries_the_runtime_and_its_items():
    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml")
    ev = k3opt.evaluate(lay, runtime=RUNTIME)
    d = ev.to_dict()
    assert d["runtime"] == RUNTIME
    items = d["ranks"][0]["memory_items"]
    assert items["hybridep_buffers"] == {"bytes": 603_979_776, "where": "outside",
                                         "formula": next(i.formula for i in ev.ranks[0].memory_items
                                                         if i.key == "hybridep_buffers")}
    assert k3opt.evaluate(lay).to_dict()["runtime"] is None


def test_throughput_rows_at_the_peak_and_at_the_achievable_rates():
    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml")
    ev = k3opt.evaluate(lay)
    rows = [(c.figure, c.unit, c.measured) for c in ev.validation]
    m = lay.measured.tokens_per_s_per_gpu
    assert rows == [("step time", "s", lay.measured.step_time_s), ("tokens/s per GPU", "tokens/s", m),
                    ("tokens/s per GPU at achievable rates", "tokens/s", m)]
    assert ev.validation[2].modeled == ev.step.achievable_tokens_per_s_per_gpu


def test_mxfp8_cached_weight_copies_of_the_rank():
    """Qwen3-30B-A3B on B200 in MXFP8, PP 2 (24 layers per rank), EP 16: per layer the quantized GEMM weights
    are q, k, v, o (2 x 4096 x 2048 + 2 x 512 x 2048 = 18,874,368) and the 128 / 16 = 8 local experts
    (8 x 3 x 768 x 2048 = 37,748,736); the router and the LM head stay BF16. Transformer Engine caches a row-wise
    and a column-wise copy, each 1 B + one E8M0 scale byte per 32 elements: 2 x 33/32 B per parameter."""
    ev = k3opt.evaluate(_qwen_b200_mxfp8(), model="qwen3-30b-a3b", cluster="b200")
    per_layer = 2 * 4096 * 2048 + 2 * 512 * 2048 + 8 * 3 * 768 * 2048
    assert ev.ranks[0].ledger["quantized_weights"] == pytest.approx(24 * 2 * 33 / 32 * per_layer, abs=0.5)


def test_eager_optimizer_state_is_resident_before_the_first_step():
    """Without lazy_optimizer_state the optimizer state exists from the start: the resident set read before
    the first step is the whole persistent ledger (seed 003's lazy run leaves the Muon state out)."""
    lay = _qwen_b200_mxfp8()
    assert not lay.lazy_optimizer_state
    r0 = k3opt.evaluate(lay, model="qwen3-30b-a3b", cluster="b200").ranks[0]
    assert r0.counts["resident_before_first_step_bytes"] == r0.persistent_bytes
    lazy = lay.model_copy(update={"lazy_optimizer_state": True})
    r0 = k3opt.evaluate(lazy, model="qwen3-30b-a3b", cluster="b200").ranks[0]
    assert r0.counts["resident_before_first_step_bytes"] == r0.persistent_bytes - r0.ledger["optimizer"]


def _qwen_b200_coefficients(precision: str):
    from k3opt.cost.coefficients import Shape, coefficients

    lay = _qwen_b200_mxfp8().model_copy(update={"precision": precision})
    return coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"))


def test_peak_tensor_time_runs_the_quantized_gemms_at_the_mxfp8_peak():
    """Qwen3-30B-A3B layer on B200 in MXFP8, T = 4,096, full recompute (x 4/3): the quantized GEMMs (q, k, v, o:
    18,874,368 weights; 8 active experts x 3 x 768 x 2,048 = 37,748,736) at the 4,500 TF/s MXFP8 peak; the BF16
    router (128 x 2,048) and the attention core (3 x 32 x 256 x 4,096 per token) at the 2,250 TF/s BF16 peak."""
    cf = _qwen_b200_coefficients("mxfp8")
    T = 4096
    quantized = 6 * T * (2 * 4096 * 2048 + 2 * 512 * 2048 + 8 * 3 * 768 * 2048) * 4 / 3
    bf16 = (6 * T * 128 * 2048 + T * 3 * 32 * 256 * 4096) * 4 / 3
    assert cf.time["tensor"][5] == pytest.approx(bf16 / 2250e12 + quantized / 4500e12, rel=1e-13, abs=0)


def test_each_update_requantizes_the_cached_weight_copies():
    """Per update, MXFP8 reads every quantized weight of the layer in BF16 (2 B) and writes the row- and
    column-wise copies (2 x 33/32 B): q, k, v, o whole (dense weights are gathered: 18,874,368) and the rank's
    128 / 16 = 8 experts (8 x 3 x 768 x 2,048 = 37,748,736), at the 8,000 GB/s HBM peak, on top of BF16's."""
    q, b = _qwen_b200_coefficients("mxfp8"), _qwen_b200_coefficients("bf16")
    weights = 2 * 4096 * 2048 + 2 * 512 * 2048 + 8 * 3 * 768 * 2048
    assert q.update["hbm"][5] - b.update["hbm"][5] == pytest.approx(weights * (2 + 2 * 33 / 32) / 8000e9,
                                                                    rel=1e-12, abs=0)
