"""Running a sweep's points: a local process pool (default) or Ray tasks, each point one plan; its rows reach the
output file (sweep.store) as soon as it finishes. What is serial: reading the grid, hashing the points, and
writing the file after each point (milliseconds against a plan's seconds); the plans themselves are independent."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3opt.inputs.errors import SpecError
from k3opt.inputs.sweep import Sweep, SweepPoint
from k3opt.sweep.rows import SweepSettings, point_key, point_rows, price
from k3opt.sweep.store import Store


@dataclass
class SweepStatus:
    """Where a running sweep stands: points done (planned now or found in the file), failed, running, total."""

    total: int
    done: int = 0
    failed: int = 0
    running: int = 0
    skipped: int = 0
    """Points the output file already held (a rerun solves them not again)."""
    started: float = field(default_factory=time.monotonic)
    solved_s: float = 0.0
    """Wall seconds of the points planned in this run."""

    def eta_s(self) -> float | None:
        """Seconds left at this run's pace (None before a point finishes)."""
        finished = self.done - self.skipped
        if finished <= 0:
            return None
        left = self.total - self.done
        return (time.monotonic() - self.started) / finished * left


@dataclass
class SweepResult:
    """A finished sweep: its status counts and the output file."""

    status: SweepStatus
    out: Path
    keys: list[str]
    """The grid's point keys (the output file may also hold rows of other grids)."""


ProgressFn = Callable[[SweepStatus], None]


def run_sweep(sweep: Sweep, out: str | Path, settings: SweepSettings, *, workers: int = 1, ray: str | None = None,
              progress: ProgressFn | None = None) -> SweepResult:
    """Plan every point of `sweep` not already in `out`, `workers` at a time on a local process pool, or as Ray
    tasks (`ray`: "auto", "local" or a cluster address), each asking Ray for `settings.threads` CPUs."""
    store = Store(out)
    store.rows = [price(r, settings) for r in store.rows]
    points = sweep.points()
    if all(p.job is None for p in points):
        raise SpecError(f"sweep: no point of the grid is a valid job ({points[0].label()}: {points[0].error})")
    keyed = [(p, point_key(p.job, p.values, settings)) for p in points]
    done = store.done()
    todo = [(p, k) for p, k in keyed if k not in done]
    status = SweepStatus(total=len(keyed), done=len(keyed) - len(todo), skipped=len(keyed) - len(todo))
    status.failed = sum(1 for r in store.rows if r.get("status") == "FAILED"
                        and str(r["point_key"]) in {k for _, k in keyed})
    _tell(progress, status)
    runner = _ray_points if ray is not None else _pool_points
    for rows in runner(todo, settings, workers, ray, status, progress):
        store.add(rows)
        status.done += 1
        status.failed += int(rows[0]["status"] == "FAILED")
        _tell(progress, status)
    store.write()  # the price columns of the rows it already held, at this run's prices
    return SweepResult(status, store.path, [k for _, k in keyed])


def _tell(progress: ProgressFn | None, status: SweepStatus) -> None:
    if progress is not None:
        progress(status)


def _pool_points(todo: list[tuple[SweepPoint, str]], settings: SweepSettings, workers: int, _ray: str | None,
                 status: SweepStatus, progress: ProgressFn | None) -> Iterator[list[dict[str, Any]]]:
    """Each point's rows as it finishes, on a process pool of `workers` (in this process when 1)."""
    if workers <= 1:
        for p, k in todo:
            status.running = 1
            _tell(progress, status)
            yield point_rows(p, k, settings)
        status.running = 0
        return
    # spawn: the parent may run a progress thread, and a fork copies no thread but keeps the locks they hold.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        pending = {pool.submit(point_rows, p, k, settings) for p, k in todo}
        while pending:
            status.running = min(workers, len(pending))
            _tell(progress, status)
            finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            status.running = min(workers, len(pending))
            for fut in finished:
                yield fut.result()
    status.running = 0


def _ray_points(todo: list[tuple[SweepPoint, str]], settings: SweepSettings, _workers: int, address: str | None,
                status: SweepStatus, progress: ProgressFn | None) -> Iterator[list[dict[str, Any]]]:
    """Each point's rows as it finishes, as Ray tasks of `settings.threads` CPUs each. "local" starts a Ray
    instance on this machine (stopped at the end); "auto" or an address joins a running cluster, whose nodes need
    k3opt installed."""
    try:
        import ray
    except ImportError:
        raise SpecError("--ray needs Ray: pip install 'k3opt[ray]'") from None
    started_here = False
    if not ray.is_initialized():
        if address == "local":
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            started_here = True
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        task = ray.remote(num_cpus=settings.threads)(point_rows)
        pending = [task.remote(p, k, settings) for p, k in todo]
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        while pending:
            status.running = min(len(pending), max(1, cpus // settings.threads))
            _tell(progress, status)
            finished, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            status.running = min(len(pending), max(1, cpus // settings.threads))
            for ref in finished:
                yield ray.get(ref)
    finally:
        status.running = 0
        if started_here:
            ray.shutdown()
