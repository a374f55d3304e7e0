"""The benchmarks' one timer, and the saved caches every timed burst starts from."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

import kvattn
from kvattn.caches import storage
from kvattn.layer.forward import extend  # the pure step, without the layer's checks and state

__all__ = ["PREFILL_CHUNK", "CacheFiller", "CacheState", "Timing", "load_state", "median_ms", "step_loop", "time_calls",
           "to_layout"]

PREFILL_CHUNK = 128


class CacheState(NamedTuple):
    """A saved cache in the slots-major layout `(B, S, K, H)`, holding `pos` tokens per sequence."""

    keys: jax.Array
    values: jax.Array
    pos: int


class Timing(NamedTuple):
    """Milliseconds per unit of each timed call, and the output of the last call."""

    ms: list[float]
    last_output: Any


def time_calls(call: Callable[[Any], Any], repeats: int, *, prepare: Callable[[], Any] = lambda: None,
               units: int = 1, warm_ups: int = 1) -> Timing:
    """Times `call(prepare())`: `warm_ups` untimed calls (compilation), then `repeats` timed ones.

    Each call is waited for with `jax.block_until_ready`; `prepare` is never timed.

    Args:
      call: the timed work; returns its output.
      repeats: timed calls.
      prepare: untimed set-up of each call; must leave nothing pending on the device.
      units: tokens (or steps) per call, the divisor of the reported times.
      warm_ups: untimed calls first; 0 when the caller warmed up itself.

    Returns:
      The milliseconds per unit of each timed call and the last output.
    """
    samples, output = [], None
    for attempt in range(warm_ups + repeats):
        state = prepare()
        started = time.perf_counter()
        output = jax.block_until_ready(call(state))
        elapsed = time.perf_counter() - started
        if attempt >= warm_ups:
            samples.append(elapsed / units * 1e3)
    return Timing(samples, output)


def median_ms(call: Callable[[], Any], repeats: int, *, warm_ups: int = 1) -> float:
    """The median milliseconds of `call()` over `repeats` timed calls, after `warm_ups` untimed ones."""
    return statistics.median(time_calls(lambda _: call(), repeats, warm_ups=warm_ups).ms)


@functools.cache
def step_loop(config, burst: int):
    """A compiled loop of `burst` steps whose outputs all feed a running sum (so none is optimised away)."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(weights, cache, xs):
        batch = xs.shape[0]

        def body(i, carry):
            cache, total = carry
            x = jax.lax.dynamic_index_in_dim(xs, i, axis=1) + total[:, None, :1]
            ys, cache = extend(weights, cache, x, jnp.ones((batch,), jnp.int32), config=config, write_first=True)
            return cache, total + ys[:, 0]

        return jax.lax.fori_loop(0, burst, body, (cache, jnp.zeros(xs.shape[::2], xs.dtype)))

    return loop


def to_layout(cache: jax.Array, layout: str) -> jax.Array:
    """A fresh copy of a slots-major cache `(B, S, K, H)` in `layout`."""
    if layout == "slots_major":
        return jnp.copy(cache)
    return jnp.swapaxes(cache, 1, 2)


def load_state(layer: kvattn.MultiHeadAttention, state: CacheState) -> kvattn.MultiHeadAttention:
    """`layer` holding a fresh copy of `state`, in its own cache layout and dtype; nothing left pending."""
    config = layer.config
    # Encoding is per token and head, so encoding the whole float32 cache
    # stores exactly what appending its tokens one by one would.
    dtype = jnp.dtype(config.cache_dtype)
    keys = storage.encode(to_layout(state.keys, config.cache_layout), dtype)
    values = storage.encode(to_layout(state.values, config.cache_layout), dtype)
    layer.k_cache.set_value(keys.values)
    layer.v_cache.set_value(values.values)
    if keys.scale is not None:
        layer.k_scale.set_value(keys.scale)
        layer.v_scale.set_value(values.scale)
    layer.pos.set_value(jnp.full((config.batch_size,), state.pos, jnp.int32))
    jax.block_until_ready(nnx.state(layer, nnx.Cache))
    return layer


class CacheFiller:
    """Prefills one slots-major cache along the stream and saves it at increasing positions."""

    def __init__(self, layer: kvattn.MultiHeadAttention, stream: jax.Array):
        self._decoder = kvattn.Decoder(layer)
        self._stream = stream
        self._chunk = min(PREFILL_CHUNK, layer.max_len)
        self._pos = 0

    def state_at(self, pos: int) -> CacheState:
        """The cache after the first `pos` tokens of the stream (pos never decreases)."""
        batch_size = self._stream.shape[0]
        while self._pos < pos:
            take = min(self._chunk, pos - self._pos)
            # Always a full chunk, its tail masked by lengths: one compiled prefill.
            chunk = self._stream[:, self._pos : self._pos + self._chunk]
            self._decoder.prefill(chunk, np.full((batch_size,), take, np.int32))
            self._pos += take
        layer = self._decoder.sync()
        state = CacheState(layer.k_cache[...], layer.v_cache[...], pos)
        return jax.block_until_ready(state)
