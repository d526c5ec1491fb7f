"""The per-layer arrays and layer kinds of the structure, and the small comm helpers, pinned from model-k3.md's
per-unit table (section 3) and the collective formulas of cost-model.md section 3."""

from __future__ import annotations

import golden_k3 as hand
import pytest

from k3opt import comm
from k3opt.structure import structure_of


def test_layer_kinds_follow_the_config(model):
    st = structure_of(model)
    kinds = [st.layer_kind(i) for i in range(93)]
    assert kinds[0] == "kda+dense" and kinds[1] == "kda+moe" and kinds[3] == "mla+moe" and kinds[92] == "mla+moe"
    assert kinds.count("mla+moe") == 24 and kinds.count("kda+moe") == 68 and kinds.count("kda+dense") == 1


def test_per_layer_arrays_from_the_unit_table(model):
    a = structure_of(model).arrays
    assert a.n == 93
    for i in range(93):
        mla = hand.is_mla(i)
        attn_muon = hand.MLA_MUON if mla else hand.KDA_MUON
        attn_adam = hand.MLA_ADAM if mla else hand.KDA_ADAM
        attn_active = hand.MLA_ACTIVE if mla else hand.KDA_ACTIVE
        if i == 0:
            want = (attn_muon + hand.DENSE_MUON, attn_adam + hand.VEC0_ADAM, 0, attn_active + hand.DENSE_ACTIVE, 0, 0)
        else:
            want = (attn_muon + hand.MOE_MUON, attn_adam + hand.MOE_ADAM + hand.VEC_ADAM, hand.ROUTED,
                    attn_active + hand.MOE_ACTIVE, hand.ROUTED_ACTIVE, 1)
        got = (a.nonrouted_muon[i], a.adamw[i], a.routed[i], a.active_nonrouted[i], a.active_routed[i], a.moe[i])
        assert tuple(int(x) for x in got) == want, i
        assert int(a.mla[i]) == int(mla)
        assert int(a.attention_flops_per_doc_token[i]) == (3 * 96 * (192 + 128) if mla else 0)
        assert int(a.scan_flops[i]) == (0 if mla else 3 * 96 * (64 * (4 * 128 + 3 * 128) + 6 * 128 * 128))
    for name in ("nonrouted_muon", "adamw", "routed", "active_nonrouted", "active_routed",
                 "attention_flops_per_doc_token", "scan_flops", "moe", "mla"):
        assert getattr(a, name).dtype.kind == "i" and getattr(a, name).shape == (93,)


@pytest.mark.parametrize(("kind", "naive"), [
    ("kda", 137_450),
    ("mla", 104_618),
    # without fused SiTU the MoE layer keeps 6 FP32 [16, 3072] and 6 FP32 [1, 6144] copies instead of the BF16
    # [16, 6144] and [1, 12288] inputs: 306,602 - 98,304 - 12,288 + 294,912 + 36,864
    ("moe", 527_786),
    # dense FFN layer: 14,337 + 9 + 6 x 33,792 + 33,792
    ("dense_ffn", 14_337 + 9 + 6 * 33_792 + 33_792),
])
def test_saved_values_per_token_without_fused_situ(model, kind, naive):
    assert structure_of(model).saved_values_per_token(kind) == naive


def test_ring_allgather_receives_all_but_its_own_shard():
    """Ring all-gather of S bytes over n ranks: each receives S (1 - 1/n) (cost-model.md section 3)."""
    assert comm.allgather_received(2_000, 64) == 1_968.75
    assert comm.allgather_received(2_000, 1) == 0
