"""The relaxation's memory rows hold the AttnRes bank and the PP packets' open residual streams (ledger
attnres_bank and pp_buffers), linear in the layers placed: R(b), the blocks closed by boundary b, counts the closing
layers of every chunk up to b, other ranks' among them. Coefficients by hand on PP2 VP2 (global chunk g = k p + r:
rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3), two layer kinds of which the first closes a block, stream S."""

from __future__ import annotations

import numpy as np
import pytest

from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import enumerate_frames
from k3opt.search.lp_bound import _bank_row, _open_streams_row  # noqa: PLC2701 - the rows under test

S = 7.0
KCLOSE = np.array([1.0, 0.0])


def _grid(row: np.ndarray) -> np.ndarray:
    """The row as [rank, local chunk, kind]."""
    return row.reshape(2, 2, 2)


def test_the_bank_of_rank_1_by_hand():
    """Rank 1 at composition (3, 1): its chunk 1 holds 3 microbatches' streams, one per block closed in chunks 0-1;
    its chunk 3 holds 1 microbatch's, one per block closed in chunks 0-3. Per closing layer: 4 S in chunks 0 and 1,
    S in chunks 2 and 3; nothing for the layers that close no block."""
    g = _grid(_bank_row(2, 2, KCLOSE, S, (3, 1), 1))
    assert g[0, 0].tolist() == [4 * S, 0.0]  # chunk 0
    assert g[1, 0].tolist() == [4 * S, 0.0]  # chunk 1
    assert g[0, 1].tolist() == [S, 0.0]      # chunk 2
    assert g[1, 1].tolist() == [S, 0.0]      # chunk 3
    # A chunk with no microbatch in flight holds no bank.
    assert not _grid(_bank_row(2, 2, KCLOSE, S, (0, 0), 1)).any()


def test_the_open_streams_of_the_packets_by_hand():
    """Rank 0's latest middle chunk is 2 (chunk 0 is the first): its packets in and out, double-buffered, carry
    2 (R(start of 2) + R(end of 2)) S more than R = 0: a closing layer of chunks 0-1 counts in both R, 4 S, one of
    chunk 2 in R(end) only, 2 S. Rank 1's is chunk 1 (chunk 3 is the last): 4 S for chunk 0, 2 S for chunk 1."""
    r0 = _grid(_open_streams_row(2, 2, KCLOSE, S, 0))
    assert [r0[0, 0, 0], r0[1, 0, 0], r0[0, 1, 0], r0[1, 1, 0]] == [4 * S, 4 * S, 2 * S, 0.0]
    r1 = _grid(_open_streams_row(2, 2, KCLOSE, S, 1))
    assert [r1[0, 0, 0], r1[1, 0, 0], r1[0, 1, 0], r1[1, 1, 0]] == [4 * S, 2 * S, 0.0, 0.0]
    assert not r0[..., 1].any() and not r1[..., 1].any()


@pytest.mark.parametrize("reserve", [2.4, 2.6])
def test_the_fractional_fit_now_settles_nodes_it_let_through(tiny, slow, reserve):
    """On the tiny model's PP2 VP2 job (`pp2_vp2_memory_job`), the fractional memory test with the bank refuses
    the accumulate lifecycle's no-recompute and selective nodes, which it let through without the bank (only the
    contiguous whole-layer test refused them). No layout of theirs fits at these reserves, and the fractional test
    never refuses a node with a fitting layout: both by enumeration in
    tests/search/test_search.py::test_the_contiguous_fit_says_no_only_where_no_layout_fits."""
    from conftest import pp2_vp2_memory_job

    from k3opt.search.frames import ACT_TOGGLES, ActMode, allocated_capacity_bytes, choices, memory_view
    from k3opt.search.lp_bound import lean_fits

    job = pp2_vp2_memory_job(reserve)
    (f,) = enumerate_frames(job, tiny, 8)
    cap = float(allocated_capacity_bytes(job, f, tiny, slow))
    lc = FsdpLifecycle.ACCUMULATE
    for rc in (Recompute.NONE, Recompute.SELECTIVE):
        lean = memory_view(job, f, ActMode(rc, *(True in choices(job, t) for t in ACT_TOGGLES)), lc, tiny, slow)
        assert not lean_fits(job, f, lean, cap, slow.host_memory_bytes), (rc, reserve)


