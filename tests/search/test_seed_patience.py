"""The seeding stops once it stalls (search/incumbents._Patience): it goes on at least POLICY.patience_min_s, then stops
once it has gone as long without a gain (the top-th fastest or the fastest layout lowered by more than `gain`, or a
layout added while there are fewer than top) as it took to make its last gain. On a fake clock, with step times
only (the rule reads nothing else)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import k3opt.search.incumbents as inc


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch, use_policy):
    c = _Clock()
    monkeypatch.setattr(inc, "_time", SimpleNamespace(monotonic=c))  # this module's clock only
    use_policy(patience_min_s=8.0)  # the rule, not the shipped value
    return c


def _items(*times: float) -> list:
    return [SimpleNamespace(rank_time_s=t) for t in sorted(times)]


def test_no_gain_stops_at_the_minimum(clock):
    p = inc._Patience(100.0, 1, 0.001, _items(20.0))
    clock.now = 107.9
    assert not p.out(_items(20.0))   # 7.9 s < POLICY.patience_min_s
    clock.now = 108.1
    assert p.out(_items(20.0))       # no gain since the start: 8.1 s > 0 s


def test_a_gain_extends_it_by_the_time_it_took(clock):
    p = inc._Patience(100.0, 1, 0.001, _items(20.0))
    clock.now = 106.0
    assert not p.out(_items(19.0, 20.0))  # 5% faster: a gain, 6 s in
    clock.now = 111.9
    assert not p.out(_items(19.0))        # 5.9 s since the gain, not more than the 6 s it took
    clock.now = 112.1
    assert p.out(_items(19.0))            # 6.1 s > 6 s


def test_a_change_within_the_gain_is_no_gain(clock):
    p = inc._Patience(100.0, 1, 0.001, _items(20.0))
    clock.now = 106.0
    assert not p.out(_items(19.99))       # 0.05% < 0.1%: not a gain
    clock.now = 108.1
    assert p.out(_items(19.99))


def test_the_top_th_layout_counts(clock):
    # top = 2: the second one's arrival (from none) is a gain, and so is a faster second one.
    p = inc._Patience(100.0, 2, 0.001, _items(20.0))
    clock.now = 107.0
    assert not p.out(_items(20.0, 25.0))  # the 2nd fastest appears at 7 s: a gain
    clock.now = 113.9
    assert not p.out(_items(20.0, 25.0))  # 6.9 s since, not more than 7 s
    clock.now = 114.0
    assert not p.out(_items(20.0, 22.0))  # 12% faster 2nd: a gain at 14 s
    clock.now = 127.9
    assert not p.out(_items(20.0, 22.0))  # 13.9 s since, not more than 14 s
    clock.now = 128.1
    assert p.out(_items(20.0, 22.0))


def test_the_fastest_layout_counts_too(clock):
    # top = 2: a faster first layout, the second unchanged, is a gain (with top 5 the best may still improve
    # while the 5th stalls).
    p = inc._Patience(100.0, 2, 0.001, _items(20.0, 25.0))
    clock.now = 107.0
    assert not p.out(_items(18.0, 25.0))  # the fastest 10% faster at 7 s
    clock.now = 113.9
    assert not p.out(_items(18.0, 25.0))
    clock.now = 114.1
    assert p.out(_items(18.0, 25.0))


def test_with_fewer_than_top_a_new_layout_is_a_gain(clock):
    p = inc._Patience(100.0, 5, 0.001, _items(20.0))
    clock.now = 109.0
    assert not p.out(_items(20.0, 30.0))        # 2 of 5: a gain at 9 s, no 5th layout yet
    clock.now = 117.9
    assert not p.out(_items(20.0, 30.0))        # 8.9 s since
    clock.now = 118.1
    assert p.out(_items(20.0, 30.0))            # 9.1 s > 9 s: stalled although fewer than 5


def test_steps_below_the_gain_add_up(clock):
    # Each step is 0.05% (below the 0.1% gain) against the previous one; the reference stays at 20.0 s, so the
    # third step (20 x 0.9995^3 = 19.970, 0.15% below 20) is a gain, at 9 s.
    p = inc._Patience(100.0, 1, 0.001, _items(20.0))
    t = 20.0
    for now in (103.0, 106.0):
        t *= 0.9995
        clock.now = now
        assert not p.out(_items(t))
    clock.now = 109.0
    t *= 0.9995
    # 0.15% below the reference: a gain at 9 s. Had the reference followed each step, no step would be a gain
    # and this call, past the 8 s minimum, would stop it.
    assert not p.out(_items(t))
    clock.now = 117.9
    assert not p.out(_items(t))                 # 8.9 s since the gain
    clock.now = 118.1
    assert p.out(_items(t))


def test_without_a_top_it_never_stops(clock):
    p = inc._Patience(100.0, None, 0.001, _items(20.0))
    clock.now = 1e6
    assert not p.out(_items(20.0))


def test_a_gain_of_one_mark_leaves_the_others_reference(clock):
    # top = 2: at 4 s the 2nd gains 10% while the fastest moves 0.05% (no gain); at 10 s the fastest is 0.11%
    # below its reference of 20.0 s (0.06% below 19.99): a gain, so the stop waits 10 s more.
    p = inc._Patience(100.0, 2, 0.001, _items(20.0, 25.0))
    clock.now = 104.0
    assert not p.out(_items(19.99, 22.5))
    clock.now = 110.0
    assert not p.out(_items(19.978, 22.5))
    clock.now = 119.9
    assert not p.out(_items(19.978, 22.5))  # 9.9 s since the gain at 10 s (6.1 s past the 4-s one's mark)
    clock.now = 120.1
    assert p.out(_items(19.978, 22.5))


def test_the_seeding_after_the_bounding_pass_has_its_own_short_minimum(monkeypatch, use_policy):
    """The part after the pass visits only shapes whose tightened bounds are under the line: its stall stop's
    minimum is POLICY.second_patience_s, not the first part's patience_min_s (which took a whole 10-s share of a
    60-s plan without a gain at 4,096 GPUs and 16K context)."""
    import k3opt
    from k3opt.search.driver import _Search  # noqa: PLC2701

    use_policy(second_patience_s=3.25, patience_min_s=17.0)
    s = _Search(k3opt.load_job("k3-512-4k"), None, None, top=1, time_limit=60.0, workers=1, pareto=False,
                pareto_step_gib=1.0, progress=None, gap=0.01)
    calls: list[float | None] = []
    monkeypatch.setattr(s, "_seed_frames", lambda patience_min, done, top: calls.append(patience_min))
    monkeypatch.setattr(s, "_proven", lambda fastest: False)
    monkeypatch.setattr(s, "_spread", lambda: None)
    s.seed_left = 5.0
    s._second_seeding()
    assert calls == [3.25]
