"""The CP-SAT search against exhaustive enumeration through evaluate() on a space small enough to enumerate
(a six-layer model with every K3 layer kind on a slow test cluster), the top-K list, the Pareto front, a
presolve-off cross-check, and the infeasible-job explanation. Tests assert status and objective, never time."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import (
    INTERLEAVED_TOGGLES,
    PP2_VP2_TOGGLES,
    assert_bounds_below,
    contiguous_splits,
    enumerated_front,
    interleaved_small_job,
    pp2_vp2_memory_job,
)

import k3opt
from k3opt.cli import main
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import Frame, enumerate_frames, isolated, solve_frame

DATA = Path(__file__).parents[1] / "data"
GIB, MIB = 2**30, 2**20
ALLOWED = ("fp8_activations", "p2p_muon")
"""Toggles of the main enumerated space (all of them: test_all_toggles_optimum_and_bounds_match_enumeration);
P2P Muon changes the optimizer-step gather, which the sharding policy also decides."""
POLICIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
MAIN_POLICIES = POLICIES[1:]
"""The main space's dense policies (no_shard, dominated by optim, is enumerated in the sharding test only)."""
FORBIDDEN = [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in ALLOWED]
TOL_S = 1e-4  # solver resolution: 100 ns per layer and rank term, times the schedule slots


@pytest.fixture(scope="module")
def job():
    return k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "rows": 1, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [1, 2, 4], "vp": [1, 2], "cp": [1], "ep": [2, 4], "expert_fsdp": [1], "dense_fsdp": [1, 2],
                   "dense_sharding": MAIN_POLICIES, "forbid_toggles": FORBIDDEN},
        "precisions": ["bf16", "fp8"],
    })


def _frame_layout(f, split, rc, lc, toggles):
    """The layout of frame `f` (degrees, sharding, gradient dtype, precision) built field by field."""
    return make_layout(gpus=f.gpus, pp=f.pp, vp=f.vp, cp=f.cp, ep=f.ep, expert_fsdp=f.expert_fsdp,
                       dense_fsdp=f.dense_fsdp, microbatches=f.microbatches, rows=1, context=2048, split=split,
                       recompute=rc, fsdp_lifecycle=lc, toggles=toggles, reserve_gib=1.5,
                       dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding, grad_dtype=f.grad_dtype,
                       precision=f.precision)


@pytest.fixture(scope="module")
def enumerated(job, tiny, slow):
    """Every layout of the space through evaluate(): (frame, step time, peak, layout) of those that fit."""
    out = []
    for f in enumerate_frames(job, tiny, 8):
        for rc, lc in itertools.product(Recompute, FsdpLifecycle):
            for flags in itertools.product([False, True], repeat=len(ALLOWED)):
                toggles = dict(zip(ALLOWED, flags, strict=True))
                for split in contiguous_splits(tiny.num_layers, f.pp * f.vp):
                    lay = _frame_layout(f, split, rc, lc, toggles)
                    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                    if ev.fits:
                        out.append((f, ev.step.rank_time_s, ev.peak_bytes, lay))
    assert out, "the test space must contain layouts that fit"
    return out


def _best_per_frame(enumerated):
    best = {}
    for f, t, m, lay in enumerated:
        if f not in best or (t, m) < best[f][:2]:
            best[f] = (t, m, lay)
    return sorted(best.items(), key=lambda kv: kv[1][:2])


def test_space_is_tight_enough_to_matter(enumerated, job, tiny):
    """Memory must rule out part of the space, or the test would not check the ledger constraints."""
    frames = enumerate_frames(job, tiny, 8)
    total = len(frames) * 6 * 2 ** len(ALLOWED)
    fitting_shapes = {(f, lay.recompute, lay.fsdp_lifecycle, lay.toggles) for f, _, _, lay in enumerated}
    assert 0 < len(fitting_shapes) < total


def test_cpsat_optimum_equals_enumeration(job, tiny, slow, enumerated):
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=0)
    assert plan.status == "OPTIMAL" and plan.gap == 0
    (f_best, (t_best, m_best, _)), *_ = _best_per_frame(enumerated)
    got = plan.layouts[0]
    assert got.rank_time_s == pytest.approx(t_best, abs=TOL_S)
    assert got.peak_bytes <= m_best + 2 * MIB  # tie-break on the peak at MiB resolution
    assert got.evaluation.fits


def test_node_cuts_belong_to_the_specs_they_were_priced_with(job, tiny, slow, enumerated):
    """The bounds the search keeps per node (the DP stage cut, the LP cut, replay paths) belong to the specs they
    were priced with: bounding the same job's node against a cluster with half the compute first must not leave
    its higher stage cut on the slow cluster's solve of that node, whose bound stays below the enumerated best."""
    slower = slow.model_copy(update={"bf16_tflops": slow.bf16_tflops / 2, "fp8_tflops": slow.fp8_tflops / 2,
                                     "hbm_gbps": slow.hbm_gbps / 2})
    (f, (t_best, _, lay)), *_ = _best_per_frame(enumerated)
    rc, lc = lay.recompute, lay.fsdp_lifecycle
    node_best = min(t for g, t, _, other in enumerated
                    if g == f and other.recompute == rc and other.fsdp_lifecycle == lc)
    from k3opt.search import node_lower_bound

    assert node_lower_bound(job, f, rc, lc, tiny, slower)[0] > node_best  # the slower cluster's cut is above
    res, item = solve_frame(job, f, tiny, slow, 60, recompute=rc, lifecycle=lc)
    assert res.status == "OPTIMAL"
    assert res.bound_step_s <= node_best + TOL_S
    assert item is not None and item.rank_time_s == pytest.approx(node_best, abs=TOL_S)


@pytest.mark.skipif(not isolated.isolation_available(), reason="solves run in process here")
def test_a_node_solve_survives_cpsat_aborting_on_its_hint(job, tiny, slow, enumerated, monkeypatch):
    """OR-tools 9.15's presolve can abort the process on a hinted model (google/or-tools#5288). With every hinted
    solve aborting, the enumerated best node still returns its best layout (solved again without the hint, read
    back from the child: split, mode, lifecycle and toggles), and this test's process lives on."""
    import os

    from ortools.sat.python import cp_model

    solve = cp_model.CpSolver.solve

    def aborting(self, model, *a, **k):
        if model.proto.has_solution_hint():
            os.abort()
        return solve(self, model, *a, **k)

    monkeypatch.setattr(cp_model.CpSolver, "solve", aborting)
    # A pipelined frame: its model carries the even split as a hint (a PP1 VP1 model has none).
    f, (t_best, _, lay) = next((g, v) for g, v in _best_per_frame(enumerated) if g.pp * g.vp > 1)
    with pytest.warns(RuntimeWarning, match="without its hint"):
        res, item = solve_frame(job, f, tiny, slow, 60, recompute=lay.recompute, lifecycle=lay.fsdp_lifecycle)
    assert res.status == "OPTIMAL"
    assert item is not None and item.rank_time_s == pytest.approx(t_best, abs=TOL_S) and item.evaluation.fits


