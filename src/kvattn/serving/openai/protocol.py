"""The OpenAI request bodies `kvattn serve` accepts, as strict pydantic models, and what the engine makes of them.

Types are strict (`"2"` is not 2, `true` is not 1), every range is checked
here, so a request that gets past parsing can only be refused for what the
model cannot hold (a prompt past the context). An explicit `null` means the
field's default, as on OpenAI's server. Fields OpenAI or vLLM define that
kvattn does not implement (`NOT_IMPLEMENTED`) are refused with a 400 naming
them when set to anything but a value that asks for nothing, never silently
ignored; bookkeeping fields that change no output (`IGNORED`) and fields
nobody defines are ignored, as OpenAI's own server does. `field_table` lists
every field with what becomes of it (the serving guide shows it).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, ClassVar, Literal

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

from kvattn.generation.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams, StructuredOutputs
from kvattn.serving.openai.chat import Message, NamedTool, Tool, chat_ids, tool_constraint
from kvattn.serving.structured import Grammars
from kvattn.serving.tokenizer import Tokenizer, TooLong

__all__ = ["IGNORED", "NOT_IMPLEMENTED", "ApiError", "ChatRequest", "CompletionRequest", "Job", "field_table", "job",
           "served_model"]

Number = StrictFloat | StrictInt
PositiveInt = Annotated[StrictInt, Field(ge=1)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Stop = Annotated[StrictStr, Field(min_length=1, max_length=256)]


# Fields OpenAI or vLLM define whose effect kvattn does not implement, with the values that ask for nothing
# (null always does): any other value is refused with a 400 that names the field.
NOT_IMPLEMENTED: dict[str, tuple] = {
    # the older form of tools, and structured outputs' other forms
    "functions": ([],), "function_call": ("none", "auto"), "structural_tag": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    # sampling
    "length_penalty": (1,), "use_beam_search": (False,), "bad_words": ([],), "logits_processors": (),
    "vllm_xargs": (),
    # text and prompt handling
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (),
    "documents": (), "chat_template": (), "mm_processor_kwargs": ({},), "suffix": ("",),
    # other modalities and models
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "web_search_options": (),
    "verbosity": (),
}
# Bookkeeping fields that change no output: accepted and ignored.
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id",
           "priority", "cache_salt", "kv_transfer_params")


def _asks_nothing(value, neutral: tuple) -> bool:
    """Whether `value` is null or one of `neutral` (a number equal to a number, never a bool to a number)."""
    def same(a, b) -> bool:
        numbers = (int, float)
        if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
            return a == b
        return type(a) is type(b) and a == b

    return value is None or any(same(value, n) for n in neutral)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchema(BaseModel):
    """`response_format.json_schema`: a named schema (`strict` is always so: the output always matches)."""

    name: StrictStr
    schema_: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format takes json_schema exactly when its type is json_schema")
        return self


class Structured(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, any JSON object, a regex, a choice, a grammar."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | StrictStr | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None


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
    skip_special_tokens: StrictBool = True
    """Extra: leave special tokens out of the text."""
    include_stop_str_in_output: StrictBool = False
    """Extra: end the text with the stop string that ended it."""
    return_token_ids: StrictBool = False
    """Extra: each choice also carries its token ids."""
    seed: Annotated[StrictInt, Field(ge=0, le=2**32 - 1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[Number, Field(gt=0, le=100)] = 1.0
    """Extra: transformers' and vLLM's repetition penalty (1: none)."""
    logit_bias: Annotated[dict[str, Annotated[Number, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    """Extra: no end of sequence, stop id or stop string before this many tokens."""
    min_p: Annotated[Number, Field(ge=0, le=1)] = 0.0
    """Extra: sample among the tokens at least this many times as likely as the most likely one."""
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 20)] | None = None
    """Extra: sample only among these ids."""
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    """Extra: keep only the prompt's last k tokens (-1: as many as the context holds, with `max_tokens`)."""
    return_tokens_as_token_ids: StrictBool = False
    """Extra: name each token in the logprobs `token_id:N`, not by its text."""
    response_format: ResponseFormat | None = None
    structured_outputs: Structured | None = None
    """Extra: vLLM's structured outputs (a JSON schema, any JSON object, a regex, a choice or a grammar)."""
    guided_json: dict | StrictStr | None = None
    """Extra: vLLM's older name for `structured_outputs.json`."""
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {}
    """This endpoint's own not-implemented fields, with the values that ask for nothing."""

    @classmethod
    def not_implemented(cls) -> dict[str, tuple]:
        return {**NOT_IMPLEMENTED, **cls.NEUTRAL}

    @model_validator(mode="before")
    @classmethod
    def _checked_first(cls, data):
        where = _unpaired_surrogate(data, "body")
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode: it holds an unpaired UTF-16 surrogate (a lone \\ud800-"
                             "\\udfff escape); send text as UTF-8")
        if not isinstance(data, dict):
            return data
        data = {key: value for key, value in data.items() if value is not None}  # null: the default
        refused = sorted(name for name, neutral in cls.not_implemented().items()
                         if name in data and not _asks_nothing(data[name], neutral))
        if refused:
            raise ValueError(f"not implemented by kvattn serve: {', '.join(refused)} (leave them out, or null)")
        return data

    @model_validator(mode="after")
    def _supported(self):
        if self.temperature is not None and not (math.isfinite(self.temperature) and 0 <= self.temperature <= 2):
            raise ValueError(f"temperature must lie in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (all tokens) or a positive int, got {self.top_k}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def structured(self) -> StructuredOutputs | None:
        """What the output must match, from whichever field asked for it; None for free text.

        Raises:
          ValueError: more than one field asks, or what one asks for is not a constraint.
        """
        asked = {}
        if self.response_format is not None and self.response_format.type != "text":
            form = self.response_format
            asked["response_format"] = (StructuredOutputs(json_object=True) if form.type == "json_object"
                                        else StructuredOutputs(json=form.json_schema.schema_))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            asked["structured_outputs"] = StructuredOutputs(**fields)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked[name] = StructuredOutputs(**{kind: getattr(self, name)})
        if len(asked) > 1:
            raise ValueError(f"structured outputs are asked for by {', '.join(sorted(asked))}: ask in one field")
        return next(iter(asked.values()), None)


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


MAX_PROMPTS = 64
"""Prompts one completions request holds at most."""
MAX_SEQUENCES = 256
"""Completions one request may ask the engine for at most: prompts × `best_of` (or `n`)."""


class CompletionRequest(_Request):
    """`POST /v1/completions`: one prompt or several, each text or token ids."""

    prompt: StrictStr | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)] | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    """Completions made per prompt, of which the `n` most likely (by total log-probability) are returned."""
    NEUTRAL: ClassVar[dict[str, tuple]] = {  # a prompt's text gets special tokens; the rest is for chats
        "add_special_tokens": (True,), "tools": ([],), "tool_choice": ("none", "auto"),
        "parallel_tool_calls": (True, False), "add_generation_prompt": (True,), "continue_final_message": (False,),
        "chat_template_kwargs": ({},)}

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of not in (None, self.n) and self.stream:
            raise ValueError("best_of other than n cannot stream: the best are known only at the end")
        if self.echo and self.logprobs is not None:
            raise ValueError("not implemented by kvattn serve: echo with logprobs (the prompt's log-probabilities)")
        if len(self.prompts) * (self.best_of or self.n) > MAX_SEQUENCES:
            raise ValueError(f"{len(self.prompts)} prompts x {self.best_of or self.n} completions each is more than "
                             f"the {MAX_SEQUENCES} one request may ask for")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ChatRequest(_Request):
    """`POST /v1/chat/completions`: messages rendered with the checkpoint's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    """Default: "auto" with tools, "none" without."""
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True
    """Extra: end the prompt with the header that starts the assistant's reply."""
    continue_final_message: StrictBool = False
    """Extra: let the model continue the last message (with add_generation_prompt false)."""
    chat_template_kwargs: dict | None = None
    """Extra: more variables for the chat template."""
    NEUTRAL: ClassVar[dict[str, tuple]] = {"add_special_tokens": (False,), "echo": (False,)}  # the template writes them

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def structured(self) -> StructuredOutputs | None:
        asked = super().structured()
        calls = tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        if asked is not None and calls is not None:
            raise ValueError(f"tool_choice {self.tool_choice!r} constrains the output; it cannot also follow "
                             "response_format or structured outputs")
        return asked or calls


