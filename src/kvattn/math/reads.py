"""How grouped queries meet a cache in either layout: which slots they see, their scores, values mixed by weights.

The two reads `kvattn.math.ops` builds attention from, with int8 scales
folded into the scores and the weights (no dequantized copy of the cache),
and for short chunks over a slots-major cache the block-diagonal form that
reads the cache in place. Axis letters follow `kvattn.math.ops`.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvattn.caches.base import HEADS_MAJOR, SLOTS_MAJOR

__all__ = ["mixed_values", "scores", "visible_slots"]

# Up to this many new tokens per call, slots-major attention reads the cache
# through the block-diagonal formulation below; longer chunks amortise the
# transpose that a plain batched dot needs.
_BLOCK_DIAGONAL_MAX_TOKENS = 8


def scores(q, k_cache, k_scale, layout, block_diagonal):
    """Scores `(B, T, K, G, S)` of grouped queries against every cache slot, int8 scales applied."""
    scores = _cache_scores(q, k_cache.astype(q.dtype), layout, block_diagonal)
    return scores if k_scale is None else scores * _scale_per_score(k_scale, layout)

def mixed_values(weights, v_cache, v_scale, layout, block_diagonal):
    """Cached values mixed by `weights` `(B, T, K, G, S)`; int8 scales fold into the weights."""
    if v_scale is not None:
        weights = weights * _scale_per_score(v_scale, layout)
    return _cache_values(weights, v_cache.astype(weights.dtype), layout, block_diagonal)

def _scale_per_score(scale, layout):
    """Per-slot scales `(B, S, K)` or `(B, K, S)` broadcast against scores `(B, T, K, G, S)`."""
    if layout == SLOTS_MAJOR:
        scale = scale.transpose(0, 2, 1)
    return scale[:, None, :, None, :]

def _cache_scores(q, k_cache, layout, block_diagonal):
    """Scores `(B, T, K, G, S)` of scaled queries `(B, T, K, G, H)` against every slot."""
    batch, num_new, num_kv_heads, group, head_dim = q.shape
    if layout == HEADS_MAJOR:
        # Rows R = (T, G) of one kv head are gathered first, so the product
        # is a plain batched matmul over (B, K) that reads the cache in place.
        rows = q.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_new * group, head_dim)
        scores = jnp.einsum("BKRH,BKSH->BKRS", rows, k_cache)
        scores = scores.reshape(batch, num_kv_heads, num_new, group, -1)
        return scores.transpose(0, 2, 1, 3, 4)
    if block_diagonal and num_new <= _BLOCK_DIAGONAL_MAX_TOKENS:
        k_flat = k_cache.reshape(batch, -1, num_kv_heads * head_dim)
        scores = jnp.einsum("BRE,BSE->BRS", _block_diagonal(q), k_flat)
        return scores.reshape(batch, num_new, num_kv_heads, group, -1)
    return jnp.einsum("BTKGH,BSKH->BTKGS", q, k_cache)

def _cache_values(weights, v_cache, layout, block_diagonal):
    """Mixes cached values `(B, T, K, G, H)` with weights `(B, T, K, G, S)`."""
    batch, num_new, num_kv_heads, group, num_slots = weights.shape
    head_dim = v_cache.shape[-1]
    if layout == HEADS_MAJOR:
        rows = weights.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_new * group, num_slots)
        mixed = jnp.einsum("BKRS,BKSH->BKRH", rows, v_cache)
        mixed = mixed.reshape(batch, num_kv_heads, num_new, group, head_dim)
        return mixed.transpose(0, 2, 1, 3, 4)
    if block_diagonal and num_new <= _BLOCK_DIAGONAL_MAX_TOKENS:
        v_flat = v_cache.reshape(batch, num_slots, num_kv_heads * head_dim)
        rows = weights.reshape(batch, num_new * num_kv_heads * group, num_slots)
        mixed = jnp.einsum("BRS,BSE->BRE", rows, v_flat)
        mixed = mixed.reshape(batch, num_new, num_kv_heads, group, num_kv_heads, head_dim)
        return (mixed * _eye(num_kv_heads, mixed.dtype)).sum(axis=4)
    return jnp.einsum("BTKGS,BSKH->BTKGH", weights, v_cache)

def _eye(num_kv_heads, dtype):
    return jnp.eye(num_kv_heads, dtype=dtype).reshape(1, 1, num_kv_heads, 1, num_kv_heads, 1)

def _block_diagonal(q):
    """Spreads queries `(B, T, K, G, H)` over a block-diagonal `(B, T*K*G, K*H)`.

    A dot over a `(B, S, K, H)` cache that batches over K must first transpose
    the whole cache on XLA:CPU. Flattening `K H` into one contraction axis
    reads the cache in place instead; the multiplications by zero cost a
    factor K in flops on a step that is bound by memory, not flops.
    """
    batch, num_new, num_kv_heads, group, head_dim = q.shape
    blocks = q[:, :, :, :, None, :] * _eye(num_kv_heads, q.dtype)
    return blocks.reshape(batch, num_new * num_kv_heads * group, num_kv_heads * head_dim)


def visible_slots(filled, query_pos, num_slots, window, slot_positions=None):
    """Which cache slots `(B, T, S)` queries at positions `query_pos` `(B, T)` see.

    `filled[b]` tokens have been written. Without a window, slot s holds
    position s and is filled when `s < filled`. In a ring of S slots (its
    window W and any spare slots), slot s holds the latest position
    `p < filled` with `p % S == s`, filled when that p >= 0. Given `slot_positions` `(B, S)`, slot s holds that position
    (a paged view), filled when it is `< filled`. A query at position q sees
    filled positions `p <= q`, and with a window only those with `p > q - W`.
    """
    filled = filled[:, None, None]
    query_pos = query_pos[:, :, None]
    if slot_positions is not None:
        position = slot_positions[:, None, :]
        visible = (position < filled) & (position <= query_pos)
        return visible if window is None else visible & (position > query_pos - window)
    slot = jnp.arange(num_slots)[None, None, :]
    if window is None:
        return (slot < filled) & (slot <= query_pos)
    position = filled - 1 - (filled - 1 - slot) % num_slots
    return (position >= 0) & (position <= query_pos) & (position > query_pos - window)
