"""Placement default of a job: GPUs spread evenly over the fewest NVLink domains that hold them."""

from __future__ import annotations

import pytest

from k3opt import load_cluster, load_model
from k3opt.inputs.specs import FsdpLifecycle, Job, Recompute
from k3opt.search.frames import ActMode, enumerate_frames, frame_shape, layout_of


@pytest.mark.parametrize(("gpus", "domain", "want"), [
    (512, 72, 64),     # ceil(512 / 72) = 8 racks; 512 / 8 = 64 per rack
    (256, 72, 64),     # 4 racks x 64
    (144, 72, None),   # 2 whole racks
    (576, 72, None),   # 8 whole racks
    (64, 72, None),    # one rack holds it
    (8192, 72, None),  # 114 racks: 8192 / 114 is not a whole number, so whole racks
    (1000, 72, None),  # 14 racks: 1000 / 14 is not whole
    (130, 72, 65),     # 2 racks x 65
    (512, 8, None),    # HGX: 64 whole 8-GPU domains
])
def test_even_share_of_the_fewest_domains(gpus: int, domain: int, want: int | None) -> None:
    assert Job(gpus=gpus, tokens_per_update=16_777_216).domain_gpus_for(gpus, domain) == want


def test_the_job_value_wins() -> None:
    assert Job(gpus=512, tokens_per_update=16_777_216, domain_gpus_used=72).domain_gpus_for(512, 72) == 72
    assert Job(gpus=512, tokens_per_update=16_777_216, domain_gpus_used=32).domain_gpus_for(512, 72) == 32


def test_plain_512_gpu_job_plans_on_8_racks_of_64() -> None:
    """Every frame, shape and planned layout of a job without domain_gpus_used carries 64 on NVL72."""
    job = Job(gpus=[512, 576], context=4096, tokens_per_update=16_777_216, reserve_gib=5)
    model, cluster = load_model("kimi-k3"), load_cluster("gb200-nvl72")
    frames = enumerate_frames(job, model, 512, cluster)
    assert frames and {f.domain_gpus_used for f in frames} == {64}
    assert {f.domain_gpus_used for f in enumerate_frames(job, model, 576, cluster)} == {None}
    f = frames[0]
    shape = frame_shape(job, f, ActMode(Recompute.FULL, False, False, False, False), FsdpLifecycle.PER_MICROBATCH)
    assert shape.domain_gpus_used == 64
    k = f.pp * f.vp
    lay = layout_of(job, f, shape, [93 // k] * (k - 1) + [93 - (93 // k) * (k - 1)])
    assert lay.domain_gpus_used == 64
