"""Megatron's sync-free MoE (moe_expert_rank_capacity_factor) and its paged stash (moe_paged_stash): the ledger
terms they change, the node model's agreement with evaluate(), the exports and the bad input; and Megatron's EP
overlap schedule as a job plans it. Expected bytes are derived from Kimi K3's and DeepSeek-V3's shapes in the
docstrings (K3's routed saved set per token is the one tests/cost/test_routed_saved.py derives by hand)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import least_value

import k3opt
from k3opt.cli import main
from k3opt.cost.ledger import PERSISTENT
from k3opt.inputs.errors import LayoutError, SpecError
from k3opt.inputs.labels import toggles_text
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import TOGGLE_NAMES, FsdpLifecycle, Recompute
from k3opt.launch import apply_target_limits, launch_refusals, to_launch
from k3opt.report.text import explain_text
from k3opt.search import enumerate_frames
from k3opt.search.frames import ActMode, frame_shape, layout_of
from k3opt.search.node_model import FrameModel

DATA = Path(__file__).parents[1] / "data"
KIB = 1024
SPLIT = [2, 1, 1, 2]

# Kimi K3, BF16, fused SiTU and the MoE backward rewrite, no recompute: the routed experts save their dispatched
# inputs 16 x 3584 x 2 = 114,688 B, the fused SiTU's BF16 input 2 x 16 x 3072 x 2 = 196,608 B and the activation
# outputs 16 x 3072 x 2 = 98,304 B a token: 409,600 B; at 4,096 tokens 1,677,721,600 B per MoE layer and microbatch.
ROUTED_LAYER = 409_600 * 4096
MOE_LAYERS = 92  # 93 layers, the first dense
# Dispatch receive + combine buffers of one MoE layer: 2 x T x k x latent x 2 B = 2 x 4096 x 16 x 3584 x 2.
EP_BUFFERS = 2 * 4096 * 16 * 3584 * 2


def _k3(**over) -> k3opt.Layout:  # noqa: ANN003
    """K3 on one pipeline stage of 64 GPUs (one microbatch in flight), every layer on rank 0."""
    fields = dict(gpus=64, pp=1, vp=1, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=4, context=4096,
                  split=[93], recompute="none", fsdp_lifecycle="accumulate", dispatcher="hybridep",
                  toggles={"fused_situ": True, "moe_backward_rewrite": True, "ep_dedup": True},
                  model="kimi-k3", cluster="gb200-nvl72")
    return make_layout(**{**fields, **over})


@pytest.fixture(scope="module")
def dropless():
    return k3opt.evaluate(_k3()).ranks[0]


def test_capacity_factor_scales_the_routed_saved_set_and_the_dispatch_buffers(dropless):
    """At 1.5 the fused grouped MLP's tensors have 1.5 x the balanced rows: 0.5 x 1,677,721,600 x 92 more saved
    bytes (77,175,193,600), and the dispatch buffers 1.5 x 939,524,096."""
    cap = k3opt.evaluate(_k3(moe_expert_rank_capacity_factor=1.5)).ranks[0]
    assert cap.ledger["activations"] - dropless.ledger["activations"] == pytest.approx(0.5 * ROUTED_LAYER * MOE_LAYERS,
                                                                                       rel=1e-12)
    assert dropless.ledger["ep_buffers"] == EP_BUFFERS
    assert cap.ledger["ep_buffers"] == 1.5 * EP_BUFFERS
    assert cap.ledger["paged_stash"] == 0 and dropless.ledger["paged_stash"] == 0


def test_capacity_factor_reaches_only_the_routed_tensors_the_recompute_mode_keeps():
    """k3opt's selective recompute replays the experts' activation outputs (98,304 B a token): the routed tensors
    kept are the dispatched inputs and the fused SiTU's input, 114,688 + 196,608 = 311,296 B a token, and the
    capacity factor 1.5 adds 0.5 x 311,296 x 4,096 x 92 bytes. Full recompute keeps none of them. Megatron's module
    recompute of the MLA up-projections and the dense MLP replays no routed tensor: all 409,600 B a token stay."""
    for rc, mods, per_token in (("selective", [], 311_296), ("full", [], 0),
                                ("selective", ["mla_up_proj", "mlp"], 409_600)):
        base = k3opt.evaluate(_k3(recompute=rc, recompute_modules=mods)).ranks[0]
        cap = k3opt.evaluate(_k3(recompute=rc, recompute_modules=mods, moe_expert_rank_capacity_factor=1.5)).ranks[0]
        assert cap.ledger["activations"] - base.ledger["activations"] == pytest.approx(
            0.5 * per_token * 4096 * MOE_LAYERS, rel=1e-12, abs=1e-3)


def test_paged_stash_holds_the_routed_set_for_the_whole_step(dropless):
    """CUDA factor 1.2, host factor 1.0: the stash is 1.2 x 92 x 1,677,721,600 = 185,220,464,640 B, persistent; the
    saved set drops the routed 92 x 1,677,721,600; the host holds 1.0 x the same;
    and the stash stays held through the optimizer step."""
    ev = k3opt.evaluate(_k3(moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True,
                            moe_paged_stash_buffer_size_factor_cuda=1.2, moe_paged_stash_buffer_size_factor_cpu=1.0))
    r = ev.ranks[0]
    routed = ROUTED_LAYER * MOE_LAYERS
    assert r.ledger["paged_stash"] == pytest.approx(1.2 * routed, rel=1e-12)
    assert dropless.ledger["activations"] - r.ledger["activations"] == pytest.approx(routed, rel=1e-12)
    assert r.host_bytes - dropless.host_bytes == pytest.approx(routed, rel=1e-12)
    # The peak is persistent + max(activation phase, optimizer phase) (seed 001's ledger). Dropless, the activation
    # phase sets it; with the stash the persistent part grows by 1.2 x routed and the activation phase loses the
    # routed set (and gains the capacity-sized dispatch buffers), so the optimizer phase may set it instead.
    persistent = sum(dropless.ledger[k] for k in PERSISTENT)
    act_phase, opt_phase = dropless.peak_bytes - persistent, dropless.ledger["optimizer_transient"]
    assert act_phase > opt_phase
    want = persistent + 1.2 * routed + max(act_phase - routed + 0.5 * EP_BUFFERS, opt_phase)
    assert r.peak_bytes == pytest.approx(want, rel=1e-12)
    # Here the optimizer phase sets the peak with the stash: the stash held through the optimizer step is what
    # raises it above the activation phase's (a stash in the activation phase alone would leave the peak at
    # persistent + activation phase + 0.2 x routed).
    assert opt_phase > act_phase - routed + 0.5 * EP_BUFFERS
    assert r.peak_bytes - persistent - 1.2 * routed == pytest.approx(opt_phase, rel=1e-12)


def test_paged_stash_is_sized_at_the_rank_s_own_in_flight_peak():
    """PP2 1F1B: rank 0 holds layers 0-45 (45 MoE layers) and two microbatches in flight at its peak, so its stash
    is 1.1 (Megatron's default factor) x 45 x 2 x 1,677,721,600."""
    lay = _k3(gpus=128, pp=2, split=[46, 47], moe_expert_rank_capacity_factor=1.0, moe_paged_stash=True)
    r0 = k3opt.evaluate(lay).ranks[0]
    assert r0.ledger["paged_stash"] == pytest.approx(1.1 * 45 * 2 * ROUTED_LAYER, rel=1e-12)


def test_the_stash_takes_its_own_peak_composition_not_the_saved_set_s():
    """DeepSeek-V3 PP2 VP2, M 4: Megatron's interleaved schedule runs 4 warmup forwards on rank 0 ((p - r - 1) x 2 +
    (v - 1) x p), then one forward, one backward: chunk 0 F m0 m1, chunk 2 F m0 m1, then F c0m2 (3, 2 in flight on
    chunks 0 and 2), B c2m0, F c0m3 (4, 1), ... Chunk 0 holds layers 0-3 (three dense, one MoE), chunk 2 layers 31-32
    (two MoE). A MoE layer's routed set in BF16 with the backward rewrite: dispatched inputs 8 x 7168 x 2 + SwiGLU
    input 2 x 8 x 2048 x 2 + activation outputs 8 x 2048 x 2 = 212,992 B a token, R = 212,992 x 4,096 a microbatch.
    The stash's peak is max(3 R + 2 x 2 R, 4 R + 2 R) = 7 R, x 1.1; the saved set, heavier on the dense chunk 0,
    peaks at (4, 1), where the routed bytes are 6 R."""
    lay = make_layout(gpus=16, pp=2, vp=2, ep=8, expert_fsdp=1, dense_fsdp=8, microbatches=4, context=4096,
                      split=[4, 27, 2, 28], recompute="none", fsdp_lifecycle="accumulate", dispatcher="hybridep",
                      toggles={"moe_backward_rewrite": True, "ep_dedup": True}, model="deepseek-v3",
                      cluster="gb200-nvl72", moe_expert_rank_capacity_factor=1.0, moe_paged_stash=True)
    r0 = k3opt.evaluate(lay).ranks[0]
    assert r0.ledger["paged_stash"] == pytest.approx(1.1 * 7 * 212_992 * 4096, abs=1)  # whole bytes


def test_the_node_model_prices_the_stash_as_evaluate_does(tiny, slow):  # noqa: ANN001 - fixtures
    """A job pinned to one PP2 VP2 layout of the tiny model with the paged stash (CUDA 1.2, host 1.0): its node
    model's stash part is at least evaluate()'s bytes and within one KiB per layer and in-flight copy above them,
    and its host spill buffer (1.0 / 1.2 of it) likewise."""
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 0.0,
        "moe_expert_rank_capacity_factor": 1.5, "moe_paged_stash": True,
        "moe_paged_stash_buffer_size_factor_cuda": 1.2, "moe_paged_stash_buffer_size_factor_cpu": 1.0,
        "search": {"pp": [2], "vp": [2], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "dense_sharding": ["optim_grads_params"], "recompute": ["none"], "fsdp_lifecycle": ["accumulate"],
                   "forbid_toggles": [t for t in TOGGLE_NAMES if t != "ep_dedup"], "split": SPLIT}})
    (f,) = enumerate_frames(job, tiny, 8)
    fm = FrameModel(job, f, tiny, slow)
    (md,) = fm.modes
    lay = layout_of(job, f, frame_shape(job, f, md, FsdpLifecycle.ACCUMULATE), SPLIT)
    assert lay.moe_paged_stash and lay.dispatcher == "hybridep" and lay.toggles.ep_dedup
    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
    for r, rank in enumerate(ev.ranks):
        led = fm.ranks[r]["ledger"]
        want = rank.ledger["paged_stash"]
        slack = KIB * (sum(e - s for s, e in rank.chunks) + 2) * (1 + int(rank.in_flight + 1))
        assert want > 0
        assert want <= least_value(fm, led.part("paged_stash").expr) * KIB <= want + slack
        # No offload and no ZeRO-2 host gradients: the rank's host bytes are the spill buffer, 1.0 / 1.2 of the stash.
        assert rank.host_bytes == pytest.approx(want / 1.2, rel=1e-9)
        assert rank.host_bytes <= least_value(fm, led.host_stash) * KIB <= rank.host_bytes + slack


