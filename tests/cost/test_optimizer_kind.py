"""The model's optimizer (ModelSpec.optimizer.name): Muon for the matrices, or AdamW for every tensor. AdamW keeps
two moments per parameter and runs no Newton-Schulz; the figures come from the parameter count and the bytes."""

from __future__ import annotations

import tomllib

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.cost.structure import structure_of
from k3opt.inputs.presets import preset_dir

LLAMA_PARAMS = 141_107_412_992 // 2  # meta-llama/Meta-Llama-3-70B model.safetensors.index.json, all BF16
GIB = 2**30


def _llama(name: str) -> k3opt.ModelSpec:
    data = tomllib.loads((preset_dir("model") / "llama3-70b.toml").read_text())
    data["optimizer"] = {"name": name}
    return k3opt.ModelSpec.model_validate(data)


def _eval(model: k3opt.ModelSpec) -> k3opt.Evaluation:
    # 64 GPUs, one stage, the whole state sharded over 64 ranks (element granularity): every rank owns P / 64
    layout = k3opt.make_layout(gpus=64, pp=1, vp=1, cp=1, ep=1, expert_fsdp=1, dense_fsdp=64, microbatches=2,
                               rows=1, context=8192, split=[80], recompute="full", fsdp_lifecycle="accumulate")
    return k3opt.evaluate(layout, model=model, cluster=k3opt.load_cluster("gb200-nvl72"))


def test_adamw_keeps_two_fp32_moments_per_owned_parameter():
    ev = _eval(_llama("adamw"))
    assert structure_of(_llama("adamw")).params.muon == 0
    # exp_avg + exp_avg_sq, 4 B each, of the P / 64 parameters a rank owns
    assert ev.ranks[0].ledger["optimizer"] == pytest.approx(2 * 4 * LLAMA_PARAMS / 64, rel=1e-12)


def test_muon_keeps_one_momentum_for_its_matrices_and_two_moments_for_the_rest():
    model = _llama("muon")
    p = structure_of(model).params
    # embedding 128,256 x 8,192 and the untied head: AdamW; the 80 layers' matrices: Muon; norms: AdamW
    assert p.total - p.muon >= 2 * 128_256 * 8192
    ev = _eval(model)
    assert ev.ranks[0].ledger["optimizer"] == pytest.approx((4 * p.muon + 8 * (p.total - p.muon)) / 64, rel=1e-12)


def test_only_muon_runs_newton_schulz():
    muon, adamw = _eval(_llama("muon")), _eval(_llama("adamw"))
    # Newton-Schulz is the update's only tensor-core work; AdamW's update is elementwise (HBM)
    assert muon.ranks[0].update_s["tensor"] > 0 and adamw.ranks[0].update_s["tensor"] == 0
    assert adamw.ranks[0].update_s["hbm"] > muon.ranks[0].update_s["hbm"]  # two moments read and written
    # AdamW's step transient is the BF16 parameter gather alone: no Newton-Schulz working set beside it
    assert adamw.ranks[0].ledger["optimizer_transient"] <= muon.ranks[0].ledger["optimizer_transient"]


@pytest.mark.parametrize("table, says", [
    ('name = "sgd"', "optimizer.name"),
    ('name = "adamw"\nadamw_matrices = ["gqa.q_proj"]', "remove adamw_matrices"),
])
def test_a_bad_optimizer_is_one_line_and_exit_2(tmp_path, table, says):
    preset = (preset_dir("model") / "llama3-70b.toml").read_text()
    text = preset[:preset.index("[optimizer]")] + f"[optimizer]\n{table}\n"
    model = tmp_path / "m.toml"
    model.write_text(text)
    res = CliRunner().invoke(main, ["explain", "mb-2-llama3-70b-gb200", "--model", str(model)])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], res.output


