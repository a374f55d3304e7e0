"""The host half of paging: page tables, reference counts, copy-on-write and prefix caching.

The device holds, per layer, a pool of `num_pages` pages of `page_size`
positions (`kvattn.paged`). Each sequence lives in a slot, a row of the
device batch; slot b's logical block j (positions `j * page_size` up to
`(j + 1) * page_size - 1`) lives in page `tables[b, j]`. Page 0 is
`NULL_PAGE`: never handed out nor written, and every unmapped entry points
at it. The device only ever sees fixed-shape int32 arrays (a `PageBatch`),
so one compiled step serves every mix of requests.

Every page other than the null page is in exactly one of three states:

- live: `refcount[page]` table entries of live slots point at it;
- cached: unreferenced but registered in the prefix cache, so `lookup` still
  finds it; pages run out -> the least recently released is evicted;
- free: unreferenced and unregistered.

A page shared by several slots (after `fork`, `reorder` or `attach`) is
never written: `reserve` gives the slot about to write into it a private
copy first. The contract of a device call made with a `PageBatch`:

1. make every copy `pool[copy_to[i]] = pool[copy_from[i]]`, dropping the
   padding `copy_to[i] == num_pages`, before any write;
2. write slot b's new tokens at positions `pos[b]`, `pos[b] + 1`, ...
   through `table[b]`.

Every method checks its arguments and capacity before touching any state,
so a call that raises leaves the manager exactly as it was.

>>> manager = PageManager(num_pages=8, page_size=4, max_sequences=2, max_pages_per_sequence=4)
>>> slot = manager.add()
>>> batch = manager.reserve([6, 0])  # a 6-token prompt: 2 pages
>>> batch.table[slot].tolist(), batch.pos.tolist()
([1, 2, 0, 0], [0, 0])
>>> manager.fork(slot, 1)  # shares both pages
>>> batch = manager.reserve([0, 1])  # slot 1 writes into the shared page 2: copied first
>>> batch.copy_from[:1].tolist(), batch.copy_to[:1].tolist(), batch.table[1].tolist()
([2], [3], [1, 3, 0, 0])
"""

from __future__ import annotations

import collections
import hashlib
import operator
from typing import NamedTuple

import numpy as np

__all__ = ["NULL_PAGE", "OutOfPagesError", "PageBatch", "PageManager", "block_digest"]

NULL_PAGE = 0
DIGEST_SIZE = 32
INT32_MAX = 2**31 - 1


class OutOfPagesError(RuntimeError):
    """Raised before any state changes when a request needs more pages, slots or positions than can be had."""

    __module__ = "kvattn"  # shown as `kvattn.OutOfPagesError`, where users import it from


class PageBatch(NamedTuple):
    """What one device call needs: fixed-shape int32 NumPy arrays, copies of the manager's state.

    Args:
        table: `(max_sequences, max_pages_per_sequence)` page of each slot's blocks, after reservation.
        pos: `(max_sequences,)` tokens each slot held before this call: where its writes start.
        copy_from: `(max_sequences,)` sources of copy-on-write copies, padded with `NULL_PAGE`.
        copy_to: `(max_sequences,)` their destinations, padded with `num_pages` (out of range, dropped).
    """

    table: np.ndarray
    pos: np.ndarray
    copy_from: np.ndarray
    copy_to: np.ndarray


class _Registration(NamedTuple):
    """What a cached page holds, compared in full on every hit so that a digest collision serves nothing."""

    digest: bytes
    parent: bytes
    salt: bytes
    tokens: bytes


def block_digest(parent: bytes, salt: bytes, tokens: bytes) -> bytes:
    """The chained digest of one full block of a prompt.

    Args:
        parent: digest of the previous block, or `b""` for the first.
        salt: keeps apart caches that must not share keys (adapters, tenants).
        tokens: the block's token ids as little-endian int32 bytes.

    Returns:
        a 32-byte BLAKE2b digest.
    """
    hasher = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    # The salt's length goes first, so no other split of the same bytes into salt and tokens hashes alike.
    hasher.update(len(salt).to_bytes(8, "little"))
    hasher.update(salt)
    hasher.update(tokens)
    return hasher.digest()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _size(name: str, value, minimum: int = 1) -> int:
    value = operator.index(value)
    if not minimum <= value <= INT32_MAX:
        raise ValueError(f"{name} must be an integer from {minimum} to {INT32_MAX}, got {value}")
    return value


