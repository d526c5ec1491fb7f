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


if __name__ == "__main__":  # pragma: no cover
    main()
