"""Shared fixtures: the shipped K3 model, the GB200 preset and the seed-000 reference layout."""

from __future__ import annotations

import os

import pytest

import k3opt
from k3opt import coefficients, schedule, structure


@pytest.fixture(autouse=True)
def _fresh_cost_model_caches():
    """Under mutation testing (bench/mutation.sh) every test recomputes the cost model instead of reading a result
    cached from another test or from mutmut's own clean run."""
    if "MUTANT_UNDER_TEST" in os.environ:
        for fn in (coefficients._static, coefficients._saved, coefficients._placement, coefficients._coefficients,
                   schedule.inflight_compositions):
            fn.cache_clear()
        structure._CACHE.clear()
    yield


@pytest.fixture(scope="session")
def model() -> k3opt.ModelSpec:
    return k3opt.load_model("kimi-k3")


@pytest.fixture(scope="session")
def cluster() -> k3opt.ClusterSpec:
    return k3opt.load_cluster("gb200-nvl72")


@pytest.fixture(scope="session")
def reference() -> k3opt.Layout:
    return k3opt.load_layout("k3-gb200-512-reference")


@pytest.fixture(scope="session")
def reference_eval(reference, model, cluster) -> k3opt.Evaluation:
    return k3opt.evaluate(reference, model=model, cluster=cluster)
