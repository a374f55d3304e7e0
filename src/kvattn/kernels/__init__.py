"""Attention through jax's Pallas GPU kernels or kvattn's native CPU kernels, and the rules that pick them.

A decode step (one new token per sequence) reads the whole cache once; on a
GPU, jax's Pallas kernels do that in one pass, split over the slots:

- a contiguous cache goes through `jax.experimental.pallas.ops.gpu.decode_attention.gqa`,
  which wants keys and values `(B, K, S, H)` per kv head: a heads-major cache
  as it lies (the two transposes that frame `gqa` cancel);
- a paged pool goes through the kernel body of
  `jax.experimental.pallas.ops.gpu.paged_attention`, with block specs that
  read kvattn's pools `(P, page, K, H)` or `(P, K, page, H)` where they lie
  (jax's own wrapper wants `(K, P, page, H)`: a transpose of the whole pool
  every step).

On XLA:CPU, a contiguous float32 heads-major cache goes through
`kvattn.kernels.native.decode_attention` instead (AVX512), where it is built and
the CPU runs it: one pass over the visible slots, where XLA's path reads a
bucket of the cache under a `cond` in several thunks. A chunk of several new
tokens (a prefill) over such a cache goes through
`kvattn.kernels.native.prefill_attention` (`chunk_route`, `contiguous_chunk`): no
Pallas kernel here takes chunks.

The decode kernels return unnormalised partial sums (per split of the
slots), which are combined here (a new token that the cache does not hold
yet joins as one more term), so a query that sees nothing gets exact zeros,
as from `kvattn.math.ops`, rather than the kernels' `0 / eps`. The prefill kernel
returns normalised outputs, zeros for padding queries.

`route` decides, per call, from `AttentionConfig.decode_kernel` (carried by
the cache types as their static `kernel` field) and from what the call asks:

- `"xla"`: `kvattn.math.ops`; more than one new token per sequence (prefill)
  takes `chunk_route` instead.
- `"auto"`: the Pallas kernel when `jax.default_backend()` is `"gpu"`, the
  layer is not sharded, the kernel serves the call (see `contiguous_limits`,
  `paged_limits`) and reads the cache in place; on the CPU, the native
  kernel under the same conditions (see `native_limits`); else `kvattn.math.ops`.
- `"pallas"`: the kernel, or `UnsupportedConfigError` naming what it lacks
  (a CPU backend included).
- `"interpret"`: the kernel in Pallas's interpret mode, on any backend (what
  the tests run on CPU), under the same limits.

Both kernels run their dots on float32 operands (an int8 pool is converted
in the kernel, its scales applied as `kvattn.math.ops` does) at the backend's
default matmul precision: TF32 on recent NVIDIA GPUs, as XLA's own float32
dots there. Axis letters follow `kvattn.math.ops`; P pages, M blocks per
sequence in a page table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from kvattn.kernels import native
from kvattn.math import ops
from kvattn.config import HEADS_MAJOR, SLOTS_MAJOR, blocks_spanned
from kvattn.errors import UnsupportedConfigError

__all__ = [
    "cache_kernel", "chunk_route", "contiguous_chunk", "contiguous_limits", "contiguous_step", "native_limits",
    "on_gpu", "paged_limits", "paged_step", "route",
]

# The paged kernel takes query heads in blocks of 16 rows (padded).
BLOCK_H = 16
# Triton's dots and loads: every tile a power of two, at least 16 along a dot.
MIN_TILE = 16
# Slots per compute block and most splits of the slots, as jax's own defaults.
BLOCK_TOKENS = 128
MAX_SPLITS = 16


def cache_kernel(config) -> str:
    """The `kernel` a layer's cache carries: `config.decode_kernel`, and `"xla"` for a sharded layer under `"auto"`.

    A `pallas_call` has no sharding rule: XLA would gather a sharded cache
    onto every device to run it.
    """
    sharded = config.data_axis is not None or config.model_axis is not None
    return "xla" if sharded and config.decode_kernel == "auto" else config.decode_kernel


def on_gpu() -> bool:
    """Whether the default backend is a GPU (the tests replace this to check the rule)."""
    return jax.default_backend() == "gpu"


def route(mode: str, cannot: str | None, *, in_place: bool = True,
          native_cannot: str | None = "no native kernel reads this cache") -> str:
    """Which path a decode step takes: `"xla"`, `"pallas"` (compiled for the GPU), `"interpret"` or `"native"`.

    Args:
      mode: `AttentionConfig.decode_kernel`, as the cache carries it.
      cannot: why the Pallas kernel cannot serve this call
        (`contiguous_limits`, `paged_limits`), or None.
      in_place: whether the kernel would read the cache where it lies;
        `"auto"` takes the kernel only then, a forced mode pays the copy.
      native_cannot: why the native CPU kernel cannot serve this call
        (`native_limits`), or None; `"auto"` takes it on a CPU backend.

    Raises:
      UnsupportedConfigError: a forced mode (`"pallas"`, `"interpret"`) the
        call cannot take, or `"pallas"` on a backend that is not a GPU.
    """
    if mode == "xla":
        return "xla"
    if mode == "auto":
        if on_gpu():
            return "pallas" if cannot is None and in_place else "xla"
        return "native" if native_cannot is None and in_place and jax.default_backend() == "cpu" else "xla"
    if cannot is None and mode == "pallas" and not on_gpu():
        cannot = f"the backend is {jax.default_backend()!r}, not a GPU ('interpret' runs the kernel anywhere, slowly)"
    if cannot is not None:
        raise UnsupportedConfigError(
            f"decode_kernel={mode!r}, but the Pallas kernel cannot serve this decode step: {cannot}; "
            "use decode_kernel='auto' (XLA there) or 'xla'"
        )
    return mode


def chunk_route(mode: str, native_cannot: str | None) -> str:
    """Which path a chunk of several new tokens per sequence takes: `"native"` or `"xla"`.

    The native prefill kernel under `"auto"` on a CPU backend, where it
    serves the call (`native_limits`, read first); XLA everywhere else. No
    Pallas kernel takes chunks, so a forced decode kernel (`"pallas"`,
    `"interpret"`) leaves them on XLA rather than refusing them.
    """
    usable = native_cannot is None and not on_gpu() and jax.default_backend() == "cpu"
    return "native" if mode == "auto" and usable else "xla"


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _head_dim_limit(head_dim: int) -> str | None:
    if head_dim < MIN_TILE or not _power_of_two(head_dim):
        return f"head_dim {head_dim} is not a power of two >= {MIN_TILE} (Triton's tiles)"
    return None


def contiguous_limits(
    k_cache: Shaped[Array, "B ..."],
    k_scale: Array | None,
    layout: str,
    *,
    window: int | None,
    write_first: bool,
    logit_softcap: float | None,
) -> str | None:
    """Why `decode_attention.gqa` cannot serve a decode step over this contiguous cache, or None.

    It has no soft-cap, no int8 scales, and reads one interval of slots: a
    ring read before the write would have to skip the slot about to be
    overwritten. Its dots take the query in the cache's dtype, so a
    bfloat16 cache would round queries and weights to bfloat16, below the
    float32 attention math kvattn promises. Slots split evenly into tiles of
    16 or more.
    """
    num_slots, head_dim = k_cache.shape[layout.index("S")], k_cache.shape[-1]
    cannot = _float32_interval("decode kernel", k_cache, k_scale, window=window, write_first=write_first,
                               logit_softcap=logit_softcap)
    if cannot is None and num_slots % MIN_TILE:
        cannot = f"{num_slots} slots are not a multiple of {MIN_TILE}"
    return cannot or _head_dim_limit(head_dim)


def _float32_interval(kernel: str, k_cache, k_scale, *, window, write_first, logit_softcap) -> str | None:
    """What both contiguous kernels need: float32 values, no soft-cap, one interval of slots to read."""
    if k_scale is not None or k_cache.dtype != jnp.float32:
        return f"the cache is {k_cache.dtype}; the {kernel} reads float32 caches"
    if logit_softcap is not None:
        return f"the {kernel} has no logit soft-cap"
    if window is not None and not write_first:
        return "a ring read before the write must skip one slot (the drivers write first)"
    return None


def native_limits(
    k_cache: Shaped[Array, "B ..."],
    k_scale: Array | None,
    layout: str,
    *,
    window: int | None,
    write_first: bool,
    logit_softcap: float | None,
) -> str | None:
    """Why kvattn's native kernels cannot serve a call over this contiguous cache, or None.

    `kvattn.kernels.native.decode_attention` (a step) and `prefill_attention` (a
    chunk, read first) read float32 heads-major caches (one interval of
    slots, as the Pallas kernel), have no soft-cap, and take head dims in
    16-float vectors.
    """
    if not (native.available(native.DECODE_ATTENTION) and native.available(native.PREFILL_ATTENTION)):
        return "kvattn's native attention kernels are not built or cannot run on this CPU"
    if layout != HEADS_MAJOR:
        return "the native kernel reads heads-major caches"
    cannot = _float32_interval("native kernel", k_cache, k_scale, window=window, write_first=write_first,
                               logit_softcap=logit_softcap)
    if cannot is None and k_cache.shape[-1] % 16:
        cannot = f"head_dim {k_cache.shape[-1]} is not a multiple of 16"
    return cannot


def paged_limits(k_pages: Shaped[Array, "P ..."], layout: str, *, window: int | None) -> str | None:
    """Why the paged kernel cannot serve a decode step over this pool, or None.

    It reads every position from the sequence's first (no window), in whole
    pages (a power of two of slots), from float32 pools or int8 ones with
    their scales (bfloat16: see `contiguous_limits`). It soft-caps as
    `kvattn.math.ops` does.
    """
    page_size = k_pages.shape[1 if layout == SLOTS_MAJOR else 2]
    if k_pages.dtype not in (jnp.float32, jnp.int8):
        return f"the pool is {k_pages.dtype}; the paged kernel reads float32 or int8 pools"
    if window is not None:
        return "the paged kernel has no window (it reads from each sequence's first position)"
    if not _power_of_two(page_size):
        return f"page_size {page_size} is not a power of two (Triton's tiles)"
    return _head_dim_limit(k_pages.shape[-1])


def _normalised(o, total, new_len):
    """Partial sums `(B, K, G, H)` over their total weight, exact zeros for a query that sees nothing or is padding."""
    batch, num_kv_heads, group, head_dim = o.shape
    ctx = o / jnp.where(total > 0, total, 1.0)[..., None]
    ctx = jnp.where((new_len > 0)[:, None, None, None], ctx, 0.0)
    return ctx.reshape(batch, 1, num_kv_heads * group, head_dim)


# ------------------------------------------------------------ contiguous caches


def _gqa_tiles(num_slots: int) -> tuple[int, int]:
    """`(k_splits, block_k)` for `gqa`: powers of two, `block_k >= 16` dividing each split."""
    k_splits = MAX_SPLITS
    while num_slots % (k_splits * MIN_TILE):
        k_splits //= 2
    split = num_slots // k_splits
    block_k = BLOCK_TOKENS
    while split % block_k:
        block_k //= 2
    return k_splits, block_k


def contiguous_step(
    q: Float[Array, "B 1 N H"],
    new_len: Int[Array, " B"],
    k_cache: Float[Array, "B ..."],
    v_cache: Float[Array, "B ..."],
    visible: Int[Array, " B"],
    layout: str,
    *,
    new: tuple[Float[Array, "B 1 K H"], Float[Array, "B 1 K H"]] | None = None,
    interpret: bool = False,
    native_kernel: bool = False,
) -> Float[Array, "B 1 N H"]:
    """Attention of one query per sequence over slots `0 .. visible[b] - 1` of a contiguous cache, on `gqa`.

    Every slot below `visible[b]` is seen (a ring written first sees all its
    filled slots: `min(filled, window)`). `new = (k, v)` adds the new token,
    not yet written, as one more key (the layer reads first, then writes).

    Args:
      q: the new tokens' queries, unscaled.
      new_len: 1 for a real query, 0 for padding (zeros out).
      k_cache, v_cache: `(B, S, K, H)` or heads-major `(B, K, S, H)`, float32.
      visible: slots each query sees.
      layout: the caches' layout.
      new: the new token's key and value, when the cache does not hold them.
      interpret: run the Pallas kernel in its interpret mode.
      native_kernel: run `kvattn.kernels.native.decode_attention` (CPU, heads-major)
        instead of the Pallas kernel.
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    num_kv_heads = k_cache.shape[layout.index("K")]
    grouped = ops.grouped_queries(q, num_kv_heads)[:, 0]  # one query per sequence: (B, K, G, H)
    batch, _, group, head_dim = grouped.shape
    if native_kernel:
        o, total, running_max = native.decode_attention(grouped, k_cache, v_cache, visible.astype(jnp.int32))
    else:
        if layout == HEADS_MAJOR:  # gqa swaps the axes back: XLA removes both transposes
            k_cache, v_cache = jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2)
        k_splits, block_k = _gqa_tiles(k_cache.shape[1])
        o, (total, running_max) = decode_attention.gqa(
            grouped.reshape(batch, num_kv_heads * group, head_dim), k_cache, v_cache, kv_seq_len=visible,
            sm_scale=1.0, block_k=block_k, k_splits=k_splits, interpret=interpret, return_residuals=True,
            normalize_output=False,
        )
        o = o.reshape(grouped.shape)
        total, running_max = (x.reshape(grouped.shape[:-1]) for x in (total, running_max))
    if new is not None:
        k_new, v_new = new
        score = jnp.einsum("BKGH,BKH->BKG", grouped, k_new[:, 0])
        top = jnp.maximum(running_max, score)
        old, fresh = jnp.exp(running_max - top), jnp.exp(score - top)
        o = o * old[..., None] + fresh[..., None] * v_new[:, 0, :, None, :]
        total = total * old + fresh
    return _normalised(o, total, new_len)


