"""Golden figures for three layouts that separate the parallel degrees: every ledger term of every PP rank, every
resource's time per microbatch and per update of every rank, and the step-time components.

The expected values come from tests/golden_k3.py, a hand model written from the spec sheets that does not import
k3opt (parameter counts from model-k3.md section 3, formulas from cost-model.md), plus literal anchors derived step
by step below. Tolerance: half a byte (k3opt rounds each term once) for bytes, 1e-13 relative for seconds.

- A, the K3 memory lab reference: 512 GB200, PP8 / EP64 / expert FSDP 1 / dense FSDP 64, M 64, full recompute.
- B: 1024 GB200 in 64-GPU blocks, PP16 / EP32 / expert FSDP 2 / dense FSDP 32, M 32, selective recompute, fused
  SiTU, FP8 activations, EP dedup, MoonEP, chunked cross-entropy.
- C: 512 GB200, PP4 / VP2 / CP2 / EP16 / expert FSDP 4 / dense FSDP 16, M 16 of 2 x 8K rows, 2K documents, no
  recompute, accumulate lifecycle, dispatch recompute, MoE backward rewrite, P2P Muon, pipeline ZeRO-2.
"""

from __future__ import annotations

import golden_k3 as hand
import pytest
from conftest import shared_scope

import k3opt
from k3opt.cost import comm
from k3opt.cost.coefficients import cost_model
from k3opt.cost.structure import structure_of

GB200 = hand.Cluster(bf16_tflops=2500, hbm_gbps=8000, nvlink_gbps=900, nic_gbps=50, host_link_gbps=200)
STREAM = 4096 * 7168 * 2  # one BF16 [4096, 7168] stream: 58,720,256 B = 56 MiB (K3 memory lab)


def _layout_b() -> k3opt.Layout:
    return k3opt.make_layout(
        gpus=1024, pp=16, ep=32, expert_fsdp=2, dense_fsdp=32, microbatches=32, split=[5] + [6] * 14 + [4],
        recompute="selective", domain_gpus_used=64,
        toggles={"fused_situ": True, "fp8_activations": True, "ep_dedup": True, "moonep": True,
                 "fused_cross_entropy": True})


def _layout_c() -> k3opt.Layout:
    return k3opt.make_layout(
        gpus=512, pp=4, vp=2, cp=2, ep=16, expert_fsdp=4, dense_fsdp=16, microbatches=16, rows=2, context=8192,
        document_length=2048, split=[11, 12, 12, 12, 12, 12, 12, 10], recompute="none",
        fsdp_lifecycle="accumulate",
        toggles={"dispatch_recompute": True, "moe_backward_rewrite": True, "p2p_muon": True,
                 "pipeline_zero2_host_grads": True})


# Placement (Megatron order tp-cp-ep-dp-pp, NVLink domains = consecutive blocks), derived by hand:
# A: stages are 64 ranks, domains 72. Stage s spans [64 s, 64 s + 63]; the boundary 72 j cuts stage 1 into 8 + 56,
#    stage 2 into 16 + 48, ..., stage 7 into 56 + 8. EP64 and dense FSDP64 groups are the whole stage: worst member
#    sees a = 8. Expert FSDP 1: a = 1. No stage pair shares a domain: every PP hop is on the NIC.
# B: 64 GPUs used per domain, stages are 64 ranks = one domain each. EP32 groups (32 consecutive) and dense FSDP32
#    groups (32 consecutive dp indices, cp = 1) sit inside a domain: a = 32; expert FSDP2 pairs ranks l and l + 32 of
#    one stage: a = 2. Every PP hop leaves its domain.
# C: stages of 128 ranks, domains 72. EP16 groups are 16 consecutive ranks and 72 j mod 16 is 0 or 8: worst a = 8.
#    Dense FSDP16 takes 16 dp indices at stride cp = 2, i.e. one parity of 32 consecutive ranks; the boundary 72
#    falls 8 ranks into the block [64, 95]: 4 members before it, 12 after, a = 4. Expert FSDP4 takes 4 expert-dp
#    indices at stride e = 16 (ranks 64 + l, 80 + l, 96 + l, 112 + l for l < 8): one member before 72, a = 1.
CASES = {
    "A": (lambda: k3opt.load_layout("k3-gb200-512-reference"), dict(
        gpus=512, pp=8, vp=1, cp=1, ep=64, fe=1, fd=64, m=64, rows=1, context=4096, doc=4096, recompute="full",
        accumulate=False, a_ep=8, a_dense=8, a_expert=1, pp_nvlink=[False] * 8)),
    "B": (_layout_b, dict(
        gpus=1024, pp=16, vp=1, cp=1, ep=32, fe=2, fd=32, m=32, rows=1, context=4096, doc=4096,
        recompute="selective", accumulate=False, a_ep=32, a_dense=32, a_expert=2, pp_nvlink=[False] * 16)),
    "C": (_layout_c, dict(
        gpus=512, pp=4, vp=2, cp=2, ep=16, fe=4, fd=16, m=16, rows=2, context=8192, doc=2048, recompute="none",
        accumulate=True, a_ep=8, a_dense=4, a_expert=1, pp_nvlink=[False] * 4)),
}
DOMAIN = {"A": 72, "B": 64, "C": 72}


