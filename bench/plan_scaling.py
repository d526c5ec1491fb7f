"""Benchmark: solve time and status of `k3opt.plan` for the default K3 job at 512 GPUs and for 2,048, 8,192
and 32,768 GPUs (same tokens per GPU per update, 8 racks' worth of 64-GPU domain blocks), with the size of the
largest CP-SAT model and the machine. Run by hand: `python bench/plan_scaling.py [--time-limit S] [--out FILE]`.
Not a test: wall time depends on the machine and its load."""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import UTC, datetime

import ortools

import k3opt
from k3opt.inputs.labels import degrees_text
from k3opt.inputs.specs import Job

TOKENS_PER_GPU = 16_777_216 // 512


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"OR-tools {ortools.__version__}, {platform.system()} {platform.release()}")


def _row(label: str, job: Job, model: k3opt.ModelSpec, top: int, time_limit: float, workers: int) -> str:
    t0 = time.monotonic()
    try:
        plan = k3opt.plan(job, model=model, top=top, time_limit=time_limit, workers=workers)
    except k3opt.K3optError as err:
        return f"| {label} | {job.gpus:,} | {top} | | | ERROR | | | {time.monotonic() - t0:.1f} | {err} | | | | |"
    wall = time.monotonic() - t0
    best = plan.layouts[0]
    lay = best.layout
    first = f"{plan.first_layout_s:.1f}" if plan.first_layout_s is not None else ""
    return (f"| {label} | {job.gpus:,} | {top} | {plan.frames_total:,} | {plan.frames_solved} | {plan.status} | "
            f"{100 * plan.gap:.2f}% | {first} | {wall:.1f} | "
            f"{degrees_text(lay)} {lay.recompute.value} | {best.rank_time_s:.3f} | {best.step_time_s:.3f} | "
            f"{best.evaluation.step.schedule_step_time_s:.3f} | {best.peak_bytes / 2**30:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, nargs="*", default=[512, 2048, 8192, 32768])
    ap.add_argument("--top", type=int, nargs="*", default=[1])
    ap.add_argument("--plain", action="store_true",
                    help="Also the plain 512-GPU job: model, cluster, context, rows, tokens, reserve 5 GiB only.")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None,
                    help="Write the table with its header to this file (bench/results.md keeps the tables by hand, "
                         "current first; the script never overwrites it unasked).")
    args = ap.parse_args()
    base = k3opt.load_job("k3-512-4k")
    model = k3opt.load_model(base.model)
    load_before = os.getloadavg()
    rows = []
    jobs = []
    if args.plain:
        jobs.append(("plain", Job(gpus=512, context=4096, rows=1, tokens_per_update=16_777_216, reserve_gib=5)))
    for gpus in args.gpus:
        jobs.append(("default", Job.model_validate({**base.model_dump(), "gpus": gpus,
                                                    "tokens_per_update": TOKENS_PER_GPU * gpus,
                                                    "name": f"k3-{gpus}-4k"})))
    for label, job in jobs:
        for top in args.top:
            row = _row(label, job, model, top, args.time_limit, args.workers)
            print(row, flush=True)
            rows.append(row)
    load_after = os.getloadavg()
    header = [
        f"# Planner benchmark ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"Machine: {machine()}. CP-SAT workers: {args.workers}; time limit {args.time_limit:g} s per job.",
        f"1-minute load average before / after: {load_before[0]:.1f} / {load_after[0]:.1f} on {os.cpu_count()} "
        "cores (after: the planner's own processes, its helper process and CP-SAT's threads, count in it)"
        + (" (MEASURED UNDER LOAD: other processes shared the cores; times are inflated)"
           if load_before[0] > 0.5 * (os.cpu_count() or 1) else "") + ".",
        "Jobs: `default` is k3-512-4k (context 4096, rows 1, reserve 4 GiB, 64 GPUs per NVL72 domain; VP 1-4 searched)",
        f"scaled at {TOKENS_PER_GPU:,} tokens per GPU per update; `plain` is a job file with only the model, cluster,",
        "gpus 512, context 4096, rows 1, tokens_per_update 16,777,216 and reserve_gib 5 (it plans with the cluster's",
        "default runtime and 8 racks x 64 GPUs, the job defaults). Wall time includes bounding",
        "every shape; `first s` is the time to the first fitting layout. `sched s` is the step priced by the replayed",
        "pipeline schedule (`StepTime.schedule_step_time_s`); the search ranks by `ranked s` (the achievable step",
        "time), the peak roofline `step s` beside it.",
        "",
        "| job | GPUs | top | shapes | CP-SAT models solved | status | gap | first s | wall s | best layout | ranked s "
        "| step s | sched s | peak GiB |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    if args.out is None:
        print("\n".join(header[:4]))
        return
    with open(args.out, "w") as fh:
        fh.write("\n".join(header + rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
