"""Achievable rates as sourced data, and the achievable step time that uses them beside the peak roofline."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import peak_roofline_cluster

import k3opt
import k3opt.report.text
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.errors import SpecError
from k3opt.inputs.presets import preset_names
from k3opt.inputs.rates import load_rates, rates_for
from k3opt.inputs.specs import FsdpLifecycle, ShardingPolicy


@pytest.mark.parametrize("name", preset_names("rates"))
def test_every_shipped_rate_names_its_source(name):
    rates = load_rates(name)
    for key, rate in rates.named().items():
        assert rate.source.strip(), key
        if rate.unit.startswith("fraction"):
            assert 0 < rate.value <= 1, key
    assert rates.cluster in preset_names("cluster")


def test_gb200_fractions_are_the_microbenchmarks_over_the_datasheet_peaks():
    r = load_rates("gb200-nvl72")
    assert r.gemm_dense["fp8"].value == round(2819.5 / 5000, 3)       # Azure cuBLASLt FP8 16384^3
    assert r.gemm_grouped["mxfp8"].value == round(2672 / 5000, 3)     # Megatron-LM GB200 guide, grouped MXFP8
    assert r.a2a_nvlink_gbps["hybridep"].value == pytest.approx(2 / (1 / 479.02 + 1 / 447.89), abs=0.05)


def test_gb300_gemm_fractions_are_its_own_microbenchmarks():
    """Azure ND GB300 v6 (CUDA 13.0): cuBLASLt FP8 16384^3 3,308.5 and FP4 16384^3 8,640.3 TFLOP/s over the 5 PF
    FP8 and 15 PF FP4 dense peaks; the grouped rates scale them by GB200's grouped / dense ratio 2,672 / 2,819.5;
    the size curve is GB300's own sweep (553.5 at 1024^3, 2,288.9 at 2048^3, 3,257.0 at 4096^3)."""
    r = load_rates("gb300-nvl72")
    assert r.gemm_dense["fp8"].value == round(3308.5 / 5000, 3)
    assert r.gemm_dense["mxfp8"].value == r.gemm_dense["fp8"].value
    assert r.gemm_dense["nvfp4"].value == round(8640.3 / 15000, 3)
    ratio = 2672 / 2819.5
    assert r.gemm_grouped["mxfp8"].value == pytest.approx(3308.5 / 5000 * ratio, abs=1e-3)
    assert r.gemm_grouped["nvfp4"].value == pytest.approx(8640.3 / 15000 * ratio, abs=1e-3)
    assert r.size_factor(np.array([2048.0]))[0] == pytest.approx(2288.9 / 3257.0, abs=1e-3)
    assert r.size_factor(np.array([1024.0]))[0] == pytest.approx(553.5 / 3257.0, abs=1e-3)
    # BF16 has no GB300 measurement of its own: its FP8 rate times one sm_100 device's BF16 / FP8 rate ratio at
    # 4096^3 (XLA's table, 1,416.9 / 2,765.0 TFLOP/s), over the 2.5 PF BF16 peak.
    assert r.gemm_dense["bf16"].value == round(3308.5 * 1416.9 / 2765.0 / 2500, 3)
    assert r.gemm_grouped["bf16"].value == pytest.approx(3308.5 * 1416.9 / 2765.0 / 2500 * ratio, abs=1e-3)


