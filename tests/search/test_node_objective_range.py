"""The node model's objective stays inside what CP-SAT accepts: thousands of microbatches make the step's time units
large, and the peak tie-break (MiB) multiplied onto them overflowed int64, so CP-SAT refused the model (Llama 3 70B
on 8 H200 at 2K context and 8M tokens per update: 4,096 microbatches, a traceback instead of a plan)."""

from __future__ import annotations

import k3opt
from k3opt.inputs.runtime import resolve_job_runtime
from k3opt.inputs.specs import GIB, MIB, Recompute, ShardingPolicy
from k3opt.search.frames import Frame, act_modes
from k3opt.search.node_model import OBJECTIVE_LIMIT, FrameModel, _tie_resolution  # noqa: PLC2701


def test_the_tie_break_coarsens_only_when_the_objective_would_pass_the_limit():
    # 140 GiB at MiB: 143,360 + 2 tie values x 12 x (10^12 + 1) = 1.72e18 >= 2^60 = 1.153e18; at 2 MiB
    # 71,682 x 12 x 10^12 = 8.6e17 fits. With 10^6 step units MiB already fits.
    assert OBJECTIVE_LIMIT == 2 ** 60
    assert _tie_resolution(10 ** 12, 140 * GIB, 12) == (2 * MIB, 71_681)
    assert _tie_resolution(10 ** 6, 140 * GIB, 12) == (MIB, 143_361)


def test_a_node_of_thousands_of_microbatches_is_a_valid_model():
    cluster = k3opt.load_cluster("h200-sxm")
    job = k3opt.Job(name="llama-8-h200", model="llama3-70b", cluster="h200-sxm", gpus=8, context=2048,
                    tokens_per_update=8_388_608, reserve_gib=0.0)
    job = resolve_job_runtime(job.model_copy(update={"search": job.search.model_copy(
        update={"recompute": [Recompute.FULL]})}), cluster)
    # 8,388,608 tokens / (DP 1 x 2,048) = 4,096 microbatches on PP8 VP4
    f = Frame(pp=8, vp=4, cp=1, ep=1, expert_fsdp=1, dense_fsdp=1, microbatches=4096, gpus=8,
              dense_sharding=ShardingPolicy.OPTIM, expert_sharding=ShardingPolicy.OPTIM)
    fm = FrameModel(job, f, k3opt.load_model("llama3-70b"), cluster, modes=act_modes(job)[:1])
    assert fm.m.validate() == ""
    assert fm.tie_unit > MIB
