"""Sampling settings, checked once, and the sampler the generation loops and the server share."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Sampling", "sample", "sample_with_logprob"]


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


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row of `logits` `(B, V)`: int32 `(B,)`."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
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
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_with_logprob(logits: jax.Array, key: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """`sample`, and each chosen token's log-probability under the model (after temperature)."""
    token = sample(logits, key, sampling)
    logprobs = jax.nn.log_softmax(logits / (sampling.temperature or 1.0), axis=-1)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
