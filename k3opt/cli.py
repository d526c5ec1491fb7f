"""The k3opt command line: explain (one layout's ledger and step time), plan (ranked layouts), pareto (CSV).

User mistakes (bad files, impossible layouts, unknown presets, infeasible jobs) print one line on stderr and
exit with status 2; nothing else does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from k3opt.cost.evaluate import evaluate
from k3opt.inputs.errors import InfeasibleJobError, K3optError, SpecError
from k3opt.inputs.labels import degrees_text, split_text
from k3opt.inputs.presets import format_validation_error, layout_toml, load_job, load_layout
from k3opt.inputs.runtime import planning_runtime
from k3opt.inputs.specs import Job
from k3opt.inputs.sweep import load_sweep
from k3opt.launch import check_format, limit_text, to_launch
from k3opt.planner import MIN_TIME_LIMIT_S, LimitPrice, binding_limits, limit_price
from k3opt.planner import pareto as run_pareto
from k3opt.planner import plan as run_plan
from k3opt.report.live import LiveProgress, SweepLive
from k3opt.report.text import explain_text, front_notes, plan_text, ranked_columns, sweep_table
from k3opt.report.throughput import validate_throughput, validation_table
from k3opt.report.validate import fit_rows, fit_text, rows_text, validation_rows
from k3opt.search import Plan
from k3opt.search.policy import POLICY
from k3opt.search.result import front_frame
from k3opt.sweep import SweepSettings, run_sweep
from k3opt.sweep.store import check_out, read_rows


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except K3optError as err:
            click.echo(f"k3opt: error: {err}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="k3opt")
def main() -> None:
    """Plan Kimi K3 training layouts on GB200 NVL72: per-rank memory ledger, roofline-plus-bubble step time,
    CP-SAT search."""
    # The command's start: a process's first command also counts the interpreter's start-up before it; a later one
    # (several commands in one process, as a test runner or a notebook invokes them) counts from its own start.
    _STARTED[:] = [time.monotonic(), _process_seconds() if not _STARTED else 0.0]
    warnings.formatwarning = _warning_line


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  line: str | None = None) -> str:
    """A warning on the command line as one line, like the errors (not Python's file, line and source)."""
    return f"k3opt: warning: {message}\n"


@main.command()
@click.argument("layout")
@click.option("--model", "model_name", default=None, help="Model preset or TOML (default: the layout's, else kimi-k3).")
@click.option("--cluster", "cluster_name", default=None,
              help="Cluster preset or TOML (default: the layout's, else gb200-nvl72).")
@click.option("--reserve-gib", type=float, default=None, help="HBM kept back per GPU (default: the layout's).")
@click.option("--runtime", "runtime_name", default=None,
              help="Runtime preset or TOML for the memory outside live tensors (default: the layout's; "
                   "none: live tensors only).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output with the same numbers.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of the per-rank ledger bars against the HBM line and the reserve.")
@click.option("--timeline", "timeline_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of the pipeline schedule per rank (forward / backward / bubble, in-flight).")
@_user_errors
def explain(layout: str, model_name: str | None, cluster_name: str | None, reserve_gib: float | None,
            runtime_name: str | None, as_json: bool, plot_path: str | None = None,
            timeline_path: str | None = None) -> None:
    """Print LAYOUT's per-rank memory ledger and step-time breakdown (a file or a shipped layout name)."""

    if reserve_gib is not None and reserve_gib < 0:
        raise click.BadParameter("must be >= 0", param_hint="--reserve-gib")
    for path in (plot_path, timeline_path):
        if path:
            _check_png(path)
    ev = evaluate(load_layout(layout), model=model_name, cluster=cluster_name, reserve_gib=reserve_gib,
                  runtime=runtime_name)
    if as_json:
        click.echo(json.dumps(ev.to_dict(), indent=2, default=float))
    else:
        click.echo(explain_text(ev))
    _pictures(ev, plot_path, timeline_path, quiet=as_json)


def _pictures(ev, plot_path: str | None, timeline_path: str | None, quiet: bool) -> None:  # noqa: ANN001
    if not (plot_path or timeline_path):
        return
    from k3opt.report import plots

    for path, draw in ((plot_path, plots.ledger_plot), (timeline_path, plots.timeline_plot)):
        if path:
            draw(ev, path)
            if not quiet:
                click.echo(f"wrote {path}")


def _check_png(path: str) -> None:
    if not path.lower().endswith(".png"):
        raise click.BadParameter(f"{path}: pictures are written as PNG; give a FILE.png")


@main.command()
@click.argument("layout")
@click.option("--format", "fmt", required=True, metavar="FORMAT",
              help="megatron-bridge | megatron-lm | torchtitan")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Write the export to FILE instead of stdout.")
@click.option("--model", "model_name", default=None, help="Model preset or TOML (default: the layout's, else kimi-k3).")
@_user_errors
def export(layout: str, fmt: str, out_path: str | None, model_name: str | None) -> None:
    """Print LAYOUT as launch settings for a framework; decisions without a switch are listed as comments
    and on stderr with what to do instead."""

    check_format(fmt)
    _emit_launch(to_launch(load_layout(layout), fmt, model_name), out_path)


def _emit_launch(launch, out_path: str | None) -> None:  # noqa: ANN001 - k3opt.launch.Launch
    if out_path:
        with open(out_path, "w") as fh:
            fh.write(launch.text)
    else:
        click.echo(launch.text, nl=False)
    for m in launch.missing:
        click.echo(f"k3opt: {launch.format}: {m.line()}", err=True)
    if out_path:
        click.echo(f"wrote {launch.format} export to {out_path} ({len(launch.missing)} decisions without a switch "
                   "listed in it)", err=True)


@main.command()
@click.option("--folder", type=click.Path(file_okay=False, exists=True), default=None,
              help="A folder of measured layouts (default: the shipped layouts/measured/).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable rows.")
@_user_errors
def validate(folder: str | None, as_json: bool) -> None:
    """Modeled vs measured for every measured layout: memory figures with the kind each compares and the GAP,
    then predicted vs measured tokens/s per GPU with the mean absolute error (as `validate-throughput`)."""

    rows = validation_rows(folder)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2, default=float))
        return
    click.echo("Memory: modeled vs measured (GAP = measured - modeled, never absorbed; kind: allocated = live "
               "tensors, reserved = + allocator slack, device = + memory outside the allocator)")
    click.echo(rows_text([r for r in rows if r.unit == "GiB"]))
    click.echo("")
    click.echo("Fit: each run's modeled device peak (worst rank; its runtime, else the cluster's default) against its "
               "GPU's HBM; every run here ran, so NO marks memory the model over-counts or a saving it cannot express. "
               "'without slack' is the device peak less the allocator slack (measured with room to spare): a run "
               "over its device line but under that one runs only if the allocator frees its cache and retries "
               "(PyTorch does, under pressure), with room for the fragmentation named")
    click.echo(fit_text(fit_rows(folder)))
    if any(r.figure.startswith("tokens/s") for r in rows):
        click.echo("")
        click.echo(validation_table(validate_throughput(Path(folder) if folder else None)))


