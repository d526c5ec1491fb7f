"""Text reports: the per-rank ledger table, the step-time breakdown, the validation GAP."""

from __future__ import annotations

import pandas as pd

from k3opt.cost.coefficients import RESOURCES
from k3opt.cost.evaluate import Evaluation
from k3opt.cost.ledger import ACTIVATION, OPTIMIZER, PERSISTENT
from k3opt.cost.structure import SEED_001_SAVED_VALUES_PER_TOKEN, structure_of
from k3opt.inputs.errors import K3optError
from k3opt.inputs.labels import layout_text, sharding_text, split_text, toggles_text
from k3opt.inputs.runtime import planning_runtime
from k3opt.inputs.specs import GIB, MIB, holds_graph_pool
from k3opt.search.result import plan_frame


def ledger_frame(ev: Evaluation) -> pd.DataFrame:
    """Rows: ledger terms and phase totals, GiB; columns: ranks."""
    rows: dict[str, list[float]] = {}
    for key in PERSISTENT + ACTIVATION + OPTIMIZER:
        rows[key] = [r.ledger[key] / GIB for r in ev.ranks]
    rows["= persistent"] = [r.persistent_bytes / GIB for r in ev.ranks]
    rows["= activation phase"] = [r.activation_phase_bytes / GIB for r in ev.ranks]
    rows["= optimizer phase"] = [r.optimizer_phase_bytes / GIB for r in ev.ranks]
    rows["PEAK"] = [r.peak_bytes / GIB for r in ev.ranks]
    if ev.runtime is not None:
        for key in sorted({i.key for r in ev.ranks for i in r.memory_items if i.where == "allocator"}):
            rows[f"+ {key}"] = [sum(i.bytes for i in r.memory_items if i.key == key) / GIB for r in ev.ranks]
    rows["ALLOCATED"] = [r.allocated_bytes / GIB for r in ev.ranks]
    if ev.runtime is not None:
        rows[f"+ allocator slack {100 * ev.runtime.slack:g}%"] = [
            (r.reserved_bytes - r.allocated_bytes) / GIB for r in ev.ranks]
    rows["RESERVED"] = [r.reserved_bytes / GIB for r in ev.ranks]
    if ev.runtime is not None:
        for key in [i.key for i in ev.ranks[0].memory_items if i.where == "outside"]:
            rows[f"+ {key}"] = [sum(i.bytes for i in r.memory_items if i.key == key) / GIB for r in ev.ranks]
    rows["DEVICE"] = [r.device_bytes / GIB for r in ev.ranks]
    rows["headroom"] = [r.headroom_bytes / GIB for r in ev.ranks]
    rows["in-flight microbatches"] = [r.in_flight for r in ev.ranks]
    rows["host memory"] = [r.host_bytes / GIB for r in ev.ranks]
    return pd.DataFrame(rows, index=[f"rank{r.rank}" for r in ev.ranks]).T


def time_frame(ev: Evaluation) -> pd.DataFrame:
    """Per rank: milliseconds per microbatch on each resource, and the binding one."""
    data = []
    for r in ev.ranks:
        row = {"layers": " ".join(f"{a}-{b - 1}" for a, b in r.chunks)}
        row.update({f"{res}_ms": r.time_s[res] * 1e3 for res in RESOURCES})
        row["stage_ms"] = r.stage_time_s * 1e3
        row["binds"] = r.binding
        row["update_ms"] = max(r.update_s.values()) * 1e3
        data.append(row)
    return pd.DataFrame(data, index=[f"rank{r.rank}" for r in ev.ranks])


def _fmt(df: pd.DataFrame, digits: int = 2) -> str:
    return df.to_string(float_format=lambda x: f"{x:,.{digits}f}")


