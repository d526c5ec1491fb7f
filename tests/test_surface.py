"""The frozen public surface: `k3opt.__all__`, the CLI commands and each command's options, as explicit sets; and
evaluate()'s bookkeeping around the cost model (capacity line, fit on the line, formulas, validation rows).

A name added or removed is a deliberate change: extend the sets below in the same commit (this file is their one
home), and say it in the README.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conftest import MEASURED

import k3opt
from k3opt.cli import main
from k3opt.cost.ledger import TERM_INFO
from k3opt.inputs.specs import Dtype

GIB = 2**30
HBM = 189_471 * 2**20  # gb200-nvl72, nvidia-smi MiB

PUBLIC_API = frozenset({
    "ClusterSpec", "Evaluation", "InfeasibleJobError", "Job", "K3optError", "Layout", "LayoutError", "ModelSpec",
    "PresetNotFoundError", "RankEvaluation", "SearchTimeoutError", "SpecError", "StepTime", "Toggles", "evaluate",
    "load_cluster",
    "load_job", "load_layout", "load_model", "make_layout", "Plan", "PlanItem", "plan", "RuntimeSpec", "load_runtime",
    "to_launch", "pareto",
})

CLI_COMMANDS = frozenset({"explain", "plan", "pareto", "export", "validate", "validate-throughput", "sweep",
                          "sweep-plot", "serve"})

# Options of each command (-h / --help come from the group and are checked separately).
CLI_OPTIONS = {
    "explain": frozenset({"--model", "--cluster", "--reserve-gib", "--json", "--runtime", "--plot", "--timeline"}),
    "plan": frozenset({"--gpus", "--top", "--time-limit", "--workers", "--show-ledger", "--save", "--json", "--gap",
                       "--export", "--target"}),
    "pareto": frozenset({"--gpus", "--top", "--time-limit", "--workers", "--csv", "--step-gib", "--json", "--gap",
                         "--plot"}),
    "export": frozenset({"--format", "--model", "--out"}),
    "validate": frozenset({"--folder", "--json"}),
    "validate-throughput": frozenset({"--json"}),
    "sweep": frozenset({"--out", "--workers", "--threads", "--ray", "--top", "--time-limit", "--gap", "--train-tokens",
                        "--usd-per-gpu-hour", "--plot"}),
    "sweep-plot": frozenset(),
    "serve": frozenset({"--port", "--host", "--sweep"}),
}
CLI_ARGUMENTS = {"explain": ("layout",), "plan": ("job",), "pareto": ("job",), "export": ("layout",), "validate": (),
                 "validate-throughput": (), "sweep": ("grid",), "sweep-plot": ("results", "png"),
                 "serve": ()}

STEP_COMPONENTS = frozenset({"compute", "hbm", "nvlink", "nic", "host_link", "microbatch_work", "bubble",
                             "exposed_update"})

LEDGER_KEYS = frozenset({"master", "grads", "optimizer", "bf16_view", "moonep_slots", "grad_accum", "moonep_buffers",
                         "activations", "attnres_bank", "recompute_working_set", "grad_transient", "pp_buffers",
                         "ep_buffers", "routing_map", "logits", "optimizer_transient", "quantized_weights",
                         "paged_stash"})


def test_all_is_the_frozen_set():
    assert len(k3opt.__all__) == len(set(k3opt.__all__)), "duplicate in __all__"
    assert set(k3opt.__all__) == PUBLIC_API
    for name in PUBLIC_API:
        assert getattr(k3opt, name) is not None


def test_cli_commands_are_the_frozen_set():
    assert set(main.commands) == CLI_COMMANDS


def test_cli_options_of_each_command_are_the_frozen_set():
    for name, command in main.commands.items():
        opts = {o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
        assert opts == CLI_OPTIONS[name], name
        args = tuple(p.name for p in command.params if isinstance(p, click.Argument))
        assert args == CLI_ARGUMENTS[name], name
        for flag in ("-h", "--help"):
            result = CliRunner().invoke(main, [name, flag])
            assert result.exit_code == 0 and "Usage:" in result.output


def test_step_components_and_ledger_keys_are_the_frozen_sets(reference_eval):
    assert set(reference_eval.step.components) == STEP_COMPONENTS
    assert "components" in {f.name for f in dataclasses.fields(k3opt.StepTime)}
    for r in reference_eval.ranks:
        assert set(r.ledger) == LEDGER_KEYS
        assert [t.key for t in r.terms] == list(r.ledger)
    data = reference_eval.to_dict()
    assert set(data["step"]["components"]) == STEP_COMPONENTS
    assert set(data["ranks"][0]["ledger_bytes"]) == LEDGER_KEYS


TO_DICT_KEYS = frozenset({"layout", "model", "cluster", "params", "capacity_bytes", "peak_bytes", "worst_rank", "fits",
                          "ranks", "terms", "step", "validation", "runtime", "peak_allocated_bytes",
                          "peak_reserved_bytes", "peak_device_bytes", "placement"})
RANK_KEYS = frozenset({"rank", "chunks", "ledger_bytes", "persistent_bytes", "activation_phase_bytes",
                       "optimizer_phase_bytes", "peak_bytes", "headroom_bytes", "fits", "in_flight", "host_bytes",
                       "host_fits", "time_per_microbatch_s", "update_s", "binding", "counts", "allocated_bytes",
                       "reserved_bytes", "device_bytes", "memory_items"})


@pytest.fixture()
def live(reference) -> k3opt.Layout:
    """The reference without its runtime: device = reserved = allocated = the ledger peak (live tensors)."""
    return reference.model_copy(update={"runtime": None})


def test_json_result_carries_the_same_numbers_under_frozen_keys(live):
    ev = k3opt.evaluate(live)
    d = ev.to_dict()
    assert set(d) == TO_DICT_KEYS
    assert (d["model"], d["cluster"]) == ("kimi-k3", "gb200-nvl72")
    # The reference layout names no domain_gpus_used: 512 GPUs on whole 72-GPU racks hold ceil(512 / 72) = 8 racks,
    # 576 GPUs, 64 of them idle.
    pl = d["placement"]
    assert (pl["gpus_used"], pl["gpus_per_domain"], pl["domains_held"], pl["gpus_held"]) == (512, 72, 8, 576)
    assert pl["tokens_per_s_per_gpu_held"] == pytest.approx(pl["tokens_per_s_per_gpu_used"] * 512 / 576)
    assert d["layout"]["pp"] == 8 and d["layout"]["split"] == [12] * 7 + [9]
    assert d["params"] == {"total": 2_779_931_738_208, "muon": 2_777_072_664_576, "adamw": 2_859_073_632,
                           "routed": 2_722_740_830_208, "active_matrix": 104_174_092_288,
                           "active_routed": 48_620_371_968, "active_conventional": 104_189_515_872}
    assert (d["capacity_bytes"], d["peak_bytes"], d["worst_rank"], d["fits"]) == (
        189_471 * 2**20, 120_887_629_304, 0, True)
    for r, row in zip(ev.ranks, d["ranks"], strict=True):
        assert set(row) == RANK_KEYS
        assert row == {
            "rank": r.rank, "chunks": [list(c) for c in r.chunks], "ledger_bytes": r.ledger,
            "persistent_bytes": r.persistent_bytes, "activation_phase_bytes": r.activation_phase_bytes,
            "optimizer_phase_bytes": r.optimizer_phase_bytes, "peak_bytes": r.peak_bytes,
            "headroom_bytes": r.capacity_bytes - r.peak_bytes, "fits": r.fits, "in_flight": r.in_flight,
            "host_bytes": r.host_bytes, "host_fits": r.host_fits, "time_per_microbatch_s": r.time_s,
            "update_s": r.update_s, "binding": r.binding, "counts": r.counts, "allocated_bytes": r.peak_bytes,
            "reserved_bytes": r.peak_bytes, "device_bytes": r.peak_bytes, "memory_items": {}}
    assert [row["chunks"] for row in d["ranks"]] == [[[12 * r, 12 * r + 12]] for r in range(7)] + [[[84, 93]]]
    assert set(d["terms"]) == LEDGER_KEYS
    for key, info in d["terms"].items():
        assert set(info) == {"phase", "kind", "formula"} and info["formula"]
        assert info["phase"] == ("optimizer" if key == "optimizer_transient" else "persistent" if key in {
            "master", "grads", "optimizer", "bf16_view", "moonep_slots", "grad_accum", "moonep_buffers",
            "quantized_weights", "paged_stash"}
            else "activation")
        assert info["kind"] in {"derived", "assumption"}
    assert d["step"] == {f.name: getattr(ev.step, f.name) for f in dataclasses.fields(k3opt.StepTime)}
    # Seed 000 does not say which kind its 146.18 GiB is: one row against reserved, one against device.
    for v, kind in zip(d["validation"], ("reserved", "device"), strict=True):
        assert v == {"figure": "peak HBM, worst rank (0)", "kind": kind, "modeled": 120_887_629_304 / 2**30,
                     "measured": 146.18, "unit": "GiB", "gap": 146.18 - 120_887_629_304 / 2**30,
                     "gap_pct": 100 * (146.18 - 120_887_629_304 / 2**30) / 146.18}


def test_json_layout_is_plain_json_without_unset_fields(reference_eval):
    lay = reference_eval.to_dict()["layout"]
    assert type(lay["recompute"]) is str and type(lay["fsdp_lifecycle"]) is str
    assert "document_length" not in lay and "domain_gpus_used" not in lay  # None fields are left out
    assert json.loads(json.dumps(lay)) == lay


def test_evaluate_reads_the_layouts_own_model_and_cluster():
    """With no model or cluster given, evaluate() uses the layout's `model` / `cluster` fields."""
    data = Path(__file__).parent / "data"
    lay = k3opt.make_layout(gpus=8, pp=2, ep=2, microbatches=4, context=2048, split=[3, 3],
                            model=str(data / "tiny-moe.toml"), cluster=str(data / "slow-cluster.toml"))
    ev = k3opt.evaluate(lay)
    assert (ev.model.name, ev.cluster.name) == (k3opt.load_model(data / "tiny-moe.toml").name,
                                                k3opt.load_cluster(data / "slow-cluster.toml").name)
    with pytest.raises(k3opt.LayoutError, match="covers 6 layers"):
        k3opt.evaluate(lay, model="kimi-k3")


