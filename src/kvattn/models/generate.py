"""Whole-model generation: ragged prompts in, new tokens out, the loop compiled once per (batch, prompt bucket)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import validation as check
from kvattn.models.decoder import DecoderLM

__all__ = ["Generated", "generate", "stream"]


class Generated(NamedTuple):
    """What `generate` returns."""

    tokens: jax.Array
    """`(B, max_new_tokens)` int32; after a stop token, zeros."""
    counts: jax.Array
    """`(B,)` int32: tokens each sequence produced, its stop token included."""


def _bucket(length: int) -> int:
    """Prompt lengths are padded up to a power of two (at least 8), so few programs serve all prompts."""
    return max(8, 1 << (length - 1).bit_length())


def generate(model: DecoderLM, prompts, max_new_tokens: int, *, lengths=None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_tokens=(), rng=None) -> Generated:
    """Appends each prompt to the model's caches, then samples `max_new_tokens` tokens per sequence.

    The caches afterwards hold the prompts and every new token, so
    generation can go on. Nothing the caller holds is deleted: the compiled
    loop works on its own copy of the caches and the model gets the new ones.

    Args:
      model: a `DecoderLM` built with `batch_size=B`.
      prompts: int `(B, T)`, right-padded.
      max_new_tokens: tokens to produce per sequence.
      lengths: int `(B,)`, the real length of each prompt (1..T); default T.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_k, top_p: sample only among the k most likely tokens / the
        smallest set holding probability p.
      stop_tokens: a sequence stops after producing one of these.
      rng: a `jax.random.key`, needed when `temperature > 0`.

    Returns:
      `Generated(tokens, counts)`.
    """
    prompts = np.asarray(check.host(prompts))
    batch = model.blocks[0].attention.config.batch_size
    if prompts.ndim != 2 or prompts.shape[0] != batch or not np.issubdtype(prompts.dtype, np.integer):
        raise ValueError(f"prompts must be int (batch_size={batch}, T), got {prompts.dtype} {prompts.shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    num_prompt = prompts.shape[1]
    lengths = np.full((batch,), num_prompt) if lengths is None else np.asarray(check.host(lengths))
    if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > num_prompt:
        raise ValueError(f"lengths must be int ({batch},) in [1, {num_prompt}], got {lengths.tolist()}")
    if not 0 <= (prompts.min() if prompts.size else 0) and prompts.max() < model.config.vocab_size:
        raise ValueError(f"prompt tokens must lie in [0, {model.config.vocab_size}), got {prompts.min()}..{prompts.max()}")
    if temperature < 0 or (temperature > 0 and rng is None):
        raise ValueError(f"temperature must be >= 0, and a sampled generation needs rng; got {temperature}, rng={rng}")
    attention = model.blocks[0].attention
    pos = check.state(attention.config, attention.pos[...])
    check.capacity(attention.config, pos, lengths + max_new_tokens)
    padded = np.zeros((batch, _bucket(num_prompt)), np.int32)
    padded[:, :num_prompt] = prompts
    graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)
    sampling = (float(temperature), top_k, None if top_p is None else float(top_p))
    tokens, counts, cache = _program(
        graphdef, params, cache, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32),
        jax.random.key(0) if rng is None else rng, int(max_new_tokens), sampling,
        tuple(int(t) for t in stop_tokens),
    )
    nnx.update(model, cache)
    return Generated(tokens, counts)


def _sample(logits, key, sampling):
    temperature, top_k, top_p = sampling
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        before = jnp.cumsum(jax.nn.softmax(ranked, axis=-1), axis=-1) - jax.nn.softmax(ranked, axis=-1)
        ranked = jnp.where(before < top_p, ranked, -jnp.inf)  # the most likely token always stays
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(ranked)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "stop_tokens"))
def _program(graphdef, params, cache, prompts, lengths, key, max_new_tokens, sampling, stop_tokens):
    model = nnx.merge(graphdef, params, cache)
    batch = prompts.shape[0]
    logits = model.prefill(prompts, lengths, last_only=True)
    key, first = jax.random.split(key)
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)

    def body(i, carry):
        cache, token, out, done, counts, key = carry
        model = nnx.merge(graphdef, params, cache)
        out = out.at[:, i].set(jnp.where(done, 0, token))
        counts = counts + (~done).astype(jnp.int32)
        done = done | jnp.any(token[:, None] == stops[None, :], axis=-1)
        logits = model.step(token, active=~done if stop_tokens else None)
        key, sub = jax.random.split(key)
        return nnx.state(model, nnx.Cache), _sample(logits, sub, sampling), out, done, counts, key

    carry = (
        nnx.state(model, nnx.Cache), _sample(logits, first, sampling), jnp.zeros((batch, max_new_tokens), jnp.int32),
        jnp.zeros((batch,), jnp.bool_), jnp.zeros((batch,), jnp.int32), key,
    )
    cache, _, out, _, counts, _ = jax.lax.fori_loop(0, max_new_tokens, body, carry)
    return out, counts, cache


def stream(model: DecoderLM, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, stop_tokens=(), rng=None) -> Iterator[int]:
    """Yields the new tokens of one sequence as they are produced (a model built with `batch_size=1`).

    The same sampling as `generate`, one compiled step per token, so a caller
    can print each token at once. The caches hold the prompt and every token
    yielded so far.
    """
    prompt = np.asarray(prompt, np.int32).reshape(1, -1)
    if model.blocks[0].attention.config.batch_size != 1 or prompt.shape[1] < 1:
        raise ValueError(f"stream needs a model built with batch_size=1 and a non-empty prompt, got {prompt.shape}")
    attention = model.blocks[0].attention
    check.capacity(attention.config, check.state(attention.config, attention.pos[...]), prompt.shape[1] + max_new_tokens)
    if temperature < 0 or (temperature > 0 and rng is None):
        raise ValueError(f"temperature must be >= 0, and a sampled generation needs rng; got {temperature}, rng={rng}")
    padded = np.zeros((1, _bucket(prompt.shape[1])), np.int32)
    padded[:, : prompt.shape[1]] = prompt
    sampling = (float(temperature), top_k, None if top_p is None else float(top_p))
    key = jax.random.key(0) if rng is None else rng
    graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)
    key, sub = jax.random.split(key)
    token, cache = _stream_prefill(graphdef, params, cache, jnp.asarray(padded), jnp.int32(prompt.shape[1]), sub,
                                   sampling)
    for _ in range(max_new_tokens):
        value = int(token[0])
        key, sub = jax.random.split(key)
        token, cache = _stream_step(graphdef, params, cache, token, sub, sampling)
        nnx.update(model, cache)
        yield value
        if value in stop_tokens:
            return


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def _stream_prefill(graphdef, params, cache, prompt, length, key, sampling):
    model = nnx.merge(graphdef, params, cache)
    logits = model.prefill(prompt, length[None], last_only=True)
    return _sample(logits, key, sampling), nnx.state(model, nnx.Cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def _stream_step(graphdef, params, cache, token, key, sampling):
    model = nnx.merge(graphdef, params, cache)
    return _sample(model.step(token), key, sampling), nnx.state(model, nnx.Cache)
