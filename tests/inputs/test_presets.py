"""Every shipped preset loads, evaluates the reference-shaped layout (K3 memory lab: PP8 / EP64 / dense FSDP 64,
M 64, one 4K row, full recompute) and gives the figures its spec sheet implies.

The spec sheet figures are typed here (clusters.md, model-k3.md section 4); the ledger and times are checked against
the hand model of tests/golden_k3.py fed with those figures, so a preset field read in the wrong unit or the wrong
field shows up as a wrong time, not just a wrong total.
"""

from __future__ import annotations

import golden_k3 as hand
import pytest

import k3opt
from k3opt.inputs.presets import preset_names
from k3opt.inputs.specs import MIB

# clusters.md: HBM (nvidia-smi MiB), HBM GB/s, BF16 and FP8 TFLOP/s, NVLink GB/s, domain GPUs, NIC GB/s,
# host memory GB per GPU, host link GB/s per GPU (GB200/GB300: C2C copy engine measured ~200; HGX: PCIe Gen5 x16 64).
SPEC_SHEET = {
    "gb200-nvl72": (189_471, 8000, 2500, 5000, 900, 72, 50, 240, 200),
    "gb300-nvl72": (284_208, 8000, 2500, 5000, 900, 72, 100, 240, 200),
    "b200": (183_359, 8000, 2250, 4500, 900, 8, 50, 256, 64),
    "h100-sxm": (81_559, 3350, 989, 1979, 450, 8, 50, 256, 64),
    "h200-sxm": (143_771, 4800, 989, 1979, 450, 8, 50, 256, 64),
}
FIELDS = ("hbm_mib", "hbm_gbps", "bf16_tflops", "fp8_tflops", "nvlink_gbps", "nvlink_domain_gpus", "nic_gbps",
          "host_memory_gb", "host_link_gbps")
# clusters.md's GiB column: nvidia-smi MiB / 1024, to 0.01
GIB_LABEL = {"gb200-nvl72": 185.03, "gb300-nvl72": 277.55, "b200": 179.06, "h100-sxm": 79.65, "h200-sxm": 140.40}


def test_the_shipped_presets_are_the_ones_with_spec_sheets():
    assert set(preset_names("cluster")) == set(SPEC_SHEET)
    # Each model preset's parameter total is checked against its published figure in test_model_families.py
    # (kimi-k3 against model-k3.md in test_figures.py; the 4-layer proxy in test_sharding.py).
    assert preset_names("model") == ["deepseek-v3", "kimi-k2", "kimi-k3", "kimi-k3-4layer-proxy", "llama3-70b",
                                     "qwen3-235b-a22b", "qwen3-30b-a3b"]
    assert preset_names("job") == ["k3-512-128k", "k3-512-32k", "k3-512-4k"]
    # Measured layouts are validated row by row (test_memory_kinds.py, test_throughput_validation.py).
    assert "k3-gb200-512-reference" in preset_names("measured layout")
    assert preset_names("runtime") == ["megatron-te-hybridep-gb200", "megatron-te-hybridep-gb200-expandable",
                                       "megatron-te-hybridep-gb200-expandable-nvls-off",
                                       "megatron-te-hybridep-gb200-nvls-off"]
    assert preset_names("rates") == ["b200", "gb200-nvl72", "gb300-nvl72", "h100-sxm", "h200-sxm"]


@pytest.mark.parametrize("name", sorted(SPEC_SHEET))
def test_cluster_preset_fields_match_the_spec_sheet(name):
    c = k3opt.load_cluster(name)
    assert c.name == name
    assert tuple(getattr(c, f) for f in FIELDS) == SPEC_SHEET[name]
    assert c.hbm_bytes == SPEC_SHEET[name][0] * MIB
    assert round(c.hbm_bytes / 2**30, 2) == GIB_LABEL[name]
    assert c.host_memory_bytes == SPEC_SHEET[name][7] * 10**9
    assert c.source


