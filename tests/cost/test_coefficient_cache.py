"""The coefficient caches never hand one shape another shape's figures.

The cost model shares parts of a build between shapes (k3opt.cost.coefficients: the per-layer arrays of a LayerShape,
the achievable tensor time, the saved set, the pipeline terms; k3opt.search.ranking: the ranked views). Each part
is keyed by the fields it reads. These tests build varied shapes of the K3 model and of smaller models through
the caches, each right after a partner that differs from it in one field only (so a key that left that field out
would return the partner's arrays), and compare every field, array by array, with a build of the same shape from
empty caches. The last tests break a key on purpose and check that the comparison sees it.

The caches of one (model, cluster, rates) belong to its CostModel (k3opt.cost.coefficients.cost_model): a spec object
equal to one already seen (a fresh copy) gets the same CostModel and the same coefficients; a different one, its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import peak_roofline_cluster

import k3opt
from k3opt.cost import coefficients as C
from k3opt.cost import schedule
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import rates_for
from k3opt.inputs.specs import Dtype, FsdpLifecycle, Precision, Recompute, ShardGranularity, ShardingPolicy, Toggles
from k3opt.search import ranking


def _clear_shape_caches() -> None:
    """Empty every cache a shape's fields reach: the module-level Memos of the cost model, the schedule and the
    ranking view, and the Memos of every CostModel in use (its `static` arrays, the same for every shape, kept)."""
    for mod in (C, schedule, ranking):
        for obj in vars(mod).values():
            if hasattr(obj, "cache_clear") and not isinstance(obj, type):
                obj.cache_clear()
    for cm in C._COST_MODELS.values():
        for obj in vars(cm).values():
            if hasattr(obj, "cache_clear"):
                obj.cache_clear()


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _differences(x: C.Coefficients, y: C.Coefficients) -> list[str]:
    return [f.name for f in dataclasses.fields(x) if not _same(getattr(x, f.name), getattr(y, f.name))]


BASE = dict(gpus=512, pp=4, vp=2, cp=1, ep=32, expert_fsdp=2, dense_fsdp=32, microbatches=16, rows=1, context=4096,
            document_length=4096, recompute=Recompute.SELECTIVE, fsdp_lifecycle=FsdpLifecycle.PER_MICROBATCH,
            toggles=Toggles(), domain_gpus_used=64)

# One field changed at a time: every field of Shape outside the parallel degrees, every toggle.
FIELD_VARIANTS: list[dict] = [
    {},
    {"vp": 1}, {"vp": 3}, {"microbatches": 32},
    {"rows": 2}, {"context": 8192, "document_length": 8192}, {"document_length": 1024},
    {"recompute": Recompute.NONE}, {"recompute": Recompute.FULL},
    {"fsdp_lifecycle": FsdpLifecycle.ACCUMULATE},
    {"dense_sharding": ShardingPolicy.OPTIM}, {"dense_sharding": ShardingPolicy.NO_SHARD},
    {"expert_sharding": ShardingPolicy.OPTIM_GRADS}, {"expert_sharding": ShardingPolicy.NO_SHARD},
    {"dense_sharding": ShardingPolicy.OPTIM, "optimizer_shard_granularity": ShardGranularity.TENSOR},
    {"grad_dtype": Dtype.BF16}, {"optimizer_state_dtype": Dtype.BF16},
    {"fp8_block_size": 32}, {"ce_chunk_tokens": 512}, {"ep_overlap": True},
    *({"toggles": Toggles(**{t: True})} for t in Toggles.model_fields),
    {"toggles": Toggles(fused_cross_entropy=True, balance_activations=True)},
]
# The parallel degrees, the placement and the precision of the K3 shapes (512 GPUs, 64-GPU domains).
K3_VARIANTS: list[dict] = [
    {"ep": 64}, {"ep": 8, "expert_fsdp": 16}, {"expert_fsdp": 4}, {"expert_fsdp": 1},
    {"dense_fsdp": 64}, {"dense_fsdp": 1}, {"cp": 2}, {"cp": 2, "recompute": Recompute.FULL},
    {"pp": 8}, {"pp": 8, "vp": 1}, {"pp": 2}, {"gpus": 1024}, {"domain_gpus_used": 72}, {"domain_gpus_used": 8},
    {"precision": Precision.FP8}, {"precision": Precision.MXFP8}, {"precision": Precision.NVFP4},
    {"dispatcher": "deepep"}, {"dispatcher": "hybridep"},
]


def _shapes(base: dict, variants: list[dict]) -> Iterator[Shape]:
    for v in variants:
        yield Shape(**{**base, **v})


def _through_caches(shapes: list[Shape], build: Callable[[Shape], C.Coefficients]) -> list[C.Coefficients]:
    """Each shape right after the base shape (its partner differing in the variant's fields), then each shape
    again after the whole list: a cached part keyed without a field hands out the partner's arrays."""
    _clear_shape_caches()
    out = []
    for s in shapes:
        build(shapes[0])
        out.append(build(s))
    for s, first in zip(shapes, out, strict=True):
        again = build(s)
        assert not _differences(first, again), s
    return out


def _fresh(shape: Shape, build: Callable[[Shape], C.Coefficients]) -> C.Coefficients:
    _clear_shape_caches()
    return build(shape)


def _mismatches(shapes: list[Shape], build: Callable[[Shape], C.Coefficients]) -> dict[int, list[str]]:
    cached = _through_caches(shapes, build)
    out = {}
    for i, (s, cf) in enumerate(zip(shapes, cached, strict=True)):
        diff = _differences(cf, _fresh(s, build))
        if diff:
            out[i] = diff
    return out


@pytest.fixture(scope="module")
def k3() -> tuple[k3opt.ModelSpec, k3opt.ClusterSpec]:
    return k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")


def test_k3_shapes_through_the_caches_equal_fresh_builds(k3):
    model, cluster = k3
    shapes = list(_shapes(BASE, FIELD_VARIANTS + K3_VARIANTS))
    assert len(shapes) > 50
    assert _mismatches(shapes, lambda s: coefficients(s, model, cluster)) == {}


def test_k3_ranked_views_and_work_floors_equal_fresh_builds(k3):
    """The views the search ranks by (achievable arrays) and their work floors, through their own caches."""
    model, cluster = k3
    shapes = list(_shapes(BASE, FIELD_VARIANTS + K3_VARIANTS))
    assert _mismatches(shapes, lambda s: ranking.ranked_coefficients(s, model, cluster)) == {}
    assert _mismatches(shapes, lambda s: ranking.work_floor(s, model, cluster)) == {}


@pytest.mark.parametrize("model_name, cluster_name, base, variants", [
    # The 4-layer K3 proxy (MLA + KDA, MoE, AttnRes) on B200 (8-GPU domains: EP and FSDP cross the NIC).
    ("kimi-k3-4layer-proxy", "b200",
     dict(BASE, gpus=64, pp=2, vp=1, ep=8, expert_fsdp=2, dense_fsdp=8, microbatches=8, domain_gpus_used=None),
     [{"ep": 4}, {"ep": 2, "expert_fsdp": 4}, {"dense_fsdp": 2}, {"pp": 1}, {"cp": 2}, {"vp": 2},
      {"precision": Precision.MXFP8}]),
    # A dense GQA model (no MoE arrays) on H200's hardware without a rates file (no achievable arrays).
    ("llama3-70b", "h200-sxm-peak",
     dict(BASE, gpus=64, pp=4, vp=1, ep=1, expert_fsdp=1, dense_fsdp=8, microbatches=8, domain_gpus_used=None),
     [{"dense_fsdp": 2}, {"dense_fsdp": 16}, {"pp": 1}, {"pp": 8}, {"cp": 2}, {"vp": 2},
      {"precision": Precision.FP8}]),
])
def test_small_models_through_the_caches_equal_fresh_builds(model_name, cluster_name, base, variants):
    model = k3opt.load_model(model_name)
    peak = cluster_name.removesuffix("-peak")
    cluster = peak_roofline_cluster(peak) if peak != cluster_name else k3opt.load_cluster(cluster_name)
    shapes = list(_shapes(base, FIELD_VARIANTS + variants))
    assert _mismatches(shapes, lambda s: coefficients(s, model, cluster)) == {}


# ------------------------------------------------------------------ the comparison sees a stale key
def _blind(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> None:
    """Make `cls` compare and hash as if it had no field `name`: a cache key that left the field out."""
    keep = [f.name for f in dataclasses.fields(cls) if f.name != name]

    def key(x: object) -> tuple:
        return tuple(getattr(x, k) for k in keep)

    monkeypatch.setattr(cls, "__eq__", lambda x, y: type(x) is type(y) and key(x) == key(y))
    monkeypatch.setattr(cls, "__hash__", lambda x: hash(key(x)))


@pytest.mark.parametrize("cls, name, variant, field_seen", [
    (C.LayerShape, "grad_dtype", {"grad_dtype": Dtype.BF16}, "grads"),
    (C.LayerShape, "toggles", {"toggles": Toggles(p2p_muon=True)}, "update"),
    (C.LayerShape, "dispatcher", {"dispatcher": "deepep"}, "achievable"),
    (C.LayerShape, "recompute", {"recompute": Recompute.FULL}, "act"),
    (Shape, "microbatches", {"microbatches": 32}, "slots"),
])
def test_a_key_without_a_field_is_caught(k3, monkeypatch, cls, name, variant, field_seen):
    """A key blind to one field hands the second shape of a pair the first one's figures; the comparison with a
    fresh build reports them."""
    model, cluster = k3
    _blind(monkeypatch, cls, name)
    shapes = list(_shapes(BASE, [{}, variant]))
    cached = _through_caches(shapes, lambda s: coefficients(s, model, cluster))
    monkeypatch.undo()
    fresh = _fresh(shapes[1], lambda s: coefficients(s, model, cluster))
    assert field_seen in _differences(cached[1], fresh)
    _clear_shape_caches()


def test_an_achievable_tensor_key_without_ep_is_caught(k3, monkeypatch):
    """The achievable tensor time keyed without EP (every shape priced at the first one's experts per rank) gives
    the routed GEMMs the wrong size factor: the comparison must report the achievable arrays."""
    model, cluster = k3
    cm = C.cost_model(model, cluster)
    real = cm.achievable_tensor
    first_ep: list[int] = []

    def forgetful(T, ep, *rest):  # noqa: ANN001, ANN202
        first_ep.append(ep)
        return real(T, first_ep[0], *rest)

    monkeypatch.setattr(cm, "achievable_tensor", forgetful)
    shapes = list(_shapes(BASE, [{}, {"ep": 64}]))
    cached = _through_caches(shapes, lambda s: coefficients(s, model, cluster))
    monkeypatch.undo()
    fresh = _fresh(shapes[1], lambda s: coefficients(s, model, cluster))
    assert "achievable" in _differences(cached[1], fresh)
    _clear_shape_caches()


def test_cached_arrays_are_read_only(k3):
    """Shapes of one key share their arrays: writing into one would change the others' figures."""
    model, cluster = k3
    cf = coefficients(Shape(**BASE), model, cluster)
    with pytest.raises(ValueError, match="read-only"):
        cf.act[0] = 0.0
    with pytest.raises(ValueError, match="read-only"):
        cf.achievable["tensor"][0] = 0.0


@pytest.mark.parametrize("extra", [
    {"toggles": {"fused_cross_entropy": True}},
    {"toggles": {"activation_offload": True}},
    {"toggles": {"pipeline_zero2_host_grads": True, "dispatch_recompute": True}},
    {"recompute": Recompute.FULL, "toggles": {}},
    {"recompute": Recompute.NONE, "toggles": {"fp8_activations": True}},
], ids=["fused-ce", "offload", "zero2-dispatch", "full", "none-fp8act"])
def test_activation_balancing_shares_the_layer_build(k3, extra):
    """Balancing changes the in-flight count only: a shape with it and one without share one build of the
    per-layer arrays, and the builder itself reads no balancing (so the shared key loses nothing), under the
    toggles and recompute modes that change what a layer saves."""
    model, cluster = k3
    base = {**BASE, **{k: v for k, v in extra.items() if k != "toggles"}}
    on = Shape(**{**base, "toggles": Toggles(balance_activations=True, **extra["toggles"])})
    off = Shape(**{**base, "toggles": Toggles(**extra["toggles"])})
    a, b = coefficients(on, model, cluster), coefficients(off, model, cluster)
    assert a.act is b.act and a.time["tensor"] is b.time["tensor"]
    assert a.balanced_inflight is not None and b.balanced_inflight is None
    key = C.LayerShape.of(off, a.placement)
    build = C.cost_model(model, cluster).layer_terms.__wrapped__  # the uncached build
    raw_on = build(dataclasses.replace(key, toggles=on.toggles))
    raw_off = build(key)
    assert raw_on.keys() == raw_off.keys()
    assert [k for k in raw_on if not _same(raw_on[k], raw_off[k])] == []


# The CostModel of a spec object not seen before.

def test_a_fresh_equal_spec_object_gets_the_same_cost_model_and_a_changed_one_its_own():
    model, cluster = k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200")
    lay = k3opt.make_layout(gpus=16, pp=2, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=2, context=4096,
                            split=[24, 24])
    a = coefficients(Shape.of(lay), model, cluster)
    fresh_model, fresh_cluster = model.model_copy(deep=True), cluster.model_copy(deep=True)
    b = coefficients(Shape.of(lay), fresh_model, fresh_cluster)
    assert b.cost is a.cost is C.cost_model(model, cluster)
    assert a.cost.model == model and a.cost.cluster == cluster and a.cost.rates == rates_for(cluster)
    np.testing.assert_array_equal(b.master, a.master)
    np.testing.assert_array_equal(b.time["nvlink"], a.time["nvlink"])
    # Half the NVLink bandwidth: another CostModel, whose NVLink seconds double (EP 8 and dense FSDP 8 exchange
    # inside the 8-GPU domains at the peak rate).
    slow = cluster.model_copy(update={"nvlink_gbps": cluster.nvlink_gbps / 2})
    c = coefficients(Shape.of(lay), model, slow)
    assert c.cost is not a.cost and c.cost.cluster == slow
    assert a.time["nvlink"].sum() > 0
    np.testing.assert_allclose(c.time["nvlink"], 2 * a.time["nvlink"])