def test_hopper_fractions_are_their_microbenchmarks_over_the_datasheet_peaks():
    """H100 SXM (989 TFLOP/s BF16, 1,979 FP8, 3,350 GB/s HBM, 450 GB/s NVLink): cuBLAS BF16 8192^3 797.8 (fast.cu),
    cuBLASLt FP8 16384^3 1,377.3 and its sweep 274.1 / 1,011.3 / 1,216.9 / 1,290.1 at 1024-8192^3 (Azure ND H100 v5),
    TE multi-stream grouped BF16 627.9, DeepGEMM grouped FP8 1,346 and 1,214 weighted by FLOPs, FlashAttention-3
    602 / 559, BabelStream copy 2.90 TB/s, nccl-tests busbw 360 GB/s, DeepEP in a node 328.97 / 287.14 GB/s.
    H200 (4,800 GB/s HBM3e): BabelStream copy 4.01 TB/s, cuBLASLt FP8 16384^3 1,366.3 and 290.8 / 1,013.4 at
    1024 / 2048^3 (Azure ND H200 v5), UCCL-EP in a node 320 / 319 GB/s."""
    r = load_rates("h100-sxm")
    assert r.gemm_dense["bf16"].value == round(797.8 / 989, 3)
    assert r.gemm_dense["fp8"].value == round(1377.3 / 1979, 3)
    assert r.gemm_grouped["bf16"].value == round(627.9 / 989, 3)
    up, down = 2 * 8192 * 4096 * 7168, 2 * 8192 * 7168 * 2048  # FLOPs of one group's GEMM in each DeepGEMM row
    assert r.gemm_grouped["fp8"].value == round((up + down) / (up / 1346 + down / 1214) / 1979, 3)
    assert (r.attention_core.value, r.attention_core_backward.value) == (round(602 / 989, 3), round(559 / 989, 3))
    assert r.hbm.value == round(2.90 / 3.35, 3) and r.collective_nvlink.value == round(360 / 450, 2)
    assert r.a2a_nvlink_gbps["deepep"].value == pytest.approx(2 / (1 / 328.97 + 1 / 287.14), abs=0.05)
    assert r.size_factor(np.array([1024.0, 2048.0, 4096.0, 8192.0, 16384.0])) == pytest.approx(
        [274.1 / 1377.3, 1011.3 / 1377.3, 1216.9 / 1377.3, 1290.1 / 1377.3, 1.0], abs=1e-3)
    h200 = load_rates("h200-sxm")
    assert h200.hbm.value == round(4.01 / 4.8, 3) and h200.gemm_dense["fp8"].value == round(1366.3 / 1979, 3)
    assert h200.size_factor(np.array([1024.0, 2048.0])) == pytest.approx([290.8 / 1366.3, 1013.4 / 1366.3],
                                                                          abs=1e-3)
    assert h200.a2a_nvlink_gbps["deepep"].value == pytest.approx(2 / (1 / 320 + 1 / 319), abs=0.05)
    # The quantize kernels' H100 fraction scaled by H200's / H100's BabelStream copy fractions.
    assert h200.hbm_quantize.value == round(2770 / 3350 * (4.01 / 4.8) / (2.90 / 3.35), 3)
    # Without an H200 measurement of its own, a fraction is H100's (the same GH100 die), marked as an assumption.
    assert h200.attention_core.value == r.attention_core.value and h200.attention_core.kind == "assumption"


def test_bf16_and_fp8_gemm_fractions_come_from_one_campaign():
    """GB200 and B200: BF16 at the FP8 fraction (Azure GB200 cuBLASLt 2,819.5 of 5 PF) times the BF16 / FP8
    fraction ratio of one device (XLA's sm_100 table at 4096^3: 1,416.9 of 2.5 PF against 2,765.0 of 5 PF)."""
    for name in ("gb200-nvl72", "b200"):
        r = load_rates(name)
        assert r.gemm_dense["bf16"].value == round(0.564 * (1416.9 / 2500) / (2765.0 / 5000), 3) == 0.578
        assert r.gemm_grouped["bf16"].value == pytest.approx(0.578 * 2672 / 2819.5, abs=1e-3)


def test_rates_file_errors(tmp_path):
    bad = tmp_path / "r.toml"
    bad.write_text((k3opt.inputs.presets.preset_dir("rates") / "gb200-nvl72.toml").read_text() + "\nfudge = 1.3\n")
    with pytest.raises(SpecError, match="fudge: unknown key"):
        load_rates(str(bad))
    r = load_rates("gb200-nvl72")
    with pytest.raises(SpecError, match="dispatcher 'nccl'"):
        r.a2a("nccl", "nvlink")


