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
from kvattn import paged as paged_ops
from kvattn.config import AttentionConfig
from kvattn.rope import apply_rope

__all__ = ["FusedWeights", "Weights", "attention_inputs", "causal_self_attention", "extend", "output", "project_qkv"]


class Weights(NamedTuple):
    """The layer's parameters as plain arrays (None where a bias or a norm is absent)."""

    query_kernel: jax.Array
    query_bias: jax.Array | None
    key_kernel: jax.Array
    key_bias: jax.Array | None
    value_kernel: jax.Array
    value_bias: jax.Array | None
    out_kernel: jax.Array
    out_bias: jax.Array | None
    query_ln: jax.Array | None = None
    """Scale `(H,)` of the per-head query norm (`normalize_qk`)."""
    key_ln: jax.Array | None = None

    def fused(self) -> FusedWeights:
        """The query, key and value kernels side by side, for one matmul instead of three."""
        kernels = (self.query_kernel, self.key_kernel, self.value_kernel)
        biases = (self.query_bias, self.key_bias, self.value_bias)
        if all(b is None for b in biases):
            bias = None
        else:  # a projection without a bias adds zeros
            bias = jnp.concatenate(
                [jnp.zeros(k.shape[1:], k.dtype) if b is None else b for k, b in zip(kernels, biases, strict=True)]
            )
        return FusedWeights(
            jnp.concatenate(kernels, axis=1), bias, self.out_kernel, self.out_bias, self.query_ln, self.key_ln
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
    query_ln: jax.Array | None = None
    key_ln: jax.Array | None = None


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


def compute_dtype(config: AttentionConfig, xs) -> jnp.dtype:
    """The projections' dtype: `config.dtype`, else promoted from the inputs and the weights (as in Flax)."""
    return jnp.dtype(config.dtype) if config.dtype is not None else jnp.result_type(xs.dtype, config.param_dtype)


def attention_inputs(config: AttentionConfig, weights: Weights | FusedWeights, xs, positions):
    """Queries, keys and values `(B, T, N|K, H)` of tokens `(B, T, D)` at `positions` `(B, T)`, in float32.

    Projected in the computation dtype, then normalised per head
    (`normalize_qk`) and rotated (`rope`): what attention reads and what the
    cache stores, so a cached key is never rotated again.
    """
    dtype = compute_dtype(config, xs)
    weights = jax.tree.map(lambda w: w.astype(dtype), weights)
    q, k, v = project_qkv(weights, xs.astype(dtype), config.heads_split)
    if config.normalize_qk:
        norm = ops.rms_norm if config.normalize_qk == "rms" else ops.layer_norm
        q, k = norm(q, weights.query_ln, config.qk_norm_eps), norm(k, weights.key_ln, config.qk_norm_eps)
    if config.rope is not None:
        q, k = apply_rope(q, positions, config.rope), apply_rope(k, positions, config.rope)
    return q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)


def output(config: AttentionConfig, weights: Weights | FusedWeights, ctx, xs):
    """The `out` projection of float32 attention values `(B, T, N, H)`, in the computation dtype."""
    dtype = compute_dtype(config, xs)
    bias = None if weights.out_bias is None else weights.out_bias.astype(dtype)
    return ops.project_out(ctx.astype(dtype), weights.out_kernel.astype(dtype), bias)


@functools.partial(jax.jit, static_argnames=("config",))
def causal_self_attention(weights: Weights, xs, *, config: AttentionConfig):
    """Full causal self-attention of tokens `(B, T, D)`, no cache: the training path.

    Token t sits at position t; with a window it sees the last `window` tokens.
    """
    positions = jnp.broadcast_to(jnp.arange(xs.shape[1]), xs.shape[:2])
    q, k, v = attention_inputs(config, weights, xs, positions)
    lengths = jnp.full(xs.shape[:1], xs.shape[1], jnp.int32)
    ctx = ops.attention(q, k, v, lengths, window=config.window, logit_softcap=config.logit_softcap)
    return output(config, weights, ctx, xs)


