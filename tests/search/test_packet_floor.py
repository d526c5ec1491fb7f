"""The interleaved bound's floor on a rank's PP packets (lp_bound._packet_floor) against the packets the cost model
prices at real splits (achievable.rank_sums): never above them, and equal where every boundary sits as shallow
as it can (every chunk one layer but the last), on K3 PP4 VP4, whose AttnRes streams make deeper packets larger."""

from __future__ import annotations

import numpy as np
import pytest

import k3opt
from k3opt.cost.achievable import rank_sums
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search.frames import ActMode, Frame, frame_shape
from k3opt.search.lp_bound import _least_packets, _packet_floor
from k3opt.search.ranking import ranked_coefficients


@pytest.fixture(scope="module")
def k3_pp4_vp4():
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    job = k3opt.Job.model_validate({"model": "kimi-k3", "cluster": "gb200-nvl72", "gpus": 512, "context": 4096,
                                    "rows": 1, "tokens_per_update": 16777216, "reserve_gib": 4,
                                    "domain_gpus_used": 64})
    f = Frame(pp=4, vp=4, cp=1, ep=64, expert_fsdp=2, dense_fsdp=64, microbatches=32, gpus=512, domain_gpus_used=64)
    shape = frame_shape(job, f, ActMode(Recompute.SELECTIVE, False, False, False, False), FsdpLifecycle.PER_MICROBATCH)
    return ranked_coefficients(shape, model, cluster)


def _packets(cf, split, r):
    """Rank r's packet seconds per link: its priced rank sums less its layers' own sums."""
    with_packets = rank_sums(cf, cf.time, cf.pp_seconds_per_byte, split, r)
    edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
    k, p, L = len(split), cf.shape.pp, cf.n_layers
    idx = [i for j in range(r, k, p) for i in range(edges[j], edges[j + 1])]
    idx += ([L] if r == 0 else []) + ([L + 1] if r == p - 1 else [])
    return {res: with_packets[res] - float(cf.time[res][idx].sum()) for res in cf.time}


def test_packet_floor_is_exact_at_the_shallowest_boundaries_and_below_elsewhere(k3_pp4_vp4):
    cf = k3_pp4_vp4
    p, v, L = 4, 4, cf.n_layers
    floor = _packet_floor(cf, p, v, L)
    assert any(floor[r].get("nic", 0) > 0 for r in range(p))  # PP hops cross NVLink domains here
    shallow = [1] * (p * v - 1) + [L - p * v + 1]
    rng = np.random.default_rng(3)
    others = [[6] * 15 + [3], *(list(np.bincount(rng.integers(0, 16, L - 16), minlength=16) + 1) for _ in range(4))]
    for r in range(p):
        got = _packets(cf, shallow, r)
        for res in ("nvlink", "nic"):
            assert floor[r].get(res, 0.0) == pytest.approx(got[res], rel=1e-9, abs=1e-12)
        for split in others:
            priced = _packets(cf, split, r)
            for res in ("nvlink", "nic"):
                assert floor[r].get(res, 0.0) <= priced[res] * (1 + 1e-9) + 1e-12
    # AttnRes: a deep boundary carries more streams than a shallow one, so the floor is strictly under the even split
    even = _packets(cf, [6] * 15 + [3], 1)
    assert floor[1]["nic"] < even["nic"]


def test_with_empty_edge_chunks_the_floor_is_exact_one_layer_shallower(k3_pp4_vp4):
    """When the first and the last chunk may hold no layer (`[search] empty_edge_chunks`), the boundary before
    chunk g lies at layer g - 1 or deeper: the floor is exact at [0, 1 x 14, L - 14] (every boundary one layer
    shallower than with a layer in every chunk) and below the splits of the test above, and no higher than the
    floor with a layer in every chunk; where a block closes between the two depths it is strictly lower."""
    cf = k3_pp4_vp4
    p, v, L = 4, 4, cf.n_layers
    least = (0,) + (1,) * (p * v - 2) + (0,)
    floor = _packet_floor(cf, p, v, L, least)
    shallow = [0] + [1] * (p * v - 2) + [L - p * v + 2]  # boundary g at layer g - 1, the last chunk the rest
    assert sum(shallow) == L and len(shallow) == p * v
    for r in range(p):
        got = _packets(cf, shallow, r)
        for res in ("nvlink", "nic"):
            assert floor[r].get(res, 0.0) == pytest.approx(got[res], rel=1e-9, abs=1e-12)
        for split in ([6] * 15 + [3], [1] * (p * v - 1) + [L - p * v + 1]):
            priced = _packets(cf, split, r)
            for res in ("nvlink", "nic"):
                assert floor[r].get(res, 0.0) <= priced[res] * (1 + 1e-9) + 1e-12
    held = _packet_floor(cf, p, v, L)
    assert sum(sum(d.values()) for d in floor) < sum(sum(d.values()) for d in held)


