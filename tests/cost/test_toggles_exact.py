"""Each toggle, recompute mode, lifecycle and placement on its own, pinned term by term against the hand model of
tests/golden_k3.py (the direction-only checks of test_toggles.py say which way a toggle moves a figure; these say
by exactly how much)."""

from __future__ import annotations

import golden_k3 as hand
import pytest

import k3opt
from k3opt.inputs.specs import TOGGLE_NAMES

GB200 = hand.Cluster(bf16_tflops=2500, hbm_gbps=8000, nvlink_gbps=900, nic_gbps=50, host_link_gbps=200)
REF = dict(gpus=512, pp=8, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, rows=1, context=4096,
           split=[12] * 7 + [9], recompute="full")
# Hand placement of the reference shape on 72-GPU domains: a = 8 for EP64 and dense FSDP64, 1 for expert FSDP 1,
# every PP hop on the NIC (see test_golden.py). On 64-GPU blocks each stage is one domain: a = 64.
HAND_REF = dict(gpus=512, pp=8, vp=1, cp=1, ep=64, fe=1, fd=64, m=64, rows=1, context=4096, doc=4096,
                recompute="full", accumulate=False, a_ep=8, a_dense=8, a_expert=1, pp_nvlink=[False] * 8)

VARIANTS = {f"toggle:{name}": ({"toggles": {name: True}}, {}) for name in TOGGLE_NAMES}
VARIANTS |= {
    "recompute:none": ({"recompute": "none"}, {"recompute": "none"}),
    "recompute:selective": ({"recompute": "selective"}, {"recompute": "selective"}),
    "lifecycle:accumulate": ({"fsdp_lifecycle": "accumulate"}, {"accumulate": True}),
    "documents:2048": ({"document_length": 2048}, {"doc": 2048}),
    "domain:64": ({"domain_gpus_used": 64}, {"a_ep": 64, "a_dense": 64}),
    "dense FSDP 1": ({"dense_fsdp": 1}, {"fd": 1, "a_dense": 1}),
    "dense FSDP 2": ({"dense_fsdp": 2}, {"fd": 2, "a_dense": 2}),
    # EP8 groups are 8 consecutive ranks and never straddle a 72-GPU boundary (a = 8); expert FSDP 8 takes ranks
    # l, l + 8, ..., l + 56 of a stage, and the boundary 72 falls 8 ranks into stage 1: one member before it, a = 1
    "EP8 expert FSDP 8": ({"ep": 8, "expert_fsdp": 8}, {"ep": 8, "fe": 8, "a_ep": 8, "a_expert": 1}),
    "fp8 block 32, CE chunk 512, 3 resident layers": (
        {"fp8_block_size": 32, "ce_chunk_tokens": 512, "offload_resident_layers": 3,
         "toggles": {"fp8_activations": True, "fused_cross_entropy": True, "activation_offload": True}},
        {"fp8_block": 32, "ce_chunk": 512, "offload_layers": 3}),
    # rank 0 holds layer 0 only (no MoE layer: no EP buffers, routing map or MoonEP buffers), rank 1 exactly one
    "edge split + moonep": ({"split": [1, 1, 13, 13, 13, 13, 13, 26], "toggles": {"moonep": True}}, {}),
    "edge split": ({"split": [1, 1, 13, 13, 13, 13, 13, 26]}, {}),
    "selective+offload+balance+fp8": (
        {"recompute": "selective", "toggles": {"activation_offload": True, "balance_activations": True,
                                               "fp8_activations": True}},
        {"recompute": "selective"}),
    "interleaved v2 + zero2 + offload": (
        {"vp": 2, "split": [6] * 15 + [3], "toggles": {"pipeline_zero2_host_grads": True,
                                                     "activation_offload": True}},
        {"vp": 2}),
}
# 64 GPUs inside one 72-GPU domain: PP8 / EP8 / dense FSDP 8. Every rank, the wrap-around hop included, shares the
# domain: a = 8, every PP hop and the balancing traffic on NVLink.
SMALL = (dict(gpus=64, pp=8, ep=8, expert_fsdp=1, dense_fsdp=8, microbatches=16, rows=1, context=4096,
              split=[12] * 7 + [9], recompute="full", toggles={"balance_activations": True, "ep_dedup": True}),
         dict(gpus=64, pp=8, vp=1, cp=1, ep=8, fe=1, fd=8, m=16, rows=1, context=4096, doc=4096, recompute="full",
              accumulate=False, a_ep=8, a_dense=8, a_expert=1, pp_nvlink=[True] * 8, pipeline_in_domain=True))