def _token_bytes(tokens) -> np.ndarray:
    """Token ids as a 1-D little-endian int32 array, refusing anything that would change on the way."""
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(
            f"tokens must be a 1-D sequence of integer ids, got shape {array.shape} dtype {array.dtype}"
        )
    if array.size and (array.min() < -INT32_MAX - 1 or array.max() > INT32_MAX):
        raise ValueError(f"token ids must fit in int32, got ids from {array.min()} to {array.max()}")
    return array.astype("<i4")


def _salt(salt) -> bytes:
    if not isinstance(salt, bytes):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}; encode a string first")
    return salt


class PageManager:
    """Decides which page holds which block of which sequence; the device only follows its tables.

    Args:
        num_pages: pages in the device pool, the null page included.
        page_size: positions per page.
        max_sequences: slots, the device batch size.
        max_pages_per_sequence: table width; a slot holds at most this many pages' worth of tokens.
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
        self.num_pages = _size("num_pages (page 0 is the null page)", num_pages, minimum=2)
        self.page_size = _size("page_size", page_size)
        self.max_sequences = _size("max_sequences", max_sequences)
        self.max_pages_per_sequence = _size("max_pages_per_sequence", max_pages_per_sequence)
        _size("capacity (max_pages_per_sequence * page_size)", self.capacity)
        self.window = None if window is None else _size("window", window)
        self.refcount = np.zeros(self.num_pages, np.int32)
        self.tables = np.full((self.max_sequences, self.max_pages_per_sequence), NULL_PAGE, np.int32)
        self.lengths = np.zeros(self.max_sequences, np.int32)
        self.live = np.zeros(self.max_sequences, bool)
        # A stack, so page 1 goes first and a page just released is reused first.
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))
        # Unreferenced registered pages, least recently released first: the eviction order.
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._registrations: dict[int, _Registration] = {}
        self._page_of_digest: dict[bytes, int] = {}

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold."""
        return self.max_pages_per_sequence * self.page_size

    @property
    def num_free(self) -> int:
        """Pages neither referenced nor cached."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for the prefix cache; evicted when the free ones run out."""
        return len(self._cached)

    @property
    def num_live(self) -> int:
        """Pages referenced by at least one live slot."""
        return self.num_pages - 1 - len(self._free) - len(self._cached)

    def pages_for(self, num_tokens: int) -> int:
        """The most pages a sequence holds at once while it grows to `num_tokens` tokens, one at a time.

        With a window that is at most the blocks one query sees, plus one; a
        chunk of tokens appended at once holds, for that call, the pages of the
        whole chunk and of the window before it.
        """
        num_tokens = _size("num_tokens", num_tokens, minimum=0)
        page_size, window = self.page_size, self.window
        if window is None or num_tokens <= window:
            return _ceil_div(num_tokens, page_size)

        def held(length: int) -> int:  # once its last token, at `length - 1`, was appended alone
            return (length - 1) // page_size - (length - window) // page_size + 1

        # Past the window, what is held repeats with the alignment of the window to the pages.
        lengths = range(window + 1, min(num_tokens, window + page_size) + 1)
        return max(_ceil_div(window, page_size), *map(held, lengths))

    def admission(self, num_tokens: int) -> str:
        """Whether a request that will grow to `num_tokens` tokens can start.

        Returns:
            `"never"` if it cannot fit even in an empty pool, `"now"` if a slot and
            enough free or evictable pages are available right now, else `"later"`.
        """
        pages = self.pages_for(num_tokens)
        if num_tokens > self.capacity or pages > self.num_pages - 1:
            return "never"
        if not self.live.all() and pages <= len(self._free) + len(self._cached):
            return "now"
        return "later"

    def add(self) -> int:
        """Claims a free slot, live and empty.

        Returns:
            the slot's index.
        """
        if self.live.all():
            raise OutOfPagesError(
                f"no free sequence slot: all {self.max_sequences} are in use; free a finished sequence first"
            )
        slot = int(np.argmin(self.live))
        self.live[slot] = True
        return slot

    def reserve(self, counts) -> PageBatch:
        """Maps pages for the tokens each slot appends in the next device call, all or nothing.

        For each slot written: with a window, the blocks its first new query can
        no longer see are released; a shared partial last page is replaced by a
        private copy (a registered one written in place leaves the prefix cache);
        fresh pages are mapped for the blocks it grows into. New pages come from
        the free list, then from evicting the least recently released cached
        page; a referenced page is never taken.

        Args:
            counts: `(max_sequences,)` tokens each slot appends (0 for slots not written,
                which dead slots must be).

        Returns:
            the `PageBatch` of the call; `lengths` grow by `counts`.
        """
        counts = self._counts(counts)
        touched = np.flatnonzero(counts).tolist()
        tables, refcount, page_size = self.tables, self.refcount, self.page_size
        lengths = [int(self.lengths[b]) for b in touched]

        # Plan first, in the order of the changes below, so a failure changes nothing.
        released = []  # (slot, block) leaving the window, latest block first
        dropped: dict[int, int] = {}  # page -> references this call drops
        gained = 0  # pages whose last reference is dropped: reusable within the call
        if self.window is not None:
            for b, length in zip(touched, lengths):
                block = max(0, length - self.window + 1) // page_size - 1
                while block >= 0 and tables[b, block] != NULL_PAGE:
                    page = int(tables[b, block])
                    dropped[page] = dropped.get(page, 0) + 1
                    gained += int(dropped[page] == refcount[page])
                    released.append((b, block))
                    block -= 1
        copies = []  # (slot, page): the slot's partial last page is shared, so it writes a copy
        unregistered = []  # pages about to change in place, so no longer what their registration says
        needed = 0
        for b, length in zip(touched, lengths):
            if length % page_size:
                page = int(tables[b, length // page_size])
                if refcount[page] - dropped.get(page, 0) > 1:
                    copies.append((b, page))
                    dropped[page] = dropped.get(page, 0) + 1
                    needed += 1
                elif page in self._registrations:
                    unregistered.append(page)
            needed += _ceil_div(length + int(counts[b]), page_size) - _ceil_div(length, page_size)
        available = len(self._free) + len(self._cached) + gained
        if needed > available:
            raise OutOfPagesError(
                f"reserve needs {needed} new pages but only {available} can be had ({len(self._free)} free, "
                f"{len(self._cached)} cached, {gained} leaving windows); nothing was changed. "
                "Reserve fewer tokens, or free or truncate sequences first."
            )

        pos = self.lengths.copy()
        for b, block in released:
            page = int(tables[b, block])
            tables[b, block] = NULL_PAGE
            self._release(page)
        copy_from = np.full(self.max_sequences, NULL_PAGE, np.int32)
        copy_to = np.full(self.max_sequences, self.num_pages, np.int32)
        for index, (b, page) in enumerate(copies):
            copy_from[index], copy_to[index] = page, self._allocate()
            tables[b, pos[b] // page_size] = copy_to[index]
            self._release(page)
        for page in unregistered:
            self._unregister(page)
        for b, length in zip(touched, lengths):
            for block in range(_ceil_div(length, page_size), _ceil_div(length + int(counts[b]), page_size)):
                tables[b, block] = self._allocate()
        self.lengths += counts.astype(np.int32)
        return PageBatch(tables.copy(), pos, copy_from, copy_to)

    def fork(self, source: int, target: int) -> None:
        """Makes `target` a copy of `source` by reference: the same pages, no new ones.

        A live `target` releases its own pages first; a dead one becomes live.
        """
        source = self._live_slot(source, "source")
        target = self._slot(target, "target")
        if target == source:
            raise ValueError(f"fork needs two different slots, got source = target = {source}")
        row = self.tables[source]
        np.add.at(self.refcount, row[row != NULL_PAGE], 1)  # before the release, so no shared page drops to zero
        if self.live[target]:
            self._release_blocks(target, 0)
        self.tables[target] = row
        self.lengths[target] = self.lengths[source]
        self.live[target] = True

    def free(self, slot: int) -> None:
        """Releases every page of a live slot; the slot becomes dead and empty."""
        slot = self._live_slot(slot)
        self._release_blocks(slot, 0)
        self.lengths[slot] = 0
        self.live[slot] = False

    def truncate(self, slot: int, keep: int) -> None:
        """Keeps the first `keep` tokens of a live slot, releasing the pages past them."""
        slot = self._live_slot(slot)
        length = int(self.lengths[slot])
        keep = operator.index(keep)
        if not 0 <= keep <= length:
            raise ValueError(f"keep must be from 0 to the slot's length {length}, got {keep}")
        if self.window is not None:
            # The next query, at position `keep`, sees positions from `keep - window + 1` on.
            first_needed = max(0, keep - self.window + 1) // self.page_size
            if first_needed < _ceil_div(keep, self.page_size) and self.tables[slot, first_needed] == NULL_PAGE:
                first_held = int(np.argmax(self.tables[slot] != NULL_PAGE))
                raise ValueError(
                    f"slot {slot} cannot keep {keep} tokens: with window {self.window} that needs block "
                    f"{first_needed}, but blocks before {first_held} left the window and were released; "
                    f"keep at least {first_held * self.page_size + self.window - 1} tokens, or 0"
                )
        self._release_blocks(slot, _ceil_div(keep, self.page_size))
        self.lengths[slot] = keep

    def reorder(self, order) -> None:
        """Beam search: each live slot b becomes what slot `order[b]` was.

        Args:
            order: `(max_sequences,)` slot indices; live slots must name live slots,
                dead slots themselves.
        """
        order = np.asarray(order)
        if order.shape != (self.max_sequences,) or (order.size and order.dtype.kind not in "iu"):
            raise ValueError(
                f"order must be integer slots of shape ({self.max_sequences},), got {order.dtype} {order.shape}"
            )
        if ((order < 0) | (order >= self.max_sequences)).any():
            raise ValueError(f"order must name slots 0 to {self.max_sequences - 1}, got {order.tolist()}")
        wrong = np.flatnonzero(np.where(self.live, ~self.live[order], order != np.arange(self.max_sequences)))
        if wrong.size:
            raise ValueError(
                f"order must map live slots to live slots and dead slots to themselves; slots {wrong.tolist()} "
                f"map to {order[wrong].tolist()} (live: {np.flatnonzero(self.live).tolist()})"
            )
        moved = np.flatnonzero(order != np.arange(self.max_sequences))
        new_rows = self.tables[order[moved]]
        np.add.at(self.refcount, new_rows[new_rows != NULL_PAGE], 1)  # before releasing, so nothing is freed between
        old_rows = self.tables[moved]
        self.tables[moved] = new_rows
        self.lengths[moved] = self.lengths[order[moved]]
        for row in old_rows:
            for page in row[::-1].tolist():
                if page != NULL_PAGE:
                    self._release(page)

    def lookup(self, tokens, salt: bytes = b"") -> int:
        """How many leading tokens of a prompt are held by cached pages; changes nothing.

        Returns:
            a multiple of `page_size`, at most `len(tokens) - 1`: the last prompt
            token is always computed, for its logits.
        """
        return len(self._cached_prefix(tokens, salt)) * self.page_size

    def attach(self, slot: int, tokens, salt: bytes = b"") -> int:
        """Maps into a live, empty slot the cached pages of a prompt's longest hit (as `lookup`).

        Returns:
            the tokens the slot now holds; the caller computes the rest of the prompt.
        """
        slot = self._live_slot(slot)
        if self.lengths[slot]:
            raise ValueError(
                f"attach needs an empty slot, but slot {slot} holds {self.lengths[slot]} tokens; "
                "free it and add a new one"
            )
        pages = self._cached_prefix(tokens, salt)
        for block, page in enumerate(pages):
            if self.refcount[page] == 0:
                del self._cached[page]
            self.refcount[page] += 1
            self.tables[slot, block] = page
        self.lengths[slot] = len(pages) * self.page_size
        return len(pages) * self.page_size

    def register(self, slot: int, tokens, salt: bytes = b"") -> None:
        """Records that a live slot's first `len(tokens)` positions hold these tokens' keys and values.

        Every full page among them that is not registered yet becomes findable by
        `lookup`, unless another page already holds the same digest.
        """
        slot = self._live_slot(slot)
        tokens, salt = _token_bytes(tokens), _salt(salt)
        if len(tokens) > self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} tokens, fewer than the {len(tokens)} to register")
        new: dict[bytes, tuple[int, _Registration]] = {}
        parent = b""
        for block in range(len(tokens) // self.page_size):
            data = tokens[block * self.page_size : (block + 1) * self.page_size].tobytes()
            held = _Registration(block_digest(parent, salt, data), parent, salt, data)
            parent = held.digest
            page = int(self.tables[slot, block])
            if page == NULL_PAGE:  # left the window; the chain goes on
                continue
            if page in self._registrations:
                if self._registrations[page] != held:
                    raise ValueError(
                        f"slot {slot} block {block} (page {page}) was registered with other tokens or salt than "
                        "given now; register the tokens the slot was given, with the salt of its request"
                    )
            elif held.digest not in self._page_of_digest and held.digest not in new:
                new[held.digest] = page, held
        # Only now, so that a refused call registers nothing.
        for digest, (page, held) in new.items():
            self._page_of_digest[digest] = page
            self._registrations[page] = held

    def check(self) -> None:
        """Asserts every invariant of the state, raising `AssertionError` naming the first broken one."""

        def require(condition, message: str) -> None:
            if not condition:
                raise AssertionError(message)

        free, cached = set(self._free), set(self._cached)
        require(len(free) == len(self._free), f"free list has duplicates: {self._free}")
        require(not free & cached, f"pages both free and cached: {sorted(free & cached)}")
        require(
            NULL_PAGE not in free | cached | set(self._registrations),
            "the null page is free, cached or registered",
        )
        require(self.refcount[NULL_PAGE] == 0, f"the null page has refcount {self.refcount[NULL_PAGE]}")
        require(all(0 < p < self.num_pages for p in free | cached), "a free or cached page is out of range")
        require(not self.refcount[list(free | cached)].any(), "a free or cached page is referenced")
        require(
            len(free) + len(cached) + int((self.refcount > 0).sum()) == self.num_pages - 1,
            f"free {len(free)} + cached {len(cached)} + live {(self.refcount > 0).sum()} != {self.num_pages - 1} pages",
        )
        require(((self.tables >= 0) & (self.tables < self.num_pages)).all(), "a table entry is out of range")
        require((self.tables[~self.live] == NULL_PAGE).all(), "a dead slot maps pages")
        require((self.lengths[~self.live] == 0).all(), "a dead slot holds tokens")
        require(((self.lengths >= 0) & (self.lengths <= self.capacity)).all(), f"lengths out of range: {self.lengths}")
        references = np.bincount(self.tables[self.live].ravel(), minlength=self.num_pages)
        references[NULL_PAGE] = 0
        wrong = np.flatnonzero(references != self.refcount)
        require(
            not wrong.size, f"pages {wrong.tolist()}: refcount {self.refcount[wrong]} != references {references[wrong]}"
        )
        for slot in np.flatnonzero(self.live).tolist():
            self._check_row(slot, require)
        require(
            all(self._page_of_digest.get(r.digest) == p for p, r in self._registrations.items())
            and len(self._page_of_digest) == len(self._registrations),
            "registered pages and digests disagree",
        )
        unreferenced = {page for page in self._registrations if self.refcount[page] == 0}
        require(
            cached == unreferenced,
            f"cached pages {sorted(cached)} != unreferenced registered pages {sorted(unreferenced)}",
        )

    def _check_row(self, slot: int, require) -> None:
        blocks = _ceil_div(int(self.lengths[slot]), self.page_size)
        row = self.tables[slot]
        require((row[blocks:] == NULL_PAGE).all(), f"slot {slot} maps blocks past its length: {row}")
        mapped = row[:blocks] != NULL_PAGE
        first = int(np.argmax(mapped)) if mapped.any() else blocks
        require(mapped[first:].all(), f"slot {slot}: an unmapped block after a mapped one: {row}")
        needed = 0 if self.window is None else max(0, int(self.lengths[slot]) - self.window + 1) // self.page_size
        require(
            first <= needed,
            f"slot {slot}: blocks {needed} to {first - 1} are still in its window but unmapped: {row}",
        )
        require(len(set(row[first:blocks].tolist())) == blocks - first, f"slot {slot} maps one page twice: {row}")

    # Internals.

    def _counts(self, counts) -> np.ndarray:
        counts = np.asarray(counts)
        if counts.shape != (self.max_sequences,) or (counts.size and counts.dtype.kind not in "iu"):
            raise ValueError(
                f"counts must be integers of shape ({self.max_sequences},), one per slot; "
                f"got {counts.dtype} {counts.shape}"
            )
        counts = counts.astype(np.int64)
        if (counts < 0).any():
            raise ValueError(f"counts must be >= 0, got {counts.tolist()}")
        dead = np.flatnonzero(~self.live & (counts != 0))
        if dead.size:
            raise ValueError(
                f"counts must be 0 for slots not in use; got {counts[dead].tolist()} for slots {dead.tolist()}; "
                "call add() first"
            )
        over = np.flatnonzero(self.lengths + counts > self.capacity)
        if over.size:
            b = int(over[0])
            raise OutOfPagesError(
                f"slot {b} would hold {self.lengths[b] + counts[b]} tokens, past its capacity of {self.capacity} "
                f"({self.max_pages_per_sequence} pages of {self.page_size}); nothing was changed"
            )
        return counts

    def _slot(self, slot, name: str = "slot") -> int:
        slot = operator.index(slot)
        if not 0 <= slot < self.max_sequences:
            raise ValueError(f"{name} must be from 0 to {self.max_sequences - 1}, got {slot}")
        return slot

    def _live_slot(self, slot, name: str = "slot") -> int:
        slot = self._slot(slot, name)
        if not self.live[slot]:
            raise ValueError(f"{name} {slot} is not in use; call add() first")
        return slot

    def _cached_prefix(self, tokens, salt: bytes) -> list[int]:
        """The cached pages of a prompt's longest page-aligned hit, leaving its last token out."""
        tokens, salt = _token_bytes(tokens), _salt(salt)
        blocks = min(max(len(tokens) - 1, 0) // self.page_size, self.max_pages_per_sequence)
        pages, parent = [], b""
        for block in range(blocks):
            data = tokens[block * self.page_size : (block + 1) * self.page_size].tobytes()
            digest = block_digest(parent, salt, data)
            page = self._page_of_digest.get(digest)
            if page is None or self._registrations[page] != (digest, parent, salt, data):
                break
            pages.append(page)
            parent = digest
        return pages

    def _allocate(self) -> int:
        """A page for one new reference: free if any, else the least recently released cached one."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)
            self._unregister(page)
        self.refcount[page] = 1
        return page

    def _release(self, page: int) -> None:
        """Drops one reference; an unreferenced page is cached if registered, else freed."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self._registrations:
                self._cached[page] = None
            else:
                self._free.append(page)

    def _release_blocks(self, slot: int, first: int) -> None:
        """Releases a slot's blocks from `first` on, latest first.

        Latest first, so a sequence's later blocks are evicted before its earlier
        ones: a block is only found through its whole prefix.
        """
        row = self.tables[slot]
        for block in range(_ceil_div(int(self.lengths[slot]), self.page_size) - 1, first - 1, -1):
            if row[block] == NULL_PAGE:  # the blocks before left a window: nothing more to release
                break
            self._release(int(row[block]))
            row[block] = NULL_PAGE

    def _unregister(self, page: int) -> None:
        del self._page_of_digest[self._registrations.pop(page).digest]
