"""Benchmark: points and time of the anytime Pareto front of a job (default: the K3 512-GPU job) under a time limit,
as `k3opt pareto JOB --time-limit T` runs it (`k3opt.pareto(job, top=5, time_limit=T)`). Prints one line per
run (points, wall s, CPU s of this process, load average before and after, proven or not) and the points. Run by
hand: `python bench/pareto_points.py [JOB] [--time-limit S] [--runs N]`. Not a test: what a time limit reaches
depends on the machine and its load."""

from __future__ import annotations

import argparse
import os
import time

from plan_scaling import machine

import k3opt

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("job", nargs="?", default="k3-512-4k")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    job = k3opt.load_job(args.job)
    print(machine())
    for _ in range(args.runs):
        load0 = os.getloadavg()[0]
        wall, cpu = time.monotonic(), time.process_time()
        plan = k3opt.pareto(job, top=5, time_limit=args.time_limit)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        print(f"{len(plan.pareto)} points in {wall:.1f} s wall, {cpu:.1f} s CPU, load {load0:.2f} -> "
              f"{os.getloadavg()[0]:.2f}, {'exact' if plan.pareto_complete else 'not proven'}")
        for it in plan.pareto:
            lay = it.layout
            on = ",".join(t for t, v in lay.toggles.model_dump().items() if v)
            print(f"  PP{lay.pp} VP{lay.vp} EP{lay.ep} dFSDP{lay.dense_fsdp} {lay.dense_sharding}/{lay.expert_sharding}"
                  f" {lay.recompute} {on}: {it.rank_time_s:.3f} s, {it.peak_bytes / GIB:.2f} GiB,"
                  f" bound {it.front_bound_s:.2f} s")


if __name__ == "__main__":
    main()
