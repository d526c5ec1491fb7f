"""The search chooses Megatron's offload modules (Job [search] offload_modules = [["moe_act"]]), against exhaustive
enumeration through evaluate() on the six-layer test model. On the slow test
cluster with a 1 GB/s host link and a 2-GiB reserve, PP2's layouts need offload to fit: the whole saved set (the
activation_offload toggle) binds the host link, the routed experts' activation input alone (moe_act) does not, so
the optimum offloads by module."""

from __future__ import annotations

import itertools

import pytest
from conftest import assert_bounds_below, contiguous_splits

import k3opt
from k3opt.inputs.errors import SpecError
from k3opt.inputs.labels import toggles_text
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import enumerate_frames

TOL_S = 1e-4
OFFLOADS = ((False, []), (True, []), (False, ["moe_act"]))
"""(activation_offload toggle, offload_modules): none, the whole saved set, the experts' activation input."""


def _job(sets: list[list[str]] | None = (("moe_act",),), reserve: float = 2.0, vp: int = 1) -> k3opt.Job:
    from pathlib import Path

    data = Path(__file__).parents[1] / "data"
    search = {"pp": [2], "vp": [vp], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
              "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t != "activation_offload"]}
    if sets is not None:
        search["offload_modules"] = [list(s) for s in sets]
    return k3opt.Job.model_validate({
        "model": str(data / "tiny-moe.toml"), "cluster": str(data / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": reserve, "search": search})


@pytest.fixture(scope="module")
def narrow_host(slow):
    return slow.model_copy(update={"host_link_gbps": 1.0})


@pytest.fixture(scope="module")
def rows(tiny, narrow_host):
    """Every layout of the space that fits: (frame, recompute, lifecycle, ranked s, peak bytes, layout)."""
    return _enumerate(tiny, narrow_host)


def _enumerate(tiny, cluster, vp: int = 1) -> list[tuple]:  # noqa: ANN001 - the fixtures' specs
    job, out = _job(vp=vp), []
    for f in enumerate_frames(job, tiny, 8):
        for rc, lc, (off, mods) in itertools.product(Recompute, FsdpLifecycle, OFFLOADS):
            if mods and rc == Recompute.FULL:
                continue  # full recompute keeps only the layer inputs (a LayoutError)
            for split in contiguous_splits(tiny.num_layers, f.pp * f.vp):
                lay = make_layout(gpus=8, pp=f.pp, vp=f.vp, ep=f.ep, expert_fsdp=1, dense_fsdp=f.dense_fsdp,
                                  microbatches=f.microbatches, context=2048, split=split, recompute=rc,
                                  fsdp_lifecycle=lc, toggles={"activation_offload": off}, offload_modules=mods,
                                  reserve_gib=2.0, dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding,
                                  grad_dtype=f.grad_dtype)
                ev = k3opt.evaluate(lay, model=tiny, cluster=cluster)
                if ev.fits:
                    out.append((f, rc, lc, ev.step.rank_time_s, ev.peak_bytes, lay))
    return out


def test_the_optimum_offloads_by_module(rows):
    """The space must make the choice matter: the fastest fitting layout offloads moe_act (5.21 s), and it is
    faster than the fastest that offloads the whole saved set or nothing (full recompute, 5.39 s)."""
    best = min(rows, key=lambda r: r[3])
    assert [m.value for m in best[5].offload_modules] == ["moe_act"]
    others = [r[3] for r in rows if not r[5].offload_modules]
    assert others and min(others) > best[3] + 100 * TOL_S


def test_the_search_finds_the_enumerated_optimum(tiny, narrow_host, rows):
    plan = k3opt.plan(_job(), model=tiny, cluster=narrow_host, top=1, gap=0)
    assert plan.status == "OPTIMAL"
    got = plan.layouts[0]
    assert got.rank_time_s == pytest.approx(min(r[3] for r in rows), abs=TOL_S)
    assert [m.value for m in got.layout.offload_modules] == ["moe_act"] and got.evaluation.fits
    assert toggles_text(got.layout).endswith("offload(moe_act)")
    assert plan.to_frame("ranked")["offload_modules"].tolist()[0] == "moe_act"


def test_the_heuristic_walk_reaches_the_module_offload(tiny, narrow_host, rows):
    """The seeding's walk from the leanest configuration (full recompute, the whole set offloaded) reaches the
    optimum's frame's best, selective recompute with moe_act offloaded: the move to the richer recompute mode
    takes an offload set in place of the whole set's."""
    import time

    from k3opt.search.incumbents import frame_walk

    job = k3opt.search.frames.resolve_offload_sets(_job(), tiny)
    f, _, _, t_best, _, _ = min(rows, key=lambda r: r[3])
    walked = frame_walk(job, f, tiny, narrow_host, time.monotonic() + 60)
    fastest = min(walked, key=lambda it: it.rank_time_s)
    assert fastest.rank_time_s == pytest.approx(t_best, abs=TOL_S)
    assert [m.value for m in fastest.layout.offload_modules] == ["moe_act"]


def test_a_walk_from_the_whole_set_moves_to_the_module_set(tiny, narrow_host, rows):
    """From the optimum frame's fitting layout that offloads the whole saved set under selective recompute, the walk
    swaps the toggle for the module set (less traffic, more GPU bytes) and reaches the optimum."""
    import time

    from k3opt.search.incumbents import frame_walk

    job = k3opt.search.frames.resolve_offload_sets(_job(), tiny)
    f, _, _, t_best, _, _ = min(rows, key=lambda r: r[3])
    start = min((r for r in rows if r[0] == f and r[1] == Recompute.SELECTIVE and r[5].toggles.activation_offload),
                key=lambda r: r[3])[5]
    walked = frame_walk(job, f, tiny, narrow_host, time.monotonic() + 60, start=start)
    assert min(it.rank_time_s for it in walked) == pytest.approx(t_best, abs=TOL_S)


def test_every_bound_is_below_the_layouts_it_stands_for(tiny, narrow_host, rows):
    """Frame and node bounds (time and peak) under the fastest and the leanest enumerated layout of each, with the
    offload variants among them: the memory views take the least of the in-flight bytes and of the backward
    transient over a mode and its offload variants."""
    job = k3opt.search.frames.resolve_offload_sets(_job(), tiny)
    frames = enumerate_frames(job, tiny, 8)
    assert_bounds_below(job, frames, [r[:5] for r in rows], tiny, narrow_host, list(Recompute))


def test_every_interleaved_bound_is_below_the_layouts_it_stands_for(tiny, narrow_host):
    """The same on PP2 VP2, whose frame bound tests which offload its nodes need (`bounds._offload_node_bound`:
    the layouts without any offload on their own bytes, those with the toggle or by module on their traffic)."""
    job = k3opt.search.frames.resolve_offload_sets(_job(vp=2), tiny)
    rows = _enumerate(tiny, narrow_host, vp=2)
    assert any(r[5].offload_modules for r in rows)
    frames = enumerate_frames(job, tiny, 8)
    assert_bounds_below(job, frames, [r[:5] for r in rows], tiny, narrow_host, list(Recompute))
    # Node by node, as the frame bound prices each (recompute, lifecycle) node.
    from k3opt.search.bounds import _frame_interleaved_bound  # noqa: PLC2701 - the per-node bounds under test

    checked = 0
    for f in frames:
        per_node: dict = {}
        _frame_interleaved_bound(job, f, tiny, narrow_host, per_node=per_node)
        for (rc, lc), bound in per_node.items():
            node = [r[3] for r in rows if r[0] == f and r[1] == rc and r[2] == lc]
            if node:
                assert bound <= min(node) + 1e-9, (f, rc, lc, bound, min(node))
                checked += 1
    assert checked


def test_host_memory_rules_out_what_it_cannot_hold(tiny, narrow_host):
    """With 0.5 GB of host memory per GPU the fastest moe_act layout (PP2 [3, 3], 0.56 GiB on the first rank's host)
    no longer fits: the search's optimum is the enumerated one under that host, which the node model's host-memory
    rows keep it to."""
    small = narrow_host.model_copy(update={"host_memory_gb": 0.5})
    rows = _enumerate(tiny, small)
    plan = k3opt.plan(_job(), model=tiny, cluster=small, top=1, gap=0)
    got = plan.layouts[0]
    assert got.evaluation.fits and all(r.host_fits for r in got.evaluation.ranks)
    assert got.rank_time_s == pytest.approx(min(r[3] for r in rows), abs=TOL_S)


@pytest.mark.parametrize("sets", [[], None])
def test_without_offload_sets_the_search_keeps_to_the_toggle(tiny, narrow_host, rows, sets):
    """offload_modules = [] or absent searches no module: the optimum is then the enumerated best without them."""
    plan = k3opt.plan(_job(sets=sets), model=tiny, cluster=narrow_host, top=1, gap=0)
    got = plan.layouts[0]
    assert not got.layout.offload_modules
    assert got.rank_time_s == pytest.approx(min(r[3] for r in rows if not r[5].offload_modules), abs=TOL_S)


def test_a_named_set_that_offloads_nothing_is_refused(tiny, narrow_host):
    """The tiny model's attention norm is fused into its QKV projection (Megatron's TE specs): nothing to offload."""
    with pytest.raises(SpecError, match=r"\[search\] offload_modules \['attn_norm'\]: offload_modules 'attn_norm' "
                                        "offloads nothing in tiny-moe"):
        k3opt.plan(_job(sets=[["attn_norm"]]), model=tiny, cluster=narrow_host, top=1, time_limit=5)


def test_a_named_set_the_dense_model_lacks_is_refused():
    """Llama has no routed experts: moe_act offloads nothing there, and a job that names it is told so."""
    job = k3opt.Job.model_validate({"model": "llama3-70b", "cluster": "gb200-nvl72", "gpus": 64,
                                    "tokens_per_update": 1048576, "search": {"offload_modules": [["moe_act"]]}})
    with pytest.raises(SpecError, match="offloads nothing in llama3-70b: it has no routed experts"):
        k3opt.search.frames.resolve_offload_sets(job, k3opt.load_model("llama3-70b"))
