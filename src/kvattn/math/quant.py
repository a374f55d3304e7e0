"""The storage forms of a weight kernel (`Form`s), the int8 quantizer, and the layouts the native dots read.

A float kernel `(D, *F)` (Flax's layout: inputs first) is stored in one
form, which `kvattn.kernels.dots.dense` reads as it is, never converted to
float first (on XLA:CPU a converted weight is written out in full before
the dot reads it):
  - `FloatWeights`: as it is, in its dtype; `TableWeights`: transposed,
    `(V, D)`, an embedding table whose rows are gathered;
  - `Int8Weights`: int8 values `(*F, D)` (torch's `(out, in)`, which
    YNNPACK packs faster) with one float32 scale per output (`quantize`);
    `dense` quantizes `x` per row on the fly and multiplies int8 by int8;
  - `TiledInt8Weights`: those values laid out once in the order
    `kvattn.kernels.native`'s int8 dot reads them (`tile`);
  - `PanelWeights`: a float32 or bfloat16 kernel as contiguous panels of 16
    outputs (`panel`), which the native float32 and bfloat16 dots stream whole;
  - `kvattn.math.int4`'s 4-bit forms, a scale per group of inputs (plain and tiled).
`kvattn.kernels.route.use_tiles` and `use_panels` say where the laid-out
forms run; `benchmarks/dots.py` measures each against XLA's dots.

Axes: M rows (tokens), D input features, F output features (one or more), V a table's rows.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int8, Shaped, UInt8

__all__ = [
    "INT8_MAX_FEATURES", "PANEL_OUTPUTS", "TILE_INPUTS", "TILE_OUTPUTS", "FloatWeights", "Form", "Int8Weights",
    "PanelWeights", "TableWeights", "TiledInt8Weights", "can_tile", "dequantize", "is_form", "panel", "quantize",
    "quantize_rows", "register_form", "rows", "tile", "unpanel", "untile",
]

# int8 x int8 products summed in int32: at most 127 * 127 * D, which must stay below 2**31.
INT8_MAX_FEATURES = (2**31 - 1) // (127 * 127)
# A tile of `TiledInt8Weights`: this many outputs (int32 lanes of a 512-bit vector), by groups of this many
# inputs (the products AVX512-VNNI sums per lane).
TILE_OUTPUTS, TILE_INPUTS = 16, 4
# Outputs per panel of a `PanelWeights` (float32 lanes of a 512-bit vector).
PANEL_OUTPUTS = 16


def register_form(stored: tuple[str, ...], meta: tuple[str, ...] = ()):
    """A `Form` as a frozen dataclass and a pytree: `stored` its arrays (main, then scale), `meta` static fields."""
    def register(cls):
        cls.arrays = stored
        return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls), data_fields=list(stored),
                                                meta_fields=list(meta))
    return register


class Form:
    """A storage form of a float kernel `(D, *F)`: what a layer stores, and what `kvattn.kernels.dots.dense` reads.

    A pytree of the arrays it stores. A layer holds one form type, chosen
    once, and asks it everything: `from_float` builds it from a float kernel
    `(*inputs, *F)`, `blank` from a zero one without computing, `stored`
    gives the arrays a layer keeps and `from_stored` reads them back,
    `to_float` gives `(D, *F)`, `rows` an embedding's lookup. A new form is
    one subclass here and one line in `dense`'s table.
    """

    features: tuple[int, ...]
    arrays: tuple[str, ...]  # the names of `stored`'s arrays, main first
    inputs_first = False  # stored `(*inputs, *F)`, else outputs slowest (`kvattn.models.layers.stored_form`)

    @classmethod
    def from_float(cls, kernel, features: tuple[int, ...], dtype) -> Form:
        raise NotImplementedError

    @classmethod
    def blank(cls, inputs: tuple[int, ...], features: tuple[int, ...], dtype) -> Form:
        """The form of a zero kernel `(*inputs, *F)`, in JAX: under `jax.eval_shape`, shapes only, no memory."""
        return cls.from_float(jnp.zeros((*inputs, *features), dtype), features, dtype)

    def stored(self) -> tuple:
        """The arrays a layer keeps, `(main, scale)`: scale None where the form has none."""
        main, *scale = (getattr(self, name) for name in self.arrays)
        return main, (scale[0] if scale else None)

    @classmethod
    def from_stored(cls, main, scale, features: tuple[int, ...]) -> Form:
        """The form of the arrays `stored` gave, for a kernel of output axes `features`."""
        meta = {"features": tuple(features)} if "features" in cls.__dataclass_fields__ else {}
        return cls(**dict(zip(cls.arrays, (main, scale))), **meta)

    def to_float(self):  # the float kernel `(D, *F)`
        raise NotImplementedError

    def rows(self, ids, dtype):
        """Rows `(*B, D)` in `dtype` of outputs `ids` `(*B,)` of a form with one output axis."""
        raise TypeError(f"a {type(self).__name__} stores no rows to look up")


@register_form(("kernel",), ("features",))
class FloatWeights(Form):
    """A float kernel `(*inputs, *F)` stored as it is, in its dtype: XLA's dot."""

    kernel: Float[Array, "*I *F"] | Float[np.ndarray, "*I *F"]
    features: tuple[int, ...]
    inputs_first = True

    @property
    def inputs(self) -> int:
        return self.kernel.size // max(math.prod(self.features), 1)

    @classmethod
    def from_float(cls, kernel, features, dtype) -> FloatWeights:
        return cls(kernel.astype(dtype), tuple(features))

    def to_float(self):
        return self.kernel.reshape(self.inputs, *self.features)


