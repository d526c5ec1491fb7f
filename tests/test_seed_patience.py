"""The seeding stops once it stalls (search/incumbents._Patience): it goes on at least PATIENCE_MIN_S, then stops
once it has gone as long without lowering the top-th fastest layout by more than `gain` as it took to make its
last such gain. On a fake clock, with step times only (the rule reads nothing else)."""

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
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(inc._time, "monotonic", c)
    monkeypatch.setattr(inc, "PATIENCE_MIN_S", 8.0)  # the rule, not the shipped value
    return c


def _items(*times: float) -> list:
    return [SimpleNamespace(rank_time_s=t) for t in sorted(times)]


def test_no_gain_stops_at_the_minimum(clock):
    p = inc._Patience(100.0, 1, 0.001, _items(20.0))
    clock.now = 107.9
    assert not p.out(_items(20.0))   # 7.9 s < PATIENCE_MIN_S
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
    # top = 2: a faster first layout is no gain; the second one's arrival (from none) is.
    p = inc._Patience(100.0, 2, 0.001, _items(20.0))
    clock.now = 105.0
    assert not p.out(_items(18.0))
    clock.now = 107.0
    assert not p.out(_items(18.0, 25.0))  # the 2nd fastest appears at 7 s: a gain
    clock.now = 113.9
    assert not p.out(_items(18.0, 25.0))  # 6.9 s since, not more than 7 s
    clock.now = 114.1
    assert p.out(_items(18.0, 25.0))


def test_without_a_top_it_never_stops(clock):
    p = inc._Patience(100.0, None, 0.001, _items(20.0))
    clock.now = 1e6
    assert not p.out(_items(20.0))
