"""/v1/responses through `splitserve up` (prefill and decode worker processes) with the official
openai client: plain answers equal the chat completion of the same conversation, streams carry
the SDK's event types and add up to the whole answer, function tools (a forced call, then its
output sent back), json_schema output, and a clear 400 for what is not served."""

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(shared_up):
    return openai.OpenAI(base_url=shared_up().url, api_key="unused", max_retries=0, timeout=300)


def collect(stream) -> tuple[list[str], list, object]:
    """(event types, events, the final response) of a streamed response."""
    events = list(stream)
    return [e.type for e in events], events, events[-1].response


def test_plain_answer_equals_the_chat_completion_streamed_or_not(client):
    ask = dict(
        model=MODEL,
        input="Name three colors.",
        instructions="Answer briefly.",
        max_output_tokens=24,
        temperature=0,
        store=False,
    )
    whole = client.responses.create(**ask)
    chat = client.chat.completions.create(
        model=MODEL,
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}],
    )
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    types, events, final = collect(client.responses.create(**ask, stream=True))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_function_tool_call_and_its_output_sent_back(client):
    ask = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    )
    whole = client.responses.create(**ask)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    types, events, final = collect(client.responses.create(**ask, stream=True))
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert json.loads(done.arguments) == json.loads(calls[0].arguments)
    streamed = [item for item in final.output if item.type == "function_call"]
    assert streamed[0].arguments == done.arguments and final.status == "completed"
    # The agent runs the tool and sends the whole conversation back (nothing is stored).
    follow = client.responses.create(
        model=MODEL,
        temperature=0,
        max_output_tokens=20,
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"},
        ],
    )
    assert follow.status in ("completed", "incomplete") and follow.output


def test_json_schema_output_streamed_and_not(client):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    ask = dict(model=MODEL, input="Invent a person.", text=fmt, temperature=0, max_output_tokens=80)
    whole = client.responses.create(**ask)
    jsonschema.validate(json.loads(whole.output_text), PERSON)
    _, events, final = collect(client.responses.create(**ask, stream=True))
    assert final.output_text == whole.output_text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_what_is_not_served_gets_a_clear_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["message"]