@register_form(("table",))
class TableWeights(Form):
    """A float kernel `(D, V)` stored transposed, `table` `(V, D)`: an embedding table, whose rows are gathered."""

    table: Float[Array, "V D"] | Float[np.ndarray, "V D"]

    @property
    def features(self) -> tuple[int, ...]:
        return self.table.shape[:1]

    @property
    def inputs(self) -> int:
        return self.table.shape[1]

    @classmethod
    def from_float(cls, kernel, features, dtype) -> TableWeights:
        return cls(kernel.reshape(-1, *features).T.astype(dtype))

    def to_float(self):
        return self.table.T

    def rows(self, ids, dtype):
        return jnp.take(self.table, ids, axis=0).astype(dtype)


@register_form(("values", "scale"))
class Int8Weights(Form):
    """A projection's weights in int8: `values` `(*F, D)` and one float32 `scale` per output channel `F`.

    The float kernel it stands for is `moveaxis(values, -1, 0) * scale`
    (`dequantize`); `quantize` makes one from a float kernel `(D, *F)`.
    """

    values: Int8[Array, "*F D"] | Int8[np.ndarray, "*F D"]
    scale: Float[Array, "*F"] | Float[np.ndarray, "*F"]

    @property
    def inputs(self) -> int:
        return self.values.shape[-1]

    @property
    def features(self) -> tuple[int, ...]:
        return tuple(self.scale.shape)

    @classmethod
    def from_float(cls, kernel, features, dtype) -> Int8Weights:
        """Quantized from the float32 kernel, per output (`dtype` is the computation's, not the storage's)."""
        return quantize(kernel.astype(np.float32).reshape(-1, *features))

    @classmethod
    def blank(cls, inputs, features, dtype) -> Int8Weights:
        return cls(jnp.zeros((*features, math.prod(inputs)), jnp.int8), jnp.ones(features, jnp.float32))

    def to_float(self):
        return dequantize(self)

    def rows(self, ids, dtype):
        """The int8 rows (`rows`) times their scales, in `dtype`."""
        return rows(self, ids).astype(dtype) * jnp.take(self.scale, ids, axis=0)[..., None].astype(dtype)


@register_form(("tiles", "scale"))
class TiledInt8Weights(Form):
    """`Int8Weights` laid out for `kvattn.kernels.native`'s int8 dot: `tiles` `(N / 16, D / 4, 16, 4)`, `scale` `*F`.

    `N` is the product of the output axes `F`. Tile `t` holds outputs
    `16t..16t+15`; each group of 64 bytes holds their four consecutive inputs.
    Values are stored as uint8 `values + 128` (the kernel multiplies uint8
    weights by int8 rows). `tile` makes one from an `Int8Weights`, `untile`
    gives it back.
    """

    tiles: UInt8[Array, "Nt Dg 16 4"] | UInt8[np.ndarray, "Nt Dg 16 4"]
    scale: Float[Array, "*F"] | Float[np.ndarray, "*F"]

    @property
    def inputs(self) -> int:
        return self.tiles.shape[1] * TILE_INPUTS

    @property
    def features(self) -> tuple[int, ...]:
        return tuple(self.scale.shape)

    @classmethod
    def from_float(cls, kernel, features, dtype) -> TiledInt8Weights:
        return tile(Int8Weights.from_float(kernel, features, dtype))

    @classmethod
    def blank(cls, inputs, features, dtype) -> TiledInt8Weights:
        return tile(Int8Weights.blank(inputs, features, dtype))

    def to_float(self):
        return dequantize(self)

    rows = Int8Weights.rows


