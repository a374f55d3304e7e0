"""Pure attention math on arrays: projections, causal masks, cached attention.

Nothing here holds state; every function is a plain JAX function of its
arguments, so each can be tested alone against the float64 reference.

The package's one axis legend (einsums, shape annotations, docstrings):
  B batch (sequences), T new tokens (queries), U new tokens as keys,
  S cache slots, N query heads, K kv heads, G query heads per kv head
  (N = K * G), H head dim, D model dim;
  M rows of a weight dot (tokens, flattened), F a weight's output features;
  P pages of a pool, J blocks of a sequence's page table;
  V vocabulary, R tokens drafted per round (R1 = R + 1).

A cache layout is named by the letters of its axes, so it can be spliced into
an einsum: `SLOTS_MAJOR = "BSKH"` stores `(max_len, K, H)` per sequence,
`HEADS_MAJOR = "BKSH"` puts the heads first.

Both attention orders (`attention`: read the cache and the chunk apart;
`cached_attention`: the chunk is already written) build their scores and
visibility, then share one `masked_softmax` and one reading of the cache
(`kvattn.math.reads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from kvattn.caches.base import HEADS_MAJOR, LAYOUTS, SLOTS_MAJOR
from kvattn.math import finite, reads

__all__ = [
    "HEADS_MAJOR", "LAYOUTS", "SLOTS_MAJOR", "attention", "bucket_index", "bucketed", "cached_attention",
    "chunked_cached_attention", "grouped_queries", "masked_scores", "masked_softmax", "project", "project_out",
]


def project(
    x: Float[Array, "B T D"],
    kernel: Float[Array, "D K H"],
    bias: Float[Array, "K H"] | None,
) -> Float[Array, "B T K H"]:
    """Projects tokens to per-head vectors (query, key or value).

    Args:
      x: tokens.
      kernel: projection weights, Flax `LinearGeneral` layout.
      bias: per-head bias, or None.

    Returns:
      The projected tokens.
    """
    y = jnp.einsum("BTD,DKH->BTKH", x, kernel)
    return y if bias is None else y + bias[None, None]


def project_out(
    ctx: Float[Array, "B T N H"],
    kernel: Float[Array, "N H D"],
    bias: Float[Array, " D"] | None,
) -> Float[Array, "B T D"]:
    """Merges the heads back to model width (the `out` projection)."""
    batch, num_new, num_heads, head_dim = ctx.shape
    # One plain matmul over the flattened heads: the kernel reshape is free,
    # whereas the 3-D contraction made XLA:CPU re-lay-out the whole kernel
    # every step to match the attention output's layout.
    flat = ctx.reshape(batch * num_new, num_heads * head_dim)
    y = (flat @ kernel.reshape(num_heads * head_dim, -1)).reshape(batch, num_new, -1)
    return y if bias is None else y + bias[None, None]


def attention(
    q: Float[Array, "B T N H"],
    k_new: Float[Array, "B T K H"],
    v_new: Float[Array, "B T K H"],
    new_len: Int[Array, " B"],
    k_cache: Shaped[Array, "B ..."] | None = None,
    v_cache: Shaped[Array, "B ..."] | None = None,
    cache_len: Int[Array, " B"] | None = None,
    layout: str = SLOTS_MAJOR,
    *,
    k_scale: Float[Array, "B ..."] | None = None,
    v_scale: Float[Array, "B ..."] | None = None,
    window: int | None = None,
    block_diagonal: bool = True,
    logit_softcap: float | None = None,
) -> Float[Array, "B T N H"]:
    """Causal attention of a chunk of new tokens over the cache and over itself.

    Sequence b holds `cache_len[b]` earlier tokens in the cache and appends
    its first `new_len[b]` new tokens; new token t sits at position
    `cache_len[b] + t`. It sees every filled cache slot `s < cache_len[b]` and
    the new tokens `u <= t`: exactly slots `0..pos` of a cache that already
    holds it. Every other score is replaced by `-inf` before the softmax, so
    unfilled slots and padding get weight zero whatever their content.
    Queries at `t >= new_len[b]` are padding and return zeros.

    With `window=W`, token t sees only the last W positions up to itself,
    and the cache is a ring of W slots (position p in slot `p % W`).

    The cache is only read, never written here: reading it before the new
    tokens are stored lets XLA update the donated buffers in place. It may
    be stored in a compact dtype; the math runs in float32, with int8
    scales applied to the scores and to the attention weights, so no
    dequantized copy of the cache is formed.

    Grouped-query attention: the `N` query heads split into `K` groups of
    `G`; a group reads its kv head directly, without repeating the cache.

    Args:
      q: queries of the new tokens, unscaled.
      k_new: keys of the new tokens.
      v_new: values of the new tokens.
      new_len: how many new tokens of each sequence are real.
      k_cache: keys of earlier tokens, `(B, S, K, H)` in the slots-major
        layout or `(B, K, S, H)` heads-major; None for no cache.
      v_cache: values of earlier tokens, same layout.
      cache_len: how many tokens each sequence has appended before (the
        filled prefix of slots, or, for a ring, every token ever appended).
      layout: `SLOTS_MAJOR` or `HEADS_MAJOR`.
      k_scale: int8 storage only: per-slot, per-head key scales, `(B, S, K)`
        or heads-major `(B, K, S)`.
      v_scale: the same for values.
      window: attend to at most this many positions (a ring cache).
      block_diagonal: allow the block-diagonal reading of a slots-major
        cache for short chunks (fast on one CPU device; off when heads are
        split over devices, where merging the head axis would gather them).
      logit_softcap: soft-cap the scores before masking (see `masked_softmax`).

    Returns:
      The attended values of every query head.
    """
    batch, num_new, num_heads, head_dim = q.shape
    q = grouped_queries(q, k_new.shape[2])

    query_t = jnp.arange(num_new)[None, :, None]
    key_u = jnp.arange(num_new)[None, None, :]
    real = query_t[:, :, 0] < new_len[:, None]  # B T
    see_new = key_u <= query_t  # B T U
    if window is not None:
        see_new &= query_t - key_u < window
    scores = [jnp.einsum("BTKGH,BUKH->BTKGU", q, k_new)]
    visible = [jnp.broadcast_to(see_new, (batch, num_new, num_new))]
    if k_cache is not None:
        query_pos = cache_len[:, None] + query_t[:, :, 0]
        visible.insert(0, reads.visible_slots(cache_len, query_pos, k_cache.shape[layout.index("S")], window))
        scores.insert(0, reads.scores(q, k_cache, k_scale, layout, block_diagonal))
    scores, visible = jnp.concatenate(scores, axis=-1), jnp.concatenate(visible, axis=-1)
    weights = masked_softmax(scores, visible, real, logit_softcap)

    ctx = finite.mixed_new_values(weights[..., -num_new:], v_new, real, window)
    if k_cache is not None:
        ctx = ctx + reads.mixed_values(weights[..., :-num_new], v_cache, v_scale, layout, block_diagonal)
    return ctx.reshape(batch, num_new, num_heads, head_dim)


def cached_attention(
    q: Float[Array, "B T N H"],
    new_len: Int[Array, " B"],
    k_cache: Shaped[Array, "B ..."],
    v_cache: Shaped[Array, "B ..."],
    cache_len: Int[Array, " B"],
    layout: str = SLOTS_MAJOR,
    *,
    k_scale: Float[Array, "B ..."] | None = None,
    v_scale: Float[Array, "B ..."] | None = None,
    window: int | None = None,
    block_diagonal: bool = True,
    logit_softcap: float | None = None,
    slot_positions: Int[Array, "B S"] | None = None,
    v_new: Float[Array, "B T K H"] | None = None,
) -> Float[Array, "B T N H"]:
    """Causal attention of a chunk whose keys and values are already written to the cache.

    Sequence b held `cache_len[b]` tokens and has just written its first
    `new_len[b]` new ones; new token t sits at position `cache_len[b] + t`
    and sees every written position up to its own (with `window=W`, the
    last W of them): "attend over slots `0..pos`, the new one
    included". Every other score is `-inf`; queries at `t >= new_len[b]` are
    padding and return zeros.

    Writing before reading keeps a step to one pass over the cache, with no
    separate scores for the new tokens; XLA reads the updated (donated)
    buffers in place. A ring chunk longer than one token must not write
    first (a later token would overwrite a slot an earlier one still sees):
    `attention` reads the old cache and the chunk apart for that case.

    Args:
      q: queries of the new tokens, unscaled.
      new_len: how many new tokens of each sequence are real (and written).
      k_cache: keys, new ones included, in `layout`.
      v_cache: values, same layout.
      cache_len: tokens each sequence held before the chunk.
      layout: `SLOTS_MAJOR` or `HEADS_MAJOR`.
      k_scale, v_scale: int8 storage only, as in `attention`.
      window: attend to at most this many positions (a ring cache).
      block_diagonal: as in `attention`.
      logit_softcap: as in `attention`.
      slot_positions: the position each slot holds, when the cache is a
        gathered view rather than slots `0..S-1` or a ring (a paged cache);
        `window` then masks by position, with no ring.
      v_new: the chunk's values as they were written, for a chunk of
        several tokens: a NaN or infinite value then reaches only the
        queries that see it (`kvattn.math.finite`). Without them, an
        earlier query of the chunk mixes a later token's slot by 0.

    Returns:
      The attended values of every query head.
    """
    batch, num_new, num_heads, head_dim = q.shape
    q = grouped_queries(q, k_cache.shape[layout.index("K")])
    query_t = jnp.arange(num_new)[None, :]
    real = query_t < new_len[:, None]  # B T
    num_slots = k_cache.shape[layout.index("S")]
    visible = reads.visible_slots(cache_len + new_len, cache_len[:, None] + query_t, num_slots, window, slot_positions)
    weights = masked_softmax(reads.scores(q, k_cache, k_scale, layout, block_diagonal), visible, real, logit_softcap)
    guard = v_new is not None and num_new > 1
    if guard:
        v_cache, v_scale = finite.written_chunk_read_finite(v_cache, v_scale, cache_len, new_len, layout,
                                                            slot_positions)
    ctx = reads.mixed_values(weights, v_cache, v_scale, layout, block_diagonal)
    if guard:
        ctx = finite.nonfinite_seen(ctx, v_new, real, window)
    return ctx.reshape(batch, num_new, num_heads, head_dim)


def masked_softmax(
    scores: Float[Array, "B T K G S"],
    visible: Bool[Array, "B T S"],
    real: Bool[Array, "B T"],
    logit_softcap: float | None = None,
) -> Float[Array, "B T K G S"]:
    """Softmax over the keys a query sees; `-inf` for every other score; zero rows for padding queries.

    With `logit_softcap`, scores first become `cap * tanh(scores / cap)`.
    Masking with `-inf` (never a finite penalty) gives unseen keys weight
    exactly zero. A padding row sees nothing, so its softmax is NaN: it is
    replaced by exact zeros.
    """
    weights = jax.nn.softmax(masked_scores(scores, visible, real, logit_softcap), axis=-1)
    return jnp.where(real[:, :, None, None, None], weights, 0.0)


def masked_scores(
    scores: Float[Array, "B T K G S"],
    visible: Bool[Array, "B T S"],
    real: Bool[Array, "B T"],
    logit_softcap: float | None = None,
) -> Float[Array, "B T K G S"]:
    """The logits `masked_softmax` normalises: soft-capped, `-inf` wherever a query does not see the key."""
    if logit_softcap is not None:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)
    visible = visible & real[:, :, None]
    return jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)


def chunked_cached_attention(
    q: Float[Array, "B T N H"],
    new_len: Int[Array, " B"],
    read_chunk: Callable[[Int[Array, ""]], tuple],
    num_chunks: Int[Array, ""],
    cache_len: Int[Array, " B"],
    layout: str = SLOTS_MAJOR,
    *,
    window: int | None = None,
    block_diagonal: bool = True,
    logit_softcap: float | None = None,
    v_new: Float[Array, "B T K H"] | None = None,
) -> Float[Array, "B T N H"]:
    """`cached_attention` over a cache read in chunks of slots, with a running (online) softmax.

    `read_chunk(c)` returns chunk c as `(k, v, k_scale, v_scale,
    slot_positions)`, the arguments `cached_attention` takes for a whole
    cache; `num_chunks` (traced) says how many to read, so the cost follows
    the filled length. Each chunk is masked by `masked_scores`, as
    everywhere; the running maximum, sum and weighted values then combine
    the chunks, so no chunk outlives its iteration: a paged cache gathers
    each chunk of pages into a buffer that stays in the CPU cache instead of
    copying out the whole sequence. `v_new`: as in `cached_attention`.
    """
    batch, num_new, num_heads, head_dim = q.shape
    num_kv_heads = read_chunk(jnp.int32(0))[0].shape[layout.index("K")]
    q = grouped_queries(q, num_kv_heads)
    real = jnp.arange(num_new)[None, :] < new_len[:, None]
    query_pos = cache_len[:, None] + jnp.arange(num_new)[None, :]
    stats_shape = (batch, num_new, num_kv_heads, num_heads // num_kv_heads)
    guard = v_new is not None and num_new > 1

    def body(chunk, carry):
        running_max, total, values = carry
        k, v, k_scale, v_scale, slot_positions = read_chunk(chunk)
        if guard:
            v, v_scale = finite.written_chunk_read_finite(v, v_scale, cache_len, new_len, layout, slot_positions)
        visible = reads.visible_slots(cache_len + new_len, query_pos, None, window, slot_positions)
        scores = masked_scores(reads.scores(q, k, k_scale, layout, block_diagonal), visible, real, logit_softcap)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        # A row that has seen nothing yet keeps -inf: shift by 0 there, so exp gives exact zeros, never NaN.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = jnp.exp(scores - shift[..., None])
        rescale = jnp.where(jnp.isfinite(running_max), jnp.exp(running_max - shift), 0.0)
        total = total * rescale + jnp.sum(weights, axis=-1)
        values = values * rescale[..., None] + reads.mixed_values(weights, v, v_scale, layout, block_diagonal)
        return new_max, total, values

    carry = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros((*stats_shape, head_dim), jnp.float32),
    )
    _, total, values = jax.lax.fori_loop(0, num_chunks, body, carry)
    ctx = jnp.where(real[:, :, None, None, None], values / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    if guard:
        ctx = finite.nonfinite_seen(ctx, v_new, real, window)
    return ctx.reshape(batch, num_new, num_heads, head_dim)




def grouped_queries(q, num_kv_heads):
    """Queries `(B, T, N, H)` scaled by `1/sqrt(H)` and split into kv-head groups `(B, T, K, G, H)`."""
    batch, num_new, num_heads, head_dim = q.shape
    q = q.reshape(batch, num_new, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)



def bucket_index(buckets: tuple[int, ...], needed: Int[Array, ""]) -> Int[Array, ""]:
    """Index of the smallest bucket holding `needed` slots (the last if none does)."""
    # A count, not `searchsorted`, which lowers to a while loop on XLA:CPU.
    index = jnp.sum(jnp.asarray(buckets, jnp.int32) < needed.astype(jnp.int32))
    return jnp.minimum(index, len(buckets) - 1)


def prefix(cache: Array, size: int, layout: str) -> Array:
    """The first `size` slots of a cache, a static slice along its slot axis."""
    return cache[(slice(None),) * layout.index("S") + (slice(0, size),)]


def bucketed(
    attend: Callable[[Any], Array],
    caches: Any,
    needed: Int[Array, ""],
    buckets: tuple[int, ...],
    layout: str,
) -> Array:
    """`attend(caches)` on the smallest bucket prefix of the caches that holds `needed` slots.

    Shapes stay static: each bucket is one branch of a `lax.switch`, picked
    at run time, plus an empty prefix for when nothing is filled yet. The
    caller passes the longest filled prefix of the batch (at most the ring
    size: a ring fills its slots in order before it wraps); slots past it are
    unfilled, hence masked for every query, so the result equals `attend` on
    the whole buffers up to the float rounding of a shorter softmax sum.

    The switch is there even with a single bucket: a conditional's operands
    are opaque to XLA's fusion, which otherwise merges a preceding in-place
    cache write into the attention reads and copies whole buffers to do so.

    Args:
      attend: attention as a function of the caches alone.
      caches: a pytree of arrays that all have the slot axis of `layout`
        (keys, values and their scales).
      needed: slots that must be read, a traced int.
      buckets: static prefix lengths, increasing, the last one all slots.
      layout: the caches' layout, naming their slot axis.
    """
    sizes = (0, *buckets)

    def branch(size):
        return lambda caches: attend(jax.tree.map(lambda c: prefix(c, size, layout), caches))

    return jax.lax.switch(bucket_index(sizes, needed), [branch(size) for size in sizes], caches)
