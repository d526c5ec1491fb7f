"""A hybrid model whose softmax layers are GQA and the rest KDA (the pattern of Qwen3-Next's gated-DeltaNet hybrids;
ModelSpec accepts [gqa] with [kda]): only the layers in full_attention_layers get GQA. Built from seed 003's K3
4-layer proxy (KDA layers 0-2, softmax layer 3) with its [mla] table swapped for Qwen3-30B-A3B's [gqa] table."""

from __future__ import annotations

import k3opt
from k3opt.cost.structure import structure_of


def _hybrid() -> k3opt.ModelSpec:
    data = k3opt.load_model("kimi-k3-4layer-proxy").model_dump()
    data.update(name="k3-proxy-gqa", mla=None, gqa={"num_heads": 32, "num_kv_heads": 4, "head_dim": 128,
                                                   "qk_norm": True})
    return k3opt.ModelSpec.model_validate(data)


def test_only_the_full_attention_layers_are_gqa():
    st = structure_of(_hybrid())
    assert [st.attention_kind(i) for i in range(4)] == ["kda", "kda", "kda", "gqa"]
    shapes = [{t.name: t.shape for b in layer for t in b.tensors} for layer in st.layers]
    for i in (0, 1, 2):
        # KDA: 96 heads x 128 = 12,288 wide projections of d = 7,168; no GQA tensor.
        assert shapes[i]["kda.q_proj"] == (12288, 7168)
        assert not any(name.startswith("gqa.") for name in shapes[i])
    # GQA: q 32 heads x 128 = 4,096, k and v 4 KV heads x 128 = 512, o back to d.
    assert (shapes[3]["gqa.q_proj"], shapes[3]["gqa.k_proj"], shapes[3]["gqa.o_proj"]) == (
        (4096, 7168), (512, 7168), (7168, 4096))
    assert not any(name.startswith("kda.") for name in shapes[3])
