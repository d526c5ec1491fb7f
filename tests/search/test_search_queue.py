"""The driver's queue (search/driver._Queue): its three picks -- the least entry, the least open v = 1 entry (of
one frame for a dive), the least open entry not yet cut by a slice -- equal a scan over the entries left, through
random pushes and takes, as the driver makes them."""

from __future__ import annotations

import dataclasses
import random

import pytest

from k3opt.search.driver import _Entry, _Queue


@dataclasses.dataclass(frozen=True)
class _F:
    name: int
    vp: int


def _scan(entries: list[_Entry], keep) -> _Entry | None:
    return min((e for e in entries if keep(e)), default=None)


@pytest.mark.parametrize("seed", range(4))
def test_picks_equal_a_scan(seed):
    rng = random.Random(seed)
    frames = [_F(i, rng.choice([1, 1, 2, 4])) for i in range(12)]
    q, left, n = _Queue(), [], 0
    for _ in range(600):
        if left and rng.random() < 0.45:
            line, peak = rng.uniform(0, 10), rng.randrange(3)
            if rng.random() < 0.5:
                def is_open(e, line=line):
                    return e.bound < line  # under the pruning line (gap > 0)
            else:
                line = round(line, 1)  # ties in the bound, decided by the peak (gap 0: not `closed`)

                def is_open(e, line=line, peak=peak):
                    return e.bound < line or (e.bound == line and e.peak < peak)

            dive = rng.choice(frames)
            want_top = min(left)
            assert q.top() == want_top
            one = _scan(left, lambda e: e.frame.vp == 1 and is_open(e))
            assert q.least_one(is_open) == one
            mine = _scan(left, lambda e, d=dive: e.frame == d and is_open(e))
            assert q.least_of(dive, is_open) == (mine if dive.vp == 1 else None)
            fresh = _scan(left, lambda e: e.attempt == 0 and is_open(e))
            assert q.least_fresh(is_open) == fresh
            picked = rng.choice([p for p in (want_top, one, mine, fresh) if p is not None])
            q.take(picked)
            left.remove(picked)
        else:
            f = rng.choice(frames)
            e = _Entry(round(rng.uniform(0, 10), 1), rng.randrange(3), n, f, None, None, rng.choice([0, 0, 1, 2]))
            n += 1
            q.push(e)
            left.append(e)
        assert len(q) == len(left) and bool(q) == bool(left)
        assert sorted(q) == sorted(left)
    while left:
        e = min(left)
        assert q.top() == e
        q.take(e)
        left.remove(e)
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.top()