def _x_of(split: list[int], kind: list[int], p: int, v: int, nk: int) -> np.ndarray:
    """The placement of a contiguous split (global chunk g = k p + r) as the rows' columns (r v + k) nk + t."""
    x = np.zeros(p * v * nk)
    i = 0
    for g, n in enumerate(split):
        k, r = divmod(g, p)
        for _ in range(n):
            x[(r * v + k) * nk + kind[i]] += 1.0
            i += 1
    return x


def test_the_order_rows_hold_for_every_contiguous_split_and_cut_the_closing_layers_dealt_last():
    """Twelve layers, every third closes a block (layers 2, 5, 8, 11: kind 0 closes, kind 1 does not), PP2 VP2.
    Every contiguous split satisfies the order rows. The placement the relaxation could take without them, the four
    closing layers in the last chunk and chunks 0-2 holding three plain layers each, breaks them: its first three
    layers close C(3) = 1 block (layer 2), not 0."""
    from itertools import combinations

    from k3opt.search.lp_bound import _order_rows  # noqa: PLC2701 - the rows under test

    closes = np.array([0, 0, 1] * 4, dtype=float)
    kind = [0 if c else 1 for c in closes]
    kclose = np.array([1.0, 0.0])
    p, v, nk = 2, 2, 2
    rows, rhs = _order_rows(p, v, closes, kclose, p * v * nk, ())
    assert len(rows) > 0
    splits = 0
    for cuts in combinations(range(1, 12), 3):  # every split of 12 layers into 4 non-empty contiguous chunks
        bounds = (0, *cuts, 12)
        split = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        assert np.all(rows @ _x_of(split, kind, p, v, nk) <= rhs + 1e-9), split
        splits += 1
    assert splits == 165  # C(11, 3)
    dealt_last = np.zeros(p * v * nk)
    for g in range(3):  # chunks 0-2: three plain layers each
        k, r = divmod(g, p)
        dealt_last[(r * v + k) * nk + 1] = 3.0
    dealt_last[(1 * v + 1) * nk + 0] = 4.0  # chunk 3 (rank 1, local chunk 1): the four closing layers
    assert np.any(rows @ dealt_last > rhs + 1e-9)


def test_the_order_rows_are_the_hull_of_the_blocks_closed_over_the_counts_a_split_can_have():
    """The same twelve layers. Chunks 0-1 hold 10 layers in any split whose chunks 2 and 3 hold one each, and the
    first 10 layers close 3 blocks (layers 2, 5, 8): 10 is the end of the range chunks 0-1 can hold (2..10), a vertex
    of the hull, so a fractional placement with 2.8 closing layers among those 10 is cut. The hull over the whole
    0..12 (ignoring the least layers of the other chunks) would allow 2.67, and a row that dropped its hull offset
    would allow less still. The placement meets every other row: chunk 0 holds 5 layers with 1.4 closing (the first
    5 close 1), chunks 0-2 hold 11 with 3 closing (the first 11 close 3)."""
    from k3opt.search.lp_bound import _order_rows  # noqa: PLC2701 - the rows under test

    closes = np.array([0, 0, 1] * 4, dtype=float)
    p, v, nk = 2, 2, 2
    rows, rhs = _order_rows(p, v, closes, np.array([1.0, 0.0]), p * v * nk, ())
    x = np.zeros(p * v * nk)
    at = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}  # global chunk -> (rank, local chunk)
    for g, (closing, plain) in {0: (1.4, 3.6), 1: (1.4, 3.6), 2: (0.2, 0.8), 3: (1.0, 0.0)}.items():
        r, k = at[g]
        x[(r * v + k) * nk:(r * v + k) * nk + 2] = (closing, plain)
    over = rows @ x - rhs
    assert np.sum(over > 1e-9) == 1  # only the boundary after chunk 1 is cut
    assert over.max() == pytest.approx(0.5 * 10 - 2.8 - (0.5 * 8 - 2))  # the segment (8, 2)-(10, 3), slope 1/2
