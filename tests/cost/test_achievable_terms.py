"""The achievable step time term by term, each figure derived from the configs' shapes and the named rates in the
comments: the achievable-rate arrays per resource (the tensor time GEMM by GEMM, every byte at its measured
fraction, the achievable MFU), the cross-entropy kernels' HBM traffic (TransformerEngine's fused cross entropy,
`[loss_kernels]` of the rates file), the EP overlap schedule that hides each all-to-all only under the compute
Megatron's combined 1F1B pairs it with (`ep_overlap_stages`), full recompute's second forward, K3's KDA scan at the
attention kernels' rates, and the update's data-parallel communication left exposed beyond its overlap window."""

from __future__ import annotations

import numpy as np
import pytest
from muon_variants import under_muon

import k3opt
from k3opt.cost.achievable import (
    achievable_for,
    achievable_step,
    ep_overlap_stage_exposed,
    forward_backward,
    ranking_arrays,
)
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.errors import SpecError
from k3opt.inputs.rates import load_rates

# constraints/clusters/b200.toml (NVIDIA B200 datasheet): dense peaks and link rates per GPU.
BF16_PEAK, MXFP8_PEAK = 2250e12, 4500e12
HBM, NVLINK, NIC, HOST = 8000e9, 900e9, 50e9, 64e9
# constraints/rates/b200.toml: measured fractions of those peaks and HybridEP's all-to-all bandwidths. BF16 is the
# FP8 fraction times one sm_100 device's BF16 / FP8 fraction ratio at 4096^3 (XLA's table: 1,416.9 TFLOP/s of 2.5 PF
# against 2,765.0 of 5 PF), 0.564 x 0.56676 / 0.5530 = 0.578; grouped = dense x the MXFP8 grouped / dense ratio
# 2,672 / 2,819.5: 0.578 x 0.9477 = 0.548.
DENSE_BF16, DENSE_MXFP8, GROUPED_BF16, GROUPED_MXFP8, ATTENTION = 0.578, 0.564, 0.548, 0.534, 0.391
ATTENTION_BACKWARD = 0.333  # attention_core_backward: 0.391 x 1,208.6 / 1,418.1 (backward / forward TFLOP/s)
HBM_FRAC, NVLINK_FRAC, NIC_FRAC = 0.74, 0.65, 0.92
A2A_NVLINK, A2A_NIC = 533.4e9, 43.74e9
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
    2,250 TF x 0.548 (grouped BF16); each expert sees 4,096 x 8 x 8 / 128 = 2,048 tokens, cube edge
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
    """pre = 3 ms (1 forward, 2 backward), mlp 1 forward + 2 backward, one layer's all-to-all 16 ms (4 exchanges of
    c = 4 ms), no SM share. Megatron's run() order, one layer after another: combine bwd 4 beside pre fwd 1 (3
    exposed); dispatch fwd 4 beside mlp bwd 2 (2); dispatch bwd 4 beside mlp fwd 1 (3); combine fwd 4 beside pre
    bwd 2 (2): 10 ms. With a quarter of the SMs held (c = 0.75 x 4 = 3): 2 + 1 + 2 + 1 = 6 ms. A short all-to-all
    (4 ms: c = 1) hides under every paired part: 0."""
    one, two = np.array([1.0]), np.array([2.0])
    assert ep_overlap_stage_exposed(one, two, one, two, np.array([16.0]), 0.0, 4)[0] == pytest.approx(10.0)
    assert ep_overlap_stage_exposed(one, two, one, two, np.array([16.0]), 0.25, 4)[0] == pytest.approx(6.0)
    assert ep_overlap_stage_exposed(one, two, one, two, np.array([4.0]), 0.0, 4)[0] == 0.0
    # a dispatch replayed in backward (5 exchanges of c = 16 / 5) rides with the backward dispatch:
    # (3.2 - 1) + (3.2 - 2) + (2 x 3.2 - 1) + (3.2 - 2) = 2.2 + 1.2 + 5.4 + 1.2 = 10.0
    assert ep_overlap_stage_exposed(one, two, one, two, np.array([16.0]), 0.0, 5)[0] == pytest.approx(10.0)


