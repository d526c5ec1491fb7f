"""Transformer Engine's default CPU-offload schedule (activation_offload_layers): what the compute stream waits for
the copies (transformer_engine/pytorch/cpu_offload.py, DefaultOffloadSynchronizer, L602-647 @ e7c550c5). Layers
0..N-1 are copied out on one stream after their forward; the forward of layer L - N + i waits for copy i; copy i
back is queued after the backward of layer L - N + i, and layer i's backward waits for it. Expected values are
walked through by hand in the comments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import k3opt
import k3opt.report.text
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.cost.schedule import offload_stall

MB2 = Path(k3opt.__file__).parents[1] / "layouts" / "measured" / "mb-2-llama3-70b-gb200.toml"


def test_copies_slower_than_the_layers_stall_both_passes():
    """L = 5, N = 3 (TE's Figure 4 case: at most 2 sets on the GPU); forward 1 s, backward 2 s, copy 3 s a layer.
    Forward: copy 0 ends at 1 + 3 = 4, copy 1 at 7, copy 2 at 10. Layer 2 is ready at 2 and waits for copy 0 (2 s);
    layer 3 at 5 waits for copy 1 (2 s), layer 4 at 8 for copy 2 (2 s); the forward ends at 11.
    Backward: layer 4 ends at 13; copy 2 back is queued then and ends at 16 (layer 3 ends at 15); copy 1 back is
    queued at 15, starts when the stream frees at 16, ends at 19; layer 2 waits 15 -> 16 (1 s) and ends at 18;
    copy 0 back ends at 22, layer 1 waits 18 -> 19 (1 s) and ends at 21; layer 0 waits 21 -> 22 (1 s)."""
    stall = offload_stall(np.ones(5), np.full(5, 2.0), np.full(5, 3.0), 3)
    np.testing.assert_allclose(stall, [1.0, 1.0, 2.0 + 1.0, 2.0, 2.0])


def test_copies_that_fit_their_window_hide():
    """L = 5, N = 2, copies as long as a forward layer: copy 0 ends at 2 (layer 3 starts at 3), copy 1 at 3 (layer 4
    at 4); copy 1 back is queued after layer 4's backward (t = 7) and ends at 8, before layer 1's backward (t = 11);
    copy 0 back, queued after layer 3's (t = 9), ends at 10, before layer 0's (t = 13)."""
    np.testing.assert_allclose(offload_stall(np.ones(5), np.full(5, 2.0), np.ones(5), 2), 0.0)


def test_no_offloaded_layer_no_stall():
    np.testing.assert_allclose(offload_stall(np.ones(4), np.ones(4), np.full(4, 9.0), 0), 0.0)


@pytest.mark.parametrize(("layers", "copy"), [(4, 0.5), (4, 5.0), (2, 5.0)])
def test_one_layer_left_on_the_gpu_exposes_every_copy(layers: int, copy: float):
    """N = L - 1 (TE warns it "prevents overlapping"): each forward waits for the previous layer's copy out and each
    backward for its own copy back, which is queued only once the layer above is done: the stall is every copy,
    out and back, whatever the compute (L = 4, N = 3: 6 copies; L = 2, N = 1: 2)."""
    stall = offload_stall(np.full(layers, 3.0), np.full(layers, 7.0), np.full(layers, copy), layers - 1)
    assert stall.sum() == pytest.approx(2 * (layers - 1) * copy)


def _llama(n: int, cluster: str, **extra) -> tuple[k3opt.Layout, k3opt.ModelSpec, k3opt.ClusterSpec]:
    data = k3opt.load_layout(str(MB2)).model_dump()
    data.pop("measured")
    data.update(activation_offload_layers=n, **extra)
    return k3opt.make_layout(**data), k3opt.load_model("llama3-70b"), k3opt.load_cluster(cluster)


def test_the_stall_lengthens_the_step_by_every_copy_when_one_layer_stays():
    """Llama 3 70B, PP1, M = 2, 79 of 80 layers offloaded on GB200 (200 GB/s host link): every copy is exposed,
    2 x the 79 layers' saved bytes (the ledger's host bytes, one microbatch in flight) / 200 GB/s per microbatch,
    at the peak and the achievable rates alike; the peak step grows by M x that."""
    lay, model, cluster = _llama(79, "gb200-nvl72")
    ev = k3opt.evaluate(lay, model, cluster)
    per_microbatch = 2 * ev.ranks[0].host_bytes / (cluster.host_link_gbps * 1e9)
    cf = coefficients(Shape.of(lay), model, cluster, k3opt.inputs.rates.rates_for(cluster))
    assert cf.offload_stall.sum() == pytest.approx(per_microbatch, rel=1e-9)
    assert cf.offload_stall_achievable.sum() == pytest.approx(per_microbatch, rel=1e-9)
    assert ev.step.offload_stall_s == pytest.approx(per_microbatch, rel=1e-9)
    assert ev.step.achievable_offload_stall_s == pytest.approx(per_microbatch, rel=1e-9)
    assert f"waits {per_microbatch * 1e3:.1f} ms per microbatch" in k3opt.report.text.explain_text(ev)
    base = k3opt.evaluate(_llama(0, "gb200-nvl72")[0], model, cluster)
    assert ev.step.step_time_s - base.step.step_time_s == pytest.approx(2 * per_microbatch, rel=1e-6)


def test_a_slow_host_link_exposes_what_c2c_hides():
    """MB-2's 40 offloaded layers: at GB200's achievable rates each copy (one layer's saved bytes / 200 GB/s) hides
    under the forward of the 40 layers kept and the backward above it; over B200's PCIe (64 GB/s) they do not."""
    lay, model, gb200 = _llama(40, "gb200-nvl72")
    rates = k3opt.inputs.rates.rates_for
    assert coefficients(Shape.of(lay), model, gb200, rates(gb200)).offload_stall_achievable.sum() == 0.0
    b200 = k3opt.load_cluster("b200")
    assert coefficients(Shape.of(lay), model, b200, rates(b200)).offload_stall_achievable.sum() > 0.0


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_stall_reads_the_forward_and_backward_of_the_compute_stream(recompute: str):
    """Llama 3 70B, 40 of 80 layers offloaded over a 4 GB/s host link (B200 otherwise): the copies outlast the
    forward, so the stall depends on how a layer's compute-stream time splits. Forward : backward is 1 : 2 of the
    tensor-core time (one more forward under full recompute, which runs in the backward: 1 : 3), 2 : 3 of the
    memory-bound kernels' passes (2 : 5 under full recompute); at the achievable rates both are on the compute
    stream."""
    lay, model, cluster = _llama(40, "b200", recompute=recompute, toggles={})
    cluster = cluster.model_copy(update={"host_link_gbps": 4})
    cf = coefficients(Shape.of(lay), model, cluster, k3opt.inputs.rates.rates_for(cluster))
    L = cf.n_layers
    copy = cf.offloaded_act[:L] / (cluster.host_link_gbps * 1e9)
    f_t, f_v = (1 / 4, 2 / 7) if recompute == "full" else (1 / 3, 2 / 5)
    tensor = cf.time["tensor"][:L] - cf.offload_stall[:L]
    want = offload_stall(f_t * tensor, (1 - f_t) * tensor, copy, 40)
    assert want.sum() > 0
    np.testing.assert_allclose(cf.offload_stall[:L], want, rtol=1e-9, atol=1e-12)
    a_tensor = cf.achievable["tensor"][:L] - cf.offload_stall_achievable[:L]
    vector = cf.achievable["vector"][:L]
    want = offload_stall(f_t * a_tensor + f_v * vector, (1 - f_t) * a_tensor + (1 - f_v) * vector, copy, 40)
    np.testing.assert_allclose(cf.offload_stall_achievable[:L], want, rtol=1e-9, atol=1e-12)
