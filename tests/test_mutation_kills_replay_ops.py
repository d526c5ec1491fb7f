"""Every operation of the pipeline replay (k3opt.cost.schedule.replay_ops: rank, forward?, global chunk, microbatch,
start, end), worked by hand on two small schedules; the pipeline picture draws these tuples, the makespan is only
their latest end."""

from __future__ import annotations

import numpy as np
import pytest

from k3opt.cost.schedule import replay_ops


def test_1f1b_two_ranks_two_microbatches():
    """p = 2, v = 1, M = 2, forward 1 s and backward 2 s per chunk, no hop. Megatron's 1F1B: rank 0 warms up with
    p - r - 1 = 1 forward, then F(mb 1), B(mb 0), B(mb 1); rank 1 alternates F, B from the start. Rank 1's F(0)
    waits for rank 0's F(0) (ends at 1); its B(0) follows its own F(0); its F(1) waits for rank 0's F(1) (2) and for
    rank 1 itself (4); rank 0's B(0) waits for rank 1's B(0) (4), its B(1) for rank 1's B(1) (7)."""
    ops = replay_ops(2, 1, 2, np.ones(2), 2 * np.ones(2))
    assert sorted(ops) == sorted([
        (0, True, 0, 0, 0.0, 1.0), (0, True, 0, 1, 1.0, 2.0), (0, False, 0, 0, 4.0, 6.0), (0, False, 0, 1, 7.0, 9.0),
        (1, True, 1, 0, 1.0, 2.0), (1, False, 1, 0, 2.0, 4.0), (1, True, 1, 1, 4.0, 5.0), (1, False, 1, 1, 5.0, 7.0)])


def test_hops_are_charged_to_the_sending_rank():
    """p = 3, v = 1, M = 1, forward 1 s, backward 2 s, hop 0.1 / 0.2 / 0.4 s out of ranks 0 / 1 / 2. Forward: rank 0
    [0, 1]; rank 1 starts 1 + 0.1; rank 2 starts 2.1 + 0.2. Backward: rank 2 right after its forward [3.3, 5.3];
    rank 1 waits 5.3 + 0.4 (sent by rank 2) [5.7, 7.7]; rank 0 waits 7.7 + 0.2 (sent by rank 1) [7.9, 9.9]."""
    ops = sorted(replay_ops(3, 1, 1, np.ones(3), 2 * np.ones(3), np.array([0.1, 0.2, 0.4])))
    want = [(0, False, 0, 0, 7.9, 9.9), (0, True, 0, 0, 0.0, 1.0), (1, False, 1, 0, 5.7, 7.7),
            (1, True, 1, 0, 1.1, 2.1), (2, False, 2, 0, 3.3, 5.3), (2, True, 2, 0, 2.3, 3.3)]
    assert [op[:4] for op in ops] == [w[:4] for w in want]
    for op, w in zip(ops, want, strict=True):
        assert op[4:] == pytest.approx(w[4:], rel=1e-12, abs=0), op
