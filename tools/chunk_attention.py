"""Times one layer's chunk attention over a deep paged cache: the native kernel against its floor.

A prefill chunk of `--chunk` tokens over `--depth` cached ones, the model
benchmark's 125M Llama heads (12 query heads on 4 kv heads of 64), pages of
16: `kvattn.kernels.native.paged_prefill_attention` and its XLA twin, each
timed over `--repeats` calls (medians, compile excluded, interleaved), with
the work both do (two dots of 2 * chunk * heads * depth * 64 flops) and the
bytes of keys and values a pass reads once, so a figure shows how far a
kernel is from reading its inputs once at the CPU's dot rate.

    python -m tools.chunk_attention [--depth 8192] [--chunk 16] [--repeats 20]   # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.model import LLAMA_125M
from benchmarks.provenance import load_average
from kvattn.kernels import native
from tools.kernel_times import paged_pools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not native.available(native.PAGED_PREFILL_ATTENTION):
        raise SystemExit("the native paged prefill attention kernel cannot run here")
    heads, kv_heads = LLAMA_125M["num_heads"], LLAMA_125M["num_kv_heads"]
    head_dim = LLAMA_125M["hidden_size"] // heads
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, args.chunk, heads, head_dim))
    k_new, v_new = (jax.random.normal(key, (1, args.chunk, kv_heads, head_dim)) for key in keys[1:3])
    # Pages in a shuffled order, as a pool that has served other requests holds them.
    k_pages, v_pages, table = paged_pools(keys[3], args.depth + args.chunk, kv_heads, head_dim, 1)
    held, fresh = jnp.int32([args.depth]), jnp.int32([args.chunk])
    contenders = {
        "native": jax.jit(native.paged_prefill_attention),
        "xla": jax.jit(native.paged_prefill_attention_on_xla),
    }
    inputs = (q, k_new, v_new, k_pages, v_pages, table, held, fresh)
    outputs = {name: np.asarray(run(*inputs)) for name, run in contenders.items()}  # compiled, and checked
    np.testing.assert_allclose(outputs["native"], outputs["xla"], rtol=1e-4, atol=1e-4)
    times = {name: [] for name in contenders}
    loads = [load_average()[0]]
    for _ in range(args.repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            jax.block_until_ready(run(*inputs))
            times[name].append(time.perf_counter() - start)
    loads.append(load_average()[0])
    flops = 2 * 2 * args.chunk * heads * (args.depth + (args.chunk + 1) / 2) * head_dim
    read = 2 * kv_heads * args.depth * head_dim * 4
    print(f"chunk {args.chunk} over {args.depth} cached tokens, {heads} heads on {kv_heads} of {head_dim}: "
          f"{flops / 1e9:.3f} GFLOP, keys and values {read / 2**20:.1f} MiB; load {loads[0]:.2f} -> {loads[1]:.2f}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:6s} median {median * 1e3:8.3f} ms  ({flops / median / 1e9:6.1f} GFLOP/s, "
              f"{read / median / 1e9:6.2f} GB/s of keys and values)")


if __name__ == "__main__":
    main()
