"""Memory a rank holds beyond the ledger's live tensors, itemized from the layout and a runtime preset.

Three measurement kinds per rank (torch.cuda.max_memory_allocated, max_memory_reserved, device-used):

    allocated = ledger peak + workspaces in the caching allocator (cuBLAS, TransformerEngine)
    reserved  = allocated x (1 + slack)                      (slack: a runtime field, public reserved/allocated)
    device    = reserved + outside the allocator             (CUDA context, NCCL / NVLS buffers, HybridEP buffers)

The HBM constraint is device <= HBM - reserve. `allocated_budget_bytes` turns it around for the search: the
ledger peak a rank may reach, floor((HBM - reserve - outside) / (1 + slack)) - workspaces. Without a runtime
(None) every item is zero and the budget is HBM - reserve, the ledger-only accounting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3opt.cost import comm
from k3opt.cost.coefficients import Shape
from k3opt.cost.coefficients import placement_of as cached_placement
from k3opt.inputs.memo import Memo
from k3opt.inputs.placement import domain_block
from k3opt.inputs.specs import GIB, ClusterSpec, ModelSpec, RuntimeSpec


@dataclass(frozen=True)
class MemoryItem:
    key: str
    bytes: int
    where: str  # "allocator" (inside allocated) | "outside" (device only)
    formula: str


def _domain(shape: Shape, cluster: ClusterSpec) -> int:
    """GPUs of one NVLink domain the job uses (the placement's block size)."""
    return domain_block(shape.domain_gpus_used, cluster.nvlink_domain_gpus)


def placement_of(shape: Shape, cluster: ClusterSpec) -> comm.Placement:
    # The cost model's cached placement: the search asks for every frame's budget, rank by rank.
    return cached_placement(shape.gpus, shape.pp, shape.cp, shape.ep, shape.expert_fsdp, shape.dense_fsdp,
                            _domain(shape, cluster))


def _count_stage_members(gpus: int, p: int, c: int, e: int, f_e: int, f_d: int, domain: int, s: int
                         ) -> tuple[int, int, int]:
    """(EP, dense shard, expert shard) members per NVLink domain of PP stage `s` alone, under the tp-cp-ep-dp-pp
    order with domains as consecutive blocks (comm.placement keeps the worst stage for the step time)."""
    stage = gpus // p
    return comm.members_at_offset(stage, c, e, f_e, f_d, domain, (s * stage) % domain)


_stage_members = Memo(_count_stage_members, maxsize=65536)


def _rank_placement(shape: Shape, cluster: ClusterSpec, rank: int) -> comm.Placement:
    """The placement as PP rank `rank`'s own communicators see it: a rank's buffers depend on where its own
    groups sit (a stage inside one domain gets NVLS and an all-local HybridEP), not on the worst stage's."""
    pl = placement_of(shape, cluster)
    a, d, x = _stage_members(shape.gpus, shape.pp, shape.cp, shape.ep, shape.expert_fsdp, shape.dense_fsdp,
                             _domain(shape, cluster), rank)
    return replace(pl, ep_local=a, dense_fsdp_local=d, expert_fsdp_local=x)


def _pp_peers(shape: Shape, rank: int, pl: comm.Placement) -> list[bool]:
    """PP send/recv peers of `rank`, each True when the hop stays inside an NVLink domain. Interleaving (v > 1)
    wraps the last rank back to the first, so every rank then has two neighbours."""
    p = shape.pp
    if p == 1:
        return []
    peers = []
    if rank > 0 or shape.vp > 1:
        peers.append(pl.pp_hop_in_domain[(rank - 1) % p])
    if (rank < p - 1 or shape.vp > 1) and not (p == 2 and peers):
        peers.append(pl.pp_hop_in_domain[rank])
    return peers


def runtime_items(shape: Shape, model: ModelSpec, cluster: ClusterSpec, runtime: RuntimeSpec | None,
                  rank: int, has_moe: bool = True) -> tuple[MemoryItem, ...]:
    """The itemized memory of PP rank `rank` outside the ledger (empty without a runtime). `has_moe`: the rank
    holds MoE layers (EP communicators and HybridEP buffers exist); the budget assumes it does."""
    if runtime is None:
        return ()
    rt = runtime
    items: list[MemoryItem] = []
    # Inside the caching allocator.
    items.append(MemoryItem("cublas_workspace", rt.cublas_handles * rt.cublas_workspace_bytes, "allocator",
                            f"{rt.cublas_handles} (handle, stream) x {rt.cublas_workspace_bytes:,} B"))
    items.append(MemoryItem("te_workspaces", rt.te_workspaces * rt.te_workspace_bytes, "allocator",
                            f"{rt.te_workspaces} TransformerEngine GEMM workspaces x {rt.te_workspace_bytes:,} B"))
    # Outside it.
    items.append(MemoryItem("cuda_context", rt.cuda_context_bytes, "outside", "CUDA context and kernel images"))

    pl = _rank_placement(shape, cluster, rank)
    conn = rt.nccl_connection_bytes
    coll = rt.nccl_coll_channels * conn
    nvls = rt.nvls_channels * 2 * rt.nvls_chunk_bytes * rt.nccl_steps * rt.nvls_heads
    stage = shape.gpus // shape.pp
    e, fe, fd, c = shape.ep, shape.expert_fsdp, shape.dense_fsdp, shape.cp
    # Collective communicators this rank joins: (name, size, all members in one NVLink domain).
    groups: list[tuple[str, int, bool]] = [
        ("dense shard", fd, pl.dense_fsdp_local == fd),
        ("dense replicate", stage // fd, False),
    ]
    if model.moe is not None and has_moe:
        groups += [("expert shard", fe, pl.expert_fsdp_local == fe),
                   ("expert replicate", stage // (e * fe), False),
                   ("EP (routing map)", e, pl.ep_local == e)]
    # The default (world) process group: barriers, and Megatron's distributed optimizer reduces the gradient norm
    # and zero count over every rank each step (MLM distrib_optimizer.py get_grad_stats_parallel_group).
    groups.append(("world (gradient norm)", shape.gpus, shape.gpus <= _domain(shape, cluster)))
    groups = [g for g in groups if g[1] > 1]
    n_coll = len(groups)
    n_nvls = sum(1 for _, size, local in groups if local and size > 2) if rt.nccl_nvls_enable else 0
    names = ", ".join(f"{n} {s}" for n, s, _ in groups) or "none"
    items.append(MemoryItem(
        "nccl_collectives", n_coll * coll, "outside",
        f"{n_coll} communicators ({names}) x {rt.nccl_coll_channels} channels x {conn:,} B per connection "
        f"(Simple + LL + LL128, rounded to {rt.nccl_alloc_granularity_bytes:,} B)"))
    items.append(MemoryItem(
        "nccl_nvls", n_nvls * nvls, "outside",
        f"{n_nvls} communicators inside one NVLink domain x {rt.nvls_channels} channels x 2 x "
        f"{rt.nvls_chunk_bytes:,} B x {rt.nccl_steps} steps x {rt.nvls_heads} heads"
        + ("" if rt.nccl_nvls_enable else " (NCCL_NVLS_ENABLE=0)")))

    nvl_buf = rt.nccl_p2p_channels_per_peer * rt.nccl_p2p_chunk_bytes * rt.nccl_steps
    net_buf = rt.nccl_p2p_channels_per_net_peer * rt.nccl_p2p_net_chunk_bytes * rt.nccl_steps
    peers = _pp_peers(shape, rank, pl)
    # TE's CP ring: the previous and the next CP rank; CP is innermost in the rank order, so inside a domain
    # unless the CP group is larger than one.
    cp_peers = [c <= _domain(shape, cluster)] * min(c - 1, 2)
    ep_peers: list[bool] = []
    if model.moe is not None and has_moe and e > 1 and not rt.hybridep:
        ep_peers = [True] * (pl.ep_local - 1) + [False] * (e - pl.ep_local)
    all_peers = peers + cp_peers + ep_peers
    p2p = sum(nvl_buf if local else net_buf for local in all_peers)
    items.append(MemoryItem(
        "nccl_p2p", p2p, "outside",
        f"send/recv peers: {len(peers)} PP, {len(cp_peers)} CP, {len(ep_peers)} EP; per NVLink peer "
        f"{rt.nccl_p2p_channels_per_peer} channels x {rt.nccl_p2p_chunk_bytes:,} B x {rt.nccl_steps} steps, per "
        f"network peer {rt.nccl_p2p_channels_per_net_peer} x {rt.nccl_p2p_net_chunk_bytes:,} B x {rt.nccl_steps}"))

    hep = 0
    hep_formula = "no EP all-to-all on this rank"
    if model.moe is not None and has_moe and e > 1 and rt.hybridep:
        m = model.moe
        a = pl.ep_local
        max_tokens = shape.tokens * a * (e // a)
        tokens = max_tokens * model.dispatch_width * rt.hybridep_token_bytes
        probs = max_tokens * (m.num_experts // e) * a * rt.hybridep_prob_bytes
        hep = tokens + probs
        hep_formula = (f"max tokens {shape.tokens} x {a} EP ranks per domain x {e // a} domains = {max_tokens:,}; "
                       f"token buffer x {model.dispatch_width} x {rt.hybridep_token_bytes} B + probs x "
                       f"({m.num_experts // e} experts x {a} ranks) x {rt.hybridep_prob_bytes} B")
    items.append(MemoryItem("hybridep_buffers", hep, "outside", hep_formula))
    return tuple(items)


def allocator_bytes(items: tuple[MemoryItem, ...]) -> int:
    return sum(i.bytes for i in items if i.where == "allocator")


def outside_bytes(items: tuple[MemoryItem, ...]) -> int:
    return sum(i.bytes for i in items if i.where == "outside")


def kinds(ledger_peak: int, items: tuple[MemoryItem, ...], runtime: RuntimeSpec | None) -> tuple[int, int, int]:
    """(allocated, reserved, device) bytes of a rank whose ledger peak is `ledger_peak`."""
    allocated = ledger_peak + allocator_bytes(items)
    slack = runtime.slack if runtime is not None else 0.0
    reserved = allocated + int(round(allocated * slack))
    return allocated, reserved, reserved + outside_bytes(items)


def allocated_budgets_bytes(shape: Shape, model: ModelSpec, cluster: ClusterSpec, reserve_gib: float,
                            runtime: RuntimeSpec | None = None) -> list[int]:
    """Per PP rank: the ledger peak (live tensors as the ledger counts them) that keeps the rank's device peak
    under HBM - reserve: floor((HBM - reserve - outside) / (1 + slack)) - workspaces."""
    cap = cluster.hbm_bytes - int(round(reserve_gib * GIB))
    slack = runtime.slack if runtime is not None else 0.0
    out = []
    pl = placement_of(shape, cluster) if runtime is not None else None
    by_peers: dict[tuple, int] = {}
    for r in range(shape.pp):
        # Ranks differ only by their PP neighbours and their groups' members per domain: itemize and size the
        # budget once per distinct pattern (the search asks for thousands of shapes' budgets, up to PP 32 each).
        sig = ((tuple(_pp_peers(shape, r, pl)), _rank_placement(shape, cluster, r)) if pl is not None else ())
        if sig not in by_peers:
            items = runtime_items(shape, model, cluster, runtime, r)
            budget = int((cap - outside_bytes(items)) // (1 + slack)) - allocator_bytes(items)
            # Integer rounding of reserved = allocated x (1 + slack) can add one byte; step down until it fits.
            while budget > 0 and kinds(budget, items, runtime)[2] > cap:
                budget -= 1
            by_peers[sig] = budget
        out.append(by_peers[sig])
    return out


def allocated_budget_bytes(shape: Shape, model: ModelSpec, cluster: ClusterSpec, reserve_gib: float,
                           runtime: RuntimeSpec | None = None) -> int:
    """The ledger peak every PP rank may reach (the minimum over ranks of `allocated_budgets_bytes`; ranks
    differ only by their PP neighbours and their groups' placement across NVLink domains). This is the search's
    HBM line for the ledger."""
    return min(allocated_budgets_bytes(shape, model, cluster, reserve_gib, runtime))
