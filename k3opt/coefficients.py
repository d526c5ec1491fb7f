"""Per-layer cost coefficients of one layout shape (everything but the split).

This is the one home of every byte and FLOP formula. For a shape it returns arrays over the L layers plus
two edge entries (index L: embedding + vision on the first chunk; index L + 1: final norm + LM head on the
last chunk). `evaluate()` sums them over a split; the search builds its CP-SAT constraints from the same
arrays. All values are float64 bytes, FLOPs or seconds per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from k3opt import comm
from k3opt.schedule import inflight_compositions, schedule_slots
from k3opt.specs import ClusterSpec, FsdpLifecycle, Layout, ModelSpec, Recompute, Toggles
from k3opt.structure import BF16, FP32, Block, Saved, Structure, structure_of


@dataclass(frozen=True)
class Shape:
    """A layout without its split: the degrees, the microbatching and the toggles."""

    gpus: int
    pp: int
    vp: int
    cp: int
    ep: int
    expert_fsdp: int
    dense_fsdp: int
    microbatches: int
    rows: int
    context: int
    document_length: int
    recompute: Recompute
    fsdp_lifecycle: FsdpLifecycle
    toggles: Toggles
    fp8_block_size: int = 128
    ce_chunk_tokens: int = 1024
    offload_resident_layers: int = 2
    domain_gpus_used: int | None = None

    @classmethod
    def of(cls, layout: Layout) -> Shape:
        return cls(
            gpus=layout.gpus, pp=layout.pp, vp=layout.vp, cp=layout.cp, ep=layout.ep,
            expert_fsdp=layout.expert_fsdp, dense_fsdp=layout.dense_fsdp, microbatches=layout.microbatches,
            rows=layout.rows, context=layout.context, document_length=layout.effective_document_length,
            recompute=layout.recompute, fsdp_lifecycle=layout.fsdp_lifecycle, toggles=layout.toggles,
            fp8_block_size=layout.fp8_block_size, ce_chunk_tokens=layout.ce_chunk_tokens,
            offload_resident_layers=layout.offload_resident_layers, domain_gpus_used=layout.domain_gpus_used,
        )

    @property
    def tokens(self) -> int:
        """Local tokens per microbatch T = rows * context / c."""
        return self.rows * self.context // self.cp

    @property
    def chunks(self) -> int:
        return self.pp * self.vp

    @property
    def dp(self) -> int:
        return self.gpus // (self.pp * self.cp)

    @property
    def tokens_per_update(self) -> int:
        """DP * M * rows * context (seed 000: 64 * 64 * 1 * 4096 = 16,777,216)."""
        return self.dp * self.microbatches * self.rows * self.context


RESOURCES = ("tensor", "hbm", "nvlink", "nic", "host_link")


@dataclass
class Coefficients:
    """Arrays of length L + 2 (layers, then the first-chunk edge, then the last-chunk edge)."""

    shape: Shape
    n_layers: int
    tokens: int
    hidden: int
    # persistent bytes
    master: np.ndarray = field(repr=False)
    grads: np.ndarray = field(repr=False)
    optimizer: np.ndarray = field(repr=False)
    bf16_view: np.ndarray = field(repr=False)
    moonep_slots: np.ndarray = field(repr=False)
    grad_accum: np.ndarray = field(repr=False)
    chunk_grad_buffer: np.ndarray = field(repr=False)
    """FP32 bytes of one unsharded chunk gradient (pipeline ZeRO-2 keeps two such buffers)."""
    host_grads: np.ndarray = field(repr=False)
    # activation-phase bytes
    act: np.ndarray = field(repr=False)
    """Saved bytes per in-flight microbatch kept on the GPU (before offload)."""
    working_set: np.ndarray = field(repr=False)
    """Bytes live only while this layer runs backward: its recomputed saved set (selective/full recompute),
    its unsharded gradient before the reduce-scatter, the two BF16 gradient streams."""
    recompute_ws: np.ndarray = field(repr=False)
    grad_transient: np.ndarray = field(repr=False)
    closes: np.ndarray = field(repr=False)
    """AttnRes residual blocks closed by each layer; R(b) = cumulative sum up to boundary b."""
    moe: np.ndarray = field(repr=False)
    view_params: np.ndarray = field(repr=False)
    resident_params: np.ndarray = field(repr=False)
    ns_working_set: np.ndarray = field(repr=False)
    ns_flops: np.ndarray = field(repr=False)
    """Newton-Schulz FLOPs per update this rank does for each layer's Muon matrices (its share)."""
    ns_flops_routed: np.ndarray = field(repr=False)
    # per-microbatch work (seconds on each resource) and per-update work
    time: dict[str, np.ndarray] = field(repr=False)
    update: dict[str, np.ndarray] = field(repr=False)
    tensor_flops: np.ndarray = field(repr=False)
    model_flops_per_token: float = 0.0
    # rank-level constants
    stream_bytes: int = 0
    """One BF16 [T, d] stream."""
    ep_buffers: float = 0.0
    moonep_buffers: float = 0.0
    routing_map: float = 0.0
    routing_map_allgathers_per_layer: int = 0
    logits: float = 0.0
    logits_formula: str = ""
    compositions: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """compositions[r]: the in-flight chunk-microbatch vectors rank r passes through."""
    balanced_inflight: float | None = None
    placement: comm.Placement | None = None
    slots: float = 0.0
    pp_seconds_per_byte: tuple[float, ...] = ()
    """For each rank boundary r -> r+1: seconds per PP packet byte (NVLink or NIC)."""
    pp_on_nvlink: tuple[bool, ...] = ()
    balance_resource: str = "nic"
    balance_seconds_per_byte: float = 0.0

    @property
    def first(self) -> int:
        return self.n_layers

    @property
    def last(self) -> int:
        return self.n_layers + 1


