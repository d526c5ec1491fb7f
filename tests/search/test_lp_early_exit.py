"""The interleaved relaxation's shortcuts (search/lp_bound.py) against its full programs and against layouts: the
memory-only program (`_fits`) settles exactly the variants whose full program is infeasible, and the early exit
at the search's pruning line (`stop_at`) returns at least min(exact, line), the exact bound above the line, inf
only where nothing fits, and never more than a fitting layout's ranked step. PP2 VP2 on the
small model with offload, balancing, ZeRO-2 host gradients, P2P Muon and the chunked cross-entropy free."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from conftest import PP2_VP2_TOGGLES, pp2_vp2_memory_job

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import enumerate_frames
from k3opt.search.frames import (
    ACT_TOGGLES,
    ActMode,
    act_modes,
    allocated_capacity_bytes,
    choices,
    memory_view,
    undominated_modes,
)
from k3opt.search.lp_bound import (
    VARIANT_TOGGLES,
    _fits,
    _paths,
    _relaxed,
    _solve,
    interleaved_lp_bound,
    lean_arrays,
    lean_fits,
)

DATA = Path(__file__).parents[1] / "data"
ALLOWED = PP2_VP2_TOGGLES
_job = pp2_vp2_memory_job


@pytest.mark.parametrize("reserve", [1.5, 2.5, 2.8])
def test_memory_program_settles_exactly_the_infeasible_variants(tiny, slow, reserve):
    """Per variant (activation mode x setting of the rank toggles) of every node: `_fits` is False exactly when the
    full program (time, replay and memory rows) is infeasible; some variants fit and some do not. Per node, the
    program over the leanest bytes (`lean_fits`, which settles a node before its variants are built) says no only
    where no variant fits, and it does say no (2.5 and 2.8 GiB reserved)."""
    job = _job(reserve)
    (f,) = enumerate_frames(job, tiny, 8)
    cap = float(allocated_capacity_bytes(job, f, tiny, slow))
    seen = set()
    lean_no = 0
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        lean = memory_view(job, f, ActMode(rc, *(True in choices(job, t) for t in ACT_TOGGLES)), lc, tiny, slow)
        lean_says_no = not lean_fits(job, f, lean, cap, slow.host_memory_bytes)
        lean_no += lean_says_no
        modes = undominated_modes(job, f, [md for md in act_modes(job) if md.recompute == rc], [lc], tiny, slow)
        names = [t for t in VARIANT_TOGGLES if t in ALLOWED]
        for md in modes:
            for flags in itertools.product(*(choices(job, t) for t in names)):
                tg = dict(zip(names, flags, strict=True))
                off, bal = tg["activation_offload"], tg["balance_activations"]
                a, c0 = _relaxed(job, f, md, lc, tg, tiny, slow)
                if bal and c0.balanced_inflight is None:
                    continue
                full = _solve(f, a, c0, cap, slow.host_memory_bytes, off, bal, _paths(f, c0, rc == Recompute.FULL))
                fits = _fits(f, a, c0, cap, slow.host_memory_bytes, off, bal)
                assert fits == math.isfinite(full), (rc, lc, md, tg, full)
                assert not (fits and lean_says_no), (rc, lc, md, tg)
                seen.add(fits)
    assert seen == {True, False} if reserve < 2.8 else False in seen
    assert lean_no if reserve > 2 else True


@pytest.mark.parametrize("reserve", [2.2, 2.5])
def test_early_exit_at_the_line_stays_below_the_exact_bound_and_every_layout(tiny, slow, reserve):
    """For lines under, at and over each node's exact bound: the bound with the early exit is at most the exact
    one and at least min(exact, line); equal to it when the line is above it; inf only when the exact bound is
    (nothing fits: the 2.5-GiB reserve). Against layouts: every fitting layout of a sample
    (each split of the six layers, offload on or off) ranks at or above the bound at every line, the lines just
    under, at and over the best of them included (an exit that answered the line, or inf, whenever a variant
    reached it would exceed that layout's step)."""
    job = _job(reserve)
    (f,) = enumerate_frames(job, tiny, 8)
    checked = infinite = 0
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        exact = interleaved_lp_bound(job, f, rc, lc, tiny, slow)
        infinite += exact == math.inf
        times = []
        for split in itertools.combinations(range(1, tiny.num_layers), 3):
            sizes = [b - a for a, b in zip((0, *split), (*split, tiny.num_layers), strict=True)]
            for offload in (False, True):
                lay = make_layout(gpus=8, pp=2, vp=2, ep=2, dense_fsdp=2, microbatches=f.microbatches, context=2048,
                                  split=sizes, recompute=rc, fsdp_lifecycle=lc, reserve_gib=reserve,
                                  toggles={"activation_offload": offload, "fp8_activations": True})
                ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                if ev.fits:
                    times.append(ev.step.rank_time_s)
        best = min(times, default=math.inf)
        assert exact <= best + 1e-9
        if math.isfinite(exact):
            lines = [0.5 * exact, 0.999 * exact, exact, 1.001 * exact, 2 * exact]
        else:
            assert not times
            lines = [0.5, 1.0, 10.0, math.inf]  # nothing fits: the line itself, or inf without a line
        if math.isfinite(best):
            lines += [0.999 * best, best, 1.001 * best]
        for line in lines:
            got = interleaved_lp_bound(job, f, rc, lc, tiny, slow, stop_at=line)
            assert got <= exact * (1 + 1e-9) and got <= best + 1e-9, (rc, lc, line, got, exact, best)
            # 1e-8: a variant whose floor came within 1e-8 under the line counts as at it (a floor that reached
            # the line reads a hair under it), and the search's pruning treats 1e-8 under its line as at it too.
            assert got >= min(exact, line) * (1 - 1e-8), (rc, lc, line, got, exact)
            assert math.isfinite(got) or not math.isfinite(exact), (rc, lc, line, got)
            if line > exact * (1 + 1e-6):
                assert got == pytest.approx(exact, rel=1e-9), (rc, lc, line, got, exact)
            checked += math.isfinite(exact)
    assert checked and (infinite if reserve == 2.5 else True)


def _assert_lean_below_every_variant(job, f, model, cluster) -> int:
    """`lean_arrays` at or below every variant's (`_relaxed`) bytes, and the node-level terms `_memory_rows` reads
    from the leanest coefficients (packets, routing map, in-flight compositions) at or below each variant's."""
    names = [t for t in VARIANT_TOGGLES if t in k3opt.search.frames.allowed_on(job)]
    n = 0
    for rc, lc in itertools.product(job.search.recompute or list(Recompute), FsdpLifecycle):
        lean = memory_view(job, f, ActMode(rc, *(True in choices(job, t) for t in ACT_TOGGLES)), lc, model,
                            cluster)
        la = lean_arrays(job, f, lean)
        for md in [md for md in act_modes(job) if md.recompute == rc]:
            for flags in itertools.product(*(choices(job, t) for t in names)):
                a, c0 = _relaxed(job, f, md, lc, dict(zip(names, flags, strict=True)), model, cluster)
                for k in ("persistent", "opt", "act"):
                    assert (getattr(la, k) <= getattr(a, k) * (1 + 1e-12)).all(), (rc, lc, md, flags, k)
                for k in ("ws_min", "nsws_min", "logits", "ep_min"):
                    assert getattr(la, k) <= getattr(a, k) * (1 + 1e-12), (rc, lc, md, flags, k)
                assert lean.stream_bytes <= c0.stream_bytes and lean.routing_map <= c0.routing_map
                assert lean.compositions == c0.compositions
                assert lean.shape.offload_resident_layers == c0.shape.offload_resident_layers
                n += 1
    return n


def test_lean_arrays_are_below_every_variant(tiny, slow):
    """On the small model with every rank toggle and FP8 activations free and moe_act offload searched, every node,
    mode and setting: 2 lifecycles x (2 modes under full recompute, 2 x 2 with and without the
    offload under none and under selective) x 2^5 settings."""
    job = _job(1.5, [["moe_act"]])
    (f,) = enumerate_frames(job, tiny, 8)
    assert _assert_lean_below_every_variant(job, f, tiny, slow) == 2 * (2 + 4 + 4) * 32


def test_lean_arrays_are_below_every_k3_variant_at_32k():
    """K3 at 32K context (the shipped job, where most interleaved nodes do not fit): a PP4 VP4 CP4 frame under
    selective recompute, every activation mode and setting of the rank toggles."""
    job = k3opt.load_job("k3-512-32k")
    job = job.model_copy(update={"search": job.search.model_copy(update={"recompute": [Recompute.SELECTIVE]})})
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    f = next(f for f in enumerate_frames(job, model, 512, cluster) if (f.pp, f.vp, f.cp) == (4, 4, 4))
    assert _assert_lean_below_every_variant(job, f, model, cluster) >= 2 * 32


def _assert_base_below_its_key(job, f, model, cluster) -> int:
    """Every variant's (`_relaxed`) time and update arrays at or above its key's base: the same activation mode,
    offload and balancing, with ZeRO-2 host gradients, P2P Muon and the chunked cross entropy at their least-work
    choice (`interleaved_lp_bound` settles a key on its base's floors before building the rest)."""
    names = [t for t in VARIANT_TOGGLES if t in k3opt.search.frames.allowed_on(job)]
    memory_only = [t for t in names if t not in ("activation_offload", "balance_activations")]
    n = 0
    for rc, lc in itertools.product(job.search.recompute or list(Recompute), FsdpLifecycle):
        for md in [md for md in act_modes(job) if md.recompute == rc]:
            for flags in itertools.product(*(choices(job, t) for t in names)):
                tg = dict(zip(names, flags, strict=True))
                base = {**tg, **{t: min(choices(job, t)) for t in memory_only}}
                a, _ = _relaxed(job, f, md, lc, tg, model, cluster)
                b, _ = _relaxed(job, f, md, lc, base, model, cluster)
                for field in ("time", "update"):
                    for res, arr in getattr(b, field).items():
                        assert (getattr(a, field)[res] >= arr * (1 - 1e-12)).all(), (rc, lc, md, tg, field, res)
                n += tg != base
    return n


def test_the_memory_only_toggles_only_add_work(tiny, slow):
    """On the small model with every rank toggle free (three of them trade work for bytes only), every node and
    mode; and K3 at 4K (the default job's PP8 VP4 shape) and 32K context (PP4 VP4 CP4)."""
    job = _job(1.5, [["moe_act"]])
    (f,) = enumerate_frames(job, tiny, 8)
    # 2 lifecycles x 10 modes (as above) x (2^5 - 2^2) settings
    assert _assert_base_below_its_key(job, f, tiny, slow) == 2 * (2 + 4 + 4) * 28
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    for name, shape in (("k3-512-4k", (8, 4, 1)), ("k3-512-32k", (4, 4, 4))):
        job = k3opt.load_job(name)
        job = job.model_copy(update={"search": job.search.model_copy(update={"recompute": [Recompute.SELECTIVE]})})
        f = next(f for f in enumerate_frames(job, model, 512, cluster) if (f.pp, f.vp, f.cp) == shape)
        assert _assert_base_below_its_key(job, f, model, cluster) >= 2 * 28


def test_a_whole_layer_floor_that_reached_the_line_skips_the_linear_programs(tiny, slow, monkeypatch):
    """`granular_stage` reports a stop it has shown reached as a hair under it (stop x (1 - 1e-9)). A variant whose
    whole-layer floor reads that close under the line is at the line: no linear program is solved for it, and the
    bound is that floor. Here every floor is made to reach the line (line = each node's exact bound, above its
    mean-load floors), so no `_solve` runs at all, where each fitting variant used to be solved."""
    from k3opt.search import lp_bound

    job = _job(2.2)
    (f,) = enumerate_frames(job, tiny, 8)
    solves = reached = 0
    real_solve = lp_bound._solve

    def counting_solve(*args, **kwargs):
        nonlocal solves
        solves += 1
        return real_solve(*args, **kwargs)

    def reaching_stage(time, L, p, v, stop=math.inf, least=(), most=()):
        nonlocal reached
        assert math.isfinite(stop)  # only floors under a line are asked for here
        reached += 1
        return stop * (1 - 1e-9)

    checked = 0
    for rc, lc in itertools.product(Recompute, FsdpLifecycle):
        exact = interleaved_lp_bound(job, f, rc, lc, tiny, slow)
        if not math.isfinite(exact):
            continue
        monkeypatch.setattr(lp_bound, "_solve", counting_solve)
        monkeypatch.setattr(lp_bound, "granular_stage", reaching_stage)
        got = interleaved_lp_bound(job, f, rc, lc, tiny, slow, stop_at=exact)
        monkeypatch.undo()
        assert exact * (1 - 1e-8) <= got <= exact, (rc, lc, got, exact)
        checked += 1
    assert checked and reached >= checked
    assert solves == 0


@pytest.mark.parametrize("reserve", [1.5, 2.2])
def test_the_interleaved_shape_bound_stopped_at_a_line_is_at_least_the_lesser_and_at_most_the_exact(
        tiny, slow, reserve):
    """The shape bound of an interleaved frame (`frame_dp_bound`, v > 1) and of a sharding group
    (`group_frame_bound`) with the search's pruning line: at least min(exact, line) (less the 1e-9 of a program
    stopped at the line) and at most the exact bound, for lines under, at and over it. (A node whose coarse floors
    reach the line is settled by them; a helper's value computed against an older, higher line stays valid.) On
    the PP2 VP2 frames of the six-layer model at FSDP 1, 2 and 4, every lifecycle and recompute mode searched."""
    from k3opt.search.bounds import frame_dp_bound, group_frame_bound
    from k3opt.search.frames import sharding_group

    job = pp2_vp2_memory_job(reserve)
    job = job.model_copy(update={"search": job.search.model_copy(update={"dense_fsdp": [1, 2, 4]})})
    frames = enumerate_frames(job, tiny, 8)
    assert len(frames) > 1 and all(f.vp == 2 for f in frames)
    groups: dict[tuple, list] = {}
    for f in frames:
        groups.setdefault(sharding_group(f), []).append(f)
    cases = [(lambda stop, f=f: frame_dp_bound(job, f, tiny, slow, stop_at=stop)[0]) for f in frames]
    cases += [(lambda stop, mem=tuple(mem): group_frame_bound(job, mem, tiny, slow, stop_at=stop))
              for mem in groups.values() if len(mem) > 1]
    assert len(cases) > len(frames)
    for bound in cases:
        exact = bound(math.inf)
        assert exact > 0 and math.isfinite(exact)
        for scale in (0.5, 0.9, 0.99, 1.0, 1.01, 1.5):
            line = exact * scale
            got = bound(line)
            assert min(exact, line) * (1 - 1e-8) <= got <= exact * (1 + 1e-12), (scale, got, exact)
