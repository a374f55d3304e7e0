"""The plain cache contender of `python -m benchmarks --model`: the decoder that model collections hand-roll.

The same weights as the kvattn model, its fused projections split back
apart; per layer a `(B, S, K, H)` buffer written with `dynamic_update_slice`
and read whole, its unfilled tail masked; one jitted (cache-donated) step
per token, called from Python.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from benchmarks.timing import time_calls

__all__ = ["plain_weights", "step_fn", "time_plain"]


def plain_weights(model) -> dict[str, Any]:
    """The loaded model's weights as plain arrays: one dict per layer, as hand-rolled decoders keep them."""
    heads, kv_heads = model.config.num_heads, model.config.num_kv_heads
    layers = []
    for block in model.blocks:
        # kvattn stores the projections fused; hand-rolled decoders keep them apart.
        query, key, value = np.split(block.attention.qkv.float_kernel(), [heads, heads + kv_heads], axis=1)
        gate, up = np.split(block.mlp.gate_up.float_kernel(), 2, axis=1)
        layers.append({
            "attention_norm": block.attention_norm.weight[...], "mlp_norm": block.mlp_norm.weight[...],
            "query": query, "key": key, "value": value, "out": block.attention.out.float_kernel(),
            "gate": gate, "up": up, "down": block.mlp.down.float_kernel(),
        })
    head = model.lm_head.float_kernel() if model.lm_head is not None else model.weight_value("embed").T  # tied
    return {"embed": model.weight_value("embed"), "lm_head": head,
            "final_norm": model.final_norm.weight[...], "layers": layers}


def step_fn(config):
    """The hand-rolled decode step: `(weights, caches, tokens (B,), pos) -> (next tokens, caches)`."""
    import jax
    import jax.numpy as jnp

    from kvattn.math.rope import apply_rope

    eps, group = config.norm_eps, config.num_heads // config.num_kv_heads

    def rms(x, weight):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return normed.astype(x.dtype) * weight[None, :]

    def step(weights, caches, tokens, pos):
        keys, values = caches  # per layer, (B, S, K, H) each
        x = jnp.take(weights["embed"], tokens, axis=0)  # B D
        positions = jnp.broadcast_to(pos, (tokens.shape[0], 1))
        visible = jnp.arange(keys[0].shape[1]) <= pos  # the whole buffer is read; the unfilled tail is masked
        new_keys, new_values = [], []
        for layer, layer_keys, layer_values in zip(weights["layers"], keys, values):
            h = rms(x, layer["attention_norm"])
            q = apply_rope(jnp.einsum("BD,DNH->BNH", h, layer["query"])[:, None], positions, config.rope)
            k = apply_rope(jnp.einsum("BD,DKH->BKH", h, layer["key"])[:, None], positions, config.rope)
            v = jnp.einsum("BD,DKH->BKH", h, layer["value"])[:, None]
            layer_keys = jax.lax.dynamic_update_slice(layer_keys, k.astype(layer_keys.dtype), (0, pos, 0, 0))
            layer_values = jax.lax.dynamic_update_slice(layer_values, v.astype(layer_values.dtype), (0, pos, 0, 0))
            new_keys.append(layer_keys)
            new_values.append(layer_values)
            q = q[:, 0].reshape(q.shape[0], config.num_kv_heads, group, config.head_dim)  # B K G H
            scores = jnp.einsum("BKGH,BSKH->BKGS", q, layer_keys).astype(jnp.float32) / math.sqrt(config.head_dim)
            scores = jnp.where(visible[None, None, None, :], scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1).astype(layer_values.dtype)
            attended = jnp.einsum("BKGS,BSKH->BKGH", probs, layer_values).reshape(q.shape[0], config.num_heads, -1)
            x = x + jnp.einsum("BNH,NHD->BD", attended.astype(x.dtype), layer["out"])
            h = rms(x, layer["mlp_norm"])
            x = x + (jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]
        logits = (rms(x, weights["final_norm"]) @ weights["lm_head"]).astype(jnp.float32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), (new_keys, new_values)

    return jax.jit(step, donate_argnums=(1,))


def time_plain(model, prompts, new_tokens: int, repeats: int) -> dict[str, Any]:
    """The hand-rolled plain cache: the prompt stepped in token by token (untimed), then greedy decoding timed."""
    import jax
    import jax.numpy as jnp

    config = model.config
    weights = plain_weights(model)
    dtype = weights["embed"].dtype
    batch, prompt_len = prompts.shape
    shape = (batch, prompt_len + new_tokens, config.num_kv_heads, config.head_dim)
    step = step_fn(config)

    def prefilled():
        caches = tuple([jnp.zeros(shape, dtype) for _ in range(config.num_layers)] for _ in range(2))
        for pos in range(prompt_len):
            token, caches = step(weights, caches, jnp.asarray(prompts[:, pos]), jnp.int32(pos))
        return jax.block_until_ready((token, caches))

    def decode(token, caches):
        out = [token]
        for pos in range(prompt_len, prompt_len + new_tokens - 1):
            token, caches = step(weights, caches, token, jnp.int32(pos))
            out.append(token)
        return jax.block_until_ready(out)

    decode(*prefilled())  # warm-up, before counting the compiled programs
    compiled = step._cache_size()
    timing = time_calls(lambda state: decode(*state), repeats, prepare=prefilled, units=new_tokens - 1, warm_ups=0)
    return {
        "decode_ms_per_token": statistics.median(timing.ms),
        "compiles_while_timed": step._cache_size() - compiled,
        "tokens": np.stack([np.asarray(t) for t in timing.last_output], axis=1).tolist(),
    }
