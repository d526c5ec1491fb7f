"""Benchmark suite: every job of bench/jobs/ and the shipped jobs, planned as `k3opt plan JOB --top 1` runs them,
each under its limit (60 s; LONG jobs 120 s). Prints one markdown row per job (status, gap, seconds to the first
layout, wall seconds, best layout, its ranked step time, placement), with the machine and its load average
before and after. Run by hand: `python bench/suite.py [--only NAME ...] [--out FILE]`. Not a test: what a time
limit reaches depends on the machine and its load."""

from __future__ import annotations

import argparse
import os
import time
from datetime import UTC, datetime
from pathlib import Path

from plan_scaling import machine

import k3opt
from k3opt.inputs.labels import degrees_text

HERE = Path(__file__).parent
SHIPPED = ["k3-512-4k", "k3-512-32k", "k3-512-128k"]
LONG = {"k3-512-32k", "k3-512-128k", "k3-32768"}
"""Jobs whose limit is 120 s: the long contexts and 32,768 GPUs."""


def jobs() -> list[tuple[str, str]]:
    return [(n, n) for n in SHIPPED] + [(p.stem, str(p)) for p in sorted((HERE / "jobs").glob("*.toml"))]


def row(name: str, source: str, workers: int) -> str:
    limit = 120.0 if name in LONG else 60.0
    job = k3opt.load_job(source)
    t0 = time.monotonic()
    try:
        plan = k3opt.plan(job, top=1, time_limit=limit, workers=workers)
    except k3opt.K3optError as err:
        return f"| {name} | {limit:.0f} | ERROR | | | {time.monotonic() - t0:.1f} | {err} | | |"
    wall = time.monotonic() - t0
    best = plan.layouts[0]
    ev = best.evaluation
    first = f"{plan.first_layout_s:.1f}" if plan.first_layout_s is not None else ""
    placement = f"{ev.domains_held} x {ev.gpus_per_domain} ({ev.layout.gpus} GPUs)"
    return (f"| {name} | {limit:.0f} | {plan.status} | {100 * plan.gap:.2f}% | {first} | {wall:.1f} | "
            f"{degrees_text(best.layout)} {best.layout.recompute.value} {best.layout.precision.value} | "
            f"{best.rank_time_s:.3f} | {placement} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", nargs="*", default=None, help="Job names to run (default: all).")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None, help="Also append the table to this file.")
    args = ap.parse_args()
    load0 = os.getloadavg()
    lines = [f"Suite run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine()}, workers {args.workers}, "
             f"load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", "",
             "| job | limit s | status | gap | first layout s | wall s | best layout | ranked s | racks x GPUs |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name, source in jobs():
        if args.only and name not in args.only:
            continue
        r = row(name, source, args.workers)
        print(r, flush=True)
        lines.append(r)
    load1 = os.getloadavg()
    tail = f"\nload average after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}"
    print(tail)
    lines.append(tail)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
