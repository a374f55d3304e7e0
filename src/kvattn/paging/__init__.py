"""The host half of paging, NumPy only: a block pool of pages, and the sequence manager that maps sequences onto it."""

from kvattn.paging.manager import PageBatch, PageManager
from kvattn.caches.base import NULL_PAGE
from kvattn.paging.pool import BlockPool, OutOfPagesError

__all__ = ["NULL_PAGE", "BlockPool", "OutOfPagesError", "PageBatch", "PageManager"]
