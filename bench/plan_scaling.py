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
from k3opt.search import enumerate_frames
from k3opt.specs import Job

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, nargs="*", default=[512, 2048, 8192, 32768])
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.md"))
    args = ap.parse_args()
    base = k3opt.load_job("k3-512-4k")
    model = k3opt.load_model(base.model)
    rows = []
    for gpus in args.gpus:
        job = Job.model_validate({**base.model_dump(), "gpus": gpus, "tokens_per_update": TOKENS_PER_GPU * gpus,
                                  "name": f"k3-{gpus}-4k"})
        t0 = time.monotonic()
        try:
            plan = k3opt.plan(job, model=model, top=1, pareto=False, time_limit=args.time_limit,
                              workers=args.workers)
            best = plan.layouts[0]
            lay = best.layout
            row = (f"| {gpus:,} | {len(enumerate_frames(job, model, gpus)):,} | {plan.frames_solved} | "
                   f"{plan.model_size.get('variables', 0):,} / {plan.model_size.get('constraints', 0):,} | "
                   f"{plan.status} | {100 * plan.gap:.2f}% | {time.monotonic() - t0:.1f} | "
                   f"PP{lay.pp} EP{lay.ep} dFSDP{lay.dense_fsdp} M{lay.microbatches} {lay.recompute.value} | "
                   f"{best.step_time_s:.3f} | {best.peak_bytes / 2**30:.1f} |")
        except k3opt.K3optError as err:
            row = f"| {gpus:,} | | | | ERROR | | {time.monotonic() - t0:.1f} | {err} | | |"
        print(row, flush=True)
        rows.append(row)
    header = [
        f"# Planner benchmark ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"Machine: {machine()}. CP-SAT workers: {args.workers}; time limit {args.time_limit:g} s per job.",
        "Job: the default k3-512-4k (context 4096, rows 1, reserve 4 GiB, 64 GPUs per NVL72 domain, vp = 1) with",
        f"{TOKENS_PER_GPU:,} tokens per GPU per update. Wall time includes bounding every shape.",
        "",
        "| GPUs | shapes | CP-SAT models solved | largest model (vars / constraints) | status | gap | wall s "
        "| best layout | step s | peak GiB |",
        "|---:|---:|---:|---|---|---:|---:|---|---:|---:|",
    ]
    with open(args.out, "w") as fh:
        fh.write("\n".join(header + rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
