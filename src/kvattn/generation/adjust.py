"""What a request's own tokens do to its logits, kept on the host: penalties, `logit_bias`, `min_tokens`, a grammar.

An `Adjuster` follows one completion (one choice of a request): it counts
the tokens it produced, knows which ids its prompt holds, and steps its
grammar's matcher along, if it has one. Before each call of the model the
engine asks it for its row of `kvattn.generation.sampling.Adjustments`
(`fill`), for the next token and, when speculating, for the token after
each draft as if the drafts before it were kept; the device applies them
in the one sampler (`adjusted`). A request that adjusts nothing has no
adjuster, and its rows stay neutral.

A grammar is any object with the `Grammar` methods;
`kvattn.serving.structured` makes them from llguidance for the serving
faces, which know the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvattn.generation.sampling import SamplingParams

__all__ = ["Adjuster", "Grammar"]


class Grammar(Protocol):
    """A matcher of one completion against a grammar, stepped token by token."""

    def forbid(self, row: np.ndarray) -> None:
        """Adds -inf to `row` `(V,)` at every id that may not come next (ids past the grammar's vocabulary: all)."""

    def advance(self, token: int) -> bool:
        """Takes `token`; False (and nothing taken) if the grammar forbids it."""

    def rollback(self, count: int) -> None:
        """Takes back the last `count` tokens."""


class Adjuster:
    """One completion's logits adjustments, as `params` asks for them.

    Args:
      params: the request's settings (`presence_penalty`,
        `frequency_penalty`, `repetition_penalty`, `logit_bias`,
        `min_tokens`, `allowed_token_ids`).
      prompt: the prompt's ids (the repetition penalty counts them).
      stop_ids: the ids `min_tokens` keeps from ending the completion early.
      vocab_size: the width of the model's logits.
      grammar: a fresh `Grammar` matcher for its structured outputs, or None.
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int], stop_ids, vocab_size: int,
                 grammar: Grammar | None = None):
        self.params, self.vocab_size, self.grammar = params, vocab_size, grammar
        self.produced = 0
        self._stops = np.array(sorted(stop_ids), np.int64)
        ids, biases = zip(*params.logit_bias) if params.logit_bias else ((), ())
        inside = np.array(ids, np.int64) < vocab_size  # a bias on an id the model never produces changes nothing
        self._bias_ids, self._biases = np.array(ids, np.int64)[inside], np.array(biases, np.float32)[inside]
        self._outside = None  # -inf past `allowed_token_ids`
        if params.allowed_token_ids is not None:
            self._outside = np.full(vocab_size, -np.inf, np.float32)
            self._outside[[i for i in params.allowed_token_ids if i < vocab_size]] = 0.0
        self._penalizes = bool(params.presence_penalty or params.frequency_penalty)
        self._counts = np.zeros(vocab_size, np.int32) if self._penalizes else None
        self._seen = None
        if params.repetition_penalty != 1.0:
            self._seen = np.zeros(vocab_size, bool)
            self._seen[np.asarray(prompt, np.int64)] = True

    def accept(self, token: int) -> bool:
        """Takes the completion's next token; False if its grammar refused it (the completion must end)."""
        self.produced += 1
        if self._counts is not None:
            self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
        return self.grammar is None or self.grammar.advance(token)

    def drafts_allowed(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, from the first, its grammar allows (all of them without a grammar)."""
        if self.grammar is None:
            return len(drafts)
        taken = 0
        for token in drafts:
            if not self.grammar.advance(int(token)):
                break
            taken += 1
        self.grammar.rollback(taken)
        return taken

    def fill(self, bias: np.ndarray, repetition: np.ndarray, penalty: np.ndarray, drafts: Sequence[int] = ()) -> None:
        """Writes its rows into neutral host rows `(W, V)`: row j for the token after `drafts[:j]` (rows past
        the last draft are left neutral; each draft must be one its grammar allows, see `drafts_allowed`)."""
        drafts = [int(t) for t in drafts][: len(bias) - 1]
        params, advanced = self.params, 0
        for j in range(len(drafts) + 1):
            before = drafts[:j]
            bias[j, self._bias_ids] = self._biases
            if self._outside is not None:
                bias[j] += self._outside
            if self.grammar is not None:
                self.grammar.forbid(bias[j])
                if j < len(drafts):
                    advanced += self.grammar.advance(drafts[j])
            if self.produced + j < params.min_tokens:
                bias[j, self._stops] = -np.inf
            if self._seen is not None:
                repetition[j, self._seen] = params.repetition_penalty
                repetition[j, before] = params.repetition_penalty
            if self._counts is not None:
                counts = self._counts.astype(np.float32)
                np.add.at(counts, np.array(before, np.int64), 1.0)
                penalty[j] = params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if advanced:
            self.grammar.rollback(advanced)
