"""Megatron-LM command-line flags for a layout (github.com/NVIDIA/Megatron-LM @ d98e8a64).

Megatron-Bridge runs the same Megatron core, so `megatron_settings` maps each decision to both a Megatron-LM
flag and a Bridge override key; megatron_bridge.py renders the keys. Flag names come from
megatron/training/arguments.py and the dataclasses its ArgumentGroupFactory turns into flags;
tests/data/megatron_lm_flags.txt is that set, and a test checks every flag emitted here against it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from k3opt.inputs.specs import (
    PER_LAYER_GRAPHS,
    CudaGraphImpl,
    Dtype,
    FsdpLifecycle,
    Layout,
    ModelSpec,
    ParamGather,
    Precision,
    Recompute,
    kda_layers,
)
from k3opt.inputs.toggles import built_in
from k3opt.launch.common import (
    Launch,
    Missing,
    global_batch,
    megatron_layout,
    moe_layer_flags,
    optimizer_instances,
    run_length_expr,
    runs_megatron_fsdp,
)
from k3opt.launch.limits import no_switch_for

SELECTIVE_MODULES = ("moe_act", "layernorm")
"""k3opt's selective recompute replays element-wise work and keeps GEMM inputs and attention outputs; of the
modules Megatron accepts (transformer_config.py L1945-1957) these two are element-wise only ('core_attn' would
recompute attention, which k3opt keeps)."""

OFFLOAD_MODULES_SAVED = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""Every module input --offload-modules accepts that holds saved activations (transformer_config.py L2127-2190)."""
OFFLOAD_MODULES_FULL = ("attn_norm",)
"""Under full recompute only each layer's input is saved: the input of its first norm."""


@dataclass(frozen=True)
class Setting:
    """One decision as a Megatron-LM flag and as a Megatron-Bridge key (None where one side has none)."""

    flag: str | None
    key: str | None
    value: object
    """True for a bare flag; a list for nargs='+'; anything else is printed."""
    bridge_value: object = None
    """The Bridge value when it differs in form (a list where Megatron-LM takes a list expression)."""


@dataclass
class _Decisions:
    """The three lists `megatron_settings` returns, filled group by group in the order they are printed."""

    settings: list[Setting] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def megatron_settings(layout: Layout, model: ModelSpec, bridge: bool = False
                      ) -> tuple[list[Setting], list[Missing], list[str]]:
    """The settings, the decisions without a switch, and caveats, shared by Megatron-LM and Megatron-Bridge."""
    out = _Decisions()
    target = "megatron-bridge" if bridge else "megatron-lm"
    _parallelism(out, layout, model, bridge)
    _batch(out, layout)
    _recompute(out, layout)
    _precision(out, layout)
    _activation_offload(out, layout)
    _moe_dispatch(out, layout, model)
    _cuda_graphs(out, layout)
    _optimizer_sharding(out, layout, model, bridge, target)
    _model_facts(out, model, bridge)
    _placement_and_unswitched(out, layout, target, model)
    return out.settings, out.missing, out.notes


