"""Achievable-step terms priced from the software the public runs use: the cross-entropy kernels' HBM traffic
(TransformerEngine's fused cross entropy, `[loss_kernels]` of the rates file) and the EP overlap schedule
that hides each all-to-all only under the compute Megatron's combined 1F1B pairs it with (`ep_overlap_stages`).
Expected values are derived from the configs' shapes and the named rates in the comments."""

from __future__ import annotations

import numpy as np
import pytest

import k3opt
from k3opt.cost.achievable import achievable_for, ep_overlap_stage_exposed, forward_backward, ranking_arrays
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.errors import SpecError
from k3opt.inputs.rates import load_rates

# constraints/clusters/b200.toml and constraints/rates/b200.toml
HBM, HBM_FRAC = 8000e9, 0.74
BF16_PEAK, GROUPED_BF16 = 2250e12, 0.679
LOSS_BYTES = 22.0  # TE fused cross entropy: 2 + (2 + 4) forward, (4 + 4) element_mul, (4 + 2) cast to BF16


def _qwen30b(**kw) -> k3opt.Layout:
    """Qwen3-30B-A3B on 8 B200, BF16, no recompute, T = 4,096 tokens per microbatch, EP8 inside one domain."""
    base = dict(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096, split=[48],
                recompute="none", precision="bf16")
    return k3opt.make_layout(**{**base, **kw})


def _coefficients(layout: k3opt.Layout, model: str, cluster: str, **rate_updates):
    rates = load_rates(cluster)
    if rate_updates:
        rates = rates.model_copy(update=rate_updates)
    return coefficients(Shape.of(layout), k3opt.load_model(model), k3opt.load_cluster(cluster), rates=rates)


def test_loss_kernels_move_22_bytes_per_logit_on_the_last_edge():
    """Qwen3-30B-A3B has one output head (no MTP) and a 151,936-token vocabulary: at T = 4,096 the loss kernels
    move 4,096 x 151,936 x 22 B = 13,691,256,832 B, at 8 TB/s x 0.74 = 2.3127 ms, on the last edge only."""
    lay = _qwen30b()
    with_loss = _coefficients(lay, "qwen3-30b-a3b", "b200")
    without = _coefficients(lay, "qwen3-30b-a3b", "b200", loss_kernels=None)
    delta = with_loss.achievable["vector"] - without.achievable["vector"]
    assert delta[with_loss.last] == pytest.approx(13_691_256_832 / (HBM * HBM_FRAC), rel=1e-12)
    assert delta[with_loss.last] == pytest.approx(2.3127e-3, rel=1e-4)
    assert not np.any(delta[: with_loss.last])  # every layer and the embedding unchanged


def test_each_mtp_module_adds_one_more_loss():
    """DeepSeek-V3: the LM head and one MTP module, vocabulary 129,280: 2 x 4,096 x 129,280 x 22 B =
    23,299,358,720 B per microbatch of 4,096 tokens."""
    lay = k3opt.make_layout(gpus=64, pp=2, vp=1, ep=32, dense_fsdp=32, expert_fsdp=1, microbatches=8, context=4096,
                            split=[31, 30], recompute="none", precision="mxfp8")
    with_loss = _coefficients(lay, "deepseek-v3", "b200")
    without = _coefficients(lay, "deepseek-v3", "b200", loss_kernels=None)
    delta = with_loss.achievable["vector"][with_loss.last] - without.achievable["vector"][with_loss.last]
    assert delta == pytest.approx(23_299_358_720 / (HBM * HBM_FRAC), rel=1e-12)


