"""Fast decoding drivers: a compiled, donated step for Python loops, and on-device loops.

Graph-mode `nnx.jit` re-walks the module graph on every call, which costs
hundreds of microseconds per token. These drivers read the layer once into
plain arrays and run `jax.jit` programs of the pure step (`attention.extend`)
whose cache argument is donated, so XLA updates the buffers in place instead
of copying `max_len` slots per step.

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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import cache as cache_ops
from kvattn import ops
from kvattn.attention import CacheOverflowError, FusedWeights, MultiHeadAttention, Weights, extend

__all__ = ["Decoder", "Generation", "decode", "generate"]

WORKING_LAYOUT = ops.HEADS_MAJOR


class _Plan(NamedTuple):
    """The static facts about a layer that its compiled decoding programs depend on."""

    layout: str
    batched: bool
    max_len: int | None
    buckets: tuple[int, ...]
    window: int | None
    heads_split: bool

    @classmethod
    def of(cls, layer: MultiHeadAttention) -> _Plan:
        return cls(
            layout=layer.layout,
            batched=layer.batch_size is not None,
            max_len=layer.max_len,
            buckets=layer.length_buckets,
            window=layer.window,
            heads_split=layer.model_axis is not None,
        )

    def extend(self, weights, cache: cache_ops.KVCache, xs, lengths):
        """`attention.extend` on a working-layout cache."""
        return extend(
            weights, cache, xs, lengths,
            max_len=self.max_len, layout=WORKING_LAYOUT, buckets=self.buckets,
            window=self.window, heads_split=self.heads_split, write_first=True,
        )

    def working(self, weights: Weights, stored: cache_ops.KVCache) -> tuple[Weights | FusedWeights, cache_ops.KVCache]:
        """Weights and cache as the layer stores them (`[B,] ...`) -> their working form (batched, heads-major)."""
        batch = (lambda a: a) if self.batched else (lambda a: a[None])
        cache = cache_ops.KVCache(*(None if a is None else batch(a) for a in stored))
        # Heads split over devices keep their projections apart (see `extend`).
        fused = weights if self.heads_split else weights.fused()
        return fused, cache_ops.relayout(cache, self.layout, WORKING_LAYOUT)

    def stored(self, cache: cache_ops.KVCache) -> cache_ops.KVCache:
        """The inverse of `working` for the cache."""
        cache = cache_ops.relayout(cache, WORKING_LAYOUT, self.layout)
        unbatch = (lambda a: a) if self.batched else (lambda a: a[0])
        return cache_ops.KVCache(*(None if a is None else unbatch(a) for a in cache))


def _write_back(layer: MultiHeadAttention, stored: cache_ops.KVCache) -> None:
    """Puts new cache arrays into the layer; `set_value` never reads the old (maybe donated) ones."""
    layer.k_cache.set_value(stored.k)
    layer.v_cache.set_value(stored.v)
    layer.pos.set_value(stored.pos)
    if stored.k_scale is not None:
        layer.k_scale.set_value(stored.k_scale)
        layer.v_scale.set_value(stored.v_scale)


@functools.partial(jax.jit, static_argnames="plan")
def _enter(plan: _Plan, weights: Weights, stored: cache_ops.KVCache):
    """`plan.working` into fresh buffers, which the decoder may donate without touching the layer's."""
    weights, cache = plan.working(weights, stored)
    return weights, jax.tree.map(jnp.copy, cache)


@functools.partial(jax.jit, static_argnames="plan")
def _leave(plan: _Plan, cache: cache_ops.KVCache):
    """`plan.stored` into fresh buffers, so the decoder's next donation leaves the layer's alone."""
    return jax.tree.map(jnp.copy, plan.stored(cache))


