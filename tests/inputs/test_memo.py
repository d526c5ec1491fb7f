"""The caches of the cost model, the inputs and the search are Memos registered in k3opt.inputs.memo: clear_all()
empties each, no functools cache is left outside the registry, and a Memo keeps lru_cache's keys and eviction."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import k3opt
import k3opt.search
from k3opt.cost import coefficients, structure
from k3opt.cost.coefficients import Shape
from k3opt.inputs import memo
from k3opt.inputs.memo import Memo
from k3opt.inputs.specs import FsdpLifecycle, Recompute, Toggles


def _modules() -> list[ModuleType]:
    """Every module of k3opt.cost, k3opt.inputs and k3opt.search."""
    out = []
    for package in (k3opt.cost, k3opt.inputs, k3opt.search):
        for info in pkgutil.iter_modules(package.__path__):
            out.append(importlib.import_module(f"{package.__name__}.{info.name}"))
    return out


def test_every_cache_is_a_registered_memo() -> None:
    registered = {id(m) for m in memo.memos()}
    unregistered = [f"{mod.__name__}.{name}" for mod in _modules() for name, obj in vars(mod).items()
                    if hasattr(obj, "cache_clear") and not isinstance(obj, type)
                    and not (isinstance(obj, Memo) and id(obj) in registered)]
    assert unregistered == []
    memos = [f"{mod.__name__}.{name}" for mod in _modules() for name, obj in vars(mod).items()
             if isinstance(obj, Memo)]
    assert len(memos) >= 19, memos  # the scan sees the caches: 9 of the cost model and inputs, 10 of the search


def test_clear_all_empties_every_memo_and_registered_store(model, cluster) -> None:
    shape = Shape(gpus=512, pp=4, vp=2, cp=1, ep=32, expert_fsdp=2, dense_fsdp=32, microbatches=16, rows=1,
                  context=4096, document_length=4096, recompute=Recompute.SELECTIVE,
                  fsdp_lifecycle=FsdpLifecycle.PER_MICROBATCH, toggles=Toggles(), domain_gpus_used=64)
    cf = coefficients.coefficients(shape, model, cluster)
    owner = coefficients.cost_model(model, cluster)
    assert cf.cost is owner and owner.coefficients.cache_info().currsize > 0
    assert structure._CACHE and coefficients._SPEC_JSON
    memo.clear_all()
    assert [m.__wrapped__.__qualname__ for m in memo.memos() if m.cache_info().currsize] == []
    assert not structure._CACHE and not coefficients._SPEC_JSON
    # The CostModel and its caches are dropped with it: the next call builds a new one, from empty caches.
    again = coefficients.cost_model(model, cluster)
    assert again is not owner and again.coefficients.cache_info().currsize == 0


def test_a_cost_model_owns_its_caches_unregistered_and_the_registry_keeps_a_few(model, cluster) -> None:
    """A CostModel's Memos are its own (not in the module registry, which would keep every CostModel alive), and
    past the registry's size the oldest CostModel is dropped."""
    owner = coefficients.cost_model(model, cluster)
    registered = {id(m) for m in memo.memos()}
    own = [m for m in vars(owner).values() if isinstance(m, Memo)]
    assert len(own) >= 8 and not any(id(m) in registered for m in own)
    others = [coefficients.cost_model(model, cluster.model_copy(update={"nic_gbps": cluster.nic_gbps + i}))
              for i in range(1, coefficients._MAX_COST_MODELS + 1)]
    assert len({id(o) for o in others}) == len(others)
    assert coefficients.cost_model(model, cluster) is not owner  # the oldest was dropped


def test_a_memo_evicts_the_least_recently_used_result() -> None:
    calls: list[int] = []

    def square(x: int) -> int:
        calls.append(x)
        return x * x

    cached = Memo(square, maxsize=2)
    assert cached.__wrapped__ is square
    assert (cached(1), cached(2), cached(1)) == (1, 4, 1)  # 2 is now the least recently used
    assert calls == [1, 2]
    assert cached(3) == 9  # evicts 2
    assert (cached(1), cached(3)) == (1, 9) and calls == [1, 2, 3]
    assert cached(2) == 4 and calls == [1, 2, 3, 2]
    info = cached.cache_info()
    assert (info.hits, info.misses, info.maxsize, info.currsize) == (3, 4, 2, 2)
    cached.cache_clear()
    assert cached.cache_info().currsize == 0


def test_a_memo_keys_like_lru_cache() -> None:
    """Positional and keyword arguments are separate keys, as in functools.lru_cache."""
    calls: list[tuple[int, int]] = []

    def add(a: int, b: int = 0) -> int:
        calls.append((a, b))
        return a + b

    cached = Memo(add, maxsize=8)
    assert (cached(1, 2), cached(1, 2), cached(1, b=2), cached(1, b=2), cached(1)) == (3, 3, 3, 3, 1)
    assert calls == [(1, 2), (1, 2), (1, 0)]


def test_register_returns_the_store_and_clear_all_empties_it() -> None:
    store = memo.register({"k": 1})
    assert store == {"k": 1}
    memo.clear_all()
    assert store == {}
