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


def test_p2p_muon_weighs_nothing_on_a_model_without_muon_and_the_lean_set_still_fits():
    """DeepSeek-V3 trains every tensor with AdamW. Its PP4 VP4 CP4 EP16 dFSDP4 frame at 32K context on 64 GB200
    fits under the lean toggle set; P2P Muon, one of that set, once priced a pull of every resident parameter
    (22.7 GiB on rank 1) where there are no Muon matrices, so the lean set missed the line and no heuristic layout
    was found. The toggle changes no byte and no second of such a model, and a plan leaves it off."""
    lay = k3opt.make_layout(gpus=64, pp=4, vp=4, cp=4, ep=16, dense_fsdp=4, microbatches=64, context=32768,
                            split=[4] * 15 + [1], recompute="selective", reserve_gib=2.0,
                            dense_sharding="optim", expert_sharding="optim", runtime="megatron-te-hybridep-gb200",
                            toggles={"activation_offload": True, "balance_activations": True,
                                     "pipeline_zero2_host_grads": True, "fused_cross_entropy": True})
    off = k3opt.evaluate(lay, model="deepseek-v3", cluster="gb200-nvl72")
    on = k3opt.evaluate(lay.model_copy(update={"toggles": lay.toggles.model_copy(update={"p2p_muon": True})}),
                        model="deepseek-v3", cluster="gb200-nvl72")
    for a, b in zip(on.ranks, off.ranks, strict=True):
        assert a.ledger == b.ledger and a.update_s == b.update_s
    job = k3opt.Job(name="dsv3-64-32k", model="deepseek-v3", cluster="gb200-nvl72", gpus=64, context=32768,
                    tokens_per_update=8_388_608, reserve_gib=2.0, runtime="megatron-te-hybridep-gb200")
    got = frame_incumbent(job, frame_of(lay), k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb200-nvl72"))
    assert got is not None and got.evaluation.fits
    small = k3opt.Job(name="qwen3-30b-8", model="qwen3-30b-a3b", cluster="b200", gpus=8, context=4096,
                      tokens_per_update=1_048_576)
    plan = k3opt.plan(small, top=3, time_limit=30)
    assert plan.layouts and not any(it.layout.toggles.p2p_muon for it in plan.layouts)
