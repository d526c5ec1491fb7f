"""Megatron exports of models trained with AdamW: the optimizer their recipes name, Megatron-FSDP where the dense
group shards its parameters, the gradient reduction dtype as the layout prices it, and the CPU offload count. The
flags are those of the measured recipes (Megatron-Bridge perf_recipes/llama/gb200/llama3.py L272-284 and
deepseek_v3 at v0.4.2; Megatron-LM arguments.py L1950-1951, L3190-3203 @ d98e8a64)."""

from __future__ import annotations

import k3opt
from k3opt.inputs.specs import Dtype, FsdpLifecycle
from k3opt.launch import apply_target_limits, launch_refusals, to_launch


def _flags(name: str) -> list[str]:
    lay = k3opt.load_layout(name)
    text = to_launch(lay, "megatron-lm", k3opt.load_model(lay.model)).text
    return [ln.strip().removesuffix(" \\") for ln in text.splitlines() if ln.strip().startswith("--")]


def test_the_llama_fsdp_recipe_comes_back_as_megatron_fsdp_with_its_offload():
    flags = _flags("mb-2-llama3-70b-gb200")
    for flag in ("--optimizer adam", "--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params",
                 "--fsdp-double-buffer", "--cpu-offloading-num-layers 40"):
        assert flag in flags, flag
    assert "--use-distributed-optimizer" not in flags
    # Its gradient buffer is BF16 as priced (Megatron-FSDP's main_grads_dtype None -> BF16); an FP32 layout says so.
    assert "--megatron-fsdp-main-grads-dtype bf16" in flags
    lay = k3opt.load_layout("mb-2-llama3-70b-gb200").model_copy(update={"grad_dtype": Dtype.FP32})
    text = to_launch(lay, "megatron-lm", k3opt.load_model("llama3-70b")).text
    assert "--megatron-fsdp-main-grads-dtype fp32" in text


def test_deepseek_runs_adam_on_the_distributed_optimizer_with_bf16_gradients():
    flags = _flags("mb-13-deepseek-v3-gb200")
    assert "--optimizer adam" in flags and "--use-distributed-optimizer" in flags
    # grad_dtype = bf16: the FP32 reduction flag would price another buffer.
    assert "--accumulate-allreduce-grads-in-fp32" not in flags
    assert "--recompute-modules mlp" in flags


def test_k3_keeps_muon_and_its_fp32_reduction():
    flags = _flags("k3-gb200-512-reference")
    assert "--optimizer muon" in flags


def test_only_muon_is_held_to_the_accumulate_lifecycle_on_megatron():
    job = k3opt.load_job("k3-512-4k").model_copy(update={"target": "megatron-lm"})
    deepseek, k3 = k3opt.load_model("deepseek-v3"), k3opt.load_model("kimi-k3")
    assert apply_target_limits(job, k3).search.fsdp_lifecycle == [FsdpLifecycle.ACCUMULATE]
    assert apply_target_limits(job, deepseek).search.fsdp_lifecycle is None
    llama = k3opt.load_layout("mb-2-llama3-70b-gb200")  # per_microbatch under Megatron-FSDP, as it ran
    assert not any("fsdp_lifecycle" in r for r in launch_refusals(llama, "megatron-lm", k3opt.load_model("llama3-70b")))
    k3_per_mb = k3opt.load_layout("k3-gb200-512-reference").model_copy(
        update={"fsdp_lifecycle": FsdpLifecycle.PER_MICROBATCH})
    assert any("fsdp_lifecycle" in r for r in launch_refusals(k3_per_mb, "megatron-lm", k3))
