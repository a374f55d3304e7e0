"""kvattn.serving.openai.chat: messages with tool calls, the constraint each tool_choice asks for, and calls parsed
from text however it is cut into pieces (tests/serving/test_http.py runs them through the server)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvattn.serving.openai.chat import Message, NamedTool, Tool, ToolCalls, tool_constraint

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
NAMED = NamedTool.model_validate({"type": "function", "function": {"name": "get_weather"}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _run(calls: ToolCalls, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    content, deltas = "", []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        shown, made = calls.push(text[start:end])
        content, deltas = content + shown, deltas + made
    shown, made = calls.finish()
    return content + shown, deltas + made


@pytest.mark.parametrize("cuts", [[], [3], [9, 10, 11], list(range(1, 80))])
def test_auto_calls_are_found_however_the_text_is_cut(cuts):
    calls = ToolCalls([WEATHER], "auto")
    content, deltas = _run(calls, "Sure. " + CALL, cuts)
    assert content == "Sure. " and calls.calls == 1
    [delta] = deltas
    assert delta["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize("text", [
    "no calls <tool", "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "other", "arguments": {}}</tool_call>',
    CALL + " and text after", CALL[:-3],
])
def test_text_that_is_not_calls_stays_content(text):
    calls = ToolCalls([WEATHER], "auto")
    content, deltas = _run(calls, text, [5])
    assert content == text and deltas == [] and calls.calls == 0


def test_a_named_call_streams_its_arguments_and_required_calls_come_whole():
    calls = ToolCalls([WEATHER], NAMED)
    content, deltas = _run(calls, '{"city": "Oslo"}', [4, 9])
    assert content == "" and deltas[0]["function"]["name"] == "get_weather" and len(deltas) == 3
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    required = ToolCalls([WEATHER], "required")
    _, deltas = _run(required, '[{"name": "get_weather", "parameters": {"city": "A"}}, '
                               '{"name": "get_weather", "parameters": {"city": "B"}}]', [7])
    assert [json.loads(d["function"]["arguments"])["city"] for d in deltas] == ["A", "B"]
    assert [d["index"] for d in deltas] == [0, 1] and required.calls == 2


def test_each_tool_choice_asks_for_its_constraint():
    assert tool_constraint([WEATHER], "auto", True) is None and tool_constraint([WEATHER], "none", True) is None
    assert json.loads(tool_constraint([WEATHER], NAMED, True).json) == WEATHER.function.parameters
    one = json.loads(tool_constraint([WEATHER], "required", False).json)
    assert one["minItems"] == 1 and one["maxItems"] == 1
    with pytest.raises(ValueError, match="not among the tools"):
        tool_constraint([WEATHER], NamedTool.model_validate({"type": "function", "function": {"name": "x"}}), True)
    with pytest.raises(ValueError, match="has no tools"):
        tool_constraint(None, "required", True)


def test_messages_with_tool_calls_and_results():
    sent = Message.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]})
    assert sent.for_template()["tool_calls"][0]["function"]["arguments"] == {"city": "X"}  # as templates take them
    assert Message.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "3"}).for_template() == \
        {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    for bad in ({"role": "user"}, {"role": "tool", "content": "3"},
                {"role": "user", "content": "x", "tool_calls": sent.model_dump()["tool_calls"]}):
        with pytest.raises(ValidationError):
            Message.model_validate(bad)
    broken = Message.model_validate({"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{oops"}}]})
    with pytest.raises(ValueError, match="arguments are JSON text"):
        broken.for_template()