# --- evaluate()'s bookkeeping: capacity and reserve, fits on the line, formulas, validation rows -------------

def test_reserve_lowers_the_capacity_line_by_exactly_its_bytes(live):
    reference = live
    ev = k3opt.evaluate(reference, reserve_gib=1.5)
    assert ev.capacity_bytes == HBM - 1_610_612_736 == HBM - 3 * GIB // 2
    assert all(r.capacity_bytes == ev.capacity_bytes for r in ev.ranks)
    assert ev.headroom_bytes == ev.capacity_bytes - 120_887_629_304
    assert k3opt.evaluate(reference).capacity_bytes == HBM  # the layout's own reserve_gib = 0


def test_a_peak_exactly_on_the_line_fits(live):
    reference = live
    peak = 120_887_629_304
    ev = k3opt.evaluate(reference, reserve_gib=(HBM - peak) / GIB)
    assert ev.capacity_bytes == peak == ev.peak_bytes
    assert ev.ranks[0].fits and ev.fits and ev.ranks[0].headroom_bytes == 0
    one_more = k3opt.evaluate(reference, reserve_gib=(HBM - peak + 1) / GIB)
    assert not one_more.ranks[0].fits and not one_more.fits


def test_host_bytes_exactly_on_the_host_line_fit(reference):
    """Pipeline ZeRO-2 puts rank 0's FP32 gradient shard, 4 (D + E)/64 = 20,917,092,254 B, in host memory."""
    lay = reference.model_copy(update={"toggles": k3opt.Toggles(pipeline_zero2_host_grads=True), "measured": None})
    host = 20_917_092_254
    base = k3opt.load_cluster("gb200-nvl72")
    on_line = base.model_copy(update={"host_memory_gb": host / 1e9})
    assert on_line.host_memory_bytes == host
    r0 = k3opt.evaluate(lay, cluster=on_line).ranks[0]
    assert r0.host_bytes == host == r0.host_capacity_bytes and r0.host_fits
    below = base.model_copy(update={"host_memory_gb": (host - 1000) / 1e9})
    assert not k3opt.evaluate(lay, cluster=below).ranks[0].host_fits
    assert k3opt.evaluate(lay).ranks[0].host_capacity_bytes == 240 * 10**9


