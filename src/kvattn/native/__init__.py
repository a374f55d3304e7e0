"""kvattn's native kernels for XLA:CPU, called from jitted programs through XLA's FFI.

One kernel so far: the int8 dot of `kvattn.quant` (`int8_dot.cc`), int8 rows
by int8 weights laid out once in AVX512-VNNI's tile order, into exact int32.
It is compiled with the package (`setup.py`) where a C++ compiler is found,
and used only where it can run: its extension is present, the CPU has
AVX512-VNNI, and JAX accepted its FFI target and got the exact products of a
small check through it. Everywhere else `available()` is False and
`kvattn.quant` keeps XLA's own int8 dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int8, Int32, UInt8

__all__ = ["INT8_DOT", "available", "int8_dot"]

# The FFI target's name, registered for the CPU platform on first use.
INT8_DOT = "kvattn_int8_dot"


@functools.cache
def available() -> bool:
    """Whether the native int8 dot is built, can run on this CPU, and is registered with JAX."""
    try:
        from kvattn.native import compiled  # the extension setup.py builds
    except ImportError:
        return False
    if not compiled.supported():
        return False
    jax.ffi.register_ffi_target(INT8_DOT, compiled.int8_dot(), platform="cpu")
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
