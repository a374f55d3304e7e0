"""Whole-model generation: ragged prompts in, new tokens out, the loop compiled once per (batch, prompt bucket)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kvattn.generation.inputs import checked_inputs
from kvattn.generation.sampling import sample
from kvattn.generation.speculative import speculate
from kvattn.models.decoder import CausalLM
from kvattn.models.tokens import token_ids

__all__ = ["Generated", "generate", "stream"]


class Generated(NamedTuple):
    """What `generate` returns."""

    tokens: jax.Array
    """`(B, max_new_tokens)` int32; after a stop token, zeros."""
    counts: jax.Array
    """`(B,)` int32: tokens each sequence produced, its stop token included."""


def generate(model: CausalLM, prompts, max_new_tokens: int, *, lengths=None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_tokens=(), rng=None,
             speculative=None) -> Generated:
    """Appends each prompt to the model's caches, then samples `max_new_tokens` tokens per sequence.

    The caches afterwards hold the prompts and every new token, so
    generation can go on. Nothing the caller holds is deleted: the compiled
    loop works on its own copy of the caches and the model gets the new ones.
    The step that appends the last token is a second program, dispatched
    after the one that produces the tokens: under JAX's asynchronous
    dispatch the tokens are ready a step before the caches are.

    Args:
      model: a `CausalLM` built with `batch_size=B`.
      prompts: int `(B, T)`, right-padded.
      max_new_tokens: tokens to produce per sequence.
      lengths: int `(B,)`, the real length of each prompt (1..T); default T.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_k, top_p: sample only among the k most likely tokens / the
        smallest set holding probability p.
      stop_tokens: a sequence stops after producing one of these.
      rng: a `jax.random.key`, needed when `temperature > 0`.
      speculative: a `PromptLookup` or `DraftModel` to produce several
        tokens per call of the model, with the same output (see
        `kvattn.generation.speculate`).

    Returns:
      `Generated(tokens, counts)`.
    """
    if speculative is not None:
        return Generated(*speculate(
            model, prompts, max_new_tokens, speculative=speculative, lengths=lengths, temperature=temperature,
            top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, rng=rng,
        )[:2])
    padded, lengths, sampling, stop_tokens = checked_inputs(
        model, prompts, max_new_tokens, lengths, temperature, top_k, top_p, stop_tokens, rng
    )
    graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)
    tokens, counts, cache, last, done = _program(
        graphdef, params, cache, jnp.asarray(padded), jnp.asarray(lengths, jnp.int32),
        jax.random.key(0) if rng is None else rng, int(max_new_tokens), sampling, stop_tokens,
    )
    # The last token goes into the caches in a program of its own, dispatched after the tokens' program: the
    # tokens are ready one step sooner, and whoever reads the caches waits for them (asynchronous dispatch).
    nnx.update(model, _append(graphdef, params, cache, last, done, bool(stop_tokens)))
    return Generated(tokens, counts)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "stop_tokens"))
def _program(graphdef, params, cache, prompts, lengths, key, max_new_tokens, sampling, stop_tokens):
    """The prompts' prefill and every new token: `(tokens, counts, cache, last, done)`.

    The caches come back holding every new token but the last (`last`), which
    `_append` adds; `done` marks the sequences that must not append it.
    """
    model = nnx.merge(graphdef, params, cache)
    batch = prompts.shape[0]
    logits = model.prefill(prompts, lengths, last_only=True)
    key, first = jax.random.split(key)
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)

    def record(i, token, out, done, counts):
        """Token `i` into `out` and `counts` (zeros once a sequence is done); done after a stop token."""
        out = out.at[:, i].set(jnp.where(done, 0, token))
        return out, done | jnp.any(token[:, None] == stops[None, :], axis=-1), counts + (~done).astype(jnp.int32)

    def body(i, carry):
        cache, token, out, done, counts, key = carry
        model = nnx.merge(graphdef, params, cache)
        out, done, counts = record(i, token, out, done, counts)
        logits = model.step(token, active=~done if stop_tokens else None)
        key, sub = jax.random.split(key)
        return nnx.state(model, nnx.Cache), sample(logits, sub, sampling), out, done, counts, key

    carry = (
        nnx.state(model, nnx.Cache), sample(logits, first, sampling), jnp.zeros((batch, max_new_tokens), jnp.int32),
        jnp.zeros((batch,), jnp.bool_), jnp.zeros((batch,), jnp.int32), key,
    )
    cache, last, out, done, counts, _ = jax.lax.fori_loop(0, max_new_tokens - 1, body, carry)
    out, done, counts = record(max_new_tokens - 1, last, out, done, counts)
    return out, counts, cache, last, done


@functools.partial(jax.jit, static_argnames=("graphdef", "stopping"))
def _append(graphdef, params, cache, token, done, stopping):
    """The caches with `token` appended to every sequence (with `stopping`, those not `done`); no head."""
    model = nnx.merge(graphdef, params, cache)
    model.step(token, active=~done if stopping else None, head=False)
    return nnx.state(model, nnx.Cache)


def stream(model: CausalLM, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, stop_tokens=(), rng=None) -> Iterator[int]:
    """Yields the new tokens of one sequence as they are produced (a model built with `batch_size=1`).

    The same sampling as `generate`, one compiled step per token, so a caller
    can print each token at once. The caches hold the prompt and every token
    yielded so far.
    """
    batch = model.blocks[0].attention.config.cache.batch_size
    if batch != 1:
        raise ValueError(f"stream needs a model built with batch_size=1, got batch_size={batch}")
    prompt = token_ids(prompt, model.config.vocab_size, "prompt", (None,))
    padded, lengths, sampling, stop_tokens = checked_inputs(
        model, prompt[None, :], max_new_tokens, None, temperature, top_k, top_p, stop_tokens, rng)
    # Checked above, eagerly; the tokens come from a generator, which runs only when iterated.
    return _stream(model, padded, int(lengths[0]), max_new_tokens, sampling, stop_tokens,
                   jax.random.key(0) if rng is None else rng)


def _stream(model, padded, length, max_new_tokens, sampling, stop_tokens, key) -> Iterator[int]:
    graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)
    key, sub = jax.random.split(key)
    token, cache = _stream_prefill(graphdef, params, cache, jnp.asarray(padded), jnp.int32(length), sub, sampling)
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
    return sample(logits, key, sampling), nnx.state(model, nnx.Cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def _stream_step(graphdef, params, cache, token, key, sampling):
    model = nnx.merge(graphdef, params, cache)
    return sample(model.step(token), key, sampling), nnx.state(model, nnx.Cache)
