"""Lower bounds on a frame's or a node's step time and worst-rank peak, over every split and toggle.

The search prunes with these; each must stay below every layout it stands for (tests/search/test_search.py)."""

from __future__ import annotations

import functools
import itertools
import math
import time as _time
from dataclasses import dataclass, field, replace

import numpy as np

from k3opt.cost.coefficients import (
    Coefficients,
    balance_moved_bytes,
    cost_model,
    policy_step_gather,
    step_gather_bytes,
    step_grad_copy_bytes,
)
from k3opt.cost.ledger import least_transient, peak_inflight, pp_packet_bytes
from k3opt.cost.schedule import schedule_slots
from k3opt.inputs.memo import Memo, register
from k3opt.inputs.specs import ClusterSpec, FsdpLifecycle, Job, ModelSpec, Recompute
from k3opt.search.frames import (
    ACT_TOGGLES,
    ActMode,
    Frame,
    act_modes,
    allocated_capacity_bytes,
    allowed_on,
    bound_persistent_bytes,
    choices,
    chunk_least,
    frame_shape,
    lean_mode,
    least_grads,
    least_or_one,
    least_step_gather,
    lifecycles,
    memory_view,
    offload_sets,
    rank_least,
    undominated_modes,
    zero2_grads,
)
from k3opt.search.lp_bound import (
    STOP_ROUNDING,
    granular_stage,
    interleaved_lp_bound,
    lean_fits,
    least_floor,
    loosest_capacity,
    needs_offload,
    no_offload_bound,
    node_terms,
    required_toggle_bound,
    schedule_terms,
)
from k3opt.search.policy import POLICY
from k3opt.search.ranking import coarse_work_floor, step_floor, update_means, work_floor
from k3opt.search.ranking import ranked_coefficients as coefficients  # the ranked view (search/ranking.py)

# ------------------------------------------------------------------------------------- bounds


