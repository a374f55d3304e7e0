"""kvattn's native kernels for XLA:CPU, called from jitted programs through XLA's FFI.

- `int8_dot` (`int8_dot.cc`): the int8 dot of `kvattn.kernels.dots`, int8
  rows by int8 weights laid out once in AVX512-VNNI's tile order
  (`kvattn.math.quant.tile`), into exact int32; on AVX512-VNNI, else on
  AVX2 (the same bits).
- `int8_dense` (`int8_dot.cc`): the whole int8 dense of `kvattn.kernels.dots`
  in one call: float32 rows quantized per row (`kvattn.math.quant.quantize_rows`),
  the same dot, each sum scaled back by its row's and its output's scale.
- `int4_dot` (`int4_dot.cc`): the 4-bit dot of `kvattn.kernels.dots`, int8
  rows by 4-bit weights with a bfloat16 scale per group of inputs
  (`kvattn.math.int4`, as an output's blocks one after another or tiled
  eight outputs side by side), each group's sum exact in int32, scaled and
  summed in float32 (AVX2).
- `f32_dot` (`f32_dot.cc`): the float32 dot of panel kernels, rows by
  weights laid out once as contiguous panels of 16 outputs
  (`kvattn.math.quant.panel`); on AVX-512, else on AVX2 and FMA (the
  same bits).
- `bf16_dot` (`f32_dot.cc`): the same dot over panels stored in bfloat16,
  each weight widened exactly to float32 in register: the float32 dot of
  those values at half the bytes, the rows kept in float32.
- `decode_attention` (`decode_attention.cc`): one query per sequence and
  head over a contiguous float32 heads-major cache, unnormalised with its
  residuals, as jax's Pallas GPU decode kernel returns them.
- `paged_decode_attention` (`decode_attention.cc`): the same sums over a
  paged float32 pool `(P, K, page, H)`, read page by page through each
  sequence's page table where the pages lie (XLA's path gathers them into
  a view first).
- `paged_prefill_attention` (`prefill_attention.cc`): `prefill_attention`
  with the cached keys and values read from a paged float32 pool.
- `read_max` (`read_max.cc`): each row's maximum of a float32 matrix, a
  pure streaming read: the benchmarks' bandwidth limit (AVX-512 or AVX2).
- `prefill_attention` (`prefill_attention.cc`): a chunk of new tokens over
  a contiguous float32 heads-major cache and causally over themselves,
  `kvattn.math.ops.attention` without a window or a soft-cap.

`KERNELS` lists them once, each with its checked wrapper, its XLA twin (the
same function in `jax.numpy`, on any backend, agreeing on every input, NaN
and inf included), the CPU features it uses and a small example input. From
that table follow: registration with XLA (only where the extension is
built, the CPU has that kernel's features, and the kernel agrees with its
twin on its example through JAX: `available`), the FFI call's output shapes
(the twin's), and derivatives (the twin's, through `jax.custom_jvp`). The
route (`kvattn.kernels.route`) uses a kernel only where it is available;
everywhere else XLA runs the twin. Every wrapper checks its operands'
shapes and dtypes before they reach the FFI handler, and registers its
kernel first, or says why it cannot run here.

A new kernel is its `.cc` file (which registers itself, `native.h`), its
wrapper, twin and example here with one `Kernel` entry in `KERNELS`, and
its lines in the shared harness (`tests/kernels/test_native.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, BFloat16, Float, Int8, Int32, Shaped, UInt8

from kvattn.math import int4, ops, quant

__all__ = [
    "BF16_DOT",
    "DECODE_ATTENTION",
    "F32_DOT",
    "INT4_DOT",
    "INT8_DOT",
    "KERNELS",
    "PAGED_DECODE_ATTENTION",
    "PAGED_PREFILL_ATTENTION",
    "PREFILL_ATTENTION",
    "READ_MAX",
    "Kernel",
    "available",
    "bf16_dot",
    "bf16_dot_on_xla",
    "decode_attention",
    "decode_attention_on_xla",
    "f32_dot",
    "f32_dot_on_xla",
    "int4_dot",
    "int4_dot_on_xla",
    "int8_dense",
    "int8_dense_on_xla",
    "int8_dot",
    "int8_dot_on_xla",
    "kernel",
    "paged_decode_attention",
    "paged_decode_attention_on_xla",
    "paged_prefill_attention",
    "paged_prefill_attention_on_xla",
    "prefill_attention",
    "prefill_attention_on_xla",
    "read_max",
    "read_max_on_xla",
    "unavailable_reason",
]

# The FFI targets' names ("kvattn_" and the kernel's name), registered for the CPU platform on first use.
INT8_DOT = "kvattn_int8_dot"
INT8_DENSE = "kvattn_int8_dense"
INT4_DOT = "kvattn_int4_dot"
F32_DOT = "kvattn_f32_dot"
BF16_DOT = "kvattn_bf16_dot"
DECODE_ATTENTION = "kvattn_decode_attention"
PAGED_DECODE_ATTENTION = "kvattn_paged_decode_attention"
PAGED_PREFILL_ATTENTION = "kvattn_paged_prefill_attention"
PREFILL_ATTENTION = "kvattn_prefill_attention"
READ_MAX = "kvattn_read_max"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One native kernel: what the registration, the self-test, the derivatives and the harness read.

    Attributes:
      name: the kernel's name in the compiled module (its `.cc`'s `KVATTN_KERNEL`); its FFI target is
        `"kvattn_" + name`.
      wrapper: the public, checked function (`int8_dot`, ...).
      twin: the same function in `jax.numpy`, on any backend: the kernel's outputs' shapes and dtypes, its
        derivatives, and the answer it must agree with.
      features: the CPU features (`compiled.cpu_features()` names) the kernel's instructions need.
      example: `rng -> arguments`, a small valid input; the self-test runs the kernel on it against the twin.
      differentiable: whether its derivatives are the twin's (an integer dot has none).
      tolerance: how far the kernel may stray from the twin (0: bit for bit).
    """

    name: str
    wrapper: Callable
    twin: Callable
    features: tuple[str, ...]
    example: Callable[[np.random.Generator], tuple]
    differentiable: bool = True
    tolerance: float = 1e-5

    @property
    def target(self) -> str:
        return "kvattn_" + self.name