def test_delayed_weight_gradients_hide_the_backward_dispatch():
    """c = 2 ms (8 ms over 4 exchanges), pre fwd 2, pre bwd 3, mlp fwd 1, mlp bwd 4 of which 2 are the experts'
    weight gradients. Without delay_wgrad_compute the backward dispatch waits for the whole mlp bwd and then hides
    only under mlp fwd: exposed max(0, 2 - 2) + max(0, 2 - 4) + max(0, 2 - 1) + max(0, 2 - 3) = 1 ms. With it
    (Megatron's run(): mlp bwd dw after the dispatch bwd is released) the streams run, from 0: combine bwd 0-2 and
    pre fwd 0-2; mlp dgrad 2-4 beside dispatch fwd 2-4; wgrad 4-6 beside dispatch bwd 4-6; mlp fwd 6-7; combine fwd
    7-9 beside pre bwd 7-10: 10 ms of compute in 10 ms, nothing exposed."""
    pre_f, pre_b, mlp_f, mlp_b, wgrad = (np.array([x]) for x in (2.0, 3.0, 1.0, 4.0, 2.0))
    ep = np.array([8.0])
    assert ep_overlap_stage_exposed(pre_f, pre_b, mlp_f, mlp_b, ep, 0.0, 4)[0] == pytest.approx(1.0)
    assert ep_overlap_stage_exposed(pre_f, pre_b, mlp_f, mlp_b, ep, 0.0, 4, wgrad)[0] == pytest.approx(0.0, abs=1e-12)
    # An all-to-all longer than every part: the comm stream sets the layer, 4 c = 32 against 10 of compute, with or
    # without the delay.
    big = np.array([32.0])
    for w in (None, wgrad):
        assert ep_overlap_stage_exposed(pre_f, pre_b, mlp_f, mlp_b, big, 0.0, 4, w)[0] == pytest.approx(22.0)


def test_stage_exposure_without_the_delay_is_the_per_pairing_sum_and_the_delay_never_adds():
    """Without delay_wgrad_compute each layer's streams wait for both of the previous layer's ends (its forward
    combine feeds the next pre-dispatch forward, its pre-dispatch backward the next backward combine), so the steady
    state is the sum over Megatron's four pairings: max(0, c - pre fwd) + max(0, c - mlp bwd)
    + max(0, (x - 3) c - mlp fwd) + max(0, c - pre bwd), c = (1 - share) a2a / x. Delaying part of the experts'
    backward only loosens a dependency. 2,000 random layers, 4 and 5 exchanges, a tenth of the SMs held."""
    rng = np.random.default_rng(7)
    pf, pb, mf, mb = (rng.uniform(0.1, 5.0, 2000) for _ in range(4))
    ep, wgrad = rng.uniform(0.1, 40.0, 2000), rng.uniform(0.0, 1.0, 2000) * mb
    for x in (4, 5):
        c = 0.9 * ep / x
        by_hand = (np.maximum(0, c - pf) + np.maximum(0, c - mb) + np.maximum(0, (x - 3) * c - mf)
                   + np.maximum(0, c - pb))
        plain = ep_overlap_stage_exposed(pf, pb, mf, mb, ep, 0.1, x)
        delayed = ep_overlap_stage_exposed(pf, pb, mf, mb, ep, 0.1, x, wgrad)
        assert np.allclose(plain, by_hand, rtol=0, atol=1e-9)
        assert np.all(delayed <= plain + 1e-9) and np.all(delayed >= 0)
        assert np.any(delayed < plain - 1e-3)  # and somewhere it hides more


