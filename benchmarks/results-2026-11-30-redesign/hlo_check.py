"""Counts cache-sized copies in the compiled B=8 `decode` program with and without donation, and times a
non-donated against a donated update of two 32 MiB arrays. Run at b62a900 on 2026-11-30:
    cd /tmp && PYTHONPATH=/tmp/bench-new/src /work/main/.venv/bin/python hlo_check.py
It reads private names (`decoding._compiled`, `decoding._decode`) of that commit."""

import re, time, jax, jax.numpy as jnp
from flax import nnx
import kvattn
from kvattn import decoding
for layout in ("heads_major", "slots_major"):
    layer = kvattn.MultiHeadAttention(8, 512, max_len=2048, batch_size=8, cache_layout=layout, cache_dtype="float32", rngs=nnx.Rngs(0))
    xs = jnp.zeros((8, 32, 512))
    for donate in (False, True):
        prog = decoding._compiled(decoding._decode, donate, ("config",))
        txt = prog.lower(layer.config, layer.weights, layer.stored_cache, xs).compile().as_text()
        big = [l for l in txt.splitlines() if re.search(r"= f32\[8,(8,2048|2048,8),64\]\{[^}]*\} copy\(", l)]
        alias = re.search(r"input_output_alias=\{[^}]*\}", txt)
        print(layout, "donate", donate, "cache-sized copies:", len(big), "alias:", alias.group(0)[:120] if alias else None)
# fresh 64 MiB copy cost vs in place
a = jnp.ones((8, 8, 2048, 64)); b = jnp.ones((8, 8, 2048, 64))
f = jax.jit(lambda a, b: (a.at[:, :, 0].set(1.0), b.at[:, :, 0].set(1.0)))
g = jax.jit(lambda a, b: (a.at[:, :, 0].set(1.0), b.at[:, :, 0].set(1.0)), donate_argnums=(0, 1))
jax.block_until_ready(f(a, b))
ts=[]
for _ in range(9):
    t=time.perf_counter(); jax.block_until_ready(f(a, b)); ts.append(time.perf_counter()-t)
print("non-donated update of two 32 MiB arrays (copy into fresh buffers): median ms", sorted(ts)[4]*1e3)
ts=[]
for _ in range(9):
    a, b = jnp.ones((8, 8, 2048, 64)), jnp.ones((8, 8, 2048, 64)); jax.block_until_ready((a,b))
    t=time.perf_counter(); a, b = jax.block_until_ready(g(a, b)); ts.append(time.perf_counter()-t)
print("donated update (in place): median ms", sorted(ts)[4]*1e3)
