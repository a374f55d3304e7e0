"""Rotary position embedding: its frequencies and the rotation itself.

Its settings, `kvattn.rotary.RoPE`, are a frozen, hashable setting that takes a Hugging Face
`rope_scaling` dict as it appears in `config.json`, so a checkpoint's
settings pass straight in. The frequencies are computed once on the host
(float64, then float32); the rotation is a pure function of queries or keys
`(B, T, heads, H)` and their absolute positions `(B, T)`.

Two pairings of the rotated dimensions exist:
  - rotate-half (Hugging Face Llama, GPT-NeoX): dimension i pairs with
    i + R/2, for i < R/2 (R = `rotary_dim`);
  - interleaved (GPT-J, the original Meta code): dimension 2i pairs with 2i + 1.
Pair i turns by the angle `position * inv_freq[i]`; dimensions past
`rotary_dim` are left as they are.

longrope (Phi-3) has two sets of frequencies, a short and a long one; the
settings (`RoPE.long`) name the one that turns every position.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvattn.rotary import RoPE

__all__ = ["apply_rope", "rope_tables"]


def _inverse_frequencies(rope: RoPE, rotary_dim: int) -> tuple[np.ndarray, float]:
    """`inv_freq` `(rotary_dim / 2,)` after scaling, and the factor cos and sin are multiplied by."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / rope.theta**exponents
    scaling = rope.scaling_dict or {"rope_type": "default"}
    kind = scaling["rope_type"]
    if kind == "longrope":
        return _longrope(inv_freq, scaling, bool(rope.long))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
        blend = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
        return (1 - blend) * inv_freq / factor + blend * inv_freq, 1.0
    if kind == "yarn":
        return _yarn(rope.theta, rotary_dim, scaling)
    return inv_freq, 1.0


def _yarn(theta: float, rotary_dim: int, scaling: dict) -> tuple[np.ndarray, float]:
    """YaRN: per-frequency blend of interpolation and extrapolation, plus an attention temperature."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]

    def magnitude(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = magnitude(factor, mscale) / magnitude(factor, mscale_all_dim)
        else:
            attention_factor = magnitude(factor)

    def correction_dim(rotations):
        return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast", 32.0)), correction_dim(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    keep = 1.0 - ramp  # 1: extrapolate (keep the frequency); 0: interpolate by `factor`
    return extrapolated / factor * (1 - keep) + extrapolated * keep, float(attention_factor)


def _longrope(inv_freq: np.ndarray, scaling: dict, long: bool) -> tuple[np.ndarray, float]:
    """longrope: each pair's frequency divided by its short or long factor; transformers' attention factor."""
    factors = np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"longrope needs one factor per rotated pair ({inv_freq.shape[0]}), got {factors.shape[0]}")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor, original = scaling.get("factor", 1.0), scaling["original_max_position_embeddings"]
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / factors, float(attention_factor)


def rope_tables(rope: RoPE, head_dim: int) -> tuple[np.ndarray, float, int]:
    """`(inv_freq, attention_factor, rotary_dim)` for one head width; host constants."""
    rotary_dim = rope.rotated_dims(head_dim)
    inv_freq, attention_factor = _inverse_frequencies(rope, rotary_dim)
    return inv_freq.astype(np.float32), attention_factor, rotary_dim


def apply_rope(
    x: Float[Array, "B T heads H"], positions: Int[Array, "B T"], rope: RoPE
) -> Float[Array, "B T heads H"]:
    """Rotates queries or keys by their absolute positions (float32 angles, result in `x`'s dtype)."""
    head_dim = x.shape[-1]
    inv_freq, attention_factor, rotary_dim = rope_tables(rope, head_dim)
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # B T R/2
    cos = (jnp.cos(angles) * attention_factor)[:, :, None, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, :, None, None, :]
    rotated = x[..., :rotary_dim].astype(jnp.float32)
    # Each pair as an axis of 2, so a rotation is x * cos + flip(x) * (-sin, sin), bit for bit what the halves
    # joined by a concatenate give; XLA:CPU fuses the flip without the branch per element it gives a concatenate,
    # several times faster.
    pair_axis = -1 if rope.interleaved else -2
    pairs = rotated.reshape(*x.shape[:-1], *((rotary_dim // 2, 2) if rope.interleaved else (2, rotary_dim // 2)))
    if rope.interleaved:
        cos, sin = jnp.swapaxes(cos, -1, -2), jnp.swapaxes(sin, -1, -2)
    signed_sin = jnp.concatenate([-sin, sin], axis=pair_axis)
    # cos joined to itself along the pair axis, as sin is: a concatenate XLA:CPU computes once, for every head and
    # layer, where a cos broadcast straight into the rotation is evaluated again for every head, a loop several
    # times slower. The same products, so the same bits.
    both_cos = jnp.concatenate([cos, cos], axis=pair_axis)
    turned = (pairs * both_cos + jnp.flip(pairs, axis=pair_axis) * signed_sin).reshape(rotated.shape).astype(x.dtype)
    return turned if rotary_dim == head_dim else jnp.concatenate([turned, x[..., rotary_dim:]], axis=-1)
