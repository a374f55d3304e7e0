"""How attention reads a sequence out of a page pool: a chunk of its blocks at a time, gathered into a view.

Functions of a `kvattn.caches.paged.PagedKVCache` (its pool, table, page
size and window); `PagedKVCache.attend` reads through them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from kvattn.caches.base import NULL_PAGE, SLOTS_MAJOR

__all__ = ["CHUNK_TOKENS", "chunk_sizes", "first_block", "view"]


# Attention reads a sequence in chunks of pages gathered into a view: short
# chunks while the batch's sequences are short (a chunk is gathered whole), long
# ones past that (fewer loop iterations). Measured on the benchmarks page (docs/benchmarks).
CHUNK_TOKENS = (256, 1024)


def chunk_sizes(cache) -> tuple[int, ...]:
    """Blocks per chunk of each chunked reading, increasing (at most the table's width)."""
    width = cache.table.shape[1]
    return tuple(sorted({max(1, min(width, tokens // cache.page_size)) for tokens in CHUNK_TOKENS}))


def first_block(cache, query_start: Int[Array, " B"]) -> Int[Array, " B"]:
    """The first block a query at `query_start[b]` can see: 0, or the window's first."""
    if cache.window is None:
        return jnp.zeros_like(query_start)
    return jnp.maximum(query_start - cache.window + 1, 0) // cache.page_size


def view(cache, num_blocks: int, first: Int[Array, " B"], filled: Int[Array, " B"]):
    """Blocks `first[b] .. first[b] + num_blocks - 1` of each sequence gathered into a contiguous view.

    Slots that hold no token (at or past `filled[b]`, past the table, or in
    an unmapped block) are zeroed, so whatever a free page holds never
    reaches an output.

    Returns:
      `(k, v, slot_positions)`: `Stored` views `(B, S, K, H)` (or
      `(B, K, S, H)`), `S = num_blocks * page`, and int32 `(B, S)`.
    """
    page, width = cache.page_size, cache.table.shape[1]
    blocks = first[:, None] + jnp.arange(num_blocks)[None, :]  # B nb
    pages = jnp.take_along_axis(cache.table, jnp.clip(blocks, 0, width - 1), axis=1)
    pages = jnp.where(blocks < width, pages, NULL_PAGE)
    slot_positions = (blocks[:, :, None] * page + jnp.arange(page)[None, None, :]).reshape(blocks.shape[0], -1)
    holds = (slot_positions < filled[:, None]) & jnp.repeat(pages != NULL_PAGE, page, axis=1)

    def gather(pool):
        taken = pool[pages]  # B nb page K [H]  or  B nb K page [H]
        if cache.layout != SLOTS_MAJOR:
            taken = jnp.moveaxis(taken, 2, 1)  # B K nb page [H]
            merged = taken.reshape(taken.shape[0], taken.shape[1], -1, *taken.shape[4:])
            mask = holds[:, None, :]
        else:
            merged = taken.reshape(taken.shape[0], -1, *taken.shape[3:])
            mask = holds
        mask = mask.reshape(mask.shape + (1,) * (merged.ndim - mask.ndim))
        return jnp.where(mask, merged, jnp.zeros((), merged.dtype))

    return jax.tree.map(gather, cache.k), jax.tree.map(gather, cache.v), slot_positions