def test_exports_write_the_ep_overlap_schedule():
    """Megatron-LM --overlap-moe-expert-parallel-comm; Bridge comm_overlap.overlap_moe_expert_parallel_comm (its
    setup copies the comm_overlap config over the model's field, comm_overlap.py L438, L593-597) with the
    shared-expert overlap off, which Megatron refuses beside it: all in the frameworks' lists at their pinned
    commits; nothing without the schedule."""
    lay = k3opt.load_layout("deepseek-v3-gb200-mxfp8-paged-stash")
    assert lay.ep_overlap
    assert "--overlap-moe-expert-parallel-comm" in to_launch(lay, "megatron-lm").body
    bridge = to_launch(lay, "megatron-bridge").body
    assert "comm_overlap.overlap_moe_expert_parallel_comm=true" in bridge
    assert "model.moe_shared_expert_overlap=false" in bridge
    assert "model.overlap_moe_expert_parallel_comm" not in bridge
    assert "--overlap-moe-expert-parallel-comm" in (DATA / "megatron_lm_flags.txt").read_text().split()
    keys = set((DATA / "megatron_bridge_keys.txt").read_text().split())
    assert {"comm_overlap.overlap_moe_expert_parallel_comm", "model.moe_shared_expert_overlap"} <= keys
    assert "overlap-moe" not in to_launch(_k3(), "megatron-lm").body
    # the recipe's delayed weight gradients (deepseek/common.py L76): Megatron-LM --delay-wgrad-compute, Bridge
    # comm_overlap.delay_wgrad_compute, both in the frameworks' lists
    assert lay.delay_wgrad_compute
    assert "--delay-wgrad-compute" in to_launch(lay, "megatron-lm").body
    assert "comm_overlap.delay_wgrad_compute=true" in bridge
    assert "--delay-wgrad-compute" in (DATA / "megatron_lm_flags.txt").read_text().split()
    assert "comm_overlap.delay_wgrad_compute" in keys
    assert "delay-wgrad" not in to_launch(lay.model_copy(update={"delay_wgrad_compute": False}), "megatron-lm").body


