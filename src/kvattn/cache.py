"""Pure cache transitions on arrays: write, reset, truncate, fork, reorder.

The cache of a batch is `k, v: (B, S, K, H)` (or `(B, K, S, H)` in the
heads-major layout, named by the `layout` argument) and `pos: (B,)`, where
`pos[b]` is the next free slot of sequence b. Every function returns new arrays and
never touches a slot it was not asked to: writes that must not happen are
dropped explicitly (an out-of-range index with `mode="drop"`), never clamped.
Axis letters follow the legend in `kvattn.ops`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvattn.ops import SLOTS_MAJOR

__all__ = ["write", "capacity_ok", "clear", "truncate", "fork", "reorder"]


def capacity_ok(pos: Int[Array, " B"], lengths: Int[Array, " B"], max_len: int) -> Bool[Array, " B"]:
    """Whether each sequence has room for its `lengths` new tokens."""
    return pos + lengths <= max_len


def write(
    cache: Float[Array, "B ..."],
    new: Float[Array, "B T K H"],
    start: Int[Array, " B"],
    lengths: Int[Array, " B"],
    layout: str = SLOTS_MAJOR,
    after: Array | None = None,
) -> Float[Array, "B ..."]:
    """Writes `new[b, :lengths[b]]` to slots `start[b] ..` of sequence b.

    Tokens at `t >= lengths[b]` are not written anywhere. The caller checks
    capacity first; any slot index that would still fall past the buffer is
    sent to an explicit out-of-range index and dropped, never wrapped.

    `after` names a result that reads the old cache (the attention output).
    The write is made to depend on it through a term that is always zero:
    without that data dependency XLA:CPU cannot prove the in-place write
    runs after the reads and copies the whole donated buffer every step.
    """
    batch, num_slots = cache.shape[0], cache.shape[layout.index("S")]
    num_new = new.shape[1]
    offsets = jnp.arange(num_new)[None, :]
    if after is not None:
        start = start + _zero_after(after)
    slots = start[:, None] + offsets
    keep = (offsets < lengths[:, None]) & (slots < num_slots)
    slots = jnp.where(keep, slots, num_slots)
    rows = jnp.arange(batch)[:, None]
    # Either way the indexed view is (B, T, K, H): with a slice between the
    # two index arrays, NumPy indexing puts the indexed axes first.
    index = (rows, slots) if layout == SLOTS_MAJOR else (rows, slice(None), slots)
    return cache.at[index].set(new.astype(cache.dtype), mode="drop")


def _zero_after(result: Array) -> Int[Array, ""]:
    """An int32 zero that XLA must compute from `result` (exact, NaN-safe)."""
    bits = jax.lax.bitcast_convert_type(jnp.sum(result).astype(jnp.float32), jnp.int32)
    return jnp.minimum(bits & 1, 0)


def clear(cache: Float[Array, "B ..."], which: Bool[Array, " B"]) -> Float[Array, "B ..."]:
    """Zeros the whole buffer of the chosen sequences; others stay bit-identical."""
    return jnp.where(which[:, None, None, None], jnp.zeros((), cache.dtype), cache)


def truncate(
    cache: Float[Array, "B ..."], keep: Int[Array, " B"], layout: str = SLOTS_MAJOR
) -> Float[Array, "B ..."]:
    """Zeros the slots at and after `keep[b]`, as if they were never written."""
    slot_axis = layout.index("S")
    shape = [1] * cache.ndim
    shape[slot_axis] = cache.shape[slot_axis]
    slot = jnp.arange(cache.shape[slot_axis]).reshape(shape)
    kept = slot < keep.reshape((-1,) + (1,) * (cache.ndim - 1))
    return jnp.where(kept, cache, jnp.zeros((), cache.dtype))


def fork(cache: Array, source: int | Int[Array, ""], targets: Bool[Array, " B"]) -> Array:
    """Copies sequence `source` into every sequence marked in `targets` (any trailing shape)."""
    mask = targets.reshape((-1,) + (1,) * (cache.ndim - 1))
    return jnp.where(mask, cache[source][None], cache)


def reorder(cache: Array, order: Int[Array, " B"]) -> Array:
    """Sequence b of the result is sequence `order[b]` of the input (beam search)."""
    return jnp.take(cache, order, axis=0)
