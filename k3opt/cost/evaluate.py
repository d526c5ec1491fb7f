"""evaluate(): the per-rank memory ledger and the roofline-plus-bubble step time of one layout.

peak(r) = persistent(r) + max(activation-phase peak(r), optimizer-phase transient(r))   (spec section 2;
          + both under a full-iteration CUDA graph: ledger.rank_peak)
step    = (M + (p - 1)/v) * max_r t_r + max_r update_r, t_r = max over resources       (seed 002)

Every number is a sum of the per-layer coefficients in k3opt.cost.coefficients over the layout's split.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from k3opt.cost.achievable import achievable_for, chunk_rows, rank_indices, slowest_index
from k3opt.cost.coefficients import RESOURCES, Coefficients, Shape, balance_moved_bytes, coefficients, step_gather_bytes
from k3opt.cost.ledger import (
    ACTIVATION,
    LEDGER,
    OPTIMIZER,
    PERSISTENT,
    TERM_INFO,
    TERMS,
    Aggregate,
    Phase,
    TermDecl,
    activation_phase_bytes,
    balanced_scale,
    binding_activation_terms,
    optimizer_transient_bytes,
    peak_inflight,
    pp_packet_bytes,
    rank_peak,
)
from k3opt.cost.memory_outside import MemoryItem, kinds, runtime_items
from k3opt.cost.schedule import bubble_fraction, bubble_overhead, chunk_times, replay_makespan
from k3opt.cost.structure import ParamCounts, check_offload_modules
from k3opt.inputs.errors import LayoutError
from k3opt.inputs.placement import domain_block, domains_held
from k3opt.inputs.presets import load_cluster, load_model, load_runtime
from k3opt.inputs.specs import (
    GIB,
    NO_RUNTIME,
    ClusterSpec,
    Layout,
    MeasurementKind,
    ModelSpec,
    Recompute,
    RuntimeSpec,
    ShardGranularity,
    ShardingPolicy,
    check_layout,
    holds_graph_pool,
    kda_layers,
    trained_model,
)

UNPRICED = (
    "CP: the KDA state pre-pass over the local chunk and the serial merge of the gathered states (small fp32 "
    "matmuls, FLA KCP); CP's exchange itself is priced (TE p2p KV ring for MLA, FLA KCP state all-gather for KDA)",
    "element-wise recompute work (selective recompute, fused SiTU, MoE backward rewrite) has no vector-unit roof",
    "vision-tower activations: microbatches are text-only in this model",
    "collective latency, rank skew and routing imbalance (routing is modelled uniform / forced-balanced)",
    "host-side kernel launch: a layout is priced the same eager, partially or fully CUDA-graphed "
    "(cuda_graph_impl), and per-layer graphs' static buffers and pools are not in the ledger (a full-iteration "
    "graph's pool is: ledger.rank_peak)",
)
"""What the step time leaves out, for a model with every kind of part (`unpriced`: those of one model)."""


def unpriced(model: ModelSpec) -> tuple[str, ...]:
    """UNPRICED without the items about parts `model` does not have: the KDA state pass under CP (no KDA layers),
    the vision tower's activations (no vision tower)."""
    return tuple(u for u in UNPRICED if (kda_layers(model) or not u.startswith("CP: the KDA"))
                 and (model.vision is not None or not u.startswith("vision-tower")))


def mfu_convention(model: ModelSpec, document_length: int, bf16_tflops: float) -> str:
    """The MFU's FLOP convention in words: 6 x the learned active matrices, the softmax attention's score and value
    contractions with the causal half (MLA and / or GQA, as the model has them), and what it leaves out."""
    kinds = " / ".join(k for k, spec in (("MLA", model.mla), ("GQA", model.gqa)) if spec is not None)
    return (f"6 x learned active matrices per token + {kinds + ' ' if kinds else ''}score/value contractions with "
            f"the causal half (Megatron convention), document length {document_length}; no recompute"
            f"{', no KDA scan' if kda_layers(model) else ''}; denominator {bf16_tflops:g} TFLOP/s dense BF16 per GPU")


@dataclass(frozen=True)
class LedgerTerm:
    key: str
    bytes: int
    phase: str  # persistent | activation | optimizer | host
    kind: str   # derived | assumption | measured
    formula: str


