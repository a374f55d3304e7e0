"""The paged KV cache type: one pool of fixed-size pages shared by a batch, read through page tables.

A `PagedKVCache` is the device half of paging (the host half, which decides
which page holds what, is `kvattn.paging.PageManager`). Its arrays:

- the pool: keys and values as `Stored` pages, `(P, page, K, H)`
  ("slots_major") or `(P, K, page, H)` ("heads_major"), with int8's scales
  `(P, page, K)` / `(P, K, page)`. Page 0 is the null page: table entries
  that map nothing point at it, and nothing is ever written to it.
- `table` `(B, M)` int32: sequence b's logical block j (positions
  `j*page .. (j+1)*page - 1`) lives in page `table[b, j]`.
- `pos` `(B,)` int32: tokens each sequence held before this call.
- `copy_from`, `copy_to` `(C,)` int32: copy-on-write copies to make before
  any write (a destination `>= P` is padding and dropped).

All of them have fixed shapes, so one compiled program serves every mix of
requests; only their values change as sequences come and go.

Attention reads a sequence through *views*: a chunk of its blocks at a time
gathered into a contiguous `(B, S, K, H)` buffer (or `(B, K, S, H)`), with
every slot that holds no token of the sequence (unfilled, unmapped, outside
the window) zeroed, so whatever a free page holds (NaN included) never
reaches an output. The chunks go through `ops.chunked_cached_attention`,
masked by the same `ops.masked_scores` as the contiguous cache. Positions
are logical: slot s of a view starting at block f holds position
`f*page + s`.

`PagedKVCache` is the cache type of the `kvattn.caches.base.Paged` spec and
implements `kvattn.caches.base.CacheType` (`fits`, `attend`, `commit`;
`variables`, `bind`, `unbind` on the layer's side): it always writes first,
then reads, so `commit` has nothing left to write. A decode step may read through
jax's Pallas paged-attention kernel instead (on a GPU), or kvattn's native
one (on the CPU; `kvattn.kernels.route`), each reading the pool where it
lies, page by page.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from kvattn import kernels
from kvattn.math import ops
from kvattn import validation as check
from kvattn.caches.base import NULL_PAGE, Paged, blocks_spanned
from kvattn.caches import views
from kvattn.caches.storage import Stored, capacity_ok, encode
from kvattn.config import AttentionConfig
from kvattn.math.ops import SLOTS_MAJOR

__all__ = [
    "NULL_PAGE",
    "PagedKVCache",
    "append",
    "apply_copies",
    "bind",
    "bound_pool",
    "mapped",
    "unbind",
    "variables",
    "zero_page_tails",
]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("k", "v", "table", "pos", "copy_from", "copy_to"),
    meta_fields=("layout", "window", "kernel", "max_len", "logit_softcap", "block_diagonal"),
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A page pool bound to one call's page tables, positions and pending copies.

    `layout` names the axes of a gathered view (`"BSKH"` for a pool
    `(P, page, K, H)`, `"BKSH"` for `(P, K, page, H)`); `window`, if set,
    limits what a query sees to the last `window` positions (pages that fall
    out of it are freed by the host, not overwritten in a ring); `kernel` is
    `AttentionConfig.decode_kernel` (see `kvattn.kernels`); `max_len` caps
    what a sequence holds (None: its table's blocks); `logit_softcap` and
    `block_diagonal` are what attention reads with (see `kvattn.math.ops`).
    """

    spec: ClassVar[type] = Paged

    k: Any
    v: Any
    table: Any
    pos: Any
    copy_from: Any = None
    copy_to: Any = None
    layout: str = SLOTS_MAJOR
    window: int | None = None
    kernel: str = "auto"
    max_len: int | None = None
    logit_softcap: float | None = None
    block_diagonal: bool = True

    @property
    def page_size(self) -> int:
        return self.k.values.shape[1 if self.layout == SLOTS_MAJOR else 2]

    @property
    def num_pages(self) -> int:
        return self.k.values.shape[0]

    @property
    def capacity(self) -> int:
        """Tokens one sequence may hold: `max_len`, at most its table's blocks times the page size."""
        blocks = self.table.shape[1] * self.page_size
        return blocks if self.max_len is None else min(self.max_len, blocks)

    def replace(self, **changes) -> PagedKVCache:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------- the interface of a cache type

    @classmethod
    def variables(cls, config: AttentionConfig) -> dict:
        return variables(config)

    @classmethod
    def bind(cls, config: AttentionConfig, arrays: dict, **how) -> PagedKVCache:
        return bind(config, arrays, **how)

    def unbind(self, config: AttentionConfig) -> dict:
        return unbind(config, self)

    def fits(self, lengths: Int[Array, " B"]) -> Bool[Array, " B"]:
        """Which sequences may append `lengths` tokens: valid, within capacity, and every block they write mapped."""
        return capacity_ok(self.pos, lengths, self.capacity) & mapped(self, lengths)

    def attend(self, q, k, v, lengths, written, *, write_first: bool):
        """Writes the new tokens (a pool is always written first), then attends over each sequence's pages.

        Reads each sequence's blocks a chunk at a time, as many chunks as the
        batch's longest sequence needs (`ops.chunked_cached_attention`): short
        chunks while the longest chunk would hold it whole, else long ones.
        A pool is written first whatever `write_first` allows (the
        caller's buffers or not): the read goes through the pool.
        """
        cache = self.write(k, v, written, width=q.shape[1])
        return cache.read(q, k, v, written, self.pos), cache

    def _path(self, width: int) -> str:
        """Which attention reads a call of `width` tokens per sequence (`kvattn.kernels.paged_path`)."""
        return kernels.paged_path(self.kernel, width, self.k.values, self.layout, window=self.window,
                                  logit_softcap=self.logit_softcap)

    def write(self, k, v, written, *, width: int) -> PagedKVCache:
        """`attend`'s first half: appends the first `written[b]` keys and values `(B, T, K, H)` of each sequence
        (`append`), and zeroes the page tails where the kernel reading a call of `width` tokens reads whole pages.

        A call that writes several groups of rows (`kvattn.layer.forward.extend_ragged`) makes every write
        before any read, so no read of the pool is ever followed by a write (which would cost XLA a copy of it).
        """
        cache = append(self, k, v, written)
        if self._path(width) not in ("xla", "native"):
            cache = zero_page_tails(cache, cache.pos, written)
        return cache

    def read(self, q, k, v, written, old_pos):
        """`attend`'s second half, on the pool after `write`: queries `q` `(B, T, N, H)` of the sequences that held
        `old_pos` tokens before it and wrote `written` more (`k`, `v` the new ones) over their pages."""
        options = dict(layout=self.layout, window=self.window, block_diagonal=self.block_diagonal,
                       logit_softcap=self.logit_softcap)
        filled = old_pos + written
        path = self._path(q.shape[1])
        if path == "native" and q.shape[1] > 1:  # the chunk from k, v; what came before from the pages
            return kernels.cpu.paged_chunk(q, k, v, written, self.k.values, self.v.values, self.table, old_pos)
        if path == "native":  # reads no slot past `filled`: the page tails need no zeroing
            return kernels.cpu.paged_step(q, written, self.k.values, self.v.values, self.table, filled)
        if path != "xla":
            return kernels.paged_step(
                q, written, self.k.values, self.v.values, self.table, filled, self.layout, k_scale=self.k.scale,
                v_scale=self.v.scale, logit_softcap=options["logit_softcap"], interpret=path == "interpret",
            )
        first = views.first_block(self, old_pos)
        needed = jnp.max(blocks_spanned(filled, self.page_size) - first)
        sizes = views.chunk_sizes(self)

        def read(chunk):
            def attend(cache):
                def read_chunk(index):
                    (k, k_scale), (v, v_scale), slot_positions = views.view(cache, chunk, first + index * chunk, filled)
                    return k, v, k_scale, v_scale, slot_positions

                num_chunks = (needed + chunk - 1) // chunk
                return ops.chunked_cached_attention(q, written, read_chunk, num_chunks, old_pos, v_new=v,
                                                    **options)

            return attend

        if len(sizes) == 1:
            return read(sizes[0])(self)
        return jax.lax.cond(needed > sizes[-1], read(sizes[-1]), read(sizes[0]), self)

    def commit(self, after) -> PagedKVCache:
        """Nothing left pending: `attend` wrote first."""
        return self


