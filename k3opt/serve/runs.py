"""The lab's plans: each runs k3opt.plan or k3opt.pareto on its own thread, reports the search's Progress as it
moves, and can be cancelled. A client has at most one plan running (a new one cancels the one before), and the
server runs at most `max_running` at once, so a page cannot queue work without end."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from k3opt.inputs.errors import K3optError
from k3opt.inputs.specs import ClusterSpec, Job, ModelSpec
from k3opt.planner import pareto as run_pareto
from k3opt.planner import plan as run_plan
from k3opt.search.progress import Progress
from k3opt.search.result import Plan

KEEP_FINISHED = 16
"""Finished plans kept for their downloads; older ones are dropped first."""


class Busy(K3optError):
    """Every plan slot of the server is taken."""


class _Cancelled(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised from the progress callback: the search unwinds (its helper process stops in its own finally)."""


@dataclass
class PlanRun:
    """One plan: its request, its state (running | done | cancelled | failed), its last Progress and its result."""

    id: str
    client: str
    pareto: bool
    job: Job
    model: ModelSpec
    cluster: ClusterSpec
    top: int
    time_limit: float
    state: str = "running"
    progress: Progress | None = None
    result: Plan | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def _on_progress(self, p: Progress) -> None:
        self.progress = p
        if self.cancel.is_set():
            raise _Cancelled

    def run(self) -> None:
        """The search on this thread; every outcome is recorded, none escapes (the server never dies on input)."""
        fn = run_pareto if self.pareto else run_plan
        try:
            res = fn(self.job, self.model, self.cluster, top=self.top, time_limit=self.time_limit,
                     progress=self._on_progress)
            self.result, self.state = res, "cancelled" if self.cancel.is_set() else "done"
        except (_Cancelled, KeyboardInterrupt):
            self.state = "cancelled"
        except K3optError as err:
            self.state, self.error = "failed", str(err)
        except Exception as err:  # noqa: BLE001 - reported on the page; the server goes on
            self.state, self.error = "failed", f"internal error: {type(err).__name__}: {err}"
        finally:
            self.ended = time.monotonic()

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "pareto": self.pareto, "error": self.error,
                "elapsed_s": (self.ended or time.monotonic()) - self.started}


class Runs:
    """Every plan of the server by id, with one running per client."""

    def __init__(self, max_running: int = 2) -> None:
        self.max_running = max_running
        self._runs: OrderedDict[str, PlanRun] = OrderedDict()
        self._threads: dict[str, threading.Thread] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(self, client: str, pareto: bool, job: Job, model: ModelSpec, cluster: ClusterSpec, top: int,
              time_limit: float) -> PlanRun:
        """A new plan for `client`, cancelling the client's running one first."""
        with self._lock:
            for r in self._runs.values():
                if r.client == client and r.state == "running":
                    r.cancel.set()
            running = [r for r in self._runs.values() if r.state == "running" and not r.cancel.is_set()]
            if len(running) >= self.max_running:
                raise Busy(f"the server runs {self.max_running} plans at once and all are taken; try again when "
                           "one ends")
            run = PlanRun(f"p{next(self._ids)}", client, pareto, job, model, cluster, top, time_limit)
            self._runs[run.id] = run
            done = [k for k, r in self._runs.items() if r.state != "running"]
            for k in done[:max(0, len(done) - KEEP_FINISHED)]:
                del self._runs[k]
                self._threads.pop(k, None)
        t = threading.Thread(target=run.run, name=f"k3opt-{run.id}", daemon=True)
        self._threads[run.id] = t
        t.start()
        return run

    def get(self, run_id: str) -> PlanRun | None:
        return self._runs.get(run_id)

    def cancel(self, run_id: str) -> PlanRun | None:
        run = self._runs.get(run_id)
        if run is not None and run.state == "running":
            run.cancel.set()
        return run

    def join(self, run_id: str, timeout: float | None = None) -> None:
        t = self._threads.get(run_id)
        if t is not None:
            t.join(timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel every running plan and wait for their threads (the server's shutdown)."""
        for r in list(self._runs.values()):
            r.cancel.set()
        for t in list(self._threads.values()):
            t.join(timeout)
