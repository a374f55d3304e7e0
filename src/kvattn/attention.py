"""The NNX layer: learned projections, a KV cache in `nnx.Cache`, step and prefill.

The layer is thin: it validates inputs (raising before any state changes),
reads its variables, calls the pure functions of `kvattn.ops` and
`kvattn.cache`, and writes the results back. Internally every path works on
a batch; a layer built without `batch_size` holds one sequence and shows the
seed's unbatched shapes `(max_len, K, H)` and a scalar `pos`.
Axis letters follow the legend in `kvattn.ops`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import initializers

from kvattn import cache as cache_ops
from kvattn import ops

__all__ = ["CacheOverflowError", "FusedWeights", "MultiHeadAttention", "Weights", "attend", "causal_self_attention", "extend"]

default_kernel_init = initializers.lecun_normal()


class Weights(NamedTuple):
    """The layer's parameters as plain arrays (biases None without `use_bias`)."""

    query_kernel: jax.Array
    query_bias: jax.Array | None
    key_kernel: jax.Array
    key_bias: jax.Array | None
    value_kernel: jax.Array
    value_bias: jax.Array | None
    out_kernel: jax.Array
    out_bias: jax.Array | None

    def fused(self) -> FusedWeights:
        """The query, key and value kernels side by side, for one matmul instead of three."""
        biases = (self.query_bias, self.key_bias, self.value_bias)
        return FusedWeights(
            jnp.concatenate([self.query_kernel, self.key_kernel, self.value_kernel], axis=1),
            None if self.query_bias is None else jnp.concatenate(biases, axis=0),
            self.out_kernel,
            self.out_bias,
        )


class FusedWeights(NamedTuple):
    """`Weights` with the query, key and value projections fused into one kernel `(D, N + 2K, H)`.

    On one token the projections are three mat-vecs; XLA:CPU pays a fixed
    cost per dot, so one wider dot is measurably cheaper per step. Inside a
    compiled loop the concatenation is loop-invariant (XLA hoists it); the
    decoding drivers fuse once, ahead of their loops.
    """

    qkv_kernel: jax.Array
    qkv_bias: jax.Array | None
    out_kernel: jax.Array
    out_bias: jax.Array | None


def _project_qkv(weights: Weights | FusedWeights, xs, heads_split: bool = False):
    """Queries, keys and values `(B, T, N|K, H)` of tokens `(B, T, D)`.

    With `heads_split` (heads sharded over devices) the projections stay
    apart: a fused kernel would interleave the three head axes across devices.
    """
    if isinstance(weights, Weights):
        if heads_split:
            return (
                ops.project(xs, weights.query_kernel, weights.query_bias),
                ops.project(xs, weights.key_kernel, weights.key_bias),
                ops.project(xs, weights.value_kernel, weights.value_bias),
            )
        weights = weights.fused()
    num_heads = weights.out_kernel.shape[0]
    num_kv_heads = (weights.qkv_kernel.shape[1] - num_heads) // 2
    qkv = ops.project(xs, weights.qkv_kernel, weights.qkv_bias)
    return jnp.split(qkv, [num_heads, num_heads + num_kv_heads], axis=2)


@functools.partial(jax.jit, static_argnames=("heads_split",))
def causal_self_attention(weights: Weights, xs, heads_split: bool = False):
    """Full causal self-attention of tokens `(B, T, D)`, no cache: the training path."""
    q, k, v = _project_qkv(weights, xs, heads_split)
    ctx = ops.attention(q, k, v, jnp.full(xs.shape[:1], xs.shape[1], jnp.int32))
    return ops.project_out(ctx, weights.out_kernel, weights.out_bias)


