"""The seeding's lean toggle sets: pipeline ZeRO-2's host gradients keep two GPU chunk buffers in place of the
gradient shard, so on a shape whose gradients are already sharded the set with every memory-saving toggle is not the
leanest, and the heuristics must not give up on a frame because that one set does not fit."""

from __future__ import annotations

import json

import k3opt
from k3opt.inputs.specs import GIB
from k3opt.search.frames import frame_of
from k3opt.search.incumbents import STATE_TOGGLES, frame_incumbent, lean_sets

# The default job's PP8 VP3 EP64 dFSDP64 optim_grads layout with FP8 activations, activation offload, P2P Muon and the
# chunked cross entropy: 18.875 s at 106.05 GiB on its worst rank (the default job's Pareto front).
VP3 = json.loads("""{"gpus": 512, "pp": 8, "vp": 3, "ep": 64, "dense_fsdp": 64, "microbatches": 64,
 "split": [4, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2], "recompute": "selective",
 "toggles": {"fp8_activations": true, "activation_offload": true, "moe_backward_rewrite": true, "fused_situ": true,
             "p2p_muon": true, "fused_cross_entropy": true},
 "dense_sharding": "optim_grads", "expert_sharding": "optim", "reserve_gib": 4.0, "domain_gpus_used": 64,
 "runtime": "megatron-te-hybridep-gb200"}""")
CAP_GIB = 108.96


def test_the_state_toggles_are_those_that_change_a_persistent_buffer():
    # Of the memory-saving rank toggles only pipeline ZeRO-2's host gradients change a persistent term ("grads").
    assert STATE_TOGGLES == ("pipeline_zero2_host_grads",)


def test_a_frame_whose_every_toggle_set_is_fatter_than_one_without_host_gradients_still_gets_a_layout():
    lay = k3opt.Layout(**VP3)
    plain = k3opt.evaluate(lay)
    with_host_grads = k3opt.evaluate(lay.model_copy(
        update={"toggles": lay.toggles.model_copy(update={"pipeline_zero2_host_grads": True})}))
    # Under a 108.96-GiB peak cap the layout fits, and the same layout with host gradients does not: its rank 0 holds
    # the two chunk buffers (more than the 1/64 gradient shard they replace).
    assert plain.peak_bytes <= CAP_GIB * GIB < with_host_grads.peak_bytes
    job = k3opt.load_job("k3-512-4k")
    job = job.model_copy(update={"search": job.search.model_copy(update={"max_peak_gib": CAP_GIB})})
    assert len(lean_sets(job)) == 2
    got = frame_incumbent(job, frame_of(lay), k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72"))
    assert got is not None and got.peak_bytes <= CAP_GIB * GIB and got.evaluation.fits
    assert not got.layout.toggles.pipeline_zero2_host_grads
