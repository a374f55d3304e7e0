"""Fast decoding drivers: a compiled, donated step for Python loops, and on-device loops.

Graph-mode `nnx.jit` re-walks the module graph on every call, which costs
hundreds of microseconds per token. These drivers read the layer once into
plain arrays and run `jax.jit` programs of the pure step (`forward.extend`)
on buffers they own, donated from one step to the next, so XLA updates them
in place instead of copying `max_len` slots per step.

Nothing the caller holds is ever deleted unless the caller asks for it:
`Decoder` works on its own copy of the cache, and `decode`/`rollout`
donate the layer's cache arrays only with `donate=True` (JAX's
`donate_argnums` convention). A call that fails leaves the layer as it was.

They also pick the working form that XLA:CPU runs fastest, whatever the
layer stores: the query, key and value kernels fused into one matmul, and
the cache in the heads-major layout, whose attention dots read the buffers
in place (a slots-major cache makes every step either transpose the cache or
do K times the flops). A slots-major layer's cache is transposed once on the
way in and once on the way out; what `nnx.state(layer, nnx.Cache)` shows is
unchanged.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvattn.caches import storage

from kvattn.caches import contiguous as cache_ops
from kvattn.math import ops
from kvattn import validation as check
from kvattn.layer.attention import MultiHeadAttention
from kvattn.errors import CacheOverflowError
from kvattn.config import AttentionConfig
from kvattn.layer.forward import FusedWeights, Weights, extend

__all__ = ["Decoder", "Rollout", "attend", "decode", "rollout"]

WORKING_LAYOUT = ops.HEADS_MAJOR


def working(config: AttentionConfig, weights: Weights | FusedWeights, stored: cache_ops.KVCache):
    """Weights and cache as the layer stores them (`[B,] ...`) -> their working form (batched, heads-major)."""
    cache = stored if config.cache.batch_size is not None else jax.tree.map(lambda a: a[None], stored)
    # Heads split over devices keep their projections apart (see `forward.project_qkv`).
    fused = weights if config.heads_split else weights.fused()
    return fused, cache_ops.relayout(cache, WORKING_LAYOUT)


def stored_form(config: AttentionConfig, cache: cache_ops.KVCache) -> cache_ops.KVCache:
    """The inverse of `working` for the cache."""
    cache = cache_ops.relayout(cache, config.layout)
    return cache if config.cache.batch_size is not None else jax.tree.map(lambda a: a[0], cache)


def _extend(config: AttentionConfig, weights: Weights | FusedWeights, cache: cache_ops.KVCache, xs, lengths):
    """`forward.extend` on a working-form cache: write first, except for a ring chunk of several tokens."""
    write_first = cache.window is None or xs.shape[1] == 1
    return extend(weights, cache, xs, lengths, config=config, write_first=write_first)


def _write_back(layer: MultiHeadAttention, stored: cache_ops.KVCache) -> None:
    """Puts new cache arrays into the layer; `set_value` never reads the old (maybe donated) ones."""
    for name, array in stored.unbind(layer.config, batched=False).items():
        getattr(layer, name).set_value(array)


@functools.partial(jax.jit, static_argnames="config")
def _enter(config: AttentionConfig, weights: Weights | FusedWeights, stored: cache_ops.KVCache):
    """`working` into fresh buffers, which the decoder may donate without touching the layer's."""
    weights, cache = working(config, weights, stored)
    return weights, jax.tree.map(jnp.copy, cache)


@functools.partial(jax.jit, static_argnames="config")
def _leave(config: AttentionConfig, cache: cache_ops.KVCache):
    """`stored_form` into fresh buffers, so the decoder's next donation leaves the layer's alone."""
    return jax.tree.map(jnp.copy, stored_form(config, cache))


@functools.lru_cache(maxsize=64)
def _program(config: AttentionConfig, method: str):
    """The donated `jax.jit` program of `Decoder.step` or `Decoder.prefill` for one layer configuration."""
    batched = config.cache.batch_size is not None

    def step(weights, cache, x, active):
        xs = x[:, None] if batched else x[None, None]
        lengths = jnp.ones(xs.shape[:1], jnp.int32) if active is None else active.astype(jnp.int32)
        ys, cache = _extend(config, weights, cache, xs, lengths)
        return (ys[:, 0] if batched else ys[0, 0]), cache

    def prefill(weights, cache, xs, lengths):
        xs = xs if batched else xs[None]
        if lengths is None:
            lengths = jnp.full(xs.shape[:1], xs.shape[1], jnp.int32)
        ys, cache = _extend(config, weights, cache, xs, lengths)
        return (ys if batched else ys[0]), cache

    # The cache is the decoder's own copy (`_enter`), so donating it deletes nothing a caller holds.
    return jax.jit({"step": step, "prefill": prefill}[method], donate_argnums=1)