def kernel(target: str) -> Kernel:
    """The entry of `KERNELS` whose FFI target is `target` (`INT8_DOT`, ...)."""
    for entry in KERNELS:
        if entry.target == target:
            return entry
    raise ValueError(f"kvattn.kernels.native takes one of {[k.target for k in KERNELS]}, got {target!r}")


@functools.cache
def _compiled() -> tuple[dict | None, dict]:
    """The compiled module's handlers (None where the extension is not built) and this CPU's features."""
    try:
        from kvattn.kernels.native import compiled  # the extension setup.py builds
    except ImportError:
        return None, {}
    return compiled.handlers(), compiled.cpu_features()


@functools.cache
def unavailable_reason(target: str) -> str | None:
    """Why the kernel `target` cannot run here, or None: it is then registered with XLA and passed its self-test.

    The self-test runs the kernel's example through a jitted FFI call
    against its twin: an FFI mismatch between the jaxlib the extension was
    built against and this one fails here rather than in a model's program.
    """
    entry = kernel(target)
    handlers, features = _compiled()
    if handlers is None:
        return "the native extension is not built (no C++ compiler at install, or another platform)"
    if entry.name not in handlers:
        return f"the native extension has no {entry.name!r}: it compiles the kernels for x86-64 only (or rebuild it)"
    lacking = [feature for feature in entry.features if not features.get(feature)]
    if lacking:
        return f"this CPU lacks {', '.join(lacking)}"
    try:
        jax.ffi.register_ffi_target(entry.target, handlers[entry.name], platform="cpu")
        with jax.ensure_compile_time_eval():
            arguments = entry.example(np.random.default_rng(0))
            got = jax.tree.leaves(jax.jit(_call(target))(*arguments))
            want = jax.tree.leaves(jax.jit(entry.twin)(*arguments))
        agree = all(np.allclose(a, b, rtol=entry.tolerance, atol=entry.tolerance) for a, b in zip(got, want, strict=True))
    except Exception as error:  # noqa: BLE001 - any failure (an FFI mismatch included): XLA's path instead
        return f"it failed its self-test through JAX ({type(error).__name__}: {error})"
    return None if agree else "it disagreed with its XLA twin in its self-test"


