"""The search chooses Megatron-FSDP's per-layer parameter gather (`[search] param_gather`): frames gain the gather
only where an optim_grads_params group of more than one rank holds parameters, the optimum equals exhaustive
enumeration through evaluate(), every bound stays below the layouts it stands for, and the Megatron targets run
only what Megatron runs."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import assert_bounds_below, contiguous_splits, plan_refusal

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, ParamGather, Recompute, ShardingPolicy
from k3opt.launch import apply_target_limits, launch_refusals
from k3opt.search import enumerate_frames

DATA = Path(__file__).parents[1] / "data"
OGP = ShardingPolicy.OPTIM_GRADS_PARAMS
ALLOWED = ("activation_offload", "fp8_activations")
FORBIDDEN = [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in ALLOWED]
# Megatron-Bridge's Llama 3 70B GB200 recipe's microbatch (MBS 2 x 8,192, FP8) on 64 GPUs, one rack of 64.
LLAMA = {"model": "llama3-70b", "cluster": "gb200-nvl72", "gpus": 64, "rows": 2, "context": 8192,
         "tokens_per_update": 2_097_152, "reserve_gib": 2.0, "domain_gpus_used": 64, "precisions": ["fp8"],
         "runtime": "none"}
SPACE = {"pp": [1], "cp": [1, 2], "dense_fsdp": [8, 16, 32, 64], "recompute": ["selective", "full"],
         "dense_sharding": ["optim_grads", "optim_grads_params"], "forbid_toggles": FORBIDDEN}


def _llama_job(gathers: list[str]) -> k3opt.Job:
    return k3opt.Job.model_validate({**LLAMA, "search": {**SPACE, "param_gather": gathers}})


def _enumerate(job: k3opt.Job, model: k3opt.ModelSpec, cluster: k3opt.ClusterSpec) -> list[tuple]:
    """(ranked s, frame) of every fitting layout of the job's space (PP1: one split), through evaluate()."""
    out = []
    for f in enumerate_frames(job, model, job.gpus):
        for rc, lc in itertools.product((Recompute.SELECTIVE, Recompute.FULL), FsdpLifecycle):
            for flags in itertools.product([False, True], repeat=len(ALLOWED)):
                lay = make_layout(model="llama3-70b", cluster="gb200-nvl72", gpus=64, pp=1, cp=f.cp, ep=1,
                                  expert_fsdp=1, dense_fsdp=f.dense_fsdp, microbatches=f.microbatches, rows=2,
                                  context=8192, split=[80], recompute=rc, fsdp_lifecycle=lc,
                                  toggles=dict(zip(ALLOWED, flags, strict=True)), reserve_gib=2.0,
                                  dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding,
                                  param_gather=f.param_gather, precision="fp8", domain_gpus_used=64)
                ev = k3opt.evaluate(lay, model=model, cluster=cluster)
                if ev.fits:
                    out.append((ev.step.rank_time_s, f))
    return out


def test_the_recipe_microbatch_fits_only_gathered_per_layer():
    """Llama 3 70B's 2 x 8K FP8 microbatch on 64 GB200: kept for the update, the BF16 view (2 B x 70.6 B = 131 GiB)
    leaves no room on any shape of the space; gathered per layer the search finds the enumeration's optimum."""
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    kept = _llama_job(["update"])
    assert _enumerate(kept, model, cluster) == []
    with pytest.raises(k3opt.InfeasibleJobError):
        k3opt.plan(kept, top=1, gap=0)
    job = _llama_job(["update", "layer"])
    rows = _enumerate(job, model, cluster)
    assert rows and {f.param_gather for _, f in rows} == {ParamGather.LAYER}
    plan = k3opt.plan(job, top=1, gap=0)
    assert plan.status == "OPTIMAL"
    assert plan.layouts[0].rank_time_s == pytest.approx(min(t for t, _ in rows), abs=1e-4)
    assert plan.layouts[0].layout.param_gather == ParamGather.LAYER


