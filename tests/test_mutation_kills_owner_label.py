"""Which rank a whole-tensor memory figure is compared on, as the validation row names it: seed 003's proxy
(dist_muon, tensor granularity, the 'K3 memory lab' measurement) read on a stated DP rank says so; without a
stated DP rank the figures are the ledger's, the rank owning the most whole tensors ('worst owner'); element
granularity has no owner to name."""

from __future__ import annotations

import k3opt

PROXY = "k3-4layer-dist-muon-8gpu"


def _rows(**fields) -> list[str]:
    base = k3opt.load_layout(PROXY)
    data = base.model_dump()
    data["measured"] = {**data["measured"], "dp_rank": None}
    data.update(fields)
    ev = k3opt.evaluate(k3opt.Layout.model_validate(data))
    return [c.figure for c in ev.validation if c.kind]


def test_an_unstated_dp_rank_is_compared_on_the_worst_owner():
    assert _rows() == [
        "resident state, PP rank 0, worst owner",
        "resident before the first step, PP rank 0, worst owner",
        "grads, PP rank 0, worst owner",
        "master, PP rank 0, worst owner",
        "optimizer, PP rank 0, worst owner",
        "bf16_view, PP rank 0, worst owner",
        "optimizer-step transient, PP rank 0, worst owner"]


def test_element_granularity_names_no_owner():
    assert _rows(optimizer_shard_granularity="element")[0] == "resident state, PP rank 0"
