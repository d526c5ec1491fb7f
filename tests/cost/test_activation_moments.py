"""Within the activation phase, the loss's logits and a layer's backward transients are not live together: one
schedule step runs one microbatch's forward or backward, and the last rank's backward of a microbatch starts with
the loss's backward, which frees the logits (Megatron's 1F1B and interleaved schedules; the combined 1F1B of the EP
overlap schedule runs a forward and a backward in one step, and there they are). MTP heads' saved softmax is live
beside the LM head's logits (Megatron computes the MTP losses first)."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost import ledger

LAYER = ("recompute_working_set", "grad_transient", "ep_buffers")
HELD = ("activations", "attnres_bank", "pp_buffers", "routing_map")


def _moments(rank: k3opt.RankEvaluation) -> tuple[int, int, int]:
    return (sum(rank.ledger[k] for k in HELD), sum(rank.ledger[k] for k in LAYER), rank.ledger["logits"])


def test_the_moments_cover_the_activation_phase_once() -> None:
    assert set(ledger.ACTIVATION) == set(LAYER) | set(HELD) | {"logits"}
    assert ledger.MOMENT_TERMS[ledger.Moment.LAYER] == LAYER
    assert ledger.MOMENT_TERMS[ledger.Moment.LOSS] == ("logits",)


def test_mb2_logits_are_not_added_to_the_layer_backward() -> None:
    """MB-2: Llama 3 70B, PP1, MBS 2 x 8,192 tokens = 16,384 tokens; vocab 128,256; 2 B BF16 logits + 4 B FP32
    softmax = 16,384 x 128,256 x 6 = 12,608,077,824 B (11.74 GiB), more than the layer's gradient transient, so the
    phase is held + logits."""
    ev = k3opt.evaluate(k3opt.load_layout("mb-2-llama3-70b-gb200"))
    (rank,) = ev.ranks
    held, layer, loss = _moments(rank)
    assert loss == 16_384 * 128_256 * 6
    assert 0 < layer < loss
    assert rank.activation_phase_bytes == pytest.approx(held + loss, abs=1)
    assert "grad_transient" not in rank.activation_peak_terms and rank.at_peak("grad_transient") == 0
    assert rank.at_peak("logits") == loss


def test_under_the_ep_overlap_schedule_the_loss_and_a_layer_are_live_together() -> None:
    lay = k3opt.load_layout("mb-2-llama3-70b-gb200")
    plain = k3opt.evaluate(lay).ranks[0]
    both = k3opt.evaluate(lay.model_copy(update={"ep_overlap": True})).ranks[0]
    held, layer, loss = _moments(both)
    assert both.activation_phase_bytes == pytest.approx(held + layer + loss, abs=1)
    assert both.peak_bytes - plain.peak_bytes == pytest.approx(layer, abs=2)


def test_an_mtp_heads_softmax_is_live_with_the_lm_heads_logits() -> None:
    """MB-13: DeepSeek-V3 (one MTP module), MBS 1 x 4,096 tokens, vocab 129,280; the last rank holds the MTP head's
    FP32 softmax (4 B) beside the LM head's BF16 logits and FP32 softmax (6 B): 4,096 x 129,280 x 10 B. MB-22 trains
    without the MTP module (mtp_layers = 0): the LM head's 6 B alone."""
    ev = k3opt.evaluate(k3opt.load_layout("mb-13-deepseek-v3-gb200"))
    assert ev.ranks[-1].ledger["logits"] == 4_096 * 129_280 * 10
    assert all(r.ledger["logits"] == 0 for r in ev.ranks[:-1])
    without = k3opt.evaluate(k3opt.load_layout("mb-22-deepseek-v3-gb200"))
    assert without.layout.mtp_layers == 0 and without.ranks[-1].ledger["logits"] == 4_096 * 129_280 * 6
    # Llama 3 has no MTP module: 6 B per logit (above)
    assert k3opt.load_model("llama3-70b").mtp_layers == 0
