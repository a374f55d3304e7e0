"""What bounds a paged decode step on XLA:CPU: copying pages into a view, against reading a buffer in place.

A paged step gathers each sequence's pages into a contiguous view before its
dots read it (XLA:CPU has no kernel that reads pages in place); a contiguous
step's dots read the cache where it lies. This times, at one chunk of the
paged read (B=8 sequences, 1024 tokens, 8 kv heads of 64, pages of 16):

- the gather of the chunk's pages from a pool, into a view;
- a plain copy of as many bytes into a fresh buffer;
- an in-place read (a sum) of as many bytes.

    python tools/gather_bound.py
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

BATCH, TOKENS, KV_HEADS, HEAD_DIM, PAGE = 8, 1024, 8, 64, 16


def median_ms(fn, *args, repeats: int = 31) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    blocks = TOKENS // PAGE
    num_pages = 1 + BATCH * 2048 // PAGE
    pool = jnp.ones((num_pages, KV_HEADS, PAGE, HEAD_DIM), jnp.float32)
    table = jnp.asarray(1 + np.random.default_rng(0).permutation(num_pages - 1)[: BATCH * blocks].reshape(BATCH, blocks))
    contiguous = jnp.ones((BATCH, KV_HEADS, TOKENS, HEAD_DIM), jnp.float32)
    megabytes = contiguous.size * 4 / 1e6
    rows = [
        ("gather pages into a view", jax.jit(lambda p, t: p[t]), (pool, table)),
        ("copy into a fresh buffer", jax.jit(lambda c: c + 0.0), (contiguous,)),
        ("read in place (sum)", jax.jit(jnp.sum), (contiguous,)),
    ]
    print(f"{megabytes:.1f} MB per chunk")
    for name, fn, args in rows:
        ms = median_ms(fn, *args)
        print(f"{name:26s} {ms:7.3f} ms  {megabytes / ms:5.1f} GB/s")


if __name__ == "__main__":
    main()
