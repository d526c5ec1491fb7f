"""The interleaved relaxation's replay terms (search/lp_bound.py): the share ratio that keeps a thin chunk's replayed
time (lp_bound._share_ratio), checked by hand and against the chunk times evaluate() replays; and the path
separation (lp_bound._violated_path), which must raise a node's bound and keep it under the node's layouts."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import k3opt
from k3opt.cost.coefficients import Shape
from k3opt.inputs.specs import FsdpLifecycle, Recompute
from k3opt.search import lp_bound
from k3opt.search.bounds import tight_node_bound
from k3opt.search.frames import Frame
from k3opt.search.lp_bound import _share_ratio
from k3opt.search.policy import POLICY
from k3opt.search.ranking import ranked_coefficients

JOB = {"model": "kimi-k3", "cluster": "gb200-nvl72", "gpus": 512, "context": 4096, "rows": 1,
       "tokens_per_update": 16777216, "reserve_gib": 4, "domain_gpus_used": 64,
       "runtime": "megatron-te-hybridep-gb200"}
TOGGLES = {"fp8_activations": True, "activation_offload": True, "moe_backward_rewrite": True, "fused_situ": True,
           "p2p_muon": True, "fused_cross_entropy": True}
# PP4 VP4 EP64 eFSDP2 dFSDP64 M32, both groups optim_grads, selective / per_microbatch: a layout of this node that
# fits (the node's best after a 20-s plan restricted to it).
NODE = {"pp": 4, "vp": 4, "cp": 1, "ep": 64, "expert_fsdp": 2, "dense_fsdp": 64, "microbatches": 32,
        "dense_sharding": "optim_grads", "expert_sharding": "optim_grads"}
FITS = [5, 5, 5, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 4]


def _layout(split: list[int]) -> k3opt.Layout:
    return k3opt.Layout(model="kimi-k3", cluster="gb200-nvl72", gpus=512, rows=1, context=4096, split=split,
                        recompute="selective", fsdp_lifecycle="per_microbatch", toggles=TOGGLES, reserve_gib=4.0,
                        domain_gpus_used=64, runtime="megatron-te-hybridep-gb200", **NODE)


def test_share_ratio_by_hand():
    """Two layers, tensor (1, 2), NIC (0.5, 3): per-layer maxima (1, 3). On the tensor, kappa = max(1/1, 3/2) = 1.5;
    on the NIC, max(1/0.5, 3/3) = 2: a middle rank (no edges) takes 1/1.5. Rank 0 with a first edge of no tensor
    work, maximum 0.4 and NIC 0.4, holding at least 2 layers (A >= 2 x 1 on the tensor, 2 x 0.5 on the NIC): on the
    tensor min(1/1.5, (2 + 0) / (1.5 x 2 + 0.4)) = 0.588; on the NIC min(1/2, (1 + 0.4) / (2 x 1 + 0.4)) = 0.5: 0.588.
    A resource with an idle layer gives nothing: with the tensor's first layer 0, only the NIC's 0.5 remains."""
    arrays = SimpleNamespace(time={"tensor": np.array([1.0, 2.0, 0.0, 0.0]), "nic": np.array([0.5, 3.0, 0.4, 0.0])},
                             hi=np.array([1.0, 3.0, 0.4, 0.0]))
    assert _share_ratio(arrays, 2, 4, 1, ["tensor", "nic"], 2) == pytest.approx(1 / 1.5)
    assert _share_ratio(arrays, 2, 4, 0, ["tensor", "nic"], 2) == pytest.approx(2 / 3.4)
    arrays.time["tensor"][0] = 0.0
    assert _share_ratio(arrays, 2, 4, 1, ["tensor", "nic"], 2) == pytest.approx(0.5)


def test_share_ratio_keeps_under_every_replayed_chunk_time():
    """The derivation c_g = t_r w_g / W_r >= rho_r e_g against the chunk times evaluate() replays (the stage time
    shared by each chunk's busiest-resource work): at even, thin-early and random splits of K3 PP4 VP4, every chunk's
    forward + backward is at least rho_r times each resource's sum over its layers (and its edge)."""
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    rng = np.random.default_rng(13)
    splits = [[6] * 15 + [3], [3] * 12 + [15, 14, 14, 14], FITS]
    splits += [list(np.bincount(rng.integers(0, 16, 93 - 16), minlength=16) + 1) for _ in range(3)]
    for split in splits:
        layout = _layout(split)
        ev = k3opt.evaluate(layout)
        cf = ranked_coefficients(Shape.of(layout), model, cluster)
        L, p, k = cf.n_layers, 4, 16
        arrays = SimpleNamespace(time=cf.time, hi=np.max(np.stack(list(cf.time.values())), axis=0))
        edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
        for g, (fwd, bwd) in enumerate(ev.step.ranked_chunk_s):
            r = g % p
            rho = _share_ratio(arrays, L, p, r, list(cf.time), 4)  # a rank holds at least one layer per chunk
            assert 0.5 < rho <= 1.0
            idx = list(range(edges[g], edges[g + 1])) + ([L] if g == 0 else []) + ([L + 1] if g == k - 1 else [])
            for arr in cf.time.values():
                assert fwd + bwd >= rho * float(arr[idx].sum()) * (1 - 1e-9)


@pytest.fixture(scope="module")
def k3_node():
    job = k3opt.Job.model_validate(JOB)
    f = Frame(gpus=512, domain_gpus_used=64, **NODE)
    return job, f, k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")


# K3 on 512 GB300 in FP8 (bench/jobs/k3-gb300-512-fp8.toml), PP8 VP2 EP64 eFSDP1 dFSDP64 M64, optim / optim,
# selective / per_microbatch: the node's heuristic layout (`incumbents.frame_incumbent`) fits at FP8_FITS.
FP8_NODE = {"pp": 8, "vp": 2, "cp": 1, "ep": 64, "expert_fsdp": 1, "dense_fsdp": 64, "microbatches": 64,
            "dense_sharding": "optim", "expert_sharding": "optim", "precision": "fp8"}
FP8_TOGGLES = {**TOGGLES, "balance_activations": True, "dispatch_recompute": True}
FP8_FITS = [6] * 9 + [5] + [6] * 5 + [4]


@pytest.fixture(scope="module")
def fp8_node():
    job = k3opt.Job.model_validate({"cluster": "gb300-nvl72", "gpus": 512, "tokens_per_update": 16777216,
                                    "reserve_gib": 4.0, "domain_gpus_used": 64, "precisions": ["bf16", "fp8", "mxfp8"]})
    f = Frame(gpus=512, domain_gpus_used=64, **FP8_NODE)
    return job, f, k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb300-nvl72")


def test_path_separation_raises_the_node_bound_and_stays_under_its_layouts(fp8_node, monkeypatch):
    """K3 FP8 on GB300, PP8 VP2 M64 (selective, per_microbatch): its relaxation moves layers to thin early chunks and
    fat last ones, where the step formula's packets are small and the replay (none of the seeded paths long there)
    is long. With the longest path at the relaxation's own chunk times added, the bound rises by more than 1% and
    stays under evaluate()'s ranked time of a fitting layout of the node and of a thin-early split."""
    job, f, model, cluster = fp8_node
    with_paths = tight_node_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model, cluster)
    monkeypatch.setattr(lp_bound, "POLICY", dataclasses.replace(POLICY, lp_path_rounds=0))
    without = tight_node_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model, cluster)
    assert with_paths > without * 1.01
    for split in (FP8_FITS, [3] * 12 + [15, 14, 14, 14]):
        ev = k3opt.evaluate(k3opt.Layout(model="kimi-k3", cluster="gb300-nvl72", gpus=512, rows=1, context=4096,
                                         split=split, recompute="selective", fsdp_lifecycle="per_microbatch",
                                         toggles=FP8_TOGGLES, reserve_gib=4.0, domain_gpus_used=64, **FP8_NODE))
        assert ev.fits
        assert with_paths <= ev.step.rank_time_s


