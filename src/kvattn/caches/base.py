"""What a cache type is: a spec per kind (what a user sets about storage), the interface every type provides.

A layer takes its cache as a spec, `Contiguous(...)` or `Paged(...)`, frozen
data normalised once (NumPy integers become `int`, dtypes their names);
`kvattn.caches.registry` maps each spec type to the cache type that
implements it. A cache type (`CacheType`) names its own `nnx.Cache` arrays
(`variables`), turns them into its pytree and back (`bind`, `unbind`), and
on that pytree says which sequences a call may write (`fits`), reads
(`attend`) and writes what `attend` left for after the output (`commit`).

This module is a leaf (it imports no other part of kvattn but `errors`), so
`AttentionConfig` can hold a spec and accept today's keyword arguments as
sugar for one.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import numpy as np

from kvattn.errors import positive_int

__all__ = [
    "CACHE_DTYPES", "INT32_MAX", "LAYOUTS", "NULL_PAGE", "CacheSpec", "CacheType", "Contiguous", "Paged",
    "blocks_spanned", "cache_dtype_name", "default_length_buckets", "spec_from_options",
]

# `pos` is int32: the most tokens a sequence may ever append, ring or not.
INT32_MAX = 2**31 - 1

# Page 0 of every page pool maps nothing: table entries without a page point
# at it, the host never hands it out, and the device never writes it.
NULL_PAGE = 0

# Storage name -> bytes per stored element.
CACHE_DTYPES = {"float32": 4, "bfloat16": 2, "int8": 1}

# Inside, a cache layout is named by the letters of its axes (legend in `kvattn.math.ops`); the words are what
# callers pass, and `AttentionConfig.layout` turns them into the letters.
SLOTS_MAJOR, HEADS_MAJOR = "BSKH", "BKSH"
LAYOUTS = {"slots_major": SLOTS_MAJOR, "heads_major": HEADS_MAJOR}

# Caches of a batch larger than this no longer fit a typical last-level CPU cache.
_CACHE_RESIDENT_BYTES = 32 * 2**20


def blocks_spanned(num_tokens, page_size: int):
    """Blocks (pages) that `num_tokens` tokens from position 0 touch: an int, or an array of them."""
    return -(-num_tokens // page_size)


def cache_dtype_name(dtype) -> str:
    """The storage name of `dtype` (`jnp.bfloat16`, `np.dtype("int8")`, `"float32"`...)."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {sorted(CACHE_DTYPES)} (a name or a dtype), got {dtype!r}")
    return name


# ------------------------------------------------------------------ the specs


# Validated by hand in `__post_init__`, whose errors are the documented ones.
@typing.no_type_check
@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """What every cache kind sets about storage.

    Args:
      max_len: tokens one sequence may hold (a contiguous cache without it
        is a ring of the layer's `window` slots).
      batch_size: sequences the cache holds, or None for one unbatched one.
      dtype: storage of keys and values, anything `numpy.dtype` reads that
        names float32 (the default), bfloat16 (half the memory) or int8 (a
        quarter, plus one float32 scale per token and kv head).
      layout: `"slots_major"` (slots before kv heads) or `"heads_major"`
        (kv heads first; what XLA:CPU's batched dots read in place).
    """

    paged: ClassVar[bool] = False

    max_len: int | None = None
    batch_size: int | None = None
    dtype: str = "float32"
    layout: str = "slots_major"

    def __post_init__(self):
        for name in ("max_len", "batch_size"):
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else positive_int(name, value))
        object.__setattr__(self, "dtype", cache_dtype_name(self.dtype))
        if self.layout not in LAYOUTS:
            raise ValueError(f"cache_layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")

    @property
    def rows(self) -> int | None:
        """Rows a call's tokens must have: `batch_size` (None: any number, or an unbatched layer's one sequence)."""
        return self.batch_size

    def num_slots(self, window: int | None) -> int:
        """Slots per sequence: `max_len`, or the ring's `window`."""
        return window if self.max_len is None else self.max_len

    def fitted(self, window: int | None, bytes_per_token: int) -> CacheSpec:
        """The spec checked against the layer's `window`, with defaults that depend on the layer filled in."""
        return self


