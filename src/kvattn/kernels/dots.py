"""The weight dots: `dense(x, kernel)` over any form `kvattn.math.quant` stores, on the kernel that runs here.

A float kernel is XLA's dot; float32 panels run `kvattn.kernels.native`'s
float32 dot on the CPU; an int8 kernel quantizes `x` per row, multiplies
int8 by int8 into int32 and scales the sums back (tiled weights: all three
in one native kernel where it runs); an int4 kernel does the same a group
of inputs at a time, each group's sum scaled by its own scale.
Which runs, and which forms models store here (`use_panels`, `use_tiles`),
`kvattn.kernels.route` decides.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Shaped

from kvattn.kernels import route
from kvattn.math import int4, quant

__all__ = ["dense"]


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
    return route.panel_dot(flat, kernel.panels).reshape(*x.shape[:-1], *kernel.features)


def _int8_dense(x, kernel: quant.Int8Weights | quant.TiledInt8Weights):
    flat = x.reshape(-1, x.shape[-1])
    if isinstance(kernel, quant.TiledInt8Weights):  # quantized, multiplied and scaled back in one kernel
        y = route.tiled_dense(flat.astype(jnp.float32), kernel.tiles, kernel.scale.reshape(-1).astype(jnp.float32))
        return y.reshape(*x.shape[:-1], *kernel.features).astype(x.dtype)
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


def _int4_dense(x, kernel: int4.Int4Weights | int4.TiledInt4Weights):
    """Per row int8 `x` by the 4-bit values, one exact int32 sum per group, scaled per group and summed in float32."""
    flat = x.reshape(-1, x.shape[-1])
    values, row_scale = quant.quantize_rows(flat)
    if isinstance(kernel, int4.TiledInt4Weights):
        packed, scale = kernel.tiles, kernel.scale
    else:
        packed, scale = kernel.packed.reshape(-1, kernel.inputs // 2), kernel.scale.reshape(-1, kernel.scale.shape[-1])
    y = route.int4_dot(values, packed, scale) * row_scale
    return y.reshape(*x.shape[:-1], *kernel.features).astype(x.dtype)


# The dot of each storage form: a new form is one line here.
_DOTS = {
    quant.FloatWeights: _float_dense, quant.TableWeights: _table_dense, quant.PanelWeights: _panel_dense,
    quant.Int8Weights: _int8_dense, quant.TiledInt8Weights: _int8_dense, int4.Int4Weights: _int4_dense,
    int4.TiledInt4Weights: _int4_dense,
}
