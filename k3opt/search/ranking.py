"""Where the search takes its coefficients: the view it ranks by.

Plans rank by the achievable step time (k3opt.cost.achievable): with a rates file for the cluster, the search's
`time` / `update` / `pp_seconds_per_byte` arrays are the achievable ones in the roofline's form
(achievable.ranking_view), so the node model, the bounds and the incumbents optimize the achievable step
unchanged; without one they are the peak roofline's. Memory arrays are the cost model's either way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from k3opt.cost.achievable import ranking_view, with_fields
from k3opt.cost.coefficients import Coefficients, CostModel, LayerShape, Shape, cost_model
from k3opt.inputs.memo import Memo, register
from k3opt.inputs.specs import ClusterSpec, FsdpLifecycle, ModelSpec, Recompute, Toggles
from k3opt.inputs.toggles import ToggleKind
from k3opt.inputs.toggles import names as toggle_names


def ranked_coefficients(shape: Shape, model: ModelSpec, cluster: ClusterSpec) -> Coefficients:
    """coefficients(shape, model, cluster) seen through ranking_view (cached like the coefficients)."""
    return _ranked(shape, cost_model(model, cluster))


def _build_ranked(shape: Shape, cm: CostModel) -> Coefficients:
    return ranking_view(cm.coefficients(shape), cm.cluster, cm.rates)


_ranked = Memo(_build_ranked, maxsize=2048)  # a miss costs one ranking_view over the cached coefficients


def update_means(update: Mapping[str, np.ndarray], hidden: Mapping[str, np.ndarray], p: int) -> tuple[float, float]:
    """(update compute, update communication) of the slowest rank, at least their means over the p ranks: per
    field the max over resources of the sum over every layer and edge, / p (0 for a field with no resource)."""
    u = max((float(a.sum()) for a in update.values()), default=0.0) / p
    h = max((float(a.sum()) for a in hidden.values()), default=0.0) / p
    return u, h


def step_floor(slots: float, stage: float, update: float, hidden: float, hidden_stages: float) -> float:
    """Least of the search's step formula (ranking_view), slots x S + update + max(0, hidden - hidden_stages x S),
    over every stage S >= `stage`, given a rank's update compute `update` and update communication `hidden`
    (lower bounds of the slowest rank's, e.g. update_means). The formula is nondecreasing in S while
    slots >= hidden_stages; otherwise it falls until the communication is hidden, at S = hidden / hidden_stages.
    Without the communication term a bound at 8,192 GPUs leaves out the 0.2-0.4 s of the update's data-parallel
    exchange that one stage-microbatch of compute does not hide (2% of the step)."""
    if not math.isfinite(stage):
        return math.inf
    s = stage
    if hidden_stages > slots and hidden > 0.0:
        s = max(stage, hidden / hidden_stages)
    return slots * s + update + max(0.0, hidden - hidden_stages * s)


FLOOR_TOGGLES = toggle_names(ToggleKind.ACTIVATION)
"""The activation toggles (search/frames.ACT_TOGGLES) a work floor ranges over by default."""


def work_floor(shape: Shape, model: ModelSpec, cluster: ClusterSpec, free: tuple[str, ...] = FLOOR_TOGGLES,
               recomputes: tuple[Recompute, ...] | None = None,
               lifecycles: tuple[FsdpLifecycle, ...] | None = None) -> Coefficients:
    """The ranked view of `shape` with every per-layer `time` and `update` array (each resource) at or below its
    value under every activation mode a layout of the shape may take: every combination of the toggles in `free`
    (the others as in `shape`), under each recompute mode of `recomputes` and lifecycle of `lifecycles` (default:
    the shape's own). A layout's ranked stage is the max over resources of per-rank sums of its mode's arrays,
    each at or above these, so every bound built from the floor (sums per rank, then the max over resources, as
    the step formula takes them) stays below it. Memory arrays and the schedule's terms are the shape's.

    With a rates file: the achievable arrays (k3opt.cost.achievable) of the shape with the free toggles off, least over
    the recompute modes and lifecycles, except the memory-bound kernels (`vector`), which the activation toggles
    lower (fused SiTU, the MoE backward rewrite, FP8 storage shrink the saved set they stream): those at their
    least over the toggle combinations (`_least_vector`); every other achievable array the free activation
    toggles leave or raise (the dispatch recompute adds all-to-all traffic). The floor is then seen through
    ranking_view, which only sums, scales and takes maxima of those arrays, so it stays below each mode's view.
    Without one, or with the saved set moved over a link (ACT_TRAFFIC): the elementwise least of every
    combination's arrays (there the toggles lower the activation HBM or link traffic).
    tests/search/test_bounds_below_k3_layouts.py checks the floor against every mode."""
    recs = tuple(recomputes) if recomputes is not None else (shape.recompute,)
    lcs = tuple(lifecycles) if lifecycles is not None else (shape.fsdp_lifecycle,)
    return _work_floor(shape, tuple(free), recs, lcs, cost_model(model, cluster))


def _build_work_floor(shape: Shape, free: tuple[str, ...], recs: tuple[Recompute, ...], lcs: tuple[FsdpLifecycle, ...],
                cm: CostModel) -> Coefficients:
    view = _ranked(shape, cm)
    off = shape.toggles.model_copy(update={t: False for t in free})
    shapes = [replace(shape, recompute=rc, fsdp_lifecycle=lc, toggles=off) for rc in recs for lc in lcs]
    raws = [cm.coefficients(sh) for sh in shapes]
    # An EP overlap schedule exposes max(0, exchange - paired compute): not monotone in the per-resource parts
    # the fast paths take minima of, so such a shape takes the elementwise least of every mode's view.
    moved = any(getattr(shape.toggles, t) for t in ACT_TRAFFIC)
    if not raws[0].achievable and not shape.ep_overlap and not moved:
        return _peak_floor(view, off, shapes, free, cm)
    if not raws[0].achievable or shape.ep_overlap or moved:
        parts = [_least_arrays(sh, free, cm) for sh in shapes]
        time = {res: np.minimum.reduce([t[res] for t, _ in parts]) for res in parts[0][0]}
        update = {res: np.minimum.reduce([u[res] for _, u in parts]) for res in parts[0][1]}
        return with_fields(view, time=time, update=update, update_hidden=_least_hidden(shapes, cm))
    cluster, rates = cm.cluster, cm.rates
    vector_only = tuple(t for t in free if t in VECTOR_ONLY)
    others = tuple(t for t in free if t not in VECTOR_ONLY)
    time: dict[str, np.ndarray] = {}
    update: dict[str, np.ndarray] = {}
    hidden: dict[str, np.ndarray] = {}
    # Per setting of the free toggles that reach other arrays too (the dispatch recompute: the all-to-all), the
    # least of the rest over the recompute modes and lifecycles, with the least vector time of the others' modes.
    for flags in itertools.product((False, True), repeat=len(others)):
        set_ = off.model_copy(update=dict(zip(others, flags, strict=True)))
        mode_raws = [cm.coefficients(replace(sh, toggles=set_))
                     for sh in shapes]
        ach = {res: np.minimum.reduce([r.achievable[res] for r in mode_raws]) for res in mode_raws[0].achievable}
        ach["vector"] = np.minimum.reduce([_least_vector(replace(sh, toggles=set_), vector_only, cm) for sh in shapes])
        upd = {res: np.minimum.reduce([r.update_achievable[res] for r in mode_raws])
               for res in mode_raws[0].update_achievable}
        fv = ranking_view(with_fields(mode_raws[0], achievable=ach, update_achievable=upd), cluster, rates)
        for dst, src in ((time, fv.time), (update, fv.update), (hidden, fv.update_hidden)):
            for res, arr in src.items():
                dst[res] = np.minimum(dst[res], arr) if res in dst else arr
    return with_fields(view, time=time, update=update, update_hidden=hidden)


_work_floor = Memo(_build_work_floor, maxsize=4096)


def _peak_floor(view: Coefficients, off: Toggles, shapes: list[Shape], free: tuple[str, ...], cm: CostModel
                ) -> Coefficients:
    """work_floor at the peak roofline (no rates file), no saved set over a link, no EP overlap schedule: per
    setting of the free toggles that reach more than HBM (the dispatch recompute), each mode's arrays with the HBM
    time lowered by the least the HBM-only toggles take off it (`_least_hbm_cut`, shared by every shape of the
    same tokens), least over the settings, recompute modes and lifecycles. Two builds per mode where the
    elementwise least over every combination takes 2^len(free); tests/search/test_peak_floor.py checks it equals
    that least."""
    vector_only = tuple(t for t in free if t in VECTOR_ONLY)
    others = tuple(t for t in free if t not in VECTOR_ONLY)
    time: dict[str, np.ndarray] = {}
    update: dict[str, np.ndarray] = {}
    for flags in itertools.product((False, True), repeat=len(others)):
        set_ = off.model_copy(update=dict(zip(others, flags, strict=True)))
        for sh in shapes:
            mode = replace(sh, toggles=set_)
            raw = cm.coefficients(mode)
            t = dict(raw.time)
            # (1 - VECTOR_MARGIN): the cut is measured on another shape, whose HBM sums round differently.
            t["hbm"] = np.maximum(t["hbm"] - _least_hbm_cut(_vector_shape(mode), vector_only, cm), 0.0) \
                * (1 - VECTOR_MARGIN)
            for dst, src in ((time, t), (update, raw.update)):
                for res, arr in src.items():
                    dst[res] = np.minimum(dst[res], arr) if res in dst else arr
    return with_fields(view, time=time, update=update, update_hidden=_least_hidden(shapes, cm))


def _least_hidden(shapes: list[Shape], cm: CostModel
                  ) -> dict[str, np.ndarray]:
    """Elementwise least update communication (`update_hidden`) of the shapes' ranked views. The activation
    toggles do not reach it (k3opt.cost.coefficients: the update's exchange reads the sharding, the lifecycle and P2P
    Muon), so the shapes' own settings stand for every combination of them."""
    views = [_ranked(sh, cm) for sh in shapes]
    return {res: np.minimum.reduce([v.update_hidden[res] for v in views]) for res in views[0].update_hidden}


ACT_TRAFFIC = toggle_names(moves_saved_set=True)
"""Rank toggles that move the saved set over a link: with one on, the activation toggles lower that link's time too,
and the floor is the elementwise least of every combination's arrays."""
VECTOR_ONLY = toggle_names(vector_only=True)
"""Activation toggles whose only effect on a time array without offload is the memory-bound kernels' traffic (the
saved set they shrink is streamed there); the dispatch recompute also replays the all-to-all."""


VECTOR_MARGIN = 1e-9
"""Relative margin under `_least_vector`: its shape's vector time differs from another shape's of the same key by
the rounding of the HBM sums it is the difference of (~1e-16 of the weight traffic)."""


def _build_least_vector(shape: Shape, free: tuple[str, ...], cm: CostModel) -> np.ndarray:
    """Per layer, the least achievable memory-bound kernel (`vector`) time over every combination of the `free`
    toggles (the shape's others kept), less VECTOR_MARGIN. Those kernels stream the saved set, the FP8 quantize
    traffic and the MoE rewrite's extra read (k3opt.cost.coefficients): they read the local tokens, the activation
    toggles, the recompute mode, the precision and the FP8 block, never the parallel degrees, the sharding or the
    schedule; so one shape per such key is built, on one GPU group of the CP degree (`_vector_shape`)."""
    key = _vector_shape(shape)
    if key != shape:
        return _least_vector(key, free, cm)
    vecs = [cm.coefficients(replace(shape, toggles=shape.toggles.model_copy(
        update=dict(zip(free, flags, strict=True))))).achievable["vector"]
        for flags in itertools.product((False, True), repeat=len(free))]
    out = np.minimum.reduce(vecs) * (1 - VECTOR_MARGIN)
    out.setflags(write=False)
    return out


_least_vector = Memo(_build_least_vector, maxsize=1024)


def _build_least_hbm_cut(key: Shape, free: tuple[str, ...], cm: CostModel) -> np.ndarray:
    """Per layer, the most peak-roofline HBM time any combination of the `free` toggles takes off the `_vector_shape`
    key's (>= 0): the toggles change only the saved set, the FP8 (de)quantize traffic and the MoE rewrite's
    re-read (coefficients._hbm_bytes), which read the local tokens, the activation toggles, the recompute mode and
    the precision, never the parallel degrees or the weights, so the cut carries to every shape of the key."""
    base = cm.coefficients(key).time["hbm"]
    cuts = [base - cm.coefficients(replace(key, toggles=key.toggles.model_copy(
        update=dict(zip(free, flags, strict=True))))).time["hbm"]
        for flags in itertools.product((False, True), repeat=len(free))]
    out = np.maximum.reduce(cuts)  # the all-off combination is among them: the cut is at least 0
    out.setflags(write=False)
    return out


_least_hbm_cut = Memo(_build_least_hbm_cut, maxsize=1024)


def _build_least_vector_any_recompute(key: Shape, free: tuple[str, ...], cm: CostModel) -> np.ndarray:
    """`_least_vector` least over every recompute mode, for a `_vector_shape` key (its recompute mode ignored):
    shared by every shape of those tokens, toggles and precision (at 8,192 GPUs, ten thousand frame bounds)."""
    out = np.minimum.reduce([_least_vector(replace(key, recompute=rc), free, cm)
                             for rc in Recompute])
    out.setflags(write=False)
    return out


_least_vector_any_recompute = Memo(_build_least_vector_any_recompute, maxsize=256)


def _vector_shape(shape: Shape) -> Shape:
    """The shape `_least_vector` builds for `shape`: its tokens, activation toggles, recompute mode, precision and
    FP8 block on CP GPUs (no pipeline, EP or FSDP), the rest at the defaults."""
    act = {t: getattr(shape.toggles, t) for t in ("fp8_activations", "fused_situ", "moe_backward_rewrite",
                                                  "dispatch_recompute")}
    return Shape(gpus=shape.cp, pp=1, vp=1, cp=shape.cp, ep=1, expert_fsdp=1, dense_fsdp=1, microbatches=1,
                 rows=shape.rows, context=shape.context, document_length=shape.document_length,
                 recompute=shape.recompute, fsdp_lifecycle=FsdpLifecycle.PER_MICROBATCH,
                 toggles=type(shape.toggles)(**act), fp8_block_size=shape.fp8_block_size, precision=shape.precision)


def coarse_work_floor(shape: Shape, model: ModelSpec, cluster: ClusterSpec,
                      free: tuple[str, ...] = FLOOR_TOGGLES) -> Coefficients:
    """A cheaper, looser floor than `work_floor` from the shape's own ranked view: its memory-bound kernels' time
    replaced by their least over every recompute mode and combination of the `free` toggles (`_least_vector`,
    shared by every shape of the same tokens), every other term as the shape's (the activation toggles leave or
    raise them; a frame bound passes recompute 'none' without toggles, the least of them). The frame bounds of
    every shape use it; the search tightens a frame with `work_floor` when it reaches it."""
    return _coarse_work_floor(shape, tuple(free), cost_model(model, cluster))


def _build_coarse_work_floor(shape: Shape, free: tuple[str, ...], cm: CostModel) -> Coefficients:
    view = _ranked(shape, cm)
    raw = cm.coefficients(shape)
    if view is raw:
        return view
    least = _least_vector_any_recompute(replace(_vector_shape(shape), recompute=Recompute.NONE), free, cm)
    time = dict(view.time)
    if "vector" in time:
        time["vector"] = least  # the kernels as their own resource
    else:
        time["tensor"] = time["tensor"] - raw.achievable["vector"] + least
    return with_fields(view, time=time)


_coarse_work_floor = Memo(_build_coarse_work_floor, maxsize=2048)


_LEAST: dict = register({})
"""`_least_arrays` by what its arrays read."""


def _least_arrays(shape: Shape, free: tuple[str, ...], cm: CostModel
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Elementwise least `time` and `update` arrays of the ranked views over every combination of the `free`
    toggles (work_floor) under the shape's recompute mode and lifecycle. The ranked per-layer arrays read the
    LayerShape (the per-layer build's key: no pipeline schedule) and the EP overlap flags only, so the shapes that
    differ in their schedule share one computation."""
    base = replace(shape, toggles=shape.toggles.model_copy(update={t: False for t in free}))
    placement = cm.coefficients(shape).placement
    key = (LayerShape.of(base, placement), shape.ep_overlap, shape.delay_wgrad_compute, free, cm)
    hit = _LEAST.get(key)
    if hit is not None:
        return hit
    views = [_ranked(replace(shape, toggles=shape.toggles.model_copy(update=dict(zip(free, flags, strict=True)))),
                     cm)
             for flags in itertools.product((False, True), repeat=len(free))]
    time = {res: np.minimum.reduce([v.time[res] for v in views]) for res in views[0].time}
    update = {res: np.minimum.reduce([v.update[res] for v in views]) for res in views[0].update}
    for arr in (*time.values(), *update.values()):
        arr.setflags(write=False)
    if len(_LEAST) > 8192:
        _LEAST.clear()
    _LEAST[key] = (time, update)
    return time, update
