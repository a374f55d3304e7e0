"""A checkpoint's tokenizer: its `tokenizer.json`, special tokens, chat template, and streamed detokenization.

- `Tokenizer.from_directory(path)` reads a Hugging Face checkpoint's
  `tokenizer.json` (with the `tokenizers` library), its special tokens and
  chat template (`chat_template.jinja`, else `tokenizer_config.json`) and its
  end-of-sequence ids (`generation_config.json`). Chat templates render as
  transformers' `apply_chat_template` renders them: a sandboxed, immutable
  jinja2 environment with the same filters, globals and variables, so a
  template from the Hub gives the same text here as there.
- `Detokenizer` turns generated ids into text one token at a time, never
  emitting half a UTF-8 character, so that the pieces add up to the
  `tokenizers` library's own `decode` of the ids, for byte-level BPE and for
  SentencePiece-style tokenizers (`▁` for a space, byte-fallback pieces).

Every refusal of a request's content (messages of the wrong shape, a
template that raises) is a `ValueError`, which the HTTP layer answers with a
400; a checkpoint's unreadable files are `ValueError`s naming the file.
`kvattn.serving.text` builds a generated sequence's text on these.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers

from kvattn.templates import TemplateProcesses, compile_template, conversation, plain

__all__ = ["Detokenizer", "Tokenizer", "TooLong", "as_token_id"]

# Bounds on what is read from a checkpoint directory: the largest tokenizer.json files on the Hub are tens of MiB.
MAX_TOKENIZER_BYTES = 128 << 20
MAX_CONFIG_BYTES = 16 << 20
# Token ids cross into the tokenizers library as unsigned 32-bit ints.
_MAX_TOKEN_ID = (1 << 32) - 1
# Context ids a Detokenizer decodes before the generated ones, at least: enough that the first generated token
# decodes as it does mid-text (a SentencePiece decoder strips the leading space of the text's first word only) and
# that a character whose first bytes end the prompt is finished by the generated ones.
_CONTEXT_TOKENS = 8


def _read_text(path: Path, limit: int) -> str:
    """A UTF-8 file's text, refusing one over `limit` bytes."""
    with open(path, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes; refusing to read it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from error


def _read_json(path: Path) -> dict:
    """A JSON object from a file of at most `MAX_CONFIG_BYTES`."""
    try:
        value = json.loads(_read_text(path, MAX_CONFIG_BYTES))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(value, dict):  # a file's content, not an argument's type, so a ValueError
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")  # noqa: TRY004
    return value


def _token_text(value, field: str, path: Path) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with its `content`."""
    if isinstance(value, dict):
        value = value.get("content", value)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: {field} must be a string or a dict with a string 'content', got {value!r}")
    return value


def _config_template(value, path: Path) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of named templates of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(entry, dict) for entry in value):
        named = {entry.get("name"): entry.get("template") for entry in value}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{path} has chat templates named {sorted(map(str, named))} but none named 'default' "
                         "with a string template; pass --chat-template")
    raise ValueError(f"{path}: chat_template must be a string or a list of {{name, template}}, got {value!r:.80}")


def _eos_ids(value, path: Path) -> list[int] | None:
    """generation_config.json's `eos_token_id`: one id, a list of them, or absent."""
    ids = [value] if isinstance(value, int) else value
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
    return ids


def as_token_id(token_id) -> int:
    """A Python int in the range the tokenizers library takes (numpy integers accepted)."""
    try:
        value = operator.index(token_id)
    except TypeError:
        raise ValueError(f"a token id must be an integer, got {token_id!r}") from None
    if isinstance(token_id, bool) or not 0 <= value <= _MAX_TOKEN_ID:
        raise ValueError(f"a token id must be an integer in [0, {_MAX_TOKEN_ID}], got {token_id!r}")
    return value


def _continued(text: str, final: str) -> str:
    """`text` cut right after the last message's content `final`, as transformers' `continue_final_message` cuts it."""
    if not final.strip() or final.strip() not in text:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered "
                         "conversation, so it cannot be continued")
    at = text.rindex(final.strip())
    if text[at : at + len(final.lstrip())] == final.lstrip():  # the template kept its trailing space
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]


class TooLong(ValueError):
    """A text that encodes to more tokens than the caller allows (`count` of them)."""

    def __init__(self, count: int, at_most: int):
        super().__init__(f"the text encodes to {count} tokens, more than {at_most}")
        self.count, self.at_most = count, at_most


