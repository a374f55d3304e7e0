"""Weights laid out for their dots (int8 with per-output scales, float32 panels), and the projection that reads any.

`dense(x, kernel)` is the matmul of every projection that may hold compact
weights. A float kernel `(D, *F)` (Flax's layout: inputs first) is
`x @ kernel`, in the kernel's dtype. An `Int8Kernel` holds int8 values and
one float32 scale per output channel; `dense` quantizes `x` on the fly, one
symmetric scale per row (dynamic quantization, as torch's
`quantize_dynamic` does on CPU), multiplies int8 by int8 into int32 and
rescales. Neither operand is ever converted to float before the dot: on
XLA:CPU a converted weight is written out in full before the dot reads it,
which costs more than reading the float weight would have.

Two facts of XLA:CPU (jaxlib 0.10) shape XLA's int8 path, both measured in
`benchmarks/dots.py`:
  - an int8 dot of one row runs on XLA's generic loop emitter, an order of
    magnitude slower than the two-row dot that goes to YNNPACK, so a single
    row is padded with a zero row;
  - YNNPACK packs the weight operand of every dot at run time and folds a
    transpose into that packing, so int8 values are stored `(*F, D)`
    (torch's `(out, in)`), which ran faster than `(D, *F)`.

Where `kvattn.kernels.native`'s int8 dot runs (XLA:CPU on a CPU with AVX512-VNNI),
models store their kernels as a `TiledInt8Kernel` instead: the same int8
values laid out once in the order that dot reads (`tile`), which runs
faster than YNNPACK's at every batch size measured, with equal results
(int32 sums are exact). `use_tiles` says where; `dense` reads either form.

A float32 kernel has a laid-out form too, for the same native library's
float32 dot: a `PanelKernel` holds `(D, *F)` as contiguous panels of 16
outputs (`panel`), which the dot streams whole. XLA:CPU reads a `(D, N)`
kernel row by row, and a step's few rows then make a strided read, so the
panels run faster at every row count `benchmarks.dots` measures, a step's
most of all. `use_panels` says where models store them.

Axis legend: M rows (tokens), D input features, F output features (one or
more axes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int8, Shaped, UInt8


__all__ = [
    "INT8_MAX_FEATURES", "PANEL_OUTPUTS", "TILE_INPUTS", "TILE_OUTPUTS", "Int8Kernel", "PanelKernel",
    "TiledInt8Kernel", "can_tile", "dequantize", "is_compact", "is_laid_out", "panel", "quantize",
    "quantize_rows", "rows", "tile", "unpanel", "untile",
]

# int8 x int8 products summed in int32: at most 127 * 127 * D, which must stay below 2**31.
INT8_MAX_FEATURES = (2**31 - 1) // (127 * 127)
# A tile of `TiledInt8Kernel`: this many outputs (int32 lanes of a 512-bit vector), by groups of this many
# inputs (the products AVX512-VNNI sums per lane).
TILE_OUTPUTS, TILE_INPUTS = 16, 4
# Outputs per panel of a `PanelKernel` (float32 lanes of a 512-bit vector).
PANEL_OUTPUTS = 16


class Int8Kernel(NamedTuple):
    """A projection's weights in int8: `values` `(*F, D)` and one float32 `scale` per output channel `F`.

    The float kernel it stands for is `moveaxis(values, -1, 0) * scale`
    (`dequantize`); `quantize` makes one from a float kernel `(D, *F)`.
    """

    values: Int8[Array, "*F D"] | Int8[np.ndarray, "*F D"]
    scale: Float[Array, "*F"] | Float[np.ndarray, "*F"]

    @property
    def inputs(self) -> int:
        """`D`, the input features."""
        return self.values.shape[-1]

    @property
    def features(self) -> tuple[int, ...]:
        """`F`, the output axes."""
        return tuple(self.scale.shape)


class TiledInt8Kernel(NamedTuple):
    """An `Int8Kernel` laid out for `kvattn.kernels.native`'s int8 dot: `tiles` `(N / 16, D / 4, 16, 4)`, `scale` `*F`.

    `N` is the product of the output axes `F`. Tile `t` holds outputs
    `16t..16t+15`; each group of 64 bytes holds their four consecutive inputs.
    Values are stored as uint8 `values + 128` (the kernel multiplies uint8
    weights by int8 rows). `tile` makes one from an `Int8Kernel`, `untile`
    gives it back.
    """

    tiles: UInt8[Array, "Nt Dg 16 4"] | UInt8[np.ndarray, "Nt Dg 16 4"]
    scale: Float[Array, "*F"] | Float[np.ndarray, "*F"]

    @property
    def inputs(self) -> int:
        """`D`, the input features."""
        return self.tiles.shape[1] * TILE_INPUTS

    @property
    def features(self) -> tuple[int, ...]:
        """`F`, the output axes."""
        return tuple(self.scale.shape)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels"], meta_fields=["features"])
@dataclasses.dataclass(frozen=True)
class PanelKernel:
    """A float32 kernel `(D, *F)` laid out for `kvattn.kernels.native`'s float32 dot: `panels` `(N / 16, D, 16)`.

    `N` is the product of the output axes `features`; panel `p` holds
    outputs `16p..16p+15` for every input, contiguously. `panel` makes one,
    `unpanel` gives the kernel back. A pytree whose one leaf is `panels`.
    """

    panels: Float[Array, "Np D 16"] | Float[np.ndarray, "Np D 16"]
    features: tuple[int, ...]

    @property
    def inputs(self) -> int:
        """`D`, the input features."""
        return self.panels.shape[1]


def is_compact(kernel) -> bool:
    """Whether `kernel` is an `Int8Kernel` or a `TiledInt8Kernel` rather than a float array."""
    return isinstance(kernel, Int8Kernel | TiledInt8Kernel)


def is_laid_out(kernel) -> bool:
    """Whether `kernel` is one of the forms `dense` reads as stored (int8, tiled or panels), not a plain array.

    Such a kernel is never converted to another dtype: `dense` reads it as it is.
    """
    return isinstance(kernel, Int8Kernel | TiledInt8Kernel | PanelKernel)



def panel(kernel: Float[Array, " D *F"] | Float[np.ndarray, " D *F"]) -> PanelKernel:
    """A float32 kernel `(D, *F)` laid out as a `PanelKernel` (NumPy for a NumPy kernel).

    Raises:
      ValueError: a kernel that is not float32, or outputs not divisible
        by 16 (`PANEL_OUTPUTS`).
    """
    xp = _xp(kernel)
    features = tuple(kernel.shape[1:])
    outputs = math.prod(features)
    if kernel.dtype != np.float32 or outputs % PANEL_OUTPUTS:
        raise ValueError(
            f"a panel kernel needs float32 with outputs divisible by {PANEL_OUTPUTS}, got {kernel.dtype} with "
            f"{outputs} outputs"
        )
    grouped = kernel.reshape(kernel.shape[0], outputs // PANEL_OUTPUTS, PANEL_OUTPUTS)
    panels = xp.transpose(grouped, (1, 0, 2))
    return PanelKernel(xp.ascontiguousarray(panels) if xp is np else panels, features)


def unpanel(kernel: PanelKernel) -> Float[Array, " D *F"] | Float[np.ndarray, " D *F"]:
    """The float32 kernel `(D, *F)` a `PanelKernel` lays out."""
    xp = _xp(kernel.panels)
    return xp.transpose(kernel.panels, (1, 0, 2)).reshape(kernel.inputs, *kernel.features)


def can_tile(outputs: int, inputs: int) -> bool:
    """Whether a kernel of `outputs` (the product of `F`) by `inputs` fits whole tiles, at least one."""
    return outputs > 0 and inputs > 0 and outputs % TILE_OUTPUTS == 0 and inputs % TILE_INPUTS == 0



def _xp(array):
    return np if isinstance(array, np.ndarray) else jnp


def tile(kernel: Int8Kernel) -> TiledInt8Kernel:
    """`kernel`'s values laid out as `TiledInt8Kernel.tiles` (NumPy for NumPy values); the scales as they are.

    Raises:
      TypeError: values that are not int8 (a wider value would wrap, a float
        would be truncated).
      ValueError: no outputs or no inputs, or counts that do not fit whole tiles (`can_tile`).
    """
    xp, values = _xp(kernel.values), kernel.values
    if values.dtype != np.int8:
        raise TypeError(f"a tiled kernel holds int8 values, got {values.dtype}; quantize float kernels first")
    inputs = values.shape[-1] if values.ndim else 0
    outputs = math.prod(values.shape[:-1])
    if not outputs or not inputs:
        raise ValueError(f"a tiled kernel needs at least one output and one input, got {outputs} and {inputs}")
    if not can_tile(outputs, inputs):
        raise ValueError(
            f"a tiled kernel needs outputs divisible by {TILE_OUTPUTS} and inputs by {TILE_INPUTS}, got {outputs} "
            f"outputs and {inputs} inputs"
        )
    grouped = values.reshape(outputs // TILE_OUTPUTS, TILE_OUTPUTS, inputs // TILE_INPUTS, TILE_INPUTS)
    tiles = (xp.transpose(grouped, (0, 2, 1, 3)).astype(xp.int16) + 128).astype(xp.uint8)
    return TiledInt8Kernel(xp.ascontiguousarray(tiles) if xp is np else tiles, kernel.scale)


def unbiased(tiles):
    """int8 values from tiles' stored `values + 128`."""
    xp = _xp(tiles)
    return (tiles.astype(xp.int16) - 128).astype(xp.int8)