def test_exports_write_the_sync_free_settings_and_torchtitan_refuses_them():
    lay = _k3(moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True, moe_paged_stash_buffer_size_factor_cuda=1.2)
    flags = to_launch(lay, "megatron-lm").body
    for flag in ("--moe-expert-rank-capacity-factor 1.5", "--use-transformer-engine-op-fuser", "--moe-paged-stash",
                 "--moe-paged-stash-buffer-size-factor-cuda 1.2", "--moe-flex-dispatcher-backend hybridep"):
        assert flag in flags
    known = set((DATA / "megatron_lm_flags.txt").read_text().split())
    assert {"--moe-expert-rank-capacity-factor", "--moe-paged-stash", "--use-transformer-engine-op-fuser"} <= known
    bridge = to_launch(lay, "megatron-bridge").body
    keys = set((DATA / "megatron_bridge_keys.txt").read_text().split())
    for key, value in (("model.moe_expert_rank_capacity_factor", "1.5"), ("model.moe_paged_stash", "true"),
                       ("model.moe_paged_stash_buffer_size_factor_cuda", "1.2"),
                       ("model.moe_paged_stash_buffer_size_factor_cpu", "0.0")):
        assert key in keys and f"{key}={value}" in bridge
    assert any("moe_paged_stash" in why for why in launch_refusals(lay, "torchtitan"))
    assert not any("moe_paged_stash" in why for why in launch_refusals(_k3(), "torchtitan"))