def _llama(**kw) -> k3opt.Layout:
    return k3opt.make_layout(gpus=64, dense_fsdp=64, microbatches=2, rows=2, context=8192, split=[80],
                             recompute="selective", fsdp_lifecycle="accumulate", **kw)


def test_achievable_tensor_time_of_one_llama_layer():
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    cf = coefficients(Shape.of(_llama()), model, cluster)
    T = 2 * 8192
    linear = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192     # q, o; k, v; gate, up, down
    attn = 3 * 64 * (128 + 128) * 8192                                  # causal score/value, per token
    # GEMMs at 0.578 of 2.5 PF: GB200's cuBLASLt FP8 2,819.5 TFLOP/s x XLA's sm_100 BF16 / FP8 ratio at 4096^3,
    # 1,416.9 / 2,765.0, = 1,444.8 TFLOP/s.
    # Attention: 1 of its 3 FLOP units is the forward (cuDNN 39.1% of the BF16 peak), 2 the backward
    # (0.391 x FA4's backward / forward rate 1,208.6 / 1,418.1 = 0.333).
    expected = 6 * T * linear / (2.5e15 * 0.578) + T * attn / 3 / (2.5e15 * 0.391) + T * attn * 2 / 3 / (2.5e15 * 0.333)
    assert cf.achievable["tensor"][5] == pytest.approx(expected, rel=1e-12)
    # The peak roofline of the same layer is the same FLOPs at 100 % of 2.5 PF.
    assert cf.time["tensor"][5] == pytest.approx((6 * T * linear + T * attn) / 2.5e15, rel=1e-12)


def test_achievable_step_is_slower_than_the_peak_bound_and_ep_overlap_hides_the_all_to_all():
    lay = k3opt.make_layout(gpus=64, pp=4, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=16, context=4096,
                            split=[16, 15, 15, 15], recompute="selective", precision="mxfp8",
                            toggles={"ep_dedup": True}, domain_gpus_used=64)
    ev = k3opt.evaluate(lay, model="deepseek-v3", cluster="gb200-nvl72")
    st = ev.step
    assert st.rates == "gb200-nvl72"
    assert st.achievable_step_time_s > st.step_time_s
    assert st.achievable_exposed_ep_s > 0
    overlapped = k3opt.evaluate(lay.model_copy(update={"ep_overlap": True}), model="deepseek-v3",
                                cluster="gb200-nvl72").step
    assert overlapped.achievable_exposed_ep_s == 0
    assert overlapped.achievable_step_time_s < st.achievable_step_time_s
    assert overlapped.step_time_s == st.step_time_s  # the peak bound already overlaps everything


def test_cluster_without_rates_has_only_the_peak_roofline():
    own = peak_roofline_cluster("h200-sxm")
    assert rates_for(own) is None and rates_for(k3opt.load_cluster("h200-sxm")) is not None
    ev = k3opt.evaluate(_llama(), model="llama3-70b", cluster=own)
    assert ev.step.achievable_step_time_s is None and ev.step.step_time_s > 0
    # Without rates the timeline draws the peak-rate chunks: one chunk (PP1), its stage split forward : backward =
    # 1 : 2 (a backward pass is two forward passes of matmuls, SC21 section 3.5; selective recompute adds none).
    ((fwd, bwd),) = ev.step.ranked_chunk_s
    assert fwd == pytest.approx(ev.step.stage_time_s / 3, rel=1e-12)
    assert bwd == pytest.approx(2 * ev.step.stage_time_s / 3, rel=1e-12)


