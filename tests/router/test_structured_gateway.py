"""Structured outputs through `splitserve up` (prefill and decode worker processes, P/D) with
the official openai client: JSON schemas, regex, choice, logit_bias and the 400s for bad input.

The 22 schemas run concurrently (one batch in the decode worker), cycling through
greedy/sampled x streamed/not x chat/completions, so every combination is covered."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
ASK = "Reply with a JSON value."


@pytest.fixture(scope="module")
def client(shared_up):
    return openai.OpenAI(base_url=shared_up().url, api_key="unused", max_retries=0, timeout=300)


def ask(client, *, chat, stream, max_tokens=120, **kw):
    """(text, finish_reason) for one request on either endpoint, streamed or not."""
    if chat:
        call = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": kw.pop("prompt", ASK)}]
    else:
        call = client.completions.create
        kw.setdefault("prompt", ASK + "\n")
    response = call(model=MODEL, max_tokens=max_tokens, stream=stream, **kw)
    if not stream:
        choice = response.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason
    text, finish = "", None
    for chunk in response:
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish


def test_json_schemas_validate_greedy_sampled_streamed_both_endpoints(client):
    def one(i):
        schema = SCHEMAS[i]
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}
        chat, stream = i % 4 < 2, i % 8 < 4
        extra = (
            {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
            if chat and i % 3
            else {"extra_body": {"structured_outputs": {"json": schema}}}
        )
        return ask(client, chat=chat, stream=stream, **sampling, **extra)

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(one, range(len(SCHEMAS))))
    for schema, (text, finish) in zip(SCHEMAS, results):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice_hold(client):
    text, finish = ask(
        client,
        chat=True,
        stream=False,
        temperature=0,
        max_tokens=200,
        prompt='Repeat exactly: {"ok": true}',
        response_format={"type": "json_object"},
    )
    assert finish == "stop" and isinstance(json.loads(text), dict)
    for chat, stream in ((True, True), (False, False)):
        text, finish = ask(
            client,
            chat=chat,
            stream=stream,
            temperature=1.0,
            seed=3,
            extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}},
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) and finish == "stop", text
        text, finish = ask(
            client,
            chat=chat,
            stream=stream,
            temperature=0,
            extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
        )
        assert text in ("alpha", "beta", "gamma") and finish == "stop", text


def test_logit_bias_minus_100_on_the_greedy_token_changes_the_answer(client, tokenizer):
    for chat in (False, True):
        base, _ = ask(client, chat=chat, stream=False, prompt="The capital of France is", temperature=0, max_tokens=1)
        [token_id] = tokenizer.encode(base, add_special_tokens=False)
        biased, _ = ask(
            client,
            chat=chat,
            stream=False,
            prompt="The capital of France is",
            temperature=0,
            max_tokens=1,
            logit_bias={str(token_id): -100},
        )
        assert biased != base, (chat, base)


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
            "response_format",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "([a-"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json"),
        ({"logit_bias": {"999999": -100}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
    ],
    ids=["unknown-type", "bad-schema", "bad-regex", "malformed-json", "id-outside-vocab", "bias-out-of-range"],
)
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=5, **kw)
    assert info.value.body["param"] == param, info.value.body
    text, finish = ask(client, chat=True, stream=False, temperature=0, max_tokens=4)
    assert finish == "length" and text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_tool_calls(stream):
    """Reassemble OpenAI-style tool-call deltas (name first, arguments in pieces, by index)."""
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["name"] is None, "the name comes once, first"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_forced_tool_calls_validate_and_stream_the_same(client, tool_choice):
    kw = dict(
        model=MODEL,
        messages=TOOL_ASK,
        tools=[WEATHER, CLOCK],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    message = client.chat.completions.create(**kw)
    choice = message.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    calls, finish = streamed_tool_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_tool_choice_errors_and_none(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=TOOL_ASK,
            tools=[WEATHER],
            max_tokens=5,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert info.value.body["param"] == "tool_choice" and "not in tools" in info.value.body["message"]
    plain = client.chat.completions.create(
        model=MODEL, messages=TOOL_ASK, tools=[WEATHER], tool_choice="none", max_tokens=5, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