def test_top_k_equals_enumerated_top_k(job, tiny, slow, enumerated):
    k = 4
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=k, gap=0)
    want = _best_per_frame(enumerated)[:k]
    assert [it.rank_time_s for it in plan.layouts] == pytest.approx([v[0] for _, v in want], abs=TOL_S)
    best = dict(_best_per_frame(enumerated))
    for it in plan.layouts:
        f = Frame(it.layout.pp, it.layout.vp, it.layout.cp, it.layout.ep, it.layout.expert_fsdp,
                  it.layout.dense_fsdp, it.layout.microbatches, it.layout.gpus, it.layout.dense_sharding,
                  it.layout.expert_sharding, it.layout.grad_dtype, it.layout.precision)
        assert it.rank_time_s == pytest.approx(best[f][0], abs=TOL_S)


def test_a_peak_cap_plans_the_fastest_layout_under_it(job, tiny, slow, enumerated):
    """[search] max_peak_gib caps every rank's ledger peak: the plan is enumeration's fastest layout whose peak is
    under the cap (a cap halfway between the leanest fitting peak and the unconstrained best's, so the best is cut
    off), nothing returned is over it, and a cap under every layout's peak is an infeasible job that names it."""
    (_, (t_free, m_free, _)), *_ = _best_per_frame(enumerated)
    m_lean = min(m for _, _, m, _ in enumerated)
    cap = (m_lean + m_free) // 2 // MIB * MIB
    assert m_lean < cap < m_free  # the cap cuts the unconstrained best off and leaves layouts under it
    capped = job.model_copy(update={"search": job.search.model_copy(update={"max_peak_gib": cap / GIB})})
    t_want = min(t for _, t, m, _ in enumerated if m <= cap)
    assert t_want > t_free + TOL_S  # the cap costs step time, or the test would not see it
    # The best under this cap is interleaved and ranks by its replay, a hair above the step formula the node's solve
    # proves (0.04%): proven to a 0.1% gap, not to 0.
    plan = k3opt.plan(capped, model=tiny, cluster=slow, top=3, gap=1e-3)
    assert plan.status == "OPTIMAL"
    assert plan.layouts[0].rank_time_s == pytest.approx(t_want, abs=TOL_S)
    assert all(it.peak_bytes <= cap and it.evaluation.fits for it in plan.layouts)
    below = job.model_copy(update={"search": job.search.model_copy(update={"max_peak_gib": (m_lean - 64 * MIB) / GIB})})
    with pytest.raises(k3opt.InfeasibleJobError, match="max_peak_gib"):
        k3opt.plan(below, model=tiny, cluster=slow, top=1, time_limit=30)


def _front_bounds_hold(plan, points):
    """Each point's proven bound holds over the peak range it stands for (below the next faster point's peak by the
    step; everything for the fastest)."""
    cap = float("inf")
    for it in plan.pareto:
        assert all(t >= it.front_bound_s - TOL_S for t, m in points if m <= cap - MIB)
        cap = it.peak_bytes // MIB * MIB - MIB


def _reaches_the_front(plan, points, gap):
    """Every enumerated front layout (1 MiB step) has a returned point at most the gap slower and no more than the
    step fatter (plus the MiB rounding of a region's cap)."""
    got = [(it.rank_time_s, it.peak_bytes) for it in plan.pareto]
    for t, m in enumerated_front(points):
        assert any(gt * (1 - gap) <= t + TOL_S and gm <= m + 2 * MIB for gt, gm in got), (t, m / GIB)


def test_pareto_front_equals_enumerated_front(job, tiny, slow, enumerated):
    """On the v = 1 frames (the epsilon solves prove the step formula, which is the ranked time there) the front is
    complete and equals enumeration. With v = 2 frames too, a layout whose replayed schedule is longer than its
    formula ranks by the replay, so the front is not proven complete, but every point's bound still holds."""
    whole = k3opt.pareto(job, model=tiny, cluster=slow, top=1, gap=0, step_gib=1 / 1024)
    _front_bounds_hold(whole, sorted((t, m) for _, t, m, _ in enumerated))
    v1 = job.model_copy(update={"search": job.search.model_copy(update={"vp": [1]})})
    plan = k3opt.pareto(v1, model=tiny, cluster=slow, top=1, gap=0, step_gib=1 / 1024)
    points = sorted((t, m) for f, t, m, _ in enumerated if f.vp == 1)
    _front_bounds_hold(plan, points)
    assert plan.pareto_complete
    frame = plan.to_frame()
    assert len(frame) == len(plan.pareto) and "peak_gib" in frame and "toggle_fp8_activations" in frame
    got = [(it.rank_time_s, it.peak_bytes) for it in plan.pareto]
    for t, m in enumerated_front(points):  # the front is resolved at the 1 MiB epsilon step
        assert any(abs(gt - t) <= TOL_S and gm <= m + MIB for gt, gm in got), (t, m / GIB)
    for gt, gm in got:  # nothing returned is dominated by an enumerated layout
        assert not any(t < gt - TOL_S and m < gm - MIB for t, m in points)
    # The complete front is proven: gap 0 at the solver's resolution.
    for it in plan.pareto:
        assert it.rank_time_s - it.front_bound_s <= TOL_S


def test_cap_descent_reaches_each_frames_fastest_layout_under_a_cap(job, tiny, slow, enumerated):
    """A region's search starts from the next faster point brought under its cap (incumbents.cap_descent). On
    every frame whose fastest layout is over a cap halfway down to the frame's leanest peak, the descent from that
    layout ends under the cap on the frame's enumerated fastest there, or (a greedy: its split climb moves one
    boundary at a time) within 0.5% of it, and on most frames exactly; under the leanest peak it finds nothing; a
    layout already under the cap is returned as it is."""
    import time

    from k3opt.search.incumbents import cap_descent
    from k3opt.search.result import PlanItem

    by_frame: dict = {}
    for f, t, m, lay in enumerated:
        by_frame.setdefault(f, []).append((t, m, lay))
    checked = exact = 0
    for f, items in by_frame.items():
        t_fast, m_fast, fast = min(items, key=lambda x: x[:2])
        lean = min(m for _, m, _ in items)
        cap = (lean + m_fast) // 2 // MIB * MIB
        if cap <= lean:
            continue
        capped = job.model_copy(update={"search": job.search.model_copy(update={"max_peak_gib": cap / GIB})})
        start = PlanItem(fast, k3opt.evaluate(fast, model=tiny, cluster=slow))
        got = cap_descent(capped, start, tiny, slow, time.monotonic() + 30)
        assert got is not None and got.peak_bytes <= cap and got.evaluation.fits
        assert (got.layout.pp, got.layout.vp, got.layout.dense_sharding) == (f.pp, f.vp, f.dense_sharding)
        want = min(t for t, m, _ in items if m <= cap)
        assert want - TOL_S <= got.rank_time_s <= want * 1.005 + TOL_S
        exact += got.rank_time_s <= want + TOL_S
        checked += 1
        under = job.model_copy(update={"search": job.search.model_copy(
            update={"max_peak_gib": (lean - MIB) / GIB})})
        assert cap_descent(under, start, tiny, slow, time.monotonic() + 30) is None
    assert checked >= 10  # the space has frames the cap cuts
    assert exact >= 0.8 * checked
    free = job.model_copy(update={"search": job.search.model_copy(update={"max_peak_gib": 1000.0})})
    assert cap_descent(free, start, tiny, slow, time.monotonic() + 30) is start