def explain_text(ev: Evaluation, terms: bool = True) -> str:
    lay, p, cl = ev.layout, ev.params, ev.cluster
    # A ledger term at zero on every rank is a feature this layout or model does not use (MoonEP, the AttnRes
    # bank of a model without AttnRes): named once below the table rather than printed as a row of zeros.
    zero = [k for k in PERSISTENT + ACTIVATION + OPTIMIZER if all(r.ledger[k] == 0 for r in ev.ranks)]
    reserve = (cl.hbm_bytes - ev.capacity_bytes) / GIB
    lines = [
        f"{lay.name or 'layout'}: {ev.model.name} on {cl.name}, {lay.gpus} GPUs",
        f"  {layout_text(lay)}",
        f"  sharding dense={lay.dense_sharding.value} expert={lay.expert_sharding.value} "
        f"granularity={lay.optimizer_shard_granularity.value} grads={lay.grad_dtype.value} "
        f"optimizer state={lay.optimizer_state_dtype.value}"
        f"{' (allocated at the first step)' if lay.lazy_optimizer_state else ''}"
        + ("; params gathered per layer (Megatron-FSDP)" if lay.param_gather.value == "layer" else "")
        + (f"; weights stored in {lay.precision.value} only (fp8_param_gather)" if lay.fp8_param_gather else "")
        + (f"; the first {lay.activation_offload_layers} layers' activations offloaded to the host"
           if lay.activation_offload_layers else "")
        + (f"; offloaded to the host in every decoder layer: {', '.join(m.value for m in lay.offload_modules)} "
           "(Megatron fine-grained activation offloading)" if lay.offload_modules else "") + "; "
        f"runtime {ev.runtime.name if ev.runtime is not None else 'none (live tensors only)'}"
        + (f"; a plan on {cl.name} uses {cl.default_runtime} (--runtime {cl.default_runtime})"
           if ev.runtime is None and cl.default_runtime else ""),
        f"  parameters {p.total:,} (Muon {p.muon:,}, AdamW {p.adamw:,}); routed {p.routed:,}; "
        f"learned active matrices per token {p.active_matrix:,}",
        f"  HBM line {cl.hbm_bytes / GIB:.2f} GiB ({cl.hbm_mib:,} MiB, nvidia-smi) - reserve {reserve:.2f} GiB "
        f"= {ev.capacity_bytes / GIB:.2f} GiB usable per GPU; host {cl.host_memory_gb:g} GB per GPU",
        "",
        "Per-rank memory ledger (GiB); peak = persistent + "
        + ("activation phase + optimizer phase (the full-iteration CUDA graph's pool keeps the activation phase "
           "reserved while the optimizer step runs eagerly)"
           if holds_graph_pool(ev.layout) else
           "max(activation phase, optimizer phase)") + "; activation "
        "phase = held + max(a layer's transients, the logits)"
        + (" (together under the EP overlap schedule)" if ev.layout.ep_overlap else "") + "; "
        "ALLOCATED = peak + allocator workspaces, RESERVED = allocated x (1 + slack), DEVICE = reserved + "
        "memory outside the allocator"
        + (f" (runtime {ev.runtime.name})" if ev.runtime is not None else
           " (no runtime: live tensors only, the reserve covers the rest)"),
        _fmt(ledger_frame(ev).drop(index=list(zero))),
    ]
    if zero:
        lines.append("zero on every rank (rows left out): " + ", ".join(zero))
    lines.append("")
    worst = max(ev.ranks, key=lambda r: r.device_bytes)
    verdict = "fits" if ev.fits else "DOES NOT FIT"
    lines.append(f"worst rank {worst.rank}: allocated {worst.allocated_bytes / GIB:.2f} GiB, reserved "
                 f"{worst.reserved_bytes / GIB:.2f} GiB, device {worst.device_bytes / GIB:.2f} GiB, headroom "
                 f"{worst.headroom_bytes / GIB:.2f} GiB: {verdict}"
                 + ("" if all(r.host_fits for r in ev.ranks) else " (host memory exceeded)"))
    s = ev.step
    lines += [
        "",
        "Step time: per microbatch, work on each resource divided by its bandwidth (ms)",
        _fmt(time_frame(ev), 1),
        "",
        f"step {s.step_time_s:.3f} s = {s.slots:g} slots x {s.stage_time_s * 1e3:.1f} ms (rank {s.slowest_rank}, "
        f"{s.binding}-bound) + exposed update {s.update_time_s * 1e3:.1f} ms; serial bound "
        f"{s.serial_step_time_s:.3f} s",
        f"bubble overhead {100 * s.bubble_overhead:.2f}% of useful work, {100 * s.bubble_fraction:.2f}% of the "
        f"compute-plus-bubble interval",
        f"tokens per update {s.tokens_per_update:,}; {s.tokens_per_s:,.0f} tokens/s; "
        f"{s.tokens_per_s_per_gpu:,.1f} tokens/s per GPU; MFU {100 * s.mfu:.1f}%",
        f"MFU convention: {s.model_flops_per_token / 1e9:.2f} GFLOP per token = {s.mfu_convention}",
        "unpriced: " + "; ".join(s.unpriced),
    ]
    if lay.activation_offload_layers:
        lines.append(
            f"offload wait: the compute stream waits {s.offload_stall_s * 1e3:.1f} ms per microbatch at the peak "
            + (f"and {s.achievable_offload_stall_s * 1e3:.1f} ms at the achievable rates "
               if s.achievable_step_time_s is not None else "")
            + f"for the copies of the first {lay.activation_offload_layers} layers' activations (TransformerEngine's "
            f"default schedule: the forward of layer L - N + i waits for layer i's copy out, layer i's backward for "
            f"its copy back)")
    lines += _achievable_lines(ev)
    if ev.validation:
        lines += ["", "Validation against measurement (modeled vs measured; the GAP is what the model does not "
                      "explain, never a scale factor)"]
        for c in ev.validation:
            kind = f" [{c.kind}]" if c.kind else ""
            lines.append(f"  {c.figure}{kind}: modeled {c.modeled:,.2f} {c.unit}, measured {c.measured:,.2f} "
                         f"{c.unit}, GAP {c.gap:+,.2f} {c.unit} ({c.gap_pct:+.1f}% of measured)")
    st = structure_of(ev.model)
    kinds = sorted({b.kind for layer in st.layers for b in layer} & {"kda", "mla", "moe", "dense_ffn"})
    cross = [f"{k} {st.saved_values_per_token(k):,} ({st.saved_values_per_token(k, True):,} with fused SiTU)"
             + (f" vs seed 001 ~{SEED_001_SAVED_VALUES_PER_TOKEN[k]:,}" if k in SEED_001_SAVED_VALUES_PER_TOKEN else "")
             for k in kinds]
    lines += ["", "Saved-for-backward values per token, no recompute, derived from shapes: " + "; ".join(cross)]
    if terms:
        lines += ["", "Ledger terms"]
        for t in [t for t in ev.ranks[0].terms if t.key not in zero]:
            lines.append(f"  {t.key:<22} [{t.kind}] {t.formula}")
        if ev.runtime is not None:
            lines += ["", f"Memory beyond the ledger, rank {worst.rank} (runtime {ev.runtime.name}; "
                          f"allocator slack {ev.runtime.slack:g} of allocated)"]
            for it in worst.memory_items:
                lines.append(f"  {it.key:<22} [{it.where}] {it.bytes / MIB:,.1f} MiB: {it.formula}")
    return "\n".join(lines)