@dataclass(frozen=True)
class RankEvaluation:
    """One physical pipeline rank: its ledger (bytes by key), its peak and its per-microbatch time."""

    rank: int
    chunks: tuple[tuple[int, int], ...]
    """Layer ranges [start, end) of the rank's chunks."""
    ledger: dict[str, int]
    terms: tuple[LedgerTerm, ...]
    persistent_bytes: int
    activation_phase_bytes: int
    optimizer_phase_bytes: int
    peak_bytes: int
    capacity_bytes: int
    fits: bool
    in_flight: float
    """Microbatches (chunk-microbatches under interleaving) held at the activation peak."""
    host_bytes: int
    host_capacity_bytes: int
    host_fits: bool
    time_s: dict[str, float]
    """Seconds per microbatch on each resource."""
    update_s: dict[str, float]
    binding: str
    counts: dict[str, Any] = field(default_factory=dict)
    """Per-update counts: Newton-Schulz FLOPs (all / routed), MoE layers, routing-map all-gathers, and per
    outgoing PP hop the AttnRes residual streams and the packet bytes."""
    allocated_bytes: int = 0
    """torch.cuda.max_memory_allocated: the ledger peak plus the workspaces inside the caching allocator."""
    reserved_bytes: int = 0
    """torch.cuda.max_memory_reserved: allocated x (1 + the runtime's allocator slack)."""
    device_bytes: int = 0
    """Device-used (nvidia-smi): reserved plus the memory outside the allocator. `fits` is device <= capacity."""
    memory_items: tuple[MemoryItem, ...] = ()
    """The runtime's items beyond the ledger (k3opt.cost.memory_outside); empty without a runtime."""
    activation_peak_terms: tuple[str, ...] = ()
    """The activation-phase terms live together at the phase's peak (ledger.binding_activation_terms): the loss's
    logits and a layer's transients are not both there unless the EP overlap schedule runs them together."""

    def at_peak(self, key: str) -> int:
        """Ledger term `key`'s bytes in the stacked peak: 0 for an activation term not live at the phase's peak."""
        if TERMS[key].phase is Phase.ACTIVATION and key not in self.activation_peak_terms:
            return 0
        return self.ledger[key]

    @property
    def headroom_bytes(self) -> int:
        """Capacity (HBM - reserve) minus the device peak."""
        return self.capacity_bytes - self.device_bytes

    @property
    def stage_time_s(self) -> float:
        return max(self.time_s.values())


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    """Optimistic: every resource overlaps (max over resources per stage), plus the exposed update."""
    serial_step_time_s: float
    """Upper bound: resources serialized (sum per stage), plus the serialized update."""
    stage_time_s: float
    slowest_rank: int
    binding: str
    update_time_s: float
    bubble_overhead: float
    bubble_fraction: float
    slots: float
    tokens_per_update: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    model_flops_per_token: float
    mfu_convention: str
    unpriced: tuple[str, ...]
    achievable_step_time_s: float | None = None
    """Roofline plus bubble at the achievable rates of the cluster's rates file (k3opt.cost.achievable); None
    without a rates file. `step_time_s` stays the optimistic peak-ceiling bound beside it."""
    achievable_tokens_per_s_per_gpu: float | None = None
    achievable_mfu: float | None = None
    achievable_binding: str = ""
    achievable_exposed_ep_s: float = 0.0
    """Exposed EP all-to-all per stage-microbatch on the slowest rank (0 with an EP overlap schedule)."""
    achievable_update_comm_exposed_s: float = 0.0
    """The update's data-parallel communication left exposed beyond its overlap window (in achievable_step_time_s)."""
    achievable_stage_time_s: float = 0.0
    achievable_update_time_s: float = 0.0
    achievable_unpaired_ep_s: float = 0.0
    """achievable_step_time_s = slots x achievable_stage_time_s + achievable_update_time_s + achievable_unpaired_ep_s
    (the exposed all-to-all of the microbatches an EP overlap schedule runs without a partner)."""
    rates: str = ""
    schedule_step_time_s: float = 0.0
    """The pipeline priced by its schedule: the makespan of Megatron's 1F1B / interleaved order over each chunk's
    forward and backward times (`schedule.replay_makespan`), plus the exposed update. Equal chunks: step_time_s."""
    achievable_schedule_step_time_s: float | None = None
    """The same replay at the achievable rates (AchievableStep.schedule_step_time_s)."""
    ranked_chunk_s: tuple[tuple[float, float], ...] = ()
    """(forward, backward) seconds per microbatch of every global chunk, as the replay at the ranking's rates
    (ranked_schedule_time_s) runs them: the timeline plot draws these."""
    achievable_rank_stage_s: tuple[dict[str, float], ...] = ()
    """Per rank: seconds per stage-microbatch on each resource at the achievable rates (AchievableStep.stage_s);
    empty without a rates file."""
    achievable_rank_binding: tuple[str, ...] = ()
    achievable_slowest_rank: int = 0
    """The rank whose achievable stage time sets the step (the lowest of tied ones)."""
    achievable_rank_exposed_ep_s: tuple[float, ...] = ()
    offload_stall_s: float = 0.0
    """Per microbatch: what the compute stream waits for activation_offload_layers' copies (TransformerEngine's
    default schedule, schedule.offload_stall) at the peak rates; part of the `compute` component."""
    achievable_offload_stall_s: float = 0.0
    """The same at the achievable rates; part of the achievable stage time."""
    components: dict[str, float] = field(default_factory=dict)
    """Named parts, in seconds. Per microbatch on the slowest rank: `compute` (tensor cores), `hbm`, `nvlink`,
    `nic`, `host_link`. Per step: `microbatch_work` (M x stage time), `bubble` ((slots - M) x stage time) and
    `exposed_update`; these three sum to step_time_s."""

    @property
    def formula_time_s(self) -> float:
        """The step formula at the ranking's rates, (M + (p - 1) / v) x the slowest rank + update:
        achievable_step_time_s with a rates file, else step_time_s. The search's model computes it; its bounds are
        lower bounds of it."""
        return self.step_time_s if self.achievable_step_time_s is None else self.achievable_step_time_s

    @property
    def ranked_schedule_time_s(self) -> float:
        """The replayed pipeline schedule at the ranking's rates (achievable_schedule_step_time_s with a rates file,
        else schedule_step_time_s). Equal chunks: within the formula; uneven interleaved chunks replay longer."""
        a = self.achievable_schedule_step_time_s
        return self.schedule_step_time_s if a is None else a

    @property
    def rank_time_s(self) -> float:
        """The step time plans rank by: the larger of the step formula (formula_time_s) and the replayed schedule
        at the same rates (ranked_schedule_time_s). The formula holds for equal chunks and never under-prices a
        v = 1 split; uneven interleaved chunks replay longer, and ranking by the larger prices them by their
        schedule. Every search bound, a lower bound of the formula, stays a lower bound of it."""
        return max(self.formula_time_s, self.ranked_schedule_time_s)

    @property
    def rank_tokens_per_s_per_gpu(self) -> float:
        """Tokens/s per GPU at rank_time_s."""
        return self.tokens_per_s_per_gpu * self.step_time_s / self.rank_time_s  # tokens/s scale as 1 / step time