def test_frames_gather_per_layer_only_where_a_group_shards_parameters(tiny):
    base = {"model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
            "context": 2048, "tokens_per_update": 32768}
    grid = {"pp": [2], "vp": [1], "cp": [1], "ep": [2], "expert_fsdp": [1, 2], "dense_fsdp": [1, 2]}
    frames = enumerate_frames(k3opt.Job.model_validate({**base, "search": {**grid, "param_gather": ["layer"]}}),
                              tiny, 8)
    # Listing "layer" with no sharding list adds optim_grads_params to the default policies (optim, optim_grads);
    # only frames whose optim_grads_params group has two ranks carry it.
    assert frames and all(f.param_gather == ParamGather.LAYER for f in frames)
    assert all((f.dense_sharding == OGP and f.dense_fsdp > 1) or (f.expert_sharding == OGP and f.expert_fsdp > 1)
               for f in frames)
    both = enumerate_frames(k3opt.Job.model_validate(
        {**base, "search": {**grid, "param_gather": ["update", "layer"]}}), tiny, 8)
    updates = {f for f in both if f.param_gather == ParamGather.UPDATE}
    assert {f.dense_sharding for f in updates} == {ShardingPolicy.OPTIM, ShardingPolicy.OPTIM_GRADS, OGP}
    # Absent, nothing gathers per layer and optim_grads_params (dominated when the view is kept) is not searched.
    plain = enumerate_frames(k3opt.Job.model_validate({**base, "search": grid}), tiny, 8)
    assert {f.param_gather for f in plain} == {ParamGather.UPDATE}
    assert all(f.dense_sharding != OGP for f in plain if f.dense_fsdp > 1)


def test_a_dense_model_does_not_gather_its_empty_expert_group():
    """Llama has no routed experts: its expert group (one rank, optim_grads_params as the representative policy)
    holds nothing, so a dense optim_grads group never gains a per-layer-gather twin."""
    frames = enumerate_frames(_llama_job(["update", "layer"]), k3opt.load_model("llama3-70b"), 64)
    layer = [f for f in frames if f.param_gather == ParamGather.LAYER]
    assert layer and all(f.dense_sharding == OGP for f in layer)
    # 7 (CP, dense FSDP) pairs: optim_grads kept, optim_grads_params kept and per layer.
    assert len(frames) == 3 * 7


def test_bounds_stay_below_every_layout_gathered_per_layer(tiny, slow):
    """The tiny model with both gathers on PP1 / PP2 / PP2 VP2 shapes: CP-SAT's optimum equals enumeration, and
    every frame and node bound is below every enumerated layout of its frame."""
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 2.0,
        "search": {"pp": [1, 2], "vp": [1, 2], "cp": [1], "ep": [2], "expert_fsdp": [1, 2, 4], "dense_fsdp": [2, 4],
                   "recompute": ["full"], "fsdp_lifecycle": ["per_microbatch"],
                   "dense_sharding": ["optim_grads", "optim_grads_params"], "expert_sharding": ["optim_grads_params"],
                   "param_gather": ["update", "layer"], "forbid_toggles": [
                       t for t in k3opt.inputs.specs.TOGGLE_NAMES if t != "fp8_activations"]}})
    frames = enumerate_frames(job, tiny, 8)
    rows = []
    for f in frames:
        for fp8 in (False, True):
            for split in contiguous_splits(tiny.num_layers, f.pp * f.vp):
                lay = make_layout(gpus=8, pp=f.pp, vp=f.vp, ep=2, expert_fsdp=f.expert_fsdp, dense_fsdp=f.dense_fsdp,
                                  microbatches=f.microbatches, context=2048, split=split, recompute="full",
                                  fsdp_lifecycle="per_microbatch", toggles={"fp8_activations": fp8}, reserve_gib=2.0,
                                  dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding,
                                  param_gather=f.param_gather)
                ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                if ev.fits:
                    rows.append((f, ev.step.rank_time_s, ev.peak_bytes))
    assert {f.param_gather for f, _, _ in rows} == {ParamGather.UPDATE, ParamGather.LAYER}
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=0)
    assert plan.layouts[0].rank_time_s == pytest.approx(min(t for _, t, _ in rows), abs=1e-4)
    full, per_mb = Recompute.FULL, FsdpLifecycle.PER_MICROBATCH
    assert_bounds_below(job, frames, [(f, full, per_mb, t, m) for f, t, m in rows], tiny, slow, (full,))