def field_table() -> str:
    """Markdown: every request field of both endpoints, and what `kvattn serve` makes of it."""
    endpoints = (CompletionRequest, ChatRequest)
    names = sorted(set().union(*(e.model_fields for e in endpoints), *(e.not_implemented() for e in endpoints),
                               IGNORED))

    def cell(endpoint, name: str) -> str:
        if name in IGNORED:
            return "accepted, changes nothing"
        if name in endpoint.not_implemented():
            neutral = ", ".join(f"`{json.dumps(value)}`" for value in endpoint.not_implemented()[name])
            return f"refused (400) unless null{' or ' + neutral if neutral else ''}"
        if name == "best_of" and name in endpoint.model_fields:
            return "honoured when equal to `n`"
        return "honoured" if name in endpoint.model_fields else "-"

    rows = ["| field | `/v1/completions` | `/v1/chat/completions` |", "|---|---|---|"]
    rows += [f"| `{name}` | {cell(endpoints[0], name)} | {cell(endpoints[1], name)} |" for name in names]
    return "\n".join(rows)


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
    """One HTTP request's generation, after every check: `params.n` completions of each prompt, of which the
    `returned` most likely are returned (`best_of`)."""

    prompts: list[list[int]]
    params: SamplingParams
    stop_ids: frozenset
    """The ids that end a choice: the request's, and the tokenizer's end-of-sequence ids unless `ignore_eos`."""
    token_ids: bool
    grammar: object = None
    """Its structured outputs compiled (`kvattn.serving.structured.Grammars.compile`), or None."""
    tools: list[Tool] | None = None
    tool_choice: str | NamedTool | None = None
    """A chat's tools and tool choice, for `kvattn.serving.openai.chat.ToolCalls`."""
    returned: int = 1
    """Completions returned per prompt (`n`); `params.n` are made (`best_of`)."""
    echo: list[str] | None = None
    """With `echo`: each prompt's text, which its completions' text begins with."""
    tokens_as_ids: bool = False
    """Name the tokens of the logprobs `token_id:N` (`return_tokens_as_token_ids`)."""

    @property
    def rows(self) -> int:
        """Completions made: `params.n` per prompt, prompt after prompt."""
        return len(self.prompts) * self.params.n

    @property
    def stops(self) -> list[str]:
        return list(self.params.stop)

    def token_name(self, tokenizer: Tokenizer, token_id: int) -> str:
        """How the logprobs name a token: its text (special tokens too), or `token_id:N`."""
        return f"token_id:{token_id}" if self.tokens_as_ids else tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def top_logprobs(self) -> int | None:  # None: no logprobs
        return self.params.logprobs


