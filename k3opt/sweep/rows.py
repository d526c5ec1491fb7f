"""One sweep point planned and turned into rows: every decision of its best layouts, their times, the cost of a
token budget, peak memory per kind, status and gap; a point that fails is one row with its reason."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from k3opt.inputs.errors import K3optError
from k3opt.inputs.presets import load_cluster, load_model, load_runtime
from k3opt.inputs.specs import NO_RUNTIME, Job
from k3opt.inputs.sweep import SweepPoint
from k3opt.planner import binding_limits, limit_prices, plan
from k3opt.search.result import plan_frame

ANSWER_SETTINGS = ("top", "time_limit", "gap")
"""The settings that change a point's answer, hence its key."""
HOURS = 3600.0
DAYS = 86400.0


@dataclass(frozen=True)
class SweepSettings:
    """How every point is planned and priced. What decides a point's answer (top, time_limit, gap) is part of its
    key, so a rerun with other values solves again; threads and the prices are not: a rerun on more workers or at
    another price reuses the finished points (their price columns are recomputed, `price`)."""

    top: int = 1
    time_limit: float = 60.0
    gap: float = 0.01
    threads: int = 1
    """CP-SAT threads of each plan (with 2 or more, its bounds also run ahead in a second process)."""
    train_tokens: float = 15e12
    """The token budget the time-to-train and cost columns are for."""
    usd_per_gpu_hour: float | None = None


def _version() -> str:
    try:
        return metadata.version("k3opt")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "source"


def point_key(job: Job | None, values: dict[str, Any], settings: SweepSettings) -> str:
    """A hash of the point's job, the presets it names (model, cluster, runtime), the k3opt version and the
    settings: what makes a finished row reusable by a rerun."""
    decides = {k: v for k, v in asdict(settings).items() if k in ANSWER_SETTINGS}
    payload: dict[str, Any] = {"version": _version(), "settings": decides, "values": values}
    if job is not None:
        payload["job"] = job.model_dump(mode="json")
        try:
            cluster = load_cluster(job.cluster)
            payload["model"] = load_model(job.model).model_dump(mode="json")
            payload["cluster"] = cluster.model_dump(mode="json")
            rt = job.runtime or cluster.default_runtime
            if rt not in (None, NO_RUNTIME):
                payload["runtime"] = load_runtime(rt).model_dump(mode="json")
        except K3optError as err:
            payload["error"] = str(err)
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def point_rows(point: SweepPoint, key: str, settings: SweepSettings) -> list[dict[str, Any]]:
    """The point planned (k3opt.plan, its `top` layouts) and turned into rows; never raises for a user error: a
    point that fails is one row with status FAILED and the reason."""
    head: dict[str, Any] = {"point_key": key, "point": point.index}
    head.update({f"sweep_{k}": _cell(v) for k, v in point.values.items()})
    t0 = time.monotonic()
    if point.job is None:
        return [{**head, "status": "FAILED", "reason": point.error, "wall_s": 0.0}]
    job = point.job
    head.update({"model": job.model, "cluster": job.cluster, "context": job.context,
                 "tokens_per_update_requested": job.tokens_per_update, "reserve_gib": job.reserve_gib,
                 "precisions": _cell([p.value for p in job.precisions]), "target": job.target or ""})
    if isinstance(job.gpus, int):
        head["gpus"] = job.gpus
    try:
        res = plan(job, top=settings.top, time_limit=settings.time_limit, workers=settings.threads,
                   gap=settings.gap)
    except K3optError as err:
        return [{**head, "status": "FAILED", "reason": str(err), "wall_s": time.monotonic() - t0}]
    except Exception as err:  # noqa: BLE001 - one point's defect must not end a sweep of hundreds; it is recorded
        reason = f"internal error ({type(err).__name__}: {err}); please report it with this point's job"
        return [{**head, "status": "FAILED", "reason": reason, "wall_s": time.monotonic() - t0}]
    if job.target is not None:
        head.update(_limit_columns(job, res.layouts[0].rank_time_s, settings))
    wall = time.monotonic() - t0
    df = plan_frame(res.layouts)
    # Per-rank columns differ with PP from point to point: the worst rank's ledger stays, the rest is in explain.
    df = df[[c for c in df.columns if not (c.startswith("rank") and c[4:5].isdigit())]]
    return [price({**head, "status": res.status, "gap": res.gap, "bound_s": res.bound, "reason": "", "wall_s": wall,
                   **rec}, settings) for rec in df.to_dict("records")]


def _limit_columns(job: Job, best_s: float, settings: SweepSettings) -> dict[str, Any]:
    """A targeted point's limit prices (k3opt.planner.limit_prices): the best without the target's limits, what
    they cost together, and per binding limit the step time it saves lifted alone (`limit_<id>_saves_s`)."""
    kw = {"time_limit": settings.time_limit, "workers": settings.threads, "gap": settings.gap}
    free = plan(job.model_copy(update={"target": None}), top=1, **kw)
    out: dict[str, Any] = {"best_without_target_s": free.layouts[0].rank_time_s,
                           "limits_cost_s": best_s - free.layouts[0].rank_time_s}
    binding = binding_limits(free.layouts[0].layout, job.target, job.model)
    for p in limit_prices(job, best_s, binding, **kw) if best_s > free.layouts[0].rank_time_s else []:
        out[f"limit_{p.limit.replace('toggle:', 'toggle_')}_saves_s"] = p.saves_s
    return out


def price(row: dict[str, Any], settings: SweepSettings) -> dict[str, Any]:
    """The row with its token-budget columns at `settings`: days to train `train_tokens` at the ranked tokens/s,
    GPU-hours (GPUs held) per trillion tokens and for the budget, and their cost at `usd_per_gpu_hour`."""
    row = {**row, "train_tokens": settings.train_tokens}
    tps = row.get("ranked_tokens_per_s")
    if row.get("status") == "FAILED" or tps is None or math.isnan(tps):  # NaN: a failed point's row
        return {**row, "train_days": None, "gpu_hours_per_trillion_tokens": None, "train_gpu_hours": None,
                "train_usd": None}
    gpu_hours_per_token = row["gpus_held"] / tps / HOURS
    gpu_hours = gpu_hours_per_token * settings.train_tokens
    return {**row, "train_days": settings.train_tokens / tps / DAYS,
            "gpu_hours_per_trillion_tokens": gpu_hours_per_token * 1e12,
            "train_gpu_hours": gpu_hours,
            "train_usd": gpu_hours * settings.usd_per_gpu_hour if settings.usd_per_gpu_hour is not None else None}


def _cell(v: Any) -> Any:
    """A swept value as a CSV cell: lists joined with '+'."""
    return "+".join(map(str, v)) if isinstance(v, list) else v
