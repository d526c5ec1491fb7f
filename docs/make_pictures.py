"""Regenerate the README's pictures and launch exports from the default plan.

    python docs/make_pictures.py [--time-limit 300]

Runs one search of the built-in k3-512-4k job with its Pareto front (a few minutes on 2 cores), then writes
docs/ledger.png, docs/timeline.png and docs/pareto.png for the best layout and the front, and
docs/launch/default-plan.{megatron-bridge,megatron-lm,torchtitan}.txt with the best layout's exports.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import k3opt
from k3opt.launch import FORMATS
from k3opt.plots import ledger_plot, pareto_plot, timeline_plot

DOCS = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=300.0)
    args = ap.parse_args()
    job = k3opt.load_job("k3-512-4k")
    plan = k3opt.plan(job, top=1, pareto=True, time_limit=args.time_limit)
    best = plan.layouts[0]
    print(f"status {plan.status}, best {best.step_time_s:.3f} s, front of {len(plan.pareto)} layouts")
    ledger_plot(best.evaluation, DOCS / "ledger.png")
    timeline_plot(best.evaluation, DOCS / "timeline.png")
    pareto_plot(plan.pareto, DOCS / "pareto.png", best=best)
    (DOCS / "launch").mkdir(exist_ok=True)
    for fmt in FORMATS:
        (DOCS / "launch" / f"default-plan.{fmt}.txt").write_text(best.layout.to_launch(fmt).text)
    print(f"wrote {DOCS}/ledger.png, timeline.png, pareto.png and launch/default-plan.*.txt")


if __name__ == "__main__":
    main()
