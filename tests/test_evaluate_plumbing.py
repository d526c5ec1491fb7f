"""evaluate()'s own bookkeeping around the cost model: the capacity line and its reserve, the fit at the boundary,
the terms' formulas, and the validation rows (measured figures are compared, never fed back)."""

from __future__ import annotations

import math

import pytest

import k3opt
from k3opt.evaluate import TERM_INFO

GIB = 2**30
HBM = 189_471 * 2**20  # gb200-nvl72, nvidia-smi MiB


def test_reserve_lowers_the_capacity_line_by_exactly_its_bytes(reference):
    ev = k3opt.evaluate(reference, reserve_gib=1.5)
    assert ev.capacity_bytes == HBM - 1_610_612_736 == HBM - 3 * GIB // 2
    assert all(r.capacity_bytes == ev.capacity_bytes for r in ev.ranks)
    assert ev.headroom_bytes == ev.capacity_bytes - 120_887_629_304
    assert k3opt.evaluate(reference).capacity_bytes == HBM  # the layout's own reserve_gib = 0


def test_a_peak_exactly_on_the_line_fits(reference):
    peak = 120_887_629_304
    ev = k3opt.evaluate(reference, reserve_gib=(HBM - peak) / GIB)
    assert ev.capacity_bytes == peak == ev.peak_bytes
    assert ev.ranks[0].fits and ev.fits and ev.ranks[0].headroom_bytes == 0
    one_more = k3opt.evaluate(reference, reserve_gib=(HBM - peak + 1) / GIB)
    assert not one_more.ranks[0].fits and not one_more.fits


def test_host_bytes_exactly_on_the_host_line_fit(reference):
    """Pipeline ZeRO-2 puts rank 0's FP32 gradient shard, 4 (D + E)/64 = 20,917,092,254 B, in host memory."""
    lay = reference.model_copy(update={"toggles": k3opt.Toggles(pipeline_zero2_host_grads=True), "measured": None})
    host = 20_917_092_254
    base = k3opt.load_cluster("gb200-nvl72")
    on_line = base.model_copy(update={"host_memory_gb": host / 1e9})
    assert on_line.host_memory_bytes == host
    r0 = k3opt.evaluate(lay, cluster=on_line).ranks[0]
    assert r0.host_bytes == host == r0.host_capacity_bytes and r0.host_fits
    below = base.model_copy(update={"host_memory_gb": (host - 1000) / 1e9})
    assert not k3opt.evaluate(lay, cluster=below).ranks[0].host_fits
    assert k3opt.evaluate(lay).ranks[0].host_capacity_bytes == 240 * 10**9


def test_terms_carry_the_ledger_bytes_and_their_formulas(reference_eval):
    for r in reference_eval.ranks:
        for t in r.terms:
            assert t.bytes == r.ledger[t.key]
            kind, formula = TERM_INFO[t.key]
            assert t.kind == kind
            if t.key == "logits":
                assert t.formula == "4096 tokens x vocab 163840 x (2 B BF16 logits + 4 B FP32 softmax)"
            else:
                assert t.formula == formula


def test_the_layouts_nvlink_domain_is_checked_against_the_cluster(reference):
    lay = reference.model_copy(update={"domain_gpus_used": 80})
    with pytest.raises(k3opt.LayoutError, match="exceeds the 72-GPU NVLink domain"):
        k3opt.evaluate(lay)


def test_every_measured_figure_gets_a_validation_row(reference_eval, reference):
    measured = reference.measured.model_copy(update={"step_time_s": 60.0, "tokens_per_s_per_gpu": 500.0})
    ev = k3opt.evaluate(reference.model_copy(update={"measured": measured}))
    peak, step, tps = ev.validation
    assert (peak.figure, peak.measured, peak.unit) == ("peak HBM, worst rank", 146.18, "GiB")
    assert (step.figure, step.modeled, step.measured, step.unit) == ("step time", ev.step.step_time_s, 60.0, "s")
    assert (tps.figure, tps.modeled, tps.measured, tps.unit) == (
        "tokens/s per GPU", ev.step.tokens_per_s_per_gpu, 500.0, "tokens/s")
    assert step.gap == 60.0 - ev.step.step_time_s and math.isclose(step.gap_pct, 100 * step.gap / 60.0)
    assert ev.step.step_time_s == reference_eval.step.step_time_s  # a measurement never moves the model