def test_adamw_experts_stay_ep_local():
    """Qwen3-30B-A3B trains every tensor with AdamW (its preset, as Megatron-Bridge's recipe): the routed experts'
    moments are still those of the rank's EP-local experts. Layer 5 from config.json: attention q 4096 x 2048,
    k and v 512 x 2048, o 2048 x 4096 (18,874,368), q/k norms 2 x 128, the two RMSNorms 2 x 2048, router
    128 x 2048: D = 19,140,864; experts 128 x 3 x 768 x 2048 = 603,979,776. EP 16, dense FSDP 16, expert FSDP 1:
    the rank owns D / 16 + E / 16 = 38,945,040 parameters, two FP32 moments each."""
    model = k3opt.load_model("qwen3-30b-a3b")
    assert model.optimizer.name == "adamw"
    lay = k3opt.make_layout(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096,
                            split=[24, 24], recompute="full", domain_gpus_used=8)
    ev = k3opt.evaluate(lay, model=model, cluster="b200")
    per_layer_owned = 19_140_864 // 16 + 603_979_776 // 16
    assert per_layer_owned == 38_945_040
    # rank 0 holds layers 0-23 and the embedding (151,936 x 2048, AdamW, sharded over the 16 dense ranks)
    assert ev.ranks[0].ledger["optimizer"] == pytest.approx(8 * (24 * per_layer_owned + 151_936 * 2048 / 16),
                                                           rel=1e-12)
    # the BF16 view keeps D + E / e per layer whatever the optimizer
    assert ev.ranks[0].ledger["bf16_view"] == pytest.approx(
        2 * (24 * (19_140_864 + 603_979_776 // 16) + 151_936 * 2048), rel=1e-12)


def test_a_bf16_gradient_buffer_is_copied_to_fp32_for_the_owned_shard_at_the_step():
    """Megatron keeps FP32 main parameters; with a BF16 gradient buffer (grad_reduce_in_fp32 = False, as every
    Megatron-Bridge performance config sets) the step gives each owned shard main_grad.float() as its .grad
    (Megatron-LM distrib_optimizer.py _copy_model_grads_to_main_grads). Qwen3-30B-A3B, Megatron's distributed
    optimizer (`optim`: state sharded, gradient buffer whole), EP 16, DP 16: rank 0 owns 24 x 38,945,040 layer
    parameters (test_adamw_experts_stay_ep_local) plus the embedding's 151,936 x 2048 / 16; AdamW runs no
    Newton-Schulz and the distributed optimizer gathers in place, so the step adds the FP32 copy alone."""
    owned = 24 * 38_945_040 + 151_936 * 2048 / 16
    view = 24 * (19_140_864 + 603_979_776 // 16) + 151_936 * 2048
    base = dict(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096, split=[24, 24],
                recompute="full", domain_gpus_used=8, dense_sharding="optim", expert_sharding="optim",
                fsdp_lifecycle="accumulate")
    bf16 = k3opt.evaluate(k3opt.make_layout(**base, grad_dtype="bf16"), model="qwen3-30b-a3b", cluster="b200")
    fp32 = k3opt.evaluate(k3opt.make_layout(**base, grad_dtype="fp32"), model="qwen3-30b-a3b", cluster="b200")
    assert bf16.ranks[0].ledger["optimizer_transient"] == pytest.approx(4 * owned, rel=1e-12)
    assert fp32.ranks[0].ledger["optimizer_transient"] == 0
    # the gradient buffer itself is whole under `optim`: 2 B (BF16) or 4 B (FP32) per element of the view
    assert bf16.ranks[0].ledger["grads"] == pytest.approx(2 * view, rel=1e-12)
    assert fp32.ranks[0].ledger["grads"] == pytest.approx(4 * view, rel=1e-12)


def test_p2p_muon_pulls_nothing_where_no_parameter_trains_with_muon():
    """The layout above with P2P Muon on: Qwen3-30B-A3B trains every tensor with AdamW, so there are no Muon
    matrices to pull, and the step keeps the optim policy's in-place gather. What remains is the 4 B FP32 copy of
    the owned BF16 gradient shard, 4 B x its 954,128,768 owned parameters (24 x 38,945,040 + 151,936 x 2048 / 16),
    and nothing with FP32 gradients; no pull traffic is added either."""
    owned = 24 * 38_945_040 + 151_936 * 2048 / 16
    base = dict(gpus=32, pp=2, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=8, context=4096, split=[24, 24],
                recompute="full", domain_gpus_used=8, dense_sharding="optim", expert_sharding="optim",
                fsdp_lifecycle="accumulate")
    for gd, want in (("bf16", 4 * owned), ("fp32", 0.0)):
        on = k3opt.evaluate(k3opt.make_layout(**base, grad_dtype=gd, toggles={"p2p_muon": True}),
                            model="qwen3-30b-a3b", cluster="b200")
        off = k3opt.evaluate(k3opt.make_layout(**base, grad_dtype=gd), model="qwen3-30b-a3b", cluster="b200")
        assert on.ranks[0].ledger["optimizer_transient"] == pytest.approx(want, rel=1e-12, abs=0.5), gd
        for a, b in zip(on.ranks, off.ranks, strict=True):
            assert a.ledger == b.ledger and a.update_s == b.update_s, gd


def test_deepseek_v3_keeps_its_adam_moments_in_bf16_unless_the_layout_says_otherwise():
    """DeepSeek-V3's recipe: exp_avg and exp_avg_sq in BF16, main parameters FP32 ([optimizer] state_dtype). Two
    2-byte moments per owned parameter weigh what its 4-byte FP32 master does; a layout's optimizer_state_dtype
    overrides the model's (FP32: twice the master)."""
    assert k3opt.load_model("deepseek-v3").optimizer.state_dtype.value == "bf16"
    assert k3opt.load_model("qwen3-30b-a3b").optimizer.state_dtype.value == "fp32"
    lay = k3opt.load_layout("mb-13-deepseek-v3-gb200").model_copy(update={"optimizer_state_dtype": None,
                                                                          "measured": None})
    ev = k3opt.evaluate(lay)
    assert ev.layout.optimizer_state_dtype.value == "bf16"
    for r in ev.ranks:
        assert r.ledger["optimizer"] == pytest.approx(r.ledger["master"], rel=1e-12)
    fp32 = k3opt.evaluate(lay.model_copy(update={"optimizer_state_dtype": k3opt.inputs.specs.Dtype.FP32}))
    assert fp32.ranks[1].ledger["optimizer"] == pytest.approx(2 * fp32.ranks[1].ledger["master"], rel=1e-12)
