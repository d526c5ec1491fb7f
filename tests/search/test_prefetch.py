"""search/prefetch.Prefetch: bound programs run ahead in a forked process, claimed, stolen and skipped as documented;
and the driver's use of it changes no layout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from k3opt.search import driver, prefetch
from k3opt.search.prefetch import Prefetch

pytestmark = pytest.mark.skipif(not prefetch.usable(), reason="no helper process here (search/prefetch.usable)")


def _recorder(log: Path, name: str, value: float | None, wait_for: Path | None = None, touch: Path | None = None):
    """A program that waits for `wait_for` to exist, appends "name pid line" to `log` (both processes write to it),
    touches `touch`, and returns `value`."""

    def program(line: float) -> float | None:
        end = time.monotonic() + 20
        while wait_for is not None and not wait_for.exists() and time.monotonic() < end:
            time.sleep(0.005)
        with log.open("a") as fh:
            fh.write(f"{name} {os.getpid()} {line}\n")
        if touch is not None:
            touch.touch()
        return value

    return program


def _runs(log: Path) -> dict[str, tuple[int, float]]:
    if not log.exists():
        return {}
    return {name: (int(pid), float(line)) for name, pid, line in (ln.split() for ln in log.read_text().splitlines())}


def _until(check, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _taken_by_child(pf: Prefetch, i: int) -> bool:
    return pf._state.get_obj()[i] == prefetch._CHILD


def test_the_child_computes_and_take_returns_its_value(tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    with Prefetch([("a", _recorder(log, "a", 1.5, wait_for=gate))], line=20.0) as pf:
        _until(lambda: _taken_by_child(pf, 0))
        gate.touch()
        assert pf.take("a") == 1.5
        assert pf.used == 1
    assert _runs(log)["a"][0] != os.getpid()  # computed in the other process


def test_a_claimed_task_is_left_to_the_caller_and_a_free_one_is_stolen_while_waiting(tmp_path: Path) -> None:
    """The child is held on "a" until "c" runs; "b" is claimed by the caller (None: solve it yourself) and nobody
    runs it; while the caller waits for "a" it computes the next free task, "c" (which releases "a"), itself, and
    "c"'s value is then taken as is."""
    log, gate = tmp_path / "log", tmp_path / "gate"
    tasks = [("a", _recorder(log, "a", 1.0, wait_for=gate)), ("b", _recorder(log, "b", 2.0)),
             ("c", _recorder(log, "c", 3.0, touch=gate))]
    with Prefetch(tasks, line=20.0) as pf:
        _until(lambda: _taken_by_child(pf, 0))
        assert pf.take("b") is None
        assert pf.take("a") == 1.0
        assert pf.take("c") == 3.0
    runs = _runs(log)
    assert "b" not in runs
    assert runs["a"][0] != os.getpid()
    assert runs["c"][0] == os.getpid()
    assert pf.used == 2


