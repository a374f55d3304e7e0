"""The sequence manager: sequences, page tables and tokens held (`pos`), copy-on-write and prefix caching, on a block pool.

The device holds, per layer, a pool of `num_pages` pages of `page_size`
positions (`kvattn.caches.paged`). Each sequence lives in a row of the
device batch; sequence b's logical block j (positions `j * page_size` up to
`(j + 1) * page_size - 1`) lives in page `tables[b, j]`, and every unmapped
entry points at `NULL_PAGE`. The device only ever sees fixed-shape int32
arrays (a `PageBatch`), so one compiled step serves every mix of requests.
Which page is free, shared or cached is the `BlockPool`'s to know; which
leading blocks a sequence may release is its window policy's.

A page shared by several sequences (after `fork`, `reorder` or `attach`) is
never written: `reserve` gives the sequence about to write into it a private
copy first (`kvattn.paging.reservation` says what the device does with the
`PageBatch` it returns). Every method checks its arguments and capacity
before touching any state, so a call that raises leaves the manager exactly
as it was.

>>> manager = PageManager(num_pages=8, page_size=4, max_sequences=2, max_pages_per_sequence=4)
>>> seq = manager.add()
>>> batch = manager.reserve([6, 0])  # a 6-token prompt: 2 pages
>>> batch.table[seq].tolist(), batch.pos.tolist()
([1, 2, 0, 0], [0, 0])
>>> manager.fork(seq, 1)  # shares both pages
>>> batch = manager.reserve([0, 1])  # seq 1 writes into the shared page 2: copied first
>>> batch.copy_from[:1].tolist(), batch.copy_to[:1].tolist(), batch.table[1].tolist()
([2], [3], [1, 3, 0, 0])
"""

from __future__ import annotations

import operator

import numpy as np

from kvattn.caches.base import INT32_MAX, NULL_PAGE, blocks_spanned
from kvattn.paging.pool import BlockPool, OutOfPagesError, block_chain, require
from kvattn.paging.prompts import cached_prefix, checked_salt, prompt_blocks, token_array
from kvattn.paging.reservation import PageBatch, checked_counts, reserve_pages
from kvattn.paging.windows import window_policy


def _size(name: str, value, minimum: int = 1) -> int:
    value = operator.index(value)
    if not minimum <= value <= INT32_MAX:
        raise ValueError(f"{name} must be an integer from {minimum} to {INT32_MAX}, got {value}")
    return value


