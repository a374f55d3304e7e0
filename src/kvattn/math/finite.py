"""NaN and infinities in attention's mix of values: each reaches exactly the queries that see it.

A masked slot gets weight exactly 0, and 0 times NaN (or inf) is NaN, so a
dot that mixes every slot by its weight would carry a bad value to queries
that never see it. A chunk's own values are mixed finite-only here, and what
each query sees of the rest is put back from running counts, as float64
arithmetic gives it. Axis letters follow `kvattn.math.ops`.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvattn.caches.base import SLOTS_MAJOR

__all__ = ["mixed_new_values", "nonfinite_seen", "written_chunk_read_finite"]


def mixed_new_values(weights, v_new, real, window):
    """The chunk's values mixed by `weights` `(B, T, K, G, U)`, where each query sees only `u <= t` (and the window).

    A weight of 0 times a NaN or infinite value is NaN, so a non-finite value
    at a later token would reach every earlier query through the dot. The
    dot reads the finite values only, and `nonfinite_seen` puts back what
    each query sees.
    """
    ctx = jnp.einsum("BTKGU,BUKH->BTKGH", weights, jnp.where(jnp.isfinite(v_new), v_new, 0.0))
    return nonfinite_seen(ctx, v_new, real, window)


def nonfinite_seen(ctx, v_new, real, window):
    """`ctx` `(B, T, K, G, H)` with the NaN and infinities each real query sees among the chunk's values `v_new`.

    Query t sees tokens `u <= t` (with a window, `u > t - W`); running
    counts over the tokens give, element by element, what float64 arithmetic
    gives: a NaN, or +inf beside -inf, is NaN; else the infinity. Linear in
    the chunk's length. A visible infinite value whose weight underflows to
    exactly 0 gives the infinity, where float64 would give NaN.
    """
    kinds = jnp.stack([jnp.isnan(v_new), v_new == jnp.inf, v_new == -jnp.inf]).astype(jnp.int32)  # 3 B U K H
    seen = jnp.cumsum(kinds, axis=2)  # tokens u <= t
    if window is not None and window < v_new.shape[1]:  # less those that left the window, u <= t - W
        seen = seen - jnp.pad(seen, ((0, 0), (0, 0), (window, 0), (0, 0), (0, 0)))[:, :, : v_new.shape[1]]
    seen = (seen > 0) & real[None, :, :, None, None]
    nan, plus, minus = (x[:, :, :, None, :] for x in seen)  # B T K 1 H, against ctx's B T K G H
    ctx = jnp.where(plus, jnp.inf, ctx)
    ctx = jnp.where(minus, -jnp.inf, ctx)
    return jnp.where(nan | (plus & minus), jnp.nan, ctx)


def written_chunk_read_finite(values, scale, cache_len, new_len, layout, slot_positions):
    """Cached values (and int8 scales) with the non-finite elements of the just-written chunk read as 0.

    The chunk's tokens hold positions `cache_len[b] .. cache_len[b] + new_len[b] - 1`
    (slot s holds position s, or `slot_positions[b, s]`). An earlier query
    weighs a later token's slot exactly 0, and 0 times NaN is NaN: reading
    those elements as 0 and putting back what each query sees
    (`nonfinite_seen`) keeps a bad token from reaching earlier ones. Every
    other slot is read as stored.
    """
    num_slots = values.shape[layout.index("S")]
    position = jnp.arange(num_slots)[None, :] if slot_positions is None else slot_positions
    in_chunk = (position >= cache_len[:, None]) & (position < (cache_len + new_len)[:, None])  # B S
    in_chunk = in_chunk[:, :, None] if layout == SLOTS_MAJOR else in_chunk[:, None, :]  # as a scale, B S K or B K S

    def finite(x, mask):
        return jnp.where(mask & ~jnp.isfinite(x), jnp.zeros((), x.dtype), x)

    if jnp.issubdtype(values.dtype, jnp.floating):
        values = finite(values, in_chunk[..., None])
    return values, None if scale is None else finite(scale, in_chunk)
