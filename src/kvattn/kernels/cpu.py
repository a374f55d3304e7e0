"""kvattn's native CPU attention kernels over a contiguous cache or a paged pool (`kvattn.kernels.route` picks
them).

On XLA:CPU, a contiguous float32 heads-major cache goes through
`kvattn.kernels.native.decode_attention` for a decode step: one pass over
the visible slots, where XLA's path reads a bucket of the cache under a
`cond` in several thunks. Its unnormalised sums are joined and normalised
as the Pallas kernel's (`kvattn.kernels.partials`). A chunk of several new
tokens read first over such a cache goes through
`kvattn.kernels.native.prefill_attention`, which returns normalised outputs
(zeros for padding queries). A decode step over a float32 heads-major
paged pool goes through `kvattn.kernels.native.paged_decode_attention`,
which reads each sequence's pages where they lie (XLA's path gathers them
into views), and a chunk over one through
`kvattn.kernels.native.paged_prefill_attention`. Axis letters follow
`kvattn.math.ops`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvattn.kernels import native, partials
from kvattn.math import ops

__all__ = ["contiguous_chunk", "contiguous_step", "paged_chunk", "paged_step"]


def contiguous_step(
    q: Float[Array, "B 1 N H"],
    new_len: Int[Array, " B"],
    k_cache: Float[Array, "B K S H"],
    v_cache: Float[Array, "B K S H"],
    visible: Int[Array, " B"],
    *,
    new: tuple[Float[Array, "B 1 K H"], Float[Array, "B 1 K H"]] | None = None,
) -> Float[Array, "B 1 N H"]:
    """Attention of one query per sequence over slots `0 .. visible[b] - 1` of a heads-major cache, natively.

    As `kvattn.kernels.pallas.contiguous_step` (its arguments, `new`
    included), on `kvattn.kernels.native.decode_attention`.
    """
    grouped = ops.grouped_queries(q, k_cache.shape[1])[:, 0]  # one query per sequence: (B, K, G, H)
    o, total, top = native.decode_attention(grouped, k_cache, v_cache, visible.astype(jnp.int32))
    return partials.normalised(*partials.joined(grouped, o, total, top, new), new_len)


def contiguous_chunk(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    new_len: Int[Array, " B"],
    k_cache: Float[Array, "B K S H"],
    v_cache: Float[Array, "B K S H"],
    cache_len: Int[Array, " B"],
) -> Float[Array, "B T N H"]:
    """`kvattn.math.ops.attention` of a chunk read first over a float32 heads-major cache, natively.

    On `kvattn.kernels.native.prefill_attention`: no window and no soft-cap
    (`kvattn.kernels.route.native_limits`).
    """
    return native.prefill_attention(q, k, v, k_cache, v_cache, cache_len.astype(jnp.int32), new_len.astype(jnp.int32))


def paged_step(
    q: Float[Array, "B 1 N H"],
    new_len: Int[Array, " B"],
    k_pages: Float[Array, "P K page H"],
    v_pages: Float[Array, "P K page H"],
    table: Int[Array, "B M"],
    filled: Int[Array, " B"],
) -> Float[Array, "B 1 N H"]:
    """Attention of one query per sequence over positions `0 .. filled[b] - 1` of a heads-major paged pool that
    holds the new token already (written first), natively.

    As `kvattn.kernels.pallas.paged_step` (its arguments; no soft-cap, no
    int8 pool), on `kvattn.kernels.native.paged_decode_attention`; a page's
    free tail is never read, so it needs no zeroing.
    """
    grouped = ops.grouped_queries(q, k_pages.shape[1])[:, 0]  # one query per sequence: (B, K, G, H)
    o, total, _ = native.paged_decode_attention(grouped, k_pages, v_pages, table.astype(jnp.int32),
                                                filled.astype(jnp.int32))
    return partials.normalised(o, total, new_len)


def paged_chunk(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    new_len: Int[Array, " B"],
    k_pages: Float[Array, "P K page H"],
    v_pages: Float[Array, "P K page H"],
    table: Int[Array, "B M"],
    cache_len: Int[Array, " B"],
) -> Float[Array, "B T N H"]:
    """`kvattn.math.ops.attention` of a chunk over the positions `0 .. cache_len[b] - 1` a heads-major paged pool
    held before it, and causally over itself, natively (`kvattn.kernels.native.paged_prefill_attention`; no
    window, no soft-cap)."""
    return native.paged_prefill_attention(q, k, v, k_pages, v_pages, table.astype(jnp.int32),
                                          cache_len.astype(jnp.int32), new_len.astype(jnp.int32))
