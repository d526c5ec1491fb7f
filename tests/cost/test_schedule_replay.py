"""The schedule replay (Megatron's 1F1B / interleaved order over per-chunk forward and backward times) against
schedules worked out by hand: the makespan, every operation's start and end, the warmup forwards and the hops charged
to the sending rank; the textbook bubble for equal chunks, the per-chunk times the replay reads, and evaluate()'s
schedule-priced step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.cost.evaluate import chunk_times_s
from k3opt.cost.schedule import (
    _replay_ends,
    chunk_times,
    critical_path,
    pipeline_order,
    replay_makespan,
    replay_ops,
    schedule_slot_units,
)
from k3opt.search import replay_bound

DATA = Path(__file__).parents[1] / "data"


def test_1f1b_two_stages_three_microbatches_by_hand():
    """p = 2, M = 3, forward 1, backward 2 on both stages. Rank 0: F0 [0,1] F1 [1,2], B0 waits for rank 1's B0
    (F0 [1,2], B0 [2,4]) -> [4,6], F2 [6,7]; rank 1: F1 [4,5] B1 [5,7], F2 [7,8] B2 [8,10]; rank 0: B1 [7,9],
    B2 [10,12]. Makespan 12 = (M + p - 1)(f + b)."""
    assert pipeline_order(2, 1, 3, 0) == [(True, 0, 0), (True, 0, 1), (False, 0, 0), (True, 0, 2), (False, 0, 1),
                                          (False, 0, 2)]
    assert replay_makespan(2, 1, 3, np.ones(2), 2 * np.ones(2)) == pytest.approx(12.0)


def test_1f1b_unequal_stages_by_hand():
    """p = 2, M = 2; stage 0: forward 2, backward 4; stage 1: forward 1, backward 2. Rank 0: F0 [0,2], F1 [2,4];
    rank 1: F0 [2,3] B0 [3,5]; rank 0: B0 [5,9]; rank 1: F1 [5,6] B1 [6,8]; rank 0: B1 [9,13]. Makespan 13, where
    (M + p - 1) x the slowest stage gives 18."""
    assert replay_makespan(2, 1, 2, np.array([2.0, 1.0]), np.array([4.0, 2.0])) == pytest.approx(13.0)


def test_interleaved_two_stages_two_chunks_by_hand():
    """p = 2, v = 2, M = 2, every op 1. Rank 0 warms up 2(p-1) + (v-1)p = 4 = all forwards (chunks 0, 0, 2, 2),
    rank 1 warms up 2 (chunk 1 twice), then F3 B3 F3 B3, then B1 B1. Worked forward: rank 0 F [0,1] [1,2] [2,3]
    [3,4]; rank 1 F1 [1,2] [2,3], F3 [3,4], B3 [4,5], F3 [5,6], B3 [6,7]; rank 0 B2 [5,6] [7,8]; rank 1 B1 [7,8]
    [8,9]; rank 0 B0 [8,9] [9,10]. Makespan 10 = (v M + p - 1) x 2."""
    assert replay_makespan(2, 2, 2, np.ones(4), np.ones(4)) == pytest.approx(10.0)


@pytest.mark.parametrize(("p", "v", "m"), [(8, 1, 64), (8, 2, 64), (8, 4, 64), (4, 3, 8), (16, 2, 32)])
def test_equal_chunks_give_the_textbook_bubble(p, v, m):
    """Equal chunks: the step is v M chunk-slots of work plus p - 1 chunk-slots of bubble, an overhead of
    (p - 1)/(v M) over the work (seed 002: 10.94% at PP8, M64)."""
    f, b = 0.25, 0.5
    k = p * v
    makespan = replay_makespan(p, v, m, np.full(k, f), np.full(k, b))
    work = v * m * (f + b)
    assert makespan / work - 1 == pytest.approx((p - 1) / (v * m), rel=1e-12)
    if (p, v, m) == (8, 1, 64):
        assert makespan / work - 1 == pytest.approx(0.109375)


def test_skewed_interleaved_split_costs_more_than_the_formula():
    """PP4 VP4 M4 with the split 2+1x6+2+1+4+1+3+20+17+20+17 (93 layers, 74 in the last virtual stage), chunk time
    proportional to its layers, backward 3x forward (a layer's forward + backward = 4). Rank r holds chunks r, r+4,
    r+8, r+12: rank 0 holds 2+1+1+20 = 24 layers, ranks 1-3 hold 23, so the formula gives (M + (p-1)/v) x 4 x 24 =
    4.75 x 96 = 456. The replay is 29% above it: the early chunks wait on the long last virtual stage."""
    split = np.array([2, 1, 1, 1, 1, 1, 1, 2, 1, 4, 1, 3, 20, 17, 20, 17], dtype=float)
    formula = (4 + 3 / 4) * max(4 * split[r::4].sum() for r in range(4))
    assert formula == pytest.approx(456.0)
    assert replay_makespan(4, 4, 4, split, 3 * split) / formula == pytest.approx(1.2894736842105263, rel=1e-9)


def test_evaluate_prices_the_schedule():
    """evaluate()'s schedule-priced step: at v = 1 the replay never exceeds (M + p - 1) x the slowest rank (the
    makespan only grows with op times, and every op is at most the slowest rank's); it exceeds the update."""
    lay = k3opt.load_layout("k3-gb200-512-reference")
    ev = k3opt.evaluate(lay)
    assert ev.step.update_time_s < ev.step.schedule_step_time_s <= ev.step.step_time_s * (1 + 1e-12)
    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    lay = k3opt.inputs.presets.make_layout(gpus=8, pp=2, vp=2, ep=2, dense_fsdp=2, microbatches=4, context=2048,
                                  split=[1, 2, 2, 1], reserve_gib=1.5)
    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
    assert ev.step.schedule_step_time_s > ev.step.update_time_s


@pytest.mark.parametrize(("p", "v", "m"), [(1, 1, 4), (2, 1, 3), (2, 2, 2), (3, 2, 5), (4, 3, 7), (5, 2, 3),
                                           (8, 4, 64), (16, 2, 32)])
def test_makespan_equals_the_event_loop(p, v, m):
    """replay_makespan runs the recurrence over a fixed dependency order; replay_ops is the event loop that runs
    each rank's order as far as its dependencies allow. Two implementations of one schedule: on random chunk
    times and per-rank hops they agree to the last bit (the same additions and maxima in the same order)."""
    rng = np.random.default_rng(p * 100 + v * 10 + m)
    for _ in range(3):
        fwd, bwd, hop = rng.uniform(0.1, 2, p * v), rng.uniform(0.1, 4, p * v), rng.uniform(0, 0.3, p)
        for h in (0.0, hop):
            ops = replay_ops(p, v, m, fwd, bwd, h)
            assert replay_makespan(p, v, m, fwd, bwd, h) == max(op[5] for op in ops)
            # Every operation's start and end, in the event loop's order.
            start, end = _replay_ends(p, v, m, fwd, bwd, h)
            assert list(zip(start, end, strict=True)) == [(op[4], op[5]) for op in ops]
    with pytest.raises(ValueError, match="p x v"):
        replay_makespan(p, v, m, np.ones(p * v + 1), np.ones(p * v + 1))


def _path_over_events(p, v, m, fwd, bwd):
    """The longest path traced back over the event loop's operations: from the first latest end, through the
    rank's previous operation when it ended exactly at this one's start, else through the operation it waited for."""
    k_all = p * v
    ops = replay_ops(p, v, m, fwd, bwd)
    at = {(f, g, mb): n for n, (_, f, g, mb, _, _) in enumerate(ops)}
    prev, last = [], {}
    for n, op in enumerate(ops):
        prev.append(last.get(op[0]))
        last[op[0]] = n
    n = max(range(len(ops)), key=lambda i: ops[i][5])
    nf, nb = np.zeros(k_all, dtype=np.int64), np.zeros(k_all, dtype=np.int64)
    while n is not None:
        _, is_f, g, mb, begin, _ = ops[n]
        (nf if is_f else nb)[g] += 1
        if prev[n] is not None and ops[prev[n]][5] == begin:
            n = prev[n]
        elif is_f:
            n = at[(True, g - 1, mb)] if g > 0 else None
        else:
            n = at[(True, g, mb)] if g == k_all - 1 else at[(False, g + 1, mb)]
    return nf, nb


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 1, 3), (4, 3, 8), (8, 4, 16)])
def test_critical_path_equals_a_trace_over_the_event_loop(p, v, m):
    """critical_path's path over the fixed order is the one traced over the event loop's operations, also where
    operations tie (equal and small-integer chunk times: a rank's previous operation and the awaited one end
    together, and the rank's wins), not only in length."""
    rng = np.random.default_rng(7 * p + v + m)
    k = p * v
    for fwd, bwd in [(np.ones(k), 2 * np.ones(k)), (rng.integers(1, 4, k).astype(float), rng.integers(1, 7, k) * 1.0),
                     (rng.uniform(0.1, 2, k), rng.uniform(0.1, 4, k))]:
        got, want = critical_path(p, v, m, fwd, bwd), _path_over_events(p, v, m, fwd, bwd)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