def test_the_ranked_stage_hands_the_experts_weight_gradients_to_the_delay(monkeypatch):
    """Under delay_wgrad_compute the stage's exposure gets the experts' weight-gradient GEMMs as the delayed part:
    as many FLOPs as their forward GEMMs (SC21 section 3.5), a third of their tensor-core time under no recompute
    (forward : backward 1 : 2), none of their memory-bound time; without the flag, nothing. Qwen3-30B-A3B at EP32
    over four B200 domains, layer 5."""
    import k3opt.cost.achievable as achievable

    seen = []
    real = achievable.ep_overlap_stage_exposed

    def spy(*args):  # noqa: ANN002, ANN202 - the exposure's arguments
        seen.append(args[7] if len(args) > 7 else None)
        return real(*args)

    monkeypatch.setattr(achievable, "ep_overlap_stage_exposed", spy)
    cluster, rates = k3opt.load_cluster("b200"), load_rates("b200")
    for delay in (False, True):
        lay = _qwen30b(gpus=32, ep=32, dense_fsdp=32, domain_gpus_used=8, ep_overlap=True, dispatcher="hybridep",
                       delay_wgrad_compute=delay)
        cf = _coefficients(lay, "qwen3-30b-a3b", "b200")
        ranking_arrays(cf, rates, cluster)
        if not delay:
            assert seen[-1] is None
        else:
            mlp_t = cf.moe_compute_achievable[5] - cf.moe_vector_achievable[5]
            assert seen[-1][5] == pytest.approx(mlp_t / 3, rel=1e-12)
            assert seen[-1][5] > 0


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
    (1 : 3) and no memory-bound time: fwd 1, bwd 3 each; c = 2 ms, 4 exchanges: combine bwd 2 - pre fwd 1 = 1,
    dispatch fwd 2 - mlp bwd 3 = 0, dispatch bwd 2 - mlp fwd 1 = 1, combine fwd 2 - pre bwd 3 = 0: 2 ms. With the
    1 : 2 split of no recompute (fwd 4/3, bwd 8/3): 2 x (2 - 4/3) = 4/3 ms."""
    zero, four, ep = np.array([0.0]), np.array([4.0]), np.array([8.0])
    f, b = forward_backward(four, zero, True)
    assert ep_overlap_stage_exposed(f, b, f, b, ep, 0.0, 4)[0] == pytest.approx(2.0)
    f, b = forward_backward(four, zero, False)
    assert ep_overlap_stage_exposed(f, b, f, b, ep, 0.0, 4)[0] == pytest.approx(4 / 3)


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
    # one layer after another (no delayed weight gradients): combine bwd beside pre fwd, dispatch fwd beside mlp
    # bwd, dispatch bwd beside mlp fwd, combine fwd beside pre bwd
    want = (max(0, c - pre_t / 3 - 2 * pre_v / 5) + max(0, c - 2 * mlp_t / 3 - 3 * mlp_v / 5)
            + max(0, c - mlp_t / 3 - 2 * mlp_v / 5) + max(0, c - 2 * pre_t / 3 - 3 * pre_v / 5))
    assert want > 1e-3  # about 1.3 ms of a 4.2 ms NIC all-to-all beside 1.2 ms of expert and 1.1 ms of other compute
    # the exposure rides the compute stream's path (tensor), layer by layer
    t_on, t_off = ranking_arrays(cf_on, on, cluster).time, ranking_arrays(cf_off, off, cluster).time
    assert t_on["tensor"][5] - t_off["tensor"][5] == pytest.approx(want, rel=1e-9)
    assert t_on["ep_nic"][5] == t_off["ep_nic"][5]
    # off, the 48 layers' NIC all-to-all (4.2 ms each) bound the stage; on, the compute path with its exposure
    # (about 2.7 + 0.45 + 1.3 ms a layer) binds and is longer
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


# The achievable-rate arrays (k3opt.cost.coefficients, at the measured fractions of a rates file) pinned per resource:
# the tensor time of one MXFP8 MoE layer and of the LM head of Qwen3-30B-A3B on B200 derived GEMM by GEMM from the
# config's shapes, every byte resource against the bytes of the peak roofline at the rates file's fractions
# (constraints/rates/b200.toml: each fraction with its source there), and the achievable MFU.


def _layout(**toggles) -> k3opt.Layout:
    """Qwen3-30B-A3B on B200 (8-GPU NVLink domains): EP16 spans two domains, so the all-to-all crosses the NIC
    too; full recompute (one more forward: 4/3 of the layer's FLOPs); activations offloaded to the host."""
    return k3opt.make_layout(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096,
                             split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8,
                             toggles={"activation_offload": True, "fused_cross_entropy": True, **toggles})


@pytest.fixture(scope="module")
def qwen_b200():
    """The coefficients without NCCL's per-call latency (its alpha terms are pinned in tests/cost/test_rates.py), so
    that every link second here is bytes over a rate."""
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    # Without the measured shape table too: these GEMM-by-GEMM figures pin the cube-edge curve (the path a precision
    # without a table column takes); tests/inputs/test_gemm_shapes.py pins the table.
    # hbm_quantize too: every HBM byte here at the one copy fraction (tests/inputs/test_gemm_shapes.py pins the cast
    # rate).
    bare = load_rates("b200").model_copy(update={"collective_base_latency_us": None, "gemm_shape": None,
                                                 "hbm_quantize": None})
    return coefficients(Shape.of(_layout()), model, cluster, rates=bare), model, cluster


def _size(m: float, out: int, inp: int) -> float:
    """The measured GEMM size curve of the rates file at the cube-equivalent edge (M out in)^(1/3)."""
    return float(load_rates("b200").size_factor(np.array([np.cbrt(m * out * inp)]))[0])


def test_mxfp8_moe_layer_tensor_time_gemm_by_gemm(qwen_b200):
    """One Qwen3-30B-A3B layer, T = 4,096 tokens per microbatch, 6 T out in FLOPs per GEMM:
    GQA q [4096, 2048], k and v [512, 2048], o [2048, 4096] in MXFP8 at 4,500 TF x 0.564 (dense);
    the router [128, 2048] stays BF16 at 2,250 TF x 0.578; the experts w1, w3 [768, 2048] and w2 [2048, 768],
    8 active per token, are grouped MXFP8 GEMMs at 4,500 TF x 0.534 whose M is the tokens one expert receives:
    T k e / E = 4096 x 8 x 16 / 128 = 4,096. Full recompute runs the forward again: x 4/3. The attention core,
    32 heads x (128 + 128) FLOPs per token per document token over 4,096 tokens per unit, runs its forward units (1,
    and 1 more recomputed) at BF16 x 0.391 and its 2 backward units at BF16 x 0.333."""
    cf, _, _ = qwen_b200
    T, m_expert = 4096, 4096 * 8 * 16 / 128
    dense = sum(6 * T * o * i / (MXFP8_PEAK * DENSE_MXFP8 * _size(T, o, i))
                for o, i in ((4096, 2048), (512, 2048), (512, 2048), (2048, 4096)))
    router = 6 * T * 128 * 2048 / (BF16_PEAK * DENSE_BF16 * _size(T, 128, 2048))
    experts = sum(6 * T * o * i * 8 / (MXFP8_PEAK * GROUPED_MXFP8 * _size(m_expert, o, i))
                  for o, i in ((768, 2048), (768, 2048), (2048, 768)))
    unit = T * 32 * 256 * 4096 / BF16_PEAK
    core = 2 * unit / ATTENTION + 2 * unit / ATTENTION_BACKWARD
    assert cf.achievable["tensor"][5] == pytest.approx((dense + router + experts) * 4 / 3 + core, rel=1e-12, abs=0)


def test_lm_head_tensor_time_with_fused_cross_entropy(qwen_b200):
    """The last edge: the untied LM head [151936, 2048] stays BF16 (6 T V d at 2,250 TF x 0.578, no recompute),
    and the fused cross-entropy recomputes the logits in backward: 2 T V d more at the same rate."""
    cf, _, _ = qwen_b200
    T, V, d = 4096, 151936, 2048
    head = 6 * T * V * d / (BF16_PEAK * DENSE_BF16 * _size(T, V, d)) + 2 * T * V * d / (BF16_PEAK * DENSE_BF16)
    assert cf.achievable["tensor"][cf.last] == pytest.approx(head, rel=1e-12, abs=0)
    assert cf.achievable["tensor"][cf.first] == 0.0  # the embedding is a lookup


def test_link_bytes_split_between_collectives_and_the_all_to_all(qwen_b200):
    """Every NVLink / NIC byte of the peak roofline (bytes = seconds x link peak) is either collective traffic
    at the link's measured fraction or EP all-to-all at HybridEP's measured bandwidth; host-link bytes run at
    the link peak (no measured fraction)."""
    cf, _, _ = qwen_b200
    a, t = cf.achievable, cf.time
    for res, peak, frac, a2a in (("nvlink", NVLINK, NVLINK_FRAC, A2A_NVLINK), ("nic", NIC, NIC_FRAC, A2A_NIC)):
        assert a[f"ep_{res}"][5] > 0 and a[res][5] > 0
        got = a[res] * peak * frac + a[f"ep_{res}"] * a2a
        np.testing.assert_allclose(got, t[res] * peak, rtol=1e-12, atol=0)
    assert a["ep_nic"][cf.last] == 0.0  # the head has no all-to-all
    assert a["host_link"][5] > 0
    np.testing.assert_allclose(a["host_link"], t["host_link"], rtol=1e-12, atol=0)


def test_per_update_times_at_the_measured_fractions(qwen_b200):
    """Per update: optimizer HBM traffic at x 0.74, the view refresh all-gather at the collective fractions, and
    under Muon the Newton-Schulz FLOPs at BF16 x 0.578; against the same work at the peaks. Qwen3 itself trains
    with AdamW (its recipe): an elementwise update, no tensor-core work."""
    cf, model, cluster = qwen_b200
    assert not cf.update["tensor"].any()
    muon = coefficients(Shape.of(_layout()), under_muon("qwen3-30b-a3b"), cluster,
                        rates=load_rates("b200").model_copy(update={"collective_base_latency_us": None,
                                                                    "gemm_shape": None, "hbm_quantize": None}))
    for c, checks in ((cf, (("hbm", HBM_FRAC), ("nvlink", NVLINK_FRAC), ("nic", NIC_FRAC))),
                      (muon, (("tensor", DENSE_BF16), ("hbm", HBM_FRAC)))):
        for res, frac in checks:
            assert c.update[res].sum() > 0, res
            np.testing.assert_allclose(c.update_achievable[res], c.update[res] / frac, rtol=1e-12, atol=0)


def test_host_gradient_shards_move_at_the_host_link_peak():
    """ZeRO-2 host gradients: the FP32 shard goes to the host once per update at the host-link peak."""
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    cf = coefficients(Shape.of(_layout(pipeline_zero2_host_grads=True)), model, cluster)
    assert cf.update["host_link"][5] > 0
    np.testing.assert_allclose(cf.update_achievable["host_link"], cf.update["host_link"], rtol=1e-12, atol=0)


def test_hbm_bound_kernels_scale_with_the_hbm_fraction(qwen_b200):
    """Halving the measured HBM fraction doubles the weight-traffic and memory-bound kernel times exactly and
    leaves the GEMM and link times alone."""
    cf, model, cluster = qwen_b200
    rates = load_rates("b200").model_copy(update={"gemm_shape": None, "hbm_quantize": None})  # as the fixture's
    half = rates.model_copy(update={"hbm": rates.hbm.model_copy(update={"value": HBM_FRAC / 2})})
    slow = coefficients(Shape.of(_layout()), model, cluster, rates=half)
    for res in ("hbm", "vector"):
        assert cf.achievable[res][5] > 0
        np.testing.assert_allclose(slow.achievable[res], 2 * cf.achievable[res], rtol=1e-12, atol=0)
    np.testing.assert_allclose(slow.update_achievable["hbm"], 2 * cf.update_achievable["hbm"], rtol=1e-12)
    np.testing.assert_array_equal(slow.achievable["tensor"], cf.achievable["tensor"])
    # The weight-side traffic alone: HBM bytes of the peak roofline = weight traffic + memory-bound kernels'.
    assert cf.achievable["hbm"][5] * HBM * HBM_FRAC < cf.time["hbm"][5] * HBM


def test_achievable_mfu_is_model_flops_over_the_bf16_peak():
    """MFU = model FLOPs per token x tokens/s / (GPUs x BF16 peak); tokens/s = tokens per update / step."""
    lay = _layout()
    ev = k3opt.evaluate(lay, model="qwen3-30b-a3b", cluster="b200")
    st = ev.step
    # Tokens per update: 8 microbatches x 4,096 tokens x 16 data-parallel replicas (dense FSDP 16 = 32 / PP 2).
    tps = 8 * 4096 * 16 / st.achievable_step_time_s
    assert st.achievable_tokens_per_s_per_gpu == pytest.approx(tps / 32, rel=1e-12, abs=0)
    # The peak-bound MFU has the same model FLOPs per token: MFU = F x (tokens/s per GPU) / BF16 peak.
    flops_per_token = st.mfu * BF16_PEAK / st.tokens_per_s_per_gpu
    assert st.achievable_mfu == pytest.approx(flops_per_token * (tps / 32) / BF16_PEAK, rel=1e-14, abs=0)
    # Without an EP overlap schedule the all-to-all over the NIC (43.74 GB/s for ~0.44 s of the stage's bytes)
    # is exposed and binds the stage.
    assert st.achievable_binding == "ep_all_to_all (exposed)" and st.achievable_exposed_ep_s > 0
    assert st.rates == "b200"


def test_an_expert_gemm_sees_t_k_e_over_e_tokens():
    """The routed GEMM's M is the tokens one expert receives, T k e / E: at EP16 4096 x 8 x 16 / 128 = 4,096, at
    EP8 (one 8-GPU domain) 2,048. Only the experts' size factors change, so the layer's achievable tensor time
    moves by the three expert GEMMs re-read on the measured size curve (x 4/3 for full recompute)."""
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    ep8 = k3opt.make_layout(gpus=16, pp=2, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=8, context=4096,
                            split=[24, 24], recompute="full", precision="mxfp8", domain_gpus_used=8)
    cube = load_rates("b200").model_copy(update={"gemm_shape": None})  # the cube-edge curve's path
    t8 = coefficients(Shape.of(ep8), model, cluster, rates=cube).achievable["tensor"][5]
    t16 = coefficients(Shape.of(_layout()), model, cluster, rates=cube).achievable["tensor"][5]
    T = 4096
    diff = sum(6 * T * o * i * 8 / (MXFP8_PEAK * GROUPED_MXFP8) * (1 / _size(2048, o, i) - 1 / _size(4096, o, i))
               for o, i in ((768, 2048), (768, 2048), (2048, 768))) * 4 / 3
    assert diff > 0
    assert t8 - t16 == pytest.approx(diff, rel=1e-9, abs=0)


# Full recompute runs each decoder layer's forward once more, and only the layers: at the achievable rates every
# Qwen3-30B-A3B decoder layer (48 identical MoE layers, config.json) has the same tensor time, the last one too, and the
# LM-head edge costs the same with and without full recompute (the head's logits are not recomputed).

def _tensor(recompute: str):
    lay = k3opt.make_layout(gpus=16, pp=1, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=1, context=4096,
                            split=[48], recompute=recompute, domain_gpus_used=8)
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=load_rates("b200"))
    return cf.achievable["tensor"]  # 48 layers, then the embedding edge and the head edge


