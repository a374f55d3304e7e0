"""One harness for kvattn's native kernels (`kvattn.kernels.native.KERNELS`), parametrised over the table.

Every kernel, on a small grid of shapes, equals its XLA twin and a float64
reference; NaN and inf in its inputs spread as in float64; its derivatives
are its twin's; bad shapes and dtypes are refused in Python with a message
naming what was expected and what came. A kernel joins with one `Harness`
entry in `HARNESS` (its cases, its non-finite inputs, its misuses).
Everything here skips a kernel that is not available on this machine, but
the table itself (features, registration) is checked everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvattn
from kvattn.kernels import native, route
from kvattn.layer.forward import extend
from kvattn.math import int4, quant
from tests.helpers import CACHED, FRESH, POISONS, XLA_LEAKS, poison_chunk
from tests.reference import attention as reference_attention

F32, I32 = np.float32, np.int32


@dataclasses.dataclass(frozen=True)
class Harness:
    """What the shared tests need of one kernel.

    Attributes:
      cases: `rng -> {id: (arguments, float64 outputs)}`, a small grid of valid shapes.
      poisons: `rng -> {id: (arguments, float64 outputs)}`, NaN and inf in the inputs.
      misuses: `(shapes, dtypes, error, match)` the wrapper refuses before the FFI.
      twin_leaks: poisons the XLA twin does not yet follow float64 on (a known gap, #33).
      twin_growth: `float64 outputs -> factor` by which the entry's kernel-twin tolerance grows on those
        inputs (1 where their conditioning does not depend on the values).
      float_reference: the kernel equals its twin bit for bit but rounds in float32 where the float64
        reference does not: held to the reference within 1e-5 (other exact kernels: equal).
    """

    cases: Callable[[np.random.Generator], dict]
    poisons: Callable[[np.random.Generator], dict] = lambda rng: {}
    misuses: tuple = ()
    twin_leaks: frozenset = frozenset()
    twin_growth: Callable[[tuple], float] = lambda wants: 1.0
    float_reference: bool = False


# ------------------------------------------------------------------ int8_dot


def _int8_case(rng, rows, groups, tiles, lowest=-128):
    a = rng.integers(lowest, 128, (rows, 4 * groups), dtype=np.int8)
    w = rng.integers(-128, 128, (16 * tiles, 4 * groups), dtype=np.int8)
    a[0, :2], w[0, :2] = (lowest, 127), (-128, -128)  # int8's extremes
    return (a, quant.tile(quant.Int8Weights(w, None)).tiles), a.astype(np.int64) @ w.astype(np.int64).T


def _int8_cases(rng):
    # Blocks of eight rows and the rest, tiles read four, two and one at a time, and 37 tiles: every thread of
    # XLA's pool takes an uneven part.
    # Rows without -128, as `quantize_rows` gives them: every row on the AVX2 body's vector path (a row holding
    # -128 is summed one product at a time there).
    shapes = {"1x4x16": (1, 1, 1), "9x160x96": (9, 40, 6), "8x8x32": (8, 2, 2), "9x64x592": (9, 16, 37),
              "7x256x80-quantized": (7, 64, 5, -127)}
    return {name: _int8_case(rng, *shape) for name, shape in shapes.items()}


# ------------------------------------------------------------------ int8_dense


def _int8_dense_case(rng, rows, groups, tiles, poison=None):
    x = (3 * rng.standard_normal((rows, 4 * groups))).astype(F32)
    w = rng.integers(-127, 128, (16 * tiles, 4 * groups), dtype=np.int8)
    scale = rng.uniform(1e-3, 0.1, 16 * tiles).astype(F32)
    if rows:  # quotients halfway between integers (rounded to even), the row's largest (127), zeros
        x[0, :6] = (np.float32(np.abs(x[0]).max() / 127) * np.array([0.5, 1.5, 2.5, -2.5, -0.5, 0], F32))[:x.shape[1]]
    if rows > 2:
        x[2] = 0  # a row of zeros: scale 1
    if poison == "non-finite rows":  # every output of a row holding NaN or inf is NaN (inf / inf, 0 * inf)
        x[0, 3], x[1, 5], x[2, 7] = np.nan, np.inf, -np.inf
    elif poison == "non-finite scales":  # +-inf where the sum is not 0, NaN where it is (as 0 * inf), NaN
        scale[1], scale[2], scale[3] = np.inf, -np.inf, np.nan
        w[1, :], w[2, :] = 0, 1
    with np.errstate(invalid="ignore"):  # a non-finite row's values do not matter: its outputs are NaN
        values, row_scale = quant.quantize_rows(x)  # the one quantizer, in NumPy: round half to even
        sums = values.astype(np.int64) @ w.astype(np.int64).T
        want = sums * row_scale.astype(np.float64) * scale.astype(np.float64)
    want[~np.isfinite(row_scale[:, 0])] = np.nan
    return (x, quant.tile(quant.Int8Weights(w, None)).tiles, scale), want


def _int8_dense_cases(rng):
    # One row and blocks of eight with the rest; tiles four, two and one at a time; 37 tiles; no rows.
    shapes = {"1x4x16": (1, 1, 1), "9x160x96": (9, 40, 6), "8x768x32": (8, 192, 2), "9x64x592": (9, 16, 37),
              "0x64x16": (0, 16, 1), "3x12x16": (3, 3, 1)}
    return {name: _int8_dense_case(rng, *shape) for name, shape in shapes.items()}


def _int8_dense_poisons(rng):
    return {f"{poison}, {rows} rows": _int8_dense_case(rng, rows, 40, 3, poison)
            for poison in ("non-finite rows", "non-finite scales") for rows in (3, 9)}


# ------------------------------------------------------------------ int4_dot


def _int4_case(rng, rows, inputs, outputs, group, poison=None, tiled=False):
    a = rng.integers(-128, 128, (rows, inputs), dtype=np.int8)
    weights = int4.quantize_groups(rng.standard_normal((inputs, outputs)).astype(np.float32), group)
    scale = weights.scale.copy()
    if poison == "a NaN scale":
        scale[1, 0] = np.nan
    elif poison == "inf scales":  # a group summing to zero gives NaN, as 0 * inf does in float64
        scale[0, -1], scale[2, 0] = np.inf, -np.inf
        a[:, :group] = 0
    values = np.asarray(int4.unpack(weights.packed), np.int64).reshape(outputs, inputs // group, group)
    sums = np.einsum("mgk,ngk->mng", a.astype(np.int64).reshape(rows, inputs // group, group), values)
    with np.errstate(invalid="ignore"):
        want = (sums * scale.astype(np.float64)[None]).sum(-1)
    if tiled:  # the same weights, eight outputs' blocks side by side
        tiles = int4.tile(int4.Int4Weights(weights.packed, scale))
        return (a, tiles.tiles, tiles.scale), want
    return (a, weights.packed, scale), want


def _int4_cases(rng):
    # Groups of one and four blocks; outputs in whole eights and not (a last block of 5, 1 output); one or two
    # rows (each its own pass) and more (blocked); no rows; 37 blocks of outputs: every thread of XLA's pool
    # takes an uneven part.
    shapes = {"1x32x8-g32": (1, 32, 8, 32), "3x256x13-g128": (3, 256, 13, 128), "9x64x1-g32": (9, 64, 1, 32),
              "0x64x16-g64": (0, 64, 16, 64), "2x96x296-g32": (2, 96, 296, 32), "1x256x16-g128": (1, 256, 16, 128),
              "2x512x24-g32": (2, 512, 24, 32)}  # whole eights of groups: scales read eight groups at a time
    # Tiled: one row and two (each its own pass), more (blocked), and 37 tiles.
    tiled = {"tiled-1x256x16-g32": (1, 256, 16, 32), "tiled-2x96x296-g32": (2, 96, 296, 32),
             "tiled-5x256x24-g128": (5, 256, 24, 128), "tiled-0x64x8-g64": (0, 64, 8, 64)}
    return {**{name: _int4_case(rng, *shape) for name, shape in shapes.items()},
            **{name: _int4_case(rng, *shape, tiled=True) for name, shape in tiled.items()}}


def _int4_poisons(rng):
    return {f"{poison}, {rows} rows{', tiled' if tiled else ''}": _int4_case(rng, rows, 256, 16, 32, poison, tiled)
            for poison in ("a NaN scale", "inf scales") for rows in (1, 3) for tiled in (False, True)}


# ------------------------------------------------------------------- f32_dot


def _f32_case(rng, rows, inputs, panels, poison=None):
    x = rng.standard_normal((rows, inputs)).astype(np.float32)
    kernel = rng.standard_normal((inputs, 16 * panels)).astype(np.float32)
    if poison == "a NaN row":
        x[1, 3] = np.nan
    elif poison == "an inf weight":
        kernel[2, 5] = np.inf
    return (x, quant.panel(kernel).panels), x.astype(np.float64) @ kernel.astype(np.float64)


def _f32_cases(rng):
    # One block of rows and several; a batch's few blocks read 64 k at a time (16 rows by 150 k: three tiles, the
    # last ragged) over two groups of panels (15: 12 and 3); no rows, one k.
    shapes = {"0x5x16": (0, 5, 1), "1x24x48": (1, 24, 3), "9x70x128": (9, 70, 8), "21x1x32": (21, 1, 2),
              "16x150x240": (16, 150, 15)}
    return {name: _f32_case(rng, *shape) for name, shape in shapes.items()}


def _f32_poisons(rng):
    return {poison: _f32_case(rng, 3, 8, 2, poison) for poison in ("a NaN row", "an inf weight")}


# ------------------------------------------------------------------- bf16_dot


def _bf16_case(rng, rows, inputs, panels, poison=None):
    """`_f32_case` with the weights in bfloat16: float64 over their exact values (a bfloat16 is a float32)."""
    (x, f32_panels), _ = _f32_case(rng, rows, inputs, panels, poison)
    stored = f32_panels.astype(jnp.bfloat16)
    kernel = np.transpose(stored.astype(np.float64), (1, 0, 2)).reshape(inputs, -1)
    return (x, stored), x.astype(np.float64) @ kernel


def _bf16_cases(rng):
    shapes = {"0x5x16": (0, 5, 1), "1x24x48": (1, 24, 3), "9x70x128": (9, 70, 8), "21x1x32": (21, 1, 2),
              "3x100x592": (3, 100, 37), "16x150x240": (16, 150, 15)}
    return {name: _bf16_case(rng, *shape) for name, shape in shapes.items()}


def _bf16_poisons(rng):
    return {poison: _bf16_case(rng, 3, 8, 2, poison) for poison in ("a NaN row", "an inf weight")}


# ---------------------------------------------------------- decode_attention


def _decode_sums64(q, keys, values, visible):
    """The unnormalised softmax sums in float64, NaN and inf spreading as they do there."""
    o, total = np.zeros(q.shape), np.zeros(q.shape[:-1])
    top = np.full(q.shape[:-1], -np.inf)
    for b in range(len(q)):
        if visible[b]:
            scores = np.einsum("kgh,ksh->kgs", q[b].astype(np.float64), keys[b, :, : visible[b]].astype(np.float64))
            top[b] = scores.max(-1)
            weights = np.exp(scores - top[b][..., None])
            o[b], total[b] = np.einsum("kgs,ksh->kgh", weights, values[b, :, : visible[b]]), weights.sum(-1)
    return o, total, top


def _decode_case(rng, batch, kv_heads, group, head_dim, slots, spread, visible):
    q = (spread * rng.standard_normal((batch, kv_heads, group, head_dim))).astype(np.float32)
    keys, values = rng.standard_normal((2, batch, kv_heads, slots, head_dim)).astype(np.float32)
    visible = np.asarray(visible, np.int32)
    return (q, keys, values, visible), _decode_sums64(q, keys, values, visible)


def _decode_cases(rng):
    # Every visible count from none to all; head dims of one to four vectors; large scores.
    return {
        "mha-none-visible": _decode_case(rng, 1, 1, 1, 16, 5, 1.0, [0]),
        "gqa3-ragged": _decode_case(rng, 3, 2, 3, 32, 19, 1.0, [19, 7, 1]),
        "gqa4-spread8": _decode_case(rng, 2, 3, 4, 64, 70, 8.0, [70, 33]),
        # Queries mixed four at a time, then the rest (4 + 1), over six columns of eight.
        "gqa5-h48": _decode_case(rng, 1, 1, 5, 48, 9, 1.0, [9]),
    }


STEP_POISONS = {  # slot, head dims, value; one query over 10 of 16 slots
    "a NaN key": (3, 0, np.nan), "an inf key": (3, slice(None), np.inf), "a NaN query": None,
    "a NaN in the last visible slot": (9, 0, np.nan), "NaN and inf past the visible slots": (10, slice(None), np.nan),
}


def _decode_poisons(rng):
    cases = {}
    for poison, where in STEP_POISONS.items():
        q = rng.standard_normal((1, 1, 2, 16)).astype(np.float32)
        keys, values = rng.standard_normal((2, 1, 1, 16, 16)).astype(np.float32)
        if where is None:
            q[0, 0, 1, 2] = np.nan
        else:
            slot, dims, value = where
            keys[0, 0, slot:slot + 1, dims] = value
            if slot == 10:
                values[0, 0, slot:] = np.inf
        visible = np.array([10], np.int32)
        cases[poison] = (q, keys, values, visible), _decode_sums64(q, keys, values, visible)
    return cases


# ---------------------------------------------------- paged_decode_attention


def _paged(rng, keys, values, held, page):
    """Caches `(B, K, S, H)` as pools `(P, K, page, H)` and a table: each sequence's first `held[b]` positions in
    shuffled pages, every other slot (free pages, page tails) NaN, which must never be read."""
    batch, kv_heads, _, head_dim = keys.shape
    blocks = max(1, -(-max(held) // page))
    pages = 1 + batch * blocks + 2  # the null page, each sequence's blocks, two free pages
    pool = np.full((2, pages, kv_heads, page, head_dim), np.nan, np.float32)
    table = rng.permutation(np.arange(1, pages))[: batch * blocks].reshape(batch, blocks).astype(np.int32)
    for b, length in enumerate(held):
        for j in range(-(-length // page)):
            used = min(page, length - j * page)
            pool[:, table[b, j], :, :used] = np.stack([keys, values])[:, b, :, j * page : j * page + used]
    return pool[0], pool[1], table


def _paged_case(rng, kv_heads, group, head_dim, page, filled, spread=1.0, poison=None):
    """A step over shuffled pages (`_paged`), against float64 over the same positions laid out contiguously."""
    batch, slots = len(filled), max(1, -(-max(filled) // page)) * page
    q = (spread * rng.standard_normal((batch, kv_heads, group, head_dim))).astype(np.float32)
    keys, values = rng.standard_normal((2, batch, kv_heads, slots, head_dim)).astype(np.float32)
    if poison is not None:
        slot, dims, value = poison
        keys[0, 0, slot, dims] = value
    k_pages, v_pages, table = _paged(rng, keys, values, filled, page)
    filled = np.asarray(filled, np.int32)
    return (q, k_pages, v_pages, table, filled), _decode_sums64(q, keys, values, filled)


def _paged_cases(rng):
    # Part of a page, whole pages, ragged sequences (one with nothing), pages of 1 and 16, spread scores.
    return {
        "mha-one-slot-pages": _paged_case(rng, 1, 1, 16, 1, [3]),
        "gqa3-ragged-pages-of-4": _paged_case(rng, 2, 3, 32, 4, [9, 0, 4, 13]),
        "gqa2-pages-of-16-spread8": _paged_case(rng, 3, 2, 64, 16, [40, 16], spread=8.0),
        # 4 + 3 queries; pages asked for two ahead of the one read, the last of them partly filled.
        "gqa7-h48-pages-of-4": _paged_case(rng, 1, 7, 48, 4, [14, 3]),
    }


def _paged_poisons(rng):
    return {name: _paged_case(rng, 1, 2, 16, 4, [10], poison=where) for name, where in
            (("a NaN key", (3, 0, np.nan)), ("an inf key", (3, slice(None), np.inf)),
             ("a NaN in the last visible slot", (9, 0, np.nan)))}


# --------------------------------------------------------- prefill_attention


def _chunk64(q, k_new, v_new, keys, values, cache_len, new_len):
    """Each real query against float64 over exactly the keys it sees; padding queries give zeros."""
    want = np.zeros(q.shape)
    for b in range(len(q)):
        k_seq = np.concatenate([keys[b, :, : cache_len[b]].transpose(1, 0, 2), k_new[b]])
        v_seq = np.concatenate([values[b, :, : cache_len[b]].transpose(1, 0, 2), v_new[b]])
        for t in range(new_len[b]):
            seen = cache_len[b] + t + 1
            want[b, t : t + 1] = reference_attention(q[b, t : t + 1], k_seq[:seen], v_seq[:seen], [seen - 1])
    return want


def _prefill_case(rng, batch, kv_heads, group, new, head_dim, slots, spread, cache_len, new_len):
    q = (spread * rng.standard_normal((batch, new, kv_heads * group, head_dim))).astype(np.float32)
    k_new, v_new = rng.standard_normal((2, batch, new, kv_heads, head_dim)).astype(np.float32)
    keys, values = rng.standard_normal((2, batch, kv_heads, slots, head_dim)).astype(np.float32)
    args = (q, k_new, v_new, keys, values, np.asarray(cache_len, np.int32), np.asarray(new_len, np.int32))
    return args, _chunk64(*args)


def _prefill_cases(rng):
    # Rows in blocks of four (a group of 3 splits a token across blocks), keys in pairs of 16, head dims past 64
    # in two passes over the values; every fill from none to all, ragged and padding rows.
    return {
        "mha-empty-cache": _prefill_case(rng, 1, 1, 1, 1, 16, 1, 1.0, [0], [1]),
        "gqa3-ragged-padding": _prefill_case(rng, 3, 2, 3, 11, 32, 40, 1.0, [40, 0, 17], [11, 4, 0]),
        "gqa2-h80-spread8": _prefill_case(rng, 2, 1, 2, 5, 80, 33, 8.0, [33, 2], [5, 5]),
        "h128": _prefill_case(rng, 1, 2, 2, 3, 128, 9, 0.1, [9], [2]),
        # Idle sequences, one with nothing visible at all (a warm-up call's).
        "idle": _prefill_case(rng, 2, 1, 2, 3, 16, 4, 1.0, [0, 2], [0, 0]),
        # 75 rows (two groups of blocks) over 315 keys (two tiles).
        "gqa3-tiles-and-groups": _prefill_case(rng, 1, 1, 3, 25, 16, 300, 1.0, [290], [25]),
    }


def _prefill_poisons(rng):
    cases = {}
    for poison in POISONS:
        q = rng.standard_normal((2, 6, 2, 16)).astype(np.float32)
        k_new, v_new = rng.standard_normal((2, 2, 6, 1, 16)).astype(np.float32)
        keys, values = rng.standard_normal((2, 2, 1, 12, 16)).astype(np.float32)
        poison_chunk(poison, q, k_new, v_new, keys, values)
        args = (q, k_new, v_new, keys, values, CACHED, FRESH)
        cases[poison] = args, _chunk64(*args)
    return cases


# --------------------------------------------------- paged_prefill_attention


def _paged_chunk(case, page, rng):
    """A `prefill_attention` case with its caches moved into shuffled pages (`_paged`); the same answer."""
    (q, k_new, v_new, keys, values, cache_len, new_len), want = case
    k_pages, v_pages, table = _paged(rng, keys, values, [max(int(n), 1) for n in cache_len], page)
    return (q, k_new, v_new, k_pages, v_pages, table, cache_len, new_len), want


def _paged_prefill_cases(rng):
    pages = {"mha-empty-cache": 1, "gqa3-ragged-padding": 4, "gqa2-h80-spread8": 16, "h128": 2,
             "idle": 2, "gqa3-tiles-and-groups": 16}
    return {name: _paged_chunk(case, pages[name], rng) for name, case in _prefill_cases(rng).items()}


def _paged_prefill_poisons(rng):
    return {name: _paged_chunk(case, 4, rng) for name, case in _prefill_poisons(rng).items()}


# ------------------------------------------------------------------ read_max


def _read_max_case(x):
    return (x,), np.max(x.astype(np.float64), axis=1)


def _read_max_cases(rng):
    # A row shorter than a vector, tails of every width, rows past four vectors (the unrolled loop), 0 rows.
    shapes = {"0x5": (0, 5), "3x1": (3, 1), "5x37": (5, 37), "4x200": (4, 200), "9x1031": (9, 1031)}
    return {name: _read_max_case((4 * rng.standard_normal(shape)).astype(np.float32)) for name, shape in shapes.items()}


def _read_max_poisons(rng):
    x = rng.standard_normal((6, 100)).astype(np.float32)
    x[0, 3], x[1, 99], x[2, :] = np.nan, np.inf, -np.inf  # a NaN, +inf in the tail, a row of -inf
    x[3, 70], x[3, 5] = np.nan, np.inf  # NaN beats inf, whichever comes first
    return {"NaN, inf and -inf rows": _read_max_case(x)}


# ------------------------------------------------------------------ the harness

def _score_growth(wants) -> float:
    """Decode attention's conditioning: its largest score (float64's `top`, its third output) past 16. A score
    s reaches the weights exp(s - top) with its float32 rounding, about |s| * 2**-24, whichever order sums it."""
    top = np.abs(np.asarray(wants[2], np.float64))
    return max(1.0, top[np.isfinite(top)].max(initial=0.0) / 16)


HARNESS = {
    native.INT8_DOT: Harness(_int8_cases, misuses=(
        ([(3, 32), (2, 7, 16, 4)], [np.int8, np.uint8], ValueError,
         r"rows \(M, D\) and tiles .*; got int8\(3, 32\), uint8\(2, 7, 16, 4\)"),
        ([(3, 32), (2, 8, 16, 4)], [np.int16, np.uint8], TypeError, "rows must be int8, got int16"),
    )),
    native.INT8_DENSE: Harness(_int8_dense_cases, _int8_dense_poisons, float_reference=True, misuses=(
        ([(3, 32), (2, 8, 16, 4), (32,)], [np.int8, np.uint8, F32], TypeError, "rows must be float32, got int8"),
        ([(3, 32), (2, 8, 16, 4), (32,)], [F32, np.uint8, jnp.bfloat16], TypeError, "scale must be float32"),
        ([(3, 32), (2, 8, 16, 4), (16,)], [F32, np.uint8, F32], ValueError,
         r"scale \(N,\); got float32\(3, 32\), uint8\(2, 8, 16, 4\), float32\(16,\)"),
        ([(3, 28), (2, 8, 16, 4), (32,)], [F32, np.uint8, F32], ValueError, r"rows \(M, D\), tiles"),
    )),
    native.INT4_DOT: Harness(_int4_cases, _int4_poisons, misuses=(
        ([(3, 64), (8, 32), (8, 2)], [np.int16, np.uint8, jnp.bfloat16], TypeError, "rows must be int8, got int16"),
        ([(3, 64), (8, 32), (8, 2)], [np.int8, np.uint8, F32], TypeError, "scale must be bfloat16, got float32"),
        ([(3, 64), (8, 32), (8, 4)], [np.int8, np.uint8, jnp.bfloat16], ValueError,
         r"the group a multiple of 32 dividing D; got int8\(3, 64\), uint8\(8, 32\), bfloat16\(8, 4\)"),
        ([(3, 48), (8, 32), (8, 2)], [np.int8, np.uint8, jnp.bfloat16], ValueError, r"rows \(M, D\), packed"),
        ([(3, 64), (2, 2, 8, 16), (2, 2)], [np.int8, np.uint8, jnp.bfloat16], ValueError,
         r"packed \(N / 8, D / 32, 8, 16\) .*; got int8\(3, 64\), uint8\(2, 2, 8, 16\), bfloat16\(2, 2\)"),
        ([(3, 64), (2, 2, 4, 16), (2, 2, 4)], [np.int8, np.uint8, jnp.bfloat16], ValueError, r"scales \(N / 8"),
    )),
    native.F32_DOT: Harness(_f32_cases, _f32_poisons, misuses=(
        ([(3, 8), (2, 8, 16)], [np.float64, F32], TypeError, "rows must be float32, got float64"),
        ([(3, 8), (2, 9, 16)], [F32, F32], ValueError, r"got float32\(3, 8\), float32\(2, 9, 16\)"),
    )),
    native.BF16_DOT: Harness(_bf16_cases, _bf16_poisons, misuses=(
        ([(3, 8), (2, 8, 16)], [F32, F32], TypeError, "panels must be bfloat16, got float32"),
        ([(3, 8), (2, 8, 16)], [jnp.bfloat16, jnp.bfloat16], TypeError, "rows must be float32, got bfloat16"),
        ([(3, 8), (2, 9, 16)], [F32, jnp.bfloat16], ValueError, r"got float32\(3, 8\), bfloat16\(2, 9, 16\)"),
    )),
    native.DECODE_ATTENTION: Harness(_decode_cases, _decode_poisons, twin_growth=_score_growth, misuses=(
        ([(1, 2, 1, 16), (1, 2, 5, 16), (1, 2, 5, 16), (2,)], [F32, F32, F32, I32], ValueError,
         r"visible \(B,\); got .*int32\(2,\)"),
        ([(1, 2, 1, 12), (1, 2, 5, 12), (1, 2, 5, 12), (1,)], [F32, F32, F32, I32], ValueError, "H a multiple of 16"),
        ([(1, 2, 1, 16), (1, 2, 5, 16), (1, 2, 5, 16), (1,)], [F32, F32, F32, np.int64], TypeError,
         "visible must be int32, got int64"),
    )),
    native.PAGED_DECODE_ATTENTION: Harness(_paged_cases, _paged_poisons, twin_growth=_score_growth, misuses=(
        ([(1, 2, 1, 16), (3, 2, 4, 16), (3, 2, 4, 16), (2, 2), (1,)], [F32, F32, F32, I32, I32], ValueError,
         r"table \(B, M\), filled \(B,\); got .*int32\(2, 2\)"),
        ([(1, 2, 1, 16), (3, 2, 4, 16), (3, 1, 4, 16), (1, 2), (1,)], [F32, F32, F32, I32, I32], ValueError,
         r"pools \(P, K, page, H\)"),
        ([(1, 2, 1, 16), (3, 2, 4, 16), (3, 2, 4, 16), (1, 2), (1,)], [F32, F32, F32, np.int64, I32], TypeError,
         "table must be int32, got int64"),
    )),
    native.PAGED_PREFILL_ATTENTION: Harness(_paged_prefill_cases, _paged_prefill_poisons, misuses=(
        ([(1, 3, 2, 16), (1, 3, 2, 16), (1, 3, 2, 16), (4, 3, 4, 16), (4, 3, 4, 16), (1, 2), (1,), (1,)],
         [F32] * 5 + [I32] * 3, ValueError, r"pools \(P, K, page, H\)"),
        ([(1, 3, 2, 16), (1, 3, 2, 16), (1, 3, 2, 16), (4, 2, 4, 16), (4, 2, 4, 16), (1, 2), (1,), (1,)],
         [F32] * 5 + [np.int64, I32, I32], TypeError, "table must be int32, got int64"),
    )),
    native.READ_MAX: Harness(_read_max_cases, _read_max_poisons, misuses=(
        ([(3, 0)], [F32], ValueError, r"x \(R, C\) with C >= 1; got float32\(3, 0\)"),
        ([(8,)], [F32], ValueError, r"x \(R, C\)"),
        ([(2, 8)], [np.float64], TypeError, "x must be float32, got float64"),
    )),
    native.PREFILL_ATTENTION: Harness(_prefill_cases, _prefill_poisons,
                                      twin_leaks=frozenset(XLA_LEAKS["ops.attention heads-major"]), misuses=(
        ([(1, 3, 3, 16), (1, 3, 2, 16), (1, 3, 2, 16), (1, 2, 5, 16), (1, 2, 5, 16), (1,), (1,)], [F32] * 5 + [I32] * 2,
         ValueError, "K dividing N"),
        ([(1, 3, 2, 16), (1, 3, 2, 16), (1, 3, 2, 16), (1, 2, 5, 16), (1, 2, 5, 16), (1,), (1,)],
         [F32, F32, F32, jnp.bfloat16, F32, I32, I32], TypeError, "k_cache must be float32, got bfloat16"),
    )),
}
KERNELS = [pytest.param(entry, id=entry.name) for entry in native.KERNELS]


def test_every_kernel_in_the_table_has_a_harness_and_a_compiled_handler_where_it_is_built():
    assert set(HARNESS) == {entry.target for entry in native.KERNELS}
    handlers, _ = native._compiled()
    if handlers:  # built: the C++ side registers exactly the table's kernels
        assert set(handlers) == {entry.name for entry in native.KERNELS}


def _needs(entry):
    if not native.available(entry.target):
        pytest.skip(f"{entry.name}: {native.unavailable_reason(entry.target)}")


@functools.cache
def _compiled(entry):
    return jax.jit(entry.wrapper), jax.jit(entry.twin)


def _check(entry, arguments, want, *, twin: bool = True):
    kernel, xla = _compiled(entry)
    got = jax.tree.leaves(kernel(*arguments))
    wants = want if isinstance(want, tuple) else (want,)
    for index, (g, w) in enumerate(zip(got, wants, strict=True)):
        # NaN and inf exactly where float64 has them; finite values close (integers: equal).
        tolerance = 0 if entry.tolerance == 0 and not HARNESS[entry.target].float_reference else 1e-5
        atol = tolerance * max(1, arguments[0].shape[-1]) if entry.name in ("f32_dot", "bf16_dot") else tolerance
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tolerance, atol=atol, err_msg=f"output {index}")
    if twin:
        tolerance = entry.tolerance * HARNESS[entry.target].twin_growth(wants)
        for g, t in zip(got, jax.tree.leaves(xla(*arguments)), strict=True):
            np.testing.assert_allclose(g, t, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("entry", KERNELS)
def test_each_kernel_equals_its_twin_and_float64_over_a_grid_of_shapes(entry):
    _needs(entry)
    for name, (arguments, want) in HARNESS[entry.target].cases(np.random.default_rng(0)).items():
        try:
            _check(entry, arguments, want)
        except AssertionError as error:
            raise AssertionError(f"{entry.name} on {name}") from error


@pytest.mark.parametrize("entry", KERNELS)
def test_nan_and_inf_spread_as_in_float64(entry):
    """Non-finite keys, values, queries or rows: NaN and inf exactly where float64 puts them, and only there."""
    _needs(entry)
    harness = HARNESS[entry.target]
    for name, (arguments, want) in harness.poisons(np.random.default_rng(1)).items():
        try:
            _check(entry, arguments, want, twin=name not in harness.twin_leaks)
        except AssertionError as error:
            raise AssertionError(f"{entry.name} with {name}") from error


@pytest.mark.parametrize("entry", [p for p in KERNELS if p.values[0].differentiable])
def test_derivatives_are_the_twins(entry):
    """An FFI call has no derivatives of its own: each kernel takes its twin's (`jax.custom_jvp`)."""
    _needs(entry)
    arguments = [jnp.asarray(x) for x in entry.example(np.random.default_rng(2))]
    floats = tuple(i for i, x in enumerate(arguments) if jnp.issubdtype(x.dtype, jnp.floating))
    probe = jax.tree.map(lambda s: jnp.asarray(np.random.default_rng(3).standard_normal(s.shape), s.dtype),
                         jax.eval_shape(entry.twin, *arguments))

    def loss(call, *arguments):
        return sum(jnp.sum(jnp.tanh(o) * p) for o, p in zip(jax.tree.leaves(call(*arguments)),
                                                            jax.tree.leaves(probe), strict=True))

    got = jax.grad(functools.partial(loss, entry.wrapper), argnums=floats)(*arguments)
    want = jax.grad(functools.partial(loss, entry.twin), argnums=floats)(*arguments)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("entry", "shapes", "dtypes", "error", "match"),
    [pytest.param(entry, *misuse, id=f"{entry.name}-{i}") for entry in native.KERNELS
     for i, misuse in enumerate(HARNESS[entry.target].misuses)],
)
def test_a_kernel_names_the_shapes_and_dtypes_it_expected_and_got(entry, shapes, dtypes, error, match):
    """Refused in Python, before the FFI handler (and whether or not the kernel runs here)."""
    with pytest.raises(error, match=match):
        entry.wrapper(*(np.zeros(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)))


