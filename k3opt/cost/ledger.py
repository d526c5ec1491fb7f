"""The rank ledger, declared once: every memory term a rank holds, with its phase, how it adds up over the rank's
layers and chunks, what gates it, the per-layer (or per-rank) coefficient it reads, its kind and its formula.

A rank's peak is persistent + max(activation phase, optimizer phase) (seed 001's ledger; the K3 memory lab), or
persistent + both under a full-iteration CUDA graph (`rank_peak`). The
term order below is the ledger's printed order. evaluate() (cost/evaluate.rank_ledger), the search's node model and
bounds (search/) and the reports read these declarations; the arithmetic that several of them share is named here
too (`persistent_layer_bytes`, `pp_packet_bytes`, `peak_inflight`, `optimizer_transient_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from k3opt.cost.coefficients import Coefficients
from k3opt.cost.schedule import composition_peak
from k3opt.inputs.toggles import RANK_TOGGLES, TOGGLES


class Phase(StrEnum):
    PERSISTENT = "persistent"
    """Held for the whole step: weights, gradients, optimizer state."""
    ACTIVATION = "activation"
    """Live between a microbatch's forward and its backward, and the buffers of the pipeline's steady state."""
    OPTIMIZER = "optimizer"
    """Live only during the optimizer step (after the last backward)."""


class Moment(StrEnum):
    """When, within the activation phase, a term is live: the saved state is held throughout, a layer's transients
    only while that layer runs, the loss's logits only between the last chunk's forward and its backward."""

    HELD = "held"
    LAYER = "layer"
    LOSS = "loss"


class Aggregate(StrEnum):
    """How a term's per-layer coefficient adds up to the rank's bytes."""

    LAYER_SUM = "sum over the rank's layers"
    CHUNK_PAIR = "2 x the rank's largest chunk"
    IN_FLIGHT = "each chunk's bytes x its in-flight microbatches, at the rank's peak composition"
    LARGEST_LAYER = "the rank's layer with the largest backward working set"
    MOE_RANK = "once per rank that holds a MoE layer"
    LAST_STAGE = "once, on the rank that holds the last chunk"
    STEP = "at the optimizer step: the step's gather and the Newton-Schulz working set"


@dataclass(frozen=True)
class ToggledForm:
    """The form a term takes while a rank toggle is on, when the toggle changes how it adds up, not only its
    coefficient."""

    toggle: str
    aggregate: Aggregate
    coefficient: str


@dataclass(frozen=True)
class TermDecl:
    key: str
    phase: Phase
    aggregate: Aggregate
    coefficient: str
    """The Coefficients field the term reads (per layer, or per rank for MOE_RANK and LAST_STAGE)."""
    gate: str | None
    """What switches the term on or off or changes its form: a toggle, the FSDP lifecycle, a sharding policy,
    the compute precision; None: always held."""
    kind: str
    """derived (from shapes) | assumption (a modelling choice, named)."""
    formula: str
    toggled: ToggledForm | None = None
    """Its form while a rank toggle is on, where that differs from `aggregate` over `coefficient`."""
    per_lifecycle: bool = False
    """The FSDP lifecycle (a decision of the search) changes its coefficient."""
    moment: Moment = Moment.HELD
    """Within the activation phase, when the term is live (k3opt.cost.ledger.activation_moments)."""


LEDGER: tuple[TermDecl, ...] = (
    TermDecl("master", Phase.PERSISTENT, Aggregate.LAYER_SUM, "master", "dense/expert sharding policy",
             "derived", "FP32 master shard: 4 x (D/f_d + E/(e f_e))"),
    TermDecl("grads", Phase.PERSISTENT, Aggregate.LAYER_SUM, "grads", "pipeline_zero2_host_grads (CHUNK_PAIR of "
             "chunk_grad_buffer when on); sharding policy", "derived",
             "FP32 gradient shard: 4 x resident parameters (pipeline ZeRO-2: two FP32 chunk-sized buffers, the "
             "shards on the host)",
             ToggledForm("pipeline_zero2_host_grads", Aggregate.CHUNK_PAIR, "chunk_grad_buffer")),
    TermDecl("optimizer", Phase.PERSISTENT, Aggregate.LAYER_SUM, "optimizer", "optimizer state dtype, granularity",
             "derived", "Muon momentum 4 x resident Muon params + AdamW moments 8 x resident AdamW params"),
    TermDecl("bf16_view", Phase.PERSISTENT, Aggregate.LAYER_SUM, "bf16_view", "sharding policy", "derived",
             "BF16 gathered compute view: 2 x (D + E/e), kept for the whole update (param_gather = layer: the "
             "layers' compute-weight shard, FP8 1 x or BF16 2 x (D/f_d + E/(e f_e)); the edges gathered whole; "
             "fp8_param_gather: none for the weights stored in the compute precision)"),
    TermDecl("moonep_slots", Phase.PERSISTENT, Aggregate.LAYER_SUM, "moonep_slots", "moonep", "derived",
             "MoonEP redundant slots: room for one more BF16 copy of the local experts"),
    TermDecl("grad_accum", Phase.PERSISTENT, Aggregate.LAYER_SUM, "grad_accum", "fsdp_lifecycle = accumulate",
             "derived", "unsharded FP32 gradient accumulation buffer 4 x (D + E/e) (accumulate lifecycle)",
             per_lifecycle=True),
    TermDecl("moonep_buffers", Phase.PERSISTENT, Aggregate.MOE_RANK, "moonep_buffers", "moonep", "assumption",
             "MoonEP fixed all-to-all buffers, sized as the dispatch + combine buffers of one MoE layer at uniform "
             "routing, allocated for the whole run"),
    TermDecl("quantized_weights", Phase.PERSISTENT, Aggregate.LAYER_SUM, "quantized_weights", "precision",
             "derived", "FP8/FP4 compute precision: cached row- and column-wise quantized copies of the local "
             "linear-layer weights, 2 x (b + 1/block) x params (0 under BF16, and for layers gathered per layer; "
             "fp8_param_gather: the weights themselves, MXFP8 both copies, per-tensor FP8 one shared buffer, "
             "(b + 1/block) x params)"),
    TermDecl("paged_stash", Phase.PERSISTENT, Aggregate.IN_FLIGHT, "stash", "moe_paged_stash", "derived",
             "Megatron's paged stash: one static CUDA buffer of the CUDA factor x the rank's peak in-flight routed "
             "experts' saved bytes at balanced routing, held for the whole step (its host spill buffer in host "
             "memory)"),
    TermDecl("activations", Phase.ACTIVATION, Aggregate.IN_FLIGHT, "act", "recompute mode, activation toggles, "
             "activation_offload, offload_modules, balance_activations", "derived",
             "saved-for-backward tensors x in-flight microbatches (full recompute: one BF16 [T, d] layer input per "
             "layer; activation_offload_layers: the first N layers' in host memory; offload_modules: those "
             "modules' tensors in host memory; the routed experts' x moe_expert_rank_capacity_factor, or in the "
             "paged stash)"),
    TermDecl("attnres_bank", Phase.ACTIVATION, Aggregate.IN_FLIGHT, "closes", "balance_activations", "derived",
             "AttnRes residual streams the rank holds: R(end of chunk) x BF16 [T, d] per in-flight microbatch"),
    TermDecl("recompute_working_set", Phase.ACTIVATION, Aggregate.LARGEST_LAYER, "recompute_ws",
             "recompute mode, offload_modules", "derived", "saved set of the one layer being recomputed in backward, "
             "or reloaded from the host (offload_modules: its own and the prefetched next layer's)",
             moment=Moment.LAYER),
    TermDecl("grad_transient", Phase.ACTIVATION, Aggregate.LARGEST_LAYER, "working_set", "CP",
             "derived", "that layer's unsharded BF16 weight gradient before its reduce-scatter, plus two BF16 "
             "[T, d] gradient streams (with CP: plus the KV ring or state-gather buffers; param_gather = layer: two "
             "gathered units, two gradient buckets and the largest fresh weight gradient)", moment=Moment.LAYER),
    TermDecl("pp_buffers", Phase.ACTIVATION, Aggregate.CHUNK_PAIR, "closes", None, "assumption",
             "one forward and one backward packet in each direction live: 2 x max over chunks (in + out packet), "
             "packet = (1 + R) x BF16 [T, d]"),
    TermDecl("ep_buffers", Phase.ACTIVATION, Aggregate.MOE_RANK, "ep_buffers", None, "derived",
             "dispatch receive + combine buffers of one MoE layer: 2 x T x k x latent x 2 B (x "
             "moe_expert_rank_capacity_factor)", moment=Moment.LAYER),
    TermDecl("routing_map", Phase.ACTIVATION, Aggregate.MOE_RANK, "routing_map", "dispatcher", "derived",
             "HybridEP Boolean routing map gathered across EP: e x T x experts bytes"),
    TermDecl("logits", Phase.ACTIVATION, Aggregate.LAST_STAGE, "logits", "fused_cross_entropy", "derived",
             "last stage: [T, vocab] BF16 logits + FP32 softmax for the cross-entropy, plus each MTP head's FP32 "
             "softmax saved before it", moment=Moment.LOSS),
    TermDecl("optimizer_transient", Phase.OPTIMIZER, Aggregate.STEP, "ns_working_set", "p2p_muon, sharding policy",
             "derived", "without P2P Muon: the full BF16 parameter group all-gathered at the step (2 x (D + E/e)); "
             "with P2P Muon: the pulled share; plus the largest Newton-Schulz working set; with a BF16 gradient "
             "buffer, the owned shard's FP32 gradient copy (4 x owned parameters)"),
)

TERMS: dict[str, TermDecl] = {t.key: t for t in LEDGER}
PERSISTENT: tuple[str, ...] = tuple(t.key for t in LEDGER if t.phase is Phase.PERSISTENT)
ACTIVATION: tuple[str, ...] = tuple(t.key for t in LEDGER if t.phase is Phase.ACTIVATION)
OPTIMIZER: tuple[str, ...] = tuple(t.key for t in LEDGER if t.phase is Phase.OPTIMIZER)
MOMENT_TERMS: dict[Moment, tuple[str, ...]] = {mo: tuple(t.key for t in LEDGER if t.phase is Phase.ACTIVATION
                                                          and t.moment is mo) for mo in Moment}


def activation_moments(concurrent: bool) -> tuple[tuple[Moment, ...], ...]:
    """The moments live together at some instant of the activation phase; the phase is the largest of their sums.
    One schedule step runs one microbatch's forward or backward on a rank (Megatron's 1F1B, interleaved too: the
    last rank runs F(last chunk, m) then B(last chunk, m), and B starts with the loss's backward, which frees the
    logits), so the loss and a layer's transients are never live together; under the EP overlap schedule
    (`concurrent`: Megatron's combined 1F1B) a forward and a backward run in one step, and they are."""
    if concurrent:
        return ((Moment.HELD, Moment.LAYER, Moment.LOSS),)
    return ((Moment.HELD, Moment.LAYER), (Moment.HELD, Moment.LOSS))


def _group_bytes(values: dict[str, float], group: tuple[Moment, ...]) -> float:
    """The ledger `values` of the activation terms live at the moments of `group`."""
    return sum(values[k] for mo in group for k in MOMENT_TERMS[mo])


def activation_phase_bytes(values: dict[str, float], concurrent: bool) -> float:
    """The activation phase of one rank from its ledger `values`: held + the larger of a layer's transients and the
    loss's logits, or all three under the EP overlap schedule (`activation_moments`)."""
    return max(_group_bytes(values, group) for group in activation_moments(concurrent))


def rank_peak(persistent: float, activation_phase: float, optimizer_phase: float, graph_pool: bool) -> float:
    """A rank's ledger peak: persistent + max(activation phase, optimizer phase) (seed 001's ledger: the phases never
    overlap), or persistent + both under a full-iteration CUDA graph (`graph_pool`): the graph's private pool keeps
    the activation phase's bytes for replay, and the optimizer step, run eagerly outside the graph, takes its
    transients from the ordinary pool (Megatron-LM@d98e8a64 full_cuda_graph.py L206-243, training.py L4433-4453,
    transformer_config.py L1049-1053; Megatron-Bridge@067f987d training/train.py L315-326, no optimizer graph in
    the recipes; PyTorch RFC #51075: a graph's private pool serves only its captures). Between replays the pool's
    blocks are free but reserved: counted here as live, they also take the allocator slack, so a measured
    'allocated' figure of such a run reads lower than this peak."""
    if graph_pool:
        return persistent + activation_phase + optimizer_phase
    return persistent + max(activation_phase, optimizer_phase)


def least_transient(layer: float | np.ndarray, loss: float | np.ndarray) -> float | np.ndarray:
    """What a layer's transients and the loss's logits add to the held bytes at the least, under either schedule
    (`activation_moments`): the larger of the two (under the EP overlap schedule their sum, which is more). The
    bounds read this form, valid for every layout."""
    return np.maximum(layer, loss)


def binding_activation_terms(values: dict[str, float], concurrent: bool) -> tuple[str, ...]:
    """The activation terms of the group that makes the phase (what a stacked ledger draws)."""
    group = max(activation_moments(concurrent), key=lambda g: _group_bytes(values, g))
    return tuple(k for k in ACTIVATION if TERMS[k].moment in group)


TERM_INFO: dict[str, tuple[str, str]] = {t.key: (t.kind, t.formula) for t in LEDGER}
"""key -> (kind, formula), as the ledger prints them."""


def rank_gate(key: str) -> str | None:
    """The rank toggle that changes ledger term `key` (k3opt.inputs.toggles: its `changes`), or None. A term that
    two rank toggles change would need its own pricing in every reader; none does."""
    gates = [t for t in RANK_TOGGLES if key in TOGGLES[t].changes]
    if len(gates) > 1:
        raise ValueError(f"ledger term {key} is changed by the rank toggles {gates}: give it its own pricing")
    return gates[0] if gates else None


ALWAYS_HELD: tuple[str, ...] = tuple(t.key for t in LEDGER
                                     if t.phase is Phase.PERSISTENT and t.aggregate is Aggregate.LAYER_SUM
                                     and rank_gate(t.key) is None and t.toggled is None and not t.per_lifecycle)
"""The persistent per-layer terms that no decision of the search changes (master, optimizer state, BF16 view,
quantized copies): a rank toggle changes the gradients (pipeline ZeRO-2) and the MoonEP slots, the FSDP lifecycle
the accumulation buffer."""


def layer_bytes(cf: Coefficients, keys: Sequence[str]) -> np.ndarray:
    """Per layer, the sum of the declared per-layer coefficients of the ledger terms `keys`, added in that order."""
    return declared_layer_bytes(cf, [TERMS[key] for key in keys])


def declared_layer_bytes(cf: Coefficients, decls: Sequence[TermDecl]) -> np.ndarray:
    """Per layer, the sum of the per-layer coefficients that the declarations `decls` read, added in that order."""
    total = np.zeros_like(cf.master, dtype=float)
    for t in decls:
        total = total + getattr(cf, t.coefficient)
    return total


def persistent_layer_bytes(cf: Coefficients) -> np.ndarray:
    """Per layer, the bytes of the always-held persistent terms (ALWAYS_HELD): what every rank holding that layer
    holds for the whole step, whatever the search decides."""
    return layer_bytes(cf, ALWAYS_HELD)


def pp_packet_bytes(streams: float | np.ndarray, stream_bytes: float) -> float | np.ndarray:
    """One PP packet: the hidden stream plus the R AttnRes residual streams open at the boundary, (1 + R) x BF16
    [T, d]."""
    return (1 + streams) * stream_bytes


def pp_packet_terms(stream_bytes: float) -> tuple[float, float]:
    """(a PP packet's bytes with no residual stream open, the bytes each open stream adds): `pp_packet_bytes` is
    linear in the streams, so a program over the split writes a packet as the first plus R times the second."""
    base = float(pp_packet_bytes(0.0, stream_bytes))
    return base, float(pp_packet_bytes(1.0, stream_bytes)) - base


def balanced_scale(balanced_inflight: float | None, n_peak: float) -> float:
    """The factor on a rank's in-flight saved bytes and bank under activation balancing: every rank holds the
    average count, balanced / its own peak (above 1 on the late ranks); 1 without balancing (K3 paper section
    5.2.2, seed 001: the in-flight count becomes the ranks' average)."""
    return balanced_inflight / n_peak if balanced_inflight is not None else 1.0


peak_inflight = composition_peak
"""The most chunk-microbatches a rank holds at once over its in-flight compositions (k3opt.cost.schedule)."""


def optimizer_transient_bytes(gather: float, ns_working_set: float, with_ns: bool) -> float:
    """The optimizer phase: the step's BF16 gather plus the Newton-Schulz working set when both are live together
    (the default policy), else the larger of the two (the layer-wise optimizer gathers after step() frees its
    Newton-Schulz buffers, seed 003)."""
    return gather + ns_working_set if with_ns else max(gather, ns_working_set)
