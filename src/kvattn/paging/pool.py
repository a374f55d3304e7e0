"""The block pool: which pages are free, referenced or cached, and what each cached page holds.

It knows only pages: never a sequence, a table or a window (those are the
sequence manager's). Page 0 is `NULL_PAGE`, never handed out. Every other
page is in exactly one of three states:

- live: `refcount[page]` references are held on it;
- cached: unreferenced but registered, so `find` still finds it; when the free
  pages run out, the least recently released cached page is evicted;
- free: unreferenced and unregistered.

A registered page is found by the key of the block it holds: a digest chained
over the previous block's digest, a salt and the block's tokens. Every hit
compares all three in full, so a digest collision serves nothing.

>>> pool = BlockPool(num_pages=4)
>>> first, second = pool.allocate(), pool.allocate()
>>> first, second, pool.num_free
(1, 2, 1)
>>> key = next(block_chain(b"", [b"four"]))
>>> pool.register(first, key)
True
>>> pool.release(first)  # unreferenced but registered: cached
>>> pool.num_cached, pool.find(key)
(1, 1)
>>> pool.allocate(), pool.allocate()  # the free page, then the cached one, evicted
(3, 1)
>>> pool.find(key) is None
True
"""

from __future__ import annotations

import collections
import hashlib
import operator
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from kvattn.caches.base import INT32_MAX, NULL_PAGE
from kvattn.errors import OutOfPagesError

DIGEST_SIZE = 32


class BlockKey(NamedTuple):
    """What a registered page holds, compared in full on every hit so that a digest collision serves nothing."""

    digest: bytes
    parent: bytes
    salt: bytes
    tokens: bytes


def block_digest(parent: bytes, salt: bytes, tokens: bytes) -> bytes:
    """The chained digest of one full block of a prompt.

    Args:
        parent: digest of the previous block, or `b""` for the first.
        salt: keeps apart caches that must not share keys (adapters, tenants).
        tokens: the block's token ids as bytes.

    Returns:
        a 32-byte BLAKE2b digest.
    """
    hasher = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    # The salt's length goes first, so no other split of the same bytes into salt and tokens hashes alike.
    hasher.update(len(salt).to_bytes(8, "little"))
    hasher.update(salt)
    hasher.update(tokens)
    return hasher.digest()


def block_chain(salt: bytes, blocks: Iterable[bytes]) -> Iterator[BlockKey]:
    """The keys of a prompt's consecutive full blocks, each chained to the one before; lazily, to stop at a miss."""
    parent = b""
    for tokens in blocks:
        key = BlockKey(block_digest(parent, salt, tokens), parent, salt, tokens)
        yield key
        parent = key.digest


def require(condition, message: str) -> None:
    """An invariant `check()` asserts: raises `AssertionError(message)` when it does not hold (even under -O)."""
    if not condition:
        raise AssertionError(message)