# Every operation of the pipeline replay (k3opt.cost.schedule.replay_ops: rank, forward?, global chunk, microbatch,
# start, end), worked by hand on two small schedules; the pipeline picture draws these tuples, the makespan is only
# their latest end.

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


# Megatron's operation order and the pipeline replay on hand-worked cases, and the per-chunk times the replay reads,
# each figure worked out from the schedule rules or the layer shapes.

def _forwards_before_the_first_backward(ops) -> int:
    return next(i for i, (is_f, _, _) in enumerate(ops) if not is_f)


@pytest.mark.parametrize(("p", "v", "m", "warm"), [
    # Megatron schedules.py, interleaved: (p - r - 1) x 2 + (v - 1) x p, capped at v M.
    (4, 2, 8, [10, 8, 6, 4]),
    (4, 3, 2, [6, 6, 6, 6]),         # 2 x 3 + 2 x 4 = 14 > v M = 6: all forwards first
    # 1F1B: p - r - 1, capped at M.
    (4, 1, 8, [3, 2, 1, 0]),
    (4, 1, 2, [2, 2, 1, 0]),
])
def test_warmup_forwards_follow_megatron(p, v, m, warm):
    for r in range(p):
        ops = pipeline_order(p, v, m, r)
        assert len(ops) == 2 * v * m
        # The steady phase opens with one forward before its first backward (none left after a full warmup).
        assert _forwards_before_the_first_backward(ops) == min(warm[r] + 1, v * m), r


