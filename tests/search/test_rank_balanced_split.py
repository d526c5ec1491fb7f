"""The interleaved candidate split balanced per rank (search/incumbents.rank_balanced_split): its layer counts by
hand, and on Kimi K2 PP16 VP3 over 1,024 B200 (61 layers in 48 chunks) the heuristic layout it gives against the
chunk-by-chunk balance it replaces there."""

from __future__ import annotations

import numpy as np
import pytest

import k3opt
from k3opt.inputs.specs import ShardingPolicy
from k3opt.search.frames import Frame
from k3opt.search.incumbents import frame_incumbent, rank_balanced_split


def _ranks(split: list[int], p: int) -> list[list[int]]:
    """Each rank's chunk sizes, its first chunk first (global chunk g on rank g mod p)."""
    return [split[r::p] for r in range(p)]


def test_counts_by_hand_with_a_heavy_head():
    """61 layers of unit work over PP16 VP3, the head worth 1.26 layers on rank 15, the embedding 0.1 on rank 0.
    Every rank holds at least 3 (one a chunk): 48, and 13 more go where the rank's load stays least, the later
    rank first on a tie. Rank 15 at 3 + 1.26 = 4.26 takes none (4 + 1.26 would pass 4); rank 0 at 3.1 takes one
    only after every other rank has, and 13 < 14, so ranks 2-14 hold 4 layers, ranks 0, 1 and 15 hold 3. Within a
    rank the extra layer goes to its last chunk (virtual stage 2)."""
    work = np.array([1.0] * 61 + [0.1, 1.26])
    split = rank_balanced_split(work, 16, 3)
    assert split is not None and sum(split) == 61 and len(split) == 48
    ranks = _ranks(split, 16)
    assert [sum(c) for c in ranks] == [3, 3] + [4] * 13 + [3]
    assert all(c == [1, 1, 2] for c in ranks[2:15])
    assert ranks[0] == ranks[1] == ranks[15] == [1, 1, 1]


def test_remainder_on_the_latest_chunks():
    """93 layers of unit work over PP8 VP4 without edges: 93 = 8 x 11 + 5, ties to the later ranks, so ranks 3-7
    hold 12 and ranks 0-2 hold 11; 11 over four chunks is 2, 3, 3, 3 (the remainder on the latest), 12 is 3 each."""
    split = rank_balanced_split(np.array([1.0] * 93 + [0.0, 0.0]), 8, 4)
    ranks = _ranks(split, 8)
    assert [sum(c) for c in ranks] == [11, 11, 11, 12, 12, 12, 12, 12]
    assert ranks[0] == [2, 3, 3, 3] and ranks[7] == [3, 3, 3, 3]


def test_a_heavy_head_keeps_its_chunk_short():
    """8 layers of unit work over PP2 VP2, the head worth 2 layers on chunk 3 (rank 1's last). Each chunk holds one
    (rank loads 2 and 4); the four left go where the rank's load stays least, the later rank on a tie: rank 0
    (3 < 5), rank 0 (4 < 5), rank 1 (5 = 5), rank 0 (5 < 6), so ranks hold 5 and 3. Within a rank a layer goes to
    the chunk whose work (its layers and its edge) stays least, the later chunk on a tie: rank 0's three extra go to
    chunk 2, chunk 0, chunk 2 (2, 3 layers); rank 1's one goes to chunk 1 (2 layers against 1 + 2 on chunk 3).
    Spread by count alone it went to chunk 3, beside the head: [2, 1, 3, 2]."""
    split = rank_balanced_split(np.array([1.0] * 8 + [0.0, 2.0]), 2, 2)
    assert split == [2, 2, 3, 1]


