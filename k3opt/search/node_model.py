"""The CP-SAT model of one node (a frame, optionally one recompute mode and FSDP lifecycle).

Resolution: memory in KiB, rounded up per layer (the solver never accepts a layout evaluate() rejects); time in
units of 100 ns, rounded up per layer; the tie-break on the worst-rank peak in MiB, then on fewer toggles."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from k3opt.cost.achievable import rank_packets
from k3opt.cost.coefficients import Coefficients, Shape, balance_moved_bytes, busiest_layer_seconds
from k3opt.cost.evaluate import Evaluation, evaluate
from k3opt.cost.ledger import peak_inflight, pp_packet_bytes, pp_packet_terms
from k3opt.cost.schedule import chunk_times, critical_path, pipeline_order, schedule_slot_units
from k3opt.inputs.errors import LayoutError
from k3opt.inputs.memo import register
from k3opt.inputs.specs import MIB, ClusterSpec, FsdpLifecycle, Job, Layout, ModelSpec, Recompute
from k3opt.search import isolated, replay_bound
from k3opt.search.bounds import DP_HINTS, LP_BOUNDS, node_key, node_lower_bound
from k3opt.search.frames import (
    ACT_TOGGLES,
    RANK_TOGGLES,
    ActMode,
    Frame,
    act_modes,
    allocated_capacity_bytes,
    choices,
    chunk_least,
    fits,
    frame_shape,
    layout_of,
    lifecycles,
    undominated_modes,
)
from k3opt.search.policy import POLICY
from k3opt.search.rank_ledger import MEM_UNIT, RankLedgerModel, RankView, ratio
from k3opt.search.ranking import ranked_coefficients as coefficients  # the ranked view (search/ranking.py)
from k3opt.search.result import PlanItem

TIME_UNIT = 1e-7         # seconds
PEAK_TIE_UNIT = MIB      # bytes, tie-break resolution


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
        self.cap_bytes = allocated_capacity_bytes(job, frame, model, cluster)
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
        self.p2p = {lc: self._cf(m0, lc, p2p_muon=True) for lc in self.lcs}
        self.c0 = self.base[(m0, lc0)]
        # Each rank toggle on alone, at the first mode and lifecycle: the variant a ledger term it changes reads.
        self.on = {t: self._cf(m0, lc0, **{t: True}) for t in RANK_TOGGLES}
        self.z2 = self.on["pipeline_zero2_host_grads"]
        self.fce = self.on["fused_cross_entropy"]
        self.bal = self.on["balance_activations"]

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
        for j, least in enumerate(chunk_least(self.job, self.f)):
            if least:
                m.add(self._x_sum(np.ones(L, dtype=np.int64), j) >= least)
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
            ch = choices(self.job, t)
            if len(ch) == 1:
                m.add(var == int(ch[0]))
            self.tv[t] = var
        for md, v in self.mv.items():
            if md.offload:
                # The toggle moves the whole saved set: a layout offloads by module or by the toggle, not both.
                m.add_implication(v, ~self.tv["activation_offload"])
        self._kinds()
        # Variable bounds keep the objective inside int64: every time term is at most the sum of all per-layer
        # work on every resource under the most expensive mode, plus the toggles' rank-level costs.
        worst = max(max(float(cf.time[res].sum()) for res in cf.time) for cf in self.base.values())
        extra = max(max(float(c.time[res].sum()) for res in c.time)
                    for c in (*self.offload.values(), self.z2, self.bal, self.fce))
        pp_bytes = 2 * self.K * pp_packet_bytes(float(self.c0.closes.sum()), self.c0.stream_bytes)
        upd = max(max(float(c.update[res].sum()) for res in (*c.update, *c.update_hidden))
                  for c in (*self.p2p.values(), self.z2))
        self.time_ub = int((worst + extra + upd + pp_bytes / (self.cluster.nic_gbps * 1e9)) / TIME_UNIT) * 2 + 10**5
        self.ranks = [self._rank(r) for r in range(p)]
        self._objective()

    def _z(self, i: int, j: int):  # noqa: ANN202
        if j <= 0:
            return 1
        if j >= self.K:
            return 0
        return self.z[i][j]

    def _x_sum(self, a: np.ndarray, j: int) -> cp_model.LinearExprT:
        """sum_i a[i] x[i][j] with x[i][j] = z[i][j] - z[i][j+1] (layers only): one weighted sum over the layers
        with a[i] != 0, each contributing +a[i] z[i][j] then -a[i] z[i][j+1] (z[i][0] = 1 and z[i][K] = 0 are
        constants)."""
        coef = np.asarray(a[: self.L]).astype(np.int64)
        nz = np.nonzero(coef)[0]
        lo, hi = (1 if j > 0 else 0), (1 if j + 1 < self.K else 0)  # which of z[i][j], z[i][j+1] are variables
        const = int(coef[nz].sum()) if j <= 0 else 0
        if not len(nz) or lo + hi == 0:
            return const
        z = self.z
        if lo and hi:
            zs = [v for i in nz.tolist() for v in (z[i][j], z[i][j + 1])]
            cs = np.stack([coef[nz], -coef[nz]], axis=1).ravel().tolist()
        elif lo:
            zs, cs = [z[i][j] for i in nz.tolist()], coef[nz].tolist()
        else:
            zs, cs = [z[i][j + 1] for i in nz.tolist()], (-coef[nz]).tolist()
        expr = cp_model.LinearExpr.weighted_sum(zs, cs)
        return expr + const if const else expr

    def chunk(self, a: np.ndarray, j: int) -> cp_model.LinearExprT:
        """Chunk j's sum of a per-layer array, with the edges on the first and last chunks."""
        expr = self._x_sum(a[: self.L], j)
        if j == 0:
            expr = expr + int(a[self.L])
        if j == self.K - 1:
            expr = expr + int(a[self.L + 1])
        return expr

    def rank_sum(self, a: np.ndarray, r: int) -> cp_model.LinearExprT:
        return sum(self.chunk(a, j) for j in range(r, self.K, self.f.pp))

    def closes_before(self, j: int) -> cp_model.LinearExprT:
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

    def mem(self, a: np.ndarray) -> np.ndarray:
        return _ceil(a, MEM_UNIT)

    def _t(self, a: np.ndarray) -> np.ndarray:
        return _ceil(a, TIME_UNIT)

    # -- one rank -----------------------------------------------------------------------------
    def _rank(self, r: int) -> dict:
        """Rank r's submodel: its ledger (k3opt.search.rank_ledger, from the ledger's declarations) with its peak
        under the budget, its host memory, its seconds per microbatch on each resource and its update terms."""
        rk = self._rank_view(r)
        ledger = RankLedgerModel(self, rk)
        host_act = ledger.host_act
        peak = ledger.peak
        self._host_memory(rk, host_act + ledger.host_stash)
        times = self._time_terms(rk)
        # The update's compute and communication, and (ranking view, search/ranking.py) its communication that
        # hides under compute: the same four cases of P2P Muon x ZeRO-2 host gradients for each field.
        upd = self._update_terms(r, "update", "u")
        hidden = self._update_terms(r, "update_hidden", "h")
        return {"peak": peak, "times": times, "update": upd, "hidden": hidden, "ledger": ledger}

    def _rank_view(self, r: int) -> RankView:
        """Rank r's chunks, its layer-kind indicators (`_has_kind`) and its edge columns."""
        mine = list(range(r, self.K, self.f.pp))
        has = self._has_kind(r)
        holds_first, holds_last = 0 in mine, (self.K - 1) in mine
        edges = ([self.L] if holds_first else []) + ([self.L + 1] if holds_last else [])
        return RankView(r, mine, has, edges, holds_last)

    def mem_var(self, rk: RankView, name: str) -> cp_model.IntVar:
        """A memory variable of rank rk (KiB, up to the larger of the budget and the host memory)."""
        mem_ub = max(self.cap_bytes, self.cluster.host_memory_bytes) // MEM_UNIT
        return self.m.new_int_var(0, mem_ub, f"{name}_r{rk.r}")

    def _time_var(self, rk: RankView, name: str) -> cp_model.IntVar:
        """A time variable of rank rk (TIME_UNIT, up to `time_ub`)."""
        return self.m.new_int_var(0, self.time_ub, f"{name}_r{rk.r}")

    def mem_int(self, nbytes: float) -> int:
        """One rank-level figure in KiB, rounded up like the per-layer arrays."""
        return int(self.mem(np.array([nbytes]))[0])

    def _host_memory(self, rk: RankView, host_act: cp_model.LinearExprT) -> None:
        """Rank rk's host memory: its offloaded saved bytes (and a paged stash's spill buffer) and ZeRO-2's host
        gradients, under the host's bytes."""
        m, tv = self.m, self.tv
        hostg = self.mem_var(rk, "hostg")
        m.add(hostg >= self.rank_sum(self.mem(self.z2.host_grads), rk.r)).only_enforce_if(
            tv["pipeline_zero2_host_grads"])
        m.add(host_act + hostg <= self.cluster.host_memory_bytes // MEM_UNIT)

    def _time_terms(self, rk: RankView) -> dict:
        """Per resource of the ranked view (search/ranking.py), rank rk's seconds per microbatch under the chosen
        mode and lifecycle: its layers' sum plus the rank-level terms (`_extra`)."""
        m, r = self.m, rk.r
        times = {}
        for res in self.c0.time:
            t = self._time_var(rk, f"t_{res}")
            for md in self.modes:
                for lc in self.lcs:
                    m.add(t >= self.rank_sum(self._t(self.base[(md, lc)].time[res]), r)
                          + self._extra(res, r, md, rk.mine)).only_enforce_if([self.mv[md], self.lv[lc]])
            times[res] = t
        return times

    def _update_terms(self, r: int, field_name: str, prefix: str) -> dict:
        """Per resource of coefficient field `field_name` ("update" or "update_hidden"): rank r's seconds per update
        under the lifecycle, P2P Muon and ZeRO-2 host gradients chosen (one variable bounded below in each case)."""
        m, tv = self.m, self.tv
        out = {}
        for res in getattr(self.c0, field_name):
            u = m.new_int_var(0, self.time_ub, f"{prefix}_{res}_r{r}")
            for lc in self.lcs:
                base = self.rank_sum(self._t(getattr(self.base[(self.modes[0], lc)], field_name)[res]), r)
                pz = self.rank_sum(self._t(getattr(self.p2p[lc], field_name)[res]), r)
                z2 = self.rank_sum(self._t(getattr(self.z2, field_name)[res] - getattr(self.c0, field_name)[res]), r)
                m.add(u >= base).only_enforce_if([self.lv[lc], ~tv["p2p_muon"], ~tv["pipeline_zero2_host_grads"]])
                m.add(u >= pz).only_enforce_if([self.lv[lc], tv["p2p_muon"], ~tv["pipeline_zero2_host_grads"]])
                m.add(u >= base + z2).only_enforce_if([self.lv[lc], ~tv["p2p_muon"], tv["pipeline_zero2_host_grads"]])
                m.add(u >= pz + z2).only_enforce_if([self.lv[lc], tv["p2p_muon"], tv["pipeline_zero2_host_grads"]])
            out[res] = u
        return out

    def _extra(self, res: str, r: int, md: ActMode, mine: list[int]) -> cp_model.LinearExprT:
        """Rank-level time terms on top of the per-layer sums: PP packets, the toggles' costs."""
        c0, tv, K = self.c0, self.tv, self.K
        expr = 0
        if res in ("nvlink", "nic"):
            # Each PP packet (`pp_packet_terms`: its bytes without an open stream, plus R times a stream's), each
            # part's seconds rounded up.
            base, per_stream = pp_packet_terms(c0.stream_bytes)
            for boundary, hop, link in rank_packets(c0, r, mine):
                if link == res:
                    rate = c0.pp_seconds_per_byte[hop]
                    expr = expr + _tq(rate * base) + _tq(rate * per_stream) * self.closes_before(boundary)
            if res == self.bal.balance_resource and self.bal.balanced_inflight is not None:
                n_peak = peak_inflight(c0.compositions[r])
                if n_peak > self.bal.balanced_inflight:
                    a = self.base[(md, self.lcs[0])].act
                    moved = balance_moved_bytes(a, n_peak, self.bal.balanced_inflight)
                    coef = _ceil(moved * self.bal.balance_seconds_per_byte, TIME_UNIT)
                    bvar = self.m.new_int_var(0, self.time_ub, f"bal_r{r}_{res}_{self.modes.index(md)}")
                    self.m.add(bvar >= self.rank_sum(coef, r)).only_enforce_if(tv["balance_activations"])
                    expr = expr + bvar
        if res == "host_link":
            hvar = self.m.new_int_var(0, self.time_ub, f"off_r{r}_{self.modes.index(md)}")
            off = self.offload[md].time["host_link"] - self.base[(md, self.lcs[0])].time["host_link"]
            self.m.add(hvar >= self.rank_sum(self._t(off), r)).only_enforce_if(tv["activation_offload"])
            zvar = self.m.new_int_var(0, self.time_ub, f"z2t_r{r}_{self.modes.index(md)}")
            z2 = self.z2.time["host_link"] - self.c0.time["host_link"]
            self.m.add(zvar >= self.rank_sum(self._t(z2), r)).only_enforce_if(tv["pipeline_zero2_host_grads"])
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
            for res in cf.update:
                m.add(f.pp * update >= int(self._t(cf.update[res]).sum())).only_enforce_if(self.lv[lc])
            for res in cf.time:
                # Under an EP overlap schedule the time has the all-to-all's own resources, the update does not.
                t = self._t(cf.time[res])
                m.add(f.pp * stage >= int(t.sum())).only_enforce_if([self.mv[md], self.lv[lc]])
                if k_moe:
                    # Pigeonhole: some rank holds at least ceil(n_moe / p) MoE layers.
                    m.add(stage >= int(np.sort(t[: self.L][moe])[:k_moe].sum())).only_enforce_if(
                        [self.mv[md], self.lv[lc]])
        slots_v = schedule_slot_units(f.pp, f.vp, f.microbatches)
        self.toggle_scale = len(RANK_TOGGLES) + len(ACT_TOGGLES) + 1
        self.tie_unit, self.tie_max = _tie_resolution(slots_v * self.time_ub + 2 * f.vp * self.time_ub,
                                                      self.cap_bytes, self.toggle_scale)
        peak_tie = m.new_int_var(0, self.tie_max, "peak_tie")
        for rk in self.ranks:
            m.add(peak_tie * (self.tie_unit // MEM_UNIT) >= rk["peak"])
        exposed = 0
        if self.c0.update_hidden:
            # Only the hidden communication beyond its window of update_hidden_stages x stage adds to the step.
            exposed = m.new_int_var(0, self.time_ub, "update_hidden_exposed")
            num, den = ratio(self.c0.update_hidden_stages)
            for rk in self.ranks:
                for u in rk["hidden"].values():
                    m.add(den * exposed >= den * u - num * stage)
        # The pipeline term: the step formula's slots x stage, and (v > 1) the replayed schedule's linear lower
        # bounds (search/replay_bound.py), so the objective is max(formula, replay bound) + update.
        self.pipe = m.new_int_var(0, slots_v * self.time_ub, "pipe")
        m.add(self.pipe >= slots_v * stage)
        self.paths: set[bytes] = set()
        if f.vp > 1:
            self._replay_terms()
        self.step_units = self.pipe + f.vp * (update + exposed)
        self.stage, self.update = stage, update
        # Lexicographic: step time, then the worst-rank peak (MiB), then fewer activation and rank toggles on,
        # so that equal layouts do not switch on toggles that buy nothing.
        toggles_on = sum(self.tv[t] for t in RANK_TOGGLES) + sum(
            (sum(getattr(md, t) for t in ACT_TOGGLES) + bool(md.offload)) * v for md, v in self.mv.items())
        self.obj_scale = (self.tie_max + 1) * self.toggle_scale
        m.minimize(self.step_units * self.obj_scale + peak_tie * self.toggle_scale + toggles_on)

    # -- replayed schedule: linear lower bound (search/replay_bound.py) ---------------------------
    def _replay_terms(self) -> None:
        """Per rank r its stage time tr_r (>= every resource's time: exact at a layout); an exact upper bound U_r
        of the replay's W_r = sum over r's chunks of the chunk's busiest-resource work (schedule.chunk_times'
        `work`): the rank's sum of per-layer maxima over resources and modes, per state of the toggles that change
        per-layer time; T_r, one resource's per-layer sum over the rank (<= t_r, <= U_r); and per chunk j a lower
        bound cl_j of its replayed time c_j = t_r w_j / W_r:

            c_j >= w_j + min(0, t_r - W_r) >= e_j + min(0, T_r - U_r) = e_j + T_r - U_r,  e_j <= w_j

        (t_r <= W_r: c_j - w_j - t_r + W_r = (W_r - w_j)(W_r - t_r) / W_r >= 0; t_r >= W_r: c_j >= w_j; the
        middle term grows with t_r and falls with W_r). PP packets and rank-level traffic are in t_r but not in
        W_r, so they stay out of both T_r and U_r. U_r is exact (equalities under the mode and toggle literals),
        so the solver cannot loosen the bound by inflating it. Then the paths of `replay_bound` bound the
        makespan (add_replay_paths).

        Per group of modes with one recompute mode and lifecycle (the activation toggles change the arrays less):
        the per-layer least of each resource (for e_j, `_replay_least_work`) and the per-layer greatest over
        resources (for U_r, `_replay_greatest_work`), the latter for each state of the two toggles that add
        host-link traffic per layer (activation offload, ZeRO-2 host gradients), exact per state rather than
        max + delta."""
        p, L = self.f.pp, self.L
        groups, lits = self._replay_groups()
        keep: dict[tuple[Recompute, FsdpLifecycle], list[tuple[np.ndarray, list]]] = {}
        hi: dict[tuple[tuple[Recompute, FsdpLifecycle], bool, bool], np.ndarray] = {}
        for g, mds in groups.items():
            keep[g] = self._replay_least_work(g, mds, lits[g])
            for o_on, z_on in itertools.product((False, True), repeat=2):
                hi[(g, o_on, z_on)] = self._replay_greatest_work(g, mds, o_on, z_on)
        self._replay_rank_terms(hi, lits)
        self._replay_chunk_bounds(groups, keep)
        full = [md.recompute == Recompute.FULL for md in self.modes]
        self.betas = replay_bound.betas(full)
        layer_work = busiest_layer_seconds(self.c0)[:L]
        self.layer_work = layer_work
        if 2 * p * self.f.vp * self.f.microbatches <= POLICY.max_dag_ops:
            self._replay_dag()
        self.add_replay_paths(replay_bound.seed_paths(p, self.f.vp, self.f.microbatches, layer_work,
                                                      self.betas[0]))

    def _replay_groups(self) -> tuple[dict[tuple[Recompute, FsdpLifecycle], list[ActMode]],
                                      dict[tuple[Recompute, FsdpLifecycle], list]]:
        """The node's modes grouped by (recompute mode, lifecycle), and each group's literals: a Boolean per
        recompute mode (when the node has several) and the lifecycle's (when it has several)."""
        m = self.m
        groups: dict[tuple[Recompute, FsdpLifecycle], list[ActMode]] = {}
        for md, lc in self.base:
            groups.setdefault((md.recompute, lc), []).append(md)
        rcs = sorted({md.recompute for md in self.modes}, key=lambda x: x.value)
        rc_lit = {}
        for rc in rcs:
            if len(rcs) == 1:
                rc_lit[rc] = []
            else:
                b_ = m.new_bool_var(f"rc_{rc.value}")
                m.add(b_ == sum(v for md, v in self.mv.items() if md.recompute == rc))
                rc_lit[rc] = [b_]
        lits = {g: rc_lit[g[0]] + ([self.lv[g[1]]] if len(self.lcs) > 1 else []) for g in groups}
        return groups, lits

    def _replay_least_work(self, g: tuple[Recompute, FsdpLifecycle], mds: list[ActMode], lits: list
                           ) -> list[tuple[np.ndarray, list]]:
        """Group g's per-layer least work (TIME_UNIT, floored) of each resource no other one dominates layer by
        layer, under the group's literals; and the host link's under offload / ZeRO-2 host gradients, each state
        under its literals."""
        c0 = self.c0
        off, zz = self.tv["activation_offload"], self.tv["pipeline_zero2_host_grads"]
        cfs = [self.base[(md, g[1])] for md in mds]
        lo = {res: np.min([np.floor(np.asarray(cf.time[res]) / TIME_UNIT + 1e-9) for cf in cfs], axis=0
                          ).astype(np.int64) for res in c0.time}
        kept: list[str] = []
        for res, arr in sorted(lo.items(), key=lambda kv: -int(kv[1].sum())):
            if arr.any() and not any(np.all(arr <= lo[k]) for k in kept):
                kept.append(res)  # a resource no kept one dominates layer by layer
        keep = [(lo[res], lits) for res in kept]
        if "host_link" in c0.time:
            for o_on, z_on in ((True, False), (False, True), (True, True)):
                if (o_on and True not in choices(self.job, "activation_offload")) or (
                        z_on and True not in choices(self.job, "pipeline_zero2_host_grads")):
                    continue
                rows = []
                for md, cf in zip(mds, cfs, strict=True):
                    arr = np.asarray(cf.time["host_link"], dtype=float)
                    if o_on:
                        arr = arr + self.offload[md].time["host_link"] - self.base[(md, self.lcs[0])].time[
                            "host_link"]
                    if z_on:
                        arr = arr + self.z2.time["host_link"] - c0.time["host_link"]
                    rows.append(np.floor(arr / TIME_UNIT + 1e-9))
                keep.append((np.maximum(np.min(rows, axis=0), 0).astype(np.int64),
                             [*lits, off if o_on else ~off, zz if z_on else ~zz]))
        return keep

    def _replay_greatest_work(self, g: tuple[Recompute, FsdpLifecycle], mds: list[ActMode], o_on: bool,
                              z_on: bool) -> np.ndarray:
        """Group g's per-layer greatest work (TIME_UNIT, rounded up) over its modes and resources, with the host
        link's offload (`o_on`) and ZeRO-2 (`z_on`) traffic on top."""
        c0 = self.c0
        rows = []
        for md in mds:
            cf = self.base[(md, g[1])]
            for res in cf.time:
                arr = np.asarray(cf.time[res], dtype=float)
                if res == "host_link" and o_on:
                    arr = arr + np.maximum(self.offload[md].time[res] - self.base[(md, self.lcs[0])].time[res], 0)
                if res == "host_link" and z_on:
                    arr = arr + np.maximum(self.z2.time[res] - c0.time[res], 0)
                rows.append(self._t(arr))
        return np.max(rows, axis=0)

    def _replay_rank_terms(self, hi: dict[tuple[tuple[Recompute, FsdpLifecycle], bool, bool], np.ndarray],
                           lits: dict[tuple[Recompute, FsdpLifecycle], list]) -> None:
        """Per rank r: tr_r at least every resource's time, and U_r, its layers' sum of `hi` in the state the
        literals pick (plus the chunked cross entropy's extra LM-head forward on the last chunk)."""
        m, K, p, L = self.m, self.K, self.f.pp, self.L
        c0, tv = self.c0, self.tv
        off, zz = tv["activation_offload"], tv["pipeline_zero2_host_grads"]
        ub = self.time_ub * 4
        fce = max(0, _tq(self.fce.time["tensor"][L + 1] - c0.time["tensor"][L + 1]))
        self.tr, self.ur = [], []
        for r, rk in enumerate(self.ranks):
            mine = list(range(r, K, p))
            t = m.new_int_var(0, self.time_ub, f"tr_r{r}")
            for x in rk["times"].values():
                m.add(t >= x)
            u = m.new_int_var(0, ub, f"u_layers_r{r}")
            for (g, o_on, z_on), arr in hi.items():
                m.add(u == self.rank_sum(arr, r)).only_enforce_if(
                    [*lits[g], off if o_on else ~off, zz if z_on else ~zz])
            if (K - 1) in mine and fce:
                u = u + fce * tv["fused_cross_entropy"]
            self.tr.append(t)
            self.ur.append(u)

    def _replay_chunk_bounds(self, groups: dict[tuple[Recompute, FsdpLifecycle], list[ActMode]],
                             keep: dict[tuple[Recompute, FsdpLifecycle], list[tuple[np.ndarray, list]]]) -> None:
        """Per chunk j, cl_j >= e_j + T_r - U_r. T_r: the largest of the rank's sums of one resource's per-layer
        least (`keep`), in the state the literals pick (<= t_r, <= U_r); bounded below only, the direction the
        solver wants to push it."""
        m, K, p = self.m, self.K, self.f.pp
        self.cl = [m.new_int_var(0, self.time_ub, f"cl_{j}") for j in range(K)]
        for r in range(p):
            low = m.new_int_var(0, self.time_ub, f"T_r{r}")
            for g in groups:
                for arr, lit in keep[g]:
                    m.add(low >= self.rank_sum(arr, r)).only_enforce_if(lit)
            for j in range(r, K, p):
                for g in groups:
                    for arr, lit in keep[g]:
                        m.add(self.cl[j] >= self.chunk(arr, j) + low - self.ur[r]).only_enforce_if(lit)

    def _replay_dag(self) -> None:
        """The replay itself over the per-chunk bounds: a start time per operation (rank order and microbatch
        chain as precedences, as schedule.replay_ops runs them), forward SCALE / (1 + beta) cl_j and backward
        SCALE beta / (1 + beta) cl_j long (the least over the node's betas), the pipeline term at least the last
        end of every rank. The least start times meeting the precedences are the replay's, so the smallest
        makespan the solver can pick is the replay at durations cl_j <= c_j: a lower bound of the true replay for
        every split, exact up to the per-chunk bounds, and linear (its LP relaxation sees fractional splits)."""
        m, p, v, mb_n = self.m, self.f.pp, self.f.vp, self.f.microbatches
        k_all = p * v
        # Floored like replay_bound.path_coefficients: a duration rounded up would no longer bound the replay.
        fc = min(math.floor(replay_bound.SCALE / (1 + b) + 1e-9) for b in self.betas)
        bc = min(math.floor(replay_bound.SCALE * b / (1 + b) + 1e-9) for b in self.betas)
        horizon = replay_bound.SCALE * (v * mb_n + p) * self.time_ub
        start: dict[tuple[bool, int, int], cp_model.IntVar] = {}

        def end(key: tuple[bool, int, int]) -> cp_model.LinearExprT:
            return start[key] + (fc if key[0] else bc) * self.cl[key[1]]

        for r in range(p):
            last = None
            for is_f, k, mb in pipeline_order(p, v, mb_n, r):
                key = (is_f, k * p + r, mb)
                start[key] = m.new_int_var(0, horizon, f"s{'fb'[not is_f]}{key[1]}_{mb}")
                if last is not None:
                    m.add(start[key] >= end(last))
                last = key
            assert last is not None
            m.add(replay_bound.SCALE * self.pipe >= v * end(last))
        for (is_f, g, mb), var in start.items():
            if is_f and g > 0:
                m.add(var >= end((True, g - 1, mb)))
            elif not is_f:
                m.add(var >= end((True, g, mb) if g == k_all - 1 else (False, g + 1, mb)))

    def add_replay_paths(self, paths: list[tuple[np.ndarray, np.ndarray]]) -> int:
        """Lower bounds of the replayed makespan, one per path (replay_bound): with a_j the path's integer
        coefficients (SCALE x), per rank r the part a_min,r x t_r + sum_j (a_j - a_min,r) cl_j (its chunks' times
        sum to t_r exactly, each at least cl_j). Returns how many were new."""
        if self.f.vp == 1:
            return 0
        p, v = self.f.pp, self.f.vp
        rows = replay_bound.undominated([replay_bound.path_coefficients(nf, nb, self.betas) for nf, nb in paths])
        new = 0
        for a in rows:
            key = a.tobytes()
            if key in self.paths:
                continue
            self.paths.add(key)
            new += 1
            expr = 0
            for r in range(p):
                ar = a[r::p]
                amin = int(ar.min())
                if amin:
                    expr = expr + amin * self.tr[r]
                for k, x in enumerate(ar.tolist()):
                    if x > amin:
                        expr = expr + (x - amin) * self.cl[k * p + r]
            self.m.add(replay_bound.SCALE * self.pipe >= v * expr)
        return new

    def add_split_paths(self, splits: list[list[int]]) -> None:
        """The replay's longest paths at these splits (e.g. a hint's), over the node's per-layer work."""
        if self.f.vp > 1:
            self.add_replay_paths(replay_bound.split_paths(self.f.pp, self.f.vp, self.f.microbatches,
                                                           self.layer_work, splits, self.betas[0]))

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
            self.add_split_paths([list(split)])

    def add_step_bound(self, step_lb_s: float) -> None:
        """A valid lower bound on the step time (the node's linear relaxation), as a cut on the objective: the
        solver's step (rounded up per layer) is at least the exact step, which is at least the bound."""
        if math.isfinite(step_lb_s) and step_lb_s > 0:
            self.m.add(self.step_units >= int(math.floor(step_lb_s * self.f.vp / TIME_UNIT)))

    def add_layout_hint(self, layout: Layout) -> None:
        """A complete solution hint from a fitting layout of this frame (an incumbent): its split, mode,
        lifecycle and toggles. Parts the model does not have (a mode dropped as dominated) are left unhinted."""
        if len(layout.split) != self.K or self.fixed_split is not None:
            return
        self.m.clear_hints()
        self.add_split_paths([list(layout.split)])
        bounds = np.cumsum(layout.split)
        for j in range(1, self.K):
            for i in range(self.L):
                self.m.add_hint(self.z[i][j], int(i >= bounds[j - 1]))
        tg = layout.toggles
        mode = ActMode(layout.recompute, *(getattr(tg, t) for t in ACT_TOGGLES),
                       offload=tuple(m.value for m in layout.offload_modules))
        if mode in self.mv:
            for md, var in self.mv.items():
                self.m.add_hint(var, int(md == mode))
        if layout.fsdp_lifecycle in self.lv:
            for lc, var in self.lv.items():
                self.m.add_hint(var, int(lc == layout.fsdp_lifecycle))
        for t, var in self.tv.items():
            self.m.add_hint(var, int(getattr(tg, t)))

    # -- solve --------------------------------------------------------------------------------
    def solve(self, time_limit: float, workers: int = 2, presolve: bool = True,
              relative_gap: float = 0.0) -> FrameResult:
        """Solve to the time limit or to `relative_gap` (CP-SAT then says OPTIMAL; the bound stays valid).
        CP-SAT does not catch Ctrl-C: the driver's handler does, and stops after this slice."""
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(time_limit, POLICY.min_solve_s)
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = 7
        solver.parameters.relative_gap_limit = relative_gap
        solver.parameters.catch_sigint_signal = False
        if self.f.vp > 1:
            # Presolve probing on an interleaved K3 node (PP8 VP3: 2,400 variables, 440k linear terms) takes 19 s
            # of a 20-s slice on 2 cores and leaves the solver with nothing, not even the hinted incumbent; without
            # it the same solve returns the incumbent and the relaxation's bound.
            solver.parameters.cp_model_probing_level = 0
        if not presolve:
            solver.parameters.cp_model_presolve = False
        got = isolated.solve(solver, self.m)
        st = got.status
        if st == cp_model.MODEL_INVALID:
            raise RuntimeError(f"CP-SAT model of {self.f} is invalid: {self.m.validate()[:300]}")
        proto = self.m.proto
        res = FrameResult(self.f, got.name, variables=len(proto.variables), constraints=len(proto.constraints))
        if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            split = self._read_split(got)
            md = next(md for md, v in self.mv.items() if got.value(v))
            lc = next(lc for lc, v in self.lv.items() if got.value(v))
            tg = {t: bool(got.value(v)) for t, v in self.tv.items()}
            res.split, res.shape = split, frame_shape(self.job, self.f, md, lc, **tg)
            res.objective = int(got.objective_value)
        if st in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
            res.bound = max(int(got.best_objective_bound), 0)
            res.bound_step_s = (res.bound // self.obj_scale) * TIME_UNIT / self.f.vp
        return res

    def _read_split(self, got: isolated.Solved) -> list[int]:
        counts = [0] * self.K
        for i in range(self.L):
            j = sum(int(got.value(self.z[i][jj])) for jj in range(1, self.K))
            counts[j] += 1
        return counts


def _tq(seconds: float) -> int:
    return int(math.ceil(seconds / TIME_UNIT - 1e-9))


def solve_frame(job: Job, f: Frame, model: ModelSpec, cluster: ClusterSpec, time_limit: float,
                workers: int = 2, presolve: bool = True,
                recompute: Recompute | None = None, lifecycle: FsdpLifecycle | None = None,
                hint: Layout | None = None, relative_gap: float = 0.0, deadline: float = math.inf
                ) -> tuple[FrameResult, PlanItem | None]:
    """Solve one frame (optionally one recompute mode and lifecycle of it) to optimality, to `relative_gap`, or
    to the time limit. `hint`: a fitting layout of the frame, handed to CP-SAT as its first solution. The solves
    also stop by the monotonic `deadline` (the search's end), however long the model took to build."""
    modes = [md for md in act_modes(job) if recompute is None or md.recompute == recompute]
    lcs = [lifecycle] if lifecycle is not None else lifecycles(job)
    modes = undominated_modes(job, f, modes, lcs, model, cluster)
    fm = FrameModel(job, f, model, cluster, modes=modes, lcs=lcs)
    if recompute is not None and lifecycle is not None:
        key = node_key(job, f, recompute, lifecycle, model, cluster)
        if key not in DP_HINTS:
            node_lower_bound(job, f, recompute, lifecycle, model, cluster)
        stage_lb, split = DP_HINTS.get(key, (0.0, None))
        fm.add_stage_bound(stage_lb, split)
        fm.add_step_bound(LP_BOUNDS.get(key, 0.0))
    if hint is not None:
        fm.add_layout_hint(hint)
    # Building a node's model (its bounds, thousands of replay rows) can take seconds: they count against the end.
    time_limit = max(min(time_limit, deadline - time.monotonic()), POLICY.min_solve_s)
    if f.vp == 1:
        res = fm.solve(time_limit, workers, presolve, relative_gap)
        return res, plan_item(job, f, fm, res, model, cluster)
    return _solve_with_replay_cuts(job, f, fm, model, cluster, time_limit, workers, presolve, relative_gap,
                                   node_key(job, f, recompute, lifecycle, model, cluster))


_NODE_PATHS: dict[tuple, list[tuple[np.ndarray, np.ndarray]]] = register({})
"""Replay paths found at a node's solutions, kept for its next solve (a node cut by its slice is solved again)."""


OBJECTIVE_LIMIT = 2 ** 60
"""What the objective's largest value stays under: CP-SAT refuses a model whose objective could overflow int64."""


def _tie_resolution(step_ub: int, cap_bytes: int, toggle_scale: int) -> tuple[int, int]:
    """(bytes per unit of the peak tie-break, its largest value): MiB, coarsened by powers of two only where the
    objective, (step_ub + 1) x (tie_max + 1) x toggle_scale, would pass OBJECTIVE_LIMIT (thousands of microbatches
    make the step's units large); the step time itself is never coarsened."""
    unit = PEAK_TIE_UNIT
    while (step_ub + 1) * (cap_bytes // unit + 2) * toggle_scale >= OBJECTIVE_LIMIT and unit < cap_bytes:
        unit *= 2
    return unit, cap_bytes // unit + 1


def _solve_with_replay_cuts(job: Job, f: Frame, fm: FrameModel, model: ModelSpec, cluster: ClusterSpec,
                            time_limit: float, workers: int, presolve: bool, relative_gap: float,
                            key: tuple) -> tuple[FrameResult, PlanItem | None]:
    """Interleaved nodes: solve; when the solution's ranked time (its replay) is above the model's objective by
    more than the gap, add the replay's longest path at that solution as a cut (replay_bound), hint the solution,
    keep the proven bound (a lower bound of the tightened model too) and solve again, while time is left. The
    bound stays valid throughout. A path found at a solution the slice cut (FEASIBLE) is kept for the node's next
    solve (_NODE_PATHS); a node that proved its model but has no time left for the new path's solve returns
    FEASIBLE, so the driver solves it again with the paths found so far."""
    fm.add_replay_paths(_NODE_PATHS.get(key, []))
    deadline = time.monotonic() + time_limit
    best: tuple[FrameResult, PlanItem | None] | None = None
    bound = 0
    timed_out = False
    while True:
        res = fm.solve(max(deadline - time.monotonic(), POLICY.min_solve_s), workers, presolve, relative_gap)
        last_status = res.status
        item = plan_item(job, f, fm, res, model, cluster)
        bound = max(bound, res.bound or 0)
        if best is None or (item is not None and (best[1] is None or item.rank_time_s < best[1].rank_time_s)):
            best = (res, item)
        if item is None or res.objective is None:
            break
        objective_s = (res.objective // fm.obj_scale) * TIME_UNIT / f.vp
        if item.rank_time_s <= objective_s * (1 + relative_gap) + 1e-9:
            break  # the model prices its solution at its ranked time (within the gap): the proof holds for it
        path = _solution_path(fm, res, model, cluster)
        if not fm.add_replay_paths([path]):
            break  # the longest path is in already: the rest is the per-chunk bounds' slack
        _NODE_PATHS.setdefault(key, []).append(path)  # kept for the next solve of a node cut by its slice
        if res.status != "OPTIMAL":
            break
        if deadline - time.monotonic() < POLICY.min_cut_slice_s:
            timed_out = True  # the gap to the ranked time is open: solve again, with this path
            break
        fm.add_layout_hint(item.layout)
        fm.m.add(fm.step_units >= bound // fm.obj_scale)
    res, item = best
    res.bound = max(res.bound or 0, bound)
    res.bound_step_s = (res.bound // fm.obj_scale) * TIME_UNIT / f.vp
    if timed_out or (res.status == "OPTIMAL" and last_status != "OPTIMAL"):
        # A later solve cut by the slice has not proven the tightened model: the driver solves the node again.
        res.status = "FEASIBLE"
    return res, item


def _solution_path(fm: FrameModel, res: FrameResult, model: ModelSpec, cluster: ClusterSpec
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The replay's longest path at a solution, over its chunks' busiest-resource work in the ranked view (each
    rank's stage taken as its resources' largest sum): which path is longest, not its length, is what the cut
    needs, and any path gives a valid cut."""
    assert res.shape is not None and res.split is not None
    cf = coefficients(res.shape, model, cluster)
    edges = np.concatenate([[0], np.cumsum(res.split)]).astype(int)
    k, p = fm.K, fm.f.pp

    def chunk(a: np.ndarray, j: int) -> float:
        return float(a[edges[j]:edges[j + 1]].sum() + (a[fm.L] if j == 0 else 0.0)
                     + (a[fm.L + 1] if j == k - 1 else 0.0))

    sums = {res_: np.array([chunk(np.asarray(a), j) for j in range(k)]) for res_, a in cf.time.items()}
    work = np.max(list(sums.values()), axis=0)
    stages = [max(float(v[r::p].sum()) for v in sums.values()) for r in range(p)]
    fwd, bwd = chunk_times(work, stages, p, res.shape.recompute == Recompute.FULL)
    return critical_path(p, fm.f.vp, fm.f.microbatches, fwd, bwd)


def plan_item(job: Job, f: Frame, fm: FrameModel, res: FrameResult, model: ModelSpec,
          cluster: ClusterSpec) -> PlanItem | None:
    if res.split is None or res.shape is None:
        return None
    layout = layout_of(job, f, res.shape, res.split)
    ev = evaluate(layout, model=model, cluster=cluster)
    _check_agreement(fm, res, ev)
    return PlanItem(layout, ev)


def _check_agreement(fm: FrameModel, res: FrameResult, ev: Evaluation) -> None:
    """The solver's integer objective and evaluate()'s ranked step time (search/ranking.py) must agree to the
    integer resolution. A solution CP-SAT has not proven optimal may leave a max variable above the terms it
    bounds, so its objective is only an upper bound of the layout's ranked time: then only the lower side holds
    (an objective below evaluate() would be a term the model misses). CP-SAT also says OPTIMAL when it stops at a
    relative gap; only a bound that meets the objective proves it."""
    f = fm.f
    solver_step = (res.objective // fm.obj_scale) * TIME_UNIT / f.vp
    slack = (fm.L + 2 + 4 * fm.K) * TIME_UNIT * (f.vp * f.microbatches + f.pp) * 2 + 1e-6
    ranked = ev.step.formula_time_s  # the model's objective is at least the formula, at most the ranked time
    # The ranking view leaves out the unpaired microbatches of an EP overlap schedule (a job's ep_overlap).
    below = ev.step.achievable_unpaired_ep_s
    exact = res.status == "OPTIMAL" and res.bound is not None and res.objective is not None \
        and res.bound >= res.objective
    upper = ev.step.rank_time_s + slack if exact else float("inf")
    if not (ranked - below - 1e-9 <= solver_step <= upper):
        raise RuntimeError(
            f"solver and evaluate() disagree on {f}: solver {solver_step:.6f} s, evaluate {ranked:.6f} s"
        )
    if not fits(fm.job, ev):
        raise RuntimeError(f"solver returned a layout evaluate() says does not fit: {f} {res.split}")
