"""fp8_param_gather (Megatron --fp8-param-gather under its distributed optimizer) on the public Llama 3 70B MXFP8 run
on 64 GB300 (PP4 VP5, DP 16; layouts/measured/llama3-70b-gb300-mxfp8.toml). Expected values from the model's
config.json shapes: hidden 8,192, FFN 28,672, 64 query and 8 KV heads of 128, vocabulary 128,256, 80 layers.

Source of the rule: Megatron-LM d98e8a64 megatron/core/distributed/param_and_grad_buffer.py L1161-1178 (MXFP8
parameters under the distributed optimizer share one buffer with the gradients: the all-gather writes BF16 there and
_post_param_sync casts it into the parameters' own MXFP8 storage) and L1263-1290 (a quantized parameter keeps no
BF16 storage of its own)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import MEASURED, measured_variant

import k3opt
from k3opt.cli import main
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.launch.megatron_lm import megatron_settings

RUN = "llama3-70b-gb300-mxfp8.toml"
# Per decoder layer, the weights of the GEMMs in the compute precision: q and o 8192 x 8192, k and v 1024 x 8192,
# gate, up and down 28672 x 8192 = 855,638,016; the layer's two RMSNorm vectors (2 x 8,192) stay BF16.
Q = 855_638_016
NORMS = 2 * 8192
EMBED = 128256 * 8192
HEAD = 128256 * 8192 + 8192
GIB = 2**30


def _layout(**update) -> k3opt.Layout:  # noqa: ANN003 - Layout fields
    return measured_variant(RUN, **update)


def _cf(lay: k3opt.Layout):
    return coefficients(Shape.of(lay), k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb300-nvl72"))


def test_mxfp8_weights_drop_their_bf16_copy_and_keep_both_quantized_copies():
    on, off = _cf(_layout()), _cf(_layout(fp8_param_gather=False))
    L = on.n_layers
    np.testing.assert_allclose(off.bf16_view[:L], 2 * (Q + NORMS))
    np.testing.assert_allclose(on.bf16_view[:L], 2 * NORMS)
    # Row- and column-wise MXFP8 copies either way: 2 x (1 + 1/32) B per weight.
    np.testing.assert_allclose(on.quantized_weights[:L], 2 * (33 / 32) * Q, rtol=1e-12)
    np.testing.assert_allclose(off.quantized_weights[:L], 2 * (33 / 32) * Q, rtol=1e-12)
    # The embedding and the output layer run BF16: their weights stay BF16.
    assert on.bf16_view[L] == pytest.approx(2 * EMBED) and on.bf16_view[L + 1] == pytest.approx(2 * HEAD)
    # MXFP8's gather stays BF16 (through the gradient buffer): the update's link time is unchanged.
    np.testing.assert_allclose(on.update["nvlink"], off.update["nvlink"], rtol=1e-12)


def test_per_tensor_fp8_weights_keep_one_buffer_and_gather_in_fp8():
    on, off = _cf(_layout(precision="fp8")), _cf(_layout(precision="fp8", fp8_param_gather=False))
    L = on.n_layers
    np.testing.assert_allclose(on.bf16_view[:L], 2 * NORMS)
    # One FP8 byte per weight, both usages reading it (Blackwell), against the cached row- and column-wise copies.
    np.testing.assert_allclose(on.quantized_weights[:L], Q)
    np.testing.assert_allclose(off.quantized_weights[:L], 2 * Q)
    # The distributed optimizer reduce-scatters the BF16 gradient buffer (2 B) and all-gathers the weights: 2 B each
    # in BF16, 1 B for the FP8 ones. Per layer 4 (Q + norms) bytes become 4 (Q + norms) - Q, over the same group.
    ratio = (4 * (Q + NORMS) - Q) / (4 * (Q + NORMS))
    np.testing.assert_allclose(on.update["nvlink"][:L], ratio * off.update["nvlink"][:L], rtol=1e-12)


def test_the_public_run_fits_its_gpu_with_it_and_not_without():
    """Rank 0 holds chunks 0, 4, 8, 12 and 16: 20 layers whose BF16 copies, 20 x 2 x 855,638,016 B = 31.875 GiB,
    are what the run does not hold."""
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb300-nvl72")
    on = k3opt.evaluate(_layout(), model, cluster)
    off = k3opt.evaluate(_layout(fp8_param_gather=False), model, cluster)
    assert on.fits and not off.fits
    assert off.peak_device_bytes - on.peak_device_bytes == pytest.approx(20 * 2 * Q, rel=1e-9)
    assert (off.peak_device_bytes - on.peak_device_bytes) / GIB == pytest.approx(31.875, abs=1e-3)


def test_exports_write_the_recipe_and_the_buffer_reuse():
    model = k3opt.load_model("llama3-70b")
    flags = {s.flag: s.value for s in megatron_settings(_layout(), model)[0]}
    assert flags["--fp8-format"] == "e4m3" and flags["--fp8-recipe"] == "mxfp8"
    assert flags["--fp8-param-gather"] is True and flags["--reuse-grad-buf-for-mxfp8-param-ag"] is True
    fp8 = {s.flag: s.value for s in megatron_settings(_layout(precision="fp8"), model)[0]}
    assert fp8["--fp8-recipe"] == "tensorwise" and fp8["--fp8-param-gather"] is True
    assert "--reuse-grad-buf-for-mxfp8-param-ag" not in fp8
    plain = {s.flag for s in megatron_settings(_layout(fp8_param_gather=False), model)[0]}
    assert "--fp8-recipe" in plain and "--fp8-param-gather" not in plain


@pytest.mark.parametrize("update, fragment", [
    ({"precision": "bf16"}, 'fp8_param_gather stores the weights in the compute precision, but precision is "bf16"'),
    ({"precision": "nvfp4"}, 'precision is "nvfp4"; use precision "fp8" or "mxfp8"'),
    ({"dense_sharding": "optim_grads"}, "fp8_param_gather is priced under Megatron's distributed optimizer"),
])
def test_a_layout_it_does_not_price_is_one_line(update, fragment):
    with pytest.raises(k3opt.LayoutError, match=fragment):
        _layout(**update)


def test_muon_cannot_gather_fp8_weights(tmp_path):
    """Kimi K2 trains with Muon, whose layer-wise optimizer has no shared gradient buffer (Megatron-Bridge turns the
    flag off for Muon + MXFP8): the layout is refused with one line, exit 2 from the CLI."""
    src = MEASURED / "mb-21-kimi-k2-gb300.toml"
    text = src.read_text().replace('grad_dtype = "bf16"', 'grad_dtype = "bf16"\nfp8_param_gather = true', 1)
    path = tmp_path / "k2.toml"
    path.write_text(text)
    with pytest.raises(k3opt.LayoutError, match="trains with Muon"):
        k3opt.evaluate(k3opt.load_layout(path))
    out = CliRunner().invoke(main, ["explain", str(path)])
    assert out.exit_code == 2
    lines = [ln for ln in out.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "fp8_param_gather needs Megatron's distributed optimizer" in lines[0], lines


DATA = Path(__file__).parents[1] / "data"


@pytest.mark.parametrize("precision", ["mxfp8", "fp8"])
def test_every_exported_switch_exists_at_the_pinned_commits(precision):
    """The flags and keys come from Megatron-LM d98e8a64's argument parser and Megatron-Bridge 067f987d's config
    fields (tests/data, as tests/launch checks every other switch)."""
    from k3opt.launch import to_launch

    lay = _layout(precision=precision)
    flags = {ln for ln in (DATA / "megatron_lm_flags.txt").read_text().splitlines() if ln and not ln.startswith("#")}
    emitted = [tok for ln in to_launch(lay, "megatron-lm").text.splitlines() if not ln.lstrip().startswith("#")
               for tok in ln.split() if tok.startswith("--")]
    assert "--fp8-param-gather" in emitted and sorted(set(emitted) - flags) == []
    keys = {ln for ln in (DATA / "megatron_bridge_keys.txt").read_text().splitlines()
            if ln and not ln.startswith("#")}
    bridge = [k for k, _ in to_launch(lay, "megatron-bridge").settings]
    assert "mixed_precision.fp8_param_gather" in bridge and sorted(set(bridge) - keys) == []


def test_the_expert_group_gathers_per_tensor_fp8_experts_in_fp8():
    """Qwen3-30B-A3B on 16 B200, EP 8, expert FSDP 2, the dense group of one rank (it gathers nothing): the update's
    link bytes per layer are the expert group's alone, the BF16 gradient buffer reduce-scattered (2 B per routed
    weight) and the weights all-gathered, 2 B in BF16 or 1 B in FP8 (every routed weight is a GEMM weight): 3/4 of
    the bytes with the flag."""
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    base = dict(gpus=16, ep=8, expert_fsdp=2, dense_fsdp=1, microbatches=8, rows=4, context=4096, split=[48],
                recompute="none", fsdp_lifecycle="accumulate", dense_sharding="optim", expert_sharding="optim",
                grad_dtype="bf16", precision="fp8", model="qwen3-30b-a3b", cluster="b200")
    on = coefficients(Shape.of(k3opt.make_layout(**base, fp8_param_gather=True)), model, cluster)
    off = coefficients(Shape.of(k3opt.make_layout(**base)), model, cluster)
    L = on.n_layers
    links_on = on.update["nvlink"][:L] + on.update["nic"][:L]
    links_off = off.update["nvlink"][:L] + off.update["nic"][:L]
    assert links_off.min() > 0
    np.testing.assert_allclose(links_on, 0.75 * links_off, rtol=1e-12)
