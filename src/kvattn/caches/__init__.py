"""The cache types: how keys and values are stored, written and read (`contiguous`, with its ring, and `paged`)."""
