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

import math
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from k3opt.coefficients import Coefficients, balance_moved_bytes, coefficients
from k3opt.search.frames import (
    ActMode,
    Frame,
    _allowed_on,
    _choices,
    act_modes,
    allocated_capacity_bytes,
    frame_shape,
)
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
    cfs = [coefficients(frame_shape(job, f, md, lc), model, cluster) for md in modes]
    c0 = cfs[0]

    def tg(**kw: bool) -> Coefficients:
        return coefficients(frame_shape(job, f, modes[0], lc, **kw), model, cluster)

    time = {res: np.min([c.time[res] for c in cfs], axis=0) for res in c0.time}
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
        off_host = np.min([coefficients(frame_shape(job, f, md, lc, activation_offload=True), model,
                                        cluster).time["host_link"] for md in modes], axis=0)
    else:
        off_host = time["host_link"]
    grads = c0.grads
    if "pipeline_zero2_host_grads" in allowed:
        # Two FP32 buffers of the largest chunk's gradient: at least 2 / v of the rank's chunk gradients.
        grads = np.minimum(grads, 2 * c0.chunk_grad_buffer / f.vp)
    accum = np.min([c.grad_accum for c in cfs], axis=0)
    persistent = c0.master + c0.optimizer + c0.bf16_view + accum + grads
    opt = 2 * c0.view_params
    if "p2p_muon" in allowed:
        opt = np.minimum(opt, 2 * c0.resident_params)
    act = np.min([c.act for c in cfs], axis=0)
    ws = np.min([c.working_set for c in cfs], axis=0)
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
    # Per-layer columns used by the LP; layers with equal columns form one kind.
    host_t = a.off_host if off else a.time["host_link"]
    cols = [a.time[r][:L] if r != "host_link" else host_t[:L] for r in res_names]
    cols += [a.update[r][:L] for r in a.update] + [a.persistent[:L], a.opt[:L], a.act[:L]]
    mat = np.stack(cols, axis=1)
    kinds, kind_of, counts = np.unique(mat, axis=0, return_inverse=True, return_counts=True)
    kind_of = np.asarray(kind_of).reshape(-1)
    nk = len(kinds)
    n_res = len(res_names)
    kt = kinds[:, :n_res]
    ku = kinds[:, n_res:n_res + len(a.update)]
    kp, kopt, kact = kinds[:, -3], kinds[:, -2], kinds[:, -1]

    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:
        raise RuntimeError("OR-tools' GLOP linear solver is unavailable")
    x = [[[solver.NumVar(0.0, float(counts[t]), "") for t in range(nk)] for _ in range(v)] for _ in range(p)]
    S = solver.NumVar(0.0, solver.infinity(), "stage")
    U = solver.NumVar(0.0, solver.infinity(), "update")
    for t in range(nk):
        row = solver.Constraint(float(counts[t]), float(counts[t]))
        for r in range(p):
            for k in range(v):
                row.SetCoefficient(x[r][k][t], 1.0)
    for r in range(p):
        for k in range(v):
            row = solver.Constraint(1.0, solver.infinity())
            for t in range(nk):
                row.SetCoefficient(x[r][k][t], 1.0)

    def edge(arr: np.ndarray, r: int) -> float:
        return float(arr[L] if r == 0 else 0.0) + float(arr[L + 1] if r == p - 1 else 0.0)

    comps = []
    for r in range(p):
        n_peak = max(sum(c) for c in c0.compositions[r])
        scale = min(1.0, bc.balanced_inflight / n_peak) if bal and bc.balanced_inflight else 1.0
        comps.append([tuple(scale * ci for ci in c) for c in c0.compositions[r]])
    # Every rank with v >= 2 holds a chunk that is neither the first nor the last: a packet in and one out,
    # double-buffered (the node model's 2 (in + out) with R >= 0).
    packets = 4.0 * c0.stream_bytes if p > 1 else 0.0
    moe = c0.moe[:L] > 0
    # Each rank holds at least v layers; more than the non-MoE layers means it holds an MoE layer.
    must_moe = int(moe.any()) and v > int((~moe).sum())
    ep_fixed = (a.ep_min + c0.routing_map) if must_moe else 0.0
    host_link = res_names.index("host_link") if "host_link" in res_names else -1
    for r in range(p):
        n_peak = max(sum(c) for c in c0.compositions[r])
        moved = 0.0
        if bal and bc.balanced_inflight is not None and n_peak > bc.balanced_inflight:
            moved = balance_moved_bytes(1.0, n_peak, bc.balanced_inflight) * bc.balance_seconds_per_byte
        for ri, res in enumerate(res_names):
            e = edge(a.off_host if (off and ri == host_link) else a.time[res], r)
            per = kt[:, ri] + (moved * kact if res == bc.balance_resource else 0.0)
            if res == bc.balance_resource and moved:
                e += moved * edge(a.act, r)
            row = solver.Constraint(-solver.infinity(), -e)
            row.SetCoefficient(S, -1.0)
            for k in range(v):
                for t in range(nk):
                    row.SetCoefficient(x[r][k][t], float(per[t]))
        for ui, res in enumerate(a.update):
            row = solver.Constraint(-solver.infinity(), -edge(a.update[res], r))
            row.SetCoefficient(U, -1.0)
            for k in range(v):
                for t in range(nk):
                    row.SetCoefficient(x[r][k][t], float(ku[t, ui]))
        fixed = edge(a.persistent, r)
        act_fixed = a.ws_min + packets + ep_fixed + (a.logits if r == p - 1 else 0.0)
        if off:
            # Without saved bytes on the GPU every composition gives the same GPU row.
            gpu_act = c0.shape.offload_resident_layers * float(a.act[:L].min())
            row = solver.Constraint(-solver.infinity(), cap * (1 + FEAS_TOL) - fixed - act_fixed - gpu_act)
            for k in range(v):
                for t in range(nk):
                    row.SetCoefficient(x[r][k][t], float(kp[t]))
        for comp in comps[r]:
            if off:
                # Saved bytes on the host; the GPU keeps at least the resident layers' smallest saved sets.
                row = solver.Constraint(-solver.infinity(), host_cap * (1 + FEAS_TOL) - _edge_act(a, comp, r, p, L))
                for k in range(v):
                    for t in range(nk):
                        row.SetCoefficient(x[r][k][t], float(comp[k] * kact[t]))
                continue
            row = solver.Constraint(-solver.infinity(),
                                    cap * (1 + FEAS_TOL) - fixed - act_fixed - _edge_act(a, comp, r, p, L))
            for k in range(v):
                for t in range(nk):
                    row.SetCoefficient(x[r][k][t], float(kp[t] + comp[k] * kact[t]))
        row = solver.Constraint(-solver.infinity(), cap * (1 + FEAS_TOL) - fixed - edge(a.opt, r) - a.nsws_min)
        for k in range(v):
            for t in range(nk):
                row.SetCoefficient(x[r][k][t], float(kp[t] + kopt[t]))
    # Granularity: some rank holds at least ceil(L / p) whole layers.
    need = -(-L // p)
    for ri, res in enumerate(res_names):
        t_col = (a.off_host if (off and ri == host_link) else a.time[res])[:L]
        row = solver.Constraint(float(np.sort(t_col)[:need].sum()) * (1 - FEAS_TOL), solver.infinity())
        row.SetCoefficient(S, 1.0)
    slots = f.microbatches + (p - 1) / v
    solver.Minimize(slots * S + U)
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return math.inf
    if status != pywraplp.Solver.OPTIMAL:
        return 0.0  # no certificate: fall back to no bound rather than a wrong one
    # GLOP's optimum is accurate to its tolerances; shave a relative 1e-6 so the bound stays below the exact one.
    return float(solver.Objective().Value()) * (1 - FEAS_TOL)


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
