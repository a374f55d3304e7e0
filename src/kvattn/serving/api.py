"""The OpenAI request bodies `kvattn serve` accepts, as strict pydantic models.

Types are strict (`"2"` is not 2, `true` is not 1), every range is checked
here, so a request that gets past parsing can only be refused for what the
model cannot hold (a prompt past the context). Fields OpenAI defines that
kvattn does not implement are refused when set to anything but their
neutral value, never silently ignored; fields nobody defines are ignored,
as OpenAI's own server does.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from kvattn.generation.sampling import MAX_TOP_LOGPROBS

__all__ = ["ChatRequest", "CompletionRequest", "Message"]

Number = StrictFloat | StrictInt
PositiveInt = Annotated[StrictInt, Field(ge=1)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Stop = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Request(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: PositiveInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    """Extra: sample among the k most likely tokens (0 or -1: all)."""
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    stop: Stop | Annotated[list[Stop], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    """Extra: stop after any of these token ids."""
    ignore_eos: StrictBool = False
    """Extra: do not stop at the tokenizer's end-of-sequence tokens."""
    return_token_ids: StrictBool = False
    """Extra: each choice also carries its token ids."""
    seed: Annotated[StrictInt, Field(ge=0, le=2**32 - 1)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    logit_bias: dict[StrictStr, Number] | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.temperature is not None and not (math.isfinite(self.temperature) and 0 <= self.temperature <= 2):
            raise ValueError(f"temperature must lie in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (all tokens) or a positive int, got {self.top_k}")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported: leave them at 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Request):
    """`POST /v1/completions`: one prompt, text or token ids."""

    prompt: StrictStr | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[StrictStr], Field(min_length=1, max_length=1)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            self.prompt = self.prompt[0]
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Request):
    """`POST /v1/chat/completions`: messages rendered with the checkpoint's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self