@pytest.fixture(scope=shared_scope, params=sorted(CASES))
def case(request):
    make, params = CASES[request.param]
    layout = make()
    ev = k3opt.evaluate(layout)
    g = hand.golden(hand.Golden(split=list(layout.split), t=layout.toggles, cluster=GB200, **params))
    return request.param, layout, ev, g


def _close(got: float, want: float, rel: float = 1e-13, abs_: float = 0.0) -> bool:
    return abs(got - want) <= max(abs_, rel * abs(want))


def test_placement_members_per_domain(case):
    name, layout, _, _ = case
    p = CASES[name][1]
    pl = comm.placement(layout.gpus, layout.pp, layout.cp, layout.ep, layout.expert_fsdp, layout.dense_fsdp,
                        DOMAIN[name])
    assert (pl.ep_local, pl.dense_fsdp_local, pl.expert_fsdp_local) == (p["a_ep"], p["a_dense"], p["a_expert"])
    assert list(pl.pp_hop_in_domain) == p["pp_nvlink"] and not pl.pipeline_in_domain


def test_every_ledger_term_of_every_rank(case):
    name, _, ev, g = case
    assert len(ev.ranks) == len(g["ranks"])
    wrong = []
    for r, (got, want) in enumerate(zip(ev.ranks, g["ranks"], strict=True)):
        assert set(want["ledger"]) == set(got.ledger), f"{name} rank {r}: ledger keys"
        for key, val in want["ledger"].items():
            if not hand.same_bytes(got.ledger[key], val):
                wrong.append((r, key, got.ledger[key], float(val)))
        if not hand.same_bytes(got.host_bytes, want["host"]):
            wrong.append((r, "host", got.host_bytes, float(want["host"])))
        if got.in_flight != pytest.approx(float(want["in_flight"]), rel=1e-12):
            wrong.append((r, "in_flight", got.in_flight, float(want["in_flight"])))
    assert not wrong, f"layout {name}: (rank, term, k3opt, hand) {wrong}"


def test_every_resource_time_per_microbatch_and_per_update(case):
    name, layout, ev, g = case
    wrong = []
    for r, (got, want) in enumerate(zip(ev.ranks, g["ranks"], strict=True)):
        for res in ("tensor", "hbm", "nvlink", "nic", "host_link"):
            if not _close(got.time_s[res], want["time"][res], abs_=1e-15):
                wrong.append((r, "microbatch", res, got.time_s[res], want["time"][res]))
            if not _close(got.update_s[res], want["update"][res], abs_=1e-15):
                wrong.append((r, "update", res, got.update_s[res], want["update"][res]))
        assert got.counts["newton_schulz_flops"] == pytest.approx(float(want["ns_flops"]), rel=1e-12)
        assert got.counts["newton_schulz_routed_flops"] == pytest.approx(float(want["ns_routed"]), rel=1e-12)
        assert got.counts["moe_layers"] == want["moe_layers"]
        assert got.counts["residual_streams_out"] == want["residual_out"]
        assert got.counts["pp_packet_out_bytes"] == want["packet_out"]
        assert got.counts["routing_map_allgathers_per_update"] == want["moe_layers"] * layout.microbatches * (
            2 if layout.recompute == "full" else 1)
    assert not wrong, f"layout {name}: {wrong}"


