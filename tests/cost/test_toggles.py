"""Each toggle moves the ledger term it acts on in the right direction and pays its named cost
(spec/cost-model.md sections 1-3; seed 001 for the K3 toggles, seed 004 for fused SiTU)."""

from __future__ import annotations

import pytest
from conftest import shared_scope

import k3opt


def _eval(reference, model, cluster, **changes):
    toggles = changes.pop("toggles", {})
    data = reference.model_dump()
    data.pop("measured")
    data.update(changes)
    data["toggles"] = {**data["toggles"], **toggles}
    return k3opt.evaluate(k3opt.Layout.model_validate(data), model=model, cluster=cluster)


@pytest.fixture(scope=shared_scope)
def base(reference, model, cluster):
    """No recompute, so activation toggles act on the saved set of every in-flight layer."""
    return _eval(reference, model, cluster, recompute="none")


def test_recompute_full_lt_selective_lt_none_activations_and_full_costs_flops(reference, model, cluster):
    ev = {m: _eval(reference, model, cluster, recompute=m) for m in ("none", "selective", "full")}
    act = {m: ev[m].ranks[0].ledger["activations"] for m in ev}
    assert act["full"] < act["selective"] < act["none"]
    t = {m: ev[m].ranks[0].time_s["tensor"] for m in ev}
    assert t["full"] == pytest.approx(t["none"] * 4 / 3, rel=1e-3)  # a forward again
    assert t["selective"] == t["none"]


def test_fp8_activations_shrink_activations_pay_hbm(base, reference, model, cluster):
    ev = _eval(reference, model, cluster, recompute="none", toggles={"fp8_activations": True})
    assert ev.ranks[0].ledger["activations"] < base.ranks[0].ledger["activations"]
    assert ev.ranks[0].time_s["hbm"] > base.ranks[0].time_s["hbm"]  # quantize + dequantize traffic
    # GEMM inputs only: the saving is below half of the activations (norm inputs, residuals stay BF16)
    assert ev.ranks[0].ledger["activations"] > base.ranks[0].ledger["activations"] / 2


def test_activation_offload_moves_activations_to_host_pays_c2c(base, reference, model, cluster):
    ev = _eval(reference, model, cluster, recompute="none", toggles={"activation_offload": True})
    r, b = ev.ranks[0], base.ranks[0]
    assert r.ledger["activations"] < b.ledger["activations"]
    assert r.host_bytes > 0 and b.host_bytes == 0
    assert r.time_s["host_link"] > 0 == b.time_s["host_link"]


def test_balance_activations_flattens_the_staircase_pays_network(base, reference, model, cluster):
    ev = _eval(reference, model, cluster, recompute="none", toggles={"balance_activations": True})
    assert ev.ranks[0].ledger["activations"] < base.ranks[0].ledger["activations"]
    assert ev.ranks[7].ledger["activations"] > base.ranks[7].ledger["activations"]
    assert ev.ranks[0].in_flight == pytest.approx(4.5)  # mean of 8, 7, ..., 1
    net = lambda r: r.time_s["nic"] + r.time_s["nvlink"]  # noqa: E731
    assert net(ev.ranks[0]) > net(base.ranks[0])


def test_moe_backward_rewrite_drops_expert_outputs(base, reference, model, cluster):
    ev = _eval(reference, model, cluster, recompute="none", toggles={"moe_backward_rewrite": True})
    saved = base.ranks[1].ledger["activations"] - ev.ranks[1].ledger["activations"]
    # 7 in flight x 12 MoE layers x 4096 tokens x 16 x 3584 BF16 values
    assert saved == 7 * 12 * 4096 * 16 * 3584 * 2


def test_dispatch_recompute_drops_dispatched_copies_pays_an_exchange(base, reference, model, cluster):
    ev = _eval(reference, model, cluster, recompute="none", toggles={"dispatch_recompute": True})
    saved = base.ranks[1].ledger["activations"] - ev.ranks[1].ledger["activations"]
    assert saved == 7 * 12 * 4096 * 16 * 3584 * 2
    net = lambda r: r.time_s["nic"] + r.time_s["nvlink"]  # noqa: E731
    assert net(ev.ranks[1]) > net(base.ranks[1])


def test_fused_situ_keeps_one_sixth(base, reference, model, cluster):
    ev = _eval(reference, model, cluster, recompute="none", toggles={"fused_situ": True})
    saved = base.ranks[1].ledger["activations"] - ev.ranks[1].ledger["activations"]
    # Expert SiTU (R = 16 T, H = 3072) and shared SiTU (H = 6144): 6 FP32 [R, H] -> BF16 [R, 2H], i.e. 5/6 saved
    per_token = 16 * 3072 * 24 * 5 / 6 + 6144 * 24 * 5 / 6
    assert saved == pytest.approx(7 * 12 * 4096 * per_token, rel=1e-9)


