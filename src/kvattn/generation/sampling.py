"""What a request asks for (`SamplingParams`, `Sampling`), checked once, and the one sampler every face calls.

`SamplingParams` is a whole request's settings, as vLLM names them: how many
tokens, how to sample them, when to stop, which log-probabilities to report.
The OpenAI server turns a request body into one, `kvattn.LLM` takes one, and
the engine reads it. `Sampling` is the part that chooses a token
(temperature, top-k, top-p); `RowSampling` lays it out per row, so one
compiled program serves every mix of requests. Every token any face
produces is drawn by `draw` from logits that `filter_rows` filtered.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_TOP_LOGPROBS", "RowSampling", "Sampling", "SamplingParams", "draw", "filter_rows", "filtered", "row_keys",
    "sample", "sample_rows", "scaled_rows",
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


def _count(value, name: str, low: int, high: int | None = None) -> int:
    """`value` as an int in [low, high], refusing bools, floats and other types."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        wanted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {wanted}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's settings: how many tokens, how to choose them, when to stop, what to report.

    The names are vLLM's (and the OpenAI API's), so code moves between them.
    Unlike vLLM, the default is greedy decoding (`temperature=0`), as in
    `kvattn.generation.generate`.

    Args:
      max_tokens: new tokens to produce at most.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_k: sample among the k most likely tokens (None: all).
      top_p: sample among the smallest set holding probability p (None: all).
      seed: the request's random stream; the same seed gives the same
        tokens whatever else runs beside it (None: drawn by the engine).
      n: independent completions of the same prompt.
      stop: strings that end the text when they appear (not included,
        unless `include_stop_str_in_output`).
      stop_token_ids: ids that end a completion (included in its tokens).
      ignore_eos: go on past the model's end-of-sequence ids.
      logprobs: report each token's log-probability and this many most
        likely alternatives (0: the chosen token's alone; None: none).
      skip_special_tokens: leave special tokens out of the text.
      include_stop_str_in_output: end the text with the stop string that
        ended it.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range,
        named with its value.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        _count(self.max_tokens, "max_tokens", 1)
        Sampling(self.temperature, self.top_k, self.top_p)  # checks them
        if self.seed is not None:
            _count(self.seed, "seed", 0, 2**32 - 1)
        _count(self.n, "n", 1)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise TypeError(f"stop must be a non-empty string or a sequence of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, (int, np.integer)) else self.stop_token_ids
        try:
            ids = tuple(_count(i, "stop_token_ids", 0) for i in ids)
        except TypeError:
            raise TypeError(f"stop_token_ids must be an int id or a sequence of them, got {self.stop_token_ids!r}"
                            ) from None
        object.__setattr__(self, "stop_token_ids", ids)
        if self.logprobs is not None:
            _count(self.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
        for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")

    @property
    def sampling(self) -> Sampling:
        """The part that chooses each token."""
        return Sampling(self.temperature, self.top_k, self.top_p)

    def stop_ids(self, eos_token_ids=()) -> frozenset[int]:
        """The ids that end a completion: `stop_token_ids`, and the model's `eos_token_ids` unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


def filtered(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """What `sample` draws from at a temperature above 0: `logits` `(B, V)` over the temperature, with what
    lies outside the top-k, then outside the top-p, at -inf (`filter_rows` with every row alike)."""
    logits = logits / sampling.temperature
    if sampling.top_k is None and sampling.top_p is None:
        return logits
    rows = logits.shape[0]
    return filter_rows(logits, jnp.full((rows,), sampling.top_k or 0, jnp.int32),
                       jnp.full((rows,), 1.0 if sampling.top_p is None else sampling.top_p, jnp.float32))


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row of `logits` `(B, V)`: int32 `(B,)`; row b draws with `jax.random.split(key, B)[b]`.

    The fixed-batch loops' face of `draw`: one static `Sampling` for every
    row, so greedy decoding compiles to an argmax alone.
    """
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draw(filtered(logits, sampling), jax.random.split(key, logits.shape[0]))


def draw(candidates: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row of `candidates` `(B, V)` (scaled, filtered logits), row b with `keys[b]`: int32 `(B,)`."""
    return jax.vmap(jax.random.categorical)(keys, candidates).astype(jnp.int32)


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


def filter_rows(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`logits` `(B, V)` with what lies outside each row's top-k (0: all) and then top-p (1: all) set at -inf.

    The one filter: every sampler and the speculative verifier draw through
    it. Ties at the edge stay; a batch where no row filters skips the sort.
    """
    filtering = jnp.any((top_k > 0) | (top_p < 1.0))
    return jax.lax.cond(filtering, _filter, lambda x, *_: x, logits, top_k, top_p)


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
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
    return scaled, filter_rows(scaled, settings.top_k, settings.top_p)


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
    sampled = draw(candidates, row_keys(settings))
    tokens = jnp.where(settings.temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen, top_ids.astype(jnp.int32), top_logprobs
