"""The cache types: how keys and values are stored, written and read.

A layer takes its cache as a spec (`Contiguous`, `Paged`: `kvattn.caches.base`); the registry
(`kvattn.caches.registry`) maps each spec type to the cache type implementing it (`contiguous`, with its ring,
and `paged`). Importing this package loads only the specs, so the leaf `kvattn.config` can hold one;
`cache_type` loads the implementations on first use.
"""

from __future__ import annotations

import importlib

from kvattn.caches.base import CacheSpec, CacheType, Contiguous, Paged

__all__ = ["CacheSpec", "CacheType", "Contiguous", "Paged", "cache_type"]


def __getattr__(name: str):
    """`cache_type`, imported on first use (the implementations import `kvattn.config`, which imports the specs)."""
    if name != "cache_type":
        raise AttributeError(f"module 'kvattn.caches' has no attribute {name!r}")
    return importlib.import_module("kvattn.caches.registry").cache_type