def test_megatron_runs_the_gather_its_optimizer_allows():
    """Muon (Kimi K3): Megatron refuses Megatron-FSDP, so a Megatron target searches the kept view only. AdamW
    (Llama): a dense optim_grads_params group is Megatron-FSDP, so the kept view under it is refused, and so is
    accumulating its gradients (Megatron-FSDP reduce-scatters every microbatch)."""
    k3 = k3opt.Job.model_validate({"gpus": 512, "tokens_per_update": 2**24, "target": "megatron-lm",
                                   "search": {"param_gather": ["update", "layer"]}})
    assert apply_target_limits(k3, k3opt.load_model("kimi-k3")).search.param_gather == [ParamGather.UPDATE]
    llama = k3opt.load_model("llama3-70b")
    lay = k3opt.load_layout("mb-2-llama3-70b-gb200")
    assert not [w for w in launch_refusals(lay, "megatron-bridge", llama) if "param_gather" in w]
    kept = lay.model_copy(update={"param_gather": ParamGather.UPDATE})
    assert [w for w in launch_refusals(kept, "megatron-bridge", llama) if "param_gather = update" in w]
    assert not [w for w in launch_refusals(kept, "torchtitan", llama) if "param_gather" in w]
    accumulated = lay.model_copy(update={"fsdp_lifecycle": FsdpLifecycle.ACCUMULATE})
    assert [w for w in launch_refusals(accumulated, "megatron-lm", llama) if "reduce-scatters" in w]


@pytest.mark.parametrize("value", ["sometimes", 3])
def test_a_bad_gather_in_search_is_one_line(tmp_path: Path, value):
    line = plan_refusal(tmp_path, f'gpus = 64\ntokens_per_update = 2097152\n[search]\nparam_gather = ["{value}"]\n')
    assert "param_gather" in line


def test_the_two_gathers_are_not_one_sharding_group():
    """A sharding group's frames differ only in FSDP degrees, so more sharding means no more memory (the search
    prunes the less sharded ones when a more sharded one is over). Across the gathers that need not hold: gathered
    per layer a rank holds a shard plus two gathered units, two gradient buckets and a fresh weight gradient, which
    on a model of few large layers can outweigh the whole view kept for the update."""
    from dataclasses import replace

    from k3opt.search.frames import sharding_group

    f = enumerate_frames(_llama_job(["update"]), k3opt.load_model("llama3-70b"), 64)[0]
    f = replace(f, dense_sharding=OGP)
    assert sharding_group(f) != sharding_group(replace(f, param_gather=ParamGather.LAYER))


@pytest.mark.parametrize(("sharding", "words"), [
    ('dense_sharding = ["optim"]\nexpert_sharding = ["optim"]', "lists leave it out"),
    ('dense_sharding = ["optim"]', "leaves no shape"),  # Llama's expert group is empty
])
def test_a_gather_with_nothing_to_gather_is_one_line(tmp_path: Path, sharding: str, words: str):
    line = plan_refusal(tmp_path, 'model = "llama3-70b"\ngpus = 64\nrows = 2\ncontext = 8192\n'
                                  'tokens_per_update = 2097152\n[search]\npp = [1]\nparam_gather = ["layer"]\n'
                                  f'{sharding}\n')
    assert words in line


def test_a_megatron_target_plans_megatron_fsdp_for_an_adamw_model_unasked():
    """Llama 3 70B (AdamW) at its recipe microbatch with target megatron-bridge and no `param_gather` listed: the
    target adds the per-layer gather (a dense optim_grads_params group runs as Megatron-FSDP), so the plan finds
    the gathered layout it finds when the job lists both gathers, where the kept view leaves no layout (the
    first test). A job that lists a gather keeps its list; Muon models keep the update gather only (above)."""
    from k3opt.launch import apply_target_limits

    llama = k3opt.load_model("llama3-70b")
    job = k3opt.Job.model_validate({**LLAMA, "target": "megatron-bridge", "search": SPACE})
    assert apply_target_limits(job, llama).search.param_gather == [ParamGather.UPDATE, ParamGather.LAYER]
    listed = k3opt.Job.model_validate({**LLAMA, "target": "megatron-bridge",
                                       "search": {**SPACE, "param_gather": ["update"]}})
    assert apply_target_limits(listed, llama).search.param_gather == [ParamGather.UPDATE]
    plan = k3opt.plan(job, top=1, gap=0)
    assert plan.layouts[0].layout.param_gather == ParamGather.LAYER
    assert plan.layouts[0].evaluation.fits
    # Its dense FSDP degree (> 1) is not ep x expert_fsdp = 1: Llama has no routed experts, so no expert-DP
    # degree is derived from it and the rule does not apply (on an MoE model it does, tests/launch).
    lay = plan.layouts[0].layout
    assert lay.dense_fsdp > lay.ep * lay.expert_fsdp
    assert not launch_refusals(lay, "megatron-bridge", llama)