@dataclass(frozen=True)
class Comparison:
    figure: str
    modeled: float
    measured: float
    unit: str
    kind: str = ""
    """The measurement kind compared (allocated / reserved / device); empty for times and rates."""

    @property
    def gap(self) -> float:
        return self.measured - self.modeled

    @property
    def gap_pct(self) -> float:
        return 100 * self.gap / self.measured


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    model: ModelSpec
    cluster: ClusterSpec
    params: ParamCounts
    ranks: tuple[RankEvaluation, ...]
    step: StepTime
    capacity_bytes: int
    validation: tuple[Comparison, ...] = field(default=())
    runtime: RuntimeSpec | None = None

    @property
    def peak_bytes(self) -> int:
        """The ledger's peak (live tensors as itemized by the ledger), worst rank."""
        return max(r.peak_bytes for r in self.ranks)

    @property
    def peak_allocated_bytes(self) -> int:
        return max(r.allocated_bytes for r in self.ranks)

    @property
    def peak_reserved_bytes(self) -> int:
        return max(r.reserved_bytes for r in self.ranks)

    @property
    def peak_device_bytes(self) -> int:
        """The peak the HBM constraint checks: device <= HBM - reserve on every rank."""
        return max(r.device_bytes for r in self.ranks)

    @property
    def worst_rank(self) -> int:
        return max(self.ranks, key=lambda r: r.peak_bytes).rank

    @property
    def fits(self) -> bool:
        return all(r.fits and r.host_fits for r in self.ranks)

    @property
    def headroom_bytes(self) -> int:
        """Capacity minus the worst device peak."""
        return self.capacity_bytes - self.peak_device_bytes

    @property
    def gpus_per_domain(self) -> int:
        """GPUs the layout uses in each NVLink domain (its `domain_gpus_used`, else the whole domain)."""
        return domain_block(self.layout.domain_gpus_used, self.cluster.nvlink_domain_gpus)

    @property
    def domains_held(self) -> int:
        """NVLink domains (racks) the placement holds: ceil(gpus / GPUs per domain)."""
        return domains_held(self.layout.gpus, self.layout.domain_gpus_used, self.cluster.nvlink_domain_gpus)

    @property
    def gpus_held(self) -> int:
        """GPUs of the domains held, used or idle: domains held x domain size."""
        return self.domains_held * self.cluster.nvlink_domain_gpus

    @property
    def tokens_per_s_per_gpu_held(self) -> float:
        """Tokens per second at the ranked step time, per GPU held (idle GPUs of the held domains count)."""
        return self.step.rank_tokens_per_s_per_gpu * self.layout.gpus / self.gpus_held

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the same numbers the tables print."""
        return {
            "placement": {"gpus_used": self.layout.gpus, "gpus_per_domain": self.gpus_per_domain,
                          "domains_held": self.domains_held, "gpus_held": self.gpus_held,
                          "tokens_per_s_per_gpu_used": self.step.rank_tokens_per_s_per_gpu,
                          "tokens_per_s_per_gpu_held": self.tokens_per_s_per_gpu_held},
            "layout": self.layout.model_dump(mode="json", exclude_none=True),
            "model": self.model.name,
            "cluster": self.cluster.name,
            "params": {k: getattr(self.params, k) for k in
                       ("total", "muon", "adamw", "routed", "active_matrix", "active_routed",
                        "active_conventional")},
            "runtime": self.runtime.name if self.runtime is not None else None,
            "capacity_bytes": self.capacity_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "worst_rank": self.worst_rank,
            "fits": self.fits,
            "ranks": [
                {
                    "rank": r.rank, "chunks": [list(c) for c in r.chunks], "ledger_bytes": r.ledger,
                    "persistent_bytes": r.persistent_bytes,
                    "activation_phase_bytes": r.activation_phase_bytes,
                    "optimizer_phase_bytes": r.optimizer_phase_bytes, "peak_bytes": r.peak_bytes,
                    "allocated_bytes": r.allocated_bytes, "reserved_bytes": r.reserved_bytes,
                    "device_bytes": r.device_bytes,
                    "memory_items": {i.key: {"bytes": i.bytes, "where": i.where, "formula": i.formula}
                                     for i in r.memory_items},
                    "headroom_bytes": r.headroom_bytes, "fits": r.fits, "in_flight": r.in_flight,
                    "host_bytes": r.host_bytes, "host_fits": r.host_fits,
                    "time_per_microbatch_s": r.time_s, "update_s": r.update_s, "binding": r.binding,
                    "counts": r.counts,
                }
                for r in self.ranks
            ],
            "terms": {t.key: {"phase": t.phase, "kind": t.kind, "formula": t.formula}
                      for t in self.ranks[0].terms},
            "step": {k: getattr(self.step, k) for k in StepTime.__dataclass_fields__},
            "validation": [
                {"figure": c.figure, "kind": c.kind, "modeled": c.modeled, "measured": c.measured,
                 "unit": c.unit, "gap": c.gap, "gap_pct": c.gap_pct}
                for c in self.validation
            ],
        }


def chunk_bounds(split: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
    return [(int(edges[j]), int(edges[j + 1])) for j in range(len(split))]


class _RankChunks:
    """The chunks physical rank r holds under a split, and sums of per-layer arrays over each of them."""

    def __init__(self, cf: Coefficients, split: list[int] | tuple[int, ...], r: int) -> None:
        sh = cf.shape
        self.cf, self.r, self.p, self.k = cf, r, sh.pp, sh.chunks
        self.bounds = chunk_bounds(split)
        # R(b): AttnRes residual blocks closed up to layer boundary b.
        self.closes_cum = np.concatenate([[0.0], np.cumsum(cf.closes[: cf.n_layers])])
        self.mine = list(range(r, self.k, self.p))
        self.idx: list[int] = rank_indices(split, r, self.p, cf.n_layers).tolist()
        self.rows = chunk_rows(split, self.mine, cf.n_layers)
        self.has_moe = sum(self.csum(cf.moe)) > 0

    def csum(self, arr: np.ndarray) -> list[float]:
        """`arr` summed over each of the rank's chunks (edges included on the first and last chunk)."""
        return (self.rows @ arr).tolist()

    def total(self, arr: np.ndarray) -> float:
        """`arr` summed over all of the rank's chunks."""
        return sum(self.csum(arr))