def test_pipeline_zero2_host_grads_two_chunk_buffers_and_host_shards(reference, model, cluster):
    # PP2 VP4 (interleaving needs pipeline stages): eight chunks, each rank holds four.
    split = [12] * 7 + [9]
    base = _eval(reference, model, cluster, pp=2, vp=4, split=split, dense_fsdp=32,
                 gpus=64, ep=32, microbatches=8)
    ev = _eval(reference, model, cluster, pp=2, vp=4, split=split, dense_fsdp=32, gpus=64, ep=32,
               microbatches=8, toggles={"pipeline_zero2_host_grads": True})
    assert ev.ranks[0].ledger["grads"] < base.ranks[0].ledger["grads"]
    assert ev.ranks[0].host_bytes == pytest.approx(base.ranks[0].ledger["grads"], abs=64)
    assert ev.ranks[0].time_s["host_link"] > 0


def test_p2p_muon_shrinks_the_optimizer_transient(reference_eval, reference, model, cluster):
    ev = _eval(reference, model, cluster, toggles={"p2p_muon": True})
    assert ev.ranks[0].ledger["optimizer_transient"] < reference_eval.ranks[0].ledger["optimizer_transient"]
    up = lambda r: r.update_s["nic"] + r.update_s["nvlink"]  # noqa: E731
    assert up(ev.ranks[0]) > up(reference_eval.ranks[0])


def test_moonep_reserves_a_second_expert_copy_and_fixed_buffers(reference_eval, reference, model, cluster):
    ev = _eval(reference, model, cluster, toggles={"moonep": True})
    r = ev.ranks[1]
    assert r.ledger["moonep_slots"] == 2 * 355_140_108_288 // 64
    assert r.ledger["moonep_buffers"] == reference_eval.ranks[1].ledger["ep_buffers"] > 0
    assert r.ledger["ep_buffers"] == 0
    assert r.peak_bytes > reference_eval.ranks[1].peak_bytes


def test_fused_cross_entropy_shrinks_logits_pays_head_flops(reference_eval, reference, model, cluster):
    ev = _eval(reference, model, cluster, toggles={"fused_cross_entropy": True})
    assert ev.ranks[7].ledger["logits"] == 1024 * 163840 * 6
    assert reference_eval.ranks[7].ledger["logits"] == 4096 * 163840 * 6
    assert ev.ranks[7].time_s["tensor"] > reference_eval.ranks[7].time_s["tensor"]


def test_ep_dedup_lowers_ep_traffic(reference_eval, reference, model, cluster):
    ev = _eval(reference, model, cluster, toggles={"ep_dedup": True})
    net = lambda r: r.time_s["nic"] + r.time_s["nvlink"]  # noqa: E731
    assert net(ev.ranks[1]) < net(reference_eval.ranks[1])


def test_accumulate_lifecycle_adds_fp32_buffer_and_drops_per_microbatch_reduce_scatter(
        reference_eval, reference, model, cluster):
    ev = _eval(reference, model, cluster, fsdp_lifecycle="accumulate")
    assert ev.ranks[1].ledger["grad_accum"] == pytest.approx(4 * (6_969_890_784 + 355_140_108_288 / 64), abs=1)
    net = lambda r: r.time_s["nic"] + r.time_s["nvlink"]  # noqa: E731
    assert net(ev.ranks[1]) < net(reference_eval.ranks[1])


def test_domain_aligned_placement_keeps_ep64_on_nvlink(reference_eval, reference, model, cluster):
    """512 GPUs as 8 racks x 64: no EP64 group straddles a domain, so no EP copy crosses the NIC."""
    ev = _eval(reference, model, cluster, domain_gpus_used=64)
    assert ev.ranks[1].time_s["nic"] < reference_eval.ranks[1].time_s["nic"]
    assert ev.step.step_time_s < reference_eval.step.step_time_s


def test_interleaving_divides_the_bubble_not_the_memory(reference, model, cluster):
    ev = _eval(reference, model, cluster, vp=2, split=[6] * 15 + [3])
    assert ev.step.bubble_overhead == pytest.approx(7 / 128)
    # Interleaving raises rank 0's held layer-equivalents (hardware notes: 1 + (p-1)/(p v) at even splits)
    base = _eval(reference, model, cluster)
    assert ev.ranks[0].ledger["activations"] > base.ranks[0].ledger["activations"]