def test_the_child_reads_the_line_published_before_it_starts_a_task(tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    tasks = [("a", _recorder(log, "a", 1.0, wait_for=gate)), ("b", _recorder(log, "b", 2.0))]
    with Prefetch(tasks, line=20.0) as pf:
        _until(lambda: _taken_by_child(pf, 0))
        pf.set_line(18.5)
        pf.set_line(19.0)  # the line only falls
        gate.touch()
        _until(lambda: "b" in _runs(log))
    runs = _runs(log)
    assert runs["a"] == (runs["b"][0], 20.0)  # "a" started before the line fell
    assert runs["b"][1] == 18.5 and runs["b"][0] != os.getpid()


def test_a_task_the_child_finds_useless_is_left_to_the_caller(tmp_path: Path) -> None:
    """A program that returns None sends nothing; the task is marked so, and take() returns None at once while the
    child goes on with the next task."""
    log, gate, done = tmp_path / "log", tmp_path / "gate", tmp_path / "done"
    tasks = [("a", _recorder(log, "a", None, wait_for=gate)), ("b", _recorder(log, "b", 1.0, wait_for=done))]
    with Prefetch(tasks, line=20.0) as pf:
        _until(lambda: _taken_by_child(pf, 0))
        gate.touch()
        _until(lambda: _taken_by_child(pf, 1))
        assert pf._state.get_obj()[0] == prefetch._SKIPPED
        assert pf.take("a") is None
        assert pf._proc.is_alive()
        done.touch()
        assert pf.take("b") == 1.0
    assert "a" in _runs(log)


def test_a_program_that_raises_is_left_to_the_caller(tmp_path: Path) -> None:
    gate = tmp_path / "gate"

    def bad(line: float) -> float:
        while not gate.exists():
            time.sleep(0.005)
        raise ValueError("no bound")

    with Prefetch([("a", bad)], line=20.0) as pf:
        _until(lambda: _taken_by_child(pf, 0))
        gate.touch()
        assert pf.take("a") is None
        assert pf.take("unknown") is None
    assert pf.used == 0


def test_a_dead_child_does_not_block_take(tmp_path: Path) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    pf = Prefetch([("a", _recorder(log, "a", 1.0, wait_for=gate))], line=20.0)
    _until(lambda: _taken_by_child(pf, 0))
    pf._proc.kill()
    pf._proc.join()
    assert pf.take("a") is None
    pf.close()
    assert pf.take("a") is None


def test_take_gives_up_past_the_deadline_and_on_stop(tmp_path: Path) -> None:
    """A child still on the task when the deadline passes (or Ctrl-C's flag is up) is stopped: the caller goes on
    alone instead of waiting for a program that may not end in time."""
    gate = tmp_path / "gate"
    for kwargs in ({"deadline": time.monotonic() + 0.5}, {"stop": lambda: True}):
        pf = Prefetch([("a", _recorder(tmp_path / "log", "a", 1.0, wait_for=gate))], line=20.0, **kwargs)
        _until(lambda pf=pf: _taken_by_child(pf, 0))
        assert pf.take("a") is None
        assert pf._proc is None  # closed
    gate.touch()


def test_no_tasks_no_process() -> None:
    pf = Prefetch([], line=20.0)
    assert pf._proc is None and pf.take("a") is None
    pf.close()


@pytest.mark.parametrize("top", [1, 3])
def test_the_plan_with_the_helper_process_matches_one_without(tiny, slow, pp2_job, monkeypatch, top) -> None:
    """The values computed ahead are used and change no layout: the same ranked layouts and status as with every
    program solved in the driver (search/prefetch patched out), both with two CP-SAT workers."""
    made: list[Prefetch] = []

    class Spy(Prefetch):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(driver, "Prefetch", lambda tasks, line, **k: Prefetch([], line))
    alone = driver.plan(pp2_job, tiny, slow, top=top, time_limit=60, pareto=False)
    monkeypatch.setattr(driver, "Prefetch", Spy)
    helped = driver.plan(pp2_job, tiny, slow, top=top, time_limit=60, pareto=False)
    assert any(pf.used > 0 for pf in made)
    assert [it.layout for it in helped.layouts] == [it.layout for it in alone.layouts]
    assert helped.status == alone.status == "OPTIMAL"
    assert helped.bound <= helped.layouts[0].rank_time_s


def test_the_helper_bounds_every_interleaved_group_before_its_members(tiny, slow, pp2_job) -> None:
    """The helper's order (driver._pass_tasks): every sharding group's program comes before the frame programs of
    the members of an interleaved group (one group program lifts all of them; a member's own is needed only where
    it does not), while the v = 1 frames, which no group program bounds, keep their place by frame bound. The
    groups' lifts by their node programs (bounds.lift_group_bound) come between: after every group program, before
    every member's."""
    import math

    from k3opt.search.bounds import frame_lower_bound
    from k3opt.search.frames import enumerate_frames, sharding_group

    frames = enumerate_frames(pp2_job, tiny, 8, slow)
    members_of: dict[tuple, list] = {}
    for f in frames:
        members_of.setdefault(sharding_group(f), []).append(f)
    grouped = {f for mem in members_of.values() if len(mem) > 1 and mem[0].vp > 1 for f in mem}
    assert grouped and any(f.vp == 1 for f in frames)
    lbs = {f: frame_lower_bound(pp2_job, f, tiny, slow) for f in frames}
    tasks = driver._pass_tasks(pp2_job, tiny, slow, frames, members_of, list(driver.Recompute)[:1],
                               list(driver.FsdpLifecycle)[:1], lbs, driver._Caps(pp2_job, tiny, slow), math.inf)
    keys = [key for key, _ in tasks]
    last_group = max(i for i, k in enumerate(keys) if k[0] == "frame")
    lifts = [i for i, k in enumerate(keys) if k[0] == "lift"]
    first_member = min(i for i, k in enumerate(keys) if k[0] in ("dp", "nodes") and k[1] in grouped)
    assert lifts and last_group < min(lifts) and max(lifts) < first_member
    assert {keys[i][1] for i in lifts} == {k[1] for k in keys if k[0] == "frame"}
    # Before the lifts: the group programs and the v = 1 frames' programs, together by frame bound.
    ahead = [min(lbs[f][0] for f in members_of[k[1]]) if k[0] == "frame" else lbs[k[1]][0]
             for k in keys[:min(lifts)]]
    assert ahead == sorted(ahead)
    assert {k[1] for k in keys[:min(lifts)] if k[0] == "dp"} == {f for f in frames if f not in grouped}


def test_the_helper_runs_until_the_first_cp_sat_solve(tiny, slow, pp2_job, monkeypatch, use_policy) -> None:
    """The helper bounds on after the seeding (at 8,192 GPUs the bounding after it solves no model) and stops
    before the first CP-SAT solve, which takes both cores: with the node models forced (gap 0) and no bounding pass
    (the node bounds then come after the seeding), every solve comes after the close, and the close after the last
    seeding call (`spread`) and node bounds computed after it."""
    events: list[str] = []

    class Spy(Prefetch):
        def close(self) -> None:
            # (The helper that shares the shapes' first bounds closes at the end of that pass: not this one.)
            if self._proc is not None and "first" not in {key[0] for key in self._index}:
                events.append("close")
            super().close()

    real_solve, real_spread = driver.solve_frame, driver.spread

    def solve(*a, **k):
        events.append("solve")
        return real_solve(*a, **k)

    def spread(*a, **k):
        events.append("spread")
        return real_spread(*a, **k)

    real_bound = driver.tight_node_bound

    def bound(*a, **k):
        events.append("bound")
        return real_bound(*a, **k)

    monkeypatch.setattr(driver, "Prefetch", Spy)
    monkeypatch.setattr(driver, "solve_frame", solve)
    monkeypatch.setattr(driver, "spread", spread)
    monkeypatch.setattr(driver, "tight_node_bound", bound)
    use_policy(bound_share=0.0)  # no bounding pass: the node bounds come after the seeding
    plan = driver.plan(pp2_job, tiny, slow, top=1, time_limit=60, pareto=False, gap=0)
    assert plan.status == "OPTIMAL"
    assert "solve" in events and "close" in events
    assert events.index("spread") < events.index("close") < events.index("solve")
    # Bounding after the seeding, with the helper still open.
    assert "bound" in events[events.index("spread"):events.index("close")]


def test_the_first_bounds_shared_with_the_helper_are_those_computed_here(tiny, slow, pp2_job) -> None:
    """The shapes' first bounds (driver._first_bounds, one sharding group per task) taken from the helper equal those
    computed in the driver, and follow the pass's rules: a shape is left out (bound None) only where a shape of its
    group with multiples of both FSDP degrees has a peak bound over the HBM line; a shape over the line has no
    budget; a shape enters the queue (an estimate) exactly when its peak bound is within its budget. At a 3.1 GiB
    reserve (0.9 GiB left of 4) the least sharded shapes' peak bounds (up to 1.2 GiB) are over the line."""
    import math

    from k3opt.search.frames import allocated_capacity_bytes, enumerate_frames, sharding_group

    job = pp2_job.model_copy(update={"reserve_gib": 3.1})
    frames = enumerate_frames(job, tiny, 8, slow)
    hbm_line = slow.hbm_bytes - int(round(job.reserve_gib * 2**30))
    by_group: dict[tuple, list] = {}
    for f in driver._most_sharded_first(frames):
        by_group.setdefault(sharding_group(f), []).append(f)
    tasks = [(("first", i), lambda line, mem=tuple(mem): driver._first_bounds(
        line, job, tiny, slow, hbm_line, mem, {})) for i, mem in enumerate(by_group.values())]
    with Prefetch(tasks, math.inf) as pf:
        _until(lambda: _taken_by_child(pf, 0))  # (the tasks are quick: the driver would claim them all first)
        shared = [pf.take(key) for key, _ in tasks]
        used = pf.used
    here = [program(math.inf) for _, program in tasks]
    assert used > 0
    assert [s for s in shared if s is not None] == [h for s, h in zip(shared, here, strict=True) if s is not None]
    over = {f for rows in here for f, lb, _, _ in rows if lb is not None and lb[1] > hbm_line}
    assert over, "the test job should have shapes over the HBM line"
    assert any(lb is None for rows in here for _, lb, _, _ in rows), "and shapes they dominate"
    for rows in here:
        for f, lb, cap, estimate in rows:
            if lb is None:
                assert any(sharding_group(g) == sharding_group(f) and g.expert_fsdp % f.expert_fsdp == 0
                           and g.dense_fsdp % f.dense_fsdp == 0 for g in over)
                continue
            assert (cap is None) == (lb[1] > hbm_line)
            if cap is not None:
                assert cap == allocated_capacity_bytes(job, f, tiny, slow)
                assert (estimate is not None) == (lb[1] <= cap)


def test_a_node_whose_group_program_outlasts_the_limit_goes_back_unsolved(tiny, slow, pp2_job, monkeypatch) -> None:
    """A group node program that ends past the time limit (at 8,192 GPUs one takes seconds) returns no bound, and the
    driver stops there: the node goes back to the queue, its own relaxation is not started (it ran the plan a
    second or two past the limit), and the plan is FEASIBLE with a bound below its layout."""
    import math

    events: list[str] = []
    real_tight = driver.tight_node_bound

    def outlasting(*a, deadline: float = math.inf, **k) -> float:
        while time.monotonic() <= deadline:
            time.sleep(0.01)
        events.append("group")
        return 0.0

    def tight(*a, **k):
        events.append("tight")
        return real_tight(*a, **k)

    monkeypatch.setattr(driver, "Prefetch", lambda tasks, line, **k: Prefetch([], line))
    monkeypatch.setattr(driver, "group_node_bound", outlasting)
    monkeypatch.setattr(driver, "tight_node_bound", tight)
    plan = driver.plan(pp2_job, tiny, slow, top=1, time_limit=8, pareto=False, gap=0)
    assert events.count("group") == 1 and events[-1] == "group", events
    assert plan.status == "FEASIBLE" and plan.layouts
    assert plan.bound <= plan.layouts[0].rank_time_s
