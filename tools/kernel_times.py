"""Times the native kernels a serving step runs, at the 125M Llama's shapes: to compare two builds of them.

The model benchmark's 125M Llama (`benchmarks.model.LLAMA_125M`: 12 query
heads on 4 kv heads of 64, hidden 768, intermediate 2048), pages of 16 in
shuffled order, random inputs made once:

- `decode`: `paged_decode_attention`, 8 sequences each `--depths` deep;
- `chunk`: `paged_prefill_attention`, a chunk of each of `--chunks` tokens
  over 8,192 cached ones;
- `dot`: `f32_dot`, each of `--rows` rows by the up projection (768 x 2048)
  and the down projection (2048 x 768);
- `step's dots`: each of `--rows` rows through every float32 dot of a decode
  step, chained (12 layers' fused query-key-value, output, fused gate-up
  and down projections, then the 32,000-row head: 400 MB, read from
  memory, unlike the single dots above).

Each call is timed `--repeats` times in turn with the others (compile
excluded, `block_until_ready`); medians in ms, and the machine's load. The
same inputs are called again, so a kernel's inputs may still be in the
cache when they fit (16 MB a layer for `chunk`): compare builds with this
tool, and a kernel's speed in a model with the model's benchmarks. To
compare two builds, run it under each, alternating:

    python -m tools.kernel_times [--depths 512,2048] [--chunks 1,8,16,64] [--rows 8,12,16,64] [--repeats 30]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.model import LLAMA_125M
from benchmarks.provenance import load_average
from kvattn.kernels import native

PAGE, BATCH, CACHED = 16, 8, 8192


def paged_pools(key, positions: int, kv_heads: int, head_dim: int, rows: int):
    """Random keys and values pools for `rows` sequences of `positions` in pages of 16, and their tables over
    the pages in shuffled order (as a pool that has served other requests holds them; page 0 left out)."""
    pages = rows * -(-positions // PAGE)
    k_pool, v_pool = (jax.random.normal(k, (pages + 1, kv_heads, PAGE, head_dim)) for k in jax.random.split(key))
    table = 1 + np.random.default_rng(0).permutation(pages).reshape(rows, -1)
    return k_pool, v_pool, jnp.asarray(table, jnp.int32)


def calls(depths, chunks, rows) -> dict:
    """`{name: (jitted kernel, arguments)}` for every shape asked for."""
    heads, kv_heads = LLAMA_125M["num_heads"], LLAMA_125M["num_kv_heads"]
    head_dim, hidden = LLAMA_125M["hidden_size"] // heads, LLAMA_125M["hidden_size"]
    keys = (jax.random.fold_in(jax.random.key(0), i) for i in itertools.count())
    out = {}
    decode, chunk, dot = (jax.jit(f) for f in (native.paged_decode_attention, native.paged_prefill_attention,
                                                 native.f32_dot))
    for depth in depths:
        q = jax.random.normal(next(keys), (BATCH, kv_heads, heads // kv_heads, head_dim))
        k_pool, v_pool, table = paged_pools(next(keys), depth, kv_heads, head_dim, BATCH)
        filled = jnp.full((BATCH,), depth, jnp.int32)
        out[f"decode B={BATCH} depth {depth}"] = decode, (q, k_pool, v_pool, table, filled)
    k_pool, v_pool, table = paged_pools(next(keys), CACHED + max(chunks, default=0), kv_heads, head_dim, 1)
    for width in chunks:
        q = jax.random.normal(next(keys), (1, width, heads, head_dim))
        k_new, v_new = (jax.random.normal(next(keys), (1, width, kv_heads, head_dim)) for _ in range(2))
        out[f"chunk {width} over {CACHED}"] = chunk, (q, k_new, v_new, k_pool, v_pool, table, jnp.int32([CACHED]),
                                                      jnp.int32([width]))
    for inputs, outputs in ((hidden, LLAMA_125M["intermediate_size"]), (LLAMA_125M["intermediate_size"], hidden)):
        panels = jax.random.normal(next(keys), (outputs // 16, inputs, 16))
        for m in rows:
            out[f"dot {m} x {inputs} x {outputs}"] = dot, (jax.random.normal(next(keys), (m, inputs)), panels)
    step = step_panels(keys)
    for m in rows:
        out[f"step's dots, {m} rows"] = jax.jit(step_dots), (jax.random.normal(next(keys), (m, hidden)), step)
    return out


def step_panels(keys) -> list:
    """Random panels `(N / 16, K, 16)` of every float32 dot of the 125M Llama's decode step, in order."""
    hidden, inner = LLAMA_125M["hidden_size"], LLAMA_125M["intermediate_size"]
    head_dim = hidden // LLAMA_125M["num_heads"]
    qkv = hidden + 2 * LLAMA_125M["num_kv_heads"] * head_dim
    shapes = [(hidden, qkv), (hidden, hidden), (hidden, 2 * inner), (inner, hidden)] * LLAMA_125M["num_layers"]
    shapes.append((hidden, LLAMA_125M["vocab_size"]))
    return [0.03 * jax.random.normal(next(keys), (n // 16, k, 16)) for k, n in shapes]


def step_dots(x, step: list):
    """`x` through every dot of `step`, each taking the first inputs of the one before's outputs (the step's
    other work, attention and norms, left out)."""
    for panels in step:
        x = native.f32_dot(x[:, : panels.shape[1]], panels)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="512,2048", help="decode depths (none: empty)")
    parser.add_argument("--chunks", default="1,8,16,64", help="chunk widths (none: empty)")
    parser.add_argument("--rows", default="8,12,16,64")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",") if x]
    for target in (native.PAGED_DECODE_ATTENTION, native.PAGED_PREFILL_ATTENTION, native.F32_DOT):
        if not native.available(target):
            raise SystemExit(f"{target} cannot run here")
    contenders = calls(ints(args.depths), ints(args.chunks), ints(args.rows))
    for run, arguments in contenders.values():
        jax.block_until_ready(run(*arguments))  # compiled
    times = {name: [] for name in contenders}
    loads = [load_average()[0]]
    for _ in range(args.repeats):
        for name, (run, arguments) in contenders.items():
            start = time.perf_counter()
            jax.block_until_ready(run(*arguments))
            times[name].append(time.perf_counter() - start)
    loads.append(load_average()[0])
    print(f"load {loads[0]:.2f} -> {loads[1]:.2f}, {args.repeats} repeats, medians")
    for name, seconds in times.items():
        print(f"  {name:28s} {statistics.median(seconds) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