def frame_lower_bound(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """(step-time bound s, worst-rank peak bound bytes) over every mode and split of frame f.

    Time: the slowest rank carries at least the mean tensor-core work, and recompute 'none' without the
    chunked cross-entropy is the least work but for the memory-bound kernels, which the activation toggles lower
    (`coarse_work_floor`: those at their least over every mode; a frame the search reaches is tightened with
    `frame_dp_bound`); the update is at least the mean Newton-Schulz time, and its data-parallel exchange at least
    its mean under the per-microbatch lifecycle (the accumulate lifecycle adds the FP32 buffer's reduce-scatter),
    of which one window of stage-microbatches hides (`ranking.step_floor`).
    Peak: the worst rank holds at least the mean of master + optimizer + BF16 view (`bound_persistent_bytes`: no
    accumulator under the per-microbatch lifecycle), which no toggle removes, plus the gradients at their least
    over the ZeRO-2 settings allowed (`least_grads`: the shard, or 2 / v of the chunk buffers)."""
    base = ActMode(Recompute.NONE, False, False, False, False)
    free = tuple(t for t in ACT_TOGGLES if True in choices(job, t))
    cf = coarse_work_floor(frame_shape(job, f, base, FsdpLifecycle.PER_MICROBATCH), model, cluster, free=free)
    p = f.pp
    stage = float(cf.time["tensor"].sum()) / p
    update = float(cf.update["tensor"].sum()) / p
    _, hidden = update_means({}, cf.update_hidden, p)
    t_lb = step_floor(schedule_slots(f.pp, f.vp, f.microbatches), stage, update, hidden, cf.update_hidden_stages)
    persistent = float(bound_persistent_bytes(cf, least_grads(cf, allowed_on(job), f.vp)).sum())
    return t_lb, persistent / p


def _floor(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec, cluster: ClusterSpec,
           recs: tuple[Recompute, ...] | None = None, lcs: tuple[FsdpLifecycle, ...] | None = None,
           fixed: dict[str, bool] | None = None, coarse: bool = False) -> Coefficients:
    """`work_floor` of frame f under recompute rc and lifecycle lc (or the least over `recs` x `lcs`): the
    activation toggles the job leaves free range over both settings, the ones it requires stay on, those in
    `fixed` take its value. `coarse`: `coarse_work_floor` instead (one build, looser: only the memory-bound kernels
    at their least over the toggles, the rest as with the free toggles off, which only add to it), except for an EP
    overlap schedule, whose exposed exchange is not monotone in the toggles."""
    fixed = fixed or {}
    free = tuple(t for t in ACT_TOGGLES if choices(job, t) == [False, True] and t not in fixed)
    required = ActMode(rc, *(fixed.get(t, t in job.search.require_toggles) for t in ACT_TOGGLES))
    shape = frame_shape(job, f, required, lc)
    if coarse and recs is None and lcs is None and not shape.ep_overlap:
        return coarse_work_floor(shape, model, cluster, free=free)
    return work_floor(shape, model, cluster, free=free, recomputes=recs, lifecycles=lcs)


def _member_terms(cfs: list[Coefficients], p: int) -> list[tuple[float, float, float]]:
    """Each member's `lp_bound.node_terms` from its floor `cfs` (one per member frame), without repeats."""
    return list(dict.fromkeys(node_terms(c, p) for c in cfs))


def frame_estimate(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec) -> float:
    """A rough step time of frame f (not a bound): slots x the mean per-rank work of its busiest resource plus
    the mean update, under recompute 'none', no toggles. Orders the frames the incumbent heuristics visit. (The
    update's exposed exchange is left out: it grows with the FSDP degrees, and with it the order puts the least
    sharded shapes first, whose memory then forces heavy recompute: at 8,192 GPUs the heuristic pass then finds
    25.6 s where it finds 19.2 s without.)"""
    base = ActMode(Recompute.NONE, False, False, False, False)
    cf = coefficients(frame_shape(job, f, base, FsdpLifecycle.PER_MICROBATCH), model, cluster)
    stage = max(float(cf.time[res].sum()) for res in cf.time) / f.pp
    update = update_means(cf.update, {}, f.pp)[0]
    return schedule_slots(f.pp, f.vp, f.microbatches) * stage + update


def node_key(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec, cluster: ClusterSpec
             ) -> tuple:
    """What a node's kept bounds, hints and paths are keyed by: the job, the specs it was priced with (one job
    may be planned against other model or cluster objects than the files it names), the frame and the node."""
    return (job.model_dump_json(), cost_model(model, cluster), f, rc, lc)


DP_HINTS: dict[tuple, tuple[float, list[int] | None]] = register({})
"""(stage-work bound, its split) of each node's dynamic program, reused as a cut and a hint by its CP-SAT model."""
LP_BOUNDS: dict[tuple, float] = register({})
"""Step-time bound (s) of each interleaved node's linear relaxation, a cut on its CP-SAT model's objective."""


def _keep(store: dict, key: tuple, value: object, most: int | None = None) -> None:
    """store[key] = value, the store emptied first when it holds `most` entries (POLICY.kept_nodes)."""
    if len(store) >= (POLICY.kept_nodes if most is None else most):
        store.clear()
    store[key] = value


def node_lower_bound(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                     cluster: ClusterSpec) -> tuple[float, float]:
    """(step-time bound, worst-rank peak bound) of one frame, recompute mode and lifecycle, over every split and
    toggle. Work uses the cheapest activation mode (the toggles only add work), memory the leanest one.

    v = 1: a dynamic program over contiguous stage ranges gives the exact min-max of a relaxed stage cost (each
    rank's work on every resource; the stage must fit persistent + in-flight saved bytes, or the optimizer phase,
    under the HBM line, with offload allowed when the host holds the rest). v > 1: the mean over ranks."""
    allowed = allowed_on(job)
    cf = _floor(job, f, rc, lc, model, cluster)
    lean = lean_mode(job, rc)
    lcf = memory_view(job, f, lean, lc, model, cluster)
    p = f.pp
    update, hidden = update_means(cf.update, cf.update_hidden, p)
    hs = cf.update_hidden_stages
    peak = _peak_lower_bound(job, f, lcf, cluster, allowed)
    cap = allocated_capacity_bytes(job, f, model, cluster)
    if f.vp == 1 and job.search.split is None:
        ocf = coefficients(frame_shape(job, f, lean, lc, activation_offload=True), model, cluster) \
            if "activation_offload" in allowed else None
        stage, dp_peak, split = _dp_bounds(cf, lcf, ocf, cluster, cap, allowed, least=chunk_least(job, f))
        _keep(DP_HINTS, node_key(job, f, rc, lc, model, cluster), (stage, split))
        return step_floor(cf.slots, stage, update, hidden, hs), max(peak, dp_peak)
    stage = max(float(cf.time[res].sum()) for res in cf.time) / p
    if "activation_offload" in allowed:
        # If no split fits without offload, every rank moves its saved bytes over the host link, at least the
        # leanest activation mode's traffic (offload moves the saved set, least under the leanest mode), per
        # setting of the dispatch recompute (`_offload_stage`). The memory tests (the second a linear program) only
        # matter when that traffic exceeds the mean load.
        offs = _offload_traffic(job, [f], lean, [lc], model, cluster)
        means = [float(arrs[0].sum()) / p for arrs in offs.values()]

        def nothing_fits(view: Coefficients) -> bool:
            return (_peak_lower_bound(job, f, view, cluster, allowed - {"activation_offload"}) > cap
                    or (f.vp > 1 and needs_offload(job, f, view, cap)))

        if max(means) > stage and nothing_fits(lcf):
            stage = max(stage, _offload_stage(job, [f], rc, [lc], model, cluster, offs, math.inf))
        elif max(means) > stage and offload_sets(job) and rc != Recompute.FULL and nothing_fits(
                memory_view(job, f, lean, lc, model, cluster, merge_offload=False)):
            # Every layout offloads, the whole saved set or by module: the lesser of the two traffics' floors.
            mods = _module_traffic(job, [f], lean, [lc], model, cluster)
            stage = max(stage, min(_offload_stage(job, [f], rc, [lc], model, cluster, offs, math.inf),
                                   _offload_stage(job, [f], rc, [lc], model, cluster, mods, math.inf)))
    return step_floor(cf.slots, stage, update, hidden, hs), peak


def frame_dp_bound(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec,
                   stop_at: float = math.inf) -> tuple[float, float]:
    """One bound for every node of a v = 1 frame: the stage dynamic program with, per layer, the least work of any
    recompute mode, lifecycle and free activation toggle (`work_floor`) and the least saved and working-set bytes
    of any (all toggles allowed). v > 1: `_frame_interleaved_bound` (its peak bound is 0), which with `stop_at`
    (the search's pruning line) stops raising a mode's bound once it reaches the line."""
    if job.search.split is not None:
        return 0.0, 0.0
    if f.vp != 1:
        return _frame_interleaved_bound(job, f, model, cluster, stop_at), 0.0
    allowed = allowed_on(job)
    recs = job.search.recompute or list(Recompute)
    lcs = lifecycles(job)
    cf = _floor(job, f, recs[0], lcs[0], model, cluster, recs=tuple(recs), lcs=tuple(lcs))
    lean = [memory_view(job, f, lean_mode(job, rc), lc, model, cluster)
            for rc in recs for lc in lcs]
    mins = {k: np.min([getattr(c, k) for c in lean], axis=0) for k in ("act", "working_set", "grad_accum", "grads")}
    lcf = replace(lean[0], **mins)
    off = None
    if "activation_offload" in allowed:
        offs = [coefficients(frame_shape(job, f, lean_mode(job, rc), lc,
                                         activation_offload=True), model, cluster) for rc in recs for lc in lcs]
        off = replace(offs[0], time={**offs[0].time,
                                     "host_link": np.min([o.time["host_link"] for o in offs], axis=0)})
    cap = allocated_capacity_bytes(job, f, model, cluster)
    stage, peak, _ = _dp_bounds(cf, lcf, off, cluster, cap, allowed, least=chunk_least(job, f))
    return step_floor(cf.slots, stage, *update_means(cf.update, cf.update_hidden, f.pp),
                      cf.update_hidden_stages), peak


def group_frame_bound(job: Job, members: tuple[Frame, ...], model: ModelSpec, cluster: ClusterSpec,
                      stop_at: float = math.inf, deadline: float = math.inf,
                      per_node: dict[tuple[Recompute, FsdpLifecycle], float] | None = None) -> float:
    """One step-time bound for every node of every interleaved frame in `members` (frames of one
    `frames.sharding_group`): `_frame_interleaved_bound` over the least of their floors and bytes and the largest
    of their budgets, so at most each member's own `frame_dp_bound`. 0.0 (no bound) when the members' schedules
    differ (slots, in-flight counts) or past the monotonic `deadline`. `per_node` (a dict to fill): each node's
    own bound (what `lift_group_bound` starts from)."""
    if job.search.split is not None or members[0].vp == 1:
        return 0.0
    nodes: dict[tuple[Recompute, FsdpLifecycle], float] = {}
    value = _frame_interleaved_bound(job, members[0], model, cluster, stop_at, members=members, deadline=deadline,
                                     per_node=nodes)
    if per_node is not None and value != 0.0:  # 0.0: stopped part-way, its nodes' bounds incomplete
        per_node.update(nodes)
    return value


def lift_group_bound(job: Job, members: tuple[Frame, ...], per_node: dict[tuple[Recompute, FsdpLifecycle], float],
                     model: ModelSpec, cluster: ClusterSpec, stop_at: float, deadline: float = math.inf
                     ) -> tuple[float, dict[tuple[Recompute, FsdpLifecycle], float]]:
    """`group_frame_bound` raised by the group programs of its nodes (`group_node_bound`): the nodes of `per_node`
    (its per-node bounds) still under the line `stop_at`, the least first, until one stays under it (the frame
    bound cannot then rise above that node's). Returns (the least node bound after, the node programs' values by
    (recompute, lifecycle), for the caller to reuse). At 8,192 GPUs the 18.3-s frame bounds of PP16 VP4 EP32 and
    PP4 VP4 EP64 are held by the members with the least exchange and the most bytes, which only the memory rows of
    the node programs lift (to 18.46-18.53 s); lifting the group at once spares each of its 50-72 members its own
    frame and node bounds."""
    nodes = dict(per_node)
    lifted: dict[tuple[Recompute, FsdpLifecycle], float] = {}
    if not nodes or not math.isfinite(stop_at):
        return (min(nodes.values()) if nodes else 0.0), lifted
    for node in sorted(nodes, key=nodes.__getitem__):
        if nodes[node] >= stop_at * (1 - STOP_ROUNDING):
            break
        # The node's own frame-level bound as far as the line first: `per_node` keeps what stopped each node at
        # the least over the nodes so far, which for a no-recompute node is often that least (18.34 s at PP16
        # VP4 EP32, 8,192 GPUs) where its own floor is at 21.9 s.
        own = _frame_interleaved_bound(job, members[0], model, cluster, stop_at, members=members, deadline=deadline,
                                       only=(node,))
        nodes[node] = max(nodes[node], own)
        if nodes[node] >= stop_at * (1 - STOP_ROUNDING):
            continue
        lifted[node] = group_node_bound(job, members, *node, model, cluster, stop_at=stop_at, deadline=deadline)
        nodes[node] = max(nodes[node], lifted[node])
        if nodes[node] < stop_at * (1 - STOP_ROUNDING):
            break
    return min(nodes.values()), lifted


def _frame_interleaved_bound(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec,
                             stop_at: float = math.inf, members: tuple[Frame, ...] | None = None,
                             deadline: float = math.inf,
                             per_node: dict[tuple[Recompute, FsdpLifecycle], float] | None = None,
                             only: tuple[tuple[Recompute, FsdpLifecycle], ...] | None = None) -> float:
    """One step-time bound for every node of an interleaved frame: per (recompute mode, lifecycle) node, each with
    its own work and bytes (a layout has one of each), the mean load (`node_lower_bound`'s) with whole layers per
    rank; nothing where the node's leanest bytes fit under no setting (`lp_bound.lean_fits`); where the offload's
    traffic exceeds that load, the lesser of the offload's floor (the layouts that offload) and
    `lp_bound.no_offload_bound` (those that do not: every rank's memory rows under the leanest mode's bytes; inf
    where none fits); the least over the nodes (inf when none can fit). Nodes that cannot undercut the best one so
    far skip the memory tests. `members`: the least over these frames too (`group_frame_bound`). At 8,192 GPUs the
    least work of either lifecycle beside the least bytes of either holds PP16 VP4 EP64 eFSDP8 dFSDP128 at 18.07 s,
    where each node on its own gives 18.57 s.

    The offload's floor: whole layers with its traffic on the host link, per setting of the dispatch
    recompute (`_offload_stage`): that toggle trades the other way from the rest (it saves the dispatched tokens
    and replays the all-to-all), so the least work (off) and the least offload traffic (on) are two modes, and one
    floor over both would put the one's work beside the other's traffic.

    `per_node` (a dict to fill): each node's own bound, keyed by (recompute, lifecycle); the value is their least.
    `only`: these nodes alone (their least)."""
    group = list(members) if members else [f]
    per_node = {} if per_node is None else per_node
    recs = sorted(job.search.recompute or list(Recompute),
                  key=lambda rc: {Recompute.FULL: 0, Recompute.SELECTIVE: 1, Recompute.NONE: 2}[rc])
    cap = max(allocated_capacity_bytes(job, g, model, cluster) for g in group)
    best = math.inf
    for rc, lc in itertools.product(recs, lifecycles(job)):
        if only is not None and (rc, lc) not in only:
            continue
        value = _group_node_bound(_GroupNode(job, f, group, rc, lc, model, cluster, cap), best, stop_at, deadline)
        if value is None:
            return 0.0
        best = min(best, value)
        per_node[(rc, lc)] = value
    return best


@dataclass
class _GroupNode:
    """One (recompute, lifecycle) node of `_frame_interleaved_bound` over the frames of `group` (f among them;
    `cap` their largest budget), and the members' work floors once built."""

    job: Job
    f: Frame
    group: list[Frame]
    rc: Recompute
    lc: FsdpLifecycle
    model: ModelSpec
    cluster: ClusterSpec
    cap: int
    cheap: list[Coefficients] = field(default_factory=list)
    """Each member's work floor (`_floor`)."""
    nodes: list[tuple[float, float, float]] = field(default_factory=list)
    """Each member's own (mean stage, update, exchange), without repeats."""
    slots: float = 0.0
    hidden_stages: float = 0.0

    def floor(self, stage: float) -> float:
        """`least_floor` of a stage bound over the members' own terms."""
        return least_floor(self.nodes, self.slots, self.hidden_stages, stage)


def _group_node_bound(node: _GroupNode, best: float, stop_at: float, deadline: float) -> float | None:
    """The node's bound in `_frame_interleaved_bound`, given the least so far `best` over the nodes before it:
    its members' coarse floors, their work floors with whole layers per rank, inf where its leanest bytes fit
    under no setting, and the offload's floor or `no_offload_bound` (`_offload_node_bound`). None (no bound) when
    the members' schedules differ or the monotonic `deadline` passed."""
    job, f, group, rc, lc, model, cluster = node.job, node.f, node.group, node.rc, node.lc, node.model, node.cluster
    # A node whose coarse floors (one build per member) already reach the least so far or the line needs no
    # more: at 8,192 GPUs that settles most full-recompute and no-recompute nodes, where most of a group
    # program's time goes to the members' work floors.
    coarse = [_floor(job, g, rc, lc, model, cluster, coarse=True) for g in group]
    rough = least_floor(_member_terms(coarse, f.pp), coarse[0].slots, max(c.update_hidden_stages for c in coarse))
    if rough >= min(best, stop_at):
        return rough
    # The work floor, not the ranked view: the activation toggles can lower the elementwise kernels' time.
    node.cheap = cheap = [_floor(job, g, rc, lc, model, cluster) for g in group]
    if len({(c.slots, c.compositions) for c in cheap}) > 1 or _time.monotonic() > deadline:
        return None
    # Each member's own (mean stage, update, exchange) with the group's stage bound.
    node.nodes = _member_terms(cheap, f.pp)
    stage = min(s for s, _, _ in node.nodes)
    update = min(u for _, u, _ in node.nodes)
    node.hidden_stages = max(c.update_hidden_stages for c in cheap)
    node.slots = cheap[0].slots
    if node.floor(stage) >= best:
        return node.floor(stage)
    views = [memory_view(job, g, lean_mode(job, rc), lc, model, cluster) for g in group]
    if len({schedule_terms(vw) for vw in views}) > 1:
        return None  # the memory tests read the first view's schedule terms
    merged = _least_bytes(views)
    # Whole layers per rank (lp_bound.granular_stage) over the least of the lifecycles' floors, each rank holding
    # no more than the leanest bytes of any setting let it (lp_bound.loosest_capacity), only as far as the least
    # so far or the line (either is all the search needs to know).
    line = min(best, stop_at)
    stop = (line - update) / node.slots if math.isfinite(line) else math.inf
    mean_stage = stage
    most = loosest_capacity(job, f, merged, node.cap, cluster.host_memory_bytes)
    if min(most) < 0:
        return math.inf  # some rank cannot hold its least layers under any setting: no layout of the node fits
    stage = max(stage, granular_stage({res: np.min([c.time[res] for c in cheap], axis=0) for res in cheap[0].time},
                                      cheap[0].n_layers, f.pp, f.vp, stop=stop, least=chunk_least(job, f),
                                      most=most))
    if node.floor(stage) >= best:
        return node.floor(stage)
    if node.floor(stage) < stop_at and not lean_fits(job, f, merged, node.cap, cluster.host_memory_bytes):
        # No layout of the node fits under any setting (the leanest bytes of every member, the largest
        # budget): it bounds nothing. At 8,192 GPUs the accumulate lifecycle's unsharded FP32 buffer leaves
        # PP4 VP4 EP32's selective nodes without a layout, whose least work would hold the shape at 18.21 s.
        return math.inf
    if "activation_offload" in allowed_on(job) and rc != Recompute.FULL:
        # (Full recompute saves the fewest bytes; its offload test is left to the nodes, which keeps this
        # bound valid and saves a linear program per shape.)
        return _offload_node_bound(node, views, merged, stage, mean_stage, stop)
    return node.floor(stage)


def _least_bytes(views: list[Coefficients]) -> Coefficients:
    """The first view with every byte array and figure the memory tests read at its least over `views`."""
    # The step's bytes too: members of a policy group differ in sharding policy and gradient dtype, hence in their
    # step gather and their FP32 gradient copies (what coefficients.step_gather_bytes reads).
    return replace(views[0], **{k: np.min([getattr(vw, k) for vw in views], axis=0) for k in (
        "master", "optimizer", "bf16_view", "grad_accum", "grads", "chunk_grad_buffer", "act",
        "working_set", "view_params", "step_grad_copy")},
        step_gather=np.min([policy_step_gather(vw) for vw in views], axis=0),
        p2p_step_gather=np.min([step_gather_bytes(vw, True) - step_grad_copy_bytes(vw) for vw in views], axis=0),
        logits=min(vw.logits for vw in views),
        ep_buffers=min(vw.ep_buffers for vw in views), routing_map=min(vw.routing_map for vw in views),
        moonep_buffers=min(vw.moonep_buffers for vw in views))


def _offload_node_bound(node: _GroupNode, views: list[Coefficients], merged: Coefficients, stage: float,
                        mean_stage: float, stop: float) -> float:
    """The node's bound from a stage bound `stage` when offload is allowed: where the offload's traffic exceeds the
    mean load `mean_stage` (at 4K context it rarely does; the programs are solved only then), the offload's floor
    if no split fits without it (`needs_offload` over the least bytes `merged`), else the lesser of the offload's
    floor and `no_offload_bound`; otherwise the work's floor."""
    job, f, group, rc, model, cluster = node.job, node.f, node.group, node.rc, node.model, node.cluster
    lcs = [node.lc]
    offs = _offload_traffic(job, group, lean_mode(job, rc), lcs, model, cluster)
    means = {dr: min(float(o.sum()) for o in arrs) / f.pp for dr, arrs in offs.items()}
    if max(means.values()) > mean_stage:
        if needs_offload(job, f, merged, node.cap):
            # (`merged` is at or below every offload set's bytes: nothing fits by module either.)
            stage = max(stage, _offload_stage(job, group, rc, lcs, model, cluster, offs, stop))
        else:
            # A layout without offload holds its saved bytes, which the memory rows of `no_offload_bound`
            # spread over the ranks (its own bytes: the views without the offload sets' variants); one with the
            # offload toggle pays the whole set's traffic, one that offloads by module its modules'.
            plain = views if not offload_sets(job) else [
                memory_view(job, g, lean_mode(job, rc), node.lc, model, cluster, merge_offload=False) for g in group]
            without = max(node.floor(stage), no_offload_bound(job, f, node.cheap, plain, node.cap, cluster))
            if without > node.floor(stage):
                offload = node.floor(max(stage, _offload_stage(job, group, rc, lcs, model, cluster, offs, stop)))
                return min(offload, without, _module_floor(node, stage, stop))
    return node.floor(stage)


def _module_floor(node: _GroupNode, stage: float, stop: float) -> float:
    """The floor of the node's layouts that offload by module (inf when the job searches no offload set): the
    least traffic of any set on the host link beside the work floor, with whole layers per rank."""
    job, group, rc, model, cluster = node.job, node.group, node.rc, node.model, node.cluster
    if not offload_sets(job):
        return math.inf
    mods = _module_traffic(job, group, lean_mode(job, rc), [node.lc], model, cluster)
    return node.floor(max(stage, _offload_stage(job, group, rc, [node.lc], model, cluster, mods, stop)))


def _module_traffic(job: Job, group: list[Frame], lean: ActMode, lcs: list[FsdpLifecycle], model: ModelSpec,
                    cluster: ClusterSpec) -> dict[bool, list[np.ndarray]]:
    """As `_offload_traffic`, for the layouts that offload by module: per allowed setting of the dispatch
    recompute, the per-layer host-link time of `lean` with each offload set the job searches, for every member of
    `group` and lifecycle of `lcs` (the leanest mode moves the fewest of the modules' bytes)."""
    return {dr: [coefficients(frame_shape(job, g, replace(lean, dispatch_recompute=dr, offload=o), lc), model,
                              cluster).time["host_link"] for g in group for lc in lcs for o in offload_sets(job)]
            for dr in choices(job, "dispatch_recompute")}


def _offload_traffic(job: Job, group: list[Frame], lean: ActMode, lcs: list[FsdpLifecycle], model: ModelSpec,
                     cluster: ClusterSpec) -> dict[bool, list[np.ndarray]]:
    """Per allowed setting of the dispatch recompute, the per-layer host-link time under offload of its leanest
    mode (`lean` with that setting: the other activation toggles on, which only shrink the saved set), for every
    member of `group` and lifecycle of `lcs`."""
    return {dr: [coefficients(frame_shape(job, g, replace(lean, dispatch_recompute=dr), lc, activation_offload=True),
                              model, cluster).time["host_link"] for g in group for lc in lcs]
            for dr in choices(job, "dispatch_recompute")}


def _offload_stage(job: Job, group: list[Frame], rc: Recompute, lcs: list[FsdpLifecycle], model: ModelSpec,
                   cluster: ClusterSpec, offs: dict[bool, list[np.ndarray]], stop: float) -> float:
    """A stage bound of every layout of the frames in `group` under recompute rc when every rank offloads: per
    setting of the dispatch recompute, whole layers per rank (granular_stage) over the work floor of that setting
    with the host link at least `offs[setting]`, the offload's traffic under its leanest mode (per member and
    lifecycle); the least over the settings, and at least the least traffic's mean per rank. PP8 VP4 EP64 at 8,192
    GPUs: 0.278 s, where one floor over both settings gives 0.270 s. `offs`: the whole set's (`_offload_traffic`)
    or the offload modules' (`_module_traffic`)."""
    f = group[0]
    host = min(min(float(a.sum()) for a in arrs) for arrs in offs.values()) / f.pp
    out = math.inf
    for dr, arrs in offs.items():
        cheap = [_floor(job, g, rc, lc, model, cluster, fixed={"dispatch_recompute": dr}) for g in group for lc in lcs]
        time = {res: np.min([c.time[res] for c in cheap], axis=0) for res in cheap[0].time}
        time["host_link"] = np.maximum(time["host_link"], np.min(arrs, axis=0))
        out = min(out, granular_stage(time, cheap[0].n_layers, f.pp, f.vp, stop=stop, least=chunk_least(job, f)))
    return max(host, out)


def tight_node_bound(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                     cluster: ClusterSpec, stop_at: float = math.inf, deadline: float = math.inf) -> float:
    """The node's step-time bound, computed when a node is about to be solved. v = 1: the dynamic program run per
    undominated activation mode (its own work and memory), the least over modes; a mode whose mean-load floor
    (`_mean_stage`) is already at or above the least so far is not run. v > 1: the linear relaxation of
    `lp_bound.interleaved_lp_bound` (fractional layers per chunk under every rank's time and memory rows, with the
    replay paths its solutions violate added; raised by the toggles no contiguous whole-layer split fits without,
    `lp_bound.required_toggle_bound`), kept for the node's CP-SAT model as a cut on its objective; with
    `stop_at` (the search's pruning line) it stops once the node is proven at or above that line (the bound is then
    at least min(exact, stop_at)); past the monotonic `deadline` its programs stop and bound less."""
    if job.search.split is not None:
        return 0.0
    if f.vp != 1:
        setting: dict[str, bool] = {}
        lp = interleaved_lp_bound(job, f, rc, lc, model, cluster, stop_at=stop_at, separate=True, deadline=deadline,
                                  setting_out=setting)
        lp = required_toggle_bound(job, f, rc, lc, model, cluster, lp, setting, stop_at, deadline)
        _keep(LP_BOUNDS, node_key(job, f, rc, lc, model, cluster), lp)
        return lp
    allowed = allowed_on(job)
    cap = allocated_capacity_bytes(job, f, model, cluster)
    modes = undominated_modes(job, f, [md for md in act_modes(job) if md.recompute == rc], [lc], model, cluster)
    offloads = [False, True] if "activation_offload" in allowed else [False]
    balances = [False, True] if "balance_activations" in allowed else [False]
    variants = []
    for md in modes:
        cf = coefficients(frame_shape(job, f, md, lc), model, cluster)
        update, hidden = update_means(cf.update, cf.update_hidden, f.pp)
        for off_on, bal_on in itertools.product(offloads, balances):
            # Offload and balancing are global decisions: every rank pays them or none does.
            off = coefficients(frame_shape(job, f, md, lc, activation_offload=True), model, cluster) if off_on \
                else None
            floor = step_floor(cf.slots, _mean_stage(cf, off), update, hidden, cf.update_hidden_stages)
            variants.append((floor, len(variants), md, cf, (update, hidden), off, bal_on))
    best = math.inf
    # Cheapest floor first: a variant whose floor is at or above the best program so far cannot lower the least
    # (its program is at least its floor; the margin covers the rounding of the two sums), so it is not run.
    for floor, _, md, cf, (update, hidden), off, bal_on in sorted(variants, key=lambda v: v[:2]):
        if floor * (1 - 1e-9) >= best:
            break
        variant = (allowed - {"activation_offload", "balance_activations"}) | (
            {"activation_offload"} if off is not None else set()) | ({"balance_activations"} if bal_on else set())
        mem = memory_view(job, f, md, lc, model, cluster, balance=bal_on)
        # A program whose stage work reaches this cannot lower the least either: it stops there.
        stop = (best - update) / cf.slots * (1 + 1e-9) if math.isfinite(best) else math.inf
        stage, _, _ = _dp_bounds(cf, mem, off, cluster, cap, variant, force=True, stop_at=stop,
                                 least=chunk_least(job, f))
        best = min(best, step_floor(cf.slots, stage, update, hidden, cf.update_hidden_stages))
    return best


def group_node_bound(job: Job, members: tuple[Frame, ...], rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                     cluster: ClusterSpec, stop_at: float = math.inf, deadline: float = math.inf) -> float:
    """One step-time bound for node (rc, lc) of every interleaved frame in `members` (frames of one
    `frames.sharding_group`: they differ in their FSDP degrees only): `lp_bound.interleaved_lp_bound` over the
    least of the arrays and the largest of the budgets of the members that can fit. At most each member's own tight
    bound, at the cost of one member's programs: at 8,192 GPUs one shape has tens of FSDP variants, each a node of
    near-equal bound. 0.0 (no bound) past the monotonic `deadline`.

    With a finite `stop_at`, a member whose own work floor with whole layers per rank (`_own_floor`) reaches it is
    left out of the program, whose least-of arrays it would only lower: at 8,192 GPUs the members with the least
    exchange (the least FSDP) hold the least work and the most bytes, and of PP16 VP4 EP32's 50 FSDP variants 14
    are under the 18.39-s line on their own floors. The program over those 14 takes a quarter of the time over
    all 50 and gives the same bound."""
    if job.search.split is not None or members[0].vp == 1:
        return 0.0
    kept, low = list(members), math.inf
    if math.isfinite(stop_at) and len(members) > 1:
        kept = []
        for g in members:
            if _time.monotonic() > deadline:
                return 0.0
            own = _own_floor(job, g, rc, lc, model, cluster, stop_at)
            if own >= stop_at * (1 - STOP_ROUNDING):
                low = min(low, own)
            else:
                kept.append(g)
        if not kept:
            return low
    setting: dict[str, bool] = {}
    value = interleaved_lp_bound(job, kept[0], rc, lc, model, cluster, stop_at=stop_at, members=tuple(kept),
                                 deadline=deadline, setting_out=setting)
    if value > 0.0:
        value = required_toggle_bound(job, kept[0], rc, lc, model, cluster, value, setting, stop_at, deadline,
                                      members=tuple(kept))
    return min(value, low) if value > 0.0 else value


def _own_floor(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec, cluster: ClusterSpec,
               stop_at: float = math.inf) -> float:
    """A lower bound on the step time of every layout of node (f, rc, lc): `least_floor` of the node's work floor
    (`_floor`) at its mean stage, raised to whole layers per rank (`lp_bound.granular_stage`, run only as far as
    `stop_at`)."""
    cf = _floor(job, f, rc, lc, model, cluster)
    terms = [node_terms(cf, f.pp)]
    value = least_floor(terms, cf.slots, cf.update_hidden_stages)
    if value >= stop_at:
        return value
    _, update, _ = terms[0]
    stop = (stop_at - update) / cf.slots if math.isfinite(stop_at) else math.inf
    stage = granular_stage(cf.time, cf.n_layers, f.pp, f.vp, stop=stop, least=chunk_least(job, f))
    return max(value, least_floor(terms, cf.slots, cf.update_hidden_stages, stage))


def _mean_stage(cf: Coefficients, off: Coefficients | None) -> float:
    """A floor on `_dp_bounds`' stage work (v = 1): the slowest rank carries at least the mean over the p ranks of
    every resource's layers and edges (packets and balancing only add), and under offload (every rank pays its
    traffic) of the host-link traffic."""
    means = [float(cf.time[res].sum()) / cf.shape.pp for res in cf.time]
    if off is not None:
        means.append(float(off.time["host_link"].sum()) / cf.shape.pp)
    return max(means)


def _dp_bounds(cf: Coefficients, lean: Coefficients, off: Coefficients | None, cluster: ClusterSpec, cap: int,
               allowed: set[str], force: bool = False, stop_at: float = math.inf, least: tuple[int, ...] = ()
               ) -> tuple[float, float, list[int] | None]:
    """Exact min over contiguous v = 1 splits of (max stage work, max stage memory) by dynamic programming over
    (rank, boundary), with work from the cheapest mode and memory from the leanest (so both are lower bounds):
    persistent + in-flight saved bytes and AttnRes bank + the largest working set + PP, EP and routing buffers +
    logits, or the optimizer phase, under the HBM line; offload when the host holds the saved bytes.
    Rank r of p only ever holds a range [a, b) with sum(least[:r]) <= a and b <= L - sum(least[r + 1:]) (each
    rank holds its least layers, `frames.chunk_least`: one, or none on an edge rank that may be empty), the first
    rank a = 0 and the last b = L: each rank's costs are computed on that block only (`_rank_block`).
    Returns (inf, inf, None) when no split fits, and the argmin split of the work. `stop_at`: once every partial
    split's work is at or above it (so is the answer's, work only grows along the ranks), (inf, nan, None)."""
    L, p = cf.n_layers, cf.shape.pp
    s = _ranges(cf, lean, off, cluster, cap, allowed, force)
    least = least_or_one(least, p)
    best_t = best_m = np.full(L + 1, np.inf)
    choice = np.zeros((p, L + 1), dtype=int)
    for r in range(p):
        rows, cols = _rank_rows_cols(r, p, L, least)
        t, mem = _rank_block(r, rows, cols, s, empty=not least[r])
        new_t, new_m = np.full(L + 1, np.inf), np.full(L + 1, np.inf)
        if r == 0:
            new_t[cols], new_m[cols] = t[0], mem[0]
        else:
            cand = np.maximum(best_t[rows][:, None], t)
            pick = np.argmin(cand, axis=0)
            choice[r][cols] = pick + rows.start
            new_t[cols] = cand[pick, np.arange(cand.shape[1])]
            new_m[cols] = np.min(np.maximum(best_m[rows][:, None], mem), axis=0)
        best_t, best_m = new_t, new_m
        if stop_at < math.inf and not (best_t < stop_at).any():
            return math.inf, math.nan, None
    if not math.isfinite(best_t[L]):
        return math.inf, float(best_m[L]), None
    bounds, b = [L], L
    for r in range(p - 1, 0, -1):
        b = int(choice[r][b])
        bounds.append(b)
    bounds.append(0)
    bounds = bounds[::-1]
    return float(best_t[L]), float(best_m[L]), [bounds[j + 1] - bounds[j] for j in range(p)]


def _ranges(cf: Coefficients, lean: Coefficients, off: Coefficients | None, cluster: ClusterSpec, cap: int,
            allowed: set[str], force: bool) -> _Ranges:
    """The rank-independent (a, b) arrays of `_dp_bounds` over every range [a, b) of layers."""
    L, p = cf.n_layers, cf.shape.pp
    _, b_i, _ = _grid(L)
    a_i = b_i.T

    def rng(arr: np.ndarray) -> np.ndarray:
        pre = np.concatenate([[0.0], np.cumsum(arr[:L])])
        return pre[None, :] - pre[:, None]  # [a, b]: pre[b] - pre[a], as pre[b_i] - pre[a_i]

    opt = least_step_gather(lean, allowed)
    Pr, Ar = rng(bound_persistent_bytes(lean, None)), rng(lean.act)
    # Gradients: the FP32 shard, or (pipeline ZeRO-2) two FP32 buffers of the stage's chunk.
    grads = rng(lean.grads)
    if "pipeline_zero2_host_grads" in allowed:
        grads = np.minimum(grads, rng(zero2_grads(lean, 1)))  # a v = 1 stage is one chunk: its range whole
    Pr = Pr + grads
    P = bound_persistent_bytes(lean, lean.grads)
    # The optimizer phase per range (ledger.optimizer_transient_bytes, elementwise).
    # An empty range (an edge rank with no layer) has no working set: 0 rather than the running max's -inf.
    ns = np.maximum(_range_max(lean.ns_working_set, L), 0.0)
    Or = rng(opt) + ns if lean.step_gather_with_ns else np.maximum(rng(opt), ns)
    R = np.concatenate([[0.0], np.cumsum(lean.closes[:L])])
    bank = R[b_i] * lean.stream_bytes
    packet_in = np.where(a_i > 0, pp_packet_bytes(R[a_i], lean.stream_bytes), 0.0)
    packet_out = np.where(b_i < L, pp_packet_bytes(R[b_i], lean.stream_bytes), 0.0)
    has_moe = rng(lean.moe) > 0
    return _Ranges(
        L=L, p=p, Pr=Pr, Ar=Ar, Or=Or, bank=bank, packet_in=packet_in, packet_out=packet_out, has_moe=has_moe,
        buffers=2 * (packet_in + packet_out) + has_moe * lean.routing_map, layer_buffers=has_moe * lean.ep_buffers,
        ws=_range_max(lean.working_set, L), work={res: rng(cf.time[res]) for res in cf.time},
        resident=(lean.shape.offload_resident_layers * np.maximum(_range_max(lean.act, L), 0.0)
                  if off is not None else None),
        host_off=rng(off.time["host_link"]) if off is not None else None, P=P, opt=opt, cf=cf, lean=lean, off=off,
        host_bytes=cluster.host_memory_bytes, cap=cap, allowed=allowed, force=force)


def _rank_rows_cols(r: int, p: int, L: int, least: tuple[int, ...]) -> tuple[slice, slice]:
    """The boundaries rank r of p can start (rows a) and end (columns b) at when each rank holds its `least`
    layers: the first rank starts at 0, the last ends at L."""
    rows = slice(0, 1) if r == 0 else slice(sum(least[:r]), L - sum(least[r:]) + 1)
    cols = slice(L, L + 1) if r == p - 1 else slice(sum(least[:r + 1]), L - sum(least[r + 1:]) + 1)
    return rows, cols


def _build_grid(L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b) index grids over boundaries 0..L and the mask of proper ranges b > a (read-only, shared)."""
    idx = np.arange(L + 1)
    a_i, b_i = np.meshgrid(idx, idx, indexing="ij")
    valid = b_i > a_i
    for arr in (a_i, b_i, valid):
        arr.setflags(write=False)
    return a_i, b_i, valid


_grid = Memo(_build_grid, maxsize=8)


def _range_max(arr: np.ndarray, L: int) -> np.ndarray:
    """[a, b]: max of arr over layers a..b-1 for b > a, -inf elsewhere (a running max along each row)."""
    a_i, _, _ = _grid(L)
    rows = np.where(a_i[:L, :L] <= np.arange(L)[None, :], arr[None, :L], -np.inf)  # row a: layers from a on
    out = np.full((L + 1, L + 1), -np.inf)
    out[:L, 1:] = np.maximum.accumulate(rows, axis=1)
    return out


@dataclass
class _Ranges:
    """The (a, b) arrays of every range [a, b) that `_rank_block` combines for one rank, and their sources."""

    L: int
    p: int
    Pr: np.ndarray
    """Persistent bytes (master, optimizer, BF16 view, accumulators, gradients)."""
    Ar: np.ndarray
    """Saved bytes per in-flight microbatch."""
    Or: np.ndarray
    """Optimizer-phase bytes (the step gather with or after the Newton-Schulz working set)."""
    bank: np.ndarray
    """AttnRes bank per in-flight microbatch."""
    packet_in: np.ndarray
    packet_out: np.ndarray
    has_moe: np.ndarray
    buffers: np.ndarray
    """PP packets in and out and the routing map: held through the activation phase."""
    layer_buffers: np.ndarray
    """The EP dispatch and combine buffers: live while a MoE layer runs (ledger.Moment.LAYER)."""
    ws: np.ndarray
    """Largest working set."""
    work: dict[str, np.ndarray]
    resident: np.ndarray | None
    """Offload: the resident layers' worth of the largest saved set."""
    host_off: np.ndarray | None
    """Offload: host-link seconds."""
    P: np.ndarray
    opt: np.ndarray
    cf: Coefficients
    lean: Coefficients
    off: Coefficients | None
    host_bytes: int
    cap: int
    allowed: set[str]
    force: bool
    inner: _RankTerms | None = None
    """The terms of a rank without edges (0 < r < p - 1), over every range, computed once."""


@dataclass
class _RankTerms:
    """One rank's (a, b) terms: the first five with its edges, `busy` without its PP packets."""

    persistent: np.ndarray
    fixed_act: np.ndarray
    """Working set, buffers and logits."""
    mem_opt: np.ndarray
    act: np.ndarray
    """Saved bytes per in-flight microbatch."""
    host_off: np.ndarray | None
    busy: dict[str, np.ndarray]
    """Seconds on each resource."""
    unpacketed: np.ndarray
    """The largest of `busy` over the resources no PP packet uses."""

    def sliced(self, blk: tuple[slice, slice]) -> _RankTerms:
        return _RankTerms(self.persistent[blk], self.fixed_act[blk], self.mem_opt[blk], self.act[blk],
                          None if self.host_off is None else self.host_off[blk],
                          {res: w[blk] for res, w in self.busy.items()}, self.unpacketed[blk])


def _rank_terms(r: int, blk: tuple[slice, slice], s: _Ranges) -> _RankTerms:
    """Rank r's terms over the ranges of block blk, each with the rank's edge (the first rank the first edge, the
    last rank the last); a rank with no edge adds none (x + 0.0 is x)."""
    lean, L, p = s.lean, s.L, s.p
    first, last = r == 0, r == p - 1

    def edge(arr: np.ndarray) -> float:
        return float(arr[L] if first else 0.0) + float(arr[L + 1] if last else 0.0)

    def plus(x: np.ndarray, e: float) -> np.ndarray:
        return x + e if (first or last) else x

    persistent = plus(s.Pr[blk], edge(s.P)) + s.has_moe[blk] * lean.moonep_buffers
    ws_r = np.maximum(s.ws[blk], max(float(lean.working_set[L]) if first else 0.0,
                                     float(lean.working_set[L + 1]) if last else 0.0))
    fixed_act = s.buffers[blk] + least_transient(ws_r + s.layer_buffers[blk], lean.logits if last else 0.0)
    busy = {res: plus(w[blk], edge(s.cf.time[res])) for res, w in s.work.items()}
    others = [w for res, w in busy.items() if res not in ("nvlink", "nic")]
    return _RankTerms(
        persistent=persistent, fixed_act=fixed_act, mem_opt=plus(persistent + s.Or[blk], edge(s.opt)),
        act=plus(s.Ar[blk], edge(lean.act)),
        host_off=None if s.host_off is None or s.off is None else plus(s.host_off[blk],
                                                                        edge(s.off.time["host_link"])),
        busy=busy, unpacketed=functools.reduce(np.maximum, others) if others else np.full_like(persistent, -np.inf))


def _rank_block(r: int, rows: slice, cols: slice, s: _Ranges, empty: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """Rank r's (work, memory) over the ranges [a, b) of its block (inf where the range is empty, unless `empty`
    lets this edge rank hold no layer, or does not fit):
    every resource's layers + edges + its PP packets, the slowest; each in-flight option (its own count, or with
    balancing the average, paying the excess over the network), the cheaper. The ranks without an edge share
    their terms, computed once over every range."""
    cf, lean, p = s.cf, s.lean, s.p
    blk = (rows, cols)
    if 0 < r < p - 1:
        if s.inner is None:
            s.inner = _rank_terms(r, (slice(None), slice(None)), s)
        rt = s.inner.sliced(blk)
    else:
        rt = _rank_terms(r, blk, s)
    # PP packets: the one in (from rank r - 1) and the one out (to rank r + 1), on that hop's link.
    packet: dict[str, np.ndarray] = {}
    if r > 0:
        hop = r - 1
        link = "nvlink" if cf.pp_on_nvlink[hop] else "nic"
        packet[link] = s.packet_in[blk] * cf.pp_seconds_per_byte[hop]
    if r < p - 1:
        link = "nvlink" if cf.pp_on_nvlink[r] else "nic"
        out = s.packet_out[blk] * cf.pp_seconds_per_byte[r]
        packet[link] = packet[link] + out if link in packet else out
    busy = {res: (rt.busy[res] + packet[res] if res in packet else rt.busy[res])
            for res in ("nvlink", "nic") if res in rt.busy}
    t_base = functools.reduce(np.maximum, busy.values(), rt.unpacketed)
    n_own = peak_inflight(lean.compositions[r])
    options = [(n_own, t_base)]
    if lean.balanced_inflight is not None and "balance_activations" in s.allowed:
        avg = lean.balanced_inflight
        t_bal = t_base
        if avg < n_own:
            # Balancing holds the average, paying the excess out and back on the network every microbatch.
            moved = balance_moved_bytes(rt.act, n_own, avg)
            res = lean.balance_resource
            t_bal = np.maximum(t_base, busy.get(res, rt.busy[res]) + moved * lean.balance_seconds_per_byte)
        # Forced (balancing on for every rank): this is the only option; otherwise a per-rank choice.
        options = [(avg, t_bal)] if s.force else [*options, (avg, t_bal)]
    t_r = mem_r = np.inf
    for n, t_opt in options:
        t_n, m_n = _dp_stage(n, t_opt, rt, s, blk, empty)
        t_r, mem_r = np.minimum(t_r, t_n), np.minimum(mem_r, m_n)
    return t_r, mem_r


def _dp_stage(n: float, t: np.ndarray, rt: _RankTerms, s: _Ranges, blk: tuple[slice, slice], empty: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """Work and memory of one rank over the ranges of its block when it holds n in-flight microbatches: persistent
    + n (saved + bank) + working set, buffers and logits, or the optimizer phase; with offload the resident
    layers' saved set stays on the GPU and the rest goes to the host."""
    valid, bank = _grid(s.L)[2][blk], s.bank[blk]
    if empty:  # an edge rank that may hold no layer: the range [a, a) too
        a_i, b_i, _ = _grid(s.L)
        valid = valid | (a_i[blk] == b_i[blk])
    saved = n * (rt.act + bank)
    mem_keep = np.maximum(rt.persistent + saved + rt.fixed_act, rt.mem_opt)
    fits_keep = mem_keep <= s.cap
    mem = mem_keep
    if s.resident is not None and rt.host_off is not None:
        host = n * rt.act <= s.host_bytes
        mem_off = np.maximum(rt.persistent + s.resident[blk] + n * bank + rt.fixed_act, rt.mem_opt)
        fits_off = host & (mem_off <= s.cap)
        t_off = np.maximum(t, rt.host_off)
        if s.force:  # offload on every rank: every rank pays its traffic
            t, mem, fits = t_off, np.where(host, mem_off, np.inf), fits_off
        else:
            t = np.where(fits_keep, t, t_off)
            # The peak bound takes the lower of the two wherever the host can hold the saved bytes.
            mem = np.where(host, np.minimum(mem_keep, mem_off), mem_keep)
            fits = fits_keep | fits_off
    else:
        fits = fits_keep
    fits = fits & valid
    return np.where(fits, t, np.inf), np.where(valid, mem, np.inf)


def _peak_lower_bound(job: Job, f: Frame, cf: Coefficients, cluster: ClusterSpec, allowed: set[str]) -> float:
    """A lower bound on the worst-rank peak over every contiguous split, by LP duality on a fractional relaxation.

    Layer i on rank r costs s_ir = P_i + c A_i: P_i its persistent bytes, A_i its saved bytes per in-flight
    microbatch under the leanest activation mode, c the in-flight copies of the chunk holding it at the rank's
    peak composition. Every chunk holds at least its least layers (`frames.chunk_least`: one, none on an edge
    chunk that may be empty), so rank r carries at least F_r = sum over its chunks of least x min_i s_ir, plus its
    edges E_r; the other L - sum(least) layers are fractional. For y_r >= 0:
    worst peak >= (sum_r y_r (E_r + F_r) + sum of the L - p v smallest min_r y_r s_ir) / sum_r y_r, here with
    y_r = 1 / (mean P + w_r mean A), w_r the rank's smallest chunk count. Offload (if allowed) keeps the resident
    layers' saved sets on the GPU and moves the rest to the host, where the same bound must fit host memory.
    The optimizer phase gives the mean of P_i + O_i."""
    L, p = cf.n_layers, f.pp
    least = chunk_least(job, f)
    P = bound_persistent_bytes(cf, least_grads(cf, allowed, f.vp))
    opt = least_step_gather(cf, allowed)
    counts = []
    for r in range(p):
        comp = np.array(max(cf.compositions[r], key=sum), dtype=float)
        if cf.balanced_inflight is not None and "balance_activations" in allowed:
            comp = comp * min(1.0, cf.balanced_inflight / comp.sum())
        counts.append(comp)
    w = np.array([c.min() for c in counts])
    A = cf.act[:L]
    edges = np.zeros(p)
    edges[0] += P[L] + cf.act[L]
    edges[p - 1] += P[L + 1] + cf.act[L + 1]

    def bound(Pl: np.ndarray, Al: np.ndarray, extra: float | np.ndarray = 0.0) -> float:
        y = 1.0 / (Pl.mean() + w * Al.mean() + 1.0)
        floor = np.array([sum(least[k * p + r] * float((Pl + c * Al).min()) for k, c in enumerate(counts[r]))
                          for r in range(p)]) + extra
        cost = ((Pl[:, None] + Al[:, None] * w[None, :]) * y[None, :]).min(axis=1)
        rest = np.sort(cost)[: max(L - sum(least), 0)].sum()
        return float((rest + (y * (edges + floor)).sum()) / y.sum())

    opt_phase = float((P + opt).sum()) / p
    gpu = bound(P[:L], A)
    offload = "activation_offload" in allowed and bound(np.zeros(L), A) <= cluster.host_memory_bytes
    if offload:
        # The GPU keeps the resident layers' worth of the rank's largest saved set (its layers' and edges'): at
        # least the least layer's, or on an edge rank that may hold no layer, its edge's if that is less.
        low = np.full(p, float(A.min()))
        for r, held in enumerate(rank_least(least, p)):
            if not held:
                low[r] = min(low[r], *([float(cf.act[L])] if r == 0 else []),
                             *([float(cf.act[L + 1])] if r == p - 1 else []))
        gpu = min(gpu, bound(P[:L], np.zeros(L), cf.shape.offload_resident_layers * low))
    # Pigeonhole: some rank holds at least ceil(n_moe / p) MoE layers, with the MoE buffers of one layer,
    # the smallest working set and, when p > 1, at least one packet each way (an edge rank has only one).
    moe = cf.moe[:L] > 0
    n_moe = int(moe.sum())
    if n_moe:
        k = -(-n_moe // p)
        buffers = (cf.ep_buffers + cf.moonep_buffers + cf.routing_map + float(cf.working_set[:L][moe].min())
                   + (2 * pp_packet_bytes(0, cf.stream_bytes) if p > 1 else 0))
        act_moe = np.zeros(n_moe) if offload else w.min() * A[moe]
        hold = np.sort(P[:L][moe] + act_moe)[:k].sum() + buffers
        hold_opt = np.sort((P + opt)[:L][moe])[:k].sum()
        gpu = max(gpu, float(hold), float(hold_opt))
    return max(gpu, opt_phase)