def test_step_components(case):
    name, layout, ev, g = case
    s = ev.step
    assert s.slowest_rank == g["slowest"]
    # the full set of component names is frozen in test_surface.py; these are the ones the hand model derives
    assert set(g["components"]) <= set(s.components)
    for key, want in g["components"].items():
        assert _close(s.components[key], want, abs_=1e-15), (name, key, s.components[key], want)
    parts = s.components["microbatch_work"] + s.components["bubble"] + s.components["exposed_update"]
    assert _close(s.step_time_s, g["step"]) and _close(parts, g["step"])
    assert _close(s.stage_time_s, g["stage"]) and _close(s.update_time_s, g["update"])
    assert s.slots == g["slots"] and s.tokens_per_update == g["tokens_per_update"]
    assert _close(s.tokens_per_s_per_gpu, g["tokens_per_update"] / g["step"] / layout.gpus)
    serial = g["slots"] * max(sum(r["time"].values()) for r in g["ranks"]) + max(
        sum(r["update"].values()) for r in g["ranks"])
    assert _close(s.serial_step_time_s, serial)
    # MFU: 6 x 104,174,092,288 active matrices + 24 MLA layers x 3 x 96 x (192 + 128) x document length,
    # over the GPUs' 2,500 TFLOP/s dense BF16.
    flops = 6 * 104_174_092_288 + 24 * 92_160 * CASES[name][1]["doc"]
    assert s.model_flops_per_token == flops
    assert _close(s.mfu, flops * g["tokens_per_update"] / g["step"] / (layout.gpus * 2.5e15))
    # seed 002's (p - 1)/(v M) and its share of the compute-plus-bubble interval, ((p - 1)/v) / (M + (p - 1)/v)
    assert s.bubble_overhead == pytest.approx(float(g["bubble_overhead"]), rel=1e-15)
    assert s.bubble_fraction == pytest.approx(float(g["bubble_fraction"]), rel=1e-15)
    assert (s.bubble_overhead, s.bubble_fraction) == {
        "A": (7 / 64, 7 / 71), "B": (15 / 32, 15 / 47), "C": (1.5 / 16, 1.5 / 17.5)}[name]


# --- literal anchors: the reference layout's rank 1 and slowest rank, derived step by step --------------------


