"""The coefficients' cache key: a spec's JSON, memoized per spec object (k3opt.cost.coefficients._spec_json). A spec
object the memo has not seen (a fresh copy) takes the serializing path and must give the same key and the same
coefficients as the original, whatever the memo held before."""

from __future__ import annotations

import numpy as np

import k3opt
from k3opt.cost.coefficients import Shape, coefficients


def test_a_fresh_spec_object_gets_the_key_pydantic_serializes_and_the_same_coefficients():
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    lay = k3opt.make_layout(gpus=16, pp=2, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=2, context=4096,
                            split=[24, 24])
    a = coefficients(Shape.of(lay), model, cluster)
    fresh_model, fresh_cluster = model.model_copy(deep=True), cluster.model_copy(deep=True)
    b = coefficients(Shape.of(lay), fresh_model, fresh_cluster)
    assert b.model_json == a.model_json == model.model_dump_json()
    np.testing.assert_array_equal(b.master, a.master)
    np.testing.assert_array_equal(b.time["nvlink"], a.time["nvlink"])