def test_a_rank_s_chunk_times_add_up_to_its_stage(k3_node, monkeypatch):
    """chunk_times shares rank r's stage time t_r among its chunks by their work, so its chunks' replayed times add
    up to t_r, at least T[r] (every resource's sum over r's layers and edges). At every program the node's bound
    solves, each rank's chunk times add up to at least its T[r]: without that row each chunk kept only its own
    floor, and the relaxation replayed K3's ranks at two thirds of their stage (0.176 of 0.266 s a microbatch on
    PP8 VP4 with thin and fat chunks)."""
    job, f, model, cluster = k3_node
    seen = []
    separate = lp_bound._violated_path

    def spy(lp, z, beta):
        seen.append((lp, z.copy()))
        return separate(lp, z, beta)

    monkeypatch.setattr(lp_bound, "_violated_path", spy)
    tight_node_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model, cluster)
    assert seen
    for lp, z in seen:
        for r in range(lp.p):
            chunks = sum(z[lp.CL0 + k * lp.p + r] for k in range(lp.v))
            assert chunks >= z[lp.T0 + r] * (1 - 1e-6) - 1e-9
            assert z[lp.T0 + r] > 0


def test_a_separation_round_cut_by_the_deadline_keeps_the_last_optimum(k3_node, monkeypatch):
    """A GLOP program the search's end cuts returns no certificate. In a separation round that must leave the
    program at its last certified optimum (each path row only raises it), not at 0: with every round's solve cut,
    the node's bound is its bound without separation."""
    job, f, model, cluster = k3_node
    monkeypatch.setattr(lp_bound, "POLICY", dataclasses.replace(POLICY, lp_path_rounds=0))
    without = tight_node_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model, cluster)
    monkeypatch.setattr(lp_bound, "POLICY", POLICY)
    real_glop, real_violated = lp_bound._glop, lp_bound._violated_path
    cut = SimpleNamespace(next=False, rounds=0)

    def violated(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        row = real_violated(*args, **kwargs)
        cut.next = row is not None
        return row

    def glop(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if cut.next:  # the round's solve, cut by the deadline: no certificate
            cut.next, cut.rounds = False, cut.rounds + 1
            return (0.0, None) if kwargs.get("solution") else 0.0
        return real_glop(*args, **kwargs)

    monkeypatch.setattr(lp_bound, "_violated_path", violated)
    monkeypatch.setattr(lp_bound, "_glop", glop)
    cut_rounds = tight_node_bound(job, f, Recompute.SELECTIVE, FsdpLifecycle.PER_MICROBATCH, model, cluster)
    assert cut.rounds > 0
    assert cut_rounds == pytest.approx(without, rel=1e-12)
