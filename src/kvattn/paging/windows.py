"""Which blocks a sequence must keep: all of them under full attention, the last few under a sliding window.

A policy tells the sequence manager which leading blocks a sequence may
release (those no later query sees) and how many pages a sequence holds at
most while it grows, for admission. The manager asks; it never branches on
the kind of attention.

>>> policy = window_policy(page_size=4, window=6)
>>> policy.first_block_seen(9)  # a query at position 9 sees positions 4 to 9
1
>>> policy.most_pages_held(100), window_policy(page_size=4, window=None).most_pages_held(100)
(3, 25)
"""

from __future__ import annotations

from kvattn.caches.base import blocks_spanned


class FullAttention:
    """Every query sees every earlier position, so a sequence keeps every block it wrote.

    Args:
        page_size: positions per page.
    """

    window: int | None = None

    def __init__(self, page_size: int):
        self.page_size = page_size

    def first_block_seen(self, pos: int) -> int:
        """The first block a query at `pos` sees; the blocks before it may be released."""
        return 0

    def most_pages_held(self, num_tokens: int, chunk: int = 1) -> int:
        """The most pages a sequence holds at once while it grows to `num_tokens` tokens, `chunk` at a time."""
        return blocks_spanned(num_tokens, self.page_size)


class SlidingWindow(FullAttention):
    """A query sees only the last `window` positions, so blocks wholly before them are released.

    Args:
        page_size: positions per page.
        window: positions a query sees, itself included.
    """

    def __init__(self, page_size: int, window: int):
        super().__init__(page_size)
        self.window = window

    def first_block_seen(self, pos: int) -> int:
        return max(0, pos - self.window + 1) // self.page_size

    def most_pages_held(self, num_tokens: int, chunk: int = 1) -> int:
        """At most the blocks one query sees, plus one.

        A chunk of tokens appended at once holds, for that call, the pages of
        the whole chunk and of the window before it.
        """
        page_size, window = self.page_size, self.window
        if num_tokens <= window:
            return blocks_spanned(num_tokens, page_size)
        if chunk > 1:
            chunked = blocks_spanned(window - 1 + min(chunk, num_tokens), page_size) + 1
            return min(blocks_spanned(num_tokens, page_size), max(self.most_pages_held(num_tokens), chunked))

        def held(length: int) -> int:  # once its last token, at `length - 1`, was appended alone
            return (length - 1) // page_size - (length - window) // page_size + 1

        # Past the window, what is held repeats with the alignment of the window to the pages.
        lengths = range(window + 1, min(num_tokens, window + page_size) + 1)
        return max(blocks_spanned(window, page_size), *map(held, lengths))


def window_policy(page_size: int, window: int | None) -> FullAttention:
    """The policy of an attention that sees the last `window` positions, or all of them if `window` is None."""
    return FullAttention(page_size) if window is None else SlidingWindow(page_size, window)
