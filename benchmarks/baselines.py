"""What kvattn is measured against: Flax's own decode layer, stepped two ways, and a bandwidth calibration."""

from __future__ import annotations

import functools

import jax
from flax import nnx

import jax.numpy as jnp

from kvattn.demo import flax_twin

from benchmarks.timing import median_ms

__all__ = ["bandwidth", "flax_scan", "flax_step", "flax_twin", "matvec"]


@nnx.jit
def flax_step(module: nnx.MultiHeadAttention, x: jax.Array) -> jax.Array:
    """One Flax decode step under graph-mode `nnx.jit`, as a Flax user writes it."""
    return module(x)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def flax_scan(graphdef, params, cache, rest, xs):
    """Flax decode steps over `xs` `(T, B, 1, D)` inside one `lax.scan`, cache donated.

    Returns:
      `(ys, cache)`: outputs `(T, B, 1, D)` and the advanced cache.
    """

    def body(cache, x):
        module = nnx.merge(graphdef, params, cache, rest)
        y = module(x)
        return nnx.state(module, nnx.Cache), y

    cache, ys = jax.lax.scan(body, cache, xs)
    return ys, cache


@jax.jit
def matvec(matrix: jax.Array, vector: jax.Array) -> jax.Array:
    """The bandwidth calibration: one pass over `matrix`."""
    return matrix @ vector


def bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of `matvec` over a float32 matrix of about `num_bytes` (median of at least 5 passes)."""
    columns = 4096
    rows = max(1, num_bytes // (4 * columns))
    matrix = jax.random.normal(jax.random.key(0), (rows, columns), jnp.float32)
    vector = jnp.ones((columns,), jnp.float32)
    return rows * columns * 4 / (median_ms(lambda: matvec(matrix, vector), max(repeats, 5)) * 1e-3)