@dataclass(frozen=True)
class _InFlight:
    """The activation terms of a rank at its in-flight peak, and what offload and balancing read of them."""

    terms: dict[str, float]
    host: float
    """Saved bytes offloaded to the host at the peak."""
    in_flight: float
    n_peak: int
    """Most in-flight chunk-microbatches the schedule holds on the rank (before balancing)."""
    act: list[float]
    """Saved bytes of one microbatch on each of the rank's chunks."""


def rank_ledger(cf: Coefficients, split: list[int] | tuple[int, ...], r: int) -> dict[str, Any]:
    """Ledger bytes (floats, in the declaration order of k3opt.cost.ledger), host bytes, in-flight count and
    per-resource time of physical rank r."""
    rc = _RankChunks(cf, split, r)
    values, tensor_terms = _persistent_terms(rc)
    fl = _in_flight_terms(rc)
    values.update(fl.terms)
    packets, pp_time = _pipeline_packets(rc)
    values["pp_buffers"] = 2 * max(packets)
    values["optimizer_transient"] = _optimizer_transient(rc)
    out = {t.key: values[t.key] if t.key in values else _declared_term(rc, t) for t in LEDGER}
    host = fl.host + rc.total(cf.host_grads)
    update = {res: float(rc.total(cf.update[res])) for res in RESOURCES}
    return {"ledger": out, "host": host, "in_flight": fl.in_flight, "time": _microbatch_time(rc, fl, pp_time),
            "update": update, "chunks": tuple(rc.bounds[j] for j in rc.mine), "counts": _counts(rc, tensor_terms)}


def _declared_term(rc: _RankChunks, t: TermDecl) -> float:
    """A term whose declaration alone prices it: a per-layer coefficient summed over the rank's layers, a per-rank
    buffer held where a MoE layer is, or the last stage's logits."""
    value = getattr(rc.cf, t.coefficient)
    if t.aggregate is Aggregate.LAYER_SUM:
        return rc.total(value)
    if t.aggregate is Aggregate.MOE_RANK:
        return value if rc.has_moe else 0.0
    if t.aggregate is Aggregate.LAST_STAGE:
        return value if (rc.k - 1) in rc.mine else 0.0
    raise ValueError(f"ledger term {t.key}: {t.aggregate} needs its own pricing in rank_ledger")


def _persistent_terms(rc: _RankChunks) -> tuple[dict[str, float], list[dict[str, int]] | None]:
    """The persistent terms whose form a decision changes: a term's declared toggled form (the gradients under
    pipeline ZeRO-2: two chunk-sized FP32 buffers), and under whole-tensor sharding the worst shard owner's master,
    optimizer state and gradients with every data-parallel rank's owned bytes. The others are priced from their
    declarations."""
    cf, sh = rc.cf, rc.cf.shape
    out: dict[str, float] = {}
    for t in LEDGER:
        alt = t.toggled
        if alt is not None and getattr(sh.toggles, alt.toggle):
            if alt.aggregate is not Aggregate.CHUNK_PAIR:
                raise ValueError(f"ledger term {t.key}: {alt.aggregate} under {alt.toggle} needs its own pricing")
            out[t.key] = 2 * max(rc.csum(getattr(cf, alt.coefficient)))
    tensor_terms = None
    if sh.optimizer_shard_granularity == ShardGranularity.TENSOR:
        out.update(_tensor_owned_state(cf, tuple(rc.idx)))
        tensor_terms = _tensor_owned_per_dp_rank(cf, tuple(rc.idx))
    return out, tensor_terms