def test_whole_front_is_proven_region_by_region(job, tiny, slow, enumerated):
    """With the v = 2 frames too, each region of the front (the peaks at or under a point, down to the next faster
    point's less the step) is proven by a ranked search under its cap, so the front is complete at the search's gap:
    every enumerated front layout has a returned point at most the gap slower and no more than the step (plus the
    MiB rounding) fatter, every point's bound holds over its region, and the region under the leanest point is
    empty."""
    gap = 1e-3
    plan = k3opt.pareto(job, model=tiny, cluster=slow, top=1, gap=gap, step_gib=1 / 1024, time_limit=120)
    points = sorted((t, m) for _, t, m, _ in enumerated)
    _front_bounds_hold(plan, points)
    assert plan.pareto_complete
    assert all(it.proven and it.front_gap <= gap + 1e-8 for it in plan.pareto)
    _reaches_the_front(plan, points, gap)
    got = [(it.rank_time_s, it.peak_bytes) for it in plan.pareto]
    leanest = min(gm for _, gm in got)
    assert not any(m <= leanest // MIB * MIB - MIB for _, m in points)  # nothing fits under the last region


def test_regions_alone_build_the_whole_front(job, tiny, slow, enumerated, use_policy):
    """With no seeding (its share 0) the front starts from the ranked search's layout alone: each region's search
    under its cap, the one under the leanest point found so far included, adds the next point, down to a region
    where nothing fits. The front is then enumeration's (as in the test above)."""
    use_policy(front_seed_share=0.0)
    gap = 1e-3
    plan = k3opt.pareto(job, model=tiny, cluster=slow, top=1, gap=gap, step_gib=1 / 1024, time_limit=120)
    points = sorted((t, m) for _, t, m, _ in enumerated)
    _front_bounds_hold(plan, points)
    assert plan.pareto_complete and len(plan.pareto) >= 3
    _reaches_the_front(plan, points, gap)
    got = [(it.rank_time_s, it.peak_bytes) for it in plan.pareto]
    assert min(gm for _, gm in got) <= min(m for _, m in points) + 2 * MIB  # the leanest layout is reached


def test_a_region_its_search_leaves_open_leaves_the_front_incomplete(job, tiny, slow, enumerated):
    """The region loop on its own (search/front.py): with no frame bounded nothing is known of any region (bound 0);
    each region is searched once, the first (no cap) and then the one under the only point; a search that ends
    short of its gap leaves the front incomplete, and the point says what held its region."""
    import time

    from k3opt.search.front import _cap_below, _FrontSearch  # noqa: PLC2701
    from k3opt.search.result import PlanItem

    (_, (_, _, lay)), *_ = _best_per_frame(enumerated)
    item = PlanItem(lay, k3opt.evaluate(lay, model=tiny, cluster=slow))
    fs = _FrontSearch(job, tiny, slow, {}, [item], 1 / 1024, time.monotonic(), 60.0, 1, None, None, None, 0.0)
    assert fs.bound_at(8, math.inf) == 0.0
    calls = []

    def cut_short(g, cap, known, points):  # noqa: ANN001, ANN202
        calls.append(cap)
        return [], 0.0, False, f"a node under {cap}"

    assert fs.prove(cut_short) is False
    assert calls == [math.inf, _cap_below(item, MIB)]
    (point,) = fs.finish()  # the point says where its region's proof stopped
    assert not point.proven and point.front_holding == "a node under inf"


def test_presolve_off_gives_the_same_objective(job, tiny, slow):
    for f in enumerate_frames(job, tiny, 8)[:6]:
        on, _ = solve_frame(job, f, tiny, slow, 30, recompute=Recompute.FULL, lifecycle=FsdpLifecycle.PER_MICROBATCH)
        off, _ = solve_frame(job, f, tiny, slow, 30, presolve=False, recompute=Recompute.FULL,
                             lifecycle=FsdpLifecycle.PER_MICROBATCH)
        assert on.status == off.status
        assert on.objective == off.objective


def test_returned_layouts_are_distinct_ranked_fitting_and_honour_the_job(job, tiny, slow):
    """Replaces a re-run of the evaluate() call the search already makes: what can go wrong in the search's own
    bookkeeping is the order, duplicates, the fit under capacity minus the reserve and the job's batch."""
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=3, gap=0)
    times = [it.rank_time_s for it in plan.layouts]
    assert len(times) == 3 and times == sorted(times)
    assert len({it.layout.model_dump_json() for it in plan.layouts}) == 3
    capacity = slow.hbm_bytes - int(job.reserve_gib * GIB)
    for it in plan.layouts:
        assert it.peak_bytes <= capacity and it.evaluation.fits
        assert it.layout.gpus == 8 and it.evaluation.step.tokens_per_update == 32768
        assert set(it.layout.toggles.model_dump(exclude_defaults=True)) <= set(ALLOWED)


def test_k3_on_64_gb200_is_infeasible_with_the_smallest_peak():
    job = k3opt.Job(gpus=64, tokens_per_update=64 * 4096, reserve_gib=4.0, search={"vp": [1]})
    with pytest.raises(k3opt.InfeasibleJobError, match=r"smallest worst-rank peak .* at least [\d,.]+ GiB"):
        k3opt.plan(job, top=1, time_limit=60)


def test_a_job_whose_state_fits_but_whose_activations_do_not_says_so(tiny, slow):
    """PP2 VP2 on the six-layer model at a 2.85 GiB reserve: the model state takes about half of the 1.15 GiB left,
    and every layout is over the budget once its activations are counted (enumerated: every split, recompute
    mode, lifecycle and toggle setting of the job's one frame). The error names the activations and what to
    change, not a smallest peak under the usable memory (which read as a contradiction)."""
    job = pp2_vp2_memory_job(2.85)
    (f,) = enumerate_frames(job, tiny, 8)
    assert not any(True for rc, lc in itertools.product(Recompute, FsdpLifecycle)
                   for _ in _pp2_vp2_fitting(f, rc, lc, PP2_VP2_TOGGLES, 2.85, tiny, slow))
    with pytest.raises(k3opt.InfeasibleJobError) as err:
        k3opt.plan(job, model=tiny, cluster=slow, top=1, time_limit=30)
    text = str(err.value)
    assert re.search(r"the model state fits \(at least ([\d.]+) of ([\d.]+) GiB usable", text), text
    low, usable = map(float, re.search(r"at least ([\d.]+) of ([\d.]+) GiB", text).groups())
    assert low <= usable
    assert "activations" in text and "rows x context 1 x 2048" in text
    assert "smallest worst-rank peak" not in text