def _parallelism(out: _Decisions, lay: Layout, model: ModelSpec, bridge: bool) -> None:
    """Parallel degrees and the split (the layout string), with what the interleaved schedule and Bridge's K3
    spec refuse."""
    out.settings += [
        Setting("--tensor-model-parallel-size", "model.tensor_model_parallel_size", 1),
        Setting("--pipeline-model-parallel-size", "model.pipeline_model_parallel_size", lay.pp),
        Setting("--context-parallel-size", "model.context_parallel_size", lay.cp),
        Setting("--expert-model-parallel-size", "model.expert_model_parallel_size", lay.ep),
        Setting("--expert-tensor-parallel-size", "model.expert_tensor_parallel_size", 1),
        Setting("--num-layers", "model.num_layers", model.num_layers),
        Setting("--pipeline-model-parallel-layout", "model.pipeline_model_parallel_layout",
                megatron_layout(lay, model))]
    if model.mtp_layers or lay.mtp_layers is not None:
        # The MTP layers trained (the layout string places them as 'm'); Megatron's default trains none.
        out.settings.append(Setting("--mtp-num-layers", "model.mtp_num_layers", model.mtp_layers))
    if lay.vp > 1:
        out.notes.append(f"vp = {lay.vp}: the layout string has pp x vp = {lay.pp * lay.vp} stages, so Megatron "
                         "sets the virtual pipeline size from it (no separate VPP flag is allowed with a layout)")
        if lay.microbatches % lay.pp:
            out.missing.append(Missing(f"vp = {lay.vp} with M = {lay.microbatches} not divisible by pp = {lay.pp}",
                                       "Megatron's interleaved schedule raises on a last microbatch group smaller "
                                       "than PP (schedules.py L1160-1180): choose M divisible by pp"))
        if bridge and kda_layers(model):
            out.missing.append(Missing(f"vp = {lay.vp}", "Megatron-Bridge's Kimi K3 spec raises on virtual pipeline "
                                       "stages (kimi_k3_spec.py L54); re-plan with target = \"megatron-bridge\""))
    if bridge and lay.cp > 1 and kda_layers(model):
        out.missing.append(Missing(f"cp = {lay.cp}", "KimiK3Attention raises for KDA layers with CP > 1 "
                                   "(kimi_k3_layers.py L126); re-plan with target = \"megatron-bridge\""))


def _batch(out: _Decisions, lay: Layout) -> None:
    """Micro and global batch and the sequence length; M itself has no flag."""
    out.settings += [Setting("--micro-batch-size", "train.micro_batch_size", lay.rows),
                     Setting("--global-batch-size", "train.global_batch_size", global_batch(lay)),
                     Setting("--seq-length", "dataset.seq_length", lay.context),
                     Setting(None, "model.seq_length", lay.context)]  # translate_mlm_to_bridge.py sets both
    out.notes.append(f"microbatches M = {lay.microbatches} has no flag: Megatron derives it as global batch / "
                     f"(micro batch x DP) = {global_batch(lay)} / ({lay.rows} x {lay.dp})")


def _recompute(out: _Decisions, lay: Layout) -> None:
    """Full recompute: one layer at a time, uniform; selective: the layout's Megatron modules, or without them the
    element-wise modules (SELECTIVE_MODULES)."""
    if lay.recompute == Recompute.FULL:
        out.settings += [Setting("--recompute-granularity", "model.recompute_granularity", "full"),
                         Setting("--recompute-method", "model.recompute_method", "uniform"),
                         Setting("--recompute-num-layers", "model.recompute_num_layers", 1)]
    elif lay.recompute == Recompute.SELECTIVE and lay.recompute_modules:
        out.settings += [Setting("--recompute-granularity", "model.recompute_granularity", "selective"),
                         Setting("--recompute-modules", "model.recompute_modules",
                                 [m.value for m in lay.recompute_modules])]
    elif lay.recompute == Recompute.SELECTIVE:
        out.settings += [Setting("--recompute-granularity", "model.recompute_granularity", "selective"),
                         Setting("--recompute-modules", "model.recompute_modules", list(SELECTIVE_MODULES))]
        out.notes.append("selective recompute: 'moe_act' and 'layernorm' are Megatron's element-wise modules; the "
                         "KDA and MLA element-wise work (gates, norms inside attention) has no module name")


_COMPUTE_RECIPES = {Precision.FP8: ("--fp8-format", "fp8", "e4m3", "--fp8-recipe", "fp8_recipe", "tensorwise"),
                    Precision.MXFP8: ("--fp8-format", "fp8", "e4m3", "--fp8-recipe", "fp8_recipe", "mxfp8"),
                    Precision.NVFP4: ("--fp4-format", "fp4", "e2m1", "--fp4-recipe", "fp4_recipe", "nvfp4")}
"""Megatron's switches for each compute precision (TransformerConfig fp8 / fp8_recipe, fp4 / fp4_recipe,
transformer_config.py L587-679 @ d98e8a64): per-tensor FP8 is the current-scaling 'tensorwise' recipe."""


