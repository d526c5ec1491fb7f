"""Per-layer cost coefficients of one layout shape (everything but the split).

This is the one home of every byte and FLOP formula. For a shape it returns arrays over the L layers plus
two edge entries (index L: embedding + vision on the first chunk; index L + 1: final norm + LM head on the
last chunk). `evaluate()` sums them over a split; the search builds its CP-SAT constraints from the same
arrays. All values are float64 bytes, FLOPs or seconds per GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np

from k3opt.cost import comm
from k3opt.cost.schedule import (
    backward_over_forward,
    composition_peak,
    inflight_compositions,
    offload_stall,
    schedule_slots,
)
from k3opt.cost.sharding import count_owned_per_rank, count_whole_params
from k3opt.cost.structure import (
    Block,
    Saved,
    Structure,
    Tensor,
    module_offload,
    module_recompute,
    replays,
    structure_of,
)
from k3opt.inputs.memo import Memo, register
from k3opt.inputs.placement import domain_block
from k3opt.inputs.rates import TE_CROSS_ENTROPY_BYTES_PER_LOGIT, RatesSpec, rates_for
from k3opt.inputs.specs import (
    BF16,
    FP32,
    ClusterSpec,
    Dtype,
    FsdpLifecycle,
    Layout,
    ModelSpec,
    MoESpec,
    ParamGather,
    Precision,
    Recompute,
    ShardGranularity,
    ShardingPolicy,
    Toggles,
    quantized_bytes_per_element,
)

R = TypeVar("R")


@dataclass(frozen=True)
class Shape:
    """A layout without its split: the degrees, the microbatching and the toggles."""

    gpus: int
    pp: int
    vp: int
    cp: int
    ep: int
    expert_fsdp: int
    dense_fsdp: int
    microbatches: int
    rows: int
    context: int
    document_length: int
    recompute: Recompute
    fsdp_lifecycle: FsdpLifecycle
    toggles: Toggles
    fp8_block_size: int = 128
    recompute_modules: tuple[str, ...] = ()
    """Megatron's selective recompute modules (Layout.recompute_modules); empty: k3opt's selective set."""
    ce_chunk_tokens: int = 1024
    offload_resident_layers: int = 2
    activation_offload_layers: int = 0
    offload_modules: tuple[str, ...] = ()
    """Megatron's fine-grained activation offload modules (Layout.offload_modules)."""
    domain_gpus_used: int | None = None
    dense_sharding: ShardingPolicy = ShardingPolicy.OPTIM_GRADS_PARAMS
    expert_sharding: ShardingPolicy = ShardingPolicy.OPTIM_GRADS_PARAMS
    optimizer_shard_granularity: ShardGranularity = ShardGranularity.ELEMENT
    param_gather: ParamGather = ParamGather.UPDATE
    grad_dtype: Dtype = Dtype.FP32
    optimizer_state_dtype: Dtype | None = None
    """None: the model's optimizer.state_dtype."""
    lazy_optimizer_state: bool = False
    precision: Precision = Precision.BF16
    """Compute precision of the linear GEMMs; a search enumerates it from Job.precisions."""
    fp8_param_gather: bool = False
    """Layout.fp8_param_gather: those GEMMs' weights stored only in the compute precision."""
    ep_overlap: bool = False
    delay_wgrad_compute: bool = False
    """Layout.delay_wgrad_compute: under the EP overlap schedule, the experts' weight gradients run after the
    backward dispatch is released."""
    dispatcher: str | None = None
    capacity_factor: float | None = None
    """Layout.moe_expert_rank_capacity_factor."""
    paged_stash: tuple[float, float] | None = None
    """Layout.moe_paged_stash's (CUDA, host) buffer factors; None: no paged stash."""

    @classmethod
    def of(cls, layout: Layout) -> Shape:
        return cls(
            gpus=layout.gpus, pp=layout.pp, vp=layout.vp, cp=layout.cp, ep=layout.ep,
            expert_fsdp=layout.expert_fsdp, dense_fsdp=layout.dense_fsdp, microbatches=layout.microbatches,
            rows=layout.rows, context=layout.context, document_length=layout.effective_document_length,
            recompute=layout.recompute, fsdp_lifecycle=layout.fsdp_lifecycle, toggles=layout.toggles,
            fp8_block_size=layout.fp8_block_size, ce_chunk_tokens=layout.ce_chunk_tokens,
            offload_resident_layers=layout.offload_resident_layers, domain_gpus_used=layout.domain_gpus_used,
            activation_offload_layers=layout.activation_offload_layers,
            dense_sharding=layout.dense_sharding, expert_sharding=layout.expert_sharding,
            optimizer_shard_granularity=layout.optimizer_shard_granularity, param_gather=layout.param_gather,
            grad_dtype=layout.grad_dtype,
            optimizer_state_dtype=layout.optimizer_state_dtype, lazy_optimizer_state=layout.lazy_optimizer_state,
            precision=layout.precision, ep_overlap=layout.ep_overlap, dispatcher=layout.dispatcher,
            delay_wgrad_compute=layout.delay_wgrad_compute,
            fp8_param_gather=layout.fp8_param_gather,
            recompute_modules=tuple(m.value for m in layout.recompute_modules),
            offload_modules=tuple(m.value for m in layout.offload_modules),
            capacity_factor=layout.moe_expert_rank_capacity_factor,
            paged_stash=(layout.moe_paged_stash_buffer_size_factor_cuda,
                         layout.moe_paged_stash_buffer_size_factor_cpu) if layout.moe_paged_stash else None,
        )

    @property
    def tokens(self) -> int:
        """Local tokens per microbatch T = rows * context / c."""
        return self.rows * self.context // self.cp

    @property
    def chunks(self) -> int:
        return self.pp * self.vp

    @property
    def dp(self) -> int:
        return self.gpus // (self.pp * self.cp)

    @property
    def tokens_per_update(self) -> int:
        """DP * M * rows * context (seed 000: 64 * 64 * 1 * 4096 = 16,777,216)."""
        return self.dp * self.microbatches * self.rows * self.context


@dataclass(frozen=True)
class LayerShape:
    """What the per-layer arrays of a Shape read: the shape without its pipeline schedule (gpus, pp, vp,
    microbatches), which reaches them only through the members per NVLink domain of the EP, FSDP and CP groups.
    The search's shapes that differ only in their schedule share one build of the arrays (the cache key), and so
    do shapes that differ only in activation balancing, which reaches the in-flight count alone (the key holds
    the toggles with balancing off)."""

    tokens: int
    context: int
    document_length: int
    cp: int
    ep: int
    expert_fsdp: int
    dense_fsdp: int
    recompute: Recompute
    recompute_modules: tuple[str, ...]
    activation_offload_layers: int
    offload_modules: tuple[str, ...]
    offload_resident_layers: int
    fsdp_lifecycle: FsdpLifecycle
    toggles: Toggles
    fp8_block_size: int
    ce_chunk_tokens: int
    dense_sharding: ShardingPolicy
    expert_sharding: ShardingPolicy
    optimizer_shard_granularity: ShardGranularity
    param_gather: ParamGather
    grad_dtype: Dtype
    optimizer_state_dtype: Dtype | None
    precision: Precision
    fp8_param_gather: bool
    dispatcher: str | None
    capacity_factor: float | None
    paged_stash: tuple[float, float] | None
    ep_local: int
    """Members per NVLink domain (comm.Placement) of the EP, dense FSDP and expert FSDP groups; the CP groups'."""
    dense_fsdp_local: int
    expert_fsdp_local: int
    cp_in_domain: bool

    @classmethod
    def of(cls, shape: Shape, pl: comm.Placement) -> LayerShape:
        # Activation balancing reaches the in-flight count only (Coefficients.balanced_inflight), no per-layer
        # array: the shapes with and without it share one build (the search's bounds price both settings).
        tg = shape.toggles.model_copy(update={"balance_activations": False}) if shape.toggles.balance_activations \
            else shape.toggles
        return cls(
            tokens=shape.tokens, context=shape.context, document_length=shape.document_length, cp=shape.cp,
            ep=shape.ep, expert_fsdp=shape.expert_fsdp, dense_fsdp=shape.dense_fsdp, recompute=shape.recompute,
            recompute_modules=shape.recompute_modules, activation_offload_layers=shape.activation_offload_layers,
            offload_modules=shape.offload_modules,
            # Read only under offload modules: elsewhere one key for every count, so the builds are shared.
            offload_resident_layers=shape.offload_resident_layers if shape.offload_modules else 0,
            fsdp_lifecycle=shape.fsdp_lifecycle, toggles=tg, fp8_block_size=shape.fp8_block_size,
            ce_chunk_tokens=shape.ce_chunk_tokens, dense_sharding=shape.dense_sharding,
            expert_sharding=shape.expert_sharding, optimizer_shard_granularity=shape.optimizer_shard_granularity,
            param_gather=shape.param_gather, grad_dtype=shape.grad_dtype,
            optimizer_state_dtype=shape.optimizer_state_dtype,
            precision=shape.precision, fp8_param_gather=shape.fp8_param_gather, dispatcher=shape.dispatcher,
            capacity_factor=shape.capacity_factor, paged_stash=shape.paged_stash,
            ep_local=pl.ep_local,
            dense_fsdp_local=pl.dense_fsdp_local, expert_fsdp_local=pl.expert_fsdp_local,
            cp_in_domain=pl.cp_in_domain,
        )


RESOURCES = ("tensor", "hbm", "nvlink", "nic", "host_link")
HIERARCHICAL_DISPATCHERS = ("hybridep", "deepep")
"""EP dispatchers that cross NVLink domains once per destination domain and forward inside it."""
DEFAULT_DISPATCHER = "hybridep"
"""Whose measured all-to-all bandwidth the achievable roofline uses when a layout names no dispatcher."""