def _load_job(job: str | None, gpus: tuple[int, ...]):  # noqa: ANN202
    from pydantic import ValidationError

    j = load_job(job or "k3-512-4k")
    if gpus:
        try:
            j = Job.model_validate({**j.model_dump(), "gpus": list(gpus) if len(gpus) > 1 else gpus[0]})
        except ValidationError as err:
            raise SpecError(format_validation_error(err, "--gpus")) from None
    return j


_plan_options = [
    click.argument("job", required=False),
    click.option("--gpus", type=click.IntRange(min=1), multiple=True,
                 help="Override the job's GPU count (repeat for a capacity sweep)."),
    click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Layouts to rank."),
    click.option("--time-limit", type=click.FloatRange(min=MIN_TIME_LIMIT_S), default=300.0, show_default=True,
                 help="Seconds for the whole search; when it stops early the status is FEASIBLE with the gap."),
    click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
                 help="CP-SAT threads; with 2 or more the bounds before the solves also run ahead in a second "
                      "process (Linux)."),
    click.option("--gap", type=click.FloatRange(min=0.0, max=1.0), default=0.01, show_default=True,
                 help="Relative gap at which the search stops and reports OPTIMAL; 0 demands the exact proof."),
]


def _with_plan_options(fn):  # noqa: ANN001, ANN202
    for opt in reversed(_plan_options):
        fn = opt(fn)
    return fn


