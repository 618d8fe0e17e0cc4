"""llmq-server under load: many concurrent streaming clients, queue overflow (429 with
Retry-After), clients that disconnect mid-stream (their sequences are cancelled), and the
aggregate throughput of continuous batching with the real chat model (SmolLM2-135M on CPU).

bench/server_load.py does the measuring; these tests assert on what it measures.
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import socket
import time

import openai
import pytest
import requests

import server_load

PROMPT = "Once upon a time"


class MetricsWatcher:
    """Polls /metrics in the background and keeps the largest running and queued counts."""

    def __init__(self, srv, interval: float = 0.01):
        self.srv, self.interval = srv, interval
        self.max_running = self.max_queued = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                m = self.srv.metrics()
                self.max_running = max(self.max_running, m.value("llmq_running_sequences"))
                self.max_queued = max(self.max_queued, m.value("llmq_queue_length"))
            except (requests.RequestException, AssertionError):
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class RawStream:
    """A streaming completion over a plain socket, so that the test decides when to hang up."""

    def __init__(self, srv, max_tokens: int, chat: bool = False, **extra):
        self.conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        body = {"max_tokens": max_tokens, "stream": True, "temperature": 0, **extra}
        if chat:
            body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
        else:
            body["prompt"] = PROMPT
        self.conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body),
                          headers={"Content-Type": "application/json", **srv.headers()})
        self.resp = None

    def response(self) -> http.client.HTTPResponse:
        if self.resp is None:
            self.resp = self.conn.getresponse()
        return self.resp

    def read_events(self, n: int) -> list[dict]:
        """Reads n data events (skipping the role-only chat chunk)."""
        out = []
        while len(out) < n:
            line = self.response().readline()
            assert line, "the stream ended early"
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                ev = json.loads(line[6:])
                ch = ev["choices"][0] if ev["choices"] else {}
                if ch.get("text") or (ch.get("delta") or {}).get("content"):
                    out.append(ev)
        return out

    def hang_up(self) -> None:
        try:
            self.conn.sock.shutdown(2)
        except OSError:
            pass
        self.conn.close()


@pytest.fixture(scope="module")
def srv(servers, stories_model):
    return servers.start(stories_model, "--parallel", "8", "--max-queue", "64")


def test_32_concurrent_streams(srv):
    """32 clients stream 64 tokens each at once; 8 run, the rest wait; all complete."""
    m0 = srv.wait_idle()
    n_prompt = len(srv.tokenize(server_load.DEFAULT_PROMPT, add_special=True))
    with MetricsWatcher(srv) as w:
        r = server_load.run_load(srv.url, clients=32, max_tokens=64, timeout=120)
    print(r.line())
    errors = [x.error for x in r.results if not x.ok]
    assert not errors, f"{len(errors)} of 32 clients failed: {errors[:5]}"
    assert r.requests == 32
    for x in r.results:
        assert x.status == 200 and x.text
        assert x.finish_reason in ("length", "stop")
        assert x.usage["prompt_tokens"] == n_prompt
        if x.finish_reason == "length":
            assert x.completion_tokens == 64, x.usage
    assert 1 < w.max_running <= 8, f"running sequences peaked at {w.max_running} (--parallel 8)"
    m = srv.wait_idle()
    assert m.value("llmq_kv_cache_blocks_used") == 0
    assert m.value("llmq_generated_tokens_total") - m0.value("llmq_generated_tokens_total") == r.tokens
    assert r.usage_tokens == r.tokens, "the streamed usage chunks disagree with the server's token counter"
    assert m.value("llmq_requests_total", endpoint="/v1/completions", status="200") - \
        m0.value("llmq_requests_total", endpoint="/v1/completions", status="200") == 32
    print(f"peak running {w.max_running:.0f}, peak queued {w.max_queued:.0f}")


def test_32_concurrent_chat_streams_through_openai(fresh_servers, stories_model):
    """The same with the official client's streaming chat, one client object per thread."""
    s = fresh_servers.start(stories_model, "--parallel", "8", "--max-queue", "64", "--chat-template", "chatml")
    results, lock, barrier = [], threading.Lock(), threading.Barrier(32)

    def one(i):
        barrier.wait()
        try:
            with s.client() as c:
                text, usage = "", None
                for ch in c.chat.completions.create(model=s.model_id, messages=[{"role": "user", "content": f"Story {i}"}],
                                                    max_tokens=32, stream=True, seed=i,
                                                    stream_options={"include_usage": True}):
                    if ch.usage:
                        usage = ch.usage
                    elif ch.choices:
                        text += ch.choices[0].delta.content or ""
                out = (text, usage.completion_tokens if usage else None)
        except Exception as e:  # noqa: BLE001
            out = e
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert len(results) == 32 and all(text and 0 < n <= 32 for text, n in results), results


