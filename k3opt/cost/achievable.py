"""The achievable step time: the same roofline-plus-bubble form as the peak step time, with the achievable
ceilings of k3opt.inputs.rates (an empirical roofline), and the overlap rules of the rates file.

    stage_r  = max(tensor + vector, HBM, NVLink, NIC, host link; at achievable rates) + exposed EP all-to-all

`vector` is the memory-bound kernels between the GEMMs (norms, activations, permutes, quantize): they run on
the GEMMs' stream, one after another, so their time adds to the tensor-core time instead of hiding under it.
    step     = slots x max_r stage_r + update compute + max(0, update communication - overlap window)
               (+ under an EP overlap schedule, the exposed all-to-all of its unpaired microbatches)

The EP all-to-all (dispatch + combine) is exposed on its own microbatch's critical path unless the layout turns
an overlap schedule on (`ep_overlap`); the NVLink- and NIC-side parts of one layer's all-to-all run concurrently
(max per layer), the layers one after another (sum). Overlapped, it
still holds the SMs its bandwidth was measured with, and the compute beside it runs on the rest; with the rates
file's `ep_overlap_stages`, each exchange hides only under the compute Megatron's combined 1F1B runs beside it, by
its streams' order and dependencies (with `delay_wgrad_compute`, the experts' weight gradients later), and the
excess adds to the compute path (ep_overlap_stage_exposed). Data-parallel
communication of the update hides under `dp_overlap_microbatches` stage-microbatches of compute (Megatron
overlap_grad_reduce / overlap_param_gather); pipeline send/recv is on its own stream, inside the max.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from k3opt.cost import comm
from k3opt.cost.coefficients import DEFAULT_DISPATCHER, Coefficients, balance_moved_bytes, forward_backward
from k3opt.cost.ledger import peak_inflight, pp_packet_bytes
from k3opt.cost.schedule import chunk_times, ep_overlap_unpaired, replay_makespan
from k3opt.inputs.rates import RatesSpec, rates_for
from k3opt.inputs.specs import ClusterSpec, Recompute

OVERLAPPED = ("tensor", "hbm", "nvlink", "nic", "host_link")


def _sm_share(cf: Coefficients, rates: RatesSpec, cluster: ClusterSpec | None) -> float:
    """Share of the SMs an overlapped all-to-all takes from compute: dispatcher SMs / GPU SMs (0 if unknown)."""
    if cluster is None or not cluster.sm_count:
        return 0.0

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
    update_comm_exposed_s: float = 0.0
    """The update's communication beyond what hides under `dp_overlap_microbatches` stage-microbatches."""
    unpaired_ep_s: float = 0.0
    """Under an EP overlap schedule: the exposed all-to-all of the microbatches run without a partner."""
    schedule_step_time_s: float = 0.0
    """The pipeline priced by its schedule at the achievable rates: the replayed makespan
    (`schedule.replay_makespan`) over each chunk's share of its rank's achievable stage time
    (`schedule.chunk_times`), plus the update and the unpaired all-to-all."""
    chunk_s: tuple[tuple[float, float], ...] = ()
    """(forward, backward) seconds per microbatch of every global chunk that replay runs."""
    stage_s: tuple[dict[str, float], ...] = ()
    """Per rank: seconds per stage-microbatch on each resource at the achievable rates, its exposed all-to-all on
    the resource it rides (the stage time is the largest)."""
    stage_binding: tuple[str, ...] = ()
    """Per rank: the resource that sets its stage time, or "ep_all_to_all (exposed)" when the exposed all-to-all is
    the larger part of it."""
    stage_exposed_ep_s: tuple[float, ...] = ()


TIE_ROUNDING = 1e-12
"""Relative: stage times this close to the largest are equal loads up to the rounding of their sums (equal layers
on the middle ranks), and the slowest rank reported is the lowest of them."""


