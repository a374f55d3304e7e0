"""What kvattn is measured against: Flax's own decode layer, stepped two ways, and the machine's bandwidth."""

from __future__ import annotations

import functools

import jax
from flax import nnx

import jax.numpy as jnp

from kvattn.demo import flax_twin

from benchmarks.timing import median_ms

__all__ = ["Calibration", "bandwidth", "flax_scan", "flax_step", "flax_twin", "matvec"]


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


class Calibration:
    """A streaming read of a float32 buffer of about `num_bytes`, kept so it can be timed again beside the
    contenders: the machine's bandwidth limit.

    The read is kvattn's native `read_max` (`kvattn.kernels.native`: each
    row's maximum, every byte read once, on XLA's threads, the contenders'
    own) where it runs, else XLA's max-reduction of the same buffer
    (`method` says which). A library's mat-vec is only that library's
    speed: the native panel dot and llama.cpp both read faster than XLA's.
    On a shared machine the bandwidth a process gets moves from minute to
    minute; a limit measured once, before minutes of contenders, is not side
    by side with them. `bytes_per_second()` times it again, so a benchmark
    can take it in every repeat, in turn with the contenders.
    """

    ROWS = 64  # rows split evenly over any thread count up to 64

    def __init__(self, num_bytes: int):
        from kvattn.kernels import native

        columns = max(1, num_bytes // (4 * self.ROWS))
        self.num_bytes = self.ROWS * columns * 4
        self.matrix = jax.random.normal(jax.random.key(0), (self.ROWS, columns), jnp.float32)
        native_read = native.available(native.READ_MAX)
        self.method = "native read_max" if native_read else "XLA max-reduction"
        self._read = jax.jit(native.read_max if native_read else native.read_max_on_xla)

    def bytes_per_second(self, passes: int = 5) -> float:
        """Bytes per second of the median of `passes` timed passes (after one untimed)."""
        return self.num_bytes / (median_ms(lambda: self._read(self.matrix), passes) * 1e-3)


def bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of `Calibration` over about `num_bytes` (median of at least 5 passes)."""
    return Calibration(num_bytes).bytes_per_second(max(repeats, 5))
