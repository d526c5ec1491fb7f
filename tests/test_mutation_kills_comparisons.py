"""Memory comparisons on one stated data-parallel rank under whole-tensor sharding (seed 003's 4-layer proxy, a
dense shard group of 8): a rank past the group is a clear error, and without lazy optimizer state the figure
before the first step is the resident state itself."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.evaluate import memory_comparisons
from k3opt.inputs.errors import LayoutError
from k3opt.inputs.specs import Measured


@pytest.fixture(scope="module")
def eager_proxy() -> k3opt.Evaluation:
    """The proxy with its optimizer state allocated eagerly (the seed's run allocates it lazily)."""
    proxy = k3opt.load_layout("k3-4layer-dist-muon-8gpu")
    return k3opt.evaluate(k3opt.Layout.model_validate({**proxy.model_dump(), "lazy_optimizer_state": False}))


def test_a_data_parallel_rank_past_the_shard_group_is_an_error(eager_proxy):
    """DP ranks 0-7 exist in a group of 8; rank 8 names no rank."""
    with pytest.raises(LayoutError) as err:
        memory_comparisons(Measured(dp_rank=8, resident_gib=100.0), eager_proxy.ranks)
    assert str(err.value) == "measured.dp_rank = 8: the shard groups have 8 ranks"


def test_eager_state_is_resident_before_the_first_step_on_any_dp_rank(eager_proxy):
    """Eager optimizer state: before the first step the rank already holds everything it holds after it, so the
    two figures agree on every DP rank, also on rank 0, whose owned optimizer state differs from the worst
    owner's (the ledger's)."""
    r = eager_proxy.ranks[0]
    mine = r.counts["owned_per_dp_rank"][0]
    assert mine["optimizer"] != r.ledger["optimizer"]
    rows = memory_comparisons(Measured(dp_rank=0, resident_gib=100.0, pre_step_resident_gib=100.0),
                              eager_proxy.ranks)
    assert [c.figure for c in rows] == ["resident state, PP rank 0, DP rank 0",
                                        "resident before the first step, PP rank 0, DP rank 0"]
    assert rows[1].modeled == rows[0].modeled