@main.command()
@_with_plan_options
@click.option("--show-ledger", type=int, default=None, metavar="N", help="Print layout N's per-rank ledger.")
@click.option("--save", nargs=2, type=(int, click.Path(dir_okay=False)), default=None, metavar="N FILE",
              help="Write layout N as a layout file that `k3opt explain` reads.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output with the same numbers.")
@click.option("--export", "export_fmt", default=None, metavar="FORMAT",
              help="megatron-bridge | megatron-lm | torchtitan: with --save N FILE, FILE gets layout N's launch "
                   "settings instead of a layout file; without --save, layout 1's are printed.")
@click.option("--target", default=None, metavar="FRAMEWORK",
              help="Search only layouts this framework can run (overrides the job's `target`); the best layout "
                   "without its limits is searched too, to show what they cost.")
@_user_errors
def plan(job: str | None, gpus: tuple[int, ...], top: int, time_limit: float, workers: int, gap: float,
         show_ledger: int | None, save: tuple[int, str] | None, as_json: bool, export_fmt: str | None = None,
         target: str | None = None) -> None:
    """Rank the fastest layouts that fit every rank for JOB (default: the built-in k3-512-4k job)."""

    if export_fmt is not None:
        check_format(export_fmt)
    j = _load_job(job, gpus)
    if target is not None:
        j = j.model_copy(update={"target": check_format(target)})
    free = None
    # With a target, every search of the command shares the one limit: the plan itself first, with its share
    # (POLICY.target_plan_share); then the plan without the target's limits and the price of each binding limit
    # share what it leaves.
    deadline = time.monotonic() + time_limit
    share = POLICY.target_plan_share if j.target is not None else 1.0
    try:
        with LiveProgress(not as_json, "plan") as live:
            result = run_plan(j, top=top, time_limit=time_limit * share, workers=workers, progress=live.callback,
                              gap=gap)
    except InfeasibleJobError as err:
        if j.target is None:
            raise
        free = _plan_free(j, deadline, 1.0, workers, gap, as_json)
        raise InfeasibleJobError(f"{err} (without the {j.target} limits the best layout takes "
                                 f"{free.layouts[0].rank_time_s:.3f} s: {_short(free.layouts[0].layout)})") from None
    if j.target is not None:
        free = _plan_free(j, deadline, POLICY.target_free_share, workers, gap, as_json)
    launch = None
    if save is not None:
        n, path = save
        if not 1 <= n <= len(result.layouts):
            raise K3optError(f"--save {n}: the plan has layouts 1..{len(result.layouts)}")
        if export_fmt is None:
            _write_layout(result.layouts[n - 1].layout, path)
        else:
            launch = to_launch(result.layouts[n - 1].layout, export_fmt, j.model)
    elif export_fmt is not None:
        launch = to_launch(result.layouts[0].layout, export_fmt, j.model)
    cost, prices = None, []
    if free is not None:
        best, unlimited = result.layouts[0].rank_time_s, free.layouts[0].rank_time_s
        cost = target_cost_line(j.target, best, unlimited, _short(free.layouts[0].layout), gap,
                                (result.gap, free.gap))
        binding = binding_limits(free.layouts[0].layout, j.target, j.model)
        todo = binding if best > unlimited else []
        for i, lim in enumerate(todo):
            left = (deadline - time.monotonic()) / (len(todo) - i)
            if left < POLICY.least_price_s:
                prices.append(LimitPrice(lim, limit_text(j.target, lim), None, None, proven=False, priced=False))
                continue
            with LiveProgress(not as_json, f"plan with {lim} lifted") as live:
                prices.append(limit_price(j, best, lim, time_limit=left, workers=workers, gap=gap,
                                          progress=live.callback))
        prices.sort(key=lambda p: -(p.saves_s or 0.0))
    if as_json:
        rt = planning_runtime(result.job, result.layouts[0].evaluation.cluster)
        out = {
            "status": result.status, "bound_s": result.bound, "gap": result.gap,
            "runtime": rt.name, "runtime_from": rt.origin,
            "solve_time_s": result.solve_time_s, "models_solved": result.frames_solved,
            "open_shapes": result.open_shapes,
            "holding": dataclasses.asdict(result.holding) if result.holding is not None else None,
            "placements": [dataclasses.asdict(o) for o in result.placements],
            "layouts": [it.evaluation.to_dict() for it in result.layouts],
        }
        if free is not None:
            out.update({"target": j.target, "best_without_target_s": free.layouts[0].rank_time_s,
                        "layout_without_target": free.layouts[0].evaluation.to_dict()["layout"],
                        "limit_prices": [dataclasses.asdict(p) for p in prices]})
        if launch is not None and save is None:
            out["export"] = {"format": launch.format, "text": launch.text,
                             "missing": [m.line() for m in launch.missing]}
        click.echo(json.dumps(out, indent=2, default=float))
    else:
        click.echo(plan_text(result, show_ledger))
        if cost:
            click.echo(f"\n{cost}")
            if prices:
                click.echo("what each binding limit costs (the plan re-run with that limit lifted alone):")
                for p in prices:
                    click.echo(f"  {p.line()}")
        if save is not None and launch is None:
            click.echo(f"\nwrote layout {save[0]} to {save[1]}")
    if launch is not None:
        if save is not None:
            _emit_launch(launch, save[1])
        elif not as_json:
            click.echo("")
            _emit_launch(launch, None)
        else:
            for m in launch.missing:
                click.echo(f"k3opt: {launch.format}: {m.line()}", err=True)


