"""The contiguous KV cache type and its pure transitions: append, clear, truncate, fork, reorder.

A batch of caches is a `KVCache`: keys and values as `Stored` arrays (the
storage dtype, with int8's per-slot, per-head scales bundled alongside),
`(B, S, K, H)` or `(B, K, S, H)`, the next free position `pos: (B,)`, and
static facts carried in the pytree structure: the `layout`, for a ring the
`window`, and the `kernel` a decode step's attention runs
(`AttentionConfig.decode_kernel`, see `kvattn.kernels`). Axis letters follow
`kvattn.math.ops`.

Every function returns a new cache and never touches a slot it was not asked
to: writes that must not happen are sent to an explicit out-of-range index
and dropped, never clamped or wrapped onto a live slot. Slots that hold no
token are kept at zero (the attention masks them, and zero keeps their
masked contribution exactly zero).

A ring cache (`window=W`, with `S = W` slots) keeps the last W tokens:
position p lives in slot `p % W`, and `pos` counts every token ever appended,
up to the int32 limit (`kvattn.caches.base.INT32_MAX`).

`KVCache` is the cache type of the `kvattn.caches.base.Contiguous` spec and
implements `kvattn.caches.base.CacheType`: `fits` (which sequences a call may
write), `attend` (the attention read, and any write made before it),
`commit` (the write left pending, made after the output); and, on the
layer's side, `variables` (the `nnx.Cache` arrays it needs), `bind` (those
arrays, checked, as a cache) and `unbind`. It also serves `clear`,
`truncate`, `fork` and `reorder`.

A sequence whose `pos` is `INVALID_POS` (-1) is poisoned: an out-of-range
index under `jit` (where nothing can raise) leaves it so. It holds no token,
accepts no write, its outputs are NaN (see `capacity_ok`), and eager calls
refuse it until it is `clear`ed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvattn import kernels
from kvattn import validation as check
from kvattn.caches.base import INT32_MAX, Contiguous
from kvattn.caches.storage import Stored, capacity_ok, encode
from kvattn.config import AttentionConfig
from kvattn.math import ops
from kvattn.math.ops import SLOTS_MAJOR

__all__ = [
    "INVALID_POS",
    "KVCache",
    "append",
    "bind",
    "clear",
    "fork",
    "relayout",
    "reorder",
    "can_roll_back",
    "truncate",
    "unbind",
    "variables",
]

INVALID_POS = -1


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("k", "v", "pos", "pending"),
    meta_fields=("layout", "window", "kernel", "length_buckets", "logit_softcap", "block_diagonal"),
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The decoding state of a batch of sequences, as plain arrays plus its static facts.

    `pos` is int32 `(B,)`. `pending` is the `(k, v, written)` that `attend`
    read first and `commit` writes (None outside `extend`). The static
    facts: `layout`, a ring's `window`, the `kernel` a decode step runs,
    and what its attention reads with (`length_buckets`, `logit_softcap`,
    `block_diagonal`: see `kvattn.math.ops`). The fields are typed loosely
    on purpose: JAX rebuilds pytrees with other leaves (shardings, tracers,
    placeholders).
    """

    spec: ClassVar[type] = Contiguous

    k: Any
    v: Any
    pos: Any
    layout: str = SLOTS_MAJOR
    window: int | None = None
    kernel: str = "auto"
    length_buckets: tuple[int, ...] = ()
    logit_softcap: float | None = None
    block_diagonal: bool = True
    pending: Any = None

    @property
    def num_slots(self) -> int:
        return self.k.values.shape[self.layout.index("S")]

    def replace(self, **changes) -> KVCache:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------- the interface of a cache type

    @property
    def capacity(self) -> int:
        """Tokens one sequence may append in all: its slots, or the int32 limit of `pos` for a ring."""
        return self.num_slots if self.window is None else INT32_MAX

    @classmethod
    def variables(cls, config: AttentionConfig) -> dict:
        return variables(config)

    @classmethod
    def bind(cls, config: AttentionConfig, arrays: dict, **how) -> KVCache:
        return bind(config, arrays, **how)

    def unbind(self, config: AttentionConfig, *, batched: bool = True) -> dict:
        return unbind(config, self, batched=batched)

    def fits(self, lengths: Int[Array, " B"]) -> Bool[Array, " B"]:
        """Which sequences may append `lengths` tokens: valid, and within `capacity` tokens."""
        return capacity_ok(self.pos, lengths, self.capacity)

    def attend(self, q, k, v, lengths, written, *, write_first: bool):
        """`(ctx, cache)`: read first, the write left pending for `commit`; or written first (`_read`)."""
        ctx, cache = self._read(q, k, v, lengths, written, write_first)
        return ctx, cache if write_first else cache.replace(pending=(k, v, written))

    def commit(self, after) -> KVCache:
        """The write `attend` left pending (a read first), after the output `after`, so XLA updates donated
        buffers in place."""
        if self.pending is None:
            return self
        return append(self.replace(pending=None), *self.pending, after=after)

    def clear(self, which: Bool[Array, " B"]) -> KVCache:
        return clear(self, which)

    def truncate(self, keep: Int[Array, " B"]) -> KVCache:
        return truncate(self, keep)

    def can_roll_back(self, keep: Int[Array, " B"]) -> Bool[Array, " B"]:
        return can_roll_back(self, keep)

    def fork(self, source: Int[Array, ""], targets: Bool[Array, " B"]) -> KVCache:
        return fork(self, source, targets)

    def reorder(self, order: Int[Array, " B"]) -> KVCache:
        return reorder(self, order)

    def _read(self, q, k, v, lengths, written, write_first: bool):
        """Attention of new queries `(B, T, N, H)` over the cache and the new chunk: `(ctx, cache)`.

        Read first (default), attention reads the old cache and the chunk
        apart and the write waits for `commit`; `write_first` writes `written`
        tokens now and reads the cache alone (one pass, fewer ops per step). A
        ring chunk of several tokens cannot be written first (a later token
        would overwrite a slot an earlier one still sees): refused. A decode
        step or chunk may run on a Pallas or native kernel instead: the route
        picks (`kvattn.kernels.contiguous_attention`).
        """
        if write_first and self.window is not None and q.shape[1] > 1:
            raise ValueError(f"a ring chunk of {q.shape[1]} tokens must be read first; use write_first only for steps")
        old_pos = self.pos
        cache = append(self, k, v, written) if write_first else self
        options = dict(layout=self.layout, window=self.window, block_diagonal=self.block_diagonal,
                       logit_softcap=self.logit_softcap)

        def read(kv):
            (k_cache, k_scale), (v_cache, v_scale) = kv
            if write_first:
                return ops.cached_attention(
                    q, written, k_cache, v_cache, old_pos, k_scale=k_scale, v_scale=v_scale, v_new=v, **options
                )
            return ops.attention(
                q, k, v, lengths, k_cache, v_cache, old_pos, k_scale=k_scale, v_scale=v_scale, **options
            )

        def on_xla():  # the longest filled prefix of the batch (at most the ring): what the read covers
            filled = jnp.max(cache.pos) if cache.window is None else jnp.minimum(jnp.max(cache.pos), cache.num_slots)
            return ops.bucketed(read, (cache.k, cache.v), filled, cache.length_buckets or (cache.num_slots,),
                                cache.layout)

        ctx = kernels.contiguous_attention(
            q, k, v, lengths, written, cache.k.values, cache.v.values, cache.k.scale, old_pos, cache.pos,
            mode=self.kernel, layout=self.layout, window=self.window, write_first=write_first,
            logit_softcap=self.logit_softcap, on_xla=on_xla,
        )
        return ctx, cache


