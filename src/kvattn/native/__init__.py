"""kvattn's native kernels for XLA:CPU, called from jitted programs through XLA's FFI.

- `int8_dot` (`int8_dot.cc`): the int8 dot of `kvattn.quant`, int8 rows by
  int8 weights laid out once in AVX512-VNNI's tile order, into exact int32.
- `f32_dot` (`f32_dot.cc`): the float32 dot of `kvattn.quant`'s panel
  kernels, rows by weights laid out once as contiguous panels of 16 outputs.
- `decode_attention` (`decode_attention.cc`): one query per sequence and
  head over a contiguous float32 heads-major cache, unnormalised with its
  residuals, as `kvattn.kernels.contiguous_step` takes jax's Pallas GPU
  kernel's.
- `prefill_attention` (`prefill_attention.cc`): a chunk of new tokens over
  a contiguous float32 heads-major cache and causally over themselves,
  `kvattn.ops.attention` without a window or a soft-cap.

They are compiled with the package (`setup.py`) where a C++ compiler is
found, and used only where they can run: the extension is present, the CPU
has AVX512-VNNI, and JAX accepted the FFI targets and got the exact products
of a small int8 dot through them. Everywhere else `available()` is False and
XLA runs what they would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8, Int32, UInt8

from kvattn import ops

__all__ = [
    "DECODE_ATTENTION", "F32_DOT", "INT8_DOT", "PREFILL_ATTENTION", "available", "decode_attention", "f32_dot",
    "f32_dot_on_xla", "int8_dot", "prefill_attention",
]

# The FFI targets' names, registered for the CPU platform on first use.
INT8_DOT = "kvattn_int8_dot"
F32_DOT = "kvattn_f32_dot"
DECODE_ATTENTION = "kvattn_decode_attention"
PREFILL_ATTENTION = "kvattn_prefill_attention"


@functools.cache
def available() -> bool:
    """Whether the native kernels are built, can run on this CPU, and are registered with JAX."""
    try:
        from kvattn.native import compiled  # the extension setup.py builds
    except ImportError:
        return False
    if not compiled.supported():
        return False
    jax.ffi.register_ffi_target(INT8_DOT, compiled.int8_dot(), platform="cpu")
    jax.ffi.register_ffi_target(F32_DOT, compiled.f32_dot(), platform="cpu")
    jax.ffi.register_ffi_target(DECODE_ATTENTION, compiled.decode_attention(), platform="cpu")
    jax.ffi.register_ffi_target(PREFILL_ATTENTION, compiled.prefill_attention(), platform="cpu")
    # A small product through the compiled call, against NumPy's: an FFI mismatch between the jaxlib the
    # extension was built against and this one fails here rather than in a model's program.
    from kvattn import quant  # which imports this module

    rng = np.random.default_rng(0)
    rows = rng.integers(-128, 128, (3, 8), dtype=np.int8)
    values = rng.integers(-127, 128, (16, 8), dtype=np.int8)
    tiles = quant.tile(quant.Int8Kernel(values, None)).tiles
    try:
        with jax.ensure_compile_time_eval():
            got = np.asarray(jax.jit(int8_dot)(rows, tiles))
    except Exception:  # any failure: XLA's int8 dot instead
        return False
    return bool((got == rows.astype(np.int32) @ values.astype(np.int32).T).all())


def int8_dot(
    rows: Int8[Array, "M D"] | Int8[np.ndarray, "M D"],
    tiles: UInt8[Array, "Nt Dg 16 4"] | UInt8[np.ndarray, "Nt Dg 16 4"],
) -> Int32[Array, "M N"]:
    """`rows @ values.T` in exact int32, for the int8 `values (N, D)` that `tiles` lays out (`kvattn.quant.tile`).

    Lowers to the native kernel's FFI call, so only for the CPU and only when
    `available()`. Under `vmap` it runs once per batch element.
    """
    out = jax.ShapeDtypeStruct((rows.shape[0], tiles.shape[0] * tiles.shape[2]), jnp.int32)
    return jax.ffi.ffi_call(INT8_DOT, out, vmap_method="sequential")(rows, tiles)


def f32_dot(
    rows: Float[Array, "M D"] | Float[np.ndarray, "M D"],
    panels: Float[Array, "Np D 16"] | Float[np.ndarray, "Np D 16"],
) -> Float[Array, "M N"]:
    """`rows @ kernel` in float32, for the kernel `(D, N)` that `panels` lays out (`kvattn.quant.panel`).

    Each output is one float32 sum over `D` in order, so a row's result does
    not depend on the other rows. CPU only, when `available()`; under `vmap`
    it runs once per batch element. Differentiable: its derivatives are
    those of `rows @ kernel` in `jax.numpy`.
    """
    return _f32_call(rows, panels)


def decode_attention(
    q: Float[Array, "B K G H"], k_cache: Float[Array, "B K S H"], v_cache: Float[Array, "B K S H"],
    visible: Int32[Array, " B"],
) -> tuple[Float[Array, "B K G H"], Float[Array, "B K G"], Float[Array, "B K G"]]:
    """Each query `(B, K, G, H)` over slots `0 .. visible[b] - 1` of heads-major caches: `(o, total, top)`.

    `o` is `sum_s exp(score_s - top) v_s` with `score_s = q . k_s` (the
    caller scales `q`), `total` the sum of those weights and `top` the largest
    score: unnormalised, -inf and zeros where nothing is visible. `H` must
    be a multiple of 16. CPU only, when `available()`; under `vmap` it runs
    once per batch element. Differentiable: its derivatives are those of
    the same sums in `jax.numpy`.
    """
    return _decode_call(q, k_cache, v_cache, visible)


def prefill_attention(
    q: Float[Array, "B T N H"], k_new: Float[Array, "B T K H"], v_new: Float[Array, "B T K H"],
    k_cache: Float[Array, "B K S H"], v_cache: Float[Array, "B K S H"], cache_len: Int32[Array, " B"],
    new_len: Int32[Array, " B"],
) -> Float[Array, "B T N H"]:
    """`kvattn.ops.attention` over heads-major caches, without a window or a soft-cap, in one native pass.

    New token `t < new_len[b]` of query head `n` (kv head `n // (N // K)`)
    sees slots `0 .. cache_len[b] - 1` and new tokens `0 .. t`; later
    queries are padding and get zeros. Queries unscaled, as `kvattn.ops`
    takes them. `H` must be a multiple of 16. CPU only, when `available()`;
    under `vmap` it runs once per batch element. Differentiable: its
    derivatives are `kvattn.ops.attention`'s.
    """
    return _prefill_call(q, k_new, v_new, k_cache, v_cache, cache_len, new_len)


# An FFI call has no derivatives of its own: each kernel takes those of its XLA twin (`kvattn.ops.attention`
# for a chunk; for a step, the same unnormalised sums in jax.numpy, which kvattn.ops never forms; for the
# float32 dot, the dot of the kernel the panels lay out), so a cached layer or a model differentiates on the
# native path as on XLA's.


def _derivatives_of(twin):
    """A `jax.custom_jvp` of the decorated kernel call whose derivatives are `twin`'s."""

    def wrap(kernel):
        call = jax.custom_jvp(kernel)
        call.defjvp(lambda primals, tangents: jax.jvp(twin, primals, tangents))
        return call

    return wrap


