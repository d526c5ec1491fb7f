"""The toggle registry: every memory toggle of a layout (k3opt.inputs.specs.Toggles), declared once.

Each entry says how the search treats the toggle (its kind, whether it may choose it, the roles the bounds read),
which ledger terms and step-time parts it changes, and how each launch target switches it on, or that it has no
switch there and what to do instead, with the source. The search's toggle sets (k3opt.search.frames,
k3opt.search.ranking, k3opt.search.lp_bound, k3opt.search.incumbents) and the launch tables
(k3opt.launch.limits.NO_SWITCH) are derived from it; tests/test_architecture.py fails when a Toggles field has no
entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from k3opt.inputs.frameworks import MLM, TT
from k3opt.inputs.specs import TOGGLE_NAMES, ModelSpec


class ToggleKind(StrEnum):
    ACTIVATION = "activation"
    """Changes the saved-for-backward set: with the recompute mode it forms the node's activation mode."""
    RANK = "rank"
    """Acts on one rank-level term: a Boolean decision of the node model, the same on every rank."""
    FIXED = "fixed"
    """A property of the stack (the dispatcher), not a memory decision: set with [search] require_toggles."""


@dataclass(frozen=True)
class Switch:
    """How a launch target turns the toggle on: its flags, keys or config entries."""

    text: str


@dataclass(frozen=True)
class NoSwitch:
    """The target has no switch for the toggle: what to do instead, and where that was read."""

    instead: str
    source: str


@dataclass(frozen=True)
class BuiltIn:
    """The target always does what the toggle prices, with no flag, for MoE models whose FFN activation is in
    `ffn_activations`: a layout for that target must have the toggle on to price what runs. Any other model gets
    `otherwise`."""

    text: str
    source: str
    ffn_activations: tuple[str, ...]
    otherwise: NoSwitch

    def applies(self, model: ModelSpec | None) -> bool:
        return model is not None and model.moe is not None and model.ffn_activation in self.ffn_activations


class Needs(StrEnum):
    """What a model must have for a toggle to change anything: without it the toggle prices nothing on that model
    (tests/inputs/test_toggle_registry.py checks every coefficient of every preset), so it is no decision there."""

    MOE = "moe"
    """MoE layers (the routed experts' saved set, the dispatch, MoonEP's slots)."""
    SITU_GLU = "situ_glu"
    """A SiTU-GLU FFN activation (the streaming kernel it fuses)."""
    MUON = "muon"
    """Muon matrices (the optimizer step's pull of their shards)."""

    def lacking(self, model: ModelSpec) -> str | None:
        """Why `model` lacks it, or None when it has it."""
        if self is Needs.MOE:
            return None if model.moe is not None else f"{model.name} has no MoE layers"
        if self is Needs.SITU_GLU:
            return None if model.ffn_activation == "situ_glu" else \
                f"{model.name}'s FFN activation is {model.ffn_activation}, not SiTU-GLU"
        return None if model.optimizer.name == "muon" else \
            f"{model.name} trains every tensor with AdamW (no Muon matrices to pull)"


@dataclass(frozen=True)
class ToggleInfo:
    name: str
    kind: ToggleKind
    changes: tuple[str, ...]
    """The ledger terms (k3opt.cost.ledger) and step-time parts (per-microbatch `time`, per-update `update`, with
    their resources) the toggle changes in k3opt.cost.coefficients."""
    searched: bool = True
    """The search may choose it; False: only a job's require_toggles turns it on."""
    memory_only: bool = False
    """Only saves memory, at some time cost: the seeding's lean configuration turns it on where allowed."""
    moves_saved_set: bool = False
    """Moves the saved set over a link: with it on, the activation toggles lower that link's time too."""
    vector_only: bool = False
    """Without offload, its only effect on a time array is the memory-bound kernels' traffic."""
    switches: dict[str, Switch | NoSwitch | BuiltIn] = field(default_factory=dict)
    """Per launch target (megatron-lm, megatron-bridge, torchtitan)."""
    needs: Needs | None = None
    """What a model must have for the toggle to act (None: every model)."""

    def switch(self, target: str, model: ModelSpec | None = None) -> Switch | NoSwitch | BuiltIn:
        """The target's switch for this toggle and model: a BuiltIn resolves to its `otherwise` where it does not
        apply (and when no model is given)."""
        sw = self.switches[target]
        if isinstance(sw, BuiltIn) and not sw.applies(model):
            return sw.otherwise
        return sw


def _megatron(sw: Switch | NoSwitch | BuiltIn) -> dict[str, Switch | NoSwitch | BuiltIn]:
    """Megatron-Bridge runs Megatron core: the same switch under its config keys, or the same missing one."""
    return {"megatron-lm": sw, "megatron-bridge": sw}


def _tt(sw: Switch | NoSwitch | BuiltIn) -> dict[str, Switch | NoSwitch | BuiltIn]:
    return {"torchtitan": sw}


_TT_NO_TOML = "torchtitan/config/job_config.py"

