"""What a request is while the server holds it, and what it and the server report: `Token`, `Completion`, `Stats`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvattn.generation.adjust import Adjuster
from kvattn.generation.sampling import Sampling

__all__ = ["Completion", "Request", "Stats", "Token"]


class Token(NamedTuple):
    """One new token of a request, as its `on_token` callback receives it."""

    id: int
    logprob: float
    """Its log-probability under the model (after the request's temperature)."""
    top: tuple[tuple[int, float], ...]
    """The request's `top_logprobs` most likely tokens and their log-probabilities, most likely first."""


@dataclasses.dataclass
class Completion:
    """A finished request."""

    request: int
    """Its index, in the order of `submit`."""
    tokens: list[int]
    """The new tokens, the stop token included."""
    logprobs: list[float]
    """Log-probability of each new token under the model (after temperature)."""
    cached_tokens: int
    """Prompt tokens its last admission found in the prefix cache."""
    preemptions: int
    """Times it was preempted and recomputed."""
    first_token_seconds: float
    """Wall time from its (last) admission to its first new token."""
    finish_reason: str = "length"
    """`"stop"` (it produced a stop token), `"length"` (`max_new_tokens`) or `"abort"` (`Server.abort`)."""


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counts for monitoring; the totals grow over the server's life."""

    waiting: int
    """Requests queued, not holding a sequence."""
    running: int
    """Requests holding a sequence."""
    pages_free: int
    pages_cached: int
    """Unreferenced pages kept for the prefix cache (evictable)."""
    pages_live: int
    prompt_tokens: int
    """Prompt tokens of every admission (a recomputed request counts again)."""
    cached_tokens: int
    """Of those, the ones found in the prefix cache."""
    generated_tokens: int
    drafted_tokens: int = 0
    """Drafts speculative rounds verified (prompt lookup)."""
    accepted_tokens: int = 0
    """Of those, the ones kept."""


@dataclasses.dataclass(eq=False)
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    stop_tokens: frozenset
    salt: bytes
    sampling: Sampling
    seed: int
    stream: int  # which choice of its submit: each has its own random stream
    top_logprobs: int
    on_token: Callable[[int, Token], None] | None
    adjuster: Adjuster | None = None  # its penalties, biases and grammar, if it has any
    halted: bool = False  # its grammar refused its last token
    siblings: list[Request] = dataclasses.field(default_factory=list)  # forked from it after its prompt
    leader: Request | None = None  # set while this choice waits to be forked from its leader
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    cached_tokens: int = 0
    admitted_at: float = 0.0
    first_admitted: float | None = None  # its place in line: a recomputed request keeps it
    first_token_seconds: float = 0.0
    # Speculative decoding, per request: drafts kept per round lately, and when to try a round again.
    expected: float = 0.0
    waited: int = 0
    patience: int = 0

    @property
    def context(self) -> list[int]:
        """Tokens whose keys and values the sequence needs: the prompt, then all but the last new token."""
        return self.prompt + self.generated[:-1] if self.generated else self.prompt

    @property
    def group(self) -> list[Request]:
        """It and the choices still waiting to be forked from it."""
        return [self, *self.siblings]

    @property
    def budget(self) -> int:
        """Drafts a speculative round may propose: new tokens left, less the one the round always produces."""
        return self.max_new_tokens - len(self.generated) - 1

    @property
    def stopped(self) -> bool:
        """Whether its last token is a stop token, or one its grammar refused."""
        return self.halted or bool(self.generated) and self.generated[-1] in self.stop_tokens

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.max_new_tokens or self.stopped

    def completion(self, reason: str) -> Completion:
        """What it produced, ended for `reason`."""
        return Completion(self.index, self.generated[: self.max_new_tokens], self.logprobs[: self.max_new_tokens],
                          self.cached_tokens, self.preemptions, self.first_token_seconds, reason)

    def settings(self, ahead: int = 0) -> tuple[Sampling, int, int, int, int]:
        """Its row of `RowSampling` for the next token (`ahead`: for a token that many past it)."""
        return self.sampling, self.seed, self.stream, len(self.generated) + ahead, self.top_logprobs

    def append(self, token: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray):
        self.generated.append(token)
        self.logprobs.append(logprob)
        if self.adjuster is not None and not self.adjuster.accept(token):
            self.halted = True
        if self.on_token is not None:
            top = tuple(zip(top_ids[: self.top_logprobs].tolist(), top_logprobs[: self.top_logprobs].tolist()))
            self.on_token(self.index, Token(token, logprob, top))