@pytest.mark.parametrize(("over", "needle"), [
    ({"moe_paged_stash": True}, "needs moe_expert_rank_capacity_factor"),
    ({"moe_expert_rank_capacity_factor": 0.8}, "below 1"),
    ({"moe_expert_rank_capacity_factor": 1.5, "dispatcher": "deepep"}, "needs dispatcher"),
    ({"moe_expert_rank_capacity_factor": 1.5, "recompute": "selective", "offload_modules": ["moe_act"]},
     re.escape("offload_modules ['moe_act']")),
    ({"moe_expert_rank_capacity_factor": 1.5, "moe_paged_stash": True,
      "toggles": {"activation_offload": True, "ep_dedup": True}}, "activation_offload toggle"),
])
def test_bad_sync_free_layouts_get_one_line(over, needle):  # noqa: ANN001
    with pytest.raises(LayoutError, match=needle) as err:
        _k3(**over)
    assert "\n" not in str(err.value)


def test_a_full_iteration_graph_of_an_moe_model_needs_the_paged_stash():
    """Dropless dispatch has dynamic shapes; the paged stash with its capacity factor makes them static
    (Megatron-LM docs/user-guide/features/cuda_graph.md L161, L170-174)."""
    for over in ({}, {"moe_expert_rank_capacity_factor": 1.5}):
        with pytest.raises(LayoutError, match="moe_paged_stash"):
            k3opt.evaluate(_k3(cuda_graph_impl="full_iteration", **over))
    k3opt.evaluate(_k3(cuda_graph_impl="full_iteration", moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True))


