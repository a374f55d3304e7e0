"""How a burst is timed, and the saved caches every burst starts from."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

import kvattn
from kvattn import cache as cache_ops

__all__ = ["PREFILL_CHUNK", "CacheFiller", "CacheState", "Timing", "load_state", "time_bursts", "to_layout"]

PREFILL_CHUNK = 128


class CacheState(NamedTuple):
    """A saved cache in the slots-major layout `(B, S, K, H)`, holding `pos` tokens per sequence."""

    keys: jax.Array
    values: jax.Array
    pos: int


class Timing(NamedTuple):
    """Per-token times of the timed bursts and the output of the burst's last token."""

    ms_per_token: list[float]
    last_output: jax.Array


def time_bursts(prepare: Callable[[], Any], burst: Callable[[Any], jax.Array], repeats: int, tokens: int) -> Timing:
    """Times `burst(prepare())` once untimed (warm-up, compiles) then `repeats` times.

    Args:
      prepare: untimed set-up of one burst; must leave nothing pending on the device.
      burst: the timed work; returns the last output.
      repeats: timed bursts.
      tokens: tokens per burst, the divisor of the per-token time.

    Returns:
      The per-token milliseconds of each timed burst and the last output.
    """
    samples = []
    for attempt in range(repeats + 1):
        state = prepare()
        started = time.perf_counter()
        output = jax.block_until_ready(burst(state))
        elapsed = time.perf_counter() - started
        if attempt:
            samples.append(elapsed / tokens * 1e3)
    return Timing(samples, output)


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
    keys = cache_ops.encode(to_layout(state.keys, config.cache_layout), dtype)
    values = cache_ops.encode(to_layout(state.values, config.cache_layout), dtype)
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
