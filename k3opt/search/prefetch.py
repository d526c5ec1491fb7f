"""Bound programs computed ahead on a second core: `Prefetch`.

The driver's heuristics (the seeding) and its bounding pass both run on one core; the group bound programs the pass
needs (bounds.group_frame_bound, bounds.group_node_bound) depend only on the queue, known once the frames are
bounded. A forked process works through them while the driver seeds, against the pruning line the driver publishes
(`set_line`); the pass then takes their values instead of solving them. Any value a bound program returns is a lower
bound whatever line it stopped at (it stops once the bound is shown at or above the line), so a value computed
against an older, higher line is as valid as one computed now, only possibly tighter."""

from __future__ import annotations

import multiprocessing as _mp
import signal
from collections.abc import Callable, Hashable
from multiprocessing.connection import Connection
from typing import Any

_FREE, _CHILD, _PARENT = 0, 1, 2
"""A task's state in the shared array: not started, taken by the child, claimed by the driver (the child skips it)."""

LOCK_WAIT_S = 5.0
"""How long the driver waits for the shared state's lock before it solves the program itself: the child holds the
lock only to read and set one byte, so a longer wait means the child died holding it."""


class Prefetch:
    """`tasks` (key, program), computed in order by a forked process: a program gets the current line (`set_line`) and
    returns a bound, or None when the line makes it useless (the driver then solves it itself if it needs it).
    `take(key)`: the child's value when it has started the task (waiting for it to finish), None when it has not
    (the driver claims it and solves it itself; the child then skips it). Without the "fork" start method, or with
    no tasks, nothing runs and every `take` is None."""

    def __init__(self, tasks: list[tuple[Hashable, Callable[[float], object]]], line: float) -> None:
        self._index = {key: i for i, (key, _) in enumerate(tasks)}
        self._results: dict[int, object] = {}
        self._proc: _mp.process.BaseProcess | None = None
        self._tasks = tasks
        self.used = 0
        """Values computed ahead (by the child, or by the driver while it waited for the child) that were used."""
        if not tasks or "fork" not in _mp.get_all_start_methods():
            return
        ctx = _mp.get_context("fork")
        self._state = ctx.Array("b", len(tasks))
        self._line = ctx.Value("d", line, lock=False)
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_work, args=(tasks, self._state, self._line, send), daemon=True)
        self._proc.start()
        send.close()

    def set_line(self, line: float) -> None:
        """The pruning line the child's next programs stop at (it only falls)."""
        if self._proc is not None:
            self._line.value = min(self._line.value, line)

    def _drain(self, block_for: int | None = None) -> None:
        """Reads the values sent so far; with `block_for`, until that task's value is in or the child is gone."""
        try:
            while True:
                if self._recv.poll(0.0 if block_for is None else 0.05):
                    i, value = self._recv.recv()
                    self._results[i] = value
                    if i == block_for:
                        return
                elif block_for is None or self._proc is None or not self._proc.is_alive():
                    return
        except (EOFError, OSError):
            pass

    def _claim(self, i: int) -> int | None:
        """Task i's state before this call, which claims it for the driver when it was free (None: no lock)."""
        lock = self._state.get_lock()
        if not lock.acquire(timeout=LOCK_WAIT_S):
            return None
        try:
            state = self._state[i]
            if state == _FREE:
                self._state[i] = _PARENT
            return state
        finally:
            lock.release()

    def take(self, key: Hashable) -> Any:
        """The value of `key`, or None: the driver solves it (the child will not). While the child finishes `key`,
        the driver computes the free tasks that follow it in the list (it would otherwise wait, idle)."""
        i = self._index.get(key)
        if i is None:
            return None
        if i not in self._results and self._proc is not None:
            state = self._claim(i)
            if state != _CHILD:
                return None
            j = i + 1
            while True:
                self._drain()
                if i in self._results or not self._proc.is_alive():
                    break
                while j < len(self._tasks) and self._claim(j) != _FREE:
                    j += 1
                if j == len(self._tasks):
                    self._drain(block_for=i)
                    break
                self._results[j] = _run(self._tasks[j][1], self._line.value)
        value = self._results.get(i)
        if value is not None:
            self.used += 1
        return value

    def close(self) -> None:
        """Keeps the values already sent and stops the child (the CP-SAT solves that follow take both cores)."""
        if self._proc is None:
            return
        self._drain()
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(timeout=LOCK_WAIT_S)
        self._drain()
        self._recv.close()
        self._proc = None

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _work(tasks: list[tuple[Hashable, Callable[[float], object]]], state, line, send: Connection) -> None:
    """The child: every task not claimed by the driver, in order; a program that raises counts as useless (None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    for i, (_, program) in enumerate(tasks):
        with state.get_lock():
            if state[i] != _FREE:
                continue
            state[i] = _CHILD
        send.send((i, _run(program, line.value)))
    send.close()


def _run(program: Callable[[float], object], line: float) -> object:
    """A task's value; one that raises counts as useless (None): the driver then solves it itself, and sees why."""
    try:
        return program(line)
    except Exception:
        return None
