"""Pipeline ZeRO-2's two FP32 chunk buffers in the relaxation's memory rows (ledger `grads` under
pipeline_zero2_host_grads: 2 x the rank's largest chunk's gradient buffer, Aggregate.CHUNK_PAIR). The rows take the
max over the rank's chunks, one row per chunk it might be, where an average over the v chunks let an uneven split
look as lean as an even one: on K3 PP8 VP4 FP8 over GB300 a split of 1, 3, 1 and 7 layers holds 14 layers' buffers,
not the 6 of the average (54 GiB against 23)."""

from __future__ import annotations

import numpy as np
import pytest

from k3opt.search.lp_bound import _Arrays, _merge, _persistent_forms  # noqa: PLC2701 - the rows under test

L, P, V = 4, 2, 2
BASE, PAIR = 10.0, 6.0  # per layer: the other persistent bytes, and 2 x its FP32 gradient buffer
FIRST_EDGE, LAST_EDGE = 100.0, 200.0  # the embedding's and the head's buffers, 2 x their gradients


def _arrays(base: float, pair: float | None, first_edge: float = FIRST_EDGE, last_edge: float = LAST_EDGE
            ) -> _Arrays:
    """One layer kind; `persistent` holds the pair's average over the V chunks (the form `_relaxed` gives); the
    edges hold their buffers only."""
    pr = None if pair is None else np.array([pair] * L + [first_edge, last_edge])
    avg = 0.0 if pr is None else pr / V
    zero = np.zeros(L + 2)
    persistent = np.array([base] * L + [0.0, 0.0]) + avg
    return _Arrays(time={}, update={}, persistent=persistent, opt=zero, act=zero, ws_min=0.0, nsws_min=0.0,
                   logits=0.0, ep_min=0.0, hi=zero, pair=pr)


def _held(a: _Arrays, r: int, per_chunk: list[float]) -> float:
    """The largest persistent bytes the forms give rank r holding per_chunk[k] layers in its k-th chunk."""
    kpair = None if a.pair is None else a.pair[:1]
    return max(sum(float(c[0]) * n for c, n in zip(coef, per_chunk, strict=True)) + fixed
               for coef, fixed in _persistent_forms(a, a.persistent[:1], kpair, r, P, V, L))


def test_the_largest_chunk_holds_the_two_buffers_by_hand():
    """Global chunk g = k P + r: rank 0 holds chunks 0 (the embedding) and 2, rank 1 chunks 1 and 3 (the head).
    Rank 0 with 1 and 3 layers: 4 BASE + 3 PAIR (chunk 2 is the largest), not the average's 4 BASE + 2 PAIR; its
    edge is the embedding, BASE-free here, in chunk 0: the largest chunk of 1 layer + the embedding is 1 PAIR + 100,
    more than 3 PAIR = 18. Rank 1 with 3 and 1: 4 BASE + 3 PAIR, or chunk 3 with the head, 1 PAIR + 200."""
    a = _arrays(BASE, PAIR)
    assert _held(a, 0, [1, 3]) == pytest.approx(4 * BASE + max(3 * PAIR, 1 * PAIR + FIRST_EDGE))
    assert _held(a, 1, [3, 1]) == pytest.approx(4 * BASE + max(3 * PAIR, 1 * PAIR + LAST_EDGE))
    # The embedding's buffers are rank 0's only: rank 1's forms hold none of them (its first chunk is chunk 1).
    head_free = _arrays(BASE, PAIR, FIRST_EDGE, 0.0)
    assert _held(head_free, 1, [3, 1]) == pytest.approx(4 * BASE + 3 * PAIR)
    # Without edges the largest decoder chunk decides: 4 BASE + 3 PAIR on either rank, either order.
    small = _arrays(BASE, PAIR, 0.0, 0.0)
    for r in range(P):
        assert _held(small, r, [1, 3]) == pytest.approx(4 * BASE + 3 * PAIR)
        assert _held(small, r, [3, 1]) == pytest.approx(4 * BASE + 3 * PAIR)
        # An even split is where the average was right: 2 PAIR for 2 + 2 layers.
        assert _held(small, r, [2, 2]) == pytest.approx(4 * BASE + 2 * PAIR)