def test_reference_rank1_ledger_literals(reference_eval):
    """Rank 1 holds layers 12..23: MLA at 15, 19, 23 (3), KDA 9, MoE 12 (model-k3.md section 1).
    D_muon = 9 x 442,892,288 + 3 x 232,194,048 + 12 x 189,923,328 = 6,961,692,672
    D_adam = 9 x 848,096 + 3 x 2,048 + 12 x (3,584 + 43,008)          = 8,198,112
    D = 6,969,890,784; E = 12 x 29,595,009,024 = 355,140,108,288."""
    led = reference_eval.ranks[1].ledger
    # master = grads = 4 (D/64 + E/(64 x 1)) = (D + E) / 16 = 362,109,999,072 / 16 (K3 memory lab)
    assert led["master"] == led["grads"] == 22_631_874_942
    # optimizer = 4 (6,961,692,672 + E)/64 + 8 x 8,198,112/64 = 22,631,362,560 + 1,024,764
    assert led["optimizer"] == 22_632_387_324
    # bf16_view = 2 (D + E/64) = 2 (6,969,890,784 + 5,549,064,192)
    assert led["bf16_view"] == 25_037_909_952
    # 1F1B rank 1 of 8: min(64, 8 - 1) = 7 in flight x 12 checkpointed inputs x 56 MiB
    assert led["activations"] == 7 * 12 * STREAM == 4_932_501_504
    # AttnRes: R(24) = floor(2 x 24 / 12) = 4 residual streams per in-flight microbatch
    assert led["attnres_bank"] == 7 * 4 * STREAM
    # PP packets: in (1 + R(12)) = 3 streams, out (1 + R(24)) = 5 streams; both directions live: 2 x 8 streams
    assert led["pp_buffers"] == 16 * STREAM
    # dispatch + combine: 2 x 4096 x 16 x 3584 x 2 B; HybridEP map 64 x 4096 x 896 = 224 MiB (K3 roofline lab)
    assert led["ep_buffers"] == 939_524_096 and led["routing_map"] == 234_881_024
    # optimizer step: the BF16 group 2 (D + E/64) + the largest Newton-Schulz set, [12288, 7168]:
    # 2 x (2 x 7168 x 12288 + 2 x 7168^2) = 557,842,432
    assert led["optimizer_transient"] == 25_037_909_952 + 557_842_432
    # full recompute: the KDA + MoE layer's whole saved set, 275,112 + 1,721,064 B per token (itemized in
    # golden_k3), x 4096 tokens; its unsharded BF16 gradient 2 x 633,710,304 plus two BF16 [T, d] streams
    assert led["recompute_working_set"] == (275_112 + 1_721_064) * 4096 == 8_176_336_896
    assert led["grad_transient"] == 2 * 633_710_304 + 2 * STREAM == 1_384_861_120
    assert led["logits"] == 0 and led["moonep_slots"] == led["grad_accum"] == led["moonep_buffers"] == 0
    # the last rank's logits: [4096, 163840] x (2 B BF16 + 4 B FP32)
    assert reference_eval.ranks[7].ledger["logits"] == 4096 * 163840 * 6 == 4_026_531_840


def test_reference_slowest_rank_nic_time_literal(reference_eval):
    """Rank 6 (layers 72..83: 3 MLA, 9 KDA, 12 MoE, so D = 6,969,890,784) binds on the NIC, a = 8 of EP64:
    EP payload: 6 exchanges x 4096 x 3584 x 2 B x 16 (1 - 8/64) = 14 cross-domain copies, x 12 layers
                = 29,595,009,024 B
    routing maps: 2 all-gathers x 4096 x 896 B x (64 - 8) ranks off-domain x 12 layers = 4,932,501,504 B
    dense FSDP reduce-scatter: (4 D / 8) x (1 - 8/64) = 3,049,327,218 B (expert FSDP 1: none)
    PP packets: in 1 + R(72) = 13 streams, out 1 + R(84) = 15 streams: 28 x 56 MiB = 1,644,167,168 B
    total 39,221,004,914 B at 50 GB/s = 0.78442009828 s; step = 71 slots x that + the exposed update."""
    s = reference_eval.step
    assert s.slowest_rank == 6 and s.binding == "nic"
    nic = 29_595_009_024 + 4_932_501_504 + 4 * 6_969_890_784 * 7 / 64 + 28 * STREAM
    assert s.components["nic"] == pytest.approx(nic / 50e9, rel=1e-12)
    assert s.components["nic"] == pytest.approx(0.78442009828, rel=1e-11)
    assert s.components["microbatch_work"] == pytest.approx(64 * 0.78442009828, rel=1e-11)
    assert s.components["bubble"] == pytest.approx(7 * 0.78442009828, rel=1e-11)  # (p - 1) = 7 slots
    # NVLink share: EP 6 x 4096 x 3584 x 2 x (15.75 - 14) x 12, maps 2 x 3,670,016 x 7 x 12, FSDP 4 D (1 - 1/8)
    nvl = 6 * 4096 * 3584 * 2 * 1.75 * 12 + 2 * 3_670_016 * 7 * 12 + 4 * 6_969_890_784 * 7 / 8
    assert s.components["nvlink"] == pytest.approx(nvl / 900e9, rel=1e-12)