# ---------------------------------------------------------------- 429

def test_queue_overflow_gives_429(fresh_servers, stories_model):
    """--parallel 1 --max-queue 1: with one request running and one waiting, every further
    request (fired concurrently, with large max_tokens) gets 429 with Retry-After."""
    s = fresh_servers.start(stories_model, "--parallel", "1", "--max-queue", "1", "--ctx", "4096",
                            "--chat-template", "chatml")
    a = RawStream(s, 4000)
    a.read_events(1)                       # a runs
    b = RawStream(s, 4000)                 # b waits
    deadline = time.monotonic() + 10
    while s.metrics().value("llmq_queue_length") < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.01)

    results, lock, barrier = [], threading.Lock(), threading.Barrier(8)

    def fire(i):
        barrier.wait()
        with s.client() as c:
            try:
                if i % 2:
                    c.chat.completions.create(model=s.model_id, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=4000)
                else:
                    c.completions.create(model=s.model_id, prompt=PROMPT, max_tokens=4000)
                out = "completed"
            except openai.RateLimitError as e:
                out = e
            except Exception as e:  # noqa: BLE001
                out = e
        with lock:
            results.append(out)

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8
    for e in results:
        assert isinstance(e, openai.RateLimitError), f"expected 429, got {e!r}"
        assert e.status_code == 429
        assert int(e.response.headers["retry-after"]) >= 1
        assert e.code == "rate_limit_exceeded"
    r = requests.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4000}, timeout=30)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"

    # Hanging up frees both places; the server serves again.
    a.hang_up()
    b.hang_up()
    s.wait_idle(timeout=5)
    with s.client() as c:
        assert c.completions.create(model=s.model_id, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_burst_overflow(fresh_servers, stories_model):
    """12 requests at once into --parallel 1 --max-queue 1: at most 2 accepted, the rest 429."""
    s = fresh_servers.start(stories_model, "--parallel", "1", "--max-queue", "1", "--ctx", "4096")
    out, lock, barrier, answered = [], threading.Lock(), threading.Barrier(12), threading.Barrier(12)

    def fire():
        barrier.wait()
        st = None
        try:
            st = RawStream(s, 4000)
            resp = st.response()
            res = (resp.status, resp.getheader("Retry-After"), resp.read() if resp.status != 200 else b"")
        except Exception as e:  # noqa: BLE001
            res = (None, None, repr(e).encode())
        with lock:
            out.append(res)
        try:
            answered.wait(30)  # the accepted ones hold their places until every request has its answer
        finally:
            if st is not None:
                st.hang_up()

    threads = [threading.Thread(target=fire) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    statuses = sorted(st for st, _, _ in out if st is not None)
    failures = [body for st, _, body in out if st is None]
    assert not failures, f"connections failed: {failures[:3]}"
    assert statuses.count(429) >= 10 and statuses.count(200) <= 2, statuses
    for st, retry, body in out:
        if st == 429:
            assert retry is not None and int(retry) >= 1
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    s.wait_idle(timeout=5)


# ---------------------------------------------------------------- disconnects

@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_disconnect_cancels(fresh_servers, stories_model, chat):
    """A client that hangs up mid-stream is cancelled: its sequence leaves at once (not after
    its 4000 tokens), and with --parallel 1 the next request runs right away."""
    s = fresh_servers.start(stories_model, "--parallel", "1", "--ctx", "4096", "--chat-template", "chatml")
    # How fast is this machine now? (200 tokens; the 4000-token request would take >= 20x as long.)
    t0 = time.monotonic()
    r = requests.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0}, timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 200
    full_estimate = (time.monotonic() - t0) * 4000 / 200

    a = RawStream(s, 4000, chat=chat)
    a.read_events(3)
    assert s.metrics().value("llmq_running_sequences") == 1
    t_close = time.monotonic()
    a.hang_up()
    s.wait_idle(timeout=max(2.0, full_estimate / 4))
    cancel_s = time.monotonic() - t_close
    m = s.metrics()
    assert m.value("llmq_kv_cache_blocks_used") == 0
    # The server keeps serving, and the single slot is free: the next request starts at once.
    t1 = time.monotonic()
    res = server_load.stream_completion(s.url, PROMPT, 8, temperature=0)
    assert res.ok and res.finish_reason == "length" and res.text, res.error
    print(f"cancelled {cancel_s * 1000:.0f} ms after the hang-up (the whole request: ~{full_estimate:.1f} s); "
          f"next request done in {time.monotonic() - t1:.2f} s")
    assert cancel_s < full_estimate / 4


def test_disconnect_while_queued(fresh_servers, stories_model):
    """A waiting request whose client hangs up gives its place in the queue back."""
    s = fresh_servers.start(stories_model, "--parallel", "1", "--max-queue", "1", "--ctx", "4096")
    a = RawStream(s, 4000)
    a.read_events(1)
    b = RawStream(s, 4000)
    assert b.response().status == 200
    deadline = time.monotonic() + 5
    while s.metrics().value("llmq_queue_length") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    b.hang_up()
    try:
        deadline = time.monotonic() + 3
        while s.metrics().value("llmq_queue_length") > 0:
            assert time.monotonic() < deadline, \
                "a request whose client left still holds its place in the queue (new requests get 429)"
            time.sleep(0.02)
        c = RawStream(s, 10)
        assert c.response().status == 200, "the queue place was not given back"
        c.hang_up()
    finally:
        a.hang_up()
    s.wait_idle(timeout=5)


def test_many_disconnects_keep_the_server_healthy(srv):
    """16 clients hang up after a few chunks while 8 others finish; nothing leaks."""
    m0 = srv.wait_idle()
    streams = [RawStream(srv, 400) for _ in range(16)]
    finished = []
    t = threading.Thread(target=lambda: finished.append(server_load.run_load(srv.url, 8, 32)))
    t.start()
    for st in streams:
        st.read_events(2)
        st.hang_up()
    t.join(120)
    assert finished and finished[0].errors == 0, [x.error for x in finished[0].results if not x.ok]
    m = srv.wait_idle(timeout=10)
    assert m.value("llmq_kv_cache_blocks_used") == 0
    assert m.value("llmq_kv_cache_blocks_total") == m0.value("llmq_kv_cache_blocks_total")
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------- throughput (SmolLM2, CPU)

def test_throughput_8_clients_vs_1(servers, smol_model):
    """Aggregate generated tokens/s with 8 concurrent clients vs 1 (continuous batching on CPU).
    The issue's target is 3x, checked by the benchmark (bench/server_load.py, numbers in
    bench/RESULTS.md), not here: a timed assertion would fail whenever other work shares the
    machine. This test checks that batching is at work at all (8 clients get more than 1.2x the
    tokens/s of 1) and prints the numbers. Two interleaved rounds, the best of each."""
    s = servers.start(smol_model, "--parallel", "8", "--ctx", "1024")
    prompt = server_load.DEFAULT_PROMPT
    server_load.stream_completion(s.url, prompt, 8)  # warm-up
    s.wait_idle()
    time.sleep(0.3)  # the warm-up's tokens are counted just after its [DONE]
    ones, eights = [], []
    for _ in range(2):
        ones.append(server_load.run_load(s.url, 1, max_tokens=64, prompt=prompt))
        eights.append(server_load.run_load(s.url, 8, max_tokens=64, prompt=prompt))
    one = max(ones, key=lambda r: r.tokens_per_s)
    eight = max(eights, key=lambda r: r.tokens_per_s)
    ratio = eight.tokens_per_s / one.tokens_per_s
    load = os.getloadavg()[0]
    print(f"\nSmolLM2-135M Q4_1, {server_load.cpu_name()}, {os.cpu_count()} CPUs, load average {load:.1f}\n"
          f"  {one.line()}\n  {eight.line()}\n  8 clients / 1 client: x{ratio:.2f} (target x3, floor here x1.2)")
    assert all(r.errors == 0 for r in ones + eights)
    assert all(r.tokens == r.requests * 64 or r.tokens > 0 for r in ones + eights)
    assert ratio >= 1.2, (f"8 clients give only x{ratio:.2f} the tokens/s of 1 (load average {load:.1f} on "
                          f"{os.cpu_count()} CPUs: other work on the machine skews this)")


def test_non_streaming_disconnect_cancels(fresh_servers, smol_model):
    """A non-streaming client that gives up is cancelled too: a request running past 2 s is sent
    chunked with white-space probes, so the server notices the closed connection and frees the
    sequence within seconds instead of after its 3000 tokens (SmolLM2 on a CPU: about a minute)."""
    s = fresh_servers.start(smol_model, "--parallel", "1", "--ctx", "4096")
    full_estimate = 3000 / 100.0  # tokens / a generous upper bound on this model's CPU decode rate
    t_close = time.monotonic()
    # The headers come after 2 s (the switch to a chunked body); then the client hangs up.
    host, port = s.url.split("//")[1].split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stop": ["\u0000"]}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200")
    assert s.metrics().value("llmq_running_sequences") == 1
    sock.close()
    s.wait_idle(timeout=full_estimate / 2)
    cancel_s = time.monotonic() - t_close
    assert s.metrics().value("llmq_kv_cache_blocks_used") == 0
    print(f"cancelled {cancel_s:.1f} s after the request started (the whole request: > {full_estimate:.0f} s)")
    assert cancel_s < full_estimate / 2
    # A non-streaming request longer than 2 s that runs to the end still returns valid JSON.
    r = requests.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 250, "temperature": 0,
                                                       "stop": ["\u0000"]}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 250