def contiguous_chunk(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    new_len: Int[Array, " B"],
    k_cache: Float[Array, "B K S H"],
    v_cache: Float[Array, "B K S H"],
    cache_len: Int[Array, " B"],
) -> Float[Array, "B T N H"]:
    """`kvattn.math.ops.attention` of a chunk read first over a float32 heads-major cache, natively.

    On `kvattn.kernels.native.prefill_attention`: no window and no soft-cap
    (`native_limits`).
    """
    return native.prefill_attention(q, k, v, k_cache, v_cache, cache_len.astype(jnp.int32), new_len.astype(jnp.int32))


# ------------------------------------------------------------------- paged pools


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _paged_tiles(width: int, page_size: int) -> tuple[int, int, int]:
    """`(pages_per_compute_block, k_splits, padded_width)` for a table of `width` blocks.

    A compute block holds about `BLOCK_TOKENS` slots and at least 16 (a
    power of two of pages); the table is padded so its splits hold whole
    compute blocks.
    """
    fewest = max(1, MIN_TILE // page_size)
    per_block = max(fewest, min(max(1, BLOCK_TOKENS // page_size), _next_power_of_two(width)))
    blocks = -(-width // per_block)
    k_splits = min(MAX_SPLITS, blocks)
    per_split = -(-blocks // k_splits) * per_block
    return per_block, k_splits, k_splits * per_split


def _kernel_table(table, filled, page_size: int, width: int):
    """The page table padded to `width`, every block past the last filled one pointing at that one.

    The kernel reads whole compute blocks and masks what lies past `filled`
    with a weight of exactly zero; a page from the sequence itself keeps
    that weight's product finite (zero times a NaN some free page holds
    would not be zero).
    """
    num_blocks = table.shape[1]
    used = blocks_spanned(filled, page_size)
    last = jnp.take_along_axis(table, jnp.clip(used - 1, 0, num_blocks - 1)[:, None], axis=1)
    padded = jnp.pad(table, ((0, 0), (0, width - num_blocks)))
    return jnp.where(jnp.arange(width)[None, :] < used[:, None], padded, last)


def _paged_partials(q, k_pages, k_scale, v_pages, v_scale, table, filled, *, layout, page_size, per_block,
                    k_splits, logit_softcap, interpret):
    """jax's paged kernel over one sequence, per split: `o (k_splits, K, G', H)`, `total`, `max (k_splits, K, G')`.

    `q` is `(K, G', H)`, its group padded to a multiple of `BLOCK_H`. The
    pools are read in kvattn's layout: kv head h is a strided slice.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu import paged_attention

    num_kv_heads, padded_group, head_dim = q.shape
    num_pages = k_pages.shape[0]
    tables = table.reshape(k_splits, -1)
    if layout == SLOTS_MAJOR:  # (P, page, K, H)
        pool = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda h, i, s: (0, 0, h, 0))
        scales = pl.BlockSpec((num_pages, page_size, None), lambda h, i, s: (0, 0, h))
    else:  # (P, K, page, H)
        pool = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda h, i, s: (0, h, 0, 0))
        scales = pl.BlockSpec((num_pages, None, page_size), lambda h, i, s: (0, h, 0))
    scales = None if k_scale is None else scales
    kernel = functools.partial(
        paged_attention.paged_attention_kernel, num_heads=padded_group, pages_per_compute_block=per_block,
        mask_value=paged_attention.DEFAULT_MASK_VALUE, attn_logits_soft_cap=logit_softcap,
    )
    per_split = jax.ShapeDtypeStruct((k_splits, num_kv_heads, padded_group), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, padded_group // BLOCK_H, k_splits),
        in_specs=[
            pl.BlockSpec((None, BLOCK_H, head_dim), lambda h, i, s: (h, i, 0)),
            pool, scales, pool, scales,
            pl.BlockSpec((None, tables.shape[1]), lambda h, i, s: (s, 0)),
            pl.BlockSpec((1,), lambda h, i, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, BLOCK_H, head_dim), lambda h, i, s: (s, h, i, 0)),
            pl.BlockSpec((None, None, BLOCK_H), lambda h, i, s: (s, h, i)),
            pl.BlockSpec((None, None, BLOCK_H), lambda h, i, s: (s, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((k_splits, *q.shape), jnp.float32), per_split, per_split],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=2),
        name="kvattn_paged_attention",
    )(q, k_pages, k_scale, v_pages, v_scale, tables, filled[None])


def paged_step(
    q: Float[Array, "B 1 N H"],
    new_len: Int[Array, " B"],
    k_pages: Shaped[Array, "P ..."],
    v_pages: Shaped[Array, "P ..."],
    table: Int[Array, "B M"],
    filled: Int[Array, " B"],
    layout: str,
    *,
    k_scale: Float[Array, "P ..."] | None = None,
    v_scale: Float[Array, "P ..."] | None = None,
    logit_softcap: float | None = None,
    interpret: bool = False,
) -> Float[Array, "B 1 N H"]:
    """Attention of one query per sequence over positions `0 .. filled[b] - 1` of a paged pool, on jax's kernel.

    The pool must hold the new token already (written first) and finite
    values in the slots past `filled[b]` of the sequence's last page (see
    `kvattn.caches.paged.zero_page_tails`); pages past it are never read.

    Args:
      q: the new tokens' queries, unscaled.
      new_len: 1 for a real query, 0 for padding (zeros out).
      k_pages, v_pages: the pools, `(P, page, K, H)` or `(P, K, page, H)`.
      table: each sequence's pages, block by block.
      filled: positions each sequence holds, the new token included.
      layout: the view layout naming the pool's (`"BSKH"` or `"BKSH"`).
      k_scale, v_scale: int8 pools' scales, `(P, page, K)` or `(P, K, page)`.
      logit_softcap: as in `kvattn.math.ops.masked_softmax`.
      interpret: run the kernel in Pallas's interpret mode.
    """
    page_size = k_pages.shape[1 if layout == SLOTS_MAJOR else 2]
    num_kv_heads = k_pages.shape[2 if layout == SLOTS_MAJOR else 1]
    grouped = ops.grouped_queries(q, num_kv_heads)[:, 0]  # one query per sequence: (B, K, G, H)
    group = grouped.shape[2]
    padded = jnp.pad(grouped, ((0, 0), (0, 0), (0, -group % BLOCK_H), (0, 0)))
    per_block, k_splits, width = _paged_tiles(table.shape[1], page_size)
    partials = functools.partial(
        _paged_partials, layout=layout, page_size=page_size, per_block=per_block, k_splits=k_splits,
        logit_softcap=logit_softcap, interpret=interpret,
    )
    filled = filled.astype(jnp.int32)
    o, total, running_max = jax.vmap(partials, in_axes=(0, None, None, None, None, 0, 0))(
        padded, k_pages, k_scale, v_pages, v_scale, _kernel_table(table, filled, page_size, width), filled
    )
    # Splits that read nothing hold zeros and the float32 minimum, never -inf: exp(0) = 1 keeps them zero.
    top = jnp.max(running_max, axis=1, keepdims=True)
    rescale = jnp.exp(running_max - top)
    o = jnp.sum(o * rescale[..., None], axis=1)[:, :, :group]
    total = jnp.sum(total * rescale, axis=1)[:, :, :group]
    return _normalised(o, total, new_len)
