"""The toggle registry (k3opt.inputs.toggles): one entry per Toggles field, a switch or NO SWITCH for every launch
target, and the search's and launch's toggle sets derived from it."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.inputs import toggles as T
from k3opt.inputs.specs import TOGGLE_NAMES
from k3opt.launch import FORMATS, to_launch
from k3opt.launch.limits import NO_SWITCH, launch_refusals


def test_every_toggles_field_has_one_registry_entry() -> None:
    assert sorted(T.TOGGLES) == sorted(TOGGLE_NAMES)
    assert len(T.REGISTRY) == len(TOGGLE_NAMES)


@pytest.mark.parametrize("name", TOGGLE_NAMES)
def test_every_toggle_says_what_it_changes_and_how_each_target_switches_it(name: str) -> None:
    info = T.TOGGLES[name]
    assert info.changes, f"{name}: no ledger term or time part named"
    assert set(info.switches) == set(FORMATS)
    for target, sw in info.switches.items():
        if isinstance(sw, T.BuiltIn):
            assert sw.text and "@" in sw.source and sw.ffn_activations, f"{name} on {target}: a built-in needs a pin"
            sw = sw.otherwise
        if isinstance(sw, T.NoSwitch):
            assert sw.instead and "@" in sw.source, f"{name} on {target}: a NO SWITCH needs what to do and a pin"
        else:
            assert isinstance(sw, T.Switch) and sw.text


def test_the_kinds_partition_the_toggles() -> None:
    kinds = T.ACT_TOGGLES + T.RANK_TOGGLES + T.FIXED_TOGGLES
    assert sorted(kinds) == sorted(TOGGLE_NAMES)
    # The paper's memory toggles (seed 001) change the saved set or one rank term; the dispatcher's dedup is fixed.
    assert set(T.ACT_TOGGLES) == {"fp8_activations", "fused_situ", "moe_backward_rewrite", "dispatch_recompute"}
    assert T.FIXED_TOGGLES == ("ep_dedup",)
    assert T.NEVER_CHOSEN == ("moonep",)


def test_the_launch_tables_derive_from_the_registry() -> None:
    for target in FORMATS:
        assert [ns.toggle for ns in NO_SWITCH[target]] == [n for n, _ in T.no_switch(target)]
    # Megatron runs FP8 saved activations (FP8 GEMM execution) and module-level activation offload; torchtitan has
    # no activation offload (its enable_cpu_offload moves parameters and optimizer state).
    assert "activation_offload" not in [n for n, _ in T.no_switch("megatron-lm")]
    assert "activation_offload" in [n for n, _ in T.no_switch("torchtitan")]


@pytest.mark.parametrize("target", FORMATS)
def test_a_registered_switch_is_emitted_and_a_no_switch_is_refused(target: str) -> None:
    """Each toggle on alone: a toggle with a switch is not refused, one without is refused with the registry's
    source, and the export lists it as missing."""
    base = k3opt.load_layout("k3-gb200-512-reference")
    model = k3opt.load_model("kimi-k3")
    for name in TOGGLE_NAMES:
        lay = base.model_copy(update={"toggles": k3opt.Toggles(**{name: True})})
        refused = [r for r in launch_refusals(lay, target, model) if r.startswith(f"toggle {name}")]
        missing = [m for m in to_launch(lay, target, model).missing if m.decision == f"toggle {name}"]
        sw = T.TOGGLES[name].switch(target, model)
        if isinstance(sw, T.NoSwitch):
            assert refused and sw.source in refused[0] and missing
        else:
            assert not refused and not missing


def test_the_activation_modes_have_one_flag_per_activation_toggle() -> None:
    from dataclasses import fields

    from k3opt.search.frames import ActMode

    # recompute first, then one flag per activation toggle, then the offload modules (not a toggle)
    assert tuple(f.name for f in fields(ActMode))[1:-1] == T.ACT_TOGGLES
    assert fields(ActMode)[-1].name == "offload"


def test_megatron_keeps_no_expert_outputs_for_swiglu_experts_so_the_rewrite_is_built_in() -> None:
    """Megatron multiplies the routing probabilities into the fused weighted SwiGLU, which saves its input and the
    probabilities (megatron/core/fusions/fused_bias_swiglu.py WeightedSwiGLUFunction.save_for_backward): the
    expert outputs are never saved, which is what moe_backward_rewrite prices. K3's SiTU experts run the unfused
    path, and torchtitan has no such path."""
    deepseek, k3, llama = (k3opt.load_model(n) for n in ("deepseek-v3", "kimi-k3", "llama3-70b"))
    for target in ("megatron-lm", "megatron-bridge"):
        assert [n for n, _ in T.built_in(target, deepseek)] == ["moe_backward_rewrite"]
        assert "moe_backward_rewrite" not in [n for n, _ in T.no_switch(target, deepseek)]
        assert "moe_backward_rewrite" in [n for n, _ in T.no_switch(target, k3)]
        assert T.built_in(target, k3) == () and T.built_in(target, llama) == ()
        # Without a model the table stays conservative: the toggle is listed as having no switch.
        assert "moe_backward_rewrite" in [n for n, _ in T.no_switch(target)]
    assert T.built_in("torchtitan", deepseek) == ()


def test_a_megatron_target_plans_deepseek_with_the_built_in_rewrite_and_refuses_to_forbid_it() -> None:
    from k3opt.inputs.errors import SpecError
    from k3opt.launch import apply_target_limits

    deepseek = k3opt.load_model("deepseek-v3")
    job = k3opt.load_job("k3-512-4k").model_copy(update={"target": "megatron-lm"})
    narrowed = apply_target_limits(job, deepseek)
    assert "moe_backward_rewrite" in narrowed.search.require_toggles
    assert "moe_backward_rewrite" not in narrowed.search.forbid_toggles
    # K3 (SiTU experts) keeps the toggle forbidden on Megatron.
    k3_narrowed = apply_target_limits(job, k3opt.load_model("kimi-k3"))
    assert "moe_backward_rewrite" in k3_narrowed.search.forbid_toggles
    forbidding = job.model_copy(update={"search": job.search.model_copy(
        update={"forbid_toggles": ["moe_backward_rewrite"]})})
    with pytest.raises(SpecError, match="always runs"):
        apply_target_limits(forbidding, deepseek)
    # The export says the toggle needs no flag, and whether the layout priced it.
    lay = k3opt.load_layout("k3-gb200-512-reference").model_copy(update={"model": "deepseek-v3"})
    notes = to_launch(lay, "megatron-lm", deepseek).notes
    assert any(n.startswith("toggle moe_backward_rewrite: built in") and "over-counted" in n for n in notes)


def _incumbent(model_name: str):  # noqa: ANN202 - (job, model, cluster, a layout)
    """A layout of the model on 512 GB200 GPUs: its first PP4 frame, selective recompute, no toggle, layers split
    evenly over the chunks (whether it fits does not matter here: both sides are priced alike)."""
    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search.driver import _frames
    from k3opt.search.frames import ActMode, frame_shape, layout_of

    model, cluster = k3opt.load_model(model_name), k3opt.load_cluster("gb200-nvl72")
    job = k3opt.Job.model_validate({"model": model_name, "cluster": "gb200-nvl72", "gpus": 512, "context": 4096,
                                    "tokens_per_update": 512 * 4096 * 8, "reserve_gib": 4.0})
    f = next(g for g in _frames(job, model, cluster) if g.pp == 4)
    shape = frame_shape(job, f, ActMode(Recompute.SELECTIVE, False, False, False, False), FsdpLifecycle.ACCUMULATE)
    k, n = f.pp * f.vp, model.num_layers
    split = [n // k + (1 if j < n % k else 0) for j in range(k)]
    return job, model, cluster, layout_of(job, f, shape, split)


@pytest.mark.parametrize("model_name", k3opt.inputs.presets.preset_names("model"))
def test_a_toggle_whose_needs_a_model_lacks_changes_nothing_there(model_name: str) -> None:
    """A toggle declared to need what the model lacks (Needs) prices nothing on it: evaluate() of a fitting layout
    gives the same step times and every rank's same ledger with the toggle on; and a toggle the model has what it
    needs for changes something on some preset (the declaration is not vacuous: below)."""
    from k3opt.cost.evaluate import evaluate

    job, model, cluster, lay = _incumbent(model_name)
    base = evaluate(lay, model, cluster)
    for name, _ in T.inapplicable(model):
        on = lay.model_copy(update={"toggles": lay.toggles.model_copy(update={name: True})})
        ev = evaluate(on, model, cluster)
        assert (ev.step.step_time_s, ev.step.rank_time_s) == (base.step.step_time_s, base.step.rank_time_s), name
        assert [(r.ledger, r.peak_bytes, r.host_bytes, r.time_s, r.update_s) for r in ev.ranks] == \
            [(r.ledger, r.peak_bytes, r.host_bytes, r.time_s, r.update_s) for r in base.ranks], name


@pytest.mark.parametrize(("model_name", "name"), [("kimi-k3", "fused_situ"), ("deepseek-v3", "moe_backward_rewrite"),
                                                  ("deepseek-v3", "dispatch_recompute"), ("kimi-k3", "p2p_muon")])
def test_a_toggle_acts_where_the_model_has_what_it_needs(model_name: str, name: str) -> None:
    from k3opt.cost.evaluate import evaluate

    job, model, cluster, lay = _incumbent(model_name)
    assert name not in [n for n, _ in T.inapplicable(model)]
    flipped = lay.model_copy(update={"toggles": lay.toggles.model_copy(
        update={name: not getattr(lay.toggles, name)})})
    a, b = evaluate(lay, model, cluster), evaluate(flipped, model, cluster)
    assert (a.step.rank_time_s, [r.ledger for r in a.ranks]) != (b.step.rank_time_s, [r.ledger for r in b.ranks])


def test_a_plan_leaves_a_toggle_the_model_lacks_off_and_a_job_requiring_one_is_told() -> None:
    """Qwen3-30B-A3B has no SiTU-GLU FFN: its plans never list fused_situ (which no launch target can switch on,
    so listing it would refuse every target), and a job requiring it gets one line naming why."""
    from k3opt.inputs.errors import SpecError

    job = k3opt.Job.model_validate({"model": "qwen3-30b-a3b", "cluster": "gb200-nvl72", "gpus": 8, "context": 4096,
                                    "tokens_per_update": 8 * 4096 * 32, "reserve_gib": 4.0})
    plan = k3opt.plan(job, top=3, time_limit=20)
    assert plan.layouts and not any(it.layout.toggles.fused_situ for it in plan.layouts)
    requiring = job.model_copy(update={"search": job.search.model_copy(update={"require_toggles": ["fused_situ"]})})
    with pytest.raises(SpecError, match="require_toggles lists fused_situ, but qwen3-30b-a3b's FFN activation is "
                                        "swiglu, not SiTU-GLU: remove it"):
        k3opt.plan(requiring, time_limit=5)