def test_cli_infeasible_job_exits_2(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("gpus = 64\ntokens_per_update = 262144\n[search]\nvp = [1]\n")
    result = CliRunner().invoke(main, ["plan", str(path)])
    assert result.exit_code == 2
    # One error line; the live progress may have printed plain lines before it (stderr is not a terminal here).
    errors = [ln for ln in result.output.splitlines() if ln.startswith("k3opt: error:")]
    assert len(errors) == 1 and errors[0].startswith("k3opt: error: no layout fits on 64 gb200-nvl72 GPUs")
    assert "30.35 TiB" in errors[0]


def test_cli_plan_save_roundtrip(tmp_path, job):
    path = tmp_path / "job.toml"
    path.write_text(
        f'model = "{DATA / "tiny-moe.toml"}"\ncluster = "{DATA / "slow-cluster.toml"}"\ngpus = 8\ncontext = 2048\n'
        'tokens_per_update = 32768\nreserve_gib = 1.5\n[search]\npp = [2]\nep = [2]\ndense_fsdp = [2]\n'
        'expert_fsdp = [1]\nvp = [1]\n')
    saved = tmp_path / "best.toml"
    result = CliRunner().invoke(main, ["plan", str(path), "--top", "1", "--save", "1", str(saved)])
    assert result.exit_code == 0, result.output
    assert "status OPTIMAL" in result.output
    result = CliRunner().invoke(main, ["explain", str(saved)])
    assert result.exit_code == 0, result.output
    csv = tmp_path / "front.csv"
    result = CliRunner().invoke(main, ["pareto", str(path), "--csv", str(csv)])
    assert result.exit_code == 0, result.output
    import pandas as pd

    df = pd.read_csv(csv)
    assert len(df) >= 1 and {"step_time_s", "peak_gib", "split_layers", "master_gib"} <= set(df.columns)


def test_job_without_a_valid_microbatch_count_is_explained():
    job = k3opt.Job(gpus=512, tokens_per_update=12345)
    with pytest.raises(k3opt.InfeasibleJobError, match="tokens_per_update"):
        k3opt.plan(job, top=1)


def test_pareto_spans_gpu_counts(tiny, slow):
    """With several GPU counts the front is over tokens/s per GPU, GPUs and peak."""
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": [4, 8],
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2], "vp": [1], "cp": [1], "ep": [2], "expert_fsdp": [1], "forbid_toggles": FORBIDDEN},
    })
    plan = k3opt.pareto(job, model=tiny, cluster=slow, top=2, gap=0)
    assert {it.layout.gpus for it in plan.pareto} <= {4, 8}
    crit = [(-it.evaluation.step.tokens_per_s_per_gpu, it.layout.gpus, it.peak_bytes) for it in plan.pareto]
    for i, a in enumerate(crit):
        for j, b in enumerate(crit):
            assert i == j or not (all(x <= y for x, y in zip(b, a, strict=True)) and a != b)
    assert "tokens_per_s_per_gpu" in plan.to_frame()


def test_bounds_never_exceed_any_layout(job, tiny, slow, enumerated):
    """Every bound the search prunes with is below every layout it stands for; a bound above a real layout
    would let the search call a suboptimal answer OPTIMAL."""
    from k3opt.search import frame_dp_bound, frame_lower_bound, node_lower_bound, tight_node_bound

    by_frame: dict = {}
    for f, t, m, lay in enumerated:
        by_frame.setdefault(f, []).append((t, m, lay))
    for f, items in by_frame.items():
        t_f, m_f = frame_lower_bound(job, f, tiny, slow)
        t_dp, m_dp = frame_dp_bound(job, f, tiny, slow)
        assert all(t >= t_f - 1e-9 and m >= m_f - 1 for t, m, _ in items)
        assert all(t >= t_dp - 1e-9 and m >= m_dp - 1 for t, m, _ in items)
        for rc, lc in itertools.product(Recompute, FsdpLifecycle):
            node = [(t, m) for t, m, lay in items if lay.recompute == rc and lay.fsdp_lifecycle == lc]
            if not node:
                continue
            t_n, m_n = node_lower_bound(job, f, rc, lc, tiny, slow)
            t_tight = tight_node_bound(job, f, rc, lc, tiny, slow)
            assert min(t for t, _ in node) >= max(t_n, t_tight) - 1e-9
            assert min(m for _, m in node) >= m_n - 1


def test_all_toggles_optimum_and_bounds_match_enumeration(tiny, slow):
    """Every searchable toggle allowed (offload, balancing, host gradients, P2P Muon, chunked cross-entropy, the
    activation toggles) on one frame: the CP-SAT optimum equals enumeration, and no bound exceeds a layout."""
    from k3opt.search import FIXED_TOGGLES, NEVER_CHOSEN, frame_dp_bound, node_lower_bound, tight_node_bound

    toggles = [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in NEVER_CHOSEN + FIXED_TOGGLES]
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2], "vp": [1], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "recompute": ["none", "full"], "fsdp_lifecycle": ["per_microbatch"],
                   "dense_sharding": ["optim"]},
    })
    frames = enumerate_frames(job, tiny, 8)
    # The distributed optimizer's in-place gather against P2P Muon's pulled share (the reference policy's fresh
    # gather is in the main space; the expert group has one rank).
    assert [f.dense_sharding for f in frames] == ["optim"]
    rows = []
    for f in frames:
        for rc in (Recompute.NONE, Recompute.FULL):
            for flags in itertools.product([False, True], repeat=len(toggles)):
                tg = dict(zip(toggles, flags, strict=True))
                for split in contiguous_splits(tiny.num_layers, 2):
                    ev = k3opt.evaluate(_frame_layout(f, split, rc, FsdpLifecycle.PER_MICROBATCH, tg),
                                        model=tiny, cluster=slow)
                    if ev.fits:
                        rows.append((f, rc, ev.step.rank_time_s, ev.peak_bytes))
    assert rows
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=0)
    assert plan.status == "OPTIMAL"
    assert plan.layouts[0].rank_time_s == pytest.approx(min(r[2] for r in rows), abs=TOL_S)
    for f in frames:
        mine = [r[1:] for r in rows if r[0] == f]
        if not mine:
            continue
        t_dp, m_dp = frame_dp_bound(job, f, tiny, slow)
        assert min(t for _, t, _ in mine) >= t_dp - 1e-9 and min(m for *_, m in mine) >= m_dp - 1
        for rc in (Recompute.NONE, Recompute.FULL):
            node = [(t, m) for r, t, m in mine if r == rc]
            if node:
                t_n, m_n = node_lower_bound(job, f, rc, FsdpLifecycle.PER_MICROBATCH, tiny, slow)
                assert min(t for t, _ in node) >= max(
                    t_n, tight_node_bound(job, f, rc, FsdpLifecycle.PER_MICROBATCH, tiny, slow)) - 1e-9
                assert min(m for _, m in node) >= m_n - 1


def test_interleaved_optimum_equals_enumeration(tiny, slow):
    """v = 2 on p = 2 (each rank sums two non-contiguous chunks; PP packets cross the wrap-around hop): against
    enumeration through evaluate(), the plan's bound is valid, its best is at least the formula optimum's layout,
    and OPTIMAL only when it is the enumerated best (ranked by the larger of formula and replayed schedule)."""
    allowed = INTERLEAVED_TOGGLES
    job = interleaved_small_job()
    frames = enumerate_frames(job, tiny, 8)
    assert len(frames) == 2  # the two default dense sharding policies
    best = None
    formula = []
    for f in frames:
        for rc in ("none", "full"):
            for flags in itertools.product([False, True], repeat=len(allowed)):
                for split in contiguous_splits(tiny.num_layers, 4):
                    lay = _frame_layout(f, split, rc, FsdpLifecycle.PER_MICROBATCH,
                                        dict(zip(allowed, flags, strict=True)))
                    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                    if ev.fits and (best is None or ev.step.rank_time_s < best):
                        best = ev.step.rank_time_s
                    if ev.fits:
                        formula.append((ev.step.formula_time_s, ev.step.rank_time_s))
    assert best is not None
    least = min(t for t, _ in formula)
    best_of_formula_optimum = min(r for t, r in formula if t <= least + TOL_S)
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=0)
    top = plan.layouts[0].rank_time_s
    # The search proves the step formula; a layout whose replayed schedule is longer ranks by the replay. Its bound
    # stays below every layout, it finds at least the formula's optimum, and OPTIMAL means the enumerated best.
    assert plan.bound <= best + TOL_S and top >= best - TOL_S
    assert top <= best_of_formula_optimum + TOL_S
    if plan.status == "OPTIMAL":
        assert top == pytest.approx(best, abs=TOL_S)
    else:
        assert plan.gap == pytest.approx((top - plan.bound) / top, abs=1e-9)


