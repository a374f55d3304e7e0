"""Structured outputs: a request's `StructuredOutputs` compiled by llguidance against the served tokenizer.

`Grammars(tokenizer).compile(spec)` checks and compiles a JSON schema, a
regex, a choice or a Lark grammar once, and returns what makes a fresh
matcher for each choice of the request (`kvattn.generation.adjust.Grammar`).
The engine masks, before each token, every id the matcher forbids, so the
output matches whatever the model's weights: a JSON schema's output parses
and validates. Why llguidance: see the serving guide.

JSON is written compactly, as `json.dumps` writes it (`", "` and `": "`
between items and keys, no other whitespace), so a model cannot spend its
tokens on blank space.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from kvattn.generation.adjust import Grammar
from kvattn.generation.sampling import StructuredOutputs
from kvattn.serving.tokenizer import Tokenizer

__all__ = ["Grammars"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FORBIDDEN = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"), 0.0,
                      -np.inf).astype(np.float32)
"""Per mask byte, its eight ids' bias, least significant bit first: 0 if allowed, -inf if not (a byte indexes it:
several times faster than unpacking the bits and writing -inf where they are clear)."""


class Grammars:
    """Compiles `StructuredOutputs` for `tokenizer`'s vocabulary (prepared on first use, once).

    Thread-safe: the server compiles on its worker threads.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._vocabulary is None:
                tokenizer = self.tokenizer
                self._vocabulary = llguidance.LLTokenizer(tokenizer._tokenizer.to_str(), n_vocab=tokenizer.vocab_size,
                                                          eos_token=sorted(tokenizer.eos_token_ids) or None)
            return self._vocabulary

    def compile(self, spec: StructuredOutputs) -> Callable[[], Grammar]:
        """What makes a fresh matcher of `spec` for each choice of a request.

        Raises:
          ValueError: a schema, regex or grammar llguidance cannot compile, with its message.
        """
        if not isinstance(spec, StructuredOutputs):
            raise TypeError(f"spec must be a StructuredOutputs, got {type(spec).__name__}")
        source = _grammar(spec)
        error = llguidance.LLMatcher.validate_grammar(source, self.vocabulary)
        if error:
            raise ValueError(f"structured outputs ({spec.kind}) do not compile: {error.strip()}")
        first = llguidance.LLMatcher(self.vocabulary, source, log_level=0)
        if first.is_error():
            raise ValueError(f"structured outputs ({spec.kind}) do not compile: {first.get_error()}")
        words, eos = self.vocabulary.vocab_size, frozenset(self.vocabulary.eos_tokens)
        return lambda: _Matcher(first.deep_copy(), words, eos)


def _grammar(spec: StructuredOutputs) -> str:
    """llguidance's grammar for `spec`."""
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as error:
            raise ValueError(f"the JSON schema is not JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    try:
        lark = any_to_lark(spec.grammar)  # GBNF, as llama.cpp's users write it, becomes Lark
    except Exception as error:  # the converter raises what its parser meets
        raise ValueError(f"the grammar is neither Lark (with a start rule) nor GBNF (with a root rule): {error}"
                         ) from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class _Matcher:
    """An llguidance matcher as `kvattn.generation.adjust.Grammar`.

    Once the output is complete the matcher stops and may take an end of
    sequence without counting it as a token, so which tokens it really took
    is kept here, for `rollback`.
    """

    def __init__(self, matcher: llguidance.LLMatcher, words: int, eos: frozenset[int]):
        self._matcher, self._words, self._eos = matcher, words, eos
        self._mask = llguidance.numpy.allocate_token_bitmask(1, words)
        self._taken: list[bool] = []  # per token advanced: whether the matcher took it

    def forbid(self, row: np.ndarray) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._mask)
        known = min(self._words, len(row))
        row[:known] += _FORBIDDEN[self._mask.view(np.uint8)].reshape(-1)[:known]
        row[known:] = -np.inf

    def advance(self, token: int) -> bool:
        if self._matcher.is_stopped():  # complete: only an end of sequence follows
            taken = False
            if token not in self._eos:
                return False
        elif self._matcher.validate_tokens([token]) == 1 and self._matcher.consume_token(token):
            taken = True
        else:
            return False
        self._taken.append(taken)
        return True

    def rollback(self, count: int) -> None:
        if count:
            taken, self._taken = self._taken[-count:], self._taken[:-count]
            if any(taken):
                self._matcher.rollback(sum(taken))
