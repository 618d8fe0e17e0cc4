"""llmq-server under the client libraries applications are built on (issue 21): instructor
extracting typed objects through json_schema, LiteLLM and LangChain's ChatOpenAI chatting,
calling tools and returning structured output, against Qwen2.5-Coder-0.5B-Instruct. Pinned in
requirements-clients.txt (a venv of its own: run.sh with LLMQ_SERVER_REQUIREMENTS)."""
from __future__ import annotations

import json
from typing import Literal

import instructor
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import CONTACT_TEXTS


class Contact(BaseModel):
    name: str
    email: str
    role: Literal["engineer", "manager", "designer", "sales", "other"]



WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def srv(servers, qwen_model):
    return servers.start(qwen_model, "--parallel", "2")


def test_instructor_extracts_typed_objects(srv):
    """instructor's JSON-schema mode sends response_format json_schema: at least 9 of 10 contacts
    come back, and each is schema-valid (the schema is enforced)."""
    client = instructor.from_openai(openai.OpenAI(base_url=srv.base_url, api_key="none"), mode=instructor.Mode.JSON_SCHEMA)
    got = 0
    for text in CONTACT_TEXTS:
        c = client.chat.completions.create(model=srv.model_id, response_model=Contact, max_retries=0, temperature=0,
                                           max_tokens=120, messages=[{"role": "user", "content": "Extract the contact: " + text}])
        assert isinstance(c, Contact)
        got += "@" in c.email and len(c.name.split()) >= 1
    assert got >= 9


def test_litellm_chat_and_tool_round_trip(srv):
    import litellm
    kw = dict(model="openai/" + srv.model_id, api_base=srv.base_url, api_key="none", temperature=0, max_tokens=60)
    r = litellm.completion(messages=[{"role": "user", "content": "Say hello in one word."}], **kw)
    assert r.choices[0].message.content
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = litellm.completion(messages=ask, tools=[WEATHER], tool_choice="required", **kw)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    follow = ask + [r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    final = litellm.completion(messages=follow, tools=[WEATHER], **kw)
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    founded: int = Field(ge=0, le=2100)  # bounded: a greedy small model may otherwise write digits forever


def test_langchain_chat_tools_and_structured_output(srv):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=srv.base_url, api_key="none", model=srv.model_id, temperature=0, max_tokens=200)
    assert llm.invoke("Say hello in one word.").content
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and "city" in msg.tool_calls[0]["args"]
    city = llm.with_structured_output(City, method="json_schema").invoke("Tell me about Tokyo.")
    assert isinstance(city, City) and city.name


def test_llama_index_chat_tools_embeddings_and_rag(srv):
    """LlamaIndex's OpenAI-compatible classes: chat, a tool call, embeddings, and a small
    retrieval-augmented query (VectorStoreIndex over llmq's /v1/embeddings, answered by llmq)."""
    from llama_index.core import Document, Settings, VectorStoreIndex
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=srv.model_id, api_base=srv.base_url, api_key="none", is_chat_model=True,
                     is_function_calling_model=True, temperature=0, max_tokens=80, context_window=4096)
    assert llm.chat([ChatMessage(role="user", content="Say hello in one word.")]).message.content

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    resp = llm.chat_with_tools([FunctionTool.from_defaults(fn=get_weather)], user_msg="What is the weather like in Paris today?",
                               tool_required=True)
    calls = llm.get_tool_calls_from_response(resp, error_on_no_tool_call=False)
    assert calls and calls[0].tool_name == "get_weather" and "city" in calls[0].tool_kwargs

    emb = OpenAILikeEmbedding(model_name=srv.model_id, api_base=srv.base_url, api_key="none", embed_batch_size=4)
    v = emb.get_text_embedding("hello")
    assert len(v) == 896 and abs(sum(x * x for x in v) - 1) < 1e-3
    assert emb.get_text_embedding_batch(["hello", "world"])[0] == pytest.approx(v, abs=1e-4)

    Settings.llm, Settings.embed_model = llm, emb
    docs = [Document(text=t) for t in ("The lighthouse on Skerry Island was built in 1871.",
                                       "Our cafeteria serves soup on Tuesdays.",
                                       "Python's list.sort is stable.")]
    engine = VectorStoreIndex.from_documents(docs).as_query_engine(similarity_top_k=2)
    answer = engine.query("When was the lighthouse on Skerry Island built?")
    assert len(answer.source_nodes) == 2 and str(answer).strip()