def saved_per_token(block: Block, toggles: Toggles, fp8_block: int) -> tuple[float, float, float]:
    """(all saved bytes, recomputable bytes, FP8-stored bytes) per token of one block after the toggles:
    fused SiTU swaps six FP32 [R, H] copies for the BF16 [R, 2H] input (seed 004); dispatch recompute drops
    the dispatched copies; the MoE backward rewrite drops the expert outputs (seed 001); FP8 stores GEMM
    inputs in 1 byte plus one FP32 scale per `fp8_block` elements."""
    total = recomputable = fp8 = 0.0
    for s in block.saved:
        if not _kept(s, toggles):
            continue
        b = float(s.bytes_per_token)
        if toggles.fp8_activations and s.gemm_input:
            b = s.values_per_token * (1 + FP32 / fp8_block)
            fp8 += s.values_per_token
        total += b
        if s.recomputable:
            recomputable += b
    return total, recomputable, fp8


def _kept(s: Saved, t: Toggles) -> bool:
    if s.role == "situ_naive":
        return not t.fused_situ
    if s.role == "situ_fused":
        return t.fused_situ
    if s.role == "dispatch_copy":
        return not t.dispatch_recompute
    if s.role == "expert_output":
        return not t.moe_backward_rewrite
    return True


def balance_moved_bytes(saved_bytes, held: float, balanced: float):  # noqa: ANN001, ANN201 - float or array
    """Activation balancing (seed 001): a rank holding `held` in-flight microbatches keeps the average `balanced`
    and sends the excess share of each microbatch's saved bytes to another rank and back: 2 S max(0, 1 - avg/n)."""
    return 2 * saved_bytes * max(0.0, 1 - balanced / held)


def newton_schulz_flops(rows: int, cols: int, iterations: int = 5) -> int:
    """Muon Newton-Schulz on an [r, c] matrix (r <= c): iterations * (4 r^2 c + 2 r^3) (seed 002)."""
    r, c = min(rows, cols), max(rows, cols)
    return iterations * (4 * r * r * c + 2 * r ** 3)


