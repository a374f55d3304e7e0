"""The block pool alone: reference counts, the free list, the eviction order, digests and its own invariants."""

from __future__ import annotations

import pytest

import kvattn.paging.pool
from kvattn.paging import NULL_PAGE, BlockPool, OutOfPagesError
from kvattn.paging.pool import BlockKey, block_chain, block_digest


def keys(*blocks: bytes, salt: bytes = b"") -> list[BlockKey]:
    return list(block_chain(salt, blocks))


def registered(pool: BlockPool, key: BlockKey) -> int:
    """A page holding `key`, registered, released: cached."""
    page = pool.allocate()
    assert pool.register(page, key)
    pool.release(page)
    return page


# References and the free list.


def test_pages_are_handed_out_from_1_and_a_released_page_is_reused_first():
    pool = BlockPool(num_pages=5)
    assert [pool.allocate() for _ in range(3)] == [1, 2, 3]
    assert (pool.num_free, pool.num_cached, pool.num_live) == (1, 0, 3)
    pool.release(2)
    assert pool.refcount.tolist() == [0, 1, 0, 1, 0]
    assert pool.allocate() == 2
    assert pool.allocate() == 4
    pool.check()


def test_a_shared_page_is_freed_by_its_last_reference_only():
    pool = BlockPool(num_pages=3)
    page = pool.allocate()
    pool.share([page, page])
    assert pool.refcount[page] == 3
    pool.release(page)
    pool.release(page)
    assert (pool.num_free, pool.num_live) == (1, 1)
    pool.release(page)
    assert (pool.num_free, pool.num_live) == (2, 0)
    pool.check()


def test_misuse_is_refused_before_anything_changes():
    pool = BlockPool(num_pages=3)
    page = pool.allocate()
    with pytest.raises(ValueError, match="page 2 holds no reference to release"):
        pool.release(2)
    with pytest.raises(ValueError, match="page 0 holds no reference to release"):
        pool.release(NULL_PAGE)
    with pytest.raises(ValueError, match=r"pages \[2\] are free, so they hold nothing to share"):
        pool.share([page, 2])
    with pytest.raises(ValueError, match=r"pages must be from 1 to 2, got \[0\]"):
        pool.share([NULL_PAGE])
    assert pool.refcount.tolist() == [0, 1, 0]
    pool.allocate()
    with pytest.raises(OutOfPagesError, match="no free or cached page left: all 2 pages are referenced"):
        pool.allocate()
    assert pool.refcount.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match=r"num_pages \(page 0 is the null page\) must be an integer from 2"):
        BlockPool(1)
    pool.check()


# The eviction order.


def test_eviction_takes_the_least_recently_released_cached_page_after_the_free_ones():
    pool = BlockPool(num_pages=5)
    first, second, third = keys(b"a", b"b", b"c")
    pages = {}
    for key in (first, second, third):
        pages[key] = pool.allocate()
        pool.register(pages[key], key)
    for key in (second, third, first):  # released in this order: evicted in this order
        pool.release(pages[key])
    assert (pool.num_free, pool.num_cached) == (1, 3)
    assert pool.allocate() == 4, "the free page goes before any cached one"
    assert pool.allocate() == pages[second]
    assert pool.find(second) is None and pool.find(third) == pages[third]
    # Taking a cached page back moves it out of the eviction order; released again, it goes last.
    pool.share([pages[third]])
    pool.release(pages[third])
    assert pool.allocate() == pages[first]
    assert pool.allocate() == pages[third]
    assert pool.find(first) is None and pool.find(third) is None
    assert pool.num_cached == 0
    pool.check()


def test_an_unregistered_page_leaves_the_cache():
    pool = BlockPool(num_pages=4)
    cached_key, live_key = keys(b"a", b"b")
    cached = registered(pool, cached_key)
    live = pool.allocate()
    pool.register(live, live_key)
    pool.unregister(live)  # about to be written in place
    pool.unregister(cached)
    assert pool.find(live_key) is None and pool.find(cached_key) is None
    assert (pool.num_free, pool.num_cached, pool.num_live) == (2, 0, 1)
    pool.release(live)
    assert pool.num_free == 3, "an unregistered page is freed, not cached"
    with pytest.raises(ValueError, match="page 1 is not registered"):
        pool.unregister(cached)
    pool.check()


# Digests.


