"""The node model's rank-ledger submodel (k3opt.search.rank_ledger), on its own: built from the ledger's
declarations, it prices every declared term once, in the form each decision selects, never under evaluate()'s
bytes and within its KiB rounding above them; a new summed term needs only its declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import least_value

import k3opt
from k3opt.cost.ledger import LEDGER, Aggregate, Phase, TermDecl
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import TOGGLE_NAMES, FsdpLifecycle
from k3opt.search import enumerate_frames, rank_ledger
from k3opt.search.node_model import FrameModel

DATA = Path(__file__).parents[1] / "data"
KIB = 1024
SPLIT = [2, 1, 1, 2]

# (recompute, lifecycle, toggles on, split): each rank toggle on somewhere, each ledger term's variants reached;
# PP2 VP1 at [1, 5] leaves rank 0 with only the dense layer 0 (no MoE buffers or routing map there).
CASES = [
    ("none", "per_microbatch", (), SPLIT),
    ("none", "per_microbatch", ("pipeline_zero2_host_grads", "fused_cross_entropy", "p2p_muon"), SPLIT),
    ("full", "accumulate", ("fp8_activations", "activation_offload"), SPLIT),
    ("none", "per_microbatch", ("moonep", "balance_activations"), SPLIT),
    ("none", "per_microbatch", (), [1, 5]),
    ("none", "per_microbatch", ("moonep",), [1, 5]),
]


def _pinned(rc: str, lc: str, on: tuple[str, ...], tiny,  # noqa: ANN001 - a fixture
            split: list[int] = SPLIT) -> tuple[k3opt.Job, object, k3opt.Layout]:
    """A job whose space is one PP2 layout of the tiny model (VP2 at SPLIT, or VP1), its frame and the layout."""
    vp = len(split) // 2
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 0.0,
        "search": {"pp": [2], "vp": [vp], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "dense_sharding": ["optim_grads_params"], "recompute": [rc], "fsdp_lifecycle": [lc],
                   "require_toggles": list(on), "forbid_toggles": [t for t in TOGGLE_NAMES if t not in on],
                   "split": split}})
    (f,) = enumerate_frames(job, tiny, 8)
    lay = make_layout(gpus=8, pp=2, vp=vp, ep=2, expert_fsdp=1, dense_fsdp=2, microbatches=f.microbatches,
                      context=2048, split=split, recompute=rc, fsdp_lifecycle=lc, toggles=dict.fromkeys(on, True),
                      reserve_gib=0.0, dense_sharding="optim_grads_params", expert_sharding=f.expert_sharding)
    return job, f, lay



@pytest.mark.parametrize(("rc", "lc", "on", "split"), CASES)
def test_each_part_is_evaluates_bytes_rounded_up(tiny, slow, rc, lc, on, split):
    """Every part at its least (the decisions pinned) lies at or above evaluate()'s bytes of its terms, and at most
    one KiB per layer, edge and in-flight copy above them; the peak likewise."""
    job, f, lay = _pinned(rc, lc, on, tiny, split)
    ev = k3opt.evaluate(lay, model=tiny, cluster=slow)
    fm = FrameModel(job, f, tiny, slow)
    for r, rank in enumerate(ev.ranks):
        led = fm.ranks[r]["ledger"]
        assert sorted(k for p in led.parts for k in p.keys) == sorted(t.key for t in LEDGER)
        layers = sum(e - s for s, e in rank.chunks) + 2
        for part in led.parts:
            want = sum(rank.ledger[k] for k in part.keys)
            slack = KIB * len(part.keys) * layers * (1 + int(rank.in_flight + 1))
            got = least_value(fm, part.expr) * KIB
            assert want <= got <= want + slack, (r, part.keys, got, want)
            assert (got == 0) == (want == 0), (r, part.keys, got, want)
        peak = least_value(fm, led.peak) * KIB
        assert rank.peak_bytes <= peak <= rank.peak_bytes + 16 * KIB * layers * (1 + int(rank.in_flight + 1))


def test_the_logits_on_the_last_rank_by_hand(tiny, slow):
    """[T, vocab] BF16 logits + FP32 softmax: T = 2,048 tokens, vocab 32,768: 2,048 x 32,768 x 6 B = 393,216 KiB
    on the rank holding the last chunk (rank 1 of PP2), none on rank 0; fused cross entropy holds one 1,024-token
    chunk, 196,608 KiB."""
    for on, want in (((), 393_216), (("fused_cross_entropy",), 196_608)):
        job, f, _ = _pinned("none", "per_microbatch", on, tiny)
        fm = FrameModel(job, f, tiny, slow)
        assert least_value(fm, fm.ranks[1]["ledger"].part("logits").expr) == want
        assert least_value(fm, fm.ranks[0]["ledger"].part("logits").expr) == 0


def test_zero2_grads_take_their_declared_chunk_pair_form(tiny, slow):
    """Pipeline ZeRO-2 holds two FP32 buffers of the rank's largest chunk instead of the FP32 gradient shard: the
    part differs from the plain form and equals 2 x the largest chunk's buffer (KiB per layer, rounded up)."""
    job, f, _ = _pinned("none", "per_microbatch", ("pipeline_zero2_host_grads",), tiny)
    fm = FrameModel(job, f, tiny, slow)
    buf = fm.on["pipeline_zero2_host_grads"].chunk_grad_buffer
    kib = [-(-int(b) // KIB) for b in buf]
    # Rank 0 holds chunks 0 (layers 0-1 and the first edge) and 2 (layer 3).
    want = 2 * max(kib[0] + kib[1] + kib[6], kib[3])
    assert least_value(fm, fm.ranks[0]["ledger"].part("grads").expr) == want
    plain = [-(-int(g) // KIB) for g in fm.c0.grads]
    assert want != plain[0] + plain[1] + plain[3] + plain[6]


def test_a_new_summed_term_needs_only_its_declaration(tiny, slow, monkeypatch):
    """A persistent term summed over the rank's layers, declared and nothing else, raises each rank's peak by its
    coefficient's sum over the rank's layers (here a second copy of the FP32 master shard)."""
    job, f, _ = _pinned("none", "per_microbatch", (), tiny)
    before = FrameModel(job, f, tiny, slow)
    extra = TermDecl("master_copy", Phase.PERSISTENT, Aggregate.LAYER_SUM, "master", None, "derived", "test")
    monkeypatch.setattr(rank_ledger, "LEDGER", (*LEDGER, extra))
    after = FrameModel(job, f, tiny, slow)
    master = [-(-int(b) // KIB) for b in before.c0.master]
    for r, layers in ((0, [0, 1, 3, 6]), (1, [2, 4, 5, 7])):
        grown = least_value(after, after.ranks[r]["ledger"].peak) - least_value(before, before.ranks[r]["ledger"].peak)
        assert abs(grown - sum(master[i] for i in layers)) <= len(layers)  # the shared rounding of the fixed sums


def test_a_term_declared_twice_is_refused(tiny, slow, monkeypatch):
    """A term declared twice stops the model instead of being counted twice in the peak (every aggregation has a
    builder, so a term no builder prices cannot be declared)."""
    job, f, _ = _pinned("none", "per_microbatch", (), tiny)
    twice = dataclasses.replace(LEDGER[0])
    monkeypatch.setattr(rank_ledger, "LEDGER", (*LEDGER, twice))
    with pytest.raises(ValueError, match="priced twice"):
        FrameModel(job, f, tiny, slow)


def test_the_lifecycle_chosen_selects_the_accumulation_buffer(tiny, slow):
    """With both FSDP lifecycles open, the unsharded FP32 accumulation buffer is held exactly when the model
    chooses `accumulate`, at evaluate()'s bytes rounded up per layer, and not at all under `per_microbatch`."""
    job, f, _ = _pinned("none", "per_microbatch", (), tiny)
    job = job.model_copy(update={"search": job.search.model_copy(
        update={"fsdp_lifecycle": [FsdpLifecycle.PER_MICROBATCH, FsdpLifecycle.ACCUMULATE]})})
    for lc in FsdpLifecycle:
        _, _, lay = _pinned("none", lc.value, (), tiny)
        want = k3opt.evaluate(lay, model=tiny, cluster=slow).ranks[0].ledger["grad_accum"]
        fm = FrameModel(job, f, tiny, slow)
        fm.m.add(fm.lv[lc] == 1)
        got = least_value(fm, fm.ranks[0]["ledger"].part("grad_accum").expr) * KIB
        assert want <= got <= want + 4 * KIB
        assert (got > 0) == (lc is FsdpLifecycle.ACCUMULATE)
