"""`lp_bound.granular_stage`: a lower bound on the slowest-rank stage when ranks hold whole layers in contiguous
chunks, between the enumeration of every way to deal the layers' counts to the ranks (what it was before it kept
each rank's kind mix) and the enumeration of every contiguous split; the textbook case of equal layers; and
`lp_bound.window_extreme`, the kind mix a rank's chunks can hold, against enumeration of every split."""

from __future__ import annotations

import itertools
import math

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


def test_a_floor_under_a_percent_above_the_mean_is_still_the_least_stage():
    # 1,001 equal layers of 1 ms over 10 ranks (2 chunks each): some rank holds 101 layers, 101 ms, 0.9% above the
    # 100.1-ms mean load. The bisection must not stop at a bracket that is merely feasible above the mean.
    L = 1001
    t = {"tensor": np.concatenate([np.full(L, 1e-3), [0.0, 0.0]])}
    assert granular_stage(t, L, 10, 2) == pytest.approx(101e-3, rel=1e-6)


def _splits(L: int, chunks: int, least: tuple[int, ...]):
    """Every split of L layers into `chunks` contiguous chunks, chunk j holding at least least[j]."""
    for cuts in itertools.combinations_with_replacement(range(L + 1), chunks - 1):
        edges = (0, *cuts, L)
        sizes = [edges[j + 1] - edges[j] for j in range(chunks)]
        if all(n >= q for n, q in zip(sizes, least, strict=True)):
            yield edges


def _contiguous(time: dict[str, np.ndarray], L: int, p: int, v: int, least: tuple[int, ...] | None = None
                ) -> float:
    """min over every contiguous split (chunk j on rank j mod p) of max over ranks and resources of the rank's
    load with its edges: what any layout's slowest stage is at least."""
    arrs = np.stack([time[r] for r in time], axis=1)
    least = least or (1,) * (p * v)
    best = np.inf
    for edges in _splits(L, p * v, least):
        loads = np.zeros((p, arrs.shape[1]))
        for j in range(p * v):
            loads[j % p] += arrs[edges[j]:edges[j + 1]].sum(axis=0)
        loads[0] += arrs[L]
        loads[p - 1] += arrs[L + 1]
        best = min(best, float(loads.max()))
    return best


