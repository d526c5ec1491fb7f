"""Pydantic models for the input files (model, cluster, runtime, layout, job); k3opt.inputs.presets loads them.

Every file is validated on load: unknown keys are rejected, sizes must be positive, and cross-field rules
(divisibility of the parallel degrees) are checked here when they need no model. Rules that need the model
(the split covers its layers, EP divides its experts) live in :func:`check_layout`.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    field_validator,
    model_validator,
)

from k3opt.inputs import pipeline_layout as pll
from k3opt.inputs.errors import LayoutError, SpecError

GIB = 1 << 30
MIB = 1 << 20
BF16, FP32, INT64 = 2, 4, 8
"""Bytes per element of the dtypes the ledger counts."""
NO_RUNTIME = "none"
"""The runtime name that means no runtime: live tensors only (a job's explicit opt-out of its cluster's default)."""



def _numpy_scalar(v: Any) -> Any:
    """NumPy integers and floats (from the search's arrays) are numbers; strings and booleans never are."""
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


# Strict numbers: "64" where a number belongs is an error, not silently converted (TOML has real numbers).
# A float field accepts an integer (TOML `hbm_gbps = 8000`); an integer field rejects 3.0 and true.
StrictInt = Annotated[int, BeforeValidator(_numpy_scalar), Field(strict=True)]
StrictFloat = Annotated[float, BeforeValidator(_numpy_scalar), Field(strict=True, allow_inf_nan=False)]
PosInt = Annotated[int, BeforeValidator(_numpy_scalar), Field(gt=0, strict=True)]
MAX_GPUS = 1 << 20
GpuCount = Annotated[int, BeforeValidator(_numpy_scalar), Field(gt=0, le=MAX_GPUS, strict=True)]
"""At most 1,048,576 GPUs: the placement builds per-rank arrays."""
PosFloat = Annotated[float, BeforeValidator(_numpy_scalar), Field(gt=0, strict=True, allow_inf_nan=False)]
NonNegFloat = Annotated[float, BeforeValidator(_numpy_scalar), Field(ge=0, strict=True, allow_inf_nan=False)]
NonNegInt = Annotated[int, BeforeValidator(_numpy_scalar), Field(ge=0, strict=True)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------- model


class KDASpec(StrictModel):
    """Kimi Delta Attention (linear attention) shapes."""

    num_heads: PosInt
    head_dim: PosInt
    short_conv_kernel: PosInt
    decay_rank: PosInt
    """Rank of the low-rank per-channel decay gate (f_a [r, d], f_b [H*dk, r])."""
    full_rank_output_gate: StrictBool = True
    chunk_size: PosInt = 64
    """Chunk length of the chunked delta-rule scan; sets the scan's intra-chunk FLOPs."""


class MLASpec(StrictModel):
    """Gated multi-head latent attention shapes."""

    num_heads: PosInt
    q_lora_rank: PosInt
    kv_lora_rank: PosInt
    qk_nope_head_dim: PosInt
    qk_rope_head_dim: PosInt
    v_head_dim: PosInt
    output_gate: StrictBool = True


class GQASpec(StrictModel):
    """Grouped-query softmax attention (Llama 3, Qwen3): H query heads share K/V across H / kv groups."""

    num_heads: PosInt
    num_kv_heads: PosInt
    head_dim: PosInt
    qk_norm: StrictBool = False
    """Per-head RMSNorm on Q and K (Qwen3: q_norm, k_norm of width head_dim)."""
    attention_bias: StrictBool = False
    """Biases on the Q, K, V projections."""

    @model_validator(mode="after")
    def _groups(self) -> GQASpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self


class DenseFFNSpec(StrictModel):
    intermediate_size: PosInt


class MoESpec(StrictModel):
    """MoE FFN. With `latent_size` (latent MoE) the routed stream is compressed to that width before
    dispatch; without it the experts read the hidden state (DeepSeek-V3, Qwen3)."""

    num_experts: PosInt
    experts_per_token: PosInt
    latent_size: PosInt | None = None
    expert_intermediate_size: PosInt
    shared_intermediate_size: StrictInt = Field(default=0, ge=0)
    """Summed intermediate width of the shared experts (0: none)."""
    router_bias: StrictBool = False
    """A learned per-expert routing bias (DeepSeek-V3 e_score_correction_bias)."""


class AttnResSpec(StrictModel):
    """Block Attention Residuals."""

    block_size: PosInt
    bank_representatives: PosInt
    """Seed 001's bank size: up to this many representatives of width d (shown as a cross-check)."""
    sublayers_per_layer: PosInt = 2
    """Seed 002 counts blocks over sublayers: a 12-layer stage emits 2 residual blocks."""


class VisionSpec(StrictModel):
    """MoonViT-style vision tower plus patch-merge projector (all AdamW, no per-token text work)."""

    num_blocks: PosInt
    hidden_size: PosInt
    num_heads: PosInt
    head_dim: PosInt
    intermediate_size: PosInt
    patch_size: PosInt
    image_channels: PosInt = 3
    pos_emb_grid: PosInt
    merge_kernel: PosInt
    """Patches merged into one projector input (2 x 2 = 4)."""
    projector_hidden_size: PosInt


class MTPSpec(StrictModel):
    """Multi-token prediction modules (DeepSeek-V3 section 2.2): each is enorm + hnorm, a [d, 2d]
    projection and one decoder layer of the last layer's kinds; embedding and output head are shared
    with the main model (no parameters) but the head is applied once more per module."""

    num_layers: PosInt = 1


class Dtype(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def bytes(self) -> int:
        return FP32 if self is Dtype.FP32 else BF16


class OptimizerSpec(StrictModel):
    """The optimizer a model trains with: Muon for its 2-D matrices (AdamW for the rest: embeddings, norms, the head,
    `adamw_matrices`), or AdamW for every tensor. AdamW keeps two moments per parameter, Muon one momentum; only
    Muon runs Newton-Schulz at the step (its time and its working set)."""

    name: Literal["muon", "adamw"] = "muon"
    state_dtype: Dtype = Dtype.FP32
    """Muon momentum / AdamW moments dtype in the model's recipe; a layout's `optimizer_state_dtype` overrides it."""
    adamw_matrices: list[str] = Field(default_factory=list)
    """Under Muon, 2-D text matrices assigned to AdamW instead (names as in k3opt.cost.structure)."""

    def state_of(self, layout_dtype: Dtype | None) -> Dtype:
        """The optimizer-state dtype a layout prices: its own, else the model's."""
        return layout_dtype or self.state_dtype

    @model_validator(mode="after")
    def _matrices_under_muon(self) -> OptimizerSpec:
        if self.name == "adamw" and self.adamw_matrices:
            raise ValueError("adamw_matrices names matrices taken out of Muon; with name = \"adamw\" every tensor is "
                             "AdamW already: remove adamw_matrices")
        return self


class ModelSpec(StrictModel):
    """A decoder stack of KDA / MLA / GQA attention with dense or (latent) MoE FFNs, read from TOML.

    `full_attention_layers` lists the softmax-attention layers (MLA or GQA, whichever table is given);
    all other layers are KDA. `dense_ffn_layers` lists the dense-FFN layers; all others are MoE. Either
    list may be the string "all"."""

    name: str
    hidden_size: PosInt
    num_layers: Annotated[int, BeforeValidator(_numpy_scalar), Field(gt=0, le=4096, strict=True)]
    vocab_size: PosInt
    tie_word_embeddings: StrictBool = False
    full_attention_layers: list[StrictInt] = Field(default_factory=list)
    dense_ffn_layers: list[StrictInt] = Field(default_factory=list)
    kda: KDASpec | None = None
    mla: MLASpec | None = None
    gqa: GQASpec | None = None
    dense_ffn: DenseFFNSpec | None = None
    moe: MoESpec | None = None
    attn_res: AttnResSpec | None = None
    vision: VisionSpec | None = None
    mtp: MTPSpec | None = None
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    source: str = ""
    """Where the shapes were copied from (repository and file)."""
    ffn_activation: Literal["situ_glu", "swiglu"] = "situ_glu"
    """Gated activation of every FFN: K3's SiTU-GLU (seed 004: the naive autograd keeps six FP32 copies unless
    the fused op is on) or a plain SwiGLU (saves its BF16 [R, 2H] input, as Megatron's fused bias-SwiGLU)."""

    @model_validator(mode="before")
    @classmethod
    def _all_layers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            n = data.get("num_layers")
            for key in ("full_attention_layers", "dense_ffn_layers"):
                if data.get(key) == "all" and isinstance(n, int):
                    data = {**data, key: list(range(n))}
        return data

    @property
    def mtp_layers(self) -> int:
        """Multi-token prediction layers (0 without MTP)."""
        return self.mtp.num_layers if self.mtp is not None else 0

    @property
    def dispatch_width(self) -> int:
        """Width of the routed stream the EP all-to-all carries: the latent width, else the hidden size."""
        assert self.moe is not None
        return self.moe.latent_size or self.hidden_size

    @model_validator(mode="after")
    def _layers(self) -> ModelSpec:
        for field in ("full_attention_layers", "dense_ffn_layers"):
            bad = [i for i in getattr(self, field) if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"{field} has layer indices outside 0..{self.num_layers - 1}: {bad}")
        if len(self.full_attention_layers) < self.num_layers and self.kda is None:
            raise ValueError("some layers are linear attention but the [kda] table is missing")
        if self.mla is not None and self.gqa is not None:
            raise ValueError("give one softmax-attention table, [mla] or [gqa], not both")
        if self.full_attention_layers and self.mla is None and self.gqa is None:
            raise ValueError("full_attention_layers is set but the [mla] (or [gqa]) table is missing")
        if self.dense_ffn_layers and self.dense_ffn is None:
            raise ValueError("dense_ffn_layers is set but the [dense_ffn] table is missing")
        if len(set(self.dense_ffn_layers)) < self.num_layers and self.moe is None:
            raise ValueError("some layers are MoE but the [moe] table is missing")
        return self


# ------------------------------------------------------------------------------------------- precision


class Precision(StrEnum):
    """Compute precision of the linear layers (Megatron / Transformer Engine run the linear GEMMs in it; the
    attention core, the router, the embedding and the output layer stay BF16)."""

    BF16 = "bf16"
    FP8 = "fp8"
    """FP8 E4M3 with per-tensor (current/delayed) scaling: one FP32 scale per tensor."""
    MXFP8 = "mxfp8"
    """OCP microscaling FP8: one E8M0 (1 byte) scale per 32 elements (TE MXFP8 recipe)."""
    NVFP4 = "nvfp4"
    """NVIDIA FP4 E2M1: one E4M3 (1 byte) scale per 16 elements plus a per-tensor FP32 scale."""


PRECISION_FORMAT: dict[Precision, tuple[float, int]] = {
    Precision.BF16: (2.0, 0),
    Precision.FP8: (1.0, 0),
    Precision.MXFP8: (1.0, 32),
    Precision.NVFP4: (0.5, 16),
}
"""(bytes per element, elements per 1-byte block scale; 0: one scale per tensor) of each precision
(OCP Microscaling Formats spec v1.0; NVIDIA Transformer Engine low-precision training docs)."""


def quantized_bytes_per_element(precision: Precision) -> float:
    """Bytes one element takes in `precision`, its block scales included: b + 1 / block."""
    b, block = PRECISION_FORMAT[precision]
    return b + (1.0 / block if block else 0.0)


# ------------------------------------------------------------------------------------------- cluster


class ClusterSpec(StrictModel):
    """Per-GPU physical quantities. Bandwidths are per GPU, per direction; FLOP/s are dense peaks.

    Every field is a named physical quantity a user may override with a measurement (for example a
    measured NCCL bus bandwidth instead of the NVLink peak)."""

    name: str
    hbm_mib: PosInt
    """HBM capacity as nvidia-smi reports it, MiB."""
    hbm_gbps: PosFloat
    bf16_tflops: PosFloat
    fp8_tflops: PosFloat
    nvlink_gbps: PosFloat
    nvlink_domain_gpus: PosInt
    nic_gbps: PosFloat
    host_memory_gb: PosFloat
    """Host memory available to one GPU's process (offloaded activations, host gradient shards), GB."""
    host_link_gbps: PosFloat
    """GPU <-> host copy bandwidth, per direction."""
    source: str = ""
    fp4_tflops: PosFloat | None = None
    """Dense FP4 (NVFP4) tensor peak; absent: the GPU has no FP4 tensor cores."""
    microscaling: StrictBool = True
    """Tensor cores take block-scaled (MX / NVFP4) operands natively (Blackwell); Hopper does not."""
    peaks_source: str = ""
    """Datasheet the dense per-precision peaks come from."""
    sm_count: PosInt | None = None
    """Streaming multiprocessors per GPU (what an overlapped communication kernel's SMs are a share of)."""
    default_runtime: str | None = None
    """Runtime preset (constraints/runtimes/) a job on this cluster plans with when the job names none: the memory
    outside live tensors of the stack measured on this hardware. Absent: no preset exists for it (live tensors)."""

    def dense_tflops(self, precision: Precision | str) -> float:
        """Dense tensor peak for one compute precision: BF16, FP8 = MXFP8, NVFP4 = FP4."""
        p = Precision(precision)
        if p == Precision.BF16:
            return self.bf16_tflops
        if p in (Precision.MXFP8, Precision.NVFP4) and not self.microscaling:
            raise LayoutError(f"{self.name} has no block-scaled ({p.value}) tensor cores; use bf16 or fp8")
        if p == Precision.NVFP4:
            if self.fp4_tflops is None:
                raise LayoutError(f"{self.name} has no FP4 peak (fp4_tflops); use bf16, fp8 or mxfp8")
            return self.fp4_tflops
        return self.fp8_tflops

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_mib * MIB

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_gb * 1e9)


# -------------------------------------------------------------------------------------------- layout


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    """Element-wise ops are recomputed in backward; GEMM inputs and attention outputs are kept."""
    FULL = "full"
    """Only each layer's input is kept; the layer's forward is replayed in backward."""


class RecomputeModule(StrEnum):
    """Megatron's selective-recompute modules (--recompute-modules) whose saved sets k3opt derives
    (k3opt.cost.structure.MEGATRON_RECOMPUTE)."""

    MLA_UP_PROJ = "mla_up_proj"
    """The MLA query and key-value up-projections with RoPE: their outputs (the attention core's q, k, v) are
    discarded after the core reads them and recomputed in backward."""
    MLP = "mlp"
    """The whole dense MLP of a non-MoE layer, checkpointed at its input."""


class CudaGraphImpl(StrEnum):
    """Megatron's --cuda-graph-impl (megatron/core/transformer/transformer_config.py L1075 @ d98e8a64)."""

    NONE = "none"
    LOCAL = "local"
    """MCore's CudaGraphManager: per-layer graphs over `cuda_graph_modules`."""
    TRANSFORMER_ENGINE = "transformer_engine"
    """TransformerEngine's make_graphed_callables: per-layer graphs over `cuda_graph_modules`."""
    FULL_ITERATION = "full_iteration"
    """One graph for the whole forward-backward pass (the optimizer step excluded)."""


PER_LAYER_GRAPHS = frozenset({CudaGraphImpl.LOCAL, CudaGraphImpl.TRANSFORMER_ENGINE})
"""The implementations that graph each layer over `cuda_graph_modules` (an empty list: the whole layer)."""


class CudaGraphModule(StrEnum):
    """Megatron's --cuda-graph-modules: what a per-layer graph captures (transformer_config.py L1090-1104)."""

    ATTN = "attn"
    """TransformerLayer._forward_attention()."""
    MLP = "mlp"
    """The dense MLP of a non-MoE layer."""
    MOE = "moe"
    """The whole MoE block: drop-and-pad MoE only."""
    MOE_ROUTER = "moe_router"
    """The MoE block up to the router, with the shared experts when they are not overlapped with EP comm."""
    MOE_PREPROCESS = "moe_preprocess"
    """MoELayer.preprocess(), with moe_router only."""


class OffloadModule(StrEnum):
    """Megatron's --offload-modules under --fine-grained-activation-offloading: each offloads what autograd saves
    inside its scope (megatron/core/transformer/transformer_config.py L1328-1342 @ d98e8a64; which k3opt saved
    tensors each holds: k3opt.cost.structure.MEGATRON_OFFLOAD)."""

    ATTN_NORM = "attn_norm"
    """The input norm of the attention part (nothing where TE fuses it into the QKV linear, as for MLA and GQA)."""
    QKV_LINEAR = "qkv_linear"
    """The Q/K/V projections (with the fused input norm): what they save up to q, k and v."""
    CORE_ATTN = "core_attn"
    """The attention core: q, k, v, its output and the softmax statistics."""
    ATTN_PROJ = "attn_proj"
    """The output projection's input (needs core_attn: that input is the core's output)."""
    MLP_NORM = "mlp_norm"
    """The pre-MLP norm of an MoE layer (fused into fc1 in a dense MLP)."""
    EXPERT_FC1 = "expert_fc1"
    """The routed experts' fc1 input: the dispatched tokens."""
    MOE_ACT = "moe_act"
    """The routed experts' activation input: the fc1 output."""


EXPERT_OFFLOAD_MODULES = frozenset({OffloadModule.EXPERT_FC1, OffloadModule.MOE_ACT})
"""The modules Megatron offloads beside cuda_graph_impl = "local" (transformer_config.py L2931-2938)."""


class ParamGather(StrEnum):
    """When a fully sharded group's (optim_grads_params) parameters are gathered for compute."""

    UPDATE = "update"
    """Gathered once and kept from the first forward to the last backward of the update (seed 000's reference)."""
    LAYER = "layer"
    """Megatron-FSDP: each decoder layer (an FSDP unit) gathered before its forward and again before its backward,
    then released; two units buffered at once (fsdp_double_buffer), the embedding and output layer kept gathered."""


class FsdpLifecycle(StrEnum):
    PER_MICROBATCH = "per_microbatch"
    """BF16 view kept for the update; gradients reduce-scattered every microbatch (seed 000 reference)."""
    ACCUMULATE = "accumulate"
    """BF16 view kept; gradients accumulated in an unsharded FP32 buffer, one reduce-scatter per update."""


class Toggles(StrictModel):
    """Memory toggles of the K3 paper section 5.2.2 (seed 001) and seed 004; false when absent."""

    fp8_activations: StrictBool = False
    """Block-wise FP8 storage of saved GEMM inputs (1 byte + one FP32 scale per block)."""
    activation_offload: StrictBool = False
    """Saved activations go to host memory; the current and the prefetched layer stay on the GPU."""
    balance_activations: StrictBool = False
    """Remote offload between PP ranks: each rank holds the average in-flight count."""
    moe_backward_rewrite: StrictBool = False
    """dL/dp_e from a_e and the upstream gradient: the expert outputs are not saved."""
    dispatch_recompute: StrictBool = False
    """Only the pre-dispatch input is saved; the dispatch is replayed in backward."""
    fused_situ: StrictBool = False
    """Streaming SiTU-GLU: saves the BF16 [R, 2H] input instead of six FP32 [R, H] copies (seed 004)."""
    pipeline_zero2_host_grads: StrictBool = False
    """Two chunk-sized FP32 gradient buffers on the GPU; the gradient shards live in host memory."""
    p2p_muon: StrictBool = False
    """Muon pulls only the matrices it orthogonalizes: no full BF16 parameter all-gather at the step."""
    moonep: StrictBool = False
    """MoonEP: room for one more copy of the local expert weights and fixed all-to-all buffers."""
    fused_cross_entropy: StrictBool = False
    """Cross-entropy over token chunks: the [T, vocab] logits are never materialized whole."""
    ep_dedup: StrictBool = False
    """Dispatcher sends a token once per destination rank (expected distinct ranks, seed 002)."""


TOGGLE_NAMES: tuple[str, ...] = tuple(Toggles.model_fields)


class ShardingPolicy(StrEnum):
    """What a data-parallel shard group shards, in Megatron's vocabulary (`--data-parallel-sharding-strategy`
    of Megatron-FSDP; `optim` is Megatron's distributed optimizer)."""

    NO_SHARD = "no_shard"
    """Nothing sharded: FP32 masters, optimizer state and the gradient buffer whole on every rank."""
    OPTIM = "optim"
    """FP32 masters and optimizer state sharded; the BF16 weights and the gradient buffer whole."""
    OPTIM_GRADS = "optim_grads"
    """Masters, state and gradients sharded (gradients reduce-scattered); the BF16 weights whole."""
    OPTIM_GRADS_PARAMS = "optim_grads_params"
    """Everything sharded; the BF16 compute view gathered and kept for the update (seed 000's reference)."""


class ShardGranularity(StrEnum):
    ELEMENT = "element"
    """Flat buffers cut into equal element ranges: every rank owns 1/f of the group."""
    TENSOR = "tensor"
    """Whole tensors per rank (layer-wise distributed optimizer, dist_muon): the worst rank owns the most."""


class MeasurementKind(StrEnum):
    """Which memory a measured peak is: torch.cuda.max_memory_allocated (live tensors), max_memory_reserved
    (plus the caching allocator's slack; torchtitan's `memory:` line), device-used (nvidia-smi,
    torch.cuda.device_memory_used), or not said (compared against both reserved and device)."""

    ALLOCATED = "allocated"
    RESERVED = "reserved"
    DEVICE = "device"
    UNSTATED = "unstated"


class Measured(StrictModel):
    """Figures a real run measured, for validation only (never an input to the model)."""

    kind: MeasurementKind = MeasurementKind.UNSTATED
    rank: Annotated[int, BeforeValidator(_numpy_scalar), Field(ge=0, strict=True)] | None = None
    """PP rank the memory figures were read on (default: the modeled worst rank)."""
    dp_rank: Annotated[int, BeforeValidator(_numpy_scalar), Field(ge=0, strict=True)] | None = None
    """Data-parallel rank (its index in the shard groups) the figures were read on; whole-tensor sharding gives
    ranks unequal shares (default: the rank owning the most)."""
    peak_gib: PosFloat | None = None
    resident_gib: PosFloat | None = None
    """Persistent (parameter-shaped) memory of the rank, after the first optimizer step."""
    optimizer_transient_gib: PosFloat | None = None
    """Peak minus resident at the optimizer step."""
    pre_step_resident_gib: PosFloat | None = None
    """Resident memory read before the first optimizer step (lazily allocated state not yet there)."""
    terms_gib: dict[str, PosFloat] = Field(default_factory=dict)
    """Measured ledger terms by ledger key (e.g. `grads`, `master`), GiB."""
    step_time_s: PosFloat | None = None
    tokens_per_s_per_gpu: PosFloat | None = None
    model_tflops_per_gpu: PosFloat | None = None
    """The run's own model-FLOP rate per GPU (Megatron's num_floating_point_operations), when published."""
    hardware: str | None = None
    """The GPU the run was measured on, when the layout's cluster preset only stands in for one k3opt has no preset
    of: its figures are then compared as allocated bytes only, and no fit against that preset's HBM is claimed."""
    note: str = ""


def _check_fp8_param_gather(lay: Layout) -> None:
    """fp8_param_gather as priced: FP8 or MXFP8 weights under Megatron's distributed optimizer, whose whole gradient
    buffer the MXFP8 all-gather reuses (megatron/core/distributed/param_and_grad_buffer.py L1161-1178 @ d98e8a64)."""
    if not lay.fp8_param_gather:
        return
    if lay.precision not in FP8_WEIGHT_PRECISIONS:
        raise ValueError(f"fp8_param_gather stores the weights in the compute precision, but precision is "
                         f"\"{lay.precision.value}\"; use precision \"fp8\" or \"mxfp8\", or drop fp8_param_gather")
    if not fp8_weights_priced(lay.precision, lay.dense_sharding, lay.dense_fsdp, lay.expert_sharding,
                              lay.expert_fsdp, lay.param_gather):
        raise ValueError(f"fp8_param_gather is priced under Megatron's distributed optimizer (dense_sharding = "
                         f"expert_sharding = \"optim\" on groups of more than one rank, param_gather = \"update\"), "
                         f"got {lay.dense_sharding.value} / "
                         f"{lay.expert_sharding.value}, param_gather {lay.param_gather.value}; set those or drop "
                         "fp8_param_gather")


def distributed_optimizer(policy: ShardingPolicy, group: int) -> bool:
    """A shard group that runs as Megatron's distributed optimizer: `optim`, or any policy over one rank, which
    shards nothing whatever it is called (the search keeps one representative policy for such a group)."""
    return policy == ShardingPolicy.OPTIM or group == 1


FP8_WEIGHT_PRECISIONS = (Precision.FP8, Precision.MXFP8)
"""The compute precisions whose weights fp8_param_gather stores (Megatron --fp8-param-gather)."""


def fp8_weights_priced(precision: Precision, dense: ShardingPolicy, fd: int, expert: ShardingPolicy, fe: int,
                       gather: ParamGather) -> bool:
    """Where fp8_param_gather is priced: FP8 or MXFP8 under Megatron's distributed optimizer on both groups, the
    view kept for the update. The layout's rule and the search's (frames.fp8_weights) both read it."""
    return (precision in FP8_WEIGHT_PRECISIONS and distributed_optimizer(dense, fd)
            and distributed_optimizer(expert, fe) and gather == ParamGather.UPDATE)


def _check_cuda_graphs(lay: Layout) -> None:
    """Megatron's own rules on CUDA graph settings, one line each (megatron/core/transformer/transformer_config.py
    @ d98e8a64, __post_init__); k3opt's MoE routes every token (dropless, or with a capacity factor a balanced
    routing fills)."""
    impl, mods = lay.cuda_graph_impl, lay.cuda_graph_modules
    per_layer = impl in PER_LAYER_GRAPHS
    if mods and not per_layer:
        raise ValueError(f"cuda_graph_modules {[m.value for m in mods]} need cuda_graph_impl = "
                         f"\"transformer_engine\" or \"local\" (got {impl.value if impl else 'none'}): Megatron "
                         "ignores them without a per-layer graph and requires them empty under full_iteration "
                         "(Megatron transformer_config.py L2794-2796)")
    if len(set(mods)) != len(mods):
        raise ValueError("cuda_graph_modules lists a module twice; name each once")
    if CudaGraphModule.MOE in mods:
        raise ValueError("cuda_graph_modules 'moe' captures drop-and-pad MoE only (Megatron "
                         "transformer_config.py L2838-2844) and k3opt's MoE is dropless; capture 'moe_router' and "
                         "'moe_preprocess' instead")
    # Under "local" Megatron adds moe_router beside moe_preprocess itself (L2804-2815); TE's graphs need both named.
    if impl == CudaGraphImpl.TRANSFORMER_ENGINE and CudaGraphModule.MOE_PREPROCESS in mods \
            and CudaGraphModule.MOE_ROUTER not in mods:
        raise ValueError("cuda_graph_modules 'moe_preprocess' needs 'moe_router' beside it (Megatron "
                         "transformer_config.py L2821-2824); add it")
    if per_layer and lay.activation_offload_layers:
        raise ValueError(f"activation_offload_layers = {lay.activation_offload_layers} with cuda_graph_impl = "
                         f"\"{impl.value}\": Megatron refuses per-layer CUDA graphs with CPU offloading "
                         "(Megatron transformer_config.py L2800-2801); use full_iteration or drop the "
                         "offload")
    if impl in (CudaGraphImpl.LOCAL, CudaGraphImpl.FULL_ITERATION) and lay.toggles.activation_offload:
        # k3opt's activation offload exports attention modules to --offload-modules; "local" graphs take only the
        # expert ones, full_iteration needs an in-flight offload count the exports do not set (L2929-2975).
        raise ValueError(f"the activation_offload toggle with cuda_graph_impl = \"{impl.value}\": Megatron runs "
                         "fine-grained activation offloading of attention modules only beside transformer_engine "
                         "graphs (Megatron transformer_config.py L2929-2975); use cuda_graph_impl = "
                         "\"transformer_engine\" or turn the toggle off")
    if per_layer and lay.recompute == Recompute.FULL:
        raise ValueError(f"recompute = \"full\" with cuda_graph_impl = \"{impl.value}\": Megatron runs full "
                         "recompute only under a full_iteration graph (Megatron transformer_config.py "
                         "L2854-2858); use selective recompute or cuda_graph_impl = \"full_iteration\"")


def ep_overlap_allowed(ep: int, pp: int, vp: int, recompute: Recompute) -> str:
    """Why Megatron refuses its EP overlap schedule (overlap_moe_expert_parallel_comm) on these degrees and recompute
    mode, or "" where it runs it (megatron/core/transformer/transformer_config.py L3007-3023 @ d98e8a64)."""
    if ep < 2:
        return "it needs expert parallelism (ep > 1; L3013-3015)"
    if pp > 1 and vp < 2:
        return "with pp > 1 it runs the interleaved schedule only (vp > 1; L3007-3011)"
    if recompute == Recompute.FULL:
        return "it refuses full recompute (L3021-3023)"
    return ""


def holds_graph_pool(layout: Layout) -> bool:
    """Whether the layout's CUDA graph keeps the activation phase in a private pool through the optimizer step: a
    full-iteration graph (k3opt.cost.ledger.rank_peak)."""
    return layout.cuda_graph_impl == CudaGraphImpl.FULL_ITERATION


def delay_wgrad_refusal(delay: bool, overlap: bool) -> str:
    """Why a layout or job may not set delay_wgrad_compute, or "": Megatron delays the weight gradients only under
    its EP overlap schedule (transformer_config.py L3073-3077 @ d98e8a64)."""
    if delay and not overlap:
        return ("delay_wgrad_compute without ep_overlap: Megatron delays the weight gradients only under its EP "
                "overlap schedule (transformer_config.py L3073-3077); set ep_overlap = true or drop "
                "delay_wgrad_compute")
    return ""


def _check_ep_overlap(ep: int, pp: int, vp: int, recompute: Recompute) -> None:
    why = ep_overlap_allowed(ep, pp, vp, recompute)
    if why:
        raise ValueError(f"ep_overlap with ep = {ep}, pp = {pp}, vp = {vp}, recompute = \"{recompute.value}\": "
                         f"Megatron's EP overlap schedule {why}; change them or set ep_overlap = false")


def dense_sync_free_refusal(model: ModelSpec, cap: float | None, stash: bool) -> str:
    """Why a layout or job of `model` may not set Megatron's sync-free MoE fields, or "": they size routed experts'
    buffers, and a dense model has none."""
    if model.moe is None and (cap is not None or stash):
        return f"moe_expert_rank_capacity_factor / moe_paged_stash: {model.name} has no MoE layers; drop them"
    return ""


def sync_free_refusal(cap: float | None, stash: bool, dispatcher: str | None, offload: Iterable[str],
                      offload_toggle: bool, offload_layers: int) -> str:
    """Why a layout or job cannot run Megatron's sync-free MoE and its paged stash as k3opt prices them, or "":
    Megatron's rules (megatron/core/transformer/transformer_config.py @ d98e8a64, L1868-1882 and L2210-2227) and
    k3opt's (a budget that a balanced routing fills; no capacity-sized tensor offloaded). `offload`: the offload
    module names it may run."""
    if cap is None:
        return ("moe_paged_stash needs moe_expert_rank_capacity_factor: the stash holds the fused grouped MLP's "
                "capacity-sized tensors (transformer_config.py L2213-2217); set the factor (e.g. 1.5) or drop "
                "moe_paged_stash") if stash else ""
    if cap < 1:
        return (f"moe_expert_rank_capacity_factor ({cap}) is below 1: HybridEP would drop tokens of a balanced "
                "routing, which k3opt does not price; set it to 1 or more")
    if dispatcher != "hybridep":
        return (f"moe_expert_rank_capacity_factor needs dispatcher = \"hybridep\" (got {dispatcher or 'none'}): "
                "Megatron sizes only the flex dispatcher's HybridEP buffers by it (transformer_config.py "
                "L1868-1874); set dispatcher = \"hybridep\"")
    expert = sorted(set(offload) & {m.value for m in EXPERT_OFFLOAD_MODULES})
    if expert:
        return (f"offload_modules {expert} with moe_expert_rank_capacity_factor: Megatron refuses them beside the "
                "paged stash (transformer_config.py L2218-2227) and k3opt does not price their capacity-sized "
                "copies; drop them")
    if offload_layers:
        return (f"moe_expert_rank_capacity_factor with activation_offload_layers = {offload_layers}: Megatron "
                "refuses the paged stash beside CPU offloading (transformer_config.py L2211-2212) and k3opt does "
                "not price the capacity-sized tensors TransformerEngine would offload; drop one of them")
    if stash and offload_toggle:
        return ("moe_paged_stash with the activation_offload toggle: the stash keeps the routed experts' saved "
                "tensors on the GPU, the toggle moves the whole saved set to the host; turn one off")
    return ""


def offload_set_rules(mods: list[OffloadModule]) -> None:
    """The rules on one set of offload modules alone: each named once, attn_proj beside core_attn
    (transformer_config.py L2148-2153 @ d98e8a64). ValueError otherwise."""
    if len(set(mods)) != len(mods):
        raise ValueError("offload_modules lists a module twice; name each once")
    if OffloadModule.ATTN_PROJ in mods and OffloadModule.CORE_ATTN not in mods:
        raise ValueError("offload_modules 'attn_proj' needs 'core_attn' beside it: its input is the core's output, "
                         "which the core's backward needs (transformer_config.py L2148-2153); add core_attn")


def _check_offload_modules(lay: Layout) -> None:
    """Megatron's rules on --offload-modules (transformer_config.py L2127-2190, L2929-2975 @ d98e8a64) and
    k3opt's: one offload mechanism at a time, and saved tensors to offload."""
    mods = lay.offload_modules
    if not mods:
        return
    names = [m.value for m in mods]
    offload_set_rules(mods)
    if lay.toggles.activation_offload:
        raise ValueError(f"offload_modules {names} with the activation_offload toggle: the toggle offloads the "
                         "whole saved set; keep one of them")
    if lay.activation_offload_layers:
        raise ValueError(f"offload_modules {names} with activation_offload_layers = "
                         f"{lay.activation_offload_layers}: Megatron refuses fine-grained offloading beside "
                         "cpu_offloading (transformer_config.py L2128-2130); keep one of them")
    if lay.recompute == Recompute.FULL:
        raise ValueError(f"offload_modules {names} with recompute = \"full\": full recompute keeps only each "
                         "layer's input, which no module offloads; use selective or no recompute, or the "
                         "activation_offload toggle")
    impl = lay.cuda_graph_impl
    if impl == CudaGraphImpl.LOCAL and not set(mods) <= EXPERT_OFFLOAD_MODULES:
        raise ValueError(f"offload_modules {names} with cuda_graph_impl = \"local\": Megatron offloads only "
                         "expert_fc1 and moe_act beside local graphs (transformer_config.py L2931-2938); use "
                         "transformer_engine graphs or drop the others")
    if impl == CudaGraphImpl.FULL_ITERATION:
        raise ValueError("offload_modules with cuda_graph_impl = \"full_iteration\": Megatron then needs an "
                         "in-flight offload count (transformer_config.py L2966-2975) k3opt does not price; use "
                         "transformer_engine graphs or none")
    if OffloadModule.ATTN_NORM in mods and impl in PER_LAYER_GRAPHS and (
            not lay.cuda_graph_modules or CudaGraphModule.ATTN in lay.cuda_graph_modules):
        raise ValueError("offload_modules 'attn_norm' under an attention CUDA graph: Megatron turns that offload "
                         "off (transformer_layer.py L1565-1572); drop it")
    if OffloadModule.MLP_NORM in mods and impl in PER_LAYER_GRAPHS and {
            CudaGraphModule.ATTN, CudaGraphModule.MOE_ROUTER} & set(lay.cuda_graph_modules):
        raise ValueError("offload_modules 'mlp_norm' under attn or moe_router CUDA graphs: Megatron turns that "
                         "offload off in MoE layers (transformer_layer.py L1573-1592); drop it")


class Layout(StrictModel):
    """One parallel layout of a training job. `split` lists layers per chunk, p*v entries in order;
    chunk j runs on PP rank j mod p."""

    gpus: GpuCount
    pp: PosInt = 1
    vp: PosInt = 1
    cp: PosInt = 1
    ep: PosInt = 1
    expert_fsdp: PosInt = 1
    dense_fsdp: PosInt = 1
    microbatches: PosInt = 1
    rows: PosInt = 1
    context: PosInt = 4096
    document_length: PosInt | None = None
    """Tokens per packed document for MLA attention work; defaults to the context (upper scenario)."""
    split: list[NonNegInt]
    """Decoder layers per chunk; a chunk may hold none (the embedding or the loss alone, as in Megatron layouts)."""
    pipeline_layout: str | None = None
    """Megatron's layout string (e.g. "Et*4|(t*4|)*14tmL"), read into `split` (k3opt.inputs.pipeline_layout); when
    both are given they must agree."""
    recompute: Recompute = Recompute.FULL
    recompute_modules: list[RecomputeModule] = Field(default_factory=list)
    """Megatron's selective recompute by module (needs recompute = "selective"): only these modules' saved
    tensors are dropped and their forward replayed. Empty: k3opt's selective set, every element-wise output."""
    fsdp_lifecycle: FsdpLifecycle = FsdpLifecycle.PER_MICROBATCH
    toggles: Toggles = Field(default_factory=Toggles)
    reserve_gib: NonNegFloat = 0.0
    """HBM kept back for what the model does not itemize: every rank's device peak must fit under HBM - reserve
    (without a runtime the device peak is the live-tensor ledger, so the reserve must cover everything else)."""
    fp8_block_size: PosInt = 128
    """Elements per FP8 scale (1 x 128 block-wise recipe)."""
    ce_chunk_tokens: PosInt = 1024
    """Tokens per chunk of the fused/chunked cross-entropy."""
    offload_resident_layers: PosInt = 2
    """Layers whose saved activations stay on the GPU under offload: the current and the prefetched."""
    activation_offload_layers: NonNegInt = 0
    """Megatron's cpu_offloading_num_layers: the saved activations of the first N decoder layers go to host memory in
    forward and come back in backward (TransformerEngine's CPU offload); the others stay. Priced for one chunk
    (pp = vp = 1), where Megatron's per-chunk count is the model's first N layers."""
    offload_modules: list[OffloadModule] = Field(default_factory=list)
    """Megatron's fine-grained activation offloading of these modules in every decoder layer: the tensors they
    save go to host memory in forward and come back in backward; the rest of the saved set stays on the GPU, with
    `offload_resident_layers` layers' offloaded part. Empty: none (the activation_offload toggle offloads the
    whole saved set instead)."""
    domain_gpus_used: PosInt | None = None
    """GPUs the job occupies in each NVLink domain (default: all of it). 512 GPUs as 8 racks x 64 is 64:
    ranks then fill domains in blocks of 64, so an EP64 group never straddles two domains."""
    model: str | None = None
    cluster: str | None = None
    name: str = ""
    measured: Measured | None = None
    dense_sharding: ShardingPolicy = ShardingPolicy.OPTIM_GRADS_PARAMS
    """Sharding over the dense shard group (`dense_fsdp` ranks)."""
    expert_sharding: ShardingPolicy = ShardingPolicy.OPTIM_GRADS_PARAMS
    """Sharding over the expert shard group (`expert_fsdp` ranks)."""
    optimizer_shard_granularity: ShardGranularity = ShardGranularity.ELEMENT
    param_gather: ParamGather = ParamGather.UPDATE
    """When the optim_grads_params groups gather their parameters: for the whole update, or per layer
    (Megatron-FSDP)."""
    grad_dtype: Dtype = Dtype.FP32
    """Gradient buffer / shard dtype (Megatron `--grad-reduce-in-bf16` makes it BF16)."""
    optimizer_state_dtype: Dtype | None = None
    """Muon momentum and AdamW moments dtype (absent: the model's `[optimizer] state_dtype`, FP32 unless its recipe
    says otherwise)."""
    lazy_optimizer_state: StrictBool = False
    """Optimizer state is allocated at the first step (seed 003: Muon state absent from a pre-step reading).
    The peak counts it either way; the rank's `resident_before_first_step_bytes` leaves it out."""
    runtime: str | None = None
    """Runtime preset or file (memory outside live tensors, constraints/runtimes/); absent or "none": live tensors
    only, so allocated = reserved = device and the reserve must cover everything else. A planned layout names the
    runtime it was planned with."""
    precision: Precision = Precision.BF16
    """Compute precision of the linear-layer GEMMs (attention core, router, embedding and head stay BF16)."""
    fp8_param_gather: StrictBool = False
    """Megatron's --fp8-param-gather under its distributed optimizer (sharding optim, param_gather update): the
    weights of the GEMMs that run in the compute precision are stored only in it, with no BF16 copy. MXFP8 keeps
    the row- and column-wise copies and all-gathers BF16 through the gradient buffer
    (--reuse-grad-buf-for-mxfp8-param-ag, which Megatron then requires); per-tensor FP8 keeps one buffer and
    all-gathers it in FP8. Megatron-Bridge's MXFP8 and FP8 current-scaling recipes set it with Adam; Muon's
    layer-wise optimizer cannot. (Megatron-FSDP with per-tensor FP8, param_gather = layer, is priced with FP8
    weights already.)"""
    ep_overlap: StrictBool = False
    """An EP communication overlap schedule is on (Megatron overlap_moe_expert_parallel_comm / DeepEP
    two-microbatch overlap): the all-to-all hides under compute. Off: it is exposed."""
    delay_wgrad_compute: StrictBool = False
    """Megatron's --delay-wgrad-compute under its EP overlap schedule (needs ep_overlap: transformer_config.py
    L3073-3077 @ d98e8a64): the experts' weight gradients run after the backward dispatch is released, so it
    hides under them too (k3opt.cost.achievable.ep_overlap_stage_exposed)."""
    dispatcher: str | None = None
    """EP token dispatcher (a key of the rates file's a2a tables: hybridep, deepep). A hierarchical dispatcher
    crosses NVLink domains once per destination domain and forwards inside it. Absent: seed 002's per-rank
    copies, and HybridEP's measured bandwidth for the achievable step time."""
    moe_expert_rank_capacity_factor: PosFloat | None = None
    """Megatron's sync-free MoE (--moe-expert-rank-capacity-factor, with HybridEP): every expert rank's token budget
    as a multiple of its balanced share. HybridEP's receive and combine buffers and the fused grouped MLP's
    tensors are allocated for that many rows, so the routed experts' saved tensors and the dispatch buffers take
    this factor x their balanced bytes; the GEMMs run on the received rows only (device-side counts), so no time
    changes. At least 1: below it HybridEP drops tokens of a balanced routing, which k3opt does not price. Absent:
    dropless, buffers sized per step from the received counts (a host sync per dispatch)."""
    moe_paged_stash: StrictBool = False
    """Megatron's paged stash (--moe-paged-stash, needs the capacity factor): the routed experts' saved tensors are
    packed into one static paged CUDA buffer, sized at `moe_paged_stash_buffer_size_factor_cuda` x the rank's
    peak of in-flight routed saved bytes at balanced routing and held for the whole step, instead of
    capacity-sized tensors per microbatch (megatron/core/transformer/moe/paged_stash.py allocate_stash_buffers)."""
    moe_paged_stash_buffer_size_factor_cuda: PosFloat = 1.10
    """The CUDA stash buffer over the balanced peak (Megatron's default 1.10). Megatron's negative form sizes it at
    the measured peak instead; under k3opt's balanced routing that is the same peak, so give its magnitude."""
    moe_paged_stash_buffer_size_factor_cpu: NonNegFloat = 0.0
    """The pinned host spill buffer over the same peak, in host memory (0: none, Megatron's default)."""
    cuda_graph_impl: CudaGraphImpl | None = None
    """CUDA graph capture (Megatron --cuda-graph-impl): recorded, checked against Megatron's rules and exported.
    Not priced: eager, partially and fully graphed runs of a layout get the same step time (the host-side launch
    cost graphs remove is listed under `unpriced`). Absent: not stated, and the exports leave Megatron's default."""
    cuda_graph_modules: list[CudaGraphModule] = Field(default_factory=list)
    """What each per-layer graph captures (Megatron --cuda-graph-modules, Bridge model.cuda_graph_scope) under
    cuda_graph_impl = "local" or "transformer_engine"; empty there: the whole layer."""
    mtp_layers: NonNegInt | None = None
    """Multi-token prediction layers trained (Megatron --mtp-num-layers): None, the model preset's; 0 trains without
    MTP (a run can drop the module its model was published with); at most the preset's, whose module it sizes."""
    source: str = ""
    """Where a measured layout's settings come from (recipe file and commit)."""

    @field_validator("runtime")
    @classmethod
    def _no_runtime(cls, v: str | None) -> str | None:
        return None if v == NO_RUNTIME else v

    @model_validator(mode="before")
    @classmethod
    def _split_from_pipeline_layout(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("pipeline_layout") is None:
            return data
        text = data["pipeline_layout"]
        if not isinstance(text, str):
            raise ValueError("pipeline_layout must be a string such as \"Et*4|(t*4|)*14tmL\"")
        split = pll.decoder_split(text)
        try:
            chunks = int(data.get("pp", 1)) * int(data.get("vp", 1))
        except (TypeError, ValueError):
            chunks = len(split)  # the degrees' own validators report them
        if len(split) != chunks:
            raise ValueError(f"pipeline_layout {text!r} has {len(split)} stages but pp x vp = {chunks} chunks; "
                             "write one '|'-separated stage per chunk")
        given = data.get("split")
        if given is not None and list(given) != split:
            raise ValueError(f"pipeline_layout {text!r} puts {split} decoder layers per stage but split is {given}; "
                             "give one of them")
        return {**data, "split": split}

    @property
    def dp(self) -> int:
        """Data-parallel replicas N / (p * c)."""
        return self.gpus // (self.pp * self.cp)

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage, DP * c = N / p."""
        return self.gpus // self.pp

    @property
    def local_tokens(self) -> int:
        """T = rows * context / c."""
        return self.rows * self.context // self.cp

    @property
    def effective_document_length(self) -> int:
        return self.document_length or self.context

    @model_validator(mode="after")
    def _degrees(self) -> Layout:
        if self.recompute_modules and self.recompute != Recompute.SELECTIVE:
            raise ValueError(f"recompute_modules {[m.value for m in self.recompute_modules]} need recompute = "
                             f"\"selective\" (got \"{self.recompute.value}\"); set recompute = \"selective\" or "
                             "drop recompute_modules")
        if self.param_gather == ParamGather.LAYER and ShardingPolicy.OPTIM_GRADS_PARAMS not in (
                self.dense_sharding, self.expert_sharding):
            raise ValueError("param_gather = \"layer\" gathers what optim_grads_params shards, but neither "
                             f"dense_sharding ({self.dense_sharding.value}) nor expert_sharding "
                             f"({self.expert_sharding.value}) is optim_grads_params; set one or drop param_gather")
        _check_fp8_param_gather(self)
        if self.activation_offload_layers and (self.pp * self.vp > 1 or self.toggles.activation_offload):
            raise ValueError(f"activation_offload_layers = {self.activation_offload_layers} is priced for one chunk "
                             "without the activation_offload toggle; use it with pp = vp = 1, or the toggle instead")
        _check_offload_modules(self)
        if len(set(self.recompute_modules)) != len(self.recompute_modules):
            raise ValueError("recompute_modules lists a module twice; name each once")
        _check_cuda_graphs(self)
        why = sync_free_refusal(self.moe_expert_rank_capacity_factor, self.moe_paged_stash, self.dispatcher,
                                (m.value for m in self.offload_modules), self.toggles.activation_offload,
                                self.activation_offload_layers)
        if why:
            raise ValueError(why)
        if self.ep_overlap:
            _check_ep_overlap(self.ep, self.pp, self.vp, self.recompute)
        why = delay_wgrad_refusal(self.delay_wgrad_compute, self.ep_overlap)
        if why:
            raise ValueError(why)
        n, p, c, e = self.gpus, self.pp, self.cp, self.ep
        if n % (p * c):
            raise ValueError(f"gpus ({n}) must be divisible by pp * cp ({p} * {c} = {p * c})")
        ranks = n // p
        if ranks % e:
            raise ValueError(f"ep ({e}) must divide the {ranks} ranks of a stage (gpus / pp = {n} / {p})")
        if ranks % self.dense_fsdp:
            raise ValueError(f"dense_fsdp ({self.dense_fsdp}) must divide the {ranks} ranks of a stage")
        if (ranks // c) % self.dense_fsdp:
            # Dense FSDP groups take dp indices at stride cp (placement in k3opt.cost.comm).
            raise ValueError(f"dense_fsdp ({self.dense_fsdp}) must divide the {ranks // c} data-parallel ranks of a "
                             f"stage (gpus / (pp * cp) = {n} / ({p} * {c}))")
        edp = ranks // e
        if edp % self.expert_fsdp:
            raise ValueError(
                f"expert_fsdp ({self.expert_fsdp}) must divide the {edp} expert-data-parallel ranks "
                f"(gpus / (pp * ep) = {n} / ({p} * {e}))"
            )
        if self.vp > 1 and p == 1:
            # megatron/core/parallel_state.py initialize_model_parallel: "pipeline-model-parallel size should be
            # greater than 1 with interleaved schedule".
            raise ValueError(f"vp ({self.vp}) needs pp > 1: Megatron's interleaved schedule runs model chunks across "
                             "pipeline stages; set vp = 1, or pp >= 2")
        if self.vp > 1 and self.microbatches % p:
            # Megatron's interleaved order runs microbatches in groups of pp per model chunk and raises on a
            # remainder (megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving);
            # in k3opt.cost.schedule.pipeline_order a partial group leaves a rank waiting on a chunk that never comes.
            raise ValueError(f"microbatches ({self.microbatches}) must be a multiple of pp ({p}) when vp > 1 "
                             f"(Megatron's interleaved schedule runs microbatches in groups of pp)")
        if len(self.split) != p * self.vp:
            raise ValueError(
                f"split has {len(self.split)} entries but pp * vp = {p} * {self.vp} = {p * self.vp} chunks"
            )
        empty = [r for r in range(1, p - 1) if not any(self.split[r::p])]
        if empty:
            # Ranks 0 and p - 1 hold the embedding and the loss; a middle rank with no decoder layer holds nothing.
            raise ValueError(f"split {self.split} leaves pipeline rank {empty[0]} of {p} without a decoder layer "
                             f"(its chunks {empty[0]}, {empty[0] + p}, ... are all 0); give every middle rank a layer "
                             "or lower pp")
        if (self.rows * self.context) % c:
            raise ValueError(f"rows * context ({self.rows * self.context}) must be divisible by cp ({c})")
        if self.measured is not None and self.measured.rank is not None and self.measured.rank >= p:
            raise ValueError(f"measured.rank ({self.measured.rank}) must be a PP rank, 0..{p - 1}")
        return self


# ----------------------------------------------------------------------------------------------- job


class SearchSpace(StrictModel):
    """Optional narrowing of the search; every list is the allowed values, absent means all."""

    pp: list[PosInt] | None = None
    vp: list[PosInt] | None = None
    cp: list[PosInt] | None = None
    ep: list[PosInt] | None = None
    expert_fsdp: list[PosInt] | None = None
    dense_fsdp: list[PosInt] | None = None
    microbatches: list[PosInt] | None = None
    recompute: list[Recompute] | None = None
    fsdp_lifecycle: list[FsdpLifecycle] | None = None
    dense_sharding: list[ShardingPolicy] | None = None
    """Sharding policies of the dense shard group the planner may choose (absent: k3opt.search.frames'
    DEFAULT_SHARDING, the policies no other policy dominates, one for both groups when neither list is given)."""
    expert_sharding: list[ShardingPolicy] | None = None
    """The same for the expert shard group."""
    grad_dtype: list[Dtype] | None = None
    """Gradient-buffer dtypes the planner may choose (absent: FP32 only; BF16 gradients change the numerics)."""
    param_gather: list[ParamGather] | None = None
    """How an optim_grads_params group may gather its parameters (Layout.param_gather): "update" keeps the BF16
    view for the update, "layer" gathers each layer just in time (Megatron-FSDP). Absent: "update" only."""
    offload_modules: list[list[OffloadModule]] | None = None
    """Module sets the planner may offload with Megatron's fine-grained activation offloading
    (Layout.offload_modules), each a choice beside offloading none under selective or no recompute, e.g.
    [["moe_act"]] (the routed experts' activation input, the largest tensor an MoE layer saves). Absent or empty:
    none (k3opt.search.frames.DEFAULT_OFFLOAD_SETS says why)."""
    forbid_toggles: list[str] = Field(default_factory=list)
    """Toggles the planner may not switch on."""
    require_toggles: list[str] = Field(default_factory=list)
    """Toggles every layout must have on."""
    split: list[NonNegInt] | None = None
    """Fix the layer split (then p * v must match its length); a 0 only on the first or last chunk, with
    `empty_edge_chunks`."""
    max_vp: PosInt = 4
    max_peak_gib: PosFloat | None = None
    """A cap on every rank's ledger peak (live tensors, `Evaluation.peak_bytes`) below the HBM budget: the
    search returns the fastest layouts that keep their worst rank under it (one region of the Pareto front).
    Absent: the budget alone (k3opt.search.frames.allocated_capacity_bytes)."""
    empty_edge_chunks: StrictBool = False
    """Let the first and the last chunk hold no decoder layer: an embedding-only first stage, a last stage of
    only the MTP layers and the loss (Megatron's layout strings 'E|t*4|...' and '...|mL'). Off: every chunk holds
    at least one layer."""

    @field_validator("offload_modules")
    @classmethod
    def _offload_sets(cls, v: list[list[OffloadModule]] | None) -> list[list[OffloadModule]] | None:
        for mods in v or []:
            if not mods:
                raise ValueError("an offload_modules set is empty; leave it out (offloading none is always a choice)")
            offload_set_rules(mods)
        return v

    @model_validator(mode="after")
    def _empty_chunks_on_the_edges(self) -> SearchSpace:
        if self.split is None or 0 not in self.split:
            return self
        if 0 in self.split[1:-1] or len(self.split) < 2:
            raise ValueError(f"split {self.split} leaves a middle chunk without a layer; only the first and the "
                             "last chunk may hold none (with empty_edge_chunks = true)")
        if not self.empty_edge_chunks:
            raise ValueError(f"split {self.split} leaves an edge chunk without a layer; set [search] "
                             "empty_edge_chunks = true to allow it")
        return self

    @model_validator(mode="after")
    def _gather_has_a_group(self) -> SearchSpace:
        # An absent list searches optim_grads_params too once "layer" is listed (search.frames.default_sharding);
        # two lists without it leave the per-layer gather nothing to gather.
        ogp = ShardingPolicy.OPTIM_GRADS_PARAMS
        if (self.param_gather is not None and ParamGather.UPDATE not in self.param_gather
                and self.dense_sharding is not None and self.expert_sharding is not None
                and ogp not in self.dense_sharding and ogp not in self.expert_sharding):
            raise ValueError("param_gather = [\"layer\"] gathers what optim_grads_params shards, but the [search] "
                             "dense_sharding and expert_sharding lists leave it out; add optim_grads_params to one "
                             "or allow \"update\"")
        return self

    @field_validator("forbid_toggles", "require_toggles")
    @classmethod
    def _known_toggles(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in TOGGLE_NAMES]
        if unknown:
            raise ValueError(f"unknown toggles {unknown}; known: {', '.join(TOGGLE_NAMES)}")
        return v


class Job(StrictModel):
    """What a user asks the planner: GPUs, context, tokens per update, memory reserve."""

    model: str = "kimi-k3"
    cluster: str = "gb200-nvl72"
    gpus: GpuCount | list[GpuCount] | None = None
    """GPUs the job runs on (a list: a capacity sweep). Absent: `racks` sets them (k3opt.inputs.placement)."""
    racks: PosInt | None = None
    """NVLink domains (racks) the job may hold. With `gpus`, a bound on the domains a placement takes; without, the
    planner chooses the GPUs per domain and so the GPU count (k3opt.inputs.placement.resolve_placement)."""
    context: PosInt = 4096
    rows: PosInt = 1
    tokens_per_update: PosInt | None = None
    """Global tokens per update; fixes M = tokens / (DP * rows * context). Absent: search.microbatches."""
    document_length: PosInt | None = None
    reserve_gib: NonNegFloat = 0.0
    """HBM kept back per GPU for what is not itemized (see Layout.reserve_gib)."""
    domain_gpus_used: PosInt | None = None
    """GPUs used per NVLink domain, pinned. Absent: the planner chooses it per parallel shape among whole domains
    and the sizes that tile the shape's rank blocks (k3opt.search.frames.domain_options)."""
    runtime: str | None = None
    """Runtime preset or file for the memory outside live tensors (see Layout.runtime). Absent: the cluster's
    `default_runtime` (live tensors only if it names none); "none": live tensors only, explicitly."""
    mtp_layers: NonNegInt | None = None
    """MTP layers to train (see Layout.mtp_layers): the planned layouts carry it. Absent: the model preset's."""
    search: SearchSpace = Field(default_factory=SearchSpace)
    name: str = ""
    precisions: list[Precision] = Field(default_factory=lambda: [Precision.BF16], min_length=1)
    """Compute precisions the user accepts; the planner may choose any of them (default: BF16 only)."""
    target: Literal["megatron-bridge", "megatron-lm", "torchtitan"] | None = None
    """Launch framework: the planner then searches only layouts it can run (k3opt.launch.limits)."""
    ep_overlap: StrictBool = False
    """Let the planner use Megatron's EP overlap schedule (Layout.ep_overlap, overlap_moe_expert_parallel_comm):
    every shape Megatron runs it on (ep > 1, vp > 1 or pp = 1, no full recompute: `ep_overlap_allowed`) is searched
    with it and without (the overlap hides the all-to-all but holds a layer's transients and the loss's logits at
    once), the others without."""
    delay_wgrad_compute: StrictBool = False
    """With ep_overlap: the overlapped layouts run Megatron's --delay-wgrad-compute (Layout.delay_wgrad_compute).
    Without ep_overlap it is an error."""
    moe_expert_rank_capacity_factor: PosFloat | None = None
    """Plan for Megatron's sync-free MoE (Layout.moe_expert_rank_capacity_factor): every layout then runs the
    HybridEP dispatcher with this capacity, and its memory is priced so. Absent: dropless."""
    moe_paged_stash: StrictBool = False
    """Plan with Megatron's paged stash (Layout.moe_paged_stash; needs the capacity factor): the activation_offload
    toggle is then not searched (Megatron refuses CPU offloading beside it). A job with the capacity factor may not
    list offload sets of the routed experts (`expert_fc1`, `moe_act`) in `[search] offload_modules`."""
    moe_paged_stash_buffer_size_factor_cuda: PosFloat = 1.10
    """Layout.moe_paged_stash_buffer_size_factor_cuda."""
    moe_paged_stash_buffer_size_factor_cpu: NonNegFloat = 0.0
    """Layout.moe_paged_stash_buffer_size_factor_cpu."""
    _runtime_from: Any = PrivateAttr(default=None)
    """Set on the job the search receives (k3opt.inputs.runtime.resolve_job_runtime): its RuntimeChoice."""

    @property
    def gpu_counts(self) -> list[int]:
        """The GPU counts searched; a job that gives only `racks` has them once resolve_placement has run."""
        if self.gpus is None:
            raise SpecError("the job gives racks but no gpus: plan it through k3opt.plan, which chooses the GPUs "
                            "per rack (k3opt.inputs.placement.resolve_placement)")
        return list(self.gpus) if isinstance(self.gpus, list) else [self.gpus]

    @model_validator(mode="after")
    def _microbatches(self) -> Job:
        if self.tokens_per_update is None and not self.search.microbatches:
            raise ValueError("give tokens_per_update or a [search] microbatches list")
        if self.gpus is None and self.racks is None:
            raise ValueError("give gpus (GPUs to run on) or racks (NVLink domains the job may hold), or both")
        if isinstance(self.gpus, list) and not self.gpus:
            raise ValueError("gpus is an empty list")
        # The job's layouts run HybridEP (search.frames.sync_free); its offload sets and a required toggle are
        # what its layouts may carry.
        why = sync_free_refusal(self.moe_expert_rank_capacity_factor, self.moe_paged_stash, "hybridep",
                                (m.value for mods in self.search.offload_modules or [] for m in mods),
                                "activation_offload" in self.search.require_toggles, 0)
        if why:
            raise ValueError(why)
        why = delay_wgrad_refusal(self.delay_wgrad_compute, self.ep_overlap)
        if why:
            raise ValueError(why)
        return self


def kda_layers(model: ModelSpec) -> list[int]:
    """0-based indices of the linear-attention (KDA) layers: every layer not listed as full attention, in a model
    with a [kda] table."""
    if model.kda is None:
        return []
    full = set(model.full_attention_layers)
    return [i for i in range(model.num_layers) if i not in full]


def trained_model(spec: Layout | Job, model: ModelSpec) -> ModelSpec:
    """The model as a layout or a job trains it: the preset with its MTP layers cut to `spec.mtp_layers` (none at
    0); the preset itself when it does not say. Above the preset's count: LayoutError for a layout, SpecError for a
    job."""
    n = spec.mtp_layers
    if n is None or n == model.mtp_layers:
        return model
    if n > model.mtp_layers:
        fix = (f"set at most {model.mtp_layers}, or 0 to train without MTP" if model.mtp_layers
               else "leave mtp_layers out or set 0")
        error = LayoutError if isinstance(spec, Layout) else SpecError
        raise error(f"mtp_layers ({n}) exceeds the {model.mtp_layers} MTP layers of {model.name}: {fix}")
    return model.model_copy(update={"mtp": MTPSpec(num_layers=n) if n else None})


def check_layout(layout: Layout, model: ModelSpec, cluster: ClusterSpec | None = None) -> None:
    """Rules that need the model: the split covers every layer, a pipeline layout string places the model's MTP
    layers, EP divides the experts."""
    total = sum(layout.split)
    if total != model.num_layers:
        raise LayoutError(
            f"layout split {layout.split} covers {total} layers; {model.name} has {model.num_layers}"
        )
    if layout.activation_offload_layers >= model.num_layers:
        # Transformer Engine keeps the last layer on the GPU: num_layers > model_layers - 1 is a ValueError
        # (transformer_engine/pytorch/cpu_offload.py L843 @ e7c550c5).
        raise LayoutError(f"activation_offload_layers ({layout.activation_offload_layers}) must be below the "
                          f"{model.num_layers} layers of {model.name}: Transformer Engine offloads at most "
                          f"{model.num_layers - 1}")
    placed = pll.mtp_layers(layout.pipeline_layout) if layout.pipeline_layout is not None else model.mtp_layers
    if placed != model.mtp_layers:
        raise LayoutError(f"pipeline_layout {layout.pipeline_layout!r} places {placed} MTP layers 'm'; {model.name} "
                          f"has {model.mtp_layers}: write them before 'L' in the last stage")
    if model.moe is not None and model.moe.num_experts % layout.ep:
        raise LayoutError(f"ep ({layout.ep}) must divide the {model.moe.num_experts} experts of {model.name}")
    if cluster is not None and layout.domain_gpus_used is not None \
            and layout.domain_gpus_used > cluster.nvlink_domain_gpus:
        raise LayoutError(
            f"domain_gpus_used ({layout.domain_gpus_used}) exceeds the {cluster.nvlink_domain_gpus}-GPU NVLink "
            f"domain of {cluster.name}"
        )
    if cluster is not None:
        cluster.dense_tflops(layout.precision)  # raises LayoutError if the cluster lacks the precision
    if model.moe is None and layout.ep != 1:
        raise LayoutError(f"ep ({layout.ep}) must be 1: {model.name} has no MoE layers")
    if layout.fp8_param_gather and model.optimizer.name == "muon":
        # Megatron-Bridge turns both off for Muon + MXFP8: they need the DistributedOptimizer's buffers, which the
        # layer-wise optimizer has not (scripts/performance/configs/kimi/kimi_llm_pretrain.py L35-44 @ v0.4.2).
        raise LayoutError(f"fp8_param_gather needs Megatron's distributed optimizer, and {model.name} trains with "
                          "Muon (its layer-wise optimizer keeps no shared gradient buffer to gather into); drop "
                          "fp8_param_gather, or train with AdamW ([optimizer] name = \"adamw\" in the model file)")
    mods = set(layout.cuda_graph_modules)
    if model.moe is None and mods & {CudaGraphModule.MOE_ROUTER, CudaGraphModule.MOE_PREPROCESS}:
        raise LayoutError(f"cuda_graph_modules 'moe_router' / 'moe_preprocess': {model.name} has no MoE layers "
                          "(transformer_config.py L2825-2829); drop them")
    impl = layout.cuda_graph_impl
    whole = impl == CudaGraphImpl.FULL_ITERATION or (impl in PER_LAYER_GRAPHS and not mods)
    why = dense_sync_free_refusal(model, layout.moe_expert_rank_capacity_factor, layout.moe_paged_stash)
    if why:
        raise LayoutError(why)
    if model.moe is not None and whole and not layout.moe_paged_stash:
        # A dropless MoE layer's dispatch syncs the host on its token counts; the paged stash, with the capacity
        # factor that pre-sizes the buffers, makes it capturable (Megatron-LM docs/user-guide/features/cuda_graph.md
        # L170-174).
        raise LayoutError(f"cuda_graph_impl = \"{impl.value}\" captures {model.name}'s MoE layers whole, and dropless "
                          "MoE dispatch has dynamic shapes that cannot be captured (Megatron-LM "
                          "docs/user-guide/features/cuda_graph.md L161); name per-layer cuda_graph_modules such as "
                          "[\"attn\", \"moe_router\", \"moe_preprocess\"], or set moe_paged_stash with "
                          "moe_expert_rank_capacity_factor (Megatron's paged stash, L170-174)")
    if model.moe is not None and CudaGraphModule.MLP in mods and not model.dense_ffn_layers:
        raise LayoutError(f"cuda_graph_modules 'mlp' captures dense-FFN layers and every layer of {model.name} is MoE "
                          "(transformer_config.py L2831-2837); drop it")


# ------------------------------------------------------------------------------------------- runtime
# A runtime file (constraints/runtimes/*.toml) holds the sizes the memory items of k3opt.cost.memory_outside are
# built from: the CUDA context, NCCL's per-connection and per-channel buffers, NVLS buffers, the HybridEP
# dispatcher's buffers, cuBLAS / TransformerEngine workspaces and the caching allocator's slack, plus the
# environment knobs that change them (NCCL_NVLS_ENABLE, NCCL_BUFFSIZE, PYTORCH_CUDA_ALLOC_CONF). Every value is a
# field a user can override with a measurement; the shipped preset names its source beside each value.


class RuntimeSpec(StrictModel):
    """Per-process sizes of one training stack on one GPU generation (bytes unless the name says otherwise)."""

    name: str
    description: str = ""
    # -- outside the caching allocator
    cuda_context_mib: PosFloat
    """CUDA context and lazily loaded kernel images of one process."""
    nccl_buffsize_bytes: PosInt
    """Simple-protocol buffer per connection (NCCL_BUFFSIZE)."""
    nccl_ll_buffer_bytes: PosInt
    """LL-protocol buffer per connection."""
    nccl_ll128_buffer_bytes: PosInt
    """LL128-protocol buffer per connection."""
    nccl_alloc_granularity_bytes: PosInt
    """cuMem allocation granularity the per-connection buffers are rounded up to."""
    nccl_coll_channels: PosInt
    """Channels of a collective (ring) communicator; one receive connection per channel."""
    nccl_p2p_channels_per_peer: PosInt
    """Channels per peer of a point-to-point (send/recv) connection over NVLink."""
    nccl_p2p_channels_per_net_peer: PosInt
    """Channels per peer over the network (NCCL_NCHANNELS_PER_NET_PEER)."""
    nccl_p2p_chunk_bytes: PosInt
    """P2P chunk over NVLink; a p2p buffer is chunk x NCCL_STEPS."""
    nccl_p2p_net_chunk_bytes: PosInt
    """P2P chunk over the network."""
    nccl_steps: PosInt
    """NCCL_STEPS: slots per connection buffer."""
    nccl_nvls_enable: StrictBool
    """NCCL_NVLS_ENABLE: NVLink SHARP buffers for communicators whose ranks share one NVLink domain."""
    nvls_channels: PosInt
    nvls_chunk_bytes: PosInt
    nvls_heads: PosInt
    """nHeads of NCCL's NVLS buffer formula (nChannels x 2 x chunk x NCCL_STEPS x nHeads)."""
    hybridep: StrictBool = True
    """The EP all-to-all runs through HybridEP (fixed buffers outside the allocator) instead of NCCL."""
    hybridep_token_bytes: PosInt = 2
    """Bytes per dispatched value in the HybridEP token buffer (BF16 dispatch)."""
    hybridep_prob_bytes: PosInt = 4
    """Bytes per routing probability (FP32) in the HybridEP probs buffer."""
    # -- inside the caching allocator (counted in allocated)
    cublas_workspace_bytes: PosInt
    cublas_handles: PosInt
    """(handle, stream) pairs with a cuBLAS workspace."""
    te_workspace_bytes: PosInt
    te_workspaces: PosInt
    """TransformerEngine GEMM workspaces: one for plain GEMMs plus one per grouped-GEMM compute stream."""
    # -- the caching allocator
    expandable_segments: StrictBool = False
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."""
    allocator_slack: NonNegFloat
    """(max reserved - max allocated) / max allocated without expandable segments."""
    allocator_slack_expandable_segments: NonNegFloat | None = None
    """The same ratio with expandable segments (no public ratio shipped: measure it)."""
    source: str = ""

    @model_validator(mode="after")
    def _slack(self) -> RuntimeSpec:
        if self.expandable_segments and self.allocator_slack_expandable_segments is None:
            raise ValueError("expandable_segments is true but allocator_slack_expandable_segments is not given; "
                             "measure (max reserved - max allocated) / max allocated with the flag and set it")
        return self

    @property
    def slack(self) -> float:
        """The allocator slack in force: reserved = allocated x (1 + slack)."""
        if self.expandable_segments:
            assert self.allocator_slack_expandable_segments is not None
            return self.allocator_slack_expandable_segments
        return self.allocator_slack

    @property
    def cuda_context_bytes(self) -> int:
        return int(round(self.cuda_context_mib * MIB))

    @property
    def nccl_connection_bytes(self) -> int:
        """One collective connection: Simple + LL + LL128 buffers, rounded up to the allocation granularity."""
        raw = self.nccl_buffsize_bytes + self.nccl_ll_buffer_bytes + self.nccl_ll128_buffer_bytes
        g = self.nccl_alloc_granularity_bytes
        return -(-raw // g) * g