def _chunk_x(split, p, v):
    """x over (r v + k) L + t, one kind per layer: 1 where layer t sits in global chunk g = k p + r."""
    L = sum(split)
    x = np.zeros(p * v * L)
    edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
    for g in range(p * v):
        k, r = divmod(g, p)
        x[(r * v + k) * L + np.arange(edges[g], edges[g + 1])] = 1.0
    return x


def test_packet_stream_rows_are_the_priced_packets_at_every_contiguous_split(k3_pp4_vp4):
    """The relaxation's packet rows (lp_bound._packet_stream_rows: a constant plus the closing layers of the chunks
    before each boundary) give each rank's priced packets exactly at a contiguous split, here with one kind per
    layer; and by hand at the even split: rank 1 holds chunks 1, 5, 9, 13, receives the packets before them and
    sends those before 2, 6, 10, 14. K3 closes an AttnRes block at every sixth layer (layers 5, 11, ...), so the
    boundary before chunk b (depth 6 b) carries 1 + b streams: 8 packets + (1 + 5 + 9 + 13 + 2 + 6 + 10 + 14) = 68
    streams of BF16 [4096, 7168] on the NIC (every PP hop of this shape leaves its NVLink domain)."""
    from k3opt.search.lp_bound import _packet_stream_rows

    cf = k3_pp4_vp4
    p, v, L = 4, 4, cf.n_layers
    closes = np.asarray(cf.closes[:L], dtype=float)
    assert closes.sum() == 15 and all(closes[i] == (1 if i % 6 == 5 else 0) for i in range(L))
    rows = _packet_stream_rows(cf, p, v, closes)
    rng = np.random.default_rng(7)
    splits = [[6] * 15 + [3], [1] * 15 + [78], [3] * 12 + [15, 14, 14, 14]]
    splits += [list(np.bincount(rng.integers(0, 16, L - 16), minlength=16) + 1) for _ in range(3)]
    for split in splits:
        x = _chunk_x(split, p, v)
        for r in range(p):
            priced = _packets(cf, split, r)
            const, row = rows[r]["nic"]
            assert const + float(row @ x) == pytest.approx(priced["nic"], rel=1e-9)
            assert "nvlink" not in rows[r] and priced["nvlink"] == pytest.approx(0.0, abs=1e-12)
    assert cf.stream_bytes == 4096 * 7168 * 2
    const, row = rows[1]["nic"]
    assert const + float(row @ _chunk_x([6] * 15 + [3], p, v)) == pytest.approx(
        68 * cf.stream_bytes * cf.pp_seconds_per_byte[0], rel=1e-9)


def test_packet_stream_rows_are_empty_without_attnres_or_a_pipeline(k3_pp4_vp4):
    """Nothing to add where no layer closes a block (the constant floor is then exact) or with one stage."""
    from k3opt.search.lp_bound import _packet_stream_rows

    cf = k3_pp4_vp4
    assert all(not d for d in _packet_stream_rows(cf, 4, 4, np.zeros(cf.n_layers)))
    assert all(not d for d in _packet_stream_rows(cf, 1, 4, np.asarray(cf.closes[:cf.n_layers], dtype=float)))


def test_the_pp_buffers_every_rank_holds_are_the_ledgers_at_no_open_stream():
    """`_least_packets`, the PP buffers the memory rows give every rank of an interleaved frame: a packet in and one
    out, each double-buffered, at no AttnRes stream: 4 x BF16 [T, d] = 4 x 4,096 x 7,168 x 2 B = 234,881,024 B on
    DeepSeek-V3 (no AttnRes), which is the ledger's pp_buffers on every rank of a PP8 VP4 layout."""
    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("b200")
    lay = make_layout(gpus=512, pp=8, vp=4, ep=8, dense_fsdp=64, microbatches=64, context=4096,
                      split=[2] * 29 + [1] * 3, recompute="selective", model="deepseek-v3", cluster="b200")
    expected = 4 * 4096 * 7168 * 2
    assert _least_packets(coefficients(Shape.of(lay), model, cluster), 8) == expected
    assert {r.ledger["pp_buffers"] for r in k3opt.evaluate(lay, model, cluster).ranks} == {expected}
