"""Sweep throughput: points per hour of one grid on the local process pool and on a local Ray instance.

    python bench/sweep_rate.py bench/sweeps/qwen3-30b-b200.toml [--time-limit 60] [--workers 2]

Each executor plans the grid into a fresh file with one CP-SAT thread per plan and `--workers` plans at once (Ray:
one CPU per task on a Ray instance of this machine's cores). Prints one markdown row per executor: the machine,
the points, wall seconds, points per hour, and whether the two gave the same decisions."""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import pandas as pd

from k3opt.inputs.sweep import load_sweep
from k3opt.sweep import SweepSettings, run_sweep
from k3opt.sweep.store import read_rows

DECISIONS = ["point", "status", "pp", "vp", "cp", "ep", "expert_fsdp", "dense_fsdp", "microbatches", "recompute",
             "ranked_step_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    sweep = load_sweep(args.grid)
    settings = SweepSettings(time_limit=args.time_limit, threads=1)
    frames = {}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average before {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| grid | executor | points | wall s | points per hour |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in (("local pool", {"workers": args.workers}), ("Ray (local)", {"ray": "local"})):
            out = Path(tmp) / f"{name.split()[0]}.csv"
            t0 = time.monotonic()
            res = run_sweep(sweep, out, settings, **kw)
            wall = time.monotonic() - t0
            frames[name] = read_rows(out)
            print(f"| {Path(args.grid).stem} | {name} | {res.status.done} | {wall:.1f} | "
                  f"{3600 * res.status.done / wall:.0f} |")
    a, b = frames.values()
    same = a[DECISIONS].astype(str).equals(b[DECISIONS].astype(str))
    print(f"same decisions on both executors: {same}")
    if not same:
        print(pd.concat([a[DECISIONS], b[DECISIONS]], axis=1).to_string())


if __name__ == "__main__":
    main()