def newton_schulz_bytes(rows: int, cols: int) -> int:
    """BF16 working set of one Newton-Schulz: X and the next X [r, c], A = X X^T and B [r, r]."""
    r, c = min(rows, cols), max(rows, cols)
    return BF16 * (2 * r * c + 2 * r * r)


def _hier(total: np.ndarray, n: int, a: int) -> tuple[np.ndarray, np.ndarray]:
    nvl, nic = comm.hierarchical_split(1.0, n, a)
    return total * nvl, total * nic


def coefficients(shape: Shape, model: ModelSpec, cluster: ClusterSpec) -> Coefficients:
    return _coefficients(shape, model.model_dump_json(), cluster.model_dump_json())


@dataclass(frozen=True)
class _Static:
    """Shape-independent per-layer arrays of one model (length L + 2)."""

    pn_muon: np.ndarray
    p_adam: np.ndarray
    p_routed: np.ndarray
    active: np.ndarray
    attn: np.ndarray
    scan: np.ndarray
    moe: np.ndarray
    ns_routed_all: np.ndarray
    """Newton-Schulz FLOPs of all of a layer's routed matrices (every expert)."""
    ns_nonrouted: np.ndarray
    ns_ws: np.ndarray
    head_active: int


@lru_cache(maxsize=16)
def _static(model_json: str) -> _Static:
    return _build_static(model_json)


# The cached entry points are thin wrappers so that the bodies stay plain functions (mutation testing,
# bench/mutation.md, only mutates undecorated functions).
def _build_static(model_json: str) -> _Static:
    model = ModelSpec.model_validate_json(model_json)
    st: Structure = structure_of(model)
    blocks: list[list[Block]] = [*st.layers, st.first, st.last]

    def per(fn) -> np.ndarray:  # noqa: ANN001
        return np.array([float(sum(fn(b) for b in bl)) for bl in blocks])

    n = len(blocks)
    ns_r, ns_n, ns_ws = np.zeros(n), np.zeros(n), np.zeros(n)
    for i, bl in enumerate(blocks):
        for t, count in st.muon_matrices(bl):
            rows, cols = t.shape
            if t.routed:
                ns_r[i] += newton_schulz_flops(rows, cols) * count
            else:
                ns_n[i] += newton_schulz_flops(rows, cols) * count
            ns_ws[i] = max(ns_ws[i], newton_schulz_bytes(rows, cols))
    return _Static(
        pn_muon=per(lambda b: b.params("muon", routed=False)), p_adam=per(lambda b: b.params("adamw")),
        p_routed=per(lambda b: b.params(routed=True)), active=per(lambda b: b.active_matrix_params),
        attn=per(lambda b: b.attention_flops_per_token_per_doc_token), scan=per(lambda b: b.scan_flops_per_token),
        moe=per(lambda b: b.moe_layers), ns_routed_all=ns_r, ns_nonrouted=ns_n, ns_ws=ns_ws,
        head_active=sum(t.active_matrix_params for t in st.last[0].tensors),
    )


@lru_cache(maxsize=512)
def _saved(model_json: str, tokens: int, toggles: Toggles, fp8_block: int) -> tuple[np.ndarray, ...]:
    return _build_saved(model_json, tokens, toggles, fp8_block)


def _build_saved(model_json: str, tokens: int, toggles: Toggles, fp8_block: int) -> tuple[np.ndarray, ...]:
    """(saved, recomputable, FP8-stored values) per microbatch for each layer and edge."""
    st = structure_of(ModelSpec.model_validate_json(model_json))
    blocks: list[list[Block]] = [*st.layers, st.first, st.last]
    out = np.zeros((3, len(blocks)))
    for i, bl in enumerate(blocks):
        for b in bl:
            out[:, i] += np.array(saved_per_token(b, toggles, fp8_block)) * tokens
    return out[0], out[1], out[2]