def apply_copies(cache: PagedKVCache) -> PagedKVCache:
    """Makes the pending copy-on-write copies (`copy_to[i] <- copy_from[i]`) and clears them.

    One page at a time, in a loop that runs once per real copy: most calls
    have none, and a gather and scatter of every padding entry cost a decode
    step more than its attention. A destination is a page fresh from the
    pool, never another copy's source, so the order of the copies does not
    matter.
    """
    if cache.copy_from is None:
        return cache
    real = cache.copy_to < cache.num_pages
    order = jnp.argsort(~real, stable=True)  # the real copies first, wherever the padding lies

    def copy(i, pools):
        source, destination = cache.copy_from[order[i]], cache.copy_to[order[i]]
        return jax.tree.map(
            lambda pool: jax.lax.dynamic_update_index_in_dim(
                pool, jax.lax.dynamic_index_in_dim(pool, source, keepdims=True), destination, 0), pools)

    k, v = jax.lax.fori_loop(0, jnp.sum(real), copy, (cache.k, cache.v))
    return cache.replace(k=k, v=v, copy_from=None, copy_to=None)


def mapped(cache: PagedKVCache, lengths: Int[Array, " B"]) -> Bool[Array, " B"]:
    """Whether every block sequence b writes (positions `pos[b] .. pos[b] + lengths[b] - 1`) has a page.

    The host reserves pages before a call; a sequence it did not reserve
    for writes nothing and gets NaN outputs rather than writing to the null
    page (never a silent skip).
    """
    blocks = jnp.arange(cache.table.shape[1])[None, :]
    first = cache.pos[:, None] // cache.page_size
    last = (cache.pos[:, None] + lengths[:, None] - 1) // cache.page_size
    written = (blocks >= first) & (blocks <= last)
    return jnp.all(~written | (cache.table != NULL_PAGE), axis=1)