class BlockPool:
    """The pages of one device pool: their reference counts, the free list, the eviction order and the digests.

    Args:
        num_pages: pages in the device pool, the null page included.
    """

    def __init__(self, num_pages: int):
        num_pages = operator.index(num_pages)
        if not 2 <= num_pages <= INT32_MAX:
            raise ValueError(
                f"num_pages (page 0 is the null page) must be an integer from 2 to {INT32_MAX}, got {num_pages}"
            )
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int32)
        # A stack, so page 1 goes first and a page just released is reused first.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        # Unreferenced registered pages, least recently released first: the eviction order.
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._key_of_page: dict[int, BlockKey] = {}
        self._page_of_digest: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Pages neither referenced nor cached."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for their registered blocks; evicted when the free ones run out."""
        return len(self._cached)

    @property
    def num_live(self) -> int:
        """Pages holding at least one reference."""
        return self.num_pages - 1 - len(self._free) - len(self._cached)

    # References.

    def allocate(self) -> int:
        """A page for one new reference: free if any, else the least recently released cached one, evicted."""
        if self._free:
            page = self._free.pop()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            self._forget(page)
        else:
            raise OutOfPagesError(
                f"no free or cached page left: all {self.num_pages - 1} pages are referenced; release some first"
            )
        self.refcount[page] = 1
        return page

    def share(self, pages) -> None:
        """One more reference to each of `pages` (a repeat counts again); a cached page leaves the eviction order."""
        pages = np.asarray(pages, np.int64).ravel()
        if ((pages <= NULL_PAGE) | (pages >= self.num_pages)).any():
            raise ValueError(f"pages must be from 1 to {self.num_pages - 1}, got {pages.tolist()}")
        unreferenced = list(dict.fromkeys(pages[self.refcount[pages] == 0].tolist()))
        free = [page for page in unreferenced if page not in self._cached]
        if free:
            raise ValueError(f"pages {free} are free, so they hold nothing to share; allocate() new ones")
        for page in unreferenced:
            del self._cached[page]
        np.add.at(self.refcount, pages, 1)

    def release(self, page: int) -> None:
        """Drops one reference; an unreferenced page is cached if registered, else freed."""
        if not (NULL_PAGE < page < self.num_pages and self.refcount[page] > 0):
            raise ValueError(f"page {page} holds no reference to release")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self._key_of_page:
                self._cached[page] = None
            else:
                self._free.append(page)

    # Digests.

    def register(self, page: int, key: BlockKey) -> bool:
        """Makes a referenced, unregistered page findable by `key`.

        Returns:
            whether it was registered: not if another page already holds the same digest.
        """
        if not (NULL_PAGE < page < self.num_pages and self.refcount[page] > 0):
            raise ValueError(f"page {page} is not referenced; register a page only while it is in use")
        if page in self._key_of_page:
            raise ValueError(f"page {page} is registered already; unregister() it before it holds another block")
        if key.digest in self._page_of_digest:
            return False
        self._page_of_digest[key.digest] = page
        self._key_of_page[page] = key
        return True

    def key_of(self, page: int) -> BlockKey | None:
        """The key a page is registered with, if any."""
        return self._key_of_page.get(page)

    def find(self, key: BlockKey) -> int | None:
        """The page registered with exactly `key` (digest, parent, salt and tokens), if any; changes nothing."""
        page = self._page_of_digest.get(key.digest)
        if page is None or self._key_of_page[page] != key:
            return None
        return page

    def unregister(self, page: int) -> None:
        """Forgets a registered page's block, as before it is written in place; a cached page becomes free."""
        if page not in self._key_of_page:
            raise ValueError(f"page {page} is not registered")
        self._forget(page)
        if page in self._cached:
            del self._cached[page]
            self._free.append(page)

    def check(self) -> None:
        """Asserts every invariant of the pool, raising `AssertionError` naming the first broken one."""
        free, cached, registered = set(self._free), set(self._cached), set(self._key_of_page)
        require(len(free) == len(self._free), f"free list has duplicates: {self._free}")
        require(not free & cached, f"pages both free and cached: {sorted(free & cached)}")
        require(NULL_PAGE not in free | cached | registered, "the null page is free, cached or registered")
        require(self.refcount[NULL_PAGE] == 0, f"the null page has refcount {self.refcount[NULL_PAGE]}")
        require((self.refcount >= 0).all(), f"negative refcounts on pages {np.flatnonzero(self.refcount < 0)}")
        require(all(0 < p < self.num_pages for p in free | cached | registered), "a page is out of range")
        require(not self.refcount[list(free | cached)].any(), "a free or cached page is referenced")
        live = int((self.refcount > 0).sum())
        require(
            len(free) + len(cached) + live == self.num_pages - 1,
            f"free {len(free)} + cached {len(cached)} + live {live} != {self.num_pages - 1} pages",
        )
        require(
            all(self._page_of_digest.get(key.digest) == page for page, key in self._key_of_page.items())
            and len(self._page_of_digest) == len(self._key_of_page),
            "registered pages and digests disagree",
        )
        unreferenced = {page for page in registered if self.refcount[page] == 0}
        require(
            cached == unreferenced,
            f"cached pages {sorted(cached)} != unreferenced registered pages {sorted(unreferenced)}",
        )

    def _forget(self, page: int) -> None:
        del self._page_of_digest[self._key_of_page.pop(page).digest]
