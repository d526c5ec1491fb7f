"""A region of the Pareto front starts from the next faster point brought under the region's cap
(search/incumbents.cap_descent). On the default job the fastest layout stands 1 GiB over the cap of the region
below it, and a layout of its own frame that is as fast exists under that cap: the descent must reach it. The
enumerated check on the six-layer model is tests/search/test_search.py's."""

from __future__ import annotations

import json
import time

import k3opt
from k3opt.inputs.specs import GIB
from k3opt.search.incumbents import cap_descent
from k3opt.search.result import PlanItem

COMMON = {"gpus": 512, "pp": 8, "vp": 4, "ep": 64, "dense_fsdp": 64, "microbatches": 64, "recompute": "selective",
          "dense_sharding": "optim_grads", "expert_sharding": "optim", "reserve_gib": 4.0, "domain_gpus_used": 64,
          "runtime": "megatron-te-hybridep-gb200"}
TOGGLES = {"fp8_activations": True, "activation_offload": True, "moe_backward_rewrite": True,
           "dispatch_recompute": True, "fused_situ": True, "p2p_muon": True, "fused_cross_entropy": True}
# The default job's fastest layout (PP8 VP4 EP64 dFSDP64, activation balancing on): 18.631 s at 109.96 GiB.
START = {**COMMON, "split": [3] * 28 + [2, 3, 2, 2], "toggles": {**TOGGLES, "balance_activations": True}}
# A layout of the same frame without the balancing, on another split (rank 3's first chunk and the last chunk a layer
# lighter): 18.624 s at 108.72 GiB.
WITNESS = {**COMMON, "split": [3, 3, 3, 2] + [3] * 27 + [1], "toggles": TOGGLES}
CAP_GIB = 108.96
JOB = json.loads('{"gpus": 512, "tokens_per_update": 16777216, "reserve_gib": 4.0, "domain_gpus_used": 64}')


def _priced(d: dict) -> PlanItem:
    lay = k3opt.Layout.model_validate(d)
    return PlanItem(lay, k3opt.evaluate(lay))


def test_the_descent_reaches_a_layout_as_fast_as_one_known_under_the_cap():
    start, witness = _priced(START), _priced(WITNESS)
    cap = CAP_GIB * GIB
    assert start.evaluation.fits and start.peak_bytes > cap  # the start is over the cap ...
    assert witness.evaluation.fits and witness.peak_bytes <= cap  # ... and a layout of its frame is under it
    job = k3opt.Job.model_validate({**JOB, "search": {"max_peak_gib": CAP_GIB}})
    got = cap_descent(job, start, k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72"),
                      time.monotonic() + 60)
    assert got is not None and got.evaluation.fits and got.peak_bytes <= cap
    # From the start itself the greedy ends at 18.720 s; from the start with the chunked cross entropy off (as fast,
    # its last rank 2.8 GiB fatter) it ends as fast as the witness.
    assert got.rank_time_s <= witness.rank_time_s + 1e-9
