"""search/prefetch.Prefetch: bound programs run ahead in a forked process, claimed, stolen and skipped as documented;
and the driver's use of it changes no layout and keeps every bound under the enumerated optimum."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from k3opt.search import driver
from k3opt.search.prefetch import Prefetch


def _recorder(log: Path, name: str, value: float, wait_for: Path | None = None):
    """A program that appends "name pid" to `log` (both processes write to it), waits for `wait_for` to exist, and
    returns `value` (or, with value nan, the line it was given)."""

    def program(line: float) -> float:
        if wait_for is not None:
            end = time.monotonic() + 10
            while not wait_for.exists() and time.monotonic() < end:
                time.sleep(0.01)
        with log.open("a") as fh:
            fh.write(f"{name} {os.getpid()}\n")
        return line if value != value else value

    return program


def _runs(log: Path) -> dict[str, int]:
    return {name: int(pid) for name, pid in (line.split() for line in log.read_text().splitlines())}


def test_the_child_computes_and_take_returns_its_value(tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    with Prefetch([("a", _recorder(log, "a", 1.5, wait_for=gate))], line=20.0) as pf:
        time.sleep(0.3)  # the child has taken "a" and waits at the gate
        gate.touch()
        assert pf.take("a") == 1.5
        assert pf.used == 1
    runs = _runs(log)
    assert runs["a"] != os.getpid()  # computed in the other process


def test_a_task_claimed_before_the_child_reaches_it_is_left_to_the_caller(tmp_path: Path) -> None:
    """The child is held on "a"; "b" is claimed by the caller (None: solve it yourself) and nobody runs it; while
    the caller waits for "a" it computes the next free task, "c", itself, and "c"'s value is then taken as is."""
    log, gate = tmp_path / "log", tmp_path / "gate"
    tasks = [("a", _recorder(log, "a", 1.0, wait_for=gate)), ("b", _recorder(log, "b", 2.0)),
             ("c", _recorder(log, "c", 3.0, wait_for=gate))]
    with Prefetch(tasks, line=20.0) as pf:
        time.sleep(0.3)
        assert pf.take("b") is None
        gate.touch()
        assert pf.take("a") == 1.0
        assert pf.take("c") == 3.0
    runs = _runs(log)
    assert "b" not in runs
    assert runs["a"] != os.getpid()
    assert runs["c"] == os.getpid()  # stolen: the caller computed it while the child finished "a"
    assert pf.used == 2


def test_the_child_reads_the_line_published_before_it_starts_a_task(tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    nan = float("nan")
    tasks = [("a", _recorder(log, "a", nan, wait_for=gate)), ("b", _recorder(log, "b", nan))]
    with Prefetch(tasks, line=20.0) as pf:
        time.sleep(0.3)
        pf.set_line(18.5)
        pf.set_line(19.0)  # the line only falls
        gate.touch()
        assert pf.take("a") == 20.0  # "a" started before the line fell
        time.sleep(0.3)
        assert pf.take("b") == 18.5


def test_a_program_that_raises_is_left_to_the_caller(tmp_path: Path) -> None:
    def bad(line: float) -> float:
        raise ValueError("no bound")

    with Prefetch([("a", bad)], line=20.0) as pf:
        time.sleep(0.3)
        assert pf.take("a") is None
        assert pf.take("unknown") is None
    assert pf.used == 0


def test_a_dead_child_does_not_block_take(tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    pf = Prefetch([("a", _recorder(log, "a", 1.0, wait_for=gate))], line=20.0)
    time.sleep(0.3)
    pf._proc.terminate()
    pf._proc.join()
    start = time.monotonic()
    assert pf.take("a") is None
    assert time.monotonic() - start < 2.0
    pf.close()
    assert pf.take("a") is None


def test_no_tasks_no_process() -> None:
    pf = Prefetch([], line=20.0)
    assert pf._proc is None and pf.take("a") is None
    pf.close()


@pytest.mark.parametrize("top", [1, 3])
def test_the_plan_with_a_second_process_matches_one_without(tiny, slow, pp2_job, monkeypatch, top) -> None:
    """The prefetched bounds are used (at least one) and change no layout: the same ranked layouts, status and
    a bound no lower than with every program solved in the driver (a program stopped at an older, higher line can
    only return a tighter bound)."""
    made: list[Prefetch] = []

    class Spy(Prefetch):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(driver, "Prefetch", Spy)
    one = driver.plan(pp2_job, tiny, slow, top=top, time_limit=60, workers=1, pareto=False)
    assert made[-1]._proc is None
    two = driver.plan(pp2_job, tiny, slow, top=top, time_limit=60, workers=2, pareto=False)
    assert made[-1].used > 0
    assert [it.layout for it in two.layouts] == [it.layout for it in one.layouts]
    assert two.status == one.status == "OPTIMAL"
    assert two.bound >= one.bound - 1e-9