def test_minmax_split_equals_enumeration():
    """The heuristics' min-max contiguous split against every split of a small heterogeneous array."""
    from k3opt.search.incumbents import minmax_split

    rng = np.random.default_rng(3)
    for layers, chunks in ((7, 3), (9, 4), (6, 6)):
        cost = rng.uniform(0.1, 5.0, size=(chunks, layers))
        fixed = rng.uniform(0.0, 2.0, size=chunks)
        got = minmax_split(cost, fixed)
        bounds = np.concatenate([[0], np.cumsum(got)])
        worst = max(fixed[j] + cost[j, bounds[j]:bounds[j + 1]].sum() for j in range(chunks))
        best = min(
            max(fixed[j] + cost[j, sum(s[:j]):sum(s[:j + 1])].sum() for j in range(chunks))
            for s in contiguous_splits(layers, chunks))
        assert sum(got) == layers and min(got) >= 1
        assert worst == pytest.approx(best, rel=1e-6)
    # With a memory cap every chunk must hold: the optimum over the splits that fit, None when none does.
    # The caps: (7, 3) and (9, 4) leave 5 of 15 and 15 of 56 splits and raise the optimum; (8, 3) leaves none.
    for layers, chunks, cap in ((7, 3, 4.0), (9, 4, 4.5), (8, 3, 2.0), (6, 2, 9.0)):
        cost = rng.uniform(0.1, 5.0, size=(chunks, layers))
        fixed = rng.uniform(0.0, 2.0, size=chunks)
        mem = rng.uniform(0.2, 2.0, size=(chunks, layers))
        mem_fixed = rng.uniform(0.0, 1.0, size=chunks)
        fitting = [s for s in contiguous_splits(layers, chunks)
                   if all(mem_fixed[j] + mem[j, sum(s[:j]):sum(s[:j + 1])].sum() <= cap for j in range(chunks))]
        got = minmax_split(cost, fixed, mem, mem_fixed, cap)
        if not fitting:
            assert got is None
            continue
        best = min(max(fixed[j] + cost[j, sum(s[:j]):sum(s[:j + 1])].sum() for j in range(chunks)) for s in fitting)
        assert got is not None and sum(got) == layers and min(got) >= 1
        b = np.concatenate([[0], np.cumsum(got)])
        assert all(mem_fixed[j] + mem[j, b[j]:b[j + 1]].sum() <= cap for j in range(chunks))
        worst = max(fixed[j] + cost[j, b[j]:b[j + 1]].sum() for j in range(chunks))
        assert worst == pytest.approx(best, rel=1e-6)


def test_interrupt_returns_the_best_so_far(job, tiny, slow):
    """Ctrl-C (KeyboardInterrupt) once a layout is at hand and the seeding has started: the plan returns the layouts
    found, FEASIBLE, with a bound no higher than the best step time."""
    seen = []

    def interrupt(p):
        seen.append(p.phase)
        if p.incumbent_s is not None and p.phase in ("seeding", "bounding pass", "solving"):
            raise KeyboardInterrupt

    plan = k3opt.plan(job, model=tiny, cluster=slow, top=2, gap=0, progress=interrupt)
    assert seen[-1] == "done" and seen[-2] in ("seeding", "bounding pass", "solving")
    assert plan.status == "FEASIBLE" and plan.layouts
    assert all(it.evaluation.fits for it in plan.layouts)
    assert plan.bound <= plan.layouts[0].rank_time_s and 0 <= plan.gap < 1


def test_context_parallel_optimum_and_bounds_match_enumeration(tiny, slow):
    """CP = 2 frames (PP2 and PP1, 2,048-token sequences split in two): the CP-SAT optimum equals enumeration through
    evaluate(), and no bound the search prunes with exceeds an enumerated layout."""

    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [1, 2], "vp": [1], "cp": [2], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [1],
                   "forbid_toggles": FORBIDDEN},
    })
    frames = enumerate_frames(job, tiny, 8)
    assert frames and all(f.cp == 2 for f in frames)
    rows = []
    for f in frames:
        for rc, lc in itertools.product(Recompute, FsdpLifecycle):
            for flags in itertools.product([False, True], repeat=len(ALLOWED)):
                for split in contiguous_splits(tiny.num_layers, f.pp):
                    lay = _frame_layout(f, split, rc, lc, dict(zip(ALLOWED, flags, strict=True)))
                    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                    if ev.fits:
                        rows.append((f, rc, lc, ev.step.rank_time_s, ev.peak_bytes))
    assert rows
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=0)
    assert plan.status == "OPTIMAL"
    assert plan.layouts[0].rank_time_s == pytest.approx(min(r[3] for r in rows), abs=TOL_S)
    assert plan.layouts[0].layout.cp == 2
    assert_bounds_below(job, frames, rows, tiny, slow, tuple(Recompute))


def test_sharding_dtype_and_precision_optimum_and_bounds_match_enumeration(tiny, slow):
    """Every dense and expert sharding policy, both gradient dtypes and both precisions searched on one shape with
    both shard groups of two ranks: the CP-SAT optimum equals enumeration through evaluate(), and no bound exceeds
    an enumerated layout of its frame."""

    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5, "precisions": ["bf16", "fp8"],
        "search": {"pp": [2], "vp": [1], "cp": [1], "ep": [2], "expert_fsdp": [2], "dense_fsdp": [2],
                   "recompute": ["none", "full"], "dense_sharding": POLICIES, "expert_sharding": POLICIES,
                   "grad_dtype": ["fp32", "bf16"], "forbid_toggles": FORBIDDEN},
    })
    frames = enumerate_frames(job, tiny, 8)
    assert len(frames) == 4 * 4 * 2 * 2
    rows = []
    for f in frames:
        for rc, lc in itertools.product((Recompute.NONE, Recompute.FULL), FsdpLifecycle):
            for flags in itertools.product([False, True], repeat=len(ALLOWED)):
                for split in contiguous_splits(tiny.num_layers, 2):
                    ev = k3opt.evaluate(_frame_layout(f, split, rc, lc, dict(zip(ALLOWED, flags, strict=True))),
                                        model=tiny, cluster=slow)
                    if ev.fits:
                        rows.append((f, rc, lc, ev.step.rank_time_s, ev.peak_bytes))
    assert rows and len({r[0] for r in rows}) > 1
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=3, gap=0)
    assert plan.status == "OPTIMAL"
    best = {}
    for f, _, _, t, m in rows:
        best[f] = min(best.get(f, (t, m)), (t, m))
    want = sorted(v[0] for v in best.values())[:3]
    assert [it.rank_time_s for it in plan.layouts] == pytest.approx(want, abs=TOL_S)
    assert_bounds_below(job, frames, rows, tiny, slow, (Recompute.NONE, Recompute.FULL))


