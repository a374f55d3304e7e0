"""Compact weights: int8 kernels with per-output-channel scales, and the one projection that reads any kernel.

`dense(x, kernel)` is the matmul of every projection that may hold compact
weights. A float kernel `(D, *F)` (Flax's layout: inputs first) is
`x @ kernel`, in the kernel's dtype. An `Int8Kernel` holds int8 values and
one float32 scale per output channel; `dense` quantizes `x` on the fly, one
symmetric scale per row (dynamic quantization, as torch's
`quantize_dynamic` does on CPU), multiplies int8 by int8 into int32 and
rescales. Neither operand is ever converted to float before the dot: on
XLA:CPU a converted weight is written out in full before the dot reads it,
which costs more than reading the float weight would have.

Two facts of XLA:CPU (jaxlib 0.10) shape the int8 path, both measured in
`benchmarks/dots.py`:
  - an int8 dot of one row runs on XLA's generic loop emitter, an order of
    magnitude slower than the two-row dot that goes to YNNPACK, so a single
    row is padded with a zero row;
  - YNNPACK packs the weight operand of every dot at run time and folds a
    transpose into that packing, so int8 values are stored `(*F, D)`
    (torch's `(out, in)`), which ran faster than `(D, *F)`.

Axis legend: M rows (tokens), D input features, F output features (one or
more axes).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int8, Shaped

__all__ = ["INT8_MAX_FEATURES", "Int8Kernel", "dense", "dequantize", "is_compact", "quantize", "quantize_rows"]

# int8 x int8 products summed in int32: at most 127 * 127 * D, which must stay below 2**31.
INT8_MAX_FEATURES = (2**31 - 1) // (127 * 127)


class Int8Kernel(NamedTuple):
    """A projection's weights in int8: `values` `(*F, D)` and one float32 `scale` per output channel `F`.

    The float kernel it stands for is `moveaxis(values, -1, 0) * scale`
    (`dequantize`); `quantize` makes one from a float kernel `(D, *F)`.
    """

    values: Int8[Array, "*F D"] | Int8[np.ndarray, "*F D"]
    scale: Float[Array, "*F"] | Float[np.ndarray, "*F"]


def is_compact(kernel) -> bool:
    """Whether `kernel` is an `Int8Kernel` rather than a float array."""
    return isinstance(kernel, Int8Kernel)


def quantize_rows(x: Float[Array, "M D"] | Float[np.ndarray, "M D"]):
    """Symmetric int8 per row: `(values, scale)` with `x ~= values * scale`, `scale = max|x| / 127` `(M, 1)`.

    A row of zeros gets scale 1 (it quantizes to zeros either way); a row
    holding NaN or infinity gets a non-finite scale, so its products are
    non-finite too rather than silently finite. NumPy in, NumPy out (the
    loader quantizes on the host, one tensor at a time); JAX otherwise.
    """
    xp = np if isinstance(x, np.ndarray) else jnp
    x = x.astype(xp.float32)
    scale = xp.max(xp.abs(x), axis=-1, keepdims=True) * xp.float32(1 / 127)
    scale = xp.where(scale == 0, xp.float32(1), scale)
    values = xp.clip(xp.round(x / scale), -127, 127).astype(xp.int8)
    return values, scale


def quantize(kernel: Shaped[Array, " D *F"] | Shaped[np.ndarray, " D *F"]) -> Int8Kernel:
    """A float kernel `(D, *F)` as int8 values `(*F, D)` with one scale per output channel (round to nearest).

    Each output channel is a row of `quantize_rows` (NumPy for a NumPy
    kernel), so quantizing the parts of a kernel that are later concatenated
    along an output axis gives the same values as quantizing the whole.

    Raises:
      ValueError: more input features than int32 accumulation allows
        (`INT8_MAX_FEATURES`), or a kernel that is not floating point.
    """
    if not jnp.issubdtype(kernel.dtype, jnp.floating):
        raise ValueError(f"quantize needs a floating-point kernel, got {kernel.dtype}")
    if kernel.shape[0] > INT8_MAX_FEATURES:
        raise ValueError(
            f"an int8 kernel sums at most {INT8_MAX_FEATURES} products per output in int32, got {kernel.shape[0]} "
            "input features"
        )
    xp = np if isinstance(kernel, np.ndarray) else jnp
    values, scale = quantize_rows(xp.moveaxis(kernel, 0, -1).reshape(-1, kernel.shape[0]))
    return Int8Kernel(values.reshape(*kernel.shape[1:], kernel.shape[0]), scale.reshape(kernel.shape[1:]))


def dequantize(kernel: Int8Kernel) -> Float[Array, " D *F"]:
    """The float32 kernel `(D, *F)` an `Int8Kernel` stands for."""
    return jnp.moveaxis(kernel.values.astype(jnp.float32) * kernel.scale[..., None], -1, 0)


def dense(x: Shaped[Array, "*M D"], kernel) -> Shaped[Array, "*M *F"]:
    """`x @ kernel` over the last axis of `x`: a float kernel `(D, *F)` or an `Int8Kernel` (module docstring).

    A float kernel computes in its own dtype, as `x @ kernel` does; an int8
    kernel returns `x`'s dtype.
    """
    if not is_compact(kernel):
        return jnp.tensordot(x, kernel, axes=1)
    features = kernel.values.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    if single:  # one row: pad to two, off XLA:CPU's slow generic path (module docstring)
        rows = jnp.concatenate([rows, jnp.zeros_like(rows)])
    values, row_scale = quantize_rows(rows)
    flat = kernel.values.reshape(-1, kernel.values.shape[-1])
    products = lax.dot_general(values, flat, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = products.astype(jnp.float32) * row_scale * kernel.scale.reshape(1, -1)
    if single:
        y = y[:1]
    return y.reshape(*x.shape[:-1], *features).astype(x.dtype)
