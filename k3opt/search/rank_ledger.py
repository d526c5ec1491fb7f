"""One rank's ledger as a CP-SAT submodel, built from the ledger's declarations (k3opt.cost.ledger.LEDGER).

Each declaration's aggregation picks its builder: a term summed over the rank's layers, held once per MoE rank or
on the last stage is priced from its declaration alone, under each coefficient variant that a decision of the node
model selects (the FSDP lifecycle, and the rank toggle that changes the term, from the toggle registry), and in its
declared toggled form while that toggle is on. The in-flight terms, the largest backward working set, the PP
packets and the optimizer step have one builder each. The rank's peak is persistent + max(activation phase,
optimizer phase), the ledger's (seed 001). Every variable is in KiB, each per-layer figure rounded up, so the
submodel never accepts a rank that evaluate() rejects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from ortools.sat.python import cp_model

from k3opt.cost.coefficients import Coefficients, step_gather_bytes
from k3opt.cost.ledger import (
    LEDGER,
    TERMS,
    Aggregate,
    Moment,
    Phase,
    TermDecl,
    activation_moments,
    balanced_scale,
    declared_layer_bytes,
    peak_inflight,
    pp_packet_bytes,
    rank_gate,
)

if TYPE_CHECKING:
    from k3opt.search.node_model import FrameModel

Expr = cp_model.LinearExprT
MEM_UNIT = 1024  # bytes: the node model's memory resolution


@dataclass
class RankView:
    """What the builders of one rank share: its index, chunks, layer-kind indicators and edge columns."""

    r: int
    mine: list[int]
    """Its global chunks r, r + p, ..."""
    has: list
    """Per layer kind, whether the rank holds one (`FrameModel.has_kind`)."""
    edges: list[int]
    """The edge columns it holds (L: the first chunk's, L + 1: the last chunk's)."""
    holds_last: bool


@dataclass
class LedgerPart:
    """Some ledger terms' bytes on the rank, in KiB: one term, or the terms one builder prices together."""

    keys: tuple[str, ...]
    phase: Phase
    expr: Expr


def ratio(x: float) -> tuple[int, int]:
    """x as num/den with den 2^16, num rounded up (balance scales are ratios of small integers)."""
    if x == 1.0:
        return 1, 1
    den = 1 << 16
    return math.ceil(x * den), den