def test_reference_exposed_update_literal(reference_eval):
    """Interior rank's Newton-Schulz (K3 roofline lab: 504 expert matrices = 487,049,291,366,400 FLOP) plus its
    share 1/64 of the non-routed Muon matrices; at 2,500 TFLOP/s it is the largest update resource."""
    kda = 5 * hand.ns(7168, 12288) + hand.ns(128, 7168) + hand.ns(12288, 128)
    mla = hand.ns(1536, 7168) + hand.ns(18432, 1536) + hand.ns(576, 7168) + hand.ns(24576, 512) \
        + hand.ns(12288, 7168) + hand.ns(7168, 12288)
    moe = hand.ns(896, 7168) + 2 * hand.ns(3584, 7168) + 3 * hand.ns(6144, 7168)
    flops = 487_049_291_366_400 + (9 * kda + 3 * mla + 12 * moe) / 64
    assert reference_eval.ranks[1].counts["newton_schulz_flops"] == pytest.approx(flops, rel=1e-12)
    assert reference_eval.step.components["exposed_update"] == pytest.approx(flops / 2.5e15, rel=1e-12)


def test_hand_model_reproduces_the_seed_state_tally():
    """The hand model's per-rank state over all 512 GPUs is the K3 memory lab's 12 P_muon + 16 P_adam."""
    make, params = CASES["A"]
    layout = make()
    g = hand.golden(hand.Golden(split=list(layout.split), t=layout.toggles, cluster=GB200, **params))
    state = sum(64 * (r["ledger"]["master"] + r["ledger"]["grads"] + r["ledger"]["optimizer"]) for r in g["ranks"])
    assert state == 33_370_617_153_024


def test_interleaved_held_vectors_match_megatron_warmup():
    """Layout C's ranks: the held chunk-microbatches peak at min(2 (p - r - 1) + (v - 1) p + 1, v M)."""
    for r in range(4):
        peak = max(sum(v) for v in hand.inflight_vectors(4, 2, 16, r))
        assert peak == min(2 * (4 - r - 1) + 4 + 1, 32)
    ev = k3opt.evaluate(_layout_c())
    assert [r.in_flight for r in ev.ranks] == [11, 9, 7, 5]


# --- the structure's per-layer arrays and layer kinds, from model-k3.md's unit table ---------------------------

def test_layer_kinds_follow_the_config(model):
    st = structure_of(model)
    kinds = [st.layer_kind(i) for i in range(93)]
    assert kinds[0] == "kda+dense" and kinds[1] == "kda+moe" and kinds[3] == "mla+moe" and kinds[92] == "mla+moe"
    assert kinds.count("mla+moe") == 24 and kinds.count("kda+moe") == 68 and kinds.count("kda+dense") == 1


def test_per_layer_arrays_from_the_unit_table(model, cluster):
    """The per-layer sums the ledger and the roofline read (CostModel.static, indexed 0 .. 92 by layer, then
    the first and last edges) against model-k3.md's unit table."""
    a = cost_model(model, cluster).static
    assert len(a.moe) == 93 + 2
    for i in range(93):
        mla = hand.is_mla(i)
        attn_muon = hand.MLA_MUON if mla else hand.KDA_MUON
        attn_adam = hand.MLA_ADAM if mla else hand.KDA_ADAM
        attn_active = hand.MLA_ACTIVE if mla else hand.KDA_ACTIVE
        if i == 0:
            want = (attn_muon + hand.DENSE_MUON, attn_adam + hand.VEC0_ADAM, 0, attn_active + hand.DENSE_ACTIVE, 0, 0)
        else:
            want = (attn_muon + hand.MOE_MUON, attn_adam + hand.MOE_ADAM + hand.VEC_ADAM, hand.ROUTED,
                    attn_active + hand.MOE_ACTIVE, hand.ROUTED_ACTIVE, 1)
        got = (a.pn_muon[i], a.p_adam[i], a.p_routed[i], a.active[i] - a.routed_active[i], a.routed_active[i],
               a.moe[i])
        assert tuple(int(x) for x in got) == want, i
        assert int(a.attn[i]) == (3 * 96 * (192 + 128) if mla else 0)
        assert int(a.scan[i]) == (0 if mla else 3 * 96 * (64 * (4 * 128 + 3 * 128) + 6 * 128 * 128))