class PageManager:
    """Decides which page holds which block of which sequence; the device only follows its tables.

    Args:
        num_pages: pages in the device pool, the null page included.
        page_size: positions per page.
        max_sequences: sequences, the device batch size.
        max_pages_per_sequence: table width; a sequence holds at most this many pages' worth of tokens.
        window: if set, a query sees only the last `window` positions, and blocks that fall wholly
            out of the window are released by `reserve`.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_sequences: int,
        max_pages_per_sequence: int,
        *,
        window: int | None = None,
    ):
        self.pool = BlockPool(num_pages)
        self.page_size = _size("page_size", page_size)
        self.max_sequences = _size("max_sequences", max_sequences)
        self.max_pages_per_sequence = _size("max_pages_per_sequence", max_pages_per_sequence)
        _size("capacity (max_pages_per_sequence * page_size)", self.capacity)
        self.policy = window_policy(self.page_size, None if window is None else _size("window", window))
        self.tables = np.full((self.max_sequences, self.max_pages_per_sequence), NULL_PAGE, np.int32)
        self.pos = np.zeros(self.max_sequences, np.int32)
        self.live = np.zeros(self.max_sequences, bool)

    @property
    def num_pages(self) -> int:
        """Pages in the device pool, the null page included."""
        return self.pool.num_pages

    @property
    def window(self) -> int | None:
        """Positions a query sees, or None for all of them."""
        return self.policy.window

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold."""
        return self.max_pages_per_sequence * self.page_size

    @property
    def refcount(self) -> np.ndarray:
        """`(num_pages,)` table entries of live sequences pointing at each page (the pool's own array)."""
        return self.pool.refcount

    @property
    def num_free(self) -> int:
        """Pages neither referenced nor cached."""
        return self.pool.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for the prefix cache; evicted when the free ones run out."""
        return self.pool.num_cached

    @property
    def num_live(self) -> int:
        """Pages referenced by at least one live sequence."""
        return self.pool.num_live

    def pages_for(self, num_tokens: int, *, chunk: int = 1) -> int:
        """The most pages a sequence holds at once while it grows to `num_tokens` tokens, `chunk` at a time.

        With a window that is at most the blocks one query sees, plus one; a
        chunk of tokens appended at once holds, for that call, the pages of the
        whole chunk and of the window before it.
        """
        return self.policy.most_pages_held(_size("num_tokens", num_tokens, minimum=0), _size("chunk", chunk))

    def admission(self, num_tokens: int, *, chunk: int = 1, sequences: int = 1) -> str:
        """Whether a request of `sequences` choices of a `num_tokens`-long sequence, grown `chunk` tokens at a
        time, can start: the choices share its full pages and hold a private copy of a partial last one.

        Returns:
            `"never"` if it cannot fit even in an empty pool, `"now"` if enough
            sequences and free or evictable pages are available right now, else `"later"`.
        """
        sequences = _size("sequences", sequences)
        pages = self.pages_for(num_tokens, chunk=chunk) + (sequences - 1) * bool(num_tokens % self.page_size)
        if num_tokens > self.capacity or pages > self.num_pages - 1 or sequences > self.max_sequences:
            return "never"
        if np.count_nonzero(~self.live) >= sequences and pages <= self.pool.num_free + self.pool.num_cached:
            return "now"
        return "later"

    def add(self) -> int:
        """Claims a free sequence, live and empty.

        Returns:
            the sequence's index.
        """
        if self.live.all():
            raise OutOfPagesError(
                f"no free sequence: all {self.max_sequences} are in use; free a finished sequence first"
            )
        seq = int(np.argmin(self.live))
        self.live[seq] = True
        return seq

    def reserve(self, counts) -> PageBatch:
        """Maps pages for the tokens each sequence appends in the next device call, all or nothing.

        For each sequence written: the blocks its first new query can no longer see
        (with a window) are released; a shared partial last page is replaced by
        a private copy (a registered one written in place leaves the prefix
        cache); fresh pages are mapped for the blocks it grows into. New pages
        come from the free list, then from evicting the least recently released
        cached page; a referenced page is never taken.

        Args:
            counts: `(max_sequences,)` tokens each sequence appends (0 for sequences not written,
                which dead sequences must be).

        Returns:
            the `PageBatch` of the call; `pos` grows by `counts`.
        """
        counts = checked_counts(counts, self.pos, self.live, self.page_size, self.max_pages_per_sequence)
        return reserve_pages(self.pool, self.policy, self.tables, self.pos, counts)

    def fork(self, source: int, target: int) -> None:
        """Makes `target` a copy of `source` by reference: the same pages, no new ones.

        A live `target` releases its own pages first; a dead one becomes live.
        """
        source = self._live_seq(source, "source")
        target = self._seq(target, "target")
        if target == source:
            raise ValueError(f"fork needs two different sequences, got source = target = {source}")
        row = self.tables[source]
        self.pool.share(row[row != NULL_PAGE])  # before the release, so no shared page drops to zero
        if self.live[target]:
            self._release_blocks(target, 0)
        self.tables[target] = row
        self.pos[target] = self.pos[source]
        self.live[target] = True

    def free(self, seq: int) -> None:
        """Releases every page of a live sequence; the sequence becomes dead and empty."""
        seq = self._live_seq(seq)
        self._release_blocks(seq, 0)
        self.pos[seq] = 0
        self.live[seq] = False

    def truncate(self, seq: int, keep: int) -> None:
        """Keeps the first `keep` tokens of a live sequence, releasing the pages past them."""
        seq = self._live_seq(seq)
        length = int(self.pos[seq])
        keep = operator.index(keep)
        if not 0 <= keep <= length:
            raise ValueError(f"keep must be from 0 to the sequence's length {length}, got {keep}")
        # The next query, at position `keep`, must still see every block it needs.
        first_needed = self.policy.first_block_seen(keep)
        if first_needed < blocks_spanned(keep, self.page_size) and self.tables[seq, first_needed] == NULL_PAGE:
            first_held = int(np.argmax(self.tables[seq] != NULL_PAGE))
            raise ValueError(
                f"sequence {seq} cannot keep {keep} tokens: with window {self.window} that needs block "
                f"{first_needed}, but blocks before {first_held} left the window and were released; "
                f"keep at least {first_held * self.page_size + self.window - 1} tokens, or 0"
            )
        self._release_blocks(seq, blocks_spanned(keep, self.page_size))
        self.pos[seq] = keep

    def reorder(self, order) -> None:
        """Beam search: each live sequence b becomes what sequence `order[b]` was.

        Args:
            order: `(max_sequences,)` sequence indices; live sequences must name live sequences,
                dead sequences themselves.
        """
        order = np.asarray(order)
        if order.shape != (self.max_sequences,) or (order.size and order.dtype.kind not in "iu"):
            raise ValueError(
                f"order must be sequence indices (integers) of shape ({self.max_sequences},), got {order.dtype} {order.shape}"
            )
        if ((order < 0) | (order >= self.max_sequences)).any():
            raise ValueError(f"order must name sequences 0 to {self.max_sequences - 1}, got {order.tolist()}")
        wrong = np.flatnonzero(np.where(self.live, ~self.live[order], order != np.arange(self.max_sequences)))
        if wrong.size:
            raise ValueError(
                f"order must map live sequences to live sequences and dead sequences to themselves; sequences {wrong.tolist()} "
                f"map to {order[wrong].tolist()} (live: {np.flatnonzero(self.live).tolist()})"
            )
        moved = np.flatnonzero(order != np.arange(self.max_sequences))
        new_rows = self.tables[order[moved]]
        self.pool.share(new_rows[new_rows != NULL_PAGE])  # before releasing, so nothing is freed between
        old_rows = self.tables[moved]
        self.tables[moved] = new_rows
        self.pos[moved] = self.pos[order[moved]]
        for row in old_rows:
            for page in row[::-1].tolist():
                if page != NULL_PAGE:
                    self.pool.release(page)

    def lookup(self, tokens, salt: bytes = b"") -> int:
        """How many leading tokens of a prompt are held by cached pages; changes nothing.

        Returns:
            a multiple of `page_size`, at most `len(tokens) - 1`: the last prompt
            token is always computed, for its logits.
        """
        return len(cached_prefix(self.pool, tokens, salt, self.page_size, self.max_pages_per_sequence)) * self.page_size

    def attach(self, seq: int, tokens, salt: bytes = b"") -> int:
        """Maps into a live, empty sequence the cached pages of a prompt's longest hit (as `lookup`).

        Returns:
            the tokens the sequence now holds; the caller computes the rest of the prompt.
        """
        seq = self._live_seq(seq)
        if self.pos[seq]:
            raise ValueError(
                f"attach needs an empty sequence, but sequence {seq} holds {self.pos[seq]} tokens; "
                "free it and add a new one"
            )
        pages = cached_prefix(self.pool, tokens, salt, self.page_size, self.max_pages_per_sequence)
        self.pool.share(pages)
        self.tables[seq, : len(pages)] = pages
        self.pos[seq] = len(pages) * self.page_size
        return len(pages) * self.page_size

    def register(self, seq: int, tokens, salt: bytes = b"") -> None:
        """Records that a live sequence's first `len(tokens)` positions hold these tokens' keys and values.

        Every full page among them that is not registered yet becomes findable by
        `lookup`, unless another page already holds the same digest.
        """
        seq = self._live_seq(seq)
        tokens, salt = token_array(tokens), checked_salt(salt)
        if len(tokens) > self.pos[seq]:
            raise ValueError(f"sequence {seq} holds {self.pos[seq]} tokens, fewer than the {len(tokens)} to register")
        new = []  # (page, key) to register once every block is known to agree
        blocks = prompt_blocks(tokens, self.page_size, len(tokens) // self.page_size)
        for block, key in enumerate(block_chain(salt, blocks)):
            page = int(self.tables[seq, block])
            if page == NULL_PAGE:  # left the window; the chain goes on
                continue
            held = self.pool.key_of(page)
            if held is None:
                new.append((page, key))
            elif held != key:
                raise ValueError(
                    f"sequence {seq} block {block} (page {page}) was registered with other tokens or salt than "
                    "given now; register the tokens the sequence was given, with the salt of its request"
                )
        for page, key in new:  # a digest another page already holds stays with that page
            self.pool.register(page, key)

    def check(self) -> None:
        """Asserts every invariant of the state, raising `AssertionError` naming the first broken one."""
        self.pool.check()
        tables, live, pos = self.tables, self.live, self.pos
        require(((tables >= 0) & (tables < self.num_pages)).all(), "a table entry is out of range")
        require((tables[~live] == NULL_PAGE).all(), "a dead sequence maps pages")
        require((pos[~live] == 0).all(), "a dead sequence holds tokens")
        require(((pos >= 0) & (pos <= self.capacity)).all(), f"pos out of range: {pos}")
        references = np.bincount(tables[live].ravel(), minlength=self.num_pages)
        references[NULL_PAGE] = 0
        wrong = np.flatnonzero(references != self.refcount)
        require(
            not wrong.size, f"pages {wrong.tolist()}: refcount {self.refcount[wrong]} != references {references[wrong]}"
        )
        for seq in np.flatnonzero(live).tolist():
            self._check_row(seq)

    def _check_row(self, seq: int) -> None:
        blocks = blocks_spanned(int(self.pos[seq]), self.page_size)
        row = self.tables[seq]
        require((row[blocks:] == NULL_PAGE).all(), f"sequence {seq} maps blocks past its length: {row}")
        mapped = row[:blocks] != NULL_PAGE
        first = int(np.argmax(mapped)) if mapped.any() else blocks
        require(mapped[first:].all(), f"sequence {seq}: an unmapped block after a mapped one: {row}")
        needed = self.policy.first_block_seen(int(self.pos[seq]))
        require(
            first <= needed,
            f"sequence {seq}: blocks {needed} to {first - 1} are still in its window but unmapped: {row}",
        )
        require(len(set(row[first:blocks].tolist())) == blocks - first, f"sequence {seq} maps one page twice: {row}")

    # Internals.

    def _seq(self, seq, name: str = "sequence") -> int:
        seq = operator.index(seq)
        if not 0 <= seq < self.max_sequences:
            raise ValueError(f"{name} must be from 0 to {self.max_sequences - 1}, got {seq}")
        return seq

    def _live_seq(self, seq, name: str = "sequence") -> int:
        seq = self._seq(seq, name)
        if not self.live[seq]:
            raise ValueError(f"{name} {seq} is not in use; call add() first")
        return seq

    def _release_blocks(self, seq: int, first: int) -> None:
        """Releases a sequence's blocks from `first` on, latest first.

        Latest first, so a sequence's later blocks are evicted before its earlier
        ones: a block is only found through its whole prefix.
        """
        row = self.tables[seq]
        for block in range(blocks_spanned(int(self.pos[seq]), self.page_size) - 1, first - 1, -1):
            if row[block] == NULL_PAGE:  # the blocks before left a window: nothing more to release
                break
            self.pool.release(int(row[block]))
            row[block] = NULL_PAGE