def test_routed_expert_compute_of_one_layer():
    """The routed experts of one Qwen3-30B-A3B layer in BF16 (the `mlp` node of Megatron's schedule): w1, w3
    [768, 2048] and w2 [2048, 768], 8 active per token: 6 x 4,096 x 3 x 768 x 2048 x 8 = 927,712,935,936 FLOPs at
    2,250 TF x 0.679 (grouped BF16); each expert sees 4,096 x 8 x 8 / 128 = 2,048 tokens, cube edge
    (2048 x 768 x 2048)^(1/3) = 1,477 on the size curve; plus their memory-bound kernels, 5 x the routed saved
    bytes per token (dispatched inputs 8 x 2048 x 2, SwiGLU inputs 2 x 8 x 768 x 2, activation outputs 8 x 768 x 2,
    expert outputs 8 x 2048 x 2 = 102,400 B) x 4,096 tokens at 8 TB/s x 0.74."""
    cf = _coefficients(_qwen30b(), "qwen3-30b-a3b", "b200", gemm_shape=None)  # the cube-edge curve's path
    size = float(load_rates("b200").size_factor(np.array([np.cbrt(2048 * 768 * 2048)]))[0])
    assert 0.13 < size < 0.62  # between the 1024^3 and 2048^3 points of the measured curve
    gemms = 927_712_935_936 / (BF16_PEAK * GROUPED_BF16 * size)
    vector = 5 * 102_400 * 4096 / (HBM * HBM_FRAC)
    assert cf.moe_compute_achievable[5] == pytest.approx(gemms + vector, rel=1e-12, abs=0)
    # the rest of the layer (attention, norms, router) is the pre-dispatch part, at least as large as zero
    assert cf.achievable["tensor"][5] + cf.achievable["vector"][5] > cf.moe_compute_achievable[5]
    assert cf.moe_compute_achievable[cf.last] == 0.0


def test_stage_exposure_by_hand():
    """pre = 3 ms (1 forward, 2 backward), mlp backward 2 ms, one layer's all-to-all 16 ms (4 exchanges of
    c = 4 ms), no SM share: combine bwd 4 - pre fwd 1 = 3; dispatch fwd + bwd 8 - mlp bwd 2 = 6; combine fwd
    4 - pre bwd 2 = 2: 11 ms. With a quarter of the SMs held (c = 0.75 x 4 = 3): 2 + 4 + 1 = 7 ms. A short
    all-to-all (4 ms: c = 1) hides under every paired part: 0."""
    one, two = np.array([1.0]), np.array([2.0])
    assert ep_overlap_stage_exposed(one, two, two, np.array([16.0]), 0.0, 4)[0] == pytest.approx(11.0)
    assert ep_overlap_stage_exposed(one, two, two, np.array([16.0]), 0.25, 4)[0] == pytest.approx(7.0)
    assert ep_overlap_stage_exposed(one, two, two, np.array([4.0]), 0.0, 4)[0] == 0.0
    # a dispatch replayed in backward (5 exchanges of c = 16 / 5) rides with the backward dispatch:
    # max(0, 3.2 - 1) + max(0, 3 x 3.2 - 2) + max(0, 3.2 - 2) = 2.2 + 7.6 + 1.2 = 11.0
    assert ep_overlap_stage_exposed(one, two, two, np.array([16.0]), 0.0, 5)[0] == pytest.approx(11.0)


def test_forward_backward_splits_each_part_by_its_own_ratio():
    """12 ms of tensor-core time splits 1 : 2 (backward = weight + input gradient GEMMs, SC21 section 3.5): 4 : 8;
    10 ms of memory-bound kernels 2 : 3 (forward: written, read; backward: read as saved, gradient written, read):
    4 : 6. Forward 8, backward 14 (a single 1 : 2 split would give 7.33 : 14.67). Under full recompute the replayed
    forward runs in the backward stage: tensor 1 : 3 (3 : 9), memory-bound 2 : 3 + 2 (7 passes, the replay's 2 in
    backward: 20/7 : 50/7): 3 + 20/7 : 9 + 50/7 = 41/7 : 113/7."""
    fwd, bwd = forward_backward(np.array([12.0]), np.array([10.0]), False)
    assert (fwd[0], bwd[0]) == (pytest.approx(8.0), pytest.approx(14.0))
    fwd, bwd = forward_backward(np.array([12.0]), np.array([10.0]), True)
    assert (fwd[0], bwd[0]) == (pytest.approx(41 / 7), pytest.approx(113 / 7))