def test_job_search_narrows_sharding_dtype_and_precision(tiny):
    """The [search] lists and the job's precisions are the values searched; a one-rank group is searched once."""
    base = {"model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
            "context": 2048, "tokens_per_update": 32768}
    grid = {"pp": [2], "vp": [1], "cp": [1], "ep": [2], "expert_fsdp": [1, 2], "dense_fsdp": [2]}
    default = enumerate_frames(k3opt.Job.model_validate({**base, "search": grid}), tiny, 8)
    # Neither list given: one strategy for both groups (tied); a one-rank expert group is searched once.
    assert {(f.expert_fsdp, f.dense_sharding, f.expert_sharding) for f in default} == {
        (1, "optim", "optim"), (1, "optim_grads", "optim"), (2, "optim", "optim"), (2, "optim_grads", "optim_grads")}
    assert {(f.grad_dtype, f.precision) for f in default} == {("fp32", "bf16")}
    narrow = enumerate_frames(k3opt.Job.model_validate({
        **base, "precisions": ["fp8"],
        "search": {**grid, "dense_sharding": ["optim_grads_params"], "expert_sharding": ["no_shard", "optim"],
                   "grad_dtype": ["bf16"]}}), tiny, 8)
    assert {(f.expert_fsdp, f.dense_sharding, f.expert_sharding, f.grad_dtype, f.precision) for f in narrow} == {
        (1, "optim_grads_params", "no_shard", "bf16", "fp8"), (2, "optim_grads_params", "no_shard", "bf16", "fp8"),
        (2, "optim_grads_params", "optim", "bf16", "fp8")}
def _pp2_vp2_fitting(f, rc, lc, allowed, reserve, tiny, slow):
    """(toggles, evaluation) of every fitting layout of the PP2 VP2 EP2 dense-FSDP-2 frame `f` on 8 GPUs under
    (rc, lc): every setting of the `allowed` toggles on every split of the layers into 4 chunks."""
    for flags in itertools.product([False, True], repeat=len(allowed)):
        toggles = dict(zip(allowed, flags, strict=True))
        for split in contiguous_splits(tiny.num_layers, 4):
            lay = make_layout(gpus=8, pp=2, vp=2, ep=2, dense_fsdp=2, microbatches=f.microbatches, context=2048,
                              split=split, recompute=rc, fsdp_lifecycle=lc, toggles=toggles, reserve_gib=reserve)
            ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
            if ev.fits:
                yield toggles, ev


@pytest.mark.parametrize("reserve", [2.3, 2.4, 2.5, 2.6])
def test_the_contiguous_fit_says_no_only_where_no_layout_fits(tiny, slow, reserve):
    """`lp_bound.contiguous_fits` (the leanest bytes' memory rows over whole layers in contiguous chunks): per
    (recompute, lifecycle) node of the PP2 VP2 job it never says no where an enumerated layout fits (every split of
    the six layers into 4 chunks under every toggle setting), and it does say no to nodes the fractional test over
    the same bytes (`lean_fits`) lets through (at 2.3 GiB reserved the accumulate lifecycle's no-recompute and
    selective nodes, at 2.5 GiB three nodes; at 2.4 and 2.6 GiB the fractional test, which counts the AttnRes bank
    and the packets' open streams, already settles them). Neither test says no where an enumerated layout fits."""
    from k3opt.search.frames import ACT_TOGGLES, ActMode, allocated_capacity_bytes, choices, memory_view
    from k3opt.search.lp_bound import contiguous_fits, lean_fits

    job = pp2_vp2_memory_job(reserve)
    (f,) = enumerate_frames(job, tiny, 8)
    cap = float(allocated_capacity_bytes(job, f, tiny, slow))
    sharper = 0
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        contiguous = contiguous_fits(job, f, rc, lc, tiny, slow, 30.0)
        assert contiguous is not None, (rc, lc)
        fitting = next(_pp2_vp2_fitting(f, rc, lc, PP2_VP2_TOGGLES, reserve, tiny, slow), None)
        lean = memory_view(job, f, ActMode(rc, *(True in choices(job, t) for t in ACT_TOGGLES)), lc, tiny, slow)
        fractional = lean_fits(job, f, lean, cap, slow.host_memory_bytes)
        if fitting is not None:
            assert contiguous, (rc, lc, fitting[0])
            assert fractional, (rc, lc, fitting[0])
        sharper += fractional and not contiguous
    if reserve in (2.3, 2.5):
        assert sharper >= 2


def _stalled_interleaved_plan(tiny, slow, monkeypatch, contiguous):
    """The small interleaved job planned (gap 0, so that nodes reach CP-SAT) with every interleaved node's CP-SAT
    slice finding nothing and `contiguous` in place of lp_bound.contiguous_fits; returns the plan and the
    interleaved (frame, recompute, lifecycle) solves in order."""
    from k3opt.search import driver
    from k3opt.search.node_model import FrameResult

    solves: list[tuple] = []
    real = driver.solve_frame

    def stalled(job, f, model, cluster, time_limit, *a, **k):
        solves.append((f, k.get("recompute"), k.get("lifecycle")))
        if f.vp > 1:
            return FrameResult(f, "UNKNOWN", bound_step_s=0.0), None
        return real(job, f, model, cluster, time_limit, *a, **k)

    monkeypatch.setattr(driver, "solve_frame", stalled)
    monkeypatch.setattr(driver, "contiguous_fits", contiguous)
    job = interleaved_small_job()
    job = job.model_copy(update={"search": job.search.model_copy(update={"vp": [1, 2]})})
    plan = driver.plan(job, tiny, slow, top=1, time_limit=60, pareto=False, gap=0.0)
    interleaved = [s for s in solves if s[0].vp > 1]
    assert interleaved, "the test needs interleaved nodes to reach CP-SAT"
    return plan, interleaved


def test_an_interleaved_node_with_no_contiguous_fit_is_not_solved_again(tiny, slow, monkeypatch):
    """A node whose CP-SAT slice found no layout (status UNKNOWN) has its contiguous whole-layer fit tested once
    (`lp_bound.contiguous_fits`); proven impossible, the node leaves the queue instead of returning for a doubled
    slice. Faked here: every interleaved node's slice finds nothing, and no contiguous split fits; then no node is
    solved twice, and the plan (gap 0, so that nodes reach CP-SAT) keeps its v = 1 layouts."""
    tested: list[tuple] = []

    def never(job, f, rc, lc, model, cluster, time_limit):
        tested.append((f, rc, lc))
        return False

    plan, interleaved = _stalled_interleaved_plan(tiny, slow, monkeypatch, never)
    assert len(interleaved) == len(set(interleaved))
    assert set(tested) == set(interleaved)
    assert plan.layouts


def test_an_undecided_contiguity_test_is_made_again_with_the_next_slice(tiny, slow, monkeypatch):
    """A contiguous whole-layer test cut by its time (None) is made again after the node's next empty slice, with
    that slice's doubled time; decided (False) the second time, the node leaves the queue. Faked as above: every
    interleaved slice finds nothing, each node's first test is undecided and its second says no split fits; then
    every interleaved node is solved exactly twice and tested twice, the second time with twice the time."""
    tested: dict[tuple, list[float]] = {}

    def undecided_then_no(job, f, rc, lc, model, cluster, time_limit):
        times = tested.setdefault((f, rc, lc), [])
        times.append(time_limit)
        return None if len(times) == 1 else False

    plan, interleaved = _stalled_interleaved_plan(tiny, slow, monkeypatch, undecided_then_no)
    assert all(interleaved.count(s) == 2 for s in interleaved)
    assert set(tested) == set(interleaved)
    assert all(len(t) == 2 and t[1] == pytest.approx(2 * t[0]) for t in tested.values())
    assert plan.layouts