def test_small_gemms_run_slower_by_the_measured_size_curve():
    r = load_rates("gb200-nvl72")
    # cuBLASLt FP8 on GB200: 1,676.1 TFLOP/s at 2048^3 against 2,694.7 at 4096^3; flat from 4096 up.
    assert r.size_factor(np.array([2048.0]))[0] == pytest.approx(1676.1 / 2694.7, abs=1e-3)
    assert r.size_factor(np.array([4096.0, 16384.0])).tolist() == [1.0, 1.0]
    # Half-way in log2 between 2048 and 4096 the factor is the mean of the two points.
    assert r.size_factor(np.array([2048 * 2 ** 0.5]))[0] == pytest.approx((0.622 + 1.0) / 2)


def test_hierarchical_dispatcher_crosses_each_remote_domain_once():
    """DeepEP / HybridEP: a token goes once to each remote NVLink domain holding one of its experts and is
    forwarded over NVLink there. DeepSeek-V3 on B200 (8-GPU domains), EP32 = 4 domains of 64 experts each."""
    from math import comb

    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("b200")
    base = dict(gpus=256, pp=8, vp=2, ep=32, dense_fsdp=32, expert_fsdp=1, microbatches=128, context=4096,
                split=[4] * 15 + [1], recompute="selective", fsdp_lifecycle="accumulate", precision="mxfp8")
    seed = coefficients(Shape.of(k3opt.make_layout(**base)), model, cluster)
    deepep = coefficients(Shape.of(k3opt.make_layout(**base, dispatcher="deepep")), model, cluster)
    T, d, k = 4096, 7168, 8
    per_copy = 4 * T * d * 2                      # dispatch + combine, forward and backward, BF16
    rank_copies = k * (1 - 8 / 32)                # seed 002: one copy per assignment outside the domain
    domain_copies = 3 * (1 - comb(256 - 64, k) / comb(256, k))
    moe_layer = 10
    diff = (seed.time["nic"][moe_layer] - deepep.time["nic"][moe_layer]) * 50e9
    assert diff == pytest.approx(per_copy * (rank_copies - domain_copies), rel=1e-9)


def test_overlapped_all_to_all_still_holds_its_sms():
    """With an EP overlap schedule the all-to-all hides under compute, but the compute beside it runs without the
    dispatcher's SMs: HybridEP was measured with 32 of a GB200's 148 SMs, so the stage keeps 32/148 of it."""
    from k3opt.cost.achievable import achievable_for

    # MB-13's layout with the EP overlap schedule of the 067f987d recipes (its 26.04.01 release ran without it).
    lay = k3opt.load_layout("layouts/measured/mb-13-deepseek-v3-gb200.toml").model_copy(update={"ep_overlap": True})
    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb200-nvl72")
    on = achievable_for(coefficients(Shape.of(lay), model, cluster), lay.split, cluster)
    off_lay = lay.model_copy(update={"ep_overlap": False})
    off = achievable_for(coefficients(Shape.of(off_lay), model, cluster), lay.split, cluster)
    assert on.binding == "tensor" and off.exposed_ep_s > 0 and on.exposed_ep_s == 0
    for step, share in ((on, 32 / 148), (off, 1.0)):
        t = step.rank_time_s[step.slowest_rank]
        ep = max(t["ep_nvlink"], t["ep_nic"])
        assert step.stage_time_s == pytest.approx(t["tensor"] + t["vector"] + share * ep, rel=1e-12)


