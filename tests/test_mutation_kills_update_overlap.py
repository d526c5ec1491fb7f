"""The achievable step's update: compute plus the data-parallel communication left exposed beyond its overlap
window (dp_overlap_microbatches x the stage time; Megatron overlaps the gradient reduce-scatter with the last
microbatch's backward and the parameter all-gather with the first forward). Qwen3-30B-A3B on 32 B200 GPUs, whose
update all-gathers and reduces over dense FSDP 16 across two NVLink domains."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.achievable import achievable_step
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates

LAYOUT = dict(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096, split=[24, 24],
              recompute="full", domain_gpus_used=8)


def _step(overlap: float, **fields):
    lay = k3opt.make_layout(**{**LAYOUT, **fields})
    r = load_rates("b200")
    rates = r.model_copy(update={"overlap": r.overlap.model_copy(update={"dp_overlap_microbatches": overlap})})
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    return achievable_step(coefficients(Shape.of(lay), model, cluster, rates=rates), lay.split, rates, cluster)


def test_a_window_of_no_microbatch_exposes_all_update_communication():
    """Window 0: every second of update communication is exposed, so the update is compute + that; a window of
    1,000 stage-microbatches hides it all (exposed 0) and leaves the compute alone. The difference of the two
    updates, and of the two steps, is the exposed communication of the first."""
    bare, hidden = _step(0.0), _step(1000.0)
    assert hidden.update_comm_exposed_s == 0.0
    assert bare.update_comm_exposed_s > 0
    assert bare.update_time_s - hidden.update_time_s == pytest.approx(bare.update_comm_exposed_s, rel=1e-9)
    assert bare.step_time_s - hidden.step_time_s == pytest.approx(bare.update_comm_exposed_s, rel=1e-9)


@pytest.mark.parametrize("fields", [{}, {"ep_overlap": True},
                                    {"dense_sharding": "no_shard", "context": 128, "domain_gpus_used": 1}])
def test_evaluate_reports_the_achievable_steps_parts(fields):
    """evaluate()'s step carries the parts of the achievable step at the shipped rates (one stage-microbatch
    window): stage, update, its exposed communication (not zero when a DDP all-reduce over the NIC outlasts a
    128-token stage-microbatch), the unpaired all-to-all (not zero under an EP overlap schedule); step = slots x
    stage + update + unpaired, slots = M + p - 1 = 9 for 1F1B."""
    lay = k3opt.make_layout(**{**LAYOUT, **fields})
    st = k3opt.evaluate(lay, model="qwen3-30b-a3b", cluster="b200").step
    ach = _step(1.0, **fields)
    assert (ach.unpaired_ep_s > 0) == ("ep_overlap" in fields)
    assert (ach.update_comm_exposed_s > 0) == ("dense_sharding" in fields)
    assert (st.achievable_stage_time_s, st.achievable_update_time_s, st.achievable_update_comm_exposed_s,
            st.achievable_unpaired_ep_s) == (ach.stage_time_s, ach.update_time_s, ach.update_comm_exposed_s,
                                             ach.unpaired_ep_s)
    assert st.achievable_step_time_s == pytest.approx(
        9 * st.achievable_stage_time_s + st.achievable_update_time_s + st.achievable_unpaired_ep_s, rel=1e-12)