def slowest_index(stages: list[float]) -> int:
    """The slowest rank: the lowest-numbered one within TIE_ROUNDING of the largest stage time, so that the rank
    reported does not hinge on the order the sums were taken in."""
    top = max(stages)
    return next(r for r, t in enumerate(stages) if t >= top * (1 - TIE_ROUNDING))


def _chunk_edges(split: list[int] | tuple[int, ...]) -> list[int]:
    """Where each chunk's layers start, then the layer count: [0, s_0, s_0 + s_1, ...]."""
    return [0, *itertools.accumulate(int(s) for s in split)]


def _chunk_indices(split: list[int] | tuple[int, ...], j: int, n_layers: int,
                   edges: list[int] | None = None) -> list[int]:
    """Chunk j's layers, with the first edge (index n_layers) on the first chunk and the last (n_layers + 1) on the
    last. `edges`: _chunk_edges(split), when the caller has it."""
    edges = edges if edges is not None else _chunk_edges(split)
    idx = list(range(edges[j], edges[j + 1]))
    if j == 0:
        idx.append(n_layers)
    if j == len(split) - 1:
        idx.append(n_layers + 1)
    return idx


def rank_indices(split: list[int] | tuple[int, ...], r: int, p: int, n_layers: int,
                  edges: list[int] | None = None) -> np.ndarray:
    """The layers and edges of physical rank r's chunks r, r + p, ... (what its sums run over), as an index array."""
    edges = edges if edges is not None else _chunk_edges(split)
    return np.array([i for j in range(r, len(split), p) for i in _chunk_indices(split, j, n_layers, edges)],
                    dtype=np.intp)


def chunk_rows(split: list[int] | tuple[int, ...], chunks: list[int], n_layers: int) -> np.ndarray:
    """One 0/1 row per chunk of `chunks` over the per-layer arrays (the layers, then the two edges), ones where
    `_chunk_indices` puts the chunk: rows @ arr gives every chunk's sum of arr in one product."""
    edges = _chunk_edges(split)
    rows = np.zeros((len(chunks), n_layers + 2))
    for i, j in enumerate(chunks):
        rows[i, _chunk_indices(split, j, n_layers, edges)] = 1.0
    return rows


def chunk_work(cf: Coefficients, arrays: dict[str, np.ndarray], split: list[int] | tuple[int, ...]) -> np.ndarray:
    """Each chunk's busiest-resource seconds over `arrays` (per-layer seconds by resource, the edges on the first
    and last chunk): the shares by which `schedule.chunk_times` divides its rank's stage for the replay."""
    rows = chunk_rows(split, list(range(len(split))), cf.n_layers)
    return np.max([rows @ arr for arr in arrays.values()], axis=0)


def rank_achievable_time(cf: Coefficients, split: list[int] | tuple[int, ...], r: int) -> dict[str, float]:
    """Seconds per stage-microbatch of physical rank r on each resource at the achievable rates, EP apart."""
    return rank_sums(cf, cf.achievable, cf.pp_seconds_per_byte_achievable, split, r)


def rank_packets(cf: Coefficients, r: int, chunks: Iterable[int]) -> list[tuple[int, int, str]]:
    """The PP packets rank r receives and sends per microbatch for its global chunks `chunks`, as (boundary, hop,
    link): in before each chunk j > 0 (boundary j, from rank r - 1 over hop r - 1), out after each j < K - 1
    (boundary j + 1, over its own hop r); the link is the hop's ('nvlink' or 'nic', `pp_on_nvlink`). The packet at
    boundary b carries the streams open after the first b chunks (`pp_packet_bytes`)."""
    p, k = cf.shape.pp, cf.shape.chunks
    out = []
    for j in chunks:
        for boundary, hop in ((j, (r - 1) % p), (j + 1, r)):
            if 0 < boundary < k:
                out.append((boundary, hop, "nvlink" if cf.pp_on_nvlink[hop] else "nic"))
    return out


