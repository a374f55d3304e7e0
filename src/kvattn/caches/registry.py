"""Which cache type implements each spec: one line per type.

A new cache type is one file (its spec, a subclass of `kvattn.caches.base.CacheSpec`, and a class following
`kvattn.caches.base.CacheType`) and one line here; the layer, `kvattn.layer.forward.extend` and the contract
suite (tests/caches/test_contract.py) find it through `cache_type`.
"""

from __future__ import annotations

from kvattn.caches.base import CacheSpec, Contiguous, Paged
from kvattn.caches.contiguous import KVCache
from kvattn.caches.paged import PagedKVCache

__all__ = ["CACHE_TYPES", "cache_type"]

# Values follow `CacheType` (annotated `type`: a protocol with data members allows no run-time `issubclass`).
CACHE_TYPES: dict[type[CacheSpec], type] = {
    Contiguous: KVCache,
    Paged: PagedKVCache,
}


def cache_type(spec: CacheSpec | type[CacheSpec]) -> type:
    """The cache type implementing `spec` (a spec instance or its type): a `kvattn.caches.base.CacheType`."""
    kind = spec if isinstance(spec, type) else type(spec)
    try:
        return CACHE_TYPES[kind]
    except KeyError:
        raise TypeError(f"no cache type implements {kind.__name__}; registered: {[t.__name__ for t in CACHE_TYPES]}")