# ------------------------------------------------------------------ the table's other promises


def test_each_kernel_needs_only_the_cpu_features_it_uses(monkeypatch):
    """No kernel needs AVX512F: on a CPU with AVX2 and FMA alone every dot remains (the int8 and panel dots'
    AVX2 bodies, the 4-bit dot), decode and prefill attention (contiguous and paged) and the streaming read. No
    kernel needs AVX512-VNNI: the int8 dot picks that body itself."""
    handlers, features = native._compiled()
    every = {feature: True for entry in native.KERNELS for feature in entry.features}
    monkeypatch.setattr(native, "_compiled", lambda: (handlers, {**every, "avx512f": False}))
    needs = {entry.name: set(entry.features) for entry in native.KERNELS}
    assert {name for name, features in needs.items() if features <= {"avx2", "fma"}} == {
        entry.name for entry in native.KERNELS if entry.target in TWO_BODIES} | {"int4_dot"}
    assert not any("avx512f" in features or "avx512vnni" in features for features in needs.values())
    if handlers:
        assert native.unavailable_reason.__wrapped__(native.PREFILL_ATTENTION) is None
    with pytest.raises(ValueError, match="one of .*, got 'kvattn_gemm'"):
        native.available("kvattn_gemm")


def test_a_kernel_is_self_tested_at_registration(monkeypatch):
    """A kernel that disagrees with its twin on its example is not used (an FFI mismatch fails here)."""
    entry = native.kernel(native.F32_DOT)
    _needs(entry)
    wrong = dataclasses.replace(entry, twin=lambda rows, panels: native.f32_dot_on_xla(rows, panels) + 1)
    monkeypatch.setattr(native, "KERNELS", tuple(wrong if e is entry else e for e in native.KERNELS))
    monkeypatch.setattr(native, "_call", native._call.__wrapped__)  # uncached: built from the patched table
    assert native.unavailable_reason.__wrapped__(native.F32_DOT) == "it disagreed with its XLA twin in its self-test"