def _achievable_lines(ev) -> list[str]:  # noqa: ANN001 - Evaluation
    """The achievable-rate step time (empirical roofline) beside the peak-ceiling bound above, and the time plans
    rank the layout by where its replayed schedule is the longer (`_ranked_line`)."""
    s = ev.step
    if s.achievable_step_time_s is None:
        return ["", f"achievable step time: no rates file for {ev.cluster.name} (constraints/rates); only the "
                    "peak roofline above", *_ranked_line(s)]
    return [
        "",
        f"achievable step {s.achievable_step_time_s:.3f} s at the measured rates of '{s.rates}' "
        f"({s.achievable_binding}-bound; exposed EP all-to-all {s.achievable_exposed_ep_s * 1e3:.1f} ms per "
        f"stage-microbatch): {s.achievable_tokens_per_s_per_gpu:,.1f} tokens/s per GPU, MFU "
        f"{100 * s.achievable_mfu:.1f}%; the peak roofline {s.step_time_s:.3f} s is the optimistic bound"
        + (f"; the EP overlap schedule's unpaired microbatches expose {s.achievable_unpaired_ep_s * 1e3:.1f} ms of "
           "all-to-all per step" if s.achievable_unpaired_ep_s else ""),
        f"precision {ev.layout.precision.value}: linear GEMMs at {ev.cluster.dense_tflops(ev.layout.precision):g} "
        f"TFLOP/s dense peak; attention core, router, embedding and head at BF16",
        *_ranked_line(s),
    ]