def _in_flight_terms(rc: _RankChunks) -> _InFlight:
    """Saved activations and AttnRes bank at the worst in-flight composition (scaled to the balanced average);
    under offload the resident layers stay on the GPU and the peak composition's bytes go to the host. The paged
    stash at its own peak composition. Then the working set of the layer whose backward needs the most."""
    cf, sh = rc.cf, rc.cf.shape
    act = rc.csum(cf.act)
    bank = [rc.closes_cum[rc.bounds[j][1]] * cf.stream_bytes for j in rc.mine]
    comps = cf.compositions[rc.r]
    n_peak = peak_inflight(comps)
    scale = balanced_scale(cf.balanced_inflight, n_peak)
    out: dict[str, float] = {}
    if sh.toggles.activation_offload:
        gpu_act = sh.offload_resident_layers * max(float(cf.act[i]) for i in rc.idx)
        host_act = max(sum(c * a for c, a in zip(comp, act, strict=True)) for comp in comps) * scale
        best_bank = max(sum(c * b for c, b in zip(comp, bank, strict=True)) for comp in comps) * scale
        out["activations"], out["attnres_bank"] = gpu_act, best_bank
        in_flight = n_peak * scale
    else:
        # activation_offload_layers: those layers' saved sets wait in host memory for every in-flight microbatch.
        off = rc.csum(cf.offloaded_act)
        host_act = max(sum(c * o for c, o in zip(comp, off, strict=True)) for comp in comps) * scale
        best = max(comps, key=lambda comp: sum(c * (a + b) for c, a, b in zip(comp, act, bank, strict=True)))
        out["activations"] = sum(c * a for c, a in zip(best, act, strict=True)) * scale
        out["attnres_bank"] = sum(c * b for c, b in zip(best, bank, strict=True)) * scale
        in_flight = sum(best) * scale
    # Megatron's paged stash: a static buffer sized at the rank's own peak of in-flight routed bytes (its
    # composition need not be the one that peaks the saved set), held through the optimizer step.
    stash, stash_host = rc.csum(cf.stash), rc.csum(cf.stash_host)
    out["paged_stash"] = max(sum(c * a for c, a in zip(comp, stash, strict=True)) for comp in comps) * scale
    host_act += max(sum(c * a for c, a in zip(comp, stash_host, strict=True)) for comp in comps) * scale
    ws_i = max(rc.idx, key=lambda i: cf.working_set[i])
    out["recompute_working_set"] = float(cf.recompute_ws[ws_i])
    out["grad_transient"] = float(cf.working_set[ws_i] - cf.recompute_ws[ws_i])
    return _InFlight(terms=out, host=host_act, in_flight=in_flight, n_peak=n_peak, act=act)


def _pipeline_packets(rc: _RankChunks) -> tuple[list[float], dict[str, float]]:
    """Bytes of each chunk's PP packets (input + output: the stream and the AttnRes residual streams, none before
    the first chunk or after the last), and their seconds per microbatch on NVLink and the NIC."""
    cf, p, r, k = rc.cf, rc.p, rc.r, rc.k
    packets = []
    pp_time = {"nvlink": 0.0, "nic": 0.0}
    for j in rc.mine:
        s, e = rc.bounds[j]
        pin = pp_packet_bytes(rc.closes_cum[s], cf.stream_bytes) if j > 0 else 0.0
        pout = pp_packet_bytes(rc.closes_cum[e], cf.stream_bytes) if j < k - 1 else 0.0
        packets.append(pin + pout)
        # Per direction: forward out + backward out (the gradient of the input packet), and the same in.
        if j > 0:
            hop = (r - 1) % p
            pp_time["nvlink" if cf.pp_on_nvlink[hop] else "nic"] += pin * cf.pp_seconds_per_byte[hop]
        if j < k - 1:
            pp_time["nvlink" if cf.pp_on_nvlink[r] else "nic"] += pout * cf.pp_seconds_per_byte[r]
    return packets, pp_time


def _optimizer_transient(rc: _RankChunks) -> float:
    """The optimizer step's gather (P2P Muon: twice the resident parameters; else the sharding policy's step
    gather) with the Newton-Schulz working set of the largest matrix."""
    cf = rc.cf
    gather = rc.total(step_gather_bytes(cf, cf.shape.toggles.p2p_muon))
    ns_ws = max(float(cf.ns_working_set[i]) for i in rc.idx)
    return optimizer_transient_bytes(gather, ns_ws, cf.step_gather_with_ns)


def _microbatch_time(rc: _RankChunks, fl: _InFlight, pp_time: dict[str, float]) -> dict[str, float]:
    """Seconds per microbatch on each resource: the chunks' work, the PP packets and the balancing traffic."""
    cf = rc.cf
    time = {res: float(rc.total(cf.time[res])) for res in RESOURCES}
    time["nvlink"] += pp_time["nvlink"]
    time["nic"] += pp_time["nic"]
    if cf.balanced_inflight is not None and fl.n_peak > cf.balanced_inflight:
        # Remote offload of the excess over the average, out and back, every microbatch (seed 001).
        moved = balance_moved_bytes(sum(fl.act), fl.n_peak, cf.balanced_inflight)
        time[cf.balance_resource] += moved * cf.balance_seconds_per_byte
    return time


def _counts(rc: _RankChunks, tensor_terms: list[dict[str, int]] | None) -> dict[str, Any]:
    """The rank's work and traffic counts the report prints beside the ledger."""
    cf, k = rc.cf, rc.k
    moe_layers = int(rc.total(cf.moe))
    counts: dict[str, Any] = {
        "newton_schulz_flops": float(rc.total(cf.ns_flops)),
        "newton_schulz_routed_flops": float(rc.total(cf.ns_flops_routed)),
        "moe_layers": moe_layers,
        "routing_map_allgathers_per_update": moe_layers * cf.routing_map_allgathers_per_layer
        * cf.shape.microbatches,
        "residual_streams_out": [int(rc.closes_cum[rc.bounds[j][1]]) for j in rc.mine if j < k - 1],
        "pp_packet_out_bytes": [int(pp_packet_bytes(rc.closes_cum[rc.bounds[j][1]], cf.stream_bytes))
                                for j in rc.mine if j < k - 1],
    }
    if tensor_terms is not None:
        counts["owned_per_dp_rank"] = tensor_terms
    return counts


def _optimizer_formula(params: ParamCounts, state_bytes: int, owner: str) -> str:
    """The optimizer-state term's formula, naming only the optimizers the model's parameters use: Muon keeps one
    momentum, AdamW two moments, each `state_bytes` per owned parameter."""
    parts = ([f"Muon momentum {state_bytes} B"] if params.muon else []) + (
        [f"AdamW moments {2 * state_bytes} B"] if params.adamw else [])
    return f"{' + '.join(parts)} per owned parameter{owner}"


