"""Temporary: the old home of `kvattn.paging`'s names, kept until its last importers move to `kvattn.paging`."""

from kvattn.paging import NULL_PAGE, OutOfPagesError, PageBatch, PageManager  # noqa: F401
