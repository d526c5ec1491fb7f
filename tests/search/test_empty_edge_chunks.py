"""The search may leave the first and the last chunk without a decoder layer (`[search] empty_edge_chunks`):
Megatron's embedding-only first stage and a last stage of only the MTP layers and the loss. On the tiny model the
output layer and loss (a 32,768 x 1,024 head) cost more than a decoder layer, so an empty last chunk is often the
fastest split. The optimum equals exhaustive enumeration through evaluate() over every split the option allows,
every bound stays below every such layout, and the heuristic split agrees with enumeration."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_bounds_below, contiguous_splits, plan_refusal

import k3opt
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import TOGGLE_NAMES, FsdpLifecycle, Recompute
from k3opt.search import enumerate_frames

DATA = Path(__file__).parents[1] / "data"
ALLOWED = ("fp8_activations", "activation_offload")
RECS = (Recompute.NONE, Recompute.FULL)


def _job(reserve: float, pp: int, vp: int, empty: bool, fsdp: list[int]) -> k3opt.Job:
    return k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": reserve,
        "search": {"pp": [pp], "vp": [vp], "cp": [1], "ep": [2], "expert_fsdp": [1, 2][: 8 // (2 * pp)],
                   "dense_fsdp": fsdp, "recompute": [rc.value for rc in RECS], "fsdp_lifecycle": ["per_microbatch"],
                   "empty_edge_chunks": empty, "forbid_toggles": [t for t in TOGGLE_NAMES if t not in ALLOWED]}})


def _enumerate(job: k3opt.Job, tiny, slow) -> list[tuple]:  # noqa: ANN001 - fixtures
    """(frame, recompute, lifecycle, ranked s, peak bytes, split) of every fitting layout of the job's space, the
    empty edge chunks included when the job allows them."""
    rows = []
    for f in enumerate_frames(job, tiny, 8):
        for rc, flags in itertools.product(RECS, itertools.product([False, True], repeat=len(ALLOWED))):
            for split in contiguous_splits(tiny.num_layers, f.pp * f.vp, job.search.empty_edge_chunks):
                lay = make_layout(gpus=8, pp=f.pp, vp=f.vp, ep=2, expert_fsdp=f.expert_fsdp,
                                  dense_fsdp=f.dense_fsdp, microbatches=f.microbatches, context=2048, split=split,
                                  recompute=rc.value, fsdp_lifecycle="per_microbatch",
                                  toggles=dict(zip(ALLOWED, flags, strict=True)), reserve_gib=job.reserve_gib,
                                  dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding)
                ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
                if ev.fits:
                    rows.append((f, rc, FsdpLifecycle.PER_MICROBATCH, ev.step.rank_time_s, ev.peak_bytes, split))
    return rows


@pytest.mark.parametrize("reserve", [1.0, 2.5])
def test_an_empty_last_chunk_is_searched_and_its_bounds_hold(tiny, slow, reserve):
    """PP2 VP2: the fastest split leaves the last chunk (the head and loss alone) empty; without the option the
    search's optimum is the best split with a layer in every chunk, which is slower."""
    job = _job(reserve, 2, 2, True, [2, 4])
    rows = _enumerate(job, tiny, slow)
    best = min(rows, key=lambda r: r[3])
    held = min((r for r in rows if min(r[5]) > 0), key=lambda r: r[3])
    assert best[5][-1] == 0 and best[3] < held[3] * 0.97
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=0)
    assert plan.status == "OPTIMAL"
    assert plan.layouts[0].rank_time_s == pytest.approx(best[3], abs=1e-4)
    assert plan.layouts[0].layout.split[-1] == 0
    assert_bounds_below(job, enumerate_frames(job, tiny, 8), [r[:5] for r in rows], tiny, slow, RECS)
    off = k3opt.plan(_job(reserve, 2, 2, False, [2, 4]), model=tiny, cluster=slow, top=1, gap=0)
    assert off.layouts[0].rank_time_s == pytest.approx(held[3], abs=1e-4)


def test_only_an_empty_last_stage_fits(tiny, slow):
    """PP4 VP1 with a 3.08-GiB reserve: no split with a layer on every stage fits (the last stage holds the head's
    FP32 master, optimizer and gradients beside its layers); with the option the search finds the enumeration's
    optimum, whose last stage holds only the head and loss, and every v = 1 bound (the stage program over
    ranges that may be empty on an edge rank) stays below every layout."""
    job = _job(3.08, 4, 1, True, [1, 2])
    rows = _enumerate(job, tiny, slow)
    assert rows and all(r[5][-1] == 0 for r in rows)
    with pytest.raises(k3opt.InfeasibleJobError):
        k3opt.plan(_job(3.08, 4, 1, False, [1, 2]), model=tiny, cluster=slow, top=1, gap=0)
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=1, gap=0)
    assert plan.layouts[0].rank_time_s == pytest.approx(min(r[3] for r in rows), abs=1e-4)
    assert_bounds_below(job, enumerate_frames(job, tiny, 8), [r[:5] for r in rows], tiny, slow, RECS)


