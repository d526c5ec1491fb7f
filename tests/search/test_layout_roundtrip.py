"""No projection drops a Layout field: a layout priced by the search's types (its frame and its Shape) comes back
from layout_of with every field it had, including the stack settings the job cannot name."""

from __future__ import annotations

import k3opt
from k3opt.cost.coefficients import Shape
from k3opt.inputs.specs import Dtype, FsdpLifecycle, Job, Precision, Recompute, ShardGranularity, ShardingPolicy
from k3opt.search.frames import frame_of, layout_of

# Every field set away from its default; `measured` and `source` describe a measurement, not a layout to price.
NOT_PRICED = {"measured", "source", "pipeline_layout", "cuda_graph_impl", "cuda_graph_modules"}
"""`pipeline_layout` spells the split in Megatron's syntax; the split it sets is what the search types carry. The CUDA
graph settings are recorded and exported, not priced (k3opt.cost.evaluate.UNPRICED): the search does not choose them,
so its types do not carry them."""


def _unusual_layout() -> k3opt.Layout:
    return k3opt.make_layout(
        gpus=128, pp=2, vp=2, cp=2, ep=8, expert_fsdp=2, dense_fsdp=16, microbatches=6, rows=2, context=8192,
        document_length=2048, split=[2, 1, 2, 1], recompute=Recompute.SELECTIVE, recompute_modules=["mla_up_proj"],
        fsdp_lifecycle=FsdpLifecycle.ACCUMULATE, toggles={"fp8_activations": True, "p2p_muon": True},
        reserve_gib=3.5, fp8_block_size=32, ce_chunk_tokens=512, offload_resident_layers=3, domain_gpus_used=64,
        offload_modules=["core_attn", "moe_act"],
        model="kimi-k3-4layer-proxy", cluster="gb300-nvl72", name="unusual", dense_sharding=ShardingPolicy.OPTIM,
        expert_sharding=ShardingPolicy.OPTIM_GRADS, optimizer_shard_granularity=ShardGranularity.TENSOR,
        grad_dtype=Dtype.BF16, optimizer_state_dtype=Dtype.BF16, lazy_optimizer_state=True,
        runtime="megatron-te-hybridep-gb200", precision=Precision.MXFP8, ep_overlap=True, dispatcher="deepep",
        delay_wgrad_compute=True,
        mtp_layers=0,
    )


def _single_chunk_fsdp_layout() -> k3opt.Layout:
    """The fields no layout can set together with the first one: Megatron-FSDP's per-layer gather (it needs an
    optim_grads_params group) and the offload of the first N layers (one chunk)."""
    return k3opt.make_layout(
        gpus=64, dense_fsdp=64, microbatches=2, rows=2, context=8192, split=[80], recompute=Recompute.NONE,
        param_gather="layer", activation_offload_layers=20, grad_dtype=Dtype.BF16, precision=Precision.FP8,
        model="llama3-70b", cluster="gb300-nvl72", name="fsdp")


def _round_trip(lay: k3opt.Layout) -> None:
    job = Job(model=lay.model, cluster=lay.cluster, gpus=lay.gpus, context=lay.context, rows=lay.rows,
              document_length=lay.document_length, reserve_gib=lay.reserve_gib, runtime=lay.runtime,
              mtp_layers=lay.mtp_layers, search={"microbatches": [lay.microbatches]})
    back = layout_of(job, frame_of(lay), Shape.of(lay), list(lay.split), name=lay.name)
    for name in set(k3opt.Layout.model_fields) - NOT_PRICED:
        assert getattr(back, name) == getattr(lay, name), name


def _fp8_weights_layout() -> k3opt.Layout:
    """MXFP8 weights stored only in MXFP8: Megatron's distributed optimizer (optim) on both groups and an AdamW
    model, which neither layout above has together."""
    return k3opt.make_layout(
        gpus=64, pp=4, vp=5, dense_fsdp=16, microbatches=16, context=8192, split=[4] * 20, recompute=Recompute.NONE,
        dense_sharding=ShardingPolicy.OPTIM, expert_sharding=ShardingPolicy.OPTIM, precision=Precision.MXFP8,
        fp8_param_gather=True, model="llama3-70b", cluster="gb300-nvl72", name="fp8-weights")


def _sync_free_layout() -> k3opt.Layout:
    """Megatron's sync-free MoE with its paged stash (HybridEP only, hence apart from the DeepEP layout above)."""
    return k3opt.make_layout(
        gpus=64, dense_fsdp=64, ep=8, expert_fsdp=8, microbatches=2, split=[61], recompute=Recompute.SELECTIVE,
        dispatcher="hybridep", toggles={"ep_dedup": True}, moe_expert_rank_capacity_factor=1.25, moe_paged_stash=True,
        moe_paged_stash_buffer_size_factor_cuda=1.3, moe_paged_stash_buffer_size_factor_cpu=0.5,
        model="deepseek-v3", cluster="gb200-nvl72", name="sync-free")


def test_every_layout_field_survives_the_search_types() -> None:
    layouts = [_unusual_layout(), _single_chunk_fsdp_layout(), _fp8_weights_layout(), _sync_free_layout()]
    defaults = {name: f.get_default(call_default_factory=True) for name, f in k3opt.Layout.model_fields.items()}
    unset = {name for name in k3opt.Layout.model_fields
             if all(getattr(lay, name) == defaults[name] for lay in layouts)} - NOT_PRICED
    assert not unset, f"the round trip must set these away from their defaults too: {sorted(unset)}"
    for lay in layouts:
        _round_trip(lay)