def _precision(out: _Decisions, lay: Layout) -> None:
    """The compute precision's format and recipe, its weights stored in it (fp8_param_gather: MXFP8 then gathers
    through the gradient buffer, which Megatron requires beside it); under BF16 compute, FP8 saved activations: the
    FP8 recipe whose scaling block is the layout's fp8_block_size."""
    if lay.precision != Precision.BF16:
        fmt, fmt_field, fmt_value, rec, rec_field, rec_value = _COMPUTE_RECIPES[lay.precision]
        out.settings += [Setting(fmt, f"mixed_precision.{fmt_field}", fmt_value),
                         Setting(rec, f"mixed_precision.{rec_field}", rec_value)]
        # Megatron-FSDP's per-tensor FP8 units are priced as FP8 primary weights (cost.coefficients._unit_weight_bytes).
        if lay.fp8_param_gather or (lay.precision == Precision.FP8 and lay.param_gather == ParamGather.LAYER):
            out.settings.append(Setting("--fp8-param-gather", "mixed_precision.fp8_param_gather", True))
            if lay.precision == Precision.MXFP8:
                out.settings.append(Setting("--reuse-grad-buf-for-mxfp8-param-ag",
                                            "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag", True))
        return
    if not lay.toggles.fp8_activations:
        return
    recipe = {128: "blockwise", 32: "mxfp8"}.get(lay.fp8_block_size)
    if recipe is None:
        out.missing.append(Missing(f"FP8 block size {lay.fp8_block_size}", "Megatron's recipes scale per 1x128 "
                                   "block (blockwise) or 1x32 (mxfp8); set fp8_block_size to 128 or 32 and re-plan"))
        return
    out.settings += [Setting("--fp8-format", "mixed_precision.fp8", "e4m3"),
                     Setting("--fp8-recipe", "mixed_precision.fp8_recipe", recipe)]
    out.notes.append("FP8 saved activations come from FP8 GEMM execution (the quantized GEMM inputs are what "
                     "backward keeps); there is no separate storage switch")
    if recipe == "blockwise":
        out.notes.append("Bridge's mixed_precision.py marks 'blockwise' as Hopper-only; on Blackwell use "
                         "'mxfp8' and price it with fp8_block_size = 32")


def _activation_offload(out: _Decisions, lay: Layout) -> None:
    """The layout's offload_modules, or under the activation_offload toggle every module holding saved activations
    (only the layer input under full recompute), as fine-grained offloading; the layout's first-N-layers offload
    as --cpu-offloading-num-layers."""
    if lay.activation_offload_layers:
        # cpu_offloading is set from the count (arguments.py L1950-1951); Megatron refuses it with recompute
        # (transformer_config.py L1896-1899).
        out.settings.append(Setting("--cpu-offloading-num-layers", "model.cpu_offloading_num_layers",
                                    lay.activation_offload_layers))
        if lay.recompute != Recompute.NONE:
            out.missing.append(Missing(
                f"activation_offload_layers = {lay.activation_offload_layers} with recompute = "
                f"{lay.recompute.value}", "Megatron's CPU offloading refuses activation recompute "
                "(transformer_config.py L1896-1899): re-plan with recompute = none"))
    if lay.offload_modules:
        out.settings += [
            Setting("--fine-grained-activation-offloading", "model.fine_grained_activation_offloading", True),
            Setting("--offload-modules", "model.offload_modules", [m.value for m in lay.offload_modules])]
        return
    if not lay.toggles.activation_offload:
        return
    mods = OFFLOAD_MODULES_FULL if lay.recompute == Recompute.FULL else OFFLOAD_MODULES_SAVED
    out.settings += [
        Setting("--fine-grained-activation-offloading", "model.fine_grained_activation_offloading", True),
        Setting("--offload-modules", "model.offload_modules", list(mods))]
    out.notes.append("activation offload: the layer-level --cpu-offloading-num-layers refuses PP > 1 and "
                     "recompute (transformer_config.py L1884-1898), so the module-level offload is used; "
                     f"offload_resident_layers = {lay.offload_resident_layers} has no switch (Megatron "
                     "prefetches on its own schedule)")


