"""Short text labels of a layout: its split in run-length form, its toggles, its parallel degrees."""

from __future__ import annotations

from k3opt.inputs.specs import PER_LAYER_GRAPHS, TOGGLE_NAMES, Layout


def split_text(split: list[int] | tuple[int, ...]) -> str:
    """Run-length form of a split: [12]*7 + [9] -> '12x7+9'."""
    out: list[str] = []
    i = 0
    while i < len(split):
        j = i
        while j < len(split) and split[j] == split[i]:
            j += 1
        out.append(f"{split[i]}x{j - i}" if j - i > 1 else str(split[i]))
        i = j
    return "+".join(out)


def toggles_text(layout: Layout) -> str:
    """The toggles switched on, then the offload modules and Megatron's MoE schedule settings:
    'fp8_activations,fused_situ,offload(moe_act)', '...,ep_overlap(delay_wgrad),capacity(1.5),paged_stash(1.2/1)'."""
    on = [t for t in TOGGLE_NAMES if getattr(layout.toggles, t)]
    if layout.offload_modules:
        on.append(f"offload({','.join(m.value for m in layout.offload_modules)})")
    if layout.ep_overlap:
        on.append("ep_overlap(delay_wgrad)" if layout.delay_wgrad_compute else "ep_overlap")
    if layout.moe_expert_rank_capacity_factor is not None:
        on.append(f"capacity({layout.moe_expert_rank_capacity_factor:g})")
    if layout.moe_paged_stash:
        on.append(f"paged_stash({layout.moe_paged_stash_buffer_size_factor_cuda:g}/"
                  f"{layout.moe_paged_stash_buffer_size_factor_cpu:g})")
    return ",".join(on) if on else "none"


def degrees_text(shape) -> str:  # noqa: ANN001 - a Layout or a search Frame
    """A parallel shape's degrees in the plan table's terms (the CLI, the plots, the search's open bound)."""
    return (f"PP{shape.pp} VP{shape.vp} CP{shape.cp} EP{shape.ep} eFSDP{shape.expert_fsdp} dFSDP{shape.dense_fsdp} "
            f"M{shape.microbatches}")


def sharding_text(shape) -> str:  # noqa: ANN001 - a Layout or a search Frame
    """The sharding policies (dense/expert), the gradient dtype and, under Megatron-FSDP's per-layer gather, the
    gather: 'optim_grads_params/optim grads=bf16 gather=layer'."""
    gather = " gather=layer" if shape.param_gather.value == "layer" else ""
    return f"{shape.dense_sharding.value}/{shape.expert_sharding.value} grads={shape.grad_dtype.value}{gather}"


def recompute_text(layout: Layout) -> str:
    """The recompute mode, with Megatron's modules when the layout names them: selective(mla_up_proj,mlp)."""
    modules = ",".join(m.value for m in layout.recompute_modules)
    return f"{layout.recompute.value}({modules})" if modules else layout.recompute.value


def layout_text(layout: Layout) -> str:
    return (f"PP{layout.pp} VP{layout.vp} CP{layout.cp} EP{layout.ep} expert-FSDP{layout.expert_fsdp} "
            f"dense-FSDP{layout.dense_fsdp} M{layout.microbatches} rows{layout.rows} ctx{layout.context} "
            f"split {split_text(layout.split)}"
            + (f" (Megatron layout {layout.pipeline_layout})" if layout.pipeline_layout else "")
            + f" recompute={recompute_text(layout)} "
            f"fsdp={layout.fsdp_lifecycle.value} toggles={toggles_text(layout)}"
            + (f" cuda_graphs={cuda_graphs_text(layout)}" if layout.cuda_graph_impl is not None else "")
            + (f" mtp_layers={layout.mtp_layers}" if layout.mtp_layers is not None else ""))


def cuda_graphs_text(layout: Layout) -> str:
    """Megatron's CUDA graph setting in one word: none, full_iteration, or the per-layer impl with its modules (an
    empty module list is the whole layer); "-" when the layout does not state it."""
    impl = layout.cuda_graph_impl
    if impl is None:
        return "-"
    if impl not in PER_LAYER_GRAPHS:
        return impl.value
    return f"{impl.value}[{','.join(m.value for m in layout.cuda_graph_modules) or 'whole layer'}]"
