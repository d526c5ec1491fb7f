"""A model without routed experts has an empty expert group: the search enumerates expert FSDP 1 only (every degree
prices alike), unless the job lists its own degrees."""

from __future__ import annotations

import k3opt
from k3opt.inputs.specs import Job
from k3opt.search import enumerate_frames


def _job(**search) -> Job:
    return Job(model="llama3-70b", cluster="b200", gpus=64, context=8192, tokens_per_update=4_194_304,
               search=search)


def test_a_dense_model_searches_one_expert_degree():
    model = k3opt.load_model("llama3-70b")
    frames = enumerate_frames(_job(), model, 64)
    assert frames and {f.expert_fsdp for f in frames} == {1}
    # Every (PP, VP, CP, dense FSDP, M, policy) shape of the full expert range is still there: with expert FSDP
    # listed, each shape appears once per divisor of the stage, and its projection is the same set.
    listed = enumerate_frames(_job(expert_fsdp=[1, 2, 4]), model, 64)
    assert {f.expert_fsdp for f in listed} == {1, 2, 4}
    key = lambda f: (f.pp, f.vp, f.cp, f.dense_fsdp, f.microbatches, f.dense_sharding, f.precision)  # noqa: E731
    assert {key(f) for f in frames} == {key(f) for f in listed if f.expert_fsdp == 1}


def test_the_expert_degree_prices_nothing_on_a_dense_model():
    """The reason one degree stands for all: the same layout at expert FSDP 1 and 8 evaluates alike."""
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("b200")
    base = dict(gpus=64, pp=4, dense_fsdp=16, microbatches=32, context=8192, split=[20] * 4, recompute="selective",
                precision="fp8", model="llama3-70b", cluster="b200")
    one, eight = (k3opt.evaluate(k3opt.make_layout(**base, expert_fsdp=fe), model, cluster) for fe in (1, 8))
    assert one.peak_device_bytes == eight.peak_device_bytes
    assert one.step.achievable_step_time_s == eight.step.achievable_step_time_s
    assert one.step.step_time_s == eight.step.step_time_s