def test_deepseek_v3_heads_chunk_holds_one_layer(dsv3_b200_node):
    """DeepSeek-V3 PP8 VP4 EP8 dFSDP64 M8, full recompute, on 512 B200 at 8K (61 layers in 32 chunks): the last
    chunk carries the LM head and the MTP head. Spread by count, rank 7's chunks held 1, 1, 1, 2 layers, two of
    them beside the heads, and the layout replayed at 5.005 s against a 4.157-s step formula. Spread by chunk
    work, the heads' chunk holds one layer, and the heuristic layout ranks within 0.1% of the split this node's
    CP-SAT model found in 60 s (evaluated here: 4.584 s)."""
    from k3opt.inputs.specs import FsdpLifecycle, Recompute

    n = dsv3_b200_node
    job, model, cluster, f = n.job, n.model, n.cluster, n.frame
    it = frame_incumbent(job, f, model, cluster, recompute=Recompute.FULL, lifecycle=FsdpLifecycle.PER_MICROBATCH)
    assert it is not None and it.evaluation.fits
    assert it.layout.split[-1] == 1
    cpsat = k3opt.evaluate(it.layout.model_copy(update={"split": n.witness}), model=model, cluster=cluster)
    assert cpsat.fits
    assert it.rank_time_s <= cpsat.step.rank_time_s * 1.001


def test_least_layers_per_chunk():
    """Chunks that must hold more (an edge chunk of 2) keep it; fewer layers than the chunks' least: None."""
    split = rank_balanced_split(np.array([1.0] * 10 + [0.0, 0.0]), 2, 2, least=(2, 1, 1, 1))
    assert split is not None and split[0] >= 2 and sum(split) == 10
    assert rank_balanced_split(np.array([1.0] * 3 + [0.0, 0.0]), 2, 2) is None


def test_kimi_k2_pp16_vp3_heuristic_layout():
    """The chunk-by-chunk balance put the 13 two-layer chunks in the middle virtual stage, four layers on the last
    rank beside the LM head (vocab 163,840): its heuristic layout was slower than the split balanced per rank,
    priced beside it, which gives the last rank three single-layer chunks and puts the two-layer chunks last;
    evaluate() ranks that layout at 3.609 s (BF16 GEMMs at 0.578 of the peak)."""
    job = k3opt.Job.model_validate({"model": "kimi-k2", "cluster": "b200", "gpus": 1024,
                                    "tokens_per_update": 8388608, "reserve_gib": 4.0})
    model, cluster = k3opt.load_model("kimi-k2"), k3opt.load_cluster("b200")
    f = Frame(pp=16, vp=3, cp=1, ep=8, expert_fsdp=1, dense_fsdp=64, microbatches=32, gpus=1024,
              dense_sharding=ShardingPolicy.OPTIM, expert_sharding=ShardingPolicy.OPTIM)
    it = frame_incumbent(job, f, model, cluster)
    assert it is not None and it.evaluation.fits
    ev = k3opt.evaluate(it.layout, model=model, cluster=cluster)
    assert ev.step.rank_time_s == pytest.approx(it.rank_time_s)
    assert ev.step.rank_time_s < 3.62
    assert _ranks(it.layout.split, 16)[15] == [1, 1, 1]


def test_the_seedings_pricing_prices_the_per_rank_split(dsv3_b200_node):
    """The seeding prices a configuration on a frame through `price_configs`, whose heuristic splits stop at the
    first that fits; the per-rank split is priced beside them, as frame_incumbent prices it. On the DeepSeek-V3
    PP8 VP4 node above, the first fitting chunk balance replays at 5.2 s; with the per-rank split the fastest
    layout priced is within 0.1% of the node's CP-SAT split."""
    import math

    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search.incumbents import config_of, price_configs

    n = dsv3_b200_node
    job, model, cluster, f = n.job, n.model, n.cluster, n.frame
    it = frame_incumbent(job, f, model, cluster, recompute=Recompute.FULL, lifecycle=FsdpLifecycle.PER_MICROBATCH)
    assert it is not None
    got = price_configs(job, f, [config_of(it.layout)], model, cluster, math.inf, every_split=False)
    assert got and all(g.evaluation.fits for g in got)
    cpsat = k3opt.evaluate(it.layout.model_copy(update={"split": n.witness}), model=model, cluster=cluster)
    assert min(g.rank_time_s for g in got) <= cpsat.step.rank_time_s * 1.001


def _loads(split: list[int], work: np.ndarray, p: int) -> list[float]:
    """Each rank's layer work and edges, summed by hand from the split (chunk g on rank g mod p)."""
    L, out, i = len(work) - 2, [0.0] * p, 0
    for g, n in enumerate(split):
        out[g % p] += float(work[i:i + n].sum())
        i += n
    out[0] += float(work[L])
    out[p - 1] += float(work[L + 1])
    return out