@functools.partial(jax.jit, static_argnames=("max_len", "layout", "buckets", "window", "heads_split", "write_first"))
def extend(
    weights: Weights | FusedWeights,
    cache: cache_ops.KVCache,
    xs,
    lengths,
    *,
    max_len: int | None,
    layout: str,
    buckets: tuple[int, ...],
    window: int | None = None,
    heads_split: bool = False,
    write_first: bool = False,
):
    """Appends tokens to a batch of caches and attends: step and prefill as one pure function.

    Sequence b appends its first `lengths[b]` tokens of `xs` `(B, T, D)` at
    positions `cache.pos[b] ..`, each attending to the cache and causally to
    the chunk. A sequence without room for them writes nothing, keeps its
    `pos` and gets NaN outputs (the in-graph half of the overflow contract).
    Padding tokens `t >= lengths[b]` get zero outputs.

    `heads_split` says the heads are sharded over devices: the projections
    then stay apart and no head axis is merged (either would gather heads).

    Two orders give the same result. By default attention reads the old
    cache and the new chunk apart, and the write comes last, tied to the
    output (see `cache._zero_after`): XLA then updates donated buffers in
    place under any surrounding `jit`. With `write_first` the chunk is
    written, then attention reads the cache alone: one pass and fewer ops
    per step, which the decoding drivers use on the batched buffers they own.
    (On a layer's unbatched `(max_len, K, H)` buffers, XLA:CPU fuses that
    write into a reshape and copies the buffers.) A ring chunk of more than
    one token always reads first: its later tokens would overwrite slots
    its earlier ones still see.

    Returns:
      `(ys, cache)`: outputs `(B, T, D)` and the advanced cache.
    """
    num_new = xs.shape[1]
    fits = cache_ops.capacity_ok(cache.pos, lengths, max_len)
    written = jnp.where(fits, lengths, 0)
    q, k, v = _project_qkv(weights, xs, heads_split)
    ring = window is not None
    options = dict(layout=layout, window=window, block_diagonal=not heads_split)
    write_first = write_first and (not ring or num_new == 1)
    if write_first:
        old_pos = cache.pos
        cache = cache_ops.append(cache, k, v, written, layout=layout, ring=ring)

        def attend(k_cache, v_cache, k_scale, v_scale):
            return ops.cached_attention(
                q, written, k_cache, v_cache, old_pos, k_scale=k_scale, v_scale=v_scale, **options
            )
    else:

        def attend(k_cache, v_cache, k_scale, v_scale):
            return ops.attention(
                q, k, v, lengths, k_cache, v_cache, cache.pos, k_scale=k_scale, v_scale=v_scale, **options
            )

    arrays = (cache.k, cache.v, cache.k_scale, cache.v_scale)
    ctx = ops.bucketed(attend, arrays, _filled(cache.pos, window), buckets, layout)
    ys = ops.project_out(ctx, weights.out_kernel, weights.out_bias)
    real = jnp.arange(num_new)[None, :] < lengths[:, None]
    ys = jnp.where(real[:, :, None], ys, 0.0)  # padding tokens
    ys = jnp.where(fits[:, None, None], ys, jnp.nan)  # sequences that overflowed
    if not write_first:
        # Stored after attention has read the old slots (`after`), so XLA can
        # update the donated buffers in place.
        cache = cache_ops.append(cache, k, v, written, layout=layout, ring=ring, after=ys)
    return ys, cache


def _filled(pos, window):
    """Slots a batch has filled: the longest sequence's, at most the ring size."""
    filled = jnp.max(pos)
    return filled if window is None else jnp.minimum(filled, window)


class CacheOverflowError(ValueError):
    """A step or prefill would write past `max_len`; nothing was changed."""