def rank_sums(cf: Coefficients, arrays: dict[str, np.ndarray], pp_spb: tuple[float, ...],
               split: list[int] | tuple[int, ...], r: int) -> dict[str, float]:
    """Rank r's sums of per-layer seconds, plus its PP packets (at `pp_spb` seconds per byte) and the activation
    balancing traffic, on the resources they ride."""
    sh = cf.shape
    p, k = sh.pp, sh.chunks
    mine = list(range(r, k, p))
    edges = _chunk_edges(split)
    idx = rank_indices(split, r, p, cf.n_layers, edges)
    out = {res: float(arr[idx].sum()) for res, arr in arrays.items()}
    # Pipeline packets (1 + AttnRes residual streams) x BF16 [T, d], in and out of each chunk, as in the ledger.
    closes_cum = np.concatenate([[0.0], np.cumsum(cf.closes[: cf.n_layers])])
    for boundary, hop, link in rank_packets(cf, r, mine):
        out[link] += pp_packet_bytes(closes_cum[edges[boundary]], cf.stream_bytes) * pp_spb[hop]
    if cf.balanced_inflight is not None:
        n_peak = peak_inflight(cf.compositions[r])
        if n_peak > cf.balanced_inflight:
            act = float(cf.act[idx].sum())
            peak_rate = 1 / cf.balance_seconds_per_byte
            out[cf.balance_resource] += balance_moved_bytes(act, n_peak, cf.balanced_inflight) / peak_rate
    return out


UPDATE_COMPUTE = ("tensor", "hbm", "host_link")
UPDATE_COMM = ("nvlink", "nic")


@dataclass(frozen=True)
class RankingArrays:
    """Per-layer (length L + 2) seconds per microbatch whose per-rank sums give the achievable stage time in the
    roofline's form, stage_r = max_res sum_{i in r} time[res][i] (+ the PP packets on nvlink / nic):
        time[res] = overlapped[res] + exposed          (exposed EP)    or    overlapped[res]    (overlap schedule)

    `overlapped` folds the memory-bound kernels into `tensor` (serial with the GEMMs) and, under an EP overlap
    schedule, the dispatcher's SM share of the all-to-all into `tensor` and the all-to-all into its own `ep_nvlink`
    / `ep_nic` resources. `exposed` is each layer's dispatch + combine, max(NVLink side, NIC side): the two sides
    of one all-to-all run concurrently, the layers one after another. max_res(A_res) + E = max_res(A_res + E), so
    the exposed part rides every resource. `update` keeps the compute side of the update only (the communication
    side, `update_hidden`, hides under `dp_overlap_microbatches` x stage and adds only its excess)."""

    time: dict[str, np.ndarray]
    update: dict[str, np.ndarray]
    exposed: np.ndarray
    """Per layer: exposed EP all-to-all seconds (zeros under an overlap schedule)."""
    update_hidden: dict[str, np.ndarray]
    """The update's communication (NVLink, NIC): step += max(0, its worst rank sum - hidden_stages x stage)."""
    hidden_stages: float


