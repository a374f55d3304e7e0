"""Unnormalised attention sums, as the decode kernels return them: a new token joined, then normalised.

jax's Pallas decode kernels and kvattn's native `decode_attention` return,
per query, `o = sum_s exp(score_s - top) v_s`, `total = sum_s exp(score_s -
top)` and `top = max_s score_s`. A new token the cache does not hold yet
joins as one more term; dividing last gives a query that sees nothing exact
zeros, as from `kvattn.math.ops`, rather than `0 / eps`. Axis letters
follow `kvattn.math.ops`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["joined", "normalised"]


def joined(
    grouped: Float[Array, "B K G H"],
    o: Float[Array, "B K G H"],
    total: Float[Array, "B K G"],
    top: Float[Array, "B K G"],
    new: tuple[Float[Array, "B 1 K H"], Float[Array, "B 1 K H"]] | None,
) -> tuple[Float[Array, "B K G H"], Float[Array, "B K G"]]:
    """`(o, total)` with the new token `new = (k, v)` joined as one more key (as is, when None)."""
    if new is None:
        return o, total
    k_new, v_new = new
    score = jnp.einsum("BKGH,BKH->BKG", grouped, k_new[:, 0])
    top_all = jnp.maximum(top, score)
    old, fresh = jnp.exp(top - top_all), jnp.exp(score - top_all)
    return o * old[..., None] + fresh[..., None] * v_new[:, 0, :, None, :], total * old + fresh


def normalised(o: Float[Array, "B K G H"], total: Float[Array, "B K G"], new_len: Int[Array, " B"]) -> Float[Array, "B 1 N H"]:
    """Partial sums `(B, K, G, H)` over their total weight, exact zeros for a query that sees nothing or is padding."""
    batch, num_kv_heads, group, head_dim = o.shape
    ctx = o / jnp.where(total > 0, total, 1.0)[..., None]
    ctx = jnp.where((new_len > 0)[:, None, None, None], ctx, 0.0)
    return ctx.reshape(batch, 1, num_kv_heads * group, head_dim)