def test_a_kernel_called_first_registers_itself():
    """A fresh process calls a kernel before `available()`: it registers first, or says why it cannot run."""
    program = (
        "import numpy as np\nfrom kvattn.kernels import native\n"
        "rows, panels = np.ones((2, 8), 'f4'), np.ones((1, 8, 16), 'f4')\n"
        "try:\n    print(float(native.f32_dot(rows, panels).sum()))\nexcept RuntimeError as error:\n    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    if native.available(native.F32_DOT):
        assert out.strip() == "256.0"
    else:
        assert "kvattn.kernels.native.f32_dot cannot run here" in out


def test_an_unavailable_kernel_says_why_and_the_dots_fall_back(monkeypatch):
    monkeypatch.setattr(native, "unavailable_reason", lambda target: "this CPU lacks avx2")
    with pytest.raises(RuntimeError, match="int8_dot cannot run here: this CPU lacks avx2; use int8_dot_on_xla"):
        native.int8_dot(jnp.zeros((1, 8), jnp.int8), jnp.zeros((2, 2, 16, 4), jnp.uint8))
    assert not route.use_tiles(32, 8) and not route.use_panels(32, jnp.float32)


@pytest.mark.parametrize("target", [native.F32_DOT, native.INT4_DOT, native.INT8_DENSE])
def test_a_dot_gives_each_row_the_same_bits_alone(target):
    """A row's bits do not depend on the rows computed beside it (a prompt's chunks and a batch's rows agree)."""
    entry = native.kernel(target)
    _needs(entry)
    rng = np.random.default_rng(4)
    cases = {native.F32_DOT: lambda: _f32_case(rng, 21, 70, 8), native.INT4_DOT: lambda: _int4_case(rng, 21, 256, 37, 32),
             native.INT8_DENSE: lambda: _int8_dense_case(rng, 21, 64, 37)}
    (x, *weights), _ = cases[target]()
    got = np.asarray(entry.wrapper(x, *weights))
    for row in (0, 8, 20):
        np.testing.assert_array_equal(np.asarray(entry.wrapper(x[row:row + 1], *weights))[0], got[row])


def test_the_4_bit_dot_gives_rows_and_tiles_the_same_bits():
    """Tiling moves the blocks, not the sums: one row, two, and a blocked batch."""
    entry = native.kernel(native.INT4_DOT)
    _needs(entry)
    rng = np.random.default_rng(8)
    for rows in (1, 2, 9):
        (x, packed, scale), _ = _int4_case(rng, rows, 512, 40, 32)
        tiles = int4.tile(int4.Int4Weights(packed, scale))
        np.testing.assert_array_equal(np.asarray(native.int4_dot(x, tiles.tiles, tiles.scale)),
                                      np.asarray(native.int4_dot(x, packed, scale)))


# The kernels with an AVX-512 body and an AVX2 one (`native.h`'s `Avx512`; KVATTN_NATIVE_AVX2 picks the second).
TWO_BODIES = [native.INT8_DOT, native.INT8_DENSE, native.DECODE_ATTENTION, native.PAGED_DECODE_ATTENTION, native.F32_DOT,
              native.BF16_DOT, native.READ_MAX, native.PREFILL_ATTENTION, native.PAGED_PREFILL_ATTENTION]


@pytest.mark.parametrize("target", TWO_BODIES)
def test_the_avx2_bodies_pass_the_harness_and_give_the_avx512_bodies_bits(target, monkeypatch):
    """Every case and poison through the AVX2 body (the only one on a CPU without AVX-512), and the same bits
    as the AVX-512 body where both run: each output is the same in-order sum."""
    entry = native.kernel(target)
    _needs(entry)
    harness = HARNESS[target]
    cases = {**harness.cases(np.random.default_rng(0)), **harness.poisons(np.random.default_rng(1))}
    default = {name: jax.tree.leaves(entry.wrapper(*arguments)) for name, (arguments, _) in cases.items()}
    monkeypatch.setenv("KVATTN_NATIVE_AVX2", "1")
    for name, (arguments, want) in cases.items():
        try:
            _check(entry, arguments, want, twin=name not in harness.twin_leaks)
            for got, wide in zip(jax.tree.leaves(entry.wrapper(*arguments)), default[name], strict=True):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(wide))
        except AssertionError as error:
            raise AssertionError(f"{entry.name}'s AVX2 body on {name}") from error


