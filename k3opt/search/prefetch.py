"""Bound programs computed ahead on a second core: `Prefetch`.

The driver's heuristics (the seeding) and its bounding pass both run on one core; the programs the pass needs (the
frame bounds bounds.frame_dp_bound and bounds.group_frame_bound, their lifts bounds.lift_group_bound, the node
bounds bounds.node_lower_bound, the group node bounds bounds.group_node_bound) depend only on the queue, known once
the frames are bounded. A forked process works through them while the driver seeds, against the pruning line the
driver publishes (`set_line`); the pass then takes their values instead of solving them. A program given to it must
return a lower bound of every layout it stands for whatever the line (the bound programs above do: they stop once
the bound is shown at or above the line, or leave out what the line already bounds), so a value computed against an
older, higher line is as valid as one computed now, only possibly tighter."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as _mp
import os
import signal
import sys
import threading
import time as _time
from collections.abc import Callable, Hashable
from multiprocessing.connection import Connection
from typing import Any

_FREE, _CHILD, _PARENT, _SKIPPED = 0, 1, 2, 3
"""A task's state in the shared array: not started, taken by the child, claimed by the driver (the child skips it),
found useless by the child (its program returned None: nothing is sent, which keeps the pipe's traffic to the values
the driver may use)."""

LOCK_WAIT_S = 5.0
"""How long the driver waits for the shared state's lock, and for the child to end once told to: the child holds
the lock only to read and set one byte, so a longer wait means it died holding it (the driver then stops using it)."""

PIPE_BYTES = 1 << 20
"""The pipe's buffer asked of Linux (F_SETPIPE_SZ; its default is 64 KiB): a node bound list is about 145 bytes, and
the child waits on a full pipe until the driver reads it (between its seeding steps)."""

_F_SETPIPE_SZ = 1031
_PR_SET_PDEATHSIG = 1


def usable() -> bool:
    """Whether a helper process may be forked here: Linux (fork without exec is unsafe on macOS), a process with one
    thread (a fork copies no other thread, and a lock one of them holds stays held in the child), two cores or more
    (on one, the child would slow the seeding, whose steps are budgeted in wall-clock time)."""
    return (sys.platform.startswith("linux") and "fork" in _mp.get_all_start_methods()
            and threading.active_count() == 1 and len(os.sched_getaffinity(0)) >= 2)


class Prefetch:
    """`tasks` (key, program), computed in order by a forked process: a program gets the current line (`set_line`)
    and returns a bound, or None when the line makes it useless. `take(key)`: the value when the child has started
    the task (waiting for it to finish, computing the next free tasks meanwhile), else None: the driver solves it
    itself (the child will not). None also when the program returned None or raised, or when the child is gone, past
    `deadline` (monotonic) or once `stop()` holds. Without `usable()`, or with no tasks, nothing runs and every `take`
    is None."""

    def __init__(self, tasks: list[tuple[Hashable, Callable[[float], object]]], line: float,
                 deadline: float = float("inf"), stop: Callable[[], bool] | None = None) -> None:
        self._index = {key: i for i, (key, _) in enumerate(tasks)}
        self._results: dict[int, object] = {}
        self._proc: _mp.process.BaseProcess | None = None
        self._recv: Connection | None = None
        self._tasks = tasks
        self._deadline, self._stop = deadline, stop
        self.used = 0
        """Values computed ahead (by the child, or by the driver while it waited for the child) that were used."""
        if not tasks or not usable():
            return
        try:
            ctx = _mp.get_context("fork")
            self._state = ctx.Array("b", len(tasks))
            self._line = ctx.Value("d", line, lock=False)
            self._recv, send = ctx.Pipe(duplex=False)
            import fcntl  # Unix only: usable() has checked for Linux

            with contextlib.suppress(OSError):
                fcntl.fcntl(send.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
            self._proc = ctx.Process(target=_work, args=(tasks, self._state, self._line, send, self._recv,
                                                         os.getpid()), daemon=True)
            self._proc.start()
            send.close()
        except OSError:  # no semaphores (/dev/shm), or the fork refused: everything is computed here
            self._proc = None
            if self._recv is not None:
                self._recv.close()
                self._recv = None

    def set_line(self, line: float) -> None:
        """The pruning line the child's next programs stop at (it only falls). Also reads the values sent so far:
        the driver calls this often, and a child whose pipe is full waits until it is read."""
        if self._proc is not None:
            self._line.value = min(self._line.value, line)
            self._drain()

    def _drain(self, wait: float = 0.0) -> None:
        """Reads the values sent so far, waiting up to `wait` seconds for the first."""
        if self._recv is None:
            return
        try:
            while self._recv.poll(wait):
                i, value = self._recv.recv()
                self._results[i] = value
                wait = 0.0
        except (EOFError, OSError):
            pass

    def _claim(self, i: int) -> int | None:
        """Task i's state before this call, which claims it for the driver when it was free. None when the lock
        could not be had: the child died holding it, and is no longer used."""
        lock = self._state.get_lock()
        if not lock.acquire(timeout=LOCK_WAIT_S):
            self.close()
            return None
        try:
            state = self._state[i]
            if state == _FREE:
                self._state[i] = _PARENT
            return state
        finally:
            lock.release()

    def _given_up(self) -> bool:
        return (self._proc is None or not self._proc.is_alive() or _time.monotonic() > self._deadline
                or (self._stop is not None and self._stop()))

    def take(self, key: Hashable) -> Any:
        """The value of `key`, or None: the driver solves it (see the class)."""
        i = self._index.get(key)
        if i is None:
            return None
        if i not in self._results and self._proc is not None:
            if self._claim(i) != _CHILD:
                return None
            j = i + 1
            while i not in self._results:
                self._drain()
                # (A byte read without the lock: a child killed while holding it must not block the driver.)
                if i in self._results or self._proc is None or self._state.get_obj()[i] == _SKIPPED:
                    break
                if self._given_up():
                    self.close()  # a child still on the task past the limit or Ctrl-C: the driver goes on alone
                    break
                state = None
                while j < len(self._tasks) and (state := self._claim(j)) not in (_FREE, None):
                    j += 1
                if state == _FREE:
                    self._results[j] = _run(self._tasks[j][1], self._line.value)
                elif state is None and self._proc is None:
                    break
                else:
                    self._drain(wait=0.05)  # nothing left to compute here: wait for the child
        value = self._results.get(i)
        if value is not None:
            self.used += 1
        return value

    def close(self) -> None:
        """Keeps the values already sent and stops the child (the CP-SAT solves that follow take both cores)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._drain()
        if proc.is_alive():
            proc.terminate()
        proc.join(timeout=LOCK_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=LOCK_WAIT_S)
        self._drain()
        if self._recv is not None:
            self._recv.close()
            self._recv = None

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _work(tasks: list[tuple[Hashable, Callable[[float], object]]], state, line, send: Connection,
          recv: Connection, parent: int) -> None:
    """The child: every task not claimed by the driver, in order, while the driver lives."""
    recv.close()  # the driver's end: with it closed here, a dead driver makes the child's send fail, not block
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # close() ends it, whatever handler the caller installed
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    for i, (_, program) in enumerate(tasks):
        if os.getppid() != parent:
            break
        with state.get_lock():
            if state[i] != _FREE:
                continue
            state[i] = _CHILD
        value = _run(program, line.value)
        if value is None:
            with state.get_lock():
                state[i] = _SKIPPED
        else:
            try:
                send.send((i, value))
            except OSError:
                break
    send.close()


def _run(program: Callable[[float], object], line: float) -> object:
    """A task's value; one that raises counts as useless (None): the driver then solves it itself, and sees why."""
    try:
        return program(line)
    except Exception:
        return None
