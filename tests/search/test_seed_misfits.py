"""The seeding (search/incumbents.seed) skips a shape whose more sharded variant had no fitting layout: at 8,192
GPUs a pipeline depth whose activations never fit has hundreds of FSDP variants, and pricing each took the
seeding's whole time before any fast shape was reached."""

from __future__ import annotations

import math

import pytest

import k3opt
import k3opt.search.incumbents as inc
from k3opt.search.frames import enumerate_frames, frame_of, sharding_group
from k3opt.search.result import PlanItem


@pytest.fixture(scope="module")
def pp2(model, cluster):
    """The default job at 512 GPUs and its PP2 VP4 shapes: 93 layers on two ranks hold 16 microbatches' saved
    activations of ~46 layers each, far over 186 GiB at any FSDP degree."""
    job = k3opt.load_job("k3-512-4k")
    frames = [f for f in enumerate_frames(job, model, 512, cluster) if f.pp == 2 and f.vp == 4]
    most = max(frames, key=lambda f: (f.expert_fsdp * f.dense_fsdp, f.ep))
    group = [f for f in frames if sharding_group(f) == sharding_group(most)]
    less = next(f for f in group if f != most and most.expert_fsdp % f.expert_fsdp == 0
                and most.dense_fsdp % f.dense_fsdp == 0)
    return job, most, less


def _priced(monkeypatch) -> list:
    seen: list = []
    for name in ("price_configs", "frame_walk"):
        fn = getattr(inc, name)

        def wrap(job, f, *a, _fn=fn, **k):
            seen.append(f)
            return _fn(job, f, *a, **k)

        monkeypatch.setattr(inc, name, wrap)
    return seen


def test_seed_skips_the_less_sharded_variant_of_a_misfit(monkeypatch, pp2, model, cluster, reference, reference_eval):
    job, most, less = pp2
    found = {frame_of(reference): PlanItem(reference, reference_eval)}
    seen = _priced(monkeypatch)
    out = inc.seed(job, [most, less], model, cluster, found, math.inf, walk_first=False)
    assert most in seen and most not in out  # priced, and nothing of it fits
    assert less not in seen


def test_seed_still_prices_the_more_sharded_variant_after_a_misfit(monkeypatch, pp2, model, cluster, reference,
                                                                    reference_eval):
    """The skip goes one way only: a less sharded shape that does not fit says nothing of a more sharded one."""
    job, most, less = pp2
    found = {frame_of(reference): PlanItem(reference, reference_eval)}
    seen = _priced(monkeypatch)
    inc.seed(job, [less, most], model, cluster, found, math.inf, walk_first=False)
    assert less in seen and most in seen