def test_the_paged_kernels_give_the_contiguous_kernels_bits():
    """Read page by page, each sum runs in position order as over a contiguous cache: the same bits."""
    for target in (native.DECODE_ATTENTION, native.PAGED_DECODE_ATTENTION):
        _needs(native.kernel(target))
    (q, k_pages, v_pages, table, filled), _ = _paged_case(np.random.default_rng(5), 2, 3, 32, 4, [9, 0, 4, 13])

    def contiguous(pool):
        return np.swapaxes(pool[table], 1, 2).reshape(len(table), pool.shape[1], -1, pool.shape[-1])

    paged = native.paged_decode_attention(q, k_pages, v_pages, table, filled)
    want = native.decode_attention(q, contiguous(k_pages), contiguous(v_pages), filled)
    for got, expected in zip(paged, want, strict=True):
        np.testing.assert_array_equal(got, expected)
    _needs(native.kernel(native.PAGED_PREFILL_ATTENTION))
    (q, k_new, v_new, k_pages, v_pages, table, cache_len, new_len), _ = _paged_prefill_cases(
        np.random.default_rng(6))["gqa3-ragged-padding"]
    np.testing.assert_array_equal(
        native.paged_prefill_attention(q, k_new, v_new, k_pages, v_pages, table, cache_len, new_len),
        native.prefill_attention(q, k_new, v_new, contiguous(k_pages), contiguous(v_pages), cache_len, new_len))


