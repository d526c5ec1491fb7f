"""Communication volumes and placement.

Placement: Megatron's default rank order, innermost first, tp-cp-ep-dp-pp (tp = 1). Global rank
g = pp_index * (N / p) + l, with l the rank inside its stage; NVLink domains are consecutive blocks of the
cluster's domain size. EP groups are e consecutive stage ranks (EP folded over DP * c); dense FSDP groups
take f_d dp indices at stride c; expert FSDP groups take f_e expert-data-parallel indices at stride e.
From the member lists follow a (group members sharing a domain), the FSDP shards per domain, and whether a
PP hop stays inside a domain.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

from k3opt.inputs.memo import Memo


def _min_members_per_domain(groups: np.ndarray, domain: int) -> int:
    """groups: [n_groups, size] global ranks. The smallest number of a member's group peers (itself
    included) in its NVLink domain, over all members: the worst member sets the collective's time."""
    dom = np.sort(groups // domain, axis=1)
    # Each row's members sit in runs of equal domain; a run's length is its members' peer count.
    starts = np.ones(dom.shape, dtype=bool)
    starts[:, 1:] = dom[:, 1:] != dom[:, :-1]
    pos = np.flatnonzero(starts)
    return int(np.diff(np.append(pos, dom.size)).min())


@dataclass(frozen=True)
class Placement:
    """Group members per NVLink domain for one layout (the worst member of each group kind)."""

    ep_local: int
    """a: EP ranks in one NVLink domain (of e)."""
    dense_fsdp_local: int
    expert_fsdp_local: int
    pp_hop_in_domain: tuple[bool, ...]
    """For each rank boundary r -> r+1 (mod p): do all its hops stay inside a domain."""
    pipeline_in_domain: bool
    """All pipeline ranks of a replica share one domain (activation balancing stays on NVLink)."""
    cp_in_domain: bool = True
    """Every CP group (c consecutive ranks) sits inside one NVLink domain, so the KV ring never crosses the NIC."""


def _count_members_at_offset(stage: int, c: int, e: int, f_e: int, f_d: int, domain: int, base: int
                             ) -> tuple[int, int, int]:
    """(EP, dense FSDP, expert FSDP) members per NVLink domain, worst member, of a stage whose first rank sits
    `base` ranks into a domain (a stage shifted by whole domains has the same members per domain)."""
    ranks = base + np.arange(stage)
    ep_groups = ranks.reshape(-1, e)
    # dense FSDP: same cp index, f_d consecutive dp indices -> stride c
    dp = stage // c
    dense_groups = ranks.reshape(dp // f_d, f_d, c).transpose(0, 2, 1).reshape(-1, f_d)
    # expert FSDP: same ep index, f_e consecutive expert-dp indices -> stride e
    edp = stage // e
    exp_groups = ranks.reshape(edp // f_e, f_e, e).transpose(0, 2, 1).reshape(-1, f_e)
    return (_min_members_per_domain(ep_groups, domain), _min_members_per_domain(dense_groups, domain),
            _min_members_per_domain(exp_groups, domain))


members_at_offset = Memo(_count_members_at_offset, maxsize=131072)


def placement(gpus: int, p: int, c: int, e: int, f_e: int, f_d: int, domain: int) -> Placement:
    """Members per domain of each group kind under the tp-cp-ep-dp-pp order."""
    stage = gpus // p
    # Stages are congruent blocks whose offsets against the domain grid differ: the worst offset sets each group.
    per_offset = [members_at_offset(stage, c, e, f_e, f_d, domain, base)
                  for base in sorted({(s * stage) % domain for s in range(p)})]
    ep_a, dense_a, exp_a = (min(m[i] for m in per_offset) for i in range(3))
    # Hop r -> r+1 (mod p): each stage-local rank's domain before and after.
    dom = np.arange(gpus).reshape(p, stage) // domain
    hops = [bool(h) for h in np.all(dom == np.roll(dom, -1, axis=0), axis=1)]
    replica = np.arange(p) * stage
    cp_groups = np.arange(gpus).reshape(-1, c)
    cp_in = bool(np.all(cp_groups // domain == (cp_groups[:, :1] // domain)))
    return Placement(ep_a, dense_a, exp_a, tuple(hops), bool(np.all(replica // domain == replica[0] // domain)),
                     cp_in)


def ep_remote_copies(top_k: int, e: int) -> float:
    """Remote GPU copies per token, one copy per assignment: k (1 - 1/e) (seed 002: 15.75 at EP64)."""
    return top_k * (1 - 1 / e)


def ep_cross_domain_copies(top_k: int, e: int, a: int) -> float:
    """Copies per token that leave the NVLink domain: k (1 - a/e)."""
    return top_k * (1 - a / e)


def ep_hit_probability(num_experts: int, top_k: int, e: int) -> float:
    """P(a given EP rank holds at least one of a token's k experts), uniform top-k without replacement:
    1 - C(E - E/e, k) / C(E, k)."""
    return 1 - comb(num_experts - num_experts // e, top_k) / comb(num_experts, top_k)


def ep_remote_copies_dedup(num_experts: int, top_k: int, e: int) -> float:
    """Expected distinct remote ranks per token: (e - 1)(1 - C(E - E/e, k)/C(E, k)) (seed 002: 14.14)."""
    return (e - 1) * ep_hit_probability(num_experts, top_k, e)


def ep_cross_domain_copies_dedup(num_experts: int, top_k: int, e: int, a: int) -> float:
    """Expected distinct destination ranks outside the domain: (e - a) * hit probability."""
    return (e - a) * ep_hit_probability(num_experts, top_k, e)


def ep_payload_bytes(exchanges: int, tokens: int, width: int, copies: float, bytes_per_value: int = 2) -> float:
    """exchanges * T * latent width * 2 * copies (seed 002)."""
    return exchanges * tokens * width * bytes_per_value * copies


def ep_exchanges(full_recompute: bool, dispatch_recompute: bool) -> int:
    """Payload exchanges per MoE layer per microbatch: 4 (dispatch, combine and their transposes),
    6 with full checkpointing (the route is traversed again); dispatch recompute replays one dispatch."""
    if full_recompute:
        return 6
    return 5 if dispatch_recompute else 4


def routing_map_bytes(tokens: int, num_experts: int) -> int:
    """HybridEP Boolean routing map [T, E], one byte per entry (seed 002: 3.5 MiB at T = 4096)."""
    return tokens * num_experts


def routing_map_allgathers_per_layer(full_recompute: bool) -> int:
    """Routing-map all-gathers per MoE layer per microbatch: the original and the recomputed forward."""
    return 2 if full_recompute else 1


def hierarchical_split(total_bytes: float, n: int, a: int) -> tuple[float, float]:
    """(NVLink, NIC) bytes per rank of an all-gather or reduce-scatter of S bytes over n ranks, a of them per
    domain: NVLink S(1 - 1/a); NIC (S/a)(1 - a/n), the per-rank share of a domain's one import (seed 002)."""
    if n <= 1:
        return 0.0, 0.0
    a = min(a, n)
    return total_bytes * (1 - 1 / a), (total_bytes / a) * (1 - a / n)


def attn_res_packet_bytes(residual_streams: int | np.ndarray, tokens: int, hidden: int) -> int | np.ndarray:
    """PP packet: (1 hidden + R residual) BF16 [T, d] streams (seed 002; seed 003's first boundary)."""
    return (1 + residual_streams) * tokens * hidden * 2


# ------------------------------------------------------------------------------------- context parallelism
# Sources: NVIDIA/TransformerEngine@d0067d0da6cb01811b8072a7d304f0e00344ce2b,
# transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py (AttnFuncWithCPAndKVP2P, the
# default `--cp-comm-type p2p` of NVIDIA/Megatron-LM@d98e8a64 transformer_config.py); fla-org/flash-linear-attention
# @bc3b101d fla/ops/cp/chunk_delta_h.py (KCP state passing for KDA / GDN).


def cp_mla_kv_bytes_per_token(heads: int, qk_head_dim: int, v_head_dim: int, bytes_per_value: int = 2) -> int:
    """Per-head K and V of one token as TE's ring moves them: h (d_qk + d_v) b. Megatron up-projects MLA before
    core attention (rope part of K copied to every head), so the ring carries full heads, not the latent."""
    return heads * (qk_head_dim + v_head_dim) * bytes_per_value


def cp_mla_ring_bytes(cp: int, tokens: int, kv_bytes_per_token: int) -> float:
    """Bytes a rank sends per MLA layer per microbatch on TE's p2p KV ring, forward + backward: the forward sends
    its KV chunk C - 1 times, the backward sends KV then (KV, dKV) pairs then dKV: 3 (C - 1) T h (d_qk + d_v) b."""
    return 3.0 * (cp - 1) * tokens * kv_bytes_per_token if cp > 1 else 0.0


def cp_mla_ring_buffer_bytes(cp: int, tokens: int, kv_bytes_per_token: int) -> float:
    """TE's ring buffers during an MLA layer's backward: two alternating (KV, dKV) receive buffers of the local
    chunk, 4 T h (d_qk + d_v) b (the forward's two KV buffers are smaller)."""
    return 4.0 * tokens * kv_bytes_per_token if cp > 1 else 0.0


def cp_kda_state_bytes(heads: int, head_dim_k: int, head_dim_v: int) -> int:
    """FLA KCP's per-rank exchange of one KDA layer: one FP32 [H, K, K + V] tensor (the local chunk's state and
    transition), 4 H K (K + V) bytes."""
    return 4 * heads * head_dim_k * (head_dim_k + head_dim_v)


def cp_kda_allgather_bytes(cp: int, state_bytes: int) -> float:
    """Bytes a rank receives per KDA layer per microbatch: a synchronous all-gather of the state tensor in the
    forward and another in the backward, 2 (C - 1) x state bytes, independent of T."""
    return 2.0 * (cp - 1) * state_bytes if cp > 1 else 0.0


def cp_overlap_min_tokens(bf16_flops_per_s: float, link_bytes_per_s: float) -> float:
    """Local tokens at which an off-diagonal ring step's attention (T^2 h (d_qk + d_v) FLOP, a T x T/2 block fwd)
    hides its KV transfer (T h (d_qk + d_v) 2 B): T >= 2 F / B; h and d cancel (TE's causal step shapes)."""
    return 2.0 * bf16_flops_per_s / link_bytes_per_s