@pytest.mark.parametrize("kinds", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_between_the_count_dealing_and_the_contiguous_splits(seed: int, kinds: int):
    rng = np.random.default_rng(seed)
    L, p, v = 7, 3, 2
    # Two or three kinds of layer with two resources each (compute-heavy and traffic-heavy ones), heavy edges.
    work = [rng.uniform(1, 3, 2) for _ in range(kinds)]
    pattern = rng.permutation([0] * 3 + [1] * 2 + [kinds - 1] * 2)
    per_layer = np.array([work[k] for k in pattern])
    edges = rng.uniform(0, 4, (2, 2))
    arrs = np.vstack([per_layer, edges])
    time = {"tensor": arrs[:, 0], "nvlink": arrs[:, 1]}
    got = granular_stage(time, L, p, v)
    # The bisection stops within a relative 1e-6 of the stage, below it.
    assert _enumerated(time, L, p, v) * (1 - 1e-6) <= got <= _contiguous(time, L, p, v)


def test_contiguity_keeps_cheap_layers_where_the_model_puts_them():
    """Four layers, two cheap (1 ms) then two dear (3 ms), over two ranks of one chunk. Dealt by counts, each rank
    takes a cheap and a dear layer: 4 ms. In model order rank 0 holds the first n layers: n = 1 leaves 1 + 3 + 3
    = 7 ms on rank 1, n = 2 gives 2 | 6, n = 3 gives 1 + 1 + 3 = 5 | 3: no split does better than 5 ms."""
    t = {"tensor": np.array([1.0, 1.0, 3.0, 3.0, 0.0, 0.0]) * 1e-3}
    assert _enumerated(t, 4, 2, 1) == pytest.approx(4e-3)
    assert granular_stage(t, 4, 2, 1) == pytest.approx(5e-3, rel=1e-6)


def test_a_rank_s_chunks_hold_the_model_s_kind_mix():
    """A K3-like order of 93 layers (layer 0 dense, then one MLA layer in four: layers 3, 7, ..., 91): a rank of
    PP4 VP4 holding 24 layers in its 4 chunks holds at most 9 MLA layers. A chunk of m consecutive layers holds at
    most ceil(m / 4) <= (m + 3) / 4 of them, so 4 chunks of 24 layers hold at most (24 + 12) / 4 = 9; chunks of 1,
    1, 1 and 21 layers reach it (one MLA layer each, and 6 in layers 3..23). Counted by kind alone, the rank could
    hold 23 of them. The fewest: a chunk of m holds at least floor(m / 4) >= (m - 3) / 4, four chunks of 24 at least
    (24 - 12) / 4 = 3 (chunks of 3, 3, 3 and 15 layers placed to miss them reach it)."""
    from k3opt.search.lp_bound import window_extreme

    order = [0] + [1 if i % 4 == 3 else 2 for i in range(1, 93)]  # 1: MLA, 2: KDA
    mla = np.array([k == 1 for k in order], dtype=float)
    assert mla.sum() == 23
    assert window_extreme(mla, (1,) * 16, 4, 1, low=False)[24] == 9
    assert window_extreme(mla, (1,) * 16, 4, 1, low=True)[24] == 3


@pytest.mark.parametrize("seed", range(12))
def test_window_extreme_equals_every_split(seed: int):
    """The least and the most weight rank r's chunks hold at n layers, against every split of the layers (edge
    chunks that may be empty in some cases)."""
    from k3opt.search.lp_bound import window_extreme, window_least

    rng = np.random.default_rng(seed)
    p, v = [(2, 2), (3, 2), (2, 3), (4, 1)][seed % 4]
    k = p * v
    L = int(rng.integers(k, k + 5))
    least = (0,) + (1,) * (k - 2) + (0,) if seed % 3 == 0 else (1,) * k
    w = rng.random(L)
    for r in range(p):
        lo = np.full(L + 1, np.inf)
        hi = np.full(L + 1, -np.inf)
        for edges in _splits(L, k, least):
            idx = [i for g in range(r, k, p) for i in range(edges[g], edges[g + 1])]
            lo[len(idx)] = min(lo[len(idx)], w[idx].sum())
            hi[len(idx)] = max(hi[len(idx)], w[idx].sum())
        np.testing.assert_allclose(window_extreme(w, least, p, r, low=True), lo)
        np.testing.assert_allclose(window_extreme(w, least, p, r, low=False), hi)
        # The batched program (_window_counts runs every kind's least and most in one): the rows are independent.
        both = window_least(np.stack([w, -w, np.zeros(L)]), least, p, r)
        np.testing.assert_allclose(both[0], lo)
        np.testing.assert_allclose(-both[1], hi)
        np.testing.assert_allclose(both[2], np.where(np.isfinite(lo), 0.0, np.inf))


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
    reduced per microbatch. A layout of it (split 3 x 3 + 2 + 3 x 27 + 1: some rank holds 12 of the 93 layers, the
    least the busiest rank can hold) ranks at 21.07 s by evaluate(). The node's bound stays under it and within 1%
    of it. Whole layers dealt at the least work over every variant (the host-link time of the variants without
    offload, which do not fit, beside the tensor time of the variants that recompute the least) gave a bound 3.1%
    under the node's best: each variant is now dealt whole layers at its own work."""
    import k3opt
    from k3opt.inputs.presets import load_cluster, load_model
    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search.frames import enumerate_frames, frame_of
    from k3opt.search.lp_bound import interleaved_lp_bound

    job = k3opt.load_job("k3-512-4k")
    model, cluster = load_model(job.model), load_cluster(job.cluster)
    toggles = dict(fp8_activations=True, activation_offload=True, moe_backward_rewrite=True, dispatch_recompute=False,
                   fused_situ=True, p2p_muon=True, fused_cross_entropy=True)
    lay = k3opt.make_layout(
        gpus=512, pp=8, vp=4, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, rows=1, context=4096,
        split=[3, 3, 3, 2] + [3] * 27 + [1], recompute="selective", fsdp_lifecycle="per_microbatch",
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
    """With `stop` (the stage the search only needs to know is reached): never above the least stage of the
    enumerated contiguous splits, at least min(stage, stop), the stage itself when the stop is above it. The stops
    come low, high, lower, just above: a kept answer for a low stop (the stop, not the stage) must not stand for a
    higher one."""
    rng = np.random.default_rng(100 + seed)
    L, p, v = 7, 3, 2
    work = [rng.uniform(1, 3, 2) for _ in range(3)]
    pattern = rng.permutation([0] * 3 + [1] * 2 + [2] * 2)
    arrs = np.vstack([np.array([work[k] for k in pattern]), rng.uniform(0, 4, (2, 2))])
    time = {"tensor": arrs[:, 0], "nvlink": arrs[:, 1]}
    ceiling = _contiguous(time, L, p, v)
    want = granular_stage(time, L, p, v)
    assert want <= ceiling
    for stop in (0.999 * want, 2 * want, 0.5 * want, 1.01 * want):
        got = granular_stage(time, L, p, v, stop=stop)
        assert got <= ceiling, (stop, got, ceiling)
        assert got >= min(want, stop) * (1 - 1e-6), (stop, got, want)
        if stop > want:
            assert got == pytest.approx(want, rel=1e-6), (stop, got, want)


def test_a_memory_row_caps_the_layers_of_its_rank():
    """lp_bound._row_capacity on a hand row: two chunks, two kinds of layer (3 of kind 0, 2 of kind 1), cost
    co[k, t] GiB for a kind-t layer in chunk k, one layer at least in each chunk. With 10 GiB of room: every
    further layer costs at least 1 GiB after the forced 2 + 1 = 3 GiB, so at most 2 + 7 = 9; the cheapest layers
    in their cheapest chunk cost 1, 1, 1, 3, 3 GiB, whose running sums 1, 2, 3, 6, 9 all fit: at most 5 (every
    layer). With 8 GiB the running sums stop at 6 (4 layers); with 2 GiB the forced 3 GiB do not fit (-1)."""
    from k3opt.search.lp_bound import _row_capacity

    gib = 2.0**30
    co = np.array([[2.0, 3.0], [1.0, 5.0]]) * gib
    counts = np.array([3, 2])
    assert _row_capacity(co, counts, [1, 1], 10 * gib) == 5
    assert _row_capacity(co, counts, [1, 1], 8 * gib) == 4
    assert _row_capacity(co, counts, [1, 1], 2 * gib) == -1
    # A chunk that may be empty (least 0) forces only the other's cheapest layer: 1 GiB, then 1 GiB a layer.
    assert _row_capacity(co, counts, [0, 1], 2.5 * gib) == 2


def test_the_early_ranks_memory_lifts_the_8k_interleaved_shape_bound():
    """K3 on 1,024 GB200 at 8K context, shape PP16 VP3 EP64 dense FSDP 64 (optim): at its peak rank 0 holds 31,
    16 and 16 microbatches of its three chunks, so under any setting (the saved sets on the GPU or offloaded to
    the host's 223.5 GiB) the first ranks hold 4 to 6 of the 93 layers, and whole layers dealt under those caps
    leave more than the 6 of an even dealing on the late ranks. The shape's bound (over every node) rises from
    the uncapped dealing (a quarter under) to within 2% of the shape's best layout, which evaluate() ranks at
    30.04 s (full recompute, two layers a chunk), and stays below it."""
    import k3opt
    from k3opt.inputs.presets import make_layout
    from k3opt.search import frame_dp_bound
    from k3opt.search.frames import frame_of

    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    job = k3opt.Job.model_validate({"gpus": 1024, "context": 8192, "tokens_per_update": 33554432, "reserve_gib": 4.0,
                                    "domain_gpus_used": 64, "runtime": "megatron-te-hybridep-gb200"})
    split = [2] * 17 + [1] + [2] * 28 + [1, 1]
    lay = make_layout(gpus=1024, pp=16, vp=3, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, context=8192,
                      split=split, recompute="full", fsdp_lifecycle="per_microbatch", reserve_gib=4.0,
                      dense_sharding="optim", expert_sharding="optim", domain_gpus_used=64,
                      runtime="megatron-te-hybridep-gb200",
                      toggles={t: True for t in ("fp8_activations", "activation_offload", "moe_backward_rewrite",
                                                 "dispatch_recompute", "fused_situ", "pipeline_zero2_host_grads",
                                                 "p2p_muon", "fused_cross_entropy")})
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    assert ev.fits and ev.step.rank_time_s == pytest.approx(30.04, abs=0.01)
    bound, _ = frame_dp_bound(job, frame_of(lay), model, cluster)
    assert 0.98 * ev.step.rank_time_s <= bound <= ev.step.rank_time_s


def test_a_keys_base_bytes_do_not_cap_its_leaner_variants():
    """Kimi K2 on 256 GB200, PP2 VP4 EP64 expert FSDP 2 dense FSDP 64, selective recompute: a layout that keeps its
    FP32 gradients on the host (pipeline ZeRO-2) and holds 31 of the 61 layers on rank 0 fits and ranks at 8.090 s
    by evaluate(). A relaxation key's base has pipeline ZeRO-2 off (its least work), hence more bytes than that
    variant: capping the ranks' layers by the base's memory rows (27 on rank 0) put the key, and the node, 2%
    above the layout. Every node bound, against any pruning line, stays below the layout."""
    import k3opt
    from k3opt.inputs.presets import make_layout
    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search import enumerate_frames, tight_node_bound
    from k3opt.search.bounds import group_node_bound
    from k3opt.search.frames import frame_of, sharding_group

    model, cluster = k3opt.load_model("kimi-k2"), k3opt.load_cluster("gb200-nvl72")
    job = k3opt.Job.model_validate({"model": "kimi-k2", "gpus": 256, "tokens_per_update": 8388608,
                                    "reserve_gib": 4.0, "domain_gpus_used": 64,
                                    "runtime": "megatron-te-hybridep-gb200"})
    lay = make_layout(model="kimi-k2", gpus=256, pp=2, vp=4, ep=64, expert_fsdp=2, dense_fsdp=64, microbatches=16,
                      context=4096, split=[6, 8, 7, 9, 9, 6, 9, 7], recompute="selective",
                      fsdp_lifecycle="per_microbatch", reserve_gib=4.0, dense_sharding="optim",
                      expert_sharding="optim", domain_gpus_used=64, runtime="megatron-te-hybridep-gb200",
                      toggles={"fp8_activations": True, "moe_backward_rewrite": True,
                               "pipeline_zero2_host_grads": True})
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    assert ev.fits and ev.step.rank_time_s == pytest.approx(8.090, abs=0.001)
    f = frame_of(lay)
    members = tuple(g for g in enumerate_frames(job, model, 256, cluster) if sharding_group(g) == sharding_group(f))
    assert f in members
    rc, lc = Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH
    for line in (8.2, 8.3, math.inf):
        assert tight_node_bound(job, f, rc, lc, model, cluster, stop_at=line) <= ev.step.rank_time_s
        assert group_node_bound(job, members, rc, lc, model, cluster, stop_at=line) <= ev.step.rank_time_s


def test_ranks_that_cannot_hold_every_layer_have_no_stage():
    # 7 equal layers over 3 ranks whose memory lets them hold at most 2, 2 and 2 layers: 6 < 7, so no dealing
    # exists at any stage (the bound is inf, the setting has no layout); with 3, 2, 2 the 7 fit and the slowest
    # rank holds 3 layers, 3 ms.
    L = 7
    t = {"tensor": np.array([1.0] * L + [0.0, 0.0]) * 1e-3}
    assert granular_stage(t, L, 3, 1, most=(2, 2, 2)) == math.inf
    assert granular_stage(t, L, 3, 1, most=(3, 2, 2)) == pytest.approx(3e-3, rel=1e-6)
