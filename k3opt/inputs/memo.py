"""The model's caches as objects: `Memo` (one builder's results), `register` (a cache kept by hand) and `clear_all`.

A cache is an object built from an ordinary function rather than a decorator on it, so the builder stays a plain
function (mutmut, bench/mutation.sh, leaves decorated functions unmutated), and every cache registers itself here,
so whoever needs cold caches (the test fixtures under mutation testing) clears them all with one call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class _Clearable(Protocol):
    def clear(self) -> None: ...


S = TypeVar("S", bound=_Clearable)

_MEMOS: list[Memo] = []
_STORES: list[_Clearable] = []


class Memo(Generic[P, R]):
    """`builder` memoized by functools.lru_cache(maxsize): the key (the positional and keyword arguments as given),
    the least-recently-used eviction and the counters are lru_cache's. `__wrapped__` is the builder. A module-level
    Memo registers itself (`registered`); one an object owns (cost.coefficients.CostModel's) lives and dies with its
    owner, which is itself reached through a registered store."""

    __slots__ = ("__call__", "__wrapped__")
    __call__: Callable[P, R]
    """The lru_cache wrapper, held in an instance slot: Python finds `__call__` on the class (the slot's descriptor),
    which hands back the wrapper, so a call runs lru_cache's C code with no Python frame in between (the caches sit
    on the search's hot path, hundreds of thousands of calls per plan)."""

    def __init__(self, builder: Callable[P, R], maxsize: int, registered: bool = True) -> None:
        self.__call__ = functools.lru_cache(maxsize=maxsize)(builder)
        self.__wrapped__ = builder
        if registered:
            _MEMOS.append(self)

    def cache_clear(self) -> None:
        """Forgets every result."""
        self.__call__.cache_clear()  # type: ignore[attr-defined]

    def cache_info(self) -> functools._CacheInfo:
        """lru_cache's (hits, misses, maxsize, currsize)."""
        return self.__call__.cache_info()  # type: ignore[attr-defined]


def register(store: S) -> S:
    """Adds a cache kept by hand (anything with `clear()`, e.g. a dict) to those `clear_all` empties; returns it."""
    _STORES.append(store)
    return store


def memos() -> tuple[Memo, ...]:
    """Every Memo made so far."""
    return tuple(_MEMOS)


def clear_all() -> None:
    """Empties every Memo and every registered cache."""
    for memo in _MEMOS:
        memo.cache_clear()
    for store in _STORES:
        store.clear()
