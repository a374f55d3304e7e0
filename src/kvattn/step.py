"""The pure decoding step: project, append, attend, project out, over a config, weights and a cache.

The NNX layer (`kvattn.attention`) and the fast drivers (`kvattn.decoding`)
both call `extend`; nothing here holds state. Axis letters follow
`kvattn.ops`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvattn import cache as cache_ops
from kvattn import ops
from kvattn.config import AttentionConfig

__all__ = ["FusedWeights", "Weights", "causal_self_attention", "extend", "project_qkv"]


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
    cost per dot, so one wider dot is cheaper per step. Inside a compiled
    loop the concatenation is loop-invariant (XLA hoists it); the decoding
    drivers fuse once, ahead of their loops.
    """

    qkv_kernel: jax.Array
    qkv_bias: jax.Array | None
    out_kernel: jax.Array
    out_bias: jax.Array | None


def project_qkv(weights: Weights | FusedWeights, xs, heads_split: bool = False):
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
    q, k, v = project_qkv(weights, xs, heads_split)
    ctx = ops.attention(q, k, v, jnp.full(xs.shape[:1], xs.shape[1], jnp.int32))
    return ops.project_out(ctx, weights.out_kernel, weights.out_bias)


@functools.partial(jax.jit, static_argnames=("config", "write_first"))
def extend(
    weights: Weights | FusedWeights,
    cache: cache_ops.KVCache,
    xs,
    lengths,
    *,
    config: AttentionConfig,
    write_first: bool = False,
):
    """Appends tokens to a batch of caches and attends: step and prefill as one pure function.

    Sequence b appends its first `lengths[b]` tokens of `xs` `(B, T, D)` at
    positions `cache.pos[b] ..`, each attending to the cache and causally to
    the chunk. A sequence without room for them (or poisoned, `pos < 0`)
    writes nothing, keeps its `pos` and gets NaN outputs: the in-graph half
    of the overflow contract. Padding tokens `t >= lengths[b]` are zeroed
    before anything reads them, so whatever they hold (NaN included) never
    reaches an output, and their outputs are zeros.

    `config` gives the capacity, the length buckets and whether heads are
    split over devices; the cache carries its own layout and window.

    Two orders give the same result, chosen here and nowhere else:
    - read first (default): attention reads the old cache and the new chunk
      apart, and the write comes last, tied to the output (see
      `cache._zero_after`), so XLA updates donated buffers in place under
      any surrounding `jit`;
    - `write_first`: the chunk is written, then attention reads the cache
      alone, one pass with fewer ops per step, which the decoding drivers
      use on the batched buffers they own. A ring chunk of more than one
      token cannot be written first (a later token would overwrite a slot
      an earlier one still sees), so it is refused rather than silently
      reordered.

    Returns:
      `(ys, cache)`: outputs `(B, T, D)` and the advanced cache.
    """
    num_new = xs.shape[1]
    if write_first and cache.window is not None and num_new > 1:
        raise ValueError(f"a ring chunk of {num_new} tokens must be read first; use write_first only for steps")
    real = jnp.arange(num_new)[None, :] < lengths[:, None]
    xs = jnp.where(real[:, :, None], xs, jnp.zeros((), xs.dtype))
    fits = cache_ops.capacity_ok(cache.pos, lengths, config.capacity)
    written = jnp.where(fits, lengths, 0)
    q, k, v = project_qkv(weights, xs, config.heads_split)
    options = dict(layout=cache.layout, window=cache.window, block_diagonal=not config.heads_split)
    old_pos = cache.pos
    if write_first:
        cache = cache_ops.append(cache, k, v, written)

        def attend(kv):
            (k_cache, k_scale), (v_cache, v_scale) = kv
            return ops.cached_attention(q, written, k_cache, v_cache, old_pos, k_scale=k_scale, v_scale=v_scale, **options)
    else:

        def attend(kv):
            (k_cache, k_scale), (v_cache, v_scale) = kv
            return ops.attention(
                q, k, v, lengths, k_cache, v_cache, old_pos, k_scale=k_scale, v_scale=v_scale, **options
            )

    ctx = ops.bucketed(attend, (cache.k, cache.v), _filled(cache), config.length_buckets, cache.layout)
    ys = ops.project_out(ctx, weights.out_kernel, weights.out_bias)
    ys = jnp.where(real[:, :, None], ys, 0.0)  # padding tokens
    ys = jnp.where(fits[:, None, None], ys, jnp.nan)  # sequences that overflowed
    if not write_first:
        # Stored after attention has read the old slots (`after`), so XLA can
        # update the donated buffers in place.
        cache = cache_ops.append(cache, k, v, written, after=ys)
    return ys, cache


def _filled(cache: cache_ops.KVCache):
    """Slots a batch has filled: the longest sequence's, at most the ring size."""
    filled = jnp.max(cache.pos)
    return filled if cache.window is None else jnp.minimum(filled, cache.window)