def ranking_arrays(cf: Coefficients, rates: RatesSpec, cluster: ClusterSpec | None) -> RankingArrays:
    """The achievable arrays in the roofline's form (RankingArrays); cf must carry achievable arrays."""
    a = cf.achievable
    exposed_on = rates.overlap.ep_exposed_without_overlap and not cf.shape.ep_overlap
    serial = rates.overlap.vector_serial_with_tensor
    over = {res: a[res] for res in OVERLAPPED}
    over["tensor"] = a["tensor"] + a["vector"] if serial else a["tensor"]
    if not serial:
        over["vector"] = a["vector"]
    ep = np.maximum(a["ep_nvlink"], a["ep_nic"])
    if exposed_on:
        time = {res: arr + ep for res, arr in over.items()}
        exposed = ep
    else:
        # Overlapped: the all-to-all hides under compute but holds its SMs meanwhile, so the compute it overlaps
        # runs on the rest: + share x all-to-all time (the measured bandwidth's SM budget).
        share = _sm_share(cf, rates, cluster)
        tensor = over["tensor"] + share * ep
        if rates.overlap.ep_overlap_stages and cf.moe_compute_achievable.size:
            # Each exchange hides only under the compute it is paired with (the compute stream's path).
            full = cf.shape.recompute == Recompute.FULL
            mlp_vector = cf.moe_vector_achievable
            mlp_tensor = cf.moe_compute_achievable - mlp_vector
            pre_fwd, pre_bwd = forward_backward(a["tensor"] - mlp_tensor, a["vector"] - mlp_vector, full)
            mlp_fwd, mlp_bwd = forward_backward(mlp_tensor, mlp_vector, full)
            # The experts' weight-gradient GEMMs have their forward GEMMs' FLOPs (SC21 section 3.5).
            wgrad = (forward_backward(mlp_tensor, np.zeros_like(mlp_vector), False)[0]
                     if cf.shape.delay_wgrad_compute else None)
            tensor = tensor + ep_overlap_stage_exposed(pre_fwd, pre_bwd, mlp_fwd, mlp_bwd, ep, share,
                                                       _exchanges(cf), wgrad)
        time = dict(over, tensor=tensor, ep_nvlink=a["ep_nvlink"], ep_nic=a["ep_nic"])
        exposed = np.zeros_like(ep)
    update = {res: (arr if res in UPDATE_COMPUTE else np.zeros_like(arr))
              for res, arr in cf.update_achievable.items()}
    hidden = {res: cf.update_achievable[res] for res in UPDATE_COMM}
    return RankingArrays(time=time, update=update, exposed=exposed, update_hidden=hidden,
                         hidden_stages=rates.overlap.dp_overlap_microbatches)


def _exchanges(cf: Coefficients) -> int:
    """All-to-all payload exchanges per MoE layer per microbatch of the layout (comm.ep_exchanges)."""
    sh = cf.shape
    return comm.ep_exchanges(sh.recompute == Recompute.FULL, sh.toggles.dispatch_recompute)


def ep_overlap_stage_exposed(pre_fwd: np.ndarray, pre_bwd: np.ndarray, mlp_fwd: np.ndarray, mlp_bwd: np.ndarray,
                             ep: np.ndarray, share: float, exchanges: int,
                             mlp_wgrad: np.ndarray | None = None) -> np.ndarray:
    """Per layer, the all-to-all seconds an EP overlap schedule leaves exposed beyond its compute, as Megatron's
    combined 1F1B runs one layer's forward (microbatch i+1) beside one layer's backward (microbatch i) on two streams
    (NVIDIA/Megatron-LM@d98e8a64 megatron/core/models/common/model_chunk_schedule_plan.py,
    TransformerLayerSchedulePlan.run):
        comm stream:  combine bwd       | dispatch fwd -> dispatch bwd     | combine fwd
        comp stream:  pre-dispatch fwd  | mlp bwd -> mlp bwd dw -> mlp fwd | pre-dispatch bwd
    Each node waits for the previous node of its microbatch (one CUDA event per microbatch,
    pipeline_parallel/utils.py ScheduleNode) and for its stream: mlp bwd after combine bwd, dispatch fwd after
    pre-dispatch fwd, dispatch bwd after mlp bwd, mlp fwd after dispatch fwd, combine fwd after mlp fwd,
    pre-dispatch bwd after dispatch bwd. The next layer's first nodes wait for both of this layer's last ones (its
    combine fwd feeds the next pre-dispatch fwd, its pre-dispatch bwd the next combine bwd), so layers run one
    after another and the exposure is one layer's makespan less its compute. Without `delay_wgrad_compute` the
    experts' weight gradients run inside mlp bwd; with it (`mlp_wgrad`, their seconds, part of `mlp_bwd`) they run
    as mlp bwd dw, which records no event (models/common/utils.py backward_dw), so dispatch bwd waits for the data
    gradient only. Kept simple: the pre-dispatch block's own delayed weight gradients stay in its backward (its
    attention core has none to split out; this can only over-count), and the paired layers are taken alike
    (Megatron pairs forward layer i with backward layer n-1-i, possibly of another chunk, and runs the layers
    without a partner alone, model_chunk_schedule_plan.py L554-590).

    Each all-to-all holds `share` of the SMs (priced on the whole stage already), so it lasts (1 - share) c here,
    c = ep / x per exchange (x = 4: dispatch and combine, forward and backward; a replayed dispatch rides with the
    backward dispatch). Without the delay
        exposed = max(0, c - pre_fwd) + max(0, c - mlp_bwd) + max(0, (x-3) c - mlp_fwd) + max(0, c - pre_bwd)."""
    c = (1 - share) * ep / exchanges
    wgrad = np.zeros_like(ep) if mlp_wgrad is None else mlp_wgrad
    combine_bwd, pre_f = c, pre_fwd
    dgrad = np.maximum(pre_f, combine_bwd) + mlp_bwd - wgrad
    dispatch_fwd = np.maximum(combine_bwd, pre_f) + c
    mlp_f = np.maximum(dgrad + wgrad, dispatch_fwd) + mlp_fwd
    dispatch_bwd = np.maximum(dispatch_fwd, dgrad) + (exchanges - 3) * c
    combine_fwd = np.maximum(dispatch_bwd, mlp_f) + c
    pre_b = np.maximum(mlp_f, dispatch_bwd) + pre_bwd
    return np.maximum(0.0, np.maximum(combine_fwd, pre_b) - (pre_fwd + mlp_bwd + mlp_fwd + pre_bwd))


