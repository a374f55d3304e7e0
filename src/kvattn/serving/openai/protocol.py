"""The OpenAI request bodies `kvattn serve` accepts, as strict pydantic models, and what the engine makes of them.

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

import dataclasses

from fastapi.responses import JSONResponse

from kvattn.generation.sampling import MAX_TOP_LOGPROBS, SamplingParams
from kvattn.serving.tokenizer import Tokenizer, TooLong

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Job", "Message", "job"]

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

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = _unpaired_surrogate(data, "body")
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode: it holds an unpaired UTF-16 surrogate (a lone \\ud800-"
                             "\\udfff escape); send text as UTF-8")
        return data

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


def _unpaired_surrogate(value, where: str) -> str | None:
    """Where in a JSON value a string holds an unpaired surrogate (which no tokenizer or encoder takes), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _unpaired_surrogate(key, f"{where} key") if isinstance(key, str) else None
        found = found or _unpaired_surrogate(item, f"{where}.{key}")
        if found is not None:
            return found
    return None


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


class ApiError(Exception):
    """A refusal with its HTTP status, shaped as OpenAI's errors."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", *, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        # A message may quote what the client sent; an unpaired surrogate there would make the body unencodable.
        super().__init__(message.encode("utf-8", "backslashreplace").decode("utf-8"))
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclasses.dataclass
class Job:
    """One HTTP request's generation, after every check."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset
    """The ids that end a choice: the request's, and the tokenizer's end-of-sequence ids unless `ignore_eos`."""
    token_ids: bool

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def stops(self) -> list[str]:
        return list(self.params.stop)

    @property
    def top_logprobs(self) -> int | None:  # None: no logprobs
        return self.params.logprobs


def job(body: CompletionRequest | ChatRequest, tokenizer: Tokenizer, *, model_name: str, max_len: int) -> Job:
    """A request body checked against the served model and made the engine's `SamplingParams`: the one place
    where an HTTP field becomes what the engine reads.

    Raises:
      ApiError: 404 for another model, 400 for a prompt the template or tokenizer refuses, one past the context,
        or settings the model cannot sample with.
    """
    if body.model != model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`",
                       "not_found_error", param="model", code="model_not_found")
    try:
        if isinstance(body, ChatRequest):
            text = tokenizer.render_chat([{"role": m.role, "content": m.text} for m in body.messages])
            prompt = tokenizer.encode(text, add_special_tokens=False, at_most=max_len)
            max_tokens = body.max_completion_tokens or body.max_tokens
            top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            prompt = (list(body.prompt) if isinstance(body.prompt, list)
                      else tokenizer.encode(body.prompt, add_special_tokens=True, at_most=max_len))
            max_tokens = body.max_tokens or 16
            top_logprobs = body.logprobs
    except TooLong as error:
        raise ApiError(400, f"the prompt holds {error.count} tokens; this server's context is {max_len}",
                       param="prompt", code="context_length_exceeded") from None
    except (ValueError, TypeError) as error:
        raise ApiError(400, str(error)) from None
    if not prompt:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
    if len(prompt) >= max_len:
        raise ApiError(400, f"the prompt holds {len(prompt)} tokens; this server's context is {max_len}",
                       param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_len - len(prompt)
    if len(prompt) + max_tokens > max_len:
        raise ApiError(400, f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed this server's context "
                            f"of {max_len} tokens", param="max_tokens", code="context_length_exceeded")
    try:  # the request body becomes the engine's SamplingParams here, and only here
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_k=None if body.top_k in (None, 0, -1) else body.top_k,
            top_p=None if body.top_p in (None, 1) else body.top_p, seed=body.seed, n=body.n,
            stop=tuple(body.stops), stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            logprobs=top_logprobs)
        params.sampling.check_vocab(tokenizer.vocab_size)
    except (ValueError, TypeError) as error:
        raise ApiError(400, str(error)) from None
    return Job(prompt, params, params.stop_ids(tokenizer.eos_token_ids), body.return_token_ids)
