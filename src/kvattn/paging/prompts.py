"""A prompt for prefix caching: its token ids and salt checked, cut into page-sized blocks, looked up in the pool."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvattn.caches.base import INT32_MAX
from kvattn.paging.pool import BlockPool, block_chain

__all__ = ["cached_prefix", "checked_salt", "prompt_blocks", "token_array"]


def token_array(tokens) -> np.ndarray:
    """Token ids as a 1-D little-endian int32 array, refusing anything that would change on the way."""
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(
            f"tokens must be a 1-D sequence of integer ids, got shape {array.shape} dtype {array.dtype}"
        )
    if array.size and (array.min() < -INT32_MAX - 1 or array.max() > INT32_MAX):
        raise ValueError(f"token ids must fit in int32, got ids from {array.min()} to {array.max()}")
    return array.astype("<i4")


def checked_salt(salt) -> bytes:
    if not isinstance(salt, bytes):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}; encode a string first")
    return salt


def prompt_blocks(tokens: np.ndarray, page_size: int, count: int) -> Iterator[bytes]:
    """The bytes of a prompt's first `count` full blocks."""
    for block in range(count):
        yield tokens[block * page_size : (block + 1) * page_size].tobytes()


def cached_prefix(pool: BlockPool, tokens, salt: bytes, page_size: int, max_blocks: int) -> list[int]:
    """The cached pages of a prompt's longest page-aligned hit, leaving its last token out."""
    tokens, salt = token_array(tokens), checked_salt(salt)
    count = min(max(len(tokens) - 1, 0) // page_size, max_blocks)
    pages = []
    for key in block_chain(salt, prompt_blocks(tokens, page_size, count)):
        page = pool.find(key)
        if page is None:
            break
        pages.append(page)
    return pages
