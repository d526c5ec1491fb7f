"""Megatron's operation order and the pipeline replay on hand-worked cases, the per-chunk times the replay reads,
and context parallelism's traffic, stall and buffers on both link kinds (TE's p2p KV ring for MLA, FLA KCP's
state all-gather for KDA), each figure worked out from the schedule rules or the layer shapes."""

from __future__ import annotations

import numpy as np
import pytest

import k3opt
from k3opt.cost import comm
from k3opt.cost.coefficients import Shape, _context_parallel, coefficients
from k3opt.cost.evaluate import chunk_times_s
from k3opt.cost.schedule import pipeline_order, replay_makespan


def _forwards_before_the_first_backward(ops) -> int:
    return next(i for i, (is_f, _, _) in enumerate(ops) if not is_f)


@pytest.mark.parametrize(("p", "v", "m", "warm"), [
    # Megatron schedules.py, interleaved: (p - r - 1) x 2 + (v - 1) x p, capped at v M.
    (4, 2, 8, [10, 8, 6, 4]),
    (4, 3, 2, [6, 6, 6, 6]),         # 2 x 3 + 2 x 4 = 14 > v M = 6: all forwards first
    # 1F1B: p - r - 1, capped at M.
    (4, 1, 8, [3, 2, 1, 0]),
    (4, 1, 2, [2, 2, 1, 0]),
])
def test_warmup_forwards_follow_megatron(p, v, m, warm):
    for r in range(p):
        ops = pipeline_order(p, v, m, r)
        assert len(ops) == 2 * v * m
        # The steady phase opens with one forward before its first backward (none left after a full warmup).
        assert _forwards_before_the_first_backward(ops) == min(warm[r] + 1, v * m), r


def test_replay_waits_for_the_hop_from_the_sending_rank():
    """p = 3, v = 1, M = 1, forward 1, 2, 3 s and backward 4, 5, 6 s per chunk, hops 1, 10, 100 s out of ranks
    0, 1, 2: f0 + h0 + f1 + h1 + f2, then b2 right after, + h2 (rank 2 sends) + b1 + h1 + b0
    = 1 + 1 + 2 + 10 + 3 + 6 + 100 + 5 + 10 + 4 = 142 s."""
    got = replay_makespan(3, 1, 1, np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0]),
                          np.array([1.0, 10.0, 100.0]))
    assert got == 142.0


def test_chunk_times_share_the_rank_time_by_work_and_split_backward_3_to_1_under_full_recompute():
    """Llama 3 70B, PP 2 x VP 2, split 20 / 20 / 30 / 10 layers: rank 0 runs chunks 0 and 2, rank 1 chunks 1
    and 3. A rank's time per microbatch is shared among its chunks by their work (the 30-layer chunk takes more
    than the 20-layer one), and each chunk splits forward : backward = 1 : 2 + 1 under full recompute (SC21
    section 3.5: the backward is twice the forward, recompute replays one forward)."""
    lay = k3opt.make_layout(gpus=32, pp=2, vp=2, dense_fsdp=16, microbatches=8, context=4096,
                            split=[20, 20, 30, 10], recompute="full", fsdp_lifecycle="accumulate")
    model, cluster = k3opt.load_model("llama3-70b"), k3opt.load_cluster("gb200-nvl72")
    ev = k3opt.evaluate(lay, model=model, cluster=cluster)
    cf = coefficients(Shape.of(lay), model, cluster)
    fwd, bwd = chunk_times_s(cf, list(ev.ranks), lay)
    np.testing.assert_allclose(bwd, 3 * fwd, rtol=1e-12)
    for r in (0, 1):
        assert fwd[r] + bwd[r] + fwd[r + 2] + bwd[r + 2] == pytest.approx(ev.ranks[r].stage_time_s, rel=1e-12, abs=0)
    assert fwd[2] > 1.4 * fwd[0]       # 30 layers against 20 (plus the embedding's small work)
    # The replayed step: the pipeline's makespan over these chunk times plus the exposed update.
    update = max(max(r.update_s.values()) for r in ev.ranks)
    assert ev.step.schedule_step_time_s == pytest.approx(replay_makespan(2, 2, 8, fwd, bwd) + update, rel=1e-12, abs=0)
    # Selective recompute: backward = 2 x forward.
    sel = lay.model_copy(update={"recompute": "selective"})
    ev_sel = k3opt.evaluate(sel, model=model, cluster=cluster)
    f_sel, b_sel = chunk_times_s(coefficients(Shape.of(sel), model, cluster), list(ev_sel.ranks), sel)
    np.testing.assert_allclose(b_sel, 2 * f_sel, rtol=1e-12)
    # 20 layers against 10 plus the LM head (128,256 x 8,192 = 1.05B parameters, about 1.2 layers of 0.86B)
    assert fwd[1] > 1.4 * fwd[3]