def test_replay_waits_for_the_hop_from_the_sending_rank():
    """p = 3, v = 1, M = 1, forward 1, 2, 3 s and backward 4, 5, 6 s per chunk, hops 1, 10, 100 s out of ranks
    0, 1, 2: f0 + h0 + f1 + h1 + f2, then b2 right after, + h2 (rank 2 sends) + b1 + h1 + b0
    = 1 + 1 + 2 + 10 + 3 + 6 + 100 + 5 + 10 + 4 = 142 s."""
    got = replay_makespan(3, 1, 1, np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0]),
                          np.array([1.0, 10.0, 100.0]))
    assert got == 142.0


def test_chunk_times_share_the_rank_time_by_work_and_split_backward_3_to_1_under_full_recompute():
    """Llama 3 70B, PP 2 x VP 2, split 20 / 20 / 30 / 10 layers: rank 0 runs chunks 0 and 2, rank 1 chunks 1
    and 3. A rank's time per microbatch is shared among its chunks by their work (the 30-layer chunk takes more
    than the 20-layer one), and each chunk splits forward : backward = 1 : 2 + 1 under full recompute (SC21
    section 3.5: the backward is twice the forward, recompute replays one forward)."""
    lay = k3opt.make_layout(gpus=32, pp=2, vp=2, dense_fsdp=16, microbatches=8, context=4096,
                            split=[20, 20, 30, 10], recompute="full", fsdp_lifecycle="accumulate")
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    cf = coefficients(Shape.of(lay), model, cluster)
    fwd, bwd = chunk_times_s(cf, list(ev.ranks), lay)
    np.testing.assert_allclose(bwd, 3 * fwd, rtol=1e-12)
    for r in (0, 1):
        assert fwd[r] + bwd[r] + fwd[r + 2] + bwd[r + 2] == pytest.approx(ev.ranks[r].stage_time_s, rel=1e-12, abs=0)
    assert fwd[2] > 1.4 * fwd[0]       # 30 layers against 20 (plus the embedding's small work)
    # The replayed step: the pipeline's makespan over these chunk times plus the exposed update.
    update = max(max(r.update_s.values()) for r in ev.ranks)
    assert ev.step.schedule_step_time_s == pytest.approx(replay_makespan(2, 2, 8, fwd, bwd) + update, rel=1e-12, abs=0)
    # Selective recompute: backward = 2 x forward.
    sel = lay.model_copy(update={"recompute": "selective"})
    ev_sel = k3opt.evaluate(sel, model=model, cluster=cluster)
    f_sel, b_sel = chunk_times_s(coefficients(Shape.of(sel), model, cluster), list(ev_sel.ranks), sel)
    np.testing.assert_allclose(b_sel, 2 * f_sel, rtol=1e-12)
    # 20 layers against 10 plus the LM head (128,256 x 8,192 = 1.05B parameters, about 1.2 layers of 0.86B)
    assert fwd[1] > 1.4 * fwd[3]


