"""Where the search takes its coefficients: the view it ranks by.

Plans rank by the achievable step time (k3opt.achievable): with a rates file for the cluster, the search's
`time` / `update` / `pp_seconds_per_byte` arrays are the achievable ones in the roofline's form
(achievable.ranking_view), so the node model, the bounds and the incumbents optimize the achievable step
unchanged; without one they are the peak roofline's. Memory arrays are the cost model's either way.
"""

from __future__ import annotations

from dataclasses import replace

from k3opt.achievable import ranking_view
from k3opt.coefficients import Coefficients, Shape, coefficients
from k3opt.specs import ClusterSpec, ModelSpec

_VIEWS: dict[int, tuple[Coefficients, Coefficients]] = {}


def ranked_coefficients(shape: Shape, model: ModelSpec, cluster: ClusterSpec) -> Coefficients:
    """coefficients(shape, model, cluster) seen through ranking_view (cached like the coefficients)."""
    cf = coefficients(shape, model, cluster)
    hit = _VIEWS.get(id(cf))
    if hit is None or hit[0] is not cf:
        if len(_VIEWS) > 256:
            _VIEWS.clear()
        hit = _VIEWS[id(cf)] = (cf, ranking_view(cf, cluster))
    return hit[1]


def work_floor(shape: Shape, model: ModelSpec, cluster: ClusterSpec) -> Coefficients:
    """The ranked view with the memory-bound kernels' time taken out of `tensor`: a per-layer work floor for every
    activation mode of the shape's recompute mode. The activation toggles change the saved set, and with it the
    elementwise traffic between the GEMMs, in either direction (fused SiTU and the MoE backward rewrite lower it);
    every other term of the view they leave or raise. Without a rates file: the roofline's coefficients, which the
    toggles only raise."""
    view = ranked_coefficients(shape, model, cluster)
    raw = coefficients(shape, model, cluster)
    if view is raw:
        return view
    time = dict(view.time)
    if "vector" in time:
        del time["vector"]  # the kernels as their own resource: a max term, dropped
    else:
        time["tensor"] = time["tensor"] - raw.achievable["vector"]
    return replace(view, time=time)