def _ranked_line(s) -> list[str]:  # noqa: ANN001 - StepTime
    """The step time a plan ranks this layout by, where its replayed pipeline schedule is longer than the step
    formula by more than SCHEDULE_GAP_SHOWN (uneven interleaved chunks): the plan's status line and table show it."""
    if not replay_shown(s):
        return []
    formula, replay = s.formula_time_s, s.ranked_schedule_time_s
    return [f"ranked step {replay:.3f} s (what plans rank this layout by): its pipeline schedule replayed at the same "
            f"rates, {100 * (replay / formula - 1):.0f}% above the step formula's {formula:.3f} s; its uneven chunks "
            "hold the warm-up and cool-down longer than (M + (p - 1) / v) x the slowest rank prices"]


def mib(x: float) -> str:
    return f"{x / MIB:,.1f} MiB"


SCHEDULE_GAP_SHOWN = 0.02
"""Relative excess of the replayed schedule over the step formula above which the plan says that a row ranks by its
replay: a display threshold only; a row with a smaller excess ranks by its replay too, without the line."""


def replay_shown(s) -> bool:  # noqa: ANN001 - StepTime
    """Whether the replayed schedule exceeds the step formula by more than SCHEDULE_GAP_SHOWN (the plan and explain
    then say the layout ranks by its replay)."""
    return s.ranked_schedule_time_s > s.formula_time_s * (1 + SCHEDULE_GAP_SHOWN)


def schedule_gap_lines(items: list) -> list[str]:
    """A line per row ranked by its replayed pipeline schedule (StepTime.ranked_schedule_time_s) because the replay
    exceeds the step formula, (M + (p - 1) / v) x slowest rank + update, by more than SCHEDULE_GAP_SHOWN: the
    formula, which the search minimizes, under-prices that split's uneven chunks."""
    out = []
    for i, it in enumerate(items, 1):
        st = it.evaluation.step
        formula, replay = st.formula_time_s, st.ranked_schedule_time_s
        if replay_shown(st):
            out.append(f"row {i} is ranked by its replayed pipeline schedule, {replay:.2f} s, "
                       f"{100 * (replay / formula - 1):.0f}% above the step formula's {formula:.2f} s that the "
                       "search minimizes: its uneven chunks hold the warm-up and cool-down longer than "
                       "(M + (p - 1) / v) x the slowest rank prices; the search's bound is on the formula, so the "
                       "gap stays open for such shapes.")
    return [""] + out if out else []


def open_lines(plan) -> list[str]:  # noqa: ANN001 - Plan
    """Where a FEASIBLE plan's proof stopped (Plan.holding): how many shapes are still under the line, and the
    one holding the bound."""
    h = plan.holding
    if h is None:
        return []
    return [f"not proven: {plan.open_shapes:,} parallel shape{'s' if plan.open_shapes != 1 else ''} still "
            f"{'have bounds' if plan.open_shapes != 1 else 'has a bound'} under {h.line_s:.3f} s (the best less "
            f"the gap); the least, {h.bound_s:.3f} s, is the {h.kind} of {h.shape}. A longer --time-limit "
            "settles more of them."]


def _per_domain(u: int | None, d: int) -> str:
    return f"whole racks ({d} per rack)" if u is None or u == d else f"{u} of {d} GPUs per rack"


def _racks_text(racks: int, per_rack: int, used: int) -> str:
    """'8 racks x 64', or, where the GPUs used leave the last rack part-filled, '12 racks x 8 and 1 rack x 4'."""
    full, rest = divmod(used, per_rack)
    if rest == 0 or full + 1 != racks:
        return f"{racks} {'rack' if racks == 1 else 'racks'} x {per_rack}"
    return f"{full} {'rack' if full == 1 else 'racks'} x {per_rack} and 1 rack x {rest}"