def test_slot_units_are_v_times_the_slots():
    # v x (M + (p - 1) / v) = 4 x (64 + 7/4) = 263 chunk-microbatch slots at PP8 VP4 M64.
    assert schedule_slot_units(8, 4, 64) == 263


def test_a_rank_with_no_work_shares_its_stage_equally():
    # Two chunks of zero work on one rank share its 3 s stage equally, 1.5 s each, forward : backward = 1 : 2.
    fwd, bwd = chunk_times(np.zeros(2), [3.0], 1, False)
    assert fwd.tolist() == [0.5, 0.5] and bwd.tolist() == [1.0, 1.0]
    # Through the replay paths (any nonnegative weights give valid ones): rank 0's chunks weigh nothing, so its
    # chunk times are 0 and the longest path is rank 1's, F of chunk 0 then 4 x (F + B) of chunks 1 and 3.
    ((nf, nb),) = replay_bound.split_paths(2, 2, 4, np.array([0., 1., 0., 1., 1., 1.]), [[1, 1, 1, 3]])
    assert nf.tolist() == [1, 4, 0, 4] and nb.tolist() == [0, 4, 0, 4]


def test_one_hop_time_for_every_hop():
    # PP2, one microbatch, 1 s forward and 2 s backward per chunk, 1 s per hop: F0 [0, 1], hop, F1 [2, 3],
    # B1 [3, 5], hop, B0 [6, 8].
    assert replay_makespan(2, 1, 1, np.ones(2), 2 * np.ones(2), 1.0) == 8.0


def test_wrong_chunk_counts_are_named():
    with pytest.raises(ValueError, match=r"p x v = 4 forward and backward chunk times, got 5 and 5"):
        replay_makespan(2, 2, 2, np.ones(5), np.ones(5))
    with pytest.raises(ValueError, match=r"p x v = 4 forward and backward chunk times, got 5 and 5"):
        replay_makespan(2, 2, 2, np.ones(5), np.ones(5), np.zeros(2))


def test_an_order_that_deadlocks_says_so():
    # M = 5 is no multiple of p = 4: Megatron's interleaved order then waits on itself.
    with pytest.raises(RuntimeError, match="p=4 v=3 M=5 deadlocks"):
        replay_makespan(4, 3, 5, np.ones(12), np.ones(12))
    with pytest.raises(RuntimeError, match="p=4 v=3 M=5 deadlocks"):
        replay_ops(4, 3, 5, np.ones(12), np.ones(12))
