"""CP-SAT solves that a native abort cannot take down.

OR-tools 9.15's presolve can abort the whole process while it carries a solution hint through a variable's
encoding (google/or-tools#5288: an uncaught `std::out_of_range` from `absl::btree_map::at` in
`SolutionCrush::SetOrUpdateVarToDomainWithOptionalEscapeValue`, nondeterministic across runs of one model). The
node models are hinted, so on Linux each solve runs in a forked child that inherits the built model and sends back
what the search reads (status, objective, bound, values). A child that dies is solved again without its hint,
which that presolve path needs; a second death leaves the node unknown. The child touches no lock another thread
of the parent may hold (it solves, pickles and writes to a pipe); one that hangs anyway is stopped past its limit.
Elsewhere the solve runs in process (fork without exec is unsafe on macOS; Windows has none).
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import select
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from k3opt.search.policy import POLICY


@dataclass(frozen=True)
class Solved:
    """What a CP-SAT solve returned, read the way the node model reads a solver: its status, the objective and
    bound, and every variable's value in the solution (empty without one)."""

    status: int
    name: str
    """CP-SAT's name of the status (OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID)."""
    objective_value: float = 0.0
    best_objective_bound: float = 0.0
    solution: tuple[int, ...] = ()
    retried_without_hint: bool = False
    aborted: int = 0
    """Children that died (0, 1 or 2)."""
    note: str = field(default="", compare=False)

    def value(self, var: cp_model.IntVar) -> int:
        """The variable's value in the solution."""
        return self.solution[var.index]


def isolation_available() -> bool:
    """Whether solves run in a forked child: on Linux, where fork is the platform's own default."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def solve(solver: cp_model.CpSolver, model: cp_model.CpModel, isolate: bool | None = None) -> Solved:
    """`solver.solve(model)`, in a forked child where available (`isolate` None: `isolation_available()`); a
    child that dies is solved again without the model's hint, and a second death gives UNKNOWN."""
    if not (isolation_available() if isolate is None else isolate):
        return _read(solver, solver.solve(model))
    limit = float(solver.parameters.max_time_in_seconds)
    try:
        got = _in_child(solver, model, limit, drop_hint=False)
    except OSError:  # no fork or pipe here (a memory or descriptor limit): the solve runs in process
        return _read(solver, solver.solve(model))
    if got is not None:
        return got
    again = _in_child(solver, model, limit, drop_hint=True)
    if again is not None:
        warnings.warn("CP-SAT aborted in presolve (google/or-tools#5288); the node was solved again without its "
                      "hint", RuntimeWarning, stacklevel=2)
        return replace(again, retried_without_hint=True, aborted=1)
    warnings.warn("CP-SAT aborted twice on one node (google/or-tools#5288); the node is left unknown",
                  RuntimeWarning, stacklevel=2)
    return Solved(cp_model.UNKNOWN, "UNKNOWN", aborted=2)


def _read(solver: cp_model.CpSolver, st: int) -> Solved:
    """The parts of a finished solve the search reads."""
    has = st in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    bounded = has or st == cp_model.UNKNOWN
    return Solved(int(st), solver.status_name(st), float(solver.objective_value) if has else 0.0,
                  float(solver.best_objective_bound) if bounded else 0.0,
                  tuple(int(v) for v in solver.response_proto.solution) if has else ())


def _in_child(solver: cp_model.CpSolver, model: cp_model.CpModel, limit: float, drop_hint: bool) -> Solved | None:
    """One solve in a forked child; None when the child died before it sent its result. The parent waits at most
    the solve's limit plus `POLICY.child_grace_s` (a child past it is killed: UNKNOWN)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns on fork beside other threads (a live display's): the child touches none of their locks.
        warnings.filterwarnings("ignore", message=".*use of fork.*", category=DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
    if pid == 0:  # the child: solve, send, leave without running the parent's exit handlers
        code = 1
        try:
            os.close(r)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops after this slice
            # An abort's C++ message and a fault handler's dump would reach the user's terminal; the parent warns.
            faulthandler.disable()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            if drop_hint:
                model.clear_hints()
            data = pickle.dumps(_read(solver, solver.solve(model)))
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    # A solve without a limit is waited for as long as it takes.
    deadline = time.monotonic() + limit + POLICY.child_grace_s if math.isfinite(limit) else math.inf
    timed_out = ended = False
    poller = select.poll()  # not select(): a process holding over 1,024 descriptors (a server) gets higher ones
    poller.register(r, select.POLLIN | select.POLLHUP)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not poller.poll(math.ceil(left * 1000) if math.isfinite(left) else None):
                continue
            chunk = os.read(r, 1 << 20)
            if not chunk:
                ended = True
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        if not ended:  # past the grace, or the parent interrupted: the child must not outlive the wait
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if timed_out:
        return Solved(cp_model.UNKNOWN, "UNKNOWN", note="the solve's child outlived its limit and was stopped")
    if not chunks:
        return None
    try:
        return pickle.loads(b"".join(chunks))
    except (pickle.UnpicklingError, EOFError, ValueError):  # cut short by the child's death
        return None
