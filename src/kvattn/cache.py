"""Pure cache transitions on arrays: append, clear, truncate, fork, reorder.

A batch of caches is a `KVCache`: keys and values `(B, S, K, H)` (or
`(B, K, S, H)` in the heads-major layout, named by the `layout` argument),
the next free position `pos: (B,)`, and, for int8 storage, one float32 scale
per token and head, `(B, S, K)` (or `(B, K, S)`).

Every function returns a new cache and never touches a slot it was not asked
to: writes that must not happen are sent to an explicit out-of-range index
and dropped, never clamped or wrapped onto a live slot. Slots that hold no
token are kept at zero (the attention masks them, and zero keeps their
masked contribution exactly zero). Axis letters follow `kvattn.ops`.

A ring cache (`window=W`, with `S = W` slots) keeps the last W tokens:
position p lives in slot `p % W`, and `pos` counts every token ever appended.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvattn.ops import SLOTS_MAJOR

__all__ = [
    "CACHE_DTYPES",
    "KVCache",
    "append",
    "bytes_per_token",
    "capacity_ok",
    "clear",
    "decode_values",
    "encode",
    "fork",
    "relayout",
    "reorder",
    "truncate",
]

CACHE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Cache bytes one token takes in one sequence: keys, values and, for int8, their scales."""
    itemsize = jnp.dtype(CACHE_DTYPES[dtype]).itemsize
    scales = 2 * num_kv_heads * 4 if dtype == "int8" else 0
    return 2 * num_kv_heads * head_dim * itemsize + scales


class KVCache(NamedTuple):
    """The decoding state of a batch of sequences, as plain arrays."""

    k: Array
    v: Array
    pos: Int[Array, " B"]
    k_scale: Float[Array, "B S K"] | Float[Array, "B K S"] | None = None
    v_scale: Float[Array, "B S K"] | Float[Array, "B K S"] | None = None


def capacity_ok(pos: Int[Array, " B"], lengths: Int[Array, " B"], max_len: int | None) -> Bool[Array, " B"]:
    """Whether each sequence has room for its `lengths` new tokens (always, for a ring)."""
    if max_len is None:
        return jnp.ones(pos.shape, jnp.bool_)
    return pos + lengths <= max_len


def encode(x: Float[Array, "B T K H"], dtype) -> tuple[Array, Float[Array, "B T K"] | None]:
    """Converts new keys or values to the storage dtype, with int8 scales.

    int8 is symmetric per token and head: `x ≈ q * scale`, `scale = max|x| / 127`.
    """
    if dtype != jnp.int8:
        return x.astype(dtype), None
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    quantized = jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(jnp.int8)
    return quantized, scale.astype(jnp.float32)


def decode_values(stored: Array, scale: Array | None) -> Float[Array, "..."]:
    """float32 keys or values from storage; the inverse of `encode` up to rounding."""
    values = stored.astype(jnp.float32)
    return values if scale is None else values * scale[..., None]


def _write(
    buffer: Array,
    new: Array,
    start: Int[Array, " B"],
    lengths: Int[Array, " B"],
    layout: str,
    ring: bool,
    after: Array | None,
) -> Array:
    """Writes `new[b, :lengths[b]]` (`(B, T, K, ...)`) at positions `start[b] ..` of sequence b.

    One sequence at a time under `vmap`, so a batch split over devices
    writes where it lives, without gathering the new tokens.
    """
    slot_axis = layout.index("S") - 1  # within one sequence
    num_slots, num_new = buffer.shape[slot_axis + 1], new.shape[1]
    if after is not None:
        start = start + _zero_after(after)

    def write_one(buffer, new, start, length):
        offsets = jnp.arange(num_new)
        slots = start + offsets
        real = offsets < length
        if ring:
            # Only the last S tokens of a chunk survive; the rest would share slots.
            keep = real & (offsets >= length - num_slots)
            slots = slots % num_slots
        else:
            keep = real & (slots < num_slots)
        slots = jnp.where(keep, slots, num_slots)  # out of range: dropped, never clamped
        if slot_axis == 0:
            return buffer.at[slots].set(new, mode="drop")
        return buffer.at[:, slots].set(jnp.swapaxes(new, 0, 1), mode="drop")

    return jax.vmap(write_one)(buffer, new.astype(buffer.dtype), start, lengths)