def _slots(cache: PagedKVCache, positions: Int[Array, "B T"], keep: Bool[Array, "B T"]):
    """Pages and in-page offsets of `positions`; positions not kept go to page `P` (dropped)."""
    blocks = jnp.clip(positions // cache.page_size, 0, cache.table.shape[1] - 1)
    pages = jnp.take_along_axis(cache.table, blocks, axis=1)
    keep = keep & (pages != NULL_PAGE)
    return jnp.where(keep, pages, cache.num_pages), positions % cache.page_size


def _put(cache: PagedKVCache, stored: Stored, pages, slots, new: Stored) -> Stored:
    """`stored` with rows `new` (`(B, T, K[, H])`) written at `pages`, `slots` (`(B*T,)`; page `P` is dropped)."""
    new = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), new)  # (B*T, K[, H])
    if cache.layout == SLOTS_MAJOR:
        return jax.tree.map(lambda pool, x: pool.at[pages, slots].set(x, mode="drop"), stored, new)
    return jax.tree.map(lambda pool, x: pool.at[pages, :, slots].set(x, mode="drop"), stored, new)


def append(cache: PagedKVCache, k_new, v_new, lengths: Int[Array, " B"]) -> PagedKVCache:
    """Writes the first `lengths[b]` new keys and values `(B, T, K, H)` of each sequence and advances `pos`.

    Pending copies are made first. The caller has checked capacity and
    mapping and passes zero `lengths` for sequences that must not change.
    """
    cache = apply_copies(cache)
    offsets = jnp.arange(k_new.shape[1])[None, :]
    pages, slots = _slots(cache, cache.pos[:, None] + offsets, offsets < lengths[:, None])
    pages, slots = pages.reshape(-1), slots.reshape(-1)

    def put(stored: Stored, new):
        return _put(cache, stored, pages, slots, encode(new, stored.values.dtype))

    return cache.replace(k=put(cache.k, k_new), v=put(cache.v, v_new), pos=cache.pos + lengths)


def zero_page_tails(cache: PagedKVCache, filled: Int[Array, " B"], written: Int[Array, " B"]) -> PagedKVCache:
    """Zeroes the slots past position `filled[b] - 1` in the page each writing sequence wrote last.

    Those slots hold no token of the sequence (a page's earlier owner may
    have left anything there, NaN included). A kernel that reads whole pages
    weighs them exactly zero, and zero times NaN is not zero. The page was
    just written, so it is the sequence's alone (copy-on-write).
    """
    offsets = jnp.arange(cache.page_size)[None, :]
    positions = filled[:, None] + offsets
    same_page = positions // cache.page_size == (filled[:, None] - 1) // cache.page_size
    pages, slots = _slots(cache, positions, same_page & (written[:, None] > 0))
    pages, slots = pages.reshape(-1), slots.reshape(-1)
    values = cache.k.values
    zeros = jnp.zeros((*positions.shape, values.shape[2 if cache.layout == SLOTS_MAJOR else 1], values.shape[-1]))

    def put(stored: Stored):
        return _put(cache, stored, pages, slots, encode(zeros, stored.values.dtype))

    return cache.replace(k=put(cache.k), v=put(cache.v))


# ------------------------------------------------------------ the layer's side


