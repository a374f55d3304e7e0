"""A generated sequence's text, the same for every face: detokenized as it comes, cut at stop strings.

- `StopStrings` cuts streamed text at the first stop string to complete,
  holding back any tail that could still become one, so a stop string split
  across tokens is matched and never emitted.
- `TextStream` is one generated sequence's text, a `Detokenizer` and
  `StopStrings` in one: every face that shows generated text (the HTTP
  server, the CLI, `kvattn.LLM`) pushes ids into one and shows what it returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvattn.serving.tokenizer import Tokenizer, as_token_id

__all__ = ["StopStrings", "TextDelta", "TextStream"]


class StopStrings:
    """Streamed text cut at the first stop string to complete, which is not emitted unless `include`d.

    Text that could be the start of a stop string is held back until the
    next piece shows whether it is one. When several stop strings complete,
    the one ending first wins (on a tie, the one starting first), as when the
    text arrives one character at a time.

    >>> stops = StopStrings(["</s>", "\\n\\n"])
    >>> stops.push("Hello </")
    ('Hello ', False)
    >>> stops.push("s> and more")
    ('', True)

    Args:
      stops: the stop strings, none empty.
      include: end the text with the stop string (vLLM's `include_stop_str_in_output`).
    """

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.include = include
        if isinstance(stops, str) or not all(isinstance(stop, str) and stop for stop in stops):
            raise ValueError(f"stop strings must be a list of non-empty strings, got {stops!r:.80}")
        self.stops = tuple(dict.fromkeys(stops))
        """The stop strings, without repeats."""
        self.matched = False
        """Whether a stop string has completed."""
        self.rest = ""
        """After a match, the text pushed past the stop string (what a caller that goes on reading needs)."""
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Adds the next piece of text; returns the text safe to emit now and whether a stop string completed.

        After a match, the text from the stop string on is dropped, and later pushes return `("", True)`.
        """
        if self.matched:
            return "", True
        pending = self._held + text
        # Held text holds no whole stop string, so every match ends in the new text.
        matches = [(start + len(stop), start) for stop in self.stops if (start := pending.find(stop)) >= 0]
        if matches:
            self.matched, self._held = True, ""
            end, start = min(matches)
            self.rest = pending[end:]
            return pending[: end if self.include else start], True
        hold = max((size for stop in self.stops for size in range(min(len(stop) - 1, len(pending)), 0, -1)
                    if pending.endswith(stop[:size])), default=0)
        self._held = pending[len(pending) - hold:]
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        """At the end of a generation, the text held back (none after a match)."""
        held, self._held = self._held, ""
        return held


class TextDelta(NamedTuple):
    """What one step adds to a sequence's text."""

    text: str
    """The text to show now ("" while it is held back)."""
    stopped: bool
    """Whether a stop string has completed: the text ends before it, and nothing follows."""


class TextStream:
    """One generated sequence's text: its ids detokenized as they come, cut at the first stop string.

    Without stop strings, the deltas of a sequence (its pushes and its
    `finish`) add up to the text the generated ids add after the prompt's,
    `decode(ids)` for an empty prompt (see `Detokenizer`); no delta holds
    half a character. With them, that text is cut where the first stop
    string to complete begins; the stop string is never shown, whether it
    comes in one token or across several, and text that could still become
    one is held back until the next token shows whether it does.

    Examples:
      >>> import tokenizers
      >>> vocab = {"<unk>": 0, "▁have": 1, "▁w": 2, "121": 3, "▁but": 4}
      >>> pieces = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>"))
      >>> pieces.decoder = tokenizers.decoders.Metaspace()
      >>> stream = TextStream(Tokenizer(pieces), stop=[" but"])
      >>> [stream.push(token_id).text for token_id in (1, 2, 3)]
      ['have', ' w', '121']
      >>> stream.push(4), stream.finish()
      (TextDelta(text='', stopped=True), TextDelta(text='', stopped=True))

    Args:
      tokenizer: the `Tokenizer`.
      prompt: the prompt's ids; its tail decodes before the generated ids,
        so the first generated word keeps its leading space.
      stop: stop strings, none empty.
      stop_token_ids: ids that end a generation (e.g. `eos_token_ids`); their
        own text is never shown, special or not.
      skip_special_tokens: leave special tokens out of the text.
      include_stop: end the text with the stop string that ended it.
      min_tokens: stop strings are looked for only in the text of the
        tokens after the first `min_tokens` (`SamplingParams.min_tokens`).
    """

    def __init__(self, tokenizer: Tokenizer, *, prompt: Sequence[int] = (), stop: Sequence[str] = (),
                 stop_token_ids: Iterable[int] = (), skip_special_tokens: bool = True, include_stop: bool = False,
                 min_tokens: int = 0):
        self._detokenizer = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens, context=prompt)
        self._stops = StopStrings(stop, include=include_stop) if stop else None
        self._stop_token_ids = frozenset(as_token_id(i) for i in stop_token_ids)
        self._unchecked = min_tokens  # tokens whose text no stop string is looked for in
        self._finished = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has completed."""
        return self._stops is not None and self._stops.matched

    def push(self, token_id: int) -> TextDelta:
        """Adds one generated id; returns the text to show now and whether a stop string completed.

        Raises:
          ValueError: `token_id` is not a token id, or the stream is finished.
        """
        if self._finished:
            raise ValueError("this TextStream is finished; make a new one for the next sequence")
        token_id = as_token_id(token_id)
        if self.stopped:
            return TextDelta("", True)
        text = "" if token_id in self._stop_token_ids else self._detokenizer.push(token_id)
        if self._unchecked > 0:
            self._unchecked -= 1
            return TextDelta(text, False)
        return self._cut(text)

    def finish(self) -> TextDelta:
        """At the end of the sequence, the text still held back (a character cut short shows as U+FFFD)."""
        if self._finished:
            raise ValueError("this TextStream is finished already")
        self._finished = True
        if self.stopped:
            return TextDelta("", True)
        text, stopped = self._cut(self._detokenizer.flush())
        if not stopped and self._stops is not None:
            text += self._stops.flush()
        return TextDelta(text, stopped)

    def _cut(self, text: str) -> TextDelta:
        if self._stops is None:
            return TextDelta(text, False)
        return TextDelta(*self._stops.push(text))