def _zero_after(result: Array) -> Int[Array, " B"]:
    """Per sequence, an int32 zero that XLA must compute from `result` (exact, NaN-safe).

    Writes use it to depend on the attention output. Without that data
    dependency XLA:CPU cannot prove the in-place write runs after the reads
    of the old cache, and copies the whole donated buffer every step. It is
    reduced per sequence so a batch split over devices needs no collective.
    """
    per_sequence = jnp.sum(result.reshape(result.shape[0], -1), axis=1).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(per_sequence, jnp.int32)
    return jnp.minimum(bits & 1, 0)


def append(
    cache: KVCache,
    k_new: Float[Array, "B T K H"],
    v_new: Float[Array, "B T K H"],
    lengths: Int[Array, " B"],
    *,
    layout: str = SLOTS_MAJOR,
    ring: bool = False,
    after: Array | None = None,
) -> KVCache:
    """Appends the first `lengths[b]` new keys and values of each sequence and advances `pos`.

    The caller has checked capacity (`capacity_ok`) and passes zero
    `lengths` for sequences that must not change. `after` names a result
    that reads the old cache (the attention output): see `_zero_after`.
    """
    k_stored, k_scale = encode(k_new, cache.k.dtype)
    v_stored, v_scale = encode(v_new, cache.v.dtype)

    def put(buffer, new):
        return _write(buffer, new, cache.pos, lengths, layout, ring, after)

    return KVCache(
        k=put(cache.k, k_stored),
        v=put(cache.v, v_stored),
        pos=cache.pos + lengths,
        k_scale=None if k_scale is None else put(cache.k_scale, k_scale),
        v_scale=None if v_scale is None else put(cache.v_scale, v_scale),
    )


def relayout(cache: KVCache, layout: str, target: str) -> KVCache:
    """The same cache with its buffers (and scales) in the `target` layout instead of `layout`."""
    if layout == target:
        return cache
    k_scale, v_scale = (None if s is None else jnp.swapaxes(s, 1, 2) for s in (cache.k_scale, cache.v_scale))
    return KVCache(jnp.swapaxes(cache.k, 1, 2), jnp.swapaxes(cache.v, 1, 2), cache.pos, k_scale, v_scale)


def _map(fn, cache: KVCache) -> KVCache:
    return KVCache(*(None if array is None else fn(array) for array in cache))


def _per_sequence(mask: Array, array: Array) -> Array:
    return mask.reshape((-1,) + (1,) * (array.ndim - 1))


def clear(cache: KVCache, which: Bool[Array, " B"]) -> KVCache:
    """Empties the chosen sequences (`pos = 0`, zeroed buffers); others stay bit-identical."""
    return _map(lambda a: jnp.where(_per_sequence(which, a), jnp.zeros((), a.dtype), a), cache)


def truncate(cache: KVCache, keep: Int[Array, " B"], layout: str = SLOTS_MAJOR) -> KVCache:
    """Keeps the first `keep[b]` tokens of sequence b and zeros the slots after them."""

    def cut(array):
        if array.ndim == 1:
            return keep.astype(array.dtype)
        slot_axis = layout.index("S")
        shape = [1] * array.ndim
        shape[slot_axis] = array.shape[slot_axis]
        slot = jnp.arange(array.shape[slot_axis]).reshape(shape)
        kept = slot < _per_sequence(keep, array)
        return jnp.where(kept, array, jnp.zeros((), array.dtype))

    return _map(cut, cache)


def fork(cache: KVCache, source: int | Int[Array, ""], targets: Bool[Array, " B"]) -> KVCache:
    """Copies sequence `source` into every sequence marked in `targets`."""
    return _map(lambda a: jnp.where(_per_sequence(targets, a), a[source][None], a), cache)


def reorder(cache: KVCache, order: Int[Array, " B"]) -> KVCache:
    """Sequence b of the result is sequence `order[b]` of the input (beam search)."""
    return _map(lambda a: jnp.take(a, order, axis=0), cache)