def available(target: str | None = None) -> bool:
    """Whether the kernel `target` (`INT8_DOT`, ...; None: every one) is built, runs on this CPU, and works through JAX.

    See `unavailable_reason`.
    """
    if target is None:
        return all(available(entry.target) for entry in KERNELS)
    return unavailable_reason(target) is None


@functools.cache
def _call(target: str):
    """The kernel's FFI call: its outputs shaped as its twin's; differentiable as its twin."""
    entry = kernel(target)

    def call(*arguments):
        shapes = jax.eval_shape(entry.twin, *arguments)
        got = jax.ffi.ffi_call(target, shapes, vmap_method="sequential")(*arguments)
        return tuple(got) if isinstance(shapes, tuple) else got

    if not entry.differentiable:
        return call
    call = jax.custom_jvp(call)
    call.defjvp(lambda primals, tangents: jax.jvp(entry.twin, primals, tangents))
    return call


def _ready(kernel: str, caller: str):
    """Registers `kernel` (through `available`), or raises saying why `caller` cannot run here."""
    reason = unavailable_reason(kernel)
    if reason is not None:
        raise RuntimeError(
            f"kvattn.kernels.native.{caller} cannot run here: {reason}; use {caller}_on_xla, its XLA twin, or let "
            "kvattn.kernels.route choose"
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
    return _call(INT8_DOT)(rows, tiles)


def int8_dense(
    rows: Float[Array, "M D"] | Float[np.ndarray, "M D"],
    tiles: UInt8[Array, "Nt Dg 16 4"] | UInt8[np.ndarray, "Nt Dg 16 4"],
    scale: Float[Array, " N"] | Float[np.ndarray, " N"],
) -> Float[Array, "M N"]:
    """`x @ dequantized` as the int8 dense computes it: each float32 row quantized, multiplied by the int8 values
    `tiles` lays out, and scaled back by its row's scale and each output's `scale`, in one call.

    Bit for bit `int8_dense_on_xla`. Lowers to the native kernel's FFI call,
    so only for the CPU and only when `available(INT8_DENSE)`.

    Raises:
      TypeError: rows or scale not float32, or tiles not uint8.
      ValueError: shapes other than rows `(M, D)`, tiles `(N / 16, D / 4, 16, 4)` and scale `(N,)`.
      RuntimeError: the kernel cannot run here.
    """
    _expect_dtype("int8_dense", jnp.float32, rows=rows, scale=scale)
    _expect_dtype("int8_dense", jnp.uint8, tiles=tiles)
    _expect(rows.ndim == 2 and tiles.ndim == 4 and tiles.shape[2:] == (16, 4) and rows.shape[1] == 4 * tiles.shape[1]
            and scale.shape == (16 * tiles.shape[0],),
            "int8_dense", "rows (M, D), tiles (N / 16, D / 4, 16, 4) and scale (N,)", rows, tiles, scale)
    _ready(INT8_DENSE, "int8_dense")
    return _call(INT8_DENSE)(rows, tiles, scale)


def int4_dot(
    rows: Int8[Array, "M D"] | Int8[np.ndarray, "M D"],
    packed: UInt8[Array, "N Dh"] | UInt8[Array, "Nt Db 8 16"] | UInt8[np.ndarray, "..."],
    scale: BFloat16[Array, "N G"] | BFloat16[Array, "Nt G 8"] | BFloat16[np.ndarray, "..."],
) -> Float[Array, "M N"]:
    """`sum_g scale[n, g] * (rows[m, g] @ values[n, g])` in float32, for the 4-bit `values (N, D)` `packed` holds.

    The int8 rows by the weights of `kvattn.math.int4.Int4Weights` (packed
    `(N, D / 2)` and scales `(N, D / group)`) or of a `TiledInt4Weights`
    (tiles `(N / 8, D / 32, 8, 16)` and scales `(N / 8, D / group, 8)`):
    each group's products summed exactly in int32, scaled, and summed over
    the groups in order in float32, so a row's result does not depend on the
    other rows or the layout. CPU only, when `available(INT4_DOT)`; under
    `vmap` it runs once per batch element.

    Raises:
      TypeError: rows not int8, packed not uint8 or scales not bfloat16.
      ValueError: shapes other than those, with rows `(M, D)` and a group a
        multiple of 32 dividing `D`.
      RuntimeError: the kernel cannot run here.
    """
    _expect_dtype("int4_dot", jnp.int8, rows=rows)
    _expect_dtype("int4_dot", jnp.uint8, packed=packed)
    _expect_dtype("int4_dot", jnp.bfloat16, scale=scale)
    tiled = packed.ndim == 4
    inputs = packed.shape[1] * int4.BLOCK if tiled else 2 * packed.shape[-1] if packed.ndim else 0
    groups = scale.shape[1] if scale.ndim > 1 else 0
    layout = (scale.ndim == 3 and packed.shape[2:] == (8, 16) and scale.shape[2] == 8 if tiled
              else packed.ndim == 2 and scale.ndim == 2)
    _expect(layout and rows.ndim == 2 and scale.shape[0] == packed.shape[0] and rows.shape[1] == inputs > 0
            and groups > 0 and inputs % groups == 0 and (inputs // groups) % 32 == 0, "int4_dot",
            "rows (M, D), packed (N, D / 2) and scales (N, D / group) or packed (N / 8, D / 32, 8, 16) and scales "
            "(N / 8, D / group, 8), the group a multiple of 32 dividing D", rows, packed, scale)
    _ready(INT4_DOT, "int4_dot")
    return _call(INT4_DOT)(rows, packed, scale)


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
    return _call(F32_DOT)(rows, panels)


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
    return _call(DECODE_ATTENTION)(q, k_cache, v_cache, visible)


def paged_decode_attention(
    q: Float[Array, "B K G H"], k_pages: Float[Array, "P K page H"], v_pages: Float[Array, "P K page H"],
    table: Int32[Array, "B M"], filled: Int32[Array, " B"],
) -> tuple[Float[Array, "B K G H"], Float[Array, "B K G"], Float[Array, "B K G"]]:
    """`decode_attention` over positions `0 .. filled[b] - 1` of a paged pool: `(o, total, top)`.

    Sequence b's position `j * page + s` lies in slot s of page
    `table[b, j]` of the pools `(P, K, page, H)` (heads-major pages, as
    `kvattn.caches.paged` lays them out); the kernel reads the pages where
    they lie, and never a slot at or past `filled[b]` (clamped to the
    table's `M * page`), so a page's free tail may hold anything. A table
    entry outside `[0, P)` reads the nearest page (a pool is never read
    past). Each sum runs in position order, so the outputs are
    `decode_attention`'s over the same positions laid out contiguously, to
    the bit. CPU only, when `available()`; differentiable through its twin.

    Raises:
      TypeError: q or the pools not float32, or table or filled not int32.
      ValueError: shapes other than those above (`H` a multiple of 16).
      RuntimeError: the kernel cannot run here.
    """
    caller = "paged_decode_attention"
    _expect_dtype(caller, jnp.float32, q=q, k_pages=k_pages, v_pages=v_pages)
    _expect_dtype(caller, jnp.int32, table=table, filled=filled)
    batch, kv_heads, _, head_dim = q.shape if q.ndim == 4 else (None,) * 4
    _expect(q.ndim == 4 and head_dim % 16 == 0 and k_pages.shape == v_pages.shape and k_pages.ndim == 4
            and (k_pages.shape[1], k_pages.shape[3]) == (kv_heads, head_dim) and k_pages.shape[0] >= 1
            and k_pages.shape[2] >= 1 and table.ndim == 2 and table.shape[0] == batch and filled.shape == (batch,),
            caller, "q (B, K, G, H) with H a multiple of 16, pools (P, K, page, H), table (B, M), filled (B,)",
            q, k_pages, v_pages, table, filled)
    _ready(PAGED_DECODE_ATTENTION, caller)
    return _call(PAGED_DECODE_ATTENTION)(q, k_pages, v_pages, table, filled)


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
    return _call(PREFILL_ATTENTION)(q, k_new, v_new, k_cache, v_cache, cache_len, new_len)


def paged_prefill_attention(
    q: Float[Array, "B T N H"], k_new: Float[Array, "B T K H"], v_new: Float[Array, "B T K H"],
    k_pages: Float[Array, "P K page H"], v_pages: Float[Array, "P K page H"], table: Int32[Array, "B M"],
    cache_len: Int32[Array, " B"], new_len: Int32[Array, " B"],
) -> Float[Array, "B T N H"]:
    """`prefill_attention` with the cached positions `0 .. cache_len[b] - 1` read from a paged pool.

    Position `j * page + s` of sequence b lies in slot s of page
    `table[b, j]` of the pools `(P, K, page, H)` (heads-major pages), read
    where it lies; the new tokens come from `k_new`, `v_new` (a pool written
    first holds the same values). `cache_len` is clamped to the table's
    `M * page`; a table entry outside `[0, P)` reads the nearest page. The
    outputs are `prefill_attention`'s over the same positions laid out
    contiguously, to the bit. CPU only, when `available()`; differentiable
    through its twin.

    Raises:
      TypeError: a float operand not float32, or table or lengths not int32.
      ValueError: shapes other than those above (`K` dividing `N`, `H` a multiple of 16).
      RuntimeError: the kernel cannot run here.
    """
    caller = "paged_prefill_attention"
    _expect_dtype(caller, jnp.float32, q=q, k_new=k_new, v_new=v_new, k_pages=k_pages, v_pages=v_pages)
    _expect_dtype(caller, jnp.int32, table=table, cache_len=cache_len, new_len=new_len)
    batch, num_new, heads, head_dim = q.shape if q.ndim == 4 else (None,) * 4
    kv_heads = k_new.shape[2] if k_new.ndim == 4 else 0
    _expect(q.ndim == 4 and head_dim % 16 == 0 and k_new.shape == v_new.shape == (batch, num_new, kv_heads, head_dim)
            and kv_heads and heads % kv_heads == 0 and k_pages.shape == v_pages.shape and k_pages.ndim == 4
            and (k_pages.shape[1], k_pages.shape[3]) == (kv_heads, head_dim) and k_pages.shape[0] >= 1
            and k_pages.shape[2] >= 1 and table.ndim == 2 and table.shape[0] == batch
            and cache_len.shape == new_len.shape == (batch,), caller,
            "q (B, T, N, H) with H a multiple of 16, new keys and values (B, T, K, H) with K dividing N, pools "
            "(P, K, page, H), table (B, M), lengths (B,)", q, k_new, v_new, k_pages, v_pages, table, cache_len, new_len)
    _ready(PAGED_PREFILL_ATTENTION, caller)
    return _call(PAGED_PREFILL_ATTENTION)(q, k_new, v_new, k_pages, v_pages, table, cache_len, new_len)


def read_max(x: Float[Array, "R C"]) -> Float[Array, " R"]:
    """Each row's maximum (NaN where the row holds one, as `jnp.max`), reading every byte of `x` once.

    A streaming read and nothing else, split over XLA's threads: the
    benchmarks' bandwidth limit (`benchmarks.baselines.Calibration`). CPU
    only, when `available()`.

    Raises:
      TypeError: x not float32.
      ValueError: x not `(R, C)` with `C >= 1`.
      RuntimeError: the kernel cannot run here.
    """
    _expect_dtype("read_max", jnp.float32, x=x)
    _expect(x.ndim == 2 and x.shape[1] >= 1, "read_max", "x (R, C) with C >= 1", x)
    _ready(READ_MAX, "read_max")
    return _call(READ_MAX)(x)


def bf16_dot(
    rows: Float[Array, "M D"] | Float[np.ndarray, "M D"],
    panels: Shaped[Array, "Np D 16"] | Shaped[np.ndarray, "Np D 16"],
) -> Float[Array, "M N"]:
    """`rows @ kernel` in float32, for the bfloat16 kernel `(D, N)` that `panels` lays out.

    `f32_dot` over the weights' exact float32 values, streaming half the
    bytes: each output is one float32 sum over `D` in order. CPU only, when
    `available()`; differentiable (its derivatives are those of `rows @
    kernel` in `jax.numpy`).

    Raises:
      TypeError: rows not float32, or panels not bfloat16.
      ValueError: shapes other than rows `(M, D)` and panels `(N / 16, D, 16)`.
      RuntimeError: the kernel cannot run here.
    """
    _expect_dtype("bf16_dot", jnp.float32, rows=rows)
    _expect_dtype("bf16_dot", jnp.bfloat16, panels=panels)
    _expect(rows.ndim == 2 and panels.ndim == 3 and panels.shape[2] == 16 and rows.shape[1] == panels.shape[1],
            "bf16_dot", "rows (M, D) and panels (N / 16, D, 16)", rows, panels)
    _ready(BF16_DOT, "bf16_dot")
    return _call(BF16_DOT)(rows, panels)


# ------------------------------------------------------------------ the XLA twins


def int8_dot_on_xla(rows: Int8[Array, "M D"], tiles: UInt8[Array, "Nt Dg 16 4"]) -> Int32[Array, "M N"]:
    """What `int8_dot` computes, as XLA's int32 dot of the values `tiles` lays out, on any backend."""
    weights = jnp.transpose(quant.unbiased(tiles), (0, 2, 1, 3)).reshape(-1, rows.shape[-1])
    return jax.lax.dot_general(rows, weights, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def int8_dense_on_xla(rows: Float[Array, "M D"], tiles: UInt8[Array, "Nt Dg 16 4"], scale: Float[Array, " N"]
                      ) -> Float[Array, "M N"]:
    """What `int8_dense` computes, on any backend: `quantize_rows`, `int8_dot_on_xla`, then each sum in float32 times
    its row's scale, times its output's."""
    values, row_scale = quant.quantize_rows(rows)
    return int8_dot_on_xla(values, tiles).astype(jnp.float32) * row_scale * scale[None]


def int4_dot_on_xla(rows: Int8[Array, "M D"], packed: UInt8[Array, "..."], scale: BFloat16[Array, "..."]
                    ) -> Float[Array, "M N"]:
    """What `int4_dot` computes, as XLA's int32 dots of each group of the unpacked values, on any backend."""
    if packed.ndim == 4:  # tiles: the outputs' blocks back one after another
        weights = int4.untile(int4.TiledInt4Weights(packed, scale, (packed.shape[0] * int4.TILE_OUTPUTS,)))
        packed, scale = weights.packed, weights.scale
    groups = scale.shape[-1]
    group = 2 * packed.shape[-1] // groups
    values = int4.unpack(packed).reshape(packed.shape[0], groups, group)
    products = jax.lax.dot_general(rows.reshape(rows.shape[0], groups, group), values, (((2,), (2,)), ((1,), (1,))),
                                   preferred_element_type=jnp.int32)  # (groups, M, N)
    return jnp.einsum("gmn,ng->mn", products.astype(jnp.float32), scale.astype(jnp.float32))


def f32_dot_on_xla(rows: Float[Array, "M D"], panels: Float[Array, "Np D 16"]) -> Float[Array, "M N"]:
    """What `f32_dot` computes, as XLA's dot of the kernel the panels lay out, on any backend."""
    return rows @ jnp.transpose(panels, (1, 0, 2)).reshape(panels.shape[1], -1)


def bf16_dot_on_xla(rows: Float[Array, "M D"], panels: Shaped[Array, "Np D 16"]) -> Float[Array, "M N"]:
    """What `bf16_dot` computes: `f32_dot`'s twin over the panels widened to float32, on any backend."""
    return f32_dot_on_xla(rows, panels.astype(jnp.float32))


def decode_attention_on_xla(
    q: Float[Array, "B K G H"], k_cache: Float[Array, "B K S H"], v_cache: Float[Array, "B K S H"],
    visible: Int32[Array, " B"],
) -> tuple[Float[Array, "B K G H"], Float[Array, "B K G"], Float[Array, "B K G"]]:
    """What `decode_attention` computes, in `jax.numpy`: the unnormalised sums `kvattn.math.ops` never forms."""
    seen = jnp.arange(k_cache.shape[2])[None, None, None, :] < visible[:, None, None, None]
    scores = jnp.where(seen, jnp.einsum("bkgh,bksh->bkgs", q, k_cache), -jnp.inf)
    top = jnp.max(scores, axis=-1)
    # Shifted by top whenever a slot is visible, so a top of NaN, +inf or -inf makes the weights NaN, as in the
    # kernel and a float64 softmax; unseen values are selected away, since 0 * NaN would be NaN.
    shift = jnp.where(visible[:, None, None] > 0, top, 0.0)
    weights = jnp.where(seen, jnp.exp(scores - shift[..., None]), 0.0)
    values = jnp.where(jnp.swapaxes(seen, 2, 3), v_cache, 0.0)
    return jnp.einsum("bkgs,bksh->bkgh", weights, values), jnp.sum(weights, axis=-1), top


def _gathered(pool: Float[Array, "P K page H"], table: Int32[Array, "B M"]) -> Float[Array, "B K S H"]:
    """Each sequence's pages laid out contiguously, `S = M * page` (an entry outside `[0, P)`: the nearest page)."""
    view = jnp.swapaxes(pool[jnp.clip(table, 0, pool.shape[0] - 1)], 1, 2)  # (B, K, M, page, H)
    return view.reshape(*view.shape[:2], -1, view.shape[-1])


def paged_decode_attention_on_xla(
    q: Float[Array, "B K G H"], k_pages: Float[Array, "P K page H"], v_pages: Float[Array, "P K page H"],
    table: Int32[Array, "B M"], filled: Int32[Array, " B"],
) -> tuple[Float[Array, "B K G H"], Float[Array, "B K G"], Float[Array, "B K G"]]:
    """What `paged_decode_attention` computes: `decode_attention_on_xla` over each sequence's pages gathered."""
    return decode_attention_on_xla(q, _gathered(k_pages, table), _gathered(v_pages, table), filled)


def paged_prefill_attention_on_xla(q, k_new, v_new, k_pages, v_pages, table, cache_len, new_len
                                   ) -> Float[Array, "B T N H"]:
    """What `paged_prefill_attention` computes: `prefill_attention_on_xla` over each sequence's pages gathered,
    the slots it never reads zeroed (a free page's NaN would meet a weight of 0 there)."""
    held = jnp.clip(cache_len, 0, table.shape[1] * k_pages.shape[2])

    def read(pool):
        view = _gathered(pool, table)
        return jnp.where((jnp.arange(view.shape[2])[None, :] < held[:, None])[:, None, :, None], view, 0.0)

    return prefill_attention_on_xla(q, k_new, v_new, read(k_pages), read(v_pages), held, new_len)


def prefill_attention_on_xla(q, k_new, v_new, k_cache, v_cache, cache_len, new_len) -> Float[Array, "B T N H"]:
    """What `prefill_attention` computes: `kvattn.math.ops.attention` over heads-major caches."""
    return ops.attention(q, k_new, v_new, new_len, k_cache, v_cache, cache_len, ops.HEADS_MAJOR)


def read_max_on_xla(x: Float[Array, "R C"]) -> Float[Array, " R"]:
    """What `read_max` computes: `jnp.max` along the rows."""
    return jnp.max(x, axis=1)


# ------------------------------------------------- examples (the self-tests' inputs)


def _int8_example(rng):
    rows = rng.integers(-128, 128, (3, 8), dtype=np.int8)
    values = rng.integers(-127, 128, (16, 8), dtype=np.int8)
    return rows, quant.tile(quant.Int8Weights(values, None)).tiles


def _int8_dense_example(rng):
    rows, tiles = _int8_example(rng)
    return rows.astype(np.float32) / 7, tiles, rng.uniform(0.5, 2, 16).astype(np.float32)


def _int4_example(rng):
    rows = rng.integers(-128, 128, (3, 64), dtype=np.int8)
    weights = int4.quantize_groups(rng.standard_normal((64, 12)).astype(np.float32))
    return rows, weights.packed, weights.scale


def _f32_example(rng):
    rows, weights = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    return rows, weights.reshape(8, 1, 16).transpose(1, 0, 2)


def _bf16_example(rng):
    rows, panels = _f32_example(rng)
    return rows, panels.astype(jnp.bfloat16)


def _decode_example(rng):
    q, k_cache, v_cache = rng.standard_normal((3, 1, 1, 3, 16)).astype(np.float32)
    return q[:, :, :1], k_cache, v_cache, np.array([3], np.int32)


def _paged_decode_example(rng):
    q = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
    k_pages, v_pages = rng.standard_normal((2, 3, 1, 2, 16)).astype(np.float32)
    return q, k_pages, v_pages, np.array([[2, 1]], np.int32), np.array([3], np.int32)


def _paged_prefill_example(rng):
    q, k_new, v_new = rng.standard_normal((3, 1, 2, 1, 16)).astype(np.float32)
    k_pages, v_pages = rng.standard_normal((2, 3, 1, 2, 16)).astype(np.float32)
    return (q, k_new, v_new, k_pages, v_pages, np.array([[2, 1]], np.int32), np.array([3], np.int32),
            np.array([2], np.int32))


def _prefill_example(rng):
    q, k_new, v_new = rng.standard_normal((3, 1, 2, 1, 16)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 1, 1, 3, 16)).astype(np.float32)
    return q, k_new, v_new, k_cache, v_cache, np.array([2], np.int32), np.array([2], np.int32)


def _read_max_example(rng):
    return (rng.standard_normal((3, 37)).astype(np.float32),)


# The kernels, once: what registers, self-tests and differentiates each, and what the harness runs.
KERNELS = (
    # The dots, both attentions and the streaming read have an AVX-512 body and an AVX2 one (`native.h`'s
    # `Avx512`; the int8 dot's first needs AVX512-VNNI too, which it asks for itself).
    Kernel("int8_dot", int8_dot, int8_dot_on_xla, ("avx2",), _int8_example, differentiable=False, tolerance=0.0),
    Kernel("int8_dense", int8_dense, int8_dense_on_xla, ("avx2",), _int8_dense_example, tolerance=0.0),
    Kernel("int4_dot", int4_dot, int4_dot_on_xla, ("avx2",), _int4_example, differentiable=False),
    Kernel("f32_dot", f32_dot, f32_dot_on_xla, ("avx2", "fma"), _f32_example),
    Kernel("bf16_dot", bf16_dot, bf16_dot_on_xla, ("avx2", "fma"), _bf16_example),
    Kernel("decode_attention", decode_attention, decode_attention_on_xla, ("avx2", "fma"), _decode_example),
    Kernel("paged_decode_attention", paged_decode_attention, paged_decode_attention_on_xla, ("avx2", "fma"),
           _paged_decode_example),
    Kernel("paged_prefill_attention", paged_prefill_attention, paged_prefill_attention_on_xla, ("avx2", "fma"),
           _paged_prefill_example),
    Kernel("prefill_attention", prefill_attention, prefill_attention_on_xla, ("avx2", "fma"), _prefill_example),
    Kernel("read_max", read_max, read_max_on_xla, ("avx2",), _read_max_example, tolerance=0.0),
)
