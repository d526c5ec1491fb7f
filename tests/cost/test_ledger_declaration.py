"""The rank ledger's declaration (k3opt.cost.ledger): every term evaluate() prices is declared once, the phases
add up to the peak as seed 001's ledger says, and the named helpers give the figures derived here by hand."""

from __future__ import annotations

from dataclasses import fields

import pytest

import k3opt
from k3opt.cost import ledger
from k3opt.cost.coefficients import Coefficients, Shape, coefficients


def test_every_priced_term_is_declared_once(reference: k3opt.Layout) -> None:
    ev = k3opt.evaluate(reference)
    assert len({t.key for t in ledger.LEDGER}) == len(ledger.LEDGER)
    for rank in ev.ranks:
        assert set(rank.ledger) == set(ledger.TERMS)
    names = {f.name for f in fields(Coefficients)}
    assert {t.coefficient for t in ledger.LEDGER} <= names


def test_the_peak_is_persistent_plus_the_larger_phase(reference: k3opt.Layout) -> None:
    """Seed 001: peak = persistent + max(activation phase, optimizer phase), per rank; within the activation phase
    the loss's logits and a layer's transients are not live together (the reference runs no EP overlap)."""
    assert not reference.ep_overlap
    ev = k3opt.evaluate(reference)
    layer = ("recompute_working_set", "grad_transient", "ep_buffers")
    for rank in ev.ranks:
        by_phase = {ph: sum(rank.ledger[t.key] for t in ledger.LEDGER if t.phase is ph) for ph in ledger.Phase}
        act_all = by_phase[ledger.Phase.ACTIVATION]
        held = act_all - sum(rank.ledger[k] for k in layer) - rank.ledger["logits"]
        act = held + max(sum(rank.ledger[k] for k in layer), rank.ledger["logits"])
        assert rank.activation_phase_bytes == pytest.approx(act, abs=1)
        expected = by_phase[ledger.Phase.PERSISTENT] + max(act, by_phase[ledger.Phase.OPTIMIZER])
        assert rank.peak_bytes == pytest.approx(expected, abs=2)


def test_the_always_held_bytes_are_what_every_rank_holds_whatever_the_search_decides(
        reference: k3opt.Layout, model: k3opt.ModelSpec, cluster: k3opt.ClusterSpec) -> None:
    """The search's persistent floor: master + optimizer state + BF16 view + quantized copies, per layer; grads,
    the MoonEP slots and the accumulation buffer change with a decision and are left out."""
    assert ledger.ALWAYS_HELD == ("master", "optimizer", "bf16_view", "quantized_weights")
    ev = k3opt.evaluate(reference)
    cf = coefficients(Shape.of(reference), model, cluster)
    per_layer = ledger.persistent_layer_bytes(cf)
    start = 0
    for r, rank in enumerate(ev.ranks):
        n = reference.split[r]
        held = per_layer[start:start + n].sum()
        start += n
        # The reference layout is PP8 VP1: rank r holds its chunk's layers; the first and last ranks also hold the
        # embedding and head edges (indices L and L + 1).
        if r == 0:
            held += per_layer[model.num_layers]
        if r == len(ev.ranks) - 1:
            held += per_layer[model.num_layers + 1]
        assert held == pytest.approx(sum(rank.ledger[k] for k in ledger.ALWAYS_HELD), rel=1e-9)


def test_a_pp_packet_is_one_stream_per_open_residual_plus_the_hidden_stream() -> None:
    # K3 at 4K context: one BF16 [4096, 7168] stream is 4096 x 7168 x 2 B = 58,720,256 B.
    stream = 4096 * 7168 * 2
    assert ledger.pp_packet_bytes(0, stream) == 58_720_256
    assert ledger.pp_packet_bytes(3, stream) == 4 * 58_720_256


def test_peak_inflight_is_the_largest_composition() -> None:
    # A rank that passes through (2 of chunk 0, 1 of chunk 1) and (0, 3) holds 3 chunk-microbatches at most.
    assert ledger.peak_inflight(((2, 1), (0, 3), (1, 1))) == 3


def test_the_optimizer_transient_adds_newton_schulz_only_when_both_are_live() -> None:
    assert ledger.optimizer_transient_bytes(10.0, 4.0, with_ns=True) == 14.0
    assert ledger.optimizer_transient_bytes(10.0, 4.0, with_ns=False) == 10.0
    assert ledger.optimizer_transient_bytes(3.0, 4.0, with_ns=False) == 4.0
