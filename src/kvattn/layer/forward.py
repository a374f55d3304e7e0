"""The pure decoding step: project, append, attend, project out, over a config, weights and a cache.

The NNX layer (`kvattn.layer.attention`) and the fast drivers (`kvattn.layer.decoding`)
both call `extend`; nothing here holds state. Axis letters follow
`kvattn.math.ops`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvattn.kernels import dots
from kvattn.math import norms, ops, quant
from kvattn.caches.base import CacheType
from kvattn.config import AttentionConfig
from kvattn.math.rope import apply_rope

__all__ = [
    "FusedWeights", "Weights", "attention_inputs", "causal_self_attention", "extend", "extend_ragged", "output",
    "project_qkv",
]


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

    @property
    def out_weights(self) -> jax.Array:
        """The out kernel, by the name `FusedWeights` gives it (what `output` reads of either)."""
        return self.out_kernel

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
    drivers fuse once, ahead of their loops, and a layer may store its
    weights fused (`kvattn.models`).

    Either may be a plain float kernel or a storage form
    (`kvattn.math.quant.Form`, read by `kvattn.kernels.dots.dense` as it is):
    the fused kernel `(D, N + 2K, H)`, the out kernel `(N, H, D)`, its
    inputs flattened to `N * H` in the int8 and panel forms.
    """

    qkv_weights: jax.Array | quant.Form
    qkv_bias: jax.Array | None
    out_weights: jax.Array | quant.Form
    out_bias: jax.Array | None
    query_ln: jax.Array | None = None
    key_ln: jax.Array | None = None

    def fused(self) -> FusedWeights:
        """Already fused: itself (so the drivers take either form)."""
        return self

    def heads(self) -> tuple[int, int]:
        """`(N, K)`: the out kernel's query heads, and the rest of the fused heads axis halved."""
        qkv, out = self.qkv_weights, self.out_weights
        if quant.is_form(qkv):
            fused_heads, head_dim = qkv.features[:2]
            num_heads = out.inputs // head_dim
        else:
            fused_heads, num_heads = qkv.shape[1], out.shape[0]
        return num_heads, (fused_heads - num_heads) // 2


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
    num_heads, num_kv_heads = weights.heads()
    if quant.is_form(weights.qkv_weights):
        qkv = dots.dense(xs, weights.qkv_weights)
        qkv = qkv if weights.qkv_bias is None else qkv + weights.qkv_bias[None, None]
    else:
        qkv = ops.project(xs, weights.qkv_weights, weights.qkv_bias)
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
    # Forms are read as they are stored: converting one would write it out in full every call.
    weights = jax.tree.map(lambda w: w if quant.is_form(w) else w.astype(dtype), weights, is_leaf=quant.is_form)
    q, k, v = project_qkv(weights, xs.astype(dtype), config.heads_split)
    if config.normalize_qk:
        norm = {"rms": norms.rms_norm, "rms_offset": functools.partial(norms.rms_norm, offset=1.0),
                True: norms.layer_norm}[config.normalize_qk]
        q, k = norm(q, weights.query_ln, config.qk_norm_eps), norm(k, weights.key_ln, config.qk_norm_eps)
    if config.rope is not None:
        q, k = apply_rope(q, positions, config.rope), apply_rope(k, positions, config.rope)
    q = q.astype(jnp.float32)
    if config.query_scale is not None:  # attention scales by 1/sqrt(H) after this
        q = q * jnp.float32(config.query_scale * math.sqrt(config.head_dim))
    return q, k.astype(jnp.float32), v.astype(jnp.float32)


def output(config: AttentionConfig, weights: Weights | FusedWeights, ctx, xs):
    """The `out` projection of float32 attention values `(B, T, N, H)`, in the computation dtype."""
    dtype = compute_dtype(config, xs)
    bias = None if weights.out_bias is None else weights.out_bias.astype(dtype)
    if quant.is_form(weights.out_weights):
        batch, num_new = ctx.shape[:2]
        ys = dots.dense(ctx.astype(dtype).reshape(batch, num_new, -1), weights.out_weights)
        return ys if bias is None else ys + bias[None, None]
    return ops.project_out(ctx.astype(dtype), weights.out_weights.astype(dtype), bias)