def test_sync_free_on_a_dense_model_is_refused():
    lay = make_layout(gpus=64, pp=1, split=[80], dense_fsdp=64, model="llama3-70b", microbatches=4,
                      dispatcher="hybridep", moe_expert_rank_capacity_factor=1.5)
    with pytest.raises(LayoutError, match="no MoE layers"):
        k3opt.evaluate(lay)
    job = k3opt.Job.model_validate({"model": "llama3-70b", "gpus": 64, "tokens_per_update": 1 << 20,
                                    "moe_expert_rank_capacity_factor": 1.5})
    with pytest.raises(SpecError, match="no MoE layers"):
        k3opt.plan(job, time_limit=5)


@pytest.mark.parametrize(("fields", "needle"), [
    ("moe_paged_stash = true", "needs moe_expert_rank_capacity_factor"),
    ("moe_expert_rank_capacity_factor = 0.5", "below 1"),
    ("moe_expert_rank_capacity_factor = \"big\"", "moe_expert_rank_capacity_factor"),
    ("moe_expert_rank_capacity_factor = 1.5\n[search]\noffload_modules = [[\"moe_act\"]]", "offload_modules"),
    ("moe_expert_rank_capacity_factor = 1.5\nmoe_paged_stash = true\n[search]\n"
     "require_toggles = [\"activation_offload\"]", "activation_offload toggle"),
    ("moe_expert_rank_capacity_factor = 1.5\ntarget = \"torchtitan\"", "torchtitan"),
    ("ep_overlap = \"yes\"", "ep_overlap"),
    ("delay_wgrad_compute = true", "delay_wgrad_compute without ep_overlap"),
    ("ep_overlap = true\ndelay_wgrad_compute = 1", "delay_wgrad_compute"),
])
def test_bad_sync_free_and_ep_overlap_jobs_exit_2_in_one_line(tmp_path, fields, needle):  # noqa: ANN001
    job = tmp_path / "job.toml"
    job.write_text(f"gpus = 512\ntokens_per_update = 16777216\n{fields}\n")
    res = CliRunner().invoke(main, ["plan", str(job), "--time-limit", "5"])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output


def test_cli_exit_2_on_a_paged_stash_without_its_capacity(tmp_path):  # noqa: ANN001
    job = tmp_path / "job.toml"
    job.write_text('gpus = 512\ntokens_per_update = 16777216\nmoe_paged_stash = true\n')
    res = CliRunner().invoke(main, ["plan", str(job), "--time-limit", "5"])
    assert res.exit_code == 2
    assert "moe_expert_rank_capacity_factor" in res.output