class RankLedgerModel:
    """Rank rk's ledger in the node model `fm`: `parts` (every LEDGER term, each in one part), the phases' sums,
    `peak` (under the node's budget), `host_act` (the offloaded saved bytes), `host_stash` and `has_moe`."""

    def __init__(self, fm: FrameModel, rk: RankView) -> None:
        self.fm, self.rk, self.m = fm, rk, fm.m
        self.has_moe = self._has_moe()
        self.host_act: cp_model.IntVar | None = None
        self.host_stash: Expr = 0
        """The paged stash's host spill buffer (0 without one)."""
        builders: dict[Aggregate, Callable[[list[TermDecl]], list[LedgerPart]]] = {
            Aggregate.LAYER_SUM: self._layer_sums,
            Aggregate.MOE_RANK: self._declared_each,
            Aggregate.LAST_STAGE: self._declared_each,
            Aggregate.IN_FLIGHT: self._in_flight,
            Aggregate.LARGEST_LAYER: self._largest_layer,
            Aggregate.CHUNK_PAIR: self._pp_packets,
            Aggregate.STEP: self._optimizer_step,
        }
        self.parts: list[LedgerPart] = []
        for agg, build in builders.items():
            decls = [t for t in LEDGER if t.aggregate is agg]
            if decls:
                self.parts += build(decls)
        priced = [k for p in self.parts for k in p.keys]
        missing = [t.key for t in LEDGER if t.key not in priced]
        if missing or len(priced) != len(set(priced)):
            raise ValueError(f"rank ledger submodel: terms {missing} have no builder, or one is priced twice")
        self.peak = fm.mem_var(rk, "peak")
        persistent = self.phase(Phase.PERSISTENT)
        for group in activation_moments(fm.c0.shape.ep_overlap):
            self.m.add(self.peak >= persistent + sum((self.moment(mo) for mo in group), start=0))
        self.m.add(self.peak >= persistent + self.phase(Phase.OPTIMIZER))
        self.m.add(self.peak <= fm.cap_bytes // MEM_UNIT)

    def phase(self, phase: Phase) -> Expr:
        """The sum of the parts in `phase`."""
        return sum((p.expr for p in self.parts if p.phase is phase), start=0)

    def moment(self, moment: Moment) -> Expr:
        """The sum of the activation-phase parts live at `moment` (a part's terms share one, `_one_phase`)."""
        return sum((p.expr for p in self.parts if p.phase is Phase.ACTIVATION and TERMS[p.keys[0]].moment is moment),
                   start=0)

    def part(self, key: str) -> LedgerPart:
        """The part that holds ledger term `key`."""
        return next(p for p in self.parts if key in p.keys)

    # -- what a term reads ---------------------------------------------------------------------
    def _has_moe(self) -> cp_model.IntVar:
        """Whether the rank holds a layer with routed experts."""
        m, fm, rk = self.m, self.fm, self.rk
        moe_kinds = [k for k, rep in enumerate(fm.kind_rep) if fm.c0.moe[rep] > 0]
        has_moe = m.new_bool_var(f"hasmoe_r{rk.r}")
        m.add(has_moe <= sum(rk.has[k] for k in moe_kinds)) if moe_kinds else m.add(has_moe == 0)
        for k in moe_kinds:
            m.add(has_moe >= rk.has[k])
        return has_moe

    def _cases(self, t: TermDecl) -> list[tuple[list, Coefficients, Aggregate, str]]:
        """The coefficient variants of term t and the literals that select each: per FSDP lifecycle where its
        coefficient differs between lifecycles; with its rank toggle off, and on (at the node's first lifecycle,
        in the declared toggled form if any)."""
        fm = self.fm
        gate = rank_gate(t.key)
        offs = {lc: fm.base[(fm.modes[0], lc)] for lc in fm.lcs}
        first = getattr(fm.c0, t.coefficient)
        if all(np.array_equal(getattr(cf, t.coefficient), first) for cf in offs.values()):
            cases = [([], fm.c0, t.aggregate, t.coefficient)]
        else:
            cases = [([fm.lv[lc]], cf, t.aggregate, t.coefficient) for lc, cf in offs.items()]
        if gate is None:
            return cases
        on = (t.toggled.aggregate, t.toggled.coefficient) if t.toggled and t.toggled.toggle == gate \
            else (t.aggregate, t.coefficient)
        off = [([*lits, ~fm.tv[gate]], cf, agg, co) for lits, cf, agg, co in cases]
        return [*off, ([fm.tv[gate]], fm.on[gate], *on)]

    def _lower_bounds(self, cf: Coefficients, agg: Aggregate, coefficient: str) -> list[Expr]:
        """The term's bytes under one variant, as lower bounds of its variable (one, or one per chunk)."""
        fm, rk = self.fm, self.rk
        value = getattr(cf, coefficient)
        if agg is Aggregate.LAYER_SUM:
            return [fm.rank_sum(fm.mem(value), rk.r)]
        if agg is Aggregate.CHUNK_PAIR:
            return [2 * fm.chunk(fm.mem(value), j) for j in rk.mine]
        if agg is Aggregate.MOE_RANK:
            return [fm.mem_int(value) * self.has_moe]
        if agg is Aggregate.LAST_STAGE:
            return [fm.mem_int(value) if rk.holds_last else 0]
        raise ValueError(f"{agg} has its own builder")

    def _declared(self, t: TermDecl, cases: list | None = None) -> LedgerPart:
        """Term t priced from its declaration (its variants `cases`, from `_cases` when not given): one expression
        when no decision changes it, else a variable above each variant under the literals that select it."""
        cases = cases if cases is not None else self._cases(t)
        if len(cases) == 1 and not cases[0][0]:
            (lb,) = self._lower_bounds(*cases[0][1:])
            return LedgerPart((t.key,), t.phase, lb)
        var = self.fm.mem_var(self.rk, t.key)
        for lits, cf, agg, co in cases:
            for lb in self._lower_bounds(cf, agg, co):
                self.m.add(var >= lb).only_enforce_if(lits)
        return LedgerPart((t.key,), t.phase, var)

    # -- the builders, one per aggregation ------------------------------------------------------------
    def _layer_sums(self, decls: list[TermDecl]) -> list[LedgerPart]:
        """The terms summed over the rank's layers. Those no decision changes are added per layer before they are
        rounded up (one rounding, `ledger.declared_layer_bytes`); the others are priced one by one."""
        cases = {t.key: self._cases(t) for t in decls}
        fixed = [t for t in decls if len(cases[t.key]) == 1]
        parts = [self._declared(t, cases[t.key]) for t in decls if t not in fixed]
        if fixed:
            keys = tuple(t.key for t in fixed)
            phases = {t.phase for t in fixed}
            if len(phases) != 1:
                raise ValueError(f"fixed layer sums {keys} span phases {phases}")
            total = self.fm.rank_sum(self.fm.mem(declared_layer_bytes(self.fm.c0, fixed)), self.rk.r)
            parts.insert(0, LedgerPart(keys, phases.pop(), total))
        return parts

    def _declared_each(self, decls: list[TermDecl]) -> list[LedgerPart]:
        return [self._declared(t) for t in decls]

    def _in_flight(self, decls: list[TermDecl]) -> list[LedgerPart]:
        """The saved activations and the AttnRes bank, together: at least every in-flight composition of the rank's
        chunks (one composition is the peak for both), scaled to balancing's average when on; under offload the
        saved bytes go to the host (`host_act`) and the GPU keeps the resident layers' worth of its largest saved
        set and the bank; under offload modules their part goes to the host (the rest is the mode's `act`)."""
        fm, rk, m = self.fm, self.rk, self.m
        c0, K, L = fm.c0, fm.K, fm.L
        comps = c0.compositions[rk.r]
        n_peak = peak_inflight(comps)
        scale_bal = balanced_scale(fm.on["balance_activations"].balanced_inflight, n_peak)
        stash = [t for t in decls if t.phase is Phase.PERSISTENT]
        decls = [t for t in decls if t.phase is not Phase.PERSISTENT]
        stream = fm.mem_int(c0.stream_bytes)
        ends = [fm.closes_before(j + 1) if j + 1 < K else int(c0.closes[:L].sum()) for j in rk.mine]
        bank = [stream * e for e in ends]
        acts = fm.mem_var(rk, "acts")
        self.host_act = host_act = fm.mem_var(rk, "host_act")
        off, bal = fm.tv["activation_offload"], fm.tv["balance_activations"]
        for md in fm.modes:
            a = fm.mem(fm.base[(md, fm.lcs[0])].act)
            chunk_act = [fm.chunk(a, j) for j in rk.mine]
            o = fm.mem(fm.base[(md, fm.lcs[0])].offloaded_act)
            chunk_off = [fm.chunk(o, j) for j in rk.mine]
            for comp in comps:
                for b_lit, sc in ((bal, scale_bal), (~bal, 1.0)):
                    tot = sum(c * (ca + bk) for c, ca, bk in zip(comp, chunk_act, bank, strict=True))
                    num, den = ratio(sc)
                    m.add(den * acts >= num * tot).only_enforce_if([fm.mv[md], ~off, b_lit])
                    host = sum(c * ca for c, ca in zip(comp, chunk_act, strict=True))
                    m.add(den * host_act >= num * host).only_enforce_if([fm.mv[md], off, b_lit])
                    if md.offload:
                        # Offload modules: their part of each in-flight microbatch waits in host memory.
                        moved = sum(c * co for c, co in zip(comp, chunk_off, strict=True))
                        m.add(den * host_act >= num * moved).only_enforce_if([fm.mv[md], ~off, b_lit])
            # Offload: the resident layers' worth of the largest saved set, plus the bank, on the GPU.
            amax = fm.mem_var(rk, f"amax{fm.modes.index(md)}")
            for k, rep in enumerate(fm.kind_rep):
                m.add(amax >= int(a[rep]) * rk.has[k])
            for e in rk.edges:
                m.add(amax >= int(a[e]))
            res_layers = fm.base[(md, fm.lcs[0])].shape.offload_resident_layers
            for comp in comps:
                for b_lit, sc in ((bal, scale_bal), (~bal, 1.0)):
                    num, den = ratio(sc)
                    bk = sum(c * b for c, b in zip(comp, bank, strict=True))
                    m.add(den * acts >= den * res_layers * amax + num * bk).only_enforce_if([fm.mv[md], off, b_lit])
        parts = [LedgerPart(tuple(t.key for t in decls), _one_phase(decls), acts)]
        if stash:
            parts.append(LedgerPart(tuple(t.key for t in stash), _one_phase(stash),
                                    self._stash_peak("stash", comps, scale_bal)))
            self.host_stash = self._stash_peak("stash_host", comps, scale_bal)
        return parts

    def _stash_peak(self, coefficient: str, comps: tuple[tuple[int, ...], ...], scale_bal: float) -> Expr:
        """The paged stash's buffer (`coefficient`: its CUDA or host bytes per in-flight microbatch): at least every
        in-flight composition's bytes, scaled as the saved set; 0 where no mode of the node has a stash."""
        fm, rk, m = self.fm, self.rk, self.m
        per_mode = {md: fm.mem(getattr(fm.base[(md, fm.lcs[0])], coefficient)) for md in fm.modes}
        if not any(a.any() for a in per_mode.values()):
            return 0
        peak = fm.mem_var(rk, coefficient)
        bal = fm.tv["balance_activations"]
        for md, a in per_mode.items():
            chunk = [fm.chunk(a, j) for j in rk.mine]
            for comp in comps:
                for b_lit, sc in ((bal, scale_bal), (~bal, 1.0)):
                    num, den = ratio(sc)
                    tot = sum(c * ca for c, ca in zip(comp, chunk, strict=True))
                    m.add(den * peak >= num * tot).only_enforce_if([fm.mv[md], b_lit])
        return peak

    def _largest_layer(self, decls: list[TermDecl]) -> list[LedgerPart]:
        """The backward working set of the rank's layer that needs the most (recompute's saved set and the
        gradient transient are one coefficient, `working_set`, per mode and lifecycle)."""
        fm, rk, m = self.fm, self.rk, self.m
        ws = fm.mem_var(rk, "ws")
        for md in fm.modes:
            for lc in fm.lcs:
                w = fm.mem(fm.base[(md, lc)].working_set)
                for k, rep in enumerate(fm.kind_rep):
                    m.add(ws >= int(w[rep]) * rk.has[k]).only_enforce_if([fm.mv[md], fm.lv[lc]])
                for e in rk.edges:
                    m.add(ws >= int(w[e])).only_enforce_if([fm.mv[md], fm.lv[lc]])
        return [LedgerPart(tuple(t.key for t in decls), _one_phase(decls), ws)]

    def _pp_packets(self, decls: list[TermDecl]) -> list[LedgerPart]:
        """Two of the rank's largest chunk's PP packets in and out (`ledger.pp_packet_bytes`), none before the first
        chunk or after the last."""
        fm, rk = self.fm, self.rk
        pp = fm.mem_var(rk, "pp")
        stream = fm.mem_int(fm.c0.stream_bytes)
        for j in rk.mine:
            pin = pp_packet_bytes(fm.closes_before(j), stream) if j > 0 else 0
            pout = pp_packet_bytes(fm.closes_before(j + 1), stream) if j < fm.K - 1 else 0
            self.m.add(pp >= 2 * (pin + pout))
        return [LedgerPart(tuple(t.key for t in decls), _one_phase(decls), pp)]

    def _optimizer_step(self, decls: list[TermDecl]) -> list[LedgerPart]:
        """The optimizer phase (`ledger.optimizer_transient_bytes`, as constraints): the step gather (the sharding
        policy's, or P2P Muon's resident pull) with the largest Newton-Schulz working set of the rank's layers on
        top (reference policy), or the larger of the two (the others)."""
        fm, rk, m, c0 = self.fm, self.rk, self.m, self.fm.c0
        nsws = fm.mem_var(rk, "nsws")
        w = fm.mem(c0.ns_working_set)
        for k, rep in enumerate(fm.kind_rep):
            m.add(nsws >= int(w[rep]) * rk.has[k])
        for e in rk.edges:
            m.add(nsws >= int(w[e]))
        opt = fm.mem_var(rk, "opt")
        for g_arr, lit in ((step_gather_bytes(c0, False), ~fm.tv["p2p_muon"]),
                           (step_gather_bytes(c0, True), fm.tv["p2p_muon"])):
            g_sum = fm.rank_sum(fm.mem(g_arr), rk.r)
            if c0.step_gather_with_ns:
                m.add(opt >= g_sum + nsws).only_enforce_if(lit)
            else:
                m.add(opt >= g_sum).only_enforce_if(lit)
                m.add(opt >= nsws).only_enforce_if(lit)
        return [LedgerPart(tuple(t.key for t in decls), _one_phase(decls), opt)]


def _one_phase(decls: list[TermDecl]) -> Phase:
    """The phase of terms one builder prices together (they must share one, and one moment)."""
    phases = {t.phase for t in decls}
    if len(phases) != 1 or len({t.moment for t in decls}) != 1:
        raise ValueError(f"ledger terms {[t.key for t in decls]} span phases {sorted(phases)} or moments")
    return phases.pop()
