"""jax's Pallas GPU decode kernels, read where kvattn's caches lie (`kvattn.kernels.route` picks them).

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

Both return unnormalised partial sums (per split of the slots), combined
here (`kvattn.kernels.partials`). `interpret=True` runs them in Pallas's
interpret mode on any backend (what the tests run on the CPU). Both run
their dots on float32 operands (an int8 pool is converted in the kernel,
its scales applied as `kvattn.math.ops` does) at the backend's default
matmul precision: TF32 on recent NVIDIA GPUs, as XLA's own float32 dots
there. Axis letters follow `kvattn.math.ops`; P pages, M blocks per
sequence in a page table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from kvattn.caches.base import HEADS_MAJOR, SLOTS_MAJOR, blocks_spanned
from kvattn.kernels import partials
from kvattn.math import ops

__all__ = ["BLOCK_H", "MIN_TILE", "contiguous_step", "paged_step"]

# The paged kernel takes query heads in blocks of 16 rows (padded).
BLOCK_H = 16
# Triton's dots and loads: every tile a power of two, at least 16 along a dot.
MIN_TILE = 16
# Slots per compute block and most splits of the slots, as jax's own defaults.
BLOCK_TOKENS = 128
MAX_SPLITS = 16



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
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    num_kv_heads = k_cache.shape[layout.index("K")]
    grouped = ops.grouped_queries(q, num_kv_heads)[:, 0]  # one query per sequence: (B, K, G, H)
    batch, _, group, head_dim = grouped.shape
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
    return partials.normalised(*partials.joined(grouped, o, total, running_max, new), new_len)


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
    per_split = functools.partial(
        _paged_partials, layout=layout, page_size=page_size, per_block=per_block, k_splits=k_splits,
        logit_softcap=logit_softcap, interpret=interpret,
    )
    filled = filled.astype(jnp.int32)
    o, total, running_max = jax.vmap(per_split, in_axes=(0, None, None, None, None, 0, 0))(
        padded, k_pages, k_scale, v_pages, v_scale, _kernel_table(table, filled, page_size, width), filled
    )
    # Splits that read nothing hold zeros and the float32 minimum, never -inf: exp(0) = 1 keeps them zero.
    top = jnp.max(running_max, axis=1, keepdims=True)
    rescale = jnp.exp(running_max - top)
    o = jnp.sum(o * rescale[..., None], axis=1)[:, :, :group]
    total = jnp.sum(total * rescale, axis=1)[:, :, :group]
    return partials.normalised(o, total, new_len)