@functools.partial(jax.jit, static_argnames=("config", "write_first"))
def extend(
    weights: Weights | FusedWeights,
    cache: cache_ops.KVCache | paged_ops.PagedKVCache,
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
    paged = isinstance(cache, paged_ops.PagedKVCache)
    if write_first and cache.window is not None and num_new > 1 and not paged:
        raise ValueError(f"a ring chunk of {num_new} tokens must be read first; use write_first only for steps")
    real = jnp.arange(num_new)[None, :] < lengths[:, None]
    xs = jnp.where(real[:, :, None], xs, jnp.zeros((), xs.dtype))
    if paged:
        fits = cache_ops.capacity_ok(cache.pos, lengths, cache.capacity) & paged_ops.mapped(cache, lengths)
    else:
        fits = cache_ops.capacity_ok(cache.pos, lengths, config.capacity)
    written = jnp.where(fits, lengths, 0)
    old_pos = cache.pos
    q, k, v = attention_inputs(config, weights, xs, old_pos[:, None] + jnp.arange(num_new)[None, :])
    options = dict(
        layout=cache.layout, window=cache.window, block_diagonal=not config.heads_split,
        logit_softcap=config.logit_softcap,
    )
    if paged:
        cache = paged_ops.append(cache, k, v, written)
        ctx = _paged_attention(q, cache, old_pos, written, options)
    else:
        if write_first:
            cache = cache_ops.append(cache, k, v, written)

        def attend(kv):
            (k_cache, k_scale), (v_cache, v_scale) = kv
            if write_first:
                return ops.cached_attention(
                    q, written, k_cache, v_cache, old_pos, k_scale=k_scale, v_scale=v_scale, **options
                )
            return ops.attention(
                q, k, v, lengths, k_cache, v_cache, old_pos, k_scale=k_scale, v_scale=v_scale, **options
            )

        ctx = ops.bucketed(attend, (cache.k, cache.v), _filled(cache), config.length_buckets, cache.layout)
    ys = output(config, weights, ctx, xs)
    ys = jnp.where(real[:, :, None], ys, jnp.zeros((), ys.dtype))  # padding tokens
    ys = jnp.where(fits[:, None, None], ys, jnp.nan)  # sequences that overflowed
    if not (write_first or paged):
        # Stored after attention has read the old slots (`after`), so XLA can
        # update the donated buffers in place.
        cache = cache_ops.append(cache, k, v, written, after=ys)
    return ys, cache


def _paged_attention(q, cache: paged_ops.PagedKVCache, old_pos, written, options):
    """Attention of the new queries over a paged cache they are already written to.

    Reads each sequence's blocks a chunk at a time, as many chunks as the
    batch's longest sequence needs (`ops.chunked_cached_attention`): short
    chunks while the longest chunk would hold it whole, else long ones.
    """
    filled = old_pos + written
    first = paged_ops.first_block(cache, old_pos)
    needed = jnp.max((filled + cache.page_size - 1) // cache.page_size - first)
    sizes = paged_ops.chunk_sizes(cache)

    def read(chunk):
        def attend(cache):
            def read_chunk(index):
                (k, k_scale), (v, v_scale), slot_positions = paged_ops.view(cache, chunk, first + index * chunk, filled)
                return k, v, k_scale, v_scale, slot_positions

            num_chunks = (needed + chunk - 1) // chunk
            return ops.chunked_cached_attention(q, written, read_chunk, num_chunks, old_pos, **options)

        return attend

    long = needed > sizes[-1]
    return jax.lax.cond(long, read(sizes[-1]), read(sizes[0]), cache) if len(sizes) > 1 else read(sizes[0])(cache)


def _filled(cache: cache_ops.KVCache):
    """Slots a batch has filled: the longest sequence's, at most the ring size."""
    filled = jnp.max(cache.pos)
    return filled if cache.window is None else jnp.minimum(filled, cache.window)