def variables(config: AttentionConfig) -> dict[str, tuple[tuple, tuple, jnp.dtype]]:
    """The `nnx.Cache` arrays of a paged layer: one pool for the whole batch, name -> (shape, mesh axes, dtype).

    Pages `(P, page, K, H)` (heads-major `(P, K, page, H)`), and int8's scales.
    """
    spec = config.cache
    if config.layout == SLOTS_MAJOR:
        pages, axes = (spec.num_pages, spec.page_size, config.num_kv_heads), (None, None, config.model_axis)
    else:
        pages, axes = (spec.num_pages, config.num_kv_heads, spec.page_size), (None, config.model_axis, None)
    dtype = jnp.dtype(spec.dtype)
    specs = {
        "k_pages": ((*pages, config.head_dim), (*axes, None), dtype),
        "v_pages": ((*pages, config.head_dim), (*axes, None), dtype),
    }
    if spec.dtype == "int8":
        specs["k_page_scale"] = (pages, axes, jnp.dtype(jnp.float32))
        specs["v_page_scale"] = (pages, axes, jnp.dtype(jnp.float32))
    return specs


def bind(config: AttentionConfig, arrays: dict, *, pages=None, lengths=None, batched: bool = True,
         operation: str = "this call") -> PagedKVCache:
    """The pool bound to one call's `PageBatch` (checked, with `lengths`, before any state changes).

    A pool is always batched (`batched` is for the contiguous cache's views).

    Without `pages` there is no sequence to speak of: `reset`, `truncate`,
    `fork` and `reorder` belong to the host `PageManager`, and are refused.
    """
    if pages is None:
        if lengths is None:
            raise ValueError(
                f"{operation} is not a paged layer's operation: its sequences live in pages that the host "
                "kvattn.PageManager owns (use its free/truncate/fork/reorder), and each call gets a PageBatch"
            )
        raise ValueError("a paged layer needs pages=: the PageBatch that PageManager.reserve(counts) returns")
    table, pos, copy_from, copy_to = _checked_pages(config, pages, lengths, lengths.shape[0])
    return bound_pool(config, arrays, table, pos, copy_from, copy_to)


def bound_pool(config: AttentionConfig, arrays: dict, table, pos, copy_from=None, copy_to=None) -> PagedKVCache:
    """The pool's arrays as a `PagedKVCache` bound to tables, positions and copies, unchecked."""
    return PagedKVCache(
        k=Stored(arrays["k_pages"], arrays.get("k_page_scale")), v=Stored(arrays["v_pages"], arrays.get("v_page_scale")),
        table=table, pos=pos, copy_from=copy_from, copy_to=copy_to, layout=config.layout, window=config.window,
        kernel=kernels.cache_kernel(config), max_len=config.cache.max_len, logit_softcap=config.logit_softcap,
        block_diagonal=not config.heads_split,
    )


def _checked_pages(config: AttentionConfig, pages, lengths, batch: int) -> tuple:
    """A `PageBatch`'s arrays for `batch` rows as int32 (`table`, `pos`, `copy_from`, `copy_to`), checked when not traced.

    Eagerly it also checks that every block the call writes has a page (the
    host reserved them), raising `CacheOverflowError` for a sequence past
    `max_len` and `ValueError` for a missing reservation, before any state changes.
    """
    width = config.cache.pages_per_sequence
    table = check.ints(pages.table, "pages.table", ((batch, width),), 0, config.cache.num_pages - 1, half_open=True)
    pos = check.ints(pages.pos, "pages.pos", ((batch,),), 0, config.cache.max_len)
    copies = getattr(pages, "copy_from", None)
    if copies is not None:
        num_pages = config.cache.num_pages
        copy_from = check.ints(pages.copy_from, "pages.copy_from", (np.shape(copies),), 0, num_pages - 1)
        copy_to = check.ints(pages.copy_to, "pages.copy_to", (np.shape(copies),), 1, num_pages)
        copies = (copy_from, copy_to)
    if not check.is_traced(table, pos, lengths):
        check.capacity(config, pos, lengths)
        lengths = np.broadcast_to(check.host(lengths), pos.shape)
        page = config.cache.page_size
        for b in np.flatnonzero(lengths):
            blocks = np.arange(pos[b] // page, (pos[b] + lengths[b] - 1) // page + 1)
            if np.any(table[b, blocks] == 0):
                raise ValueError(
                    f"sequence {b} writes positions {pos[b]}..{pos[b] + lengths[b] - 1}, but blocks "
                    f"{blocks[table[b, blocks] == 0].tolist()} of its page table have no page; reserve them with "
                    "PageManager.reserve before the call. Nothing was changed."
                )
    return (jnp.asarray(table), jnp.asarray(pos), *(copies or (None, None)))


def unbind(config: AttentionConfig, cache: PagedKVCache) -> dict:
    """The pool's arrays to store, by variable name."""
    arrays = {"k_pages": cache.k.values, "v_pages": cache.v.values}
    if cache.k.scale is not None:
        arrays.update(k_page_scale=cache.k.scale, v_page_scale=cache.v.scale)
    return arrays