def test_ranking_view_sums_to_the_achievable_stage():
    """The search ranks by per-layer arrays summed over a rank's layers (achievable.ranking_view); for a single-stage
    layout (no PP packets, EP inside one domain) their max is the achievable stage written from the raw arrays:
    exposed, max(tensor + vector, HBM, NVLink, NIC, host) + the all-to-all; overlapped, the all-to-all is one more
    resource and the compute beside it loses HybridEP's 32 of 148 SMs. The view's update keeps the compute side."""
    from k3opt.cost.achievable import achievable_for, ranking_view

    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml")
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("gb200-nvl72")
    for overlap in (True, False):
        lo = lay.model_copy(update={"ep_overlap": overlap})
        cf = coefficients(Shape.of(lo), model, cluster)
        view = ranking_view(cf, cluster)
        a = {res: float(v.sum()) for res, v in cf.achievable.items()}
        assert a["ep_nvlink"] > 0 and a["ep_nic"] == 0
        inner = [a["tensor"] + a["vector"], a["hbm"], a["nvlink"], a["nic"], a["host_link"]]
        want = (max(inner[0] + 32 / 148 * a["ep_nvlink"], *inner[1:], a["ep_nvlink"]) if overlap
                else max(inner) + a["ep_nvlink"])
        stage = max(float(v.sum()) for v in view.time.values())
        assert stage == pytest.approx(want, rel=1e-12)
        assert stage == pytest.approx(achievable_for(cf, lo.split, cluster).stage_time_s, rel=1e-12)
        assert view.update["nvlink"].sum() == 0 and view.update["tensor"].sum() == cf.update_achievable["tensor"].sum()
        assert view.pp_seconds_per_byte == cf.pp_seconds_per_byte_achievable
        assert view.act is cf.act


def test_exposed_all_to_all_is_per_layer_when_it_crosses_domains():
    """Each layer's dispatch + combine runs its NVLink and NIC sides at once and the layers one after another, so
    the exposed time is sum over MoE layers of max(NVLink side, NIC side) (B200 row: EP 32 over 8-GPU domains)."""
    from k3opt.cost.achievable import achievable_for

    lay = k3opt.load_layout("layouts/measured/mb-14-deepseek-v3-b200.toml").model_copy(update={"ep_overlap": False})
    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("b200")
    cf = coefficients(Shape.of(lay), model, cluster)
    step = achievable_for(cf, lay.split, cluster)
    r = step.slowest_rank
    edges = np.concatenate([[0], np.cumsum(lay.split)]).astype(int)
    mine = [i for j in range(r, lay.pp * lay.vp, lay.pp) for i in range(edges[j], edges[j + 1])]
    nvl, nic = cf.achievable["ep_nvlink"][mine], cf.achievable["ep_nic"][mine]
    assert nvl.sum() > 0 and nic.sum() > 0
    assert step.exposed_ep_s == pytest.approx(float(np.maximum(nvl, nic).sum()), rel=1e-12)


