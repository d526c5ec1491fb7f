"""The work floor on a cluster without a rates file (the peak roofline): the search's floor
(ranking._peak_floor, two builds a mode) is, array by array, at or below every mode it stands for and equal to
their elementwise least found by trying every combination of the activation toggles here."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from conftest import peak_roofline_cluster

import k3opt
from k3opt.cost.coefficients import Shape
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search.frames import ACT_TOGGLES
from k3opt.search.ranking import ranked_coefficients, work_floor

RANKS = [{}, {"fused_cross_entropy": True}, {"pipeline_zero2_host_grads": True}, {"p2p_muon": True},
         {"activation_offload": True}]


def _base(model: str, cluster: str, **kw: object) -> Shape:
    lay = k3opt.make_layout(model=model, cluster=cluster, context=4096, recompute="none", **kw)
    return replace(Shape.of(lay), toggles=lay.toggles.model_copy(update={t: False for t in ACT_TOGGLES}))


@pytest.mark.parametrize(("model", "cluster", "kw"), [
    # DeepSeek-V3 on H200 nodes: EP across the NIC, interleaved pipeline, dense FSDP
    ("deepseek-v3", "h200-sxm", dict(gpus=1024, pp=16, vp=1, ep=8, expert_fsdp=2, dense_fsdp=64,
                                     microbatches=32, split=[4] * 15 + [1])),
    ("deepseek-v3", "h200-sxm", dict(gpus=1024, pp=8, vp=2, ep=64, expert_fsdp=1, dense_fsdp=128,
                                     microbatches=32, split=[4] * 15 + [1])),
    # Qwen3-30B-A3B on H200 with context parallelism
    ("qwen3-30b-a3b", "h200-sxm", dict(gpus=64, pp=2, vp=1, cp=2, ep=8, expert_fsdp=2, dense_fsdp=16,
                                       microbatches=8, split=[24, 24])),
    # Llama 3 70B (no MoE: the MoE toggles change nothing)
    ("llama3-70b", "h200-sxm", dict(gpus=64, pp=4, vp=1, ep=1, expert_fsdp=1, dense_fsdp=16, microbatches=16,
                                    split=[20] * 4)),
])
def test_peak_floor_is_the_least_of_every_mode(model: str, cluster: str, kw: dict) -> None:
    m, c = k3opt.load_model(model), peak_roofline_cluster(cluster)
    base = _base(model, cluster, **kw)
    assert not ranked_coefficients(base, m, c).achievable  # no rates file: the peak roofline
    for rank in RANKS:
        node_base = replace(base, toggles=base.toggles.model_copy(update=rank))
        for recs, lcs in [((rc,), (lc,)) for rc in Recompute for lc in FsdpLifecycle] \
                + [(tuple(Recompute), tuple(FsdpLifecycle))]:
            floor = work_floor(node_base, m, c, recomputes=recs, lifecycles=lcs)
            combos = list(itertools.product([False, True], repeat=len(ACT_TOGGLES)))
            views = [ranked_coefficients(replace(node_base, recompute=rc, fsdp_lifecycle=lc,
                                                 toggles=node_base.toggles.model_copy(
                                                     update=dict(zip(ACT_TOGGLES, flags, strict=True)))), m, c)
                     for rc in recs for lc in lcs for flags in combos]
            for field in ("time", "update"):
                for res in getattr(views[0], field):
                    least = np.minimum.reduce([getattr(v, field)[res] for v in views])
                    got = getattr(floor, field)[res]
                    assert (got <= least).all(), (rank, recs, lcs, field, res)
                    # No looser than the least: within the floor's rounding margin (1e-9 relative).
                    np.testing.assert_allclose(got, least, rtol=1e-7, atol=1e-15, err_msg=f"{rank} {recs} {res}")


def test_peak_floor_hbm_cut_is_real() -> None:
    """The HBM-only toggles do lower the peak HBM time of a DeepSeek-V3 MoE layer on H100 (the MoE backward rewrite
    and FP8 activations shrink the saved set written and read), so the floor's HBM time sits under the mode
    without toggles there: the fast path cannot pass by ignoring them. The first three layers are dense."""
    m, c = k3opt.load_model("deepseek-v3"), peak_roofline_cluster("h200-sxm")
    base = _base("deepseek-v3", "h200-sxm", gpus=1024, pp=16, vp=1, ep=8, expert_fsdp=2, dense_fsdp=64,
                 microbatches=32, split=[4] * 15 + [1])
    floor = work_floor(base, m, c)
    plain = ranked_coefficients(base, m, c)
    assert list(m.dense_ffn_layers) == [0, 1, 2]
    moe = slice(3, m.num_layers)
    assert (floor.time["hbm"][moe] < plain.time["hbm"][moe] * (1 - 1e-3)).all()
