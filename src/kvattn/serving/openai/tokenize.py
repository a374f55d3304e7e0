"""`POST /tokenize` and `POST /detokenize`, as vLLM shapes them: text (or a conversation) to ids and back."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from kvattn.serving.openai.chat import Message, chat_ids
from kvattn.serving.openai.protocol import ApiError, TokenId, served_model
from kvattn.serving.tokenizer import Tokenizer, TooLong

__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenized", "tokenized"]


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's shape): a prompt, or messages rendered with the chat template, to token ids."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = None
    """Default: true for a prompt, false for messages (the template writes them)."""
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages, not both")
        return self


class DetokenizeRequest(BaseModel):
    """`POST /detokenize` (vLLM's shape): token ids to text."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


MAX_TOKENIZE_TOKENS = 1 << 16


def tokenized(body: TokenizeRequest, tokenizer: Tokenizer, *, model_name: str, max_len: int) -> bytes:
    """`/tokenize`'s JSON answer (`count`, `max_model_len`, `tokens`, `token_strs`), serialised here, off the loop."""
    served_model(body.model, model_name)
    try:
        if body.messages is not None:
            ids = chat_ids(tokenizer, body.messages, at_most=MAX_TOKENIZE_TOKENS,
                           add_generation_prompt=body.add_generation_prompt,
                           add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False,
                                   at_most=MAX_TOKENIZE_TOKENS)
    except TooLong as error:
        raise ApiError(400, f"the text holds {error.count} tokens; /tokenize answers at most {error.at_most}",
                       param="prompt") from None
    except (ValueError, TypeError) as error:
        raise ApiError(400, str(error)) from None
    strings = [tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
    return json.dumps({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strings}).encode()


def detokenized(body: DetokenizeRequest, tokenizer: Tokenizer, *, model_name: str) -> dict:
    """`/detokenize`'s answer: `{"prompt": text}`; a 400 for an id past the vocabulary."""
    served_model(body.model, model_name)
    past = [i for i in body.tokens if i >= tokenizer.vocab_size]
    if past:
        raise ApiError(400, f"token ids {past[:8]} are past the vocabulary of {tokenizer.vocab_size}", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
