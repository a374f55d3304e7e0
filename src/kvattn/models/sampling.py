"""Sampling settings, checked once, and the sampler the generation loops and the server share."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_TOP_LOGPROBS", "RowSampling", "Sampling", "filtered", "row_keys", "sample", "sample_rows", "sample_with_logprob",
    "scaled_rows",
]

MAX_TOP_LOGPROBS = 20
"""The most alternatives per token `sample_rows` reports (OpenAI's `top_logprobs` limit)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; hashable, so a compiled program takes it as a static argument.

    Args:
      temperature: 0 for greedy decoding, else a finite positive temperature.
      top_k: sample among the k most likely tokens: a positive int (at most
        the vocabulary, checked by `check_vocab`), or None.
      top_p: sample among the smallest set holding probability p, in
        (0, 1], or None.

    Raises:
      ValueError: a setting out of range (the message names it and its value).
      TypeError: a setting of the wrong type.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)):
            raise TypeError(f"temperature must be a number, got {t!r}")
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        if self.top_k is not None:
            k = self.top_k
            if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
                raise TypeError(f"top_k must be a positive int or None, got {k!r}")
            if k < 1:
                raise ValueError(f"top_k must be a positive int or None, got {k!r}")
            object.__setattr__(self, "top_k", int(k))
        if self.top_p is not None:
            p = self.top_p
            if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
                raise TypeError(f"top_p must be a number in (0, 1] or None, got {p!r}")
            if not 0 < p <= 1:
                raise ValueError(f"top_p must lie in (0, 1] or be None, got {p!r}")
            object.__setattr__(self, "top_p", float(p))

    def check_vocab(self, vocab_size: int) -> Sampling:
        """Itself, after checking `top_k` against the model's vocabulary."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab_size}, got {self.top_k}")
        return self

    def check_rng(self, rng) -> None:
        if self.temperature > 0 and rng is None:
            raise ValueError(f"sampling at temperature {self.temperature} needs rng (a jax.random.key)")


def filtered(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """What `sample` draws from at a temperature above 0: `logits` `(B, V)` over the temperature, with what
    lies outside the top-k, then outside the top-p, at -inf."""
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        before = jnp.cumsum(jax.nn.softmax(ranked, axis=-1), axis=-1) - jax.nn.softmax(ranked, axis=-1)
        ranked = jnp.where(before < sampling.top_p, ranked, -jnp.inf)  # the most likely token always stays
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(ranked)
    return logits


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row of `logits` `(B, V)`: int32 `(B,)`."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered(logits, sampling), axis=-1).astype(jnp.int32)


def sample_with_logprob(logits: jax.Array, key: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """`sample`, and each chosen token's log-probability under the model (after temperature)."""
    token = sample(logits, key, sampling)
    logprobs = jax.nn.log_softmax(logits / (sampling.temperature or 1.0), axis=-1)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


class RowSampling(NamedTuple):
    """Per-row sampling settings as arrays, so one compiled program serves every mix of requests.

    Row b samples at `temperature[b]` (0: greedy), among its `top_k[b]` most
    likely tokens (0: all) holding probability `top_p[b]` (1: all), with the
    key `fold_in(fold_in(key(seed[b]), stream[b]), index[b])`: a request's
    tokens depend on its seed, its stream (one per choice of a request) and
    the token's index, never on which other requests share the batch.
    """

    temperature: jax.Array  # (B,) float32
    top_k: jax.Array  # (B,) int32
    top_p: jax.Array  # (B,) float32
    seed: jax.Array  # (B,) uint32
    stream: jax.Array  # (B,) uint32
    index: jax.Array  # (B,) uint32

    @classmethod
    def of(cls, rows: list[tuple[Sampling, int, int, int]], batch: int) -> RowSampling:
        """Host arrays for `rows` of `(sampling, seed, stream, index)`, padded to `batch` greedy rows."""
        values = np.zeros((6, batch), np.float64)
        values[2] = 1.0
        for row, (sampling, seed, stream, index) in enumerate(rows):
            values[:, row] = (sampling.temperature, sampling.top_k or 0, sampling.top_p or 1.0, seed, stream, index)
        return cls(values[0].astype(np.float32), values[1].astype(np.int32), values[2].astype(np.float32),
                   *(v.astype(np.uint32) for v in values[3:]))


def _row_filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`logits` `(B, V)` with what lies outside each row's top-k and then top-p set at -inf (ties at the edge stay)."""
    vocab = logits.shape[-1]
    ranked = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.maximum(jnp.sum((before < top_p[:, None]) & (ranked > -jnp.inf), axis=-1), 1)  # the best always stays
    threshold = jnp.take_along_axis(ranked, (kept - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def scaled_rows(logits: jax.Array, settings: RowSampling) -> tuple[jax.Array, jax.Array]:
    """`logits` `(B, V)` over each row's temperature (1 for a greedy row), then also filtered to its top-k and
    top-p: `(scaled, filtered)`; a row samples from `filtered`, its log-probabilities are `scaled`'s."""
    temperature = settings.temperature
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    filtering = jnp.any((settings.top_k > 0) | (settings.top_p < 1.0))
    return scaled, jax.lax.cond(filtering, _row_filter, lambda x, *_: x, scaled, settings.top_k, settings.top_p)


def row_keys(settings: RowSampling) -> jax.Array:
    """Each row's key: `fold_in(fold_in(key(seed), stream), index)`."""
    return jax.vmap(lambda s, t, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), t), i))(
        settings.seed, settings.stream, settings.index)


def sample_rows(logits: jax.Array, settings: RowSampling) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token per row of `logits` `(B, V)`, each row with its own `settings`.

    Returns:
      `(tokens, logprobs, top_ids, top_logprobs)`: int32 `(B,)`; each token's
      log-probability under the model after its temperature, float32 `(B,)`;
      the `MAX_TOP_LOGPROBS` most likely tokens and their log-probabilities,
      `(B, MAX_TOP_LOGPROBS)`.
    """
    scaled, candidates = scaled_rows(logits, settings)
    sampled = jax.vmap(jax.random.categorical)(row_keys(settings), candidates)
    tokens = jnp.where(settings.temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen, top_ids.astype(jnp.int32), top_logprobs
