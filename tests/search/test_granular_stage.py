"""`lp_bound.granular_stage`: the least slowest-rank stage when ranks hold whole layers, against enumeration of every
way to deal the layers' counts to the ranks, and the textbook case of equal layers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from k3opt.search.lp_bound import granular_stage


def _compositions(n: int, parts: int):
    """Every way to write n as an ordered sum of `parts` nonnegative integers."""
    for cuts in itertools.combinations(range(n + parts - 1), parts - 1):
        edges = (-1, *cuts, n + parts - 1)
        yield [edges[i + 1] - edges[i] - 1 for i in range(parts)]


def _enumerated(time: dict[str, np.ndarray], L: int, p: int, v: int) -> float:
    """min over integer counts n[r][kind] (each rank >= v layers) of max over ranks and resources of the rank's
    load: the kinds' counts dealt to the ranks in every possible way."""
    arrs = np.stack([time[r] for r in time], axis=1)
    kinds, counts = np.unique(arrs[:L], axis=0, return_counts=True)
    zero = np.zeros(arrs.shape[1])
    edges = [(arrs[L] if r == 0 else zero) + (arrs[L + 1] if r == p - 1 else zero) for r in range(p)]
    best = np.inf
    for deal in itertools.product(*(list(_compositions(int(c), p)) for c in counts)):
        n = np.array(deal).T  # (p, kinds)
        if (n.sum(axis=1) < v).any():
            continue
        loads = n @ kinds + np.array(edges)
        best = min(best, float(loads.max()))
    return best


def test_equal_layers_deal_ceil_layers_to_the_slowest_rank():
    # 93 equal layers of 1 ms over 8 ranks, no edges: some rank holds ceil(93 / 8) = 12 layers, 12 ms (the mean
    # load is 11.625 ms).
    L = 93
    t = {"tensor": np.concatenate([np.full(L, 1e-3), [0.0, 0.0]])}
    assert granular_stage(t, L, 8, 3) == pytest.approx(12e-3, rel=1e-6)
    assert granular_stage(t, L, 8, 3) <= 12e-3


@pytest.mark.parametrize("kinds", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_equals_enumeration_on_small_mixed_stacks(seed: int, kinds: int):
    rng = np.random.default_rng(seed)
    L, p, v = 7, 3, 2
    # Two or three kinds of layer with two resources each (compute-heavy and traffic-heavy ones), heavy edges.
    work = [rng.uniform(1, 3, 2) for _ in range(kinds)]
    pattern = rng.permutation([0] * 3 + [1] * 2 + [kinds - 1] * 2)
    per_layer = np.array([work[k] for k in pattern])
    edges = rng.uniform(0, 4, (2, 2))
    arrs = np.vstack([per_layer, edges])
    time = {"tensor": arrs[:, 0], "nvlink": arrs[:, 1]}
    want = _enumerated(time, L, p, v)
    got = granular_stage(time, L, p, v)
    assert got <= want
    assert got == pytest.approx(want, rel=1e-6)


def test_each_rank_holds_one_layer_per_chunk():
    # 6 equal layers, 3 ranks of v = 2 chunks: every rank holds 2 layers even when the edges of ranks 0 and 2
    # (5 ms each) would rather leave them empty; the slowest rank is an edge rank with its 2 layers, 5 + 2 = 7 ms.
    L = 6
    t = {"tensor": np.array([1.0] * L + [5.0, 5.0]) * 1e-3}
    assert granular_stage(t, L, 3, 2) == pytest.approx(7e-3, rel=1e-6)


def test_an_edge_chunk_that_may_be_empty_lowers_its_rank_s_least():
    # The same 6 layers and edges with the first and last chunk allowed no layer (chunk 0 on rank 0, chunk 5 on
    # rank 2): ranks 0 and 2 need one layer, rank 1 two; dealing 1 + 4 + 1 puts 5 + 1 = 6 ms on each edge rank and
    # 4 ms on rank 1, and no dealing does better (an edge rank holds its 5-ms edge and at least one layer).
    L = 6
    t = {"tensor": np.array([1.0] * L + [5.0, 5.0]) * 1e-3}
    assert granular_stage(t, L, 3, 2, least=(0, 1, 1, 1, 1, 0)) == pytest.approx(6e-3, rel=1e-6)
    # The least layers enter the cache key: the bound with one layer per chunk is still 7 ms after it.
    assert granular_stage(t, L, 3, 2) == pytest.approx(7e-3, rel=1e-6)


def test_interleaved_bound_deals_each_variant_whole_layers():
    """Kimi K3 on the default 512-GPU job, node PP8 VP4 EP64 dense FSDP 64 M64, selective recompute, gradients
    reduced per microbatch. A layout of it (split 3 x 28 + 2 + 3 + 2 x 2: some rank holds 12 of the 93 layers, the
    least the busiest rank can hold) ranks at 18.63 s by evaluate(). The node's bound stays under it and within 1%
    of it. Whole layers dealt at the least work over every variant (the host-link time of the variants without
    offload, which do not fit, beside the tensor time of the variants that recompute the least) gave 18.04 s, 3.1%
    under: each variant is now dealt whole layers at its own work."""
    import k3opt
    from k3opt.inputs.presets import load_cluster, load_model
    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search.frames import enumerate_frames, frame_of
    from k3opt.search.lp_bound import interleaved_lp_bound

    job = k3opt.load_job("k3-512-4k")
    model, cluster = load_model(job.model), load_cluster(job.cluster)
    toggles = dict(fp8_activations=True, activation_offload=True, moe_backward_rewrite=True, dispatch_recompute=True,
                   fused_situ=True, p2p_muon=True, fused_cross_entropy=True)
    lay = k3opt.make_layout(
        gpus=512, pp=8, vp=4, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, rows=1, context=4096,
        split=[3] * 28 + [2, 3, 2, 2], recompute="selective", fsdp_lifecycle="per_microbatch",
        reserve_gib=job.reserve_gib, domain_gpus_used=64, dense_sharding="optim", expert_sharding="optim",
        runtime=job.runtime, toggles=toggles)
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    assert ev.fits
    f = frame_of(lay)
    assert f in enumerate_frames(job, model, 512, cluster)
    bound = interleaved_lp_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model, cluster)
    assert 0.99 * ev.step.rank_time_s <= bound <= ev.step.rank_time_s


@pytest.mark.parametrize("seed", range(4))
def test_stop_gives_at_least_the_lesser_of_the_stage_and_the_stop(seed: int):
    """With `stop` (the stage the search only needs to know is reached): never above the enumerated least stage,
    at least min(stage, stop), the stage itself when the stop is above it. The stops come low, high, lower, just
    above: a kept answer for a low stop (the stop, not the stage) must not stand for a higher one."""
    rng = np.random.default_rng(100 + seed)
    L, p, v = 7, 3, 2
    work = [rng.uniform(1, 3, 2) for _ in range(3)]
    pattern = rng.permutation([0] * 3 + [1] * 2 + [2] * 2)
    arrs = np.vstack([np.array([work[k] for k in pattern]), rng.uniform(0, 4, (2, 2))])
    time = {"tensor": arrs[:, 0], "nvlink": arrs[:, 1]}
    want = _enumerated(time, L, p, v)
    for stop in (0.999 * want, 2 * want, 0.5 * want, 1.01 * want):
        got = granular_stage(time, L, p, v, stop=stop)
        assert got <= want, (stop, got, want)
        assert got >= min(want, stop) * (1 - 1e-6), (stop, got, want)
        if stop > want:
            assert got == pytest.approx(want, rel=1e-6), (stop, got, want)
