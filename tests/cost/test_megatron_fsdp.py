"""Megatron-FSDP's per-layer parameter gather (param_gather = "layer") and TransformerEngine's CPU offload of the
first N layers' activations (activation_offload_layers), on the Llama 3 70B recipe they come from (Megatron-Bridge
perf_recipes/llama/gb200/llama3.py::llama3_70b_pretrain_64gpu_gb200_fp8cs_config). Expected values from the model's
config.json shapes in the comments: hidden 8,192, FFN 28,672, 64 query and 8 KV heads of 128, vocabulary 128,256,
80 layers; DP = dense FSDP = 64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import MEASURED, explain_refusal, measured_variant

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.errors import LayoutError

MB2 = "mb-2-llama3-70b-gb200.toml"
# Per decoder layer: q 8192 x 8192, k and v 1024 x 8192 each, o 8192 x 8192, gate and up 28672 x 8192 each, down
# 8192 x 28672 = 855,638,016 weights, plus two RMSNorm vectors of 8,192.
LAYER = 855_638_016 + 2 * 8192
FC1 = 2 * 28672 * 8192  # gate and up run as one GEMM: the largest weight gradient of a layer
EMBED = 128256 * 8192
HEAD = 128256 * 8192 + 8192  # output layer and final norm
DP = 64
GIB = 2**30


def _layout(**update) -> k3opt.Layout:  # noqa: ANN003 - Layout fields
    return measured_variant(MB2, **update)


def _cf(lay: k3opt.Layout):
    return coefficients(Shape.of(lay), k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72"))


def test_a_layer_keeps_its_fp8_shard_and_the_edges_stay_gathered():
    cf = _cf(_layout())
    L = cf.n_layers
    # FP8 primary weights (fp8_param_gather): 1 byte per element of the rank's 1/64 shard; no cached copies.
    np.testing.assert_allclose(cf.bf16_view[:L], LAYER / DP)
    np.testing.assert_allclose(cf.quantized_weights[:L], 0.0)
    # Embedding and output layer are not FSDP units: gathered whole in BF16 for the run.
    assert cf.bf16_view[L] == pytest.approx(2 * EMBED)
    assert cf.bf16_view[L + 1] == pytest.approx(2 * HEAD)
    kept = _cf(_layout(param_gather="update", grad_dtype="fp32"))
    # The update-long view holds every layer in BF16 and its FP8 row- and column-wise copies.
    np.testing.assert_allclose(kept.bf16_view[:L], 2 * LAYER)


def test_a_running_layer_holds_two_units_two_gradient_buckets_and_one_fresh_weight_gradient():
    """fsdp_double_buffer: 2 gathered FP8 units (1 B) + 2 BF16 gradient buckets (2 B) + the fc1 weight gradient in
    BF16 before it is copied into its bucket = 6 x 855,654,400 + 2 x 469,762,048 = 6,073,450,496 B; the two BF16
    [T, d] gradient streams (T = 2 x 8,192) add 2 x 16,384 x 8,192 x 2 = 536,870,912 B."""
    cf = _cf(_layout())
    L = cf.n_layers
    streams = 2 * 16384 * 8192 * 2
    np.testing.assert_allclose(cf.working_set[:L] - cf.recompute_ws[:L], 6 * LAYER + 2 * FC1 + streams)
    # The edges: their BF16 weight gradient and its BF16 bucket (the output layer's is not a unit's fresh gradient).
    assert cf.working_set[L] - cf.recompute_ws[L] == pytest.approx(4 * EMBED, rel=1e-12)
    assert cf.working_set[L + 1] - cf.recompute_ws[L + 1] == pytest.approx(4 * HEAD, rel=1e-12)


def test_a_unit_in_mxfp8_is_gathered_in_bf16_with_its_quantized_copies():
    """MXFP8 without FP8 primary weights: a BF16 shard (2 x P / 64), and each gathered unit in BF16 plus its GEMMs'
    row- and column-wise MXFP8 copies, 2 x (1 + 1/32) B per weight: two units = 2 x (2 P + 2 x 33/32 x 855,638,016)."""
    cf = _cf(_layout(precision="mxfp8"))
    L = cf.n_layers
    np.testing.assert_allclose(cf.bf16_view[:L], 2 * LAYER / DP, rtol=1e-12)
    streams = 2 * 16384 * 8192 * 2
    units = 2 * (2 * LAYER + 2 * (33 / 32) * 855_638_016)
    np.testing.assert_allclose(cf.working_set[:L] - cf.recompute_ws[:L], units + 2 * 2 * LAYER + 2 * FC1 + streams,
                               rtol=1e-12)


def test_a_unit_in_bf16_is_gathered_in_bf16_alone():
    """BF16: two BF16 units (2 x 2 B x P), two BF16 gradient buckets, the fc1 gradient, the gradient streams."""
    cf = _cf(_layout(precision="bf16"))
    L = cf.n_layers
    streams = 2 * 16384 * 8192 * 2
    np.testing.assert_allclose(cf.working_set[:L] - cf.recompute_ws[:L], 4 * LAYER + 4 * LAYER + 2 * FC1 + streams,
                               rtol=1e-12)


def test_an_expert_group_gathered_per_layer_leaves_the_dense_edges_alone():
    """Qwen3-30B-A3B with the dense group under Megatron's distributed optimizer (optim) and the experts under
    Megatron-FSDP: only the routed experts are units (E / e per layer), the edges keep their whole gradient buffer."""
    lay = k3opt.make_layout(gpus=16, ep=8, expert_fsdp=2, dense_fsdp=16, microbatches=4, split=[48],
                            recompute="selective",
                            dense_sharding="optim", expert_sharding="optim_grads_params", param_gather="layer",
                            grad_dtype="bf16", model="qwen3-30b-a3b", cluster="b200")
    kept = k3opt.make_layout(**{**lay.model_dump(exclude={"measured"}), "param_gather": "update"})
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    cf, ref = (coefficients(Shape.of(x), model, cluster) for x in (lay, kept))
    L = cf.n_layers
    # 128 experts of 3 x 768 x 2048 over EP8: 16 x 4,718,592 = 75,497,472 routed weights per layer in the view; per
    # layer gathered, a rank keeps its BF16 half of them (expert FSDP 2): 2 x 75,497,472 - 2 x 37,748,736.
    routed = 16 * 3 * 768 * 2048
    np.testing.assert_allclose(ref.bf16_view[:L] - cf.bf16_view[:L], 2 * routed - 2 * routed / 2, rtol=1e-12)
    np.testing.assert_allclose(cf.working_set[L:] - ref.working_set[L:], 0.0)


@pytest.mark.parametrize("ep, link", [(8, "nic"), (4, "nvlink")])
def test_expert_units_are_gathered_twice_a_microbatch_in_bf16(ep: int, link: str):
    """The expert group of the test above under Megatron-FSDP: per microbatch and layer, each rank gathers its
    128 / ep experts (3 x 768 x 2048 weights each) before the forward and again before the backward, in BF16, from
    its expert-FSDP peer: 2 x 2 B x (128 / ep) x 4,718,592 x (1 - 1/2). EP 8 fills an 8-GPU B200 domain, so the two
    expert-FSDP ranks sit in two domains (the NIC: 150,994,944 B); EP 4 leaves them in one (NVLink: 301,989,888 B).
    The other link and the dense group (distributed optimizer, gathered at the update) carry nothing more; the
    update's all-gather of the experts goes."""
    base = dict(gpus=16, ep=ep, expert_fsdp=2, dense_fsdp=16, microbatches=4, split=[48], recompute="selective",
                dense_sharding="optim", expert_sharding="optim_grads_params", grad_dtype="bf16",
                model="qwen3-30b-a3b", cluster="b200")
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    cf, ref = (coefficients(Shape.of(k3opt.make_layout(**base, param_gather=g)), model, cluster)
               for g in ("layer", "update"))
    L = cf.n_layers
    rate = {"nic": cluster.nic_gbps, "nvlink": cluster.nvlink_gbps}
    other = "nvlink" if link == "nic" else "nic"
    gathered = 2 * 2 * (128 // ep) * 3 * 768 * 2048 * (1 - 1 / 2)
    np.testing.assert_allclose((cf.time[link][:L] - ref.time[link][:L]) * rate[link] * 1e9, gathered, rtol=1e-9)
    np.testing.assert_allclose(cf.time[other][:L] - ref.time[other][:L], 0.0, atol=1e-15)
    np.testing.assert_allclose(cf.time[link][L:] - ref.time[link][L:], 0.0, atol=1e-15)  # the edges: no unit
    # AdamW's FP32 masters of the layer's share, either way: the dense group's 19,140,864 / 16 and the rank's
    # experts over the expert-FSDP pair, 128 x 4,718,592 / (ep x 2); the resident count is the same share.
    share = 19_140_864 / 16 + 128 * 3 * 768 * 2048 / (ep * 2)
    np.testing.assert_allclose(cf.master[:L], 4 * share, rtol=1e-12)
    np.testing.assert_allclose(cf.resident_params[:L], share, rtol=1e-12)
    # The update no longer all-gathers the experts' BF16 parameters from their shards, 2 B x (128 / ep) x 4,718,592
    # x (1 - 1/2) on the same link (the gradient reduce-scatter runs per microbatch either way).
    np.testing.assert_allclose((ref.update[link][:L] - cf.update[link][:L]) * rate[link] * 1e9, gathered / 2,
                               rtol=1e-9)
    np.testing.assert_allclose(ref.update[other][:L] - cf.update[other][:L], 0.0, atol=1e-15)
    # Nor does the step gather them into fresh buffers: 2 B x (128 / ep) x 4,718,592 when gathered at the update.
    np.testing.assert_allclose(ref.step_gather, np.r_[[2 * (128 // ep) * 3 * 768 * 2048] * L, 0, 0], rtol=1e-12)
    np.testing.assert_allclose(cf.step_gather, 0.0)


def test_the_step_gathers_nothing_and_the_gather_runs_twice_a_microbatch():
    lay = _layout()
    ev = k3opt.evaluate(lay, k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72"))
    own = (80 * LAYER + EMBED + HEAD) / DP
    # Only the FP32 copy of the owned BF16 gradient shard (4 B per owned parameter) is live at the step.
    assert ev.ranks[0].ledger["optimizer_transient"] == pytest.approx(4 * own, rel=1e-9)
    kept = _cf(_layout(param_gather="update"))
    cf = _cf(lay)
    # Per microbatch and layer: forward and backward gathers of the FP8 shards, 2 x 1 B x P x 63/64 on NVLink (the
    # 64 ranks share one domain), on top of the BF16 gradient reduce-scatter both modes run.
    extra = cf.time["nvlink"][:80] - kept.time["nvlink"][:80]
    np.testing.assert_allclose(extra * k3opt.load_cluster("gb200-nvl72").nvlink_gbps * 1e9,
                               2 * LAYER * 63 / 64, rtol=1e-9)
    # In BF16 (no FP8 primary weights) the shards and their gathers are 2 B a weight: twice the traffic.
    bf16, bf16_kept = _cf(_layout(precision="bf16")), _cf(_layout(param_gather="update", precision="bf16"))
    extra = bf16.time["nvlink"][:80] - bf16_kept.time["nvlink"][:80]
    np.testing.assert_allclose(extra * k3opt.load_cluster("gb200-nvl72").nvlink_gbps * 1e9,
                               2 * 2 * LAYER * 63 / 64, rtol=1e-9)


def test_the_first_n_layers_wait_in_host_memory():
    """PP1, M 2: one microbatch in flight. Offloading the first 40 of 80 identical layers moves half of the layers'
    saved bytes to the host; the edges stay."""
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    all_on_gpu = k3opt.evaluate(_layout(activation_offload_layers=0), model, cluster).ranks[0]
    half = k3opt.evaluate(_layout(activation_offload_layers=40), model, cluster).ranks[0]
    cf = _cf(_layout(activation_offload_layers=0))
    per_layer = float(cf.act[0])
    np.testing.assert_allclose(cf.act[:80], per_layer)
    assert all_on_gpu.ledger["activations"] - half.ledger["activations"] == pytest.approx(40 * per_layer)
    assert half.host_bytes - all_on_gpu.host_bytes == pytest.approx(40 * per_layer)
    # Out in forward and back in backward over the host link, per microbatch.
    off = _cf(_layout(activation_offload_layers=40))
    np.testing.assert_allclose(off.time["host_link"][:40] * cluster.host_link_gbps * 1e9, 2 * per_layer)
    np.testing.assert_allclose(off.time["host_link"][40:80], 0.0)


def test_the_recipes_fit_once_their_savings_are_expressed():
    """MB-1 (GB300, 20 layers offloaded) is judged to fit on live tensors; the whole-view accounting was 580 GiB."""
    model = k3opt.load_model("llama3-70b")
    lay = k3opt.load_layout("mb-1-llama3-70b-gb300")
    ev = k3opt.evaluate(lay, model, k3opt.load_cluster("gb300-nvl72"))
    assert ev.fits and ev.peak_device_bytes / GIB < 277.5


@pytest.mark.parametrize(("update", "words"), [
    ({"param_gather": "layer", "dense_sharding": "optim", "expert_sharding": "optim"}, "neither dense_sharding"),
    ({"activation_offload_layers": 10, "pp": 2, "split": [40, 40], "dense_fsdp": 32}, "priced for one chunk"),
    ({"activation_offload_layers": 10, "toggles": {"activation_offload": True}}, "priced for one chunk"),
    ({"param_gather": "sometimes"}, "param_gather"),
])
def test_bad_values_are_one_line(update: dict, words: str):
    with pytest.raises(LayoutError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _layout(**update)


@pytest.mark.parametrize("n", [80, 81])
def test_offloading_every_layer_is_refused(n: int):
    """Transformer Engine keeps the last layer on the GPU (num_layers > model_layers - 1 raises, cpu_offload.py
    L843 @ e7c550c5): 80 of Llama's 80 layers is as impossible as 81."""
    with pytest.raises(LayoutError, match="must be below the 80 layers"):
        k3opt.evaluate(_layout(activation_offload_layers=n), k3opt.load_model("llama3-70b"),
                       k3opt.load_cluster("gb200-nvl72"))


@pytest.mark.parametrize(("line", "words"), [
    ('param_gather = "sometimes"', "param_gather"),
    ("activation_offload_layers = -1", "activation_offload_layers"),
    ("activation_offload_layers = 90", "must be below the 80 layers"),
])
def test_explain_refuses_a_bad_setting_in_one_line(tmp_path: Path, line: str, words: str):
    key = line.split(" =")[0]
    text = "\n".join(ln for ln in (MEASURED / MB2).read_text().splitlines() if not ln.startswith(key))
    assert words in explain_refusal(tmp_path, text.replace("[toggles]", f"{line}\n\n[toggles]", 1))
