"""Structured outputs (issue 21, item 2): `response_format` json_object and json_schema (strict) and
llama.cpp's `grammar` (GBNF), enforced by constrained decoding (server/structured.h, xgrammar).
Every reply must parse and satisfy its schema, sampled at temperature 1 as well as greedy; the
openai client's own `chat.completions.parse` (pydantic models, what instructor-style extraction
does) extracts all 8 objects; bad schemas and grammars are 400s naming the field."""
from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from conftest import CONTACT_TEXTS

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string"}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "total", "status"],
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 4,
                                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                            "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}}}},
                        "total": {"type": "number"}, "status": {"enum": ["open", "paid", "shipped"]}}}


def check(value, schema):
    """A small validator for the schemas above (types, required, no extras, enum, bounds)."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    t = schema["type"]
    if t == "object":
        assert isinstance(value, dict)
        assert set(schema.get("required", [])) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"])
        for k, v in value.items():
            check(v, schema["properties"][k])
    elif t == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
        for v in value:
            check(v, schema["items"])
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", -10**18) <= value <= schema.get("maximum", 10**18)
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)


@pytest.fixture(scope="module")
def srv(servers, smol_model):
    return servers.start(smol_model, "--parallel", "4")


def schema_format(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature,seed", [(0, 0), (1.0, 1), (1.0, 2), (1.0, 3)])
@pytest.mark.parametrize("name,schema,ask", [
    ("person", PERSON, "Invent a person: their name, age and home city."),
    ("order", ORDER, "Write an order of two products with a total and a status."),
])
def test_json_schema_replies_parse_and_validate(client, srv, name, schema, ask, temperature, seed):
    r = client.chat.completions.create(model=srv.model_id, messages=[{"role": "user", "content": ask}],
                                       response_format=schema_format(name, schema), temperature=temperature,
                                       seed=seed, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    check(value, schema)
    if name == "person":  # keys come in the schema's order
        assert list(value) == ["name", "age", "city"]


def test_streamed_json_schema_reply_parses(client, srv):
    stream = client.chat.completions.create(model=srv.model_id, stream=True, max_tokens=200, temperature=1.0, seed=5,
                                            messages=[{"role": "user", "content": "Describe a person."}],
                                            response_format=schema_format("person", PERSON))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check(json.loads(text), PERSON)


def test_json_object_is_an_object(client, srv):
    for seed in range(3):
        r = client.completions.create(model=srv.model_id, prompt="A list of colors:", max_tokens=120, temperature=1.0,
                                      seed=seed, extra_body={"response_format": {"type": "json_object"}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].text), dict)
        else:  # cut by max_tokens: still the start of an object
            assert r.choices[0].text.lstrip().startswith("{")


def test_gbnf_grammar(client, srv):
    grammar = r'root ::= ("yes" | "no") ", because " [a-z ]+ "."'
    for seed in range(4):
        r = client.chat.completions.create(model=srv.model_id, max_tokens=40, temperature=1.0, seed=seed,
                                           messages=[{"role": "user", "content": "Is the sky blue?"}],
                                           extra_body={"grammar": grammar})
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            assert re.fullmatch(r"(yes|no), because [a-z ]+\.", text), text
        else:
            assert re.fullmatch(r"(yes|no), because [a-z ]*", text), text


class Contact(BaseModel):
    name: str
    email: str
    role: Literal["engineer", "manager", "designer", "other"]


def test_openai_parse_extracts_every_object(client, srv):
    """client.chat.completions.parse sends a strict json_schema from the pydantic model and parses
    the reply: what extraction libraries (instructor's JSON-schema mode, LangChain's
    with_structured_output) rely on. 8 of 8 must come back as objects."""
    texts = CONTACT_TEXTS[:8]
    got = 0
    for t in texts:
        r = client.chat.completions.parse(model=srv.model_id, temperature=0, max_tokens=120, response_format=Contact,
                                          messages=[{"role": "system", "content": "Extract the contact as JSON."},
                                                    {"role": "user", "content": t}])
        if isinstance(r.choices[0].message.parsed, Contact):
            got += 1
    assert got == len(texts)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format", "Unsupported type"),
    ({"grammar": "root ::= undefined_rule"}, "grammar", "not defined"),
    # an empty language (found by fuzz/structured_output): it compiles, and no token can start it
    ({"grammar": "root ::= item\nitem ::= root \")\""}, "grammar", "matches no output"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "response_format", "either"),
])
def test_bad_formats_are_400(srv, body, param, words):
    r = srv.post("/v1/chat/completions", dict(body, messages=[{"role": "user", "content": "x"}], max_tokens=4))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_without_a_grammar_cache(fresh_servers, smol_model):
    """--grammar-cache-mib 0 (issue 22: the compiled-grammar cache is bounded by a flag): every
    request compiles its own grammar, and constrained replies are the same as with the cache."""
    s = fresh_servers.start(smol_model, "--parallel", "2", "--grammar-cache-mib", "0")
    body = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 12, "temperature": 0,
            "grammar": r'root ::= ("yes" | "no") ", because " [a-z ]+ "."'}
    texts = []
    for _ in range(2):
        r = s.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and re.match(r"(yes|no), because ", texts[0]), texts