def test_terms_carry_the_ledger_bytes_and_their_formulas(reference_eval):
    for r in reference_eval.ranks:
        for t in r.terms:
            assert t.bytes == r.ledger[t.key]
            kind, formula = TERM_INFO[t.key]
            assert t.kind == kind
            if t.key == "logits":
                assert t.formula == "4096 tokens x vocab 163840 x (2 B BF16 logits + 4 B FP32 softmax)"
            else:
                assert t.formula == formula


def test_the_layouts_nvlink_domain_is_checked_against_the_cluster(reference):
    lay = reference.model_copy(update={"domain_gpus_used": 80})
    with pytest.raises(k3opt.LayoutError, match="exceeds the 72-GPU NVLink domain"):
        k3opt.evaluate(lay)


def test_every_measured_figure_gets_a_validation_row(reference_eval, reference):
    measured = reference.measured.model_copy(update={"step_time_s": 60.0, "tokens_per_s_per_gpu": 500.0})
    ev = k3opt.evaluate(reference.model_copy(update={"measured": measured}))
    reserved, device, step, tps, tps_achievable = ev.validation
    assert tps_achievable.figure == "tokens/s per GPU at achievable rates"
    assert tps_achievable.modeled == ev.step.achievable_tokens_per_s_per_gpu
    for peak in (reserved, device):
        assert (peak.figure, peak.measured, peak.unit) == ("peak HBM, worst rank (0)", 146.18, "GiB")
    assert (step.figure, step.modeled, step.measured, step.unit) == ("step time", ev.step.step_time_s, 60.0, "s")
    assert (tps.figure, tps.modeled, tps.measured, tps.unit) == (
        "tokens/s per GPU", ev.step.tokens_per_s_per_gpu, 500.0, "tokens/s")
    assert step.gap == 60.0 - ev.step.step_time_s and math.isclose(step.gap_pct, 100 * step.gap / 60.0)
    assert ev.step.step_time_s == reference_eval.step.step_time_s  # a measurement never moves the model


