"""4-bit weights: `Int4Weights`, a float kernel quantized group-wise along its inputs, and its quantizer.

Each output's inputs fall in groups of `group` (32 by default, as
llama.cpp's Q4_0; 128 as GPTQ's and AWQ's); a group stores one bfloat16
scale `d` and one 4-bit value `q` in -8..7 per input, the weight being
`q * d`. Symmetric: no zero point, zero stays zero. As Q4_0 does, `d` is
the group's value of largest magnitude over -8, so that value is stored
exactly (as -8) and the others round to the nearest of the 16 steps; the
values are rounded against the stored (bfloat16) scale, so the rounding
sees the scale the dot will use.

Values are packed two to a byte, biased by 8 (0..15), in blocks of 32
inputs (Q4_0's order): byte `i` of a block holds input `i` in its low
nibble and input `i + 16` in its high one, so unpacking 16 bytes with a
mask and a shift gives 32 consecutive inputs.

`TiledInt4Weights` holds the same blocks with eight outputs' blocks side by
side (`tile`), the layout kvattn's native 4-bit dot reads as one stream.

`kvattn.kernels.dots.dense` multiplies such a kernel as the int8 one:
`x` quantized per row to int8 (`kvattn.math.quant.quantize_rows`), each
group's int8 products summed exactly in int32, and the group sums scaled
by their `d` and summed in float32.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, BFloat16, Int8, UInt8

from kvattn.math import quant

__all__ = ["BLOCK", "GROUP", "TILE_OUTPUTS", "Int4Weights", "TiledInt4Weights", "pack", "quantize_groups", "tile",
           "unpack", "untile"]

# Inputs per packed block (16 bytes), and the default inputs per scale.
BLOCK, GROUP = 32, 32
# Outputs whose blocks a `TiledInt4Weights` tile holds side by side (int32 lanes of a 256-bit vector).
TILE_OUTPUTS = 8


@quant.register_form(("packed", "scale"))
class Int4Weights(quant.Form):
    """A kernel `(D, *F)` in 4 bits: `packed` uint8 `(*F, D / 2)` (`pack`) and a bfloat16 `scale` `(*F, D / group)`.

    The float kernel it stands for is `unpack(packed) * scale` repeated over
    each group, moved to inputs first (`to_float`); `group` is `D` over the
    scales per output.
    """

    packed: UInt8[Array, "*F Dh"] | UInt8[np.ndarray, "*F Dh"]
    scale: BFloat16[Array, "*F G"] | BFloat16[np.ndarray, "*F G"]

    @property
    def inputs(self) -> int:
        return 2 * self.packed.shape[-1]

    @property
    def features(self) -> tuple[int, ...]:
        return tuple(self.scale.shape[:-1])

    @property
    def group(self) -> int:
        return self.inputs // self.scale.shape[-1]

    @classmethod
    def from_float(cls, kernel, features, dtype) -> Int4Weights:
        """Quantized from the float32 kernel in groups of `GROUP` (`dtype` is the computation's, not the storage's)."""
        return quantize_groups(kernel.astype(np.float32).reshape(-1, *features))

    @classmethod
    def blank(cls, inputs, features, dtype) -> Int4Weights:
        size = math.prod(inputs)
        _check(size, GROUP)
        packed = jnp.full((*features, size // 2), 0x88, jnp.uint8)  # every value 0
        return cls(packed, jnp.ones((*features, size // GROUP), jnp.bfloat16))

    def values(self) -> Int8[Array, "*F D"]:
        """The 4-bit values `(*F, D)` in -8..7, as int8."""
        return unpack(self.packed)

    def to_float(self):
        return jnp.moveaxis(_dequantized(self.packed, self.scale), -1, 0)

    def rows(self, ids, dtype):
        """Rows `(*B, D)` of outputs `ids`: their values times their groups' scales, in `dtype`."""
        take = functools.partial(jnp.take, indices=ids, axis=0)
        return _dequantized(take(jnp.asarray(self.packed)), take(jnp.asarray(self.scale))).astype(dtype)


