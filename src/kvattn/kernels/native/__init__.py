"""kvattn's native kernels for XLA:CPU, called from jitted programs through XLA's FFI.

- `int8_dot` (`int8_dot.cc`): the int8 dot of `kvattn.math.quant`, int8 rows by
  int8 weights laid out once in AVX512-VNNI's tile order, into exact int32.
- `f32_dot` (`f32_dot.cc`): the float32 dot of `kvattn.math.quant`'s panel
  kernels, rows by weights laid out once as contiguous panels of 16 outputs.
- `decode_attention` (`decode_attention.cc`): one query per sequence and
  head over a contiguous float32 heads-major cache, unnormalised with its
  residuals, as `kvattn.kernels.contiguous_step` takes jax's Pallas GPU
  kernel's.
- `prefill_attention` (`prefill_attention.cc`): a chunk of new tokens over
  a contiguous float32 heads-major cache and causally over themselves,
  `kvattn.math.ops.attention` without a window or a soft-cap.

They are compiled with the package (`setup.py`) where a C++ compiler is
found, and each is used only where it can run: the extension is present,
the CPU has the instructions that kernel uses (AVX512F; the int8 dot also
AVX512BW and AVX512-VNNI), and JAX accepted its FFI target and got its
result on a small input through it (`available`). Everywhere else XLA runs
what it would. Every wrapper checks its operands' shapes and dtypes before
they reach the FFI handler, and registers its kernel first, or says why it
cannot run here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8, Int32, UInt8

from kvattn.math import ops

__all__ = [
    "DECODE_ATTENTION", "F32_DOT", "INT8_DOT", "KERNELS", "PREFILL_ATTENTION", "available", "decode_attention",
    "f32_dot", "f32_dot_on_xla", "int8_dot", "prefill_attention",
]

# The FFI targets' names, registered for the CPU platform on first use.
INT8_DOT = "kvattn_int8_dot"
F32_DOT = "kvattn_f32_dot"
DECODE_ATTENTION = "kvattn_decode_attention"
PREFILL_ATTENTION = "kvattn_prefill_attention"


KERNELS = (INT8_DOT, F32_DOT, DECODE_ATTENTION, PREFILL_ATTENTION)


@functools.cache
def _registered() -> frozenset[str]:
    """The kernels this CPU can run, registered with JAX; empty where the extension is not built."""
    try:
        from kvattn.kernels.native import compiled  # the extension setup.py builds
    except ImportError:
        return frozenset()
    supported = compiled.supported()
    runs = frozenset(name for name in KERNELS if supported[name.removeprefix("kvattn_")])
    for name in runs:
        jax.ffi.register_ffi_target(name, getattr(compiled, name.removeprefix("kvattn_"))(), platform="cpu")
    return runs


@functools.cache
def available(kernel: str | None = None) -> bool:
    """Whether `kernel` (one of `KERNELS`; None: every one) is built, can run on this CPU, and works through JAX.

    A small input through the compiled call, against NumPy's answer, checks
    each: an FFI mismatch between the jaxlib the extension was built against
    and this one fails here rather than in a model's program.
    """
    if kernel is None:
        return all(available(name) for name in KERNELS)
    if kernel not in KERNELS:
        raise ValueError(f"kvattn.kernels.native.available takes one of {KERNELS} or None, got {kernel!r}")
    if kernel not in _registered():
        return False
    try:
        with jax.ensure_compile_time_eval():
            return _SELF_TESTS[kernel](np.random.default_rng(0))
    except Exception:  # noqa: BLE001 - any failure (an FFI mismatch included): XLA's path instead
        return False


def _int8_dot_works(rng) -> bool:
    from kvattn.math import quant

    rows = rng.integers(-128, 128, (3, 8), dtype=np.int8)
    values = rng.integers(-127, 128, (16, 8), dtype=np.int8)
    got = np.asarray(jax.jit(_int8_call)(rows, quant.tile(quant.Int8Kernel(values, None)).tiles))
    return bool((got == rows.astype(np.int32) @ values.astype(np.int32).T).all())


def _f32_dot_works(rng) -> bool:
    rows, kernel = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    got = np.asarray(jax.jit(_f32_call)(rows, kernel.reshape(8, 1, 16).transpose(1, 0, 2)))
    return bool(np.allclose(got, rows.astype(np.float64) @ kernel, rtol=1e-5, atol=1e-5))


def _decode_attention_works(rng) -> bool:
    q, k_cache, v_cache = rng.standard_normal((3, 1, 1, 3, 16)).astype(np.float32)
    visible = np.array([3], np.int32)
    got = jax.jit(_decode_call)(q[:, :, :1], k_cache, v_cache, visible)
    want = _decode_sums(*(jnp.asarray(x) for x in (q[:, :, :1], k_cache, v_cache, visible)))
    return all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want, strict=True))


def _prefill_attention_works(rng) -> bool:
    q, k_new, v_new = rng.standard_normal((3, 1, 2, 1, 16)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 1, 1, 3, 16)).astype(np.float32)
    arrays = (q, k_new, v_new, k_cache, v_cache, np.array([2], np.int32), np.array([2], np.int32))
    got = jax.jit(_prefill_call)(*arrays)
    return bool(np.allclose(got, _chunk_on_xla(*(jnp.asarray(x) for x in arrays)), rtol=1e-5, atol=1e-5))


_SELF_TESTS = {
    INT8_DOT: _int8_dot_works, F32_DOT: _f32_dot_works, DECODE_ATTENTION: _decode_attention_works,
    PREFILL_ATTENTION: _prefill_attention_works,
}


def _ready(kernel: str, caller: str):
    """Registers `kernel` (through `available`), or raises saying why `caller` cannot run here."""
    if not available(kernel):
        raise RuntimeError(
            f"kvattn.kernels.native.{caller} cannot run here: its kernel is not built, this CPU lacks the instructions it "
            f"uses, or it failed its check through JAX (kvattn.kernels.native.available({kernel!r}) is False); use its XLA "
            "twin, or let kvattn.kernels and kvattn.math.quant choose"
        )


def _expect(condition: bool, caller: str, expected: str, *operands):
    """Raises a ValueError naming `expected` and the shapes and dtypes `caller` got, unless `condition`."""
    if not condition:
        got = ", ".join(f"{jnp.dtype(x.dtype).name}{tuple(x.shape)}" for x in operands)
        raise ValueError(f"kvattn.kernels.native.{caller} expects {expected}; got {got}")


def _expect_dtype(caller: str, dtype, **operands):
    """Raises a TypeError naming the first operand whose dtype is not `dtype`."""
    for name, x in operands.items():
        if jnp.dtype(x.dtype) != jnp.dtype(dtype):
            raise TypeError(f"kvattn.kernels.native.{caller}: {name} must be {jnp.dtype(dtype)}, got {jnp.dtype(x.dtype)}")


def int8_dot(
    rows: Int8[Array, "M D"] | Int8[np.ndarray, "M D"],
    tiles: UInt8[Array, "Nt Dg 16 4"] | UInt8[np.ndarray, "Nt Dg 16 4"],
) -> Int32[Array, "M N"]:
    """`rows @ values.T` in exact int32, for the int8 `values (N, D)` that `tiles` lays out (`kvattn.math.quant.tile`).

    Lowers to the native kernel's FFI call, so only for the CPU and only when
    `available(INT8_DOT)`. Under `vmap` it runs once per batch element.

    Raises:
      TypeError: rows not int8 or tiles not uint8.
      ValueError: shapes other than rows `(M, D)` and tiles `(D / 4 groups)`.
      RuntimeError: the kernel cannot run here.
    """
    _expect_dtype("int8_dot", jnp.int8, rows=rows)
    _expect_dtype("int8_dot", jnp.uint8, tiles=tiles)
    _expect(rows.ndim == 2 and tiles.ndim == 4 and tiles.shape[2:] == (16, 4) and rows.shape[1] == 4 * tiles.shape[1],
            "int8_dot", "rows (M, D) and tiles (N / 16, D / 4, 16, 4)", rows, tiles)
    _ready(INT8_DOT, "int8_dot")
    return _int8_call(rows, tiles)


def f32_dot(
    rows: Float[Array, "M D"] | Float[np.ndarray, "M D"],
    panels: Float[Array, "Np D 16"] | Float[np.ndarray, "Np D 16"],
) -> Float[Array, "M N"]:
    """`rows @ kernel` in float32, for the kernel `(D, N)` that `panels` lays out (`kvattn.math.quant.panel`).

    Each output is one float32 sum over `D` in order, so a row's result does
    not depend on the other rows. CPU only, when `available()`; under `vmap`
    it runs once per batch element. Differentiable: its derivatives are
    those of `rows @ kernel` in `jax.numpy`.

    Raises:
      TypeError: operands not float32.
      ValueError: shapes other than rows `(M, D)` and panels `(N / 16, D, 16)`.
      RuntimeError: the kernel cannot run here.
    """
    _expect_dtype("f32_dot", jnp.float32, rows=rows, panels=panels)
    _expect(rows.ndim == 2 and panels.ndim == 3 and panels.shape[2] == 16 and rows.shape[1] == panels.shape[1],
            "f32_dot", "rows (M, D) and panels (N / 16, D, 16)", rows, panels)
    _ready(F32_DOT, "f32_dot")
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
    the same sums in `jax.numpy`. A NaN or inf among the visible scores
    spreads as in a float64 softmax: `top` NaN or +inf, `o` and `total` NaN.

    Raises:
      TypeError: q or the caches not float32, or visible not int32.
      ValueError: shapes other than those above.
      RuntimeError: the kernel cannot run here.
    """
    _expect_dtype("decode_attention", jnp.float32, q=q, k_cache=k_cache, v_cache=v_cache)
    _expect_dtype("decode_attention", jnp.int32, visible=visible)
    batch, kv_heads, _, head_dim = q.shape if q.ndim == 4 else (None,) * 4
    _expect(q.ndim == 4 and head_dim % 16 == 0 and k_cache.shape == v_cache.shape and k_cache.ndim == 4
            and (k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]) == (batch, kv_heads, head_dim)
            and visible.shape == (batch,),
            "decode_attention", "q (B, K, G, H) with H a multiple of 16, caches (B, K, S, H), visible (B,)",
            q, k_cache, v_cache, visible)
    _ready(DECODE_ATTENTION, "decode_attention")
    return _decode_call(q, k_cache, v_cache, visible)