class Tokenizer:
    """A checkpoint's `tokenizers.Tokenizer` with its special tokens, end-of-sequence ids and chat template.

    Args:
      tokenizer: the `tokenizers.Tokenizer` (from a `tokenizer.json`).
      chat_template: jinja2 source of the chat template, or None for none.
      bos_token, eos_token: the special tokens' text, as templates see them.
      eos_token_ids: the ids that end a generation; default the id of `eos_token`.
      name: what messages call this tokenizer (its directory).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids: Iterable[int] | None = None, name: str = "the tokenizer"):
        self._tokenizer = tokenizer
        self._name = name
        self.bos_token = bos_token
        """The beginning-of-sequence token's text, or None."""
        self.eos_token = eos_token
        """The end-of-sequence token's text, or None."""
        if eos_token_ids is None and eos_token is not None:
            eos_id = tokenizer.token_to_id(eos_token)
            if eos_id is None:
                raise ValueError(f"{name}: eos_token {eos_token!r} is not in the vocabulary")
            eos_token_ids = [eos_id]
        self.eos_token_ids = frozenset(as_token_id(i) for i in eos_token_ids or ())
        """The ids that end a generation (generation_config.json's `eos_token_id`, else `eos_token`'s id)."""
        self._source = chat_template
        self._template = None if chat_template is None else compile_template(chat_template)
        self._processes: TemplateProcesses | None = None
        self._special_ids = frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
        # A byte-fallback decoder turns a run of byte pieces that is not valid UTF-8 into one U+FFFD per byte, valid
        # bytes included, so a run's text is known only when the run ends.
        byte_piece_ids = (tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
        self._byte_piece_ids = frozenset(i for i in byte_piece_ids if i is not None)

    @classmethod
    def from_directory(cls, path, chat_template: str | None = None) -> Tokenizer:
        """Reads a Hugging Face checkpoint directory's tokenizer files.

        Args:
          path: a directory with `tokenizer.json`, and optionally
            `tokenizer_config.json` (`bos_token`, `eos_token`,
            `chat_template`), `chat_template.jinja` (which takes precedence
            over the config's template, as in transformers) and
            `generation_config.json` (`eos_token_id`).
          chat_template: a template's source (e.g. the text of a
            `--chat-template FILE`), used instead of the directory's.

        Raises:
          FileNotFoundError: no `tokenizer.json`.
          ValueError: a file too large, not JSON, or with fields of the
            wrong type; a template that does not compile.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json: pass a checkpoint directory with its tokenizer")
        source = _read_text(tokenizer_file, MAX_TOKENIZER_BYTES)
        try:
            tokenizer = tokenizers.Tokenizer.from_str(source)
        except Exception as error:  # the tokenizers library raises plain Exceptions
            raise ValueError(f"{tokenizer_file} is not a tokenizer the tokenizers library can load: {error}") from error
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        if chat_template is None and (path / "chat_template.jinja").is_file():
            chat_template = _read_text(path / "chat_template.jinja", MAX_CONFIG_BYTES)
        if chat_template is None:
            chat_template = _config_template(config.get("chat_template"), config_file)
        generation_file = path / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else {}
        return cls(tokenizer, chat_template=chat_template,
                   bos_token=_token_text(config.get("bos_token"), "bos_token", config_file),
                   eos_token=_token_text(config.get("eos_token"), "eos_token", config_file),
                   eos_token_ids=_eos_ids(generation.get("eos_token_id"), generation_file), name=str(path))

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, *, at_most: int | None = None) -> list[int]:
        """`text`'s token ids; `add_special_tokens` applies the tokenizer's post-processor (e.g. a leading BOS).

        The encoding runs with the GIL released (the tokenizers library's
        batch call; its single-text call holds it), so a long text encoded
        on a worker thread leaves the others running. With `at_most`, a text
        of more tokens raises `TooLong` before its ids become a Python list
        (which holds the GIL for as long as the list is long).
        """
        if not isinstance(text, str):
            raise TypeError(f"text to encode must be a string, got {type(text).__name__}")
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if at_most is not None and len(encoding) > at_most:
            raise TooLong(len(encoding), at_most)
        return encoding.ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; ids past the vocabulary decode to nothing, as in the tokenizers library."""
        return self._tokenizer.decode([as_token_id(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        """Whether `render_chat` has a template to render with."""
        return self._template is not None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The prompt text for a conversation, as transformers' `apply_chat_template(..., tokenize=False)` gives it.

        Args:
          messages: dicts with a string `role` and `content` (other keys
            are passed to the template as they are; an assistant message
            with `tool_calls` may have no content).
          add_generation_prompt: end with the header that starts the
            assistant's reply.
          continue_final_message: end right after the last message's
            content, so the model continues it (not with `add_generation_prompt`).
          tools: the tools' JSON schemas, as the template's `tools`.
          template_kwargs: more variables for the template (none of the above).

        Raises:
          ValueError: no chat template; messages of the wrong shape; the
            template raised (`raise_exception`, an unsafe access refused by
            the sandbox, or any other error); with `bound_rendering`, it ran
            past its time, output or memory; a last message the rendered
            text does not hold, with `continue_final_message`.
        """
        if self._template is None:
            raise ValueError(f"{self._name} has no chat_template; pass --chat-template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message; it cannot also add a generation "
                             "prompt: set add_generation_prompt to false")
        extra = dict(template_kwargs or {})
        reserved = sorted(extra.keys() & {"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                          "eos_token"})
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: they have fields of their own")
        variables = {**plain(extra, "chat_template_kwargs"), "messages": conversation(messages),
                     "add_generation_prompt": bool(add_generation_prompt),
                     "tools": None if tools is None else plain(list(tools), "tools"), "documents": None}
        # As in transformers, an unset special token is left undefined rather than rendered as "None".
        variables.update({name: token for name, token in (("bos_token", self.bos_token),
                                                           ("eos_token", self.eos_token)) if token is not None})
        if self._processes is not None:
            text = self._processes.render(variables)
        else:
            try:
                text = self._template.render(**variables)
            except Exception as error:  # template code runs on request data: any failure is the request's
                raise ValueError(f"the chat template refused the messages: {type(error).__name__}: {error}"
                                 ) from error
        return _continued(text, variables["messages"][-1].get("content") or "") if continue_final_message else text

    def bound_rendering(self, *, seconds: float, max_chars: int, memory_bytes: int, processes: int) -> None:
        """From now on, `render_chat` renders in child processes, bounded in time, output and memory.

        A server renders templates from request data: a template that loops
        for ever or builds a huge string then fails that request (a
        `ValueError`) instead of stalling or exhausting the server. See
        `kvattn.templates.TemplateProcesses`.
        """
        self.close()
        if self._source is not None:
            self._processes = TemplateProcesses(self._source, seconds=seconds, max_chars=max_chars,
                                                memory_bytes=memory_bytes, processes=processes)

    def close(self) -> None:
        """Ends `bound_rendering`'s child processes (rendering goes back in-process)."""
        if self._processes is not None:
            self._processes.close()
            self._processes = None

    def detokenizer(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> Detokenizer:
        """A fresh `Detokenizer` over this tokenizer (see there)."""
        return Detokenizer(self, skip_special_tokens=skip_special_tokens, context=context)


class Detokenizer:
    """Generated ids to text, one token at a time, never splitting a UTF-8 character.

    Each push decodes a short window of ids and returns what its text adds
    to the window before the new ids; the window moves on only where the
    text is final. Text is held back while it ends in U+FFFD (a character's
    bytes still arriving) or in a byte-fallback piece (the run of byte pieces
    decodes as one U+FFFD per byte if it turns out not to be UTF-8). So the
    pushed pieces and the flush add up to `decode(context + ids)` past where
    it first differs from `decode(context)`: `decode(ids)` with no context.

    Args:
      tokenizer: the `Tokenizer`.
      skip_special_tokens: leave special tokens out of the text.
      context: ids that precede the first pushed one (the prompt), so the
        first new token decodes as it would mid-text (e.g. keeps the leading
        space a SentencePiece-style decoder strips at the start). Only its
        tail is decoded: the last few ids, and back to where the run of byte
        pieces they may end in starts.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        self._decode = tokenizer._tokenizer.decode
        self._skip = skip_special_tokens
        self._silent_ids = tokenizer._special_ids if skip_special_tokens else frozenset()
        self._byte_piece_ids = tokenizer._byte_piece_ids
        start = max(0, len(context) - _CONTEXT_TOKENS)
        # New bytes that make a run invalid turn all of it into U+FFFD, so the context holds the whole run.
        while start > 0 and (context[start] in self._byte_piece_ids or context[start] in self._silent_ids):
            start -= 1
        self._ids = [as_token_id(i) for i in context[start:]]
        # The window is ids[_window_start:]; its text up to _read_end (_read_text) has been emitted or is context.
        self._window_start, self._read_end = 0, len(self._ids)
        self._read_text = self._decode(self._ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Adds one generated id; returns the text now final ("" while a character is incomplete)."""
        self._ids.append(as_token_id(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a generation, the text still held back (e.g. a final incomplete character, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._ids[self._window_start:]
        text = self._decode(window, skip_special_tokens=self._skip)
        if not final and (text.endswith("\ufffd") or self._last_decoded(window) in self._byte_piece_ids):
            return ""
        # The window's text starts with what was read but where the context ended mid-character (or in a byte run
        # that the new bytes make invalid): then the new text starts where the two differ.
        if text.startswith(self._read_text):
            cut = len(self._read_text)
        else:
            cut = len(os.path.commonprefix([self._read_text, text]))
        if len(text) <= cut:
            return ""
        self._window_start, self._read_end = self._read_end, len(self._ids)
        self._read_text = self._decode(self._ids[self._window_start:self._read_end], skip_special_tokens=self._skip)
        return text[cut:]

    def _last_decoded(self, window: list[int]) -> int | None:
        """The window's last id that shows in the text (skipped special tokens do not end a byte run)."""
        return next((i for i in reversed(window) if i not in self._silent_ids), None)