def test_every_decoder_layer_is_recomputed_and_the_head_is_not():
    full, selective = _tensor("full"), _tensor("selective")
    assert len(full) == 48 + 2
    assert full[47] == pytest.approx(full[0], rel=1e-12, abs=0)  # the last decoder layer like the first
    assert full[0] > selective[0]
    assert full[49] == pytest.approx(selective[49], rel=1e-12, abs=0) and full[49] > 0
    assert full[48] == 0.0  # the embedding lookup runs no GEMM


# The achievable tensor time of K3's chunked delta-rule scan (KDA layers), derived from the config's shapes and the
# measured attention-kernel fractions of constraints/rates/gb200-nvl72.toml.

def test_kda_scan_flops_run_at_the_attention_kernels_rates():
    """K3's KDA layer 0 has no softmax attention; its chunked delta-rule scan, 3 x 96 heads x (64 x (4 + 3) x 128 +
    6 x 128 x 128) = 44,826,624 FLOPs per token (fwd + bwd; fla chunk_kda, chunk 64, head dim 128), runs as the
    attention core: its forward third at BF16 2,500 TF x 0.391, its backward two thirds at x 0.333. Halving both
    measured fractions adds exactly that time again (T = 4,096, no recompute) and leaves the GEMMs alone."""
    lay = k3opt.make_layout(gpus=64, pp=1, ep=64, dense_fsdp=64, expert_fsdp=1, microbatches=1, context=4096,
                            split=[93], recompute="none")
    m, c = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    r = load_rates("gb200-nvl72")
    slow = r.model_copy(update={
        "attention_core": r.attention_core.model_copy(update={"value": 0.391 / 2}),
        "attention_core_backward": r.attention_core_backward.model_copy(update={"value": 0.333 / 2})})
    a = coefficients(Shape.of(lay), m, c, rates=r).achievable["tensor"]
    b = coefficients(Shape.of(lay), m, c, rates=slow).achievable["tensor"]
    core = 4096 * 3 * 96 * (64 * 7 * 128 + 6 * 128 * 128)
    added = core / 3 / (2500e12 * 0.391) + core * 2 / 3 / (2500e12 * 0.333)
    assert b[0] - a[0] == pytest.approx(added, rel=1e-9, abs=0)
    assert b[-1] == a[-1]  # the LM head: GEMMs only


