"""Every search bound of a frame lies below the ranked step time of real K3 layouts of that frame, on the
shipped GB200 rates (where the activation toggles lower the elementwise kernels' time, so the mode without
toggles is not the least work). The layouts are the kind the anytime Pareto front finds: interleaved, selective
recompute with FP8 activations, fused SiTU, the MoE backward rewrite and activation offload (host-link-bound)."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.search import bounds
from k3opt.search.frames import frame_of
from k3opt.specs import FsdpLifecycle, Layout, Recompute

TOGGLES = {"fp8_activations": True, "activation_offload": True, "moe_backward_rewrite": True, "fused_situ": True}


def _layout(vp: int, split: list[int]) -> Layout:
    return Layout(gpus=512, pp=8, vp=vp, cp=1, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, rows=1,
                  context=4096, split=split, recompute="selective", toggles=TOGGLES, dense_sharding="optim_grads",
                  expert_sharding="optim", reserve_gib=4.0, domain_gpus_used=64,
                  runtime="megatron-te-hybridep-gb200")


@pytest.mark.parametrize(("vp", "split"), [
    (3, [3] + [4] * 22 + [2]),          # 93 layers in 24 chunks
    (2, [5, 5] + [6] * 13 + [5]),       # 93 layers in 16 chunks
    (4, [2] + [3] * 30 + [1]),          # 93 layers in 32 chunks
])
def test_every_bound_is_below_an_interleaved_k3_layout(vp: int, split: list[int]) -> None:
    job = k3opt.load_job("k3-512-4k")
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    lay = _layout(vp, split)
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    assert ev.fits
    ranked = ev.step.rank_time_s
    f = frame_of(lay)
    assert bounds.frame_lower_bound(job, f, model, cluster)[0] <= ranked
    assert bounds.frame_dp_bound(job, f, model, cluster)[0] <= ranked
    assert bounds.node_lower_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model,
                                   cluster)[0] <= ranked
    assert bounds.tight_node_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model,
                                   cluster) <= ranked
