"""How keys and values are stored, whatever the cache type: the storage dtype with int8's scales (`Stored`,
`encode`, `decode_values`), the capacity check every type shares, and a sequence's values moved in and out of
pages (`read_sequence`, `write_sequence`, `empty_pool`). Axis letters follow `kvattn.math.ops`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvattn.math import quant
from kvattn.math.ops import SLOTS_MAJOR

__all__ = ["Stored", "capacity_ok", "decode_values", "empty_pool", "encode", "read_sequence", "write_sequence"]



class Stored(NamedTuple):
    """Keys or values in their storage dtype; for int8, one float32 scale per slot and kv head.

    `values` is `(B, S, K, H)` or `(B, K, S, H)`; `scale` drops the last
    axis, or is None for float storage. The two always travel together.
    """

    values: Array
    scale: Float[Array, "B S K"] | Float[Array, "B K S"] | None = None


def capacity_ok(pos: Int[Array, " B"], lengths: Int[Array, " B"], capacity: int) -> Bool[Array, " B"]:
    """Whether each sequence is valid and has room for its `lengths` new tokens (written without overflow)."""
    return (pos >= 0) & (lengths <= capacity - pos)


def encode(x: Float[Array, "B T K H"], dtype) -> Stored:
    """New keys or values in the storage dtype, with int8 scales.

    int8 is `kvattn.math.quant.quantize_rows` per token and head: `x ≈ q * scale`.
    """
    if dtype != jnp.int8:
        return Stored(x.astype(dtype))
    quantized, scale = quant.quantize_rows(x)
    return Stored(quantized, scale[..., 0])


def decode_values(stored: Stored) -> Float[Array, "..."]:
    """float32 keys or values from storage; the inverse of `encode` up to rounding."""
    values = stored.values.astype(jnp.float32)
    return values if stored.scale is None else values * stored.scale[..., None]


def empty_pool(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, layout: str = SLOTS_MAJOR):
    """Zeroed key and value pools (`Stored`, with int8 scales)."""
    shape = (num_pages, page_size, num_kv_heads) if layout == SLOTS_MAJOR else (num_pages, num_kv_heads, page_size)

    def one():
        scale = jnp.zeros(shape, jnp.float32) if jnp.dtype(dtype) == jnp.int8 else None
        return Stored(jnp.zeros((*shape, head_dim), dtype), scale)

    return one(), one()


def read_sequence(stored: Stored, pages, length: int, layout: str = SLOTS_MAJOR) -> Stored:
    """The first `length` tokens held in `pages` (a sequence's table entries), as `(length, K, H)` (scales `(length, K)`).

    Host-side sizes (`length` is a Python int); the layout of the result
    never depends on the pool's.
    """
    def take(pool):
        taken = pool[jnp.asarray(pages)]  # n page K [H]  or  n K page [H]
        if layout != SLOTS_MAJOR:
            taken = jnp.swapaxes(taken, 1, 2)
        return taken.reshape(-1, *taken.shape[2:])[:length]

    return jax.tree.map(take, stored)


def write_sequence(stored: Stored, pages, values: Stored, layout: str = SLOTS_MAJOR) -> Stored:
    """`stored` with `values` (`(length, K, H)`, as `read_sequence` gives) written into `pages`, from their start."""
    length = values.values.shape[0]
    page_size = stored.values.shape[1 if layout == SLOTS_MAJOR else 2]
    positions = jnp.arange(length)
    page = jnp.asarray(pages)[positions // page_size]

    def put(pool, new):
        if layout == SLOTS_MAJOR:
            return pool.at[page, positions % page_size].set(new.astype(pool.dtype))
        return pool.at[page, :, positions % page_size].set(new.astype(pool.dtype))

    return jax.tree.map(put, stored, values)
