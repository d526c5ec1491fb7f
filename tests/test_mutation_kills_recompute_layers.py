"""Full recompute runs each decoder layer's forward once more, and only the layers: at the achievable rates every
Qwen3-30B-A3B decoder layer (48 identical MoE layers, config.json) has the same tensor time, the last one too, and
the LM-head edge costs the same with and without full recompute (the head's logits are not recomputed)."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates


def _tensor(recompute: str):
    lay = k3opt.make_layout(gpus=16, pp=1, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=1, context=4096,
                            split=[48], recompute=recompute, domain_gpus_used=8)
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=load_rates("b200"))
    return cf.achievable["tensor"]  # 48 layers, then the embedding edge and the head edge


def test_every_decoder_layer_is_recomputed_and_the_head_is_not():
    full, selective = _tensor("full"), _tensor("selective")
    assert len(full) == 48 + 2
    assert full[47] == pytest.approx(full[0], rel=1e-12, abs=0)  # the last decoder layer like the first
    assert full[0] > selective[0]
    assert full[49] == pytest.approx(selective[49], rel=1e-12, abs=0) and full[49] > 0
    assert full[48] == 0.0  # the embedding lookup runs no GEMM