def target_cost_line(target: str, best: float, unlimited: float, layout: str, gap: float,
                     ended: tuple[float, float] = (0.0, 0.0)) -> str:
    """What a launch target's limits cost: the best with them against the best without. Each search stops within
    its gap, so the one without the limits may end above the one with them; that reads as no measurable cost, not
    as a negative one. `ended`: the gaps the two searches ended at (with, without the limits); where one is above
    `gap`, its time limit cut it, and the line says so instead of claiming the gap."""
    head = f"launch target {target}: best {best:.3f} s with its limits, {unlimited:.3f} s without ({layout}); "
    if best <= unlimited:
        if max(ended) > gap:
            return head + (f"the search without them found nothing faster, but the searches ended {ended[0]:.2%} and "
                           f"{ended[1]:.2%} above their bounds: a longer --time-limit measures the limits' cost")
        return head + (f"the search without them found nothing faster: the limits cost nothing it can measure (each "
                       f"search ends within {gap:.0%} of its bound)")
    return head + f"the limits cost {best - unlimited:+.3f} s per step ({(best / unlimited - 1):+.1%})"


def _short(layout) -> str:  # noqa: ANN001

    return f"{degrees_text(layout)} split {split_text(layout.split)}"


@main.command()
@_with_plan_options
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write the front, one row per layout, every decision and ledger term a column.")
@click.option("--step-gib", type=click.FloatRange(min=0.001), default=1.0, show_default=True,
              help="Epsilon step of the front on the worst-rank peak.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of step time against worst-rank peak, one series per GPU count, best starred.")
