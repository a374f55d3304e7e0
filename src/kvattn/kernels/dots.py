"""The weight dots: `dense(x, kernel)` over any form `kvattn.math.quant` stores, on the kernel that runs here.

A float kernel is XLA's dot; float32 panels run `kvattn.kernels.native`'s
float32 dot on the CPU; an int8 kernel quantizes `x` per row and multiplies
int8 by int8 into int32, tiled on the native int8 dot where it runs.
`use_panels` and `use_tiles` say which forms models store here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, Int8, Shaped, UInt8

from kvattn.kernels import native
from kvattn.math import quant

__all__ = ["dense", "use_panels", "use_tiles"]


def use_panels(outputs: int, dtype) -> bool:
    """Whether a float kernel of `outputs` (the product of `F`) is best stored as panels here.

    It must be float32 with whole panels, and the native dot must run on
    this backend.
    """
    return (jnp.dtype(dtype) == jnp.float32 and outputs % quant.PANEL_OUTPUTS == 0 and jax.default_backend() == "cpu"
            and native.available(native.F32_DOT))

def use_tiles(outputs: int, inputs: int) -> bool:
    """Whether an int8 kernel of this shape is best stored tiled here: it fits, and the native dot runs here."""
    return quant.can_tile(outputs, inputs) and jax.default_backend() == "cpu" and native.available(native.INT8_DOT)

def dense(x: Shaped[Array, "*M D"], kernel) -> Shaped[Array, "*M *F"]:
    """`x @ kernel` over the last axis of `x`: a float kernel `(D, *F)` or any `kvattn.math.quant.Form` of one.

    Each form has its dot (`_DOTS`, by type). A float kernel computes in its
    own dtype, as `x @ kernel` does; panels in float32; an int8 kernel
    returns `x`'s dtype.
    """
    if not quant.is_form(kernel):
        return jnp.tensordot(x, kernel, axes=1)
    return _DOTS[type(kernel)](x, kernel)

def _float_dense(x, kernel: quant.FloatWeights):
    return jnp.tensordot(x, kernel.kernel.reshape(-1, *kernel.features), axes=1)

def _table_dense(x, kernel: quant.TableWeights):
    return x @ kernel.table.T

def _panel_dense(x, kernel: quant.PanelWeights):
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return _panel_dot(flat, kernel.panels).reshape(*x.shape[:-1], *kernel.features)

def _int8_dense(x, kernel: quant.Int8Weights | quant.TiledInt8Weights):
    flat = x.reshape(-1, x.shape[-1])
    if isinstance(kernel, quant.TiledInt8Weights):
        values, row_scale = quant.quantize_rows(flat)
        products = _tiled_dot(values, kernel.tiles)
    else:
        single = flat.shape[0] == 1
        if single:  # one row: pad to two; XLA:CPU runs a one-row int8 dot on its slow generic emitter
            flat = jnp.concatenate([flat, jnp.zeros_like(flat)])
        values, row_scale = quant.quantize_rows(flat)
        products = lax.dot_general(values, kernel.values.reshape(-1, kernel.inputs), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32)
        if single:
            products, row_scale = products[:1], row_scale[:1]
    y = products.astype(jnp.float32) * row_scale * kernel.scale.reshape(1, -1)
    return y.reshape(*x.shape[:-1], *kernel.features).astype(x.dtype)

# The dot of each storage form: a new form is one line here.
_DOTS = {
    quant.FloatWeights: _float_dense, quant.TableWeights: _table_dense, quant.PanelWeights: _panel_dense,
    quant.Int8Weights: _int8_dense, quant.TiledInt8Weights: _int8_dense,
}

def _panel_dot(rows: Float[Array, "M D"], panels: Float[Array, "Np D 16"]) -> Float[Array, "M N"]:
    """`rows @ kernel` for the kernel `panels` lays out: the native dot on the CPU, XLA's dot elsewhere."""
    if not native.available(native.F32_DOT):
        return native.f32_dot_on_xla(rows, panels)
    return lax.platform_dependent(rows, panels, cpu=native.f32_dot, default=native.f32_dot_on_xla)

def _tiled_dot(values: Int8[Array, "M D"], tiles: UInt8[Array, "Nt Dg 16 4"]) -> Int[Array, "M N"]:
    """`values @ untiled.T` in int32: the native dot on the CPU, XLA's dot of the untiled values elsewhere."""

    def untiled(values, tiles):
        weights = jnp.transpose(quant.unbiased(tiles), (0, 2, 1, 3)).reshape(-1, values.shape[-1])
        return lax.dot_general(values, weights, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)

    if not native.available(native.INT8_DOT):
        return untiled(values, tiles)
    return lax.platform_dependent(values, tiles, cpu=native.int8_dot, default=untiled)

