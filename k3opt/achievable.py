"""The achievable step time: the same roofline-plus-bubble form as the peak step time, with the achievable
ceilings of k3opt.rates (an empirical roofline), and the overlap rules of the rates file.

    stage_r  = max(tensor + vector, HBM, NVLink, NIC, host link; at achievable rates) + exposed EP all-to-all

`vector` is the memory-bound kernels between the GEMMs (norms, activations, permutes, quantize): they run on
the GEMMs' stream, one after another, so their time adds to the tensor-core time instead of hiding under it.
    step     = slots x max_r stage_r + update compute + max(0, update communication - overlap window)

The EP all-to-all (dispatch + combine) is exposed on its own microbatch's critical path unless the layout turns
an overlap schedule on (`ep_overlap`); the NVLink- and NIC-side parts run concurrently (max). Overlapped, it
still holds the SMs its bandwidth was measured with, and the compute beside it runs on the rest. Data-parallel
communication of the update hides under `dp_overlap_microbatches` stage-microbatches of compute (Megatron
overlap_grad_reduce / overlap_param_gather); pipeline send/recv is on its own stream, inside the max.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3opt.coefficients import Coefficients, balance_moved_bytes
from k3opt.rates import RatesSpec, rates_for
from k3opt.specs import ClusterSpec

OVERLAPPED = ("tensor", "hbm", "nvlink", "nic", "host_link")


def _sm_share(cf: Coefficients, rates: RatesSpec, cluster: ClusterSpec | None) -> float:
    """Share of the SMs an overlapped all-to-all takes from compute: dispatcher SMs / GPU SMs (0 if unknown)."""
    if cluster is None or not cluster.sm_count:
        return 0.0
    from k3opt.coefficients import DEFAULT_DISPATCHER

    return min(1.0, rates.a2a_sms(cf.shape.dispatcher or DEFAULT_DISPATCHER) / cluster.sm_count)


@dataclass(frozen=True)
class AchievableStep:
    step_time_s: float
    stage_time_s: float
    slowest_rank: int
    binding: str
    exposed_ep_s: float
    """Exposed EP all-to-all per stage-microbatch on the slowest rank."""
    update_time_s: float
    rank_time_s: tuple[dict[str, float], ...]
    rates: str


def _chunk_indices(split: list[int] | tuple[int, ...], j: int, n_layers: int) -> list[int]:
    edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
    idx = list(range(int(edges[j]), int(edges[j + 1])))
    if j == 0:
        idx.append(n_layers)
    if j == len(split) - 1:
        idx.append(n_layers + 1)
    return idx


def rank_achievable_time(cf: Coefficients, split: list[int] | tuple[int, ...], r: int) -> dict[str, float]:
    """Seconds per stage-microbatch of physical rank r on each resource at the achievable rates, EP apart."""
    sh = cf.shape
    p, k = sh.pp, sh.chunks
    mine = list(range(r, k, p))
    idx = [i for j in mine for i in _chunk_indices(split, j, cf.n_layers)]
    out = {res: float(arr[idx].sum()) for res, arr in cf.achievable.items()}
    # Pipeline packets (1 + AttnRes residual streams) x BF16 [T, d], in and out of each chunk, as in the ledger.
    edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
    closes_cum = np.concatenate([[0.0], np.cumsum(cf.closes[: cf.n_layers])])
    for j in mine:
        s, e = int(edges[j]), int(edges[j + 1])
        if j > 0:
            hop = (r - 1) % p
            out["nvlink" if cf.pp_on_nvlink[hop] else "nic"] += (
                (1 + closes_cum[s]) * cf.stream_bytes * cf.pp_seconds_per_byte_achievable[hop])
        if j < k - 1:
            out["nvlink" if cf.pp_on_nvlink[r] else "nic"] += (
                (1 + closes_cum[e]) * cf.stream_bytes * cf.pp_seconds_per_byte_achievable[r])
    if cf.balanced_inflight is not None:
        n_peak = max(sum(c) for c in cf.compositions[r])
        if n_peak > cf.balanced_inflight:
            act = sum(float(cf.act[_chunk_indices(split, j, cf.n_layers)].sum()) for j in mine)
            peak_rate = 1 / cf.balance_seconds_per_byte
            out[cf.balance_resource] += balance_moved_bytes(act, n_peak, cf.balanced_inflight) / peak_rate
    return out


def achievable_step(cf: Coefficients, split: list[int] | tuple[int, ...], rates: RatesSpec,
                    cluster: ClusterSpec | None = None) -> AchievableStep:
    """Roofline plus bubble at the achievable ceilings (module docstring)."""
    sh = cf.shape
    share = _sm_share(cf, rates, cluster)
    per_rank = tuple(rank_achievable_time(cf, split, r) for r in range(sh.pp))
    stages = []
    for t in per_rank:
        ep = max(t.get("ep_nvlink", 0.0), t.get("ep_nic", 0.0))
        exposed = ep if (rates.overlap.ep_exposed_without_overlap and not sh.ep_overlap) else 0.0
        inner = {res: t[res] for res in OVERLAPPED}
        if rates.overlap.vector_serial_with_tensor:
            inner["tensor"] += t.get("vector", 0.0)
        else:
            inner["vector"] = t.get("vector", 0.0)
        if not exposed:
            # Overlapped: the all-to-all hides under compute but holds its SMs meanwhile, so the compute it
            # overlaps runs on the rest: + share x all-to-all time (the measured bandwidth's SM budget).
            inner["tensor"] += share * ep
            inner["ep_all_to_all"] = ep
        binding = max(inner, key=inner.get)
        if exposed > inner[binding]:
            binding = "ep_all_to_all (exposed)"
        stages.append((max(inner.values()) + exposed, binding, exposed))
    slowest = max(range(sh.pp), key=lambda r: stages[r][0])
    stage, binding, exposed = stages[slowest]
    idx_all = np.arange(cf.n_layers + 2)
    update_compute = update_comm = 0.0
    for r in range(sh.pp):
        idx = [i for j in range(r, sh.chunks, sh.pp) for i in _chunk_indices(split, j, cf.n_layers)]
        u = {res: float(arr[idx_all[idx]].sum()) for res, arr in cf.update_achievable.items()}
        update_compute = max(update_compute, u["tensor"], u["hbm"], u["host_link"])
        update_comm = max(update_comm, u["nvlink"], u["nic"])
    hidden = rates.overlap.dp_overlap_microbatches * stage
    update = update_compute + max(0.0, update_comm - hidden)
    return AchievableStep(
        step_time_s=cf.slots * stage + update, stage_time_s=stage, slowest_rank=slowest, binding=binding,
        exposed_ep_s=exposed, update_time_s=update, rank_time_s=per_rank, rates=rates.name,
    )


def achievable_for(cf: Coefficients, split: list[int] | tuple[int, ...], cluster: ClusterSpec,
                   rates: RatesSpec | None = None) -> AchievableStep | None:
    """The achievable step of a layout, or None when the cluster has no rates file."""
    rates = rates if rates is not None else rates_for(cluster)
    if rates is None or not cf.achievable:
        return None
    return achievable_step(cf, split, rates, cluster)


@dataclass(frozen=True)
class SearchArrays:
    """Per-layer (length L + 2) seconds per microbatch for a search that ranks by the achievable step time:

        stage_r   = max_res sum_{i in r} overlapped[res][i] + exposed_r
        exposed_r = max(sum_{i in r} ep_nvlink[i], sum_{i in r} ep_nic[i])  if ep_exposed else 0

    where `overlapped` already folds the memory-bound
    kernels into `tensor` and, under an EP overlap schedule, the SM share of the all-to-all into `tensor` and the
    all-to-all itself into its own `ep_all_to_all` resource. The PP packets at the achievable rates add to
    `nvlink` / `nic` per rank as in rank_achievable_time. Every term is a linear sum over the rank's layers, so a
    CP-SAT model builds it with the same AddMaxEquality constraints as the peak roofline."""

    overlapped: dict[str, np.ndarray]
    ep_nvlink: np.ndarray
    ep_nic: np.ndarray
    ep_exposed: bool


def search_arrays(cf: Coefficients, cluster: ClusterSpec, rates: RatesSpec | None = None) -> SearchArrays | None:
    """What a search needs to rank layouts of one shape by the achievable step time (None without rates)."""
    rates = rates if rates is not None else rates_for(cluster)
    if rates is None or not cf.achievable:
        return None
    a = cf.achievable
    exposed = rates.overlap.ep_exposed_without_overlap and not cf.shape.ep_overlap
    tensor = a["tensor"] + (a["vector"] if rates.overlap.vector_serial_with_tensor else 0.0)
    over = {res: a[res].copy() for res in OVERLAPPED}
    over["tensor"] = tensor
    if not rates.overlap.vector_serial_with_tensor:
        over["vector"] = a["vector"].copy()
    if not exposed:
        # The SM share is charged on the per-layer max of the two sides: equal to the rank-level charge when one
        # side is empty (EP inside a domain), an upper bound otherwise.
        share = _sm_share(cf, rates, cluster)
        over["ep_nvlink"], over["ep_nic"] = a["ep_nvlink"].copy(), a["ep_nic"].copy()
        over["tensor"] = tensor + share * np.maximum(a["ep_nvlink"], a["ep_nic"])
    return SearchArrays(overlapped=over, ep_nvlink=a["ep_nvlink"], ep_nic=a["ep_nic"], ep_exposed=exposed)
