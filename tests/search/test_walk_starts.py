"""The seeding's walks of the fastest layouts' frames (search/incumbents.frame_walk with `without_offload`) start
twice where the activation offload is free: from the leanest configuration and from the leanest without the
offload. Under the offload, dropping another memory saving can add host-link traffic instead of saving time, so a
walk from the leanest alone can end where the configurations without the offload are never met (Kimi K2 on 256
GB200, PP2 VP4: 7.530 s, against 7.245 s from the second start). Other walks start once."""

from __future__ import annotations

import math

import k3opt.search.incumbents as inc
from k3opt.inputs.specs import Recompute
from k3opt.search.frames import enumerate_frames


def _starts(monkeypatch) -> list:
    calls: list = []
    real = inc._walk

    def spy(job, f, model, cluster, deadline, runtime=None, start=None):
        calls.append(start)
        return real(job, f, model, cluster, deadline, runtime, start)

    monkeypatch.setattr(inc, "_walk", spy)
    return calls


def _frame(job, tiny):
    return next(g for g in enumerate_frames(job, tiny, 8) if g.vp == 1 and g.dense_fsdp == 4)


def test_a_lead_walk_starts_again_without_the_offload(tiny, slow, pp2_job, monkeypatch):
    f = _frame(pp2_job, tiny)
    calls = _starts(monkeypatch)
    out = inc.frame_walk(pp2_job, f, tiny, slow, math.inf, without_offload=True)
    # pp2_job leaves two toggles free (FP8 activations and the offload) and recompute none or full: the second
    # start is full recompute (the leanest) with FP8 activations on and the offload off.
    assert len(calls) == 2 and calls[0] is None
    second = calls[1]
    assert second.recompute == Recompute.FULL
    assert second.toggles.fp8_activations and not second.toggles.activation_offload
    assert any(it.layout == second for it in out)  # the second start is a layout the walk returns


def test_other_walks_start_once(tiny, slow, pp2_job, monkeypatch):
    f = _frame(pp2_job, tiny)
    calls = _starts(monkeypatch)
    first = inc.frame_walk(pp2_job, f, tiny, slow, math.inf)
    assert calls == [None] and first
    # A given start is walked from alone, the second start asked for or not.
    calls.clear()
    inc.frame_walk(pp2_job, f, tiny, slow, math.inf, start=first[0].layout, without_offload=True)
    assert calls == [first[0].layout]


def test_one_start_where_the_offload_is_not_free(tiny, slow, pp2_job, monkeypatch):
    job = pp2_job.model_copy(update={"search": pp2_job.search.model_copy(
        update={"forbid_toggles": [*pp2_job.search.forbid_toggles, "activation_offload"]})})
    calls = _starts(monkeypatch)
    inc.frame_walk(job, _frame(job, tiny), tiny, slow, math.inf, without_offload=True)
    assert calls == [None]


def test_the_seeding_gives_its_lead_walks_the_second_start(tiny, slow, pp2_job, monkeypatch):
    frames = enumerate_frames(pp2_job, tiny, 8)
    start = inc.incumbents(pp2_job, [((False, 0), f) for f in frames], tiny, slow, 1, 5.0, math.inf)
    seen: list[bool] = []
    real = inc.frame_walk

    def spy(*a, **k):
        seen.append(k.get("without_offload", False))
        return real(*a, **k)

    monkeypatch.setattr(inc, "frame_walk", spy)
    inc.seed(pp2_job, frames, tiny, slow, dict(start), math.inf)
    assert seen and seen[0] is True  # the first walks are the leads'
