"""What the lab's page draws, as JSON built from evaluate() and the plan: the per-rank ledger as stacked segments
against the HBM and reserve lines, the seconds per microbatch per rank and resource with the binding one marked,
the pipeline timeline as the ranked step time replays it, and plans as rows a click loads into the explorer.
Every number comes from the cost model's own objects; nothing is recomputed here."""

from __future__ import annotations

import math
from typing import Any

from k3opt.cost.coefficients import RESOURCES
from k3opt.cost.evaluate import Evaluation
from k3opt.cost.ledger import ACTIVATION, OPTIMIZER, PERSISTENT
from k3opt.inputs.labels import degrees_text, split_text, toggles_text
from k3opt.inputs.specs import GIB, TOGGLE_NAMES, Layout
from k3opt.report.plots import pipeline_schedule
from k3opt.report.text import ledger_frame, time_frame
from k3opt.search.progress import Progress
from k3opt.search.result import Plan, PlanItem, front_frame, plan_frame
from k3opt.serve.forms import MODULE_CONTROLS

TIMELINE_MAX_OPS = 20_000
"""Operations the page draws in one timeline (PP x VP x M x 2); beyond it the browser takes seconds to draw, and
`k3opt explain --timeline` draws the picture instead."""


def form_of(layout: Layout, runtime: str | None) -> dict[str, Any]:
    """The explorer's control values for `layout` (what a click on a plan row or a front point loads)."""
    data = layout.model_dump(mode="json")
    out = {k: data[k] for k in ("gpus", "pp", "vp", "cp", "ep", "expert_fsdp", "dense_fsdp", "microbatches", "rows",
                                "context", "reserve_gib", "recompute", "fsdp_lifecycle", "dense_sharding",
                                "expert_sharding", "grad_dtype", "optimizer_state_dtype", "precision",
                                "param_gather", "cuda_graph_impl")}
    out["activation_offload_layers"] = layout.activation_offload_layers or ""
    out["domain_gpus_used"] = layout.domain_gpus_used or ""
    out["mtp_layers"] = "" if layout.mtp_layers is None else layout.mtp_layers
    out["optimizer_state_dtype"] = out["optimizer_state_dtype"] or "model"
    out["cuda_graph_impl"] = out["cuda_graph_impl"] or "unstated"
    out["fp8_param_gather"] = "on" if layout.fp8_param_gather else "off"
    out["split"] = split_text(layout.split)
    out["pipeline_layout"] = layout.pipeline_layout or ""
    for k in MODULE_CONTROLS:
        out[k] = ", ".join(m.value for m in getattr(layout, k))
    out["toggles"] = {t: bool(getattr(layout.toggles, t)) for t in TOGGLE_NAMES}
    out.update(model=layout.model, cluster=layout.cluster, runtime=runtime or "none")
    return out


def _ledger_segments(ev: Evaluation) -> list[dict[str, Any]]:
    """Stack order of the bars: persistent terms, activation-phase terms, then what the allocated, reserved and
    device measurements add above the ledger's peak (live tensors)."""
    ranks = ev.ranks
    segs: list[dict[str, Any]] = []
    for k in PERSISTENT + ACTIVATION:
        if any(r.ledger[k] for r in ranks):
            segs.append({"key": k, "group": "persistent" if k in PERSISTENT else "activation phase",
                         "gib": [r.at_peak(k) / GIB for r in ranks],
                         "formula": next(t.formula for t in ranks[0].terms if t.key == k)})
    # The ledger's peak is persistent + max(activation, optimizer phase), or both under a full-iteration CUDA graph
    # (ledger.rank_peak): what it holds beyond the activation phase is drawn so the stack reaches the peak.
    extra = [(r.peak_bytes - r.persistent_bytes - r.activation_phase_bytes) / GIB for r in ranks]
    if any(extra):
        segs.append({"key": "optimizer phase beyond the activation phase", "group": "optimizer phase", "gib": extra,
                     "formula": " + ".join(OPTIMIZER)})
    if ev.runtime is not None:
        for key, lo, hi, what in (("allocated", "peak_bytes", "allocated_bytes", "workspaces in the allocator"),
                                  ("reserved", "allocated_bytes", "reserved_bytes", "allocator slack"),
                                  ("device", "reserved_bytes", "device_bytes", "memory outside the allocator")):
            segs.append({"key": f"{key}: + {what}", "group": key,
                         "gib": [(getattr(r, hi) - getattr(r, lo)) / GIB for r in ranks], "formula": what})
    return segs


def _timeline(ev: Evaluation) -> dict[str, Any]:
    lay = ev.layout
    p, v, m = lay.pp, lay.vp, lay.microbatches
    n_ops = 2 * p * v * m
    if n_ops > TIMELINE_MAX_OPS:
        return {"ops": [], "note": f"{n_ops:,} operations: too many to draw here; `k3opt explain LAYOUT --timeline "
                                   f"FILE.png` draws them"}
    per = ev.step.ranked_chunk_s
    ops = pipeline_schedule(p, v, m, [[per[r + k * p][0] for k in range(v)] for r in range(p)],
                            [[per[r + k * p][1] for k in range(v)] for r in range(p)])
    return {"ops": [[o.rank, o.kind, o.chunk, o.microbatch, o.start, o.end] for o in ops], "note": ""}


EXPOSED_EP = "ep_all_to_all (exposed)"


