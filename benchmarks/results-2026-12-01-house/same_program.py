"""Prints the StableHLO of the pure step as the decoding drivers run it (B=1, heads-major, write first), without
source locations, so two revisions' programs can be diffed:

    cd /tmp && PYTHONPATH=/tmp/old-src/src python same_program.py | sed 's/%[0-9a-z_]*/%x/g' > old.mlir
    cd /tmp && PYTHONPATH=/work/main/src python same_program.py | sed 's/%[0-9a-z_]*/%x/g' > new.mlir
    diff old.mlir new.mlir   # empty on 2026-12-01: 403 lines each

It reads the module that holds `extend` under either name (`kvattn.step` before the rename, `kvattn.forward` after).
"""

import re

import jax
import jax.numpy as jnp
from flax import nnx

import kvattn
from kvattn import decoding

try:
    from kvattn.forward import extend
except ImportError:
    from kvattn.step import extend

layer = kvattn.MultiHeadAttention(8, 512, max_len=2048, batch_size=1, cache_layout="heads_major", rngs=nnx.Rngs(0))
weights, cache = decoding.working(layer.config, layer.weights, layer.stored_cache)
xs, lengths = jnp.zeros((1, 1, 512)), jnp.ones((1,), jnp.int32)
program = jax.jit(extend, static_argnames=("config", "write_first"))
text = program.lower(weights, cache, xs, lengths, config=layer.config, write_first=True).as_text()
print(re.sub(r"#loc\d*", "", re.sub(r"loc\([^)]*\)", "", text)))
