"""What every launch export shares: the pinned sources, the rendered result, the layer facts of the model.

A launch export translates a Layout's decisions into one framework's switches. A decision without a switch
is never dropped: it becomes a `Missing` entry (what was decided, what the user must do instead), rendered as
a comment in the output and printed on stderr by the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3opt.inputs.errors import UnknownTargetError
from k3opt.inputs.frameworks import MEGATRON_BRIDGE_COMMIT, MEGATRON_LM_COMMIT, TORCHTITAN_TOML_COMMIT
from k3opt.inputs.labels import layout_text
from k3opt.inputs.pipeline_layout import format_layout
from k3opt.inputs.specs import Layout, ModelSpec, ShardingPolicy

FORMATS: tuple[str, ...] = ("megatron-bridge", "megatron-lm", "torchtitan")


SOURCES: dict[str, str] = {
    "megatron-lm": f"github.com/NVIDIA/Megatron-LM @ {MEGATRON_LM_COMMIT}",
    "megatron-bridge": f"github.com/NVIDIA-NeMo/Megatron-Bridge @ {MEGATRON_BRIDGE_COMMIT} "
                       f"(on Megatron-LM core @ {MEGATRON_LM_COMMIT[:8]})",
    "torchtitan": f"github.com/pytorch/torchtitan @ {TORCHTITAN_TOML_COMMIT} (torchtitan/config/job_config.py)",
}


def check_format(fmt: str) -> str:
    """The format name, or UnknownTargetError naming the known ones."""
    if fmt not in FORMATS:
        raise UnknownTargetError(f"unknown launch format/target '{fmt}'; known: {', '.join(FORMATS)}")
    return fmt


@dataclass(frozen=True)
class Missing:
    """A decision the target has no switch for, and what the user must do instead."""

    decision: str
    instead: str

    def line(self) -> str:
        return f"NO SWITCH: {self.decision} -> {self.instead}"


@dataclass(frozen=True)
class Launch:
    """One layout rendered for one framework."""

    format: str
    layout: Layout
    body: str
    """The launch text itself (flags, overrides or TOML), without the header comments."""
    settings: tuple[tuple[str, str], ...]
    """(switch, value) pairs in emission order; value '' for a bare flag."""
    missing: tuple[Missing, ...] = ()
    notes: tuple[str, ...] = field(default=())
    """Caveats on switches that exist but differ from what k3opt priced."""

    @property
    def text(self) -> str:
        head = [
            f"# k3opt export ({self.format}): {layout_text(self.layout)}",
            f"# switches from {SOURCES[self.format]}",
        ]
        head += [f"# NOTE: {n}" for n in self.notes]
        head += [f"# {m.line()}" for m in self.missing]
        return "\n".join(head) + "\n" + self.body.rstrip("\n") + "\n"


# ----------------------------------------------------------------------------------- model facts


def moe_layer_flags(model: ModelSpec) -> list[int]:
    """1 for a MoE layer, 0 for a dense-FFN layer, by 0-based index (Megatron's --moe-layer-freq list)."""
    if model.moe is None:
        return [0] * model.num_layers
    dense = set(model.dense_ffn_layers)
    return [0 if i in dense else 1 for i in range(model.num_layers)]


def run_length_expr(values: list[int]) -> str:
    """A Python list expression Megatron's _eval_pattern accepts (characters ,0-9[]()+*): [0]+[1]*92."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        parts.append(f"[{values[i]}]*{j - i}" if j - i > 1 else f"[{values[i]}]")
        i = j
    return "+".join(parts)


def megatron_layout(layout: Layout, model: ModelSpec) -> str:
    """--pipeline-model-parallel-layout: the layout's own string when it was given one, else one '|'-separated
    stage per chunk in k3opt's chunk order (k3opt.inputs.pipeline_layout.format_layout: 'E' on the first, the MTP
    layers and 'L' on the last, t*n for n decoder layers).

    k3opt's chunk j runs on PP rank j mod p (specs.Layout); Megatron places stage i on pp_rank i % PP,
    virtual stage i // PP (pipeline_parallel_layer_layout.py), so the orders agree."""
    if layout.pipeline_layout is not None:
        return layout.pipeline_layout
    return format_layout(layout.split, model.mtp_layers)


def runs_megatron_fsdp(layout: Layout, model: ModelSpec) -> bool:
    """Megatron runs `layout` under Megatron-FSDP: an AdamW model whose dense group shards its parameters
    (optim_grads_params; megatron/training/arguments.py L3190-3203 @ d98e8a64). Muon refuses Megatron-FSDP
    (L1739-1740) and runs the distributed optimizer instead."""
    return model.optimizer.name != "muon" and layout.dense_sharding == ShardingPolicy.OPTIM_GRADS_PARAMS


def global_batch(layout: Layout) -> int:
    """Sequences per update: rows x M x DP (k3opt's tokens per update / context)."""
    return layout.rows * layout.microbatches * layout.dp


def optimizer_instances(layout: Layout) -> int:
    """Megatron's --num-distributed-optimizer-instances N: the dense shard group is DP*CP / N, so
    N = (gpus / pp) / dense_fsdp (megatron/core/parallel_state.py)."""
    return layout.stage_ranks // layout.dense_fsdp
