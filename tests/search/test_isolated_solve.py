"""CP-SAT solves in a forked child (k3opt.search.isolated): the same answer as in process, and a child that aborts
(OR-tools 9.15's presolve can, google/or-tools#5288) or hangs leaves the search running."""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest
from ortools.sat.python import cp_model

from k3opt.search import isolated

pytestmark = pytest.mark.skipif(not isolated.isolation_available(), reason="solves run in process here")


def _model() -> tuple[cp_model.CpModel, cp_model.IntVar, cp_model.IntVar]:
    """max 3x + 2y, x + y <= 4, x <= 3, hinted at (0, 0): by hand x = 3 (each unit of x pays 3 > 2, capped at 3),
    y = 4 - 3 = 1, objective 3 * 3 + 2 * 1 = 11."""
    m = cp_model.CpModel()
    x, y = m.new_int_var(0, 10, "x"), m.new_int_var(0, 10, "y")
    m.add(x + y <= 4)
    m.add(x <= 3)
    m.maximize(3 * x + 2 * y)
    m.add_hint(x, 0)
    m.add_hint(y, 0)
    return m, x, y


def _solver(limit: float = 10.0) -> cp_model.CpSolver:
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = limit
    s.parameters.num_workers = 1
    return s


@pytest.mark.parametrize("isolate", [True, False])
def test_same_answer_in_a_child_and_in_process(isolate: bool) -> None:
    m, x, y = _model()
    got = isolated.solve(_solver(), m, isolate=isolate)
    assert (got.status, got.name) == (cp_model.OPTIMAL, "OPTIMAL")
    assert got.objective_value == 11 and got.best_objective_bound == 11
    assert (got.value(x), got.value(y)) == (3, 1)
    assert not got.retried_without_hint and got.aborted == 0


def _abort_when(hinted_only: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """CP-SAT's solve aborts the process (as #5288's presolve does) on a hinted model, or on every model."""
    solve = cp_model.CpSolver.solve

    def aborting(self: cp_model.CpSolver, model: cp_model.CpModel, *a: object, **k: object) -> object:
        if model.proto.has_solution_hint() or not hinted_only:
            os.abort()
        return solve(self, model, *a, **k)

    monkeypatch.setattr(cp_model.CpSolver, "solve", aborting)


def test_an_aborted_child_is_solved_again_without_its_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    m, x, y = _model()
    _abort_when(True, monkeypatch)
    with pytest.warns(RuntimeWarning, match="without its hint"):
        got = isolated.solve(_solver(), m, isolate=True)
    assert got.name == "OPTIMAL" and got.objective_value == 11 and (got.value(x), got.value(y)) == (3, 1)
    assert got.retried_without_hint and got.aborted == 1
    assert m.proto.has_solution_hint()  # the parent's model keeps its hint: only the child dropped it


def test_two_aborts_leave_the_node_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    m, _, _ = _model()
    _abort_when(False, monkeypatch)
    with pytest.warns(RuntimeWarning, match="aborted twice"):
        got = isolated.solve(_solver(), m, isolate=True)
    assert (got.status, got.name, got.aborted, got.solution) == (cp_model.UNKNOWN, "UNKNOWN", 2, ())


def _solve_after(seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """CP-SAT's solve sleeps `seconds` before it solves (a slow or hung child)."""
    solve = cp_model.CpSolver.solve

    def sleeping(self: cp_model.CpSolver, model: cp_model.CpModel, *a: object, **k: object) -> object:
        time.sleep(seconds)
        return solve(self, model, *a, **k)

    monkeypatch.setattr(cp_model.CpSolver, "solve", sleeping)


def test_a_hung_child_is_stopped_past_its_limit_and_grace(monkeypatch: pytest.MonkeyPatch, use_policy) -> None:
    """A child that outlives its limit plus POLICY.child_grace_s is killed; the solve reports UNKNOWN (a child
    left to finish would return the optimum after its 30-s sleep)."""
    use_policy(child_grace_s=0.2)
    _solve_after(30, monkeypatch)
    m, _, _ = _model()
    got = isolated.solve(_solver(limit=0.1), m, isolate=True)
    assert got.name == "UNKNOWN" and "outlived its limit" in got.note


def test_a_solve_without_a_limit_is_not_cut_by_the_grace(monkeypatch: pytest.MonkeyPatch, use_policy) -> None:
    """CP-SAT's default limit is infinite: the parent then waits for the child however long it takes (here 0.5 s
    against a 0.1-s grace), and gets its optimum."""
    use_policy(child_grace_s=0.1)
    _solve_after(0.5, monkeypatch)
    m, _, _ = _model()
    s = cp_model.CpSolver()
    s.parameters.num_workers = 1
    got = isolated.solve(s, m, isolate=True)
    assert got.name == "OPTIMAL" and got.objective_value == 11


def test_an_interrupted_wait_stops_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in the parent while it waits (a KeyboardInterrupt off the main thread) kills the child
    rather than waiting for it to finish its solve (30 s here): the exception propagates and the child reaped was
    ended by SIGKILL."""
    class Interrupted:
        def register(self, *a: object) -> None:
            pass

        def poll(self, *a: object) -> list:
            raise KeyboardInterrupt

    reaped: list[int] = []
    waitpid = os.waitpid

    def spy(pid: int, options: int) -> tuple[int, int]:
        got = waitpid(pid, options)
        reaped.append(got[1])
        return got

    _solve_after(30, monkeypatch)
    monkeypatch.setattr(isolated.select, "poll", Interrupted)
    monkeypatch.setattr(isolated.os, "waitpid", spy)
    m, _, _ = _model()
    with pytest.raises(KeyboardInterrupt):
        isolated.solve(_solver(limit=10.0), m, isolate=True)
    assert len(reaped) == 1 and os.WIFSIGNALED(reaped[0]) and os.WTERMSIG(reaped[0]) == signal.SIGKILL


def test_a_refused_fork_solves_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fork is refused (ENOMEM under a memory limit), the node is solved in the planner's process."""
    def refused() -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(isolated.os, "fork", refused)
    m, x, y = _model()
    got = isolated.solve(_solver(), m, isolate=True)
    assert got.name == "OPTIMAL" and (got.value(x), got.value(y)) == (3, 1)


def test_a_solve_started_off_the_main_thread_runs_in_its_child() -> None:
    """The browser lab plans on worker threads: the child, forked from one, still sets its signal handling (the
    forking thread is its main thread) and returns the optimum without dying."""
    import threading

    out: list = []

    def run() -> None:
        m, x, y = _model()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a child that died would warn
            out.append(isolated.solve(_solver(), m, isolate=True))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(out) == 1 and out[0].name == "OPTIMAL" and out[0].objective_value == 11 and out[0].aborted == 0