@functools.lru_cache(maxsize=64)
def _program(plan: _Plan, method: str):
    """The donated `jax.jit` program of `Decoder.step` or `Decoder.prefill` for one layer structure."""

    def step(weights, cache, x, active):
        xs = x[:, None] if plan.batched else x[None, None]
        lengths = jnp.ones(xs.shape[:1], jnp.int32) if active is None else active.astype(jnp.int32)
        ys, cache = plan.extend(weights, cache, xs, lengths)
        return (ys[:, 0] if plan.batched else ys[0, 0]), cache

    def prefill(weights, cache, xs, lengths):
        xs = xs if plan.batched else xs[None]
        if lengths is None:
            lengths = jnp.full(xs.shape[:1], xs.shape[1], jnp.int32)
        ys, cache = plan.extend(weights, cache, xs, lengths)
        return (ys if plan.batched else ys[0]), cache

    return jax.jit({"step": step, "prefill": prefill}[method], donate_argnums=1)


class Decoder:
    """The fast way to decode from Python: one compiled, donated program per method.

    The decoder takes a copy of the layer's cache, in its working form (see
    the module docstring), and advances it with `jax.jit`-compiled `step`
    and `prefill` calls whose cache is donated, so each call updates the
    buffers in place. The layer itself is untouched until `sync()` writes
    the decoder's cache back into it.

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
        self._plan = _Plan.of(layer)
        self._weights, self._cache = _enter(self._plan, layer.weights, layer.stored_cache)
        self._programs = {method: _program(self._plan, method) for method in ("step", "prefill")}
        self._host_pos = np.array(layer._batched(layer.pos[...]))

    @property
    def pos(self) -> int | np.ndarray:
        """Next free slot (an int, or one per sequence), as known on the host: no device sync."""
        return self._host_pos.copy() if self.layer.batch_size is not None else int(self._host_pos[0])

    def step(self, x, active=None):
        """`MultiHeadAttention.step`, compiled once and run with the cache donated."""
        layer = self.layer
        lead = 0 if layer.batch_size is None else 1
        x = layer._check_tokens(x, "x", ranks=(1 + lead,))
        if active is not None:
            active = layer._check_mask(active, "active")
            lengths = np.asarray(active).astype(np.int32)
        else:
            lengths = 1
        return self._advance("step", (x, active), lengths)

    def prefill(self, xs, lengths=None):
        """`MultiHeadAttention.prefill`, compiled once per chunk shape, cache donated."""
        layer = self.layer
        lead = 0 if layer.batch_size is None else 1
        xs = layer._check_tokens(xs, "xs", ranks=(2 + lead,))
        if xs.shape[-2] == 0:
            raise ValueError(f"prefill needs at least one token, got xs of shape {xs.shape}")
        if lengths is not None:
            lengths = layer._check_lengths(lengths, xs.shape[-2])
            host_lengths = np.asarray(lengths)
        else:
            host_lengths = np.full_like(self._host_pos, xs.shape[-2])
        return self._advance("prefill", (xs, lengths), host_lengths)

    def sync(self) -> MultiHeadAttention:
        """Writes (a copy of) the decoder's cache into the layer, in the layer's layout, and returns the layer."""
        _write_back(self.layer, _leave(self._plan, self._cache))
        return self.layer

    def _advance(self, method, args, lengths):
        needed = self._host_pos + lengths
        capacity = self.layer.max_len
        if capacity is not None and needed.max() > capacity:
            over = np.flatnonzero(needed > capacity)
            lengths = np.broadcast_to(lengths, needed.shape)
            raise CacheOverflowError(
                f"cache overflow for sequences {over.tolist()}: pos {self._host_pos[over].tolist()} + "
                f"{np.asarray(lengths)[over].tolist()} new tokens exceeds max_len={self.layer.max_len}; "
                "nothing was written. Start a new Decoder on a reset layer or use a larger max_len."
            )
        out, self._cache = self._programs[method](self._weights, self._cache, *args)
        self._host_pos = needed
        return out


@functools.partial(jax.jit, static_argnames="plan", donate_argnames="stored")
def _decode(plan: _Plan, weights: Weights, stored: cache_ops.KVCache, xs):
    weights, cache = plan.working(weights, stored)
    xs = xs if plan.batched else xs[None]
    ones = jnp.ones(xs.shape[:1], jnp.int32)

    def body(cache, x):
        ys, cache = plan.extend(weights, cache, x[:, None], ones)
        return cache, ys[:, 0]

    cache, ys = jax.lax.scan(body, cache, jnp.swapaxes(xs, 0, 1))
    ys = jnp.swapaxes(ys, 0, 1)
    return (ys if plan.batched else ys[0]), plan.stored(cache)


def decode(layer: MultiHeadAttention, xs):
    """Feeds a stream through `layer.step` inside one compiled loop.

    Equal to a Python loop of `layer.step` over the tokens, without its
    per-call overhead; the cache is donated and updated in place, and the
    layer holds the advanced cache afterwards. The loop runs on the working
    form of the module docstring: a slots-major cache is transposed once
    each way, which needs a second cache-sized buffer during the call.

    Args:
      layer: the attention layer.
      xs: tokens `(T, D)`, or `(B, T, D)` for a batched layer.

    Returns:
      The feature vector of every token, same shape as `xs`.

    Raises:
      CacheOverflowError: before anything runs, if the stream does not fit.
    """
    xs = layer._check_tokens(xs, "xs", ranks=(3 if layer.batch_size is not None else 2,))
    pos = np.asarray(layer.pos[...]).reshape(-1)
    layer._check_capacity(pos, np.full(pos.shape, xs.shape[-2]))
    ys, stored = _decode(_Plan.of(layer), layer.weights, layer.stored_cache, xs)
    _write_back(layer, stored)
    return ys


class Generation(NamedTuple):
    """What `generate` returns."""

    outputs: jax.Array
    """`(num_steps, D)` or `(B, num_steps, D)`; rows past `length` are NaN."""
    length: jax.Array
    """How many steps ran before every sequence was full (int32 scalar)."""


@functools.partial(jax.jit, static_argnames=("plan", "num_steps", "next_input"), donate_argnames="stored")
def _generate(plan: _Plan, weights: Weights, stored: cache_ops.KVCache, x0, num_steps, next_input):
    weights, cache = plan.working(weights, stored)
    outputs = jnp.full((num_steps, *x0.shape), jnp.nan, x0.dtype)
    ones = jnp.ones(cache.pos.shape, jnp.int32)

    def room(cache):
        return True if plan.max_len is None else jnp.any(cache.pos < plan.max_len)

    def cond(carry):
        i, cache, _, _ = carry
        return (i < num_steps) & room(cache)

    def body(carry):
        i, cache, x, outputs = carry
        ys, cache = plan.extend(weights, cache, (x if plan.batched else x[None])[:, None], ones)
        y = ys[:, 0] if plan.batched else ys[0, 0]
        return i + 1, cache, next_input(y).astype(x.dtype), outputs.at[i].set(y)

    carry = (jnp.int32(0), cache, x0, outputs)
    length, cache, _, outputs = jax.lax.while_loop(cond, body, carry)
    return Generation(outputs, length), plan.stored(cache)


def generate(layer: MultiHeadAttention, x0, num_steps: int, next_input: Callable[[jax.Array], jax.Array]):
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
      num_steps: how many tokens to decode at most.
      next_input: maps an output `(D,)` (or `(B, D)`) to the next input.

    Returns:
      `Generation(outputs, length)`: outputs `(num_steps, D)` (batched:
      `(B, num_steps, D)`) and the number of steps that ran.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
    batched = layer.batch_size is not None
    x0 = layer._check_tokens(x0, "x0", ranks=(2 if batched else 1,))
    result, stored = _generate(_Plan.of(layer), layer.weights, layer.stored_cache, x0, num_steps, next_input)
    _write_back(layer, stored)
    if batched:
        return Generation(jnp.swapaxes(result.outputs, 0, 1), result.length)
    return result