def _check(layout_fields: dict, hand_fields: dict) -> None:
    layout = k3opt.make_layout(**layout_fields)
    ev = k3opt.evaluate(layout)
    g = hand.golden(hand.Golden(split=list(layout.split), t=layout.toggles, cluster=GB200, **hand_fields))
    wrong = []
    for got, want in zip(ev.ranks, g["ranks"], strict=True):
        for key, val in want["ledger"].items():
            if not hand.same_bytes(got.ledger[key], val):
                wrong.append((got.rank, key, got.ledger[key], float(val)))
        if not hand.same_bytes(got.host_bytes, want["host"]):
            wrong.append((got.rank, "host", got.host_bytes, float(want["host"])))
        if got.in_flight != pytest.approx(float(want["in_flight"]), rel=1e-12):
            wrong.append((got.rank, "in_flight", got.in_flight, float(want["in_flight"])))
        for res in want["time"]:
            for what, x, y in (("t", got.time_s[res], want["time"][res]), ("u", got.update_s[res],
                                                                          want["update"][res])):
                if abs(x - y) > max(1e-15, 1e-13 * abs(y)):
                    wrong.append((got.rank, what, res, x, y))
        assert next(t.formula for t in got.terms if t.key == "logits") == want["logits_formula"]
        assert got.counts["residual_streams_out"] == want["residual_out"]
        assert got.counts["pp_packet_out_bytes"] == want["packet_out"]
    assert not wrong, wrong
    assert ev.step.step_time_s == pytest.approx(g["step"], rel=1e-13)
    for key, val in g["components"].items():
        assert ev.step.components[key] == pytest.approx(val, rel=1e-13, abs=1e-15), key


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_of_the_reference_matches_the_hand_model(variant):
    layout_delta, hand_delta = VARIANTS[variant]
    _check({**REF, **layout_delta}, {**HAND_REF, **hand_delta})


def test_pipeline_inside_one_domain_balances_over_nvlink():
    _check(*SMALL)
    ev = k3opt.evaluate(k3opt.make_layout(**SMALL[0]))
    # 1F1B peaks 8, 7, ..., 1 average to 4.5: every rank holds 4.5 microbatches' inputs (12 or 9 x 56 MiB)
    assert [r.in_flight for r in ev.ranks] == [4.5] * 8
    assert ev.ranks[0].time_s["nic"] == 0


def test_pipeline_hops_alternating_between_nvlink_and_the_nic():
    """192 GPUs, PP8: stages of 24 ranks, three per 72-GPU domain (0-2, 3-5, 6-7). EP8, dense FSDP 8 and expert
    FSDP 3 (ranks l, l + 8, l + 16) stay inside a stage, so inside a domain. Hops 0->1, 1->2, 3->4, 4->5, 6->7 stay
    in a domain; 2->3, 5->6 and the wrap-around 7->0 cross it: each rank pays its in and out packets on its own
    hops' links."""
    _check(dict(gpus=192, pp=8, ep=8, expert_fsdp=3, dense_fsdp=8, microbatches=16, rows=1, context=4096,
                split=[12] * 7 + [9], recompute="full", toggles={"balance_activations": True}),
           dict(gpus=192, pp=8, vp=1, cp=1, ep=8, fe=3, fd=8, m=16, rows=1, context=4096, doc=4096,
                recompute="full", accumulate=False, a_ep=8, a_dense=8, a_expert=3,
                pp_nvlink=[True, True, False, True, True, False, True, False]))


def test_expert_fsdp_inside_a_domain_with_accumulate_and_p2p_muon():
    """Layout B of test_golden.py (64-GPU blocks: expert FSDP 2 pairs sit in one domain, a = 2) with the accumulate
    lifecycle and P2P Muon: the expert groups' per-update collectives run on NVLink."""
    _check(dict(gpus=1024, pp=16, ep=32, expert_fsdp=2, dense_fsdp=32, microbatches=32, split=[5] + [6] * 14 + [4],
                recompute="selective", domain_gpus_used=64, fsdp_lifecycle="accumulate", toggles={"p2p_muon": True}),
           dict(gpus=1024, pp=16, vp=1, cp=1, ep=32, fe=2, fd=32, m=32, rows=1, context=4096, doc=4096,
                recompute="selective", accumulate=True, a_ep=32, a_dense=32, a_expert=2, pp_nvlink=[False] * 16))


def test_a_model_without_attnres_carries_no_bank_and_one_stream_per_packet(model):
    """Without Block AttnRes nothing closes a residual block: no bank, and every PP packet is the hidden stream."""
    plain = model.model_copy(update={"attn_res": None})
    ev = k3opt.evaluate(k3opt.make_layout(**REF), model=plain)
    stream = 4096 * 7168 * 2
    for r in ev.ranks:
        assert r.ledger["attnres_bank"] == 0
        assert r.counts["residual_streams_out"] == ([0] if r.rank < 7 else [])
        assert r.ledger["pp_buffers"] == 2 * (2 if 0 < r.rank < 7 else 1) * stream
