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
