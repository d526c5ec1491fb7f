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

    assert tuple(f.name for f in fields(ActMode))[1:] == T.ACT_TOGGLES


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