def _write(buffer: Array, new: Array, start: Int[Array, " B"], lengths: Int[Array, " B"], layout: str, ring: bool) -> Array:
    """Writes `new[b, :lengths[b]]` (`(B, T, K, ...)`) at positions `start[b] ..` of sequence b.

    One sequence at a time under `vmap`, so a batch split over devices
    writes where it lives, without gathering the new tokens.
    """
    slot_axis = layout.index("S") - 1  # within one sequence
    num_slots, num_new = buffer.shape[slot_axis + 1], new.shape[1]

    def write_one(buffer, new, start, length):
        offsets = jnp.arange(num_new)
        real = offsets < length
        # Padding offsets may pass the int32 limit near it; they are dropped anyway.
        slots = start + jnp.where(real, offsets, 0)
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
    after: Array | None = None,
) -> KVCache:
    """Appends the first `lengths[b]` new keys and values of each sequence and advances `pos`.

    The caller has checked capacity (`capacity_ok`) and passes zero
    `lengths` for sequences that must not change. `after` names a result
    that reads the old cache (the attention output): see `_zero_after`.
    """
    start = cache.pos if after is None else cache.pos + _zero_after(after)

    def put(stored: Stored, new: Array) -> Stored:
        new = encode(new, stored.values.dtype)
        return jax.tree.map(
            lambda buffer, x: _write(buffer, x, start, lengths, cache.layout, cache.window is not None), stored, new
        )

    return cache.replace(k=put(cache.k, k_new), v=put(cache.v, v_new), pos=cache.pos + lengths)