@quant.register_form(("tiles", "scale"), ("features",))
class TiledInt4Weights(quant.Form):
    """`Int4Weights` laid out for kvattn's native 4-bit dot: `tiles` uint8 `(N / 8, D / 32, 8, 16)` and a bfloat16
    `scale` `(N / 8, D / group, 8)`.

    `N` is the product of the output axes `features`, a multiple of 8. Tile
    `t` holds outputs `8t..8t+7`: block `b` of each, 16 bytes in `pack`'s
    order, side by side, then block `b + 1`; their scales the same way, so a
    pass over eight outputs reads one stream. `tile` makes one from an
    `Int4Weights`, `untile` gives it back.
    """

    tiles: UInt8[Array, "Nt Db 8 16"] | UInt8[np.ndarray, "Nt Db 8 16"]
    scale: BFloat16[Array, "Nt G 8"] | BFloat16[np.ndarray, "Nt G 8"]
    features: tuple[int, ...]

    @property
    def inputs(self) -> int:
        return BLOCK * self.tiles.shape[1]

    @property
    def group(self) -> int:
        return self.inputs // self.scale.shape[1]

    @classmethod
    def from_float(cls, kernel, features, dtype) -> TiledInt4Weights:
        return tile(Int4Weights.from_float(kernel, features, dtype))

    @classmethod
    def blank(cls, inputs, features, dtype) -> TiledInt4Weights:
        return tile(Int4Weights.blank(inputs, features, dtype))

    def to_float(self):
        return untile(self).to_float()

    def rows(self, ids, dtype):
        """Rows `(*B, D)` of outputs `ids`: their values times their groups' scales, in `dtype`."""
        ids = jnp.asarray(ids)
        tiles, scale = jnp.asarray(self.tiles), jnp.asarray(self.scale)
        packed = tiles[ids // TILE_OUTPUTS, :, ids % TILE_OUTPUTS].reshape(*ids.shape, self.inputs // 2)
        return _dequantized(packed, scale[ids // TILE_OUTPUTS, :, ids % TILE_OUTPUTS]).astype(dtype)


def tile(weights: Int4Weights) -> TiledInt4Weights:
    """`weights` as a `TiledInt4Weights` (NumPy for NumPy).

    Raises:
      ValueError: outputs that are not a multiple of 8.
    """
    outputs = math.prod(weights.features)
    if outputs % TILE_OUTPUTS:
        raise ValueError(f"tiled int4 weights need outputs in whole tiles of {TILE_OUTPUTS}, got {outputs}")
    xp = _xp(weights.packed)
    blocks, groups = weights.inputs // BLOCK, weights.scale.shape[-1]
    tiles = xp.transpose(weights.packed.reshape(-1, TILE_OUTPUTS, blocks, BLOCK // 2), (0, 2, 1, 3))
    scale = xp.transpose(weights.scale.reshape(-1, TILE_OUTPUTS, groups), (0, 2, 1))
    if xp is np:
        tiles, scale = np.ascontiguousarray(tiles), np.ascontiguousarray(scale)
    return TiledInt4Weights(tiles, scale, weights.features)


def untile(weights: Int4Weights | TiledInt4Weights) -> Int4Weights:
    """The `Int4Weights` that `tile` laid out (an `Int4Weights` as it is)."""
    if isinstance(weights, Int4Weights):
        return weights
    xp = _xp(weights.tiles)
    packed = xp.transpose(weights.tiles, (0, 2, 1, 3)).reshape(*weights.features, weights.inputs // 2)
    scale = xp.transpose(weights.scale, (0, 2, 1)).reshape(*weights.features, weights.scale.shape[1])
    return Int4Weights(packed, scale)


def _dequantized(packed, scale) -> jnp.ndarray:
    """The float32 weights `(*F, D)` of packed values `(*F, D / 2)` and their groups' scales `(*F, G)`."""
    values = unpack(packed).astype(jnp.float32)
    grouped = values.reshape(*values.shape[:-1], scale.shape[-1], -1) * jnp.asarray(scale, jnp.float32)[..., None]
    return grouped.reshape(values.shape)


def _check(inputs: int, group: int) -> None:
    if group % BLOCK or not inputs or inputs % group:
        raise ValueError(f"int4 weights need inputs divisible by the group, a multiple of {BLOCK}; got {inputs} "
                         f"inputs in groups of {group}")


def _xp(array):
    return np if isinstance(array, np.ndarray) else jnp


def pack(values: Int8[Array, "*F D"] | Int8[np.ndarray, "*F D"]) -> UInt8[Array, "*F Dh"]:
    """int8 values in -8..7 `(*F, D)`, `D` a multiple of 32, packed as `Int4Weights.packed` (NumPy for NumPy)."""
    xp = _xp(values)
    blocks = (values.astype(xp.int16) + 8).astype(xp.uint8).reshape(*values.shape[:-1], -1, 2, BLOCK // 2)
    packed = blocks[..., 0, :] | (blocks[..., 1, :] << 4)
    return packed.reshape(*values.shape[:-1], values.shape[-1] // 2)


def unpack(packed: UInt8[Array, "*F Dh"] | UInt8[np.ndarray, "*F Dh"]) -> Int8[Array, "*F D"]:
    """The int8 values in -8..7 `(*F, D)` that `pack` packed (JAX)."""
    packed = jnp.asarray(packed)
    blocks = packed.reshape(*packed.shape[:-1], -1, BLOCK // 2)
    both = jnp.concatenate([blocks & 0xF, blocks >> 4], axis=-1).astype(jnp.int8) - jnp.int8(8)
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_groups(kernel, group: int = GROUP) -> Int4Weights:
    """A float kernel `(D, *F)` as `Int4Weights` in groups of `group` inputs (NumPy in, NumPy arrays out).

    Each output's groups are quantized on their own, so quantizing parts of
    a kernel later concatenated along an output axis gives the values of
    quantizing the whole. A group of zeros stores scale 0; a group holding
    NaN or infinity a non-finite scale, so its products are non-finite too.

    Raises:
      ValueError: a kernel that is not floating point, with no outputs, or
        whose inputs are not a multiple of `group` (itself a multiple of 32).
    """
    if not jnp.issubdtype(kernel.dtype, jnp.floating):
        raise ValueError(f"int4 quantization needs a floating-point kernel, got {kernel.dtype}")
    if kernel.ndim < 2 or not math.prod(kernel.shape[1:]):
        raise ValueError(f"int4 quantization needs a kernel (D, *F) with at least one output, got {kernel.shape}")
    _check(kernel.shape[0], group)
    xp = _xp(kernel)
    features, inputs = kernel.shape[1:], kernel.shape[0]
    if xp is np:  # one float32 copy, rounded in place: loading converts a slice at a time, within its bytes
        grouped = np.ascontiguousarray(np.moveaxis(kernel, 0, -1), np.float32).reshape(*features, -1, group)
    else:
        grouped = jnp.moveaxis(kernel.astype(jnp.float32), 0, -1).reshape(*features, inputs // group, group)
    largest = xp.take_along_axis(grouped, xp.argmax(xp.abs(grouped), axis=-1)[..., None], axis=-1)
    scale = (largest / -8).astype(jnp.bfloat16)
    wide = scale.astype(xp.float32)
    finite = xp.isfinite(wide) & (wide != 0)
    if xp is np:
        np.divide(grouped, np.where(finite, wide, 1), out=grouped)
        np.copyto(grouped, 0, where=~finite)
        values = np.clip(np.rint(grouped, out=grouped), -8, 7, out=grouped).astype(np.int8)
    else:
        ratio = jnp.where(finite, grouped / jnp.where(finite, wide, 1), 0)
        values = jnp.clip(jnp.round(ratio), -8, 7).astype(jnp.int8)
    return Int4Weights(pack(values.reshape(*features, inputs)), scale[..., 0])
