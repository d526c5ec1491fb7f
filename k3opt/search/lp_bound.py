"""A linear-programming lower bound on a node's step time for interleaved frames (v > 1).

The exact node model assigns each layer to one chunk (contiguous chunks, chunk j on rank j mod p). Here a layer
may be split fractionally over the chunks and contiguity is dropped; everything else that the relaxation keeps is
a relaxation of the exact term, so the LP optimum is a lower bound on every layout of the node:

- time: each rank's per-microbatch work on every resource is the sum of its layers' work (the cheapest mode per
  layer: the activation toggles only add work), the first-chunk edge on rank 0, the last-chunk edge on rank p - 1;
  PP packets are dropped. The update is the same sum of per-layer update work. Objective: the step,
  (M + (p - 1)/v) x the slowest rank + the slowest rank's update (`schedule_slots`, as in the node model).
- memory: every rank's activation phase for every in-flight composition it passes through (persistent bytes of
  its layers + count x saved bytes of each chunk's layers + the smallest working set + the packets and expert
  buffers every such rank must hold) and its optimizer phase, under the allocated budget, with the leanest mode's
  bytes per layer; the AttnRes bank is dropped. Offload and balancing are global switches (every rank or none),
  so the bound is the least over the allowed (offload, balancing) variants: offload moves the saved bytes to host
  memory (which must hold them) and pays the offload's host-link work; balancing scales the in-flight counts to
  the balanced average and pays the moved bytes on its network.
- granularity: every chunk holds at least one layer, and some rank holds at least ceil(L / p) layers, so the
  slowest rank does at least the work of the ceil(L / p) cheapest layers on each resource.

Layers whose coefficients are all equal are aggregated into one variable per chunk (exact for the LP), which
keeps a 93-layer, 32-chunk node at a few hundred variables. Solved with GLOP (OR-tools' LP solver)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import linear_solver_pb2, pywraplp

from k3opt.coefficients import Coefficients, balance_moved_bytes
from k3opt.search.frames import (
    ActMode,
    Frame,
    _allowed_on,
    _choices,
    act_modes,
    allocated_capacity_bytes,
    frame_shape,
)
from k3opt.search.ranking import work_floor as coefficients  # ranked view's work floor (search/ranking.py)
from k3opt.specs import ClusterSpec, FsdpLifecycle, Job, ModelSpec, Recompute

FEAS_TOL = 1e-6
"""Relative slack on the LP's memory rows: GLOP's primal tolerance must not turn a fitting layout infeasible."""


@dataclass
class _Arrays:
    """Per-layer (length L + 2) relaxed coefficients of one node: least work, least bytes over its modes."""

    time: dict[str, np.ndarray]
    update: dict[str, np.ndarray]
    off_host: np.ndarray
    persistent: np.ndarray
    opt: np.ndarray
    act: np.ndarray
    ws_min: float
    nsws_min: float
    logits: float
    ep_min: float


def _relaxed(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
             cluster: ClusterSpec) -> tuple[_Arrays, Coefficients]:
    allowed = _allowed_on(job)
    modes = [md for md in act_modes(job) if md.recompute == rc]
    # The first mode has only the required activation toggles on (the least work), the last every allowed one
    # (the fewest saved and working-set bytes): the toggles trade work for bytes, except that saving fewer bytes
    # also moves fewer over HBM, so the HBM row is dropped (a dropped row keeps the relaxation valid).
    cfs = [coefficients(frame_shape(job, f, md, lc), model, cluster) for md in (modes[0], modes[-1])]
    c0, lean = cfs

    def tg(**kw: bool) -> Coefficients:
        return coefficients(frame_shape(job, f, modes[0], lc, **kw), model, cluster)

    time = {res: (np.zeros_like(c0.time[res]) if res == "hbm" else c0.time[res]) for res in c0.time}
    if "fused_cross_entropy" in allowed:
        fce = tg(fused_cross_entropy=True)
        for res in time:
            time[res] = np.minimum(time[res], fce.time[res] - c0.time[res] + time[res])
        logits = min(c0.logits, fce.logits)
    else:
        logits = c0.logits
    # Update: base, P2P Muon, and each with ZeRO-2 host gradients' extra (the node model's four cases).
    upd_cases = [c0.update]
    if "p2p_muon" in allowed:
        upd_cases.append(tg(p2p_muon=True).update)
    if "pipeline_zero2_host_grads" in allowed:
        z2 = tg(pipeline_zero2_host_grads=True)
        upd_cases += [{res: u[res] + z2.update[res] - c0.update[res] for res in u} for u in list(upd_cases)]
    update = {res: np.min([u[res] for u in upd_cases], axis=0) for res in c0.update}
    if "activation_offload" in allowed:
        # Offload moves the saved bytes: the leanest mode moves the fewest.
        off_host = coefficients(frame_shape(job, f, modes[-1], lc, activation_offload=True), model,
                                cluster).time["host_link"]
    else:
        off_host = time["host_link"]
    grads = c0.grads
    if "pipeline_zero2_host_grads" in allowed:
        # Two FP32 buffers of the largest chunk's gradient: at least 2 / v of the rank's chunk gradients.
        grads = np.minimum(grads, 2 * c0.chunk_grad_buffer / f.vp)
    accum = np.minimum(c0.grad_accum, lean.grad_accum)
    persistent = c0.master + c0.optimizer + c0.bf16_view + accum + grads
    opt = 2 * c0.view_params
    if "p2p_muon" in allowed:
        opt = np.minimum(opt, 2 * c0.resident_params)
    act = np.minimum(c0.act, lean.act)
    ws = np.minimum(c0.working_set, lean.working_set)
    L = c0.n_layers
    ep = c0.ep_buffers
    if "moonep" in allowed:
        ep = min(ep, tg(moonep=True).moonep_buffers)
    arrays = _Arrays(time=time, update=update, off_host=off_host, persistent=persistent, opt=opt, act=act,
                     ws_min=float(ws[:L].min()), nsws_min=float(c0.ns_working_set[:L].min()), logits=float(logits),
                     ep_min=float(ep))
    return arrays, c0


def interleaved_lp_bound(job: Job, f: Frame, rc: Recompute, lc: FsdpLifecycle, model: ModelSpec,
                         cluster: ClusterSpec) -> float:
    """Lower bound (s) on the step time of every layout of node (f, rc, lc) with f.vp > 1; inf when no
    relaxed layout fits the memory. See the module docstring for what is relaxed."""
    a, c0 = _relaxed(job, f, rc, lc, model, cluster)
    allowed = _allowed_on(job)
    cap = float(allocated_capacity_bytes(job, f, model, cluster))
    offs = [False, True] if "activation_offload" in allowed else [False]
    if "activation_offload" in job.search.require_toggles:
        offs = [True]
    # Balancing's in-flight average, moved bytes' network and rate (the balanced shape's; no other array changes).
    bc = coefficients(frame_shape(job, f, ActMode(rc, False, False, False, False), lc, balance_activations=True),
                      model, cluster)
    bals = [False]
    if bc.balanced_inflight is not None and True in _choices(job, "balance_activations"):
        bals = [True] if False not in _choices(job, "balance_activations") else [False, True]
    best = math.inf
    for off in offs:
        for bal in bals:
            best = min(best, _solve(f, a, c0, bc, cap, cluster.host_memory_bytes, off, bal))
    return best


def _solve(f: Frame, a: _Arrays, c0: Coefficients, bc: Coefficients, cap: float, host_cap: float, off: bool,
           bal: bool) -> float:
    L, p, v = c0.n_layers, f.pp, f.vp
    res_names = list(a.time)
    time = {res: (a.off_host if (off and res == "host_link") else a.time[res]) for res in res_names}
    # Per-layer columns used by the LP; layers with equal columns form one kind.
    cols = [time[r][:L] for r in res_names] + [a.update[r][:L] for r in a.update]
    cols += [a.persistent[:L], a.opt[:L], a.act[:L]]
    kinds, counts = np.unique(np.stack(cols, axis=1), axis=0, return_counts=True)
    nk, n_res = len(kinds), len(res_names)
    kt, ku = kinds[:, :n_res], kinds[:, n_res:n_res + len(a.update)]
    kp, kopt, kact = kinds[:, -3], kinds[:, -2], kinds[:, -1]
    # Columns: x[r, k, t] (layers of kind t in rank r's k-th chunk) at (r * v + k) * nk + t, then S, U.
    n = p * v * nk
    S_col, U_col = n, n + 1

    def col(r: int, k: int) -> slice:
        return slice((r * v + k) * nk, (r * v + k + 1) * nk)

    def edge(arr: np.ndarray, r: int) -> float:
        return float(arr[L] if r == 0 else 0.0) + float(arr[L + 1] if r == p - 1 else 0.0)

    rows: list[np.ndarray] = []
    rhs: list[float] = []

    def le(coef_by_chunk: list[np.ndarray], r: int, bound: float, extra: dict[int, float] | None = None) -> None:
        row = np.zeros(n + 2)
        for k in range(v):
            row[col(r, k)] = coef_by_chunk[k]
        for c, val in (extra or {}).items():
            row[c] = val
        rows.append(row)
        rhs.append(bound)

    # Every rank with v >= 2 holds a chunk that is neither the first nor the last: a packet in and one out,
    # double-buffered (the node model's 2 (in + out) with R >= 0).
    packets = 4.0 * c0.stream_bytes if p > 1 else 0.0
    moe = c0.moe[:L] > 0
    # Each rank holds at least v layers; more than the non-MoE layers means it holds an MoE layer.
    must_moe = bool(moe.any()) and v > int((~moe).sum())
    ep_fixed = (a.ep_min + c0.routing_map) if must_moe else 0.0
    room = cap * (1 + FEAS_TOL)
    for r in range(p):
        n_peak = max(sum(c) for c in c0.compositions[r])
        moved = 0.0
        if bal and bc.balanced_inflight is not None and n_peak > bc.balanced_inflight:
            moved = balance_moved_bytes(1.0, n_peak, bc.balanced_inflight) * bc.balance_seconds_per_byte
        for ri, res in enumerate(res_names):
            per = kt[:, ri] + (moved * kact if res == bc.balance_resource else 0.0)
            e = edge(time[res], r) + (moved * edge(a.act, r) if res == bc.balance_resource else 0.0)
            if per.any() or e:
                le([per] * v, r, -e, {S_col: -1.0})
        for ui, res in enumerate(a.update):
            e = edge(a.update[res], r)
            if ku[:, ui].any() or e:
                le([ku[:, ui]] * v, r, -e, {U_col: -1.0})
        fixed = edge(a.persistent, r)
        act_fixed = a.ws_min + packets + ep_fixed + (a.logits if r == p - 1 else 0.0)
        scale = min(1.0, bc.balanced_inflight / n_peak) if bal and bc.balanced_inflight else 1.0
        comps = _undominated([tuple(scale * ci for ci in c) for c in c0.compositions[r]])
        if off:
            # Saved bytes on the host; the GPU keeps at least the resident layers' smallest saved sets.
            gpu_act = c0.shape.offload_resident_layers * float(a.act[:L].min())
            le([kp] * v, r, room - fixed - act_fixed - gpu_act)
            for comp in comps:
                le([comp[k] * kact for k in range(v)], r, host_cap * (1 + FEAS_TOL) - _edge_act(a, comp, r, p, L))
        else:
            for comp in comps:
                le([kp + comp[k] * kact for k in range(v)], r, room - fixed - act_fixed - _edge_act(a, comp, r, p, L))
        le([kp + kopt] * v, r, room - fixed - edge(a.opt, r) - a.nsws_min)
    # Granularity: some rank holds at least ceil(L / p) whole layers.
    need = -(-L // p)
    for res in res_names:
        row = np.zeros(n + 2)
        row[S_col] = -1.0
        rows.append(row)
        rhs.append(-float(np.sort(time[res][:L])[:need].sum()) * (1 - FEAS_TOL))
    a_ub = np.array(rows)
    # Equalities: each kind's layers all placed; each chunk holds at least one layer (as -sum <= -1).
    a_eq = np.zeros((nk, n + 2))
    chunk_rows = np.zeros((p * v, n + 2))
    for r in range(p):
        for k in range(v):
            a_eq[:, col(r, k)] = np.eye(nk)
            chunk_rows[r * v + k, col(r, k)] = -1.0
    a_ub = np.vstack([a_ub, chunk_rows])
    b_ub = np.concatenate([rhs, -np.ones(p * v)])
    upper = np.concatenate([np.tile(counts.astype(float), p * v), [np.inf, np.inf]])
    cost = np.zeros(n + 2)
    cost[S_col] = f.microbatches + (p - 1) / v
    cost[U_col] = 1.0
    value = _glop(cost, a_ub, b_ub, a_eq, counts.astype(float), upper)
    # GLOP's optimum is accurate to its tolerances; shave a relative 1e-6 so the bound stays below the exact one.
    return value * (1 - FEAS_TOL) if math.isfinite(value) else value


def _undominated(comps: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """In-flight compositions no other composition covers entry by entry (a covered one gives a weaker row)."""
    return list(_undominated_cached(tuple(comps)))


@functools.lru_cache(maxsize=4096)
def _undominated_cached(comps: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    arr = np.unique(np.array(comps, dtype=float), axis=0)
    covered = np.all(arr[None, :, :] >= arr[:, None, :], axis=2)  # covered[i, j]: j covers i
    np.fill_diagonal(covered, False)
    return tuple(tuple(float(x) for x in c) for c in arr[~covered.any(axis=1)])


def _glop(cost: np.ndarray, a_ub: np.ndarray, b_ub: np.ndarray, a_eq: np.ndarray, b_eq: np.ndarray,
          upper: np.ndarray) -> float:
    """min cost.z, a_ub z <= b_ub, a_eq z = b_eq, 0 <= z <= upper, by GLOP: the optimum, inf if infeasible,
    0 when GLOP ends without a certificate (no bound rather than a wrong one). The model is handed over as one
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
        for i in range(mat.shape[0]):
            row = proto.constraint.add()
            row.lower_bound = float(b_vec[i]) if equal else -math.inf
            row.upper_bound = float(b_vec[i])
            nz = np.flatnonzero(mat[i])
            row.var_index.extend(nz.tolist())
            row.coefficient.extend(mat[i, nz].astype(float).tolist())
    proto.maximize = False
    error = solver.LoadModelFromProto(proto)
    if error:
        raise RuntimeError(f"GLOP rejected the relaxation: {error}")
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return math.inf
    if status != pywraplp.Solver.OPTIMAL:
        return 0.0
    return float(solver.Objective().Value())


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
    mode's coefficients (`frames._memory_view`); its saved and working-set bytes are the least of any mode."""
    allowed = _allowed_on(job)
    L, p, v = lean.n_layers, f.pp, f.vp
    grads = lean.grads
    if "pipeline_zero2_host_grads" in allowed:
        grads = np.minimum(grads, 2 * lean.chunk_grad_buffer / v)
    P = lean.master + lean.optimizer + lean.bf16_view + lean.grad_accum + grads
    A = lean.act
    kinds, counts = np.unique(np.stack([P[:L], A[:L]], axis=1), axis=0, return_counts=True)
    nk = len(counts)
    kp, ka = kinds[:, 0], kinds[:, 1]
    moe = lean.moe[:L] > 0
    must_moe = bool(moe.any()) and v > int((~moe).sum())
    ep = lean.ep_buffers
    if "moonep" in allowed:
        ep = min(ep, lean.moonep_buffers)
    act_fixed = float(lean.working_set[:L].min()) + (4.0 * lean.stream_bytes if p > 1 else 0.0) \
        + ((ep + lean.routing_map) if must_moe else 0.0)
    n = p * v * nk
    rows, rhs = [], []
    for r in range(p):
        n_peak = max(sum(c) for c in lean.compositions[r])
        scale = 1.0
        if "balance_activations" in allowed and lean.balanced_inflight is not None:
            scale = min(1.0, lean.balanced_inflight / n_peak)
        fixed = (P[L] if r == 0 else 0.0) + (P[L + 1] + lean.logits if r == p - 1 else 0.0) + act_fixed
        for comp in _undominated([tuple(scale * c for c in cc) for cc in lean.compositions[r]]):
            row = np.zeros(n)
            for k in range(v):
                row[(r * v + k) * nk:(r * v + k + 1) * nk] = kp + comp[k] * ka
            edge_act = (comp[0] * A[L] if r == 0 else 0.0) + (comp[-1] * A[L + 1] if r == p - 1 else 0.0)
            rows.append(row)
            rhs.append(cap * (1 + FEAS_TOL) - fixed - edge_act)
    chunk_rows = np.zeros((p * v, n))
    a_eq = np.zeros((nk, n))
    for j in range(p * v):
        chunk_rows[j, j * nk:(j + 1) * nk] = -1.0
        a_eq[:, j * nk:(j + 1) * nk] = np.eye(nk)
    a_ub = np.vstack([np.array(rows), chunk_rows])
    b_ub = np.concatenate([rhs, -np.ones(p * v)])
    upper = np.tile(counts.astype(float), p * v)
    return _glop(np.zeros(n), a_ub, b_ub, a_eq, counts.astype(float), upper) == math.inf
