"""torchtitan TOML sections for a layout (torchtitan/config/job_config.py @ e347b1e5, the last TOML-era
version; torchtitan HEAD b5bcd76c reads Python config functions and keeps these keys as `--section.key`
overrides).

FSDP: the dense shard mesh is dp_shard x cp and the rest of a stage's ranks replicate, so
data_parallel_shard_degree = dense_fsdp / cp and data_parallel_replicate_degree = (gpus / pp) / dense_fsdp.
The expert shard degree is derived (efsdp = dp_shard x cp x tp / ep).
"""

from __future__ import annotations

import json

from k3opt.inputs.presets import shipped_model
from k3opt.inputs.specs import CudaGraphImpl, Dtype, Layout, ModelSpec, Precision, Recompute, kda_layers
from k3opt.launch.common import Launch, Missing, global_batch
from k3opt.launch.limits import no_switch_for, torchtitan_precisions


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def chunk_fqns(layout: Layout) -> list[list[str]]:
    """module_fqns_per_model_part: chunk j holds layers.a .. layers.b; the embedding goes on the first chunk,
    the final norm and the output head on the last (torchtitan's llama-style module names)."""
    parts: list[list[str]] = []
    start = 0
    last = len(layout.split) - 1
    for j, n in enumerate(layout.split):
        names = [f"layers.{i}" for i in range(start, start + n)]
        if j == 0:
            names.insert(0, "tok_embeddings")
        if j == last:
            names += ["norm", "output"]
        parts.append(names)
        start += n
    return parts


MODELS: dict[str, tuple[str, str, str]] = {
    "llama3-70b": ("llama3", "70B", "torchtitan/models/llama3/__init__.py L82"),
    "deepseek-v3": ("deepseek_v3", "671B", "torchtitan/models/deepseek_v3/__init__.py L130"),
    "qwen3-30b-a3b": ("qwen3", "30B-A3B", "torchtitan/models/qwen3/__init__.py L145"),
    "qwen3-235b-a22b": ("qwen3", "235B-A22B", "torchtitan/models/qwen3/__init__.py L168"),
}
"""k3opt's model presets that torchtitan builds (the pinned TOML commit): its [model] name and flavor, with source.
Kimi K3 (KDA layers) and Kimi K2 (DeepSeek-V3's architecture at 384 experts, no flavor of it) are listed missing,
and so is a model file that reuses a preset's name with other shapes (`shipped_model`)."""


def _model_section(lay: Layout, model: ModelSpec, sections: dict[str, list[tuple[str, object]]],
                   miss: list[Missing]) -> None:
    """[model] name and flavor, and [optimizer] name, as torchtitan spells them; what it has no model or optimizer
    for is listed missing."""
    preset = shipped_model(model)
    name, flavor, _ = MODELS.get(preset or "", ("kimi_k3" if kda_layers(model) else model.name.replace("-", "_"),
                                              None, ""))
    sections["model"].append(("name", name))
    if flavor is not None:
        sections["model"].append(("flavor", flavor))
    elif not kda_layers(model):
        miss.append(Missing(f"{model.name} model", f"torchtitan has no model flavor with its shapes: register one "
                            f"under [model] name = \"{name}\""))
    if model.optimizer.name == "muon":
        miss.append(Missing(f"Muon optimizer ({model.name}'s matrices)", "the TOML-era [optimizer] name offers "
                            "Adam/AdamW only; torchtitan HEAD's DistMuon is set in Python config "
                            "(optimizer.param_groups)"))
    else:
        sections["optimizer"] = [("name", "AdamW")]
        if model.optimizer.state_of(lay.optimizer_state_dtype) != Dtype.FP32:
            miss.append(Missing("AdamW moments in BF16", "no key: torchtitan's AdamW keeps its moments in the "
                                "parameters' FP32; price the layout with optimizer_state_dtype = \"fp32\""))


def _cuda_graphs_missing(lay: Layout) -> list[Missing]:
    """A stated CUDA graph capture: torchtitan's job config (TORCHTITAN_TOML_COMMIT) has no switch for it."""
    if lay.cuda_graph_impl in (None, CudaGraphImpl.NONE):
        return []
    return [Missing(f"cuda_graph_impl = {lay.cuda_graph_impl.value}",
                    "torchtitan's job config has no CUDA-graph switch for training; the run is eager")]