def test_layer_kinds_move_the_short_chunk():
    """7 layers over PP2 VP2 with layers 1 and 2 twice as heavy (works 1, 2, 2, 1, 1, 1, 1, no edges). Counted at
    the mean, the water-fill gives rank 1 four layers and rank 0 three, split 1, 2, 2, 2: rank 0 holds layers 0, 3,
    4 (3) and rank 1 layers 1, 2, 5, 6 (6). With chunks of one or two layers and the last never grown, the one-layer
    chunk can sit at chunk 1 (ranks 5 and 4), chunk 2 (4 and 5) or chunk 3 (5 and 4): the slowest rank is 5, not 6."""
    work = np.array([1.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    split = rank_balanced_split(work, 2, 2)
    assert split is not None and sum(split) == 7 and set(split) <= {1, 2}
    assert max(_loads(split, work, 2)) == 5.0


def test_k3_b200_pp16_short_chunks_by_layer_kind():
    """K3 PP16 VP3 EP8 eFSDP8 dFSDP16 M64, full recompute, on 1,024 B200 (93 layers in 48 chunks: 45 of two layers
    and three of one). Counted at the mean layer work, the one-layer chunks went to ranks 0, 1 and 15, and six ranks
    held six of the heavier layers. The heuristic's slowest rank is here the least over every placement of the three
    one-layer chunks (C(48, 3) = 17,296 splits, enumerated on the same per-layer work), and its step is lower."""
    import itertools

    from k3opt.cost.coefficients import Shape, busiest_layer_seconds
    from k3opt.inputs.specs import FsdpLifecycle, Recompute
    from k3opt.search import enumerate_frames
    from k3opt.search.ranking import ranked_coefficients

    job = k3opt.Job.model_validate({"model": "kimi-k3", "cluster": "b200", "gpus": 1024,
                                    "tokens_per_update": 16777216, "reserve_gib": 4.0})
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("b200")
    f = next(g for g in enumerate_frames(job, model, 1024, cluster)
             if (g.pp, g.vp, g.ep, g.expert_fsdp, g.dense_fsdp, g.microbatches) == (16, 3, 8, 8, 16, 64)
             and g.dense_sharding == ShardingPolicy.OPTIM)
    it = frame_incumbent(job, f, model, cluster, recompute=Recompute.FULL, lifecycle=FsdpLifecycle.PER_MICROBATCH)
    assert it is not None and it.evaluation.fits
    work = busiest_layer_seconds(ranked_coefficients(Shape.of(it.layout), model, cluster))
    least = min(max(_loads([1 if g in ones else 2 for g in range(48)], work, 16))
                for ones in itertools.combinations(range(48), 3))
    got = max(_loads(list(it.layout.split), work, 16))
    assert got <= least * (1 + 1e-9)
    water = [1, 1] + [2] * 45 + [1]  # the mean-work water-fill's split: short chunks on ranks 0, 1 and 15
    assert max(_loads(water, work, 16)) > least * (1 + 1e-4)
    before = k3opt.evaluate(it.layout.model_copy(update={"split": water}), model=model, cluster=cluster)
    assert it.rank_time_s < before.step.rank_time_s * (1 - 1e-3)


def test_split_kept_when_the_slowest_rank_cannot_drop():
    """8 layers over PP3 VP2 (works 1, 2, 1, 1, 1, 2, 1, 1), a head of 5 on rank 2. The water-fill gives ranks 0
    and 1 one more layer each (ties to the later rank, then the later chunk): split 1, 1, 1, 2, 2, 1, rank loads 3
    (layers 0, 3, 4), 5 (1, 5, 6) and 7 (2, 7 and the head). Rank 2 holds at least two layers of work 1 beside the
    head, so no split is under 7; 2, 1, 1, 1, 2, 1 would even ranks 0 and 1 (4 and 4) under the same 7, a change the
    replay reads and the step does not, so the water-fill's split stands."""
    work = np.array([1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 0.0, 5.0])
    assert rank_balanced_split(work, 3, 2) == [1, 1, 1, 2, 2, 1]
    assert _loads([1, 1, 1, 2, 2, 1], work, 3) == [3.0, 5.0, 7.0]