def _moe_dispatch(out: _Decisions, lay: Layout, model: ModelSpec) -> None:
    """The MoE shape and the token dispatcher: flex with HybridEP under EP deduplication or a capacity factor, else
    all-to-all; the EP overlap schedule; the sync-free MoE's capacity factor and paged stash."""
    if model.moe is None:
        return
    out.settings += [
        Setting("--num-experts", "model.num_moe_experts", model.moe.num_experts),
        Setting("--moe-router-topk", "model.moe_router_topk", model.moe.experts_per_token),
        Setting("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size", model.moe.expert_intermediate_size),
        *([Setting("--moe-latent-size", "model.moe_latent_size", model.moe.latent_size)]
          if model.moe.latent_size is not None else []),  # no latent MoE: Megatron's default (None) is no flag
        Setting("--moe-layer-freq", "model.moe_layer_freq", run_length_expr(moe_layer_flags(model)),
                moe_layer_flags(model)),
        Setting("--moe-grouped-gemm", "model.moe_grouped_gemm", True)]
    if model.moe.shared_intermediate_size:
        out.settings.append(Setting("--moe-shared-expert-intermediate-size",
                                    "model.moe_shared_expert_intermediate_size", model.moe.shared_intermediate_size))
    cap = lay.moe_expert_rank_capacity_factor
    if lay.toggles.ep_dedup or cap is not None:
        out.settings += [Setting("--moe-token-dispatcher-type", "model.moe_token_dispatcher_type", "flex"),
                         Setting("--moe-flex-dispatcher-backend", "model.moe_flex_dispatcher_backend", "hybridep")]
    else:
        out.settings.append(Setting("--moe-token-dispatcher-type", "model.moe_token_dispatcher_type", "alltoall"))
    if lay.ep_overlap:
        # Bridge copies its comm_overlap config onto the model at setup (comm_overlap.py L438, L593-597 @ 067f987d),
        # over a model key; Megatron refuses the shared-expert overlap beside it (transformer_config.py L3039-3041),
        # which some Bridge recipes turn on.
        out.settings += [
            Setting("--overlap-moe-expert-parallel-comm", "comm_overlap.overlap_moe_expert_parallel_comm", True),
            Setting(None, "model.moe_shared_expert_overlap", False)]
    if lay.delay_wgrad_compute:
        out.settings.append(Setting("--delay-wgrad-compute", "comm_overlap.delay_wgrad_compute", True))
    if cap is not None:
        # HybridEP's capacity needs the op fuser's grouped MLP (transformer_config.py L1876-1882 @ d98e8a64).
        out.settings += [Setting("--moe-expert-rank-capacity-factor", "model.moe_expert_rank_capacity_factor", cap),
                         Setting("--use-transformer-engine-op-fuser", "model.use_transformer_engine_op_fuser", True)]
    if lay.moe_paged_stash:
        out.settings += [
            Setting("--moe-paged-stash", "model.moe_paged_stash", True),
            Setting("--moe-paged-stash-buffer-size-factor-cuda", "model.moe_paged_stash_buffer_size_factor_cuda",
                    lay.moe_paged_stash_buffer_size_factor_cuda),
            Setting("--moe-paged-stash-buffer-size-factor-cpu", "model.moe_paged_stash_buffer_size_factor_cpu",
                    lay.moe_paged_stash_buffer_size_factor_cpu)]