@dataclass
class Coefficients:
    """Arrays of length L + 2 (layers, then the first-chunk edge, then the last-chunk edge)."""

    shape: Shape
    n_layers: int
    tokens: int
    hidden: int
    # persistent bytes
    master: np.ndarray = field(repr=False)
    grads: np.ndarray = field(repr=False)
    optimizer: np.ndarray = field(repr=False)
    bf16_view: np.ndarray = field(repr=False)
    moonep_slots: np.ndarray = field(repr=False)
    grad_accum: np.ndarray = field(repr=False)
    chunk_grad_buffer: np.ndarray = field(repr=False)
    """FP32 bytes of one unsharded chunk gradient (pipeline ZeRO-2 keeps two such buffers)."""
    host_grads: np.ndarray = field(repr=False)
    # activation-phase bytes
    act: np.ndarray = field(repr=False)
    """Saved bytes per in-flight microbatch kept on the GPU (before the activation_offload toggle)."""
    offloaded_act: np.ndarray = field(repr=False)
    """Saved bytes per in-flight microbatch the layout's activation_offload_layers or offload_modules keep in host
    memory."""
    stash: np.ndarray = field(repr=False)
    """Under Megatron's paged stash, per in-flight microbatch: the routed experts' saved bytes at balanced routing
    x the CUDA buffer factor (the static buffer is this at the rank's peak composition); out of `act`. Zeros
    without the paged stash."""
    stash_host: np.ndarray = field(repr=False)
    """The same x the host spill buffer's factor, in pinned host memory."""
    working_set: np.ndarray = field(repr=False)
    """Bytes live only while this layer runs backward: its recomputed saved set (selective/full recompute) or its
    reloaded one (offload_modules), its unsharded gradient before the reduce-scatter, the two BF16 gradient
    streams."""
    recompute_ws: np.ndarray = field(repr=False)
    """Saved bytes brought back for the layer's backward: recomputed, or reloaded from the host (offload_modules)."""
    grad_transient: np.ndarray = field(repr=False)
    closes: np.ndarray = field(repr=False)
    """AttnRes residual blocks closed by each layer; R(b) = cumulative sum up to boundary b."""
    moe: np.ndarray = field(repr=False)
    view_params: np.ndarray = field(repr=False)
    resident_params: np.ndarray = field(repr=False)
    ns_working_set: np.ndarray = field(repr=False)
    ns_flops: np.ndarray = field(repr=False)
    """Newton-Schulz FLOPs per update this rank does for each layer's Muon matrices (its share)."""
    ns_flops_routed: np.ndarray = field(repr=False)
    # per-microbatch work (seconds on each resource) and per-update work
    time: dict[str, np.ndarray] = field(repr=False)
    update: dict[str, np.ndarray] = field(repr=False)
    tensor_flops: np.ndarray = field(repr=False)
    model_flops_per_token: float = 0.0
    # rank-level constants
    stream_bytes: int = 0
    """One BF16 [T, d] stream."""
    ep_buffers: float = 0.0
    moonep_buffers: float = 0.0
    routing_map: float = 0.0
    routing_map_allgathers_per_layer: int = 0
    logits: float = 0.0
    logits_formula: str = ""
    compositions: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """compositions[r]: the in-flight chunk-microbatch vectors rank r passes through."""
    balanced_inflight: float | None = None
    placement: comm.Placement | None = None
    slots: float = 0.0
    pp_seconds_per_byte: tuple[float, ...] = ()
    """For each rank boundary r -> r+1: seconds per PP packet byte (NVLink or NIC)."""
    pp_on_nvlink: tuple[bool, ...] = ()
    balance_resource: str = "nic"
    balance_seconds_per_byte: float = 0.0
    step_gather: np.ndarray | None = field(default=None, repr=False)
    """BF16 bytes all-gathered into fresh buffers at the optimizer step (without P2P Muon), by sharding policy."""
    p2p_step_gather: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """The step's fresh BF16 bytes under P2P Muon: the pulled resident Muon matrices (2 x resident Muon
    parameters) and the AdamW parameters' policy gather."""
    state_bytes: int = 4
    """Bytes per optimizer-state element: the layout's optimizer_state_dtype, else the model's."""
    step_grad_copy: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """FP32 copies of the owned gradient shard made at the optimizer step when the gradient buffer is BF16 (zero with
    FP32 gradients): the step's FP32 main parameters take FP32 gradients."""
    step_gather_with_ns: bool = True
    """The Newton-Schulz working set adds to the step gather (default policy) instead of preceding it."""
    cost: CostModel | None = field(default=None, repr=False)
    """The CostModel that built these coefficients (its caches of the parameters a rank owns); every build sets it,
    the default only keeps the field order."""
    gemm_flops: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Per-microbatch FLOPs of the linear GEMMs that run in the compute precision (0 under BF16)."""
    quantized_weights: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Cached low-precision weight copies (row- and column-wise, with block scales) of the local GEMM weights, per
    layer (zeros under BF16); the builder always sets it, the default only keeps the field order."""
    achievable: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    """Seconds per microbatch per resource at the achievable rates (empty without a rates file); `ep_nvlink` and
    `ep_nic` hold the EP all-to-all apart from the other NVLink / NIC traffic."""
    update_achievable: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    pp_seconds_per_byte_achievable: tuple[float, ...] = ()
    rates_name: str = ""
    moe_compute_achievable: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Per layer, seconds per microbatch of the routed-expert part of its compute at the achievable rates
    (the sum of CostModel.expert_compute's parts; the rest of `achievable` tensor + vector is the pre-dispatch
    part); empty without rates. The EP overlap schedule pairs each all-to-all with one of the two parts
    (achievable.py)."""
    moe_vector_achievable: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """The memory-bound kernels' share of `moe_compute_achievable` (the rest is its tensor-core time); part of the
    `vector` resource, as the routed GEMMs' time is part of `tensor`."""
    update_hidden: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    """Per-update seconds that hide under `update_hidden_stages` stage-microbatches of compute; only what exceeds
    that window adds to the step (empty in the cost model's own coefficients: the roofline exposes the whole update;
    set by the achievable ranking view, k3opt.cost.achievable.ranking_view)."""
    update_hidden_stages: float = 0.0
    offload_stall: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Per layer, seconds per microbatch the compute stream waits for activation_offload_layers' copies at the
    peak rates (_offload_stall); already part of `time["tensor"]`."""
    offload_stall_achievable: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    """The same at the achievable rates; already part of `achievable["tensor"]`."""

    @property
    def first(self) -> int:
        return self.n_layers

    @property
    def last(self) -> int:
        return self.n_layers + 1


def saved_per_token(block: Block, toggles: Toggles, fp8_block: int, precision: Precision = Precision.BF16,
                    routed: bool | None = None, only: frozenset[str] | None = None) -> tuple[float, float, float]:
    """(all saved bytes, recomputable bytes, FP8-stored bytes) per token of one block after the toggles:
    fused SiTU swaps six FP32 [R, H] copies for the BF16 [R, 2H] input (seed 004); dispatch recompute drops
    the dispatched copies; the MoE backward rewrite drops the expert outputs (seed 001); FP8 stores GEMM
    inputs in 1 byte plus one FP32 scale per `fp8_block` elements. A low compute precision saves each GEMM
    input as the quantized copy the wgrad GEMM reads (Transformer Engine keeps the column-wise usage,
    TransformerEngine PR #1596): b + 1/block bytes per element; a GEMM that stays BF16 (router, output layer)
    keeps the BF16 input besides (or instead of) that copy. FP8 storage (the toggle) compresses every GEMM input.
    `routed`: only the routed experts' saved tensors (True), only the others (False), or all (None); `only`: only
    the saved tensors of these names."""
    total = recomputable = fp8 = 0.0
    for s in block.saved:
        if not _kept(s, toggles) or (routed is not None and s.routed != routed) or (only is not None
                                                                                    and s.name not in only):
            continue
        if s.copy_only and precision == Precision.BF16 and not toggles.fp8_activations:
            continue
        b = float(s.bytes_per_token)
        if precision != Precision.BF16 and s.gemm_input:
            b = s.values_per_token * (quantized_bytes_per_element(precision) * s.quantized_reader
                                      + BF16 * s.bf16_reader)
        elif toggles.fp8_activations and s.gemm_input:
            b = s.values_per_token * (1 + FP32 / fp8_block)
            fp8 += s.values_per_token
        total += b
        if s.recomputable:
            recomputable += b
    return total, recomputable, fp8


MEMORY_BOUND_FORWARD_PASSES = 2
"""HBM passes of the memory-bound kernels between the GEMMs over each saved tensor in forward: its producer
writes it, its consumer reads it."""
MEMORY_BOUND_BACKWARD_PASSES = 3
"""The same in backward: read again as a saved input, and met by a gradient of its size (written, then read)."""


def memory_bound_passes(full: bool) -> int:
    """HBM passes of a decoder layer's memory-bound kernels over each saved tensor per microbatch: 2 forward + 3
    backward, and under full recompute 2 more (the replayed forward runs its kernels again): 5, or 7. Passes, not
    FLOPs: the FLOP factor 4/3 (recompute_flops_factor) would price the replay at 5/3 passes."""
    return MEMORY_BOUND_FORWARD_PASSES + MEMORY_BOUND_BACKWARD_PASSES + (MEMORY_BOUND_FORWARD_PASSES if full else 0)


def memory_bound_kernel_bytes(saved: np.ndarray, full: bool) -> np.ndarray:
    """HBM bytes per microbatch of the memory-bound kernels (norms, activations, permutes, residual adds) over the
    saved tensors of each layer and edge (`saved`: bytes, length L + 2): memory_bound_passes x bytes on the decoder
    layers (5, or 7 under full recompute), 5 x bytes on the edges (they are not checkpointed)."""
    passes = np.where(np.arange(len(saved)) < len(saved) - 2, memory_bound_passes(full), memory_bound_passes(False))
    return passes * saved


def memory_bound_forward_share(full: bool) -> float:
    """Share of a decoder layer's memory-bound kernel traffic (memory_bound_kernel_bytes) its forward stage runs:
    forward passes / all passes, 2/5; under full recompute the replayed forward runs in the backward stage, 2/7."""
    return MEMORY_BOUND_FORWARD_PASSES / memory_bound_passes(full)


def forward_backward(tensor: np.ndarray, vector: np.ndarray, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of compute-stream work, each part split by its own ratio: tensor-core time
    1 : beta as the replayed schedule splits a chunk (schedule.chunk_times: beta = BACKWARD_OVER_FORWARD, one more
    forward under full recompute, whose replay runs in the backward stage), memory-bound kernel time by the share
    of their passes the forward runs (coefficients.memory_bound_forward_share: 2 of 5, 2 of 7 under full recompute)."""
    f_tensor = 1.0 / (1.0 + backward_over_forward(full))
    f_vector = memory_bound_forward_share(full)
    fwd = f_tensor * tensor + f_vector * vector
    return fwd, (1.0 - f_tensor) * tensor + (1.0 - f_vector) * vector


def _kept(s: Saved, t: Toggles) -> bool:
    if s.role == "situ_naive":
        return not t.fused_situ
    if s.role == "situ_fused":
        return t.fused_situ
    if s.role == "dispatch_copy":
        return not t.dispatch_recompute
    if s.role == "expert_output":
        return not t.moe_backward_rewrite
    return True


def balance_moved_bytes(saved_bytes, held: float, balanced: float):  # noqa: ANN001, ANN201 - float or array
    """Activation balancing (seed 001): a rank holding `held` in-flight microbatches keeps the average `balanced`
    and sends the excess share of each microbatch's saved bytes to another rank and back: 2 S max(0, 1 - avg/n)."""
    return 2 * saved_bytes * max(0.0, 1 - balanced / held)


def busiest_layer_seconds(cf: Coefficients) -> np.ndarray:
    """Per layer (the two edges last), the seconds per microbatch of its busiest resource, max over `cf.time`: the
    work the heuristic splits balance, the replay's per-layer maxima and its seed paths' weights."""
    return np.max([np.asarray(t, dtype=float) for t in cf.time.values()], axis=0)


def step_gather_bytes(cf: Coefficients, p2p_muon: bool) -> np.ndarray:
    """Per-layer bytes the optimizer step adds beside the Newton-Schulz working set (evaluate.rank_ledger): under
    P2P Muon the pulled resident Muon matrices, 2 x resident Muon parameters, beside the AdamW parameters' policy
    gather (P2P Muon changes only how Muon's matrices meet); else the sharding policy's step gather (2 x the BF16
    view where the coefficients have none); plus the FP32 copies of a BF16 gradient shard (step_grad_copy)."""
    copy = step_grad_copy_bytes(cf)
    if p2p_muon:
        return cf.p2p_step_gather + copy
    return policy_step_gather(cf) + copy


def policy_step_gather(cf: Coefficients) -> np.ndarray:
    """Per-layer BF16 bytes the sharding policy all-gathers into fresh buffers at the step (2 x the BF16 view where
    the coefficients have none)."""
    return 2 * cf.view_params if cf.step_gather is None else cf.step_gather


def step_grad_copy_bytes(cf: Coefficients) -> np.ndarray | float:
    """Per-layer FP32 copies of the owned gradient shard at the step (0 where the coefficients have none)."""
    return cf.step_grad_copy if len(cf.step_grad_copy) else 0.0


def newton_schulz_flops(rows: int, cols: int, iterations: int = 5) -> int:
    """Muon Newton-Schulz on an [r, c] matrix (r <= c): iterations * (4 r^2 c + 2 r^3) (seed 002)."""
    r, c = min(rows, cols), max(rows, cols)
    return iterations * (4 * r * r * c + 2 * r ** 3)


def newton_schulz_bytes(rows: int, cols: int) -> int:
    """BF16 working set of one Newton-Schulz: X and the next X [r, c], A = X X^T and B [r, r]."""
    r, c = min(rows, cols), max(rows, cols)
    return BF16 * (2 * r * c + 2 * r * r)


def _hier(total: np.ndarray, n: int, a: int) -> tuple[np.ndarray, np.ndarray]:
    nvl, nic = comm.hierarchical_split(1.0, n, a)
    return total * nvl, total * nic


def quantized_gemm(block: Block, t: Tensor) -> bool:
    """Megatron with Transformer Engine runs the decoder's linear layers in FP8/FP4; the router, the embedding,
    the output layer (and the MTP head pass sharing it) and the vision tower stay BF16."""
    return (t.is_matrix and t.active_per_token > 0 and block.kind not in ("embedding", "head", "vision")
            and not t.name.endswith(("router", "shared_head", "lm_head")))


def coefficients(shape: Shape, model: ModelSpec, cluster: ClusterSpec, rates: RatesSpec | None = None) -> Coefficients:
    """Per-layer arrays of one shape. `rates`: the achievable rates (default: the shipped rates file named like
    the cluster, if any); without rates the achievable arrays are empty and only the peak roofline exists."""
    return cost_model(model, cluster, rates).coefficients(shape)


class CostModel:
    """One model on one cluster under one set of achievable rates (None: the peak roofline only), and the caches of
    what is built from them: the model's shape-independent arrays (`static`), the saved bytes of a token count,
    each LayerShape's per-layer terms, each Shape's coefficients, the parameters a rank owns. Obtain one with
    `cost_model()`, which hands equal specs the same object, so their caches are shared; `memo.clear_all()` drops
    every CostModel and with it every cache it owns."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, rates: RatesSpec | None) -> None:
        self.model, self.cluster, self.rates = model, cluster, rates
        self.structure: Structure = structure_of(model)

        def own(builder: Callable[..., R], maxsize: int) -> Memo[..., R]:
            return Memo(partial(builder, self), maxsize=maxsize, registered=False)

        self.coefficients: Memo[[Shape], Coefficients] = own(_build_coefficients, 8192)
        """coefficients(): one Shape's."""
        self.layer_terms: Memo[[LayerShape], dict[str, object]] = own(_build_layer_terms, 8192)
        """The Coefficients fields of a LayerShape (shared by the shapes that differ only in their schedule)."""
        self.saved = own(_build_saved, 512)
        self.module_recompute = own(_build_module_recompute, 64)
        self.module_offload = own(_build_module_offload, 64)
        self.achievable_tensor = own(_build_achievable_tensor, 1024)
        self.expert_compute = own(_build_expert_compute, 1024)
        self.owned_per_rank = Memo(partial(count_owned_per_rank, model), maxsize=1024, registered=False)
        """sharding.count_owned_per_rank of this model."""
        self.whole_params = Memo(partial(count_whole_params, model), maxsize=1024, registered=False)
        """sharding.count_whole_params of this model."""

    @functools.cached_property
    def static(self) -> _Static:
        """The model's shape-independent per-layer arrays."""
        return _build_static(self.model, self.structure)

    def __reduce__(self) -> tuple[object, tuple]:
        """A CostModel crosses a process boundary (a sweep's pool) as its specs: the receiver builds its own."""
        return cost_model, (self.model, self.cluster, self.rates)


_COST_MODELS: dict[tuple[str, str, str], CostModel] = register({})
"""Every CostModel in use, keyed by its specs' JSON; the oldest is dropped past _MAX_COST_MODELS."""
_MAX_COST_MODELS = 8
"""A planner session prices a handful of (model, cluster, rates): a sweep over clusters, the validation's runs."""


def cost_model(model: ModelSpec, cluster: ClusterSpec, rates: RatesSpec | None = None) -> CostModel:
    """The CostModel of (model, cluster, rates), one per distinct content (`rates` default to the shipped file
    named like the cluster, if any)."""
    rates = rates if rates is not None else rates_for(cluster)
    key = (_spec_json(model), _spec_json(cluster), _spec_json(rates) if rates is not None else "")
    hit = _COST_MODELS.get(key)
    if hit is None:
        if len(_COST_MODELS) >= _MAX_COST_MODELS:
            del _COST_MODELS[next(iter(_COST_MODELS))]
        hit = _COST_MODELS[key] = CostModel(model, cluster, rates)
    return hit


_SPEC_JSON: dict[int, tuple[ModelSpec | ClusterSpec | RatesSpec, str]] = register({})


def _spec_json(spec: ModelSpec | ClusterSpec | RatesSpec) -> str:
    """A (frozen) spec's JSON, which tells equal specs apart from different ones, serialized once per spec object:
    the search asks for thousands of shapes of one model and cluster. The entry keeps the object alive, so its id
    is not reused."""
    hit = _SPEC_JSON.get(id(spec))
    if hit is None or hit[0] is not spec:
        if len(_SPEC_JSON) > 256:
            _SPEC_JSON.clear()
        hit = _SPEC_JSON[id(spec)] = (spec, spec.model_dump_json())
    return hit[1]


@dataclass(frozen=True)
class _Static:
    """Shape-independent per-layer arrays of one model (length L + 2)."""

    pn_muon: np.ndarray
    """Non-routed Muon parameters."""
    p_adam: np.ndarray
    """Non-routed AdamW parameters."""
    p_routed: np.ndarray
    """Routed expert parameters (either optimizer)."""
    pr_adam: np.ndarray
    """Routed expert parameters under AdamW (a model with optimizer.name = "adamw")."""
    active: np.ndarray
    attn: np.ndarray
    scan: np.ndarray
    moe: np.ndarray
    ns_routed_all: np.ndarray
    """Newton-Schulz FLOPs of all of a layer's routed matrices (every expert)."""
    ns_nonrouted: np.ndarray
    ns_ws: np.ndarray
    head_active: int
    routed_active: np.ndarray = field(default_factory=lambda: np.zeros(0))
    q_active_routed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    q_active: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Active matrix parameters of the GEMMs that run in the compute precision (linear layers of the decoder
    and MTP layers; not the router, the embedding, the output head or the vision tower)."""
    q_elements: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Elements quantized per token for those GEMMs: the input X forward and the output gradient dY backward,
    sum of active copies x (in + out)."""
    q_params_nonrouted: np.ndarray = field(default_factory=lambda: np.zeros(0))
    q_params_routed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    moe_k: int = 0
    moe_experts: int = 0
    closes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """AttnRes residual blocks closed by each layer (Coefficients.closes)."""
    gemms: np.ndarray = field(default_factory=lambda: np.zeros((0, 6)))
    """One row per GEMM weight a token multiplies with: (layer or edge index, out, in, active copies per token,
    routed 0/1, runs in the compute precision 0/1)."""
    gemm_out_fused: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per row of `gemms`: the output width of the one GEMM it runs in (fused_gemm_widths)."""
    gemm_names: tuple[tuple[str, str], ...] = ()
    """Per row of `gemms`: its block's kind and the weight's tensor name (structure.Block.kind, Tensor.name)."""
    largest_weight: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per layer and edge, the elements of its largest non-routed GEMM weight as the GEMM runs it (q, k, v and
    gate, up fused: fused_gemm_widths)."""

    @property
    def pr_muon(self) -> np.ndarray:
        """Routed expert parameters under Muon: the routed parameters less those under AdamW."""
        return self.p_routed - self.pr_adam


def _largest_weight(rows: list[tuple], fused: list[int], n: int) -> np.ndarray:
    """Per layer and edge, max over its non-routed GEMM rows of (fused output width x input width)."""
    out = np.zeros(n)
    for (i, _, inp, _, routed, _), width in zip(rows, fused, strict=True):
        if not routed:
            out[i] = max(out[i], float(width) * inp)
    return out


def _build_static(model: ModelSpec, st: Structure) -> _Static:
    """The shape-independent per-layer arrays of one model (its Structure `st`), built once per CostModel."""
    blocks: list[list[Block]] = [*st.layers, st.first, st.last]

    def per(fn) -> np.ndarray:  # noqa: ANN001
        return np.array([float(sum(fn(b) for b in bl)) for bl in blocks])

    n = len(blocks)
    ns_r, ns_n, ns_ws = np.zeros(n), np.zeros(n), np.zeros(n)
    for i, bl in enumerate(blocks):
        for t, count in st.muon_matrices(bl):
            rows, cols = t.shape
            if t.routed:
                ns_r[i] += newton_schulz_flops(rows, cols) * count
            else:
                ns_n[i] += newton_schulz_flops(rows, cols) * count
            ns_ws[i] = max(ns_ws[i], newton_schulz_bytes(rows, cols))
    gemm_tensors = [(i, b, t) for i, bl in enumerate(blocks) for b in bl for t in b.tensors
                    if t.is_matrix and t.active_per_token > 0]
    gemm_rows = [(i, t.shape[0], t.shape[1], t.active_per_token, int(t.routed), int(quantized_gemm(b, t)))
                 for i, b, t in gemm_tensors]
    fused = [w for bl in blocks for b in bl
             for w in fused_gemm_widths([(t.name, t.shape[0]) for t in b.tensors
                                         if t.is_matrix and t.active_per_token > 0])]

    def q_sum(fn) -> np.ndarray:  # noqa: ANN001
        return per(lambda b: sum(fn(t) for t in b.tensors if quantized_gemm(b, t)))

    return _Static(
        gemms=np.array(gemm_rows, dtype=float).reshape(-1, 6), gemm_out_fused=np.array(fused, dtype=float),
        gemm_names=tuple((b.kind, t.name) for _, b, t in gemm_tensors),
        largest_weight=_largest_weight(gemm_rows, fused, n),
        moe_k=model.moe.experts_per_token if model.moe else 0, moe_experts=model.moe.num_experts if model.moe else 0,
        q_active=q_sum(lambda t: t.active_matrix_params),
        q_active_routed=q_sum(lambda t: t.active_matrix_params if t.routed else 0),
        routed_active=per(lambda b: b.routed_active_params),
        q_elements=per(quantized_cast_elements),
        q_params_nonrouted=q_sum(lambda t: 0 if t.routed else t.numel),
        q_params_routed=q_sum(lambda t: t.numel if t.routed else 0),
        pn_muon=per(lambda b: b.params("muon", routed=False)), p_adam=per(lambda b: b.params("adamw", routed=False)),
        p_routed=per(lambda b: b.params(routed=True)), pr_adam=per(lambda b: b.params("adamw", routed=True)),
        active=per(lambda b: b.active_matrix_params),
        attn=per(lambda b: b.attention_flops_per_token_per_doc_token), scan=per(lambda b: b.scan_flops_per_token),
        moe=per(lambda b: b.moe_layers), ns_routed_all=ns_r, ns_nonrouted=ns_n, ns_ws=ns_ws,
        head_active=sum(t.active_matrix_params for t in st.last[0].tensors), closes=_closes(model),
    )


MEGATRON_FUSED_GEMMS: tuple[frozenset[str], ...] = (
    frozenset({"gqa.q_proj", "gqa.k_proj", "gqa.v_proj"}),     # linear_qkv (attention.py, SelfAttention)
    frozenset({"ffn.gate_proj", "ffn.up_proj"}),                # linear_fc1 of a gated MLP (mlp.py)
    frozenset({"moe.shared_gate", "moe.shared_up"}),            # the shared experts' linear_fc1
    frozenset({"moe.experts.w1", "moe.experts.w3"}),            # the routed experts' grouped linear_fc1
)
"""Weights Megatron multiplies as one GEMM, their outputs side by side (NVIDIA/Megatron-LM
megatron/core/transformer/attention.py linear_qkv, megatron/core/transformer/mlp.py linear_fc1 with
gated_linear_unit, megatron/core/transformer/moe/experts.py); MLA's down and up projections stay separate."""


def quantized_cast_elements(block: Block) -> int:
    """Elements the low-precision cast kernels quantize per token for one block's GEMMs: each GEMM's input X
    (forward) and output gradient dY (backward), sum of active copies x (in + out), with the input of a
    MEGATRON_FUSED_GEMMS group counted once: Megatron runs the group as one TransformerEngine linear (linear_qkv,
    the gated linear_fc1), which quantizes its input once for all the group's weights."""
    total, seen = 0, set()
    for t in block.tensors:
        if not quantized_gemm(block, t):
            continue
        group = next((g for g in MEGATRON_FUSED_GEMMS if t.name in g), None)
        total += t.active_per_token * t.shape[0]
        if group is None or group not in seen:
            total += t.active_per_token * t.shape[1]
        if group is not None:
            seen.add(group)
    return total


def fused_gemm_widths(rows: list[tuple[str, int]]) -> list[int]:
    """Per weight of one block ((name, out) in the block's order), the output width of the GEMM it runs in: the sum
    of the outs of the block's weights in its MEGATRON_FUSED_GEMMS group, else its own out."""
    out = []
    for name, width in rows:
        group = next((g for g in MEGATRON_FUSED_GEMMS if name in g), None)
        out.append(sum(w for n, w in rows if n in group) if group else width)
    return out


def _closes(model: ModelSpec) -> np.ndarray:
    """AttnRes residual blocks closed by each layer (0 on the edges): block of boundary b = b x sublayers //
    block size."""
    L, ar = model.num_layers, model.attn_res
    if ar is None:
        return np.zeros(L + 2)
    b = np.arange(L + 1)
    r_at = (b * ar.sublayers_per_layer) // ar.block_size
    return np.concatenate([np.diff(r_at), [0, 0]]).astype(float)


def _build_saved(cm: CostModel, tokens: int, toggles: Toggles, fp8_block: int,
                 precision: Precision = Precision.BF16, routed: bool | None = None) -> tuple[np.ndarray, ...]:
    """(saved, recomputable, FP8-stored values) per microbatch for each layer and edge (`routed`: as in
    saved_per_token)."""
    st = cm.structure
    blocks: list[list[Block]] = [*st.layers, st.first, st.last]
    out = np.zeros((3, len(blocks)))
    for i, bl in enumerate(blocks):
        for b in bl:
            out[:, i] += np.array(saved_per_token(b, toggles, fp8_block, precision, routed)) * tokens
    return out[0], out[1], out[2]


def _build_module_recompute(cm: CostModel, tokens: int, toggles: Toggles, fp8_block: int, precision: Precision,
                            modules: tuple[str, ...], routed: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(saved bytes dropped, replayed active matrix weights) per microbatch of each layer and edge under Megatron's
    recompute `modules` (structure.MEGATRON_RECOMPUTE); `routed`: of the dropped bytes, only the routed experts'
    (True), as in saved_per_token."""
    st = cm.structure
    blocks: list[list[Block]] = [*st.layers, st.first, st.last]
    dropped, replayed = np.zeros(len(blocks)), np.zeros(len(blocks))
    for i, bl in enumerate(blocks):
        for b in bl:
            names, weights = module_recompute(b, modules)
            if names:
                dropped[i] += saved_per_token(b, toggles, fp8_block, precision, routed, only=names)[0] * tokens
            replayed[i] += weights
    return dropped, replayed


def _build_module_offload(cm: CostModel, tokens: int, toggles: Toggles, fp8_block: int, precision: Precision,
                          recompute: Recompute, recompute_modules: tuple[str, ...], modules: tuple[str, ...]
                          ) -> np.ndarray:
    """Saved bytes per microbatch of each decoder layer (0 on the edges) that Megatron's offload `modules` send to
    the host (structure.MEGATRON_OFFLOAD): the modules' saved tensors the recompute mode keeps (selective drops
    its recomputable ones, or what Megatron's recompute_modules drop)."""
    st = cm.structure
    out = np.zeros(len(st.layers) + 2)
    for i, bl in enumerate(st.layers):
        for b in bl:
            names = module_offload(b, modules)
            if recompute == Recompute.SELECTIVE and recompute_modules:
                names = names - module_recompute(b, recompute_modules)[0]
            elif recompute == Recompute.SELECTIVE:
                names = names - {s.name for s in b.saved if s.recomputable}
            if names:
                out[i] += saved_per_token(b, toggles, fp8_block, precision, only=frozenset(names))[0] * tokens
    return out


def _build_placement(gpus: int, p: int, c: int, e: int, fe: int, fd: int, domain: int) -> comm.Placement:
    return comm.placement(gpus, p, c, e, fe, fd, domain)


placement_of = Memo(_build_placement, maxsize=65536)


def _context_parallel(model: ModelSpec, shape: Shape, tokens: int, cluster: ClusterSpec, on_nvlink: bool,
                      attn_flops: np.ndarray, full: bool) -> tuple[np.ndarray, ...]:
    """(NVLink bytes, NIC bytes, compute-stream stall s, transient buffer bytes) per layer of CP's own traffic.

    MLA: TE's p2p KV ring (`comm.cp_mla_ring_bytes`; full recompute replays the forward ring), overlapped with the
    layer's attention: the stall is what the attention time does not cover. KDA: FLA KCP's synchronous state
    all-gather (`comm.cp_kda_allgather_bytes`; full recompute replays the forward one), all of it a stall. The
    ring runs at the slowest hop: NVLink when every CP group sits in one domain, else the NIC."""
    n, L = model.num_layers + 2, model.num_layers
    c = shape.cp
    link, ws, stall = np.zeros(n), np.zeros(n), np.zeros(n)
    rate = (cluster.nvlink_gbps if on_nvlink else cluster.nic_gbps) * 1e9
    # Every MLA layer moves the same ring and every KDA layer the same gather: one value per kind, set by mask.
    mla = np.zeros(n, dtype=bool)
    if model.mla is not None:
        mla[[i for i in set(model.full_attention_layers) if 0 <= i < L]] = True
        m = model.mla
        kv = comm.cp_mla_kv_bytes_per_token(m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
        sent = comm.cp_mla_ring_bytes(c, tokens, kv) * (4 / 3 if full else 1.0)
        link[mla] = sent
        ws[mla] = comm.cp_mla_ring_buffer_bytes(c, tokens, kv)
        stall[mla] = np.maximum(0.0, sent / rate - attn_flops[mla] / (cluster.bf16_tflops * 1e12))
    if model.kda is not None:
        kda = ~mla
        kda[L:] = False
        k = model.kda
        state = comm.cp_kda_state_bytes(k.num_heads, k.head_dim, k.head_dim)
        got = comm.cp_kda_allgather_bytes(c, state) * (3 / 2 if full else 1.0)
        link[kda] = got
        ws[kda] = c * state  # the gather buffer: every rank's state tensor
        stall[kda] = got / rate
    zero = np.zeros(n)
    return (link, zero, stall, ws) if on_nvlink else (zero, link, stall, ws)


def _build_coefficients(cm: CostModel, shape: Shape) -> Coefficients:
    """One shape's coefficients: the per-layer arrays of its LayerShape (one build for every shape that differs
    only in its pipeline schedule) and the schedule's own terms: in-flight compositions, slots, PP hops."""
    cluster = cm.cluster
    tg = shape.toggles
    domain = domain_block(shape.domain_gpus_used, cluster.nvlink_domain_gpus)
    pl = placement_of(shape.gpus, shape.pp, shape.cp, shape.ep, shape.expert_fsdp, shape.dense_fsdp, domain)
    terms = cm.layer_terms(LayerShape.of(shape, pl))
    comps = _compositions(shape.pp, shape.vp, shape.microbatches)
    balanced = _balanced_inflight(shape.pp, shape.vp, shape.microbatches) if tg.balance_activations else None
    gb = 1e9
    pp_spb = tuple(
        1 / (cluster.nvlink_gbps * gb) if hop else 1 / (cluster.nic_gbps * gb) for hop in pl.pp_hop_in_domain
    )
    pp_spb_ach: tuple[float, ...] = ()
    if cm.rates is not None:
        rt = cm.rates
        pp_spb_ach = tuple(
            1 / (cluster.nvlink_gbps * gb * rt.collective_nvlink.value) if hop
            else 1 / (cluster.nic_gbps * gb * rt.collective_nic.value) for hop in pl.pp_hop_in_domain)
    # Fresh dicts per shape: a caller that rebinds an entry must not reach the shared arrays of other shapes.
    fresh = {k: dict(terms[k]) for k in _DICT_FIELDS}
    return Coefficients(
        shape=shape, **{**terms, **fresh}, compositions=comps, balanced_inflight=balanced, placement=pl,
        slots=schedule_slots(shape.pp, shape.vp, shape.microbatches),
        pp_seconds_per_byte=pp_spb, pp_on_nvlink=pl.pp_hop_in_domain,
        balance_resource="nvlink" if pl.pipeline_in_domain else "nic",
        balance_seconds_per_byte=1 / ((cluster.nvlink_gbps if pl.pipeline_in_domain else cluster.nic_gbps) * gb),
        pp_seconds_per_byte_achievable=pp_spb_ach,
    )


_DICT_FIELDS = ("time", "update", "achievable", "update_achievable")
"""The Coefficients fields that hold per-resource dicts of arrays."""


def _build_compositions(p: int, v: int, m: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Coefficients.compositions: each rank's in-flight chunk-microbatch vectors."""
    return tuple(inflight_compositions(p, v, m, r) for r in range(p))


_compositions = Memo(_build_compositions, maxsize=256)


def _build_balanced_inflight(p: int, v: int, m: int) -> float:
    """Activation balancing's target (seed 001): the mean over ranks of each rank's peak in-flight microbatches."""
    return float(np.mean([composition_peak(cr) for cr in _compositions(p, v, m)]))


_balanced_inflight = Memo(_build_balanced_inflight, maxsize=256)


def _build_layer_terms(cm: CostModel, shape: LayerShape) -> dict[str, object]:
    """The Coefficients fields of a LayerShape (every per-layer array and rank-level constant), read-only: the
    cache hands the same arrays to every shape of the key."""
    b = _LayerBuild.of(shape, cm)
    acts = _saved_activations(b)
    work = _compute_work(b)
    ep = _ep_dispatch(b)
    traffic = _microbatch_traffic(b, acts, work, ep)
    ns = _newton_schulz(b)
    up = _update_traffic(b)
    moonep = shape.toggles.moonep
    working_set = acts.working_set if traffic.cp_working_set is None else acts.working_set + traffic.cp_working_set
    time = _peak_seconds(b, work, traffic)
    stall = _offload_stall(b, acts, time["tensor"], None)
    time["tensor"] = time["tensor"] + stall
    return _read_only(dict(
        n_layers=b.model.num_layers, tokens=shape.tokens, hidden=b.model.hidden_size,
        **_persistent_bytes(b), **ns, **_logits(b),
        **_routed_capacity(shape, acts),
        offloaded_act=acts.offloaded, working_set=working_set,
        recompute_ws=acts.recompute_ws + acts.reloaded, grad_transient=acts.grad_transient,
        closes=b.sa.closes, moe=b.sa.moe, routing_map_allgathers_per_layer=ep.allgathers,
        time=time, update=_peak_update_seconds(b, ns["ns_flops"], up), offload_stall=stall,
        tensor_flops=work.tensor_flops, model_flops_per_token=work.model_flops_per_token,
        stream_bytes=b.stream, ep_buffers=0.0 if moonep else ep.buffers * (shape.capacity_factor or 1.0),
        moonep_buffers=ep.buffers if moonep else 0.0, routing_map=ep.routing_map,
        cost=cm, gemm_flops=work.gemm_flops,
        **_achievable_terms(b, acts, work, traffic, ns["ns_flops"], up),
    ))


def _routed_capacity(shape: LayerShape, acts: _Activations) -> dict[str, np.ndarray]:
    """`act`, `stash` and `stash_host` under Megatron's sync-free MoE. The fused grouped MLP's saved tensors have
    the rows of HybridEP's capacity-sized receive buffer (experts.py L766-777 @ d98e8a64: max_num_tokens is its
    row count, the balanced count that / the factor), so the routed part of the kept saved set takes the capacity
    factor; under the paged stash it leaves `act` for the static buffer, sized at the CUDA factor x the balanced
    peak (paged_stash.py allocate_stash_buffers: avg-based maxima x the factor) and the host spill buffer at the
    host factor x the same."""
    act = acts.act - acts.offloaded
    none = np.zeros_like(act)
    if shape.paged_stash is not None:
        cuda, host = shape.paged_stash
        return dict(act=act - acts.routed, stash=cuda * acts.routed, stash_host=host * acts.routed)
    cap = shape.capacity_factor or 1.0
    return dict(act=act + (cap - 1.0) * acts.routed, stash=none, stash_host=none)


_GRADS_SHARDED = (ShardingPolicy.OPTIM_GRADS, ShardingPolicy.OPTIM_GRADS_PARAMS)
"""The sharding policies (Megatron's vocabulary) that shard the gradients: optim_grads and optim_grads_params."""


@dataclass(frozen=True, eq=False)
class _LayerBuild:
    """What every group of a LayerShape's terms reads: the shape, the specs, the model's shape-independent arrays,
    and the parameters per layer a rank holds, owns and reduces under the shape's degrees and sharding policies."""

    shape: LayerShape
    cm: CostModel
    """The CostModel building it: its caches of the saved bytes, the replayed modules and the achievable times."""
    model: ModelSpec
    cluster: ClusterSpec
    sa: _Static
    n: int
    """Layers and edges, L + 2."""
    layer: np.ndarray
    """True on the decoder layers, False on the two edges."""
    full: bool
    """Full recompute."""
    accumulate: bool
    """The accumulate FSDP lifecycle (gradients reduced once per update)."""
    stream: int
    """One BF16 [T, d] stream."""
    pn: np.ndarray
    """Dense parameters (Muon and AdamW) of each layer, D."""
    resident: np.ndarray
    """Parameters resident per GPU: D / f_d + E / (e f_e)."""
    res_muon: np.ndarray
    """Of those, the Muon parameters."""
    view: np.ndarray
    """Parameters of the gathered compute view: D + E / e."""
    own_muon: np.ndarray
    """Muon parameters whose optimizer state the rank owns (its shard; all of them where a group shards nothing)."""
    own_adam: np.ndarray
    """The same for the AdamW parameters."""
    opt_fd: int
    """Dense group over which the optimizer state is sharded (1 where the policy shards nothing)."""
    opt_fe: int
    """Expert group over which the optimizer state is sharded."""
    unit: np.ndarray
    """Parameters of each decoder layer gathered per layer (param_gather = layer: the optim_grads_params groups,
    D and / or E / e; 0 on the edges, which stay gathered, and where the view is kept for the update)."""
    unit_shard: np.ndarray
    """The rank's shard of those parameters, D / f_d and / or E / (e f_e)."""
    unit_q: np.ndarray
    """Of `unit`, the parameters of GEMMs in the compute precision."""
    gather_d: bool
    """The dense group gathers per layer (param_gather = layer under optim_grads_params)."""
    gather_e: bool
    """The expert group gathers per layer."""
    g_fd: int
    """Dense group over which the gradients are sharded (1 where they are whole)."""
    g_fe: int
    """Expert group over which the gradients are sharded."""
    gd: int
    """Bytes per gradient element."""
    sd: int
    """Bytes per optimizer-state element."""
    lowp: bool
    """The linear GEMMs run in a low compute precision (FP8 / FP4)."""
    qb: float
    """Bytes per element in that precision, block scales included."""
    q_view: np.ndarray
    """Local parameters of the GEMMs that run in the compute precision."""
    fp8_params: np.ndarray
    """Of the view, the parameters stored only in the compute precision (fp8_param_gather: q_view; else 0)."""

    @classmethod
    def of(cls, shape: LayerShape, cm: CostModel) -> _LayerBuild:
        """The build context of `shape` under the CostModel `cm`."""
        model = cm.model
        sa = cm.static
        n = model.num_layers + 2
        e, fe, fd = shape.ep, shape.expert_fsdp, shape.dense_fsdp
        pn_muon, p_adam, p_routed, pr_adam, pr_muon = sa.pn_muon, sa.p_adam, sa.p_routed, sa.pr_adam, sa.pr_muon
        pn = pn_muon + p_adam
        # Seed 000: resident parameters per GPU = D / f_d + E / (e * f_e); BF16 view = 2 (D + E / e). The routed
        # experts are EP-local whichever optimizer trains them (Muon under K3's split, AdamW for every tensor).
        res_muon = pn_muon / fd + pr_muon / (e * fe)
        res_adam = p_adam / fd + pr_adam / (e * fe)
        # Each of the dense and expert groups shards nothing, the optimizer (masters + state), also the
        # gradients, or also the parameters (the FSDP accounting).
        pol_d, pol_e = shape.dense_sharding, shape.expert_sharding
        opt_fd = fd if pol_d != ShardingPolicy.NO_SHARD else 1
        opt_fe = fe if pol_e != ShardingPolicy.NO_SHARD else 1
        per_layer = shape.param_gather == ParamGather.LAYER
        gd_ = float(per_layer and pol_d == ShardingPolicy.OPTIM_GRADS_PARAMS)
        ge_ = float(per_layer and pol_e == ShardingPolicy.OPTIM_GRADS_PARAMS)
        layer = np.arange(n) < model.num_layers
        q_view = sa.q_params_nonrouted + sa.q_params_routed / e  # local params of the low-precision GEMMs
        return cls(
            shape=shape, cm=cm, model=model, cluster=cm.cluster, sa=sa, n=n,
            layer=layer, full=shape.recompute == Recompute.FULL,
            accumulate=shape.fsdp_lifecycle == FsdpLifecycle.ACCUMULATE,
            stream=shape.tokens * model.hidden_size * BF16, pn=pn, resident=res_muon + res_adam, res_muon=res_muon,
            view=pn + p_routed / e, own_muon=pn_muon / opt_fd + pr_muon / (e * opt_fe),
            own_adam=p_adam / opt_fd + pr_adam / (e * opt_fe),
            unit=layer * (gd_ * pn + ge_ * p_routed / e),
            unit_shard=layer * (gd_ * pn / fd + ge_ * p_routed / (e * fe)),
            unit_q=layer * (gd_ * sa.q_params_nonrouted + ge_ * sa.q_params_routed / e),
            gather_d=bool(gd_), gather_e=bool(ge_),
            opt_fd=opt_fd, opt_fe=opt_fe, g_fd=fd if pol_d in _GRADS_SHARDED else 1,
            g_fe=fe if pol_e in _GRADS_SHARDED else 1, gd=shape.grad_dtype.bytes,
            sd=model.optimizer.state_of(shape.optimizer_state_dtype).bytes,
            lowp=shape.precision != Precision.BF16, qb=quantized_bytes_per_element(shape.precision),
            q_view=q_view,
            fp8_params=q_view if shape.fp8_param_gather else np.zeros(n),
        )


def _persistent_bytes(b: _LayerBuild) -> dict[str, object]:
    """Bytes per layer held through the step: FP32 masters, gradients, optimizer state, the BF16 view, MoonEP's
    slots, the accumulation buffer, the pipeline ZeRO-2 chunk buffer and host shards, the quantized weights, and
    the optimizer step's gather."""
    sh, n, p_routed, e = b.shape, b.n, b.sa.p_routed, b.shape.ep
    zero2 = sh.toggles.pipeline_zero2_host_grads
    own = b.own_muon + b.own_adam
    grad_elems = b.pn / b.g_fd + p_routed / (e * b.g_fe)
    # An unsharded accumulation buffer only where the gradients are otherwise sharded (a whole buffer accumulates).
    d_sharded, e_sharded = sh.dense_sharding in _GRADS_SHARDED, sh.expert_sharding in _GRADS_SHARDED
    grad_accum = 4 * (b.pn * d_sharded + p_routed / e * e_sharded) if b.accumulate else np.zeros(n)
    default_policy = sh.dense_sharding == sh.expert_sharding == ShardingPolicy.OPTIM_GRADS_PARAMS
    return dict(
        master=4 * own,
        grads=np.zeros(n) if zero2 else b.gd * grad_elems,
        optimizer=b.sd * b.own_muon + 2 * b.sd * b.own_adam,          # Muon momentum; AdamW two moments
        bf16_view=2 * (b.view - b.unit - b.fp8_params) + _unit_weight_bytes(b)[0],
        moonep_slots=2 * p_routed / e if sh.toggles.moonep else np.zeros(n),
        grad_accum=grad_accum,
        chunk_grad_buffer=4 * b.view,
        host_grads=4 * b.resident if zero2 else np.zeros(n),
        view_params=b.view, resident_params=b.resident,
        quantized_weights=_quantized_weight_bytes(b),
        step_gather=_step_gather(b), p2p_step_gather=2 * b.res_muon + _step_gather(b, adamw_only=True),
        step_gather_with_ns=default_policy,
        # Megatron's optimizers keep FP32 main parameters; with a BF16 gradient buffer the step hands each owned
        # shard main_grad.float() as its .grad (NVIDIA/Megatron-LM@2edffadb megatron/core/optimizer/
        # distrib_optimizer.py _copy_model_grads_to_main_grads, `shard_main_param.grad = shard_model_grad.float()`;
        # an FP32 buffer's .float() is the buffer itself). They live until the next zero_grad, before any forward.
        step_grad_copy=4 * own if b.gd < 4 else np.zeros(n), state_bytes=b.sd,
    )


def _quantized_weight_bytes(b: _LayerBuild) -> np.ndarray:
    """Row- and column-wise copies of the local weights of the GEMMs in a low compute precision, 2 (b + 1/block)
    per element, cached by TransformerEngine across the microbatches of an update; under fp8_param_gather the
    weights themselves: MXFP8 keeps both copies (its tile scales differ per direction), per-tensor FP8 one buffer
    that both usages read on Blackwell (TransformerEngine float8_tensor_storage.py L245-250 @ e7c550c5), the
    DDP parameter buffer Megatron maps it into (param_and_grad_buffer.py L1263-1290 @ d98e8a64)."""
    if not b.lowp:
        return np.zeros(b.n)
    if _fp8_one_buffer(b.shape):
        return b.qb * b.q_view
    return 2 * b.qb * (b.q_view - b.unit_q)


def _fp8_one_buffer(shape: LayerShape) -> bool:
    """Per-tensor FP8 weights stored only in FP8 (fp8_param_gather): one 1-byte buffer, which both usages read and
    the update gathers; MXFP8's keep both copies and gather BF16 through the gradient buffer."""
    return shape.fp8_param_gather and shape.precision == Precision.FP8


def _fsdp_weight_bytes(precision: Precision) -> float:
    """Bytes per weight of a Megatron-FSDP shard and of its gather: FP8 primary weights under per-tensor FP8, else
    BF16 (see _unit_weight_bytes)."""
    return quantized_bytes_per_element(precision) if precision == Precision.FP8 else float(BF16)


def _unit_weight_bytes(b: _LayerBuild) -> tuple[np.ndarray, np.ndarray]:
    """(persistent shard, one gathered unit) bytes per layer of the groups gathered per layer (Megatron-FSDP).
    Per-tensor FP8 runs FP8 primary weights (Megatron-Bridge's FP8 current-scaling recipes set fp8_param_gather,
    training/mixed_precision.py L302 @ 067f987d): a 1-byte shard gathered as 1 byte, row- and column-wise sharing
    one buffer on Blackwell (TransformerEngine float8_tensor_storage.py L245-250 @ e7c550c5). Otherwise a BF16 shard
    gathered in BF16, plus the row- and column-wise quantized copies of its GEMMs in a low compute precision."""
    wb = _fsdp_weight_bytes(b.shape.precision)
    quantized = 2 * b.qb * b.unit_q if b.lowp and b.shape.precision != Precision.FP8 else 0.0
    return wb * b.unit_shard, wb * b.unit + quantized


def _step_gather(b: _LayerBuild, adamw_only: bool = False) -> np.ndarray:
    """Optimizer-step all-gather into fresh BF16 buffers. Default policy: the whole view. optim / optim_grads:
    Megatron's distributed optimizer gathers in place into the whole BF16 weights (element granularity: no extra
    buffer); the layer-wise optimizer (tensor granularity) allocates receive buffers for every sharded group, after
    step() (seed 003: 9.71 GiB = dense params x 2 B at EP8, f_e = 1). `adamw_only`: the AdamW parameters' share
    (what P2P Muon leaves to the policy)."""
    sh = b.shape
    tensor_gran = sh.optimizer_shard_granularity == ShardGranularity.TENSOR

    def gather(pol: ShardingPolicy, f: int, params: np.ndarray, per_layer: bool = False) -> np.ndarray:
        if pol == ShardingPolicy.OPTIM_GRADS_PARAMS:
            # Gathered per layer, the step updates the shards in place and the next forward gathers them.
            return np.zeros(b.n) if per_layer else 2 * params
        if pol == ShardingPolicy.NO_SHARD or f == 1 or not tensor_gran:
            return np.zeros(b.n)
        return 2 * params

    # The edges gathered per layer's mode stay gathered (not FSDP units): their buffers are the bf16_view term.
    pn, p_routed = (b.sa.p_adam, b.sa.pr_adam) if adamw_only else (b.pn, b.sa.p_routed)
    dense = gather(sh.dense_sharding, sh.dense_fsdp, pn, b.gather_d)
    return dense + gather(sh.expert_sharding, sh.expert_fsdp, p_routed / sh.ep, b.gather_e)


def _newton_schulz(b: _LayerBuild) -> dict[str, np.ndarray]:
    """Muon Newton-Schulz per update: a rank orthogonalizes its share of whole matrices (the matrices it owns: all
    of them where the group shards nothing); the working set of the layer's largest matrix."""
    ns_flops_routed = b.sa.ns_routed_all / (b.shape.ep * b.opt_fe)
    return dict(ns_flops_routed=ns_flops_routed, ns_flops=ns_flops_routed + b.sa.ns_nonrouted / b.opt_fd,
                ns_working_set=b.sa.ns_ws)


def _activation_toggles(tg: Toggles) -> Toggles:
    """The toggles that change what a layer saves for backward (the only ones the saved-set caches key on)."""
    return Toggles(fp8_activations=tg.fp8_activations, fused_situ=tg.fused_situ,
                   dispatch_recompute=tg.dispatch_recompute, moe_backward_rewrite=tg.moe_backward_rewrite)


@dataclass(frozen=True, eq=False)
class _Activations:
    """Saved-for-backward bytes per microbatch of each layer and edge, and what the recompute mode keeps of them."""

    saved: np.ndarray
    fp8_values: np.ndarray
    act: np.ndarray
    recompute_ws: np.ndarray
    grad_transient: np.ndarray
    working_set: np.ndarray
    """Without CP's buffers (_microbatch_traffic adds them)."""
    offloaded: np.ndarray
    """Of `act`, the part that waits in host memory: the first N decoder layers' (activation_offload_layers), or
    each decoder layer's offload modules' (offload_modules)."""
    reloaded: np.ndarray
    """Under offload_modules, the offloaded part back on the GPU while the layer runs backward: its own, reloaded,
    and the next layer's, prefetched (offload_resident_layers copies of the layer's)."""
    routed: np.ndarray
    """Of `act`, the routed experts' saved tensors the recompute mode keeps (what the fused grouped MLP saves)."""


def _saved_activations(b: _LayerBuild) -> _Activations:
    """Saved bytes per recompute mode: none keeps all; selective drops the recomputable part to the working set of
    the layer in backward; full keeps one BF16 [T, d] layer input per layer (the edges are not checkpointed). The
    working set adds the layer's unsharded gradient (per-microbatch lifecycle) and its two gradient streams."""
    sh, n, e = b.shape, b.n, b.shape.ep
    saved, recomputable, fp8_values = b.cm.saved(sh.tokens, _activation_toggles(sh.toggles), sh.fp8_block_size,
                                                 sh.precision)
    r_saved, r_recomputable, _ = b.cm.saved(sh.tokens, _activation_toggles(sh.toggles), sh.fp8_block_size,
                                            sh.precision, routed=True)
    if sh.recompute == Recompute.NONE:
        act, recompute_ws, routed = saved.copy(), np.zeros(n), r_saved
    elif sh.recompute == Recompute.SELECTIVE and sh.recompute_modules:
        dropped = b.cm.module_recompute(sh.tokens, _activation_toggles(sh.toggles), sh.fp8_block_size,
                                        sh.precision, sh.recompute_modules)[0]
        act, recompute_ws = saved - dropped, dropped.copy()
        routed = r_saved - b.cm.module_recompute(sh.tokens, _activation_toggles(sh.toggles), sh.fp8_block_size,
                                                 sh.precision, sh.recompute_modules, True)[0]
    elif sh.recompute == Recompute.SELECTIVE:
        act, recompute_ws, routed = saved - recomputable, recomputable.copy(), r_saved - r_recomputable
    else:
        act = np.where(b.layer, b.stream, saved)
        recompute_ws = np.where(b.layer, saved, 0.0)
        routed = np.zeros(n)
    # Unsharded BF16 gradient of the layer, live until its reduce-scatter (per-microbatch lifecycle).
    # Only where the gradients are sharded: a whole gradient buffer accumulates in place.
    grad_transient = np.zeros(n) if b.accumulate else (
        2 * b.pn * (b.g_fd > 1) * (not b.gather_d) + 2 * (b.sa.p_routed / e) * (b.g_fe > 1) * (not b.gather_e))
    if b.gather_d or b.gather_e:
        grad_transient = grad_transient + _unit_transient(b)
    grad_streams = np.where(b.layer, 2 * b.stream, 0.0)
    offloaded = np.where(np.arange(n) < sh.activation_offload_layers, act, 0.0)
    reloaded = np.zeros(n)
    if sh.offload_modules:
        moved = b.cm.module_offload(sh.tokens, _activation_toggles(sh.toggles), sh.fp8_block_size, sh.precision,
                                    sh.recompute, sh.recompute_modules, sh.offload_modules)
        offloaded, reloaded = offloaded + moved, sh.offload_resident_layers * moved
    return _Activations(saved=saved, fp8_values=fp8_values, act=act, recompute_ws=recompute_ws,
                        grad_transient=grad_transient,
                        working_set=recompute_ws + reloaded + grad_transient + grad_streams,
                        offloaded=offloaded, reloaded=reloaded, routed=routed)


def _unit_transient(b: _LayerBuild) -> np.ndarray:
    """Megatron-FSDP's buffers per layer while it runs (megatron_fsdp/param_and_grad_buffer.py @ d98e8a64): two
    gathered units (the layer and the one prefetched, fsdp_double_buffer: L4420-4485), two unsharded gradient buckets
    in the gradient dtype (L3956-3978), and the fresh BF16 weight gradient of the layer's largest GEMM before it is
    copied into its bucket (gradient_accumulation_fusion off). On the edges, kept gathered (not FSDP units): the
    BF16 weight gradient and its bucket."""
    unit = _unit_weight_bytes(b)[1]
    layers = 2 * unit + 2 * b.gd * b.unit + BF16 * b.sa.largest_weight * (b.unit > 0)
    edges = (BF16 + b.gd) * b.pn * (~b.layer) * b.gather_d
    return layers + edges


@dataclass(frozen=True, eq=False)
class _Work:
    """FLOPs per microbatch of each layer and edge."""

    tensor_flops: np.ndarray
    gemm_flops: np.ndarray
    """The part in the low compute precision (0 under BF16)."""
    model_flops_per_token: float
    s_eff: int
    """Tokens each token attends to: min(document length, context)."""


def _compute_work(b: _LayerBuild) -> _Work:
    """Training FLOPs: T (6 active + attention x s_eff + scan) x the recompute factor on the layers, plus the
    forward GEMMs Megatron's recompute modules replay (2 T x replayed weights, in the compute precision); chunked
    cross entropy recomputes each chunk's logits in backward (one more LM-head forward)."""
    sh, sa, T, L = b.shape, b.sa, b.shape.tokens, b.model.num_layers
    active, attn, scan = sa.active, sa.attn, sa.scan
    s_eff = min(sh.document_length, sh.context)
    rc_factor = recompute_flops_factor(b.full)
    fwd_bwd = T * (6 * active + attn * s_eff + scan)
    tensor_flops = np.where(b.layer, fwd_bwd * rc_factor, fwd_bwd)
    replay = np.zeros(b.n)
    if sh.recompute == Recompute.SELECTIVE and sh.recompute_modules:
        replay = 2 * T * b.cm.module_recompute(T, _activation_toggles(sh.toggles), sh.fp8_block_size,
                                               sh.precision, sh.recompute_modules)[1]
    tensor_flops = tensor_flops + replay
    if sh.toggles.fused_cross_entropy:
        tensor_flops[L + 1] += 2 * T * sa.head_active
    # Linear GEMMs in a low compute precision: their FLOPs run at that precision's peak.
    q_flops = 6 * T * sa.q_active
    gemm_flops = np.where(b.layer, q_flops * rc_factor, q_flops) + replay if b.lowp else np.zeros(b.n)
    return _Work(tensor_flops=tensor_flops, gemm_flops=gemm_flops, s_eff=s_eff,
                 model_flops_per_token=float(6 * active.sum() + attn[:L].sum() * s_eff))


@dataclass(frozen=True, eq=False)
class _Dispatch:
    """EP traffic per microbatch of each layer: the all-to-all copies and the routing-map all-gathers."""

    nvl: np.ndarray
    nic: np.ndarray
    ep_nvl: np.ndarray
    """The all-to-all alone (the achievable roofline prices it at the dispatcher's measured bandwidth)."""
    ep_nic: np.ndarray
    routing_map: float = 0.0
    buffers: float = 0.0
    allgathers: int = 0


def _ep_dispatch(b: _LayerBuild) -> _Dispatch:
    """The EP all-to-all bytes on NVLink and the NIC (comm.ep_*; deduplicated under ep_dedup), then the routing-map
    all-gathers; the routing map and the dispatch + combine buffers of one MoE layer."""
    n = b.n
    if b.model.moe is None:
        return _Dispatch(nvl=np.zeros(n), nic=np.zeros(n), ep_nvl=np.zeros(n), ep_nic=np.zeros(n))
    sh, m, moe, T, e = b.shape, b.model.moe, b.sa.moe, b.shape.tokens, b.shape.ep
    nvl, nic = _ep_all_to_all(b, m)
    ep_nvl, ep_nic = nvl.copy(), nic.copy()
    n_ag = comm.routing_map_allgathers_per_layer(b.full)
    rmap = comm.routing_map_bytes(T, m.num_experts)
    nvl = nvl + moe * n_ag * rmap * (sh.ep_local - 1)
    nic = nic + moe * n_ag * rmap * (e - sh.ep_local)
    return _Dispatch(nvl=nvl, nic=nic, ep_nvl=ep_nvl, ep_nic=ep_nic, routing_map=float(e * rmap),
                     buffers=float(2 * T * m.experts_per_token * b.model.dispatch_width * BF16), allgathers=n_ag)


def _ep_all_to_all(b: _LayerBuild, m: MoESpec) -> tuple[np.ndarray, np.ndarray]:
    """All-to-all bytes per microbatch on NVLink and on the NIC of the model's MoE `m`: payload per copy x the
    remote copies of a token, those crossing NVLink domains on the NIC."""
    sh, tg, moe, e = b.shape, b.shape.toggles, b.sa.moe, b.shape.ep
    nvl, nic = np.zeros(b.n), np.zeros(b.n)
    exch = comm.ep_exchanges(b.full, tg.dispatch_recompute)
    if tg.ep_dedup:
        remote = comm.ep_remote_copies_dedup(m.num_experts, m.experts_per_token, e)
        cross = comm.ep_cross_domain_copies_dedup(m.num_experts, m.experts_per_token, e, sh.ep_local)
    else:
        remote = comm.ep_remote_copies(m.experts_per_token, e)
        cross = comm.ep_cross_domain_copies(m.experts_per_token, e, sh.ep_local)
    per_copy = comm.ep_payload_bytes(exch, sh.tokens, b.model.dispatch_width, 1.0)
    if sh.dispatcher in HIERARCHICAL_DISPATCHERS and sh.ep_local < e:
        # DeepEP / HybridEP send a token once per destination NVLink domain over RDMA and forward it over
        # NVLink inside that domain (DeepEP README, internode kernels): NIC copies = (e/a - 1) x P(domain
        # hit), P from the domain's E a / e experts; the forwarded rank copies then ride NVLink.
        a_ = sh.ep_local
        dom = (e // a_ - 1) * comm.ep_hit_probability(m.num_experts, m.experts_per_token, e // a_)
        return nvl + moe * per_copy * remote, nic + moe * per_copy * dom
    return nvl + moe * per_copy * (remote - cross), nic + moe * per_copy * cross


@dataclass(frozen=True, eq=False)
class _Traffic:
    """Bytes per microbatch of each layer and edge on HBM, the links and the host link; CP's stall and buffers."""

    hbm: np.ndarray
    hbm_weights: np.ndarray
    """The weight-side part of `hbm` (streamed inside the GEMMs)."""
    quantize: np.ndarray
    """The low-precision cast kernels' part of `hbm`."""
    nvl: np.ndarray
    nic: np.ndarray
    ep_nvl: np.ndarray
    ep_nic: np.ndarray
    host: np.ndarray
    cp_stall: np.ndarray
    cp_working_set: np.ndarray | None


def _microbatch_traffic(b: _LayerBuild, acts: _Activations, work: _Work, ep: _Dispatch) -> _Traffic:
    """Per-microbatch traffic: HBM (_hbm_bytes); on the links the EP dispatch, the gradient reduce-scatter
    (per-microbatch lifecycle) and CP's own traffic; on the host link activation offload and ZeRO-2's shards."""
    sh, n, e = b.shape, b.n, b.shape.ep
    hbm_weights, hbm, quantize = _hbm_bytes(b, acts)
    nvl, nic = ep.nvl, ep.nic
    if not b.accumulate:
        # Per-microbatch reduce-scatter of the gradients in the gradient dtype, g P (1 - 1/n), hierarchical; only
        # where the gradients are sharded (a whole gradient buffer accumulates and is reduced once per update).
        a, b_ = _hier(b.gd * b.pn, b.g_fd, sh.dense_fsdp_local)
        c, d_ = _hier(b.gd * b.sa.p_routed / e, b.g_fe, sh.expert_fsdp_local)
        nvl, nic = nvl + a + c, nic + b_ + d_
    if b.gather_d or b.gather_e:
        # Megatron-FSDP gathers each layer before its forward and again before its backward, in the bytes per
        # element its shard holds (_unit_weight_bytes).
        wb = _fsdp_weight_bytes(sh.precision)
        a, b_ = _hier(2 * wb * b.pn * b.layer * b.gather_d, sh.dense_fsdp, sh.dense_fsdp_local)
        c, d_ = _hier(2 * wb * b.sa.p_routed / e * b.layer * b.gather_e, sh.expert_fsdp, sh.expert_fsdp_local)
        nvl, nic = nvl + a + c, nic + b_ + d_
    cp_stall, cp_ws = np.zeros(n), None
    if sh.cp > 1:
        cp_nvl, cp_nic, cp_stall, cp_ws = _context_parallel(b.model, sh, sh.tokens, b.cluster, sh.cp_in_domain,
                                                            sh.tokens * b.sa.attn * work.s_eff, b.full)
        nvl, nic = nvl + cp_nvl, nic + cp_nic
    host = np.zeros(n)
    if sh.toggles.activation_offload:
        host = host + 2 * acts.act                       # out in forward, back in backward
    host = host + 2 * acts.offloaded                     # activation_offload_layers: the same, for those layers
    if sh.toggles.pipeline_zero2_host_grads:
        host = host + FP32 * b.resident                  # gradient shard accumulated on the host
    return _Traffic(hbm=hbm, hbm_weights=hbm_weights, quantize=quantize, nvl=nvl, nic=nic, ep_nvl=ep.ep_nvl,
                    ep_nic=ep.ep_nic, host=host, cp_stall=cp_stall, cp_working_set=cp_ws)


def _hbm_bytes(b: _LayerBuild, acts: _Activations) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight-side, all, cast-kernel) HBM bytes per microbatch: weights read per pass, saved activations written
    and read, BF16 gradients and the FP32 read-modify-write, FP8 (de)quantization, the low-precision casts."""
    tg, T, view = b.shape.toggles, b.shape.tokens, b.view
    passes = 4 if b.full else 3
    acc = view if b.accumulate else b.resident
    # Weight-side traffic only (streamed inside the GEMMs); the achievable roofline keeps it apart from the
    # activation traffic of the memory-bound kernels between GEMMs.
    hbm_weights = passes * BF16 * view + BF16 * view + 2 * FP32 * acc
    hbm = passes * BF16 * view                          # weights read per pass
    hbm = hbm + 2 * (acts.act + acts.recompute_ws)      # saved activations written and read
    hbm = hbm + BF16 * view + 2 * FP32 * acc            # BF16 grads, FP32 RMW
    if tg.fp8_activations:
        hbm = hbm + 2 * BF16 * acts.fp8_values          # quantize reads BF16, dequantize writes BF16
    # Every low-precision GEMM operand X (forward) and dY (backward) is quantized once: read BF16, write a row-wise
    # and a column-wise copy (b + 1/block bytes each; Transformer Engine makes both usages for the forward/dgrad and
    # wgrad GEMMs). The cast kernels' own bytes are kept apart so the achievable step prices them at their rate.
    quantize = T * b.sa.q_elements * (BF16 + 2 * b.qb) if b.lowp else np.zeros(b.n)
    hbm = hbm + quantize
    if tg.moe_backward_rewrite and b.model.moe is not None:
        hbm = hbm + b.sa.moe * T * b.model.moe.experts_per_token * b.model.moe.expert_intermediate_size * BF16
    return hbm_weights, hbm, quantize


def _offload_stall(b: _LayerBuild, acts: _Activations, tensor: np.ndarray, vector: np.ndarray | None
                   ) -> np.ndarray:
    """Per layer (0 on the edges), the seconds one microbatch's compute stream waits for Transformer Engine's
    offload copies of activation_offload_layers (schedule.offload_stall): each layer's compute-stream seconds
    (`tensor`, plus `vector` where the memory-bound kernels run on the same stream) split forward / backward by
    forward_backward, one direction's copy = the layer's offloaded saved bytes / the host link."""
    stall = np.zeros(b.n)
    offloaded = b.shape.activation_offload_layers
    if not offloaded:
        return stall
    layers = b.model.num_layers
    fwd, bwd = forward_backward(tensor[:layers], np.zeros(layers) if vector is None else vector[:layers], b.full)
    stall[:layers] = offload_stall(fwd, bwd, host_link_seconds(acts.offloaded[:layers], b.cluster), offloaded)
    return stall


def host_link_seconds(nbytes: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """Seconds to move `nbytes` over one direction of the host link: bytes / host_link_gbps (the preset's figure
    is a measured copy-engine rate, so the peak and the achievable step read it alike)."""
    return nbytes / (cluster.host_link_gbps * 1e9)


def _peak_seconds(b: _LayerBuild, work: _Work, traffic: _Traffic) -> dict[str, np.ndarray]:
    """Seconds per microbatch on each resource at the cluster's peaks (the roofline): FLOPs / peak (the low
    precision GEMMs at theirs) + CP's stall, bytes / bandwidth."""
    cl, gb = b.cluster, 1e9
    return {
        "tensor": (work.tensor_flops - work.gemm_flops) / (cl.bf16_tflops * 1e12)
        + work.gemm_flops / (cl.dense_tflops(b.shape.precision) * 1e12) + traffic.cp_stall,
        "hbm": traffic.hbm / (cl.hbm_gbps * gb),
        "nvlink": traffic.nvl / (cl.nvlink_gbps * gb),
        "nic": traffic.nic / (cl.nic_gbps * gb),
        "host_link": host_link_seconds(traffic.host, cl),
    }


@dataclass(frozen=True, eq=False)
class _UpdateTraffic:
    """Bytes per update of each layer and edge on HBM, the links and the host link."""

    hbm: np.ndarray
    quantize: np.ndarray
    """The weight casts' part of `hbm`."""
    nvl: np.ndarray
    nic: np.ndarray
    host: np.ndarray


def _update_traffic(b: _LayerBuild) -> _UpdateTraffic:
    """Per-update traffic: the optimizer's HBM reads and writes (master r/w, grad read, momentum r/w; AdamW: two
    moments r/w) and the weight casts into the cached low-precision copies (row- and column-wise); the link bytes
    of _update_link_bytes; ZeRO-2's gradient shards over the host link."""
    n = b.n
    up_hbm = (2 * FP32 + FP32 + 2 * FP32) * b.own_muon + (2 * FP32 + FP32 + 4 * FP32) * b.own_adam
    up_quantize = b.q_view * (BF16 + 2 * b.qb) if b.lowp else np.zeros(n)
    up_nvl, up_nic = _update_link_bytes(b)
    return _UpdateTraffic(hbm=up_hbm + up_quantize, quantize=up_quantize, nvl=up_nvl, nic=up_nic,
                          host=FP32 * b.resident if b.shape.toggles.pipeline_zero2_host_grads else np.zeros(n))


def _update_link_bytes(b: _LayerBuild) -> tuple[np.ndarray, np.ndarray]:
    """NVLink and NIC bytes per update: the BF16 view refresh, the once-per-update gradient reduction per group,
    and P2P Muon's pull of the shards of the matrices a rank orthogonalizes."""
    sh, pn, p_routed, e = b.shape, b.pn, b.sa.p_routed, b.shape.ep
    # BF16 view refresh all-gather of the updated shards (none where the group shards nothing: every rank updates
    # the whole model itself).
    # Groups gathered per layer (Megatron-FSDP) gather each microbatch instead (_microbatch_traffic); their edges,
    # kept gathered, are refreshed here.
    # Per-tensor FP8 weights under fp8_param_gather are gathered in FP8; MXFP8's gather BF16 into the gradient
    # buffer and cast there (param_and_grad_buffer.py _post_param_sync @ d98e8a64).
    fp8 = _fp8_one_buffer(sh)
    dense_ag = 2 * pn - (2 - b.qb) * b.sa.q_params_nonrouted if fp8 else 2 * pn
    routed_ag = (2 * p_routed - (2 - b.qb) * b.sa.q_params_routed) / e if fp8 else 2 * p_routed / e
    up_nvl, up_nic = _hier(dense_ag * (1 - b.gather_d * b.layer), b.opt_fd, sh.dense_fsdp_local)
    a, b_ = _hier(routed_ag * (not b.gather_e), b.opt_fe, sh.expert_fsdp_local)
    up_nvl, up_nic = up_nvl + a, up_nic + b_
    # Gradient reduction once per update, per group: the FP32 accumulation buffer reduce-scattered (accumulate
    # lifecycle, sharded gradients); a whole gradient buffer reduce-scattered (optim: Megatron's distributed
    # optimizer) or all-reduced, twice the reduce-scatter's bytes (no_shard: DDP), in the gradient dtype.
    for total, f, local, pol in ((pn, sh.dense_fsdp, sh.dense_fsdp_local, sh.dense_sharding),
                                 (p_routed / e, sh.expert_fsdp, sh.expert_fsdp_local, sh.expert_sharding)):
        if pol in _GRADS_SHARDED:
            a, b_ = _hier(4 * total, f, local) if b.accumulate else (0.0, 0.0)
        else:
            times = 2 if pol == ShardingPolicy.NO_SHARD else 1
            a, b_ = _hier(times * b.gd * total, f, local)
        up_nvl, up_nic = up_nvl + a, up_nic + b_
    if sh.toggles.p2p_muon:
        # Pull the other shards of the Muon matrices this rank orthogonalizes: 2 (P / n)(1 - 1/n) per group (the
        # AdamW parameters are stepped element-wise on their shards: nothing to pull).
        a, b_ = _hier(2 * b.sa.pn_muon / sh.dense_fsdp, sh.dense_fsdp, sh.dense_fsdp_local)
        c, d_ = _hier(2 * b.sa.pr_muon / (e * sh.expert_fsdp), sh.expert_fsdp, sh.expert_fsdp_local)
        up_nvl, up_nic = up_nvl + a + c, up_nic + b_ + d_
    return up_nvl, up_nic


def _peak_update_seconds(b: _LayerBuild, ns_flops: np.ndarray, up: _UpdateTraffic) -> dict[str, np.ndarray]:
    """Seconds per update on each resource at the cluster's peaks: Newton-Schulz FLOPs, bytes / bandwidth."""
    cl, gb = b.cluster, 1e9
    return {
        "tensor": ns_flops / (cl.bf16_tflops * 1e12),
        "hbm": up.hbm / (cl.hbm_gbps * gb),
        "nvlink": up.nvl / (cl.nvlink_gbps * gb),
        "nic": up.nic / (cl.nic_gbps * gb),
        "host_link": host_link_seconds(up.host, cl),
    }


def _logits(b: _LayerBuild) -> dict[str, object]:
    """The loss's logits on the last stage: the LM head's BF16 logits and FP32 softmax of the microbatch's tokens,
    plus each MTP head's FP32 softmax, saved for backward when its loss ran before the LM head's (Megatron's
    GPTModel._postprocess computes the MTP losses first); under the chunked cross entropy one chunk, nothing saved."""
    tg, T, vocab = b.shape.toggles, b.shape.tokens, b.model.vocab_size
    if tg.fused_cross_entropy:
        v_tokens = min(T, b.shape.ce_chunk_tokens)
        return dict(logits=float(v_tokens * vocab * (BF16 + FP32)),
                    logits_formula=(f"{v_tokens} tokens x vocab {vocab} x (2 B BF16 logits + 4 B FP32 softmax) "
                                    "(one cross-entropy chunk)"))
    mtp = b.model.mtp_layers
    mtp_text = f" + {mtp} MTP head{'s' * (mtp > 1)} x 4 B FP32 softmax" if mtp else ""
    return dict(logits=float(T * vocab * (BF16 + FP32 + mtp * FP32)),
                logits_formula=f"{T} tokens x vocab {vocab} x (2 B BF16 logits + 4 B FP32 softmax{mtp_text})")


def _achievable_terms(b: _LayerBuild, acts: _Activations, work: _Work, traffic: _Traffic, ns_flops: np.ndarray,
                      up: _UpdateTraffic) -> dict[str, object]:
    """The achievable arrays of the CostModel's rates (empty without rates): per-resource seconds per microbatch and
    per update with the collectives' latency, and the routed experts' compute."""
    rt = b.cm.rates
    if rt is None:
        return dict(achievable={}, update_achievable={}, rates_name="", moe_compute_achievable=np.zeros(0),
                    moe_vector_achievable=np.zeros(0), offload_stall_achievable=np.zeros(0))
    sh, full, T, e = b.shape, b.full, b.shape.tokens, b.shape.ep
    # Memory-bound kernels between the GEMMs (memory_bound_kernel_bytes); quantize adds its own traffic.
    # Kernels on one stream run in sequence, so this time adds to the GEMM time.
    elementwise = memory_bound_kernel_bytes(acts.saved, full) \
        + (traffic.hbm - traffic.hbm_weights - 2 * (acts.act + acts.recompute_ws))
    elementwise = elementwise + loss_kernel_bytes(b.model, rt, T)
    replayed = sh.recompute_modules if sh.recompute == Recompute.SELECTIVE else ()
    tensor = b.cm.achievable_tensor(T, e, sh.precision, full, work.s_eff, sh.toggles.fused_cross_entropy, replayed)
    moe_gemm, moe_vector = b.cm.expert_compute(T, e, sh.precision, full, _activation_toggles(sh.toggles),
                                               sh.fp8_block_size)
    achievable, update_achievable = _achievable_time(
        sh, b.cluster, rt, tensor=tensor, hbm=traffic.hbm_weights, elementwise=elementwise, nvl=traffic.nvl,
        nic=traffic.nic, ep_nvl=traffic.ep_nvl, ep_nic=traffic.ep_nic, host=traffic.host, ns_flops=ns_flops,
        up_hbm=up.hbm, up_nvl=up.nvl, up_nic=up.nic, up_host=up.host, quantize=traffic.quantize,
        up_quantize=up.quantize)
    stall = _offload_stall(b, acts, achievable["tensor"],
                           achievable["vector"] if rt.overlap.vector_serial_with_tensor else None)
    achievable["tensor"] = achievable["tensor"] + stall
    lat = collective_latency(sh, rt, moe=b.sa.moe, dense=b.pn > 0, routed=b.sa.p_routed > 0,
                             moe_model=b.model.moe is not None)
    for res in ("nvlink", "nic"):
        achievable[res] = achievable[res] + lat["microbatch"][res]
        update_achievable[res] = update_achievable[res] + lat["update"][res]
    return dict(achievable=achievable, update_achievable=update_achievable, rates_name=rt.name,
                moe_compute_achievable=moe_gemm + moe_vector, moe_vector_achievable=moe_vector,
                offload_stall_achievable=stall)


def _read_only(terms: dict[str, object]) -> dict[str, object]:
    """Marks every array of a cached build read-only (also inside the per-resource dicts): shapes share them."""
    for v in terms.values():
        if type(v) is np.ndarray:
            v.flags.writeable = False
        elif type(v) is dict:
            for arr in v.values():
                arr.flags.writeable = False
    return terms


def collective_latency(shape: LayerShape, rt: RatesSpec, *, moe: np.ndarray, dense: np.ndarray,
                       routed: np.ndarray, moe_model: bool) -> dict[str, dict[str, np.ndarray]]:
    """Per-layer latency seconds of the NCCL collectives, per microbatch and per update, on the link each call
    crosses (the NIC when its group spans NVLink domains): calls x RatesSpec.ring_latency_s(group, per domain).
    Per microbatch: the routing-map all-gathers of each MoE layer over EP (comm.routing_map_allgathers_per_layer),
    and without gradient accumulation one gradient reduce-scatter per layer and sharded group (dense, routed).
    Per update: one parameter all-gather per layer and sharded group, plus the reduce-scatters under accumulation
    or of a whole gradient buffer (optim; no_shard all-reduces: two ring passes). The bytes of the same calls are
    priced elsewhere; this is their alpha term only."""
    n = len(moe)
    out = {k: {"nvlink": np.zeros(n), "nic": np.zeros(n)} for k in ("microbatch", "update")}

    def add(kind: str, calls: np.ndarray, group: int, local: int) -> None:
        lat = rt.ring_latency_s(group, local)
        if lat:
            out[kind]["nic" if group > local else "nvlink"] += calls * lat

    full = shape.recompute == Recompute.FULL
    if moe_model:
        add("microbatch", moe * comm.routing_map_allgathers_per_layer(full), shape.ep, shape.ep_local)
    accumulate = shape.fsdp_lifecycle == FsdpLifecycle.ACCUMULATE
    groups = ((dense.astype(float), shape.dense_fsdp, shape.dense_fsdp_local, shape.dense_sharding),
              (routed.astype(float), shape.expert_fsdp, shape.expert_fsdp_local, shape.expert_sharding))
    for calls, group, local, pol in groups:
        # The same calls as the byte terms of each sharding policy: no all-gather where the group shards nothing;
        # sharded gradients reduced per microbatch (per update under accumulation); a whole gradient buffer once
        # per update, reduce-scattered (optim) or all-reduced, two ring passes (no_shard).
        if pol != ShardingPolicy.NO_SHARD:
            add("update", calls, group, local)  # parameter all-gather
        if pol in (ShardingPolicy.OPTIM_GRADS, ShardingPolicy.OPTIM_GRADS_PARAMS):
            add("update" if accumulate else "microbatch", calls, group, local)  # gradient reduce-scatter
        else:
            add("update", calls * (2 if pol == ShardingPolicy.NO_SHARD else 1), group, local)
    return out


def model_moe_tokens_factor(ep: int, sa: _Static) -> float:
    """Tokens one routed expert's GEMM sees per token of the microbatch: k e / E (balanced, dropless)."""
    return sa.moe_k * ep / sa.moe_experts if sa.moe_experts else 1.0


def recompute_flops_factor(full: bool) -> float:
    """A layer's training FLOPs over fwd + bwd (3 units): 4/3 under full recompute (one more forward), else 1."""
    return 4 / 3 if full else 1.0


def _gemm_row_seconds(sa: _Static, cluster: ClusterSpec, rt: RatesSpec, T: int, ep: int,
                      precision: Precision) -> np.ndarray:
    """Seconds per microbatch of each row of `sa.gemms` (fwd + bwd, no recompute) at the achievable rates.
    Each weight: 6 x T x out x in x active FLOPs at (peak of its precision) x (class fraction) x (shape factor).
    Its M is the microbatch's T tokens, or for a routed expert the tokens one expert receives under balanced
    dropless routing, T k e / E. With a measured shape table (RatesSpec.gemm_shape) each of the three passes, a
    third of the FLOPs, runs at the table's rate of its own GEMM relative to the class's reference shape, with F
    the output width of the GEMM the weight runs in (fused_gemm_widths: q, k, v; gate and up): forward (M, F, in),
    data gradient (M, in, F), weight gradient (F, in, M), the two gradients in the table's gradient column where
    the rates name one (GemmShape.gradient_columns). Otherwise one factor from the cube-edge curve at
    (M out in)^(1/3)."""
    tf = 1e12
    p, bf = precision, Precision.BF16
    lowp = p != bf
    bf16 = cluster.bf16_tflops * tf
    pk = cluster.dense_tflops(p) * tf
    g = sa.gemms
    _, out, inp, act, is_routed, q = (g[:, j] for j in range(6))
    moe = model_moe_tokens_factor(ep, sa)
    m_tokens = np.where(is_routed > 0, T * moe, T)
    flops = 6.0 * T * out * inp * act
    use_q = (q > 0) & lowp
    dense = np.where(use_q, rt.gemm("dense", p) if lowp else 0, rt.gemm("dense", bf))
    frac = np.where(is_routed > 0, np.where(use_q, rt.gemm("grouped", p) if lowp else 0, rt.gemm("grouped", bf)),
                    dense)
    peak = np.where(use_q, pk, bf16)
    cube = rt.size_factor(np.cbrt(m_tokens * out * inp))
    fused = sa.gemm_out_fused
    inv = np.zeros(len(out))  # 1 / (class fraction x shape factor), averaged over the passes
    for prec, rows in ((p, use_q), (bf, ~use_q)):
        if not rows.any():
            continue
        m, f, k, r = m_tokens[rows], fused[rows], inp[rows], is_routed[rows]
        passes = []
        for grad, mnk in ((False, (m, f, k)), (True, (m, k, f)), (True, (f, k, m))):
            g = rt.shape_factors(prec, r, *mnk, gradient=grad)
            if g is None:
                break
            # A group of a grouped GEMM runs no faster than one dense GEMM of its shape: above the grouped
            # reference's size the dense class's rate caps it.
            d = rt.shape_factors(prec, np.zeros_like(r), *mnk, gradient=grad)
            passes.append(np.where(r > 0, np.minimum(frac[rows] * g, dense[rows] * d), frac[rows] * g))
        inv[rows] = (sum(1.0 / x for x in passes) / 3.0 if passes else 1.0 / (frac[rows] * cube[rows]))
    return flops * inv / peak


def _build_achievable_tensor(cm: CostModel, T: int, ep: int, precision: Precision,
                             full: bool, s_eff: int, fused_cross_entropy: bool,
                             modules: tuple[str, ...] = ()) -> np.ndarray:
    """Tensor-core seconds per microbatch of each layer and edge at the achievable rates (read-only: cached):
    FLOPs of each GEMM class / (its precision's dense peak x the class's measured fraction x its shape factor),
    attention and scan FLOPs / (BF16 peak x attention forward / backward fraction). A weight Megatron's recompute
    `modules` replay runs its forward once more: a third of its row's seconds."""
    cluster, rt, sa = cm.cluster, cm.rates, cm.static
    tf = 1e12
    n = len(sa.moe)
    layer = np.arange(n) < n - 2
    rc = np.where(layer, recompute_flops_factor(full), 1.0)
    bf = Precision.BF16
    bf16 = cluster.bf16_tflops * tf
    g = sa.gemms
    rows = _gemm_row_seconds(sa, cluster, rt, T, ep, precision)
    tensor = np.bincount(g[:, 0].astype(int), weights=rows, minlength=n) * rc
    if modules:
        # A replayed weight runs its forward once more: one of its row's three passes (forward, data gradient,
        # weight gradient), a third of the row's seconds.
        again = np.array([replays(kind, name, modules) for kind, name in sa.gemm_names], dtype=float)
        tensor = tensor + np.bincount(g[:, 0].astype(int), weights=rows * again / 3, minlength=n)
    if fused_cross_entropy:
        tensor[-1] += 2 * T * sa.head_active / (bf16 * rt.gemm("dense", bf))
    # Attention and scan FLOPs are 1 forward + 2 backward units (one more forward under full recompute, rc = 4/3):
    # the forward share runs at the forward kernels' rate, the backward share at the backward kernels'.
    core = T * (sa.attn * s_eff + sa.scan)
    tensor = tensor + core * (rc - 2 / 3) / (bf16 * rt.attention_core.value) \
        + core * (2 / 3) / (bf16 * rt.attention_backward())
    tensor.flags.writeable = False
    return tensor


def achievable_hbm_seconds(nbytes: np.ndarray, cluster: ClusterSpec, rt: RatesSpec) -> np.ndarray:
    """Seconds to stream `nbytes` through HBM at the achievable rate: bytes / (HBM peak x the rates' HBM fraction)."""
    return nbytes / (cluster.hbm_gbps * 1e9 * rt.hbm.value)


def achievable_quantize_seconds(nbytes: np.ndarray, cluster: ClusterSpec, rt: RatesSpec) -> np.ndarray:
    """Seconds of the MXFP8 / FP8 cast kernels (read BF16, write the row- and column-wise copies) moving `nbytes`:
    bytes / (HBM peak x the rates' `hbm_quantize` fraction; without one, the `hbm` copy fraction)."""
    return nbytes / (cluster.hbm_gbps * 1e9 * (rt.hbm_quantize or rt.hbm).value)


def _achievable_time(shape: LayerShape, cluster: ClusterSpec, rt: RatesSpec, *, tensor: np.ndarray,
                     hbm: np.ndarray, elementwise: np.ndarray, nvl: np.ndarray,
                     nic: np.ndarray, ep_nvl: np.ndarray, ep_nic: np.ndarray, host: np.ndarray, ns_flops: np.ndarray,
                     up_hbm: np.ndarray, up_nvl: np.ndarray, up_nic: np.ndarray, up_host: np.ndarray,
                     quantize: np.ndarray, up_quantize: np.ndarray
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Seconds per microbatch (and per update) on each resource at the achievable rates of `rt`: `tensor` from
    _achievable_tensor, bytes / (link or HBM peak x fraction), EP all-to-all bytes / the dispatcher's measured
    all-to-all bandwidth. `ep_nvlink` / `ep_nic` are kept apart: they are exposed unless an overlap schedule is on
    (the step-time helper decides). `quantize` / `up_quantize`: the part of `elementwise` / `up_hbm` the MXFP8 / FP8
    cast kernels move, at achievable_quantize_seconds."""
    q, uq = quantize, up_quantize
    gb, tf = 1e9, 1e12
    dispatcher = shape.dispatcher or DEFAULT_DISPATCHER
    bf = Precision.BF16
    bf16 = cluster.bf16_tflops * tf
    c_nvl = cluster.nvlink_gbps * gb * rt.collective_nvlink.value
    c_nic = cluster.nic_gbps * gb * rt.collective_nic.value
    time = {
        "tensor": tensor,
        "hbm": achievable_hbm_seconds(hbm, cluster, rt),
        "vector": achievable_hbm_seconds(elementwise - q, cluster, rt) + achievable_quantize_seconds(q, cluster, rt),
        "nvlink": (nvl - ep_nvl) / c_nvl,
        "nic": (nic - ep_nic) / c_nic,
        "host_link": host_link_seconds(host, cluster),
        "ep_nvlink": ep_nvl / (rt.a2a(dispatcher, "nvlink") * gb) if ep_nvl.any() else np.zeros_like(nvl),
        "ep_nic": ep_nic / (rt.a2a(dispatcher, "nic") * gb) if ep_nic.any() else np.zeros_like(nic),
    }
    update = {
        "tensor": ns_flops / (bf16 * rt.gemm("dense", bf)),
        "hbm": achievable_hbm_seconds(up_hbm - uq, cluster, rt) + achievable_quantize_seconds(uq, cluster, rt),
        "nvlink": up_nvl / c_nvl,
        "nic": up_nic / c_nic,
        "host_link": host_link_seconds(up_host, cluster),
    }
    return time, update


# ---------------------------------------------------------------- achievable: loss kernels and the MoE expert part
# Two per-layer terms of the achievable roofline kept apart from the rest: the cross-entropy kernels' HBM traffic
# on the last edge, and the routed-expert share of each layer's compute that the EP overlap schedule pairs with
# the all-to-all (k3opt.cost.achievable.ep_overlap_stage_exposed).


def loss_kernel_bytes(model: ModelSpec, rt: RatesSpec, tokens: int) -> np.ndarray:
    """HBM bytes per microbatch of the cross-entropy kernels, on the last edge (length L + 2): one loss per output
    head (the LM head and each MTP module), T x vocab logits x TE_CROSS_ENTROPY_BYTES_PER_LOGIT when the rates
    file's `[loss_kernels]` names TransformerEngine's fused cross entropy; zeros otherwise (unpriced)."""
    out = np.zeros(model.num_layers + 2)
    if rt.loss_kernels is not None and rt.loss_kernels.te_fused_cross_entropy:
        heads = 1 + model.mtp_layers
        out[-1] = heads * tokens * model.vocab_size * TE_CROSS_ENTROPY_BYTES_PER_LOGIT
    return out


def _build_expert_compute(cm: CostModel, T: int, ep: int, precision: Precision, full: bool, toggles: Toggles,
                          fp8_block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, (tensor-core, memory-bound) seconds per microbatch of the compute Megatron's combined 1F1B schedule
    runs as the `mlp` node (NVIDIA/Megatron-LM megatron/core/models/gpt/fine_grained_callables.py: the routed
    experts; attention, the router and the shared experts run in the pre-dispatch node): the routed GEMMs at the
    achievable rates (_gemm_row_seconds) x the recompute factor, and the memory-bound kernels over the routed
    experts' saved tensors (Saved.routed: the dispatched inputs, the expert activations and outputs;
    memory_bound_kernel_bytes, as in the `vector` resource) at the achievable HBM rate. Read-only: cached."""
    sa, cluster, rt = cm.static, cm.cluster, cm.rates
    n = len(sa.moe)
    g = sa.gemms
    rc = np.where(np.arange(n) < n - 2, recompute_flops_factor(full), 1.0)
    routed = g[:, 4] > 0
    gemm = np.bincount(g[:, 0].astype(int), weights=_gemm_row_seconds(sa, cluster, rt, T, ep, precision) * routed,
                       minlength=n) * rc
    routed_saved = cm.saved(T, toggles, fp8_block, precision, routed=True)[0]
    out = gemm, achievable_hbm_seconds(memory_bound_kernel_bytes(routed_saved, full), cluster, rt)
    for part in out:
        part.flags.writeable = False
    return out