def ranking_view(cf: Coefficients, cluster: ClusterSpec, rates: RatesSpec | None = None) -> Coefficients:
    """The coefficients a search ranks by: the achievable arrays (RankingArrays) in the `time` / `update` /
    `pp_seconds_per_byte` fields and the update's communication in `update_hidden`, every memory array unchanged;
    `cf` itself without a rates file (the search then ranks by the peak roofline). A search's step on this view,
    slots x max_r stage_r + max_r update_r + max(0, max_r hidden_r - hidden_stages x stage), is achievable_step's
    (the search's bounds take its least over stages at or above theirs: `search.ranking.step_floor`). Under
    an EP overlap schedule (a layout's ep_overlap, or a job's) the view leaves out the unpaired microbatches'
    all-to-all (unpaired_ep_s), and is a lower bound."""
    rates = rates if rates is not None else rates_for(cluster)
    if rates is None or not cf.achievable:
        return cf
    ra = ranking_arrays(cf, rates, cluster)
    return with_fields(cf, time=ra.time, update=ra.update, pp_seconds_per_byte=cf.pp_seconds_per_byte_achievable,
                       update_hidden=ra.update_hidden, update_hidden_stages=ra.hidden_stages)


def with_fields(cf: Coefficients, **fields: object) -> Coefficients:
    """dataclasses.replace for Coefficients (a shallow copy with some fields rebound), without re-running the
    50-field __init__: the search makes one view per shape it prices."""
    unknown = fields.keys() - cf.__dataclass_fields__.keys()
    if unknown:
        raise TypeError(f"Coefficients has no field {sorted(unknown)}")
    out = object.__new__(type(cf))
    out.__dict__.update(cf.__dict__, **fields)
    return out