@_user_errors
def pareto(job: str | None, gpus: tuple[int, ...], top: int, time_limit: float, workers: int, gap: float,
           csv_path: str | None, step_gib: float, as_json: bool, plot_path: str | None = None) -> None:
    """The Pareto front of JOB over (step time, worst-rank peak HBM), and over GPU count when the job lists
    several. The time limit counts from the command's start (start-up included); when it is too short to prove
    the front, each point says how far from proven it is."""

    if plot_path:
        _check_png(plot_path)
    j = _load_job(job, gpus)
    limit = max(MIN_TIME_LIMIT_S, time_limit - _command_seconds() - _OUTPUT_RESERVE_S)
    with LiveProgress(not as_json, "pareto") as live:
        result = run_pareto(j, top=top, time_limit=limit, workers=workers, step_gib=step_gib,
                            progress=live.callback, gap=gap)
    df = front_frame(result.pareto)
    if csv_path:
        df.to_csv(csv_path, index=False)
    if plot_path:
        from k3opt.report import plots

        plots.pareto_plot(result.pareto, plot_path, best=result.layouts[0] if result.layouts else None)
        if not as_json:
            click.echo(f"wrote {plot_path}", err=True)
    if as_json:
        click.echo(df.to_json(orient="records", indent=2))
        return
    cols = ["rank", "gpus", "pp", "vp", "ep", "expert_fsdp", "dense_fsdp", "microbatches", "recompute",
            "achievable_step_time_s", "step_time_s", "achievable_tokens_per_s_per_gpu", "tokens_per_s_per_gpu",
            "peak_gib", "headroom_gib", "front_bound_s", "front_gap_pct", "proven"]
    worst = max((it.front_gap or 0.0 for it in result.pareto), default=0.0)
    if result.pareto_complete:
        status = (f"proven at the {step_gib:g} GiB step: no layout in a point's peak range is faster than the point by "
                  f"more than the {100 * gap:g}% gap, and none is leaner than the last")
    else:
        proven = sum(it.proven for it in result.pareto)
        status = (f"NOT PROVEN (cut by the time limit), {proven} of {len(result.pareto)} points proven to the "
                  f"{100 * gap:g}% gap: each point's front_bound_s is a proven lower bound on the step time in its "
                  f"peak range, gap up to {100 * worst:.1f}%")
    click.echo(f"Pareto front, {len(df)} layouts in {result.solve_time_s:.1f} s, {status}; ranked search "
               f"status {result.status}")
    if result.layouts:
        click.echo(planning_runtime(result.job, result.layouts[0].evaluation.cluster).line())
    if len(df):
        shown = ranked_columns(df)
        click.echo(shown[[c for c in cols if c in shown]].to_string(index=False, float_format=lambda x: f"{x:,.2f}"))
    for line in front_notes(result.pareto):
        click.echo(line)
    if csv_path:
        click.echo(f"wrote {len(df)} rows to {csv_path}")


@main.command()
@click.argument("grid", type=click.Path(dir_okay=False))
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Output .csv or .parquet: one row per point and layout. A rerun into it solves only new points.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Points planned at once on the local process pool  [default: half the CPUs, so each plan gets "
                   "the two threads `k3opt plan` uses]")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CP-SAT threads per plan (2 or more also runs its bounds ahead in a second process)  [default: "
                   "CPUs / workers locally, 2 per Ray task]")
@click.option("--ray", "ray_address", default=None, metavar="auto|local|ADDRESS",
              help="Run the points as Ray tasks: 'local' starts Ray here, 'auto' or an address joins a cluster "
                   "(needs k3opt[ray]).")
@click.option("--top", type=click.IntRange(min=1), default=1, show_default=True,
              help="Layouts per point: the best and the next K-1.")
@click.option("--time-limit", type=click.FloatRange(min=MIN_TIME_LIMIT_S), default=60.0, show_default=True,
              help="Seconds per point's plan.")
@click.option("--gap", type=click.FloatRange(min=0.0, max=1.0), default=0.01, show_default=True,
              help="Relative gap at which each plan stops and reports OPTIMAL.")
@click.option("--train-tokens", type=click.FloatRange(min=1.0), default=15e12, show_default=True,
              help="Token budget of the days-to-train and GPU-hour columns.")
@click.option("--usd-per-gpu-hour", type=click.FloatRange(min=0.0), default=None,
              help="Price per GPU-hour (GPUs held): adds train_usd.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of tokens/s per GPU and days to train against GPU count.")