def _cuda_graphs(out: _Decisions, lay: Layout) -> None:
    """CUDA graph capture as the layout states it (absent: nothing, Megatron's default is none). Bridge keeps the
    per-layer modules under model.cuda_graph_scope (its perf recipes' key at 067f987d)."""
    if lay.cuda_graph_impl is None:
        return
    impl = lay.cuda_graph_impl
    out.settings.append(Setting("--cuda-graph-impl", "model.cuda_graph_impl", impl.value))
    if lay.cuda_graph_modules:
        out.settings.append(Setting("--cuda-graph-modules", "model.cuda_graph_scope",
                                    [m.value for m in lay.cuda_graph_modules]))
    elif impl in PER_LAYER_GRAPHS:
        # The whole layer: Megatron-LM's default; a Bridge recipe may carry its own scope, so clear it.
        out.settings.append(Setting(None, "model.cuda_graph_scope", []))
    if impl == CudaGraphImpl.NONE:
        return
    # Bridge asserts TE's RNG tracker under any CUDA graph (models/gpt_provider.py L233-238); Megatron-LM sets it.
    out.settings.append(Setting(None, "model.use_te_rng_tracker", True))
    if impl == CudaGraphImpl.FULL_ITERATION:
        # Megatron-LM training/arguments.py L1235-1237, Bridge training/config.py L1508-1512: no NaN check in the graph.
        out.settings.append(Setting("--no-check-for-nan-in-loss-and-grad", "rerun_state_machine.check_for_nan_in_loss",
                                    True, bridge_value=False))
    out.notes.append("CUDA graphs: k3opt prices the step the same with or without them (the host launch cost "
                     "they remove is unpriced); a full-iteration graph's pool is in the memory ledger, per-layer "
                     "graphs' static buffers and pools are not: keep headroom for them")


def _optimizer_sharding(out: _Decisions, lay: Layout, model: ModelSpec, bridge: bool, target: str) -> None:
    """The model's optimizer with the layout's sharding: Muon with the distributed optimizer (N instances), AdamW
    with the distributed optimizer or, where the dense group shards its parameters, Megatron-FSDP; the gradient
    reduction dtype; what neither can express."""
    if runs_megatron_fsdp(lay, model):
        _megatron_fsdp(out, lay)
        return
    n = optimizer_instances(lay)
    muon = model.optimizer.name == "muon"
    out.settings += [Setting("--optimizer", "optimizer.optimizer", "muon" if muon else "adam"),
                     Setting("--use-distributed-optimizer", "ddp.use_distributed_optimizer", True),
                     Setting("--num-distributed-optimizer-instances", "ddp.num_distributed_optimizer_instances", n)]
    if muon:
        out.notes.append("with Muon, --use-distributed-optimizer becomes the layer-wise distributed optimizer "
                         "(arguments.py L1724-1736): each matrix is owned whole by one rank of the shard group and "
                         "gradients are all-reduced, so a rank's optimizer memory equals k3opt's even share only on "
                         "average")
    if bridge and muon:
        out.notes.append("Bridge's Kimi-K2 Muon recipe sets ddp.use_distributed_optimizer=false with its "
                         "distributed Muon; k3opt priced Muon state sharded over dense_fsdp, which is the "
                         "distributed optimizer here")
    if lay.fsdp_lifecycle == FsdpLifecycle.ACCUMULATE:
        if lay.grad_dtype == Dtype.FP32:
            out.settings.append(Setting("--accumulate-allreduce-grads-in-fp32", "ddp.grad_reduce_in_fp32", True))
    elif muon:
        out.missing.append(Missing(
            f"fsdp_lifecycle = {lay.fsdp_lifecycle.value} (gradients reduce-scattered every microbatch)",
            "Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads) would do it, but "
            "Muon refuses Megatron-FSDP (arguments.py L1740); the distributed optimizer reduces once per update: "
            f"re-plan with fsdp_lifecycle = accumulate (job target = \"{target}\")"))
    else:
        out.missing.append(Missing(
            f"fsdp_lifecycle = {lay.fsdp_lifecycle.value} with dense_sharding = {lay.dense_sharding.value}",
            "the distributed optimizer reduces gradients once per update; per-microbatch reduce-scatter is "
            "Megatron-FSDP's, which shards the parameters too: re-plan with dense_sharding = optim_grads_params"))
    if lay.dense_fsdp != lay.ep * lay.expert_fsdp:
        out.missing.append(Missing(
            f"expert_fsdp = {lay.expert_fsdp} with dense_fsdp = {lay.dense_fsdp}, ep = {lay.ep}",
            f"no independent switch: with N = {n} optimizer instances the expert shard group is "
            f"(gpus / (pp x ep)) / N = {lay.stage_ranks // lay.ep // n}; re-plan with target = \"{target}\""))


