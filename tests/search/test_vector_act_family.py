"""The seeding's family of traffic-only activation toggles (search/incumbents.VECTOR_ACT_TOGGLES): FP8 saved sets,
the fused SiTU-GLU and the MoE backward rewrite change only memory-bound traffic, while the dispatch recompute
replays a network pass. With the families 'none' and 'every activation toggle' alone, a frame whose fast layout
wants the first three without the fourth got the replay's time."""

from __future__ import annotations

import itertools
import math

import k3opt
from k3opt.inputs.specs import Precision, ShardingPolicy
from k3opt.search.frames import ACT_TOGGLES, Frame
from k3opt.search.incumbents import VECTOR_ACT_TOGGLES, frame_incumbent, toggle_sets

JOB = k3opt.Job.model_validate({"model": "kimi-k3", "cluster": "gb300-nvl72", "gpus": 512, "reserve_gib": 4.0,
                                "tokens_per_update": 16777216, "domain_gpus_used": 64, "precisions": ["fp8"]})
# K3 FP8 PP8 VP1 EP64 dFSDP64 on 512 GB300: 93 layers over 8 ranks, 64 microbatches.
FRAME = Frame(pp=8, vp=1, cp=1, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, gpus=512,
              dense_sharding=ShardingPolicy.OPTIM_GRADS, expert_sharding=ShardingPolicy.OPTIM_GRADS_PARAMS,
              precision=Precision.FP8, domain_gpus_used=64)


def test_the_family_is_the_toggles_without_a_network_replay():
    assert set(VECTOR_ACT_TOGGLES) == {"fp8_activations", "fused_situ", "moe_backward_rewrite"}
    assert "dispatch_recompute" in ACT_TOGGLES and "dispatch_recompute" not in VECTOR_ACT_TOGGLES
    acts = [frozenset(t for t, on in act.items() if on) for act, _ in toggle_sets(JOB)]
    assert frozenset(VECTOR_ACT_TOGGLES) in acts


def test_heuristic_layout_is_the_best_activation_setting_at_its_split():
    """Every one of the 16 settings of the four activation toggles, each evaluated at the heuristic layout's split
    and recompute mode with the rank toggles it chose: the heuristic's step is the least of those that fit. Before the
    family, it kept the dispatch recompute on (15.21 s) where the fitting setting without it runs 14.53 s
    (the node's CP-SAT optimum); this brute force reaches the faster one on its own."""
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb300-nvl72")
    it = frame_incumbent(JOB, FRAME, model, cluster, repair_below=math.inf)
    assert it is not None and it.evaluation.fits
    best = math.inf
    for bits in itertools.product([False, True], repeat=len(ACT_TOGGLES)):
        tg = it.layout.toggles.model_copy(update=dict(zip(ACT_TOGGLES, bits, strict=True)))
        ev = k3opt.evaluate(it.layout.model_copy(update={"toggles": tg}), model=model, cluster=cluster,
                            reserve_gib=JOB.reserve_gib)
        if ev.fits:
            best = min(best, ev.step.rank_time_s)
    assert it.rank_time_s <= best * (1 + 1e-9)
    assert not it.layout.toggles.dispatch_recompute
    assert it.rank_time_s < 14.6  # 14.53 s; with the replay on, 15.21 s
