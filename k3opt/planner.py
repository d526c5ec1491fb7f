"""The public k3opt.plan and k3opt.pareto: one entry that resolves the job's runtime and launch target for every
caller (the CLI, launch scripts, the benchmarks), then runs the search (k3opt.search.plan). `plan` returns when
the ranked search is done; `pareto` also builds the front over (step time, worst-rank peak)."""

from __future__ import annotations

import time as _time
from dataclasses import dataclass, replace
from typing import Any

from k3opt.inputs.errors import InfeasibleJobError, SearchTimeoutError, SpecError
from k3opt.inputs.placement import resolve_placement
from k3opt.inputs.presets import load_cluster, load_model
from k3opt.inputs.runtime import resolve_job_runtime
from k3opt.inputs.specs import GIB, ClusterSpec, Job, Layout, ModelSpec, trained_model
from k3opt.inputs.toggles import inapplicable
from k3opt.launch import FORMATS, apply_target_limits, degree_refusals, launch_refusals, limit_text, refusals
from k3opt.search import plan as search_plan
from k3opt.search.driver import DEFAULT_GAP
from k3opt.search.frames import Frame
from k3opt.search.progress import ProgressFn
from k3opt.search.result import Plan, PlanItem

MIN_TIME_LIMIT_S = 0.1
"""The least time limit a search is given, and the least --time-limit the CLI accepts: a limit used up by a wider
request or a command's start-up starts the search with this, never with a zero or negative limit."""


def plan(job: Job, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None, top: int = 5,
         *, time_limit: float = 60.0, workers: int = 2, progress: ProgressFn | None = None,
         gap: float = DEFAULT_GAP, lifted: frozenset[str] = frozenset()) -> Plan:
    """The `top` fastest layouts of `job` that fit every rank, best first, with the proven bound and gap; returns
    as soon as the ranked search is proven to `gap` (or at `time_limit`). `Plan.pareto` is empty: the front is
    k3opt.pareto. `progress`, when given, is called with a search.progress.Progress snapshot as the search moves.
    `lifted`: limit ids of the job's target (k3opt.launch.refusals) left out, to price them (`limit_prices`)."""
    return _run(job, model, cluster, top, dict(time_limit=time_limit, workers=workers, pareto=False,
                                               progress=progress, gap=gap), lifted)


def pareto(job: Job, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None, top: int = 5,
           *, time_limit: float = 60.0, workers: int = 2, step_gib: float = 1.0, progress: ProgressFn | None = None,
           gap: float = DEFAULT_GAP) -> Plan:
    """The ranked layouts and the Pareto front of `job` over (step time, worst-rank peak) at a `step_gib` epsilon
    step (search/front.py): `Plan.pareto`, each point with its proven front bound, and `Plan.pareto_complete` when
    every point is proven. The ranked search gets a share of `time_limit` and the front the rest."""
    return _run(job, model, cluster, top, dict(time_limit=time_limit, workers=workers, pareto=True,
                                               pareto_step_gib=step_gib, progress=progress, gap=gap))


@dataclass(frozen=True)
class LimitPrice:
    """What one launch-target limit costs: the best step time with every limit of the target against the best
    with this one lifted alone."""

    limit: str
    """Its id (k3opt.launch.refusals): vp, cp, expert_fsdp, fsdp_lifecycle, param_gather, offload_modules,
    precision or toggle:NAME."""
    text: str
    best_s: float | None
    """The best ranked step time with this limit lifted (None: nothing runnable was found even so)."""
    saves_s: float | None
    """Step time it would save: best with every limit - best_s."""
    proven: bool = True
    """The lifted search ended OPTIMAL (else best_s is only the best it found: the saving is at least saves_s)."""
    priced: bool = True
    """False: no time was left to search it."""

    def line(self) -> str:
        what = f"{self.limit.removeprefix('toggle:')} has no switch" if self.limit.startswith("toggle:") \
            else f"{self.limit} limited"
        if not self.priced:
            return f"{what}: not priced, the time limit was spent (raise --time-limit) ({self.text})"
        if not self.proven and self.saves_s is not None and self.saves_s >= 5e-4:
            return f"{what}: at least {-self.saves_s:+.3f} s per step lifted alone (search cut by the time limit) " \
                   f"({self.text})"
        if self.saves_s is None:
            if not self.proven:
                return f"{what}: lifting it alone found no runnable layout within its time ({self.text})"
            return f"{what}: lifting it alone finds no runnable layout ({self.text})"
        if self.saves_s < 5e-4:  # under half the printed resolution (0.001 s): it would print as -0.000 s
            return f"{what}: saves nothing lifted alone, it pays only with other limits lifted ({self.text})"
        return f"{what}: {-self.saves_s:+.3f} s per step lifted alone ({self.text})"