def prefill_attention(
    q: Float[Array, "B T N H"], k_new: Float[Array, "B T K H"], v_new: Float[Array, "B T K H"],
    k_cache: Float[Array, "B K S H"], v_cache: Float[Array, "B K S H"], cache_len: Int32[Array, " B"],
    new_len: Int32[Array, " B"],
) -> Float[Array, "B T N H"]:
    """`kvattn.math.ops.attention` over heads-major caches, without a window or a soft-cap, in one native pass.

    New token `t < new_len[b]` of query head `n` (kv head `n // (N // K)`)
    sees slots `0 .. cache_len[b] - 1` and new tokens `0 .. t`; later
    queries are padding and get zeros. Queries unscaled, as `kvattn.math.ops`
    takes them. `H` must be a multiple of 16. CPU only, when `available()`;
    under `vmap` it runs once per batch element. Differentiable: its
    derivatives are `kvattn.math.ops.attention`'s. A NaN or inf spreads as in a
    float64 softmax: to the queries that see it, never to earlier ones.

    Raises:
      TypeError: queries, keys, values or caches not float32, or lengths not int32.
      ValueError: shapes other than those above (`K` dividing `N`).
      RuntimeError: the kernel cannot run here.
    """
    caller = "prefill_attention"
    _expect_dtype(caller, jnp.float32, q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)
    _expect_dtype(caller, jnp.int32, cache_len=cache_len, new_len=new_len)
    batch, num_new, heads, head_dim = q.shape if q.ndim == 4 else (None,) * 4
    kv_heads = k_new.shape[2] if k_new.ndim == 4 else 0
    _expect(q.ndim == 4 and head_dim % 16 == 0 and k_new.shape == v_new.shape == (batch, num_new, kv_heads, head_dim)
            and kv_heads and heads % kv_heads == 0 and k_cache.shape == v_cache.shape and k_cache.ndim == 4
            and (k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]) == (batch, kv_heads, head_dim)
            and cache_len.shape == new_len.shape == (batch,), caller,
            "q (B, T, N, H) with H a multiple of 16, new keys and values (B, T, K, H) with K dividing N, caches "
            "(B, K, S, H), lengths (B,)", q, k_new, v_new, k_cache, v_cache, cache_len, new_len)
    _ready(PREFILL_ATTENTION, caller)
    return _prefill_call(q, k_new, v_new, k_cache, v_cache, cache_len, new_len)