REGISTRY: tuple[ToggleInfo, ...] = (
    # -- activation toggles, in the order of the search's activation modes (search/frames.ActMode)
    ToggleInfo(
        "fp8_activations", ToggleKind.ACTIVATION,
        ("activations", "recompute_working_set", "time.hbm (quantize / dequantize traffic)"), vector_only=True,
        switches={**_megatron(Switch("--fp8-format e4m3 --fp8-recipe blockwise|mxfp8 (by fp8_block_size)")),
                  **_tt(Switch("[model] converters = quantize.linear.mx, quantize.grouped_mm.mx (MXFP8)"))}),
    ToggleInfo(
        "fused_situ", ToggleKind.ACTIVATION, ("activations", "recompute_working_set", "time.hbm"),
        vector_only=True, needs=Needs.SITU_GLU,
        switches={**_megatron(NoSwitch(
            "plan without it, or replace the GLU activation with a streaming SiTU-GLU kernel; no recompute or "
            "activation option names it",
            f"megatron/core/transformer/transformer_config.py (recompute_modules, activation) {MLM}")),
                  **_tt(NoSwitch("plan without it, or write the streaming SiTU-GLU kernel into the model",
                                 f"{_TT_NO_TOML} {TT}"))}),
    ToggleInfo(
        "moe_backward_rewrite", ToggleKind.ACTIVATION, ("activations", "time.hbm (expert outputs re-read)"),
        vector_only=True, needs=Needs.MOE,
        # Megatron applies the routing probabilities inside the expert activation, so dL/dp reads the activation,
        # not the expert outputs: for SwiGLU the fused weighted SwiGLU saves only its input and the probabilities.
        switches={**_megatron(BuiltIn(
            "built in: TEGroupedMLP multiplies the routing probabilities into the activation; with SwiGLU and "
            "bias_activation_fusion the fused weighted SwiGLU saves its input and the probabilities, never the "
            "expert outputs",
            f"megatron/core/transformer/moe/experts.py L943-974, megatron/core/fusions/fused_bias_swiglu.py "
            f"L266-270 {MLM}",
            ("swiglu",),
            NoSwitch("plan without it (expert outputs priced as saved): for another activation Megatron runs "
                     "use_te_activation_func, whose probability multiply keeps the unweighted BF16 activation "
                     "output instead, which this toggle does not price",
                     f"megatron/core/transformer/moe/experts.py L951-962 {MLM}"))),
                  **_tt(NoSwitch("plan without it, or patch the MoE module's backward", f"{_TT_NO_TOML} {TT}"))}),
    ToggleInfo(
        "dispatch_recompute", ToggleKind.ACTIVATION, ("activations", "time.nvlink", "time.nic (dispatch replayed)"),
        needs=Needs.MOE,
        switches={**_megatron(NoSwitch(
            "plan without it; the nearest switch, 'moe' in --recompute-modules, re-runs the whole MoE forward "
            "(route, dispatch, experts, combine), not the dispatch alone",
            f"megatron/core/transformer/moe/moe_layer.py L657-717 {MLM}")),
                  **_tt(NoSwitch("plan without it; selective AC per op ('op') recomputes non-matmul ops, it does "
                                 "not re-run the dispatch alone",
                                 f"{_TT_NO_TOML} (ActivationCheckpoint) {TT}"))}),
    # -- rank toggles, in the order of the node model's Boolean decisions
    ToggleInfo(
        "activation_offload", ToggleKind.RANK, ("activations", "attnres_bank", "host", "time.host_link"),
        memory_only=True, moves_saved_set=True,
        switches={**_megatron(Switch("--fine-grained-activation-offloading --offload-modules ...")),
                  **_tt(NoSwitch("plan without it: [training] enable_cpu_offload offloads parameters, gradients "
                                 "and optimizer state, not activations; core torchtitan has no activation offload",
                                 f"{_TT_NO_TOML} (Training, ActivationCheckpoint) {TT}"))}),
    ToggleInfo(
        "balance_activations", ToggleKind.RANK, ("activations", "attnres_bank", "time.nic or time.nvlink"),
        memory_only=True, moves_saved_set=True,
        switches={**_megatron(NoSwitch(
            "plan without it: Megatron offloads activations only to the local host "
            "(--fine-grained-activation-offloading), never to another PP rank",
            f"megatron/core/transformer/transformer_config.py (offload fields) {MLM}")),
                  **_tt(NoSwitch("plan without it: no activation offload exists to balance",
                                 f"{_TT_NO_TOML} {TT}"))}),
    ToggleInfo(
        "pipeline_zero2_host_grads", ToggleKind.RANK, ("grads", "host", "time.host_link", "update.host_link"),
        memory_only=True,
        switches={**_megatron(NoSwitch(
            "plan without it; only pieces exist: --optimizer-cpu-offload (+ --use-precision-aware-optimizer) "
            "copies gradients to the host for a CPU optimizer step, it does not keep FP32 gradient shards on the "
            "host behind two GPU chunk buffers", f"megatron/training/arguments.py L2918-2934 {MLM}")),
                  **_tt(NoSwitch("plan without it: FSDP2 under PP already keeps parameters unsharded between "
                                 "forward and backward, but enable_cpu_offload moves parameters, gradients and "
                                 "optimizer state together, not gradients alone",
                                 f"{_TT_NO_TOML} (Training) {TT}"))}),
    ToggleInfo(
        "p2p_muon", ToggleKind.RANK, ("optimizer_transient", "update.nvlink", "update.nic"), memory_only=True,
        needs=Needs.MUON,
        switches={**_megatron(NoSwitch(
            "plan without it: --optimizer muon with --use-distributed-optimizer is the layer-wise distributed "
            "optimizer, whose parameter sync is an all-gather",
            f"megatron/training/arguments.py L1724-1736, L3160 {MLM}")),
                  **_tt(NoSwitch("plan without it: the TOML-era [optimizer] has no Muon at all (torchtitan HEAD's "
                                 "DistMuon is Python config and redistributes by packed all-to-all, not "
                                 "point-to-point)", f"{_TT_NO_TOML} (Optimizer) {TT}"))}),
    ToggleInfo(
        "fused_cross_entropy", ToggleKind.RANK, ("logits", "time.tensor (one more LM-head forward)"),
        memory_only=True,
        switches={**_megatron(NoSwitch(
            "plan without it: --cross-entropy-loss-fusion fuses the loss kernel but the [T, vocab] logits are "
            "still materialized whole; chunking over tokens needs a custom loss",
            f"megatron/training/arguments.py (--cross-entropy-loss-fusion, --cross-entropy-fusion-impl) {MLM}")),
                  **_tt(NoSwitch("plan without it: the loss is computed on the whole [T, vocab] logits",
                                 f"{_TT_NO_TOML} {TT}"))}),
    ToggleInfo(
        # MoonEP only adds memory here: its benefit, expert-load balance, is outside the forced-balanced routing
        # model, so the search takes it only when a job requires it.
        "moonep", ToggleKind.RANK, ("moonep_slots", "moonep_buffers", "ep_buffers"), searched=False,
        needs=Needs.MOE,
        switches={**_megatron(NoSwitch(
            "plan without it; the nearest dispatcher is --moe-token-dispatcher-type flex "
            "--moe-flex-dispatcher-backend hybridep, which has no redundant expert slots",
            f"megatron/core/transformer/transformer_config.py (moe_flex_dispatcher_backend) {MLM}")),
                  **_tt(NoSwitch("plan without it; expert_parallel_comm_backend = 'deepep' is the nearest "
                                 "dispatcher", f"{_TT_NO_TOML} (Parallelism) {TT}"))}),
    # -- fixed toggles
    ToggleInfo(
        "ep_dedup", ToggleKind.FIXED, ("time.nvlink", "time.nic (one copy per destination rank)"), searched=False,
        switches={**_megatron(Switch("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep")),
                  **_tt(Switch("[parallelism] expert_parallel_comm_backend = 'deepep'"))}),
)