# The achievable step's update: compute plus the data-parallel communication left exposed beyond its overlap window
# (dp_overlap_microbatches x the stage time; Megatron overlaps the gradient reduce-scatter with the last microbatch's
# backward and the parameter all-gather with the first forward). Qwen3-30B-A3B on 32 B200 GPUs, whose update all-gathers
# and reduces over dense FSDP 16 across two NVLink domains.

LAYOUT = dict(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096, split=[24, 24],
              recompute="full", domain_gpus_used=8)


def _step(overlap: float, **fields):
    lay = k3opt.make_layout(**{**LAYOUT, **fields})
    r = load_rates("b200")
    rates = r.model_copy(update={"overlap": r.overlap.model_copy(update={"dp_overlap_microbatches": overlap})})
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    return achievable_step(coefficients(Shape.of(lay), model, cluster, rates=rates), lay.split, rates, cluster)


def test_a_window_of_no_microbatch_exposes_all_update_communication():
    """Window 0: every second of update communication is exposed, so the update is compute + that; a window of
    1,000 stage-microbatches hides it all (exposed 0) and leaves the compute alone. The difference of the two
    updates, and of the two steps, is the exposed communication of the first."""
    bare, hidden = _step(0.0), _step(1000.0)
    assert hidden.update_comm_exposed_s == 0.0
    assert bare.update_comm_exposed_s > 0
    assert bare.update_time_s - hidden.update_time_s == pytest.approx(bare.update_comm_exposed_s, rel=1e-9)
    assert bare.step_time_s - hidden.step_time_s == pytest.approx(bare.update_comm_exposed_s, rel=1e-9)