def test_a_chunk_row_has_the_bits_of_its_token_alone():
    """Rows in groups of blocks and keys in tiles leave each row's sums in key order: a token's outputs in a
    chunk of 25 (75 rows, two groups; 315 keys, two tiles) are, to the bit, those of the token alone over the
    same keys (one block, one tile less)."""
    _needs(native.kernel(native.PREFILL_ATTENTION))
    (q, k_new, v_new, keys, values, cache_len, new_len), _ = _prefill_cases(
        np.random.default_rng(7))["gqa3-tiles-and-groups"]
    chunk = np.asarray(native.prefill_attention(q, k_new, v_new, keys, values, cache_len, new_len))
    for t in (0, 13, 24):
        held = int(cache_len[0]) + t
        k_cache, v_cache = (np.concatenate([cache[:, :, : cache_len[0]], new[:, :t].transpose(0, 2, 1, 3)], axis=2)
                            for cache, new in ((keys, k_new), (values, v_new)))
        alone = native.prefill_attention(q[:, t : t + 1], k_new[:, t : t + 1], v_new[:, t : t + 1], k_cache, v_cache,
                                          np.int32([held]), np.int32([1]))
        np.testing.assert_array_equal(np.asarray(alone), chunk[:, t : t + 1], err_msg=f"token {t}")