@register_form(("panels",), ("features",))
class PanelWeights(Form):
    """A kernel `(D, *F)` laid out for `kvattn.kernels.native`'s panel dots: `panels` `(N / 16, D, 16)`.

    `N` is the product of the output axes `features`; panel `p` holds
    outputs `16p..16p+15` for every input, contiguously. `panel` makes one,
    `unpanel` gives the kernel back. Stored in float32, or in bfloat16 when
    built for that dtype (half the bytes; the dot widens each weight
    exactly and sums in float32).
    """

    panels: Float[Array, "Np D 16"] | Float[np.ndarray, "Np D 16"]
    features: tuple[int, ...]

    @property
    def inputs(self) -> int:
        return self.panels.shape[1]

    @classmethod
    def from_float(cls, kernel, features, dtype) -> PanelWeights:
        stored = jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.float32
        return panel(kernel.astype(stored).reshape(-1, *features))

    def to_float(self):
        return unpanel(self)

    def rows(self, ids, dtype):
        """Output `t` is lane `t % 16` of panel `t // 16`."""
        return jnp.asarray(self.panels)[ids // PANEL_OUTPUTS, :, ids % PANEL_OUTPUTS].astype(dtype)


def is_form(weights) -> bool:
    """Whether `weights` is a `Form` rather than a plain float array (a form is read as it is, never converted)."""
    return isinstance(weights, Form)


def panel(kernel: Float[Array, " D *F"] | Float[np.ndarray, " D *F"]) -> PanelWeights:
    """A float32 or bfloat16 kernel `(D, *F)` laid out as a `PanelWeights` (NumPy for a NumPy kernel).

    Raises:
      ValueError: a kernel that is neither float32 nor bfloat16, or outputs
        not divisible by 16 (`PANEL_OUTPUTS`).
    """
    xp = _xp(kernel)
    features = tuple(kernel.shape[1:])
    outputs = math.prod(features)
    if kernel.dtype not in (np.float32, jnp.bfloat16) or outputs % PANEL_OUTPUTS:
        raise ValueError(f"a panel kernel needs float32 or bfloat16 with outputs divisible by {PANEL_OUTPUTS}, "
                         f"got {kernel.dtype} with {outputs} outputs")
    grouped = kernel.reshape(kernel.shape[0], outputs // PANEL_OUTPUTS, PANEL_OUTPUTS)
    panels = xp.transpose(grouped, (1, 0, 2))
    return PanelWeights(xp.ascontiguousarray(panels) if xp is np else panels, features)


def unpanel(kernel: PanelWeights) -> Float[Array, " D *F"] | Float[np.ndarray, " D *F"]:
    """The kernel `(D, *F)` a `PanelWeights` lays out, in its dtype."""
    xp = _xp(kernel.panels)
    return xp.transpose(kernel.panels, (1, 0, 2)).reshape(kernel.inputs, *kernel.features)


def can_tile(outputs: int, inputs: int) -> bool:
    """Whether a kernel of `outputs` (the product of `F`) by `inputs` fits whole tiles, at least one."""
    return outputs > 0 and inputs > 0 and outputs % TILE_OUTPUTS == 0 and inputs % TILE_INPUTS == 0


def _xp(array):
    return np if isinstance(array, np.ndarray) else jnp


def tile(kernel: Int8Weights) -> TiledInt8Weights:
    """`kernel`'s values laid out as `TiledInt8Weights.tiles` (NumPy for NumPy values); the scales as they are.

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
    return TiledInt8Weights(xp.ascontiguousarray(tiles) if xp is np else tiles, kernel.scale)


def unbiased(tiles):
    """int8 values from tiles' stored `values + 128`."""
    xp = _xp(tiles)
    return (tiles.astype(xp.int16) - 128).astype(xp.int8)


def untile(kernel: Int8Weights | TiledInt8Weights) -> Int8Weights:
    """The `Int8Weights` a `TiledInt8Weights` lays out, values `(*F, D)` (an `Int8Weights` as it is)."""
    if isinstance(kernel, Int8Weights):
        return kernel
    xp, tiles = _xp(kernel.tiles), kernel.tiles
    values = xp.transpose(unbiased(tiles), (0, 2, 1, 3)).reshape(*kernel.scale.shape, kernel.inputs)
    return Int8Weights(values, kernel.scale)


def rows(kernel: Int8Weights | TiledInt8Weights, ids: Int[Array, "*B"]) -> Int8[Array, "*B D"]:
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
    if isinstance(kernel, Int8Weights):
        return jnp.take(kernel.values, ids, axis=0)
    # Advanced indices on the tile and its lane, around the groups' slice: (*B, D / 4, 4).
    picked = jnp.asarray(kernel.tiles)[ids // TILE_OUTPUTS, :, ids % TILE_OUTPUTS, :]
    return unbiased(picked).reshape(*ids.shape, kernel.inputs)


def quantize_rows(x: Float[Array, "*M D"] | Float[np.ndarray, "*M D"]):
    """Symmetric int8 per row: `(values, scale)` with `x ~= values * scale`, `scale = max|x| / 127` `(*M, 1)`.

    The one int8 quantizer: weights (a row per output channel) and the KV
    cache (a row per token and kv head, `kvattn.caches.storage.encode`).

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


def quantize(kernel: Shaped[Array, " D *F"] | Shaped[np.ndarray, " D *F"]) -> Int8Weights:
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
    return Int8Weights(values.reshape(*kernel.shape[1:], kernel.shape[0]), scale.reshape(kernel.shape[1:]))


def dequantize(kernel: Int8Weights | TiledInt8Weights) -> Float[Array, " D *F"]:
    """The float32 kernel `(D, *F)` an int8 kernel stands for."""
    kernel = untile(kernel)
    return jnp.moveaxis(kernel.values.astype(jnp.float32) * kernel.scale[..., None], -1, 0)