def _policy_formulas(layout: Layout, params: ParamCounts) -> dict[str, str]:
    """Term formulas under the layout's sharding policy, dtype and granularity and the model's optimizers (TERM_INFO's
    where they are the defaults)."""
    d, e_ = layout.dense_sharding, layout.expert_sharding
    default = ShardingPolicy.OPTIM_GRADS_PARAMS
    tensor = layout.optimizer_shard_granularity == ShardGranularity.TENSOR
    if (d == e_ == default and not tensor and layout.grad_dtype.bytes == 4
            and layout.optimizer_state_dtype.bytes == 4):
        return {} if params.muon and params.adamw else {"optimizer": _optimizer_formula(params, 4, "")}

    def div(pol: ShardingPolicy, f: str, grads: bool = False) -> str:
        sharded = pol in (ShardingPolicy.OPTIM_GRADS, default) if grads else pol != ShardingPolicy.NO_SHARD
        return f"/{f}" if sharded else ""

    owner = " of the rank owning the most whole tensors" if tensor else ""
    g, sd = layout.grad_dtype.bytes, layout.optimizer_state_dtype.bytes
    pol = f"dense {d.value}, expert {e_.value}"
    return {
        "master": f"FP32 masters{owner}: 4 x (D{div(d, 'f_d')} + E/e{div(e_, 'f_e')}) ({pol})",
        "grads": f"{layout.grad_dtype.value.upper()} gradients: {g} x (D{div(d, 'f_d', True)} + "
                 f"E/e{div(e_, 'f_e', True)}) ({pol}; unsharded = the whole buffer)",
        "optimizer": _optimizer_formula(params, sd, owner),
        "optimizer_transient": "without P2P Muon, BF16 all-gathered at the step: optim_grads_params groups 2 x "
                               "params (plus Newton-Schulz), optim / optim_grads in place (element) or into "
                               "receive buffers after Newton-Schulz (tensor): max(2 x sharded params, NS)"
                               + ("; plus the FP32 copy of the BF16 gradient shard the rank owns, 4 x owned params"
                                  if g < 4 else ""),
    }


def _tensor_owned_state(cf: Coefficients, idx: tuple[int, ...], dp_rank: int | None = None) -> dict[str, float]:
    """Master, optimizer state (and sharded gradients) a data-parallel rank owns under whole-tensor sharding, by
    Megatron's layer-wise assignment (k3opt.cost.sharding): of `dp_rank` (its index in the dense and in the expert shard
    group), or (None) of each group's rank owning the most bytes, the HBM constraint's worst rank."""
    sh = cf.shape
    out: dict[str, float] = {"master": 0.0, "optimizer": 0.0}
    grads = 0.0
    sd, gd = cf.state_bytes, sh.grad_dtype.bytes
    sharded_grads = (ShardingPolicy.OPTIM_GRADS, ShardingPolicy.OPTIM_GRADS_PARAMS)
    for routed, pol, f in ((False, sh.dense_sharding, sh.dense_fsdp), (True, sh.expert_sharding, sh.expert_fsdp)):
        group = 1 if pol == ShardingPolicy.NO_SHARD else f
        g_b = gd if pol in sharded_grads else 0

        def owned_bytes(s: tuple[int, int], g_b: int = g_b) -> int:
            return (4 + sd + g_b) * s[0] + (4 + 2 * sd + g_b) * s[1]

        shares = cf.cost.owned_per_rank(idx, routed, group, sh.ep)
        m, a = shares[dp_rank % group] if dp_rank is not None else max(shares, key=owned_bytes)
        out["master"] += 4 * (m + a)
        out["optimizer"] += sd * m + 2 * sd * a
        if pol in sharded_grads:
            grads += gd * (m + a)
        else:
            grads += gd * cf.cost.whole_params(idx, routed, sh.ep)
    if not sh.toggles.pipeline_zero2_host_grads:
        out["grads"] = grads
    return out


def _tensor_owned_per_dp_rank(cf: Coefficients, idx: tuple[int, ...]) -> list[dict[str, int]]:
    """`_tensor_owned_state` of every data-parallel rank d < max(dense, expert shard group) (bytes)."""
    sh = cf.shape
    n = max(sh.dense_fsdp, sh.expert_fsdp)
    return [{k: int(round(v)) for k, v in _tensor_owned_state(cf, idx, d).items()} for d in range(n)]


