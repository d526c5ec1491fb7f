"""The CLI's live view of a running search (plan, pareto): the latest search.progress.Progress snapshot, with its
own clock so the elapsed time moves during a long CP-SAT slice that sends none.

On a terminal: a rich Live panel on stderr, refreshed `refresh_per_second` times a second and cleared at the end.
Elsewhere (a log, a pipe): one plain line every `period_s` seconds on stderr. Disabled (--json): nothing."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time as _time
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from k3opt.search.progress import Progress


class LiveProgress:
    """A progress callback (`live(p)` stores the snapshot) and a context manager that shows it while open."""

    def __init__(self, enabled: bool, title: str = "k3opt", stream: IO[str] | None = None,
                 period_s: float = 5.0, refresh_per_second: float = 4.0, terminal: bool | None = None) -> None:
        self.enabled, self.title = enabled, title
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.period_s, self.refresh = period_s, refresh_per_second
        self.latest: Progress | None = None
        self.received = self.started = _time.monotonic()
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, p: Progress) -> None:
        with self._lock:
            self.latest, self.received = p, _time.monotonic()

    def now(self) -> Progress | None:
        """The latest snapshot with its elapsed time moved to now."""
        with self._lock:
            p, received = self.latest, self.received
        if p is None:
            return None
        return dataclasses.replace(p, elapsed_s=p.elapsed_s + _time.monotonic() - received)

    def __rich__(self) -> Table:
        p = self.now()
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        if p is None:
            t.add_row(self.title, f"starting ({_time.monotonic() - self.started:.0f} s)")
            return t
        gap = f"{100 * p.gap:.2f}%" if p.gap is not None else "-"
        t.add_row(self.title, f"{p.phase}, {p.elapsed_s:.1f} s")
        t.add_row("best", f"{p.incumbent_s:.3f} s" if p.incumbent_s is not None else "none yet")
        t.add_row("bound", f"{p.bound_s:.3f} s" if p.bound_s is not None else "not yet (shapes being bounded)")
        t.add_row("gap", gap)
        t.add_row("shapes settled", f"{p.shapes_settled:,} / {p.shapes_total:,}")
        t.add_row("models solved", f"{p.models_solved:,}")
        if p.phase == "front":
            t.add_row("front points", f"{p.front_points}")
            if p.front_region:
                t.add_row("region", p.front_region)
        return t

    def _plain(self) -> None:
        while not self._stop.wait(self.period_s):
            p = self.now()
            if p is not None:
                print(p.line(), file=self.stream, flush=True)

    def __enter__(self) -> LiveProgress:
        if not self.enabled:
            return self
        if self.terminal:
            console = Console(file=self.stream, force_terminal=True)
            self._live = Live(self, console=console, refresh_per_second=self.refresh, transient=True)
            self._live.start()
        else:
            self._thread = threading.Thread(target=self._plain, name="k3opt-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    @property
    def callback(self) -> LiveProgress | None:
        """What the search gets: this object when enabled, else None (no snapshots built at all)."""
        return self if self.enabled else None


class SweepLive:
    """The live view of a sweep (k3opt.sweep.run): a rich progress bar over the points on a terminal (done,
    failed, running, ETA), else a plain line whenever a point finishes, at most every `period_s` seconds, and a
    last one at the end. A callback for run_sweep and a context manager, like LiveProgress."""

    def __init__(self, enabled: bool, stream: IO[str] | None = None, period_s: float = 5.0,
                 terminal: bool | None = None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.period_s = period_s
        self.last_line = -math.inf
        self.latest = None
        self._bar = Progress(TextColumn("sweep"), BarColumn(), TextColumn("{task.description}"),
                             TimeElapsedColumn(), console=Console(file=self.stream, force_terminal=True),
                             transient=False)
        self._task = None

    @staticmethod
    def text(s) -> str:  # noqa: ANN001 - k3opt.sweep.run.SweepStatus
        eta = s.eta_s()
        return (f"{s.done}/{s.total} points done ({s.skipped} from the file), {s.failed} failed, {s.running} "
                f"running, ETA {'-' if eta is None else f'{eta:.0f} s'}")

    def __call__(self, s) -> None:  # noqa: ANN001
        self.latest = s
        if not self.enabled:
            return
        if self.terminal:
            if self._task is None:
                self._task = self._bar.add_task(self.text(s), total=s.total)
            self._bar.update(self._task, completed=s.done, description=self.text(s))
        elif _time.monotonic() - self.last_line >= self.period_s or s.done == s.total:
            self.last_line = _time.monotonic()
            print(self.text(s), file=self.stream, flush=True)

    def __enter__(self) -> SweepLive:
        if self.enabled and self.terminal:
            self._bar.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self.enabled and self.terminal:
            self._bar.stop()