@lru_cache(maxsize=4096)
def _placement(gpus: int, p: int, c: int, e: int, fe: int, fd: int, domain: int) -> comm.Placement:
    return comm.placement(gpus, p, c, e, fe, fd, domain)


@lru_cache(maxsize=8192)
def _coefficients(shape: Shape, model_json: str, cluster_json: str) -> Coefficients:
    return _build_coefficients(shape, model_json, cluster_json)


def _build_coefficients(shape: Shape, model_json: str, cluster_json: str) -> Coefficients:
    model = ModelSpec.model_validate_json(model_json)
    cluster = ClusterSpec.model_validate_json(cluster_json)
    sa = _static(model_json)
    tg = shape.toggles
    L, n = model.num_layers, model.num_layers + 2
    T, d = shape.tokens, model.hidden_size
    e, fe, fd = shape.ep, shape.expert_fsdp, shape.dense_fsdp
    full = shape.recompute == Recompute.FULL
    pn_muon, p_adam, p_routed = sa.pn_muon, sa.p_adam, sa.p_routed
    pn = pn_muon + p_adam
    # Seed 000: resident parameters per GPU = D / f_d + E / (e * f_e); BF16 view = 2 (D + E / e).
    res_muon = pn_muon / fd + p_routed / (e * fe)
    res_adam = p_adam / fd
    resident = res_muon + res_adam
    view = pn + p_routed / e

    zero2 = tg.pipeline_zero2_host_grads
    master = 4 * resident
    grads = np.zeros(n) if zero2 else 4 * resident
    host_grads = 4 * resident if zero2 else np.zeros(n)
    optimizer = 4 * res_muon + 8 * res_adam
    bf16_view = 2 * view
    moonep_slots = 2 * p_routed / e if tg.moonep else np.zeros(n)
    accumulate = shape.fsdp_lifecycle == FsdpLifecycle.ACCUMULATE
    grad_accum = 4 * view if accumulate else np.zeros(n)
    chunk_grad_buffer = 4 * view

    # Saved-for-backward bytes per microbatch (only the activation toggles matter for the cache key).
    act_toggles = Toggles(fp8_activations=tg.fp8_activations, fused_situ=tg.fused_situ,
                          dispatch_recompute=tg.dispatch_recompute, moe_backward_rewrite=tg.moe_backward_rewrite)
    saved, recomputable, fp8_values = _saved(model_json, T, act_toggles, shape.fp8_block_size)
    layer = np.arange(n) < L
    stream = T * d * BF16
    if shape.recompute == Recompute.NONE:
        act, recompute_ws = saved.copy(), np.zeros(n)
    elif shape.recompute == Recompute.SELECTIVE:
        act, recompute_ws = saved - recomputable, recomputable.copy()
    else:
        # Full recompute keeps one BF16 [T, d] layer input per layer; the edges are not checkpointed.
        act = np.where(layer, stream, saved)
        recompute_ws = np.where(layer, saved, 0.0)
    # Unsharded BF16 gradient of the layer, live until its reduce-scatter (per-microbatch lifecycle).
    grad_transient = np.zeros(n) if accumulate else (
        2 * pn * (fd > 1) + 2 * (p_routed / e) * (fe > 1))
    grad_streams = np.where(layer, 2 * stream, 0.0)
    working_set = recompute_ws + grad_transient + grad_streams

    ar = model.attn_res
    if ar is not None:
        b = np.arange(L + 1)
        r_at = (b * ar.sublayers_per_layer) // ar.block_size
        closes = np.concatenate([np.diff(r_at), [0, 0]]).astype(float)
    else:
        closes = np.zeros(n)
    moe = sa.moe

    # Muon Newton-Schulz per update: a rank orthogonalizes its share of whole matrices.
    ns_flops_routed = sa.ns_routed_all / (e * fe)
    ns_flops = ns_flops_routed + sa.ns_nonrouted / fd
    ns_ws = sa.ns_ws

    # ---------------------------------------------------------------- per-microbatch work
    active, attn, scan = sa.active, sa.attn, sa.scan
    s_eff = min(shape.document_length, shape.context)
    rc_factor = 4 / 3 if full else 1.0
    fwd_bwd = T * (6 * active + attn * s_eff + scan)
    tensor_flops = np.where(layer, fwd_bwd * rc_factor, fwd_bwd)
    if tg.fused_cross_entropy:
        # Chunked cross-entropy recomputes each chunk's logits in backward: one more LM-head forward.
        tensor_flops[L + 1] += 2 * T * sa.head_active
    model_flops_per_token = float(6 * active.sum() + attn[:L].sum() * s_eff)

    passes = 4 if full else 3
    hbm = passes * BF16 * view                          # weights read per pass
    hbm = hbm + 2 * (act + recompute_ws)                # saved activations written and read
    hbm = hbm + BF16 * view + 2 * FP32 * (view if accumulate else resident)  # BF16 grads, FP32 RMW
    if tg.fp8_activations:
        hbm = hbm + 2 * BF16 * fp8_values               # quantize reads BF16, dequantize writes BF16
    if tg.moe_backward_rewrite and model.moe is not None:
        hbm = hbm + moe * T * model.moe.experts_per_token * model.moe.expert_intermediate_size * BF16

    domain = min(shape.domain_gpus_used or cluster.nvlink_domain_gpus, cluster.nvlink_domain_gpus)
    pl = _placement(shape.gpus, shape.pp, shape.cp, e, fe, fd, domain)
    nvl = np.zeros(n)
    nic = np.zeros(n)
    routing_map = ep_buffers = 0.0
    n_ag = 0
    if model.moe is not None:
        m = model.moe
        exch = comm.ep_exchanges(full, tg.dispatch_recompute)
        if tg.ep_dedup:
            remote = comm.ep_remote_copies_dedup(m.num_experts, m.experts_per_token, e)
            cross = comm.ep_cross_domain_copies_dedup(m.num_experts, m.experts_per_token, e, pl.ep_local)
        else:
            remote = comm.ep_remote_copies(m.experts_per_token, e)
            cross = comm.ep_cross_domain_copies(m.experts_per_token, e, pl.ep_local)
        per_copy = comm.ep_payload_bytes(exch, T, m.latent_size, 1.0)
        nvl = nvl + moe * per_copy * (remote - cross)
        nic = nic + moe * per_copy * cross
        n_ag = comm.routing_map_allgathers_per_layer(full)
        rmap = comm.routing_map_bytes(T, m.num_experts)
        nvl = nvl + moe * n_ag * rmap * (pl.ep_local - 1)
        nic = nic + moe * n_ag * rmap * (e - pl.ep_local)
        routing_map = float(e * rmap)
        ep_buffers = float(2 * T * m.experts_per_token * m.latent_size * BF16)
    if not accumulate:
        # Per-microbatch FP32 reduce-scatter of the gradients: 4 P (1 - 1/n), hierarchical.
        a, b_ = _hier(4 * pn, fd, pl.dense_fsdp_local)
        c, d_ = _hier(4 * p_routed / e, fe, pl.expert_fsdp_local)
        nvl, nic = nvl + a + c, nic + b_ + d_

    host = np.zeros(n)
    if tg.activation_offload:
        host = host + 2 * act                            # out in forward, back in backward
    if zero2:
        host = host + FP32 * resident                    # gradient shard accumulated on the host

    gb = 1e9
    time = {
        "tensor": tensor_flops / (cluster.bf16_tflops * 1e12),
        "hbm": hbm / (cluster.hbm_gbps * gb),
        "nvlink": nvl / (cluster.nvlink_gbps * gb),
        "nic": nic / (cluster.nic_gbps * gb),
        "host_link": host / (cluster.host_link_gbps * gb),
    }

    # ---------------------------------------------------------------- per-update work
    up_hbm = (2 * FP32 + FP32 + 2 * FP32) * res_muon + (2 * FP32 + FP32 + 4 * FP32) * res_adam
    # master r/w, grad read, momentum r/w (AdamW: two moments r/w)
    up_nvl, up_nic = _hier(2 * pn, fd, pl.dense_fsdp_local)     # BF16 view refresh all-gather
    a, b_ = _hier(2 * p_routed / e, fe, pl.expert_fsdp_local)
    up_nvl, up_nic = up_nvl + a, up_nic + b_
    if accumulate:
        a, b_ = _hier(4 * pn, fd, pl.dense_fsdp_local)
        c, d_ = _hier(4 * p_routed / e, fe, pl.expert_fsdp_local)
        up_nvl, up_nic = up_nvl + a + c, up_nic + b_ + d_
    if tg.p2p_muon:
        # Pull the other shards of the matrices this rank orthogonalizes: 2 (P / n)(1 - 1/n) per group.
        a, b_ = _hier(2 * pn / fd, fd, pl.dense_fsdp_local)
        c, d_ = _hier(2 * p_routed / (e * fe), fe, pl.expert_fsdp_local)
        up_nvl, up_nic = up_nvl + a + c, up_nic + b_ + d_
    up_host = FP32 * resident if zero2 else np.zeros(n)
    update = {
        "tensor": ns_flops / (cluster.bf16_tflops * 1e12),
        "hbm": up_hbm / (cluster.hbm_gbps * gb),
        "nvlink": up_nvl / (cluster.nvlink_gbps * gb),
        "nic": up_nic / (cluster.nic_gbps * gb),
        "host_link": up_host / (cluster.host_link_gbps * gb),
    }

    v_tokens = min(T, shape.ce_chunk_tokens) if tg.fused_cross_entropy else T
    logits = float(v_tokens * model.vocab_size * (BF16 + FP32))
    logits_formula = (f"{v_tokens} tokens x vocab {model.vocab_size} x (2 B BF16 logits + 4 B FP32 softmax)"
                      + (" (one cross-entropy chunk)" if tg.fused_cross_entropy else ""))

    comps = tuple(inflight_compositions(shape.pp, shape.vp, shape.microbatches, r) for r in range(shape.pp))
    balanced = None
    if tg.balance_activations:
        balanced = float(np.mean([max(sum(c) for c in cr) for cr in comps]))

    pp_spb = tuple(
        1 / (cluster.nvlink_gbps * gb) if hop else 1 / (cluster.nic_gbps * gb) for hop in pl.pp_hop_in_domain
    )
    return Coefficients(
        shape=shape, n_layers=L, tokens=T, hidden=d,
        master=master, grads=grads, optimizer=optimizer, bf16_view=bf16_view, moonep_slots=moonep_slots,
        grad_accum=grad_accum, chunk_grad_buffer=chunk_grad_buffer, host_grads=host_grads,
        act=act, working_set=working_set, recompute_ws=recompute_ws, grad_transient=grad_transient,
        closes=closes, moe=moe, view_params=view, resident_params=resident, ns_working_set=ns_ws, ns_flops=ns_flops,
        ns_flops_routed=ns_flops_routed, routing_map_allgathers_per_layer=n_ag,
        time=time, update=update, tensor_flops=tensor_flops, model_flops_per_token=model_flops_per_token,
        stream_bytes=stream, ep_buffers=0.0 if tg.moonep else ep_buffers,
        moonep_buffers=ep_buffers if tg.moonep else 0.0, routing_map=routing_map,
        logits=logits, logits_formula=logits_formula, compositions=comps, balanced_inflight=balanced,
        placement=pl, slots=schedule_slots(shape.pp, shape.vp, shape.microbatches),
        pp_seconds_per_byte=pp_spb, pp_on_nvlink=pl.pp_hop_in_domain,
        balance_resource="nvlink" if pl.pipeline_in_domain else "nic",
        balance_seconds_per_byte=1 / ((cluster.nvlink_gbps if pl.pipeline_in_domain else cluster.nic_gbps) * gb),
    )