def binding_limits(best_free: Layout, target: str, model: ModelSpec | str | None = None) -> list[str]:
    """The ids of the limits of `target` that the best layout without its limits breaks: those that bind."""
    m = model if isinstance(model, ModelSpec) else load_model(model or best_free.model or "kimi-k3")
    return list(dict.fromkeys(k for k, _ in refusals(best_free, target, m)))


def limit_price(job: Job, best_s: float, limit: str, model: ModelSpec | str | None = None,
                cluster: ClusterSpec | str | None = None, *, time_limit: float = 60.0, workers: int = 2,
                gap: float = DEFAULT_GAP, progress: ProgressFn | None = None) -> LimitPrice:
    """One limit of job.target priced: the job re-planned with `limit` lifted alone, against `best_s`, the best
    with every limit."""
    if job.target is None:
        raise SpecError("a limit price needs a job with a launch target; set `target` or pass --target")
    proven = True
    try:
        res = plan(job, model, cluster, top=1, time_limit=time_limit, workers=workers, gap=gap,
                   lifted=frozenset({limit}), progress=progress)
        t: float | None = res.layouts[0].rank_time_s
        proven = res.status == "OPTIMAL"
    except SearchTimeoutError:
        t, proven = None, False
    except InfeasibleJobError:
        t = None
    return LimitPrice(limit, limit_text(job.target, limit), t, None if t is None else best_s - t, proven)


def limit_prices(job: Job, best_s: float, binding: list[str], model: ModelSpec | str | None = None,
                 cluster: ClusterSpec | str | None = None, **kwargs: Any) -> list[LimitPrice]:
    """Every binding limit priced alone (`limit_price`), largest saving first. The prices need not add up to the
    cost of all the limits together: the best layout without them may need two lifted at once."""
    m = model if isinstance(model, ModelSpec) else load_model(model or job.model)
    out = [limit_price(job, best_s, lim, m, cluster, **kwargs) for lim in binding]
    return sorted(out, key=lambda p: -(p.saves_s or 0.0))


def _model_toggles(job: Job, model: ModelSpec) -> Job:
    """Toggles that act on what `model` lacks (k3opt.inputs.toggles.Needs: MoE layers, a SiTU-GLU FFN, Muon
    matrices) price nothing there, so they are no decision: the search leaves them off, which keeps them out of the
    plan's toggles and its launch refusals. A job that requires one is told so."""
    lacking = [(name, why) for name, why in inapplicable(model) if name not in job.search.forbid_toggles]
    for name, why in lacking:
        if name in job.search.require_toggles:
            raise SpecError(f"[search] require_toggles lists {name}, but {why}: remove it")
    if not lacking:
        return job
    search = job.search.model_copy(update={"forbid_toggles": [*job.search.forbid_toggles, *(n for n, _ in lacking)]})
    return job.model_copy(update={"search": search})