def test_unpaired_microbatches_of_the_ep_overlap_schedule():
    """Megatron's combined 1F1B pairs one microbatch's forward with another's backward; the ones without a partner
    run their all-to-all exposed. Interleaved PP 4 x VP 4, 64 microbatches, rank 0: warmup 2(4 - 1) + 3 x 4 + 1 = 19
    forwards, chunks in groups of 4 microbatches (0000 1111 2222 3333 000); the last 19 backwards run last chunk
    first per group (000 | 3333 2222 1111 0000). PP 1: the first forward and the last backward."""
    from k3opt.cost.schedule import ep_overlap_unpaired

    fwd, bwd = ep_overlap_unpaired(4, 4, 64, 0)
    assert fwd == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [0] * 3
    assert bwd == [0] * 3 + [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4
    assert ep_overlap_unpaired(4, 4, 64, 3) == ([0] * 4 + [1] * 4 + [2] * 4 + [3], [3] + [2] * 4 + [1] * 4 + [0] * 4)
    assert ep_overlap_unpaired(1, 1, 16, 0) == ([0], [0])
    assert ep_overlap_unpaired(8, 4, 2, 0) == ([0, 0, 1, 1, 2, 2, 3, 3], [3, 3, 2, 2, 1, 1, 0, 0])  # capped at v M


def test_ep_overlap_exposes_one_microbatch_of_all_to_all_under_pp1():
    """MB-20's layout under the 067f987d recipe's EP overlap (PP 1, HybridEP, 32 of 148 SMs; its 26.04.01 release
    ran without overlap): the first forward's dispatch + combine and the last
    backward's run alone, one microbatch's all-to-all in all (4 payload exchanges, 2 each way), costing what the
    overlapped stage did not charge: (1 - 32/148) x its time, added once to the step. Without overlap: 0."""
    from k3opt.cost.achievable import achievable_for

    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml").model_copy(update={"ep_overlap": True})
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("gb200-nvl72")
    cf = coefficients(Shape.of(lay), model, cluster)
    step = achievable_for(cf, lay.split, cluster)
    a2a = float(cf.achievable["ep_nvlink"].sum())  # 8 GPUs in one domain: no NIC side
    assert cf.achievable["ep_nic"].sum() == 0 and a2a > 0
    assert step.unpaired_ep_s == pytest.approx((1 - 32 / 148) * a2a, rel=1e-12)
    assert step.step_time_s == pytest.approx(16 * step.stage_time_s + step.update_time_s + step.unpaired_ep_s)
    off = lay.model_copy(update={"ep_overlap": False})
    assert achievable_for(coefficients(Shape.of(off), model, cluster), off.split, cluster).unpaired_ep_s == 0
    text = k3opt.report.text.explain_text(k3opt.evaluate(lay, model=model, cluster=cluster))
    assert f"unpaired microbatches expose {step.unpaired_ep_s * 1e3:.1f} ms" in text


def test_full_recompute_runs_the_attention_forward_twice_at_the_forward_rate():
    """Full recompute adds one attention forward (4 FLOP units: 2 forward, 2 backward): the tensor time grows by one
    forward unit at the forward rate (39.1% of the BF16 peak), not at the backward one, on top of the GEMMs'
    recomputed forward."""
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    lay = k3opt.make_layout(gpus=64, dense_fsdp=64, microbatches=2, rows=2, context=8192, split=[80],
                            recompute="full", fsdp_lifecycle="accumulate")
    full = coefficients(Shape.of(lay), model, cluster)
    sel = coefficients(Shape.of(_llama()), model, cluster)
    T = 2 * 8192
    linear = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192
    attn = 3 * 64 * (128 + 128) * 8192
    extra = 2 * T * linear / (2.5e15 * 0.578) + T * attn / 3 / (2.5e15 * 0.391)
    assert full.achievable["tensor"][5] - sel.achievable["tensor"][5] == pytest.approx(extra, rel=1e-9)


def test_nccl_ring_latency_is_the_tuning_models_alpha(tmp_path):
    """NCCL's tuning model (tuning.cc at 5067397c, Ring / Simple): base 8.4 us + 3.4 us per step inside an NVLink
    domain + 14.0 us per step across domains; a ring all-gather over n ranks in n/a domains has n - 1 steps, n/a - 1
    of them across."""
    r = load_rates("gb200-nvl72")
    assert r.ring_latency_s(64, 64) == pytest.approx((8.4 + 63 * 3.4) * 1e-6, rel=1e-12)         # 222.6 us
    assert r.ring_latency_s(32, 8) == pytest.approx((8.4 + 28 * 3.4 + 3 * 14.0) * 1e-6, rel=1e-12)  # 145.6 us
    assert r.ring_latency_s(1, 1) == 0.0
    # Without the fields (a user's rates file that leaves them out) there is no latency term.
    assert r.model_copy(update={"collective_hop_latency_nic_us": None}).ring_latency_s(64, 64) == 0.0
    bad = tmp_path / "r.toml"
    text = (k3opt.inputs.presets.preset_dir("rates") / "gb200-nvl72.toml").read_text()
    bad.write_text(text.replace("value = 8.4", "value = -8.4"))
    with pytest.raises(SpecError, match="collective_base_latency_us"):
        load_rates(str(bad))


def _latency_delta(path: str, model: str, cluster: str, **update) -> tuple[dict, dict]:
    """(per-microbatch, per-update) seconds the latency fields add to the achievable nvlink / nic arrays."""
    lay = k3opt.load_layout(path).model_copy(update=update)
    m, c = k3opt.load_model(model), k3opt.load_cluster(cluster)
    r = load_rates(cluster)
    bare = r.model_copy(update={"collective_base_latency_us": None})
    a = coefficients(Shape.of(lay), m, c, rates=r)
    b = coefficients(Shape.of(lay), m, c, rates=bare)
    per_mb = {res: a.achievable[res] - b.achievable[res] for res in ("nvlink", "nic")}
    per_up = {res: a.update_achievable[res] - b.update_achievable[res] for res in ("nvlink", "nic")}
    return per_mb, per_up


def test_collective_latency_inside_one_nvlink_domain():
    """MB-13 (DeepSeek-V3, GB200, EP64 and DP64 each inside one 64-GPU domain, gradients accumulated): per
    microbatch, one routing-map all-gather over EP64 per MoE layer, 8.4 + 63 x 3.4 = 222.6 us on NVLink, none on a
    dense layer (0-2); per update, one parameter all-gather and one gradient reduce-scatter over DP64 per layer,
    2 x 222.6 us (expert FSDP 1: no expert-group call)."""
    mb, up = _latency_delta("layouts/measured/mb-13-deepseek-v3-gb200.toml", "deepseek-v3", "gb200-nvl72")
    ring = (8.4 + 63 * 3.4) * 1e-6
    assert mb["nvlink"][0] == 0.0 and mb["nvlink"][10] == pytest.approx(ring, rel=1e-12)
    assert not mb["nic"].any() and not up["nic"].any()
    assert up["nvlink"][0] == pytest.approx(2 * ring, rel=1e-12)
    assert up["nvlink"][10] == pytest.approx(2 * ring, rel=1e-12)


def test_collective_latency_across_domains_per_microbatch_reduce_scatter():
    """MB-14's layout on B200 (8-GPU domains) under FSDP (optim_grads_params) with gradients reduce-scattered every
    microbatch: EP32 and DP32 each span 4 domains, 8.4 + 28 x 3.4 + 3 x 14.0 = 145.6 us a call, on the NIC. Per
    microbatch a dense layer (0) pays the DP reduce-scatter, an MoE layer (10) that plus the routing-map all-gather;
    per update, the parameter all-gather of each layer."""
    fsdp = ShardingPolicy.OPTIM_GRADS_PARAMS
    mb, up = _latency_delta("layouts/measured/mb-14-deepseek-v3-b200.toml", "deepseek-v3", "b200",
                            fsdp_lifecycle=FsdpLifecycle.PER_MICROBATCH, dense_sharding=fsdp, expert_sharding=fsdp)
    ring = (8.4 + 28 * 3.4 + 3 * 14.0) * 1e-6
    assert not mb["nvlink"].any()
    assert mb["nic"][0] == pytest.approx(ring, rel=1e-12)
    assert mb["nic"][10] == pytest.approx(2 * ring, rel=1e-12)
    assert up["nic"][10] == pytest.approx(ring, rel=1e-12)


def test_collective_latency_follows_the_sharding_policy():
    """MB-14's layout on B200 with gradients reduced every microbatch where they are sharded (145.6 us a call, on
    the NIC, as above). optim (Megatron's distributed optimizer): the whole gradient buffer is reduce-scattered once
    per update, so a dense layer (0) pays nothing per microbatch and all-gather + reduce-scatter = 2 calls per
    update; no_shard (DDP): no parameter all-gather, one all-reduce = two ring passes per update, again 2 calls."""
    ring = (8.4 + 28 * 3.4 + 3 * 14.0) * 1e-6
    for policy in ("optim", "no_shard"):
        mb, up = _latency_delta("layouts/measured/mb-14-deepseek-v3-b200.toml", "deepseek-v3", "b200",
                                fsdp_lifecycle="per_microbatch", dense_sharding=policy)
        assert mb["nic"][0] == 0.0, policy
        assert up["nic"][0] == pytest.approx(2 * ring, rel=1e-12), policy
