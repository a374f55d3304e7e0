"""CPU and wall time per `Decoder.step` (D=512, 8 heads, max_len 4096, 65 tokens held), over 2,000 steps.

    PYTHONPATH=OLD_OR_NEW_SRC .venv/bin/python benchmarks/results-2026-12-03-house/step_cpu_time.py 8 heads_major

Prints `[cpu ms, wall ms]` per step; run it for each revision in alternation. CPU time (all threads) is
less sensitive than wall time to other processes on a shared machine.
"""
import json, sys, time
import jax
from flax import nnx
import kvattn
B = int(sys.argv[1]); layout = sys.argv[2]
layer = kvattn.MultiHeadAttention(8, 512, max_len=4096, batch_size=B, cache_layout=layout, rngs=nnx.Rngs(0))
xs = jax.random.normal(jax.random.key(0), (B, 64, 512))
layer.prefill(xs)
decoder = kvattn.Decoder(layer)
x = xs[:, 0]
jax.block_until_ready(decoder.step(x))
c0, w0 = time.process_time(), time.perf_counter()
for _ in range(2000):
    jax.block_until_ready(decoder.step(x))
print(json.dumps([1e3 * (time.process_time() - c0) / 2000, 1e3 * (time.perf_counter() - w0) / 2000]))