def placement_lines(plan) -> list[str]:  # noqa: ANN001 - Plan
    """The best layout's placement (racks held against GPUs used, throughput per GPU used and held) and, against
    each other placement searched at its GPU count, why it was chosen."""
    ev = plan.layouts[0].evaluation
    d = ev.cluster.nvlink_domain_gpus
    used, held = ev.layout.gpus, ev.gpus_held
    per_used = ev.step.rank_tokens_per_s_per_gpu
    lines = [f"placement: {_racks_text(ev.domains_held, ev.gpus_per_domain, used)} of {d} GPUs ({used} GPUs used, "
             f"{held} held, {held - used} idle); tokens/s per GPU used {per_used:,.0f}, per GPU held "
             f"{ev.tokens_per_s_per_gpu_held:,.0f}"]
    mine = ev.layout.domain_gpus_used
    others = [o for o in plan.placements if o.domain_gpus_used != mine]
    if plan.job.domain_gpus_used is not None:
        lines.append("  pinned by the job's domain_gpus_used")
    elif not others:
        lines.append("  the only placement searched: no other GPUs-per-rack size tiles a rank block differently")
    best = plan.layouts[0].rank_time_s
    for o in others:
        why = (f"best found {o.best_s:.3f} s ({o.best_s / best - 1:+.1%})" if o.best_s is not None else
               "no layout fits" if o.bound_s == float("inf") else f"no layout found, bound {o.bound_s:.3f} s")
        racks = "rack" if o.domains_held == 1 else "racks"
        lines.append(f"  over {_per_domain(o.domain_gpus_used, d)}, {o.domains_held} {racks}: {why}")
    return lines


def front_notes(points: list) -> list[str]:
    """Why each unproven Pareto point is not proven: where its region's search stopped, or that no search ran under
    its region's cap before the time limit (its bound is then a wider region's, or its shapes')."""
    out = []
    for n, it in enumerate(points, start=1):
        if it.proven:
            continue
        if it.front_holding:
            out.append(f"point {n} not proven: its region's search stopped at {it.front_holding}")
        elif not it.front_searched:
            out.append(f"point {n} not proven: its region (peak <= {it.front_cap_bytes / GIB:.2f} GiB) was not "
                       f"searched before the time limit, so its bound {it.front_bound_s:.3f} s comes from a wider "
                       "region or its shapes' bounds; a longer --time-limit searches it")
    return out


def ranked_columns(df: pd.DataFrame) -> pd.DataFrame:
    """plan_frame's rows as the tables show them: where a row has achievable rates, its achievable step time and
    tokens/s per GPU are the ranked ones (the larger of the step formula and the replayed schedule, what the plan
    ranks by and its status line prints); the CSV and JSON keep both columns apart."""
    out = df.copy()
    if "achievable_step_time_s" in out and len(out):
        has = out["achievable_step_time_s"].notna()
        out.loc[has, "achievable_step_time_s"] = out.loc[has, "ranked_step_time_s"]
        if "achievable_tokens_per_s_per_gpu" in out:
            out.loc[has, "achievable_tokens_per_s_per_gpu"] = out.loc[has, "ranked_tokens_per_s_per_gpu"]
    return out