def test_without_the_toggle_one_form_holds_the_persistent_bytes():
    a = _arrays(BASE + PAIR, None)  # the gradients as a per-layer shard: all of them in persistent
    assert len(_persistent_forms(a, a.persistent[:1], None, 0, P, V, L)) == 1
    assert _held(a, 0, [1, 3]) == pytest.approx(4 * (BASE + PAIR))


@pytest.mark.parametrize("split", [[1, 3], [3, 1], [2, 2], [0, 4], [4, 0]])
def test_merged_rows_stay_under_each_member(split):
    """A group's merged arrays (a ZeRO-2 member beside one without it, and one with a larger pair) hold, at any
    placement, at most what each member holds: the least pair beside the least of the rest."""
    members = [_arrays(BASE, PAIR), _arrays(BASE + 2 * PAIR, None), _arrays(BASE - 1.0, 2 * PAIR)]
    merged = _merge(members, V)
    for r in range(P):
        assert _held(merged, r, split) <= min(_held(m, r, split) for m in members) + 1e-9
    # Where some member keeps no buffers, the merged arrays are the least of the members' average forms: per layer
    # 10 + 6 / 2 = 13 (the first member; the second holds 10 + 12, the third 9 + 12 / 2), edges 0 (the second's),
    # so 4 x 13 for four layers, not the 4 x 9 of the least base with no buffers at all.
    assert merged.pair is None
    assert _held(merged, 0, [2, 2]) == pytest.approx(4 * (BASE + PAIR / 2))
    # Members that all keep the buffers keep the max form when merged: 3 PAIR, not 2, at the uneven split.
    both = _merge([_arrays(BASE, PAIR, 0.0, 0.0), _arrays(BASE + 1.0, PAIR + 1.0, 0.0, 0.0)], V)
    assert both.pair is not None
    assert _held(both, 0, [1, 3]) == pytest.approx(4 * BASE + 3 * PAIR)


def test_a_zero2_variant_of_the_tiny_model_holds_its_largest_chunk(tiny, slow):
    """The tiny model's PP2 VP2 node (`pp2_vp2_memory_job`) under ZeRO-2 host gradients, split 1, 1, 1, 3: rank 1
    holds chunks 1 and 3 (1 and 3 layers, chunk 3 with the head). Its rows' persistent bytes at that placement are
    the ledger's (evaluate(), whose `grads` are 2 x the largest chunk's buffer: a contiguous split is where the rows
    are exact) and above the average form's, 2 / v of every layer's buffer, which an uneven split beats."""
    from conftest import pp2_vp2_memory_job

    from k3opt.cost.evaluate import evaluate
    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search import enumerate_frames
    from k3opt.search.frames import frame_shape, layout_of, lean_mode
    from k3opt.search.lp_bound import _relaxed  # noqa: PLC2701 - the arrays under test

    job = pp2_vp2_memory_job(2.6)
    (f,) = enumerate_frames(job, tiny, 8)
    md, lc = lean_mode(job, Recompute.SELECTIVE), FsdpLifecycle.PER_MICROBATCH
    a, c0 = _relaxed(job, f, md, lc, {"pipeline_zero2_host_grads": True}, tiny, slow)
    L = c0.n_layers
    assert a.pair is not None and L == 6
    split = [1, 1, 1, 3]
    mine = {0: range(1, 2), 1: range(3, 6)}  # rank 1's layers by local chunk: global chunks 1 and 3
    rows = _persistent_forms(a, a.persistent[:L], a.pair[:L], 1, P, V, L)
    held = max(sum(float(coef[k][i]) for k in mine for i in mine[k]) + fixed for coef, fixed in rows)
    average = sum(float(a.persistent[i]) for k in mine for i in mine[k]) + float(a.persistent[L + 1])
    ev = evaluate(layout_of(job, f, frame_shape(job, f, md, lc, pipeline_zero2_host_grads=True), split), tiny,
                  slow)
    assert held == pytest.approx(ev.ranks[1].persistent_bytes, rel=1e-9)
    # Chunk 3 holds 3 layers and the head, chunk 1 one layer: the max form holds more than the average's 2 / 2 of
    # the four layers' and the head's buffers, by the buffers of (3 - 2) layers at least.
    assert held > average + 0.5 * float(a.pair[3:6].min())