TOGGLES: dict[str, ToggleInfo] = {t.name: t for t in REGISTRY}


def names(kind: ToggleKind | None = None, **roles: bool) -> tuple[str, ...]:
    """The registered toggles of `kind` (any kind when None) whose roles match, in registry order; e.g.
    names(ToggleKind.RANK, memory_only=True)."""
    return tuple(t.name for t in REGISTRY if (kind is None or t.kind is kind)
                 and all(getattr(t, role) == want for role, want in roles.items()))


ACT_TOGGLES = names(ToggleKind.ACTIVATION)
"""Toggles that change the saved-for-backward set; they form one-hot activation modes with the recompute mode."""
RANK_TOGGLES = names(ToggleKind.RANK)
"""Toggles that act on one rank-level term each; Boolean decisions of the node model."""
FIXED_TOGGLES = names(ToggleKind.FIXED)
NEVER_CHOSEN = names(ToggleKind.RANK, searched=False)
"""Rank toggles the search takes only when a job requires them."""


def inapplicable(model: ModelSpec) -> tuple[tuple[str, str], ...]:
    """(toggle, why) for every toggle that changes nothing on `model` (its `needs` lacking), in registry order."""
    return tuple((t.name, why) for t in REGISTRY if t.needs is not None and (why := t.needs.lacking(model)))


def no_switch(target: str, model: ModelSpec | None = None) -> tuple[tuple[str, NoSwitch], ...]:
    """(toggle, NoSwitch) for every toggle `target` cannot switch on for `model` (any model when None), in Toggles
    field order."""
    return tuple((name, sw) for name in TOGGLE_NAMES
                 if isinstance(sw := TOGGLES[name].switch(target, model), NoSwitch))


def built_in(target: str, model: ModelSpec | None) -> tuple[tuple[str, BuiltIn], ...]:
    """(toggle, BuiltIn) for every toggle `target` always does for `model`, in Toggles field order."""
    return tuple((name, sw) for name in TOGGLE_NAMES
                 if isinstance(sw := TOGGLES[name].switch(target, model), BuiltIn))
