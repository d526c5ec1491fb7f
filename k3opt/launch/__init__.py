"""From plan to launch: a layout as Megatron-Bridge overrides, Megatron-LM flags or torchtitan TOML, and the
frameworks' limits as search constraints.

    to_launch(layout, "megatron-lm").text      # flags, with every decision that has no switch as a comment
    apply_target_limits(job, model)            # the job narrowed to what job.target can run
    launch_refusals(layout, "megatron-bridge") # why a target cannot run a layout ([] when it can)
    plan(job, ...)                             # k3opt.plan honouring job.target
"""

from __future__ import annotations

from k3opt.launch import megatron_bridge, megatron_lm, torchtitan
from k3opt.launch.common import FORMATS, SOURCES, Launch, Missing, check_format
from k3opt.launch.limits import LIMITS, NO_SWITCH, apply_target_limits, launch_refusals
from k3opt.specs import Layout, ModelSpec, load_model

_EXPORTERS = {"megatron-bridge": megatron_bridge.export, "megatron-lm": megatron_lm.export,
              "torchtitan": torchtitan.export}


def to_launch(layout: Layout, fmt: str, model: ModelSpec | str | None = None) -> Launch:
    """`layout` rendered for framework `fmt` (one of FORMATS); model: object, preset or path (default: the
    layout's, else kimi-k3). Raises UnknownTargetError for an unknown format."""
    check_format(fmt)
    m = model if isinstance(model, ModelSpec) else load_model(model or layout.model or "kimi-k3")
    return _EXPORTERS[fmt](layout, m)


def plan(job, model=None, cluster=None, top: int = 5, **kwargs):  # noqa: ANN001, ANN201
    """k3opt's plan() for a job with a launch target: the job is narrowed by apply_target_limits, and
    frames that break a coupled rule the [search] lists cannot express (the derived expert sharding degree)
    are dropped from the ranking. The ranked search keeps one layout per frame, and whether a frame is
    runnable depends only on its degrees once the toggles are narrowed, so asking for more frames and
    filtering keeps the optimum among runnable layouts; the request grows until `top` runnable ones are
    found or the search runs out of frames. Without a target it is search.plan unchanged. Either way the job
    first takes its cluster's default runtime when it names none (k3opt.runtime.resolve_job_runtime)."""
    from k3opt.errors import InfeasibleJobError
    from k3opt.runtime import resolve_job_runtime
    from k3opt.search import plan as search_plan
    from k3opt.search.driver import DEFAULT_GAP
    from k3opt.specs import ClusterSpec, load_cluster

    job = resolve_job_runtime(job, cluster)
    target = getattr(job, "target", None)
    if target is None:
        return search_plan(job, model=model, cluster=cluster, top=top, **kwargs)
    m = model if isinstance(model, ModelSpec) else load_model(model or job.model)
    c = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or job.cluster)
    narrowed = apply_target_limits(job, m)
    ask = top
    while True:
        res = search_plan(narrowed, model=m, cluster=c, top=ask, **kwargs)
        ok = [it for it in res.layouts if not launch_refusals(it.layout, target, m)]
        exhausted = len(res.layouts) < ask
        if len(ok) >= top or exhausted or res.status != "OPTIMAL" or ask >= 64:
            break
        ask *= 4
    if not ok:
        raise InfeasibleJobError(
            f"no layout that {target} can run was found ({len(res.layouts)} ranked layouts all break its "
            f"derived expert sharding rule dense_fsdp = ep x expert_fsdp); widen [search] or drop the target")
    res.layouts = ok[:top]
    res.pareto = [it for it in res.pareto if not launch_refusals(it.layout, target, m)]
    best = res.layouts[0].rank_time_s
    if res.status == "OPTIMAL":
        # OPTIMAL: every node the search left has a bound of at least (1 - gap) x the last ranked layout, or x its
        # own frame's ranked layout, and runnability depends on the frame alone; every ranked layout faster than
        # `best` was refused, so a runnable layout takes at least (1 - gap) x best: proven within the gap.
        res.bound = max(res.bound, best * (1 - kwargs.get("gap", DEFAULT_GAP)))
    res.gap = (best - res.bound) / best if best else 0.0
    return res


__all__ = ["FORMATS", "LIMITS", "NO_SWITCH", "SOURCES", "Launch", "Missing", "apply_target_limits",
           "check_format", "launch_refusals", "plan", "to_launch"]