def test_a_cached_layer_differentiates_on_the_native_kernels_as_on_xla():
    """Through a layer: a ragged prefill (the prefill kernel) then a step (the decode kernel), against XLA's."""
    for target in (native.DECODE_ATTENTION, native.PREFILL_ATTENTION):
        _needs(native.kernel(target))
    rng = np.random.default_rng(2)
    xs, x = (jnp.asarray(rng.standard_normal((*shape, 64)).astype(np.float32)) for shape in ((3, 5), (3,)))
    lengths = jnp.asarray([5, 3, 0], jnp.int32)
    grads = {}
    for kernel in ("auto", "xla"):
        built = kvattn.MultiHeadAttention(4, 64, num_kv_heads=2, batch_size=3, rngs=nnx.Rngs(0), max_len=16,
                                          cache_layout="heads_major", decode_kernel=kernel)

        def loss(weights, xs, x, built=built):
            ys, cache = extend(weights, built.cache, xs, lengths, config=built.config)
            y, _ = extend(weights, cache, x[:, None], jnp.ones((3,), jnp.int32), config=built.config)
            return jnp.sum(ys**2) + jnp.sum(jnp.sin(y))

        grads[kernel] = jax.grad(loss, argnums=(0, 1, 2))(built.weights, xs, x)
    for got, want in zip(jax.tree.leaves(grads["auto"]), jax.tree.leaves(grads["xla"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    return set(cpuinfo.read_text().split()) if platform.machine() == "x86_64" and cpuinfo.exists() else set()


def test_every_kernel_the_cpu_can_run_is_built_and_runs():
    """A build that silently failed would only make models slower, every other test still passing: not here
    (the CPU's features read from /proc/cpuinfo, not from the extension)."""
    runnable = [entry for entry in native.KERNELS if set(entry.features) <= _cpu_flags()]
    if not runnable:
        pytest.skip("this CPU lacks AVX2, which every native kernel needs")
    assert {entry.name: native.unavailable_reason(entry.target) for entry in runnable} == {
        entry.name: None for entry in runnable}