@pytest.mark.parametrize("name", sorted(SPEC_SHEET))
def test_cluster_preset_evaluates_the_reference_shape_like_the_hand_model(name, reference, model):
    hbm_mib, hbm, bf16, _, nvl, domain, nic, _, host = SPEC_SHEET[name]
    ev = k3opt.evaluate(reference, model=model, cluster=name)
    # Placement: 64-rank stages. 72-GPU domains: the worst stage is cut 8 + 56 (a = 8). 8-GPU domains (HGX): an
    # EP64 or dense FSDP64 group spans 8 whole nodes, a = 8 as well. No PP hop stays inside a domain.
    g = hand.golden(hand.Golden(
        gpus=512, pp=8, vp=1, cp=1, ep=64, fe=1, fd=64, m=64, rows=1, context=4096, doc=4096,
        split=list(reference.split), recompute="full", accumulate=False, t=reference.toggles, a_ep=8, a_dense=8,
        a_expert=1, pp_nvlink=[False] * 8,
        cluster=hand.Cluster(bf16_tflops=bf16, hbm_gbps=hbm, nvlink_gbps=nvl, nic_gbps=nic, host_link_gbps=host)))
    assert domain in (8, 72)
    for got, want in zip(ev.ranks, g["ranks"], strict=True):
        for key, val in want["ledger"].items():
            assert hand.same_bytes(got.ledger[key], val), (name, got.rank, key)
        for res, val in want["time"].items():
            assert got.time_s[res] == pytest.approx(val, rel=1e-13, abs=1e-15), (name, got.rank, res)
            assert got.update_s[res] == pytest.approx(want["update"][res], rel=1e-13, abs=1e-15), (name, res)
    assert ev.step.step_time_s == pytest.approx(g["step"], rel=1e-13)
    for key, val in g["components"].items():
        assert ev.step.components[key] == pytest.approx(val, rel=1e-13, abs=1e-15), (name, key)
    # capacity is the nvidia-smi total minus the layout's reserve (0 here); the ledger's peak decides the fit
    assert ev.capacity_bytes == hbm_mib * MIB
    peak = max(r.peak_bytes for r in ev.ranks)
    assert ev.fits == (peak <= hbm_mib * MIB)


def test_reference_fit_per_preset_follows_the_modeled_peak(reference, model):
    """The modeled peak (rank 0, 112.59 GiB; the K3 memory lab measured 146.18 GiB and the GAP is reported) fits
    every part but the H100's 79.65 GiB; the measured peak would not fit the H200's 140.40 GiB either."""
    evs = {name: k3opt.evaluate(reference, model=model, cluster=name) for name in SPEC_SHEET}
    assert {name: ev.fits for name, ev in evs.items()} == {
        "gb200-nvl72": True, "gb300-nvl72": True, "b200": True, "h100-sxm": False, "h200-sxm": True}
    assert round(evs["h200-sxm"].peak_bytes / 2**30, 2) == 112.59 < 140.40 < 146.18


def test_gb300_nic_halves_the_reference_nic_time(reference, model):
    """ConnectX-8 (100 GB/s) against ConnectX-7 (50 GB/s): the same bytes, half the seconds, on every rank."""
    a = k3opt.evaluate(reference, model=model, cluster="gb200-nvl72")
    b = k3opt.evaluate(reference, model=model, cluster="gb300-nvl72")
    for ra, rb in zip(a.ranks, b.ranks, strict=True):
        assert rb.time_s["nic"] == pytest.approx(ra.time_s["nic"] / 2, rel=1e-12)
        assert rb.time_s["tensor"] == ra.time_s["tensor"] and rb.time_s["nvlink"] == ra.time_s["nvlink"]


def test_model_preset_totals_match_model_k3_section_4():
    m = k3opt.load_model("kimi-k3")
    ev = k3opt.evaluate(k3opt.load_layout("k3-gb200-512-reference"), model=m)
    p = ev.params
    assert (p.total, p.muon, p.adamw, p.routed, p.active_matrix, p.active_routed, p.active_conventional) == (
        2_779_931_738_208, 2_777_072_664_576, 2_859_073_632, 2_722_740_830_208, 104_174_092_288, 48_620_371_968,
        104_189_515_872)
    assert (m.hidden_size, m.num_layers, m.vocab_size, len(m.full_attention_layers)) == (7168, 93, 163840, 24)


def test_job_preset_is_the_seed_reference_batch():
    """k3-512-4k: 512 GPUs, 4K context, one row, 16,777,216 tokens per update (K3 memory lab)."""
    j = k3opt.load_job("k3-512-4k")
    assert (j.gpus, j.context, j.rows, j.tokens_per_update) == (512, 4096, 1, 16_777_216)
    assert (j.model, j.cluster, j.domain_gpus_used, j.reserve_gib) == ("kimi-k3", "gb200-nvl72", 64, 4.0)


def test_layout_preset_is_the_seed_reference():
    lay = k3opt.load_layout("k3-gb200-512-reference")
    assert (lay.gpus, lay.pp, lay.vp, lay.cp, lay.ep, lay.expert_fsdp, lay.dense_fsdp) == (512, 8, 1, 1, 64, 1, 64)
    assert (lay.microbatches, lay.rows, lay.context, lay.recompute) == (64, 1, 4096, "full")
    assert lay.split == [12] * 7 + [9] and lay.measured.peak_gib == 146.18