# An FFI call has no derivatives of its own: each kernel takes those of its XLA twin (`kvattn.math.ops.attention`
# for a chunk; for a step, the same unnormalised sums in jax.numpy, which kvattn.math.ops never forms; for the
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
    # Shifted by top whenever a slot is visible, so a top of NaN, +inf or -inf makes the weights NaN, as in the
    # kernel and a float64 softmax; unseen values are selected away, since 0 * NaN would be NaN.
    shift = jnp.where(visible[:, None, None] > 0, top, 0.0)
    weights = jnp.where(seen, jnp.exp(scores - shift[..., None]), 0.0)
    values = jnp.where(jnp.swapaxes(seen, 2, 3), v_cache, 0.0)
    return jnp.einsum("bkgs,bksh->bkgh", weights, values), jnp.sum(weights, axis=-1), top


def _chunk_on_xla(q, k_new, v_new, k_cache, v_cache, cache_len, new_len):
    return ops.attention(q, k_new, v_new, new_len, k_cache, v_cache, cache_len, ops.HEADS_MAJOR)


def f32_dot_on_xla(rows: Float[Array, "M D"], panels: Float[Array, "Np D 16"]) -> Float[Array, "M N"]:
    """What `f32_dot` computes, as XLA's dot of the kernel the panels lay out: it runs on any backend, and its
    derivatives are `f32_dot`'s."""
    return rows @ jnp.transpose(panels, (1, 0, 2)).reshape(panels.shape[1], -1)


def _int8_call(rows, tiles):
    out = jax.ShapeDtypeStruct((rows.shape[0], tiles.shape[0] * tiles.shape[2]), jnp.int32)
    return jax.ffi.ffi_call(INT8_DOT, out, vmap_method="sequential")(rows, tiles)


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