def test_the_contiguous_fit_never_refuses_a_node_with_an_empty_edge_layout(tiny, slow):
    """`lp_bound.contiguous_fits` decides that a node has no layout: with empty edge chunks allowed, every node
    with a fitting enumerated layout must not be refused. At a 2.8-GiB reserve one of the two nodes with a
    fitting layout has one only with an edge chunk empty."""
    from k3opt.search.lp_bound import contiguous_fits

    job = _job(2.9, 2, 2, True, [2, 4])
    rows = _enumerate(job, tiny, slow)
    nodes = {(r[0], r[1]) for r in rows}
    assert any(all(0 in (r[5][0], r[5][-1]) for r in rows if (r[0], r[1]) == n) for n in nodes)
    for f, rc in nodes:
        assert contiguous_fits(job, f, rc, FsdpLifecycle.PER_MICROBATCH, tiny, slow, 10.0) is not False


def test_the_heuristic_split_may_leave_the_edges_empty():
    """incumbents.minmax_split with `least` (0 on the edges) against every split of a small array whose edge
    chunks carry a heavy fixed cost: the optimum empties them; with one layer each it cannot."""
    from k3opt.search.incumbents import minmax_split

    rng = np.random.default_rng(5)
    for layers, chunks in ((7, 3), (9, 4), (6, 4)):
        cost = rng.uniform(0.5, 1.5, size=(chunks, layers))
        fixed = np.zeros(chunks)
        fixed[0] = fixed[-1] = float(layers)  # above any layer count of the middle chunks
        least = (0,) + (1,) * (chunks - 2) + (0,)

        def worst(s: list[int], cost: np.ndarray = cost, fixed: np.ndarray = fixed) -> float:
            b = np.concatenate([[0], np.cumsum(s)])
            return max(fixed[j] + cost[j, b[j]:b[j + 1]].sum() for j in range(len(s)))

        got = minmax_split(cost, fixed, least=least)
        assert sum(got) == layers and min(got[1:-1]) >= 1
        assert worst(got) == pytest.approx(min(worst(s) for s in contiguous_splits(layers, chunks, True)), rel=1e-6)
        assert worst(got) < min(worst(s) for s in contiguous_splits(layers, chunks))


@pytest.mark.parametrize("value", ['"yes"', "1.5", "[true]"])
def test_a_bad_empty_edge_chunks_is_one_line(tmp_path: Path, value: str):
    line = plan_refusal(tmp_path, f"gpus = 64\ntokens_per_update = 2097152\n[search]\nempty_edge_chunks = {value}\n")
    assert "empty_edge_chunks" in line


def test_an_empty_edge_chunk_can_leave_a_rank_without_an_moe_layer():
    """The relaxation's MoE buffers on every rank (`lp_bound._must_moe`): the tiny model has one dense layer
    (layer 0) and five MoE layers. With a layer in every chunk, each PP2 VP2 rank holds two layers, so at least
    one MoE layer; with empty edge chunks rank 1 may hold chunk 1 = layer 0 alone (chunk 3 empty), and no rank
    need hold one."""
    from k3opt.search.lp_bound import _must_moe

    moe = np.array([False] + [True] * 5)
    assert _must_moe(moe, (1, 1, 1, 1), 2, 2)
    assert not _must_moe(moe, (0, 1, 1, 0), 2, 2)
    assert _must_moe(moe, (), 2, 2)  # no least given: one layer per chunk
    assert not _must_moe(np.array([False, False] + [True] * 4), (1, 1, 1, 1), 2, 2)


@pytest.mark.parametrize(("split", "flag", "words"), [
    ("[1, 0, 3, 2]", "true", "middle chunk"),
    ("[0, 2, 2, 2]", "false", "empty_edge_chunks = true"),
])
def test_a_fixed_split_with_an_empty_chunk_is_one_line(tmp_path: Path, split: str, flag: str, words: str):
    line = plan_refusal(tmp_path, f"gpus = 64\ntokens_per_update = 2097152\n[search]\nsplit = {split}\n"
                                  f"empty_edge_chunks = {flag}\n")
    assert words in line


def test_a_fixed_split_may_leave_the_last_chunk_empty(tiny, slow):
    """`[search] split` pins the enumeration's optimum of the first test: the plan prices exactly it."""
    job = _job(1.0, 2, 2, True, [2, 4])
    pinned = job.model_copy(update={"search": job.search.model_copy(update={"split": [1, 2, 3, 0]})})
    plan = k3opt.plan(pinned, model=tiny, cluster=slow, top=1, gap=0)
    assert plan.layouts[0].layout.split == [1, 2, 3, 0]
    best = min((r for r in _enumerate(job, tiny, slow) if r[5] == [1, 2, 3, 0]), key=lambda r: r[3])
    assert plan.layouts[0].rank_time_s == pytest.approx(best[3], abs=1e-4)