def test_stage_exposure_under_full_recompute_by_hand():
    """Full recompute puts the recomputed forward in the backward stage. pre = mlp = 4 ms of tensor-core time
    (1 : 3) and no memory-bound time: pre fwd 1, pre bwd 3, mlp bwd 3; c = 4 ms, 4 exchanges: combine bwd 4 - 1 = 3;
    dispatch 8 - 3 = 5; combine fwd 4 - 3 = 1: 9 ms (9.33 ms with the 1 : 2 split of no recompute)."""
    zero, four = np.array([0.0]), np.array([4.0])
    pre_f, pre_b = forward_backward(four, zero, True)
    _, mlp_b = forward_backward(four, zero, True)
    assert ep_overlap_stage_exposed(pre_f, pre_b, mlp_b, np.array([16.0]), 0.0, 4)[0] == pytest.approx(9.0)
    pre_f, pre_b = forward_backward(four, zero, False)
    assert ep_overlap_stage_exposed(pre_f, pre_b, pre_b, np.array([16.0]), 0.0, 4)[0] == pytest.approx(28 / 3)


def test_stage_exposure_applies_only_under_the_overlap_schedule_and_only_when_the_all_to_all_is_long():
    """Qwen3-30B-A3B at EP32 over four 8-GPU B200 domains: the all-to-all crosses the 50 GB/s NIC and outlasts
    the compute paired with it, so the overlap schedule's stage exposure adds to the achievable stage (switched
    off in the rates file, the stage is the whole-stage overlap of before). Without the overlap schedule the
    all-to-all is exposed whole and the stage rule does not apply."""
    cluster = k3opt.load_cluster("b200")
    lay = _qwen30b(gpus=32, ep=32, dense_fsdp=32, domain_gpus_used=8, ep_overlap=True, dispatcher="hybridep")
    on = load_rates("b200")
    off = on.model_copy(update={"overlap": on.overlap.model_copy(update={"ep_overlap_stages": False})})
    cf_on = _coefficients(lay, "qwen3-30b-a3b", "b200")
    cf_off = _coefficients(lay, "qwen3-30b-a3b", "b200", overlap=off.overlap)
    a = cf_on.achievable
    # by hand for layer 5: pre = tensor + vector - expert part, each split forward : backward by its own ratio,
    # tensor-core time 1 : 2, memory-bound time 2 : 3; c = (1 - 16/148) x a2a / 4 (HybridEP: 16 SMs)
    ep = max(a["ep_nvlink"][5], a["ep_nic"][5])
    mlp_v = cf_on.moe_vector_achievable[5]
    mlp_t = cf_on.moe_compute_achievable[5] - mlp_v
    pre_t, pre_v = a["tensor"][5] - mlp_t, a["vector"][5] - mlp_v
    c = (1 - 16 / 148) * ep / 4
    want = (max(0, c - pre_t / 3 - 2 * pre_v / 5) + max(0, 2 * c - 2 * mlp_t / 3 - 3 * mlp_v / 5)
            + max(0, c - 2 * pre_t / 3 - 3 * pre_v / 5))
    assert want > 1e-3  # about 1.8 ms of a 4.2 ms NIC all-to-all beside 1.2 ms of expert and 1.1 ms of other compute
    # the exposure rides the compute stream's path (tensor), layer by layer
    t_on, t_off = ranking_arrays(cf_on, on, cluster).time, ranking_arrays(cf_off, off, cluster).time
    assert t_on["tensor"][5] - t_off["tensor"][5] == pytest.approx(want, rel=1e-9)
    assert t_on["ep_nic"][5] == t_off["ep_nic"][5]
    # off, the 48 layers' NIC all-to-all (4.2 ms each) bound the stage; on, the compute path with its exposure
    # (about 2.7 + 0.45 + 1.8 ms a layer) binds and is longer
    step_on, step_off = achievable_for(cf_on, lay.split, cluster, on), achievable_for(cf_off, lay.split, cluster, off)
    assert step_off.stage_time_s == pytest.approx(float(t_off["ep_nic"].sum()), rel=1e-9)
    assert step_on.stage_time_s == pytest.approx(float(t_on["tensor"].sum()), rel=1e-9)
    assert step_on.stage_time_s > step_off.stage_time_s
    # no overlap schedule: identical with or without the stage rule
    plain = _qwen30b(gpus=32, ep=32, dense_fsdp=32, domain_gpus_used=8, ep_overlap=False, dispatcher="hybridep")
    cf_p = _coefficients(plain, "qwen3-30b-a3b", "b200")
    assert achievable_for(cf_p, plain.split, cluster, on).stage_time_s == pytest.approx(
        achievable_for(cf_p, plain.split, cluster, off).stage_time_s, rel=1e-12)