def _megatron_fsdp(out: _Decisions, lay: Layout) -> None:
    """AdamW under Megatron-FSDP, fully sharded (megatron/training/arguments.py L3190-3203 @ d98e8a64; the flags
    of Megatron-Bridge's Llama 3 70B FSDP recipes)."""
    out.settings += [Setting("--optimizer", "optimizer.optimizer", "adam"),
                     Setting("--use-megatron-fsdp", "ddp.use_megatron_fsdp", True),
                     Setting("--data-parallel-sharding-strategy", "ddp.data_parallel_sharding_strategy",
                             "optim_grads_params")]
    # The gradient buffer in the dtype the layout prices ('auto' would take the model's BF16 gradients;
    # arguments.py L3691-3694 @ d98e8a64).
    out.settings.append(Setting("--megatron-fsdp-main-grads-dtype", "ddp.megatron_fsdp_main_grads_dtype",
                                lay.grad_dtype.value))
    if lay.param_gather == ParamGather.LAYER:
        out.settings.append(Setting("--fsdp-double-buffer", "ddp.fsdp_double_buffer", True))
    else:
        out.missing.append(Missing(
            "param_gather = update (the BF16 view kept for the update)",
            "Megatron-FSDP gathers each layer just in time: re-plan or re-price with param_gather = \"layer\""))
    if lay.fsdp_lifecycle == FsdpLifecycle.ACCUMULATE:
        out.missing.append(Missing(
            "fsdp_lifecycle = accumulate with Megatron-FSDP",
            "Megatron-FSDP reduce-scatters every microbatch: re-plan with fsdp_lifecycle = per_microbatch"))
    if lay.dense_fsdp != lay.stage_ranks // lay.cp:
        out.missing.append(Missing(
            f"dense_fsdp = {lay.dense_fsdp} of {lay.stage_ranks // lay.cp} data-parallel ranks",
            "Megatron-FSDP shards over the whole data-parallel group; re-plan with dense_fsdp = DP"))


def _model_facts(out: _Decisions, model: ModelSpec, bridge: bool) -> None:
    """MLA or GQA, hidden and FFN sizes; the KDA layers (Bridge only), AttnRes and the vision tower."""
    if model.mla is not None:
        out.settings += [Setting("--multi-latent-attention", "model.multi_latent_attention", True),
                         Setting("--num-attention-heads", "model.num_attention_heads", model.mla.num_heads),
                         Setting("--q-lora-rank", "model.q_lora_rank", model.mla.q_lora_rank),
                         Setting("--kv-lora-rank", "model.kv_lora_rank", model.mla.kv_lora_rank),
                         Setting("--qk-head-dim", "model.qk_head_dim", model.mla.qk_nope_head_dim),
                         Setting("--qk-pos-emb-head-dim", "model.qk_pos_emb_head_dim", model.mla.qk_rope_head_dim),
                         Setting("--v-head-dim", "model.v_head_dim", model.mla.v_head_dim)]
    if model.gqa is not None:
        # Grouped-query attention as Megatron-LM's arguments spell it; --group-query-attention is an argparse switch
        # only (Megatron core reads num_query_groups).
        gqa = model.gqa
        out.settings += [Setting("--num-attention-heads", "model.num_attention_heads", gqa.num_heads),
                         Setting("--group-query-attention", None, True),
                         Setting("--num-query-groups", "model.num_query_groups", gqa.num_kv_heads),
                         Setting("--kv-channels", "model.kv_channels", gqa.head_dim)]
        if gqa.qk_norm:
            out.settings.append(Setting("--qk-layernorm", "model.qk_layernorm", True))
        if gqa.attention_bias:
            out.settings.append(Setting("--add-qkv-bias", "model.add_qkv_bias", True))
    out.settings.append(Setting("--hidden-size", "model.hidden_size", model.hidden_size))
    # The ledger holds no dropout masks: the models train without dropout (Megatron-Bridge's model bridges set
    # hidden_dropout = 0.0, e.g. deepseek_v3_bridge.py L87, kimi_k3_bridge.py L127), while TransformerConfig's
    # defaults are 0.1 (transformer_config.py L188-192). Zero also lets a whole-layer graph capture a recomputed
    # MLP (transformer_config.py L2886-2899).
    out.settings += [Setting("--hidden-dropout", "model.hidden_dropout", 0.0),
                     Setting("--attention-dropout", "model.attention_dropout", 0.0)]
    if model.dense_ffn is not None:
        out.settings.append(Setting("--ffn-hidden-size", "model.ffn_hidden_size", model.dense_ffn.intermediate_size))
    kda = kda_layers(model)
    if kda and bridge:
        out.settings.append(Setting(None, "model.kimi_kda_layers", [i + 1 for i in kda]))
    elif kda:
        out.missing.append(Missing(f"{len(kda)} KDA (Kimi Delta Attention) layers",
                                   "Megatron-LM has no KDA layer (--experimental-attention-variant offers gdn, "
                                   "gdn2, dsa; --hybrid-layer-pattern has no KDA symbol): run K3 through "
                                   "Megatron-Bridge's KimiK3ModelProvider (model.kimi_kda_layers)"))
    if model.attn_res is not None and not bridge:
        out.missing.append(Missing(f"Block Attention Residuals (block size {model.attn_res.block_size})",
                                   "no Megatron-LM switch; Megatron-Bridge's Kimi K3 layers carry the AttnRes bank "
                                   "across pipeline stages"))
    if model.vision is not None:
        out.missing.append(Missing("vision tower on the first pipeline chunk", "the layout string places only "
                                   "E/t/m/L; the K3 language backbone is what these switches configure, attach "
                                   "the vision tower to the first stage in the model provider"))


