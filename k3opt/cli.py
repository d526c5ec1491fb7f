"""The k3opt command line: explain (one layout's ledger and step time), plan (ranked layouts), pareto (CSV).

User mistakes (bad files, impossible layouts, unknown presets, infeasible jobs) print one line on stderr and
exit with status 2; nothing else does.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from k3opt.errors import K3optError


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


@main.command()
@click.argument("layout")
@click.option("--model", "model_name", default=None, help="Model preset or TOML (default: the layout's, else kimi-k3).")
@click.option("--cluster", "cluster_name", default=None,
              help="Cluster preset or TOML (default: the layout's, else gb200-nvl72).")
@click.option("--reserve-gib", type=float, default=None, help="HBM kept back per GPU (default: the layout's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output with the same numbers.")
@_user_errors
def explain(layout: str, model_name: str | None, cluster_name: str | None, reserve_gib: float | None,
            as_json: bool) -> None:
    """Print LAYOUT's per-rank memory ledger and step-time breakdown (a file or a shipped layout name)."""
    from k3opt.evaluate import evaluate
    from k3opt.report import explain_text
    from k3opt.specs import load_layout

    if reserve_gib is not None and reserve_gib < 0:
        raise click.BadParameter("must be >= 0", param_hint="--reserve-gib")
    ev = evaluate(load_layout(layout), model=model_name, cluster=cluster_name, reserve_gib=reserve_gib)
    if as_json:
        click.echo(json.dumps(ev.to_dict(), indent=2, default=float))
    else:
        click.echo(explain_text(ev))


def _load_job(job: str | None, gpus: tuple[int, ...]):  # noqa: ANN202
    from k3opt.specs import Job, load_job

    j = load_job(job or "k3-512-4k")
    if gpus:
        j = Job.model_validate({**j.model_dump(), "gpus": list(gpus) if len(gpus) > 1 else gpus[0]})
    return j


def _progress(enabled: bool):  # noqa: ANN202
    if not enabled:
        return None
    state = {"last": 0.0}

    def report(solved: int, total: int, elapsed: float) -> None:
        if elapsed > 3 and elapsed - state["last"] >= 2:
            state["last"] = elapsed
            click.echo(f"  ... {solved} models solved, {elapsed:.0f} s", err=True)

    return report


_plan_options = [
    click.argument("job", required=False),
    click.option("--gpus", type=click.IntRange(min=1), multiple=True,
                 help="Override the job's GPU count (repeat for a capacity sweep)."),
    click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Layouts to rank."),
    click.option("--time-limit", type=click.FloatRange(min=0.1), default=300.0, show_default=True,
                 help="Seconds for the whole search; when it stops early the status is FEASIBLE with the gap."),
    click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="CP-SAT threads."),
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
@_user_errors
def plan(job: str | None, gpus: tuple[int, ...], top: int, time_limit: float, workers: int, gap: float,
         show_ledger: int | None, save: tuple[int, str] | None, as_json: bool) -> None:
    """Rank the fastest layouts that fit every rank for JOB (default: the built-in k3-512-4k job)."""
    from k3opt.report import plan_text
    from k3opt.search import plan as run_plan

    j = _load_job(job, gpus)
    result = run_plan(j, top=top, time_limit=time_limit, workers=workers, pareto=False,
                      progress=_progress(not as_json), gap=gap)
    if save is not None:
        n, path = save
        if not 1 <= n <= len(result.layouts):
            raise K3optError(f"--save {n}: the plan has layouts 1..{len(result.layouts)}")
        _write_layout(result.layouts[n - 1].layout, path)
    if as_json:
        click.echo(json.dumps({
            "status": result.status, "bound_s": result.bound, "gap": result.gap,
            "solve_time_s": result.solve_time_s, "models_solved": result.frames_solved,
            "layouts": [it.evaluation.to_dict() for it in result.layouts],
        }, indent=2, default=float))
    else:
        click.echo(plan_text(result, show_ledger))
        if save is not None:
            click.echo(f"\nwrote layout {save[0]} to {save[1]}")


@main.command()
@_with_plan_options
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write the front, one row per layout, every decision and ledger term a column.")
@click.option("--step-gib", type=click.FloatRange(min=0.001), default=1.0, show_default=True,
              help="Epsilon step of the front on the worst-rank peak.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_user_errors
def pareto(job: str | None, gpus: tuple[int, ...], top: int, time_limit: float, workers: int, gap: float,
           csv_path: str | None, step_gib: float, as_json: bool) -> None:
    """The Pareto front of JOB over (step time, worst-rank peak HBM), and over GPU count when the job lists
    several."""
    from k3opt.report import plan_frame
    from k3opt.search import plan as run_plan

    j = _load_job(job, gpus)
    result = run_plan(j, top=top, time_limit=time_limit, workers=workers, pareto=True, pareto_step_gib=step_gib,
                      progress=_progress(not as_json), gap=gap)
    df = plan_frame(result.pareto)
    if csv_path:
        df.to_csv(csv_path, index=False)
    if as_json:
        click.echo(df.to_json(orient="records", indent=2))
        return
    cols = ["rank", "gpus", "pp", "vp", "ep", "expert_fsdp", "dense_fsdp", "microbatches", "recompute",
            "step_time_s", "tokens_per_s_per_gpu", "peak_gib", "headroom_gib"]
    click.echo(f"Pareto front ({'complete' if result.pareto_complete else 'cut by the time limit'}), "
               f"{len(df)} layouts; ranked search status {result.status}")
    click.echo(df[cols].to_string(index=False, float_format=lambda x: f"{x:,.2f}"))
    if csv_path:
        click.echo(f"wrote {len(df)} rows to {csv_path}")


def _write_layout(layout, path: str) -> None:  # noqa: ANN001
    data = layout.model_dump(mode="json", exclude_none=True)
    toggles = data.pop("toggles")
    data.pop("measured", None)
    lines = ["# Saved by k3opt plan; `k3opt explain FILE` prints its ledger."]
    for k, v in data.items():
        lines.append(f"{k} = {json.dumps(v)}")
    lines.append("")
    lines.append("[toggles]")
    lines += [f"{k} = {json.dumps(v)}" for k, v in toggles.items()]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":  # pragma: no cover
    main()