@pytest.mark.parametrize("reserve", [2.2, 2.55])
def test_interleaved_lp_bound_below_every_layout_and_sees_memory(tiny, slow, reserve):
    """v = 2 on p = 2 with offload, balancing, host gradients, P2P Muon and the chunked cross-entropy searchable,
    under budgets tight enough that offload is needed (2.2 GiB reserve) or most nodes have no layout (2.55 GiB: only
    full recompute under the per-microbatch lifecycle fits): per (recompute,
    lifecycle) node, the linear relaxation and the node bound stay below every enumerated layout; the memory
    program says offload is forced only where no layout without offload fits, and it does say so where only
    offload layouts fit; the relaxation is tighter than the mean load where memory binds."""
    from k3opt.search import node_lower_bound, tight_node_bound
    from k3opt.search.frames import ActMode, allocated_capacity_bytes, memory_view
    from k3opt.search.lp_bound import needs_offload

    allowed = PP2_VP2_TOGGLES
    job = pp2_vp2_memory_job(reserve)
    (f,) = enumerate_frames(job, tiny, 8)
    cap = allocated_capacity_bytes(job, f, tiny, slow)
    infinite = above_mean = forced_with_fit = 0
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        best = None
        without_offload = with_offload = False
        for toggles, ev in _pp2_vp2_fitting(f, rc, lc, allowed, reserve, tiny, slow):
            with_offload |= toggles["activation_offload"]
            without_offload |= not toggles["activation_offload"]
            if best is None or ev.step.rank_time_s < best:
                best = ev.step.rank_time_s
        lp = tight_node_bound(job, f, rc, lc, tiny, slow)
        mean = node_lower_bound(job, f, rc, lc, tiny, slow)[0]
        if best is not None:
            assert lp <= best + 1e-9, (rc, lc, lp, best)
            assert mean <= best + 1e-9, (rc, lc, mean, best)
            # Tight to within 6% of the enumerated optimum (4.142 of 4.362 s without full recompute): each
            # variant's own work and bytes, the replay and whole layers. Mixing the least work of one toggle
            # setting with the least bytes of another gave 3.976 s, 8.9% under it.
            assert lp >= 0.94 * best, (rc, lc, lp, best)
        forced = needs_offload(job, f, memory_view(job, f, ActMode(rc, True, False, False, False), lc, tiny, slow),
                               cap)
        assert not (forced and without_offload), (rc, lc)
        forced_with_fit += forced and with_offload
        infinite += lp == float("inf")
        above_mean += mean * 1.01 < lp < float("inf")
    assert above_mean
    assert infinite if reserve == 2.55 else forced_with_fit


@pytest.mark.parametrize("reserve", [1.5, 2.0])
def test_interleaved_shape_bound_prices_the_layouts_without_offload_by_their_memory(tiny, slow, reserve, monkeypatch):
    """PP2 VP2 with offload searchable on a host link of 1 GB/s, where offloading costs more than the mean load:
    the shape bound (`frame_dp_bound`, v > 1) takes the least of the offload's traffic floor and, for the layouts
    without offload, `lp_bound.no_offload_bound` (the memory rows spread the layers over the ranks). Per recompute
    mode the latter stays below every enumerated layout without offload (inf only where none fits), and the shape
    bound below every layout of the frame. At a 2.0 GiB reserve no layout without offload fits but under full
    recompute (5.000 s, the optimum): the bound is 4.48 s. Without the memory rows it was the mean load, 3.78 s."""
    import k3opt.search.bounds as bounds

    allowed = PP2_VP2_TOGGLES
    cluster = slow.model_copy(update={"host_link_gbps": 1.0})
    job = pp2_vp2_memory_job(reserve)
    (f,) = enumerate_frames(job, tiny, 8)
    seen: list[tuple[Recompute, float]] = []
    real = bounds.no_offload_bound

    def spy(job_, f_, floors, views, cap, cluster_):
        value = real(job_, f_, floors, views, cap, cluster_)
        seen.append((floors[0].shape.recompute, value))
        return value

    monkeypatch.setattr(bounds, "no_offload_bound", spy)
    bound = bounds.frame_dp_bound(job, f, tiny, cluster)[0]
    best: dict[tuple[Recompute, bool], float] = {}
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        for toggles, ev in _pp2_vp2_fitting(f, rc, lc, allowed, reserve, tiny, cluster):
            key = (rc, toggles["activation_offload"])
            best[key] = min(best.get(key, math.inf), ev.step.rank_time_s)
    # Selective recompute fits without offload by the leanest bytes (at 2.0 GiB only fractionally): priced.
    assert Recompute.SELECTIVE in {rc for rc, _ in seen}
    for rc, value in seen:
        assert value <= best.get((rc, False), math.inf) + 1e-9, (rc, value, best)
        assert math.isfinite(value) or (rc, False) not in best
    optimum = min(best.values())
    assert bound <= optimum + 1e-9
    if reserve == 2.0:
        assert optimum == pytest.approx(5.000, abs=1e-3) and (Recompute.FULL, False) in best
        assert not any((rc, False) in best for rc in (Recompute.SELECTIVE, Recompute.NONE))
        assert bound >= 0.88 * optimum, bound


@pytest.mark.parametrize("nic_gbps", [0.03, 0.01])
def test_interleaved_bounds_below_every_layout_when_pp_packets_bind(tiny, slow, nic_gbps):
    """PP2 VP2 on a cluster whose NIC makes the pipeline packets the slowest resource of a rank (the PP hop
    crosses the 4-GPU NVLink domains): a rank's stage then exceeds its layers' busiest-resource work, and the
    replay rows of the relaxation must still stay below every enumerated layout (a packet term in the chunk rows'
    T_r once put the bound at 8.74 s over a 7.49 s layout)."""
    from k3opt.search import frame_dp_bound, node_lower_bound, tight_node_bound

    slow_nic = slow.model_copy(update={"nic_gbps": nic_gbps})
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 0.5,
        "search": {"pp": [2], "vp": [2], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "dense_sharding": ["optim_grads_params"], "recompute": ["none"],
                   "fsdp_lifecycle": ["per_microbatch"], "forbid_toggles": list(k3opt.inputs.specs.TOGGLE_NAMES)},
    })
    (f,) = enumerate_frames(job, tiny, 8)
    times = []
    for split in contiguous_splits(tiny.num_layers, 4):
        lay = make_layout(gpus=8, pp=2, vp=2, ep=2, dense_fsdp=2, microbatches=f.microbatches, context=2048,
                          split=split, recompute=Recompute.NONE, fsdp_lifecycle=FsdpLifecycle.PER_MICROBATCH,
                          reserve_gib=0.5)
        ev = k3opt.evaluate(lay, model=tiny, cluster=slow_nic)
        if ev.fits:
            times.append(ev.step.rank_time_s)
    assert times
    rc, lc = Recompute.NONE, FsdpLifecycle.PER_MICROBATCH
    assert tight_node_bound(job, f, rc, lc, tiny, slow_nic) <= min(times) + 1e-9
    assert node_lower_bound(job, f, rc, lc, tiny, slow_nic)[0] <= min(times) + 1e-9
    assert frame_dp_bound(job, f, tiny, slow_nic)[0] <= min(times) + 1e-9