def test_digests_chain_over_the_parent_the_salt_and_the_tokens():
    digest = block_digest(b"", b"", b"abcd")
    assert len(digest) == 32
    assert block_digest(b"", b"", b"abcd") == digest
    assert len({digest, block_digest(b"p", b"", b"abcd"), block_digest(b"", b"s", b"abcd")}) == 3
    assert block_digest(b"", b"ab", b"cd") != block_digest(b"", b"a", b"bcd"), "the salt's length is hashed"
    first, second = keys(b"ab", b"cd", salt=b"s")
    assert first == BlockKey(block_digest(b"", b"s", b"ab"), b"", b"s", b"ab")
    assert second == BlockKey(block_digest(first.digest, b"s", b"cd"), first.digest, b"s", b"cd")


def test_find_hits_only_the_exact_block_and_prefix():
    pool = BlockPool(num_pages=4)
    first, second = keys(b"ab", b"cd")
    pages = [registered(pool, first), registered(pool, second)]
    assert [pool.find(key) for key in keys(b"ab", b"cd")] == pages
    assert pool.find(keys(b"ab", b"cd", salt=b"other")[1]) is None, "another salt"
    assert pool.find(keys(b"xy", b"cd")[1]) is None, "another prefix"
    assert pool.find(keys(b"ab", b"ce")[1]) is None, "other tokens"
    assert pool.num_cached == 2, "find changes nothing"


def test_a_digest_another_page_holds_is_not_registered_again():
    pool = BlockPool(num_pages=4)
    (key,) = keys(b"ab")
    holder, duplicate = pool.allocate(), pool.allocate()
    assert pool.register(holder, key)
    assert not pool.register(duplicate, key)
    assert pool.key_of(duplicate) is None and pool.find(key) == holder
    with pytest.raises(ValueError, match="page 1 is registered already"):
        pool.register(holder, keys(b"zz")[0])
    with pytest.raises(ValueError, match="page 3 is not referenced"):
        pool.register(3, keys(b"zz")[0])
    pool.check()


@pytest.mark.parametrize(
    "digest",
    [
        pytest.param(lambda parent, salt, tokens: b"same", id="constant"),
        pytest.param(lambda parent, salt, tokens: tokens, id="ignores-parent-and-salt"),
    ],
)
def test_a_digest_collision_never_hits(monkeypatch, digest):
    monkeypatch.setattr(kvattn.paging.pool, "block_digest", digest)
    pool = BlockPool(num_pages=6)
    first, second = keys(b"ab", b"cd")
    page = registered(pool, first)
    colliding = [
        keys(b"ab", salt=b"s")[0],  # another salt
        keys(b"xy", b"ab")[1],  # another prefix
        BlockKey(first.digest, b"", b"", b"zz"),  # other tokens
    ]
    for other in colliding:
        assert other.digest == first.digest, "the collision is real"
        assert pool.find(other) is None, f"{other} was served the page of another block"
    assert pool.find(first) == page, "what is really cached is still found"
    assert pool.register(pool.allocate(), second) == (second.digest != first.digest)
    pool.check()


# Invariants.


def corrupt_free_twice(pool):
    pool._free.append(pool._free[-1])


def corrupt_free_and_cached(pool):
    pool._cached[pool._free[-1]] = None


def corrupt_referenced_free_page(pool):
    pool.refcount[pool._free[-1]] = 1


def corrupt_lost_page(pool):
    pool._free.pop()


def corrupt_digest_index(pool):
    pool._page_of_digest[b"other"] = pool._page_of_digest.pop(next(iter(pool._page_of_digest)))


def corrupt_cached_but_referenced(pool):
    pool.refcount[next(iter(pool._cached))] = 1


def corrupt_uncached_registered_page(pool):
    pool._free.append(pool._cached.popitem()[0])


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (corrupt_free_twice, "free list has duplicates"),
        (corrupt_free_and_cached, "pages both free and cached"),
        (corrupt_referenced_free_page, "a free or cached page is referenced"),
        (corrupt_lost_page, r"free 2 \+ cached 1 \+ live 1 != 5 pages"),
        (corrupt_digest_index, "registered pages and digests disagree"),
        (corrupt_cached_but_referenced, "a free or cached page is referenced"),
        (corrupt_uncached_registered_page, r"cached pages \[\] != unreferenced registered pages \[1\]"),
    ],
)
def test_check_names_a_broken_invariant(corrupt, message):
    pool = BlockPool(num_pages=6)
    registered(pool, keys(b"ab")[0])
    pool.allocate()
    pool.check()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check()
