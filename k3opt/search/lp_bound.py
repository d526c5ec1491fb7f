"""A linear-programming lower bound on a node's step time for interleaved frames (v > 1).

The exact node model assigns each layer to one chunk (contiguous chunks, chunk j on rank j mod p). Here a layer
may be split fractionally over the chunks and contiguity is dropped; everything else that the relaxation keeps is
a relaxation of the exact term, so the LP optimum is a lower bound on every layout of the node. One program per
variant: an activation mode of the node (the node model picks one for every layer) and a setting of the rank
toggles that trade work for bytes (offload, balancing, ZeRO-2 host gradients, P2P Muon, the chunked cross
entropy: global decisions), each with that variant's own work and bytes; the bound is the least over variants.
(The least work of one variant beside the least bytes of another lets a K3 PP4 VP4 node look like it fits at
the mean load, 18.12 s, when every fitting layout needs full-recompute-like savings: 20.7 s.)

- time: each rank's per-microbatch work on every resource is the sum of its layers' work, the first-chunk edge on
  rank 0, the last-chunk edge on rank p - 1, and its PP packets: at least their shallowest (`_packet_floor`), and
  each packet's open AttnRes streams, linear in the closing layers of the chunks before its boundary
  (`_packet_stream_rows`). The update is the same sum of per-layer update work. The replayed schedule
  (`StepTime.rank_time_s` ranks by the larger of the step formula and the replay): each chunk's replayed time is
  bounded below as in the node model (`_replay_terms`) and by a share of its work (`_share_ratio`), and every
  replay path of `replay_bound` bounds the makespan; the path longest at the program's own chunk times joins them
  and the program is solved again, up to `SearchPolicy.lp_path_rounds` times (`_violated_path`). Objective:
  max((M + (p - 1)/v) x the slowest rank, replay) + the slowest rank's update + the excess of its update
  communication over `update_hidden_stages` x the slowest rank (`schedule_slots`, as in the node model).
- memory: every rank's activation phase for every in-flight composition it passes through (persistent bytes of
  its layers + count x saved bytes of each chunk's layers + the smallest working set + the packets and expert
  buffers every such rank must hold + the AttnRes bank and the packets' open residual streams, both linear in the
  closing layers of every earlier chunk) and its optimizer phase, under the allocated budget. Offload moves the
  saved bytes to host memory (which must hold them; the bank stays on the GPU); balancing scales the in-flight
  counts to the balanced average and pays the moved bytes on its network.
- granularity: every chunk holds at least one layer, and some rank holds at least ceil(L / p) layers, so the
  slowest rank does at least the work of the ceil(L / p) cheapest layers on each resource. `granular_stage` deals
  whole layers to ranks (some rank of PP8 holds 12 of 93 layers) at each variant's own work (and over the least of
  the work of the variants a merged program stands for), each rank holding the mix of layer kinds its chunks can
  hold in model order (K3's busiest PP4 VP4 rank holds at most 9 MLA layers of its 24, not the 24 cheapest).

Layers whose coefficients are all equal are aggregated into one variable per chunk (exact for the LP), which
keeps a 93-layer, 32-chunk node at a few hundred variables. Solved with GLOP (OR-tools' LP solver).

Cheapest first: the memory rows alone over bytes at or below every variant's (`lean_fits`) settle a node that fits
under no setting before its variants are built (most interleaved nodes at long contexts), then the floors of each
(mode, offload, balancing) key's base (the toggles that only add work off) settle keys before their other variants
are built, then per (offload, balancing) setting the memory rows over its merged variants (`_fits`), then the
merged programs with the time rows, then each variant; with the search's pruning line (`stop_at`) nothing is solved
past it. Contiguity is kept only by `contiguous_fits` (the leanest bytes' memory rows over whole layers in
contiguous chunks, by CP-SAT), which the driver runs on an interleaved node whose CP-SAT slice found no layout."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from ortools.linear_solver import linear_solver_pb2, pywraplp
from ortools.sat.python import cp_model

from k3opt.cost.achievable import rank_packets
from k3opt.cost.coefficients import Coefficients, balance_moved_bytes, busiest_layer_seconds, step_gather_bytes
from k3opt.cost.ledger import balanced_scale, least_transient, peak_inflight, pp_packet_bytes, pp_packet_terms
from k3opt.cost.schedule import critical_path, schedule_slots
from k3opt.inputs.memo import Memo, register
from k3opt.inputs.specs import ClusterSpec, FsdpLifecycle, Job, ModelSpec, Recompute
from k3opt.inputs.toggles import REGISTRY as TOGGLE_REGISTRY
from k3opt.inputs.toggles import ToggleKind
from k3opt.inputs.toggles import names as toggle_names
from k3opt.search import replay_bound
from k3opt.search.frames import (
    ActMode,
    Frame,
    act_modes,
    allocated_capacity_bytes,
    allowed_on,
    bound_persistent_bytes,
    choices,
    chunk_least,
    frame_shape,
    lean_mode,
    least_grads,
    least_or_one,
    least_step_gather,
    memory_view,
    rank_least,
    undominated_modes,
    zero2_grads,
)
from k3opt.search.policy import POLICY
from k3opt.search.ranking import ranked_coefficients as ranked  # the ranked view (search/ranking.py)
from k3opt.search.ranking import step_floor, update_means

STOP_ROUNDING = 1e-8
"""Relative: `granular_stage` returns a hair under a stop it has shown reached (the stop x (1 - 1e-9)), so a floor
this close under `stop_at` counts as at it. Without it every variant whose whole-layer floor proved the pruning line
would go on to its linear program, whose value (below the floor) leaves the bound as it is: min(value, stop_at)
of each such variant."""

FEAS_TOL = 1e-6
"""Relative slack on the LP's memory rows: GLOP's primal tolerance must not turn a fitting layout infeasible."""


class _NoBound(Exception):
    """A group's members do not share the schedule's terms, or the deadline passed while building: no bound (0)."""


@dataclass
class _Arrays:
    """Per-layer (length L + 2) relaxed coefficients of one node: least work, least bytes over its modes."""

    time: dict[str, np.ndarray]
    update: dict[str, np.ndarray]
    persistent: np.ndarray
    opt: np.ndarray
    act: np.ndarray
    ws_min: float
    nsws_min: float
    logits: float
    ep_min: float
    hi: np.ndarray
    """Per layer, at or above its busiest-resource work under every setting this stands for (the replay's U_r)."""
    hidden: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """The update's communication per resource (`Coefficients.update_hidden`): only its excess over
    `hidden_stages` x stage adds to the step."""
    hidden_stages: float = 0.0
    with_ns: bool = True
    """Whether the optimizer phase holds the step gather and the Newton-Schulz working set at once (the default
    policy, `Coefficients.step_gather_with_ns`); else the larger of the two (ledger.optimizer_transient_bytes)."""
    least: tuple[int, ...] = ()
    """The least decoder layers of each chunk, in chunk order (`frames.chunk_least`; empty: one each)."""
    pair: np.ndarray | None = None
    """Per layer (L + 2), bytes a rank holds for each layer of its largest chunk (pipeline ZeRO-2's two FP32 chunk
    buffers, 2 x `chunk_grad_buffer`; ledger Aggregate.CHUNK_PAIR). `persistent` holds their average, pair / v per
    layer; the memory rows take the exact max over chunks, one row per chunk it might be (`_memory_rows`). None:
    no such bytes."""
    updates: tuple[tuple[float, float, float], ...] = ()
    """Per node these arrays stand for (a group's members, each variant), its (stage, update compute, update
    communication) at least their means over the ranks (`ranking.update_means`): one node's triple bounds its
    layouts, while the merged arrays pair the least update of one member (the most sharded) with the least
    exchange and stage of others."""


VARIANT_TOGGLES = toggle_names(ToggleKind.RANK, searched=True)
"""Rank toggles that trade work for bytes: each is a global decision (every rank or none), so the bound is the
least over their settings, each with its own work and bytes (never the work of one setting with the bytes of
another)."""


def _relaxed(job: Job, f: Frame, md: ActMode, lc: FsdpLifecycle, toggles: dict[str, bool], model: ModelSpec,
             cluster: ClusterSpec) -> tuple[_Arrays, Coefficients]:
    """The arrays of one activation mode `md` (the node model picks one mode for every layer) under one setting
    of the rank toggles: its own work and bytes per layer. ZeRO-2 host gradients keep `frames.zero2_grads`; P2P Muon
    gathers a resident matrix (2 x resident) rather than the BF16 view; MoonEP (searched only when required) its
    buffers."""
    allowed = allowed_on(job)
    c0 = ranked(frame_shape(job, f, md, lc, **toggles), model, cluster)
    zero2 = bool(toggles.get("pipeline_zero2_host_grads"))
    grads = zero2_grads(c0, f.vp) if zero2 else c0.grads
    persistent = bound_persistent_bytes(c0, grads)
    opt = step_gather_bytes(c0, bool(toggles.get("p2p_muon")))
    L = c0.n_layers
    ep = c0.ep_buffers
    if "moonep" in allowed:
        ep = min(ep, ranked(frame_shape(job, f, md, lc, **toggles, moonep=True), model, cluster).moonep_buffers)
    arrays = _Arrays(time=dict(c0.time), update=dict(c0.update), persistent=persistent, opt=opt, act=c0.act,
                     ws_min=float(c0.working_set[:L].min()), nsws_min=float(c0.ns_working_set[:L].min()),
                     logits=float(c0.logits), ep_min=float(ep),
                     hi=busiest_layer_seconds(c0),
                     hidden=dict(c0.update_hidden), hidden_stages=c0.update_hidden_stages,
                     updates=(node_terms(c0, f.pp),), with_ns=c0.step_gather_with_ns,
                     least=chunk_least(job, f), pair=2 * c0.chunk_grad_buffer if zero2 else None)
    return arrays, c0


def interleaved_lp_bound(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                         cluster: ClusterSpec, stop_at: float = math.inf,
                         members: tuple[Frame, ...] | None = None, deadline: float = math.inf,
                         separate: bool = False, setting_out: dict[str, bool] | None = None) -> float:
    """Lower bound (s) on the step time of every layout of node (f, rc, lc) with f.vp > 1; inf when no
    relaxed layout fits the memory. See the module docstring for what is relaxed. The least over the node's
    undominated activation modes and the settings of the rank toggles (VARIANT_TOGGLES), each with its own work
    and bytes: a variant whose mean load is at or above the least so far is not solved.

    `stop_at`: a line the caller only needs to know the node is at or above (the search's pruning line). A
    variant whose floor or merged program reaches it is not solved either; the bound is then min(least,
    stop_at), still below every layout, and inf only when every variant was proven not to fit.

    `members`: frames of f's `frames.sharding_group` (f among them) to bound at once: the members whose own lean
    memory rows fit (`lean_fits`; the others have no layout); each variant's arrays are the least over those
    members (`_merge`), the budget the largest, the modes every member's undominated ones, so the program relaxes
    the node (rc, lc) of every member. The schedule's terms (in-flight counts, packets, balancing) must be the
    members' common ones; 0.0 (no bound) when they are not, or when the monotonic `deadline` passes while the
    members' arrays are built (tens of members take seconds).

    `separate`: add the replay paths violated at each program's solution (`_violated_path`, up to
    SearchPolicy.lp_path_rounds solves more per program). Taken for a node about to be solved (`tight_node_bound`),
    not for the many group and shape programs of the bounding pass, where the extra solves cost more proofs than
    they make.

    `setting_out`: filled with the rank toggles' setting of the variant whose program gave the bound (left empty
    when a floor or the line gave it)."""
    fitting = _fitting_members(job, list(members or (f,)), rc, lc, model, cluster, deadline)
    if not isinstance(fitting, tuple):
        return fitting
    group, cap = fitting
    modes = _members_modes(job, group, rc, lc, model, cluster, deadline)
    if modes is None:
        return 0.0
    search = _VariantSearch(job, f, lc, model, cluster, group, cap, modes, stop_at, deadline, separate)
    try:
        search.build_bases()
        search.solve_keys(_paths(f, next(iter(search.base.values())).coefs, rc == Recompute.FULL))
    except _NoBound:
        return 0.0
    if setting_out is not None:
        setting_out.update(search.winner)
    return search.whole_layer_bound()


def _fitting_members(job: Job, group: list[Frame], rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                     cluster: ClusterSpec, deadline: float) -> tuple[list[Frame], float] | float:
    """(the members whose lean memory rows fit, their largest budget), or the bound when that settles it: 0.0 when
    the members' schedules differ or the deadline passes, inf when no member fits.

    The memory rows over the least bytes of any variant come first: most interleaved nodes at long contexts fit
    under no setting, which this settles without building the variants. Each member on its own: one that cannot
    fit has no layout to bound, and leaving it out spares building its variants (on the default job, 12 of the 16
    FSDP variants of PP4 VP4 EP64 and 8 of the 14 of PP8 VP4 EP32 fit under no setting). The deadline is checked
    per member: building a group node program over tens of members takes seconds at 8,192 GPUs, and a check
    once per step would let the plan overrun its time limit by a second."""
    leans = [memory_view(job, g, lean_mode(job, rc), lc, model, cluster) for g in group]
    if len({schedule_terms(c) for c in leans}) > 1:
        return 0.0
    caps = [float(allocated_capacity_bytes(job, g, model, cluster)) for g in group]
    kept = []
    for i, (g, c) in enumerate(zip(group, leans, strict=True)):
        if time.monotonic() > deadline:
            return 0.0
        if lean_fits(job, g, c, caps[i], cluster.host_memory_bytes):
            kept.append(i)
    if not kept:
        return math.inf
    return [group[i] for i in kept], max(caps[i] for i in kept)


def _members_modes(job: Job, group: list[Frame], rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                   cluster: ClusterSpec, deadline: float) -> list[ActMode] | None:
    """The activation modes of recompute rc undominated on some member (each once, in the members' order); None
    when the deadline passes."""
    modes_of = []
    for g in group:
        if time.monotonic() > deadline:
            return None
        modes_of.extend(undominated_modes(job, g, [md for md in act_modes(job) if md.recompute == rc], [lc], model,
                                          cluster))
    return list(dict.fromkeys(modes_of))


class _Variant(NamedTuple):
    """One variant of a node (an activation mode and a setting of the rank toggles), ordered by (floor, order)."""

    floor: float
    """Its mean-load floor (`_floor`)."""
    order: int
    """The order it was built in (ties on the floor)."""
    mode: ActMode
    setting: dict[str, bool]
    arrays: _Arrays
    """The members' merged arrays."""
    coefs: Coefficients
    """The first member's coefficients (the schedule's terms, common to the members)."""


class _VariantSearch:
    """The variants of one node (or group node) of `interleaved_lp_bound`, cheapest first, and the least bound
    found so far (`best`).

    Variants that differ only in the toggles that leave the saved set and its schedule alone (ZeRO-2 host
    gradients, P2P Muon, the chunked cross entropy) form a key (mode, offload, balancing). Each of those toggles
    only adds work (k3opt.cost.coefficients: ZeRO-2 host-link traffic, P2P Muon update traffic, the chunked cross
    entropy one more LM-head forward; tests/search/test_lp_early_exit.py checks it), so the key's base, each of them at
    its least-work choice, has every time and update array at or below each variant of the key's: a floor of the
    base that reaches the least so far or the line settles the key before its other variants are built (on the
    default job, 6 of the 8 keys of a PP8 VP4 group node)."""

    def __init__(self, job: Job, f: Frame, lc: FsdpLifecycle, model: ModelSpec, cluster: ClusterSpec,
                 group: list[Frame], cap: float, modes: list[ActMode], stop_at: float, deadline: float,
                 separate: bool = False) -> None:
        self.job, self.f, self.lc, self.model, self.cluster = job, f, lc, model, cluster
        self.rounds = POLICY.lp_path_rounds if separate else 0
        self.group, self.cap, self.host_cap = group, cap, cluster.host_memory_bytes
        self.stop_at, self.deadline = stop_at, deadline
        allowed = allowed_on(job)
        self.names = [t for t in VARIANT_TOGGLES if t in allowed]
        settings = [dict(zip(self.names, flags, strict=True))
                    for flags in itertools.product(*(choices(job, t) for t in self.names))]
        self.keys: dict[tuple, list[dict[str, bool]]] = {}
        for md in modes:
            for tg in settings:
                self.keys.setdefault((md, tg.get("activation_offload", False), tg.get("balance_activations", False)),
                                     []).append(tg)
        self.count = itertools.count()
        self.base: dict[tuple, _Variant] = {}
        self.full: dict[tuple, list[_Variant]] = {}
        self.settled: dict[tuple[bool, bool], float] = {}
        """Per (offload, balancing) setting, the bound of its merged program (`setting_bound`)."""
        self.best = math.inf
        self.winner: dict[str, bool] = {}
        """The rank toggles' setting of the variant whose program set `best` (empty while none has)."""
        self.capped = math.inf
        """The least value at which some variant was left unsolved only because it reached `stop_at` (not the least
        so far, not memory): a lower bound of those variants."""

    def variant(self, md: ActMode, tg: dict[str, bool]) -> _Variant:
        """The variant (md, tg) over the members: their merged arrays and its floor."""
        built = []
        for g in self.group:
            if time.monotonic() > self.deadline:
                raise _NoBound
            built.append(_relaxed(self.job, g, md, self.lc, tg, self.model, self.cluster))
        if len({schedule_terms(c) for _, c in built}) > 1:
            raise _NoBound
        a = _merge([b[0] for b in built], self.f.vp) if len(built) > 1 else built[0][0]
        c0 = built[0][1]
        stage = max(float(t.sum()) for t in a.time.values()) / self.f.pp
        return _Variant(_floor(c0.slots, stage, a, self.f.pp), next(self.count), md, tg, a, c0)

    def build_bases(self) -> None:
        """Each key's base: its toggles that only add work at their least-work choice."""
        least = {t: min(choices(self.job, t)) for t in self.names
                 if t not in ("activation_offload", "balance_activations")}
        self.base = {key: self.variant(key[0], next(tg for tg in tgs if all(tg[t] == v for t, v in least.items())))
                     for key, tgs in self.keys.items()}

    def expand(self, key: tuple) -> list[_Variant]:
        """Every variant of the key, least floor first (built once)."""
        if key not in self.full:
            b = self.base[key]
            self.full[key] = sorted([b] + [self.variant(key[0], tg) for tg in self.keys[key] if tg is not b.setting],
                                    key=lambda x: x[:2])
        return self.full[key]

    def whole_layers(self, floor: float, a: _Arrays, c: Coefficients, setting: tuple[bool, bool] | None) -> float:
        """The variant's floor with whole layers per rank (granular_stage at its own work, cached by its input:
        most toggles move the update or the edges only), at least `floor`; with the (offload, balancing) `setting`,
        each rank holds no more layers than its memory rows under it allow (`rank_capacity`), which needs `a`'s
        bytes at or below those of every variant it stands for (not a key's base: its other variants may hold
        less, pipeline ZeRO-2 keeping the gradients on the host). The program runs only as far as the least so far
        or the line: a value it stops at is at or above them, and only decides a skip."""
        upd = _mean_update(a, self.f.pp)
        line = min(self.best, self.stop_at)
        most: tuple[int, ...] = ()
        if setting is not None:
            most = rank_capacity(self.f, a, c, self.cap, self.host_cap, *setting, exact_balance=True)
            if min(most) < 0:
                return math.inf  # some rank cannot hold its least layers: no layout of the setting fits
        stage = granular_stage(a.time, c.n_layers, self.f.pp, self.f.vp,
                               stop=(line - upd) / c.slots if math.isfinite(line) else math.inf, least=a.least,
                               most=most)
        return max(floor, _floor(c.slots, stage, a, self.f.pp))

    def target(self) -> float:
        """The value at which a program stops tightening: the least so far, or the line (`over` is then true)."""
        return min(self.best, self.stop_at)

    def over(self, value: float) -> bool:
        """`value` (a floor or a relaxation of some variants) cannot lower the least below min(best, stop_at)."""
        if value >= self.best:
            return True
        if value >= self.stop_at * (1 - STOP_ROUNDING):
            if math.isfinite(value):
                self.capped = min(self.capped, value, self.stop_at)
            return True
        return False

    def settled_by_base(self, key: tuple) -> bool:
        """The key's base floor, or its whole-layer floor, cannot lower the least (nor can any variant of the key's:
        each is at or above its base). Once true, true for the rest of the call: `best` only falls."""
        b = self.base[key]
        return self.over(b.floor * (1 - 1e-9)) or self.over(self.whole_layers(b.floor, b.arrays, b.coefs, None))

    def solve_keys(self, paths: np.ndarray) -> None:
        """Every key not settled, cheapest base first: its (offload, balancing) setting's merged program
        (`setting_bound`), then its own merged program, then each of its variants. `paths`: the replay paths (any
        nonnegative per-layer weights give valid ones, replay_bound.split_paths: the first key's)."""
        for key in sorted(self.keys, key=lambda k: self.base[k][:2]):
            _md, off, bal = key
            if (bal and self.base[key].coefs.balanced_inflight is None) or self.settled_by_base(key):
                continue
            if (off, bal) not in self.settled:
                self.settled[(off, bal)] = self.setting_bound(off, bal, paths)
            if self.over(self.settled[(off, bal)]):
                continue
            self.solve_key(key, off, bal, paths)

    def setting_bound(self, off: bool, bal: bool, paths: np.ndarray) -> float:
        """A bound of every variant of one (offload, balancing) setting over every activation mode: inf when the
        memory rows alone show none fits (`_fits`), else (several variants) their merged program, -inf for one.
        Keys of one setting share the schedule and the edges' terms (in-flight compositions, packets, balancing's
        average): their merged arrays relax all of them at once, and most such settings do not fit at all when
        memory binds. The memory rows, a program a fraction of the size, decide that first; the merged program
        with the time rows only for a setting that fits. The keys their bases settle are left out (their variants
        are not built)."""
        every = [v for k2 in self.keys if (k2[1], k2[2]) == (off, bal) and not self.settled_by_base(k2)
                 for v in self.expand(k2)]
        merged_all = _merge([m.arrays for m in every], self.f.vp) if len(every) > 1 else every[0].arrays
        c0 = every[0].coefs
        if not _fits(self.f, merged_all, c0, self.cap, self.host_cap, off, bal, exact_balance=True):
            return math.inf
        if len(every) > 1:
            lo = self.whole_layers(min(m.floor for m in every), merged_all, c0, (off, bal))
            return lo if self.over(lo) else max(
                lo, _solve(self.f, merged_all, c0, self.cap, self.host_cap, off, bal, paths, exact_balance=True,
                           stop=self.target(), rounds=self.rounds, deadline=self.deadline))
        return -math.inf

    def solve_key(self, key: tuple, off: bool, bal: bool, paths: np.ndarray) -> None:
        """The key's merged program (several variants), then each variant's floors and program, least floor first,
        lowering `best`."""
        members = self.expand(key)
        c0 = members[0].coefs
        if len(members) > 1:
            merged = _merge([m.arrays for m in members], self.f.vp)
            if (self.over(self.whole_layers(members[0].floor, merged, c0, (off, bal)))
                    or self.over(_solve(self.f, merged, c0, self.cap, self.host_cap, off, bal, paths,
                                        exact_balance=True, stop=self.target(), rounds=self.rounds,
                                        deadline=self.deadline))):
                return
        for floor, _, _md, tg, a, c in members:
            if self.over(floor * (1 - 1e-9)):
                break
            floor = self.whole_layers(floor, a, c, (off, bal))
            if self.over(floor * (1 - 1e-9)):
                continue
            value = max(floor, _solve(self.f, a, c, self.cap, self.host_cap, off, bal, paths, exact_balance=True,
                                      stop=self.target(), rounds=self.rounds, deadline=self.deadline))
            if value < self.best:
                self.best, self.winner = value, tg

    def whole_layer_bound(self) -> float:
        """The least found (or the line's cap), raised by whole layers over the least of every variant's arrays,
        each rank an integer count of each kind of layer (it only raises the bound: not needed once the bound is at
        the line)."""
        variants = [v for key in self.keys for v in self.full.get(key, [self.base[key]])]
        best = min(self.best, self.capped)
        if math.isfinite(best) and best < self.stop_at * (1 - STOP_ROUNDING):
            merged = _merge([v.arrays for v in variants], self.f.vp)
            update = _mean_update(merged, self.f.pp)
            slots = variants[0].coefs.slots
            stage = granular_stage(merged.time, variants[0].coefs.n_layers, self.f.pp, self.f.vp,
                                   stop=(self.stop_at - update) / slots if math.isfinite(self.stop_at) else math.inf,
                                   least=merged.least)
            best = max(best, _floor(slots, stage, merged, self.f.pp))
        return best


def schedule_terms(c: Coefficients) -> tuple:
    """What the programs read from a node's Coefficients besides the merged arrays (`_solve`, `_memory_rows`,
    `_packet_floor`): equal over the members of a group bound, or the group is not bounded at once."""
    return (c.n_layers, c.slots, tuple(tuple(tuple(x) for x in comps) for comps in c.compositions),
            c.balanced_inflight, c.balance_seconds_per_byte, c.balance_resource, c.stream_bytes,
            c.moe.tobytes(), c.closes.tobytes(), c.routing_map, c.shape.offload_resident_layers,
            tuple(c.pp_on_nvlink), tuple(np.asarray(c.pp_seconds_per_byte, dtype=float).tolist()))


def _mean_update(a: _Arrays, p: int) -> float:
    """The slowest rank's update compute is at least its mean over the p ranks: max over resources of sum / p."""
    return update_means(a.update, {}, p)[0]


def node_terms(c: Coefficients, p: int) -> tuple[float, float, float]:
    """One node's (mean stage of its busiest resource, mean update, mean exchange) over the p ranks, from its
    arrays or floor `c`: what `least_floor` pairs per node."""
    return max(float(t.sum()) for t in c.time.values()) / p, *update_means(c.update, c.update_hidden, p)


def least_floor(terms: Iterable[tuple[float, float, float]], slots: float, hidden_stages: float,
                stage: float = 0.0) -> float:
    """`ranking.step_floor` of a stage bound raised to each node's own mean stage, with that node's own update and
    exchange (`node_terms`: the least update is the most sharded member's, whose exchange is the largest), the
    least over the nodes."""
    return min(step_floor(slots, max(stage, s), u, h, hidden_stages) for s, u, h in terms)


def _floor(slots: float, stage: float, a: _Arrays, p: int) -> float:
    """`least_floor` of a stage bound (at or below every node's the arrays stand for) over the nodes' terms
    (`_Arrays.updates`)."""
    return least_floor(a.updates or ((stage, *update_means(a.update, a.hidden, p)),), slots, a.hidden_stages, stage)




_GRANULAR: dict[tuple, tuple[float, bool]] = register({})
"""granular_stage by its whole input (every resource's array, L, p, v): (value, exact); a value that is not exact
is a stop the stage was shown to reach. Frames whose floors differ only in what the stage does not read (the
microbatch count, the sharding of state) share one program."""


def granular_stage(time: dict[str, np.ndarray], L: int, p: int, v: int, stop: float = math.inf,
                   least: tuple[int, ...] = (), most: tuple[int, ...] = ()) -> float:
    """A lower bound on the slowest rank's stage when every rank holds whole layers: the least S such that the L
    layers can be dealt to the p ranks, each holding at least its chunks' least layers (`least`, as
    `frames.chunk_least`; empty: one per chunk, v), with every resource's sum over a
    rank's layers and its edges (the first-chunk edge on rank 0, the last on rank p - 1) at most S, and each rank's
    count of every kind within what its chunks can hold as windows of the model's layer order (`_mix_allowed`).
    Memory is dropped but for `most`. Bisection on S; each test is a program over ranks whose state is the count
    of every layer kind but the most numerous, of which each rank then takes as many as fit and its kind mix
    allows (its loads grow with the count).
    93 layers over 8 ranks of equal layers: 12 layers' work, not 11.625. `stop`: a stage the caller only needs
    to know is reached; when no dealing fits under it, the bound is stop (just under it) without the bisection.
    inf when the ranks' `most` layers add up to fewer than L."""
    chunk_leasts = least_or_one(least, p * v)
    need = tuple(int(n) for n in rank_least(chunk_leasts, p))
    cap = tuple(min(int(n), L) for n in most) if most else (L,) * p
    if sum(cap) < L:
        return math.inf  # the ranks' most layers cannot hold the model's L: no layout deals them at any stage
    windows = tuple(int(n) for n in chunk_leasts)
    key = (tuple((r, np.asarray(time[r], dtype=float).tobytes()) for r in time), L, p, need, cap, windows)
    hit = _GRANULAR.get(key)
    if hit is not None and (hit[1] or hit[0] >= stop * (1 - 1e-9)):
        return hit[0]
    value, exact = _granular_stage(time, L, p, need, stop, cap, windows)
    if len(_GRANULAR) > 8192:
        _GRANULAR.clear()
    _GRANULAR[key] = (value, exact)
    return value


def _granular_stage(time: dict[str, np.ndarray], L: int, p: int, need: tuple[int, ...], stop: float,
                    most: tuple[int, ...], windows: tuple[int, ...]) -> tuple[float, bool]:
    """(granular_stage's value, whether it is the bisection's rather than the stop); `need` and `most`: each rank's
    least and most layers; `windows`: every chunk's least layers, in global chunk order (`_mix_allowed`)."""
    arrs = np.stack([np.asarray(time[r], dtype=float) for r in time], axis=1)  # (L + 2, resources)
    kinds, kind_of, counts = np.unique(arrs[:L], axis=0, return_inverse=True, return_counts=True)
    main = int(np.argmax(counts))
    others = [t for t in range(len(counts)) if t != main]
    dims = tuple(int(counts[t]) + 1 for t in others)
    if math.prod(dims) > POLICY.max_granular_states:
        return 0.0, True
    grid = np.indices(dims).reshape(len(dims), -1).T if dims else np.zeros((1, 0), dtype=int)  # patterns
    base = grid @ kinds[others] if others else np.zeros((1, arrs.shape[1]))
    n_base = grid.sum(axis=1)
    w = kinds[main]
    n_main = int(counts[main])
    edges = [(arrs[L] if r == 0 else 0.0) + (arrs[L + 1] if r == p - 1 else 0.0) for r in range(p)]
    # Per rank, for each pattern, the most main-kind layers beside it that its chunks' kind mix allows (<= x).
    mix = [_mix_allowed(kind_of.ravel(), len(counts), main, others, grid, n_main, windows, p, r) for r in range(p)]

    # Every (state, pattern) pair with the pattern inside the state, as flat indices: a rank moves the program from
    # state s - P to s by taking pattern P (and as many of the main kind as fit beside it).
    states = np.indices(dims).reshape(len(dims), -1).T if dims else np.zeros((1, 0), dtype=int)
    inside = (states[:, None, :] >= grid[None, :, :]).all(axis=2)  # (states, patterns)
    dst, pat = np.nonzero(inside)
    src = np.ravel_multi_index(tuple((states[dst] - grid[pat]).T), dims) if dims else np.zeros_like(dst)
    full = int(np.ravel_multi_index(tuple(d - 1 for d in dims), dims)) if dims else 0

    def capacity(S: float, r: int) -> np.ndarray:
        """Per pattern, the most layers of the main kind rank r can add within S (-1: the pattern does not fit)."""
        room = S - base - edges[r]  # (patterns, resources)
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.where(w > 0, np.floor(room / np.where(w > 0, w, 1.0) + 1e-9), np.inf)
        cmax = np.minimum(np.minimum(per.min(axis=1), n_main), most[r] - n_base)
        ok = (room >= -1e-15).all(axis=1) & (cmax >= 0)
        allowed = mix[r]
        cmax = np.where(ok, allowed[np.arange(len(cmax)), np.clip(cmax, 0, n_main).astype(np.int64)], -1)
        ok = cmax >= np.maximum(need[r] - n_base, 0)
        return np.where(ok, cmax, -1).astype(np.int64)

    def feasible(S: float) -> bool:
        val = np.full(len(states), -1, dtype=np.int64)
        val[0] = 0
        for r in range(p):
            cap = capacity(S, r)
            cand = np.where((val[src] >= 0) & (cap[pat] >= 0), val[src] + cap[pat], -1)
            val = np.full(len(states), -1, dtype=np.int64)
            np.maximum.at(val, dst, cand)
        return bool(val[full] >= n_main)

    lo = max(float((arrs[:L].sum(axis=0) + arrs[L] + arrs[L + 1]).max()) / p, 0.0)
    hi = float(arrs.sum(axis=0).max())
    if lo < stop < hi:
        if not feasible(stop):
            return stop * (1 - 1e-9), False
        hi = stop
    elif not feasible(hi):
        return 0.0, True  # only a rounding miss of the sums can get here: no bound rather than a wrong one
    if feasible(lo):
        return lo, True
    # Whole layers lift the mean by a few layers' work at most: a bracket just above it first.
    for up in (1 / 64, 1 / 16, 1 / 4):
        if lo * (1 + up) >= hi:
            break
        if feasible(lo * (1 + up)):
            hi = lo * (1 + up)
            break
        lo = lo * (1 + up)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-6 * hi:
            break
    return lo * (1 - 1e-9), True


def _mix_allowed(kind_of: np.ndarray, nkinds: int, main: int, others: list[int], grid: np.ndarray, n_main: int,
                 chunk_least: tuple[int, ...], p: int, r: int) -> np.ndarray:
    """allowed[P, x]: the most main-kind layers c <= x that rank r may hold beside the other kinds' counts of
    pattern P (-1: none): its layers form contiguous chunks of the model in order, so a rank of n layers holds
    between the least and the most of each kind that its chunks' windows can hold (`_window_counts`). K3 has one
    MLA layer in four: a rank of PP4 VP4 with 24 layers holds at most 9 of them, not the 24 cheapest layers that
    a dealing by kind counts alone may give it."""
    lo, hi = _window_counts(kind_of, nkinds, chunk_least, p, r)
    n_p = grid.sum(axis=1)  # (patterns,)
    c = np.arange(n_main + 1)
    n = n_p[:, None] + c[None, :]  # (patterns, c): the rank's layers
    inside = n <= len(kind_of)
    n = np.minimum(n, len(kind_of))
    ok = inside & (lo[main][n] <= c[None, :]) & (c[None, :] <= hi[main][n])
    for j, t in enumerate(others):
        ok &= (lo[t][n] <= grid[:, j:j + 1]) & (grid[:, j:j + 1] <= hi[t][n])
    return np.maximum.accumulate(np.where(ok, c[None, :], -1), axis=1)


def _window_counts(kind_of: np.ndarray, nkinds: int, chunk_least: tuple[int, ...], p: int, r: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), each (kinds, L + 1): the least and the most layers of each kind rank r's chunks can hold when they
    hold n layers in all (`window_extreme` over each kind's indicator); L + 1 (lo) and -1 (hi) where no chunks add
    up to n. Kept by their input: the search asks for the same order and chunks many times."""
    key = (kind_of.tobytes(), nkinds, chunk_least, p, r)
    hit = _WINDOWS.get(key)
    if hit is None:
        ind = np.stack([(kind_of == t).astype(float) for t in range(nkinds)])
        # Every kind's least and (negated) most in one program: the most is minus the least of the negation.
        both = window_least(np.concatenate([ind, -ind]), chunk_least, p, r)
        lo, hi = both[:nkinds], -both[nkinds:]
        L = len(kind_of)
        hit = (np.where(np.isfinite(lo), np.rint(lo), L + 1).astype(np.int64),
               np.where(np.isfinite(hi), np.rint(hi), -1).astype(np.int64))
        if len(_WINDOWS) > 512:
            _WINDOWS.clear()
        _WINDOWS[key] = hit
    return hit


_WINDOWS: dict[tuple, tuple[np.ndarray, np.ndarray]] = register({})


def window_extreme(weight: np.ndarray, chunk_least: tuple[int, ...], p: int, r: int, low: bool) -> np.ndarray:
    """best[n], n = 0..L: the least (`low`) or the most sum of `weight` (one entry per layer, model order) that rank
    r's chunks can hold when they hold n layers in all: its chunks (global chunks k p + r, each of at least
    `chunk_least[k p + r]` layers) are windows of the layer order, in order, disjoint, with at least the other
    ranks' chunks' least layers between them and before and after them (`chunk_least` in global chunk order).
    Exact over contiguous splits: every such placement completes to a split. -inf / inf where no chunks add up to
    n. The most is the least of the negated weights (`window_least`)."""
    w = np.asarray(weight, dtype=float)[None, :]
    return window_least(w, chunk_least, p, r)[0] if low else -window_least(-w, chunk_least, p, r)[0]


def window_least(weights: np.ndarray, chunk_least: tuple[int, ...], p: int, r: int) -> np.ndarray:
    """`window_extreme`'s least sums for each row of `weights` (B, L) at once: (B, L + 1), inf where no chunks
    add up to n. A dynamic program over the position after each of rank r's windows.

    best[x, n]: the windows so far hold n layers, and the next may start at layer x or later. A window [s, y) of
    m = y - s >= least layers, with `gap` layers of other ranks' chunks after it, leads to
        step[y + gap, n + m] = min over s <= y - least of  best[s, n] + W[y] - W[s]      (W: prefix sums),
    and with d = (n + m) - y = n - s fixed along a window's moves this is  W[y] + min_{s <= y - least} A[s, d],
    A[s, d] = best[s, s + d] - W[s]: a running minimum over s of A per d, so each window costs a few array
    operations over (L + 1) x (2 L + 1), not one per window length."""
    weights = np.asarray(weights, dtype=float)
    b, L = weights.shape
    mine = list(range(r, len(chunk_least), p))
    lead = sum(chunk_least[:mine[0]])
    gaps = [sum(chunk_least[a + 1:b_]) for a, b_ in itertools.pairwise(mine)] + [sum(chunk_least[mine[-1] + 1:])]
    prefix = np.concatenate([np.zeros((b, 1)), np.cumsum(weights, axis=1)], axis=1)  # (B, L + 1)
    # The model's first chunk starts at layer 0 and its last ends at layer L: no chunk lies before or after them.
    best = np.full((b, L + 1, L + 1), np.inf)
    best[:, lead:lead + 1 if mine[0] == 0 else L + 1, 0] = 0.0
    s_idx, n_idx = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
    diag = n_idx - s_idx + L  # column of d = n - s, shifted to 0..2L
    counts = np.arange(L + 1)
    step = best
    for k, gap in zip(mine, gaps, strict=True):
        least = int(chunk_least[k])
        a = np.full((b, L + 1, 2 * L + 1), np.inf)
        a[:, s_idx, diag] = best - prefix[:, :, None]
        run = np.minimum.accumulate(a, axis=1)
        step = np.full_like(best, np.inf)
        ends = np.arange(least, L - gap + 1)  # y: where the window ends
        if len(ends):
            cols = counts[None, :] - ends[:, None] + L  # (ends, n'): d = n' - y
            step[:, ends + gap, :] = prefix[:, ends, None] + run[:, (ends - least)[:, None], cols]
        best = np.minimum.accumulate(step, axis=1)
    return step[:, L] if mine[-1] == len(chunk_least) - 1 else best[:, L]


def rank_capacity(f: Frame, a: _Arrays, c0: Coefficients, cap: float, host_cap: float, off: bool, bal: bool,
                  exact_balance: bool = False) -> tuple[int, ...]:
    """Per rank, the most decoder layers it can hold under the memory rows of one (offload, balancing) setting
    (`_memory_rows`, the relaxation's): in each row of rank r, its chunks hold at least their least layers
    (`_Arrays.least`) at their cheapest kind, and every further layer costs at least the row's cheapest
    coefficient, so n <= sum(least) + (rhs - forced) / cheapest. -1 where a row cannot hold even the least
    layers. Where the in-flight counts crowd the early ranks' chunks, their capacity is what pushes the layers
    onto the late ranks (K3 PP16 VP3 at 8K context: about 5 layers on the first ranks under offload)."""
    L, p, v = c0.n_layers, f.pp, f.vp
    kinds, counts = np.unique(np.stack([a.persistent[:L], a.opt[:L], a.act[:L], _pair(a, L)], axis=1), axis=0,
                              return_counts=True)
    nk = len(kinds)
    rows, rhs = _memory_rows(f, a, c0, cap, host_cap, off, bal, kinds[:, 0], kinds[:, 1], kinds[:, 2], kinds[:, 3],
                             exact_balance=exact_balance)
    least = least_or_one(a.least, p * v)
    most = [L] * p
    for row, b in zip(rows, rhs, strict=True):
        blocks = np.asarray(row).reshape(p, v, nk)
        held = np.abs(blocks).sum(axis=(1, 2))
        if not held.any():
            continue
        r = int(np.argmax(held))  # each row reads one rank's columns
        if most[r] < 0:
            continue
        most[r] = min(most[r], _row_capacity(blocks[r], counts, [least[k * p + r] for k in range(v)], b))
    return tuple(most)


def _row_capacity(co: np.ndarray, counts: np.ndarray, least: list[int], b: float) -> int:
    """The most layers one memory row (coefficient co[k, t] for a layer of kind t in the rank's k-th chunk, at most
    b) lets its rank hold, -1 when not even its chunks' least layers fit. Two lower bounds on n layers' cost, each
    valid alone: every chunk's least layers at its cheapest kind and every further layer at the row's cheapest
    coefficient; and the n layers that are cheapest in their cheapest chunk, each kind at most its count."""
    slack = 1e-9
    lk = np.asarray(least, dtype=float)
    forced = float((lk * co.min(axis=1)).sum())
    if b < forced * (1 - slack) - 1.0:  # a byte and a relative hair of slack for the sums' rounding
        return -1
    step = float(co.min())
    n1 = int(lk.sum()) + math.floor((b - forced) / step * (1 + slack) + slack) if step > 0 else int(counts.sum())
    cheapest = co.min(axis=0)  # per kind, in its cheapest chunk
    order = np.argsort(cheapest, kind="stable")
    per = np.repeat(cheapest[order], counts[order])
    n2 = int(np.searchsorted(np.cumsum(per), b * (1 + slack) + 1.0, side="right"))
    return min(n1, n2)


def loosest_capacity(job: Job, f: Frame, lean: Coefficients, cap: float, host_cap: float) -> tuple[int, ...]:
    """Per rank, the most layers any variant of a node lets it hold: `rank_capacity` over `lean_arrays` (bytes at
    or below every variant's, the in-flight counts at balancing's average where allowed), the most over the
    allowed offload settings. -1 where no setting holds the rank's least layers."""
    a = lean_arrays(job, f, lean)
    bal = _lean_balance(job, lean)
    per = [rank_capacity(f, a, lean, cap, host_cap, off, bal) for off in choices(job, "activation_offload")]
    return tuple(max(c[r] for c in per) for r in range(f.pp))


def _merge(arrays: list[_Arrays], v: int) -> _Arrays:
    """The least of every array and figure over `arrays` (a relaxation of each). The chunk-pair bytes, where every
    member has them: the least pair beside the least of the rest of the persistent bytes, so that each of the
    merged rows is at or below the same row of each member; where some member has none, none, and the persistent
    bytes at the least of the members' (the pair's members at its average, which each of their rows is above)."""
    first = arrays[0]
    persistent, pair = np.min([a.persistent for a in arrays], axis=0), None
    if all(a.pair is not None for a in arrays):
        pair = np.min([a.pair for a in arrays], axis=0)
        persistent = np.min([a.persistent - a.pair / v for a in arrays], axis=0) + pair / v
    return _Arrays(
        persistent=persistent, pair=pair,
        time={res: np.min([a.time[res] for a in arrays], axis=0) for res in first.time},
        update={res: np.min([a.update[res] for a in arrays], axis=0) for res in first.update},
        hidden={res: np.min([a.hidden[res] for a in arrays], axis=0) for res in first.hidden},
        hidden_stages=max(a.hidden_stages for a in arrays),  # the step only falls as it grows
        updates=tuple(dict.fromkeys(u for a in arrays for u in a.updates)),
        **{k: np.min([getattr(a, k) for a in arrays], axis=0) for k in ("opt", "act")},
        **{k: min(getattr(a, k) for a in arrays) for k in ("ws_min", "nsws_min", "logits", "ep_min")},
        hi=np.max([a.hi for a in arrays], axis=0),
        with_ns=all(a.with_ns for a in arrays),  # the max form is at or below the sum: valid for every member
        least=first.least,  # the members of one group share their frame's pipeline shape and the job
    )


@dataclass
class _Program:
    """The columns of `_solve`'s linear program and the rows written so far (a_ub z <= b_ub).

    Columns: x[r, k, t] (layers of kind t in rank r's k-th chunk) at (r v + k) nk + t, then S (the slowest rank's
    stage), U (its update); then the replay's terms: T[r] per rank, cl[g] per global chunk g = k p + r, the replay
    bound R and Z = max(slots S, R); last E, the update communication's excess over its window,
    max(0, max_r hidden_r - hidden_stages x S)."""

    L: int
    p: int
    v: int
    m: int
    """Microbatches per step."""
    res_names: list[str]
    """The resources of the arrays' per-microbatch work."""
    counts: np.ndarray
    """Layers of each kind."""
    kt: np.ndarray
    """Per kind, its work on each resource (columns in `res_names` order)."""
    ku: np.ndarray
    """Per kind, its update compute on each resource."""
    kh: np.ndarray
    """Per kind, its update communication on each resource."""
    kclose: np.ndarray
    """Per kind, the AttnRes blocks it closes (the bank's rows)."""
    kmax: np.ndarray
    """Per kind, its busiest-resource work (`_Arrays.hi`)."""
    kpair: np.ndarray
    """Per kind, its chunk-pair bytes (`_Arrays.pair`; zeros without)."""
    kp: np.ndarray
    kopt: np.ndarray
    kact: np.ndarray
    """Per kind, its persistent, optimizer-phase and saved bytes."""
    rows: list[np.ndarray] = dataclasses.field(default_factory=list)
    rhs: list[float] = dataclasses.field(default_factory=list)
    nk: int = dataclasses.field(init=False)
    """Layer kinds."""
    n: int = dataclasses.field(init=False)
    """Columns of the x[r, k, t]."""
    S: int = dataclasses.field(init=False)
    U: int = dataclasses.field(init=False)
    T0: int = dataclasses.field(init=False)
    CL0: int = dataclasses.field(init=False)
    R: int = dataclasses.field(init=False)
    Z: int = dataclasses.field(init=False)
    E: int = dataclasses.field(init=False)
    ncol: int = dataclasses.field(init=False)
    """The column of each figure (T0, CL0: the first T[r], cl[g]), and their count."""

    def __post_init__(self) -> None:
        self.nk = len(self.counts)
        self.n = self.p * self.v * self.nk
        self.S, self.U, self.T0 = self.n, self.n + 1, self.n + 2
        self.CL0 = self.T0 + self.p
        self.R = self.CL0 + self.p * self.v
        self.Z, self.E = self.R + 1, self.R + 2
        self.ncol = self.E + 1

    def col(self, r: int, k: int) -> slice:
        """The x[r, k, t] of rank r's k-th chunk."""
        return slice((r * self.v + k) * self.nk, (r * self.v + k + 1) * self.nk)

    def le(self, coef_by_chunk: list[np.ndarray], r: int, bound: float, extra: dict[int, float] | None = None
           ) -> None:
        """The row sum_k coef_by_chunk[k] . x[r, k] + sum extra[c] z_c <= bound."""
        row = np.zeros(self.ncol)
        for k in range(self.v):
            row[self.col(r, k)] = coef_by_chunk[k]
        for c, val in (extra or {}).items():
            row[c] = val
        self.rows.append(row)
        self.rhs.append(bound)

    def add(self, row: np.ndarray, bound: float) -> None:
        """The row z . row <= bound."""
        self.rows.append(row)
        self.rhs.append(bound)


def _program(f: Frame, a: _Arrays, c0: Coefficients) -> _Program:
    """The program's variables: layers with equal per-layer columns (work, update, busiest work, bytes) form one
    kind, placed by the x[r, k, t]."""
    L = c0.n_layers
    res_names = list(a.time)
    cols = [a.time[r][:L] for r in res_names] + [a.update[r][:L] for r in a.update]
    cols += [a.hidden[r][:L] for r in a.hidden]
    cols += [np.asarray(c0.closes[:L], dtype=float), a.hi[:L], _pair(a, L), a.persistent[:L], a.opt[:L], a.act[:L]]
    kinds, counts = np.unique(np.stack(cols, axis=1), axis=0, return_counts=True)
    n_res, n_up = len(res_names), len(a.update)
    return _Program(
        L=L, p=f.pp, v=f.vp, m=f.microbatches, res_names=res_names, counts=counts, kt=kinds[:, :n_res],
        ku=kinds[:, n_res:n_res + n_up], kh=kinds[:, n_res + n_up:n_res + n_up + len(a.hidden)],
        kclose=kinds[:, -6], kmax=kinds[:, -5], kpair=kinds[:, -4], kp=kinds[:, -3], kopt=kinds[:, -2],
        kact=kinds[:, -1])


def _solve(f: Frame, a: _Arrays, c0: Coefficients, cap: float, host_cap: float, off: bool, bal: bool,
           paths: np.ndarray, exact_balance: bool = False, stop: float = math.inf, rounds: int = 0,
           deadline: float = math.inf) -> float:
    """The linear program of the module docstring over one node's arrays `a` (c0: the schedule's terms) under one
    offload and balancing setting: its optimum, shaved by FEAS_TOL; inf when infeasible. Up to `rounds`
    times, the replay path longest at the solution's chunk times joins the path rows and the
    program is solved again (`_violated_path`), until no path is violated, a path leaves the value where it was, or
    the value reaches `stop`. A solve the monotonic `deadline` cuts bounds nothing: the value stays the last
    solve's (each path row only raises the optimum)."""
    lp = _program(f, a, c0)
    _work_rows(lp, a, c0, bal)
    mem_rows, mem_rhs = _memory_rows(f, a, c0, cap, host_cap, off, bal, lp.kp, lp.kopt, lp.kact, lp.kpair,
                                     lp.kclose, exact_balance=exact_balance)
    for row_x, b in zip(mem_rows, mem_rhs, strict=True):
        row = np.zeros(lp.ncol)
        row[:lp.n] = row_x
        lp.add(row, b)
    _granularity_rows(lp, a)
    _replay_rows(lp, a, paths)
    _pipeline_rows(lp)
    # Equalities: each kind's layers all placed; each chunk holds its least layers (as -sum <= -least).
    chunk_rows, chunk_rhs, a_eq = _placement_rows(lp.p, lp.v, lp.nk, lp.ncol, a.least)
    order_rows, order_rhs = _order_rows(lp.p, lp.v, np.asarray(c0.closes[:lp.L], dtype=float), lp.kclose, lp.ncol,
                                        a.least)
    a_ub = np.vstack([np.array(lp.rows), chunk_rows, order_rows])
    b_ub = np.concatenate([lp.rhs, chunk_rhs, order_rhs])
    upper = np.concatenate([np.tile(lp.counts.astype(float), lp.p * lp.v), np.full(lp.ncol - lp.n, np.inf)])
    value, z = _glop(_objective(lp), a_ub, b_ub, a_eq, lp.counts.astype(float), upper, solution=True,
                     deadline=deadline)
    beta = replay_bound.betas([c0.shape.recompute == Recompute.FULL])
    for _ in range(rounds):
        if value * (1 - FEAS_TOL) >= stop:
            break  # already at the least so far or the line: more paths would not change what the caller does
        cut = _violated_path(lp, z, beta) if z is not None else None
        if cut is None:
            break
        a_ub, b_ub = np.vstack([a_ub, cut]), np.append(b_ub, 0.0)
        before = value
        value, z = _glop(_objective(lp), a_ub, b_ub, a_eq, lp.counts.astype(float), upper, solution=True,
                         deadline=deadline)
        if z is None and math.isfinite(value):
            value = before  # no certificate (the deadline cut it): the last optimum stands, a path row only raises it
            break
        if value <= before * (1 + FEAS_TOL):
            break  # the program had another optimum the path does not touch: more paths rarely move it
    # GLOP's optimum is accurate to its tolerances; shave a relative 1e-6 so the bound stays below the exact one.
    return value * (1 - FEAS_TOL) if math.isfinite(value) else value


def _violated_path(lp: _Program, z: np.ndarray, beta: list[float]) -> np.ndarray | None:
    """The replay path longest at the relaxation's own chunk times, as a row R >= sum_g a_g cl[g] / SCALE, when
    it is longer than the relaxation's R; else None. Every path of the replay graph bounds the makespan at any chunk
    times (`schedule.critical_path`), so the row is valid for every split; the longest one at the solution's cl[g]
    is the most violated (a separation step: the seeded paths come from sample splits, and the relaxation places
    its layers where none of them is long)."""
    K = lp.p * lp.v
    cl = np.maximum(z[lp.CL0:lp.CL0 + K], 0.0)
    if not cl.any():
        return None
    b = beta[0]
    nf, nb = critical_path(lp.p, lp.v, lp.m, cl / (1 + b), cl * b / (1 + b))
    a_g = replay_bound.path_coefficients(nf, nb, beta).astype(float) / replay_bound.SCALE
    if float(a_g @ cl) <= z[lp.R] * (1 + FEAS_TOL):  # within GLOP's tolerance: not violated
        return None
    row = np.zeros(lp.ncol)
    row[lp.CL0:lp.CL0 + K] = a_g
    row[lp.R] = -1.0
    return row


def _work_rows(lp: _Program, a: _Arrays, c0: Coefficients, bal: bool) -> None:
    """Per rank: every resource's work (its layers, its edges, a floor on its PP packets and balancing's traffic)
    at most S; every resource's update at most U; every resource's update communication at most
    hidden_stages x S + E."""
    L, p, v, work = lp.L, lp.p, lp.v, a.time
    pk = _packet_floor(c0, p, v, L, a.least)
    streams = _packet_stream_rows(c0, p, v, lp.kclose)
    for r in range(p):
        n_peak = peak_inflight(c0.compositions[r])
        moved = 0.0
        if bal and c0.balanced_inflight is not None and n_peak > c0.balanced_inflight:
            moved = balance_moved_bytes(1.0, n_peak, c0.balanced_inflight) * c0.balance_seconds_per_byte
        for ri, res in enumerate(lp.res_names):
            per = lp.kt[:, ri] + (moved * lp.kact if res == c0.balance_resource else 0.0)
            e = _edge(work[res], r, p, L) + (moved * _edge(a.act, r, p, L) if res == c0.balance_resource else 0.0)
            if per.any() or e or res in pk[r]:
                lp.le([per] * v, r, -(e + pk[r].get(res, 0.0)), {lp.S: -1.0})
            if res in streams[r]:
                # The same row with each packet's open residual streams, linear in the closing layers of the
                # chunks before its boundary (with `_order_rows` keeping them in model order).
                const, row_x = streams[r][res]
                row = np.zeros(lp.ncol)
                for k in range(v):
                    row[lp.col(r, k)] = per
                row[:lp.n] += row_x
                row[lp.S] = -1.0
                lp.add(row, -(e + const))
        for ui, res in enumerate(a.update):
            e = _edge(a.update[res], r, p, L)
            if lp.ku[:, ui].any() or e:
                lp.le([lp.ku[:, ui]] * v, r, -e, {lp.U: -1.0})
        for hi_, res in enumerate(a.hidden):
            e = _edge(a.hidden[res], r, p, L)
            if lp.kh[:, hi_].any() or e:
                lp.le([lp.kh[:, hi_]] * v, r, -e, {lp.S: -a.hidden_stages, lp.E: -1.0})


def _granularity_rows(lp: _Program, a: _Arrays) -> None:
    """Some rank holds at least ceil(L / p) whole layers: S is at least the work of that many cheapest layers on
    every resource."""
    need = -(-lp.L // lp.p)
    for res in lp.res_names:
        row = np.zeros(lp.ncol)
        row[lp.S] = -1.0
        lp.add(row, -float(np.sort(a.time[res][:lp.L])[:need].sum()) * (1 - FEAS_TOL))


def _replay_rows(lp: _Program, a: _Arrays, paths: np.ndarray) -> None:
    """The replayed schedule (the node model's _replay_terms, relaxed): rank r's stage t_r >= T[r] >= each
    resource's sum over r's layers; W_r (chunk_times' sum of the chunks' busiest-resource work) <= U_r = the sum
    of r's per-layer maxima over resources (`_Arrays.hi`; no packets in T[r] or U_r); chunk g's replayed time
    c_g = t_r w_g / W_r >= w_g + min(0, t_r - W_r) >= e_g + T[r] - U_r for every resource's chunk sum e_g <= w_g;
    every replay path (replay_bound) gives R >= sum_g a_g c_g / SCALE; and a rank's chunk times add up to its stage,
    sum_k c_{kp+r} = t_r >= T[r].

    The same share as a ratio: W_r <= sum of r's per-layer maxima <= kappa_q A + H_r and t_r >= A + E_r for any
    resource q, with A r's layers' sum on q, kappa_q the largest per-layer maximum over q's own time, H_r and E_r its
    edges' maxima and q-time (`_share_ratio`); so c_g = t_r w_g / W_r >= rho_r w_g >= rho_r e_g. This keeps a small
    chunk's time where the difference form gives none (U_r - T[r] is larger than the chunk when the layers bind on
    different resources) and makes the paths through thin chunks count."""
    L, p, v, work = lp.L, lp.p, lp.v, a.time
    K = p * v
    least = least_or_one(a.least, K)
    rhos = [_share_ratio(a, L, p, r, lp.res_names, sum(least[r::p])) for r in range(p)]
    for g in range(K):
        k, r = divmod(g, p)
        rho = rhos[r]
        if rho <= 0:
            continue
        for ri, res in enumerate(lp.res_names):
            row = np.zeros(lp.ncol)
            row[lp.col(r, k)] = lp.kt[:, ri] * rho
            row[lp.CL0 + g] = -1.0
            e_g = (float(work[res][L]) if g == 0 else 0.0) + (float(work[res][L + 1]) if g == K - 1 else 0.0)
            lp.add(row, -e_g * rho)
    for r in range(p):
        for ri, res in enumerate(lp.res_names):
            # Without the packets: T[r] <= U_r, which U_r (per-layer maxima) needs (the node model's note).
            lp.le([lp.kt[:, ri]] * v, r, -_edge(work[res], r, p, L), {lp.T0 + r: -1.0})
        # chunk_times shares t_r among r's chunks, so they sum to it: sum_k c_{k p + r} = t_r >= T[r]. Without
        # this row each chunk keeps only its own floor, and a rank of thin and fat chunks replays at a fraction of
        # its stage time.
        lp.le([np.zeros(lp.nk)] * v, r, 0.0, {lp.T0 + r: 1.0, **{lp.CL0 + k * p + r: -1.0 for k in range(v)}})
        u_r = _edge(a.hi, r, p, L)
        for k in range(v):
            g = k * p + r
            first, last = g == 0, g == K - 1
            for ri, res in enumerate(lp.res_names):
                row = np.zeros(lp.ncol)
                row[lp.col(r, k)] += lp.kt[:, ri]
                for k2 in range(v):
                    row[lp.col(r, k2)] -= lp.kmax
                row[lp.T0 + r] = 1.0
                row[lp.CL0 + g] = -1.0
                e_g = (float(work[res][L]) if first else 0.0) + (float(work[res][L + 1]) if last else 0.0)
                lp.add(row, u_r - e_g)
    for a_g in paths:
        row = np.zeros(lp.ncol)
        row[lp.CL0:lp.CL0 + K] = a_g / replay_bound.SCALE
        row[lp.R] = -1.0
        lp.add(row, 0.0)


def _share_ratio(a: _Arrays, L: int, p: int, r: int, res_names: list[str], least_layers: int) -> float:
    """rho_r of `_replay_rows`: the largest over resources q of min(1 / kappa_q, (A + E_r) / (kappa_q A + H_r)) at
    A = the least layers rank r holds x the least per-layer time on q, a lower bound of t_r / W_r over every split
    ((A + E) / (kappa A + H) is monotone in A); 0 when no resource has work in every layer."""
    edges = [i for i, mine in ((L, r == 0), (L + 1, r == p - 1)) if mine]
    h = np.asarray(a.hi, dtype=float)
    big_h = float(h[edges].sum()) if edges else 0.0
    best = 0.0
    for res in res_names:
        t = np.asarray(a.time[res], dtype=float)
        layers = t[:L]
        if np.any(layers <= 0):
            continue
        kappa = max(1.0, float(np.max(h[:L] / layers)))
        e = float(t[edges].sum()) if edges else 0.0
        lo = least_layers * float(layers.min())
        rho = 1.0 / kappa
        if kappa * lo + big_h > 0:
            rho = min(rho, (lo + e) / (kappa * lo + big_h))
        best = max(best, rho)
    return best


def _pipeline_rows(lp: _Program) -> None:
    """The ranked pipeline term: Z >= slots x S (the step formula's, `schedule_slots`) and Z >= R (the replay)."""
    slots = schedule_slots(lp.p, lp.v, lp.m)
    for extra in ({lp.S: slots, lp.Z: -1.0}, {lp.R: 1.0, lp.Z: -1.0}):
        row = np.zeros(lp.ncol)
        for c, val in extra.items():
            row[c] = val
        lp.add(row, 0.0)


def _objective(lp: _Program) -> np.ndarray:
    """max(slots S, R) + U + E: the pipeline term, the slowest rank's update and its exposed communication."""
    cost = np.zeros(lp.ncol)
    cost[lp.Z] = 1.0
    cost[lp.U] = 1.0
    cost[lp.E] = 1.0
    return cost


def _placement_rows(p: int, v: int, nk: int, ncol: int, least: tuple[int, ...]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every chunk holds its least layers, as -sum_t x[j, t] <= -least; their right-hand sides; every kind's
    layers all placed, as sum_j x[j, t] = count_t) over the first p v nk of ncol columns (rank r's k-th chunk,
    global chunk k p + r, at (r v + k) nk ..). `least` in global chunk order (`frames.chunk_least`; empty: one)."""
    chunks = p * v
    least = least_or_one(least, chunks)
    chunk_rows = np.zeros((chunks, ncol))
    chunk_rhs = np.zeros(chunks)
    a_eq = np.zeros((nk, ncol))
    for j in range(chunks):
        chunk_rows[j, j * nk:(j + 1) * nk] = -1.0
        a_eq[:, j * nk:(j + 1) * nk] = np.eye(nk)
        r, k = divmod(j, v)
        chunk_rhs[j] = -float(least[k * p + r])
    return chunk_rows, chunk_rhs, a_eq


def _order_rows(p: int, v: int, closes: np.ndarray, kclose: np.ndarray, ncol: int, least: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The AttnRes blocks closed before each chunk boundary, in model order: a split is contiguous, so global chunks
    0..g hold the first N_g layers and close exactly C(N_g) blocks (C(n): the blocks the first n layers close, a
    step function of n). Every line of C's lower convex hull lies below it over the N_g a split can have (from the
    least layers of chunks 0..g to L less those of the later chunks), so sum_{chunks <= g} kclose . x >=
    c1 + s (N_g - n1) for each hull segment. Without them the relaxation deals the closing layers (K3: every sixth)
    into the last chunks and holds almost no residual bank; the bank only grows with C, so the upper side is not
    needed. `closes`: blocks closed per layer in model order; `kclose`: per kind."""
    L = len(closes)
    chunks = p * v
    nk = len(kclose)
    if not np.any(closes):
        return np.zeros((0, ncol)), np.zeros(0)
    lk = least_or_one(least, chunks)
    prefix = np.concatenate([[0.0], np.cumsum(closes)])
    rows: list[np.ndarray] = []
    rhs: list[float] = []
    held = np.zeros(ncol)  # N_g: every layer in global chunks 0..g
    closed = np.zeros(ncol)  # the blocks they close
    for g in range(chunks - 1):
        k, r = divmod(g, p)
        held[(r * v + k) * nk:(r * v + k + 1) * nk] = 1.0
        closed[(r * v + k) * nk:(r * v + k + 1) * nk] = kclose
        lo, hi = int(sum(lk[:g + 1])), L - int(sum(lk[g + 1:]))
        if hi <= lo:
            continue  # N_g is pinned by the least layers, and with it the placement rows' counts
        for (n1, c1), (n2, c2) in itertools.pairwise(_hull(np.arange(lo, hi + 1), prefix[lo:hi + 1])):
            slope = (c2 - c1) / (n2 - n1)
            rows.append(slope * held - closed)
            rhs.append(slope * n1 - c1)
    if not rows:
        return np.zeros((0, ncol)), np.zeros(0)
    return np.array(rows), np.array(rhs)


def _hull(ns: np.ndarray, c: np.ndarray) -> list[tuple[int, float]]:
    """The vertices of the lower convex hull of the points (ns[i], c[i]), ns increasing (monotone chain)."""
    out: list[tuple[int, float]] = []
    for n, y in zip(ns.tolist(), c.tolist(), strict=True):
        while len(out) >= 2:
            (n0, y0), (n1, y1) = out[-2], out[-1]
            cross = (n1 - n0) * (y - y0) - (y1 - y0) * (n - n0)
            if cross <= 0:
                out.pop()
            else:
                break
        out.append((n, y))
    return out


def _pair(a: _Arrays, L: int) -> np.ndarray:
    """The decoder layers' chunk-pair bytes (`_Arrays.pair`), zeros without."""
    return a.pair[:L] if a.pair is not None else np.zeros(L)


def _edge(arr: np.ndarray, r: int, p: int, L: int) -> float:
    """Rank r's edge entries of a per-layer array: the first edge on rank 0, the last on rank p - 1."""
    return float(arr[L] if r == 0 else 0.0) + float(arr[L + 1] if r == p - 1 else 0.0)


def _memory_rows(f: Frame, a: _Arrays, c0: Coefficients, cap: float, host_cap: float, off: bool, bal: bool,
                 kp: np.ndarray, kopt: np.ndarray, kact: np.ndarray, kpair: np.ndarray,
                 kclose: np.ndarray | None = None, exact_balance: bool = False) -> tuple[np.ndarray, list[float]]:
    """Every rank's memory rows over x[r, k, t] (layers of kind t in rank r's k-th chunk, column (r v + k) nk + t;
    kp, kopt, kact: each kind's persistent, optimizer-phase and saved bytes): the activation phase for every
    undominated in-flight composition (with offload: the GPU's persistent bytes and the host's saved bytes) and the
    optimizer phase, under the allocated budget. The one home of these rows: `_solve` and `_fits` share them.
    `kclose`: each kind's AttnRes blocks closed (`Coefficients.closes`); given, every activation row also holds the
    AttnRes bank of its composition (`_bank_row`), on the GPU under offload too (the ledger's attnres_bank), which
    reads the layers of every earlier chunk, other ranks' among them. None: the bank is left out (a looser row).
    `exact_balance`: `bal` is the setting of every layout the rows stand for, so the in-flight counts are balancing's
    average on every rank; False: rows over both settings, each rank at the lesser of its count and the average.
    `kpair`: each kind's chunk-pair bytes (`_Arrays.pair`, whose average kp holds; `_pair`); where `a` has them,
    every row that holds the persistent bytes is written once per chunk of the rank with that chunk's pair bytes in
    full (2 x the largest chunk is at least 2 x each chunk): exact where the average lets uneven chunks look as lean
    as even ones."""
    L, p, v, nk = c0.n_layers, f.pp, f.vp, len(kp)
    rows: list[np.ndarray] = []
    rhs: list[float] = []

    def le(coef_by_chunk: list[np.ndarray], r: int, bound: float, bank: np.ndarray | None = None) -> None:
        row = np.zeros(p * v * nk) if bank is None else bank.copy()
        row[r * v * nk:(r + 1) * v * nk] += np.concatenate(coef_by_chunk)
        rows.append(row)
        rhs.append(bound)

    packets = _least_packets(c0, p)
    moe = c0.moe[:L] > 0
    # Each rank holds at least its chunks' least layers; more than the non-MoE layers means it holds an MoE layer.
    must_moe = _must_moe(moe, a.least, p, v)
    room = cap * (1 + FEAS_TOL)
    for r in range(p):
        n_peak = peak_inflight(c0.compositions[r])
        persist = _persistent_forms(a, kp, kpair, r, p, v, L)
        act_fixed = _least_act_fixed(a.ws_min, packets, a.ep_min, c0.routing_map, must_moe,
                                     a.logits if r == p - 1 else 0.0)
        ratio = balanced_scale(c0.balanced_inflight, n_peak) if bal else 1.0
        # Balancing on: every rank holds the average count, more than its own on the late ranks (evaluate's scale).
        # Rows over several settings at once (the lean tests) take the smaller of the two counts.
        scale = ratio if exact_balance else min(1.0, ratio)
        comps = _undominated([tuple(scale * ci for ci in c) for c in c0.compositions[r]])
        banks: list[np.ndarray | None] = [None] * len(comps)
        if kclose is not None and kclose.any():
            streams = _open_streams_row(p, v, kclose, c0.stream_bytes, r)
            banks = [_bank_row(p, v, kclose, c0.stream_bytes, comp, r) + streams for comp in comps]
        if off:
            # Saved bytes on the host; the GPU keeps at least the resident layers' smallest saved sets, and the bank
            # (per composition; without the bank rows, one row).
            gpu_act = c0.shape.offload_resident_layers * float(a.act[:L].min())
            for bank in banks if banks[0] is not None else [None]:
                for kps, fixed in persist:
                    le(kps, r, room - fixed - act_fixed - gpu_act, bank=bank)
            for comp in comps:
                le([comp[k] * kact for k in range(v)], r, host_cap * (1 + FEAS_TOL) - _edge_act(a, comp, r, p, L))
        else:
            for comp, bank in zip(comps, banks, strict=True):
                for kps, fixed in persist:
                    le([kps[k] + comp[k] * kact for k in range(v)], r,
                       room - fixed - act_fixed - _edge_act(a, comp, r, p, L), bank=bank)
        # The optimizer phase (ledger.optimizer_transient_bytes): gather + NS under the default policy, else
        # max(gather, NS), which is at least each of them.
        for kps, fixed in persist:
            if a.with_ns:
                le([kps[k] + kopt for k in range(v)], r, room - fixed - _edge(a.opt, r, p, L) - a.nsws_min)
            else:
                le([kps[k] + kopt for k in range(v)], r, room - fixed - _edge(a.opt, r, p, L))
                le(kps, r, room - fixed - a.nsws_min)
    return np.array(rows), rhs


def _persistent_forms(a: _Arrays, kp: np.ndarray, kpair: np.ndarray, r: int, p: int, v: int, L: int
                      ) -> list[tuple[list[np.ndarray], float]]:
    """Rank r's persistent bytes as (per-chunk coefficients over the kinds, the edges' bytes): one form, kp in
    every chunk, without chunk-pair bytes; else one form per chunk kk of the rank, the pair's
    average taken out of kp and its whole put on chunk kk, and on the edge that chunk kk holds (the first edge in
    global chunk 0, the last in chunk p v - 1)."""
    fixed = _edge(a.persistent, r, p, L)
    if a.pair is None:
        return [([kp] * v, fixed)]
    base, base_fixed = kp - kpair / v, fixed - _edge(a.pair, r, p, L) / v
    out = []
    for kk in range(v):
        g = kk * p + r
        edge = (float(a.pair[L]) if g == 0 else 0.0) + (float(a.pair[L + 1]) if g == p * v - 1 else 0.0)
        out.append(([base + kpair if k == kk else base for k in range(v)], base_fixed + edge))
    return out


def _least_act_fixed(ws_min: float, packets: float, ep_min: float, routing_map: float, must_moe: bool,
                     logits: float) -> float:
    """The least activation-phase bytes beside the saved sets and the bank: the PP packets and (on a rank that must
    hold a MoE layer) the routing map, held; the smallest working set and EP buffers of a layer, or the loss's
    logits, whichever is more (ledger.least_transient)."""
    held = packets + (routing_map if must_moe else 0.0)
    return held + float(least_transient(ws_min + (ep_min if must_moe else 0.0), logits))


def _bank_row(p: int, v: int, kclose: np.ndarray, stream: float, comp: tuple[float, ...], r: int) -> np.ndarray:
    """Rank r's AttnRes bank at in-flight composition `comp`, over the columns (r' v + k') nk + t: each of its chunks
    (global chunk g = k p + r) holds comp[k] microbatches' BF16 [T, d] streams, one per block closed by the end of
    g, i.e. by any layer of a chunk g' <= g of any rank: sum_k comp[k] x stream x sum_{g' <= g} kclose . x[g']."""
    held = np.zeros(p * v)
    held[[k * p + r for k in range(v)]] = comp
    # Chunk g' weighs with every own chunk at or after it: a suffix sum over global chunks.
    return _by_chunk(p, v, stream * np.cumsum(held[::-1])[::-1], kclose)


def _open_streams_row(p: int, v: int, kclose: np.ndarray, stream: float, r: int) -> np.ndarray:
    """The AttnRes streams in rank r's PP packets beyond the R = 0 ones `_least_packets` counts: its latest chunk g
    that is neither the first nor the last (p > 1) has its two packets in and out double-buffered, 2 x (R(start of
    g) + R(end of g)) x stream more, R(b) the blocks closed by boundary b (ledger pp_buffers: 2 x the largest
    chunk's, so at least this chunk's). Zero when r holds no such chunk."""
    weight = np.zeros(p * v)
    mid = [k * p + r for k in range(v) if 0 < k * p + r < p * v - 1]
    if p > 1 and mid:
        g = mid[-1]
        per_stream = pp_packet_bytes(1.0, stream) - pp_packet_bytes(0.0, stream)  # one more open stream
        weight[:g] = 2 * 2 * per_stream  # double-buffered, in both R(start of g) and R(end of g)
        weight[g] = 2 * per_stream
    return _by_chunk(p, v, weight, kclose)


def _by_chunk(p: int, v: int, per_chunk: np.ndarray, kclose: np.ndarray) -> np.ndarray:
    """A row over the columns (r v + k) nk + t from a weight per global chunk g = k p + r times kclose[t]."""
    return (per_chunk.reshape(v, p).T[:, :, None] * kclose[None, None, :]).ravel()


def lean_fits(job: Job, f: Frame, lean: Coefficients, cap: float, host_cap: float,
              arrays: _Arrays | None = None) -> bool:
    """Whether any variant of a node of interleaved frame f might fit: `_fits` over `lean_arrays` (at or below every
    variant's bytes), the in-flight counts at balancing's average where allowed (a smaller count only lowers a
    row), under each allowed offload setting (offload moves saved bytes to the host and changes no other byte,
    k3opt.cost.coefficients). `arrays`: the lean arrays to test instead (a group's merged ones)."""
    a = arrays if arrays is not None else lean_arrays(job, f, lean)
    return any(_fits(f, a, lean, cap, host_cap, off, _lean_balance(job, lean))
               for off in choices(job, "activation_offload"))


def _lean_balance(job: Job, lean: Coefficients) -> bool:
    """Whether the lean memory rows take the in-flight counts at balancing's average: where the job allows it and
    the schedule has one (a smaller count only lowers a row)."""
    return "balance_activations" in allowed_on(job) and lean.balanced_inflight is not None


def contiguous_fits(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec, cluster: ClusterSpec,
                    time_limit: float, members: tuple[Frame, ...] | None = None) -> bool | None:
    """Whether a layout of node (f, rc, lc) with f.vp > 1 might fit, with whole layers in contiguous chunks: the
    memory rows of `lean_fits` (the leanest bytes of every variant, each allowed offload setting) over one Boolean
    per layer and chunk (`_contiguous`). None when CP-SAT neither finds a split nor proves there is none within
    `time_limit` seconds. The linear relaxation drops contiguity, and a node it says fits can have no contiguous
    split, which the node model's bound can take minutes to prove and this program seconds. Its optimizer-phase rows
    are the lean view's (`lean_arrays`: no Newton-Schulz working set), so where that phase binds it says yes.
    `members`: frames of f's sharding group (f among them) tested at once, over the least of their lean arrays
    (`_merge`) under the largest of their budgets: False only when no member's layout fits."""
    group = members or (f,)
    leans = [memory_view(job, g, lean_mode(job, rc), lc, model, cluster) for g in group]
    lean = leans[0]
    arrays = [lean_arrays(job, g, vw) for g, vw in zip(group, leans, strict=True)]
    a = _merge(arrays, f.vp) if len(arrays) > 1 else arrays[0]
    cap = max(float(allocated_capacity_bytes(job, g, model, cluster)) for g in group)
    bal = _lean_balance(job, lean)
    deadline = time.monotonic() + time_limit
    undecided = False
    for off in choices(job, "activation_offload"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        fits = _contiguous(f, a, lean, cap, cluster.host_memory_bytes, off, bal, left)
        if fits:
            return True
        undecided = undecided or fits is None
    return None if undecided else False


HOST_LINK_TOGGLES = tuple(t.name for t in TOGGLE_REGISTRY if t.kind is ToggleKind.RANK and t.searched
                          and t.memory_only and "time.host_link" in t.changes)
"""Rank toggles that buy memory with host-link traffic (activation offload, pipeline ZeRO-2): a node whose layouts
cannot fit without one holds only layouts that pay it. The host link is the slowest resource, so requiring one can
move a bound by its whole stage (the others add a pass of the LM head or update traffic, a few percent, which is
not worth a whole-layer test per node)."""


def with_toggles(job: Job, forbid: Iterable[str] = (), require: Iterable[str] = ()) -> Job:
    """`job` with toggles added to its [search] forbid_toggles and require_toggles."""
    s = job.search
    return job.model_copy(update={"search": s.model_copy(update={
        "forbid_toggles": [*s.forbid_toggles, *forbid], "require_toggles": [*s.require_toggles, *require]})})


def required_toggle_bound(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                          cluster: ClusterSpec, bound: float, setting: dict[str, bool], stop_at: float,
                          deadline: float, members: tuple[Frame, ...] | None = None) -> float:
    """`bound` (interleaved_lp_bound of node (f, rc, lc), whose least variant had the rank toggles `setting`)
    raised by the toggles the node cannot do without: while the bound is under `stop_at`, each host-link toggle
    (HOST_LINK_TOGGLES) off in the least variant is tested with `contiguous_fits` on the job that forbids it (for
    at most SearchPolicy.required_check_s); where no contiguous whole-layer split fits without it, every layout of
    the node has it on, and the bound is the relaxation over the variants with it on (and those required before).
    The relaxation's fractional layers fit without the toggle where whole ones do not: DeepSeek-V3 PP8 VP4 EP16
    dFSDP4 on 1,024 H100 at the peak roofline (61 layers in 32 chunks), full recompute: 4.10 s with offload alone,
    7.13 s once pipeline ZeRO-2 is required (its layouts replay at 8.4 s). `members`: as in interleaved_lp_bound,
    the group node of f's sharding group (a toggle is then required when no member fits without it)."""
    tried: set[str] = set()
    allowed = allowed_on(job)
    while bound < stop_at * (1 - STOP_ROUNDING) and time.monotonic() < deadline:
        off = [t for t in HOST_LINK_TOGGLES if t in allowed and setting.get(t) is False and t not in tried
               and t not in job.search.require_toggles]
        if not off:
            break
        t = off[0]
        tried.add(t)
        if contiguous_fits(with_toggles(job, forbid=[t]), f, rc, lc, model, cluster, POLICY.required_check_s,
                           members=members) is not False:
            continue
        job, setting = with_toggles(job, require=[t]), {}
        bound = max(bound, interleaved_lp_bound(job, f, rc, lc, model, cluster, stop_at=stop_at,
                                                separate=members is None, members=members, deadline=deadline,
                                                setting_out=setting))
    return bound


def _contiguous(f: Frame, a: _Arrays, c0: Coefficients, cap: float, host_cap: float, off: bool, bal: bool,
                time_limit: float) -> bool | None:
    """`contiguous_fits` under one offload setting, by CP-SAT: `_memory_rows` over a Boolean per layer and chunk
    (column (r v + k) L + i: layer i in rank r's k-th chunk, global chunk k p + r), every layer in one chunk, the
    first layer in chunk 0 and the last in chunk G - 1, and each next layer in the same chunk or the next (so
    every chunk holds one). Rows in KiB, each coefficient rounded up and the bound raised by one KiB per term,
    which only loosens a row (sum ceil(c / U) x <= sum (c / U + 1) x). (CP-SAT rather than SCIP: on the 128K node
    of `contiguous_fits` SCIP needs 13 s over the same rows, and finds no answer in 60 s over suffix binaries.)"""
    L, p, v = c0.n_layers, f.pp, f.vp
    G = p * v
    rows, rhs = _memory_rows(f, a, c0, cap, host_cap, off, bal, a.persistent[:L], a.opt[:L], a.act[:L], _pair(a, L),
                             np.asarray(c0.closes[:L], dtype=float))
    m = cp_model.CpModel()
    x = [m.new_bool_var(f"x{j}") for j in range(G * L)]

    def at(g: int, i: int) -> cp_model.IntVar:
        k, r = divmod(g, p)
        return x[(r * v + k) * L + i]

    for i in range(L):
        m.add_exactly_one(at(g, i) for g in range(G))
    # The first layer opens chunk 0 (or chunk 1 when chunk 0 may be empty), the last closes chunk G - 1 (or G - 2).
    least = least_or_one(a.least, G)
    m.add_bool_or([at(0, 0)] + ([at(1, 0)] if not least[0] and G > 1 else []))
    m.add_bool_or([at(G - 1, L - 1)] + ([at(G - 2, L - 1)] if not least[-1] and G > 1 else []))
    for i in range(L - 1):
        for g in range(G):
            m.add_bool_or([~at(g, i), at(g, i + 1)] + ([at(g + 1, i + 1)] if g + 1 < G else []))
    unit = 1024.0
    for row, bound in zip(rows, rhs, strict=True):
        nz = np.nonzero(row)[0]
        m.add(sum(int(math.ceil(row[j] / unit)) * x[j] for j in nz) <= math.floor(bound / unit) + len(nz))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit, 0.05)
    solver.parameters.num_workers = 2
    solver.parameters.catch_sigint_signal = False
    status = solver.solve(m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return True
    if status == cp_model.INFEASIBLE:
        return False
    return None


def lean_arrays(job: Job, f: Frame, lean: Coefficients) -> _Arrays:
    """The memory side of `_relaxed` at or below every variant of a node, from `lean`, its leanest mode with the
    chunked cross-entropy and balancing on where allowed (`frames.memory_view`: the least saved and working-set
    bytes of any mode, as `needs_offload` takes them): the gradients at the lesser of the FP32 shard and ZeRO-2's
    two chunk buffers, the step gather at the lesser of the BF16 view and P2P Muon's resident matrix, MoonEP's
    buffers where allowed, no Newton-Schulz working set. No work (the memory rows read none)."""
    allowed = allowed_on(job)
    L = lean.n_layers
    grads = least_grads(lean, allowed, f.vp)
    ep = lean.ep_buffers
    if "moonep" in allowed:
        ep = min(ep, lean.moonep_buffers)
    return _Arrays(time={}, update={}, persistent=bound_persistent_bytes(lean, grads),
                   opt=least_step_gather(lean, allowed), act=lean.act,
                   ws_min=float(lean.working_set[:L].min()), nsws_min=0.0, logits=float(lean.logits),
                   ep_min=float(ep), hi=np.zeros(L + 2), with_ns=lean.step_gather_with_ns,
                   least=chunk_least(job, f))


def no_offload_bound(job: Job, f: Frame, floors: list[Coefficients], views: list[Coefficients], cap: float,
                     cluster: ClusterSpec) -> float:
    """A lower bound (s) on every layout without offload of the nodes whose work floors and leanest views are
    `floors` and `views` (pairwise, one pair per member frame; their schedule terms equal, f one of
    the frames): `_solve`'s program over the least work of the floors (every activation mode's work at or above)
    beside the least bytes of the views (`lean_arrays`: every mode's bytes at or above), under every allowed
    balancing setting; inf when no such layout fits. Pairing one mode's work with another's bytes keeps it below
    every layout; what it keeps of memory is each rank's rows: where the early ranks' in-flight counts crowd their
    chunks, the layers pile onto the late ranks. No replay paths (they read per-layer maxima at or above every
    mode's work, which a floor is not). K3 PP8 VP4 EP64 at 8,192 GPUs, selective: 27.8 s, where the group's mean
    load is 17.96 s (its node relaxation: 31.3 s without offload)."""
    arrays = []
    for cf, vw in zip(floors, views, strict=True):
        lean = lean_arrays(job, f, vw)
        arrays.append(dataclasses.replace(
            lean, time=dict(cf.time), update=dict(cf.update), hidden=dict(cf.update_hidden),
            hidden_stages=cf.update_hidden_stages, hi=busiest_layer_seconds(cf),
            updates=(node_terms(cf, f.pp),)))
    merged = _merge(arrays, f.vp) if len(arrays) > 1 else arrays[0]
    c0 = views[0]
    no_paths = np.zeros((0, f.pp * f.vp))
    # (Balancing without a balanced count, which `_memory_rows` then leaves at the full count, still bounds.)
    return min(_solve(f, merged, c0, cap, cluster.host_memory_bytes, False, bal, no_paths)
               for bal in choices(job, "balance_activations"))


def _fits(f: Frame, a: _Arrays, c0: Coefficients, cap: float, host_cap: float, off: bool, bal: bool,
          exact_balance: bool = False) -> bool:
    """Whether `_solve`'s program over the same arrays is feasible: its memory rows, every chunk holding a layer
    and every layer placed (its time and replay rows only bound free variables from below, so they never make it
    infeasible). Layers are grouped by their memory columns and closed blocks alone, which is exact for the
    fractional program: a much smaller program that settles a node that cannot fit before its time rows are
    built."""
    L, p, v = c0.n_layers, f.pp, f.vp
    kinds, counts = np.unique(np.stack([a.persistent[:L], a.opt[:L], a.act[:L], c0.closes[:L], _pair(a, L)], axis=1),
                              axis=0, return_counts=True)
    nk = len(counts)
    mem_rows, mem_rhs = _memory_rows(f, a, c0, cap, host_cap, off, bal, kinds[:, 0], kinds[:, 1], kinds[:, 2],
                                     kinds[:, 4], kinds[:, 3], exact_balance=exact_balance)
    n = p * v * nk
    chunk_rows, chunk_rhs, a_eq = _placement_rows(p, v, nk, n, a.least)
    order_rows, order_rhs = _order_rows(p, v, np.asarray(c0.closes[:L], dtype=float), kinds[:, 3], n, a.least)
    a_ub = np.vstack([mem_rows, chunk_rows, order_rows])
    b_ub = np.concatenate([mem_rhs, chunk_rhs, order_rhs])
    return _glop(np.zeros(n), a_ub, b_ub, a_eq, counts.astype(float), np.tile(counts.astype(float), p * v)) < math.inf


def _paths(f: Frame, c0: Coefficients, full: bool) -> np.ndarray:
    """The undominated replay-path coefficient rows (replay_bound: SCALE a_g per global chunk g) of the frame's
    schedule: the classic paths and the longest paths at sample splits over equal per-layer weights (any
    nonnegative weights give valid paths; equal ones let every frame of one schedule share them)."""
    return _paths_of(f.pp, f.vp, f.microbatches, c0.n_layers, full)


def _build_paths_of(p: int, v: int, m: int, L: int, full: bool) -> np.ndarray:
    beta = replay_bound.betas([full])
    paths = replay_bound.seed_paths(p, v, m, np.ones(L), beta[0])
    out = np.array(replay_bound.undominated([replay_bound.path_coefficients(nf, nb, beta) for nf, nb in paths]),
                   dtype=float)
    out.setflags(write=False)
    return out


_paths_of = Memo(_build_paths_of, maxsize=256)


def _packet_floor(c0: Coefficients, p: int, v: int, L: int, least: tuple[int, ...] = ()
                  ) -> list[dict[str, float]]:
    """Per rank, a floor on its PP packets' seconds per microbatch on each link (achievable.rank_sums prices them:
    `pp_packet_bytes` in and out of every chunk but the model's ends). The boundary before global chunk g lies at
    layer sum(least[:g]) or deeper (g with a layer in every chunk; `least` as `frames.chunk_least`), and the open
    streams only grow with depth, so each boundary carries at least its shallowest possible packet."""
    out: list[dict[str, float]] = [{} for _ in range(p)]
    if p == 1:
        return out
    closes_cum = np.concatenate([[0.0], np.cumsum(c0.closes[:L])])
    k = p * v
    depth = np.concatenate([[0], np.cumsum(least_or_one(least, k))])
    for r in range(p):
        for boundary, hop, res in rank_packets(c0, r, range(r, k, p)):
            out[r][res] = out[r].get(res, 0.0) + (
                pp_packet_bytes(closes_cum[depth[boundary]], c0.stream_bytes) * c0.pp_seconds_per_byte[hop])
    return out


def _packet_stream_rows(c0: Coefficients, p: int, v: int, kclose: np.ndarray
                        ) -> list[dict[str, tuple[float, np.ndarray]]]:
    """Per rank and link, its PP packets' seconds per microbatch as a constant plus a row over the x[r, k, t]:
    the packet at the boundary before global chunk g carries 1 + R_g streams (`pp_packet_bytes`), R_g = sum over
    chunks g' < g of kclose . x[g'], the blocks closed by the layers before the boundary, which is exact for a
    contiguous split in model order (the node model's `closes_before`). Rank r sends the packet before its chunk
    g + 1 on its own hop and receives the one before its chunk g on hop r - 1, as `achievable.rank_sums` prices
    them. Empty for p = 1 and where no layer closes a block (the constant floor `_packet_floor` is then exact)."""
    out: list[dict[str, tuple[float, np.ndarray]]] = [{} for _ in range(p)]
    if p == 1 or not np.any(kclose):
        return out
    k = p * v
    one, per_stream = pp_packet_terms(c0.stream_bytes)
    for r in range(p):
        weight: dict[str, np.ndarray] = {}
        const: dict[str, float] = {}
        for boundary, hop, res in rank_packets(c0, r, range(r, k, p)):
            spb = c0.pp_seconds_per_byte[hop]
            w = weight.setdefault(res, np.zeros(k))
            w[:boundary] += per_stream * spb
            const[res] = const.get(res, 0.0) + one * spb
        for res, w in weight.items():
            out[r][res] = (const[res], _by_chunk(p, v, w, kclose))
    return out


def _undominated(comps: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """In-flight compositions no other composition covers entry by entry (a covered one gives a weaker row)."""
    return list(_undominated_cached(tuple(comps)))


def _build_undominated_cached(comps: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    arr = np.unique(np.array(comps, dtype=float), axis=0)
    covered = np.all(arr[None, :, :] >= arr[:, None, :], axis=2)  # covered[i, j]: j covers i
    np.fill_diagonal(covered, False)
    return tuple(tuple(float(x) for x in c) for c in arr[~covered.any(axis=1)])


_undominated_cached = Memo(_build_undominated_cached, maxsize=4096)


def _glop(cost: np.ndarray, a_ub: np.ndarray, b_ub: np.ndarray, a_eq: np.ndarray, b_eq: np.ndarray,
          upper: np.ndarray, solution: bool = False, deadline: float = math.inf
          ):  # noqa: ANN201 - float, or (float, array | None)
    """min cost.z, a_ub z <= b_ub, a_eq z = b_eq, 0 <= z <= upper, by GLOP: the optimum, inf if infeasible,
    0 when GLOP ends without a certificate (no bound rather than a wrong one), as when it reaches the monotonic
    `deadline`; with `solution`, (optimum, z), z None where there is no optimum. The model is handed over as one
    MPModelProto (rows filled from numpy slices) rather than coefficient by coefficient: the same model, built in a
    fraction of the time."""
    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:
        raise RuntimeError("OR-tools' GLOP linear solver is unavailable")
    proto = linear_solver_pb2.MPModelProto()
    for u, c in zip(upper, cost, strict=True):
        var = proto.variable.add()
        var.lower_bound = 0.0
        var.upper_bound = float(u) if math.isfinite(u) else math.inf
        var.objective_coefficient = float(c)
    for mat, b_vec, equal in ((a_ub, b_ub, False), (a_eq, b_eq, True)):
        rows_nz, cols_nz = np.nonzero(mat)
        starts = np.searchsorted(rows_nz, np.arange(mat.shape[0] + 1)).tolist()
        cols_l, vals_l, b_l = cols_nz.tolist(), mat[rows_nz, cols_nz].astype(float).tolist(), b_vec.tolist()
        for i in range(mat.shape[0]):
            row = proto.constraint.add()
            row.lower_bound = float(b_l[i]) if equal else -math.inf
            row.upper_bound = float(b_l[i])
            row.var_index.extend(cols_l[starts[i]:starts[i + 1]])
            row.coefficient.extend(vals_l[starts[i]:starts[i + 1]])
    proto.maximize = False
    error = solver.LoadModelFromProto(proto)
    if error:
        raise RuntimeError(f"GLOP rejected the relaxation: {error}")
    if math.isfinite(deadline):
        # One program can take seconds (K3 FP8 on GB300: 3-8 s): past the search's end it would run the plan over.
        left = deadline - time.monotonic()
        if left <= 0:
            return (0.0, None) if solution else 0.0
        solver.SetTimeLimit(max(1, int(left * 1000)))
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return (math.inf, None) if solution else math.inf
    if status != pywraplp.Solver.OPTIMAL:
        return (0.0, None) if solution else 0.0
    value = float(solver.Objective().Value())
    if not solution:
        return value
    return value, np.array([var.solution_value() for var in solver.variables()])


def _edge_act(a: _Arrays, comp: tuple[float, ...], r: int, p: int, L: int) -> float:
    """Saved bytes of the edges: the first edge rides chunk 0 (rank 0, k = 0), the last chunk K - 1 (rank p - 1,
    k = v - 1), each times that chunk's in-flight count."""
    out = 0.0
    if r == 0:
        out += comp[0] * float(a.act[L])
    if r == p - 1:
        out += comp[-1] * float(a.act[L + 1])
    return out


__all__ = ["interleaved_lp_bound"]


def needs_offload(job: Job, f: Frame, lean: Coefficients, cap: float) -> bool:
    """True when no split of the interleaved frame f fits its activation phase under `cap` without offload (with
    balancing, if allowed), by the memory rows of the relaxation alone (layers fractional over chunks, each chunk
    holding at least one layer, every undominated in-flight composition of every rank). `lean`: the leanest
    mode's coefficients (`frames.memory_view`); its saved and working-set bytes are the least of any mode, and
    the other bytes are `lean_arrays`'."""
    allowed = allowed_on(job)
    L, p, v = lean.n_layers, f.pp, f.vp
    la = lean_arrays(job, f, lean)
    P = la.persistent
    A = lean.act
    kinds, counts = np.unique(np.stack([P[:L], A[:L]], axis=1), axis=0, return_counts=True)
    nk = len(counts)
    kp, ka = kinds[:, 0], kinds[:, 1]
    moe = lean.moe[:L] > 0
    must_moe = _must_moe(moe, la.least, p, v)
    n = p * v * nk
    rows, rhs = [], []
    for r in range(p):
        n_peak = peak_inflight(lean.compositions[r])
        scale = 1.0
        if "balance_activations" in allowed and lean.balanced_inflight is not None:
            scale = min(1.0, balanced_scale(lean.balanced_inflight, n_peak))
        fixed = (P[L] if r == 0 else 0.0) + (P[L + 1] if r == p - 1 else 0.0) + _least_act_fixed(
            la.ws_min, _least_packets(lean, p), la.ep_min, lean.routing_map, must_moe,
            lean.logits if r == p - 1 else 0.0)
        for comp in _undominated([tuple(scale * c for c in cc) for cc in lean.compositions[r]]):
            row = np.zeros(n)
            for k in range(v):
                row[(r * v + k) * nk:(r * v + k + 1) * nk] = kp + comp[k] * ka
            edge_act = (comp[0] * A[L] if r == 0 else 0.0) + (comp[-1] * A[L + 1] if r == p - 1 else 0.0)
            rows.append(row)
            rhs.append(cap * (1 + FEAS_TOL) - fixed - edge_act)
    chunk_rows, chunk_rhs, a_eq = _placement_rows(p, v, nk, n, la.least)
    a_ub = np.vstack([np.array(rows), chunk_rows])
    b_ub = np.concatenate([rhs, chunk_rhs])
    upper = np.tile(counts.astype(float), p * v)
    return _glop(np.zeros(n), a_ub, b_ub, a_eq, counts.astype(float), upper) == math.inf


def _must_moe(moe: np.ndarray, least: tuple[int, ...], p: int, v: int) -> bool:
    """Whether every rank holds an MoE layer: each holds at least its chunks' least layers (`frames.rank_least`;
    v with one per chunk), and more layers than the model has non-MoE ones include an MoE layer."""
    fewest = int(rank_least(least_or_one(least, p * v), p).min())
    return bool(moe.any()) and fewest > int((~moe).sum())


def _least_packets(c: Coefficients, p: int) -> float:
    """PP buffers every rank of an interleaved frame holds (p > 1): each holds a chunk that is neither the first
    nor the last, a packet in and one out, double-buffered (the node model's 2 (in + out)), each at least
    `pp_packet_bytes` with no AttnRes stream open (R >= 0)."""
    return 4.0 * pp_packet_bytes(0.0, c.stream_bytes) if p > 1 else 0.0