def test_a_sync_free_job_plans_layouts_that_carry_it(tiny, slow):  # noqa: ANN001 - fixtures
    """The tiny model on 8 GPUs with the sync-free MoE and the paged stash: every ranked layout runs HybridEP with
    EP deduplication, carries the job's factors, never the activation_offload toggle, and holds a stash on every
    rank with a MoE layer in the rank's chunks."""
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 0.0,
        "moe_expert_rank_capacity_factor": 1.25, "moe_paged_stash": True,
        "search": {"pp": [2], "vp": [1], "ep": [2]}})
    res = k3opt.plan(job, model=tiny, cluster=slow, top=2, time_limit=30)
    assert res.layouts
    for it in res.layouts:
        lay = it.layout
        assert lay.moe_expert_rank_capacity_factor == 1.25 and lay.moe_paged_stash
        assert lay.dispatcher == "hybridep" and lay.toggles.ep_dedup and not lay.toggles.activation_offload
        ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
        assert ev.peak_bytes == it.evaluation.peak_bytes
        assert any(r.ledger["paged_stash"] > 0 for r in ev.ranks)


@pytest.mark.parametrize(("over", "needle"), [
    ({"ep": 1, "expert_fsdp": 1, "dense_fsdp": 64}, "needs expert parallelism"),
    ({"gpus": 128, "pp": 2, "split": [46, 47]}, "interleaved schedule only"),
    ({"recompute": "full"}, "refuses full recompute"),
])
def test_megatron_s_ep_overlap_rules_are_one_line(over, needle):  # noqa: ANN001
    """Megatron's EP overlap schedule needs EP > 1, the interleaved schedule under PP > 1, and no full recompute
    (transformer_config.py L3007-3023 @ d98e8a64)."""
    with pytest.raises(LayoutError, match=needle) as err:
        _k3(ep_overlap=True, **over)
    assert "\n" not in str(err.value)
    _k3(ep_overlap=True)  # PP 1, EP 64, no recompute: Megatron runs it


def test_delayed_weight_gradients_need_the_overlap_schedule():
    """Megatron asserts overlap_moe_expert_parallel_comm under delay_wgrad_compute (transformer_config.py
    L3073-3077 @ d98e8a64): a layout or job without it gets one line."""
    with pytest.raises(LayoutError, match="delay_wgrad_compute without ep_overlap") as err:
        _k3(delay_wgrad_compute=True)
    assert "\n" not in str(err.value)
    assert _k3(ep_overlap=True, delay_wgrad_compute=True).delay_wgrad_compute
    with pytest.raises(ValueError, match="delay_wgrad_compute without ep_overlap"):
        k3opt.Job.model_validate({"gpus": 512, "tokens_per_update": 1 << 24, "delay_wgrad_compute": True})


def test_a_job_s_ep_overlap_reaches_the_shapes_megatron_runs_it_on(tiny):  # noqa: ANN001 - a fixture
    """The tiny model on 8 GPUs: PP2 VP2 EP2 runs the EP overlap schedule, PP2 VP1 and full recompute do not. Each
    interleaved frame comes twice, with and without the overlap (it hides the all-to-all but holds more memory); each
    PP2 VP1 frame once, without."""
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "ep_overlap": True,
        "search": {"pp": [2], "ep": [2], "cp": [1]}})
    seen = set()
    frames = enumerate_frames(job, tiny, 8)
    for f in frames:
        for rc in (Recompute.NONE, Recompute.FULL):
            md = ActMode(rc, False, False, False, False)
            on = frame_shape(job, f, md, FsdpLifecycle.ACCUMULATE).ep_overlap
            assert on == (f.ep_overlap and rc != Recompute.FULL), (f, rc)
            seen.add(on)
    assert seen == {True, False}
    twins = Counter(dataclasses.replace(f, ep_overlap=False) for f in frames)
    assert twins and all(n == (2 if f.vp > 1 else 1) for f, n in twins.items())
    assert {f.vp for f in twins} >= {1, 2}
    # with delay_wgrad_compute the overlapped shapes (only they) delay the experts' weight gradients
    delay = job.model_copy(update={"delay_wgrad_compute": True})
    for f in frames:
        for rc in (Recompute.NONE, Recompute.FULL):
            sh = frame_shape(delay, f, ActMode(rc, False, False, False, False), FsdpLifecycle.ACCUMULATE)
            assert sh.delay_wgrad_compute == sh.ep_overlap
            assert not frame_shape(job, f, ActMode(rc, False, False, False, False),
                                   FsdpLifecycle.ACCUMULATE).delay_wgrad_compute
    off = job.model_copy(update={"ep_overlap": False})
    assert not any(f.ep_overlap for f in enumerate_frames(off, tiny, 8))
    assert not any(frame_shape(off, f, ActMode(Recompute.NONE, False, False, False, False),
                               FsdpLifecycle.ACCUMULATE).ep_overlap for f in enumerate_frames(off, tiny, 8))