def test_mfu_convention_and_unpriced_items_are_stated(reference_eval):
    s = reference_eval.step
    assert s.mfu_convention == (
        "6 x learned active matrices per token + MLA score/value contractions with the causal half (Megatron "
        "convention), document length 4096; no recompute, no KDA scan; denominator 2500 TFLOP/s dense BF16 per GPU")
    assert len(s.unpriced) == 5 and s.unpriced[0].startswith("CP: the KDA state pre-pass")
    assert any("routing imbalance" in u for u in s.unpriced)
    assert any("host-side kernel launch" in u for u in s.unpriced)


def test_mfu_convention_and_unpriced_items_name_only_the_models_own_parts():
    """Qwen3-30B-A3B (MB-20) has GQA attention, no KDA layer and no vision tower: its convention names GQA and no
    KDA scan, and its unpriced list drops the KDA state pass and the vision tower's activations."""
    lay = k3opt.load_layout(str(MEASURED / "mb-20-qwen3-30b-a3b-gb200.toml"))
    s = k3opt.evaluate(lay).step
    assert s.mfu_convention == (
        "6 x learned active matrices per token + GQA score/value contractions with the causal half (Megatron "
        "convention), document length 4096; no recompute; denominator 2500 TFLOP/s dense BF16 per GPU")
    assert len(s.unpriced) == 3 and not any("KDA" in u or "vision" in u for u in s.unpriced)
    assert any("host-side kernel launch" in u for u in s.unpriced)


def test_the_optimizer_term_names_only_the_optimizers_the_model_uses(reference):
    """K3 trains its matrices with Muon and the rest with AdamW; DeepSeek-V3's recipe trains everything with AdamW,
    so its ledger's optimizer formula names AdamW's two moments (2 x 2 B at BF16 state) and no Muon momentum."""
    def formula(lay: k3opt.Layout) -> str:
        return next(t.formula for t in k3opt.evaluate(lay).ranks[0].terms if t.key == "optimizer")

    k3 = formula(reference.model_copy(update={"measured": None}))
    assert "Muon momentum" in k3 and "AdamW moments" in k3
    dsv3 = k3opt.load_layout("layouts/measured/mb-14-deepseek-v3-b200.toml")
    assert formula(dsv3) == "AdamW moments 4 B per owned parameter"
    fp32 = dsv3.model_copy(update={"optimizer_state_dtype": Dtype.FP32, "dense_sharding": "optim_grads_params",
                                   "expert_sharding": "optim_grads_params", "grad_dtype": Dtype.FP32,
                                   "measured": None})
    assert formula(fp32) == "AdamW moments 8 B per owned parameter"
