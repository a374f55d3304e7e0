"""The NNX layer: learned projections, a KV cache in `nnx.Cache`, step and prefill.

The layer is thin: it validates inputs through `kvattn.validation` (raising
before any state changes), reads its variables, calls the pure step
(`kvattn.layer.forward.extend`) and its cache type's transitions, and writes
the results back. Its static settings live in one `AttentionConfig`
(`layer.config`), whose `cache` spec chooses the cache type
(`kvattn.caches.registry`), once. Internally every path works on a batch; a layer built
without `batch_size` holds one sequence and shows the unbatched shapes
`(max_len, K, H)` and a scalar `pos`. Axis letters follow `kvattn.math.ops`.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import initializers

from kvattn.caches import paged as paged_ops
from kvattn.caches.registry import cache_type
from kvattn import validation as check
from kvattn.config import AttentionConfig
from kvattn.layer.forward import Weights, causal_self_attention, extend, extend_ragged

__all__ = ["MultiHeadAttention"]

default_kernel_init = initializers.lecun_normal()


class MultiHeadAttention(nnx.Module):
    """Causal multi-head attention with a KV cache for one-token-at-a-time decoding.

    Parameters have the paths and shapes of `flax.nnx.MultiHeadAttention`:
    `query`, `key`, `value` kernels `(D, N|K, H)` and biases `(N|K, H)`; `out`
    kernel `(N, H, D)` and bias `(D,)`. The decoding state lives in
    `nnx.Cache` variables that the cache type names (`kvattn.caches`): for
    the default `kvattn.Contiguous` cache, keys and values float32
    `(max_len, K, H)` (or `(B, max_len, K, H)` with `batch_size`; `K` before
    `max_len` in the heads-major layout), `pos`, the next free slot, int32
    `()` (or `(B,)`), and int8 storage's scales, one float32 per slot and kv
    head.

    Overflow contract: a layer holds at most `max_len` tokens per sequence.
    Called eagerly, a `step` or `prefill` that would pass it raises
    `CacheOverflowError` before any state changes. Under `jit`, where `pos` is
    traced, an overflowing sequence writes no slot, keeps its `pos`, and its
    outputs are all NaN; the other sequences of a batch proceed. A windowed
    layer holds any number of tokens up to the int32 limit of `pos`
    (2**31 - 1), under the same contract. An index out of range under `jit`
    (`fork`, `reorder`) poisons the sequences it would have written: they
    are emptied with `pos = -1`, their outputs are NaN, and eager calls
    raise `InvalidStateError` until they are `reset`.

    Every size and option is a keyword argument normalised once into
    `layer.config`, a frozen `AttentionConfig`, which documents them all
    (`window`, `head_dim`, `num_kv_heads`, `use_bias`, `rope`,
    `normalize_qk`, `logit_softcap`, `dtype`, `param_dtype`, mesh axes) and
    holds the cache as a spec: `cache=kvattn.Contiguous(max_len=...)` or
    `cache=kvattn.Paged(num_pages=..., page_size=..., max_len=...,
    batch_size=...)`, or the same as the keywords `max_len`, `batch_size`,
    `cache_dtype`, `cache_layout`, `length_buckets`, `num_pages`,
    `page_size`; the attributes of the same names read it.

    Args:
      num_heads: query heads N.
      in_features: model width D.
      kernel_init, bias_init: initializers of the projections, as in Flax.
      out_kernel_init, out_bias_init: those of `out`, if they differ.
      rngs: random streams for the initializers.
      **options: the fields of `AttentionConfig`, with its defaults: `cache`
        (a spec) or its keywords, `max_len` or `window` (for a contiguous
        cache exactly one), `head_dim`, `qkv_features`,
        `out_features`, `num_kv_heads`, `batch_size`, `use_bias`, `rope`,
        `normalize_qk`, `qk_norm_eps`, `logit_softcap`, `cache_dtype`,
        `cache_layout`, `length_buckets`, `dtype`, `param_dtype`,
        `data_axis`/`model_axis`, `num_pages`/`page_size`, `decode_kernel`.

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

    @typing.no_type_check  # validated by `AttentionConfig`, which names what it expected
    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        kernel_init=default_kernel_init,
        bias_init=initializers.zeros_init(),
        out_kernel_init=None,
        out_bias_init=None,
        rngs: nnx.Rngs,
        **options,
    ):
        self.config = config = AttentionConfig(num_heads, in_features, **options)

        def linear(name, in_f, out_f, kernel_axes, bias_axes, kernel_init=kernel_init, bias_init=bias_init, **kw):
            return nnx.LinearGeneral(
                in_f, out_f, use_bias=config.biased(name), kernel_init=kernel_init, bias_init=bias_init,
                param_dtype=config.param_dtype, rngs=rngs, kernel_metadata=self._annotation(kernel_axes),
                bias_metadata=self._annotation(bias_axes), **kw,
            )

        num_heads, num_kv_heads, head_dim, model_axis = (
            config.num_heads, config.num_kv_heads, config.head_dim, config.model_axis
        )
        heads = (None, model_axis, None)
        self.query = linear("query", config.in_features, (num_heads, head_dim), heads, (model_axis, None))
        self.key = linear("key", config.in_features, (num_kv_heads, head_dim), heads, (model_axis, None))
        self.value = linear("value", config.in_features, (num_kv_heads, head_dim), heads, (model_axis, None))
        self.out = linear(
            "out", (num_heads, head_dim), config.out_features, (model_axis, None, None), (None,), axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
        )
        if config.normalize_qk:
            # Flax's names and shapes: one scale per head dim, shared by every head.
            # The scale of "rms_offset" multiplies as `1 + scale` (`kvattn.math.norms.rms_norm`), so it starts at 0.
            norm = functools.partial(
                {"rms": nnx.RMSNorm, "rms_offset": functools.partial(nnx.RMSNorm, scale_init=nnx.initializers.zeros),
                 True: functools.partial(nnx.LayerNorm, use_bias=False)}[config.normalize_qk],
                head_dim, epsilon=config.qk_norm_eps, param_dtype=config.param_dtype, rngs=rngs,
                scale_metadata=self._annotation((None,)),
            )
            self.query_ln, self.key_ln = norm(), norm()

        self._build_cache()

    def _build_cache(self):
        """The cache type's `nnx.Cache` variables, zeroed: it names its own arrays (`CacheType.variables`)."""
        for name, (shape, axes, dtype) in self._cache_type.variables(self.config).items():
            setattr(self, name, nnx.Cache(jnp.zeros(shape, dtype), **self._annotation(axes)))

    def _annotation(self, axes) -> dict:
        """Flax sharding metadata for a variable, or nothing when no mesh axis is named."""
        if self.config.data_axis is None and self.config.model_axis is None:
            return {}
        # Placed now only under a mesh (`jax.set_mesh`); otherwise later, by `kvattn.shard`.
        eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
        return {"out_sharding": tuple(axes), "eager_sharding": eager}

    num_heads = property(lambda self: self.config.num_heads, doc="`config.num_heads`")
    qkv_features = property(lambda self: self.config.qkv_features, doc="`config.qkv_features`")
    out_features = property(lambda self: self.config.out_features, doc="`config.out_features`")
    rope = property(lambda self: self.config.rope, doc="`config.rope`")
    num_kv_heads = property(lambda self: self.config.num_kv_heads, doc="`config.num_kv_heads`")
    in_features = property(lambda self: self.config.in_features, doc="`config.in_features`")
    head_dim = property(lambda self: self.config.head_dim, doc="`config.head_dim`")
    max_len = property(lambda self: self.config.max_len, doc="`config.max_len`")
    window = property(lambda self: self.config.window, doc="`config.window`")
    num_slots = property(lambda self: self.config.num_slots, doc="`config.num_slots`")
    batch_size = property(lambda self: self.config.batch_size, doc="`config.batch_size`")
    use_bias = property(lambda self: self.config.use_bias, doc="`config.use_bias`")
    cache_dtype = property(lambda self: self.config.cache_dtype, doc="`config.cache_dtype`")
    cache_layout = property(lambda self: self.config.cache_layout, doc="`config.cache_layout`")
    layout = property(lambda self: self.config.layout, doc="`config.layout`")
    length_buckets = property(lambda self: self.config.length_buckets, doc="`config.length_buckets`")
    data_axis = property(lambda self: self.config.data_axis, doc="`config.data_axis`")
    model_axis = property(lambda self: self.config.model_axis, doc="`config.model_axis`")
    cache_bytes_per_token = property(
        lambda self: self.config.cache_bytes_per_token,
        doc="Bytes of cache one token takes in one sequence (keys, values and int8 scales).",
    )

    # ------------------------------------------------------------------ public

    def __call__(self, xs):
        """Full causal self-attention over `xs`, without reading or writing the cache.

        The training path and the recompute baseline.

        Args:
          xs: tokens `(..., T, D)` with any number of leading batch axes
            (independent of the cache's `batch_size`), T >= 1.

        Returns:
          The feature vector of every token, `(..., T, out_features)`.
        """
        xs = check.free_tokens(self.config, xs)
        lead = xs.shape[:-2]
        flat = xs.reshape(-1, *xs.shape[-2:])
        ys = causal_self_attention(self.weights, flat, config=self.config)
        return ys.reshape(*lead, *ys.shape[-2:])

    def step(self, x, active=None, *, pages=None):
        """Decodes one token per sequence through the cache.

        Projects only `x`, writes its key and value at slot `pos`, advances
        `pos`, and attends over slots `0..pos` including the new one.

        Args:
          x: the new token `(D,)`, or `(B, D)` for a batched layer.
          active: batched layers only, optional bool `(B,)`: inactive sequences
            neither write nor advance, and return zeros.
          pages: a paged layer only, and required there: the `PageBatch` of
            `PageManager.reserve` for this call (its tables, positions and
            copy-on-write copies).

        Returns:
          The new token's feature vector, same shape as `x`. NaN for a
          sequence that overflowed under jit (see the class docstring).
        """
        x = check.tokens(self.config, x, "x", rank=1)
        rows = x.shape[0] if self.config.cache.batch_size is not None else None  # a paged call takes any rows
        lengths = None if active is None else check.mask(self.config, active, "active", rows).astype(jnp.int32)
        return self._extend(x[..., None, :], lengths, pages)[..., 0, :]

    def prefill(self, xs, lengths=None, *, pages=None):
        """Writes a chunk of tokens into the cache in one call.

        Each token attends causally to the cache and to the chunk up to
        itself; outputs and the final state equal those of one `step` per
        token, from any starting `pos`.

        Args:
          xs: tokens `(T, D)`, or `(B, T, D)` for a batched layer; T >= 1.
          lengths: batched layers only, optional int `(B,)` with
            `0 <= lengths[b] <= T`: sequence b takes its first `lengths[b]`
            tokens. Padding never enters the cache or any attention, and its
            outputs are zeros, whatever it holds.
          pages: a paged layer only, as in `step`.

        Returns:
          The feature vector of every token, same shape as `xs`.
        """
        xs = check.tokens(self.config, xs, "xs", rank=2)
        check.nonempty(xs)
        if lengths is not None:
            rows = xs.shape[0] if self.config.cache.batch_size is not None else None
            lengths = check.per_sequence_ints(self.config, lengths, "lengths", upper=xs.shape[-2], batch=rows)
        return self._extend(xs, lengths, pages)

    def ragged(self, xs, lengths, groups, *, pages):
        """Appends groups of sequences of different widths in one call (a paged layer): one step's decode rows
        and a prefill chunk, projected together so their dots read the weights once.

        Every output equals the one `step` or `prefill` would give its group alone
        (`kvattn.layer.forward.extend_ragged`).

        Args:
          xs: every group's tokens flat `(N, D)`, group after group and row after row.
          lengths: int `(B,)`: the real tokens of each row, at most its group's width (as `prefill`'s).
          groups: `((rows, width), ...)`, Python ints: group g is `rows` consecutive rows of `pages`, each of
            `width` tokens; `N` is the sum of `rows * width`, `B` of `rows`.
          pages: the `PageBatch` of the call, one row per sequence of every group, in group order.

        Returns:
          The feature vector of every token `(N, D)`; zeros for padding.
        """
        if not self.config.cache.paged:
            raise ValueError("ragged calls are a paged layer's: build it with num_pages and page_size")
        groups = _groups(groups)
        rows, tokens = sum(r for r, _ in groups), sum(r * w for r, w in groups)
        xs = check.tokens(self.config, xs, "xs", rank=1)
        if xs.shape[0] != tokens:
            raise ValueError(f"xs must hold the {tokens} tokens of groups {groups}, got shape {xs.shape}")
        lengths = check.ints(lengths, "lengths", ((rows,),), 0, max(w for _, w in groups))
        if not check.is_traced(lengths):
            widths = np.repeat([w for _, w in groups], [r for r, _ in groups])
            if np.any(lengths > widths):
                raise ValueError(f"lengths must be at most each row's group width {widths.tolist()}, got "
                                 f"{lengths.tolist()}")
        lengths = jnp.asarray(lengths)
        cache = self._bind("this call", pages=pages, lengths=lengths)  # checked before any state changes
        ys, cache = extend_ragged(self.weights, cache, xs, lengths, config=self.config, groups=groups)
        self._store(cache)
        return ys

    def reset(self, which=None):
        """Empties the cache: `pos = 0` and zeroed buffers, as freshly built.

        Args:
          which: batched layers only, optional indices or bool mask `(B,)` of
            the sequences to empty; the others stay bit-identical.
        """
        cache = self._bind("reset")
        self._store(cache.clear(check.which(self.config, which)))

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

        A ring (`window` without `max_len`) rolls back only while it still
        holds what the next query sees: `spare_slots + 1` tokens (see
        `kvattn.Contiguous`), to nothing, or anywhere before it has wrapped.
        Eagerly a deeper roll-back raises; under jit it empties and poisons
        the sequence.
        """
        cache = self._bind("truncate")
        host_pos = check.state(self.config, cache.pos)
        keep = check.keep_counts(self.config, keep, cache.pos if host_pos is None else host_pos)
        keep = jnp.clip(keep, 0, cache.pos)
        if cache.window is not None and host_pos is not None and not check.is_traced(keep):
            deep = np.flatnonzero(~np.asarray(cache.can_roll_back(keep)))
            if deep.size:
                spare = self.config.cache.spare_slots
                raise ValueError(
                    f"sequences {deep.tolist()} cannot roll back to {np.asarray(keep).reshape(-1).tolist()} tokens: "
                    f"a ring of window {cache.window} with spare_slots={spare} has overwritten what the next query "
                    f"would see; it rolls back at most {spare + 1} tokens (or to 0). Nothing was changed."
                )
        self._store(cache.truncate(keep))

    def fork(self, source, targets):
        """Copies sequence `source` (cache and `pos`) into other sequences of the batch.

        Share a prompt prefix: prefill it once, then fork it into the slots
        of the requests that start with it.

        Args:
          source: index of the sequence to copy. Under jit, a source out of
            range poisons the targets (see the class docstring).
          targets: indices or bool mask `(B,)` of the sequences to overwrite.
        """
        cache = self._bind("fork")
        check.require_batched(self.config, "fork")
        source = check.sequence_index(self.config, source, "source")
        self._store(cache.fork(source, check.which(self.config, targets)))

    def reorder(self, order):
        """Sequence b becomes what sequence `order[b]` was (beam search selection).

        Args:
          order: int `(B,)` of source indices; repeats allowed. Under jit, an
            index out of range poisons its sequence (see the class docstring).
        """
        cache = self._bind("reorder")
        check.require_batched(self.config, "reorder")
        order = check.per_sequence_ints(self.config, order, "order", upper=self.config.cache.batch_size - 1)
        self._store(cache.reorder(order))

    # ---------------------------------------------------------------- internal

    @property
    def _cache_type(self):
        """The layer's cache type, the registry's for its spec (`kvattn.caches.registry`), chosen here only."""
        return cache_type(self.config.cache)

    def _extend(self, xs, lengths, pages=None):
        """Appends `xs` `([B,] T, D)` to the cache and attends; the core of step and prefill."""
        xs_b = self._batched(xs)
        if lengths is None:
            lengths = jnp.full(xs_b.shape[:1], xs_b.shape[1], jnp.int32)
        cache = self._bind("this call", pages=pages, lengths=lengths)  # checked before any state changes
        ys, cache = extend(self.weights, cache, xs_b, lengths, config=self.config)
        self._store(cache)
        return ys if self.config.cache.batch_size is not None else ys[0]

    def _arrays(self) -> dict:
        return {name: getattr(self, name)[...] for name in self._cache_type.variables(self.config)}

    def _bind(self, operation: str, *, pages=None, lengths=None, batched: bool = True):
        """The cache variables as the cache type's value (checked for a call that appends `lengths`)."""
        return self._cache_type.bind(
            self.config, self._arrays(), pages=pages, lengths=lengths, batched=batched, operation=operation
        )

    def _store(self, cache):
        """Writes a cache value back into the `nnx.Cache` variables."""
        for name, array in cache.unbind(self.config).items():
            getattr(self, name)[...] = array

    def paged_cache(self, table, pos, copy_from=None, copy_to=None) -> paged_ops.PagedKVCache:
        """The page pool bound to one call's tables, positions and copies, unchecked (a paged layer)."""
        return paged_ops.bound_pool(self.config, self._arrays(), table, pos, copy_from, copy_to)

    def set_pool(self, cache: paged_ops.PagedKVCache):
        """Writes a paged cache's pool back into the `nnx.Cache` variables."""
        self._store(cache)

    @property
    def weights(self) -> Weights:
        """The four projections' current arrays."""

        def bias(linear):
            return None if linear.bias is None else linear.bias[...]

        norms = (self.query_ln.scale[...], self.key_ln.scale[...]) if self.config.normalize_qk else (None, None)
        return Weights(
            self.query.kernel[...],
            bias(self.query),
            self.key.kernel[...],
            bias(self.key),
            self.value.kernel[...],
            bias(self.value),
            self.out.kernel[...],
            bias(self.out),
            *norms,
        )

    @property
    def cache(self):
        """The decoding state as a `KVCache`, always with a leading batch axis."""
        return self._bind("a contiguous cache view")

    @property
    def stored_cache(self):
        """The decoding state exactly as the `nnx.Cache` variables hold it (no batch axis added).

        Unbatched, its arrays lack the batch axis that the `KVCache` legend
        names; `cache` adds it.
        """
        return self._bind("a contiguous cache view", batched=False)

    def _batched(self, array):
        return array if self.config.cache.batch_size is not None else array[None]


def _groups(groups) -> tuple[tuple[int, int], ...]:
    """`ragged`'s groups as a tuple of `(rows, width)` positive Python ints (they pick the program)."""

    def pair(group) -> bool:
        return (isinstance(group, (tuple, list)) and len(group) == 2
                and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in group))

    if not isinstance(groups, (tuple, list)) or not groups or not all(pair(g) for g in groups):
        raise ValueError(f"groups must be ((rows, width), ...) of positive Python ints, got {groups!r}")
    return tuple((int(r), int(w)) for r, w in groups)