def test_bad_loss_switch_and_overlap_rule_are_one_clear_error(tmp_path):
    """A loss-kernel switch without its source or not a boolean, and a non-boolean stage rule are rejected by the
    loader with the key named (SpecError; the CLI prints it as one line and exits 2)."""
    text = (k3opt.inputs.presets.preset_dir("rates") / "b200.toml").read_text()
    start = text.index("[loss_kernels]")
    end = text.index("\n[", start + 1)
    cases = {
        "no source": text[:start] + "[loss_kernels]\nte_fused_cross_entropy = true\n" + text[end:],
        "not a switch": text.replace("te_fused_cross_entropy = true", "te_fused_cross_entropy = 22"),
        "stage rule": text.replace("ep_overlap_stages = true", 'ep_overlap_stages = "yes"'),
    }
    for name, body in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.toml"
        bad.write_text(body)
        with pytest.raises(SpecError, match="loss_kernels|ep_overlap_stages"):
            load_rates(str(bad))


def test_routed_expert_compute_under_full_recompute_in_mxfp8():
    """The same layer in MXFP8 under full recompute: the routed GEMMs at 4,500 TF (B200 FP8 / MXFP8 dense) x 0.534
    (grouped MXFP8), same size factor (the tokens per expert do not change); the saved bytes at the quantized width
    where a GEMM reads them (1 + 1/32 B): dispatched inputs 8 x 2048 x 1.03125 = 16,896, SwiGLU inputs 24,576,
    activation outputs 8 x 768 x 1.03125 = 6,336, expert outputs 32,768 = 80,576 B a token; the GEMMs x 4/3 (the
    recomputed forward's FLOPs), the memory-bound kernels 7 passes (2 forward + 3 backward + the replayed forward's
    2), on every decoder layer, the last one (47) too."""
    cf = _coefficients(_qwen30b(recompute="full", precision="mxfp8"), "qwen3-30b-a3b", "b200", gemm_shape=None)
    size = float(load_rates("b200").size_factor(np.array([np.cbrt(2048 * 768 * 2048)]))[0])
    gemms = 927_712_935_936 / (4500e12 * 0.534 * size)
    vector = 7 * 80_576 * 4096 / (HBM * HBM_FRAC)
    assert cf.moe_compute_achievable[5] == pytest.approx(gemms * 4 / 3 + vector, rel=1e-12, abs=0)
    assert cf.moe_compute_achievable[47] == pytest.approx(gemms * 4 / 3 + vector, rel=1e-12, abs=0)
    assert cf.moe_compute_achievable[cf.first] == 0.0 and cf.moe_compute_achievable[cf.last] == 0.0


def test_the_slowest_rank_is_the_lowest_of_equal_loads():
    """Equal loads up to the rounding of their sums (1e-12, relative) go to the lowest rank, so the rank reported does
    not depend on the order the sums were taken in; a load 1e-9 under the largest is not a tie."""
    from k3opt.cost.achievable import slowest_index

    assert slowest_index([1.0, 2.0 * (1 - 1e-15), 2.0, 1.5]) == 1
    assert slowest_index([1.0, 2.0, 2.0 * (1 - 1e-15)]) == 1
    assert slowest_index([1.0, 2.0 * (1 - 1e-9), 2.0]) == 2
    assert slowest_index([3.0]) == 0
