"""The search stores the compute-precision weights only in that precision wherever Megatron takes it
(frames.fp8_weights): FP8 or MXFP8 under the distributed optimizer (optim on both groups) with AdamW, for a Megatron
target or none. It only removes bytes, so the frames carry it rather than branch on it."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.inputs.specs import Job, ParamGather, Precision, ShardingPolicy
from k3opt.search.frames import enumerate_frames

OPTIM = ShardingPolicy.OPTIM


def _job(**kw) -> Job:
    base = dict(model="qwen3-30b-a3b", cluster="b200", gpus=8, context=4096, rows=4, tokens_per_update=2097152,
                precisions=["bf16", "mxfp8", "fp8"], search={"pp": [1], "ep": [8]})
    base.update(kw)
    return Job(**base)


def test_frames_set_it_exactly_where_megatron_takes_it():
    job = _job(search={"pp": [1], "ep": [8], "dense_sharding": ["optim", "optim_grads"],
                       "expert_sharding": ["optim", "optim_grads"]})
    frames = enumerate_frames(job, k3opt.load_model("qwen3-30b-a3b"), 8, k3opt.load_cluster("b200"))
    seen = set()
    for f in frames:
        want = (f.precision in (Precision.FP8, Precision.MXFP8) and f.dense_sharding == f.expert_sharding == OPTIM
                and f.param_gather == ParamGather.UPDATE)
        assert f.fp8_param_gather == want, f
        seen.add(want)
    assert seen == {True, False}


@pytest.mark.parametrize("kw, model", [({"target": "torchtitan"}, "qwen3-30b-a3b"), ({}, "kimi-k3-4layer-proxy")])
def test_not_for_torchtitan_nor_for_muon(kw, model):
    """torchtitan has no such switch; Muon's layer-wise optimizer has no shared gradient buffer to gather into."""
    job = _job(model=model, **kw, search={"pp": [1], "dense_sharding": ["optim"], "expert_sharding": ["optim"]})
    frames = enumerate_frames(job, k3opt.load_model(model), 8, k3opt.load_cluster("b200"))
    assert frames and not any(f.fp8_param_gather for f in frames)


def test_a_planned_mxfp8_layout_keeps_no_bf16_weights():
    """MB-20's recipe on 8 B200 (MXFP8, Megatron's distributed optimizer): the plan's layout states the setting,
    evaluate() prices it, and its export writes it with the buffer reuse Megatron requires beside it."""
    job = _job(precisions=["mxfp8"], search={"pp": [1], "ep": [8], "dense_sharding": ["optim"],
                                             "expert_sharding": ["optim"], "microbatches": [16]})
    plan = k3opt.plan(job, top=1, time_limit=30)
    lay = plan.layouts[0].layout
    assert lay.fp8_param_gather and lay.precision == Precision.MXFP8
    ev = k3opt.evaluate(lay)
    assert ev.step.rank_time_s == pytest.approx(plan.layouts[0].rank_time_s)
    with_bf16 = k3opt.evaluate(lay.model_copy(update={"fp8_param_gather": False}))
    # 48 layers x 128 experts / EP 8 x 3 x 768 x 2048 routed weights + 48 x (q 4096 x 2048, k and v 512 x 2048 each,
    # o 2048 x 4096) attention weights in MXFP8, whose BF16 copies (2 B) the layout does not hold.
    routed = 48 * 16 * 3 * 768 * 2048
    attn = 48 * (4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096)
    assert with_bf16.peak_bytes - ev.peak_bytes == pytest.approx(2 * (routed + attn), rel=1e-9)
    from k3opt.report.text import plan_text

    assert plan.to_frame("layouts")["fp8_param_gather"].tolist() == [True]
    text = plan_text(plan)
    assert " mxfp8 params " in text and "the weights are stored in that precision only" in text


def test_a_group_of_one_rank_counts_as_the_distributed_optimizer():
    """Llama 3 70B for a Megatron target: its expert group is empty (expert_fsdp 1), where the search keeps one
    representative policy (optim_grads_params, the target allowing Megatron-FSDP); a one-rank group shards nothing
    under any policy, so those frames store their FP8 weights in FP8 too, and the layout validates."""
    from k3opt.launch import apply_target_limits

    model = k3opt.load_model("llama3-70b")
    job = apply_target_limits(_job(model="llama3-70b", gpus=64, rows=1, context=8192, tokens_per_update=4194304,
                                   precisions=["fp8"], target="megatron-lm", search={"pp": [8], "vp": [1]}), model)
    frames = enumerate_frames(job, model, 64, k3opt.load_cluster("b200"))
    on = [f for f in frames if f.fp8_param_gather]
    assert on and all(f.expert_fsdp == 1 and f.param_gather == ParamGather.UPDATE for f in on)
    assert any(f.expert_sharding == ShardingPolicy.OPTIM_GRADS_PARAMS for f in on)
    assert all(f.dense_sharding == OPTIM or f.dense_fsdp == 1 for f in on)
    k3opt.make_layout(gpus=64, pp=8, dense_fsdp=8, microbatches=64, context=8192, split=[10] * 8,
                      dense_sharding="optim", expert_sharding="optim_grads_params", precision="fp8",
                      fp8_param_gather=True, model="llama3-70b", cluster="b200")
    with pytest.raises(k3opt.LayoutError, match="distributed optimizer"):
        k3opt.make_layout(gpus=64, pp=8, dense_fsdp=8, microbatches=64, context=8192, split=[10] * 8,
                          dense_sharding="optim_grads", expert_sharding="optim", precision="fp8",
                          fp8_param_gather=True, model="llama3-70b", cluster="b200")
