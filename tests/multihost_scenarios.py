"""Scenarios that `tests/multihost.py` runs in every process of a multi-controller run.

Each takes a `Context` and returns, on every process, the same dict of NumPy
values (global arrays are all-gathered). With one process and no mesh, the
same function is the single-device oracle the test compares against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kvattn
from kvattn.validation import host

BATCH, IN_FEATURES, HEADS, KV_HEADS, MAX_LEN = 4, 16, 4, 2, 16
ROPE = kvattn.RoPE(scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8})


def build(ctx):
    """The layer, and `put(array, spec)` that makes an input a global array on the mesh (or a plain one)."""
    data, model = ctx.kwargs.get("data", 1), ctx.kwargs.get("model", 1)
    options = dict(max_len=MAX_LEN, batch_size=BATCH, num_kv_heads=KV_HEADS, rope=ROPE, normalize_qk="rms",
                   cache_layout=ctx.kwargs.get("layout", "slots_major"), rngs=nnx.Rngs(0))
    if data * model == 1:
        return kvattn.MultiHeadAttention(HEADS, IN_FEATURES, **options), lambda array, spec: jnp.asarray(array)
    mesh = kvattn.make_mesh(data=data, model=model)
    with jax.set_mesh(mesh):
        layer = kvattn.MultiHeadAttention(HEADS, IN_FEATURES, data_axis="data", model_axis="model", **options)

    def put(array, spec):
        array = np.asarray(array)
        return jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec), lambda index: array[index])

    return layer, put


def cache(layer) -> dict:
    return {"/".join(map(str, path)): host(v[...]) for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Cache))}


def decoding_paths(ctx) -> dict:
    """Eager prefill/step, Decoder, decode, generate, fork/reorder/truncate/reset, attend, overflow, snapshots."""
    layer, put = build(ctx)
    xs_host = np.random.default_rng(0).standard_normal((BATCH, 14, IN_FEATURES)).astype(np.float32)
    xs = put(xs_host, P("data"))
    out = {}
    out["prefill"] = host(layer.prefill(xs[:, :3], put(np.array([3, 2, 1, 0], np.int32), P("data"))))
    out["step"] = host(layer.step(xs[:, 3], put(np.array([True, True, False, True]), P("data"))))
    decoder = kvattn.Decoder(layer)
    out["decoder_step"] = host(decoder.step(xs[:, 4]))
    out["decoder_prefill"] = host(decoder.prefill(xs[:, 5:7], np.array([2, 1, 2, 0], np.int32)))
    out["decoder_pos"] = np.asarray(decoder.pos)
    decoder.sync()
    out["decode"] = host(kvattn.decode(layer, xs[:, 7:9]))
    generation = kvattn.rollout(layer, xs[:, 9], 2, jnp.tanh)
    out["generate"], out["generate_length"] = host(generation.outputs), host(generation.length)
    out["cache_after_drivers"] = cache(layer)
    layer.fork(0, [3])
    layer.reorder(np.array([1, 0, 2, 3], np.int32))
    layer.truncate(np.array([5, 4, 3, 2], np.int32))
    layer.reset([2])
    out["after_edits"] = host(layer.step(xs[:, 10]))
    before = cache(layer)
    try:
        layer.prefill(xs[:, :12])
        out["overflow_raised"] = False
    except kvattn.CacheOverflowError:
        out["overflow_raised"] = True
    out["unchanged_after_overflow"] = all(np.array_equal(before[k], v) for k, v in cache(layer).items())
    out["attend"] = host(kvattn.attend(layer, xs[:, :4], xs[:, 4], lengths=np.array([4, 3, 2, 1], np.int32)))
    out["final_cache"] = cache(layer)
    path = ctx.kwargs.get("snapshot")
    if path is not None:
        kvattn.save_cache(layer, path)
        out["after_save"] = host(layer.step(xs[:, 11]))
    return out
