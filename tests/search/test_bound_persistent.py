"""The bounds' persistent bytes are the ledger's: every always-held term (the FP8 weight copies included) and the
accumulator, so a bound's memory side is what evaluate() charges a rank, never less than a layout holds."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.search.frames import bound_persistent_bytes

GIB = 2**30


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_ranks_bound_persistent_bytes_are_its_ledger_terms(precision: str):
    """Llama 3 70B, PP4: under FP8 the cached row- and column-wise copies of a rank's 20 layers (855.6 M weights
    each, kept whole) are persistent like the BF16 view; the bound sums master, optimizer state, BF16 view, those
    copies and the accumulator over the rank's layers."""
    lay = k3opt.make_layout(model="llama3-70b", cluster="b200", gpus=64, pp=4, ep=1, dense_fsdp=16, microbatches=32,
                            context=8192, split=[20] * 4, recompute="selective", fsdp_lifecycle="accumulate",
                            precision=precision, dense_sharding="optim_grads", expert_sharding="optim")
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("b200")
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    cf = coefficients(Shape.of(lay), model, cluster)
    bound = bound_persistent_bytes(cf, None)
    rank = ev.ranks[1]  # a middle rank: 20 decoder layers, no edge
    want = sum(rank.ledger[k] for k in ("master", "optimizer", "bf16_view", "quantized_weights", "grad_accum"))
    assert float(bound[20:40].sum()) == pytest.approx(want, rel=1e-12)
    if precision == "fp8":
        # 2 copies x (1 B + 1/block scale bytes) per weight of the 20 layers: at least 2 B per weight.
        assert rank.ledger["quantized_weights"] >= 2 * 20 * 855_638_016
