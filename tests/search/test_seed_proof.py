"""The second seeding stops once the bounds close the search (search/driver.plan): it runs first until it stalls
briefly, the bounding pass then bounds the queue (no CP-SAT solve) against the pruning line of the layouts found,
and the rest of the seeding stops as soon as a layout it finds puts that line at or under the queue's least bound.
On the default job the pass's bounds close the search for the layout the seeding's first second finds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import k3opt
import k3opt.report.text
import k3opt.search.driver as driver
import k3opt.search.incumbents as inc
from k3opt.search.bounds import frame_lower_bound
from k3opt.search.frames import enumerate_frames
from k3opt.search.policy import POLICY
from k3opt.search.prefetch import Prefetch


def _k(t: float, peak: int = 100) -> SimpleNamespace:
    return SimpleNamespace(rank_time_s=t, peak_bytes=peak)


def test_closed_at_the_gap_line():
    # k = 10 s, gap 1%: the line is 9.9 s; a bound a hair under it (LINE_ROUNDING) counts as at it.
    assert driver._closed(9.9, 0, _k(10.0), 0.01)
    assert driver._closed(9.9 * (1 - 1e-9), 0, _k(10.0), 0.01)
    assert not driver._closed(9.89, 0, _k(10.0), 0.01)
    assert not driver._closed(9.9, 0, None, 0.01)  # no top-th layout: nothing is closed


def test_closed_with_no_gap_ties_go_to_the_peak():
    assert driver._closed(10.1, 0, _k(10.0), 0.0)
    assert not driver._closed(9.99, 10**9, _k(10.0), 0.0)
    assert driver._closed(10.0, 100, _k(10.0, peak=100), 0.0)   # as fast, no leaner
    assert not driver._closed(10.0, 99, _k(10.0, peak=100), 0.0)  # as fast and leaner: may displace it


def _count_prices(monkeypatch) -> list:
    priced: list = []
    real = inc.price_configs

    def spy(job, f, *a, **k):
        priced.append(f)
        return real(job, f, *a, **k)

    monkeypatch.setattr(inc, "price_configs", spy)
    return priced


def test_seed_stops_when_done(tiny, slow, pp2_job, monkeypatch):
    frames = enumerate_frames(pp2_job, tiny, 8)
    start = inc.incumbents(pp2_job, [((False, 0), f) for f in frames], tiny, slow, 1, 5.0, math.inf)
    assert start
    priced = _count_prices(monkeypatch)
    out = inc.seed(pp2_job, frames, tiny, slow, dict(start), math.inf, walk_first=False, done=lambda fs: True)
    assert out == {} and priced == []
    # The same call without the stop prices the frames under the fastest configuration.
    inc.seed(pp2_job, frames, tiny, slow, dict(start), math.inf, walk_first=False, done=lambda fs: False)
    assert priced


def test_seed_goes_on_where_the_last_call_stopped(tiny, slow, pp2_job, monkeypatch):
    frames = enumerate_frames(pp2_job, tiny, 8)
    start = inc.incumbents(pp2_job, [((False, 0), f) for f in frames], tiny, slow, 1, 5.0, math.inf)
    priced = _count_prices(monkeypatch)
    inc.seed(pp2_job, frames, tiny, slow, dict(start), math.inf, walk_first=False)
    whole = list(priced)
    assert len(whole) >= 2
    # Stopped once it has priced one frame, then resumed from its state: together the two calls price what one
    # call does, in the same order, none twice.
    priced.clear()
    state = inc.SeedState()
    inc.seed(pp2_job, frames, tiny, slow, dict(start), math.inf, walk_first=False, state=state,
             done=lambda fs: len(priced) >= 1)
    assert priced == whole[:1]
    assert state.queue is not None and whole[0] in state.visited
    inc.seed(pp2_job, frames, tiny, slow, dict(start), math.inf, walk_first=False, state=state)
    assert priced == whole


def test_the_driver_bounds_before_the_rest_of_the_seeding(tiny, slow, pp2_job, monkeypatch):
    """On the PP2 job the pass leaves nodes for CP-SAT: the third seeding call gets the driver's proof as its stop,
    which holds for a layout under the queue's least bound and not for one far above it, and every CP-SAT solve
    comes after it (the pass solves nothing)."""
    events: list[tuple] = []
    real_seed, real_solve = driver.seed, driver.solve_frame

    lowers: list[tuple[float, float]] = []

    def seed_spy(*a, **k):
        done = k.get("done")
        # The call after the pass is the one with the driver's proof as its stop (the seeding's `done` wraps it).
        if done is not None and done.args[0] is not None:
            events.append(("done", done([_k(1e-9)]), done([]), done([_k(1e9)])))
            # The seeding's lower bound of a frame: after the pass, its least bound in the queue (tightened).
            lowers.extend((k["lower"](f), frame_lower_bound(pp2_job, f, tiny, slow)[0]) for f in a[1])
        events.append(("seed", k.get("patience_min")))
        return real_seed(*a, **k)

    def solve_spy(*a, **k):
        events.append(("solve",))
        return real_solve(*a, **k)

    monkeypatch.setattr(driver, "seed", seed_spy)
    monkeypatch.setattr(driver, "solve_frame", solve_spy)
    # The spy's layouts of 1e-9 s would lower the line search/prefetch's process stops at: no helper process.
    monkeypatch.setattr(driver, "Prefetch", lambda tasks, line, **k: Prefetch([], line))
    plan = k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, time_limit=20)
    assert plan.status == "OPTIMAL"
    names = [e[0] for e in events]
    assert names[:2] == ["seed", "seed"]
    assert events[1] in (("seed", POLICY.first_patience_s), ("seed", POLICY.first_patience_near_s))
    assert "done" in names and "solve" in names
    third = names.index("done")
    # A layout of 1e-9 s is under every bound (closed); no layout: not closed; one of 1e9 s is above the queue's.
    assert events[third] == ("done", True, False, False)
    assert events[third + 1] == ("seed", POLICY.second_patience_s)
    assert "solve" not in names[:third]
    assert lowers and all(lo >= fl for lo, fl in lowers) and any(lo > fl + 1e-6 for lo, fl in lowers)


def test_nodes_left_for_cp_sat_keep_the_bound_under_the_line(tiny, slow, pp2_job, monkeypatch):
    """The nodes the bounding pass sets aside for CP-SAT are open (under the pruning line, best x (1 - gap)) and
    go back to the queue: when the time limit ends the search before any is solved (here the seeding after the
    pass runs past it), the plan's bound is the least over them, under the line, and at most the optimum (the
    exact one, from a gap-0 plan). Lost, they would leave only closed entries: a bound at or over the line."""
    import time

    exact = k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, time_limit=60, gap=0.0)
    assert exact.status == "OPTIMAL"
    limit = 4.0
    real_seed, real_solve = driver.seed, driver.solve_frame
    later: list[int] = []
    solves: list[int] = []

    def seed_past_the_limit(*a, **k):
        out = real_seed(*a, **k)
        if k.get("done") is not None:
            later.append(1)
            time.sleep(max(0.0, before + limit + 0.1 - time.monotonic()))
        return out

    def count(*a, **k):
        solves.append(1)
        return real_solve(*a, **k)

    monkeypatch.setattr(driver, "seed", seed_past_the_limit)
    monkeypatch.setattr(driver, "solve_frame", count)
    before = time.monotonic()
    cut = k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, time_limit=limit)
    assert later and not solves and cut.status == "FEASIBLE"
    assert cut.bound < cut.layouts[0].rank_time_s * (1 - driver.DEFAULT_GAP)
    assert cut.bound <= exact.layouts[0].rank_time_s * (1 + 1e-12)
    # What the cut plan leaves open: the entry holding its bound (no node was cut mid-solve, so it is the bound), under
    # the line of its best layout less the default gap; the gap-0 plan that ran to its end leaves nothing open.
    line = cut.layouts[0].rank_time_s * (1 - driver.DEFAULT_GAP)
    assert cut.holding is not None and 1 <= cut.open_shapes <= cut.frames_total
    assert cut.holding.bound_s == cut.bound and cut.holding.line_s == pytest.approx(line, rel=1e-12)
    assert cut.holding.shape.startswith("PP") and "bound" in cut.holding.kind
    text = k3opt.report.text.plan_text(cut)
    assert f"the least, {cut.bound:.3f} s, is the {cut.holding.kind} of {cut.holding.shape}" in text
    assert exact.open_shapes == 0 and exact.holding is None and "not proven" not in k3opt.report.text.plan_text(exact)


def test_with_top_above_one_the_first_part_stalls_on_the_fastest(tiny, slow, pp2_job, monkeypatch):
    """With top > 1 the seeding's first part stops on the fastest layout's stall (the top-th keeps falling as
    siblings are priced), and the sibling pricing follows at once, bringing the top-th layout near the fastest
    before the pass (on the default job, top 5: the pass then closes the search in 26 s instead of 34-35 s)."""
    events: list[tuple] = []
    real_seed, real_spread = driver.seed, driver.spread

    def seed_spy(*a, **k):
        events.append(("seed", k.get("top"), k.get("patience_min", "none given")))
        return real_seed(*a, **k)

    def spread_spy(*a, **k):
        events.append(("spread",))
        return real_spread(*a, **k)

    monkeypatch.setattr(driver, "seed", seed_spy)
    monkeypatch.setattr(driver, "spread", spread_spy)
    k3opt.plan(pp2_job, model=tiny, cluster=slow, top=2, time_limit=20)
    assert events[0] == ("seed", None, "none given") and events[2] == ("spread",)
    assert events[1] in (("seed", 1, POLICY.first_patience_s), ("seed", 1, POLICY.first_patience_near_s))
    assert all(e[1] == 2 for e in events[3:] if e[0] == "seed")  # the part after the pass: the top-th


class _Captured(Exception):
    pass


def _first_pass_visits(job, model, cluster, monkeypatch) -> list:
    """The frames the plan hands its first heuristic pass, in its order (the pass itself is not run)."""
    seen: list = []

    def spy(job_, ordered, *a, **k):
        seen.extend(f for _, f in ordered)
        raise _Captured

    monkeypatch.setattr(driver, "incumbents", spy)
    with pytest.raises(_Captured):
        k3opt.plan(job, model=model, cluster=cluster, top=1, time_limit=60)
    return seen


def _most_sharded_heads(frames, key) -> dict:
    """Per key(f), its most sharded frame: most EP and dense FSDP, then least expert FSDP and CP (where the key
    leaves CP open)."""
    heads: dict = {}
    for f in frames:
        mine = heads.get(key(f))
        if mine is None or (-f.ep, -f.dense_fsdp, f.expert_fsdp, f.cp) < (-mine.ep, -mine.dense_fsdp,
                                                                          mine.expert_fsdp, mine.cp):
            heads[key(f)] = f
    return heads


@pytest.mark.parametrize("name", ["k3-512-4k", "k3-512-32k"])
def test_the_first_pass_visits_the_pipeline_shapes_that_can_fit_fastest_bound_first(name, model, cluster,
                                                                                      monkeypatch):
    """K3 on 512 GPUs: each (PP, VP, CP) has a head, its most sharded shape (most EP and dense FSDP, least expert
    FSDP), ranked by its bounds: those whose peak bound is under HBM less the reserve first, then by step-time
    bound. The first heuristic pass's first round takes one shape per (PP, VP), its best-ranked head, the pipeline
    shapes in the order of those heads. At 4K (the default job, CP 1 only) PP8 VP4 leads (it came 13th when the
    order was by sharding alone); at 32K the CP degrees have heads of their own (with one head per (PP, VP), CP 1's,
    the pass fit nothing there)."""
    from k3opt.inputs.specs import GIB

    job = k3opt.load_job(name)
    seen = _first_pass_visits(job, model, cluster, monkeypatch)
    frames = enumerate_frames(job, model, 512, cluster)
    heads = _most_sharded_heads(frames, lambda f: (f.pp, f.vp, f.cp))
    assert any(cp > 1 for _, _, cp in heads) == (name == "k3-512-32k")
    line = cluster.hbm_bytes - job.reserve_gib * GIB
    bounds = {pv: frame_lower_bound(job, f, model, cluster) for pv, f in heads.items()}
    rank = {k: (bounds[k][1] > line, bounds[k][0]) for k in heads}
    best: dict = {}
    for k in heads:
        if k[:2] not in best or rank[k] < rank[best[k[:2]]]:
            best[k[:2]] = k
    expected = sorted(best.values(), key=rank.__getitem__)
    assert [(f.pp, f.vp, f.cp) for f in seen[:len(best)]] == expected
    assert seen[:len(best)] == [heads[k] for k in expected]
    if name == "k3-512-4k":
        assert expected[0] == (8, 4, 1) and len(best) == len(heads)
    else:
        assert any(k[2] > 1 for k in expected)
    assert len(seen) == len(frames)


def test_the_first_pass_leads_with_the_faster_precision(model, cluster, monkeypatch):
    """K3 on 512 GPUs with BF16 and FP8 listed: each (PP, VP, CP) has a head per precision, and the pass's order
    follows those heads' bounds, so its first shape is the FP8 head of the pipeline shape that bounds least (FP8's
    GEMMs run at twice BF16's peak). With one head per (PP, VP), the BF16 shapes came first and K3 on 512 GB300
    with BF16, FP8 and MXFP8 listed spent the whole pass on them."""
    from k3opt.inputs.specs import GIB

    job = k3opt.Job.model_validate({**k3opt.load_job("k3-512-4k").model_dump(), "precisions": ["bf16", "fp8"]})
    seen = _first_pass_visits(job, model, cluster, monkeypatch)
    heads = _most_sharded_heads(enumerate_frames(job, model, 512, cluster),
                                lambda f: (f.pp, f.vp, f.cp, f.precision))
    line = cluster.hbm_bytes - job.reserve_gib * GIB
    bounds = {k: frame_lower_bound(job, f, model, cluster) for k, f in heads.items()}
    first = min(heads, key=lambda k: (bounds[k][1] > line, bounds[k][0]))
    assert str(first[3]) == "fp8"
    assert (seen[0].pp, seen[0].vp, seen[0].cp, seen[0].precision) == first
    # Every pipeline shape's first visit is at its faster-bounding precision.
    firsts = {}
    for f in seen:
        firsts.setdefault((f.pp, f.vp, f.cp), f.precision)
    rank = {k: (b[1] > line, b[0]) for k, b in bounds.items()}
    for (pp, vp, cp), prec in firsts.items():
        assert rank[(pp, vp, cp, prec)] == min(r for k, r in rank.items() if k[:3] == (pp, vp, cp))


def _second_pass_calls(monkeypatch, use_policy, tiny, slow, pp2_job, above: float,
                       first: dict | None = None) -> list[str]:
    """The order of the driver's helper start, walk (first seed call) and heuristic passes on the PP2 job with
    POLICY.round_robin_above set to `above`; `first`: what the first heuristic pass returns instead of its layouts."""
    events: list[str] = []
    real_inc, real_seed, real_prefetch = driver.incumbents, driver.seed, driver.Prefetch

    def inc_spy(*a, **k):
        events.append("pass")
        got = real_inc(*a, **k)
        return first if first is not None and events.count("pass") == 1 else got

    def seed_spy(*a, **k):
        events.append("seed" if "patience_min" not in k else f"seed {k['patience_min']}")
        return real_seed(*a, **k)

    def prefetch_spy(tasks, line, **k):
        # (The driver's placeholder before the fork has no tasks; the helper that shares the shapes' first bounds
        # runs before the first pass ends and is not this one.)
        if tasks and tasks[0][0][0] != "first":
            events.append("helper")
        return real_prefetch([], line)

    use_policy(round_robin_above=above)
    monkeypatch.setattr(driver, "incumbents", inc_spy)
    monkeypatch.setattr(driver, "seed", seed_spy)
    monkeypatch.setattr(driver, "Prefetch", prefetch_spy)
    plan = k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, time_limit=20)
    assert plan.layouts
    return events


def test_the_second_heuristic_pass_runs_only_when_the_walks_end_far_above_the_least_bound(
        tiny, slow, pp2_job, monkeypatch, use_policy):
    """The first pass, then the helper process, then the walks; the second pass (a round-robin over the pipeline
    shapes) only when the fastest layout after the walks is more than POLICY.round_robin_above over the queue's least
    bound, or when there is no layout at all, and the seeding's first part then has the longer minimum
    (POLICY.first_patience_s; POLICY.first_patience_near_s when the walks ended near the bound). Any layout is far
    above a line
    at -100% of the bound, none is above one at 1e9 x it."""
    far_first = f"seed {POLICY.first_patience_s}"
    far = _second_pass_calls(monkeypatch, use_policy, tiny, slow, pp2_job, above=-1.0)
    assert far[:5] == ["pass", "helper", "seed", "pass", far_first]
    monkeypatch.undo()
    near = _second_pass_calls(monkeypatch, use_policy, tiny, slow, pp2_job, above=1e9)
    assert near[:4] == ["pass", "helper", "seed", f"seed {POLICY.first_patience_near_s}"]
    assert near.count("pass") == 1
    assert POLICY.first_patience_near_s < POLICY.first_patience_s
    monkeypatch.undo()
    # No layout from the first pass (nor from the walks, which start from its layouts): the second pass runs.
    none = _second_pass_calls(monkeypatch, use_policy, tiny, slow, pp2_job, above=1e9, first={})
    assert none[:5] == ["pass", "helper", "seed", "pass", far_first]


def test_open_bounds_count_the_shapes_under_the_line_and_name_the_least():
    """`driver._open_bounds`: the shapes (not entries) with an entry under the top-th layout's line, best x (1 - gap),
    and the least entry with the kind of its bound: a shape's before and after its own whole-layer bound, a node's
    first bound, its relaxation (v > 1) or split programs (v = 1), CP-SAT's after its slices. Entries at or over the
    line and taken ones count for nothing."""
    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search.frames import Frame

    a, b, c = (Frame(pp=2, vp=v, cp=1, ep=2, expert_fsdp=1, dense_fsdp=d, microbatches=4, gpus=8)
               for v, d in ((2, 2), (2, 4), (1, 4)))
    k = SimpleNamespace(rank_time_s=10.0, peak_bytes=1)  # line at 1% gap: 9.9 s
    sel, pm = Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH

    def queue(*entries):
        q = driver._Queue()
        for i, (t, f, rc, att) in enumerate(entries):
            q.push(driver._Entry(t, 0.0, i, f, rc, pm if rc is not None else None, att))
        return q

    q = queue((9.0, a, sel, 0), (9.5, a, None, 0), (9.8, b, None, 0), (9.9, c, None, 0), (12.0, c, sel, 0))
    n, h = driver._open_bounds(q, k, 0.01, set(), set())
    # 9.9 is the line itself (closed); a twice and b once are open.
    assert n == 2 and h.bound_s == 9.0 and h.line_s == pytest.approx(9.9)
    assert h.kind == "selective / per_microbatch node: its first bound (not tightened yet)"
    assert h.shape == "PP2 VP2 CP1 EP2 eFSDP1 dFSDP2 M4 optim_grads_params/optim_grads_params grads=fp32 bf16 on 8 GPUs"
    relaxed = driver._open_bounds(q, k, 0.01, set(), {(a, sel, pm)})[1]
    assert relaxed.kind.endswith("its linear relaxation (not solved yet)")
    q.take(q.top())
    n, h = driver._open_bounds(q, k, 0.01, set(), set())
    assert n == 2 and h.bound_s == 9.5 and h.kind == "shape bound (not tightened to the shape's own layers yet)"
    assert driver._open_bounds(q, k, 0.01, {a}, set())[1].kind.startswith("shape bound over whole layers")
    v1 = queue((9.0, c, sel, 0))
    split = driver._open_bounds(v1, k, 0.01, set(), {(c, sel, pm)})[1]
    assert split.kind.endswith("its split programs (not solved yet)")
    cut = queue((9.0, c, sel, 2))
    assert driver._open_bounds(cut, k, 0.01, set(), set())[1].kind == (
        "selective / per_microbatch node: CP-SAT's bound after 2 time slices")
    # Nothing under the line: nothing open; without a top-th layout every entry is open.
    assert driver._open_bounds(queue((9.9, a, None, 0), (11.0, b, sel, 0)), k, 0.01, set(), set()) == (0, None)
    n, h = driver._open_bounds(queue((11.0, b, sel, 0)), None, 0.01, set(), set())
    assert n == 1 and h.line_s == math.inf


@pytest.mark.parametrize("limit, budget_s", [(20.0, 0.5), (60.0, 1.5), (300.0, 1.5)])
def test_the_first_pass_takes_half_the_budget_at_most_first_pass_s(tiny, slow, pp2_job, monkeypatch, limit, budget_s):
    """The first heuristic pass runs half the budget (5% of the time limit, 1 to 5 s) once it has a layout, at most
    POLICY.first_pass_s: at the CLI's 300-s default it used to take 2.5 s (half of 5) and found nothing more than in
    1.5 s."""
    calls: list[float] = []
    real = driver.incumbents

    def spy(*a, **k):
        calls.append(a[5])
        return real(*a, **k)

    monkeypatch.setattr(driver, "incumbents", spy)
    assert k3opt.plan(pp2_job, model=tiny, cluster=slow, top=1, time_limit=limit).layouts
    assert calls[0] == pytest.approx(budget_s) and POLICY.first_pass_s == 1.5