@pytest.mark.parametrize(("kind", "naive"), [
    ("kda", 137_450),
    ("mla", 104_618),
    # without fused SiTU the MoE layer keeps 6 FP32 [16, 3072] and 6 FP32 [1, 6144] copies instead of the BF16
    # [16, 6144] and [1, 12288] inputs: 306,602 - 98,304 - 12,288 + 294,912 + 36,864
    ("moe", 527_786),
    # dense FFN layer: 14,337 + 9 + 6 x 33,792 + 33,792
    ("dense_ffn", 14_337 + 9 + 6 * 33_792 + 33_792),
])
def test_saved_values_per_token_without_fused_situ(model, kind, naive):
    assert structure_of(model).saved_values_per_token(kind) == naive


# --- the tensor inventory: names are part of the model TOML's contract (optimizer.adamw_matrices names them) ---
M, A = "muon", "adamw"
INVENTORY = {
    # model-k3.md section 2, [out, in]; (name, shape, optimizer, count, routed, active copies per token)
    "kda": [("kda.q_proj", (12288, 7168), M, 1, False, 1), ("kda.k_proj", (12288, 7168), M, 1, False, 1),
            ("kda.v_proj", (12288, 7168), M, 1, False, 1), ("kda.g_proj", (12288, 7168), M, 1, False, 1),
            ("kda.o_proj", (7168, 12288), M, 1, False, 1), ("kda.f_a_proj", (128, 7168), M, 1, False, 1),
            ("kda.f_b_proj", (12288, 128), M, 1, False, 1), ("kda.beta_proj", (96, 7168), A, 1, False, 1),
            ("kda.conv1d", (3, 12288, 4), A, 1, False, 0), ("kda.dt_bias", (12288,), A, 1, False, 0),
            ("kda.A_log", (96,), A, 1, False, 0), ("kda.o_norm", (128,), A, 1, False, 0)],
    "mla": [("mla.q_a_proj", (1536, 7168), M, 1, False, 1), ("mla.q_b_proj", (18432, 1536), M, 1, False, 1),
            ("mla.kv_a_proj", (576, 7168), M, 1, False, 1), ("mla.kv_b_proj", (24576, 512), M, 1, False, 1),
            ("mla.o_proj", (7168, 12288), M, 1, False, 1), ("mla.q_a_norm", (1536,), A, 1, False, 0),
            ("mla.kv_a_norm", (512,), A, 1, False, 0), ("mla.g_proj", (12288, 7168), M, 1, False, 1)],
    "dense_ffn": [("ffn.gate_proj", (33792, 7168), M, 1, False, 1), ("ffn.up_proj", (33792, 7168), M, 1, False, 1),
                  ("ffn.down_proj", (7168, 33792), M, 1, False, 1)],
    "moe": [("moe.router", (896, 7168), M, 1, False, 1), ("moe.latent_down", (3584, 7168), M, 1, False, 1),
            ("moe.latent_up", (7168, 3584), M, 1, False, 1), ("moe.latent_norm", (3584,), A, 1, False, 0),
            ("moe.experts.w1", (3072, 3584), M, 896, True, 16), ("moe.experts.w3", (3072, 3584), M, 896, True, 16),
            ("moe.experts.w2", (3584, 3072), M, 896, True, 16), ("moe.shared_gate", (6144, 7168), M, 1, False, 1),
            ("moe.shared_up", (6144, 7168), M, 1, False, 1), ("moe.shared_down", (7168, 6144), M, 1, False, 1)],
    "vectors": [("input_norm", (7168,), A, 1, False, 0), ("post_attention_norm", (7168,), A, 1, False, 0),
                ("attn_res.attn_norm", (7168,), A, 1, False, 0), ("attn_res.attn_proj", (1, 7168), A, 1, False, 0),
                ("attn_res.mlp_norm", (7168,), A, 1, False, 0), ("attn_res.mlp_proj", (1, 7168), A, 1, False, 0)],
    "embedding": [("embed", (163840, 7168), A, 1, False, 0)],
    "head": [("final_norm", (7168,), A, 1, False, 0), ("attn_res.output_norm", (7168,), A, 1, False, 0),
             ("attn_res.output_proj", (1, 7168), A, 1, False, 0), ("lm_head", (163840, 7168), A, 1, False, 1)],
    # MoonViT-V2: 27 blocks of width 1024, 12 heads x 128, MLP 4096, patch 14, 64 x 64 positions; projector
    # 4 x 1024 -> 4096 -> 7168 (401,214,464 + 46,144,512 parameters)
    "vision": [("vision.blocks.wqkv", (4608, 1024), A, 27, False, 0),
               ("vision.blocks.wo", (1024, 1536), A, 27, False, 0),
               ("vision.blocks.fc0", (4096, 1024), A, 27, False, 0),
               ("vision.blocks.fc1", (1024, 4096), A, 27, False, 0),
               ("vision.blocks.norm0", (1024,), A, 27, False, 0), ("vision.blocks.norm1", (1024,), A, 27, False, 0),
               ("vision.patch_embed", (1024, 3, 14, 14), A, 1, False, 0),
               ("vision.pos_emb", (64, 64, 1024), A, 1, False, 0),
               ("vision.final_norm", (1024,), A, 1, False, 0), ("projector.proj0", (4096, 4096), A, 1, False, 0),
               ("projector.proj2", (7168, 4096), A, 1, False, 0), ("projector.post_norm", (7168,), A, 1, False, 0)],
}


