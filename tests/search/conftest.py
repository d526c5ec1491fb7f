"""Shared fixtures of the search tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import k3opt


@pytest.fixture(scope="module")
def dsv3_b200_node() -> SimpleNamespace:
    """DeepSeek-V3 on 512 B200 at 8K, 4,194,304 tokens per update, 4-GiB reserve, and its PP8 VP4 EP8 eFSDP1
    dFSDP64 optim shape (61 layers in 32 chunks, LM head and MTP head on the last); `witness`: the split that
    shape's full-recompute per_microbatch CP-SAT model found in 60 s."""
    from k3opt.search import enumerate_frames

    job = k3opt.Job.model_validate({"model": "deepseek-v3", "cluster": "b200", "gpus": 512, "context": 8192,
                                    "tokens_per_update": 4194304, "reserve_gib": 4.0})
    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("b200")
    frame = next(g for g in enumerate_frames(job, model, 512, cluster)
                 if (g.pp, g.vp, g.ep, g.expert_fsdp, g.dense_fsdp) == (8, 4, 8, 1, 64)
                 and g.dense_sharding == "optim")
    witness = [2, 2, 1] + [2] * 12 + [1] + [2] * 8 + [1, 2, 3, 2, 2, 2, 2, 1]
    assert sum(witness) == model.num_layers
    return SimpleNamespace(job=job, model=model, cluster=cluster, frame=frame, witness=witness)