@typing.no_type_check
@dataclasses.dataclass(frozen=True, kw_only=True)
class Contiguous(CacheSpec):
    """One buffer per sequence, `max_len` slots; with `max_len=None` a ring of the layer's `window` slots.

    Args:
      length_buckets: attend only over the smallest of these static prefix
        lengths that holds every filled slot, so a step costs about the
        filled length rather than `max_len`. None picks
        `default_length_buckets`; `()` always reads the whole buffer;
        buckets past the slots are ignored.
      spare_slots: slots a ring keeps past its window (only without
        `max_len`): its `truncate` then rolls back up to `spare_slots + 1`
        tokens (one without spares), as speculative decoding's refused
        drafts need; attention still sees the last `window` positions.

    >>> Contiguous(max_len=16, dtype="int8", length_buckets=[8, 4])
    Contiguous(max_len=16, batch_size=None, dtype='int8', layout='slots_major', length_buckets=(4, 8), spare_slots=0)
    """

    length_buckets: tuple[int, ...] | None = None
    spare_slots: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.length_buckets is not None:
            object.__setattr__(self, "length_buckets", _buckets(self.length_buckets))
        spare = self.spare_slots
        if isinstance(spare, (bool, np.bool_)) or not isinstance(spare, (int, np.integer)) or spare < 0:
            raise ValueError(f"spare_slots must be an int >= 0, got {spare!r}")
        object.__setattr__(self, "spare_slots", int(spare))

    def num_slots(self, window: int | None) -> int:
        """Slots per sequence: `max_len`, or the ring's `window` plus its `spare_slots`."""
        return window + self.spare_slots if self.max_len is None else self.max_len

    def fitted(self, window: int | None, bytes_per_token: int) -> Contiguous:
        if (self.max_len is None) == (window is None):
            raise ValueError(
                f"give exactly one of max_len (a bounded cache) or window (a ring), "
                f"got max_len={self.max_len!r} and window={window!r}"
            )
        if self.spare_slots and self.max_len is not None:
            raise ValueError(f"spare_slots are a ring's (a window without max_len), got max_len={self.max_len}")
        num_slots = self.num_slots(window)
        if self.length_buckets is None:
            buckets = default_length_buckets(num_slots, cache_bytes=(self.batch_size or 1) * num_slots * bytes_per_token)
        else:  # buckets at or past the slot count add nothing: the last one is all slots
            buckets = tuple(sorted({b for b in self.length_buckets if b < num_slots} | {num_slots}))
        return dataclasses.replace(self, length_buckets=buckets)


@typing.no_type_check
@dataclasses.dataclass(frozen=True, kw_only=True)
class Paged(CacheSpec):
    """One pool of `num_pages` pages of `page_size` tokens shared by `batch_size` sequences of up to `max_len`.

    Keys and values `(P, page, K, H)` (heads-major `(P, K, page, H)`); each
    sequence reaches its pages through its page table (see
    `kvattn.caches.paged`). Every call then takes `pages=`, the `PageBatch`
    a host `kvattn.PageManager` hands out. The layer's `window` may be given
    with `max_len`: it limits what a token sees, and the host frees the
    pages that fall out of it.

    >>> Paged(num_pages=9, page_size=4, max_len=16, batch_size=2).pages_per_sequence
    4
    """

    paged: ClassVar[bool] = True

    num_pages: int
    page_size: int

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "num_pages", positive_int("num_pages", self.num_pages))
        object.__setattr__(self, "page_size", positive_int("page_size", self.page_size))
        if self.num_pages < 2 or self.max_len is None or self.batch_size is None:
            raise ValueError(
                "a paged cache needs num_pages >= 2 (page 0 is the null page), max_len (tokens per sequence) "
                f"and batch_size (sequences), got num_pages={self.num_pages}, max_len={self.max_len!r}, "
                f"batch_size={self.batch_size!r}"
            )

    @property
    def rows(self) -> None:
        """Any: each call brings its own page tables."""
        return None

    @property
    def pages_per_sequence(self) -> int:
        """A table's width: the blocks of `max_len` tokens."""
        return blocks_spanned(self.max_len, self.page_size)


