"""The weight-holding layers a decoder block is built from: norms, `Linear`, the MLPs, and the storage form of each.

Every projection, and the embedding table, holds its weights in one
storage form (`kvattn.math.quant.Form`), chosen once when it is built from
the weights' dtype and the dots that run here (`weight_form`,
`table_form`); no method branches on the form. The layers keep the
form's arrays as `nnx.Param`s under fixed names (`kernel` and
`kernel_scale`; the model's `embed` and `embed_scale`), so checkpoint
tables, snapshots and fingerprints see the same paths whatever the form.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.kernels import dots, route
from kvattn.math import int4, norms, quant
from kvattn.models import tensors
from kvattn.models.model_config import ModelConfig

__all__ = [
    "MLP_LAYERS", "NORM_LAYERS", "GatedGeluMLP", "GatedMLP", "GatedSiluMLP", "GeluMLP", "HeadScale", "LayerNorm",
    "Linear", "OffsetRMSNorm", "RMSNorm",
    "aligned_empty", "initial", "storage_dtype", "stored_form", "table_form", "weight_form",
]

# XLA:CPU adopts a host array whose data starts on such a boundary without copying it (`jax.device_put`).
_ALIGN = 64


def storage_dtype(dtype, weights: str | None):
    """The dtype float weights are stored in: bfloat16 under `weights="bfloat16"`, else the model's `dtype`."""
    return jnp.dtype(jnp.bfloat16) if weights == "bfloat16" else jnp.dtype(dtype)


def weight_form(outputs: int, inputs: int, dtype, *, weights: str | None) -> type[quant.Form]:
    """The form a projection of `outputs` by `inputs` stores here: int8 (tiled where the native int8 dot runs)
    under `weights="int8"`; 4-bit groups under `weights="int4"` (`kvattn.math.int4`, tiled where the native 4-bit dot
    runs); panels where the native
    dot runs, in float32 for a float32 model and in bfloat16 under `weights="bfloat16"` (whose dot sums in
    float32: a model computing in bfloat16 keeps XLA's dot); else the float kernel in the storage dtype
    (`storage_dtype`)."""
    if weights == "int8":
        return quant.TiledInt8Weights if route.use_tiles(outputs, inputs) else quant.Int8Weights
    if weights == "int4":
        return int4.TiledInt4Weights if route.use_int4_tiles(outputs) else int4.Int4Weights
    stored = storage_dtype(dtype, weights)
    paneled = (weights == "bfloat16" or stored == jnp.float32) and route.use_panels(outputs, stored)
    return quant.PanelWeights if paneled else quant.FloatWeights


