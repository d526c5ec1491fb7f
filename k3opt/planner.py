"""The public k3opt.plan and k3opt.pareto: one entry that resolves the job's runtime and launch target for every
caller (the CLI, launch scripts, the benchmarks), then runs the search (k3opt.search.plan). `plan` returns when
the ranked search is done; `pareto` also builds the front over (step time, worst-rank peak)."""

from __future__ import annotations

from typing import Any

from k3opt.inputs.errors import InfeasibleJobError
from k3opt.inputs.placement import resolve_placement
from k3opt.inputs.presets import load_cluster, load_model
from k3opt.inputs.runtime import resolve_job_runtime
from k3opt.inputs.specs import ClusterSpec, Job, ModelSpec
from k3opt.launch import apply_target_limits, launch_refusals
from k3opt.search import plan as search_plan
from k3opt.search.driver import DEFAULT_GAP
from k3opt.search.progress import ProgressFn
from k3opt.search.result import Plan


def plan(job: Job, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None, top: int = 5,
         *, time_limit: float = 60.0, workers: int = 2, progress: ProgressFn | None = None,
         gap: float = DEFAULT_GAP) -> Plan:
    """The `top` fastest layouts of `job` that fit every rank, best first, with the proven bound and gap; returns
    as soon as the ranked search is proven to `gap` (or at `time_limit`). `Plan.pareto` is empty: the front is
    k3opt.pareto. `progress`, when given, is called with a search.progress.Progress snapshot as the search moves."""
    return _run(job, model, cluster, top, dict(time_limit=time_limit, workers=workers, pareto=False,
                                               progress=progress, gap=gap))


def pareto(job: Job, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None, top: int = 5,
           *, time_limit: float = 60.0, workers: int = 2, step_gib: float = 1.0, progress: ProgressFn | None = None,
           gap: float = DEFAULT_GAP) -> Plan:
    """The ranked layouts and the Pareto front of `job` over (step time, worst-rank peak) at a `step_gib` epsilon
    step (search/front.py): `Plan.pareto`, each point with its proven front bound, and `Plan.pareto_complete` when
    every point is proven. The ranked search gets a share of `time_limit` and the front the rest."""
    return _run(job, model, cluster, top, dict(time_limit=time_limit, workers=workers, pareto=True,
                                               pareto_step_gib=step_gib, progress=progress, gap=gap))


def _run(job: Job, model: ModelSpec | str | None, cluster: ClusterSpec | str | None, top: int,
         kwargs: dict[str, Any]) -> Plan:
    """The search of `job` after it takes its cluster's default runtime when it names none
    (k3opt.inputs.runtime.resolve_job_runtime).

    With a launch target the job is narrowed by apply_target_limits, and frames that break a coupled rule the
    [search] lists cannot express (the derived expert sharding degree) are dropped from the ranking. The ranked
    search keeps one layout per frame, and whether a frame is runnable depends only on its degrees once the toggles
    are narrowed, so asking for more frames and filtering keeps the optimum among runnable layouts; the request
    grows until `top` runnable ones are found or the search runs out of frames."""
    m = model if isinstance(model, ModelSpec) else load_model(model or job.model)
    c = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or job.cluster)
    job = resolve_placement(resolve_job_runtime(job, c), m, c)
    target = getattr(job, "target", None)
    if target is None:
        return search_plan(job, model=m, cluster=c, top=top, **kwargs)
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
    gap = kwargs["gap"]
    if res.status == "OPTIMAL":
        # OPTIMAL: every node the search left has a bound of at least (1 - gap) x the last ranked layout, or x its
        # own frame's ranked layout, and runnability depends on the frame alone; every ranked layout faster than
        # `best` was refused, so a runnable layout takes at least (1 - gap) x best: proven within the gap.
        res.bound = max(res.bound, best * (1 - gap))
    res.gap = (best - res.bound) / best if best else 0.0
    return res