class Decoder:
    """The fast way to decode from Python: one compiled, donated program per method.

    The decoder takes a copy of the layer's cache, in its working form (see
    the module docstring), and advances it with `jax.jit`-compiled `step`
    and `prefill` calls that update that copy in place. The layer itself,
    and every array of it a caller holds, is untouched until `sync()` writes
    a copy of the decoder's cache back into it.

    Capacity is tracked on the host, so an overflowing call raises
    `CacheOverflowError` before anything runs, exactly like an eager step.
    The decoder keeps the weights the layer had when it was made: after
    changing them, make a new decoder (its cached keys and values are stale
    anyway).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import kvattn
      >>> layer = kvattn.MultiHeadAttention(2, 8, max_len=16, rngs=nnx.Rngs(0))
      >>> decoder = kvattn.Decoder(layer)
      >>> xs = jnp.ones((3, 8))
      >>> ys = [decoder.step(x) for x in xs]
      >>> int(decoder.sync().pos[...])
      3
    """

    def __init__(self, layer: MultiHeadAttention):
        self.layer = layer
        self.config = layer.config
        self._host_pos = check.state(self.config, layer.pos[...])
        self._weights, self._cache = _enter(self.config, layer.weights, layer.stored_cache)
        self._programs = {method: _program(self.config, method) for method in ("step", "prefill")}

    @property
    def pos(self) -> int | np.ndarray:
        """Next free slot (an int, or one per sequence), as known on the host: no device sync."""
        return self._host_pos.copy() if self.config.cache.batch_size is not None else int(self._host_pos[0])

    def step(self, x, active=None):
        """`MultiHeadAttention.step`, compiled once and run on the decoder's own cache."""
        x = check.tokens(self.config, x, "x", rank=1)
        if active is not None:
            active = check.mask(self.config, active, "active")
        lengths = 1 if active is None else check.host(active).astype(np.int32)
        return self._advance("step", (x, active), lengths)

    def prefill(self, xs, lengths=None):
        """`MultiHeadAttention.prefill`, compiled once per chunk shape."""
        xs = check.tokens(self.config, xs, "xs", rank=2)
        check.nonempty(xs)
        if lengths is not None:
            lengths = check.per_sequence_ints(self.config, lengths, "lengths", upper=xs.shape[-2])
        host_lengths = xs.shape[-2] if lengths is None else check.host(lengths)
        return self._advance("prefill", (xs, lengths), host_lengths)

    def sync(self) -> MultiHeadAttention:
        """Writes (a copy of) the decoder's cache into the layer, in the layer's layout, and returns the layer."""
        _write_back(self.layer, _leave(self.config, self._cache))
        return self.layer

    def _advance(self, method, args, lengths):
        check.capacity(self.config, self._host_pos, lengths)
        out, self._cache = self._programs[method](self._weights, self._cache, *args)
        self._host_pos = self._host_pos + lengths
        return out


@functools.cache
def _compiled(fn, donate: bool, static_argnames: tuple[str, ...]):
    """`jax.jit(fn)`, donating the layer's stored cache only when the caller asked for it."""
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=("stored",) if donate else ())


def _run(layer: MultiHeadAttention, program, args, donate: bool):
    """Runs `program(config, weights, stored, *args)` and writes its cache into the layer only if it succeeds.

    With `donate`, the layer's cache arrays are handed to XLA, which updates
    them in place: the caller asked for that, so every reference to them
    (clones, `nnx.state` snapshots, `[...]` reads) is invalidated. Should the
    program fail after the hand-over, the layer is left empty (as after
    `reset()`) rather than holding deleted arrays.
    """
    stored = layer.stored_cache
    if check.is_traced(*jax.tree.leaves(stored)):  # inside the caller's own jit: nothing to protect
        result, new = program(layer.config, layer.weights, stored, *args)
        _write_back(layer, new)
        return result
    if donate:
        stored = _distinct_buffers(stored)
    try:
        result, new = program(layer.config, layer.weights, stored, *args)
        # A run-time failure surfaces here, before the layer changes.
        jax.block_until_ready(new.pos)
    except Exception:
        if donate and any(a.is_deleted() for a in jax.tree.leaves(stored)):
            _write_back(layer, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), stored))
        raise
    _write_back(layer, new)
    return result


def _distinct_buffers(stored: cache_ops.KVCache) -> cache_ops.KVCache:
    """`stored` with any array that appears twice (e.g. keys and values one array) copied, so each is donated once."""
    seen = set()

    def once(array):
        if id(array) in seen:
            return jnp.copy(array)
        seen.add(id(array))
        return array

    return jax.tree.map(once, stored)


def _decode(config: AttentionConfig, weights: Weights | FusedWeights, stored: cache_ops.KVCache, xs):
    weights, cache = working(config, weights, stored)
    xs = xs if config.cache.batch_size is not None else xs[None]
    ones = jnp.ones(xs.shape[:1], jnp.int32)

    def body(cache, x):
        ys, cache = _extend(config, weights, cache, x[:, None], ones)
        return cache, ys[:, 0]

    cache, ys = jax.lax.scan(body, cache, jnp.swapaxes(xs, 0, 1))
    ys = jnp.swapaxes(ys, 0, 1)
    return (ys if config.cache.batch_size is not None else ys[0]), stored_form(config, cache)


