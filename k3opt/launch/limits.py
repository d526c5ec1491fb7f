"""Framework limits as search constraints: what each launch target refuses or has no switch for.

Each limit is data with its source (file and commit). `apply_target_limits` narrows a Job's [search] so the
planner only proposes layouts the target can run; `launch_refusals` checks one layout. The same tables drive
the exports' "NO SWITCH" lists, so what the search forbids and what an export says cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from k3opt.inputs.errors import InfeasibleJobError, SpecError
from k3opt.inputs.frameworks import MB, MLM, TT
from k3opt.inputs.specs import FsdpLifecycle, Job, Layout, ModelSpec, ParamGather, Precision, kda_layers
from k3opt.inputs.toggles import built_in, no_switch
from k3opt.launch.common import FORMATS, check_format, runs_megatron_fsdp


@dataclass(frozen=True)
class NoSwitch:
    """A k3opt toggle the target has no switch for: the search forbids it, an export lists it."""

    toggle: str
    instead: str
    source: str


def no_switch_for(target: str, model: ModelSpec | None = None) -> tuple[NoSwitch, ...]:
    """The toggles `target` has no switch for with `model` (any model when None), from the toggle registry
    (k3opt.inputs.toggles)."""
    return tuple(NoSwitch(name, sw.instead, sw.source) for name, sw in no_switch(target, model))


NO_SWITCH: dict[str, tuple[NoSwitch, ...]] = {target: no_switch_for(target) for target in FORMATS}
"""Per target, the toggles it has no switch for whatever the model; a toggle built in for some models only
(k3opt.inputs.toggles.BuiltIn) is listed here, and `no_switch_for` with the model drops it."""


@dataclass(frozen=True)
class Limit:
    """A layout rule a target enforces (it raises, or the degree is derived and cannot be set)."""

    target: str
    name: str
    """What the rule constrains: vp, cp, expert_fsdp, fsdp_lifecycle, microbatches."""
    rule: str
    source: str


LIMITS: tuple[Limit, ...] = (
    Limit("megatron-bridge", "vp",
          "vp = 1 when the model has KDA layers: build_kimi_k3_spec raises 'Kimi K3 does not support virtual "
          "pipeline parallelism yet'",
          f"src/megatron/bridge/models/kimi/kimi_k3_spec.py L54-55 {MB}"),
    Limit("megatron-bridge", "cp",
          "cp = 1 when the model has KDA layers: KimiK3Attention raises 'Kimi K3 KDA context parallelism is not "
          "supported yet'", f"src/megatron/bridge/models/kimi/kimi_k3_layers.py L126-127 {MB}"),
    Limit("megatron-lm", "expert_fsdp",
          "dense_fsdp = ep x expert_fsdp: expert-DP = world / (ETP x EP x PP) is derived and "
          "--num-distributed-optimizer-instances N divides dense and expert DP by the same N",
          f"megatron/core/parallel_state.py, megatron/training/arguments.py L3216 {MLM}"),
    Limit("megatron-bridge", "expert_fsdp",
          "dense_fsdp = ep x expert_fsdp (Megatron core's derived expert-DP, ddp.num_distributed_optimizer_instances)",
          f"megatron/core/parallel_state.py {MLM}"),
    Limit("megatron-lm", "fsdp_lifecycle",
          "fsdp_lifecycle = accumulate: Muon is an emerging optimizer and 'does not support Megatron-FSDP', so "
          "sharding is the distributed optimizer, which reduces gradients once per update",
          f"megatron/training/arguments.py L1739-1740 {MLM}"),
    Limit("megatron-bridge", "fsdp_lifecycle", "fsdp_lifecycle = accumulate (same Megatron core rule for Muon)",
          f"megatron/training/arguments.py L1739-1740 {MLM}"),
    Limit("megatron-lm", "param_gather",
          "param_gather: with Muon, update only (Megatron-FSDP is refused, the distributed optimizer keeps the view); "
          "with AdamW, a dense optim_grads_params group is Megatron-FSDP, which gathers each layer just in time "
          "(param_gather = layer) and reduce-scatters every microbatch (fsdp_lifecycle = per_microbatch)",
          f"megatron/training/arguments.py L1739-1740, L3190-3203 {MLM}"),
    Limit("megatron-bridge", "param_gather", "param_gather: as megatron-lm (same Megatron core rules)",
          f"megatron/training/arguments.py L1739-1740, L3190-3203 {MLM}"),
    Limit("torchtitan", "expert_fsdp", "dense_fsdp = ep x expert_fsdp: efsdp = dp_shard x cp x tp / ep is derived",
          f"torchtitan/config/job_config.py (expert_parallel_degree) {TT}"),
    Limit("torchtitan", "cp", "cp divides dense_fsdp: the FSDP mesh is dp_shard x cp",
          f"torchtitan/config/job_config.py (data_parallel_shard_degree) {TT}"),
    Limit("torchtitan", "offload_modules", "no offload modules: core torchtitan offloads no activations "
          "([training] enable_cpu_offload moves parameters, gradients and optimizer state)",
          f"torchtitan/config/job_config.py (Training.enable_cpu_offload) {TT}"),
    Limit("torchtitan", "moe_capacity", "no expert-rank capacity factor or paged stash: its EP backends are "
          "'standard' and 'deepep', both dropless", f"torchtitan/config/job_config.py L474 {TT}"),
    Limit("torchtitan", "ep_overlap", "no EP overlap schedule under 1F1B or the interleaved schedule: its overlap of "
          "the expert all-to-all (pipeline_parallel_expert_parallel_overlap) runs under DualPipeV only",
          f"torchtitan/config/job_config.py L420-426 {TT}"),
    Limit("torchtitan", "precision", "precision bf16 or mxfp8 (its MX converters), and fp8 on a model without routed "
          "experts (Float8Linear, recipe 'tensorwise'): its FP8 grouped-GEMM converter scales row-wise and refuses "
          "pipeline parallelism, and it has no NVFP4 converter",
          f"torchtitan/config/job_config.py L738, torchtitan/components/quantization/float8.py L176-208 {TT}"),
)


def torchtitan_precisions(model: ModelSpec | None) -> tuple[Precision, ...]:
    """The compute precisions torchtitan runs as k3opt prices them: BF16, MXFP8 (its MX linear and grouped-GEMM
    converters), and per-tensor FP8 only where no routed expert needs its row-wise FP8 grouped GEMM (unknown
    model: assume it has them, the stricter rule)."""
    dense = model is not None and model.moe is None
    return (Precision.BF16, Precision.MXFP8, *((Precision.FP8,) if dense else ()))


def _source(target: str, name: str) -> str:
    return next(lim.source for lim in LIMITS if lim.target == target and lim.name == name)


def _muon(model: ModelSpec | None) -> bool:
    """The model trains with Muon (unknown model: assume so, the stricter rule). Megatron's Muon refuses
    Megatron-FSDP; an AdamW model may reduce-scatter every microbatch under it."""
    return model is None or model.optimizer.name == "muon"


def _has_kda(model: ModelSpec) -> bool:
    return bool(kda_layers(model))


def _gather_refusal(layout: Layout, model: ModelSpec | None) -> str:
    """Why Megatron cannot gather the parameters as `layout` prices them ('' when it can): Muon runs the
    distributed optimizer only, whose BF16 view is kept for the update; an AdamW dense optim_grads_params group
    runs Megatron-FSDP (the exports' choice), which gathers each layer just in time."""
    if _muon(model):
        if layout.param_gather == ParamGather.LAYER:
            return ("param_gather = layer: with Muon Megatron-FSDP is refused, the parameters are gathered for the "
                    "update")
        return ""
    if not runs_megatron_fsdp(layout, model):
        return ""
    if layout.param_gather == ParamGather.UPDATE:
        return ("param_gather = update with dense_sharding = optim_grads_params: Megatron-FSDP gathers each layer "
                "just in time (param_gather = layer)")
    if layout.fsdp_lifecycle == FsdpLifecycle.ACCUMULATE:
        return ("fsdp_lifecycle = accumulate with dense_sharding = optim_grads_params: Megatron-FSDP reduce-scatters "
                "the gradients every microbatch (per_microbatch)")
    return ""


class Degrees(Protocol):
    """The parallel degrees a target's degree rules read: a Layout's or a search Frame's."""

    vp: int
    cp: int
    ep: int
    expert_fsdp: int
    dense_fsdp: int


def degree_refusals(d: Degrees, target: str, model: ModelSpec | None = None,
                    lifted: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """The limits of `refusals` that read the parallel degrees alone (a frame breaks them or not whatever its
    split, modes and toggles): Bridge's VP and CP with KDA layers; the derived expert sharding degree
    (dense_fsdp = ep x expert_fsdp, on a model with routed experts); torchtitan's CP dividing the dense FSDP group."""
    check_format(target)
    out: list[tuple[str, str]] = []
    if target == "megatron-bridge" and d.vp > 1 and (model is None or _has_kda(model)):
        out.append(("vp", f"vp = {d.vp} > 1 with KDA layers [{_source(target, 'vp')}]"))
    if target == "megatron-bridge" and d.cp > 1 and (model is None or _has_kda(model)):
        out.append(("cp", f"cp = {d.cp} > 1 with KDA layers [{_source(target, 'cp')}]"))
    # A model without routed experts has no expert group, and nothing derives its degree.
    if d.dense_fsdp != d.ep * d.expert_fsdp and (model is None or model.moe is not None):
        src = _source(target, "expert_fsdp")
        out.append(("expert_fsdp", f"dense_fsdp {d.dense_fsdp} != ep x expert_fsdp = {d.ep} x "
                                   f"{d.expert_fsdp}: the expert sharding degree is derived [{src}]"))
    if target == "torchtitan" and d.dense_fsdp % d.cp:
        out.append(("cp", f"cp {d.cp} does not divide dense_fsdp {d.dense_fsdp} [{_source(target, 'cp')}]"))
    return [(k, why) for k, why in out if k not in lifted]


def refusals(layout: Layout, target: str, model: ModelSpec | None = None,
             lifted: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(limit id, reason with its source) of every limit of `target` that `layout` breaks, but those `lifted`.
    Limit ids: the Limit names (vp, cp, expert_fsdp, fsdp_lifecycle, param_gather, offload_modules, moe_capacity,
    ep_overlap, precision) and
    `toggle:NAME` for a toggle with no switch."""
    out = degree_refusals(layout, target, model, frozenset())
    if target in ("megatron-lm", "megatron-bridge") and layout.fsdp_lifecycle != FsdpLifecycle.ACCUMULATE \
            and _muon(model):
        out.append(("fsdp_lifecycle", f"fsdp_lifecycle {layout.fsdp_lifecycle.value}: with Muon only the "
                                      f"distributed optimizer (accumulate) runs [{_source(target, 'fsdp_lifecycle')}]"))
    if target in ("megatron-lm", "megatron-bridge"):
        why = _gather_refusal(layout, model)
        if why:
            out.append(("param_gather", f"{why} [{_source(target, 'param_gather')}]"))
    for ns in no_switch_for(target, model):
        if getattr(layout.toggles, ns.toggle):
            out.append((f"toggle:{ns.toggle}", f"toggle {ns.toggle} has no switch [{ns.source}]"))
    if target == "torchtitan" and layout.offload_modules:
        out.append(("offload_modules", f"offload_modules {[m.value for m in layout.offload_modules]} has no key "
                                       f"[{_source(target, 'offload_modules')}]"))
    if target == "torchtitan" and (layout.moe_expert_rank_capacity_factor is not None or layout.moe_paged_stash):
        out.append(("moe_capacity", "moe_expert_rank_capacity_factor / moe_paged_stash have no key "
                                    f"[{_source(target, 'moe_capacity')}]"))
    if target == "torchtitan" and layout.ep_overlap:
        out.append(("ep_overlap", f"ep_overlap has no switch [{_source(target, 'ep_overlap')}]"))
    if target == "torchtitan" and layout.precision not in torchtitan_precisions(model):
        out.append(("precision", f"precision {layout.precision.value} has no converter "
                                 f"[{_source(target, 'precision')}]"))
    return [(k, why) for k, why in out if k not in lifted]


def launch_refusals(layout: Layout, target: str, model: ModelSpec | None = None,
                    lifted: frozenset[str] = frozenset()) -> list[str]:
    """Every reason `target` cannot run `layout` as k3opt priced it (empty: it can), each naming its source; the
    limits in `lifted` (ids as in `refusals`) do not count."""
    return [why for _, why in refusals(layout, target, model, lifted)]


def limit_text(target: str, limit: str) -> str:
    """What limit id `limit` of `target` is, in one phrase with its source."""
    if limit.startswith("toggle:"):
        name = limit.removeprefix("toggle:")
        src = next((ns.source for ns in NO_SWITCH[target] if ns.toggle == name), "")
        return f"{name} has no switch in {target} [{src}]"
    lim = next((x for x in LIMITS if x.target == target and x.name == limit), None)
    return f"{lim.rule} [{lim.source}]" if lim is not None else f"{target} limit {limit}"


def apply_target_limits(job: Job, model: ModelSpec | None = None, lifted: frozenset[str] = frozenset()) -> Job:
    """The job narrowed to what job.target can run (unchanged when no target): vp / cp lists, the FSDP
    lifecycle, torchtitan's EP overlap off (its sync-free MoE refused), every toggle without a switch added to
    forbid_toggles, and every toggle the target always runs for
    the model (k3opt.inputs.toggles.BuiltIn) added to require_toggles; but the limits in `lifted` (ids as in
    `refusals`), left as the job had them, to price each limit alone.

    The derived expert-DP rule (dense_fsdp = ep x expert_fsdp) couples three degrees, which the [search] lists
    cannot say; `k3opt.planner.plan` filters frames that break it (see launch_refusals)."""
    target = getattr(job, "target", None)
    if target is None:
        return job
    check_format(target)
    s = job.search
    upd: dict = {}

    def narrow(name: str, allowed: list) -> None:
        if name in lifted:
            return
        cur = getattr(s, name)
        upd[name] = [v for v in cur if v in allowed] if cur is not None else list(allowed)

    if target == "megatron-bridge" and (model is None or _has_kda(model)):
        # Kimi K3's spec (its KDA layers): the other models' Bridge recipes run interleaved schedules and CP.
        narrow("vp", [1])
        narrow("cp", [1])
    if target in ("megatron-lm", "megatron-bridge") and _muon(model):
        narrow("fsdp_lifecycle", [FsdpLifecycle.ACCUMULATE])
        narrow("param_gather", [ParamGather.UPDATE])
    elif (target in ("megatron-lm", "megatron-bridge") and model is not None and s.param_gather is None
          and "param_gather" not in lifted):
        # AdamW: a dense optim_grads_params group runs as Megatron-FSDP, which gathers per layer; a job that names
        # no gather searches that one too, as it would have to list it to plan what Megatron runs.
        upd["param_gather"] = [ParamGather.UPDATE, ParamGather.LAYER]
    if target == "torchtitan" and "offload_modules" not in lifted:
        upd["offload_modules"] = []
    precisions = job.precisions
    if target == "torchtitan" and "precision" not in lifted:
        precisions = [p for p in job.precisions if p in torchtitan_precisions(model)]
        if not precisions:
            raise InfeasibleJobError(
                f"precisions {[p.value for p in job.precisions]} leave none target torchtitan runs "
                f"({limit_text(target, 'precision')}); add \"bf16\" or \"mxfp8\" to precisions or drop the target")
    forbid = list(s.forbid_toggles)
    for ns in no_switch_for(target, model):
        if ns.toggle not in forbid and f"toggle:{ns.toggle}" not in lifted:
            forbid.append(ns.toggle)
    required = [t for t in s.require_toggles if t in forbid]
    if required:
        raise SpecError(f"job requires toggles {required} that target {target} has no switch for; "
                        "remove them from [search] require_toggles or drop the target")
    always = [name for name, _ in built_in(target, model)]
    refused = [t for t in always if t in s.forbid_toggles]
    if refused:
        raise SpecError(f"job forbids toggles {refused} that target {target} always runs for this model; "
                        "remove them from [search] forbid_toggles or drop the target")
    upd["forbid_toggles"] = forbid
    upd["require_toggles"] = [*s.require_toggles, *(t for t in always if t not in s.require_toggles)]
    for name in ("vp", "cp", "fsdp_lifecycle", "param_gather"):
        if name in upd and not upd[name]:
            raise InfeasibleJobError(f"[search] {name} leaves no value target {target} can run; "
                                     f"allow {name} = 1 / accumulate / update or drop the target")
    job_upd: dict = {"search": s.model_copy(update=upd), "precisions": precisions}
    if target == "torchtitan" and job.moe_expert_rank_capacity_factor is not None and "moe_capacity" not in lifted:
        raise SpecError(f"moe_expert_rank_capacity_factor with target torchtitan: {limit_text(target, 'moe_capacity')};"
                        " drop the sync-free MoE fields or the target")
    if target == "torchtitan" and job.ep_overlap and "ep_overlap" not in lifted:
        # Its 1F1B and interleaved schedules run the all-to-all exposed.
        job_upd.update(ep_overlap=False, delay_wgrad_compute=False)
    return job.model_copy(update=job_upd)