def evaluate(layout: Layout, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None,
             reserve_gib: float | None = None, runtime: RuntimeSpec | str | None = None) -> Evaluation:
    """Per-rank ledger and step time of `layout` (model and cluster: objects, preset names or paths;
    default: the layout's own `model` / `cluster` fields, else kimi-k3 on gb200-nvl72). `runtime` (default:
    the layout's `runtime`; absent there, or "none": live tensors only) itemizes the memory outside the ledger.
    A layout is evaluated as written: the cluster's `default_runtime` is the planner's default for jobs, and a
    planned layout names the runtime it was planned with."""
    model = load_model(model or layout.model or "kimi-k3") if not isinstance(model, ModelSpec) else model
    cluster = (load_cluster(cluster or layout.cluster or "gb200-nvl72")
               if not isinstance(cluster, ClusterSpec) else cluster)
    model = trained_model(layout, model)
    check_layout(layout, model, cluster)
    check_offload_modules(layout, model)
    if layout.optimizer_state_dtype is None:
        layout = layout.model_copy(update={"optimizer_state_dtype": model.optimizer.state_of(None)})
    rt_name = runtime if runtime is not None else layout.runtime
    rt = load_runtime(rt_name) if rt_name not in (None, NO_RUNTIME) else None
    shape = Shape.of(layout)
    cf = coefficients(shape, model, cluster)
    reserve = layout.reserve_gib if reserve_gib is None else reserve_gib
    capacity = cluster.hbm_bytes - int(round(reserve * GIB))
    host_capacity = cluster.host_memory_bytes

    graph_pool = holds_graph_pool(layout)
    ranks = []
    for r in range(layout.pp):
        rl = rank_ledger(cf, layout.split, r)
        ledger = {key: int(round(val)) for key, val in rl["ledger"].items()}
        persistent = sum(ledger[k] for k in PERSISTENT)
        act_phase = int(activation_phase_bytes(ledger, layout.ep_overlap))
        opt_phase = sum(ledger[k] for k in OPTIMIZER)
        peak = int(rank_peak(persistent, act_phase, opt_phase, graph_pool))
        terms = []
        policy_text = _policy_formulas(layout, cf.cost.structure.params)
        for key in PERSISTENT + ACTIVATION + OPTIMIZER:
            kind, formula = TERM_INFO[key]
            formula = policy_text.get(key, formula)
            if key == "logits":
                formula = cf.logits_formula
            phase = TERMS[key].phase.value
            terms.append(LedgerTerm(key, ledger[key], phase, kind, formula))
        host = int(round(rl["host"]))
        time = rl["time"]
        binding = max(time, key=time.get)
        items = runtime_items(shape, model, cluster, rt, r, has_moe=rl["counts"]["moe_layers"] > 0)
        allocated, reserved, device = kinds(peak, items, rt)
        rl["counts"]["resident_before_first_step_bytes"] = (
            persistent - ledger["optimizer"] if layout.lazy_optimizer_state else persistent)
        ranks.append(RankEvaluation(
            rank=r, chunks=rl["chunks"], ledger=ledger, terms=tuple(terms), persistent_bytes=persistent,
            activation_phase_bytes=act_phase, optimizer_phase_bytes=opt_phase, peak_bytes=peak,
            capacity_bytes=capacity, fits=device <= capacity, in_flight=rl["in_flight"], host_bytes=host,
            host_capacity_bytes=host_capacity, host_fits=host <= host_capacity, time_s=time,
            update_s=rl["update"], binding=binding, counts=rl["counts"], allocated_bytes=allocated,
            reserved_bytes=reserved, device_bytes=device, memory_items=items,
            activation_peak_terms=binding_activation_terms(ledger, layout.ep_overlap),
        ))

    step = _step(cf, ranks, model, cluster, layout)
    step = _with_achievable(step, cf, layout, cluster)
    validation = []
    if layout.measured is not None:
        m = layout.measured
        validation += memory_comparisons(
            m, ranks, ", worst owner" if layout.optimizer_shard_granularity == ShardGranularity.TENSOR
            else "")
        if m.step_time_s is not None:
            validation.append(Comparison("step time", step.step_time_s, m.step_time_s, "s"))
        if m.tokens_per_s_per_gpu is not None:
            validation.append(Comparison("tokens/s per GPU", step.tokens_per_s_per_gpu,
                                         m.tokens_per_s_per_gpu, "tokens/s"))
        if m.tokens_per_s_per_gpu is not None and step.achievable_tokens_per_s_per_gpu is not None:
            validation.append(Comparison("tokens/s per GPU at achievable rates",
                                         step.achievable_tokens_per_s_per_gpu, m.tokens_per_s_per_gpu, "tokens/s"))
    return Evaluation(layout=layout, model=model, cluster=cluster, params=cf.cost.structure.params,
                      ranks=tuple(ranks), step=step, capacity_bytes=capacity, validation=tuple(validation),
                      runtime=rt)


_KIND_ATTR = {"allocated": "allocated_bytes", "reserved": "reserved_bytes", "device": "device_bytes"}


def memory_comparisons(m: Any, ranks: list[RankEvaluation], owner: str = "") -> list[Comparison]:
    """Modeled vs measured memory, like with like: a peak of kind K against the modeled K peak of the measured
    rank (default: the rank with the largest modeled K); "unstated" against both reserved and device. Resident,
    per-term and optimizer-step figures are live tensors, compared against the ledger."""
    out: list[Comparison] = []
    kinds_ = ["reserved", "device"] if m.kind == MeasurementKind.UNSTATED else [m.kind.value]
    if m.peak_gib is not None:
        for k in kinds_:
            attr = _KIND_ATTR[k]
            r = ranks[m.rank] if m.rank is not None else max(ranks, key=lambda x: getattr(x, attr))
            where = f"rank {r.rank}" if m.rank is not None else f"worst rank ({r.rank})"
            out.append(Comparison(f"peak HBM, {where}", getattr(r, attr) / GIB, m.peak_gib, "GiB", k))
    r = ranks[m.rank] if m.rank is not None else max(ranks, key=lambda x: x.peak_bytes)
    ledger, persistent = dict(r.ledger), r.persistent_bytes
    pre_step = r.counts.get("resident_before_first_step_bytes", persistent)
    per_dp = r.counts.get("owned_per_dp_rank")
    if per_dp is not None and m.dp_rank is not None:
        # Whole-tensor sharding: the figures were read on one data-parallel rank; its owned terms replace the
        # worst owner's (the ledger's, for the HBM constraint).
        if m.dp_rank >= len(per_dp):
            raise LayoutError(f"measured.dp_rank = {m.dp_rank}: the shard groups have {len(per_dp)} ranks")
        mine = per_dp[m.dp_rank]
        delta = sum(mine.values()) - sum(ledger[k] for k in mine)
        lazy = pre_step != persistent
        pre_step += delta - ((mine["optimizer"] - ledger["optimizer"]) if lazy else 0)
        persistent += delta
        ledger.update(mine)
        owner = f", DP rank {m.dp_rank}"
    if m.resident_gib is not None:
        out.append(Comparison(f"resident state, PP rank {r.rank}{owner}", persistent / GIB,
                              m.resident_gib, "GiB", "allocated"))
    if m.pre_step_resident_gib is not None:
        out.append(Comparison(f"resident before the first step, PP rank {r.rank}{owner}",
                              pre_step / GIB, m.pre_step_resident_gib, "GiB", "allocated"))
    for key, gib in m.terms_gib.items():
        if key not in ledger:
            raise LayoutError(f"measured.terms_gib.{key}: not a ledger key; known: {', '.join(ledger)}")
        out.append(Comparison(f"{key}, PP rank {r.rank}{owner}", ledger[key] / GIB, gib, "GiB", "allocated"))
    if m.optimizer_transient_gib is not None:
        out.append(Comparison(f"optimizer-step transient, PP rank {r.rank}{owner}", r.optimizer_phase_bytes / GIB,
                              m.optimizer_transient_gib, "GiB", "allocated"))
    return out


