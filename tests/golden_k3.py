"""An independent hand model of the K3 ledger and step time, written from the spec sheets (model-k3.md, cost-model.md,
clusters.md) for the golden tests. It does not import k3opt: every figure below is typed from the spec's tables or
derived from the shapes, so a wrong coefficient in k3opt disagrees with it instead of agreeing by construction.

Per-layer parameter figures are model-k3.md section 3 (the spec sheet's own per-unit counts); the saved-for-backward
inventory is the one cost-model.md section 2 itemizes, written here per token from the tensor shapes and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from math import comb

# ---------------------------------------------------------------------------------- model-k3.md, sections 1 and 3
D_MODEL, N_LAYERS, VOCAB = 7168, 93, 163840
EXPERTS, TOP_K, LATENT, EXPERT_FF, SHARED_FF, DENSE_FF = 896, 16, 3584, 3072, 6144, 33792
KDA_H, KDA_DK, KDA_RANK, KDA_CHUNK = 96, 128, 128, 64
MLA_H, MLA_QK, MLA_V = 96, 128 + 64, 128
BANK = 9  # AttnRes bank representatives (seed 001, K3 paper's memory-efficient training ledger)

KDA_MUON, KDA_ADAM, KDA_ACTIVE = 442_892_288, 848_096, 443_580_416
MLA_MUON, MLA_ADAM, MLA_ACTIVE = 232_194_048, 2_048, 232_194_048
MOE_MUON, MOE_ADAM, MOE_ACTIVE = 189_923_328, 3_584, 189_923_328          # router + latent + shared (non-routed)
ROUTED, ROUTED_ACTIVE = 29_595_009_024, 528_482_304                        # 896 experts; 16 of them per token
DENSE_MUON = DENSE_ACTIVE = 726_663_168
VEC_ADAM, VEC0_ADAM = 43_008, 28_672
EMBED = HEAD = 1_174_405_120
VISION = 401_214_464 + 46_144_512
HEAD_VEC = 21_504


def is_mla(i: int) -> bool:
    """MLA at i % 4 == 3 for i < 92, plus i = 92 (model-k3.md section 1)."""
    return i == 92 or i % 4 == 3


def ns(rows: int, cols: int) -> int:
    """Muon Newton-Schulz, 5 iterations of 4 r^2 c + 2 r^3 with r <= c (cost-model.md section 3)."""
    r, c = min(rows, cols), max(rows, cols)
    return 5 * (4 * r * r * c + 2 * r**3)


def ns_ws(rows: int, cols: int) -> int:
    """BF16 Newton-Schulz working set: X and the next X [r, c], X X^T and B [r, r]."""
    r, c = min(rows, cols), max(rows, cols)
    return 2 * (2 * r * c + 2 * r * r)


# Muon matrices per unit, from model-k3.md section 2 ([out, in]).
KDA_MATS = [(12288, 7168)] * 4 + [(7168, 12288), (128, 7168), (12288, 128)]
MLA_MATS = [(1536, 7168), (18432, 1536), (576, 7168), (24576, 512), (12288, 7168), (7168, 12288)]
DENSE_MATS = [(33792, 7168)] * 2 + [(7168, 33792)]
MOE_MATS = [(896, 7168), (3584, 7168), (7168, 3584), (6144, 7168), (6144, 7168), (7168, 6144)]
EXPERT_MATS = [(3072, 3584), (3072, 3584), (3584, 3072)]


# ------------------------------------------------------------------ saved-for-backward bytes per token, by shape
# Each entry: (values per token, bytes per value, GEMM input (FP8-storable), recomputable by selective recompute).
def _norm() -> list[tuple[int, int, bool, bool]]:
    # RMSNorm keeps its BF16 input, its FP32 rstd, and its BF16 output (the next GEMM's input).
    return [(D_MODEL, 2, False, False), (1, 4, False, False), (D_MODEL, 2, True, True)]


def _attn_res() -> list[tuple[int, int, bool, bool]]:
    return [(BANK, 4, False, False)]  # FP32 scores over the 9 bank representatives


def _situ(rows: int, width: int, fused: bool) -> list[tuple[int, int, bool, bool]]:
    # Streaming SiTU in K3 RL: naive autograd keeps 6 FP32 [R, H]; the fused op keeps the BF16 [R, 2H] input.
    return [(2 * rows * width, 2, False, False)] if fused else [(6 * rows * width, 4, False, False)]


def kda_saved() -> list[tuple[int, int, bool, bool]]:
    hd = KDA_H * KDA_DK  # 12288
    return _norm() + _attn_res() + [
        (3 * hd, 2, False, False),        # q, k, v before the short conv
        (3 * hd, 2, False, True),         # q, k, v after the short conv (element-wise, recomputable)
        (KDA_RANK, 2, True, False),       # low-rank decay f_a output (input of f_b)
        (hd, 2, False, False),            # decay gate
        (KDA_H, 4, False, False),         # beta, FP32 per head
        (hd, 2, False, False),            # output gate
        (hd, 2, False, False),            # scan output
        (hd, 2, True, True),              # gated-norm output (input of o_proj)
    ]


def mla_saved() -> list[tuple[int, int, bool, bool]]:
    return _norm() + _attn_res() + [
        (1536, 2, False, False), (1536, 2, True, True),      # q_a output, its norm (input of q_b)
        (576, 2, False, False), (512, 2, True, True),        # kv_a output, kv_a norm (input of kv_b)
        (MLA_H * MLA_QK, 2, False, False),                   # q
        (MLA_H * MLA_QK, 2, False, False),                   # k
        (MLA_H * MLA_V, 2, False, False),                    # v
        (MLA_H * MLA_V, 2, False, False),                    # attention output
        (MLA_H, 4, False, False),                            # softmax log-sum-exp
        (MLA_H * MLA_V, 2, False, False),                    # sigmoid output gate
        (MLA_H * MLA_V, 2, True, True),                      # gated output (input of o_proj)
    ]


def dense_saved(fused: bool) -> list[tuple[int, int, bool, bool]]:
    return _norm() + _attn_res() + _situ(1, DENSE_FF, fused) + [(DENSE_FF, 2, True, True)]


def moe_saved(fused: bool, dispatch_recompute: bool, rewrite: bool) -> list[tuple[int, int, bool, bool]]:
    items = _norm() + _attn_res() + [
        (EXPERTS, 4, False, False),             # router scores FP32
        (TOP_K, 4, False, False),               # top-k weights FP32
        (TOP_K, 8, False, False),               # top-k indices INT64
        (LATENT, 2, False, False),              # latent down output
        (LATENT, 2, False, True),               # latent norm output
    ]
    if not dispatch_recompute:
        items.append((TOP_K * LATENT, 2, True, False))   # 16 dispatched copies of the latent (seed 001: 57,344)
    items += _situ(TOP_K, EXPERT_FF, fused) + [(TOP_K * EXPERT_FF, 2, True, True)]
    if not rewrite:
        items.append((TOP_K * LATENT, 2, False, False))  # 16 expert outputs (seed 001: 57,344)
    items.append((LATENT, 2, True, False))               # combined latent (input of latent up)
    items += _situ(1, SHARED_FF, fused) + [(SHARED_FF, 2, True, True)]
    return items


EMBED_SAVED = [(1, 8, False, False)]           # INT64 token ids
HEAD_SAVED = _norm()                            # final norm before the LM head


def saved_bytes(items, fp8: bool, block: int = 128) -> tuple[Fraction, Fraction, int]:  # noqa: ANN001
    """(all, recomputable, FP8-stored values) per token. FP8: 1 byte + one FP32 scale per `block` values."""
    total = rec = Fraction(0)
    fp8_values = 0
    for values, width, gemm, recomputable in items:
        b = Fraction(values * width)
        if fp8 and gemm:
            b = values * (1 + Fraction(4, block))
            fp8_values += values
        total += b
        rec += b if recomputable else 0
    return total, rec, fp8_values


# ----------------------------------------------------------------------------------------- one layer or edge
@dataclass
class Unit:
    d_muon: int = 0
    d_adam: int = 0
    routed: int = 0
    active: int = 0          # learned matrix parameters per token
    attn: int = 0            # MLA causal FLOPs per token per document token
    scan: int = 0            # KDA chunked-scan training FLOPs per token
    moe: int = 0
    ns_nonrouted: int = 0
    ns_routed_all: int = 0
    ns_ws: int = 0
    saved: list = field(default_factory=list)
    is_layer: bool = True


def layer_unit(i: int, t) -> Unit:  # noqa: ANN001 - toggles
    u = Unit()
    if is_mla(i):
        u.d_muon += MLA_MUON
        u.d_adam += MLA_ADAM
        u.active += MLA_ACTIVE
        u.attn = 3 * MLA_H * (MLA_QK + MLA_V)      # half of the causal 2 x 2 S H (d_qk + d_v), times 3 (fwd + bwd)
        mats, sv = MLA_MATS, mla_saved()
    else:
        u.d_muon += KDA_MUON
        u.d_adam += KDA_ADAM
        u.active += KDA_ACTIVE
        # chunked delta rule per head: C (4 dk + 3 dv) intra-chunk + 6 dk dv inter-chunk, times 3 for training
        u.scan = 3 * KDA_H * (KDA_CHUNK * (4 * KDA_DK + 3 * KDA_DK) + 6 * KDA_DK * KDA_DK)
        mats, sv = KDA_MATS, kda_saved()
    if i == 0:
        u.d_muon += DENSE_MUON
        u.active += DENSE_ACTIVE
        u.d_adam += VEC0_ADAM
        mats = mats + DENSE_MATS
        sv = sv + dense_saved(t.fused_situ)
    else:
        u.d_muon += MOE_MUON
        u.d_adam += MOE_ADAM + VEC_ADAM
        u.routed = ROUTED
        u.active += MOE_ACTIVE + ROUTED_ACTIVE
        u.moe = 1
        mats = mats + MOE_MATS
        u.ns_routed_all = EXPERTS * sum(ns(r, c) for r, c in EXPERT_MATS)
        sv = sv + moe_saved(t.fused_situ, t.dispatch_recompute, t.moe_backward_rewrite)
    u.ns_nonrouted = sum(ns(r, c) for r, c in mats)
    u.ns_ws = max(ns_ws(r, c) for r, c in mats + (EXPERT_MATS if u.moe else []))
    u.saved = sv
    return u


def first_edge() -> Unit:
    return Unit(d_adam=EMBED + VISION, saved=EMBED_SAVED, is_layer=False)


def last_edge() -> Unit:
    return Unit(d_adam=HEAD + HEAD_VEC, active=HEAD, saved=HEAD_SAVED, is_layer=False)


# ------------------------------------------------------------------------------------------------ the layout
@dataclass
class Cluster:
    bf16_tflops: float
    hbm_gbps: float
    nvlink_gbps: float
    nic_gbps: float
    host_link_gbps: float


@dataclass
class Golden:
    gpus: int
    pp: int
    vp: int
    cp: int
    ep: int
    fe: int
    fd: int
    m: int
    rows: int
    context: int
    doc: int
    split: list[int]
    recompute: str
    accumulate: bool
    t: object                          # the layout's k3opt.Toggles (read as plain booleans)
    a_ep: int                          # EP ranks per NVLink domain (placement, derived in the test)
    a_dense: int
    a_expert: int
    pp_nvlink: list[bool]              # is the hop r -> r + 1 inside one domain
    cluster: Cluster
    pipeline_in_domain: bool = False   # all PP ranks of a replica in one domain (balancing then uses NVLink)
    fp8_block: int = 128               # values per FP32 scale of FP8 storage
    ce_chunk: int = 1024               # tokens per chunk of the chunked cross-entropy
    offload_layers: int = 2            # layers whose saved set stays on the GPU under offload


def same_bytes(got: int, want) -> bool:  # noqa: ANN001 - Fraction or int
    """k3opt rounds each ledger term to whole bytes once: within half a byte of the exact value (plus float noise)."""
    return abs(got - float(want)) <= 0.5 + 1e-12 * abs(float(want))


def hier(size: float, n: int, a: int) -> tuple[float, float]:
    """Two-level collective (cost-model.md section 3): NVLink S (1 - 1/a); NIC (S/a)(1 - a/n); nothing if n = 1."""
    if n <= 1:
        return 0.0, 0.0
    a = min(a, n)
    return size * (1 - 1 / a), size / a * (1 - a / n)


def inflight_vectors(p: int, v: int, m: int, r: int) -> list[tuple[int, ...]]:
    """Held chunk-microbatches per local chunk for every steady-state moment of rank r.
    1F1B: min(M, p - r) (K3 memory lab). Interleaved (Megatron): warmup W = min(2(p - r - 1) + (v - 1) p + 1, v M)
    forwards; the q-th forward runs local chunk (q // p) mod v, the q-th backward chunk v - 1 - (q // p) mod v;
    after W + t forwards, t backwards are done."""
    if v == 1:
        return [(min(m, p - r),)]
    w = min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)
    out = []
    for t in range(v * m - w + 1):
        held = [0] * v
        for q in range(w + t):
            held[(q // p) % v] += 1
        for q in range(t):
            held[v - 1 - (q // p) % v] -= 1
        out.append(tuple(held))
    return out


def residuals(b: int) -> int:
    """AttnRes residual blocks closed before layer boundary b: 2 sublayers per layer, blocks of 12 sublayers."""
    return (2 * b) // 12


def golden(g: Golden) -> dict:
    """Per-rank ledger (bytes), per-microbatch and per-update seconds per resource, and the step components."""
    t = g.t
    T = g.rows * g.context // g.cp
    stream = T * D_MODEL * 2                 # one BF16 [T, d] stream
    k = g.pp * g.vp
    bounds, s = [], 0
    for n in g.split:
        bounds.append((s, s + n))
        s += n
    e, fe, fd = g.ep, g.fe, g.fd
    full, selective = g.recompute == "full", g.recompute == "selective"
    c = g.cluster

    def per_unit(u: Unit) -> dict:
        pn = u.d_muon + u.d_adam
        res_muon = Fraction(u.d_muon, fd) + Fraction(u.routed, e * fe)     # K3 memory lab: D/f_d + E/(e f_e)
        res_adam = Fraction(u.d_adam, fd)
        resident = res_muon + res_adam
        view = pn + Fraction(u.routed, e)                                  # BF16 view 2 (D + E/e)
        sv, rec, fp8v = saved_bytes(u.saved, t.fp8_activations, g.fp8_block)
        sv, rec = sv * T, rec * T
        if g.recompute == "none":
            act, rws = sv, Fraction(0)
        elif selective:
            act, rws = sv - rec, rec
        else:
            act, rws = (Fraction(stream), sv) if u.is_layer else (sv, Fraction(0))
        grad_tr = 0 if g.accumulate else 2 * pn * (fd > 1) + 2 * Fraction(u.routed, e) * (fe > 1)
        ws = rws + grad_tr + (2 * stream if u.is_layer else 0)
        # tensor cores: 6 active T + MLA contractions at the effective document length + KDA scan; + a forward
        flops = T * (6 * u.active + u.attn * min(g.doc, g.context) + u.scan)
        if full and u.is_layer:
            flops = flops * Fraction(4, 3)
        if t.fused_cross_entropy and not u.is_layer and u.active:
            flops += 2 * T * HEAD      # chunked CE recomputes the LM-head forward in backward
        hbm = (4 if full else 3) * 2 * view + 2 * (act + rws) + 2 * view + 8 * (view if g.accumulate else resident)
        if t.fp8_activations:
            hbm += 4 * fp8v * T
        if t.moe_backward_rewrite:
            hbm += u.moe * T * TOP_K * EXPERT_FF * 2
        nvl = nic = 0.0
        if u.moe:
            exch = 6 if full else (5 if t.dispatch_recompute else 4)
            if t.ep_dedup:
                hit = 1 - comb(EXPERTS - EXPERTS // e, TOP_K) / comb(EXPERTS, TOP_K)
                remote, cross = (e - 1) * hit, (e - g.a_ep) * hit
            else:
                remote, cross = TOP_K * (1 - 1 / e), TOP_K * (1 - g.a_ep / e)
            per_copy = exch * T * LATENT * 2
            nvl += per_copy * (remote - cross)
            nic += per_copy * cross
            n_ag = 2 if full else 1
            nvl += n_ag * T * EXPERTS * (g.a_ep - 1)
            nic += n_ag * T * EXPERTS * (e - g.a_ep)
        if not g.accumulate:
            for size, n, a in ((4 * pn, fd, g.a_dense), (4 * u.routed / e, fe, g.a_expert)):
                x, y = hier(size, n, a)
                nvl, nic = nvl + x, nic + y
        stall = 0.0
        if g.cp > 1 and u.is_layer:
            # Context parallelism, both layouts here keep a CP group inside one NVLink domain.
            cpn = g.cp - 1
            if u.attn:
                # MLA on TransformerEngine's p2p KV ring: per token the full per-head K and V, 96 heads x
                # (128 nope + 64 rope + 128 value) x 2 B = 61,440 B; forward sends its chunk C - 1 times, backward
                # KV, then (KV, dKV) pairs, then dKV: 3 (C - 1) chunks (+ 1/3 more under full recompute's replay).
                # The ring overlaps the layer's own attention; only the excess stalls the compute stream.
                ring = 3 * cpn * T * 61_440 * (Fraction(4, 3) if full else 1)
                nvl += float(ring)
                ws += 4 * T * 61_440          # two alternating (KV, dKV) receive buffers of the local chunk
                attention = T * u.attn * min(g.doc, g.context)
                stall = max(0.0, float(ring) / (c.nvlink_gbps * 1e9) - float(attention) / (c.bf16_tflops * 1e12))
            elif u.scan:
                # KDA on FLA's KCP: one FP32 [96 heads, 128, 128 + 128] state-and-transition tensor per rank,
                # 12,582,912 B, all-gathered in forward and in backward (+1 forward under full recompute); the
                # gather is synchronous, so all of it stalls compute; the gather buffer holds C of them.
                state = 4 * 96 * 128 * (128 + 128)
                got = 2 * cpn * state * (Fraction(3, 2) if full else 1)
                nvl += float(got)
                ws += g.cp * state
                stall = float(got) / (c.nvlink_gbps * 1e9)
        host = 0.0
        if t.activation_offload:
            host += 2 * float(act)
        if t.pipeline_zero2_host_grads:
            host += 4 * float(resident)
        up_nvl = up_nic = 0.0
        groups = [(2 * pn, fd, g.a_dense), (2 * u.routed / e, fe, g.a_expert)]
        if g.accumulate:
            groups += [(4 * pn, fd, g.a_dense), (4 * u.routed / e, fe, g.a_expert)]
        if t.p2p_muon:
            # P2P Muon pulls the shards of the Muon matrices only (K3's routed experts are all Muon).
            groups += [(2 * u.d_muon / fd, fd, g.a_dense), (2 * u.routed / (e * fe), fe, g.a_expert)]
        for size, n, a in groups:
            x, y = hier(size, n, a)
            up_nvl, up_nic = up_nvl + x, up_nic + y
        ns_flops = Fraction(u.ns_routed_all, e * fe) + Fraction(u.ns_nonrouted, fd)
        return {
            "master": 4 * resident,
            "grads": 0 if t.pipeline_zero2_host_grads else 4 * resident,
            "host_grads": 4 * resident if t.pipeline_zero2_host_grads else 0,
            "optimizer": 4 * res_muon + 8 * res_adam,
            "bf16_view": 2 * view,
            "moonep_slots": 2 * Fraction(u.routed, e) if t.moonep else 0,
            "grad_accum": 4 * view if g.accumulate else 0,
            "chunk_grad": 4 * view, "view": view, "resident": resident,
            "res_muon": res_muon, "d_adam": u.d_adam,
            "act": act, "rws": rws, "ws": ws, "moe": u.moe, "ns_ws": u.ns_ws, "ns_flops": ns_flops,
            "ns_routed": Fraction(u.ns_routed_all, e * fe),
            "time": {"tensor": float(flops) / (c.bf16_tflops * 1e12) + stall, "hbm": float(hbm) / (c.hbm_gbps * 1e9),
                     "nvlink": nvl / (c.nvlink_gbps * 1e9), "nic": nic / (c.nic_gbps * 1e9),
                     "host_link": host / (c.host_link_gbps * 1e9)},
            "update": {"tensor": float(ns_flops) / (c.bf16_tflops * 1e12),
                       "hbm": float(20 * res_muon + 28 * res_adam) / (c.hbm_gbps * 1e9),
                       "nvlink": up_nvl / (c.nvlink_gbps * 1e9), "nic": up_nic / (c.nic_gbps * 1e9),
                       "host_link": (4 * float(resident) if t.pipeline_zero2_host_grads else 0.0)
                       / (c.host_link_gbps * 1e9)},
        }

    layer_units = [per_unit(layer_unit(i, t)) for i in range(N_LAYERS)]
    edge_first, edge_last = per_unit(first_edge()), per_unit(last_edge())

    def chunk_units(j: int) -> list[dict]:
        lo, hi = bounds[j]
        units = layer_units[lo:hi]
        if j == 0:
            units = units + [edge_first]
        if j == k - 1:
            units = units + [edge_last]
        return units

    ep_buf = 2 * T * TOP_K * LATENT * 2           # dispatch receive + combine buffers of one MoE layer
    peaks = [max(sum(v) for v in inflight_vectors(g.pp, g.vp, g.m, r)) for r in range(g.pp)]
    # Balancing across PP ranks (K3 paper's memory-efficient training ledger): every rank holds the average count.
    balanced = Fraction(sum(peaks), g.pp) if t.balance_activations else None
    ranks = []
    for r in range(g.pp):
        mine = list(range(r, k, g.pp))
        units = [u for j in mine for u in chunk_units(j)]

        def tot(key: str, units=units) -> Fraction:  # noqa: B008
            return sum((u[key] for u in units), Fraction(0))

        led = {key: tot(key) for key in ("master", "grads", "optimizer", "bf16_view", "moonep_slots", "grad_accum")}
        if t.pipeline_zero2_host_grads:
            led["grads"] = 2 * max(sum((u["chunk_grad"] for u in chunk_units(j)), Fraction(0)) for j in mine)
        has_moe = tot("moe") > 0
        led["moonep_buffers"] = ep_buf if (t.moonep and has_moe) else 0
        acts = [sum((u["act"] for u in chunk_units(j)), Fraction(0)) for j in mine]
        banks = [residuals(bounds[j][1]) * stream for j in mine]
        vecs = inflight_vectors(g.pp, g.vp, g.m, r)
        scale = balanced / peaks[r] if balanced is not None else 1
        host_act = 0
        if t.activation_offload:
            # only the current and the prefetched layer stay on the GPU; the in-flight sets live in host memory
            led["activations"] = g.offload_layers * max(u["act"] for u in units)
            host_act = max(sum(n * a for n, a in zip(h, acts, strict=True)) for h in vecs) * scale
            led["attnres_bank"] = max(sum(n * b for n, b in zip(h, banks, strict=True)) for h in vecs) * scale
            in_flight = peaks[r] * scale
        else:
            best = max(vecs, key=lambda h: sum(n * (a + b) for n, a, b in zip(h, acts, banks, strict=True)))
            led["activations"] = sum(n * a for n, a in zip(best, acts, strict=True)) * scale
            led["attnres_bank"] = sum(n * b for n, b in zip(best, banks, strict=True)) * scale
            in_flight = sum(best) * scale
        worst = max(units, key=lambda u: u["ws"])
        led["recompute_working_set"] = worst["rws"]
        led["grad_transient"] = worst["ws"] - worst["rws"]
        packets = []
        pp_time = {"nvlink": 0.0, "nic": 0.0}
        for j in mine:
            lo, hi = bounds[j]
            pin = (1 + residuals(lo)) * stream if j > 0 else 0
            pout = (1 + residuals(hi)) * stream if j < k - 1 else 0
            packets.append(pin + pout)
            for size, hop in ((pin, (r - 1) % g.pp), (pout, r)):
                link = "nvlink" if g.pp_nvlink[hop] else "nic"
                pp_time[link] += size / ((c.nvlink_gbps if link == "nvlink" else c.nic_gbps) * 1e9)
        led["pp_buffers"] = 2 * max(packets)
        led["ep_buffers"] = ep_buf if (has_moe and not t.moonep) else 0
        led["routing_map"] = e * T * EXPERTS if has_moe else 0
        v_tokens = min(T, g.ce_chunk) if t.fused_cross_entropy else T
        led["logits"] = v_tokens * VOCAB * (2 + 4) if (k - 1) in mine else 0
        ws = max(u["ns_ws"] for u in units)
        # Default policy (optim_grads_params, gathered at the update): the step all-gathers the whole BF16 group;
        # under P2P Muon the Muon matrices are pulled instead (2 x resident Muon parameters) and the AdamW
        # parameters are still all-gathered whole (2 x D_adam).
        gather = 2 * tot("res_muon") + 2 * tot("d_adam") if t.p2p_muon else 2 * tot("view")
        led["optimizer_transient"] = gather + ws
        led["quantized_weights"] = 0  # BF16 compute precision: no cached low-precision weight copies
        led["paged_stash"] = 0  # no sync-free MoE: the routed experts' saved tensors are in `activations`
        time = {res: sum(u["time"][res] for u in units) for res in ("tensor", "hbm", "nvlink", "nic", "host_link")}
        time["nvlink"] += pp_time["nvlink"]
        time["nic"] += pp_time["nic"]
        if balanced is not None and peaks[r] > balanced:
            # the excess share of each microbatch's saved bytes goes to another rank and comes back
            moved = float(2 * sum(acts) * (1 - balanced / peaks[r]))
            link = "nvlink" if g.pipeline_in_domain else "nic"
            time[link] += moved / ((c.nvlink_gbps if link == "nvlink" else c.nic_gbps) * 1e9)
        update = {res: sum(u["update"][res] for u in units) for res in time}
        formula = f"{v_tokens} tokens x vocab {VOCAB} x (2 B BF16 logits + 4 B FP32 softmax)" + (
            " (one cross-entropy chunk)" if t.fused_cross_entropy else "")
        ranks.append({"logits_formula": formula, "ledger": led, "time": time, "update": update,
                      "host": host_act + tot("host_grads"),
                      "in_flight": in_flight,
                      "residual_out": [residuals(bounds[j][1]) for j in mine if j < k - 1],
                      "packet_out": [(1 + residuals(bounds[j][1])) * stream for j in mine if j < k - 1],
                      "ns_flops": tot("ns_flops"), "ns_routed": tot("ns_routed"), "moe_layers": int(tot("moe"))})

    slowest = max(range(g.pp), key=lambda r: max(ranks[r]["time"].values()))
    stage = max(ranks[slowest]["time"].values())
    slots = g.m + (g.pp - 1) / g.vp
    update = max(max(rk["update"].values()) for rk in ranks)
    comps = {"compute": ranks[slowest]["time"]["tensor"],
             **{res: ranks[slowest]["time"][res] for res in ("hbm", "nvlink", "nic", "host_link")},
             "microbatch_work": g.m * stage, "bubble": (slots - g.m) * stage, "exposed_update": update}
    bubble = Fraction(g.pp - 1, g.vp)
    return {"bubble_overhead": bubble / g.m, "bubble_fraction": bubble / (g.m + bubble),
            "ranks": ranks, "slowest": slowest, "stage": stage, "update": update, "slots": slots,
            "components": comps, "step": slots * stage + update, "tokens_per_update": (g.gpus // (g.pp * g.cp))
            * g.m * g.rows * g.context}
