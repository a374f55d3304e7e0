"""What a request asks for (`SamplingParams`, `Sampling`), checked once, and the one sampler every face calls.

`SamplingParams` is a whole request's settings, as vLLM names them: how many
tokens, how to sample them, when to stop, which log-probabilities to report.
The OpenAI server turns a request body into one, `kvattn.LLM` takes one, and
the engine reads it. `Sampling` is the part that chooses a token
(temperature, top-k, top-p, min-p); `RowSampling` lays it out per row, so one
compiled program serves every mix of requests. What depends on a request's
own tokens (penalties, `logit_bias`, `min_tokens`, a grammar) reaches the
device as `Adjustments`, built on the host by `kvattn.generation.adjust`.
Every token any face produces is drawn by `draw` from logits that
`adjusted` and `filter_rows` processed, in vLLM's order: biases and masks,
penalties, temperature, then top-k, top-p and min-p.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "Adjustments", "RowSampling", "Sampling", "SamplingParams",
    "StructuredOutputs", "adjusted", "draw", "filter_rows", "filtered", "greedy_tokens", "row_keys", "sample",
    "sample_rows", "scaled_rows", "token_logprobs",
]

MAX_TOP_LOGPROBS = 20
"""The most alternatives per token `sample_rows` reports (OpenAI's `top_logprobs` limit)."""
MAX_LOGIT_BIAS = 1024
"""The most entries a request's `logit_bias` holds."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; hashable, so a compiled program takes it as a static argument.

    Args:
      temperature: 0 for greedy decoding, else a finite positive temperature.
      top_k: sample among the k most likely tokens: a positive int (at most
        the vocabulary, checked by `check_vocab`), or None.
      top_p: sample among the smallest set holding probability p, in
        (0, 1], or None.
      min_p: sample among the tokens at least `min_p` times as likely as
        the most likely one, in [0, 1] (0 or None: all), as transformers'
        `MinPLogitsWarper` (after top-k and top-p).

    Raises:
      ValueError: a setting out of range (the message names it and its value).
      TypeError: a setting of the wrong type.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

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
        if self.min_p is not None:
            object.__setattr__(self, "min_p", _fraction(self.min_p, "min_p") or None)  # 0: off

    def check_vocab(self, vocab_size: int) -> Sampling:
        """Itself, after checking `top_k` against the model's vocabulary."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab_size}, got {self.top_k}")
        return self

    def check_rng(self, rng) -> None:
        if self.temperature > 0 and rng is None:
            raise ValueError(f"sampling at temperature {self.temperature} needs rng (a jax.random.key)")


def _number(value, name: str, low: float, high: float) -> float:
    """`value` as a float in [low, high], refusing bools, NaN and other types."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value!r}")
    return float(value)


def _fraction(value, name: str) -> float:
    return _number(value, name, 0.0, 1.0)


def _count(value, name: str, low: int, high: int | None = None) -> int:
    """`value` as an int in [low, high], refusing bools, floats and other types."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        wanted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {wanted}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must be: exactly one of a JSON schema, any JSON object, a regex, a choice of
    strings or a grammar (vLLM's `StructuredOutputsParams`). The engine that serves it compiles it with a
    grammar engine (`kvattn.serving.structured`) and masks every token outside it.

    Args:
      json: a JSON schema, as a dict or its JSON text (kept as text).
      json_object: any JSON object.
      regex: a regular expression the whole output matches.
      choice: one of these strings, exactly.
      grammar: a Lark grammar (llguidance's dialect; GBNF is translated).

    Raises:
      ValueError, TypeError: none or several of them, or one of the wrong type.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        import json as json_text

        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json_text.dumps(self.json, separators=(",", ":")))
        elif self.json is not None and not isinstance(self.json, str):
            raise TypeError(f"json must be a JSON schema (a dict or its text), got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise TypeError(f"choice must be a non-empty sequence of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {self.json_object!r}")
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint it is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's settings: how many tokens, how to choose them, when to stop, what to report.

    The names and meanings are vLLM's (and the OpenAI API's), so code moves
    between them. Unlike vLLM, the default is greedy decoding
    (`temperature=0`), as in `kvattn.generation.generate`.

    Args:
      max_tokens: new tokens to produce at most.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_k: sample among the k most likely tokens (None: all).
      top_p: sample among the smallest set holding probability p (None: all).
      min_p: sample among the tokens at least `min_p` times as likely as the
        most likely one (0: all).
      seed: the request's random stream; the same seed gives the same
        tokens whatever else runs beside it (None: drawn by the engine).
      n: independent completions of the same prompt.
      presence_penalty: subtracted from the logit of every token the
        completion has produced, in [-2, 2].
      frequency_penalty: subtracted from a token's logit once per time the
        completion has produced it, in [-2, 2].
      repetition_penalty: divides the positive logits, and multiplies the
        negative ones, of every token in the prompt or the completion
        (transformers' `RepetitionPenaltyLogitsProcessor`); > 0, 1: none.
      logit_bias: `{token id: bias}` added to the logits, each in
        [-100, 100] (-100 in effect bans a token); kept as sorted pairs.
      min_tokens: the stop ids cannot end a completion before it holds this
        many tokens, nor can stop strings.
      allowed_token_ids: sample only among these ids (None: all).
      stop: strings that end the text when they appear (not included,
        unless `include_stop_str_in_output`).
      stop_token_ids: ids that end a completion (included in its tokens).
      ignore_eos: go on past the model's end-of-sequence ids.
      logprobs: report each token's log-probability and this many most
        likely alternatives (0: the chosen token's alone; None: none).
      skip_special_tokens: leave special tokens out of the text.
      include_stop_str_in_output: end the text with the stop string that
        ended it.
      structured_outputs: a `StructuredOutputs` the output must match.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range,
        named with its value.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        _count(self.max_tokens, "max_tokens", 1)
        object.__setattr__(self, "min_p", _fraction(self.min_p, "min_p"))
        Sampling(self.temperature, self.top_k, self.top_p, self.min_p)  # checks them
        if self.seed is not None:
            _count(self.seed, "seed", 0, 2**32 - 1)
        _count(self.n, "n", 1)
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _number(getattr(self, name), name, -2.0, 2.0))
        repetition = _number(self.repetition_penalty, "repetition_penalty", 0.0, math.inf)
        if not 0 < repetition < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0 (1: none), got {repetition!r}")
        object.__setattr__(self, "repetition_penalty", repetition)
        object.__setattr__(self, "logit_bias", _biases(self.logit_bias))
        _count(self.min_tokens, "min_tokens", 0, self.max_tokens)
        if self.allowed_token_ids is not None:
            allowed = tuple(_count(i, "allowed_token_ids", 0) for i in self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids must hold one id or more (None: all)")
            object.__setattr__(self, "allowed_token_ids", allowed)
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
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise TypeError("structured_outputs must be a kvattn.generation.StructuredOutputs or None, got "
                            f"{type(self.structured_outputs).__name__}")

    @property
    def sampling(self) -> Sampling:
        """The part that chooses each token."""
        return Sampling(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def adjusts(self) -> bool:
        """Whether its logits need `Adjustments`: penalties, biases, `min_tokens`, `allowed_token_ids` or
        structured outputs."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.structured_outputs is not None
                    or self.allowed_token_ids is not None)

    def stop_ids(self, eos_token_ids=()) -> frozenset[int]:
        """The ids that end a completion: `stop_token_ids`, and the model's `eos_token_ids` unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


def _biases(value) -> tuple[tuple[int, float], ...]:
    """`logit_bias` (a mapping or pairs of token id and bias) as sorted pairs, each checked."""
    try:
        pairs = [(i, b) for i, b in (value.items() if isinstance(value, dict) else value)]
    except (TypeError, ValueError):
        raise TypeError(f"logit_bias must map token ids to numbers, got {value!r}") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}")
    return tuple(sorted({_count(i, "a logit_bias token id", 0): _number(b, "a logit_bias value", -100.0, 100.0)
                         for i, b in pairs}.items()))


def filtered(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """What `sample` draws from at a temperature above 0: `logits` `(B, V)` over the temperature, with what
    lies outside the top-k, then the top-p, then the min-p set at -inf (`filter_rows` with every row alike)."""
    logits = logits / sampling.temperature
    if sampling.top_k is None and sampling.top_p is None and sampling.min_p is None:
        return logits
    rows = logits.shape[0]
    return filter_rows(logits, jnp.full((rows,), sampling.top_k or 0, jnp.int32),
                       jnp.full((rows,), 1.0 if sampling.top_p is None else sampling.top_p, jnp.float32),
                       jnp.full((rows,), sampling.min_p or 0.0, jnp.float32))


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row of `logits` `(B, V)`: int32 `(B,)`; row b draws with `jax.random.split(key, B)[b]`.

    The fixed-batch loops' face of `draw`: one static `Sampling` for every
    row, so greedy decoding compiles to an argmax alone.
    """
    if sampling.temperature == 0.0:
        return greedy_tokens(logits)
    return draw(filtered(logits, sampling), jax.random.split(key, logits.shape[0]))


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The greedy token: `jnp.argmax(logits, axis=-1)` as int32, to the index (the first of equal largest values,
    the first NaN where a row holds one), in two vectorised passes, where XLA:CPU's argmax reduces pairs of
    values and indices at a third of the speed."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    at = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where((logits == top) | jnp.isnan(logits), at, logits.shape[-1]), axis=-1)


def draw(candidates: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row of `candidates` `(B, V)` (scaled, filtered logits), row b with `keys[b]`: int32 `(B,)`."""
    return jax.vmap(jax.random.categorical)(keys, candidates).astype(jnp.int32)


class Adjustments(NamedTuple):
    """What a row's own tokens do to its logits, as dense arrays `(..., V)` the host fills
    (`kvattn.generation.adjust`); `adjusted` applies them.

    A row that adjusts nothing holds `bias` 0, `repetition` 1 and `penalty` 0.
    """

    bias: jax.Array
    """Added first: `logit_bias`, and -inf for what a grammar or `min_tokens` forbids."""
    repetition: jax.Array
    """Then each logit is divided by it where positive, multiplied by it where not (1: unchanged)."""
    penalty: jax.Array
    """Then subtracted: the presence and frequency penalties."""

    @classmethod
    def neutral(cls, shape: tuple[int, ...]) -> Adjustments:
        """Host arrays that change nothing, of `shape` `(..., V)`, for the host to fill."""
        return cls(np.zeros(shape, np.float32), np.ones(shape, np.float32), np.zeros(shape, np.float32))


def adjusted(logits: jax.Array, adjustments: Adjustments | None) -> jax.Array:
    """`logits` `(..., V)` after `adjustments` (None: unchanged), in vLLM's order: biases and masks, the
    repetition penalty, then the presence and frequency penalties."""
    if adjustments is None:
        return logits
    biased = logits + adjustments.bias
    repetition = adjustments.repetition
    return jnp.where(biased > 0, biased / repetition, biased * repetition) - adjustments.penalty


class RowSampling(NamedTuple):
    """Per-row sampling settings as arrays, so one compiled program serves every mix of requests.

    Row b samples at `temperature[b]` (0: greedy), among its `top_k[b]` most
    likely tokens (0: all) holding probability `top_p[b]` (1: all) and at
    least `min_p[b]` times as likely as the best (0: all), with the key
    `fold_in(fold_in(key(seed[b]), stream[b]), index[b])`: a request's tokens
    depend on its seed, its stream (one per choice of a request) and the
    token's index, never on which other requests share the batch. A row
    reports its `top_logprobs[b]` most likely alternatives (0: none; when no
    row asks, they are never computed).
    """

    temperature: jax.Array  # (B,) float32
    top_k: jax.Array  # (B,) int32
    top_p: jax.Array  # (B,) float32
    min_p: jax.Array  # (B,) float32
    seed: jax.Array  # (B,) uint32
    stream: jax.Array  # (B,) uint32
    index: jax.Array  # (B,) uint32
    top_logprobs: jax.Array  # (B,) int32

    @classmethod
    def of(cls, rows: list[tuple[Sampling, int, int, int, int]], batch: int) -> RowSampling:
        """Host arrays for `rows` of `(sampling, seed, stream, index, top_logprobs)`, padded to `batch` greedy
        rows."""
        values = np.zeros((8, batch), np.float64)
        values[2] = 1.0
        for row, (sampling, seed, stream, index, top) in enumerate(rows):
            values[:, row] = (sampling.temperature, sampling.top_k or 0, sampling.top_p or 1.0, sampling.min_p or 0.0,
                              seed, stream, index, top)
        return cls(values[0].astype(np.float32), values[1].astype(np.int32), values[2].astype(np.float32),
                   values[3].astype(np.float32), *(v.astype(np.uint32) for v in values[4:7]), values[7].astype(np.int32))


def filter_rows(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """`logits` `(B, V)` with what lies outside each row's top-k (0: all), then its top-p (1: all), then its
    min-p set (0: all; None: none) at -inf.

    The one filter: every sampler and the speculative verifier draw through
    it. Ties at the edge stay; a batch where no row filters skips the sort.
    Min-p keeps the tokens whose probability is at least `min_p` times the
    best one's, as transformers' `MinPLogitsWarper` (the best always stays).
    """
    filtering = jnp.any((top_k > 0) | (top_p < 1.0))
    logits = jax.lax.cond(filtering, _filter, lambda x, *_: x, logits, top_k, top_p)
    if min_p is None:
        return logits
    return jax.lax.cond(jnp.any(min_p > 0), _min_p, lambda x, _: x, logits, min_p)


def _min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    best = jnp.max(logits, axis=-1, keepdims=True)
    relative = jnp.exp(logits - best)  # each token's probability over the best one's
    return jnp.where((relative < min_p[:, None]) & (logits < best), -jnp.inf, logits)


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
    """`logits` `(B, V)` over each row's temperature (1 for a greedy row), then also filtered to its top-k,
    top-p and min-p: `(scaled, filtered)`; a row samples from `filtered`, its log-probabilities are `scaled`'s."""
    temperature = settings.temperature
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    return scaled, filter_rows(scaled, settings.top_k, settings.top_p, settings.min_p)


def row_keys(settings: RowSampling) -> jax.Array:
    """Each row's key: `fold_in(fold_in(key(seed), stream), index)`."""
    return jax.vmap(lambda s, t, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), t), i))(
        settings.seed, settings.stream, settings.index)


def sample_rows(logits: jax.Array, settings: RowSampling, adjustments: Adjustments | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token per row of `logits` `(B, V)`, each row with its own `settings` and `adjustments`.

    Returns:
      `(tokens, logprobs, top_ids, top_logprobs)`: int32 `(B,)`; each token's
      log-probability after its row's adjustments and temperature, float32
      `(B,)`; the `MAX_TOP_LOGPROBS` most likely tokens and their
      log-probabilities, `(B, MAX_TOP_LOGPROBS)` (zeros when no row's
      `settings.top_logprobs` asks for them).

    A batch whose rows are all greedy skips the scaling, the filters and the
    draw, and one where no row asks for alternatives skips their top-k: a step
    pays only for what its rows use.
    """
    logits = adjusted(logits, adjustments)
    sampling = settings.temperature > 0

    def drawn(logits):
        _, candidates = scaled_rows(logits, settings)
        return jnp.where(sampling, draw(candidates, row_keys(settings)), greedy_tokens(logits))

    tokens = jax.lax.cond(jnp.any(sampling), drawn, greedy_tokens, logits)
    # `scaled_rows`' scaling again, outside the cond, so it fuses into the log-probabilities' reductions rather than
    # come out of a branch as a copy of the logits (a greedy row's scale is 1: its logits, to the bit).
    scaled = logits / jnp.where(sampling, settings.temperature, 1.0)[:, None]
    return tokens, *token_logprobs(scaled, tokens, jnp.any(settings.top_logprobs > 0))


def token_logprobs(scaled: jax.Array, tokens: jax.Array, alternatives: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-probability of each of `tokens` `(...)` under `scaled` `(..., V)`, and, if the scalar
    `alternatives` holds, the `MAX_TOP_LOGPROBS` most likely tokens with theirs (else zeros): `(chosen, top_ids,
    top_logprobs)`.

    Each value is `jax.nn.log_softmax`'s, to the bit; the full log-softmax
    and its top-k are made only when asked.
    """
    # `scaled - best` is formed where each use needs it, never as a whole array of its own.
    best = jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    total = jnp.log(jnp.sum(jnp.exp(scaled - best), axis=-1, keepdims=True))
    chosen = (jnp.take_along_axis(scaled, tokens[..., None], axis=-1) - best)[..., 0] - total[..., 0]
    count = min(MAX_TOP_LOGPROBS, scaled.shape[-1])

    def top(scaled, best, total):
        values, ids = jax.lax.top_k((scaled - best) - total, count)
        return ids.astype(jnp.int32), values

    def none(scaled, *_):
        shape = (*scaled.shape[:-1], count)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, scaled.dtype)

    return chosen, *jax.lax.cond(alternatives, top, none, scaled, best, total)