def achievable_step(cf: Coefficients, split: list[int] | tuple[int, ...], rates: RatesSpec,
                    cluster: ClusterSpec | None = None) -> AchievableStep:
    """Roofline plus bubble at the achievable ceilings (module docstring), summed from ranking_arrays."""
    sh = cf.shape
    ra = ranking_arrays(cf, rates, cluster)
    per_rank = tuple(rank_achievable_time(cf, split, r) for r in range(sh.pp))
    edges = _chunk_edges(split)
    rank_idx = [rank_indices(split, r, sh.pp, cf.n_layers, edges) for r in range(sh.pp)]
    stages = []
    for r in range(sh.pp):
        t = rank_sums(cf, ra.time, cf.pp_seconds_per_byte_achievable, split, r)
        idx = rank_idx[r]
        exposed = float(ra.exposed[idx].sum())
        binding = max(t, key=t.get)
        if exposed > t[binding] - exposed:
            binding = "ep_all_to_all (exposed)"
        stages.append((max(t.values()), binding, exposed, t))
    slowest = slowest_index([st[0] for st in stages])
    _, binding, exposed, _ = stages[slowest]
    stage = max(st[0] for st in stages)
    update_compute = update_comm = 0.0
    for r in range(sh.pp):
        idx = rank_idx[r]
        u = {res: float(arr[idx].sum()) for res, arr in cf.update_achievable.items()}
        update_compute = max(update_compute, *(u[res] for res in UPDATE_COMPUTE))
        update_comm = max(update_comm, *(u[res] for res in UPDATE_COMM))
    hidden = rates.overlap.dp_overlap_microbatches * stage
    comm_exposed = max(0.0, update_comm - hidden)
    update = update_compute + comm_exposed
    unpaired = unpaired_ep_s(cf, split, rates, cluster)
    fwd, bwd = chunk_times(chunk_work(cf, ra.time, split), [st[0] for st in stages], sh.pp,
                           sh.recompute == Recompute.FULL)
    replayed = replay_makespan(sh.pp, sh.vp, sh.microbatches, fwd, bwd)
    return AchievableStep(
        step_time_s=cf.slots * stage + update + unpaired, stage_time_s=stage, slowest_rank=slowest,
        binding=binding, exposed_ep_s=exposed, update_time_s=update, rank_time_s=per_rank, rates=rates.name,
        update_comm_exposed_s=comm_exposed, unpaired_ep_s=unpaired,
        schedule_step_time_s=replayed + update + unpaired,
        chunk_s=tuple(zip(fwd.tolist(), bwd.tolist(), strict=True)),
        stage_s=tuple(st[3] for st in stages), stage_binding=tuple(st[1] for st in stages),
        stage_exposed_ep_s=tuple(st[2] for st in stages),
    )


def unpaired_ep_s(cf: Coefficients, split: list[int] | tuple[int, ...], rates: RatesSpec,
                  cluster: ClusterSpec | None) -> float:
    """Under an EP overlap schedule, the all-to-all of the microbatches the schedule runs without a partner
    (schedule.ep_overlap_unpaired: the warmup forwards, the cooldown backwards) is exposed: per rank,
    (1 - SM share) x sum over those chunk passes of their all-to-all (forward: dispatch + combine, 2 of the
    `comm.ep_exchanges` payloads; backward: the rest), as they would cost beside compute; the slowest rank's adds
    to the step. 0 without an overlap schedule (then every all-to-all is exposed in the stage already)."""
    sh = cf.shape
    if not sh.ep_overlap or not rates.overlap.ep_exposed_without_overlap:
        return 0.0
    ep = np.maximum(cf.achievable["ep_nvlink"], cf.achievable["ep_nic"])
    exch = comm.ep_exchanges(sh.recompute == Recompute.FULL, sh.toggles.dispatch_recompute)
    fwd_share = 2 / exch
    keep = 1 - _sm_share(cf, rates, cluster)
    worst = 0.0
    edges = _chunk_edges(split)
    for r in range(sh.pp):
        chunk = [float(ep[_chunk_indices(split, r + k * sh.pp, cf.n_layers, edges)].sum()) for k in range(sh.vp)]
        fwd, bwd = ep_overlap_unpaired(sh.pp, sh.vp, sh.microbatches, r)
        worst = max(worst, keep * (fwd_share * sum(chunk[k] for k in fwd)
                                   + (1 - fwd_share) * sum(chunk[k] for k in bwd)))
    return worst


def achievable_for(cf: Coefficients, split: list[int] | tuple[int, ...], cluster: ClusterSpec,
                   rates: RatesSpec | None = None) -> AchievableStep | None:
    """The achievable step of a layout, or None when the cluster has no rates file."""
    rates = rates if rates is not None else rates_for(cluster)
    if rates is None or not cf.achievable:
        return None
    return achievable_step(cf, split, rates, cluster)