def test_tensor_inventory_names_shapes_and_optimizers(model):
    st = structure_of(model)
    blocks = {"kda": st.layers[1][0], "mla": st.layers[3][0], "dense_ffn": st.layers[0][1], "moe": st.layers[1][1],
              "vectors": st.layers[1][2], "embedding": st.first[0], "vision": st.first[1], "head": st.last[0]}
    for kind, block in blocks.items():
        got = [(t.name, t.shape, t.optimizer, t.count, t.routed, t.active_per_token) for t in block.tensors]
        assert got == INVENTORY[kind], kind
        assert block.kind == kind
    assert [t.name for t in st.layers[0][2].tensors] == ["input_norm", "post_attention_norm", "attn_res.mlp_norm",
                                                           "attn_res.mlp_proj"]  # layer 0 has no attention pair
    assert [b.name for b in st.layers[3]] == ["layer3.mla", "layer3.moe", "layer3.vectors"]
    assert [b.name for b in st.layers[0]] == ["layer0.kda", "layer0.dense_ffn", "layer0.vectors"]
    assert [b.name for b in st.first + st.last] == ["embedding", "vision", "lm_head"]


SAVED = {
    # (name, values per token, bytes per value, GEMM input, recomputable, role); itemized in golden_k3 by shape
    "kda": ["attn_norm_input", "attn_norm_rstd", "attn_norm_output", "attn_attn_res_scores", "kda_qkv_pre_conv",
            "kda_qkv_post_conv", "kda_decay_lowrank", "kda_decay_gate", "kda_beta", "kda_output_gate",
            "kda_scan_output", "kda_gated_norm_output"],
    "mla": ["attn_norm_input", "attn_norm_rstd", "attn_norm_output", "attn_attn_res_scores", "mla_q_a_output",
            "mla_q_a_norm_output", "mla_kv_a_output", "mla_kv_a_norm_output", "mla_q", "mla_k", "mla_v",
            "mla_attn_output", "mla_softmax_lse", "mla_output_gate", "mla_gated_output"],
    "moe": ["mlp_norm_input", "mlp_norm_rstd", "mlp_norm_output", "mlp_attn_res_scores", "moe_router_scores",
            "moe_topk_weights", "moe_topk_indices", "moe_latent_down_output", "moe_latent_norm_output",
            "moe_dispatched_inputs", "moe_expert_situ_fp32_copies", "moe_expert_situ_input", "moe_expert_act_output",
            "moe_expert_outputs", "moe_combined_latent", "moe_shared_situ_fp32_copies", "moe_shared_situ_input",
            "moe_shared_act_output"],
}
ROLES = {"moe_dispatched_inputs": "dispatch_copy", "moe_expert_outputs": "expert_output",
         "moe_expert_situ_fp32_copies": "situ_naive", "moe_shared_situ_fp32_copies": "situ_naive",
         "moe_expert_situ_input": "situ_fused", "moe_shared_situ_input": "situ_fused",
         "ffn_situ_fp32_copies": "situ_naive", "ffn_situ_input": "situ_fused"}