def _with_achievable(step: StepTime, cf: Coefficients, layout: Layout, cluster: ClusterSpec) -> StepTime:
    """The peak-ceiling step time with the achievable-rate step time (k3opt.cost.achievable) beside it."""
    ach = achievable_for(cf, layout.split, cluster)
    if ach is None:
        return step
    tps = cf.shape.tokens_per_update / ach.step_time_s
    return replace(
        step, achievable_step_time_s=ach.step_time_s, achievable_tokens_per_s_per_gpu=tps / cf.shape.gpus,
        achievable_mfu=cf.model_flops_per_token * tps / (cf.shape.gpus * cluster.bf16_tflops * 1e12),
        achievable_binding=ach.binding, achievable_exposed_ep_s=ach.exposed_ep_s, rates=ach.rates,
        achievable_update_comm_exposed_s=ach.update_comm_exposed_s, achievable_stage_time_s=ach.stage_time_s,
        achievable_update_time_s=ach.update_time_s, achievable_unpaired_ep_s=ach.unpaired_ep_s,
        achievable_schedule_step_time_s=ach.schedule_step_time_s, ranked_chunk_s=ach.chunk_s,
        achievable_rank_stage_s=ach.stage_s, achievable_rank_binding=ach.stage_binding,
        achievable_rank_exposed_ep_s=ach.stage_exposed_ep_s, achievable_slowest_rank=ach.slowest_rank,
        achievable_offload_stall_s=float(cf.offload_stall_achievable.sum()),
    )


def _step(cf: Coefficients, ranks: list[RankEvaluation], model: ModelSpec, cluster: ClusterSpec,
          layout: Layout) -> StepTime:
    sh = cf.shape
    stage = max(r.stage_time_s for r in ranks)
    slowest = ranks[slowest_index([r.stage_time_s for r in ranks])]
    update = max(max(r.update_s.values()) for r in ranks)
    serial_stage = max(sum(r.time_s.values()) for r in ranks)
    serial_update = max(sum(r.update_s.values()) for r in ranks)
    step = cf.slots * stage + update
    serial = cf.slots * serial_stage + serial_update
    tokens = sh.tokens_per_update
    tps = tokens / step
    mfu = cf.model_flops_per_token * tps / (sh.gpus * cluster.bf16_tflops * 1e12)
    # The pipeline over the chunks actually chosen; PP packet time is already in each rank's NVLink / NIC time, so
    # the replay adds no hop latency on top (none is priced).
    fwd, bwd = chunk_times_s(cf, ranks, layout)
    return StepTime(
        step_time_s=step, serial_step_time_s=serial, stage_time_s=stage, slowest_rank=slowest.rank,
        binding=slowest.binding, update_time_s=update,
        bubble_overhead=bubble_overhead(sh.pp, sh.vp, sh.microbatches),
        bubble_fraction=bubble_fraction(sh.pp, sh.vp, sh.microbatches), slots=cf.slots,
        tokens_per_update=tokens, tokens_per_s=tps, tokens_per_s_per_gpu=tps / sh.gpus, mfu=mfu,
        model_flops_per_token=cf.model_flops_per_token,
        mfu_convention=mfu_convention(model, min(sh.document_length, sh.context), cluster.bf16_tflops),
        unpriced=unpriced(model),
        schedule_step_time_s=replay_makespan(sh.pp, sh.vp, sh.microbatches, fwd, bwd) + update,
        ranked_chunk_s=tuple(zip(fwd.tolist(), bwd.tolist(), strict=True)),
        offload_stall_s=float(cf.offload_stall.sum()),
        components={
            "compute": float(slowest.time_s["tensor"]),
            **{res: float(slowest.time_s[res]) for res in RESOURCES if res != "tensor"},
            "microbatch_work": float(sh.microbatches * stage),
            "bubble": float((cf.slots - sh.microbatches) * stage),
            "exposed_update": float(update),
        },
    )


def chunk_times_s(cf: Coefficients, ranks: list[RankEvaluation], layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of every global chunk per microbatch at peak rates (`schedule.chunk_times`:
    each rank's stage time shared among its chunks by their busiest-resource work)."""
    k = layout.pp * layout.vp
    rows = chunk_rows(layout.split, list(range(k)), cf.n_layers)
    work = np.max([rows @ cf.time[res] for res in RESOURCES], axis=0)
    return chunk_times(work, [r.stage_time_s for r in ranks], layout.pp, layout.recompute == Recompute.FULL)
