"""Pictures: the per-rank memory ledger against the HBM line, the Pareto front, the pipeline timeline.

matplotlib with the Agg backend (files only, no display). Every number drawn comes from evaluate() or from
the plan; the timeline's schedule generator lives here (pipeline_schedule) and replays Megatron's 1F1B and
interleaved-1F1B operation order per rank with the cost model's per-microbatch stage times.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from k3opt.cost.evaluate import Evaluation  # noqa: E402
from k3opt.cost.ledger import ACTIVATION, OPTIMIZER, PERSISTENT
from k3opt.cost.schedule import BACKWARD_OVER_FORWARD, replay_ops  # noqa: E402
from k3opt.inputs.errors import LayoutError, SpecError  # noqa: E402
from k3opt.inputs.labels import degrees_text  # noqa: E402
from k3opt.inputs.specs import GIB, holds_graph_pool  # noqa: E402

FORWARD_SHARE = 1 / (1 + BACKWARD_OVER_FORWARD)
"""Forward share of a microbatch's stage time in the timeline, from the schedule module's backward / forward
ratio (drawing only; the step time is the cost model's)."""


def _save(fig: plt.Figure, path: str | Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# -------------------------------------------------------------------------------- ledger bars


def ledger_plot(ev: Evaluation, path: str | Path) -> None:
    """Stacked per-rank bars: persistent terms, then the activation-phase terms live at its peak; a tick marks
    persistent + optimizer phase (peak = persistent + max of the two phases; + both under a full-iteration CUDA
    graph). Lines: HBM capacity and the usable share
    after the reserve."""
    ranks = list(ev.ranks)
    x = list(range(len(ranks)))
    keys = [k for k in PERSISTENT + ACTIVATION if any(r.ledger[k] for r in ranks)]
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(ranks) + 4), 5.5))
    bottom = [0.0] * len(ranks)
    for i, k in enumerate(keys):
        vals = [r.at_peak(k) / GIB for r in ranks]
        hatch = "" if k in PERSISTENT else "//"
        where = "persistent" if k in PERSISTENT else "activation phase" if any(vals) else \
            "activation phase, not live at its peak"
        ax.bar(x, vals, bottom=bottom, color=cmap(i % 20), hatch=hatch, edgecolor="white", linewidth=0.4,
               label=f"{k} ({where})")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    # Under a full-iteration CUDA graph the optimizer phase comes on top of the activation phase (ledger.rank_peak).
    pool = holds_graph_pool(ev.layout)
    opt = [(r.persistent_bytes + r.optimizer_phase_bytes + (r.activation_phase_bytes if pool else 0)) / GIB
           for r in ranks]
    ax.scatter(x, opt, marker="_", s=900, color="black", zorder=5,
               label=f"persistent + {'activation phase + ' if pool else ''}{'/'.join(OPTIMIZER)} (optimizer phase)")
    if ev.runtime is not None:
        # Measurement kinds above the live-tensor peak: allocated adds the allocator-held workspaces, reserved the
        # allocator's slack, device the memory outside the allocator (k3opt.cost.memory_outside).
        kinds = (("allocated: + workspaces", "peak_bytes", "allocated_bytes", "#4d4d4d"),
                 ("reserved: + allocator slack", "allocated_bytes", "reserved_bytes", "#8c8c8c"),
                 ("device: + outside the allocator", "reserved_bytes", "device_bytes", "#c7c7c7"))
        for label, lo, hi, color in kinds:
            ax.bar(x, [(getattr(r, hi) - getattr(r, lo)) / GIB for r in ranks],
                   bottom=[getattr(r, lo) / GIB for r in ranks], color=color, hatch="..", edgecolor="white",
                   linewidth=0.4, label=label)
    hbm = ev.cluster.hbm_bytes / GIB
    usable = ev.capacity_bytes / GIB
    ax.axhline(hbm, color="red", linewidth=1.5, label=f"HBM {hbm:.1f} GiB")
    if usable < hbm:
        ax.axhspan(usable, hbm, color="red", alpha=0.08, label=f"reserve {hbm - usable:.1f} GiB")
        ax.axhline(usable, color="red", linestyle="--", linewidth=1, label=f"usable {usable:.1f} GiB")
    for xi, r in zip(x, ranks, strict=True):
        top = r.device_bytes if ev.runtime is not None else r.peak_bytes
        ax.text(xi, top / GIB + hbm * 0.01, f"{top / GIB:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"rank {r.rank}\n{sum(b - a for a, b in r.chunks)} layers" for r in ranks], fontsize=8)
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_ylim(0, hbm * 1.12)
    ax.set_title(f"Per-rank memory ledger: {ev.model.name} on {ev.cluster.name}, {ev.layout.gpus} GPUs\n"
                 f"{_short(ev)}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _save(fig, path)


def _short(ev: Evaluation) -> str:
    lay = ev.layout
    return (f"{degrees_text(lay)}, recompute {lay.recompute.value}; worst-rank peak {ev.peak_bytes / GIB:.1f} GiB"
            + (f" live, {ev.peak_device_bytes / GIB:.1f} GiB device" if ev.runtime is not None else ""))


# ------------------------------------------------------------------------------------- Pareto


def pareto_plot(items: list, path: str | Path, best: object | None = None) -> None:  # list[PlanItem]
    """Ranked step time (achievable when the cluster has rates) against worst-rank peak, one series per GPU
    count; `best` (a PlanItem) is starred."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    by_gpus: dict[int, list] = {}
    for it in items:
        by_gpus.setdefault(it.layout.gpus, []).append(it)
    markers = "osD^v<>p"
    for i, (g, its) in enumerate(sorted(by_gpus.items())):
        its = sorted(its, key=lambda it: it.evaluation.peak_bytes)
        ax.plot([it.evaluation.peak_bytes / GIB for it in its], [it.evaluation.step.rank_time_s for it in its],
                marker=markers[i % len(markers)], linestyle="-", drawstyle="steps-post", label=f"{g} GPUs")
    if best is not None:
        ev = best.evaluation
        ax.scatter([ev.peak_bytes / GIB], [ev.step.rank_time_s], marker="*", s=320, color="gold",
                   edgecolor="black", zorder=6,
                   label=f"chosen: {ev.step.rank_time_s:.2f} s at {ev.peak_bytes / GIB:.1f} GiB")
        cap = ev.capacity_bytes / GIB
        ax.axvline(cap, color="red", linestyle="--", linewidth=1, label=f"usable HBM {cap:.1f} GiB")
    ax.set_xlabel("worst-rank peak memory (GiB)")
    ranked = "achievable step time" if best is not None and best.evaluation.step.rates else "step time"
    ax.set_ylabel(f"{ranked} (s)")
    ax.set_title(f"Pareto front: {ranked} against worst-rank peak HBM", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _save(fig, path)


# ----------------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Op:
    rank: int
    kind: str  # "F" or "B"
    chunk: int
    microbatch: int
    start: float
    end: float


def pipeline_schedule(p: int, v: int, m: int, chunk_times: list[list[float]],
                      backward_s: list[list[float]] | None = None) -> list[Op]:
    """Start and end of every forward and backward on every rank (`k3opt.cost.schedule.replay_ops`: each op starts when
    its rank is free and its input has arrived). chunk_times[r][k]: seconds per microbatch of local chunk k on
    rank r, forward + backward split 1 : BACKWARD_OVER_FORWARD; or, with `backward_s` given, the forward seconds
    and backward_s[r][k] the backward's. Interleaving needs M divisible by p (Megatron's rule)."""
    if v > 1 and m % p:
        raise LayoutError(f"the interleaved 1F1B timeline needs microbatches ({m}) divisible by pp ({p}); "
                          "Megatron's interleaved schedule has the same rule")
    per_chunk = np.array([chunk_times[g % p][g // p] for g in range(p * v)], dtype=float)
    if backward_s is None:
        fwd, bwd = per_chunk * FORWARD_SHARE, per_chunk * (1 - FORWARD_SHARE)
    else:
        fwd, bwd = per_chunk, np.array([backward_s[g % p][g // p] for g in range(p * v)], dtype=float)
    ops = replay_ops(p, v, m, fwd, bwd)
    return [Op(r, "F" if is_f else "B", g // p, mb, start, end) for r, is_f, g, mb, start, end in ops]


def in_flight_peak(ops: list[Op], rank: int) -> int:
    """Most forwards rank `rank` holds whose backward has not run (chunk-microbatches under interleaving)."""
    held = peak = 0
    for op in sorted((o for o in ops if o.rank == rank), key=lambda o: o.start):
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak


def timeline_plot(ev: Evaluation, path: str | Path) -> None:
    """Per rank: forward and backward boxes over one step's pipeline phase, idle time (bubble) in grey, and
    the in-flight microbatches over time in a second panel."""
    lay = ev.layout
    p, v, m = lay.pp, lay.vp, lay.microbatches
    # The chunks' forward and backward times the ranked step replays (StepTime.ranked_chunk_s, global chunk g on
    # rank g mod p), so the drawing is the schedule the plan is priced by.
    per = ev.step.ranked_chunk_s
    ops = pipeline_schedule(p, v, m, [[per[r + k * p][0] for k in range(v)] for r in range(p)],
                            [[per[r + k * p][1] for k in range(v)] for r in range(p)])
    end = max(o.end for o in ops)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(14, 3 + 0.55 * p + 2.5), sharex=True,
                                  gridspec_kw={"height_ratios": [max(p, 2), 3]})
    shades = [("#1f77b4", "#9ecae1"), ("#d62728", "#fcae91")]  # forward, backward; dark/light by chunk parity
    for r in range(p):
        ax.broken_barh([(0, end)], (r - 0.4, 0.8), color="#d9d9d9")
        for kind, (dark, light) in zip("FB", shades, strict=True):
            for parity, col in ((0, dark), (1, light)):
                bars = [(o.start, o.end - o.start) for o in ops
                        if o.rank == r and o.kind == kind and o.chunk % 2 == parity]
                if bars:
                    ax.broken_barh(bars, (r - 0.4, 0.8), color=col, edgecolor="white", linewidth=0.2)
        ax.text(end * 1.005, r, f"peak {in_flight_peak(ops, r)} in flight", va="center", fontsize=8)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.13)
    even = ", even chunk" if v > 1 else ""
    handles = [Patch(color=shades[0][0], label=f"forward{even}"), Patch(color=shades[1][0], label=f"backward{even}"),
               Patch(color="#d9d9d9", label="bubble (idle)")]
    if v > 1:
        handles += [Patch(color=shades[0][1], label="forward, odd chunk"),
                    Patch(color=shades[1][1], label="backward, odd chunk")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    sched = "interleaved 1F1B" if v > 1 else "1F1B"
    ax.set_title(f"{sched} pipeline schedule per rank, PP{p} VP{v}, {m} microbatches: "
                 f"bubble share {ev.step.bubble_fraction:.1%}\neach chunk's forward and backward as the ranked "
                 f"step time replays them; {_short(ev)}", fontsize=10)
    for r in range(p):
        evs = sorted((o for o in ops if o.rank == r), key=lambda o: o.end if o.kind == "F" else o.start)
        ts, hs, held = [0.0], [0], 0
        for o in evs:
            held += 1 if o.kind == "F" else -1
            ts.append(o.end if o.kind == "F" else o.start)
            hs.append(held)
        ts.append(end)
        hs.append(held)
        ax2.step(ts, hs, where="post", linewidth=1, label=f"rank {r}")
    ax2.set_ylabel("in-flight\nmicrobatches")
    ax2.set_xlabel("time within the step's pipeline phase (s)")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False, ncol=1 + p // 10)
    ax2.grid(alpha=0.3)
    _save(fig, path)


__all__ = ["ledger_plot", "pareto_plot", "pipeline_schedule", "timeline_plot", "in_flight_peak"]


# -------------------------------------------------------------------------------- capacity sweep


def sweep_plot(df: pd.DataFrame, path: str | Path) -> None:
    """A sweep's first picture: tokens/s per GPU held and days to train its token budget against GPU count, one
    line per value of the other swept keys (context, cluster, ...), from each point's best layout; points with no
    fitting layout are marked x on the axis."""
    if "gpus" not in df.columns and "sweep_gpus" not in df.columns:
        raise SpecError("sweep plot: the output has no GPU count column (no point planned)")
    best = df[df["rank"].isna() | (df["rank"] == 1)] if "rank" in df.columns else df
    swept = [c for c in best.columns if c.startswith("sweep_") and c not in ("sweep_gpus", "sweep_racks")]
    best = best.assign(series=best[swept].astype(str).agg(" ".join, axis=1) if swept else "all",
                       x=best["gpus"].fillna(best.get("sweep_gpus")) if "gpus" in best else best["sweep_gpus"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, grp in best.groupby("series", sort=False):
        ok = grp[grp["status"] != "FAILED"].sort_values("x")
        bad = grp[grp["status"] == "FAILED"]
        label = " ".join(w.removeprefix("sweep_") for w in str(name).split()) if swept else "all points"
        for ax, col in zip(axes, ("ranked_tokens_per_s_per_gpu_held", "train_days"), strict=True):
            line = ax.plot(ok["x"], ok[col], marker="o", label=label)[0] if len(ok) else None
            open_ = ok[ok["status"] != "OPTIMAL"]
            if line is not None and len(open_):  # not proven to the gap: drawn hollow
                ax.scatter(open_["x"], open_[col], s=70, facecolors="white", edgecolors=line.get_color(), zorder=3)
            if len(bad):
                # at the foot of the axes whatever their scale: a failed point has no value to draw
                ax.scatter(bad["x"], np.full(len(bad), 0.03), marker="x", s=60, clip_on=False,
                           transform=blended_transform_factory(ax.transData, ax.transAxes),
                           color=line.get_color() if line else "red",
                           label=f"{label}: no layout" if not line else None)
    axes[0].set_ylabel("tokens/s per GPU held (best layout)")
    budget = best["train_tokens"].dropna()
    axes[1].set_ylabel(f"days to train {budget.iloc[0]:.3g} tokens" if len(budget) else "days to train")
    ticks = sorted({int(x) for x in best["x"].dropna()})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, title=", ".join(c.removeprefix("sweep_") for c in swept) or None)
    fig.suptitle("capacity sweep: hollow points are not proven to the gap (FEASIBLE); x marks points with no layout "
                 "(infeasible, or none found in the time limit)", fontsize=10)
    _save(fig, path)