def test_the_node_model_of_an_ep_overlap_job_prices_its_layout_as_evaluate_does(tiny, slow):  # noqa: ANN001
    """A job pinned to one PP2 VP2 EP2 layout of the tiny model with the EP overlap schedule: its node model builds
    (the all-to-all's own resources under the overlap are in the stage, not in the update), every rank's peak is at
    least evaluate()'s, whose activation phase holds a layer's transients and the logits together, and within the
    KiB rounding above it."""
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 0.0, "ep_overlap": True,
        "search": {"pp": [2], "vp": [2], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "dense_sharding": ["optim_grads_params"], "recompute": ["none"], "fsdp_lifecycle": ["accumulate"],
                   "forbid_toggles": list(TOGGLE_NAMES), "split": SPLIT}})
    frames = enumerate_frames(job, tiny, 8)
    assert [g.ep_overlap for g in frames] == [True, False]  # searched with the overlap and without
    f = frames[0]
    fm = FrameModel(job, f, tiny, slow)
    (md,) = fm.modes
    shape = frame_shape(job, f, md, FsdpLifecycle.ACCUMULATE)
    lay = layout_of(job, f, shape, SPLIT)
    assert lay.ep_overlap
    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
    for r, rank in enumerate(ev.ranks):
        slack = KIB * 16 * (sum(e - s for s, e in rank.chunks) + 2) * (1 + int(rank.in_flight + 1))
        assert rank.peak_bytes <= least_value(fm, fm.ranks[r]["ledger"].peak) * KIB <= rank.peak_bytes + slack


def test_torchtitan_runs_neither_the_ep_overlap_schedule_nor_the_sync_free_moe():
    """torchtitan overlaps the expert all-to-all only under DualPipeV (job_config.py L420-426 at its pinned commit)
    and has no capacity factor: a layout with either is refused, a job's EP overlap is turned off, and a job's
    sync-free MoE is a one-line SpecError."""
    assert any("ep_overlap" in why for why in launch_refusals(_k3(ep_overlap=True), "torchtitan"))
    job = k3opt.load_job("k3-512-4k").model_copy(update={"ep_overlap": True, "target": "torchtitan"})
    assert not apply_target_limits(job).ep_overlap
    assert apply_target_limits(job.model_copy(update={"target": "megatron-lm"})).ep_overlap
    with pytest.raises(SpecError, match="torchtitan") as err:
        apply_target_limits(job.model_copy(update={"moe_expert_rank_capacity_factor": 1.5}))
    assert "\n" not in str(err.value)


def test_the_plan_table_and_explain_name_the_schedule_settings():
    """A layout's EP overlap (with its delayed weight gradients), capacity factor and paged stash show beside its
    toggles, in the plan table's column and in explain's layout line; a layout without them shows none of them."""
    lay = k3opt.load_layout("deepseek-v3-gb200-mxfp8-paged-stash")
    assert toggles_text(lay) == ("moe_backward_rewrite,ep_dedup,ep_overlap(delay_wgrad),capacity(1.5),"
                                 "paged_stash(1.2/1)")
    assert "ep_overlap,capacity" in toggles_text(lay.model_copy(update={"delay_wgrad_compute": False}))
    assert "ep_overlap(delay_wgrad),capacity(1.5),paged_stash(1.2/1)" in explain_text(k3opt.evaluate(lay))
    plain = toggles_text(_k3())
    assert not any(word in plain for word in ("ep_overlap", "capacity", "paged_stash"))
