"""Where the search takes its coefficients: the view it ranks by.

Plans rank by the achievable step time (k3opt.achievable): with a rates file for the cluster, the search's
`time` / `update` / `pp_seconds_per_byte` arrays are the achievable ones in the roofline's form
(achievable.ranking_view), so the node model, the bounds and the incumbents optimize the achievable step
unchanged; without one they are the peak roofline's. Memory arrays are the cost model's either way.
"""

from __future__ import annotations

from functools import lru_cache

from k3opt.achievable import ranking_view, with_fields
from k3opt.coefficients import Coefficients, Shape, cache_key, coefficients_of_key, specs_of_key
from k3opt.specs import ClusterSpec, ModelSpec


def ranked_coefficients(shape: Shape, model: ModelSpec, cluster: ClusterSpec) -> Coefficients:
    """coefficients(shape, model, cluster) seen through ranking_view (cached like the coefficients)."""
    return _ranked(shape, *cache_key(model, cluster))


@lru_cache(maxsize=2048)  # a miss costs one ranking_view over the cached coefficients
def _ranked(shape: Shape, model_json: str, cluster_json: str, rates_json: str) -> Coefficients:
    cluster, rates = specs_of_key(cluster_json, rates_json)
    return ranking_view(coefficients_of_key(shape, model_json, cluster_json, rates_json), cluster, rates)


def work_floor(shape: Shape, model: ModelSpec, cluster: ClusterSpec) -> Coefficients:
    """The ranked view with the memory-bound kernels' time taken out of `tensor`: a per-layer work floor for every
    activation mode of the shape's recompute mode. The activation toggles change the saved set, and with it the
    elementwise traffic between the GEMMs, in either direction (fused SiTU and the MoE backward rewrite lower it);
    every other term of the view they leave or raise. Without a rates file: the roofline's coefficients, which the
    toggles only raise."""
    return _work_floor(shape, *cache_key(model, cluster))


@lru_cache(maxsize=2048)
def _work_floor(shape: Shape, model_json: str, cluster_json: str, rates_json: str) -> Coefficients:
    return _build_work_floor(shape, model_json, cluster_json, rates_json)


def _build_work_floor(shape: Shape, model_json: str, cluster_json: str, rates_json: str) -> Coefficients:
    view = _ranked(shape, model_json, cluster_json, rates_json)
    raw = coefficients_of_key(shape, model_json, cluster_json, rates_json)
    if view is raw:
        return view
    time = dict(view.time)
    if "vector" in time:
        del time["vector"]  # the kernels as their own resource: a max term, dropped
    else:
        time["tensor"] = time["tensor"] - raw.achievable["vector"]
    return with_fields(view, time=time)