def _run(job: Job, model: ModelSpec | str | None, cluster: ClusterSpec | str | None, top: int,
         kwargs: dict[str, Any], lifted: frozenset[str] = frozenset()) -> Plan:
    """The search of `job` after it takes its cluster's default runtime when it names none
    (k3opt.inputs.runtime.resolve_job_runtime).

    With a launch target the job is narrowed by apply_target_limits, the frames that break a rule of the degrees
    alone that the [search] lists cannot express (the derived expert sharding degree; k3opt.launch.degree_refusals)
    are left out of the search, and ranked layouts that break a rule of the degrees and the node (the AdamW gather
    under Megatron-FSDP) are dropped from the ranking. The ranked search keeps one layout per frame, and whether a
    frame is runnable depends only on its degrees once the toggles are narrowed, so asking for more frames and
    filtering keeps the optimum among runnable layouts; the request grows until `top` runnable ones are found or
    the search runs out of frames."""
    m = trained_model(job, model if isinstance(model, ModelSpec) else load_model(model or job.model))
    c = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or job.cluster)
    if job.reserve_gib * GIB >= c.hbm_bytes:
        raise SpecError(f"reserve_gib = {job.reserve_gib:g} leaves nothing of {c.name}'s {c.hbm_bytes / GIB:.2f} GiB "
                        "of HBM per GPU: lower it")
    job = _model_toggles(resolve_placement(resolve_job_runtime(job, c), m, c), m)
    target = getattr(job, "target", None)
    if target is None:
        return _with_targets(search_plan(job, model=m, cluster=c, top=top, **kwargs), m)
    narrowed = apply_target_limits(job, m, lifted)

    def refuse(f: Frame) -> list[str]:
        return [why for _, why in degree_refusals(f, target, m, lifted)]

    ask = top
    # The wider requests share the one time limit: each gets what the ones before it left.
    deadline = _time.monotonic() + kwargs["time_limit"]
    kept: tuple[Plan, list[PlanItem]] | None = None
    while True:
        res = search_plan(narrowed, model=m, cluster=c, top=ask, refuse=refuse,
                          **{**kwargs, "time_limit": max(deadline - _time.monotonic(), MIN_TIME_LIMIT_S)})
        ok = [it for it in res.layouts if not launch_refusals(it.layout, target, m, lifted)]
        # A wider request starts again with what time is left: where it returns fewer runnable layouts, or a
        # slower best, the earlier answer stands.
        if kept is not None and (len(ok) < len(kept[1]) or (ok and kept[1]
                                                            and ok[0].rank_time_s > kept[1][0].rank_time_s)):
            res, ok = kept
            break
        kept = (res, ok)
        exhausted = len(res.layouts) < ask
        # Past OPTIMAL a wider request costs another search; it is made only while nothing runnable is found. The
        # front is the answer of a pareto request, and a wider one would start it again: it is made once.
        if len(ok) >= top or exhausted or (res.status != "OPTIMAL" and ok) or ask >= 64 \
                or _time.monotonic() >= deadline or kwargs.get("pareto"):
            break
        ask *= 4
    if not ok:
        raise InfeasibleJobError(
            f"no layout that {target} can run was found ({len(res.layouts)} ranked layouts all break a rule "
            f"the [search] lists cannot express: its derived expert sharding degree dense_fsdp = ep x expert_fsdp, "
            f"or its parameter gather for optim_grads_params); widen [search] or drop the target")
    res.layouts = ok[:top]
    res.pareto = [it for it in res.pareto if not launch_refusals(it.layout, target, m, lifted)]
    best = res.layouts[0].rank_time_s
    gap = kwargs["gap"]
    if res.status == "OPTIMAL":
        # OPTIMAL: every node the search left has a bound of at least (1 - gap) x the last ranked layout, or x its
        # own frame's ranked layout, and runnability depends on the frame alone; every ranked layout faster than
        # `best` was refused, so a runnable layout takes at least (1 - gap) x best: proven within the gap.
        res.bound = max(res.bound, best * (1 - gap))
    res.gap = (best - res.bound) / best if best else 0.0
    return _with_targets(res, m)


def _with_targets(res: Plan, model: ModelSpec) -> Plan:
    """Each ranked and front layout with the launch targets that can run it (PlanItem.runs_on)."""
    def mark(it: PlanItem) -> PlanItem:
        return replace(it, runs_on=tuple(t for t in FORMATS if not launch_refusals(it.layout, t, model)))

    res.layouts = [mark(it) for it in res.layouts]
    res.pareto = [mark(it) for it in res.pareto]
    return res