def decode(layer: MultiHeadAttention, xs, *, donate: bool = False):
    """Feeds a stream through `layer.step` inside one compiled loop.

    Equal to a Python loop of `layer.step` over the tokens, without its
    per-call overhead; the layer holds the advanced cache afterwards. The
    loop runs on the working form of the module docstring.

    Called eagerly, it checks capacity and state on the host first; inside
    your own `jit` (e.g. `nnx.jit(lambda m, xs: kvattn.decode(m, xs))`) the
    in-graph overflow contract applies instead.

    Args:
      layer: the attention layer.
      xs: tokens `(T, D)`, or `(B, T, D)` for a batched layer.
      donate: hand the layer's cache arrays to XLA to update in place (no
        cache-sized copy); any other reference to them is then deleted. By
        default they are left intact and the layer gets new arrays.

    Returns:
      The feature vector of every token, same shape as `xs`.

    Raises:
      CacheOverflowError: before anything runs, if the stream does not fit.
    """
    config = layer.config
    xs = check.tokens(config, xs, "xs", rank=2)
    check.capacity(config, check.state(config, layer.pos[...]), xs.shape[-2])
    if xs.shape[-2] == 0:
        return xs
    return _run(layer, _compiled(_decode, donate, ("config",)), (xs,), donate)


class Rollout(NamedTuple):
    """What `rollout` returns."""

    outputs: jax.Array
    """`(num_steps, D)` or `(B, num_steps, D)`; rows past `length` are NaN."""
    length: jax.Array
    """How many steps ran before every sequence was full (int32 scalar)."""


def _rollout(config: AttentionConfig, weights: Weights | FusedWeights, stored: cache_ops.KVCache, x0, num_steps,
             next_input):
    batched = config.cache.batch_size is not None
    weights, cache = working(config, weights, stored)
    outputs = jnp.full((num_steps, *x0.shape), jnp.nan, x0.dtype)
    ones = jnp.ones(cache.pos.shape, jnp.int32)

    def cond(carry):
        i, cache, _, _ = carry
        return (i < num_steps) & jnp.any(storage.capacity_ok(cache.pos, ones, config.capacity))

    def body(carry):
        i, cache, x, outputs = carry
        ys, cache = _extend(config, weights, cache, (x if batched else x[None])[:, None], ones)
        y = ys[:, 0] if batched else ys[0, 0]
        return i + 1, cache, next_input(y).astype(x.dtype), outputs.at[i].set(y)

    carry = (jnp.int32(0), cache, x0, outputs)
    length, cache, _, outputs = jax.lax.while_loop(cond, body, carry)
    return Rollout(outputs, length), stored_form(config, cache)


@typing.no_type_check  # `num_steps` is validated by hand, with the documented error
def rollout(
    layer: MultiHeadAttention,
    x0,
    num_steps: int,
    next_input: Callable[[jax.Array], jax.Array],
    *,
    donate: bool = False,
):
    """An on-device autoregressive loop: each output becomes the next input.

    Steps `x0`, then `next_input(y)` of each output `y`, `num_steps` times in
    one compiled `while_loop`. It stops early and cleanly when the cache is
    full: no slot is overwritten, and the rows not produced stay NaN. In a
    batch, a sequence that is full follows the overflow contract (NaN, no
    write) while the others go on; the loop stops when all are full.

    `next_input` is traced once; pass the same function object on every call
    to reuse the compiled loop.

    Args:
      layer: the attention layer; it holds the advanced cache afterwards.
      x0: the first token `(D,)`, or `(B, D)` for a batched layer.
      num_steps: how many tokens to decode at most (0 runs nothing).
      next_input: maps an output `(D,)` (or `(B, D)`) to the next input.
      donate: as in `decode`.

    Returns:
      `Rollout(outputs, length)`: outputs `(num_steps, D)` (batched:
      `(B, num_steps, D)`) and the number of steps that ran.
    """
    if isinstance(num_steps, (bool, np.bool_)) or not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
    num_steps = int(num_steps)
    config = layer.config
    x0 = check.tokens(config, x0, "x0", rank=1)
    check.state(config, layer.pos[...])
    if num_steps == 0:
        outputs = jnp.zeros((*x0.shape[:-1], 0, x0.shape[-1]), x0.dtype)
        return Rollout(outputs, jnp.int32(0))
    program = _compiled(_rollout, donate, ("config", "num_steps", "next_input"))
    result = _run(layer, program, (x0, num_steps, next_input), donate)
    if config.cache.batch_size is not None:
        return Rollout(jnp.swapaxes(result.outputs, 0, 1), result.length)
    return result


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
    config = layer.config
    history = check.tokens(config, history, "history", rank=2)
    x = check.tokens(config, x, "x", rank=1)
    if history.shape[-2] + 1 > config.capacity:
        raise CacheOverflowError(
            f"history of {history.shape[-2]} tokens plus x does not fit max_len={config.cache.max_len}; "
            "nothing was changed"
        )
    if lengths is not None:
        lengths = check.per_sequence_ints(config, lengths, "lengths", upper=history.shape[-2])
    layer.reset()
    if history.shape[-2]:
        layer.prefill(history, lengths)
    return layer.step(x)