def _time(ev: Evaluation) -> dict[str, Any]:
    """Milliseconds per stage-microbatch per rank and resource, as the plan ranks them: at the achievable rates
    when the cluster has a rates file (each resource's overlapped work, then the exposed all-to-all that adds to
    the largest), else at the peak roofline (explain's step-time table)."""
    st, ranks = ev.step, [f"rank {r.rank}" for r in ev.ranks]
    if st.achievable_rank_stage_s:
        ex = st.achievable_rank_exposed_ep_s
        res = list(st.achievable_rank_stage_s[0])
        ms = {k: [1e3 * (t[k] - e) for t, e in zip(st.achievable_rank_stage_s, ex, strict=True)] for k in res}
        ms[EXPOSED_EP] = [1e3 * e for e in ex]
        stage = [1e3 * max(t.values()) for t in st.achievable_rank_stage_s]
        return {"ranks": ranks, "resources": [*res, EXPOSED_EP], "ms": ms, "stage_ms": stage,
                "binding": list(st.achievable_rank_binding), "slowest_rank": st.achievable_slowest_rank,
                "rates": f"achievable rates '{st.rates}'"}
    tf = time_frame(ev)
    return {"ranks": ranks, "resources": list(RESOURCES),
            "ms": {k: [r.time_s[k] * 1e3 for r in ev.ranks] for k in RESOURCES},
            "stage_ms": [float(x) for x in tf["stage_ms"]], "binding": [r.binding for r in ev.ranks],
            "slowest_rank": st.slowest_rank, "rates": "peak roofline"}


def ledger_table(ev: Evaluation) -> dict[str, Any]:
    """`k3opt explain`'s ledger table (GiB per rank, two decimals): the same rows and the same figures."""
    df = ledger_frame(ev)
    return {"columns": list(df.columns),
            "rows": [[str(idx)] + [f"{x:,.2f}" for x in row] for idx, row in zip(df.index, df.to_numpy(),
                                                                                  strict=True)]}


def evaluation_view(ev: Evaluation) -> dict[str, Any]:
    """Everything the explorer draws for one layout."""
    st = ev.step
    return {
        "summary": {
            "layout": degrees_text(ev.layout), "split": split_text(ev.layout.split),
            "toggles": toggles_text(ev.layout), "model": ev.model.name, "cluster": ev.cluster.name,
            "runtime": ev.runtime.name if ev.runtime is not None else "none (live tensors only)",
            "rank_time_s": st.rank_time_s, "step_time_s": st.step_time_s,
            "achievable_step_time_s": st.achievable_step_time_s, "binding": st.achievable_binding or st.binding,
            "slowest_rank": st.achievable_slowest_rank if st.rates else st.slowest_rank,
            "bubble_fraction": st.bubble_fraction,
            "tokens_per_s_per_gpu": st.rank_tokens_per_s_per_gpu, "mfu": st.achievable_mfu or st.mfu,
            "peak_device_gib": ev.peak_device_bytes / GIB, "peak_gib": ev.peak_bytes / GIB,
            "capacity_gib": ev.capacity_bytes / GIB, "hbm_gib": ev.cluster.hbm_bytes / GIB,
            "headroom_gib": ev.headroom_bytes / GIB, "fits": ev.fits, "worst_rank": ev.worst_rank,
            "gpus_held": ev.gpus_held, "gpus_per_domain": ev.gpus_per_domain, "domains_held": ev.domains_held,
        },
        "ledger": {"ranks": [f"rank {r.rank}" for r in ev.ranks], "segments": _ledger_segments(ev),
                   "device_gib": [r.device_bytes / GIB for r in ev.ranks],
                   "fits": [r.fits and r.host_fits for r in ev.ranks],
                   "hbm_gib": ev.cluster.hbm_bytes / GIB, "capacity_gib": ev.capacity_bytes / GIB},
        "time": _time(ev),
        "timeline": {"pp": ev.layout.pp, "vp": ev.layout.vp, "microbatches": ev.layout.microbatches,
                     **_timeline(ev)},
        "table": ledger_table(ev),
    }


def _item(i: int, it: PlanItem) -> dict[str, Any]:
    ev = it.evaluation
    return {"index": i, "layout": degrees_text(it.layout), "split": split_text(it.layout.split),
            "recompute": it.layout.recompute.value, "rank_time_s": it.rank_time_s,
            "peak_device_gib": ev.peak_device_bytes / GIB, "peak_gib": ev.peak_bytes / GIB,
            "headroom_gib": ev.headroom_bytes / GIB, "binding": ev.step.achievable_binding or ev.step.binding,
            "toggles": toggles_text(it.layout),
            "runs_on": None if it.runs_on is None else list(it.runs_on),
            "front_bound_s": it.front_bound_s, "front_gap": it.front_gap, "proven": it.proven,
            "form": form_of(it.layout, it.layout.runtime)}


def plan_view(res: Plan) -> dict[str, Any]:
    """The ranked layouts and the front of a finished plan, each a row the page can load."""
    return {"status": res.status, "bound_s": res.bound if math.isfinite(res.bound) else None, "gap": res.gap,
            "solve_time_s": res.solve_time_s, "layouts": [_item(i, it) for i, it in enumerate(res.layouts)],
            "pareto": [_item(i, it) for i, it in enumerate(res.pareto)],
            "pareto_complete": res.pareto_complete}


def progress_view(p: Progress) -> dict[str, Any]:
    return {"phase": p.phase, "elapsed_s": p.elapsed_s, "incumbent_s": p.incumbent_s, "bound_s": p.bound_s,
            "gap": p.gap, "shapes_settled": p.shapes_settled, "shapes_total": p.shapes_total,
            "models_solved": p.models_solved, "front_points": p.front_points, "line": p.line()}


def plan_csv(res: Plan, pareto: bool) -> str:
    """The plan's CSV as the CLI writes it: `k3opt pareto --csv` for a front, plan_frame's rows otherwise."""
    return (front_frame(res.pareto) if pareto else plan_frame(res.layouts)).to_csv(index=False)
