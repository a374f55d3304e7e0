"""int8 step's dots (125M Llama decode step shapes, 400 MB f32 -> 100 MB int8 tiles), M rows, from memory."""
import sys, time, statistics, numpy as np, jax, jax.numpy as jnp
from kvattn.kernels import native
from benchmarks.model import LLAMA_125M
hidden, inner = LLAMA_125M["hidden_size"], LLAMA_125M["intermediate_size"]
qkv = hidden + 2 * LLAMA_125M["num_kv_heads"] * (hidden // LLAMA_125M["num_heads"])
shapes = [(hidden, qkv), (hidden, hidden), (hidden, 2 * inner), (inner, hidden)] * LLAMA_125M["num_layers"] + [(hidden, LLAMA_125M["vocab_size"])]
rng = np.random.default_rng(0)
tiles = [jnp.asarray(rng.integers(0, 256, (n // 16, k // 4, 16, 4), dtype=np.uint8)) for k, n in shapes]
def chain(x, tiles):
    out = []
    for t in tiles:
        k = t.shape[1] * 4
        out.append(native.int8_dot(x[:, :k], t)[:, 0])
    return out
f = jax.jit(chain)
for m in [int(v) for v in sys.argv[1].split(",")]:
    x = jnp.asarray(rng.integers(-127, 128, (m, 2048), dtype=np.int8))
    jax.block_until_ready(f(x, tiles))
    ts = []
    for _ in range(int(sys.argv[2])):
        t = time.perf_counter(); jax.block_until_ready(f(x, tiles)); ts.append(time.perf_counter() - t)
    print(f"  int8 step's dots, {m} rows: median {statistics.median(ts)*1e3:.2f} ms (min {min(ts)*1e3:.2f})")