def relayout(cache: KVCache, target: str) -> KVCache:
    """The same cache with its buffers (and scales) in the `target` layout."""
    if cache.layout == target:
        return cache
    swap = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    return cache.replace(k=jax.tree.map(swap, cache.k), v=jax.tree.map(swap, cache.v), layout=target)


def _per_sequence(mask: Array, array: Array) -> Array:
    return mask.reshape((-1,) + (1,) * (array.ndim - 1))


def _select(which: Bool[Array, " B"], chosen: KVCache, other: KVCache) -> KVCache:
    """Sequence by sequence, `chosen` where `which`, else `other`."""
    return jax.tree.map(lambda a, b: jnp.where(_per_sequence(which, a), a, b), chosen, other)


def _emptied(cache: KVCache, pos: int = 0) -> KVCache:
    """Every sequence emptied: zero buffers, `pos` set to `pos`."""
    empty = jax.tree.map(jnp.zeros_like, cache)
    return empty.replace(pos=jnp.full_like(cache.pos, pos))


def clear(cache: KVCache, which: Bool[Array, " B"]) -> KVCache:
    """Empties the chosen sequences (`pos = 0`, zeroed buffers); others stay bit-identical."""
    return _select(which, _emptied(cache), cache)


def truncate(cache: KVCache, keep: Int[Array, " B"]) -> KVCache:
    """Keeps the first `keep[b]` tokens of sequence b and zeros the slots after them.

    A ring zeros the slots of the positions it drops. It can only roll back
    while it still holds every position the next query sees (`can_roll_back`):
    a sequence asked for more is emptied and poisoned (`pos` = `INVALID_POS`),
    as an out-of-range index under `jit` leaves it.
    """
    slot_axis, num_slots = cache.layout.index("S"), cache.num_slots
    slot = jnp.arange(num_slots)[None, :]
    if cache.window is None:
        held = slot  # the position each slot holds
    else:  # the latest position p < pos with p % S == slot
        pos = cache.pos[:, None]
        held = pos - 1 - (pos - 1 - slot) % num_slots
    kept = held < keep[:, None]
    valid = can_roll_back(cache, keep)
    kept &= valid[:, None]

    def cut(array):
        shape = [array.shape[0]] + [1] * (array.ndim - 1)
        shape[slot_axis] = num_slots
        return jnp.where(kept.reshape(shape), array, jnp.zeros((), array.dtype))

    pos = jnp.where(valid, keep, INVALID_POS).astype(cache.pos.dtype)
    return cache.replace(k=jax.tree.map(cut, cache.k), v=jax.tree.map(cut, cache.v), pos=pos)


def can_roll_back(cache: KVCache, keep: Int[Array, " B"]) -> Bool[Array, " B"]:
    """Whether each sequence can keep only its first `keep[b]` tokens (`0 <= keep <= pos`).

    Always without a window. A ring of S slots holds positions `pos - S ..
    pos - 1`, and a query at `keep` sees the `window - 1` before it: it can
    roll back `S - window + 1` tokens (its spare slots and one), or to
    nothing, or anywhere while it has not yet wrapped.
    """
    if cache.window is None:
        return jnp.ones(keep.shape, jnp.bool_)
    oldest = cache.pos - cache.num_slots  # the oldest position held, when it has wrapped
    return (keep == 0) | (oldest <= jnp.maximum(keep - cache.window + 1, 0))


