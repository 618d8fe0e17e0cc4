"""Tool calling through /v1/chat/completions with the openai client (issue 21, first part):
`tools` rendered by the model's own chat template (Qwen2.5-Coder's, a Jinja template with a tools
section), the reply parsed for Hermes <tool_call> blocks (or the bare call object), returned as
`tool_calls` with finish_reason "tool_calls", streamed as OpenAI's deltas; tool results sent back
with role "tool"; tool_choice "none" leaves the reply as text; "required" and a named function force
one call by constrained decoding (server/structured.h), even where the model would answer in text."""
from __future__ import annotations

import json

import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def srv(servers, qwen_model):
    return servers.start(qwen_model, "--parallel", "2")


def test_tool_call_is_returned_as_tool_calls(client, srv):
    r = client.chat.completions.create(model=srv.model_id, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_call_matches(client, srv):
    stream = client.chat.completions.create(model=srv.model_id, messages=ASK, tools=[WEATHER], temperature=0,
                                            max_tokens=80, stream=True)
    calls, finish, content = [], None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        calls += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_result_turn_is_accepted(client, srv):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature_c\": 21, \"sky\": \"sunny\"}"},
    ]
    r = client.chat.completions.create(model=srv.model_id, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The tool result reached the prompt inside the template's <tool_response> block.
    assert r.usage.prompt_tokens > 200


def test_tool_choice_none_keeps_text(client, srv):
    r = client.chat.completions.create(model=srv.model_id, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content


TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
CHAT = [{"role": "user", "content": "Tell me a short joke about cats."}]  # no reason to call anything


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_forces_a_call(client, srv, stream):
    kw = dict(model=srv.model_id, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80)
    for seed in range(3):
        calls, finish = [], None
        if stream:
            for chunk in client.chat.completions.create(**kw, stream=True, temperature=1.0, seed=seed):
                if chunk.choices:
                    calls += chunk.choices[0].delta.tool_calls or []
                    finish = chunk.choices[0].finish_reason or finish
        else:
            r = client.chat.completions.create(**kw, temperature=1.0, seed=seed)
            calls, finish = r.choices[0].message.tool_calls or [], r.choices[0].finish_reason
        assert finish == "tool_calls"
        (call,) = calls
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_time":
            assert args["zone"] in ("UTC", "CET", "PST") and set(args) == {"zone"}
        else:
            assert isinstance(args["city"], str)


def test_named_tool_choice_calls_that_function(client, srv):
    r = client.chat.completions.create(model=srv.model_id, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET", "PST")


def test_bad_tool_choice_is_400(srv):
    for choice, words in [({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
                          ("sometimes", "tool_choice must be"), ({"type": "function"}, "tool_choice must be")]:
        r = srv.post("/v1/chat/completions", {"model": srv.model_id, "messages": ASK, "tools": [WEATHER], "tool_choice": choice})
        assert r.status_code == 400, choice
        assert r.json()["error"]["param"] == "tool_choice" and words in r.json()["error"]["message"]
    r = srv.post("/v1/chat/completions", {"model": srv.model_id, "messages": ASK, "tool_choice": "required"})
    assert r.status_code == 400 and "'tools' is empty" in r.json()["error"]["message"]


def test_malformed_tools_are_400(srv):
    for tools in ([{"type": "function"}], [{"type": "retrieval", "function": {"name": "x"}}], "x",
                  [{"type": "function", "function": {"name": "x", "parameters": "no"}}]):
        r = srv.post("/v1/chat/completions", {"model": srv.model_id, "messages": ASK, "tools": tools})
        assert r.status_code == 400, tools
        assert r.json()["error"]["param"] == "tools"
    r = srv.post("/v1/chat/completions", {"model": srv.model_id, "messages": ASK + [{"role": "assistant", "tool_calls": 3}]})
    assert r.status_code == 400


def test_builtin_template_refuses_tools(servers, stories_model):
    s = servers.start(stories_model, "--chat-template", "chatml")
    r = s.post("/v1/chat/completions", {"model": s.model_id, "messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400
    assert "cannot render tools" in r.json()["error"]["message"]


def test_suffix_fills_in_the_middle(client, srv):
    """/v1/completions with `suffix` on a code model: the prompt is prefix-suffix-middle with the
    model's own FIM tokens (server/infill.h), so it counts the two texts' tokens plus three."""
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n"
    r = client.completions.create(model=srv.model_id, prompt=prefix, suffix=suffix, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == len(srv.tokenize(prefix)) + len(srv.tokenize(suffix)) + 3
    assert r.choices[0].finish_reason in ("stop", "length")
    plain = client.completions.create(model=srv.model_id, prompt=prefix, max_tokens=16, temperature=0)
    assert plain.usage.prompt_tokens == len(srv.tokenize(prefix))
