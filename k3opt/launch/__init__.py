"""From plan to launch: a layout as Megatron-Bridge overrides, Megatron-LM flags or torchtitan TOML, and the
frameworks' limits as search constraints.

    to_launch(layout, "megatron-lm").text      # flags, with every decision that has no switch as a comment
    apply_target_limits(job, model)            # the job narrowed to what job.target can run
    launch_refusals(layout, "megatron-bridge") # why a target cannot run a layout ([] when it can)
"""

from __future__ import annotations

from k3opt.inputs.presets import load_model
from k3opt.inputs.specs import Layout, ModelSpec, trained_model
from k3opt.launch import megatron_bridge, megatron_lm, torchtitan
from k3opt.launch.common import FORMATS, SOURCES, Launch, Missing, check_format
from k3opt.launch.limits import (
    LIMITS,
    NO_SWITCH,
    apply_target_limits,
    degree_refusals,
    launch_refusals,
    limit_text,
    refusals,
)

_EXPORTERS = {"megatron-bridge": megatron_bridge.export, "megatron-lm": megatron_lm.export,
              "torchtitan": torchtitan.export}


def to_launch(layout: Layout, fmt: str, model: ModelSpec | str | None = None) -> Launch:
    """`layout` rendered for framework `fmt` (one of FORMATS); model: object, preset or path (default: the
    layout's, else kimi-k3). Raises UnknownTargetError for an unknown format."""
    check_format(fmt)
    m = model if isinstance(model, ModelSpec) else load_model(model or layout.model or "kimi-k3")
    return _EXPORTERS[fmt](layout, trained_model(layout, m))


__all__ = ["FORMATS", "LIMITS", "NO_SWITCH", "SOURCES", "Launch", "Missing", "apply_target_limits",
           "check_format", "degree_refusals", "launch_refusals", "limit_text", "refusals", "to_launch"]