def table_form(vocab: int, hidden: int, dtype, *, weights: str | None, tied: bool) -> type[quant.Form]:
    """The form of an embedding table `(V, D)`: a tied one is the head's kernel `(D, V)` in a projection's form,
    except that a plain float one stays a table; an untied one, only ever gathered, is a float table."""
    form = weight_form(vocab, hidden, dtype, weights=weights) if tied else quant.TableWeights
    return quant.TableWeights if form is quant.FloatWeights else form


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised NumPy array whose data starts on a 64-byte boundary, which `jax.device_put` on the CPU
    adopts without a copy (a plain `np.empty` is 16-byte aligned, and copied)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def stored_form(form: type[quant.Form], kernel, features: tuple[int, ...], dtype) -> quant.Form:
    """`form.from_float(kernel, features, dtype)`, built a slice of the first output axis at a time into NumPy arrays
    allocated once, 64-byte aligned (`aligned_empty`: on the CPU, `jax.device_put` then holds them as they are).

    `kernel` `(*inputs, *features)` is any array that slices: NumPy (a view
    of a memory-mapped checkpoint tensor reads only the slice), JAX, or a
    `kvattn.models.tensors.Joined`. Only one slice, about 16 MB in float32,
    is converted at a time, so storing a weight costs its stored bytes and a
    slice, not several whole copies. Slices hold whole panels and tiles (16
    outputs), and every form is built per output: the result equals
    `form.from_float` of the whole kernel, bit for bit.
    """
    if not hasattr(kernel, "ndim"):
        kernel = np.asarray(kernel)
    features = tuple(features)
    inputs_ndim = kernel.ndim - len(features)
    first, inner = features[0], math.prod(features[1:])
    unit = quant.PANEL_OUTPUTS // math.gcd(inner, quant.PANEL_OUTPUTS)  # first-axis entries per 16 outputs
    step = max(unit, tensors.SLICE_BYTES // max(4 * math.prod(kernel.shape[:inputs_ndim]) * inner, 1) // unit * unit)
    axis = inputs_ndim if form.inputs_first else 0  # where the stored arrays' outputs run
    stored, filled = None, None
    for start in range(0, first, step):
        stop = min(start + step, first)
        piece = np.asarray(kernel[(slice(None),) * inputs_ndim + (slice(start, stop),)])
        part = form.from_float(piece, (stop - start, *features[1:]), dtype).stored()
        if stored is None:  # each array's extent along `axis` is proportional to the outputs it holds
            stored = [None if a is None else aligned_empty(
                (*a.shape[:axis], a.shape[axis] * first // (stop - start), *a.shape[axis + 1:]), a.dtype) for a in part]
            filled = [0] * len(part)
        for i, a in enumerate(part):
            if a is not None:
                stored[i][(slice(None),) * axis + (slice(filled[i], filled[i] + a.shape[axis]),)] = a
                filled[i] += a.shape[axis]
    if stored is None:  # no outputs
        return form.from_float(np.asarray(kernel), features, dtype)
    return form.from_stored(*stored, features)


def initial(shape: tuple[int, ...], fan_in: int, rngs: nnx.Rngs | None) -> jax.Array:
    """Initial float32 weights: normal with variance `1 / fan_in` (LeCun's, Flax's default), or zeros without `rngs`."""
    if rngs is None:  # `from_pretrained` overwrites every value
        return jnp.zeros(shape, jnp.float32)
    return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)


class RMSNorm(nnx.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, normalised in float32 and scaled after the cast back (Llama's order)."""

    def __init__(self, features: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.eps = eps

    def __call__(self, x):
        return norms.rms_norm(x, self.weight[...], self.eps, scale_after_cast=True)


class OffsetRMSNorm(nnx.Module):
    """`(1 + weight) * x / sqrt(mean(x^2) + eps)` in float32, cast back after (Gemma's); the weight starts at zero."""

    def __init__(self, features: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((features,), dtype))
        self.eps = eps

    def __call__(self, x):
        return norms.rms_norm(x, self.weight[...], self.eps, offset=1.0)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (GPT-2's), normalised in float32 and scaled after the cast back."""

    def __init__(self, features: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.bias = nnx.Param(jnp.zeros((features,), dtype))
        self.eps = eps

    def __call__(self, x):
        return norms.layer_norm(x, self.weight[...], self.eps, self.bias[...], scale_after_cast=True)


class Linear(nnx.Module):
    """`x @ kernel (+ bias)` over a float kernel `(*inputs, *outputs)` (Flax's layout), held in one storage form.

    `form` (`weight_form`) is the `kvattn.math.quant.Form` type of the
    weights; `kernel` holds its main array and `kernel_scale` its scales
    (None for the float forms). `weight` is the form `kvattn.kernels.dots.dense`
    reads, `float_kernel` the float kernel back, `load_kernel` stores one.
    """

    def __init__(self, inputs: tuple[int, ...], outputs: tuple[int, ...], *, bias: bool, dtype, weights: str | None,
                 rngs: nnx.Rngs | None):
        self.inputs, self.outputs, self.dtype = inputs, outputs, jnp.dtype(dtype)
        self.stored_dtype = storage_dtype(dtype, weights)
        self.form = weight_form(math.prod(outputs), math.prod(inputs), dtype, weights=weights)
        if rngs is None:  # zeros, as `initial` gives, without quantizing them
            kernel = self.form.blank(inputs, outputs, self.stored_dtype)
        else:
            kernel = self.form.from_float(initial((*inputs, *outputs), math.prod(inputs), rngs), outputs,
                                          self.stored_dtype)
        main, scale = kernel.stored()
        self.kernel = nnx.Param(jnp.asarray(main))
        self.kernel_scale = None if scale is None else nnx.Param(jnp.asarray(scale))
        self.bias = nnx.Param(jnp.zeros(outputs, dtype)) if bias else None

    @property
    def weight(self) -> quant.Form:
        """The weights in their form, as `kvattn.kernels.dots.dense` reads them."""
        scale = None if self.kernel_scale is None else self.kernel_scale[...]
        return self.form.from_stored(self.kernel[...], scale, self.outputs)

    def float_kernel(self) -> jax.Array:
        """The kernel `(*inputs, *outputs)` as a float array: panels laid back, int8 values dequantized."""
        return self.weight.to_float().reshape(*self.inputs, *self.outputs)

    def bias_value(self) -> jax.Array | None:
        """The bias `outputs`, or None without one."""
        return None if self.bias is None else self.bias[...]

    def kernel_shape(self) -> tuple[int, ...]:
        """The float kernel's shape, `(*inputs, *outputs)`, in whatever form it is stored."""
        return (*self.inputs, *self.outputs)

    def load_kernel(self, value) -> None:
        """Stores a float kernel `(*inputs, *outputs)` in this layer's form (quantized per output when int8), a slice
        at a time (`stored_form`): a memory-mapped kernel is read once, never held whole beside its stored form."""
        main, scale = stored_form(self.form, value, self.outputs, self.stored_dtype).stored()
        self.kernel.set_value(jax.device_put(main))
        if scale is not None:
            self.kernel_scale.set_value(jax.device_put(scale))

    def __call__(self, x):
        y = dots.dense(x, self.weight)
        return y if self.bias is None else y + norms.along_last(self.bias[...], y)


class HeadScale(nnx.Module):
    """The learned scale `(H,)` of a per-head query or key norm (the path `query_ln/scale` Flax's layers use)."""

    def __init__(self, head_dim: int, dtype, *, offset: bool = False):
        # An offset norm scales by `1 + scale` (`OffsetRMSNorm`), so its scale starts at zero.
        self.scale = nnx.Param((jnp.zeros if offset else jnp.ones)((head_dim,), dtype))


class GeluMLP(nnx.Module):
    """GPT-2's MLP: `down(gelu_tanh(up(x)))`."""

    def __init__(self, config: ModelConfig, dtype, *, weights: str | None, rngs: nnx.Rngs | None):
        hidden, inner = config.hidden_size, config.intermediate_size
        layer = functools.partial(Linear, bias=config.block.mlp_bias, dtype=dtype, weights=weights, rngs=rngs)
        self.up = layer((hidden,), (inner,))
        self.down = layer((inner,), (hidden,))

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


class GatedMLP(nnx.Module):
    """A gated MLP: `down(act(gate(x)) * up(x))`, Llama's SwiGLU (`act` SiLU) or Gemma's GeGLU (tanh GELU).

    The gate and up projections are one kernel `gate_up` `(D, 2I)`, gate
    first: one dot per step instead of two.
    """

    activation = staticmethod(jax.nn.silu)

    def __init__(self, config: ModelConfig, dtype, *, weights: str | None, rngs: nnx.Rngs | None):
        hidden, inner = config.hidden_size, config.intermediate_size
        layer = functools.partial(Linear, bias=config.block.mlp_bias, dtype=dtype, weights=weights, rngs=rngs)
        self.gate_up = layer((hidden,), (2 * inner,))
        self.down = layer((inner,), (hidden,))

    def __call__(self, x):
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(self.activation(gate) * up)


class GatedSiluMLP(GatedMLP):
    """Llama's MLP (SwiGLU): `down(silu(gate(x)) * up(x))`."""


class GatedGeluMLP(GatedMLP):
    """Gemma's MLP (GeGLU): `down(gelu_tanh(gate(x)) * up(x))`."""

    activation = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


# The layers each kind a `kvattn.models.spec.BlockSpec` names builds.
NORM_LAYERS = {"layer": LayerNorm, "rms": RMSNorm, "rms_offset": OffsetRMSNorm}
MLP_LAYERS = {"gelu": GeluMLP, "gated_silu": GatedSiluMLP, "gated_gelu": GatedGeluMLP}
