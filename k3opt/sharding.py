"""Whole-tensor optimizer sharding (layer-wise distributed optimizer, e.g. dist_muon): each tensor's FP32
master and optimizer state live on one rank of the shard group, so ranks own unequal shares.

Ownership is computed from the model's real tensor list (k3opt.structure) by longest-processing-time
assignment (largest tensor to the least-loaded rank); the ledger counts the rank that owns the most.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

from k3opt.specs import ModelSpec
from k3opt.structure import structure_of


@lru_cache(maxsize=1024)
def worst_owned(model_json: str, blocks: tuple[int, ...], routed: bool, group: int, ep: int) -> tuple[int, int]:
    """(Muon params, AdamW params) owned by the most-loaded of `group` ranks over the tensors of `blocks`
    (indices into layers + [first edge, last edge]). Routed tensors: the rank's ep-local experts only."""
    st = structure_of(ModelSpec.model_validate_json(model_json))
    all_blocks = [*st.layers, st.first, st.last]
    sizes: list[tuple[int, bool]] = []
    base_m = base_a = 0
    for i in blocks:
        for b in all_blocks[i]:
            for t in b.tensors:
                if t.routed != routed:
                    continue
                copies = t.count // ep if routed else t.count
                numel = t.numel // t.count
                muon = t.optimizer == "muon"
                # Many identical copies (experts, vision blocks): every rank takes q whole copies first, the
                # rest (fewer than 2 per rank) go through the largest-first assignment.
                q = max(0, copies // group - 1)
                base_m += q * numel * muon
                base_a += q * numel * (not muon)
                sizes += [(numel, muon)] * (copies - q * group)
    sizes.sort(key=lambda s: -s[0])
    heap = [(base_m + base_a, k, base_m, base_a) for k in range(group)]  # (load, rank, muon, adamw)
    for numel, muon in sizes:
        load, k, m, a = heapq.heappop(heap)
        heapq.heappush(heap, (load + numel, k, m + numel * muon, a + numel * (not muon)))
    _, _, m, a = max(heap)
    return m, a