def _model_missing(model: ModelSpec) -> list[Missing]:
    """The model's parts torchtitan's job config cannot build: KDA layers, MTP layers, the vision tower."""
    miss = []
    if kda_layers(model):
        miss.append(Missing(f"{model.name} model (KDA linear-attention layers)",
                            "torchtitan has no KDA model: register one under [model] name = \"kimi_k3\" "
                            "with the module names used in module_fqns_per_model_part"))
    if model.mtp_layers:
        miss.append(Missing(f"{model.mtp_layers} MTP layer(s) before the loss",
                            "no job-config key: torchtitan builds DeepSeek-V3's MTP layers through its model "
                            "registry (model_registry(num_mtp_layers=N), torchtitan/models/deepseek_v3/MTP.md at "
                            "b5bcd76c); register a flavor with them, or plan with mtp_layers = 0"))
    if model.vision is not None:
        miss.append(Missing("vision tower on the first pipeline chunk",
                            "add the vision tower's module names to the first list of module_fqns_per_model_part"))
    return miss


def _precision(lay: Layout, model: ModelSpec, sections: dict[str, list[tuple[str, object]]], miss: list[Missing],
               notes: list[str]) -> None:
    """The compute precision's converters (or the precision listed as missing: limits.torchtitan_precisions)."""
    if lay.precision not in torchtitan_precisions(model):
        # The search's own limit (limits.LIMITS "precision"): a plan with target torchtitan never lands here.
        miss.append(Missing(f"precision = \"{lay.precision.value}\"", "torchtitan's FP8 grouped-GEMM converter "
                            "scales row-wise and refuses pipeline parallelism (float8.py L176-208), and it has no "
                            "NVFP4 converter; price the layout with precision \"mxfp8\" (its MX converters) or "
                            "\"bf16\""))
    elif lay.precision == Precision.FP8:
        # Per-tensor FP8 on the linears of a model without routed experts (job_config.py L738 at the pinned commit).
        sections["model"].append(("converters", ["quantize.linear.float8"]))
        sections["quantize.linear.float8"] = [("recipe_name", "tensorwise")]
    elif lay.toggles.fp8_activations or lay.precision == Precision.MXFP8:
        sections["model"].append(("converters", ["quantize.linear.mx", "quantize.grouped_mm.mx"]))
        sections["quantize.linear.mx"] = [("recipe_name", "mxfp8_cublas")]
        # The grouped-GEMM converter acts only on the MoE modules listed (default: none).
        sections["quantize.grouped_mm.mx"] = [("recipe_name", "mxfp8"), ("fqns", ["experts"])]
        if lay.precision == Precision.BF16 and lay.fp8_block_size != 32:  # MXFP8 compute prices 1x32 itself
            notes.append(f"FP8: torchtitan's block-scaled converter is MXFP8 (1x32 blocks); k3opt priced "
                         f"1x{lay.fp8_block_size} blocks: set fp8_block_size = 32 to price what runs")


