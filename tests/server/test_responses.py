"""OpenAI's Responses API (issue 21, item 4): POST /v1/responses through the official client's
`client.responses`, served by the chat machinery (server/responses.h): text, instructions,
structured output (text.format), function calls and their results as input items, and the
streaming events; Qwen2.5-Coder-0.5B-Instruct (its template renders tools)."""
from __future__ import annotations

import json

import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def srv(servers, qwen_model):
    return servers.start(qwen_model, "--parallel", "2")


def test_text_response(client, srv):
    r = client.responses.create(model=srv.model_id, input="Say hello in one word.", instructions="Be brief.",
                                temperature=0, max_output_tokens=20)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief."
    # The same as a chat completion of the same messages.
    chat = client.chat.completions.create(model=srv.model_id, temperature=0, max_tokens=20, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello in one word."}])
    assert r.output_text == chat.choices[0].message.content


def test_max_output_tokens_is_incomplete(client, srv):
    r = client.responses.create(model=srv.model_id, input="Write a long poem about the sea.", temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_structured_output(client, srv):
    fmt = {"type": "json_schema", "name": "city", "strict": True, "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["name", "country"], "additionalProperties": False}}
    r = client.responses.create(model=srv.model_id, input="Tell me about Paris.", temperature=0, max_output_tokens=60,
                                text={"format": fmt})
    assert set(json.loads(r.output_text)) == {"name", "country"}


def test_function_call_round_trip(client, srv):
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.responses.create(model=srv.model_id, input=ask, tools=[WEATHER], tool_choice="required", temperature=0,
                                max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
                    {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"sky": "sunny", "celsius": 21})}]
    final = client.responses.create(model=srv.model_id, input=follow, tools=[WEATHER], temperature=0, max_output_tokens=60)
    assert final.output_text or any(o.type == "function_call" for o in final.output)
    assert final.usage.input_tokens > r.usage.input_tokens  # the call and its result reached the prompt


def test_streaming_events(client, srv):
    types, deltas, done = [], "", None
    for ev in client.responses.create(model=srv.model_id, input="Count from one to five.", temperature=0,
                                      max_output_tokens=30, stream=True):
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            done = ev.response
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in types and "response.output_text.done" in types
    assert done.output_text == deltas and deltas
    whole = client.responses.create(model=srv.model_id, input="Count from one to five.", temperature=0, max_output_tokens=30)
    assert whole.output_text == deltas


def test_streamed_function_call(client, srv):
    items = []
    for ev in client.responses.create(model=srv.model_id, input="What is the weather in Rome?", tools=[WEATHER],
                                      tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                      max_output_tokens=60, stream=True):
        if ev.type == "response.output_item.done":
            items.append(ev.item)
    calls = [i for i in items if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"


def test_bad_requests_are_400(srv):
    for body, param in [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({}, "input"), ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools")]:
        r = srv.post("/v1/responses", dict(body, model=srv.model_id))
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param, r.json()
