"""Fast decoding drivers: a compiled, donated step for Python loops, and on-device loops.

Graph-mode `nnx.jit` re-walks the module graph on every call, which costs
hundreds of microseconds per token. These drivers split the layer once into a
static graph definition, its weights and its cache, and run plain `jax.jit`
programs whose cache argument is donated, so XLA updates the buffers in place
instead of copying `max_len` slots per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.attention import CacheOverflowError, MultiHeadAttention

__all__ = ["Decoder", "Generation", "decode", "generate"]


@functools.lru_cache(maxsize=64)
def _compiled_method(graphdef, cache_def, rest_def, method):
    """One `jax.jit` program per layer structure and method, cache donated.

    Works on flat leaf lists with the tree structures closed over, so a call
    pays neither for hashing the graph definition nor for walking `nnx.State`.
    """

    def run(rest_leaves, cache_leaves, args):
        cache = jax.tree.unflatten(cache_def, cache_leaves)
        rest = jax.tree.unflatten(rest_def, rest_leaves)
        layer = nnx.merge(graphdef, cache, rest)
        out = getattr(layer, method)(*args)
        return out, jax.tree.leaves(nnx.state(layer, nnx.Cache))

    return jax.jit(run, donate_argnums=1)


class Decoder:
    """The fast way to decode from Python: one compiled, donated program per method.

    The decoder takes a copy of the layer's cache and advances it with
    `jax.jit`-compiled `step` and `prefill` calls whose cache is donated, so
    each call updates the buffers in place. The layer itself is untouched
    until `sync()` writes the decoder's cache back into it.

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
        graphdef, cache, rest = nnx.split(layer, nnx.Cache, ...)
        cache_leaves, self._cache_def = jax.tree.flatten(cache)
        self._rest, rest_def = jax.tree.flatten(rest)
        self._cache = [jnp.copy(leaf) for leaf in cache_leaves]
        self._programs = {
            method: _compiled_method(graphdef, self._cache_def, rest_def, method) for method in ("step", "prefill")
        }
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
            lengths = np.ones_like(self._host_pos)
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
        """Writes the decoder's cache into the layer and returns the layer."""
        cache = jax.tree.unflatten(self._cache_def, [jnp.copy(leaf) for leaf in self._cache])
        nnx.update(self.layer, cache)
        return self.layer

    def _advance(self, method, args, lengths):
        needed = self._host_pos + lengths
        capacity = self.layer.max_len
        over = np.flatnonzero(needed > capacity) if capacity is not None else np.empty(0, int)
        if over.size:
            raise CacheOverflowError(
                f"cache overflow for sequences {over.tolist()}: pos {self._host_pos[over].tolist()} + "
                f"{np.asarray(lengths)[over].tolist()} new tokens exceeds max_len={self.layer.max_len}; "
                "nothing was written. Start a new Decoder on a reset layer or use a larger max_len."
            )
        out, self._cache = self._programs[method](self._rest, self._cache, args)
        self._host_pos = needed
        return out


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _decode(graphdef, rest, cache, xs):
    def body(cache, x):
        layer = nnx.merge(graphdef, cache, rest)
        y = layer.step(x)
        return nnx.state(layer, nnx.Cache), y

    cache, ys = jax.lax.scan(body, cache, xs)
    return ys, cache


def decode(layer: MultiHeadAttention, xs):
    """Feeds a stream through `layer.step` inside one compiled loop.

    Equal to a Python loop of `layer.step` over the tokens, without its
    per-call overhead; the cache is donated and updated in place, and the
    layer holds the advanced cache afterwards.

    Args:
      layer: the attention layer.
      xs: tokens `(T, D)`, or `(B, T, D)` for a batched layer.

    Returns:
      The feature vector of every token, same shape as `xs`.

    Raises:
      CacheOverflowError: before anything runs, if the stream does not fit.
    """
    batched = layer.batch_size is not None
    xs = layer._check_tokens(xs, "xs", ranks=(3 if batched else 2,))
    pos = layer._batched(layer.pos[...])
    layer._check_capacity(pos, jnp.full(pos.shape, xs.shape[-2], jnp.int32))
    graphdef, cache, rest = nnx.split(layer, nnx.Cache, ...)
    stream = jnp.swapaxes(xs, 0, 1) if batched else xs
    ys, cache = _decode(graphdef, rest, cache, stream)
    nnx.update(layer, cache)
    return jnp.swapaxes(ys, 0, 1) if batched else ys


class Generation(NamedTuple):
    """What `generate` returns."""

    outputs: jax.Array
    """`(num_steps, D)` or `(B, num_steps, D)`; rows past `length` are NaN."""
    length: jax.Array
    """How many steps ran before every sequence was full (int32 scalar)."""


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "next_input"), donate_argnames=("cache",))
def _generate(graphdef, rest, cache, x0, num_steps, next_input):
    max_len = nnx.merge(graphdef, cache, rest).max_len
    outputs = jnp.full((num_steps, *x0.shape), jnp.nan, x0.dtype)

    def room(cache):
        return True if max_len is None else jnp.any(cache["pos"][...] < max_len)

    def cond(carry):
        i, cache, _, _ = carry
        return (i < num_steps) & room(cache)

    def body(carry):
        i, cache, x, outputs = carry
        layer = nnx.merge(graphdef, cache, rest)
        y = layer.step(x)
        return i + 1, nnx.state(layer, nnx.Cache), next_input(y).astype(x.dtype), outputs.at[i].set(y)

    carry = (jnp.int32(0), cache, x0, outputs)
    length, cache, _, outputs = jax.lax.while_loop(cond, body, carry)
    return Generation(outputs, length), cache


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
    graphdef, cache, rest = nnx.split(layer, nnx.Cache, ...)
    result, cache = _generate(graphdef, rest, cache, x0, num_steps, next_input)
    nnx.update(layer, cache)
    if batched:
        return Generation(jnp.swapaxes(result.outputs, 0, 1), result.length)
    return result