def export(layout: Layout, model: ModelSpec) -> Launch:
    """A TOML config with [model], [parallelism], [training], [activation_checkpoint] and, for an AdamW model,
    [optimizer] sections."""
    lay = layout
    miss: list[Missing] = []
    notes: list[str] = []
    sections: dict[str, list[tuple[str, object]]] = {"model": [], "parallelism": [], "training": [],
                                                     "activation_checkpoint": []}
    _model_section(lay, model, sections, miss)
    _precision(lay, model, sections, miss, notes)

    par = sections["parallelism"]
    cp = lay.cp
    if lay.dense_fsdp % cp:
        miss.append(Missing(f"dense_fsdp = {lay.dense_fsdp} with cp = {cp}",
                            "the FSDP mesh is dp_shard x cp, so cp must divide dense_fsdp; re-plan with "
                            "target = \"torchtitan\""))
    par += [("data_parallel_replicate_degree", lay.stage_ranks // lay.dense_fsdp),
            ("data_parallel_shard_degree", max(lay.dense_fsdp // cp, 1)),
            ("tensor_parallel_degree", 1),
            ("pipeline_parallel_degree", lay.pp),
            ("pipeline_parallel_schedule", "Interleaved1F1B" if lay.vp > 1 else "1F1B"),
            ("pipeline_parallel_microbatch_size", lay.rows),
            ("module_fqns_per_model_part", chunk_fqns(lay)),
            ("context_parallel_degree", cp),
            ("expert_parallel_degree", lay.ep),
            ("expert_tensor_parallel_degree", 1)]
    if lay.toggles.ep_dedup:
        par.append(("expert_parallel_comm_backend", "deepep"))
    if model.moe is not None and lay.dense_fsdp != lay.ep * lay.expert_fsdp:
        miss.append(Missing(f"expert_fsdp = {lay.expert_fsdp} with dense_fsdp = {lay.dense_fsdp}, ep = {lay.ep}",
                            f"no key: torchtitan derives efsdp = dp_shard x cp / ep = "
                            f"{lay.dense_fsdp // lay.ep if lay.dense_fsdp >= lay.ep else 'below 1'}; "
                            "re-plan with target = \"torchtitan\""))

    sections["training"] += [("local_batch_size", lay.rows * lay.microbatches),
                             ("global_batch_size", global_batch(lay)),
                             ("seq_len", lay.context)]
    notes.append(f"microbatches M = local_batch_size / pipeline_parallel_microbatch_size = "
                 f"{lay.rows * lay.microbatches} / {lay.rows}")

    ac = sections["activation_checkpoint"]
    if lay.recompute == Recompute.FULL:
        ac.append(("mode", "full"))
    elif lay.recompute == Recompute.SELECTIVE and lay.recompute_modules:
        ac += [("mode", "selective"), ("selective_ac_option", "op")]
        miss.append(Missing(f"recompute_modules {[m.value for m in lay.recompute_modules]}",
                            "no key: selective AC recomputes per op or every n-th layer, not Megatron's modules; "
                            "re-plan without recompute_modules to price what 'op' keeps"))
    elif lay.recompute == Recompute.SELECTIVE:
        ac += [("mode", "selective"), ("selective_ac_option", "op")]
        notes.append("selective: per-op SAC ('op') saves matmul outputs and recomputes the other ops, the "
                     "nearest match to k3opt's selective recompute")
    else:
        ac.append(("mode", "none"))

    if lay.offload_modules:
        miss.append(Missing(f"offload_modules {[m.value for m in lay.offload_modules]}",
                            "no key: core torchtitan has no activation offload ([training] enable_cpu_offload moves "
                            "parameters, gradients and optimizer state); re-plan without offload_modules"))
    miss.append(Missing(f"fsdp_lifecycle = {lay.fsdp_lifecycle.value}",
                        "no key: FSDP2's gradient reduce-scatter timing under a PP schedule is decided by "
                        "PyTorch's pipelining stage, not by the config; check it matches what k3opt priced"))
    miss += _cuda_graphs_missing(lay)
    miss += _model_missing(model)
    if lay.domain_gpus_used is not None:
        miss.append(Missing(f"{lay.domain_gpus_used} GPUs used per NVLink domain",
                            f"no key: give torchrun {lay.domain_gpus_used} ranks per rack so rank blocks follow "
                            "the NVLink domains"))
    for ns in no_switch_for("torchtitan", model):
        if getattr(lay.toggles, ns.toggle):
            miss.append(Missing(f"toggle {ns.toggle}", ns.instead))

    lines: list[str] = []
    pairs: list[tuple[str, str]] = []
    for sec, items in sections.items():
        if not items:
            continue
        lines.append(f"[{sec}]")
        for k, v in items:
            if k == "module_fqns_per_model_part":
                lines.append(f"{k} = [")
                lines += [f"    {_toml(part)}," for part in v]  # type: ignore[union-attr]
                lines.append("]")
            else:
                lines.append(f"{k} = {_toml(v)}")
            pairs.append((f"{sec}.{k}", _toml(v)))
        lines.append("")
    return Launch("torchtitan", layout, "\n".join(lines), tuple(pairs), tuple(miss), tuple(notes))