def test_cp_helpers_are_zero_without_cp():
    assert comm.cp_mla_ring_bytes(1, 4096, 61_440) == 0.0
    assert comm.cp_mla_ring_buffer_bytes(1, 4096, 61_440) == 0.0
    assert comm.cp_kda_allgather_bytes(1, 12 * 2**20) == 0.0
    # CP 4: the ring sends 3 (C - 1) T kv, buffers 4 T kv; KDA gathers 2 (C - 1) states.
    assert comm.cp_mla_ring_bytes(4, 4096, 61_440) == 9 * 4096 * 61_440
    assert comm.cp_mla_ring_buffer_bytes(4, 4096, 61_440) == 4 * 4096 * 61_440
    assert comm.cp_kda_allgather_bytes(4, 12 * 2**20) == 6 * 12 * 2**20


def test_cp_across_domains_rides_the_nic():
    """K3, CP 2, T = 16,384 local tokens, full recompute, CP groups across NVLink domains (NIC, 50 GB/s).
    MLA layer 3: the ring carries full heads, 96 x (192 + 128) x 2 B = 61,440 B per token; sent = 3 (C - 1) T kv
    x 4/3 (recompute replays the forward ring) = 4 x 16,384 x 61,440 B; buffers 4 T kv; the stall is the
    transfer minus the attention it overlaps.
    KDA layer 2: state 12 MiB, 2 (C - 1) x 12 MiB x 3/2 = 36 MiB received, all of it a stall; buffer C x state."""
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    lay = k3opt.make_layout(gpus=512, pp=8, cp=2, ep=64, dense_fsdp=32, microbatches=16, context=32768,
                            split=[12] * 7 + [9], recompute="full", reserve_gib=4, domain_gpus_used=64)
    n = model.num_layers + 2
    mla_sent, kda_got = 4 * 16384 * 61_440, 3 * 12 * 2**20
    attn = np.zeros(n)
    attn[3] = 0.99 * mla_sent / 50e9 * 2500e12  # attention at 2,500 TF/s covering 99 % of the ring's transfer
    nvl, nic, stall, ws = _context_parallel(model, Shape.of(lay), 16384, cluster, False, attn, True)
    assert not nvl.any()
    assert nic[3] == mla_sent and nic[2] == kda_got
    assert ws[3] == 4 * 16384 * 61_440 and ws[2] == 2 * 12 * 2**20
    assert stall[3] == pytest.approx(mla_sent / 50e9 - attn[3] / 2500e12, rel=1e-12, abs=0)
    assert stall[2] == pytest.approx(kda_got / 50e9, rel=1e-14, abs=0)
    on_nvl = _context_parallel(model, Shape.of(lay), 16384, cluster, True, np.zeros(n), True)
    assert not on_nvl[1].any() and on_nvl[0][3] == mla_sent
    assert on_nvl[2][2] == pytest.approx(kda_got / 900e9, rel=1e-14, abs=0)