def served_model(model: str | None, model_name: str) -> None:
    """A 404 unless `model` names the served model (None: any, where the field is optional)."""
    if model is not None and model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{model_name}`",
                       "not_found_error", param="model", code="model_not_found")


def job(body: CompletionRequest | ChatRequest, tokenizer: Tokenizer, *, model_name: str, max_len: int,
        grammars: Grammars | None = None) -> Job:
    """A request body checked against the served model and made the engine's `SamplingParams`: the one place
    where an HTTP field becomes what the engine reads.

    Runs on a text worker: it renders, tokenizes and compiles a grammar (with `grammars`, made for `tokenizer`).

    Raises:
      ApiError: 404 for another model, 400 for a prompt the template or tokenizer refuses, one past the context,
        settings the model cannot sample with, or structured outputs that do not compile.
    """
    served_model(body.model, model_name)
    chat = isinstance(body, ChatRequest)
    limit = None if body.truncate_prompt_tokens is not None else max_len  # a prompt to truncate may be longer
    try:
        if chat:
            prompts = [chat_ids(tokenizer, body.messages, at_most=limit,
                                add_generation_prompt=body.add_generation_prompt,
                                continue_final_message=body.continue_final_message, tools=body.tools,
                                template_kwargs=body.chat_template_kwargs)]
            max_tokens = body.max_completion_tokens or body.max_tokens
            top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            prompts = [list(prompt) if isinstance(prompt, list)
                       else tokenizer.encode(prompt, add_special_tokens=True, at_most=limit)
                       for prompt in body.prompts]
            max_tokens = body.max_tokens or 16
            top_logprobs = body.logprobs
    except TooLong as error:
        raise ApiError(400, f"the prompt holds {error.count} tokens; this server's context is {max_len}",
                       param="prompt", code="context_length_exceeded") from None
    except (ValueError, TypeError) as error:
        raise ApiError(400, str(error)) from None
    if body.truncate_prompt_tokens is not None:
        keep = body.truncate_prompt_tokens
        if keep == -1:
            keep = max_len - (max_tokens or 1)
        if keep < 1:
            raise ApiError(400, f"truncate_prompt_tokens keeps {keep} tokens: give max_tokens below the context "
                                f"of {max_len}", param="truncate_prompt_tokens")
        prompts = [prompt[-keep:] for prompt in prompts]
    longest = max(len(prompt) for prompt in prompts)
    if not min(len(prompt) for prompt in prompts):
        raise ApiError(400, "a prompt encodes to no tokens", param="prompt")
    if longest >= max_len:
        raise ApiError(400, f"the prompt holds {longest} tokens; this server's context is {max_len}",
                       param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_len - longest
    if longest + max_tokens > max_len:
        raise ApiError(400, f"{longest} prompt tokens + max_tokens {max_tokens} exceed this server's context "
                            f"of {max_len} tokens", param="max_tokens", code="context_length_exceeded")
    try:  # the request body becomes the engine's SamplingParams here, and only here
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_k=None if body.top_k in (None, 0, -1) else body.top_k,
            top_p=None if body.top_p in (None, 1) else body.top_p, min_p=body.min_p, seed=body.seed,
            n=body.n if chat else body.best_of or body.n,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=_logit_bias(body.logit_bias, tokenizer.vocab_size),
            min_tokens=body.min_tokens, allowed_token_ids=_ids_in(body.allowed_token_ids, tokenizer.vocab_size),
            stop=tuple(body.stops), stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, logprobs=top_logprobs, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, structured_outputs=body.structured())
        params.sampling.check_vocab(tokenizer.vocab_size)
        grammar = None
        if params.structured_outputs is not None:
            grammar = (grammars or Grammars(tokenizer)).compile(params.structured_outputs)
    except (ValueError, TypeError) as error:
        raise ApiError(400, str(error)) from None
    if chat:
        return Job(prompts, params, params.stop_ids(tokenizer.eos_token_ids), body.return_token_ids, grammar,
                   body.tools, body.tool_choice, returned=body.n, tokens_as_ids=body.return_tokens_as_token_ids)
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in body.prompts]
    return Job(prompts, params, params.stop_ids(tokenizer.eos_token_ids), body.return_token_ids, grammar,
               returned=body.n, echo=echo, tokens_as_ids=body.return_tokens_as_token_ids)


def _ids_in(ids: list[int] | None, vocab_size: int) -> tuple[int, ...] | None:
    """`allowed_token_ids`, each in the vocabulary."""
    if ids is not None and max(ids) >= vocab_size:
        raise ValueError(f"allowed_token_ids are token ids in [0, {vocab_size}), got {max(ids)}")
    return None if ids is None else tuple(ids)


def _logit_bias(biases: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON keys) as ids, each in the vocabulary."""
    out = {}
    for key, bias in (biases or {}).items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise ValueError(f"logit_bias keys are token ids in [0, {vocab_size}), got {key!r}")
        out[int(key)] = bias
    return out