def _decode_sums(q, k_cache, v_cache, visible):
    seen = jnp.arange(k_cache.shape[2])[None, None, None, :] < visible[:, None, None, None]
    scores = jnp.where(seen, jnp.einsum("bkgh,bksh->bkgs", q, k_cache), -jnp.inf)
    top = jnp.max(scores, axis=-1)
    weights = jnp.where(seen, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)[..., None]), 0.0)
    return jnp.einsum("bkgs,bksh->bkgh", weights, v_cache), jnp.sum(weights, axis=-1), top


def _chunk_on_xla(q, k_new, v_new, k_cache, v_cache, cache_len, new_len):
    return ops.attention(q, k_new, v_new, new_len, k_cache, v_cache, cache_len, ops.HEADS_MAJOR)


def f32_dot_on_xla(rows: Float[Array, "M D"], panels: Float[Array, "Np D 16"]) -> Float[Array, "M N"]:
    """What `f32_dot` computes, as XLA's dot of the kernel the panels lay out: it runs on any backend, and its
    derivatives are `f32_dot`'s."""
    return rows @ jnp.transpose(panels, (1, 0, 2)).reshape(panels.shape[1], -1)


@_derivatives_of(f32_dot_on_xla)
def _f32_call(rows, panels):
    out = jax.ShapeDtypeStruct((rows.shape[0], panels.shape[0] * panels.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(F32_DOT, out, vmap_method="sequential")(rows, panels)


@_derivatives_of(_decode_sums)
def _decode_call(q, k_cache, v_cache, visible):
    batch, heads, group, _ = q.shape
    residual = jax.ShapeDtypeStruct((batch, heads, group), jnp.float32)
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), residual, residual)
    return jax.ffi.ffi_call(DECODE_ATTENTION, out, vmap_method="sequential")(q, k_cache, v_cache, visible)


@_derivatives_of(_chunk_on_xla)
def _prefill_call(q, k_new, v_new, k_cache, v_cache, cache_len, new_len):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(PREFILL_ATTENTION, out, vmap_method="sequential")(
        q, k_new, v_new, k_cache, v_cache, cache_len, new_len
    )
