"""Before/after figures for issue #33 (cache types as specs, kernels in one package, the layers as folders): the
same measurements on two revisions, in alternating subprocesses, so that machine noise falls on both alike.

Usage, from the repository root (the old revision checked out elsewhere, e.g. with `git worktree add`, and its
native extension built there):

    .venv/bin/python benchmarks/results-2026-12-03-house/ab.py OLD_SRC NEW_SRC [ROUNDS]

Each round runs one process per revision (old first on odd rounds, new first on even ones). Each process uses
only public names (`kvattn.MultiHeadAttention`, `kvattn.Decoder`, `kvattn.PageManager`, `kvattn.models`,
`kvattn.generation`), so the one child program runs on both; it warms every program up, then reports the median
of its timed repeats (`block_until_ready` after each). Printed: per figure, each side's per-round medians, the
median of those, and new/old, with the machine's load average before and after.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import kvattn
from kvattn import generation, models

def median_ms(call, repeats):
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); jax.block_until_ready(call()); times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)

out = {}
# The layer: a compiled Decoder step at T=512 of max_len 1024 (D=512, 8 heads), both cache layouts
# (heads-major takes the native decode kernel on this CPU, slots-major XLA).
for layout in ("heads_major", "slots_major"):
    for batch in (1, 8):
        layer = kvattn.MultiHeadAttention(8, 512, max_len=1024, batch_size=batch, cache_layout=layout,
                                          rngs=nnx.Rngs(0))
        xs = jax.random.normal(jax.random.key(0), (batch, 512, 512))
        layer.prefill(xs)
        decoder = kvattn.Decoder(layer)
        x = xs[:, 0]
        out[f"layer Decoder.step {layout} B={batch} T=512 (ms)"] = median_ms(lambda: decoder.step(x), 200)

# The paged step: the same layer over pages of 16, 8 sequences each holding 512 tokens.
pages = 8 * 1024 // 16 + 1
layer = kvattn.MultiHeadAttention(8, 512, max_len=1024, batch_size=8, num_pages=pages, page_size=16,
                                  rngs=nnx.Rngs(0))
manager = kvattn.PageManager(num_pages=pages, page_size=16, max_sequences=8, max_pages_per_sequence=64)
for _ in range(8):
    manager.add()
xs = jax.random.normal(jax.random.key(0), (8, 512, 512))
layer.prefill(xs, jnp.full((8,), 512), pages=manager.reserve([512] * 8))
step = nnx.jit(lambda layer, x, pages: layer.step(x, pages=pages))
batch_pages = manager.reserve([1] * 8)  # the same reservation each time: every step writes position 512
out["paged layer step B=8 T=512 (ms)"] = median_ms(lambda: step(layer, xs[:, 0], batch_pages), 100)

# The model: a random 4-layer Llama-shaped model (D=512, 8 heads, 4 kv heads, V=8192), generate() of 64 new
# tokens after 32-token prompts: ms per new token (whole call, prefill included), float32 and int8 weights.
config = models.ModelConfig("llama", vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                            head_dim=64, intermediate_size=1536, norm_eps=1e-5, tie_embeddings=False,
                            max_position_embeddings=1024, rope=kvattn.RoPE(theta=10000.0))
for weights in ("float32", "int8"):
    for batch in (1, 8):
        model = models.CausalLM(config, max_len=128, batch_size=batch, weights=None if weights == "float32" else weights,
                                rngs=nnx.Rngs(0))
        prompts = np.random.default_rng(0).integers(0, 8192, (batch, 32))

        def run():
            model.reset()
            return generation.generate(model, prompts, 64).tokens

        out[f"model generate {weights} B={batch} (ms/new token)"] = median_ms(run, 7) / 64
print(json.dumps(out))
'''


def run(src: str) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, cwd="/tmp",
                          check=False)
    if done.returncode:
        raise SystemExit(f"{src}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(old: str, new: str, rounds: int = 3):
    results = {"old": [], "new": []}
    load_before = os.getloadavg()
    for round_ in range(rounds):
        order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
        for side in order:
            results[side].append(run(old if side == "old" else new))
            print(side, results[side][-1], file=sys.stderr, flush=True)
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print("| figure | old (per round) | new (per round) | old | new | new/old |")
    print("|---|---|---|---:|---:|---:|")
    for name in results["old"][0]:
        olds = [r[name] for r in results["old"]]
        news = [r[name] for r in results["new"]]
        old_m, new_m = statistics.median(olds), statistics.median(news)
        fmt = lambda xs: ", ".join(f"{x:.3g}" for x in xs)  # noqa: E731
        print(f"| {name} | {fmt(olds)} | {fmt(news)} | {old_m:.3g} | {new_m:.3g} | {new_m / old_m:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