def spec_from_options(*, max_len=None, batch_size=None, cache_dtype="float32", cache_layout="slots_major",
                      length_buckets=None, num_pages=None, page_size=None, spare_slots=0) -> CacheSpec:
    """The spec that the layer's storage keyword arguments describe (their sugar)."""
    storage = dict(max_len=max_len, batch_size=batch_size, dtype=cache_dtype, layout=cache_layout)
    if num_pages is None and page_size is None:
        return Contiguous(**storage, length_buckets=length_buckets, spare_slots=spare_slots)
    if spare_slots:
        raise ValueError("spare_slots are a ring's; a paged cache keeps its pages as the PageManager says")
    if num_pages is None or page_size is None:
        raise ValueError(
            f"a paged cache needs both num_pages and page_size, got num_pages={num_pages!r} and page_size={page_size!r}"
        )
    if length_buckets is not None:
        raise ValueError("length_buckets is a contiguous cache's; a paged cache reads its pages in chunks")
    return Paged(**storage, num_pages=num_pages, page_size=page_size)


def _buckets(buckets) -> tuple[int, ...]:
    """Explicit bucket lengths: positive ints, sorted, without repeats."""
    array_like = hasattr(buckets, "__array__")
    if isinstance(buckets, (str, bytes)) or not (array_like or isinstance(buckets, Iterable)):
        raise TypeError(f"length_buckets must be a sequence of positive ints or None, got {buckets!r}")
    values = np.asarray(buckets if array_like else list(buckets))
    if values.ndim != 1:
        raise TypeError(f"length_buckets must be a sequence of positive ints or None, got {buckets!r}")
    values = values.tolist()
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"length_buckets must be positive ints (slot counts), got {values}")
    return tuple(sorted(set(values)))


def default_length_buckets(max_len: int, smallest: int = 128, cache_bytes: int = 0) -> tuple[int, ...]:
    """Static prefix lengths a step may read: doublings from `smallest` up to a limit, then `max_len`.

    A dot cannot read part of a buffer on XLA:CPU: a bucket's K/V prefix is
    first copied out, and a prefix only pays when that copy costs less than
    reading the whole buffers. While the batch's caches (`cache_bytes` in
    all) stay in the CPU's last-level cache, the dot reads them several times
    faster per byte than the copy runs, so buckets stop at `max_len / 8`;
    once they spill to DRAM, both run at DRAM speed and buckets go on to
    `max_len / 4`. The measurements behind the limits are on the benchmarks page (docs/benchmarks).

    >>> default_length_buckets(2048)
    (128, 256, 2048)
    >>> default_length_buckets(2048, cache_bytes=64 * 2**20)
    (128, 256, 512, 2048)
    >>> default_length_buckets(300)
    (300,)
    """
    limit = max_len // (4 if cache_bytes > _CACHE_RESIDENT_BYTES else 8)
    buckets = []
    size = min(smallest, max_len)
    while size <= limit:
        buckets.append(size)
        size *= 2
    buckets.append(max_len)
    return tuple(buckets)


# ------------------------------------------------------------- the interface


@typing.runtime_checkable  # annotations are checked at test time (jaxtyping + beartype)
class CacheType(Protocol):
    """What a cache type provides: the layer's side (class methods) and the cache pytree's.

    `spec` is the spec type it implements. The pytree carries its static
    facts (layout, window, kernel, what attention needs to know) in its
    structure, so `kvattn.layer.forward.extend` passes it only arrays.
    """

    spec: ClassVar[type[CacheSpec]]
    pos: Any

    @classmethod
    def variables(cls, config) -> dict[str, tuple[tuple, tuple, Any]]:
        """The `nnx.Cache` arrays a layer with `config` holds: name -> (shape, mesh axes, dtype)."""

    @classmethod
    def bind(cls, config, arrays: dict, *, pages=None, lengths=None, batched: bool = True,
             operation: str = "this call") -> CacheType:
        """Those arrays as the cache pytree (checked first for a call appending `lengths`)."""

    def unbind(self, config) -> dict:
        """The inverse of `bind`: the arrays to store, by variable name."""

    def fits(self, lengths) -> Any:
        """Bool `(B,)`: which sequences may append `lengths` tokens (the others write nothing, output NaN)."""

    def attend(self, q, k, v, lengths, written, *, write_first: bool) -> tuple[Any, CacheType]:
        """`(ctx, cache)`: attention of new queries over the cache and the chunk, and any write made before it."""

    def commit(self, after) -> CacheType:
        """The write `attend` left pending, made after the output `after` (so donated buffers update in place)."""