def test_frame_peak_bound_shrinks_with_more_sharding(job, tiny, slow):
    """The driver skips a shape when a shape of its group with a multiple of both FSDP degrees is already over the
    HBM line: that needs the frame peak bound to be non-increasing in the expert and dense FSDP degrees."""
    from k3opt.search import frame_lower_bound

    wide = job.model_validate({**job.model_dump(), "search": {**job.search.model_dump(), "expert_fsdp": None,
                                                              "dense_fsdp": None, "ep": None}})
    frames = enumerate_frames(wide, tiny, 8)
    peak = {f: frame_lower_bound(wide, f, tiny, slow)[1] for f in frames}
    pairs = 0
    for f, g in itertools.product(frames, frames):
        key = (f.pp, f.vp, f.cp, f.ep, f.microbatches, f.dense_sharding, f.expert_sharding, f.grad_dtype,
               f.precision)
        same = key == (g.pp, g.vp, g.cp, g.ep, g.microbatches, g.dense_sharding, g.expert_sharding, g.grad_dtype,
                       g.precision)
        if same and f != g and g.expert_fsdp % f.expert_fsdp == 0 and g.dense_fsdp % f.dense_fsdp == 0:
            pairs += 1
            assert peak[g] <= peak[f] + 1, (f, g)
    assert pairs >= 10


def test_budget_depends_on_the_degrees_only():
    """allocated_capacity_bytes shares one budget among frames that differ only in microbatches, sharding
    policies, gradient dtype and precision: each must equal the budget of its own shape, computed directly."""
    from dataclasses import replace

    from k3opt.cost.memory_outside import allocated_budget_bytes
    from k3opt.inputs.presets import load_cluster, load_model
    from k3opt.inputs.specs import Dtype, Precision, ShardingPolicy
    from k3opt.search.frames import ActMode, _runtime, allocated_capacity_bytes, frame_shape

    job = k3opt.load_job("k3-512-4k")
    assert job.runtime is not None
    model, cluster = load_model(job.model), load_cluster(job.cluster)
    frames = enumerate_frames(job, model, 512, cluster)
    picked = {(f.pp, f.vp, f.cp, f.ep): f for f in frames}  # one frame per (PP, VP, CP, EP)
    checked = 0
    for f in list(picked.values())[:12]:
        for g in (f, replace(f, microbatches=2 * f.microbatches), replace(f, grad_dtype=Dtype.BF16),
                  replace(f, precision=Precision.FP8), replace(f, dense_sharding=ShardingPolicy.NO_SHARD,
                                                               expert_sharding=ShardingPolicy.OPTIM)):
            shape = frame_shape(job, g, ActMode(Recompute.NONE, True, True, True, True), FsdpLifecycle.ACCUMULATE)
            direct = allocated_budget_bytes(shape, model, cluster, job.reserve_gib, _runtime(job.runtime))
            assert allocated_capacity_bytes(job, g, model, cluster) == direct, g
            checked += 1
    assert checked == 60


def test_a_peak_cap_lowers_the_budget_it_is_under():
    """With a runtime (the device line), [search] max_peak_gib caps each frame's allocated budget: a cap under the
    budget is the budget (to the byte: 120 GiB = 128,849,018,880 B), a cap over it leaves the budget alone."""
    from k3opt.cost.memory_outside import allocated_budget_bytes
    from k3opt.inputs.presets import load_cluster, load_model
    from k3opt.search.frames import ActMode, _runtime, allocated_capacity_bytes, frame_shape

    job = k3opt.load_job("k3-512-4k")
    model, cluster = load_model(job.model), load_cluster(job.cluster)
    f = enumerate_frames(job, model, 512, cluster)[0]
    shape = frame_shape(job, f, ActMode(Recompute.NONE, True, True, True, True), FsdpLifecycle.ACCUMULATE)
    direct = allocated_budget_bytes(shape, model, cluster, job.reserve_gib, _runtime(job.runtime))
    assert direct > 120 * GIB  # a GB200's budget at a 4-GiB reserve holds well over 120 GiB of live tensors
    for cap_gib, want in ((120, 128_849_018_880), (direct / GIB + 1, direct)):
        capped = job.model_copy(update={"search": job.search.model_copy(update={"max_peak_gib": cap_gib})})
        assert allocated_capacity_bytes(capped, f, model, cluster) == want


def test_a_node_bound_stopped_at_the_line_closes_it(tiny, slow, monkeypatch):
    """A bound program told to stop at the pruning line returns a hair under it once the line is reached
    (granular_stage: the stop x (1 - 1e-9)). The search must count such a node as at the line: not solve it with
    CP-SAT, and report OPTIMAL with the proven gap within the gap (plus that rounding). Every node's bound is made
    such a stop here, so the search ends on the incumbents without a solve."""
    import k3opt.search.driver as driver

    def at_line(job, f, rc, lc, model, cluster, stop_at=math.inf, deadline=math.inf):  # noqa: ARG001
        return stop_at * (1 - 1e-9) if math.isfinite(stop_at) else 0.0

    monkeypatch.setattr(driver, "tight_node_bound", at_line)
    monkeypatch.setattr(driver, "group_node_bound", lambda job, members, *a, **k: -math.inf)
    plan = k3opt.plan(interleaved_small_job(), model=tiny, cluster=slow, top=1, gap=0.01)
    assert plan.frames_solved == 0
    assert plan.status == "OPTIMAL" and plan.gap <= 0.01 + 1e-8


@pytest.mark.parametrize("reserve", [2.0, 2.2])
def test_offload_bounds_per_dispatch_recompute_setting_stay_below_every_layout(tiny, tmp_path, reserve):
    """PP2 VP2 with the dispatch recompute, FP8 activations and offload searchable, under budgets where offload is
    needed and a host link slow enough that its traffic passes the mean load: the shape and node bounds take whole
    layers with the offload's traffic per setting of the dispatch recompute (it saves less and replays the
    all-to-all, so the least work and the least traffic are two modes); each stays below every enumerated layout
    it stands for (the larger of the two settings' values did not)."""
    from k3opt.search import frame_dp_bound, frame_lower_bound, node_lower_bound

    text = (DATA / "slow-cluster.toml").read_text()
    assert "host_link_gbps = 5\n" in text
    path = tmp_path / "slow-host.toml"
    path.write_text(text.replace("host_link_gbps = 5\n", "host_link_gbps = 0.5\n"))
    slow = k3opt.load_cluster(path)

    allowed = ("fp8_activations", "dispatch_recompute", "activation_offload")
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(path), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": reserve,
        "search": {"pp": [2], "vp": [2], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "dense_sharding": ["optim_grads_params"],
                   "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in allowed]},
    })
    (f,) = enumerate_frames(job, tiny, 8)
    rows = []
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        rows += [(rc, lc, toggles, ev.step.rank_time_s)
                 for toggles, ev in _pp2_vp2_fitting(f, rc, lc, allowed, reserve, tiny, slow)]
    assert rows and all(r[2]["activation_offload"] for r in rows if r[0] == Recompute.NONE)
    assert {r[2]["dispatch_recompute"] for r in rows} == {False, True}
    best = min(r[3] for r in rows)
    assert max(frame_lower_bound(job, f, tiny, slow)[0], frame_dp_bound(job, f, tiny, slow)[0]) <= best + 1e-9
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        node = [r[3] for r in rows if r[0] == rc and r[1] == lc]
        if node:
            assert node_lower_bound(job, f, rc, lc, tiny, slow)[0] <= min(node) + 1e-9, (rc, lc)
