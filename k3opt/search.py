"""The CP-SAT search over layouts.

A *frame* is the parallel shape: p, v, c, e, f_e, f_d and M. A *node* is a frame with its recompute mode and FSDP
lifecycle fixed. One CP-SAT model per node decides everything else at once: the contiguous layer-to-chunk split,
the activation mode (FP8 storage, fused SiTU, MoE backward rewrite, dispatch recompute) and the rank toggles
(offload, balancing, host gradient shards, P2P Muon, chunked cross-entropy), under every rank's HBM and host
limits. Frames and nodes are explored best-first by lower bounds that tighten as they are popped: the mean
tensor work, then an exact dynamic program over contiguous stage ranges of a relaxed cost (v = 1), then that
program per activation mode with offload and balancing decided globally. The search stops with a proof once
the next bound exceeds the K-th best layout found; the bound and gap it reports are that proof.

Every coefficient comes from k3opt.coefficients (one call per mode combination); the model only sums them over
the split. Every layout returned is re-evaluated with `evaluate()`, and what is reported is that evaluation; a
disagreement beyond the integer resolution raises an error instead of being rounded away.

Resolution: memory in KiB, rounded up per layer (the solver never accepts a layout evaluate() rejects); time in
units of 100 ns, rounded up per layer; the tie-break on the worst-rank peak in MiB, then on fewer toggles.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time as _time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
from ortools.sat.python import cp_model

from k3opt.coefficients import Coefficients, Shape, balance_moved_bytes, coefficients
from k3opt.errors import InfeasibleJobError, LayoutError
from k3opt.evaluate import Evaluation, evaluate
from k3opt.schedule import schedule_slots
from k3opt.specs import (
    GIB,
    MIB,
    ClusterSpec,
    FsdpLifecycle,
    Job,
    Layout,
    ModelSpec,
    Recompute,
    Toggles,
    load_cluster,
    load_model,
)

MEM_UNIT = 1024          # bytes
TIME_UNIT = 1e-7         # seconds
PEAK_TIE_UNIT = MIB      # bytes, tie-break resolution

ACT_TOGGLES = ("fp8_activations", "fused_situ", "moe_backward_rewrite", "dispatch_recompute")
"""Toggles that change the saved-for-backward set; they form one-hot activation modes with the recompute mode."""
RANK_TOGGLES = ("activation_offload", "balance_activations", "pipeline_zero2_host_grads", "p2p_muon",
                "fused_cross_entropy", "moonep")
NEVER_CHOSEN = ("moonep",)
"""MoonEP only adds memory here: its benefit, expert-load balance, is outside the forced-balanced routing model.
It is searched only when a job requires it."""
"""Toggles that act on one rank-level term each; they are Boolean decisions of the frame model."""
FIXED_TOGGLES = ("ep_dedup",)
"""A property of the dispatcher, not a memory decision: set it with [search] require_toggles."""


@dataclass(frozen=True, order=True)
class Frame:
    """The parallel shape of a layout: everything the frame model does not decide."""

    pp: int
    vp: int
    cp: int
    ep: int
    expert_fsdp: int
    dense_fsdp: int
    microbatches: int
    gpus: int


@dataclass(frozen=True)
class PlanItem:
    layout: Layout
    evaluation: Evaluation

    @property
    def step_time_s(self) -> float:
        return self.evaluation.step.step_time_s

    @property
    def peak_bytes(self) -> int:
        return self.evaluation.peak_bytes


@dataclass
class Plan:
    """What `plan()` returns: the status, the proven bound and gap, the ranked layouts, the Pareto front."""

    job: Job
    status: str
    layouts: list[PlanItem]
    pareto: list[PlanItem]
    bound: float
    """Lower bound on the best step time (s) over the whole space; equals the best when OPTIMAL."""
    gap: float
    """(best - bound) / best."""
    frames_total: int
    frames_solved: int
    solve_time_s: float
    model_size: dict[str, int] = field(default_factory=dict)
    pareto_complete: bool = False
    """True when every frame was either dominated by its bounds or solved down to its last epsilon step."""

    def to_frame(self, which: str = "pareto"):  # noqa: ANN201 - pandas DataFrame
        """The CSV schema: one row per layout, every decision and every ledger term a column, units in names."""
        from k3opt.report import plan_frame

        return plan_frame(self.pareto if which == "pareto" and self.pareto else self.layouts)


# ------------------------------------------------------------------------------------- enumeration


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(values: list[int], allowed: list[int] | None) -> list[int]:
    return [v for v in values if allowed is None or v in allowed]


def enumerate_frames(job: Job, model: ModelSpec, gpus: int) -> list[Frame]:
    """Every frame the job allows on `gpus` GPUs (divisibility rules of the Layout model)."""
    s = job.search
    L = model.num_layers
    experts = model.moe.num_experts if model.moe else 1
    frames = []
    for p in _allowed(_divisors(gpus), s.pp):
        if p > L:
            continue
        stage = gpus // p
        max_v = max(s.vp) if s.vp else s.max_vp
        for v in _allowed(list(range(1, max_v + 1)), s.vp):
            if p * v > L or (v > 1 and p == 1):
                continue
            if s.split is not None and len(s.split) != p * v:
                continue
            for c in _allowed(_divisors(stage), s.cp if s.cp is not None else [1]):
                if (job.rows * job.context) % c:
                    continue
                dp = stage // c
                if job.tokens_per_update is not None:
                    per = dp * job.rows * job.context
                    if job.tokens_per_update % per:
                        continue
                    ms = [job.tokens_per_update // per]
                    ms = _allowed(ms, s.microbatches)
                else:
                    ms = list(s.microbatches or [])
                for e in _allowed([d for d in _divisors(stage) if experts % d == 0], s.ep):
                    for fe in _allowed(_divisors(stage // e), s.expert_fsdp):
                        for fd in _allowed(_divisors(stage), s.dense_fsdp):
                            for m in ms:
                                frames.append(Frame(p, v, c, e, fe, fd, m, gpus))
    return frames


@dataclass(frozen=True)
class ActMode:
    recompute: Recompute
    fp8_activations: bool
    fused_situ: bool
    moe_backward_rewrite: bool
    dispatch_recompute: bool

    def toggles(self) -> dict[str, bool]:
        return {t: getattr(self, t) for t in ACT_TOGGLES}


def _choices(job: Job, name: str) -> list[bool]:
    if name in job.search.require_toggles:
        return [True]
    if name in job.search.forbid_toggles:
        return [False]
    if name in FIXED_TOGGLES or name in NEVER_CHOSEN:
        return [False]
    return [False, True]


def act_modes(job: Job) -> list[ActMode]:
    recs = job.search.recompute or list(Recompute)
    return [ActMode(r, *flags) for r in recs for flags in itertools.product(*(_choices(job, t) for t in ACT_TOGGLES))]


def lifecycles(job: Job) -> list[FsdpLifecycle]:
    return job.search.fsdp_lifecycle or list(FsdpLifecycle)


def frame_shape(job: Job, f: Frame, mode: ActMode, lifecycle: FsdpLifecycle, **rank_toggles: bool) -> Shape:
    fixed = {t: t in job.search.require_toggles for t in FIXED_TOGGLES}
    tg = Toggles(**mode.toggles(), **fixed, **rank_toggles)
    return Shape(
        gpus=f.gpus, pp=f.pp, vp=f.vp, cp=f.cp, ep=f.ep, expert_fsdp=f.expert_fsdp, dense_fsdp=f.dense_fsdp,
        microbatches=f.microbatches, rows=job.rows, context=job.context,
        document_length=job.document_length or job.context, recompute=mode.recompute, fsdp_lifecycle=lifecycle,
        toggles=tg, domain_gpus_used=job.domain_gpus_used,
    )


def layout_of(job: Job, f: Frame, shape: Shape, split: list[int], name: str = "") -> Layout:
    return Layout(
        gpus=f.gpus, pp=f.pp, vp=f.vp, cp=f.cp, ep=f.ep, expert_fsdp=f.expert_fsdp, dense_fsdp=f.dense_fsdp,
        microbatches=f.microbatches, rows=job.rows, context=job.context, document_length=job.document_length,
        split=split, recompute=shape.recompute, fsdp_lifecycle=shape.fsdp_lifecycle, toggles=shape.toggles,
        reserve_gib=job.reserve_gib, domain_gpus_used=job.domain_gpus_used, model=job.model, cluster=job.cluster,
        name=name,
    )


# ------------------------------------------------------------------------------------- bounds


def frame_lower_bound(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """(step-time bound s, worst-rank peak bound bytes) over every mode and split of frame f.

    Time: the slowest rank carries at least the mean tensor-core work, and recompute 'none' without the
    chunked cross-entropy is the least work; the update is at least the mean Newton-Schulz time.
    Peak: the worst rank holds at least the mean of master + optimizer + BF16 view (gradients may live on the
    host under pipeline ZeRO-2), which no toggle removes."""
    base = ActMode(Recompute.NONE, False, False, False, False)
    cf = coefficients(frame_shape(job, f, base, FsdpLifecycle.PER_MICROBATCH), model, cluster)
    p = f.pp
    stage = float(cf.time["tensor"].sum()) / p
    update = float(cf.update["tensor"].sum()) / p
    t_lb = schedule_slots(f.pp, f.vp, f.microbatches) * stage + update
    persistent = float((cf.master + cf.optimizer + cf.bf16_view).sum())
    if "pipeline_zero2_host_grads" not in _allowed_on(job):
        persistent += float(cf.grads.sum())
    return t_lb, persistent / p


def _allowed_on(job: Job) -> set[str]:
    return {t for t in RANK_TOGGLES + ACT_TOGGLES if True in _choices(job, t)}


# ------------------------------------------------------------------------------------- frame model


def _ceil(a: np.ndarray | float, unit: float) -> np.ndarray:
    return np.ceil(np.asarray(a, dtype=float) / unit - 1e-9).astype(np.int64)


@dataclass
class FrameResult:
    frame: Frame
    status: str
    split: list[int] | None = None
    shape: Shape | None = None
    objective: int | None = None
    bound: int | None = None
    bound_step_s: float = 0.0
    variables: int = 0
    constraints: int = 0


class FrameModel:
    """One CP-SAT model: a frame's split, recompute mode, lifecycle and toggles, with every rank's ledger."""

    def __init__(self, job: Job, frame: Frame, model: ModelSpec, cluster: ClusterSpec,
                 modes: list[ActMode] | None = None, lcs: list[FsdpLifecycle] | None = None,
                 fixed_split: list[int] | None = None) -> None:
        self.job, self.f, self.model, self.cluster = job, frame, model, cluster
        self.L = model.num_layers
        self.K = frame.pp * frame.vp
        self.m = cp_model.CpModel()
        self.modes = modes or act_modes(job)
        self.lcs = lcs or lifecycles(job)
        self.cap_bytes = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
        self.fixed_split = fixed_split or job.search.split
        self._coefs()
        self._build()

    # -- coefficients -------------------------------------------------------------------------
    def _cf(self, mode: ActMode, lc: FsdpLifecycle, **tg: bool) -> Coefficients:
        return coefficients(frame_shape(self.job, self.f, mode, lc, **tg), self.model, self.cluster)

    def _coefs(self) -> None:
        m0, lc0 = self.modes[0], self.lcs[0]
        self.base = {(m, lc): self._cf(m, lc) for m in self.modes for lc in self.lcs}
        self.offload = {m: self._cf(m, lc0, activation_offload=True) for m in self.modes}
        self.z2 = self._cf(m0, lc0, pipeline_zero2_host_grads=True)
        self.p2p = {lc: self._cf(m0, lc, p2p_muon=True) for lc in self.lcs}
        self.fce = self._cf(m0, lc0, fused_cross_entropy=True)
        self.moon = self._cf(m0, lc0, moonep=True)
        self.bal = self._cf(m0, lc0, balance_activations=True)
        self.c0 = self.base[(m0, lc0)]

    # -- variables ----------------------------------------------------------------------------
    def _build(self) -> None:
        m, L, K, p = self.m, self.L, self.K, self.f.pp
        # z[i][j] (j = 1..K-1): layer i belongs to chunk j or later. Monotone in i and in j.
        self.z = [[None] + [m.new_bool_var(f"z{i}_{j}") for j in range(1, K)] + [None] for i in range(L)]
        for j in range(1, K):
            for i in range(L - 1):
                m.add_implication(self.z[i][j], self.z[i + 1][j])
            if j + 1 < K:
                for i in range(L):
                    m.add_implication(self.z[i][j + 1], self.z[i][j])
        for j in range(K):
            m.add(self._x_sum(np.ones(L, dtype=np.int64), j) >= 1)
        even = np.cumsum([L // K + (1 if j < L % K else 0) for j in range(K)])
        for j in range(1, K):
            for i in range(L):
                m.add_hint(self.z[i][j], int(i >= even[j - 1]))
        if self.fixed_split is not None:
            if sum(self.fixed_split) != L or len(self.fixed_split) != K:
                raise LayoutError(f"[search] split {self.fixed_split} does not fit p*v = {K} chunks of {L} layers")
            bounds = np.cumsum(self.fixed_split)
            for j in range(1, K):
                for i in range(L):
                    m.add(self.z[i][j] == int(i >= bounds[j - 1]))

        self.mv = {md: m.new_bool_var(f"mode{k}") for k, md in enumerate(self.modes)}
        m.add_exactly_one(self.mv.values())
        self.lv = {lc: m.new_bool_var(f"lc_{lc.value}") for lc in self.lcs}
        m.add_exactly_one(self.lv.values())
        self.tv = {}
        for t in RANK_TOGGLES:
            var = m.new_bool_var(t)
            ch = _choices(self.job, t)
            if len(ch) == 1:
                m.add(var == int(ch[0]))
            self.tv[t] = var
        self._kinds()
        # Variable bounds keep the objective inside int64: every time term is at most the sum of all per-layer
        # work on every resource under the most expensive mode, plus the toggles' rank-level costs.
        worst = max(max(float(cf.time[res].sum()) for res in cf.time) for cf in self.base.values())
        extra = max(max(float(c.time[res].sum()) for res in c.time)
                    for c in (*self.offload.values(), self.z2, self.bal, self.fce))
        pp_bytes = 2 * self.K * (1 + float(self.c0.closes.sum())) * self.c0.stream_bytes
        upd = max(max(float(c.update[res].sum()) for res in c.update) for c in (*self.p2p.values(), self.z2))
        self.time_ub = int((worst + extra + upd + pp_bytes / (self.cluster.nic_gbps * 1e9)) / TIME_UNIT) * 2 + 10**5
        self.tie_max = self.cap_bytes // PEAK_TIE_UNIT + 1
        self.ranks = [self._rank(r) for r in range(p)]
        self._objective()

    def _z(self, i: int, j: int):  # noqa: ANN202
        if j <= 0:
            return 1
        if j >= self.K:
            return 0
        return self.z[i][j]

    def _x_sum(self, a: np.ndarray, j: int) -> cp_model.LinearExprT:
        """sum_i a[i] x[i][j] with x[i][j] = z[i][j] - z[i][j+1] (layers only)."""
        terms: list = []
        const = 0
        for i in range(self.L):
            if a[i] == 0:
                continue
            for zz, sign in ((self._z(i, j), 1), (self._z(i, j + 1), -1)):
                if isinstance(zz, int):
                    const += sign * int(a[i]) * zz
                else:
                    terms.append(sign * int(a[i]) * zz)
        return sum(terms) + const if terms else const

    def _chunk(self, a: np.ndarray, j: int) -> cp_model.LinearExprT:
        """Chunk j's sum of a per-layer array, with the edges on the first and last chunks."""
        expr = self._x_sum(a[: self.L], j)
        if j == 0:
            expr = expr + int(a[self.L])
        if j == self.K - 1:
            expr = expr + int(a[self.L + 1])
        return expr

    def _rank_sum(self, a: np.ndarray, r: int) -> cp_model.LinearExprT:
        return sum(self._chunk(a, j) for j in range(r, self.K, self.f.pp))

    def _closes_before(self, j: int) -> cp_model.LinearExprT:
        """R at the start of chunk j: AttnRes residual blocks closed by layers before it."""
        closes = self.c0.closes[: self.L]
        return sum(int(closes[i]) * (1 - self._z(i, j)) for i in range(self.L) if closes[i]) if j > 0 else 0

    def _kinds(self) -> None:
        """Group layers whose max-relevant coefficients are identical, so 'max over the rank's layers' needs
        one indicator per kind and rank instead of one constraint per layer."""
        keys = []
        for i in range(self.L):
            key = [float(cf.working_set[i]) for cf in self.base.values()]
            key += [float(cf.act[i]) for cf in self.base.values()]
            key += [float(self.c0.ns_working_set[i]), float(self.c0.moe[i])]
            keys.append(tuple(key))
        uniq = sorted(set(keys))
        self.kind_of = np.array([uniq.index(k) for k in keys])
        self.kind_rep = [int(np.where(self.kind_of == k)[0][0]) for k in range(len(uniq))]

    def _has_kind(self, r: int) -> list:
        m, K, p = self.m, self.K, self.f.pp
        has = []
        for k, _ in enumerate(self.kind_rep):
            b = m.new_bool_var(f"has_r{r}_k{k}")
            for i in np.where(self.kind_of == k)[0]:
                y = sum(self._z(int(i), j) - self._z(int(i), j + 1) for j in range(r, K, p))
                m.add(b >= y)
            has.append(b)
        return has

    def _mem(self, a: np.ndarray) -> np.ndarray:
        return _ceil(a, MEM_UNIT)

    def _t(self, a: np.ndarray) -> np.ndarray:
        return _ceil(a, TIME_UNIT)

    # -- one rank -----------------------------------------------------------------------------
    def _rank(self, r: int) -> dict:
        m, K, p, L = self.m, self.K, self.f.pp, self.L
        c0, tv = self.c0, self.tv
        mine = list(range(r, K, p))
        has = self._has_kind(r)
        holds_first, holds_last = 0 in mine, (K - 1) in mine
        edges = ([L] if holds_first else []) + ([L + 1] if holds_last else [])
        mem_ub = max(self.cap_bytes, self.cluster.host_memory_bytes) // MEM_UNIT

        def var(name: str) -> cp_model.IntVar:
            return m.new_int_var(0, mem_ub, f"{name}_r{r}")

        def tvar(name: str) -> cp_model.IntVar:
            return m.new_int_var(0, self.time_ub, f"{name}_r{r}")

        # persistent -----------------------------------------------------------------------
        persistent = self._rank_sum(self._mem(c0.master + c0.optimizer + c0.bf16_view), r)
        grads = var("grads")
        m.add(grads >= self._rank_sum(self._mem(c0.grads), r)).only_enforce_if(~tv["pipeline_zero2_host_grads"])
        for j in mine:
            m.add(grads >= 2 * self._chunk(self._mem(self.z2.chunk_grad_buffer), j)).only_enforce_if(
                tv["pipeline_zero2_host_grads"])
        accum = var("accum")
        for lc in self.lcs:
            m.add(accum >= self._rank_sum(self._mem(self.base[(self.modes[0], lc)].grad_accum), r)).only_enforce_if(
                self.lv[lc])
        moon = var("moonep")
        m.add(moon >= self._rank_sum(self._mem(self.moon.moonep_slots), r)).only_enforce_if(tv["moonep"])
        moon_b = var("moonep_buf")
        moe_kinds = [k for k, rep in enumerate(self.kind_rep) if c0.moe[rep] > 0]
        has_moe = m.new_bool_var(f"hasmoe_r{r}")
        m.add(has_moe <= sum(has[k] for k in moe_kinds)) if moe_kinds else m.add(has_moe == 0)
        for k in moe_kinds:
            m.add(has_moe >= has[k])
        moon_buf = int(self._mem(np.array([self.moon.moonep_buffers]))[0])
        ep_buf = int(self._mem(np.array([c0.ep_buffers]))[0])
        rmap = int(self._mem(np.array([c0.routing_map]))[0])
        # MoonEP buffers are persistent (allocated for the run), plain EP buffers are activation-phase.
        m.add(moon_b >= moon_buf * (has_moe + tv["moonep"] - 1))
        persistent = persistent + grads + accum + moon + moon_b

        # activation phase -------------------------------------------------------------------
        comps = c0.compositions[r]
        n_peak = max(sum(c) for c in comps)
        scale_bal = (self.bal.balanced_inflight / n_peak) if self.bal.balanced_inflight else 1.0
        stream = int(self._mem(np.array([c0.stream_bytes]))[0])
        ends = []
        for j in mine:
            ends.append(self._closes_before(j + 1) if j + 1 < K else int(c0.closes[:L].sum()))
        bank = [stream * e for e in ends]
        acts = var("acts")
        host_act = var("host_act")
        off, bal = tv["activation_offload"], tv["balance_activations"]
        for md in self.modes:
            cf = self.base[(md, self.lcs[0])]
            a = self._mem(cf.act)
            chunk_act = [self._chunk(a, j) for j in mine]
            for comp in comps:
                for b_lit, sc in ((bal, scale_bal), (~bal, 1.0)):
                    tot = sum(c * (ca + bk) for c, ca, bk in zip(comp, chunk_act, bank, strict=True))
                    num, den = _ratio(sc)
                    m.add(den * acts >= num * tot).only_enforce_if([self.mv[md], ~off, b_lit])
                    host = sum(c * ca for c, ca in zip(comp, chunk_act, strict=True))
                    m.add(den * host_act >= num * host).only_enforce_if([self.mv[md], off, b_lit])
            # Offload: the resident layers' worth of the largest saved set, plus the bank, on the GPU.
            amax = var(f"amax{self.modes.index(md)}")
            for k, rep in enumerate(self.kind_rep):
                m.add(amax >= int(a[rep]) * has[k])
            for e in edges:
                m.add(amax >= int(a[e]))
            res_layers = self.base[(md, self.lcs[0])].shape.offload_resident_layers
            for comp in comps:
                for b_lit, sc in ((bal, scale_bal), (~bal, 1.0)):
                    num, den = _ratio(sc)
                    bk = sum(c * b for c, b in zip(comp, bank, strict=True))
                    m.add(den * acts >= den * res_layers * amax + num * bk).only_enforce_if([self.mv[md], off, b_lit])
        ws = var("ws")
        for md in self.modes:
            for lc in self.lcs:
                w = self._mem(self.base[(md, lc)].working_set)
                for k, rep in enumerate(self.kind_rep):
                    m.add(ws >= int(w[rep]) * has[k]).only_enforce_if([self.mv[md], self.lv[lc]])
                for e in edges:
                    m.add(ws >= int(w[e])).only_enforce_if([self.mv[md], self.lv[lc]])
        pp = var("pp")
        for j in mine:
            pin = stream * (1 + self._closes_before(j)) if j > 0 else 0
            pout = stream * (1 + (self._closes_before(j + 1))) if j < K - 1 else 0
            m.add(pp >= 2 * (pin + pout))
        epb = var("epb")
        m.add(epb >= ep_buf * (has_moe - tv["moonep"]))
        logits = 0
        if holds_last:
            lo = int(self._mem(np.array([c0.logits]))[0])
            lf = int(self._mem(np.array([self.fce.logits]))[0])
            logits = lo + (lf - lo) * tv["fused_cross_entropy"]
        act_phase = acts + ws + pp + epb + rmap * has_moe + logits

        # optimizer phase ------------------------------------------------------------------
        nsws = var("nsws")
        w = self._mem(c0.ns_working_set)
        for k, rep in enumerate(self.kind_rep):
            m.add(nsws >= int(w[rep]) * has[k])
        for e in edges:
            m.add(nsws >= int(w[e]))
        opt = var("opt")
        m.add(opt >= self._rank_sum(self._mem(2 * c0.view_params), r) + nsws).only_enforce_if(~tv["p2p_muon"])
        m.add(opt >= self._rank_sum(self._mem(2 * c0.resident_params), r) + nsws).only_enforce_if(tv["p2p_muon"])

        peak = var("peak")
        m.add(peak >= persistent + act_phase)
        m.add(peak >= persistent + opt)
        m.add(peak <= self.cap_bytes // MEM_UNIT)

        hostg = var("hostg")
        m.add(hostg >= self._rank_sum(self._mem(self.z2.host_grads), r)).only_enforce_if(
            tv["pipeline_zero2_host_grads"])
        m.add(host_act + hostg <= self.cluster.host_memory_bytes // MEM_UNIT)

        # time per microbatch ----------------------------------------------------------------
        times = {}
        for res in ("tensor", "hbm", "nvlink", "nic", "host_link"):
            t = tvar(f"t_{res}")
            for md in self.modes:
                for lc in self.lcs:
                    m.add(t >= self._rank_sum(self._t(self.base[(md, lc)].time[res]), r) + self._extra(res, r, md, mine)
                          ).only_enforce_if([self.mv[md], self.lv[lc]])
            times[res] = t
        upd = {}
        for res in ("tensor", "hbm", "nvlink", "nic", "host_link"):
            u = tvar(f"u_{res}")
            for lc in self.lcs:
                base = self._rank_sum(self._t(self.base[(self.modes[0], lc)].update[res]), r)
                m.add(u >= base).only_enforce_if([self.lv[lc], ~tv["p2p_muon"], ~tv["pipeline_zero2_host_grads"]])
                pz = self._rank_sum(self._t(self.p2p[lc].update[res]), r)
                m.add(u >= pz).only_enforce_if([self.lv[lc], tv["p2p_muon"], ~tv["pipeline_zero2_host_grads"]])
                z2 = self._rank_sum(self._t(self.z2.update[res] - self.c0.update[res]), r)
                m.add(u >= base + z2).only_enforce_if([self.lv[lc], ~tv["p2p_muon"], tv["pipeline_zero2_host_grads"]])
                m.add(u >= pz + z2).only_enforce_if([self.lv[lc], tv["p2p_muon"], tv["pipeline_zero2_host_grads"]])
            upd[res] = u
        return {"peak": peak, "times": times, "update": upd}

    def _extra(self, res: str, r: int, md: ActMode, mine: list[int]) -> cp_model.LinearExprT:
        """Rank-level time terms on top of the per-layer sums: PP packets, the toggles' costs."""
        c0, tv, K, p = self.c0, self.tv, self.K, self.f.pp
        expr = 0
        if res in ("nvlink", "nic"):
            for j in mine:
                if j > 0:
                    hop = (r - 1) % p
                    if ("nvlink" if c0.pp_on_nvlink[hop] else "nic") == res:
                        spb = c0.pp_seconds_per_byte[hop] * c0.stream_bytes
                        expr = expr + _tq(spb) * (1 + self._closes_before(j))
                if j < K - 1 and ("nvlink" if c0.pp_on_nvlink[r] else "nic") == res:
                    spb = c0.pp_seconds_per_byte[r] * c0.stream_bytes
                    expr = expr + _tq(spb) * (1 + self._closes_before(j + 1))
            if res == self.bal.balance_resource and self.bal.balanced_inflight is not None:
                n_peak = max(sum(c) for c in c0.compositions[r])
                if n_peak > self.bal.balanced_inflight:
                    a = self.base[(md, self.lcs[0])].act
                    moved = balance_moved_bytes(a, n_peak, self.bal.balanced_inflight)
                    coef = _ceil(moved * self.bal.balance_seconds_per_byte, TIME_UNIT)
                    bvar = self.m.new_int_var(0, self.time_ub, f"bal_r{r}_{res}_{self.modes.index(md)}")
                    self.m.add(bvar >= self._rank_sum(coef, r)).only_enforce_if(tv["balance_activations"])
                    expr = expr + bvar
        if res == "host_link":
            hvar = self.m.new_int_var(0, self.time_ub, f"off_r{r}_{self.modes.index(md)}")
            off = self.offload[md].time["host_link"] - self.base[(md, self.lcs[0])].time["host_link"]
            self.m.add(hvar >= self._rank_sum(self._t(off), r)).only_enforce_if(tv["activation_offload"])
            zvar = self.m.new_int_var(0, self.time_ub, f"z2t_r{r}_{self.modes.index(md)}")
            z2 = self.z2.time["host_link"] - self.c0.time["host_link"]
            self.m.add(zvar >= self._rank_sum(self._t(z2), r)).only_enforce_if(tv["pipeline_zero2_host_grads"])
            expr = expr + hvar + zvar
        if res == "tensor" and (K - 1) in mine:
            secs = self.fce.time["tensor"][self.L + 1] - self.c0.time["tensor"][self.L + 1]
            expr = expr + _tq(secs) * self.tv["fused_cross_entropy"]
        return expr

    def _objective(self) -> None:
        m, f = self.m, self.f
        stage = m.new_int_var(0, self.time_ub, "stage")
        update = m.new_int_var(0, self.time_ub, "update")
        for rk in self.ranks:
            for t in rk["times"].values():
                m.add(stage >= t)
            for u in rk["update"].values():
                m.add(update >= u)
        # Redundant cuts: the slowest rank carries at least the mean work of every resource, and the update at
        # least its mean; without them the bound does not move (CP-SAT practice notes, A11).
        moe = self.c0.moe[: self.L] > 0
        k_moe = -(-int(moe.sum()) // f.pp)
        for (md, lc), cf in self.base.items():
            for res in cf.time:
                t = self._t(cf.time[res])
                m.add(f.pp * stage >= int(t.sum())).only_enforce_if([self.mv[md], self.lv[lc]])
                m.add(f.pp * update >= int(self._t(cf.update[res]).sum())).only_enforce_if(self.lv[lc])
                if k_moe:
                    # Pigeonhole: some rank holds at least ceil(n_moe / p) MoE layers.
                    m.add(stage >= int(np.sort(t[: self.L][moe])[:k_moe].sum())).only_enforce_if(
                        [self.mv[md], self.lv[lc]])
        peak_mib = m.new_int_var(0, self.tie_max, "peak_mib")
        for rk in self.ranks:
            m.add(peak_mib * (PEAK_TIE_UNIT // MEM_UNIT) >= rk["peak"])
        slots_v = f.vp * f.microbatches + f.pp - 1  # v * (M + (p - 1)/v)
        self.step_units = slots_v * stage + f.vp * update
        self.peak_mib = peak_mib
        self.stage, self.update = stage, update
        # Lexicographic: step time, then the worst-rank peak (MiB), then fewer activation and rank toggles on,
        # so that equal layouts do not switch on toggles that buy nothing.
        toggles_on = sum(self.tv[t] for t in RANK_TOGGLES) + sum(
            sum(getattr(md, t) for t in ACT_TOGGLES) * v for md, v in self.mv.items())
        self.toggle_scale = len(RANK_TOGGLES) + len(ACT_TOGGLES) + 1
        self.obj_scale = (self.tie_max + 1) * self.toggle_scale
        m.minimize(self.step_units * self.obj_scale + peak_mib * self.toggle_scale + toggles_on)

    def add_stage_bound(self, stage_lb_s: float, split: list[int] | None) -> None:
        """A valid lower bound on the stage time (from the node's dynamic program) and its split as a hint."""
        if math.isfinite(stage_lb_s) and stage_lb_s > 0:
            self.m.add(self.stage >= int(math.floor(stage_lb_s / TIME_UNIT)))
        if split is not None and len(split) == self.K:
            self.m.clear_hints()
            bounds = np.cumsum(split)
            for j in range(1, self.K):
                for i in range(self.L):
                    self.m.add_hint(self.z[i][j], int(i >= bounds[j - 1]))

    # -- solve --------------------------------------------------------------------------------
    def solve(self, time_limit: float, workers: int = 2, presolve: bool = True,
              peak_cap_mib: int | None = None) -> FrameResult:
        if peak_cap_mib is not None:
            self.m.add(self.peak_mib <= peak_cap_mib)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(time_limit, 0.05)
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = 7
        if not presolve:
            solver.parameters.cp_model_presolve = False
        st = solver.solve(self.m)
        if st == cp_model.MODEL_INVALID:
            raise RuntimeError(f"CP-SAT model of {self.f} is invalid: {self.m.validate()[:300]}")
        proto = self.m.proto
        res = FrameResult(self.f, solver.status_name(st), variables=len(proto.variables),
                          constraints=len(proto.constraints))
        if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            split = self._read_split(solver)
            md = next(md for md, v in self.mv.items() if solver.value(v))
            lc = next(lc for lc, v in self.lv.items() if solver.value(v))
            tg = {t: bool(solver.value(v)) for t, v in self.tv.items()}
            res.split, res.shape = split, frame_shape(self.job, self.f, md, lc, **tg)
            res.objective = int(solver.objective_value)
            res.bound = int(solver.best_objective_bound)
            res.bound_step_s = (res.bound // self.obj_scale) * TIME_UNIT / self.f.vp
        return res

    def _read_split(self, solver: cp_model.CpSolver) -> list[int]:
        counts = [0] * self.K
        for i in range(self.L):
            j = sum(int(solver.value(self.z[i][jj])) for jj in range(1, self.K))
            counts[j] += 1
        return counts


def _ratio(x: float) -> tuple[int, int]:
    """x as num/den with den 2^16, num rounded up (balance scales are ratios of small integers)."""
    if x == 1.0:
        return 1, 1
    den = 1 << 16
    return math.ceil(x * den), den


def _tq(seconds: float) -> int:
    return int(math.ceil(seconds / TIME_UNIT - 1e-9))


# ------------------------------------------------------------------------------------- driver


def _key(ev: Evaluation) -> tuple[float, int]:
    return (ev.step.step_time_s, ev.peak_bytes)


def solve_frame(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec, time_limit: float,
                workers: int = 2, presolve: bool = True, peak_cap_mib: int | None = None,
                recompute: Recompute | None = None, lifecycle: FsdpLifecycle | None = None
                ) -> tuple[FrameResult, PlanItem | None]:
    """Solve one frame (optionally one recompute mode and lifecycle of it) to optimality or the time limit."""
    modes = [md for md in act_modes(job) if recompute is None or md.recompute == recompute]
    lcs = [lifecycle] if lifecycle is not None else lifecycles(job)
    modes = undominated_modes(job, f, modes, lcs, model, cluster)
    fm = FrameModel(job, f, model, cluster, modes=modes, lcs=lcs)
    if recompute is not None and lifecycle is not None:
        key = (job.model_dump_json(), f, recompute, lifecycle)
        if key not in _DP_HINTS:
            node_lower_bound(job, f, recompute, lifecycle, model, cluster)
        stage_lb, split = _DP_HINTS.get(key, (0.0, None))
        fm.add_stage_bound(stage_lb, split)
    res = fm.solve(time_limit, workers, presolve, peak_cap_mib)
    return res, _item(job, f, fm, res, model, cluster)


def undominated_modes(job: Job, f: Frame, modes: list[ActMode], lcs: list[FsdpLifecycle], model: ModelSpec,
                      cluster: ClusterSpec) -> list[ActMode]:
    """Drop activation modes another mode beats or ties on every per-layer time and memory coefficient
    (for example fused SiTU, which saves memory at no priced time): they cannot be strictly better."""
    def vec(md: ActMode) -> np.ndarray:
        parts = []
        for lc in lcs:
            cf = coefficients(frame_shape(job, f, md, lc), model, cluster)
            off = coefficients(frame_shape(job, f, md, lc, activation_offload=True), model, cluster)
            parts += [cf.time[r] for r in cf.time] + [cf.act, cf.working_set, off.time["host_link"]]
        return np.concatenate(parts)

    vecs = {md: vec(md) for md in modes}
    keep = []
    for md in modes:
        v = vecs[md]
        beaten = any(
            np.all(vecs[o] <= v) and (np.any(vecs[o] < v) or modes.index(o) < modes.index(md))
            for o in modes if o is not md
        )
        if not beaten:
            keep.append(md)
    return keep


def _memory_view(job: Job, f: Frame, md: ActMode, lc: FsdpLifecycle, model: ModelSpec, cluster: ClusterSpec,
                 balance: bool | None = None) -> Coefficients:
    """Coefficients for the memory side of a bound: the chunked cross-entropy on when allowed (smaller logits),
    and balancing on when allowed (so the balanced in-flight count is known; it changes no other array)."""
    allowed = _allowed_on(job)
    bal = ("balance_activations" in allowed) if balance is None else balance
    return coefficients(frame_shape(job, f, md, lc, fused_cross_entropy="fused_cross_entropy" in allowed,
                                    balance_activations=bal), model, cluster)


_DP_HINTS: dict[tuple, tuple[float, list[int] | None]] = {}
"""(stage-work bound, its split) of each node's dynamic program, reused as a cut and a hint by its CP-SAT model."""


def node_lower_bound(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                     cluster: ClusterSpec) -> tuple[float, float]:
    """(step-time bound, worst-rank peak bound) of one frame, recompute mode and lifecycle, over every split and
    toggle. Work uses the cheapest activation mode (the toggles only add work), memory the leanest one.

    v = 1: a dynamic program over contiguous stage ranges gives the exact min-max of a relaxed stage cost (each
    rank's work on every resource; the stage must fit persistent + in-flight saved bytes, or the optimizer phase,
    under the HBM line, with offload allowed when the host holds the rest). v > 1: the mean over ranks."""
    allowed = _allowed_on(job)
    cf = coefficients(frame_shape(job, f, ActMode(rc, *(t in job.search.require_toggles for t in ACT_TOGGLES)),
                                  lc), model, cluster)
    lean = ActMode(rc, *(True in _choices(job, t) for t in ACT_TOGGLES))
    lcf = _memory_view(job, f, lean, lc, model, cluster)
    p = f.pp
    update = max(float(cf.update[res].sum()) for res in cf.update) / p
    peak = _peak_lower_bound(job, f, lcf, cluster, allowed)
    cap = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
    if f.vp == 1 and job.search.split is None:
        ocf = coefficients(frame_shape(job, f, lean, lc, activation_offload=True), model, cluster) \
            if "activation_offload" in allowed else None
        stage, dp_peak, split = _dp_bounds(cf, lcf, ocf, cluster, cap, allowed)
        _DP_HINTS[(job.model_dump_json(), f, rc, lc)] = (stage, split)
        return (cf.slots * stage + update if math.isfinite(stage) else math.inf), max(peak, dp_peak)
    stage = max(float(cf.time[res].sum()) for res in cf.time) / p
    return cf.slots * stage + update, peak


def frame_dp_bound(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """One bound for every node of a v = 1 frame: the stage dynamic program with, per layer, the least work of any
    recompute mode and lifecycle (no toggles) and the least saved and working-set bytes of any (all toggles
    allowed); (0, 0) for v > 1."""
    if f.vp != 1 or job.search.split is not None:
        return 0.0, 0.0
    allowed = _allowed_on(job)
    recs = job.search.recompute or list(Recompute)
    lcs = lifecycles(job)
    cheap = [coefficients(frame_shape(job, f, ActMode(rc, *(t in job.search.require_toggles for t in ACT_TOGGLES)),
                                      lc), model, cluster) for rc in recs for lc in lcs]
    lean = [_memory_view(job, f, ActMode(rc, *(True in _choices(job, t) for t in ACT_TOGGLES)), lc, model, cluster)
            for rc in recs for lc in lcs]
    time = {res: np.min([c.time[res] for c in cheap], axis=0) for res in cheap[0].time}
    update = {res: np.min([c.update[res] for c in cheap], axis=0) for res in cheap[0].update}
    mins = {k: np.min([getattr(c, k) for c in lean], axis=0) for k in ("act", "working_set", "grad_accum", "grads")}
    cf = replace(cheap[0], time=time, update=update)
    lcf = replace(lean[0], **mins)
    off = None
    if "activation_offload" in allowed:
        offs = [coefficients(frame_shape(job, f, ActMode(rc, *(True in _choices(job, t) for t in ACT_TOGGLES)), lc,
                                         activation_offload=True), model, cluster) for rc in recs for lc in lcs]
        off = replace(offs[0], time={**offs[0].time,
                                     "host_link": np.min([o.time["host_link"] for o in offs], axis=0)})
    cap = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
    stage, peak, _ = _dp_bounds(cf, lcf, off, cluster, cap, allowed)
    upd = max(float(update[res].sum()) for res in update) / f.pp
    return (cf.slots * stage + upd if math.isfinite(stage) else math.inf), peak


def tight_node_bound(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                     cluster: ClusterSpec) -> float:
    """The node's step-time bound with the dynamic program run per undominated activation mode (its own work
    and memory), the least over modes; only for v = 1. Computed when a node is about to be solved."""
    if f.vp != 1 or job.search.split is not None:
        return 0.0
    allowed = _allowed_on(job)
    cap = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
    modes = undominated_modes(job, f, [md for md in act_modes(job) if md.recompute == rc], [lc], model, cluster)
    best = math.inf
    offloads = [False, True] if "activation_offload" in allowed else [False]
    balances = [False, True] if "balance_activations" in allowed else [False]
    for md in modes:
        cf = coefficients(frame_shape(job, f, md, lc), model, cluster)
        update = max(float(cf.update[res].sum()) for res in cf.update) / f.pp
        for off_on, bal_on in itertools.product(offloads, balances):
            # Offload and balancing are global decisions: every rank pays them or none does.
            off = coefficients(frame_shape(job, f, md, lc, activation_offload=True), model, cluster) if off_on \
                else None
            variant = (allowed - {"activation_offload", "balance_activations"}) | (
                {"activation_offload"} if off_on else set()) | ({"balance_activations"} if bal_on else set())
            mem = _memory_view(job, f, md, lc, model, cluster, balance=bal_on)
            stage, _, _ = _dp_bounds(cf, mem, off, cluster, cap, variant, force=True)
            best = min(best, cf.slots * stage + update)
    return best


def _dp_bounds(cf: Coefficients, lean: Coefficients, off: Coefficients | None, cluster: ClusterSpec, cap: int,
               allowed: set[str], force: bool = False) -> tuple[float, float, list[int] | None]:
    """Exact min over contiguous v = 1 splits of (max stage work, max stage memory) by dynamic programming over
    (rank, boundary), with work from the cheapest mode and memory from the leanest (so both are lower bounds):
    persistent + in-flight saved bytes and AttnRes bank + the largest working set + PP, EP and routing buffers +
    logits, or the optimizer phase, under the HBM line; offload when the host holds the saved bytes.
    Returns (inf, inf, None) when no split fits, and the argmin split of the work."""
    L, p = cf.n_layers, cf.shape.pp
    idx = np.arange(L + 1)
    a_i, b_i = np.meshgrid(idx, idx, indexing="ij")
    valid = b_i > a_i

    def rng(arr: np.ndarray) -> np.ndarray:
        pre = np.concatenate([[0.0], np.cumsum(arr[:L])])
        return pre[b_i] - pre[a_i]

    def edge(arr: np.ndarray, r: int) -> float:
        return float(arr[L] if r == 0 else 0.0) + float(arr[L + 1] if r == p - 1 else 0.0)

    cache: dict[int, np.ndarray] = {}

    def range_max(arr: np.ndarray) -> np.ndarray:
        if id(arr) not in cache:
            out = np.full((L + 1, L + 1), -np.inf)
            for a in range(L):
                out[a, a + 1:] = np.maximum.accumulate(arr[a:L])
            cache[id(arr)] = out
        return cache[id(arr)]

    P = lean.master + lean.optimizer + lean.bf16_view + lean.grad_accum
    opt = 2 * (lean.resident_params if "p2p_muon" in allowed else lean.view_params)
    Pr, Ar = rng(P), rng(lean.act)
    # Gradients: the FP32 shard, or (pipeline ZeRO-2) two FP32 buffers of the stage's chunk.
    grads = rng(lean.grads)
    if "pipeline_zero2_host_grads" in allowed:
        grads = np.minimum(grads, 2 * rng(lean.chunk_grad_buffer))
    Pr = Pr + grads
    P = P + lean.grads
    Or = rng(opt) + range_max(lean.ns_working_set)
    R = np.concatenate([[0.0], np.cumsum(lean.closes[:L])])
    bank = R[b_i] * lean.stream_bytes
    packet_in = np.where(a_i > 0, (1 + R[a_i]) * lean.stream_bytes, 0.0)
    packet_out = np.where(b_i < L, (1 + R[b_i]) * lean.stream_bytes, 0.0)
    has_moe = rng(lean.moe) > 0
    buffers = 2 * (packet_in + packet_out) + has_moe * (lean.routing_map + lean.ep_buffers)
    ws = range_max(lean.working_set)
    work = {res: rng(cf.time[res]) for res in cf.time}
    packet_s = {res: np.zeros((p, L + 1, L + 1)) for res in ("nvlink", "nic")}
    for r in range(p):
        # PP packets: the one in (from rank r - 1) and the one out (to rank r + 1), on that hop's link.
        if r > 0:
            hop = r - 1
            packet_s["nvlink" if cf.pp_on_nvlink[hop] else "nic"][r] += packet_in * cf.pp_seconds_per_byte[hop]
        if r < p - 1:
            packet_s["nvlink" if cf.pp_on_nvlink[r] else "nic"][r] += packet_out * cf.pp_seconds_per_byte[r]
    host_off = rng(off.time["host_link"]) if off is not None else None
    best_t = np.full(L + 1, np.inf)
    best_m = np.full(L + 1, np.inf)
    choice = np.zeros((p, L + 1), dtype=int)
    for r in range(p):
        n_own = max(sum(c) for c in lean.compositions[r])
        t_base = np.max([w + edge(cf.time[res], r) + (packet_s[res][r] if res in packet_s else 0.0)
                         for res, w in work.items()], axis=0)
        options = [(n_own, t_base)]
        balancing = lean.balanced_inflight is not None and "balance_activations" in allowed
        if balancing:
            avg = lean.balanced_inflight
            t_bal = t_base
            if avg < n_own:
                # Balancing holds the average, paying the excess out and back on the network every microbatch.
                moved = balance_moved_bytes(Ar + edge(lean.act, r), n_own, avg)
                res = lean.balance_resource
                t_bal = np.maximum(t_base, work[res] + edge(cf.time[res], r)
                                   + (packet_s[res][r] if res in packet_s else 0.0)
                                   + moved * lean.balance_seconds_per_byte)
            # Forced (balancing on for every rank): this is the only option; otherwise a per-rank choice.
            options = [(avg, t_bal)] if force else [*options, (avg, t_bal)]
        t_r, mem_r = np.full((L + 1, L + 1), np.inf), np.full((L + 1, L + 1), np.inf)
        for n, t_opt in options:
            t_n, m_n = _dp_stage(n, t_opt, r, p, L, P, Pr, Ar, Or, opt, bank, buffers, ws, has_moe, lean, off,
                                 host_off, edge, range_max, cluster, cap, valid, force)
            t_r, mem_r = np.minimum(t_r, t_n), np.minimum(mem_r, m_n)
        t, mem = t_r, mem_r
        if r == 0:
            new_t, new_m = t[0].copy(), mem[0].copy()
        else:
            cand = np.maximum(best_t[:, None], t)
            choice[r] = np.argmin(cand, axis=0)
            new_t = cand[choice[r], idx]
            new_m = np.min(np.maximum(best_m[:, None], mem), axis=0)
        best_t, best_m = new_t, new_m
    if not math.isfinite(best_t[L]):
        return math.inf, float(best_m[L]), None
    bounds, b = [L], L
    for r in range(p - 1, 0, -1):
        b = int(choice[r][b])
        bounds.append(b)
    bounds.append(0)
    bounds = bounds[::-1]
    return float(best_t[L]), float(best_m[L]), [bounds[j + 1] - bounds[j] for j in range(p)]


def _dp_stage(n: float, t: np.ndarray, r: int, p: int, L: int, P: np.ndarray, Pr: np.ndarray, Ar: np.ndarray,
              Or: np.ndarray, opt: np.ndarray, bank: np.ndarray, buffers: np.ndarray, ws: np.ndarray,
              has_moe: np.ndarray, lean: Coefficients, off: Coefficients | None, host_off: np.ndarray | None,
              edge: Callable, range_max: Callable, cluster: ClusterSpec, cap: int, valid: np.ndarray,
              force: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Work and memory of rank r over every range [a, b) when it holds n in-flight microbatches."""
    persistent = Pr + edge(P, r) + has_moe * lean.moonep_buffers
    ws_r = np.maximum(ws, max(float(lean.working_set[L]) if r == 0 else 0.0,
                              float(lean.working_set[L + 1]) if r == p - 1 else 0.0))
    fixed_act = ws_r + buffers + (lean.logits if r == p - 1 else 0.0)
    saved = n * (Ar + edge(lean.act, r) + bank)
    mem_opt = persistent + Or + edge(opt, r)
    mem_keep = np.maximum(persistent + saved + fixed_act, mem_opt)
    fits_keep = mem_keep <= cap
    mem = mem_keep
    if off is not None and host_off is not None:
        host = n * (Ar + edge(lean.act, r)) <= cluster.host_memory_bytes
        resident = lean.shape.offload_resident_layers * range_max(lean.act)
        mem_off = np.maximum(persistent + resident + n * bank + fixed_act, mem_opt)
        fits_off = host & (mem_off <= cap)
        t_off = np.maximum(t, host_off + edge(off.time["host_link"], r))
        if force:  # offload on every rank: every rank pays its traffic
            t, mem, fits = t_off, np.where(host, mem_off, np.inf), fits_off
        else:
            t = np.where(fits_keep, t, t_off)
            # The peak bound takes the lower of the two wherever the host can hold the saved bytes.
            mem = np.where(host, np.minimum(mem_keep, mem_off), mem_keep)
            fits = fits_keep | fits_off
    else:
        fits = fits_keep
    fits = fits & valid
    return np.where(fits, t, np.inf), np.where(valid, mem, np.inf)


def _peak_lower_bound(job: Job, f: Frame, cf: Coefficients, cluster: ClusterSpec, allowed: set[str]) -> float:
    """A lower bound on the worst-rank peak over every contiguous split, by LP duality on a fractional relaxation.

    Layer i on rank r costs s_ir = P_i + c A_i: P_i its persistent bytes, A_i its saved bytes per in-flight
    microbatch under the leanest activation mode, c the in-flight copies of the chunk holding it at the rank's
    peak composition. Every chunk holds at least one layer, so rank r carries at least F_r = sum over its chunks
    of min_i s_ir, plus its edges E_r; the other L - p v layers are fractional. For y_r >= 0:
    worst peak >= (sum_r y_r (E_r + F_r) + sum of the L - p v smallest min_r y_r s_ir) / sum_r y_r, here with
    y_r = 1 / (mean P + w_r mean A), w_r the rank's smallest chunk count. Offload (if allowed) keeps the resident
    layers' saved sets on the GPU and moves the rest to the host, where the same bound must fit host memory.
    The optimizer phase gives the mean of P_i + O_i."""
    L, p, v = cf.n_layers, f.pp, f.vp
    P = cf.master + cf.optimizer + cf.bf16_view + cf.grad_accum
    if "pipeline_zero2_host_grads" not in allowed:
        P = P + cf.grads
    opt = 2 * (cf.resident_params if "p2p_muon" in allowed else cf.view_params)
    counts = []
    for r in range(p):
        comp = np.array(max(cf.compositions[r], key=sum), dtype=float)
        if cf.balanced_inflight is not None and "balance_activations" in allowed:
            comp = comp * min(1.0, cf.balanced_inflight / comp.sum())
        counts.append(comp)
    w = np.array([c.min() for c in counts])
    A = cf.act[:L]
    edges = np.zeros(p)
    edges[0] += P[L] + cf.act[L]
    edges[p - 1] += P[L + 1] + cf.act[L + 1]

    def bound(Pl: np.ndarray, Al: np.ndarray, extra: float = 0.0) -> float:
        y = 1.0 / (Pl.mean() + w * Al.mean() + 1.0)
        floor = np.array([sum(float((Pl + c * Al).min()) for c in counts[r]) for r in range(p)]) + extra
        cost = ((Pl[:, None] + Al[:, None] * w[None, :]) * y[None, :]).min(axis=1)
        rest = np.sort(cost)[: max(L - p * v, 0)].sum()
        return float((rest + (y * (edges + floor)).sum()) / y.sum())

    opt_phase = float((P + opt).sum()) / p
    gpu = bound(P[:L], A)
    offload = "activation_offload" in allowed and bound(np.zeros(L), A) <= cluster.host_memory_bytes
    if offload:
        gpu = min(gpu, bound(P[:L], np.zeros(L), cf.shape.offload_resident_layers * float(A.min())))
    # Pigeonhole: some rank holds at least ceil(n_moe / p) MoE layers, with the MoE buffers of one layer,
    # the smallest working set and, when p > 1, at least one packet each way (an edge rank has only one).
    moe = cf.moe[:L] > 0
    n_moe = int(moe.sum())
    if n_moe:
        k = -(-n_moe // p)
        buffers = (cf.ep_buffers + cf.moonep_buffers + cf.routing_map + float(cf.working_set[:L][moe].min())
                   + (2 * cf.stream_bytes if p > 1 else 0))
        act_moe = np.zeros(n_moe) if offload else w.min() * A[moe]
        hold = np.sort(P[:L][moe] + act_moe)[:k].sum() + buffers
        hold_opt = np.sort((P + opt)[:L][moe])[:k].sum()
        gpu = max(gpu, float(hold), float(hold_opt))
    return max(gpu, opt_phase)


def _item(job: Job, f: Frame, fm: FrameModel, res: FrameResult, model: ModelSpec,
          cluster: ClusterSpec) -> PlanItem | None:
    if res.split is None or res.shape is None:
        return None
    layout = layout_of(job, f, res.shape, res.split)
    ev = evaluate(layout, model=model, cluster=cluster)
    _check_agreement(fm, res, ev)
    return PlanItem(layout, ev)


def _check_agreement(fm: FrameModel, res: FrameResult, ev: Evaluation) -> None:
    """The solver's integer objective and evaluate() must agree to the integer resolution."""
    f = fm.f
    solver_step = (res.objective // fm.obj_scale) * TIME_UNIT / f.vp
    slack = (fm.L + 2 + 4 * fm.K) * TIME_UNIT * (f.vp * f.microbatches + f.pp) * 2 + 1e-6
    if not (ev.step.step_time_s - 1e-9 <= solver_step <= ev.step.step_time_s + slack):
        raise RuntimeError(
            f"solver and evaluate() disagree on {f}: solver {solver_step:.6f} s, evaluate {ev.step.step_time_s:.6f} s"
        )
    if not ev.fits:
        raise RuntimeError(f"solver returned a layout evaluate() says does not fit: {f} {res.split}")


ProgressFn = Callable[[int, int, float], None]


def plan(job: Job, model: ModelSpec | str | None = None, cluster: ClusterSpec | str | None = None, top: int = 5,
         time_limit: float = 60.0, workers: int = 2, pareto: bool = True, pareto_step_gib: float = 1.0,
         progress: ProgressFn | None = None) -> Plan:
    """Ranked layouts (best first, one per frame) and the Pareto front over (step time, worst-rank peak).

    Best-first branch and bound: frames enter a queue keyed by a lower bound on their step time; a popped frame
    is expanded into (recompute, lifecycle) nodes with tighter bounds; a popped node is solved exactly by its
    CP-SAT model. The search is OPTIMAL when every node left has a bound above the K-th best, FEASIBLE when the
    time limit stopped it first (the bound and gap say how far from proven), and raises InfeasibleJobError with
    the smallest reachable peak when nothing fits."""
    t0 = _time.monotonic()
    model = model if isinstance(model, ModelSpec) else load_model(model or job.model)
    cluster = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or job.cluster)
    frames = [f for g in job.gpu_counts for f in enumerate_frames(job, model, g)]
    if not frames:
        raise InfeasibleJobError(
            f"no parallel shape satisfies the job's rules (gpus {job.gpus}, tokens_per_update "
            f"{job.tokens_per_update}, rows x context {job.rows} x {job.context}); make tokens_per_update a "
            "multiple of DP x rows x context for some PP, or give [search] microbatches"
        )
    cap = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
    recs = job.search.recompute or list(Recompute)
    lcs = lifecycles(job)
    heap: list = []
    seq = itertools.count()
    min_peak_lb: tuple[float, Frame | None] = (math.inf, None)
    for f in frames:
        t_lb, m_lb = frame_lower_bound(job, f, model, cluster)
        if m_lb < min_peak_lb[0]:
            min_peak_lb = (m_lb, f)
        if m_lb <= cap:
            heapq.heappush(heap, (t_lb, m_lb, next(seq), f, None, None))
    candidates = len(heap)
    best_of: dict[Frame, PlanItem] = {}
    solved = 0
    status = "OPTIMAL"
    size: dict[str, int] = {}
    bound = math.inf
    stopped_bound = math.inf
    tightened: set = set()
    frame_tightened: set = set()

    def kth() -> PlanItem | None:
        ranked = sorted(best_of.values(), key=lambda it: _key(it.evaluation))
        return ranked[top - 1] if len(ranked) >= top else None

    while heap:
        t_lb, m_lb, _, f, rc, lc = heap[0]
        k = kth()
        if k is not None and (t_lb > k.step_time_s or (t_lb == k.step_time_s and m_lb >= k.peak_bytes)):
            break
        remaining = time_limit - (_time.monotonic() - t0)
        if remaining <= 0:
            status = "FEASIBLE"
            break
        heapq.heappop(heap)
        mine = best_of.get(f)
        if mine is not None and t_lb > mine.step_time_s:
            continue  # this node cannot improve its frame, and the frame is already ranked
        if rc is None and f not in frame_tightened:
            frame_tightened.add(f)
            ft, fm_ = frame_dp_bound(job, f, model, cluster)
            if ft > t_lb + 1e-12 or fm_ > m_lb:
                if math.isfinite(ft) and fm_ <= cap:
                    heapq.heappush(heap, (max(ft, t_lb), max(fm_, m_lb), next(seq), f, None, None))
                continue
        if rc is None:
            for r_ in recs:
                for l_ in lcs:
                    nt, nm = node_lower_bound(job, f, r_, l_, model, cluster)
                    if nm <= cap:
                        heapq.heappush(heap, (max(nt, t_lb), max(nm, m_lb), next(seq), f, r_, l_))
            continue
        if (f, rc, lc) not in tightened:
            tightened.add((f, rc, lc))
            tight = tight_node_bound(job, f, rc, lc, model, cluster)
            if tight > t_lb + 1e-12:
                if math.isfinite(tight):
                    heapq.heappush(heap, (tight, m_lb, next(seq), f, rc, lc))
                continue
        res, item = solve_frame(job, f, model, cluster, remaining, workers, recompute=rc, lifecycle=lc)
        solved += 1
        size = {"variables": max(size.get("variables", 0), res.variables),
                "constraints": max(size.get("constraints", 0), res.constraints)}
        if res.status == "FEASIBLE":
            status = "FEASIBLE"
            stopped_bound = min(stopped_bound, res.bound_step_s)
        elif res.status not in ("OPTIMAL", "INFEASIBLE"):
            status = "FEASIBLE"
            stopped_bound = min(stopped_bound, t_lb)
        if item is not None and (mine is None or _key(item.evaluation) < _key(mine.evaluation)):
            best_of[f] = item
        if progress:
            progress(solved, candidates, _time.monotonic() - t0)
    if heap:
        bound = heap[0][0]
    bound = min(bound, stopped_bound)
    ranked = sorted(best_of.values(), key=lambda it: _key(it.evaluation))
    if not ranked:
        if status != "OPTIMAL":
            raise InfeasibleJobError(
                f"no layout found within the {time_limit:g} s time limit ({solved} candidate shapes solved); "
                "raise --time-limit")
        raise InfeasibleJobError(_infeasible_reason(job, model, cluster, cap, min_peak_lb[1], min_peak_lb[0]))
    top_items = ranked[:top]
    best_t = top_items[0].step_time_s
    bound = min(bound, best_t)
    gap = (best_t - bound) / best_t if best_t else 0.0
    front, complete = (_pareto(job, model, cluster, best_of, ranked, pareto_step_gib, t0, time_limit, workers)
                       if pareto else ([], False))
    return Plan(job=job, status=status, layouts=top_items, pareto=front, bound=bound, gap=gap,
                frames_total=len(frames), frames_solved=solved, solve_time_s=_time.monotonic() - t0,
                model_size=size, pareto_complete=complete)


def _pareto(job: Job, model: ModelSpec, cluster: ClusterSpec, best_of: dict[Frame, PlanItem],
            ranked: list[PlanItem], step_gib: float, t0: float, time_limit: float, workers: int
            ) -> tuple[list[PlanItem], bool]:
    """Non-dominated (step time, worst-rank peak) layouts by epsilon-constraint solves per frame: minimize the
    step time (ties: the lower peak) under peak <= epsilon, then lower epsilon by the step. A frame is skipped,
    or its loop stopped, once a point found dominates its bounds (every further layout of it is dominated).
    Returns the front and whether it is complete (False when the time limit cut it short)."""
    points: list[PlanItem] = list(ranked)
    step_mib = max(1, int(round(step_gib * GIB / MIB)))
    cap_bytes = cluster.hbm_bytes - int(round(job.reserve_gib * GIB))
    frames = [f for g in job.gpu_counts for f in enumerate_frames(job, model, g)]
    bounds = sorted((*frame_lower_bound(job, f, model, cluster), f) for f in frames)
    complete = True

    def dominated(f: Frame, t_lb: float, peak_cap: float) -> bool:
        """Some point found has at least the frame's best possible tokens/s per GPU, no more GPUs, and a
        peak no higher than peak_cap (with one GPU count: a step time no longer than the frame's bound)."""
        tps_ub = job_tokens(f) / (t_lb * f.gpus) if t_lb > 0 else math.inf
        return any(p.evaluation.step.tokens_per_s_per_gpu >= tps_ub and p.layout.gpus <= f.gpus
                   and p.peak_bytes <= peak_cap for p in points)

    def job_tokens(f: Frame) -> int:
        return f.gpus // (f.pp * f.cp) * f.microbatches * job.rows * job.context

    for t_lb, m_lb, f in bounds:
        if m_lb > cap_bytes or dominated(f, t_lb, m_lb):
            continue
        if _time.monotonic() - t0 > time_limit:
            complete = False
            break
        have = best_of.get(f)
        cap = have.peak_bytes // MIB - step_mib if have else None
        fm: FrameModel | None = None
        while True:
            if cap is not None and (cap * MIB < m_lb or dominated(f, t_lb, cap * MIB)):
                break
            remaining = time_limit - (_time.monotonic() - t0)
            if remaining <= 0:
                complete = False
                break
            if fm is None:
                modes = undominated_modes(job, f, act_modes(job), lifecycles(job), model, cluster)
                fm = FrameModel(job, f, model, cluster, modes=modes)
            res = fm.solve(remaining, workers, peak_cap_mib=cap)
            if res.status == "FEASIBLE" or res.status == "UNKNOWN":
                complete = False
            item = _item(job, f, fm, res, model, cluster)
            if item is None:
                break
            points.append(item)
            cap = item.peak_bytes // MIB - step_mib
    return _non_dominated(points), complete


def _frame_of(layout: Layout) -> Frame:
    return Frame(layout.pp, layout.vp, layout.cp, layout.ep, layout.expert_fsdp, layout.dense_fsdp,
                 layout.microbatches, layout.gpus)


def _non_dominated(items: Iterable[PlanItem]) -> list[PlanItem]:
    """Layouts no other beats on tokens/s per GPU, GPU count and worst-rank peak at once (one of them strictly).
    With one GPU count and fixed tokens per update this is the (step time, peak) front."""
    items = sorted(items, key=lambda it: (-it.evaluation.step.tokens_per_s_per_gpu, it.layout.gpus, it.peak_bytes))

    def crit(it: PlanItem) -> tuple[float, int, int]:
        return (-it.evaluation.step.tokens_per_s_per_gpu, it.layout.gpus, it.peak_bytes)

    front: list[PlanItem] = []
    for it in items:
        c = crit(it)
        if not any(all(a <= b for a, b in zip(crit(o), c, strict=True)) and crit(o) != c for o in front) \
                and all(crit(o) != c for o in front):
            front.append(it)
    return sorted(front, key=lambda it: (it.layout.gpus, it.step_time_s))


def _infeasible_reason(job: Job, model: ModelSpec, cluster: ClusterSpec, cap: int, f: Frame | None,
                       lb: float) -> str:
    """The smallest peak any layout could reach on its worst rank, against the capacity, with its terms."""
    if f is None:
        return "no candidate shape"
    base = ActMode(Recompute.FULL, True, True, True, True)
    cf = coefficients(frame_shape(job, f, base, FsdpLifecycle.PER_MICROBATCH), model, cluster)
    terms = {"master": cf.master.sum() / f.pp, "optimizer": cf.optimizer.sum() / f.pp,
             "bf16_view": cf.bf16_view.sum() / f.pp, "grads": cf.grads.sum() / f.pp}
    top = sorted(terms.items(), key=lambda kv: -kv[1])
    state = (cf.master + cf.grads + cf.optimizer).sum() * (f.gpus // f.pp)
    gpus = ", ".join(str(g) for g in job.gpu_counts)
    return (f"no layout fits on {gpus} {cluster.name} GPUs: the smallest worst-rank peak any layout can reach is at "
            f"least {lb / GIB:,.1f} GiB against {cap / GIB:,.1f} GiB usable (best shape PP{f.pp} EP{f.ep} "
            f"expert-FSDP{f.expert_fsdp} dense-FSDP{f.dense_fsdp}: "
            + ", ".join(f"{k} {v / GIB:,.1f}" for k, v in top)
            + f" GiB per GPU; the model state alone is {state / 2**40:,.2f} TiB); use more GPUs or a larger-memory "
            "cluster")


__all__ = ["Frame", "Plan", "PlanItem", "enumerate_frames", "frame_lower_bound", "plan", "solve_frame"]
