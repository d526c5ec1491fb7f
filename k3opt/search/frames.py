"""Frames (the parallel shapes a job allows), activation modes, and the per-rank memory budget."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from k3opt.cost import comm
from k3opt.cost.coefficients import Coefficients, Shape, step_gather_bytes
from k3opt.cost.evaluate import Evaluation
from k3opt.cost.ledger import ALWAYS_HELD, layer_bytes
from k3opt.cost.memory_outside import allocated_budget_bytes
from k3opt.cost.structure import offloads_nothing
from k3opt.inputs import toggles as toggle_registry
from k3opt.inputs.errors import LayoutError, SpecError
from k3opt.inputs.memo import Memo, register
from k3opt.inputs.placement import domains_held
from k3opt.inputs.presets import load_cluster, load_runtime
from k3opt.inputs.specs import (
    GIB,
    ClusterSpec,
    Dtype,
    FsdpLifecycle,
    Job,
    Layout,
    ModelSpec,
    OffloadModule,
    ParamGather,
    Precision,
    Recompute,
    RuntimeSpec,
    SearchSpace,
    ShardingPolicy,
    Toggles,
    dense_sync_free_refusal,
    ep_overlap_allowed,
    fp8_weights_priced,
)
from k3opt.search.ranking import ranked_coefficients as coefficients  # the ranked view (search/ranking.py)

# The search's toggle sets, from the toggle registry (k3opt.inputs.toggles): activation toggles form one-hot modes
# with the recompute mode; rank toggles are Boolean decisions of the node model; a rank toggle never chosen (MoonEP,
# whose benefit, expert-load balance, is outside the forced-balanced routing model) and a fixed one (the
# dispatcher's dedup) are searched only when a job requires them.
ACT_TOGGLES = toggle_registry.ACT_TOGGLES
RANK_TOGGLES = toggle_registry.RANK_TOGGLES
NEVER_CHOSEN = toggle_registry.NEVER_CHOSEN
FIXED_TOGGLES = toggle_registry.FIXED_TOGGLES


@dataclass(frozen=True, order=True)
class Frame:
    """The parallel shape of a layout: everything the frame model does not decide."""

    pp: int
    vp: int
    cp: int
    ep: int
    expert_fsdp: int
    dense_fsdp: int
    microbatches: int
    gpus: int
    dense_sharding: ShardingPolicy = ShardingPolicy.OPTIM_GRADS_PARAMS
    expert_sharding: ShardingPolicy = ShardingPolicy.OPTIM_GRADS_PARAMS
    grad_dtype: Dtype = Dtype.FP32
    precision: Precision = Precision.BF16
    domain_gpus_used: int | None = None
    """GPUs used per NVLink domain (one of `domain_options`); None: whole domains."""
    param_gather: ParamGather = ParamGather.UPDATE
    """How the optim_grads_params groups gather their parameters (Layout.param_gather)."""
    fp8_param_gather: bool = False
    """The compute-precision weights stored only in it (Layout.fp8_param_gather; `fp8_weights`)."""
    ep_overlap: bool = False
    """Megatron's EP overlap schedule under the activation modes it runs with (`frame_shape`); a job with
    ep_overlap searches each frame that allows it with and without (`_overlaps`)."""


DEFAULT_SHARDING = (ShardingPolicy.OPTIM, ShardingPolicy.OPTIM_GRADS)
"""Sharding policies searched when the job's [search] lists none: the two no other policy dominates. `no_shard`
holds every byte `optim` holds or more and moves more (an all-reduce, g P x 2 (1 - 1/n) against `optim`'s
reduce-scatter g P + BF16 all-gather 2 P, g >= 2 B) and orthogonalizes every matrix itself; `optim_grads_params`
(k3opt's accounting: the BF16 view gathered and kept) moves what `optim_grads` moves and adds the fresh BF16
all-gather at the step. `optim` keeps the whole gradient buffer and reduces it once per update; `optim_grads`
shards it and reduce-scatters every microbatch (the memory-for-traffic trade)."""


def frame_of(layout: Layout) -> Frame:
    """The frame of a layout (its degrees, microbatches, sharding, gradient dtype and precision)."""
    return Frame(layout.pp, layout.vp, layout.cp, layout.ep, layout.expert_fsdp, layout.dense_fsdp,
                 layout.microbatches, layout.gpus, layout.dense_sharding, layout.expert_sharding, layout.grad_dtype,
                 layout.precision, layout.domain_gpus_used, layout.param_gather, layout.fp8_param_gather,
                 layout.ep_overlap)


def fp8_weights(job: Job, model: ModelSpec, precision: Precision, dense: ShardingPolicy, expert: ShardingPolicy,
                gather: ParamGather, fd: int, fe: int) -> bool:
    """Whether a frame stores its compute-precision weights only in that precision (Layout.fp8_param_gather):
    wherever Megatron takes it, FP8 or MXFP8 under its distributed optimizer (`optim`, the view kept for the update)
    with AdamW, for a Megatron target or none (a group of one rank, fd or fe = 1, under any policy). It only removes
    bytes (the BF16 copy; per-tensor FP8's second copy) and link bytes (per-tensor FP8's gather), so the search sets
    it rather than branching on it, as Megatron-Bridge's precision configs do."""
    return (fp8_weights_priced(precision, dense, fd, expert, fe, gather) and model.optimizer.name == "adamw"
            and job.target != "torchtitan")


def default_sharding(s: SearchSpace) -> list[ShardingPolicy]:
    """The policies searched when the job lists none: DEFAULT_SHARDING, and optim_grads_params too where the job
    allows the per-layer gather (`[search] param_gather`). Gathered per layer, it holds a parameter shard and two
    layers instead of the whole view: no longer dominated by optim_grads."""
    per_layer = ParamGather.LAYER in (s.param_gather or ())
    return [*DEFAULT_SHARDING, *([ShardingPolicy.OPTIM_GRADS_PARAMS] if per_layer else [])]


def _policies(listed: list[ShardingPolicy] | None, group: int, s: SearchSpace) -> list[ShardingPolicy]:
    """Policies searched for a shard group of `group` ranks: with one rank every policy shards nothing, so one
    representative (the reference policy when allowed) stands for all."""
    allowed = list(listed) if listed is not None else default_sharding(s)
    if group == 1:
        return [ShardingPolicy.OPTIM_GRADS_PARAMS if ShardingPolicy.OPTIM_GRADS_PARAMS in allowed else allowed[0]]
    return allowed


# ------------------------------------------------------------------------------------- enumeration


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(values: list[int], allowed: list[int] | None) -> list[int]:
    return [v for v in values if allowed is None or v in allowed]


def default_cp(job: Job, cluster: ClusterSpec, stage: int) -> list[int]:
    """CP degrees searched when the job lists none: 1, and every C dividing the stage whose split of the sequence
    into 2 C load-balancing chunks is whole (TE's DualChunkSwap) and whose local tokens T = rows x context / C
    still hide the MLA KV ring behind the attention of a ring step on NVLink (T >= 2 F / B,
    `comm.cp_overlap_min_tokens`); below that CP only adds exposed traffic to a shorter sequence."""
    seq = job.rows * job.context
    t_min = comm.cp_overlap_min_tokens(cluster.bf16_tflops * 1e12, cluster.nvlink_gbps * 1e9)
    return [c for c in _divisors(stage) if c == 1 or (seq % (2 * c) == 0 and seq / c >= t_min)]


def _policy_pairs(s: SearchSpace, fd: int, fe: int) -> list[tuple[ShardingPolicy, ShardingPolicy]]:
    """(dense, expert) sharding policies searched. With neither list given, one strategy for both groups, as
    Megatron launches it (one `--data-parallel-sharding-strategy` for every parameter of Megatron-FSDP;
    `--use-distributed-optimizer` shards both groups): DEFAULT_SHARDING, tied. A list given for either group
    searches every pair of the two lists."""
    dense, expert = _policies(s.dense_sharding, fd, s), _policies(s.expert_sharding, fe, s)
    if s.dense_sharding is None and s.expert_sharding is None and fd > 1 and fe > 1:
        return [(p, p) for p in dense]
    return list(itertools.product(dense, expert))


def _gathers(s: SearchSpace, dense: ShardingPolicy, expert: ShardingPolicy, fd: int, fe: int, routed: bool
             ) -> list[ParamGather]:
    """The parameter gathers searched for a pair of sharding policies: the job's list (absent: the update-long
    view only); the per-layer gather only where a group of more than one rank, holding parameters, shards them
    (optim_grads_params): elsewhere it gathers nothing and would repeat the frame."""
    listed = list(dict.fromkeys(s.param_gather or [ParamGather.UPDATE]))
    ogp = ShardingPolicy.OPTIM_GRADS_PARAMS
    if (dense == ogp and fd > 1) or (expert == ogp and fe > 1 and routed):
        return listed
    return [ParamGather.UPDATE] if ParamGather.UPDATE in listed else []


def enumerate_frames(job: Job, model: ModelSpec, gpus: int, cluster: ClusterSpec | None = None) -> list[Frame]:
    """Every frame the job allows on `gpus` GPUs (divisibility rules of the Layout model). CP: the job's list, else
    `default_cp` on the job's cluster (or `cluster`). Per shape, the dense and expert sharding policies
    (`_policy_pairs`), the gradient dtypes (the job's list, else FP32) and the job's accepted precisions. A dense
    model searches expert FSDP 1 only (its expert group is empty)."""
    s = job.search
    if cluster is None:
        cluster = load_cluster(job.cluster)
    L = model.num_layers
    experts = model.moe.num_experts if model.moe else 1
    grad_dtypes = list(dict.fromkeys(s.grad_dtype or [Dtype.FP32]))
    precisions = list(dict.fromkeys(job.precisions))
    _check_precisions(precisions, cluster)
    frames = []
    for p in _allowed(_divisors(gpus), s.pp):
        if p > L:
            continue
        stage = gpus // p
        max_v = max(s.vp) if s.vp else s.max_vp
        for v in _allowed(list(range(1, max_v + 1)), s.vp):
            if p * v > L or (v > 1 and p == 1):
                continue
            if s.split is not None and len(s.split) != p * v:
                continue
            for c in (_allowed(_divisors(stage), s.cp) if s.cp is not None else default_cp(job, cluster, stage)):
                if (job.rows * job.context) % c:
                    continue
                dp = stage // c
                if job.tokens_per_update is not None:
                    per = dp * job.rows * job.context
                    if job.tokens_per_update % per:
                        continue
                    ms = [job.tokens_per_update // per]
                    ms = _allowed(ms, s.microbatches)
                else:
                    ms = list(s.microbatches or [])
                for e in _allowed([d for d in _divisors(stage) if experts % d == 0], s.ep):
                    # A model without routed experts has an empty expert group: every degree prices alike, so one
                    # stands for all unless the job lists its own.
                    fes = [1] if model.moe is None and s.expert_fsdp is None else _divisors(stage // e)
                    for fe in _allowed(fes, s.expert_fsdp):
                        for fd in _allowed(_divisors(dp), s.dense_fsdp):  # dense FSDP groups are dp indices
                            for m, (pd, pe), g, q, u in itertools.product(
                                    ms, _policy_pairs(s, fd, fe), grad_dtypes, precisions,
                                    domain_options(job, gpus, p, c, e, fe, fd, cluster.nvlink_domain_gpus)):
                                if v == 1 or m % p == 0:  # interleaving needs whole groups of p (Layout)
                                    for pg, o in itertools.product(_gathers(s, pd, pe, fd, fe, model.moe
                                                                            is not None), _overlaps(job, e, p, v)):
                                        frames.append(Frame(p, v, c, e, fe, fd, m, gpus, pd, pe, g, q, u, pg,
                                                            fp8_weights(job, model, q, pd, pe, pg, fd, fe), o))
    return frames


def _overlaps(job: Job, ep: int, pp: int, vp: int) -> list[bool]:
    """The EP overlap settings searched on degrees (ep, pp, vp): both where the job asks for the schedule and
    Megatron runs it there (under selective or no recompute), the overlapped one first; else none. The schedule
    hides the all-to-all (its stage is never longer: `achievable.ep_overlap_stage_exposed`) but holds a layer's
    transients and the loss's logits at once (`ledger.activation_moments`), so a shape whose overlap does not fit
    may fit without it."""
    if job.ep_overlap and not ep_overlap_allowed(ep, pp, vp, Recompute.NONE):
        return [True, False]
    return [False]


SHAPE_LIST_RULES = {
    "pp": "PP divides the GPUs and is at most the layers",
    "vp": "PP x VP chunks are at most the layers, and VP > 1 needs PP > 1 and microbatches in groups of PP",
    "cp": "CP divides the GPUs of a stage and rows x context",
    "ep": "EP divides the GPUs of a stage and the routed experts",
    "expert_fsdp": "expert FSDP divides the GPUs of a stage over EP",
    "dense_fsdp": "dense FSDP divides the data-parallel degree",
    "microbatches": "microbatches = tokens_per_update / (DP x rows x context)",
    "split": "a split has PP x VP entries",
}
"""The [search] lists that restrict the parallel shapes themselves (the others choose configurations of a shape),
each with the rule a value must meet (`enumerate_frames`)."""


def blocking_lists(job: Job, model: ModelSpec, cluster: ClusterSpec) -> list[tuple[str, object]]:
    """The [search] shape lists each of which, dropped alone, lets some shape through: what an error should name
    when the job's rules leave none."""
    out = []
    for key in SHAPE_LIST_RULES:
        value = getattr(job.search, key)
        if value is None:
            continue
        kept = job.model_copy(update={"search": job.search.model_copy(update={key: None})})
        if any(enumerate_frames(kept, model, g, cluster) for g in job.gpu_counts):
            out.append((key, value))
    return out


def _check_precisions(precisions: list[Precision], cluster: ClusterSpec) -> None:
    """A job's accepted precision the cluster's tensor cores cannot run is bad input, named with its fix."""
    runs, cannot = [], []
    for q in Precision:
        try:
            cluster.dense_tflops(q)
            runs.append(q.value)
        except LayoutError:
            if q in precisions:
                cannot.append(q.value)
    if cannot:
        raise SpecError(f"the job's precisions list {', '.join(cannot)}, which {cluster.name} cannot run; "
                        f"list only {', '.join(runs)} in `precisions` for this cluster")


def _placement_signature(gpus: int, p: int, c: int, e: int, fe: int, fd: int, u: int) -> tuple:
    """Everything the cost model reads of a placement (k3opt.cost.comm.placement for the step, each stage's group
    members per domain for its buffers, and whether the world and a CP group fit in one domain): two sizes with
    the same signature price every layout alike."""
    stage = gpus // p
    members = tuple(comm.members_at_offset(stage, c, e, fe, fd, u, (st * stage) % u) for st in range(p))
    return (comm.placement(gpus, p, c, e, fe, fd, u), members, gpus <= u, c <= u)


def _build_domain_options(job_racks: int | None, pinned: int | None, gpus: int, p: int, c: int, e: int, fe: int,
                          fd: int, domain_gpus: int) -> tuple[int | None, ...]:
    """See domain_options (memoized on the degrees alone)."""
    if pinned is not None:
        return (pinned,)
    stage = gpus // p
    sizes = {domain_gpus} | {domain_gpus // b * b for b in (c * e, c * e * fe, c * fd, stage) if b <= domain_gpus}
    n = domains_held(gpus, None, domain_gpus)
    if gpus % n == 0:
        sizes.add(gpus // n)  # the fewest domains, evenly filled
    if job_racks is not None:
        sizes = {u for u in sizes if domains_held(gpus, u, domain_gpus) <= job_racks}
    kept: dict[tuple, int] = {}
    # Fewest domains held first, then the fuller domains: of sizes that price alike, the one that idles least.
    for u in sorted(sizes, key=lambda u: (domains_held(gpus, u, domain_gpus), -u)):
        kept.setdefault(_placement_signature(gpus, p, c, e, fe, fd, u), u)
    return tuple(None if u == domain_gpus else u for u in sorted(kept.values(), reverse=True))


_domain_options = Memo(_build_domain_options, maxsize=65536)


def domain_options(job: Job, gpus: int, p: int, c: int, e: int, fe: int, fd: int, domain_gpus: int
                   ) -> tuple[int | None, ...]:
    """GPUs per NVLink domain the search chooses among for one shape (None: whole domains): the job's pinned
    `domain_gpus_used`, else whole domains, the even fill of the fewest domains, and for each rank block of the
    shape that fits a domain (CP x EP, the expert shard group, the dense shard group, the PP stage) the largest
    multiple of the block a domain holds, so no block straddles two domains. Within `racks` when the job gives
    them. Sizes that the cost model cannot tell apart (_placement_signature) collapse to the one holding fewest
    domains."""
    return _domain_options(job.racks, job.domain_gpus_used, gpus, p, c, e, fe, fd, domain_gpus)


@dataclass(frozen=True)
class ActMode:
    recompute: Recompute
    fp8_activations: bool
    fused_situ: bool
    moe_backward_rewrite: bool
    dispatch_recompute: bool
    offload: tuple[str, ...] = ()
    """Megatron offload modules (Layout.offload_modules): what of the saved set waits in host memory."""

    def toggles(self) -> dict[str, bool]:
        return {t: getattr(self, t) for t in ACT_TOGGLES}


DEFAULT_OFFLOAD_SETS: tuple[tuple[str, ...], ...] = ()
"""The module sets a job that names none searches: none. Each set is a mode of its own beside every activation mode
under selective and no recompute, and its lower in-flight bytes weaken the bounds that infer an offload is required
(the memory view is the least over the variants): with [["moe_act"]] searched by default, K3 on 2,048 to 32,768
GB200 ended FEASIBLE at 2.2-3.0% after 60-120 s where it ends OPTIMAL (bench/results.md). A job asks for them with
[search] offload_modules; [["moe_act"]], the routed experts' activation input, is the largest tensor an MoE layer
saves (fused SiTU-GLU: 2 x top-k x FFN width BF16 a token)."""


def offload_sets(job: Job) -> list[tuple[str, ...]]:
    """The module sets the search offloads with beside none (after `resolve_offload_sets`)."""
    sets = job.search.offload_modules
    return [tuple(str(m) for m in s) for s in sets] if sets is not None else list(DEFAULT_OFFLOAD_SETS)


def resolve_offload_sets(job: Job, model: ModelSpec) -> Job:
    """The job with its offload sets written out; a set that offloads nothing in `model`
    (k3opt.cost.structure.offloads_nothing), or names expert_fc1 beside per-tensor FP8 precision, is a SpecError,
    as is a sync-free MoE on a model without one."""
    keep = []
    for mods in offload_sets(job):
        named = [OffloadModule(m) for m in mods]
        why = offloads_nothing(named, model)
        if why:
            raise SpecError(f"[search] offload_modules {list(mods)}: {why}")
        if OffloadModule.EXPERT_FC1 in named and Precision.FP8 in job.precisions:
            raise SpecError(f"[search] offload_modules {list(mods)} with precision fp8 in precisions: Megatron then "
                            "offloads fc1's BF16 input, which k3opt does not price; drop expert_fc1 or fp8")
        keep.append(named)
    why = dense_sync_free_refusal(model, job.moe_expert_rank_capacity_factor, job.moe_paged_stash)
    if why:
        raise SpecError(why)
    return job.model_copy(update={"search": job.search.model_copy(update={"offload_modules": keep})})


def choices(job: Job, name: str) -> list[bool]:
    if name in job.search.require_toggles:
        return [True]
    if name == "activation_offload" and job.moe_paged_stash:
        return [False]  # the paged stash keeps the routed experts' tensors on the GPU (specs.sync_free_refusal)
    if name == "ep_dedup" and job.moe_expert_rank_capacity_factor is not None:
        return [True]  # the sync-free MoE runs HybridEP, which sends a token once per destination rank
    if name in job.search.forbid_toggles:
        return [False]
    if name in FIXED_TOGGLES or name in NEVER_CHOSEN:
        return [False]
    return [False, True]


def act_modes(job: Job) -> list[ActMode]:
    """Every recompute mode with every setting of the activation toggles the job leaves free, and under selective
    or no recompute each with every offload set (full recompute keeps only the layer inputs, which no module
    offloads)."""
    recs = job.search.recompute or list(Recompute)
    sets = [(), *offload_sets(job)]
    return [ActMode(r, *flags, offload=o) for r in recs
            for flags in itertools.product(*(choices(job, t) for t in ACT_TOGGLES))
            for o in (sets if r != Recompute.FULL else [()])]


def lean_mode(job: Job, rc: Recompute) -> ActMode:
    """The activation mode of recompute rc that the memory tests take at or below every mode's saved bytes: every
    activation toggle the job allows, on."""
    return ActMode(rc, *(True in choices(job, t) for t in ACT_TOGGLES))


def lifecycles(job: Job) -> list[FsdpLifecycle]:
    return job.search.fsdp_lifecycle or list(FsdpLifecycle)


def frame_shape(job: Job, f: Frame, mode: ActMode, lifecycle: FsdpLifecycle, **rank_toggles: bool) -> Shape:
    """The cost model's shape of frame f under activation mode `mode`, lifecycle and rank toggles. The
    activation_offload toggle moves the whole saved set and full recompute keeps only the layer inputs, so under
    either the mode's offload modules are dropped."""
    fixed = {t: choices(job, t) == [True] for t in FIXED_TOGGLES}
    tg = Toggles(**mode.toggles(), **fixed, **rank_toggles)
    offload = () if rank_toggles.get("activation_offload") or mode.recompute == Recompute.FULL else mode.offload
    overlap = f.ep_overlap and not ep_overlap_allowed(f.ep, f.pp, f.vp, mode.recompute)
    return Shape(
        gpus=f.gpus, pp=f.pp, vp=f.vp, cp=f.cp, ep=f.ep, expert_fsdp=f.expert_fsdp, dense_fsdp=f.dense_fsdp,
        microbatches=f.microbatches, rows=job.rows, context=job.context,
        document_length=job.document_length or job.context, recompute=mode.recompute, fsdp_lifecycle=lifecycle,
        toggles=tg, domain_gpus_used=f.domain_gpus_used, dense_sharding=f.dense_sharding,
        expert_sharding=f.expert_sharding, grad_dtype=f.grad_dtype, precision=f.precision,
        param_gather=f.param_gather, offload_modules=offload, fp8_param_gather=f.fp8_param_gather,
        ep_overlap=overlap, delay_wgrad_compute=overlap and job.delay_wgrad_compute, **sync_free(job),
    )


def node_frame(f: Frame, rc: Recompute) -> Frame:
    """The frame whose layouts frame f's node under recompute rc finds: f, but its overlap-free twin where f runs
    the EP overlap and Megatron refuses it under rc (full recompute: `frame_shape` runs that node without it)."""
    if f.ep_overlap and ep_overlap_allowed(f.ep, f.pp, f.vp, rc):
        return dataclasses.replace(f, ep_overlap=False)
    return f


def sync_free(job: Job) -> dict:
    """The Shape fields of the job's sync-free MoE: its capacity factor on the HybridEP dispatcher, and its paged
    stash's buffer factors; none for a dropless job."""
    cap = job.moe_expert_rank_capacity_factor
    if cap is None:
        return {}
    stash = ((job.moe_paged_stash_buffer_size_factor_cuda, job.moe_paged_stash_buffer_size_factor_cpu)
             if job.moe_paged_stash else None)
    return {"capacity_factor": cap, "paged_stash": stash, "dispatcher": "hybridep"}


SHAPE_FIELDS_IN_LAYOUT = tuple(fl.name for fl in dataclasses.fields(Shape)
                               if fl.name in Layout.model_fields and fl.name != "document_length")
"""The Shape fields a Layout also has: layout_of copies every one of them, so no field the cost model priced is
dropped on the way back (document_length stays the job's, None meaning the context)."""


def layout_of(job: Job, f: Frame, shape: Shape, split: list[int], name: str = "") -> Layout:
    """The Layout of a priced shape: every Shape field it shares (the frame's degrees and policies, which
    frame_shape copied from `f`, the node's recompute, lifecycle and toggles, the stack settings), the split, and
    the job's context, reserve, presets and MTP layers."""
    carried = {k: getattr(shape, k) for k in SHAPE_FIELDS_IN_LAYOUT}
    if shape.paged_stash is not None:
        carried.update(moe_paged_stash=True, moe_paged_stash_buffer_size_factor_cuda=shape.paged_stash[0],
                       moe_paged_stash_buffer_size_factor_cpu=shape.paged_stash[1])
    return Layout(**carried, document_length=job.document_length, split=split, reserve_gib=job.reserve_gib,
                  model=job.model, cluster=job.cluster, runtime=job.runtime, mtp_layers=job.mtp_layers, name=name,
                  moe_expert_rank_capacity_factor=shape.capacity_factor)


def chunk_least(job: Job, f: Frame) -> tuple[int, ...]:
    """The least decoder layers each chunk of frame f holds, in chunk order: one, but none on the first and the
    last chunk when the job allows empty edge chunks (`[search] empty_edge_chunks`) and there are two or more."""
    k = f.pp * f.vp
    if not job.search.empty_edge_chunks or k < 2:
        return (1,) * k
    return (0,) + (1,) * (k - 2) + (0,)


def least_or_one(least: tuple[int, ...], chunks: int) -> tuple[int, ...]:
    """`least` as `chunk_least` gives it, or one layer in each of `chunks` chunks where it is empty (the callers
    without a job: the default of every function that takes a `least`)."""
    return least or (1,) * chunks


def rank_least(least: tuple[int, ...], p: int) -> np.ndarray:
    """The least decoder layers each of the p ranks holds: the sum of `chunk_least` over its chunks r, r + p, ..."""
    return np.array([sum(least[r::p]) for r in range(p)], dtype=int)


def sharding_group(f: Frame) -> tuple:
    """A frame's shape but for its expert and dense FSDP degrees. Within a group, FSDP degrees that are multiples
    of another frame's shard the same state over more ranks (less persistent memory per rank) and leave the
    activations as they are: when such a frame is over a memory line, so is the other."""
    return (f.gpus, f.pp, f.vp, f.cp, f.ep, f.microbatches, f.dense_sharding, f.expert_sharding, f.grad_dtype,
            f.precision, f.domain_gpus_used, f.param_gather, f.ep_overlap)


def policy_group(f: Frame) -> tuple:
    """A frame's shape but for its FSDP degrees, sharding policies and gradient dtype: several sharding groups,
    which share the schedule and the activations. One group program over all of them (the least of their
    persistent bytes and work) settles them at once where the activations bind (long contexts)."""
    return (f.gpus, f.pp, f.vp, f.cp, f.ep, f.microbatches, f.precision, f.domain_gpus_used, f.ep_overlap)


def allowed_on(job: Job) -> set[str]:
    return {t for t in RANK_TOGGLES + ACT_TOGGLES if True in choices(job, t)}


def undominated_modes(job: Job, f: Frame, modes: list[ActMode], lcs: list[FsdpLifecycle], model: ModelSpec,
                      cluster: ClusterSpec) -> list[ActMode]:
    """Drop activation modes another mode beats or ties on every per-layer time and memory coefficient
    (for example fused SiTU, which saves memory at no priced time): they cannot be strictly better. A tie goes to
    the mode listed first. Kept per node: the bounds and the node's model ask for the same list."""
    key = (job.model_dump_json(), f, tuple(modes), tuple(lcs), id(model), id(cluster))
    hit = _UNDOMINATED.get(key)
    if hit is not None and hit[1] is model and hit[2] is cluster:
        return list(hit[0])

    def vec(md: ActMode) -> np.ndarray:
        parts = []
        for lc in lcs:
            cf = coefficients(frame_shape(job, f, md, lc), model, cluster)
            off = coefficients(frame_shape(job, f, md, lc, activation_offload=True), model, cluster)
            parts += [cf.time[r] for r in cf.time] + [cf.act, cf.working_set, off.time["host_link"]]
        return np.concatenate(parts)

    vecs = np.array([vec(md) for md in modes])
    # [i, j]: mode j is at or below mode i everywhere, and below somewhere or listed first.
    le = np.all(vecs[None, :, :] <= vecs[:, None, :], axis=2)
    lt = np.any(vecs[None, :, :] < vecs[:, None, :], axis=2)
    first = np.arange(len(modes))[None, :] < np.arange(len(modes))[:, None]
    beats = le & (lt | first)
    np.fill_diagonal(beats, False)
    keep = [md for md, beaten in zip(modes, beats.any(axis=1), strict=True) if not beaten]
    if len(_UNDOMINATED) > 4096:
        _UNDOMINATED.clear()
    _UNDOMINATED[key] = (tuple(keep), model, cluster)
    return keep


_UNDOMINATED: dict[tuple, tuple[tuple[ActMode, ...], ModelSpec, ClusterSpec]] = register({})
"""undominated_modes by (job, frame, modes, lifecycles, model, cluster); the value keeps the specs alive so an
identity is never reused while its entry exists."""


def bound_persistent_bytes(cf: Coefficients, grads: np.ndarray | None) -> np.ndarray:
    """Per-layer persistent bytes as the bounds count them: the ledger's always-held terms (master, optimizer
    state, BF16 view, quantized weight copies: `ledger.ALWAYS_HELD`, which no toggle or activation mode changes) +
    the gradient accumulator + `grads` (the gradients as the caller holds them; None: left out)."""
    out = layer_bytes(cf, (*ALWAYS_HELD, "grad_accum"))
    return out if grads is None else out + grads


def zero2_grads(cf: Coefficients, v: int) -> np.ndarray:
    """Per layer, at least what pipeline ZeRO-2 host gradients keep on the GPU: a rank holds two FP32 buffers of
    its largest chunk (ledger `grads`, CHUNK_PAIR), and of v chunks the largest holds at least their mean, so at
    least 2 / v of its layers' chunk buffers."""
    return 2 * cf.chunk_grad_buffer / v


def least_grads(cf: Coefficients, allowed: set[str], v: int) -> np.ndarray:
    """Per-layer gradient bytes at or below every setting of pipeline ZeRO-2 host gradients the job allows: the
    FP32 shard, or where ZeRO-2 is allowed the lesser of it and `zero2_grads` (a rank takes one setting, and the
    sum of per-layer minima is at most the lesser of the two sums)."""
    if "pipeline_zero2_host_grads" not in allowed:
        return cf.grads
    return np.minimum(cf.grads, zero2_grads(cf, v))


def least_step_gather(cf: Coefficients, allowed: set[str]) -> np.ndarray:
    """Per-layer optimizer-step gather at or below every setting of P2P Muon the job allows: the lesser of
    `step_gather_bytes` without it and with it (where allowed)."""
    gather = step_gather_bytes(cf, False)
    return np.minimum(gather, step_gather_bytes(cf, True)) if "p2p_muon" in allowed else gather


def memory_view(job: Job, f: Frame, md: ActMode, lc: FsdpLifecycle, model: ModelSpec, cluster: ClusterSpec,
                 balance: bool | None = None, merge_offload: bool = True) -> Coefficients:
    """Coefficients for the memory side of a bound: the chunked cross-entropy on when allowed (smaller logits),
    and balancing on when allowed (so the balanced in-flight count is known; it changes no other array). Under
    selective or no recompute with offload sets searched, the in-flight bytes and the backward transient are the
    least over `md` and its offload variants; `merge_offload` False: `md`'s own (the layouts that offload
    nothing by module)."""
    allowed = allowed_on(job)
    bal = ("balance_activations" in allowed) if balance is None else balance

    def view(mode: ActMode) -> Coefficients:
        return coefficients(frame_shape(job, f, mode, lc, fused_cross_entropy="fused_cross_entropy" in allowed,
                                        balance_activations=bal), model, cluster)

    base = view(md)
    if not merge_offload or md.offload or md.recompute == Recompute.FULL or not offload_sets(job):
        return base
    # An offload set lowers the in-flight bytes and raises the backward transient: the view takes the least of
    # each over the mode and its offload variants, at or below every one of them.
    views = [base] + [view(dataclasses.replace(md, offload=o)) for o in offload_sets(job)]
    return dataclasses.replace(base, **{k: np.min([getattr(v, k) for v in views], axis=0)
                                        for k in ("act", "working_set", "recompute_ws")})


def allocated_capacity_bytes(job: Job, frame: Frame, model: ModelSpec, cluster: ClusterSpec) -> int:
    """The ledger peak (live tensors) a rank may reach. Without a runtime: HBM minus the job's reserve. With one
    (`job.runtime`): the budget that keeps every rank's device peak (+ workspaces, allocator slack and the memory
    outside the allocator, k3opt.cost.memory_outside) under HBM minus the reserve, as evaluate() checks it. Every
    capacity test of the search goes through this function."""
    if job.runtime is None:
        return budget_line(job, cluster)
    # Keyed by object identity (specs hold lists, so they are not hashable); the value keeps the objects alive so
    # an identity is never reused while its entry exists.
    # The runtime items (memory_outside.runtime_items) read the degrees, the tokens and the placement only: any
    # activation mode, microbatch count, sharding policy, gradient dtype and precision gives the same budget, so
    # the frames that differ only there share one (tests/search/test_search.py checks it over a job's frames).
    degrees = Frame(frame.pp, frame.vp, frame.cp, frame.ep, frame.expert_fsdp, frame.dense_fsdp, 1, frame.gpus,
                    domain_gpus_used=frame.domain_gpus_used)
    key = (job.model_dump_json(), degrees, id(model), id(cluster))
    hit = _BUDGETS.get(key)
    if hit is None:
        shape = frame_shape(job, degrees, ActMode(Recompute.FULL, False, False, False, False),
                            FsdpLifecycle.PER_MICROBATCH)
        budget = allocated_budget_bytes(shape, model, cluster, job.reserve_gib, _runtime(job.runtime))
        if len(_BUDGETS) > 65536:
            _BUDGETS.clear()
        hit = _BUDGETS[key] = (min(budget, budget_line(job, cluster)), model, cluster)
    return hit[0]


def peak_cap_bytes(job: Job) -> int | None:
    """The job's cap on every rank's ledger peak (`[search] max_peak_gib`) in bytes; None without one."""
    cap = job.search.max_peak_gib
    return None if cap is None else int(round(cap * GIB))


def fits(job: Job, ev: Evaluation) -> bool:
    """evaluate()'s fit (the device line or the live tensors under HBM minus the reserve) and the job's peak cap
    (`peak_cap_bytes`) on the worst rank's ledger peak: what a layout the search returns must meet."""
    cap = peak_cap_bytes(job)
    return ev.fits and (cap is None or ev.peak_bytes <= cap)


def budget_line(job: Job, cluster: ClusterSpec) -> int:
    """What no rank's allocated budget exceeds: HBM minus the job's reserve, or the job's peak cap
    (`peak_cap_bytes`) when it is lower."""
    line = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
    cap = peak_cap_bytes(job)
    return line if cap is None else min(line, cap)


_BUDGETS: dict[tuple, tuple[int, ModelSpec, ClusterSpec]] = register({})


def _build_runtime(name: str) -> RuntimeSpec:
    return load_runtime(name)


_runtime = Memo(_build_runtime, maxsize=16)
