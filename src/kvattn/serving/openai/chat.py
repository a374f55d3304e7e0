"""The chat endpoint's own parts: messages (tool calls and their results included), tools, and tool calls.

A conversation becomes a prompt through the checkpoint's chat template
(`chat_ids`), the tools going in as the template's `tools`, as transformers
passes them. What comes back becomes tool calls (`ToolCalls`) by the
request's `tool_choice`:

- `"none"`: text only;
- a named function: the output is constrained to its `parameters` schema and
  is that call's `arguments`;
- `"required"`: the output is constrained to a JSON array of one or more
  `{"name", "parameters"}` calls (one, without `parallel_tool_calls`), as vLLM does;
- `"auto"`: free text, in which each `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` block (the Hermes format that Qwen's and Hermes'
  templates teach their models) naming one of the tools becomes a call.

`ToolCalls` works on text as it streams, so a streamed answer and a whole
one carry the same calls: a named call's arguments stream as they come, the
others are sent whole when they end.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from kvattn.generation.sampling import StructuredOutputs
from kvattn.serving.text import StopStrings
from kvattn.serving.tokenizer import Tokenizer

__all__ = ["Message", "NamedTool", "Tool", "ToolCalls", "chat_ids", "tool_constraint"]

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class CalledFunction(BaseModel):
    name: StrictStr
    arguments: StrictStr
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(BaseModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    """One message of a conversation: an assistant's may carry `tool_calls` instead of content, a `tool`
    message answers one of them."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _shaped(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's with tool_calls has none)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant's message carries tool_calls, not a {self.role}'s")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message names the call it answers: tool_call_id")
        return self

    @property
    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as chat templates take it (transformers' shape: tool calls' arguments as objects)."""
        out = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"a tool call's arguments are JSON text, got {text!r:.80}") from None


class Function(BaseModel):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class _Named(BaseModel):
    name: StrictStr


class NamedTool(BaseModel):
    """`tool_choice` naming one function."""

    type: Literal["function"]
    function: _Named


def chat_ids(tokenizer: Tokenizer, messages: list[Message], *, at_most: int, add_generation_prompt: bool = True,
             add_special_tokens: bool = False, continue_final_message: bool = False,
             tools: list[Tool] | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The ids of a conversation rendered with the chat template (which writes the special tokens itself)."""
    text = tokenizer.render_chat([m.for_template() for m in messages], add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message,
                                 tools=None if not tools else [tool.model_dump(exclude_none=True) for tool in tools],
                                 template_kwargs=template_kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens, at_most=at_most)


def _mode(tools: list[Tool] | None, choice: str | NamedTool | None) -> str | None:
    """`"named"`, `"required"`, `"auto"`, or None for no tool calls."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, NamedTool):
        return "named"
    return "required" if choice == "required" else "auto"


def tool_constraint(tools: list[Tool] | None, choice: str | NamedTool | None, parallel: bool
                    ) -> StructuredOutputs | None:
    """What the output must match for `tool_choice`: a named function's parameters, or for `"required"` an
    array of calls; None otherwise.

    Raises:
      ValueError: a named function that is not among the tools; a choice that needs tools without any.
    """
    if choice not in (None, "none", "auto") and not tools:
        raise ValueError("tool_choice asks for a tool call, but the request has no tools")
    mode = _mode(tools, choice)
    if mode == "named":
        chosen = [tool for tool in tools if tool.function.name == choice.function.name]
        if not chosen:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                             f"({', '.join(t.function.name for t in tools)})")
        return StructuredOutputs(json=chosen[0].function.parameters)
    if mode == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [tool.function.name]},
                                                   "parameters": tool.function.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputs(json=schema | ({} if parallel else {"maxItems": 1}))
    return None


class ToolCalls:
    """One choice's text split into content and tool calls, as it streams.

    `push(text)` and `finish()` return `(content, calls)`: text to show as
    content now, and OpenAI's streamed `tool_calls` deltas
    (`{"index", "id", "type", "function": {"name", "arguments"}}`, later
    deltas of a named call carrying only more `arguments`). `calls` counts
    the calls made, for `finish_reason: "tool_calls"`.
    """

    def __init__(self, tools: list[Tool] | None, choice: str | NamedTool | None):
        self.mode = _mode(tools, choice)
        self._names = {tool.function.name for tool in tools or ()}
        self._named = choice.function.name if self.mode == "named" else None
        self._held: list[str] = []  # text that may be (part of) calls
        self._start = StopStrings([CALL_START]) if self.mode == "auto" else None
        self.calls = 0

    def push(self, text: str) -> tuple[str, list[dict]]:
        if self.mode is None:
            return text, []
        if self.mode == "named":
            if not text:
                return "", []
            delta = {"index": 0, "function": {"arguments": text}}
            if not self.calls:
                self.calls = 1
                delta = {"index": 0, "id": _call_id(), "type": "function",
                         "function": {"name": self._named, "arguments": text}}
            return "", [delta]
        if self.mode == "required" or self._start.matched:
            self._held.append(text)
            return "", []
        shown, started = self._start.push(text)
        if started:
            self._held.append(CALL_START + self._start.rest)
        return shown, []

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode in (None, "named"):
            return "", []
        if self.mode == "auto" and not self._start.matched:
            return self._start.flush(), []
        held = "".join(self._held)
        calls = _required_calls(held) if self.mode == "required" else _hermes_calls(held, self._names)
        if calls is None:  # not calls after all (cut short, or not the format): it was content
            return held, []
        self.calls = len(calls)
        return "", [{"index": i, "id": _call_id(), "type": "function",
                     "function": {"name": name, "arguments": arguments}} for i, (name, arguments) in enumerate(calls)]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _required_calls(text: str) -> list[tuple[str, str]] | None:
    try:
        calls = json.loads(text)
        return [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in calls]
    except (json.JSONDecodeError, TypeError, KeyError):
        return None


_HERMES = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.DOTALL)


def _hermes_calls(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """The calls of text that is nothing but `<tool_call>` blocks (and space), each naming a tool; else None."""
    blocks = _HERMES.findall(text)
    if not blocks or _HERMES.sub("", text).strip():
        return None
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict)):
            return None
        calls.append((call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    return calls
