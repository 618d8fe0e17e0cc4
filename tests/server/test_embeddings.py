"""/v1/embeddings through the official openai client (and requests for the raw body): shape,
unit length, determinism, batched inputs equal single ones, token-id inputs, base64, pooling
choices, errors, /metrics. stories260K (dim 64) for speed, SmolLM2-135M (dim 576) as a real model.
"""
from __future__ import annotations

import base64
import math
import struct

import openai
import pytest

TEXTS = ["The cat sat on the mat.", "A dog ran in the park.", "Once upon a time there was a little girl.",
         "Quarterly revenue grew by five percent."]


@pytest.fixture(scope="module")
def srv(servers, stories_model):
    return servers.start(stories_model, "--parallel", "3", "--ctx", "256")


def embed(client, srv, inp, **kw):
    return client.embeddings.create(model=srv.model_id, input=inp, **kw)


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def close(a, b, tol=1e-5):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_shape_unit_length_and_determinism(client, srv):
    r = embed(client, srv, TEXTS[0])
    assert r.object == "list" and r.model == srv.model_id and len(r.data) == 1
    e = r.data[0]
    assert e.object == "embedding" and e.index == 0 and len(e.embedding) == 64
    assert abs(norm(e.embedding) - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(srv.tokenize(TEXTS[0], add_special=True))
    assert embed(client, srv, TEXTS[0]).data[0].embedding == e.embedding  # the same bits again


def test_batch_equals_single_inputs(client, srv):
    batch = embed(client, srv, TEXTS)
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    for text, d in zip(TEXTS, batch.data):
        assert close(d.embedding, embed(client, srv, text).data[0].embedding)
    assert not close(batch.data[0].embedding, batch.data[3].embedding, 1e-2)  # different texts, different vectors
    assert batch.usage.prompt_tokens == sum(len(srv.tokenize(t, add_special=True)) for t in TEXTS)
    many = embed(client, srv, [TEXTS[i % 4] for i in range(40)])  # more than the queue takes at once
    assert len(many.data) == 40 and close(many.data[39].embedding, batch.data[3].embedding)


def test_token_id_inputs(client, srv):
    ids = [srv.tokenize(t, add_special=True) for t in TEXTS[:2]]
    from_text = embed(client, srv, TEXTS[:2])
    assert close(embed(client, srv, ids[0]).data[0].embedding, from_text.data[0].embedding)
    both = embed(client, srv, ids)
    assert all(close(a.embedding, b.embedding) for a, b in zip(both.data, from_text.data))


def test_base64_is_the_float32_bytes(srv):
    floats = srv.post("/v1/embeddings", {"input": TEXTS[1]}).json()["data"][0]["embedding"]
    r = srv.post("/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64", "model": srv.model_id})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-7)


def test_openai_client_default_base64(client, srv):
    # The openai package asks for base64 when the caller names no format, and decodes it.
    got = client.embeddings.create(model=srv.model_id, input=TEXTS[2]).data[0].embedding
    plain = srv.post("/v1/embeddings", {"input": TEXTS[2]}).json()["data"][0]["embedding"]
    assert close(got, plain, 1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", 5]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [10 ** 6]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 32}, "dimensions"),
    ({}, "input"),
])
def test_bad_requests(srv, body, param):
    r = srv.post("/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_errors_through_the_client(client, srv):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, srv, "word " * 400)  # over the 256-token context
    assert e.value.code == "context_length_exceeded"
    assert embed(client, srv, "hi", dimensions=64).data[0].embedding


def test_metrics_count_embeddings(srv):
    before = srv.metrics().value("llmq_requests_total", endpoint="/v1/embeddings", status="200")
    assert srv.post("/v1/embeddings", {"input": ["a", "b"]}).status_code == 200
    after = srv.metrics().value("llmq_requests_total", endpoint="/v1/embeddings", status="200")
    assert after == before + 1


def test_pooling_flag(servers, stories_model, client, srv):
    mean_srv = servers.start(stories_model, "--pooling", "mean")
    last = embed(client, srv, TEXTS[0]).data[0].embedding
    with mean_srv.client() as c:
        mean = c.embeddings.create(model=mean_srv.model_id, input=TEXTS[0]).data[0].embedding
        one = c.embeddings.create(model=mean_srv.model_id, input=[1]).data[0].embedding
    assert abs(norm(mean) - 1) < 1e-5 and not close(mean, last, 1e-3)
    with srv.client() as c:  # one token: mean and last pool the same state
        assert close(one, c.embeddings.create(model=srv.model_id, input=[1]).data[0].embedding)


def test_smollm2_embeddings(servers, smol_model):
    s = servers.start(smol_model, "--parallel", "2")
    with s.client() as c:
        r = c.embeddings.create(model=s.model_id, input=TEXTS)
        assert len(r.data) == 4 and all(len(d.embedding) == 576 for d in r.data)
        assert all(abs(norm(d.embedding) - 1) < 1e-4 for d in r.data)
        again = c.embeddings.create(model=s.model_id, input=TEXTS[1])
        assert close(again.data[0].embedding, r.data[1].embedding, 1e-4)
