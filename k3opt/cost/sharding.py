"""Whole-tensor optimizer sharding (layer-wise distributed optimizer, e.g. dist_muon): each tensor's FP32
master and optimizer state live on one rank of the shard group, so ranks own unequal shares.

Ownership follows Megatron's own assignment (NVIDIA/Megatron-LM@1ca250c6fb,
megatron/core/optimizer/layer_wise_optimizer.py `LayerWiseDistributedOptimizer.shard_params`, the version whose
`_allgather_helper` lines 207 / 223 the K3 activation review's allocator trace names): the parameters of every
optimizer's param groups (Muon's first, then AdamW's), stably sorted by element count, ascending, are dealt to the
ranks of the group in a ping-pong loop 0, 1, ..., n-1, n-1, ..., 0; expert-parallel parameters go through the same
loop over the expert data-parallel group. The tensors are the framework's parameters, not the checkpoint's
(`framework_tensors`), because their count and order decide which rank gets the largest.
"""

from __future__ import annotations

from k3opt.cost.structure import Block, structure_of
from k3opt.inputs.specs import ModelSpec

_FUSED_FC1 = (("ffn.gate_proj", "ffn.up_proj"), ("moe.shared_gate", "moe.shared_up"),
              ("moe.experts.w1", "moe.experts.w3"))
"""Megatron's GatedMLP keeps gate and up as one `linear_fc1` [2 ff, d] (Megatron-Bridge@067f987d
kimi_k3_bridge.py GatedMLPMapping for the dense MLP, the shared experts and each routed expert)."""


def framework_tensors(blocks: list[Block], routed: bool, ep: int, attn_res_pair: int = 0
                      ) -> list[tuple[int, bool, int]]:
    """(elements, Muon?, copies) of the framework parameters of `blocks`, in model order (`copies` identical
    parameters in a row); routed: the rank's ep-local experts, one parameter per expert and projection.
    Differences from the checkpoint's tensor list (Megatron-Bridge@067f987d kimi_k3_layers.py): gate and up
    fused (`_FUSED_FC1`); KDA's short convolution is three modules q_conv1d / k_conv1d / v_conv1d (L194-196);
    every decoder layer builds both AttnRes norm + proj pairs (L460-463), so a layer whose checkpoint lacks the
    attention pair gets `attn_res_pair` more (norm [d], proj [1, d])."""
    out: list[tuple[int, bool, int]] = []
    for b in blocks:
        by_name = {t.name: t for t in b.tensors}
        skip: set[str] = set()
        for t in b.tensors:
            if t.routed != routed or t.name in skip or t.count == 0:
                continue  # count 0: a shared tensor (the MTP module's head is the LM head), owned where it lives
            copies = t.count // ep if routed else t.count
            numel = t.numel // t.count
            muon = t.optimizer == "muon"
            pair = next((p for p in _FUSED_FC1 if t.name == p[0] and p[1] in by_name), None)
            if pair is not None:
                skip.add(pair[1])
                numel += by_name[pair[1]].numel // by_name[pair[1]].count
            if t.name == "kda.conv1d" and len(t.shape) == 3 and t.shape[0] == 3:
                out.append((numel // 3, muon, 3 * copies))
                continue
            out.append((numel, muon, copies))
        if not routed and b.kind == "vectors" and attn_res_pair and "attn_res.attn_norm" not in by_name \
                and "attn_res.mlp_norm" in by_name:
            out.append((attn_res_pair, False, 2))
    return out


def count_owned_per_rank(model: ModelSpec, blocks: tuple[int, ...], routed: bool, group: int, ep: int
                         ) -> tuple[tuple[int, int], ...]:
    """(Muon params, AdamW params) each of the `group` ranks owns over the tensors of `blocks` (indices into
    layers + [first edge, last edge]), by Megatron's ping-pong assignment (module docstring). Cached per model by
    coefficients.CostModel.owned_per_rank."""
    st = structure_of(model)
    all_blocks = [*st.layers, st.first, st.last]
    n_layers = len(st.layers)
    # Model order: embedding (first edge), decoder layers, final norm and head (last edge).
    order = sorted(blocks, key=lambda i: -1 if i == n_layers else i)
    pair = model.hidden_size if model.attn_res is not None else 0
    tensors = [t for i in order for t in framework_tensors(all_blocks[i], routed, ep, pair)]
    # Muon's param groups come first in the chained optimizer.
    return ping_pong([t for t in tensors if t[1]] + [t for t in tensors if not t[1]], group)


def ping_pong(params: list[tuple[int, bool, int]], group: int) -> tuple[tuple[int, int], ...]:
    """(Muon, AdamW) elements per rank when `params` ((elements, Muon?, copies) in param-group order) are stably
    sorted by size, ascending, and dealt in the loop 0, 1, ..., n-1, n-1, ..., 0 (`shard_params`). A run of
    identical copies gives every rank two per full loop of 2 n; the rest are dealt one by one."""
    loop = list(range(group)) + list(range(group))[::-1]
    period = len(loop)
    own = [[0, 0] for _ in range(group)]
    i = 0
    for numel, muon, copies in sorted(params, key=lambda t: t[0]):
        k = 0 if muon else 1
        full, rest = divmod(copies, period)
        for r in range(group):
            own[r][k] += 2 * full * numel
        for j in range(rest):
            own[loop[(i + j) % period]][k] += numel
        i = (i + copies) % period
    return tuple((m, a) for m, a in own)


def count_whole_params(model: ModelSpec, blocks: tuple[int, ...], routed: bool, ep: int) -> int:
    """Parameters of `blocks` a rank holds whole (routed: its ep-local experts), the checkpoint's count as the
    rest of the ledger uses it. Cached per model by coefficients.CostModel.whole_params."""
    st = structure_of(model)
    all_blocks = [*st.layers, st.first, st.last]
    return sum(b.params(routed=routed) // (ep if routed else 1) for i in blocks for b in all_blocks[i])


def worst_owned(model: ModelSpec, blocks: tuple[int, ...], routed: bool, group: int, ep: int) -> tuple[int, int]:
    """(Muon params, AdamW params) of the rank owning the most elements (ties: the lowest rank)."""
    shares = count_owned_per_rank(model, blocks, routed, group, ep)
    return max(shares, key=lambda s: (s[0] + s[1], -shares.index(s)))
