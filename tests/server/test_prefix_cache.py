"""Automatic prefix caching (issue 21, item 5): requests that share a long system prompt reuse
its KV blocks (KVCache::attach_prefix). The second request reports usage.prompt_tokens_details.
cached_tokens > 0 and reaches its first token at least 5 times sooner; greedy answers are the same
with the cache on and off; /metrics counts the hits. SmolLM2-135M-Instruct."""
from __future__ import annotations

import time

import pytest

SYSTEM = " ".join(f"Rule {i}: answer politely, briefly and truthfully about topic number {i}." for i in range(120))
QUESTIONS = ["What is the capital of France?", "Name a color.", "What is the capital of France?"]


def first_token_seconds(srv, messages):
    t0 = time.time()
    r = srv.post("/v1/chat/completions", {"model": srv.model_id, "messages": messages, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.time() - t0, r.json()


def answers(srv):
    out = []
    for q in QUESTIONS:
        r = srv.post("/v1/chat/completions", {"model": srv.model_id, "max_tokens": 12, "temperature": 0,
                                              "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
        out.append((r.json()["choices"][0]["message"]["content"], r.json()["usage"]))
    return out


def test_second_request_reuses_the_system_prompt(servers, smol_model):
    srv = servers.start(smol_model, "--parallel", "2", "--ctx", "4096")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    cold, first = first_token_seconds(srv, msgs)
    assert first["usage"]["prompt_tokens"] >= 1500
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    msgs[1]["content"] = "Good morning!"
    warm, second = first_token_seconds(srv, msgs)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 32  # all but the last (partial) blocks and the question
    print(f"prompt {second['usage']['prompt_tokens']} tokens, {cached} cached: first token {cold:.3f} s cold, {warm:.3f} s warm")
    assert cold >= 5 * warm
    assert srv.metrics().value("llmq_prefix_cache_hit_tokens_total") == cached


def test_answers_are_the_same_with_the_cache_off(servers, smol_model):
    on = answers(servers.start(smol_model, "--parallel", "2"))
    off = answers(servers.start(smol_model, "--parallel", "2", "--no-prefix-cache"))
    assert [a for a, _ in on] == [a for a, _ in off]
    assert on[1][1]["prompt_tokens_details"]["cached_tokens"] > 0 and on[2][1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for _, u in off)


def test_n_samples_share_one_prefill(servers, smol_model):
    """n > 1: the samples after the first wait for its prefill and start from its cached blocks."""
    srv = servers.start(smol_model, "--parallel", "4")
    r = srv.post("/v1/chat/completions", {"model": srv.model_id, "n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 1,
                                          "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 3
    prompt = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] > 3
    # Both later samples took all whole blocks but the one holding the prompt's last token.
    assert srv.metrics().value("llmq_prefix_cache_hit_tokens_total") >= 2 * (prompt - 16)
