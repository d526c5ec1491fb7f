"""The stage dynamic program of the v = 1 bounds (search/bounds.py) against brute force: on a six-layer model with
every searchable toggle allowed, its (work, memory) min-max over contiguous splits, computed rank by rank on the
boundaries each rank can hold, equals the min over every split of the max of the per-rank cost tables evaluated
over every range. (The min-max split heuristic is checked against every split in test_search.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import contiguous_splits

import k3opt
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import bounds as B
from k3opt.search import frames as FR

DATA = Path(__file__).parents[1] / "data"



@pytest.fixture(scope="module")
def space():
    tiny, slow = k3opt.load_model(DATA / "tiny-moe.toml"), k3opt.load_cluster(DATA / "slow-cluster.toml")
    toggles = [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in FR.NEVER_CHOSEN + FR.FIXED_TOGGLES]
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"vp": [1], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [1, 2],
                   "dense_sharding": ["optim"], "require_toggles": [], "forbid_toggles": []},
    })
    assert {"activation_offload", "balance_activations"} <= set(toggles)
    frames = FR.enumerate_frames(job, tiny, 8)
    assert {f.pp for f in frames} == {1, 2, 4}
    return job, tiny, slow, frames


@pytest.mark.parametrize("force", [False, True])
def test_stage_program_equals_brute_force_over_splits(space, force):
    job, tiny, slow, frames = space
    allowed = FR.allowed_on(job)
    checked = mixed = 0
    for f in frames:
        for rc in (Recompute.NONE, Recompute.FULL):
            md = FR.ActMode(rc, False, False, False, False)
            lc = FsdpLifecycle.PER_MICROBATCH
            cf = FR.coefficients(FR.frame_shape(job, f, md, lc), tiny, slow)
            lean = FR.memory_view(job, f, md, lc, tiny, slow)
            off = FR.coefficients(FR.frame_shape(job, f, md, lc, activation_offload=True), tiny, slow)
            caps = [2**40]
            for cap in caps:
                stage, peak, split = B._dp_bounds(cf, lean, off, slow, cap, allowed, force=force)
                s = B._ranges(cf, lean, off, slow, cap, allowed, force)
                full = slice(0, cf.n_layers + 1)
                tables = [B._rank_block(r, full, full, s) for r in range(f.pp)]
                best_t = best_m = math.inf
                seen, peaks = set(), []
                for sp in contiguous_splits(cf.n_layers, f.pp):
                    edges = np.concatenate([[0], np.cumsum(sp)])
                    t = max(tables[r][0][edges[r], edges[r + 1]] for r in range(f.pp))
                    m = max(tables[r][1][edges[r], edges[r + 1]] for r in range(f.pp))
                    best_t, best_m = min(best_t, t), min(best_m, m)
                    seen.add(math.isfinite(t))
                    peaks.append(m)
                assert stage == best_t
                assert peak == best_m
                if math.isfinite(stage):
                    edges = np.concatenate([[0], np.cumsum(split)])
                    assert max(tables[r][0][edges[r], edges[r + 1]] for r in range(f.pp)) == stage
                checked += 1
                mixed += seen == {True, False}
                if len(caps) == 1 and f.pp > 1:
                    # Then a cap at the median split's peak, so that memory rules out some splits and not others.
                    caps.append(int(sorted(peaks)[len(peaks) // 2]))
    assert checked >= 12 and mixed >= 2  # memory rules out some splits of a node and not others


def test_the_kept_node_cuts_are_bounded_and_cleared_with_the_caches():
    """DP_HINTS and LP_BOUNDS keep one entry per node bounded: a long-lived process (the lab, a sweep) must not
    grow them without end, and cold-cache runs (memo.clear_all) must empty them like every other cache."""
    from k3opt.inputs import memo
    from k3opt.search import bounds

    store: dict = {}
    for i in range(3):
        bounds._keep(store, (i,), (1.0, None), most=2)
    assert list(store) == [(2,)]  # full at 2 entries: it started over before the third
    bounds._keep(bounds.DP_HINTS, ("probe",), (1.0, None))
    bounds._keep(bounds.LP_BOUNDS, ("probe",), 1.0)
    memo.clear_all()
    assert ("probe",) not in bounds.DP_HINTS and ("probe",) not in bounds.LP_BOUNDS


@pytest.mark.parametrize("offload", [False, True])
def test_a_pinned_configuration_s_tables_are_its_ledger_and_its_rank_times(offload):
    """With every toggle pinned (none, or the activation offload required), the v = 1 program's per-rank tables at
    a split are what evaluate() gives that layout: each rank's peak bytes (the AttnRes bank of each in-flight
    microbatch, 8-40 MiB on the six-layer model, among them) and its busiest resource's seconds per microbatch.
    The brute-force test above compares the program with its own tables; this one checks the tables."""
    tiny, slow = k3opt.load_model(DATA / "tiny-moe.toml"), k3opt.load_cluster(DATA / "slow-cluster.toml")
    names = list(k3opt.inputs.specs.TOGGLE_NAMES)
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2], "vp": [1], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "dense_sharding": ["optim"],
                   "require_toggles": ["activation_offload"] if offload else [],
                   "forbid_toggles": [t for t in names if not (offload and t == "activation_offload")]},
    })
    (f,) = FR.enumerate_frames(job, tiny, 8)
    md, lc = FR.ActMode(Recompute.NONE, False, False, False, False), FsdpLifecycle.PER_MICROBATCH
    shape = FR.frame_shape(job, f, md, lc, activation_offload=offload)
    cf = FR.coefficients(FR.frame_shape(job, f, md, lc), tiny, slow)
    off = FR.coefficients(shape, tiny, slow) if offload else None
    s = B._ranges(cf, FR.memory_view(job, f, md, lc, tiny, slow), off, slow, 2**40, FR.allowed_on(job), offload)
    full = slice(0, cf.n_layers + 1)
    tables = [B._rank_block(r, full, full, s) for r in range(f.pp)]
    banks = set()
    for split in contiguous_splits(cf.n_layers, f.pp):
        edges = np.concatenate([[0], np.cumsum(split)])
        ev = k3opt.evaluate(FR.layout_of(job, f, shape, list(split)), model=tiny, cluster=slow)
        for r, rank in enumerate(ev.ranks):
            a, b = edges[r], edges[r + 1]
            assert tables[r][1][a, b] == pytest.approx(rank.peak_bytes, rel=1e-9)
            assert tables[r][0][a, b] == pytest.approx(max(rank.time_s.values()), rel=1e-9)
            banks.add(rank.ledger["attnres_bank"])
    assert min(banks) > 0 and len(banks) > 1  # the bank is in the tables and varies with the split
