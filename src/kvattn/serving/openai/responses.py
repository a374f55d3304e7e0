"""OpenAI's response bodies, whole or streamed as server-sent events, from the deltas the app produces.

A completion's choices, text or chat message, log-probabilities in OpenAI's
two shapes (chat's `content` list, completions' four legacy lists), usage,
and `token_ids` when asked for.
"""

from __future__ import annotations

import json

from fastapi.sse import format_sse_event

from kvattn.serving.openai.chat import ToolCalls
from kvattn.serving.openai.protocol import ApiError, Job
from kvattn.serving.requests import Token
from kvattn.serving.tokenizer import Tokenizer

__all__ = ["ClientGone", "event", "sse", "token_logprobs", "whole"]


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


def token_logprobs(tokenizer: Tokenizer, tokens: list[tuple[Token, str]], chat: bool, offsets: list[int],
                   job: Job) -> dict:
    """OpenAI's logprobs object: `{"content": [...]}` for chat, the legacy four lists for completions.

    `offsets` are where each token's text starts in the choice's text (its
    `text_offset`): the text sent before the token's own, so special tokens,
    which add their string to `tokens` but nothing to the text, never point
    past its end.
    """
    def name(token_id: int) -> str:
        return job.token_name(tokenizer, token_id)

    if chat:
        return {"content": [
            {"token": text, "logprob": token.logprob, "bytes": list(text.encode()),
             "top_logprobs": [{"token": (alt := name(i)), "logprob": lp,
                               "bytes": list(alt.encode())} for i, lp in token.top]}
            for token, text in tokens]}
    return {"tokens": [text for _, text in tokens], "token_logprobs": [token.logprob for token, _ in tokens],
            "top_logprobs": [{name(i): lp for i, lp in token.top}
                             for token, _ in tokens],
            "text_offset": offsets}


def _calls(deltas: list[dict]) -> list[dict]:
    """Streamed `tool_calls` deltas merged into whole calls (a call's later deltas add to its arguments)."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta["index"] in calls:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            calls[delta["index"]] = {key: value for key, value in delta.items() if key != "index"}
    return list(calls.values())


def _finish_reason(reason: str | None, calls: ToolCalls | None) -> str | None:
    """`"tool_calls"` for a choice that stopped after making calls."""
    return "tool_calls" if reason == "stop" and calls is not None and calls.calls else reason


async def whole(tokenizer: Tokenizer, events, first, head: dict, job: Job, chat: bool) -> dict:
    choices = [{"text": [], "length": 0, "ids": [], "tokens": [], "offsets": [], "finish_reason": None,
                "logprob": 0.0} for _ in range(job.rows)]
    item = first
    while not isinstance(item, dict):
        choice = choices[item.index]
        choice["offsets"] += [choice["length"]] * len(item.tokens)
        choice["length"] += len(item.text)
        choice["text"].append(item.text)
        choice["ids"] += item.ids
        choice["tokens"] += item.tokens
        choice["logprob"] += item.logprob
        choice["finish_reason"] = item.finish_reason or choice["finish_reason"]
        item = await anext(events)
    out = []
    for index, (row, choice) in enumerate(_returned(choices, job)):
        text = "".join(choice["text"])
        if job.echo is not None:
            prompt = job.echo[row // job.params.n]
            text, choice["offsets"] = prompt + text, [offset + len(prompt) for offset in choice["offsets"]]
        entry = {"index": index, "finish_reason": choice["finish_reason"],
                 "logprobs": (token_logprobs(tokenizer, choice["tokens"], chat, choice["offsets"], job)
                              if job.top_logprobs is not None else None)}
        if chat:
            calls = ToolCalls(job.tools, job.tool_choice)
            (content, deltas), (tail, more) = calls.push(text), calls.finish()
            message = {"role": "assistant", "content": content + tail}
            if calls.calls:
                message = {"role": "assistant", "content": message["content"] or None,
                           "tool_calls": _calls(deltas + more)}
            entry |= {"message": message, "finish_reason": _finish_reason(choice["finish_reason"], calls)}
        else:
            entry["text"] = text
        if job.token_ids:
            entry["token_ids"] = choice["ids"]
        out.append(entry)
    return {**head, "choices": out, "usage": item}


def _returned(choices: list[dict], job: Job) -> list[tuple[int, dict]]:
    """The choices returned, with their rows: of each prompt's `params.n` completions (`best_of`), the
    `job.returned` of highest total log-probability, in the order they were made."""
    made = job.params.n
    if made == job.returned:
        return list(enumerate(choices))
    kept = []
    for start in range(0, len(choices), made):
        best = sorted(range(start, start + made), key=lambda row: -choices[row]["logprob"])[: job.returned]
        kept += [(row, choices[row]) for row in sorted(best)]
    return kept


async def sse(tokenizer: Tokenizer, events, first, head: dict, job: Job, chat: bool, usage: bool):
    """The answer as server-sent events (never with `best_of` above `n`: the protocol refuses it)."""
    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    offsets = [0] * job.rows
    calls = [ToolCalls(job.tools, job.tool_choice) for _ in range(job.rows)] if chat else None
    for index in range(job.rows):
        opening = None
        if chat:
            opening = {"index": index, "delta": {"role": "assistant", "content": ""}}
        elif job.echo is not None:
            offsets[index] = len(prompt := job.echo[index // job.params.n])
            opening = {"index": index, "text": prompt}
        if opening is not None:
            yield event({**chunk_head, "choices": [{**opening, "logprobs": None, "finish_reason": None}]})
    item = first
    try:
        while not isinstance(item, dict):
            if item.text or item.ids or item.finish_reason:
                logprobs = (token_logprobs(tokenizer, item.tokens, chat, [offsets[item.index]] * len(item.tokens), job)
                            if job.top_logprobs is not None and item.tokens else None)
                offsets[item.index] += len(item.text)
                entry = {"index": item.index, "logprobs": logprobs, "finish_reason": item.finish_reason}
                if chat:
                    split = calls[item.index]
                    content, deltas = split.push(item.text)
                    if item.finish_reason is not None:
                        tail, more = split.finish()
                        content, deltas = content + tail, deltas + more
                        entry["finish_reason"] = _finish_reason(item.finish_reason, split)
                    entry["delta"] = {"content": content} if content else {}
                    if deltas:
                        entry["delta"]["tool_calls"] = deltas
                else:
                    entry["text"] = item.text
                if job.token_ids:
                    entry["token_ids"] = item.ids
                yield event({**chunk_head, "choices": [entry]})
            item = await anext(events)
    except ApiError as error:
        yield event(error.body())
        yield format_sse_event(data_str="[DONE]")
        return
    except ClientGone:
        return
    finally:
        await events.aclose()  # aborts what is left, whether the stream ended or was cancelled
    if usage:
        yield event({**chunk_head, "choices": [], "usage": item})
    yield format_sse_event(data_str="[DONE]")


def event(data: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(data, separators=(",", ":")))