# Megatron runs its EP overlap schedule under PP > 1 only interleaved and without full recompute.
EP_OVERLAP = {"ep_overlap": True, "vp": 2, "split": [12, 12, 12, 12], "recompute": "selective"}


@pytest.mark.parametrize("fields", [{}, EP_OVERLAP,
                                    {"dense_sharding": "no_shard", "context": 128, "domain_gpus_used": 1}])
def test_evaluate_reports_the_achievable_steps_parts(fields):
    """evaluate()'s step carries the parts of the achievable step at the shipped rates (one stage-microbatch
    window): stage, update, its exposed communication (not zero when a DDP all-reduce over the NIC outlasts a
    128-token stage-microbatch), the unpaired all-to-all (not zero under an EP overlap schedule); step = slots x
    stage + update + unpaired, slots = M + (p - 1) / v: 9 for 1F1B, 8.5 interleaved over two chunks a rank."""
    lay = k3opt.make_layout(**{**LAYOUT, **fields})
    st = k3opt.evaluate(lay, model="qwen3-30b-a3b", cluster="b200").step
    ach = _step(1.0, **fields)
    assert (ach.unpaired_ep_s > 0) == ("ep_overlap" in fields)
    assert (ach.update_comm_exposed_s > 0) == ("dense_sharding" in fields)
    assert (st.achievable_stage_time_s, st.achievable_update_time_s, st.achievable_update_comm_exposed_s,
            st.achievable_unpaired_ep_s) == (ach.stage_time_s, ach.update_time_s, ach.update_comm_exposed_s,
                                             ach.unpaired_ep_s)
    slots = 8.5 if "ep_overlap" in fields else 9
    assert st.achievable_step_time_s == pytest.approx(
        slots * st.achievable_stage_time_s + st.achievable_update_time_s + st.achievable_unpaired_ep_s, rel=1e-12)
    # The per-rank parts the timeline and the explorer draw are the achievable step's own.
    assert (st.ranked_chunk_s, st.achievable_rank_stage_s, st.achievable_rank_binding,
            st.achievable_rank_exposed_ep_s, st.achievable_slowest_rank) == (
        ach.chunk_s, ach.stage_s, ach.stage_binding, ach.stage_exposed_ep_s, ach.slowest_rank)
    assert len(st.ranked_chunk_s) == len(lay.split) and len(st.achievable_rank_stage_s) == 2


def test_the_slowest_rank_is_the_one_with_the_most_layers():
    """At split [16, 32] rank 1 holds twice rank 0's decoder layers and the LM head: it is the slowest rank at the
    achievable rates, and its stage is the step's stage."""
    st = k3opt.evaluate(k3opt.make_layout(**{**LAYOUT, "split": [16, 32]}), model="qwen3-30b-a3b",
                        cluster="b200").step
    assert st.achievable_slowest_rank == 1