def untile(kernel: Int8Kernel | TiledInt8Kernel) -> Int8Kernel:
    """The `Int8Kernel` a `TiledInt8Kernel` lays out, values `(*F, D)` (an `Int8Kernel` as it is)."""
    if isinstance(kernel, Int8Kernel):
        return kernel
    xp, tiles = _xp(kernel.tiles), kernel.tiles
    values = xp.transpose(unbiased(tiles), (0, 2, 1, 3)).reshape(*kernel.scale.shape, kernel.inputs)
    return Int8Kernel(values, kernel.scale)


def rows(kernel: Int8Kernel | TiledInt8Kernel, ids: Int[Array, "*B"]) -> Int8[Array, "*B D"]:
    """The int8 values of outputs `ids` of a kernel with one output axis: an int8 embedding table's lookup.

    Both forms of a kernel give the same rows for every id: ids outside
    `0 .. N - 1` are refused when they are known (not traced); traced, they
    are clamped into that range, as `jnp.take(..., mode="clip")` does.

    Raises:
      TypeError: ids that are not integers.
      IndexError: known ids outside `0 .. N - 1`.
    """
    (count,) = kernel.features
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"rows takes integer ids, got {jnp.result_type(ids)}")
    if not isinstance(ids, jax.core.Tracer):
        known = np.asarray(ids)
        if known.size and (known.min() < 0 or known.max() >= count):
            raise IndexError(f"rows takes ids in 0 .. {count - 1} (the kernel's outputs), got {known.min()} .. "
                             f"{known.max()}")
    ids = jnp.clip(jnp.asarray(ids), 0, count - 1)
    if isinstance(kernel, Int8Kernel):
        return jnp.take(kernel.values, ids, axis=0)
    # Advanced indices on the tile and its lane, around the groups' slice: (*B, D / 4, 4).
    picked = jnp.asarray(kernel.tiles)[ids // TILE_OUTPUTS, :, ids % TILE_OUTPUTS, :]
    return unbiased(picked).reshape(*ids.shape, kernel.inputs)


def quantize_rows(x: Float[Array, "*M D"] | Float[np.ndarray, "*M D"]):
    """Symmetric int8 per row: `(values, scale)` with `x ~= values * scale`, `scale = max|x| / 127` `(*M, 1)`.

    The one int8 quantizer: weights (a row per output channel) and the KV
    cache (a row per token and kv head, `kvattn.caches.contiguous.encode`).

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
        (`INT8_MAX_FEATURES`), none, or a kernel that is not floating point.
    """
    if not jnp.issubdtype(kernel.dtype, jnp.floating):
        raise ValueError(f"quantize needs a floating-point kernel, got {kernel.dtype}")
    if kernel.ndim < 2 or not kernel.shape[0] or not math.prod(kernel.shape[1:]):
        raise ValueError(f"quantize needs a kernel (D, *F) with at least one input and output, got {kernel.shape}")
    if kernel.shape[0] > INT8_MAX_FEATURES:
        raise ValueError(
            f"an int8 kernel sums at most {INT8_MAX_FEATURES} products per output in int32, got {kernel.shape[0]} "
            "input features"
        )
    xp = np if isinstance(kernel, np.ndarray) else jnp
    values, scale = quantize_rows(xp.moveaxis(kernel, 0, -1).reshape(-1, kernel.shape[0]))
    return Int8Kernel(values.reshape(*kernel.shape[1:], kernel.shape[0]), scale.reshape(kernel.shape[1:]))


def dequantize(kernel: Int8Kernel | TiledInt8Kernel) -> Float[Array, " D *F"]:
    """The float32 kernel `(D, *F)` an int8 kernel stands for."""
    kernel = untile(kernel)
    return jnp.moveaxis(kernel.values.astype(jnp.float32) * kernel.scale[..., None], -1, 0)