def plan_text(plan, show_ledger: int | None = None) -> str:  # noqa: ANN001 - Plan
    job = plan.job
    gpus = ", ".join(str(g) for g in job.gpu_counts)
    rates = plan.layouts[0].evaluation.step.rates
    ranked = f"(achievable, rates '{rates}')" if rates else "(peak roofline: no rates file)"
    lines = [
        f"{job.name or 'job'}: {job.model} on {gpus} {job.cluster} GPUs, context {job.context}, rows {job.rows}, "
        f"tokens per update {job.tokens_per_update or 'from [search] microbatches'}, reserve {job.reserve_gib:g} GiB",
        planning_runtime(job, plan.layouts[0].evaluation.cluster).line(),
        f"status {plan.status}: best {plan.layouts[0].rank_time_s:.3f} s {ranked}, bound {plan.bound:.3f} s, "
        f"gap {100 * plan.gap:.2f}%; {plan.frames_solved} CP-SAT models solved of {plan.frames_total} parallel "
        f"shapes in {plan.solve_time_s:.1f} s " + (
            f"(largest model {plan.model_size.get('variables', 0):,} variables, "
            f"{plan.model_size.get('constraints', 0):,} constraints)" if plan.frames_solved else
            "(the heuristic layouts and the bounds settled every shape)" if plan.status == "OPTIMAL" else
            "(no CP-SAT model solved; the bounds did not settle every shape)"),
        *open_lines(plan),
        *placement_lines(plan),
        "",
    ]
    df = ranked_columns(plan_frame(plan.layouts))
    cols = {
        "rank": "#", "pp": "PP", "vp": "VP", "cp": "CP", "ep": "EP", "expert_fsdp": "eFSDP",
        "dense_fsdp": "dFSDP", "microbatches": "M", "split_layers": "split", "recompute": "recompute",
        "achievable_step_time_s": "achievable_s", "step_time_s": "step_s",
        "ranked_tokens_per_s": "tokens/s", "ranked_mfu_pct": "MFU%", "peak_gib": "live_GiB",
        "peak_device_gib": "device_GiB", "headroom_gib": "headroom_GiB", "binding_resource": "binds",
        "runs_on": "runs_on",
    }
    if rates:
        df["binding_resource"] = df["achievable_binding_resource"]
    else:
        del cols["achievable_step_time_s"]  # no rates file: step_s, the peak roofline, is the ranked time
    table = df[list(cols)].rename(columns=cols)
    table["tokens/s"] = table["tokens/s"].round().astype(int)
    table["split"] = [split_text(it.layout.split) for it in plan.layouts]
    # The searched sharding (dense/expert policy, gradient dtype) and compute precision.
    table["sharding"] = [sharding_text(it.layout) for it in plan.layouts]
    table["precision"] = [it.layout.precision.value + (" params" if it.layout.fp8_param_gather else "")
                          for it in plan.layouts]
    table["toggles"] = [toggles_text(it.layout) for it in plan.layouts]
    lines.append(table.to_string(index=False, float_format=lambda x: f"{x:,.2f}"))
    lines.append("")
    lines.append("Every row is re-evaluated with evaluate(); layouts are distinct parallel shapes (PP, VP, CP, EP, "
                 "FSDP degrees, M, sharding policies, gradient dtype, precision"
                 + (", EP overlap schedule" if job.ep_overlap else "") + "), each with its best split, "
                 "recompute mode and toggles. "
                 + ("Ranked by achievable_s (roofline plus bubble at the cluster's achievable rates, or the pipeline "
                    "schedule replayed at those rates where that is longer; step_s, the peak roofline, is the "
                    "optimistic bound beside it); " if rates else
                    f"Ranked by step_s, the peak roofline plus bubble: the cluster '{job.cluster}' has no rates "
                    "file, so no achievable step time; ")
                 + "tokens/s, MFU% and "
                 "binds are at the ranked time. Ties in step time go to the lower worst-rank peak. "
                 "live_GiB: the ledger's live tensors; device_GiB: + workspaces, "
                 "allocator slack and memory outside the allocator (the job's runtime); headroom = HBM - reserve - "
                 "device."
                 + (" precision 'fp8 params' / 'mxfp8 params': the weights are stored in that precision only "
                    "(Megatron --fp8-param-gather under its distributed optimizer; no BF16 copy)."
                    if any(it.layout.fp8_param_gather for it in plan.layouts) else ""))
    lines += schedule_gap_lines(plan.layouts)
    if show_ledger is not None:
        if not 1 <= show_ledger <= len(plan.layouts):
            raise K3optError(f"--show-ledger {show_ledger}: the plan has layouts 1..{len(plan.layouts)}")
        lines += ["", explain_text(plan.layouts[show_ledger - 1].evaluation, terms=False)]
    return "\n".join(lines)


def sweep_table(df: pd.DataFrame) -> str:
    """A sweep's output, one line per point: its swept values, status, gap, best layout, ranked step time,
    tokens/s per GPU held and days to train (or the reason it failed)."""
    if df.empty:
        return "(no points)"
    best = df[df["rank"].isna() | (df["rank"] == 1)] if "rank" in df.columns else df
    swept = [c for c in best.columns if c.startswith("sweep_")]
    lines = []
    for _, r in best.sort_values("point").iterrows():
        values = " ".join(f"{c.removeprefix('sweep_')}={r[c]}" for c in swept)
        if r["status"] == "FAILED":
            lines.append(f"{values}: FAILED: {r['reason']}")
            continue
        lay = (f"PP{int(r['pp'])} VP{int(r['vp'])} CP{int(r['cp'])} EP{int(r['ep'])} eFSDP{int(r['expert_fsdp'])} "
               f"dFSDP{int(r['dense_fsdp'])} M{int(r['microbatches'])} {r['recompute']}")
        lines.append(f"{values}: {r['status']} gap {100 * r['gap']:.2f}%, {lay}, {r['ranked_step_time_s']:.3f} s, "
                     f"{r['ranked_tokens_per_s_per_gpu_held']:,.0f} tokens/s per GPU held, "
                     f"{r['train_days']:.1f} days for {r['train_tokens']:.3g} tokens")
    return "\n".join(lines)