def _placement_and_unswitched(out: _Decisions, lay: Layout, target: str, model: ModelSpec) -> None:
    """What stays outside the framework: the GPUs used per NVLink domain and the toggles without a switch; and
    the toggles the framework always runs for this model, which need no flag."""
    if lay.domain_gpus_used is not None:
        out.missing.append(Missing(f"{lay.domain_gpus_used} GPUs used per NVLink domain",
                                   f"no framework switch: give the launcher {lay.domain_gpus_used} ranks per rack "
                                   "(hostfile / SLURM --ntasks-per-node over the rack's nodes) so rank blocks "
                                   "follow the domains"))
    on = {ns.toggle: ns for ns in no_switch_for(target, model)}
    for t, ns in on.items():
        if getattr(lay.toggles, t):
            out.missing.append(Missing(f"toggle {t}", ns.instead))
    for t, b in built_in(target, model):
        priced = "priced so" if getattr(lay.toggles, t) else "priced without it, so memory is over-counted"
        out.notes.append(f"toggle {t}: {b.text} ({priced}) [{b.source}]")


def _flag_value(v: object) -> list[str]:
    if v is True:
        return []
    if isinstance(v, list):
        return [str(x) for x in v]
    return [str(v)]


def export(layout: Layout, model: ModelSpec) -> Launch:
    """`pretrain_gpt.py` flags, one per line, with the missing switches as comments."""
    settings, miss, notes = megatron_settings(layout, model, bridge=False)
    # The shapes k3opt prices are written; the switches that change no byte or FLOP it counts are the model's own
    # and not (Bridge's recipe carries them; pretrain_gpt.py's defaults are LayerNorm, GeLU and learned positions).
    notes = list(notes) + [f"{model.name}'s architecture switches that k3opt does not price are not written "
                           "(--normalization, --swiglu, --position-embedding-type and its base, the tokenizer and "
                           "vocabulary, --untie-embeddings-and-output-weights, --disable-bias-linear, the router's "
                           "score function): take them from the model's Megatron-LM example script"]
    lines = ["pretrain_gpt.py \\"]
    pairs = []
    for st in settings:
        if st.flag is None:
            continue
        vals = _flag_value(st.value)
        lines.append("    " + " ".join([st.flag] + [shlex.quote(v) for v in vals]) + " \\")
        pairs.append((st.flag, " ".join(vals)))
    lines[-1] = lines[-1].removesuffix(" \\")
    return Launch("megatron-lm", layout, "\n".join(lines), tuple(pairs), tuple(miss), tuple(notes))
