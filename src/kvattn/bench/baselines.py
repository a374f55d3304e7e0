"""What kvattn is measured against: Flax's own decode layer, stepped two ways, and a bandwidth calibration."""

from __future__ import annotations

import functools

import jax
from flax import nnx

import kvattn

__all__ = ["flax_scan", "flax_step", "flax_twin", "matvec"]


def flax_twin(layer: kvattn.MultiHeadAttention, batch_size: int) -> nnx.MultiHeadAttention:
    """Flax's `nnx.MultiHeadAttention(decode=True)` holding `layer`'s weights, its cache ready for `batch_size`."""
    twin = nnx.MultiHeadAttention(
        layer.num_heads,
        layer.in_features,
        qkv_features=layer.num_heads * layer.head_dim,
        num_kv_heads=layer.num_kv_heads,
        use_bias=layer.use_bias,
        decode=True,
        rngs=nnx.Rngs(0),
    )
    nnx.update(twin, nnx.state(layer, nnx.Param))
    twin.init_cache((batch_size, layer.max_len, layer.in_features))
    return twin


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
