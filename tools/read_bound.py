"""The machine's streaming-read bandwidth, three ways, side by side: what the benchmarks' limit is.

Over one float32 buffer larger than the last-level cache (400 MB by
default, about the 125M model's decode step), in turn within each repeat:

- `read_max`: kvattn's native streaming read (`kvattn.kernels.native`), the
  benchmarks' limit since #36 (`benchmarks.baselines.Calibration`);
- XLA's max-reduction of the same buffer (`read_max`'s twin, the limit
  where the native kernel cannot run);
- XLA's mat-vec over it (the limit before: a library's own speed).

GB/s of the median pass, on XLA's threads (the contenders' own), and the
machine's load.

    python -m tools.read_bound [--megabytes 400] [--repeats 15]   # from the repository root
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

from kvattn.kernels import native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rows, columns = 64, args.megabytes * 10**6 // (4 * 64 * 4096) * 4096  # whole rows of the mat-vec too
    x = jax.random.normal(jax.random.key(0), (rows, columns), jnp.float32)
    flat = x.reshape(-1, 4096)
    vector = jnp.ones((4096,), jnp.float32)
    reads = {"XLA max-reduction": lambda: jax.jit(native.read_max_on_xla)(x),
             "XLA mat-vec": lambda: jax.jit(jnp.matmul)(flat, vector)}
    if native.available(native.READ_MAX):
        reads = {"native read_max": lambda: jax.jit(native.read_max)(x), **reads}
    else:
        print(f"native read_max: {native.unavailable_reason(native.READ_MAX)}")
    for read in reads.values():
        jax.block_until_ready(read())
    times = {name: [] for name in reads}
    load = os.getloadavg()
    for _ in range(args.repeats):
        for name, read in reads.items():
            start = time.perf_counter()
            jax.block_until_ready(read())
            times[name].append(time.perf_counter() - start)
    print(f"{x.nbytes / 1e6:.0f} MB, {args.repeats} repeats, load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    for name, seconds in times.items():
        print(f"{name:20s} {x.nbytes / statistics.median(seconds) / 1e9:6.1f} GB/s "
              f"(median {1e3 * statistics.median(seconds):.1f} ms, {1e3 * min(seconds):.1f}-{1e3 * max(seconds):.1f})")


if __name__ == "__main__":
    main()