def fork(cache: KVCache, source: Int[Array, ""], targets: Bool[Array, " B"]) -> KVCache:
    """Copies sequence `source` into every sequence marked in `targets`.

    A `source` outside `[0, B)` (only possible under `jit`) poisons the targets.
    """
    batch = cache.pos.shape[0]
    valid = (source >= 0) & (source < batch)
    copied = jax.tree.map(lambda a: jnp.broadcast_to(a[jnp.clip(source, 0, batch - 1)][None], a.shape), cache)
    copied = _select(jnp.broadcast_to(valid, (batch,)), copied, _emptied(cache, INVALID_POS))
    return _select(targets, copied, cache)


def reorder(cache: KVCache, order: Int[Array, " B"]) -> KVCache:
    """Sequence b of the result is sequence `order[b]` of the input (beam search).

    An entry outside `[0, B)` (only possible under `jit`) poisons sequence b.
    """
    batch = cache.pos.shape[0]
    valid = (order >= 0) & (order < batch)
    taken = jax.tree.map(lambda a: jnp.take(a, jnp.clip(order, 0, batch - 1), axis=0), cache)
    return _select(valid, taken, _emptied(cache, INVALID_POS))


# ------------------------------------------------------------ the layer's side


def variables(config: AttentionConfig) -> dict[str, tuple[tuple, tuple, jnp.dtype]]:
    """The `nnx.Cache` arrays a contiguous (or ring) layer holds: name -> (shape, mesh axes, dtype).

    `(B, S, K, H)` or `(B, K, S, H)` keys and values without the batch axis
    for an unbatched layer, `pos` `(B,)` or `()`, and int8's scales.
    """
    lead, lead_axes = ((), ()) if config.cache.batch_size is None else ((config.cache.batch_size,), (config.data_axis,))
    if config.layout == SLOTS_MAJOR:
        slots, slot_axes = (config.num_slots, config.num_kv_heads), (None, config.model_axis)
    else:
        slots, slot_axes = (config.num_kv_heads, config.num_slots), (config.model_axis, None)
    dtype = jnp.dtype(config.cache.dtype)
    specs = {
        "k_cache": ((*lead, *slots, config.head_dim), (*lead_axes, *slot_axes, None), dtype),
        "v_cache": ((*lead, *slots, config.head_dim), (*lead_axes, *slot_axes, None), dtype),
        "pos": (lead, lead_axes, jnp.dtype(jnp.int32)),
    }
    if config.cache.dtype == "int8":
        specs["k_scale"] = ((*lead, *slots), (*lead_axes, *slot_axes), jnp.dtype(jnp.float32))
        specs["v_scale"] = ((*lead, *slots), (*lead_axes, *slot_axes), jnp.dtype(jnp.float32))
    return specs


def bind(config: AttentionConfig, arrays: dict, *, pages=None, lengths=None, batched: bool = True,
         operation: str = "this call") -> KVCache:
    """The layer's arrays as a `KVCache` (with a batch axis unless `batched=False`).

    With `lengths` (a call about to append them), checks first that every
    sequence holds a valid state and has room. `pages` is refused: only a
    paged layer takes them. (`operation` names the caller in a paged
    layer's refusals; a contiguous cache serves them all.)
    """
    if pages is not None:
        raise ValueError("pages= is only for a paged layer (built with num_pages and page_size)")
    cache = KVCache(
        k=Stored(arrays["k_cache"], arrays.get("k_scale")), v=Stored(arrays["v_cache"], arrays.get("v_scale")),
        pos=arrays["pos"], layout=config.layout, window=config.window, kernel=kernels.cache_kernel(config),
        length_buckets=config.cache.length_buckets, logit_softcap=config.logit_softcap,
        block_diagonal=not config.heads_split,
    )
    if lengths is not None:
        check.capacity(config, check.state(config, cache.pos), lengths)
    if batched and config.cache.batch_size is None:
        return jax.tree.map(lambda a: a[None], cache)
    return cache


def unbind(config: AttentionConfig, cache: KVCache, *, batched: bool = True) -> dict:
    """The inverse of `bind`: the arrays to store, by variable name (`batched=False`: `cache` is as stored)."""
    if batched and config.cache.batch_size is None:
        cache = jax.tree.map(lambda a: a[0], cache)
    arrays = {"k_cache": cache.k.values, "v_cache": cache.v.values, "pos": cache.pos.astype(jnp.int32)}
    if cache.k.scale is not None:
        arrays.update(k_scale=cache.k.scale, v_scale=cache.v.scale)
    return arrays