@_user_errors
def sweep(grid: str, out_path: str, workers: int | None, threads: int | None, ray_address: str | None, top: int,
          time_limit: float, gap: float, train_tokens: float, usd_per_gpu_hour: float | None,
          plot_path: str | None) -> None:
    """Plan every point of GRID (a job file with a [sweep] table of lists: its product) into --out, one row per
    point (with --top K, K rows); a point that fails is a row with its reason."""
    if plot_path:
        _check_png(plot_path)
    check_out(out_path)
    grid_spec = load_sweep(grid)
    cores = os.cpu_count() or 1
    workers = workers or max(1, cores // 2)
    threads = threads or (2 if ray_address else max(1, cores // workers))
    settings = SweepSettings(top=top, time_limit=time_limit, gap=gap, threads=threads, train_tokens=train_tokens,
                             usd_per_gpu_hour=usd_per_gpu_hour)
    axes = " x ".join(f"{k} {len(v)}" for k, v in grid_spec.axes.items())
    click.echo(f"sweep {grid}: {grid_spec.size()} points ({axes}), "
               f"{'Ray ' + ray_address if ray_address else f'{workers} local workers'}, {threads} CP-SAT "
               f"thread(s) per plan, {time_limit:g} s per plan", err=True)
    with SweepLive(True) as live:
        res = run_sweep(grid_spec, out_path, settings, workers=workers, ray=ray_address, progress=live)
    df = read_rows(res.out)
    click.echo(sweep_table(df[df["point_key"].astype(str).isin(res.keys)]))
    st = res.status
    click.echo(f"wrote {len(df)} rows to {res.out}: {st.done} points ({st.skipped} already in the file), "
               f"{st.failed} failed")
    if plot_path:
        _sweep_picture(df, plot_path)


def _sweep_picture(df, path: str) -> None:  # noqa: ANN001 - a pandas DataFrame
    from k3opt.report import plots

    plots.sweep_plot(df, path)
    click.echo(f"wrote {path}", err=True)


@main.command("sweep-plot")
@click.argument("results", type=click.Path(dir_okay=False, exists=True))
@click.argument("png", type=click.Path(dir_okay=False))
@_user_errors
def sweep_plot_cmd(results: str, png: str) -> None:
    """Draw a sweep's output (RESULTS, .csv or .parquet) into PNG: tokens/s per GPU and days to train against GPU
    count, one line per value of the other swept keys, points with no fitting layout marked."""
    _check_png(png)
    _sweep_picture(read_rows(results), png)


def _plan_free(j: Job, deadline: float, share: float, workers: int, gap: float, as_json: bool) -> Plan:
    """The plan of `j` without its launch target's limits, in `share` of the time left before `deadline`."""
    with LiveProgress(not as_json, f"plan without the {j.target} limits") as live:
        return run_plan(j.model_copy(update={"target": None}), top=1,
                        time_limit=max(MIN_TIME_LIMIT_S, (deadline - time.monotonic()) * share), workers=workers,
                        progress=live.callback, gap=gap)


_OUTPUT_RESERVE_S = 2.0
"""Seconds the pareto command keeps, out of its time limit, for building and writing the table after the search
(about 1 s for a few dozen rows on a loaded 2-core machine)."""


_STARTED: list[float] = []
"""[monotonic time the current command started, start-up seconds before it]: set by `main`."""


def _command_seconds() -> float:
    """Seconds since the current command started, start-up included (`main`); the process's age outside `main`."""
    if not _STARTED:
        return _process_seconds()
    return time.monotonic() - _STARTED[0] + _STARTED[1]


def _process_seconds() -> float:
    """Wall seconds since this process started (Linux /proc; 0 elsewhere): the start-up the pareto command's time
    limit includes."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _write_layout(layout, path: str) -> None:  # noqa: ANN001
    with open(path, "w") as fh:
        fh.write(layout_toml(layout))


@main.command()
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True,
              help="TCP port (0: any free port, printed at start).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; the default keeps the lab on this machine.")
@click.option("--sweep", "sweeps", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="A sweep output (.csv / .parquet) whose table and picture the Sweeps tab shows (repeatable).")
@_user_errors
def serve(port: int, host: str, sweeps: tuple[str, ...]) -> None:
    """The planning lab in the browser: explore one layout's ledger, step time and pipeline with controls, run
    plans and fronts with their live state, and read the validation (needs the `serve` extra)."""
    try:
        import uvicorn

        from k3opt.serve import create_app
    except ImportError as err:
        raise K3optError(f"k3opt serve needs the serve extra ({err.name} is missing): "
                         "pip install 'k3opt[serve]'") from None
    for path in sweeps:
        read_rows(path)  # a bad sweep file fails here, in one line, not on the page
    app = create_app([Path(p) for p in sweeps])
    click.echo(f"k3opt lab on http://{host}:{port}/ (Ctrl-C stops it)", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


@main.command("validate-throughput")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output with the same numbers.")
@_user_errors
def validate_throughput_cmd(as_json: bool) -> None:
    """Predicted vs measured tokens/s per GPU for every measured layout (layouts/measured/) and their mean
    absolute error: the achievable step time, with the peak roofline beside it."""

    v = validate_throughput()
    if as_json:
        click.echo(json.dumps(v.to_dict(), indent=2, default=float))
    else:
        click.echo(validation_table(v))


if __name__ == "__main__":  # pragma: no cover
    main()
