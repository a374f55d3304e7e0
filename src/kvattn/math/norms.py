"""Normalisations over the last axis, computed in float32: the layer's QK-norm and the models' norms.

One function per norm; where frameworks disagree on the order of the final
cast and the scale, the order is an argument rather than a second copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

__all__ = ["along_last", "layer_norm", "rms_norm"]


def layer_norm(x: Float[Array, "... H"], scale: Float[Array, " H"], eps: float, bias: Float[Array, " H"] | None = None,
               *, scale_after_cast: bool = False) -> Float[Array, "... H"]:
    """LayerNorm over the last axis, normalised in float32.

    Without `bias` and scaled in float32, Flax's (the layer's `normalize_qk`);
    GPT-2's has a bias and scales after the cast back to `x`'s dtype
    (`scale_after_cast`, as `rms_norm` explains).
    """
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    if scale_after_cast:
        normed = normed.astype(x.dtype) * along_last(scale, x)
    else:
        normed = (normed * along_last(scale.astype(jnp.float32), x)).astype(x.dtype)
    return normed if bias is None else normed + along_last(bias, x)


def rms_norm(x: Float[Array, "... H"], scale: Float[Array, " H"], eps: float, *,
             scale_after_cast: bool = False, offset: float = 0.0) -> Float[Array, "... H"]:
    """RMSNorm over the last axis with a learned scale, normalised in float32.

    Flax's `nnx.RMSNorm` (and so the layer's QK-norm) multiplies by the scale
    in float32 and casts the product; Hugging Face's Llama family casts the
    normalised values to `x`'s dtype first, then multiplies in that dtype
    (`scale_after_cast=True`, what `kvattn.models` loads must match). The two
    orders agree exactly in float32 and differ by rounding below it. Gemma
    multiplies by `offset + scale` (`offset=1`: its weights are stored as
    their difference from one), the sum taken in float32.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if scale_after_cast:
        if offset:
            raise ValueError("rms_norm takes an offset only when it scales in float32 (scale_after_cast=False)")
        return normed.astype(x.dtype) * along_last(scale, x)
    scale = scale.astype(jnp.float32)
    if offset:
        scale = scale + jnp.float32(offset)
    return (normed * along_last(scale, x)).astype(x.dtype)


def along_last(vector: Shaped[Array, " F"], x: Shaped[Array, "... F"]) -> Shaped[Array, "..."]:
    """A per-feature `vector` `(F,)` shaped to broadcast against `x` `(..., F)` (rank promotion is off)."""
    return vector.reshape((1,) * (x.ndim - 1) + vector.shape)
