"""Tool-call parsing and planning (router/api/tools.py) on scripted model outputs, no servers."""

import json

import pytest

from splitserve.router.api.schemas import ChatCompletionRequest
from splitserve.router.api.tools import (
    openai_tool_calls,
    parse_calls,
    plan_tools,
    render_messages,
    stream_deltas,
)
from splitserve.router.errors import APIError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def request(**kw):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME], **kw)


@pytest.mark.parametrize(
    "parser, text",
    [
        (
            "hermes",
            'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        ),
        ("json", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'),
    ],
)
def test_auto_parsers_read_scripted_outputs(parser, text):
    plan, forced = plan_tools(request(), parser)
    assert forced is None and not plan.forced
    content, calls = parse_calls(plan, text)
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]
    assert content == ("Let me check." if parser == "hermes" else None)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice.",
        "<tool_call>{broken</tool_call>",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
    ],
)
def test_auto_without_a_valid_call_is_plain_content(text):
    plan, _ = plan_tools(request(), "hermes")
    assert parse_calls(plan, text) == (text, [])


def test_forced_plans_and_errors():
    _, forced = plan_tools(request(tool_choice={"type": "function", "function": {"name": "get_time"}}), "hermes")
    schema = json.loads(forced.value)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "get_time"}
    _, forced = plan_tools(request(tool_choice="required"), "hermes")
    assert "maxItems" not in json.loads(forced.value)
    _, forced = plan_tools(request(tool_choice="required", parallel_tool_calls=False), "hermes")
    assert json.loads(forced.value)["maxItems"] == 1
    assert plan_tools(request(tool_choice="none"), "hermes") == (None, None)
    with pytest.raises(APIError, match="not in tools") as info:
        plan_tools(request(tool_choice={"type": "function", "function": {"name": "nope"}}), "hermes")
    assert info.value.param == "tool_choice"
    with pytest.raises(APIError, match="tools\\[0\\]"):
        plan_tools(
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[{"x": 1}]), "hermes"
        )


def test_default_block_and_stream_deltas_reassemble():
    messages, kwargs = render_messages([{"role": "user", "content": "hi"}], [WEATHER], "no tool support here")
    assert kwargs == {} and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert render_messages([{"role": "user", "content": "hi"}], [WEATHER], "{{ tools }}")[1] == {"tools": [WEATHER]}
    calls = openai_tool_calls([{"name": "get_weather", "arguments": '{"city": "A very long city name"}'}])
    deltas = stream_deltas(calls)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == calls[0]["function"]["arguments"]
    assert len(deltas) > 2 and calls[0]["id"].startswith("call_")
