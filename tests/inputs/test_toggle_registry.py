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
        sw = T.TOGGLES[name].switches[target]
        if isinstance(sw, T.NoSwitch):
            assert refused and sw.source in refused[0] and missing
        else:
            assert not refused and not missing


def test_the_activation_modes_have_one_flag_per_activation_toggle() -> None:
    from dataclasses import fields

    from k3opt.search.frames import ActMode

    assert tuple(f.name for f in fields(ActMode))[1:] == T.ACT_TOGGLES
