"""Reserving pages for one device call, all or nothing: planned in full, checked, then applied.

A sequence about to write releases the blocks its first new query no longer
sees (its window policy says which), swaps a shared partial last page for a
private copy, and maps fresh pages for the blocks it grows into. The device
gets a `PageBatch`, and the contract of a call made with it is:

1. make every copy `pool[copy_to[i]] = pool[copy_from[i]]`, dropping the
   padding `copy_to[i] == num_pages`, before any write;
2. write sequence b's new tokens at positions `pos[b]`, `pos[b] + 1`, ...
   through `table[b]`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvattn.caches.base import NULL_PAGE, blocks_spanned
from kvattn.paging.pool import BlockPool, OutOfPagesError
from kvattn.paging.windows import FullAttention


class PageBatch(NamedTuple):
    """What one device call needs: fixed-shape int32 NumPy arrays, copies of the manager's state.

    Args:
        table: `(max_sequences, max_pages_per_sequence)` page of each sequence's blocks, after reservation.
        pos: `(max_sequences,)` tokens each sequence held before this call: where its writes start.
        copy_from: `(max_sequences,)` sources of copy-on-write copies, padded with `NULL_PAGE`.
        copy_to: `(max_sequences,)` their destinations, padded with `num_pages` (out of range, dropped).
    """

    table: np.ndarray
    pos: np.ndarray
    copy_from: np.ndarray
    copy_to: np.ndarray


def checked_counts(counts, pos: np.ndarray, live: np.ndarray, page_size: int, max_pages: int) -> np.ndarray:
    """The tokens each sequence appends, as int64, once they fit the sequences: else an error that names the fix.

    Args:
        counts: `(max_sequences,)` tokens each sequence asks to append.
        pos: `(max_sequences,)` tokens each sequence holds.
        live: `(max_sequences,)` whether each sequence is in use.
        page_size: positions per page.
        max_pages: pages one sequence maps at most.
    """
    counts = np.asarray(counts)
    if counts.shape != pos.shape or (counts.size and counts.dtype.kind not in "iu"):
        raise ValueError(
            f"counts must be integers of shape {pos.shape}, one per sequence; got {counts.dtype} {counts.shape}"
        )
    counts = counts.astype(np.int64)
    if (counts < 0).any():
        raise ValueError(f"counts must be >= 0, got {counts.tolist()}")
    dead = np.flatnonzero(~live & (counts != 0))
    if dead.size:
        raise ValueError(
            f"counts must be 0 for sequences not in use; got {counts[dead].tolist()} for sequences {dead.tolist()}; "
            "call add() first"
        )
    capacity = max_pages * page_size
    over = np.flatnonzero(pos + counts > capacity)
    if over.size:
        b = int(over[0])
        raise OutOfPagesError(
            f"sequence {b} would hold {pos[b] + counts[b]} tokens, past its capacity of {capacity} "
            f"({max_pages} pages of {page_size}); nothing was changed"
        )
    return counts


def reserve_pages(
    pool: BlockPool, policy: FullAttention, tables: np.ndarray, pos: np.ndarray, counts: np.ndarray
) -> PageBatch:
    """Maps pages for `counts` more tokens per sequence, in place, or raises `OutOfPagesError` changing nothing.

    New pages come from the free list, then from evicting the least recently
    released cached page; a referenced page is never taken. A registered page
    about to be written in place leaves the prefix cache.

    Args:
        pool: the pages.
        policy: which blocks a sequence's queries still see.
        tables: `(max_sequences, max_pages_per_sequence)` page of each sequence's blocks; updated.
        pos: `(max_sequences,)` tokens each sequence holds; grow by `counts`.
        counts: `(max_sequences,)` int64 tokens each sequence appends, from `checked_counts`.

    Returns:
        the `PageBatch` of the call.
    """
    touched = np.flatnonzero(counts).tolist()
    refcount, page_size = pool.refcount, policy.page_size
    old_pos = [int(pos[b]) for b in touched]

    # Plan first, in the order of the changes below, so a failure changes nothing.
    released = []  # (sequence, block) out of sight of the sequence's first new query, latest block first
    dropped: dict[int, int] = {}  # page -> references this call drops
    gained = 0  # pages whose last reference is dropped: reusable within the call
    for b, length in zip(touched, old_pos):
        block = policy.first_block_seen(length) - 1
        while block >= 0 and tables[b, block] != NULL_PAGE:
            page = int(tables[b, block])
            dropped[page] = dropped.get(page, 0) + 1
            gained += int(dropped[page] == refcount[page])
            released.append((b, block))
            block -= 1
    copies = []  # (sequence, page): the sequence's partial last page is shared, so it writes a copy
    unregistered = []  # pages about to change in place, so no longer what their registration says
    needed = 0
    for b, length in zip(touched, old_pos):
        if length % page_size:
            page = int(tables[b, length // page_size])
            if refcount[page] - dropped.get(page, 0) > 1:
                copies.append((b, page))
                dropped[page] = dropped.get(page, 0) + 1
                needed += 1
            elif pool.key_of(page) is not None:
                unregistered.append(page)
        needed += blocks_spanned(length + int(counts[b]), page_size) - blocks_spanned(length, page_size)
    available = pool.num_free + pool.num_cached + gained
    if needed > available:
        raise OutOfPagesError(
            f"reserve needs {needed} new pages but only {available} can be had ({pool.num_free} free, "
            f"{pool.num_cached} cached, {gained} leaving windows); nothing was changed. "
            "Reserve fewer tokens, or free or truncate sequences first."
        )

    before = pos.copy()
    for b, block in released:
        page = int(tables[b, block])
        tables[b, block] = NULL_PAGE
        pool.release(page)
    copy_from = np.full(len(pos), NULL_PAGE, np.int32)
    copy_to = np.full(len(pos), pool.num_pages, np.int32)
    for index, (b, page) in enumerate(copies):
        copy_from[index], copy_to[index] = page, pool.allocate()
        tables[b, before[b] // page_size] = copy_to[index]
        pool.release(page)
    for page in unregistered:
        pool.unregister(page)
    for b, length in zip(touched, old_pos):
        for block in range(blocks_spanned(length, page_size), blocks_spanned(length + int(counts[b]), page_size)):
            tables[b, block] = pool.allocate()
    pos += counts.astype(pos.dtype)
    return PageBatch(tables.copy(), before, copy_from, copy_to)