def test_saved_inventory_matches_the_hand_itemization(model):
    """Names, roles and (values, bytes, GEMM input, recomputable) of every saved-for-backward item, against
    golden_k3's itemization from shapes (both SiTU variants listed: the toggles pick one)."""
    st = structure_of(model)
    plain = {"kda": hand.kda_saved(), "mla": hand.mla_saved()}
    for kind, block in (("kda", st.layers[1][0]), ("mla", st.layers[3][0])):
        assert [s.name for s in block.saved] == SAVED[kind]
        got = [(s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable) for s in block.saved]
        assert got == plain[kind] and all(s.role == "" for s in block.saved)
    moe = st.layers[1][1]
    assert [s.name for s in moe.saved] == SAVED["moe"]
    for s in moe.saved:
        assert s.role == ROLES.get(s.name, "")
    naive = [(s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable) for s in moe.saved
             if s.role != "situ_fused"]
    fused = [(s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable) for s in moe.saved
             if s.role != "situ_naive"]
    assert naive == hand.moe_saved(False, False, False) and fused == hand.moe_saved(True, False, False)
    dense = st.layers[0][1]
    assert [(s.name, s.role) for s in dense.saved] == [
        ("mlp_norm_input", ""), ("mlp_norm_rstd", ""), ("mlp_norm_output", ""), ("mlp_attn_res_scores", ""),
        ("ffn_situ_fp32_copies", "situ_naive"), ("ffn_situ_input", "situ_fused"), ("ffn_act_output", "")]
    assert [(s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable) for s in dense.saved
            if s.role != "situ_fused"] == hand.dense_saved(False)
    assert [(s.name, s.values_per_token, s.bytes_per_value) for s in st.first[0].saved] == [("token_ids", 1, 8)]
    assert [s.name for s in st.last[0].saved] == ["final_norm_input", "final_norm_rstd", "final_norm_output"]
    assert [(s.values_per_token, s.bytes_per_value, s.gemm_input, s.recomputable)
            for s in st.last[0].saved] == hand.HEAD_SAVED


@pytest.mark.parametrize(("p", "v", "m"), [(4, 2, 16), (8, 2, 64), (4, 4, 8), (2, 3, 4), (3, 2, 3), (8, 4, 8)])
def test_interleaved_compositions_are_every_held_vector_of_megatrons_order(p, v, m):
    """Every distinct (held chunk-microbatches per local chunk) vector a rank passes through in steady state, against
    the hand enumeration of Megatron's order (golden_k3.inflight_vectors)."""
    from k3opt.cost.schedule import inflight_compositions

    for r in range(p):
        assert set(inflight_compositions(p, v, m, r)) == set(hand.inflight_vectors(p, v, m, r)), r


def test_every_matrix_named_in_adamw_matrices_moves_to_adamw(model):
    """optimizer.adamw_matrices is matched by name: naming every text matrix puts each one on AdamW."""
    names = [t[0] for kind in ("kda", "mla", "dense_ffn", "moe") for t in INVENTORY[kind] if len(t[1]) == 2]
    moved = model.model_copy(update={"optimizer": model.optimizer.model_copy(update={"adamw_matrices": names})})
    st = structure_of(moved)
    for block in (st.layers[1][0], st.layers[3][0], st.layers[0][1], st.layers[1][1]):
        assert all(t.optimizer == "adamw" for t in block.tensors), block.name
    assert st.params.muon == 0 and st.params.total == 2_779_931_738_208