def _is_traced(*arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class MultiHeadAttention(nnx.Module):
    """Causal multi-head attention with a KV cache for one-token-at-a-time decoding.

    Parameters have the paths and shapes of `flax.nnx.MultiHeadAttention`:
    `query`, `key`, `value` kernels `(D, N|K, H)` and biases `(N|K, H)`; `out`
    kernel `(N, H, D)` and bias `(D,)`. The decoding state lives in
    `nnx.Cache` variables: `k_cache`, `v_cache` float32 `(max_len, K, H)` (or
    `(B, max_len, K, H)` with `batch_size`; `K` before `max_len` in the
    heads-major layout) and `pos`, the next free slot, int32 `()` (or
    `(B,)`). int8 storage adds `k_scale`, `v_scale`, one float32 per slot and
    kv head.

    Overflow contract: a layer holds at most `max_len` tokens per sequence.
    Called eagerly, a `step` or `prefill` that would pass it raises
    `CacheOverflowError` before any state changes. Under `jit`, where `pos` is
    traced, an overflowing sequence writes no slot, keeps its `pos`, and its
    outputs are all NaN; the other sequences of a batch proceed. A windowed
    layer never overflows.

    Args:
      num_heads: query heads N.
      in_features: model width D.
      max_len: cache capacity in tokens, per sequence. Not used with `window`.
      head_dim: width H of a head; defaults to `in_features // num_heads`.
      num_kv_heads: key/value heads K (grouped-query attention); must divide
        `num_heads`. Defaults to `num_heads`; 1 gives multi-query attention.
      batch_size: number of sequences the cache holds, or None for one
        unbatched sequence.
      use_bias: whether the projections have biases.
      window: sliding-window attention over the last `window` tokens, kept
        in a ring of `window` slots: a stream can run forever at constant
        memory. Replaces `max_len`.
      cache_dtype: storage of keys and values: `"float32"` (the seed's),
        `"bfloat16"` (half the memory) or `"int8"` (a quarter, plus one
        float32 scale per token and head). Attention math is float32.
      cache_layout: `"slots_major"`, the seed's `(max_len, K, H)`, or
        `"heads_major"`, `(K, max_len, H)`: the same results, and 2-3x faster
        attention on XLA:CPU, whose batched dots want the head axis first.
      length_buckets: attend only over the smallest of these static prefix
        lengths that holds every filled slot, so a step costs about the filled
        length rather than `max_len`. None picks `ops.length_buckets`; `()`
        always reads the whole buffer; buckets past `max_len` are ignored.
      data_axis, model_axis: names of mesh axes to shard over: sequences of
        the batch over `data_axis`, heads (projections and cache) over
        `model_axis`. Recorded as Flax `out_sharding` annotations, applied
        when the layer is built under `jax.set_mesh(mesh)` or by
        `kvattn.shard`.
      kernel_init, bias_init: initializers, as in Flax.
      rngs: random streams for the initializers.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import kvattn
      >>> layer = kvattn.MultiHeadAttention(2, 8, max_len=16, rngs=nnx.Rngs(0))
      >>> xs = jnp.ones((5, 8))
      >>> y = layer.prefill(xs[:4])
      >>> y.shape, int(layer.pos[...])
      ((4, 8), 4)
      >>> bool(jnp.allclose(layer.step(xs[4]), layer(xs)[4], atol=1e-5))
      True
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        max_len: int | None = None,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        batch_size: int | None = None,
        use_bias: bool = True,
        window: int | None = None,
        cache_dtype: str = "float32",
        cache_layout: str = "slots_major",
        length_buckets: tuple[int, ...] | None = None,
        data_axis: str | None = None,
        model_axis: str | None = None,
        kernel_init=default_kernel_init,
        bias_init=initializers.zeros_init(),
        rngs: nnx.Rngs,
    ):
        num_heads = _positive_int("num_heads", num_heads)
        in_features = _positive_int("in_features", in_features)
        if (max_len is None) == (window is None):
            raise ValueError(
                f"give exactly one of max_len (a bounded cache) or window (a ring), "
                f"got max_len={max_len!r} and window={window!r}"
            )
        num_slots = _positive_int("window" if max_len is None else "max_len", window if max_len is None else max_len)
        if head_dim is None:
            if in_features % num_heads:
                raise ValueError(
                    f"in_features ({in_features}) must be divisible by num_heads ({num_heads}) "
                    "when head_dim is not given; pass head_dim explicitly"
                )
            head_dim = in_features // num_heads
        head_dim = _positive_int("head_dim", head_dim)
        num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if batch_size is not None:
            batch_size = _positive_int("batch_size", batch_size)
        if cache_layout not in ops.LAYOUTS:
            raise ValueError(f"cache_layout must be one of {sorted(ops.LAYOUTS)}, got {cache_layout!r}")
        if cache_dtype not in cache_ops.CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {sorted(cache_ops.CACHE_DTYPES)}, got {cache_dtype!r}")
        if length_buckets is None:
            cache_bytes = (batch_size or 1) * num_slots * cache_ops.bytes_per_token(num_kv_heads, head_dim, cache_dtype)
            length_buckets = ops.length_buckets(num_slots, cache_bytes=cache_bytes)
        else:
            if length_buckets and min(length_buckets) < 1:
                raise ValueError(f"length_buckets must be positive slot counts, got {length_buckets}")
            # Buckets at or past the slot count add nothing: the last one is all slots.
            length_buckets = tuple(sorted({int(b) for b in length_buckets if b < num_slots} | {num_slots}))

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.in_features = in_features
        self.head_dim = head_dim
        self.max_len = max_len
        self.window = window
        self.num_slots = num_slots
        self.batch_size = batch_size
        self.use_bias = use_bias
        self.cache_dtype = cache_dtype
        self.cache_layout = cache_layout
        self.layout = ops.LAYOUTS[cache_layout]
        self.length_buckets = length_buckets
        self.data_axis = data_axis
        self.model_axis = model_axis

        def linear(in_f, out_f, kernel_axes, bias_axes, **kw):
            return nnx.LinearGeneral(
                in_f, out_f, use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init, rngs=rngs,
                kernel_metadata=self._annotation(kernel_axes), bias_metadata=self._annotation(bias_axes), **kw,
            )

        heads = (None, model_axis, None)
        self.query = linear(in_features, (num_heads, head_dim), heads, (model_axis, None))
        self.key = linear(in_features, (num_kv_heads, head_dim), heads, (model_axis, None))
        self.value = linear(in_features, (num_kv_heads, head_dim), heads, (model_axis, None))
        self.out = linear((num_heads, head_dim), in_features, (model_axis, None, None), (None,), axis=(-2, -1))

        lead, lead_axes = ((), ()) if batch_size is None else ((batch_size,), (data_axis,))
        if self.layout == ops.SLOTS_MAJOR:
            slots, slot_axes = (num_slots, num_kv_heads), (None, model_axis)
        else:
            slots, slot_axes = (num_kv_heads, num_slots), (model_axis, None)
        dtype = cache_ops.CACHE_DTYPES[cache_dtype]

        def cache(shape, axes, dtype):
            return nnx.Cache(jnp.zeros(shape, dtype), **self._annotation(axes))

        self.k_cache = cache((*lead, *slots, head_dim), (*lead_axes, *slot_axes, None), dtype)
        self.v_cache = cache((*lead, *slots, head_dim), (*lead_axes, *slot_axes, None), dtype)
        self.pos = cache(lead, lead_axes, jnp.int32)
        if cache_dtype == "int8":
            self.k_scale = cache((*lead, *slots), (*lead_axes, *slot_axes), jnp.float32)
            self.v_scale = cache((*lead, *slots), (*lead_axes, *slot_axes), jnp.float32)

    def _annotation(self, axes) -> dict:
        """Flax sharding metadata for a variable, or nothing when no mesh axis is named."""
        if self.data_axis is None and self.model_axis is None:
            return {}
        # Placed now only under a mesh (`jax.set_mesh`); otherwise later, by `kvattn.shard`.
        eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
        return {"out_sharding": tuple(axes), "eager_sharding": eager}

    @property
    def cache_bytes_per_token(self) -> int:
        """Bytes of cache one token takes in one sequence (keys, values and int8 scales)."""
        return cache_ops.bytes_per_token(self.num_kv_heads, self.head_dim, self.cache_dtype)

    # ------------------------------------------------------------------ public

    def __call__(self, xs):
        """Full causal self-attention over `xs`, without reading or writing the cache.

        The training path and the recompute baseline.

        Args:
          xs: tokens `(T, D)` or a batch `(B, T, D)`.

        Returns:
          The feature vector of every token, same shape as `xs`.
        """
        xs = self._check_tokens(xs, "xs", ranks=(2, 3), check_batch=False)
        batched = xs.ndim == 3
        xs = xs if batched else xs[None]
        ys = causal_self_attention(self.weights, xs, heads_split=self.model_axis is not None)
        return ys if batched else ys[0]

    def step(self, x, active=None):
        """Decodes one token per sequence through the cache.

        Projects only `x`, writes its key and value at slot `pos`, advances
        `pos`, and attends over slots `0..pos` including the new one.

        Args:
          x: the new token `(D,)`, or `(B, D)` for a batched layer.
          active: batched layers only, optional bool `(B,)`: inactive sequences
            neither write nor advance, and return zeros.

        Returns:
          The new token's feature vector, same shape as `x`. NaN for a
          sequence that overflowed under jit (see the class docstring).
        """
        lead = 0 if self.batch_size is None else 1
        x = self._check_tokens(x, "x", ranks=(1 + lead,))
        if active is None:
            lengths = None
        else:
            active = self._check_mask(active, "active")
            lengths = active.astype(jnp.int32)
        ys = self._extend(x[..., None, :], lengths)
        return ys[..., 0, :]

    def prefill(self, xs, lengths=None):
        """Writes a chunk of tokens into the cache in one call.

        Each token attends causally to the cache and to the chunk up to
        itself; outputs and the final state equal those of one `step` per
        token, from any starting `pos`.

        Args:
          xs: tokens `(T, D)`, or `(B, T, D)` for a batched layer; T >= 1.
          lengths: batched layers only, optional int `(B,)` with
            `0 <= lengths[b] <= T`: sequence b takes its first `lengths[b]`
            tokens. Padding never enters the cache or any attention, and its
            outputs are zeros.

        Returns:
          The feature vector of every token, same shape as `xs`.
        """
        lead = 0 if self.batch_size is None else 1
        xs = self._check_tokens(xs, "xs", ranks=(2 + lead,))
        if xs.shape[-2] == 0:
            raise ValueError(f"prefill needs at least one token, got xs of shape {xs.shape}")
        if lengths is not None:
            lengths = self._check_lengths(lengths, xs.shape[-2])
        return self._extend(xs, lengths)

    def reset(self, which=None):
        """Empties the cache: `pos = 0` and zeroed buffers, as freshly built.

        Args:
          which: batched layers only, optional indices or bool mask `(B,)` of
            the sequences to empty; the others stay bit-identical.
        """
        self._set_cache(cache_ops.clear(self.cache, self._which(which)))

    def truncate(self, keep):
        """Rolls back: keeps the first `keep` tokens of each sequence and drops the rest.

        Dropped slots are zeroed and `pos` set to `keep`, so what follows is
        identical to never having decoded the dropped tokens: the building
        block of speculative decoding.

        Args:
          keep: tokens to keep, an int (every sequence) or int `(B,)` for a
            batched layer, with `0 <= keep <= pos`. Eagerly anything else
            raises; under jit a sequence asked to keep more than it holds is
            left as it is, and a negative count keeps nothing.

        Not available with `window`: the ring has already overwritten the
        tokens that would slide back into view.
        """
        if self.window is not None:
            raise ValueError("truncate is not supported on a windowed layer; reset() it or keep decoding")
        pos = self._batched(self.pos[...])
        keep = jnp.asarray(keep)
        if not jnp.issubdtype(keep.dtype, jnp.integer) or keep.shape not in ((), pos.shape):
            raise ValueError(f"keep must be an int or int array of shape {pos.shape}, got {keep.dtype} {keep.shape}")
        keep = jnp.broadcast_to(keep, pos.shape).astype(jnp.int32)
        if not _is_traced(pos, keep):
            bad = np.flatnonzero((np.asarray(keep) < 0) | (np.asarray(keep) > np.asarray(pos)))
            if bad.size:
                raise ValueError(
                    f"truncate keeps 0..pos tokens per sequence; got keep {np.asarray(keep)[bad].tolist()} "
                    f"for sequences {bad.tolist()} holding {np.asarray(pos)[bad].tolist()}"
                )
        self._set_cache(cache_ops.truncate(self.cache, jnp.clip(keep, 0, pos), self.layout))

    def fork(self, source, targets):
        """Copies sequence `source` (cache and `pos`) into other sequences of the batch.

        Share a prompt prefix: prefill it once, then fork it into the slots
        of the requests that start with it.

        Args:
          source: index of the sequence to copy.
          targets: indices or bool mask `(B,)` of the sequences to overwrite.
        """
        self._require_batched("fork")
        source = jnp.asarray(source)
        if not jnp.issubdtype(source.dtype, jnp.integer) or source.shape != ():
            raise ValueError(f"source must be one sequence index, got {source.dtype} {source.shape}")
        if not _is_traced(source) and not 0 <= int(source) < self.batch_size:
            raise ValueError(f"source must lie in [0, {self.batch_size}), got {int(source)}")
        self._set_cache(cache_ops.fork(self.cache, source, self._which(targets)))

    def reorder(self, order):
        """Sequence b becomes what sequence `order[b]` was (beam search selection).

        Args:
          order: int `(B,)` of source indices; repeats allowed.
        """
        order = self._check_per_sequence_ints(order, "order", upper=self.batch_size - 1)
        self._set_cache(cache_ops.reorder(self.cache, order))

    # ---------------------------------------------------------------- internal

    def _extend(self, xs, lengths):
        """Appends `xs` `([B,] T, D)` to the cache and attends; the core of step and prefill."""
        xs_b = self._batched(xs)
        batch, num_new = xs_b.shape[:2]
        cache = self.cache
        if lengths is None:
            lengths = jnp.full((batch,), num_new, jnp.int32)
        self._check_capacity(cache.pos, lengths)
        ys, cache = extend(
            self.weights,
            cache,
            xs_b,
            lengths,
            max_len=self.max_len,
            layout=self.layout,
            buckets=self.length_buckets,
            window=self.window,
            heads_split=self.model_axis is not None,
        )
        self._set_cache(cache)
        return ys if self.batch_size is not None else ys[0]

    @property
    def weights(self) -> Weights:
        """The four projections' current arrays."""

        def bias(linear):
            return None if linear.bias is None else linear.bias[...]

        return Weights(
            self.query.kernel[...],
            bias(self.query),
            self.key.kernel[...],
            bias(self.key),
            self.value.kernel[...],
            bias(self.value),
            self.out.kernel[...],
            bias(self.out),
        )

    @property
    def cache(self) -> cache_ops.KVCache:
        """The decoding state as plain arrays, always with a leading batch axis."""
        return cache_ops.KVCache(*(None if a is None else self._batched(a) for a in self.stored_cache))

    @property
    def stored_cache(self) -> cache_ops.KVCache:
        """The decoding state exactly as the `nnx.Cache` variables hold it (no batch axis added)."""
        int8 = self.cache_dtype == "int8"
        return cache_ops.KVCache(
            k=self.k_cache[...],
            v=self.v_cache[...],
            pos=self.pos[...],
            k_scale=self.k_scale[...] if int8 else None,
            v_scale=self.v_scale[...] if int8 else None,
        )

    def _set_cache(self, cache: cache_ops.KVCache):
        """Writes a `KVCache` (with its batch axis) back into the `nnx.Cache` variables."""
        unbatch = (lambda a: a[0]) if self.batch_size is None else (lambda a: a)
        self.k_cache[...] = unbatch(cache.k)
        self.v_cache[...] = unbatch(cache.v)
        self.pos[...] = unbatch(cache.pos).astype(jnp.int32)
        if self.cache_dtype == "int8":
            self.k_scale[...] = unbatch(cache.k_scale)
            self.v_scale[...] = unbatch(cache.v_scale)

    def _batched(self, array):
        return array if self.batch_size is not None else array[None]

    def _check_capacity(self, pos, lengths):
        if self.max_len is None or _is_traced(pos, lengths):
            return  # a ring never overflows; under jit the in-graph guard applies
        needed = np.asarray(pos) + np.asarray(lengths)
        over = np.flatnonzero(needed > self.max_len)
        if over.size:
            where = "" if self.batch_size is None else f" for sequences {over.tolist()}"
            raise CacheOverflowError(
                f"cache overflow{where}: pos {np.asarray(pos)[over].tolist()} + "
                f"{np.asarray(lengths)[over].tolist()} new tokens exceeds max_len={self.max_len}; "
                "nothing was written. Call reset() or build the layer with a larger max_len."
            )

    def _check_tokens(self, x, name, ranks, check_batch=True):
        if not isinstance(x, jax.Array):
            x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
        if x.ndim not in ranks:
            expected = " or ".join(f"rank {r}" for r in ranks)
            raise ValueError(f"{name} must have {expected} (..., D={self.in_features}), got shape {x.shape}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{name} must end in in_features={self.in_features}, got shape {x.shape}")
        if check_batch and self.batch_size is not None and x.shape[0] != self.batch_size:
            raise ValueError(f"{name} must have batch_size={self.batch_size} rows, got shape {x.shape}")
        return x

    def _require_batched(self, name):
        if self.batch_size is None:
            raise ValueError(f"{name} is only for layers built with batch_size; this layer holds one sequence")

    def _check_mask(self, mask, name):
        self._require_batched(name)
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_ or mask.shape != (self.batch_size,):
            raise ValueError(f"{name} must be bool ({self.batch_size},), got {mask.dtype} {mask.shape}")
        return mask

    def _check_lengths(self, lengths, num_new):
        return self._check_per_sequence_ints(lengths, "lengths", upper=num_new)

    def _check_per_sequence_ints(self, values, name, upper):
        """Int `(B,)` values, each (when not traced) in `[0, upper]`, as int32."""
        self._require_batched(name)
        values = jnp.asarray(values)
        if not jnp.issubdtype(values.dtype, jnp.integer) or values.shape != (self.batch_size,):
            raise ValueError(f"{name} must be int ({self.batch_size},), got {values.dtype} {values.shape}")
        if not _is_traced(values):
            host = np.asarray(values)
            if host.min() < 0 or host.max() > upper:
                raise ValueError(f"{name} must lie in [0, {upper}], got {host.tolist()}")
        return values.astype(jnp.int32)

    def _which(self, which):
        """Bool mask `(B,)` of sequences to act on; all of them when `which` is None."""
        batch = 1 if self.batch_size is None else self.batch_size
        if which is None:
            return jnp.ones((batch,), jnp.bool_)
        self._require_batched("which")
        which = jnp.asarray(which)
        if which.size == 0:
            which = which.astype(jnp.int32)  # `[]` is float32 to NumPy: no sequence, not a type error
        if which.dtype == jnp.bool_:
            return self._check_mask(which, "which")
        if not jnp.issubdtype(which.dtype, jnp.integer) or which.ndim > 1:
            raise ValueError(f"which must be indices or a bool mask ({batch},), got {which.dtype} {which.shape}")
        if not _is_traced(which):
            host = np.atleast_1d(np.asarray(which))
            if host.size and (host.min() < 0 or host.max() >= batch):
                raise ValueError(f"which indices must lie in [0, {batch}), got {host.tolist()}")
        return jnp.zeros((batch,), jnp.bool_).at[which].set(True)


def attend(layer: MultiHeadAttention, history, x, lengths=None):
    """The entrypoint: rebuilds the cache from `history`, then steps `x`.

    Every call resets the layer's cache, fills it with `history` (one
    prefill), steps `x` and returns its feature vector, which equals row T of
    `layer(concat(history, x))`. Afterwards the cache holds T + 1 tokens, so
    decoding can go on with `layer.step`.

    Args:
      layer: the attention layer; its cache is overwritten.
      history: earlier tokens `(T, D)` with T >= 0, or `(B, T, D)` for a
        batched layer.
      x: the new token `(D,)`, or `(B, D)`.
      lengths: batched layers only, optional `(B,)`: sequence b's history is
        its first `lengths[b]` rows (a padded batch of histories).

    Returns:
      The new token's feature vector, same shape as `x`.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import kvattn
      >>> layer = kvattn.MultiHeadAttention(2, 8, max_len=16, rngs=nnx.Rngs(0))
      >>> xs = jnp.arange(24.0).reshape(3, 8) / 24
      >>> y = kvattn.attend(layer, xs[:2], xs[2])
      >>> bool(jnp.allclose(y, layer(xs)[2], atol=1e-5)), int(layer.pos[...])
      (True, 3)
    """
    lead = 0 if layer.batch_size is None else 1
    history = layer._check_tokens(history, "history", ranks=(2 + lead,))
    x = layer._check_tokens(x, "x", ranks=(1 + lead,))
    if layer.max_len is not None and history.shape[-2] + 1 > layer.max_len:
        raise CacheOverflowError(
            f"history of {history.shape[-2]} tokens plus x does not fit max_len={layer.max_len}"
        )
    if lengths is not None:
        lengths = layer._check_lengths(lengths, history.shape[-2])
    layer.reset()
    if history.shape[-2]:
        layer.prefill(history, lengths)
    return layer.step(x)