@functools.partial(jax.jit, static_argnames=("config",))
def causal_self_attention(weights: Weights | FusedWeights, xs, *, config: AttentionConfig):
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
    cache: CacheType,
    xs,
    lengths,
    *,
    config: AttentionConfig,
    write_first: bool = False,
):
    """Appends tokens to a batch of caches and attends: step and prefill as one pure function.

    Sequence b appends its first `lengths[b]` tokens of `xs` `(B, T, D)` at
    positions `cache.pos[b] ..`, each attending to the cache and causally to
    the chunk. A sequence without room for them (or poisoned, `pos < 0`, or,
    paged, without a page for a block it writes) writes nothing, keeps its
    `pos` and gets NaN outputs: the in-graph half of the overflow contract.
    Padding tokens `t >= lengths[b]` are zeroed before anything reads them,
    so whatever they hold (NaN included) never reaches an output, and their
    outputs are zeros.

    The cache chooses its own path (`fits`, `attend`, `commit`: the
    `kvattn.caches.base.CacheType` interface) and carries its own static
    facts (capacity, layout, window, what attention reads with). `write_first`
    lets a cache write the chunk before attention reads it, one pass with
    fewer ops per step, which the decoding drivers use on the buffers they
    own; by default a contiguous cache reads first and writes last, tied to
    the output, so XLA updates donated buffers in place under any
    surrounding `jit`. `config` describes the attention (projections, norms,
    rotary positions).

    Returns:
      `(ys, cache)`: outputs `(B, T, D)` and the advanced cache.
    """
    real = jnp.arange(xs.shape[1])[None, :] < lengths[:, None]
    xs = jnp.where(real[:, :, None], xs, jnp.zeros((), xs.dtype))
    fits = cache.fits(lengths)
    written = jnp.where(fits, lengths, 0)
    q, k, v = attention_inputs(config, weights, xs, cache.pos[:, None] + jnp.arange(xs.shape[1])[None, :])
    ctx, cache = cache.attend(q, k, v, lengths, written, write_first=write_first)
    ys = output(config, weights, ctx, xs)
    ys = jnp.where(real[:, :, None], ys, jnp.zeros((), ys.dtype))  # padding tokens
    ys = jnp.where(fits[:, None, None], ys, jnp.nan)  # sequences that overflowed
    return ys, cache.commit(ys)


@functools.partial(jax.jit, static_argnames=("config", "groups"))
def extend_ragged(
    weights: Weights | FusedWeights,
    cache: CacheType,
    xs,
    lengths,
    *,
    config: AttentionConfig,
    groups: tuple[tuple[int, int], ...],
):
    """`extend` over groups of sequences of different widths in one call: one step's decode rows and a prefill
    chunk, say, whose projections then read the weights once rather than once per group.

    Group g is `groups[g] = (rows, width)`: `rows` consecutive sequences of
    the cache's batch (its table and positions, in group order), each
    appending up to `width` tokens. `xs` `(N, D)` holds every group's tokens
    flat, group after group and row after row (`N` is the sum of `rows *
    width`); `lengths` `(B,)` the real tokens of each row, as in `extend`.
    The projections, norms and rotary positions see the flat tokens; each
    group attends on its own (a decode read for width 1, a chunk read
    otherwise), after every group has written (`PagedKVCache.write`, then
    `read`), so a cache whose rows can be told apart (`PagedKVCache`: rows
    are table rows over one pool) is required.
    Every output equals `extend`'s on that group alone.

    Returns:
      `(ys, cache)`: outputs `(N, D)` and the advanced cache.
    """
    if not cache.spec.paged:
        raise TypeError(f"extend_ragged needs a paged cache, whose rows are page tables over one pool; got "
                        f"{type(cache).__name__}")
    starts = [0]
    for rows, _ in groups:
        starts.append(starts[-1] + rows)
    if starts[-1] != lengths.shape[0] or sum(r * w for r, w in groups) != xs.shape[0]:
        raise ValueError(f"groups {groups} hold {starts[-1]} rows of {sum(r * w for r, w in groups)} tokens; got "
                         f"lengths {lengths.shape} and xs {xs.shape}")
    fits = cache.fits(lengths)
    written = jnp.where(fits, lengths, 0)

    def flat(per_row, width):  # (rows,) -> (rows * width,), each row's value over its tokens
        return jnp.repeat(per_row, width, total_repeat_length=per_row.shape[0] * width)

    offsets = jnp.concatenate([jnp.tile(jnp.arange(width), rows) for rows, width in groups])
    spans = [slice(a, b) for a, b in zip(starts, starts[1:])]
    real = offsets < jnp.concatenate([flat(lengths[s], w) for s, (_, w) in zip(spans, groups)])
    xs = jnp.where(real[:, None], xs, jnp.zeros((), xs.dtype))
    positions = jnp.concatenate([flat(cache.pos[s], w) for s, (_, w) in zip(spans, groups)]) + offsets
    q, k, v = attention_inputs(config, weights, xs[None], positions[None])
    table, pos, parts, first = cache.table, cache.pos, [], 0
    for span, (rows, width) in zip(spans, groups):
        tokens = slice(first, first + rows * width)
        first += rows * width
        parts.append((span, *(a[0, tokens].reshape(rows, width, *a.shape[2:]) for a in (q, k, v))))
    for span, _, k_group, v_group in parts:  # every write before any read: no read is followed by a write
        part = cache.replace(table=table[span], pos=pos[span])  # copies are made by the first group's write
        cache = part.write(k_group, v_group, written[span], width=k_group.shape[1]).replace(table=table, pos=pos)
    ctxs = [cache.replace(table=table[span]).read(q_group, k_group, v_group, written[span], pos[span])
            for span, q_group, k_group, v_group in parts]
    ctxs = [ctx.reshape(-1, *ctx.shape[2:]) for ctx in ctxs]
    ys = output(config, weights, jnp.concatenate(ctxs)[None], xs[None])[0]
    ys = jnp.where(real[:, None], ys, jnp.zeros((), ys.dtype))
    unfit = jnp.concatenate([flat(~fits[s], w) for s, (_, w) in zip(spans, groups)])
    ys = jnp.where(unfit[:, None], jnp.nan, ys)
    return ys, cache.replace(pos=pos + written).commit(ys)
