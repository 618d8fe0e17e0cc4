#!/usr/bin/env python3
"""Soak test for llmq-server (issue 8): minutes of mixed traffic from many concurrent clients,
then a verdict on crashes, server errors, hangs and memory growth. Not part of CI.

Traffic, drawn at random (fixed --seed) by every client thread:
  valid     /v1/completions and /v1/chat/completions, streaming and not, with varied max_tokens,
            temperature, top_p/top_k, stop strings, logprobs, seeds, token-id prompts; each answer
            is checked (JSON shape, finish_reason, usage, [DONE], stop strings absent)
  invalid   malformed JSON, wrong types, absurd values, unknown routes and methods, oversized
            bodies, bad UTF-8, deep nesting, bodies cut short, half-sent headers: each must get
            its 4xx (or, for an oversized body, 413 or a closed connection)
  cancel    the client hangs up mid-stream, or mid-way through a non-streaming request
  misc      /health, /metrics, /v1/models, /tokenize, /detokenize, keep-alive request series
  overload  every --overload-every seconds a burst of long requests larger than
            --parallel + --max-queue: some must get 429 (with Retry-After)

It reports requests served, outcomes by kind (HTTP status or client-side exception type),
p50/p99 latency per kind, and the server's RSS (VmRSS in /proc/PID/status), threads and open
file descriptors at start, after warm-up and at the end (both measured with the server idle:
traffic pauses for a moment), and asserts:
  - the server process is alive and /health answers 200 at the end (no crash, no hang);
  - no 5xx answer at all (overload is answered 429 by design; 503 only while loading);
  - every request got the status its kind expects (429 is allowed for any generating request);
  - no valid request failed client-side (reset, timeout, malformed answer);
  - the server is idle at the end: no running or queued sequence, every KV block free;
  - RSS growth from warm-up to the end < --max-rss-growth (default 5%);
  - when the script started the server: SIGTERM stops it with exit code 0.

Only the Python standard library is used. Against a running server (its PID for RSS):
    python3 scripts/soak.py --url http://127.0.0.1:8080 --pid PID --parallel 8 --max-queue 16 --minutes 2

Or let it start the server (stopped with SIGTERM at the end; see also scripts/soak.sh, which
converts stories260K first):
    python3 scripts/soak.py --server build/llmq-server --model stories.llmq --minutes 30 \
        --server-args="-t 1 --parallel 8 --max-queue 16 --ctx 2048 --chat-template chatml"

Exit code 0 when every assertion holds, 1 otherwise; --json writes the full summary.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter, defaultdict
from dataclasses import dataclass, field

PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park. They saw",
    "The little dog was sad because",
    "One day, a big bear",
    "Mom said: \"",
    "Ünïcödé prompt: 日本語, emoji 🐻 and a tab\tthere",
]
GENERATING = ("completion", "completion_stream", "chat", "chat_stream", "cancel_stream", "cancel_nonstream",
              "overload")
CRASH_MARKERS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error:",
                 "terminate called", "Segmentation fault", "Aborted", "core dumped")


# ---------------------------------------------------------------- results

@dataclass
class Outcome:
    """What one client-side operation saw."""
    kind: str                    # traffic kind (completion, invalid, cancel_stream, ...)
    sub: str = ""                # the invalid-request case, or a detail of the kind
    status: int | None = None    # HTTP status, None when no status line arrived
    exc: str = ""                # client-side exception type, "" when none
    seconds: float = 0.0
    anomaly: str = ""            # why this outcome breaks an assertion ("" = fine)

    @property
    def label(self) -> str:
        if self.status is not None:
            return f"HTTP {self.status}"
        return self.exc or ("hung up" if self.kind in ("cancel_nonstream", "invalid") else "no answer")


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: list = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# ---------------------------------------------------------------- the server process

def proc_status(pid: int) -> dict:
    """VmRSS/VmHWM (KiB), thread count and open file descriptors of a process; {} if it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    out[k] = int(v.split()[0])
                elif k == "Threads":
                    out["threads"] = int(v)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


class Target:
    """The server under test: where it listens, its PID, and (optionally) the process we started."""

    def __init__(self, url: str, pid: int | None, proc: subprocess.Popen | None = None, log_path: str = ""):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.url = url.rstrip("/")
        self.pid = pid
        self.proc = proc
        self.log_path = log_path

    def request(self, method: str, path: str, body=None, timeout: float = 30.0, headers: dict | None = None):
        """One request on a fresh connection; returns (status, headers, body bytes). Raises on errors."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            h = {"Content-Type": "application/json"} if body is not None else {}
            h.update(headers or {})
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def metrics(self) -> dict:
        """The unlabelled samples of /metrics (name -> value) plus llmq_requests_total by label string."""
        st, _, body = self.request("GET", "/metrics", timeout=30)
        if st != 200:
            raise RuntimeError(f"/metrics answered {st}")
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Waits until no sequence runs or waits; returns the last metrics (raises on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get("llmq_running_sequences", 0) == 0 and m.get("llmq_queue_length", 0) == 0:
                return m
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server is not idle after {timeout:.0f} s: running "
                                   f"{m.get('llmq_running_sequences')}, queued {m.get('llmq_queue_length')}")
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary: str, model: str, args: list[str], log_path: str) -> Target:
    port = free_port()
    log = open(log_path, "w")
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), *args]
    print("soak: starting", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    t = Target(f"http://127.0.0.1:{port}", proc.pid, proc, log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llmq-server exited with {proc.returncode} while starting; log: {log_path}")
        try:
            if t.request("GET", "/health", timeout=2)[0] == 200:
                return t
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("llmq-server did not become ready in 120 s")


# ---------------------------------------------------------------- raw sockets

def raw_exchange(t: Target, data: bytes, timeout: float = 30.0, send_all: bool = True) -> tuple[int | None, bytes]:
    """Sends raw bytes, reads until the server closes (or the timeout); returns (status, head+body).
    A reset while sending or reading after the status line arrived still returns that status."""
    s = socket.create_connection((t.host, t.port), timeout=timeout)
    got = b""
    try:
        try:
            if send_all:
                s.sendall(data)
            else:
                s.send(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (e.g. 413) and close before reading all of it
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                if got:
                    break
                raise
            if not chunk:
                break
            got += chunk
            if b"\r\n\r\n" in got and _complete(got):
                break
        else:
            raise TimeoutError("no complete answer")
    finally:
        s.close()
    status = None
    if got.startswith(b"HTTP/1."):
        try:
            status = int(got.split(b" ", 2)[1])
        except (IndexError, ValueError):
            pass
    return status, got


def _complete(resp: bytes) -> bool:
    head, _, body = resp.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return len(body) >= int(v.strip())
    return False  # chunked or close-delimited: read to the end


def post_raw(path: str, body: bytes, extra_headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra_headers}\r\n").encode() + body


# ---------------------------------------------------------------- traffic

class Client:
    """One client thread's traffic generator."""

    def __init__(self, t: Target, stats: Stats, rng: random.Random, args):
        self.t, self.stats, self.rng, self.args = t, stats, rng, args

    # ------------------------------------------------ valid requests

    def valid_body(self, chat: bool, stream: bool) -> dict:
        r = self.rng
        body: dict = {"max_tokens": r.choice([1, 2, 5, 16, 32, 64, 128, r.randint(1, 200)])}
        if chat:
            msgs = [{"role": "user", "content": r.choice(PROMPTS)}]
            if r.random() < 0.3:
                msgs = [{"role": "system", "content": "You tell stories."},
                        {"role": "user", "content": r.choice(PROMPTS)},
                        {"role": "assistant", "content": "Once there was a cat."},
                        {"role": "user", "content": [{"type": "text", "text": "More, "}, {"type": "text", "text": "please."}]}]
            body["messages"] = msgs
        else:
            body["prompt"] = r.choice(PROMPTS) if r.random() < 0.85 else [1, 400, 300, 200]
        if r.random() < 0.7:
            body["temperature"] = r.choice([0, 0.5, 0.8, 1.0, 1.5, 2.0])
        if r.random() < 0.3:
            body["top_p"] = r.choice([0.1, 0.5, 0.9, 1.0])
        if r.random() < 0.2:
            body["top_k"] = r.choice([0, 1, 5, 40, 1000])
        if r.random() < 0.1:
            body["min_p"] = 0.05
        if r.random() < 0.1:
            body["frequency_penalty"] = r.choice([-1.0, 0.5, 2.0])
        if r.random() < 0.5:
            body["seed"] = r.randint(-2**63, 2**63 - 1)
        if r.random() < 0.3:
            body["stop"] = r.choice([".", "\n", ["the", "a"], [" and", "!", "?", "Lily"], "zzz"])
        if r.random() < 0.3:
            if chat:
                body["logprobs"] = True
                if r.random() < 0.7:
                    body["top_logprobs"] = r.randint(0, 20)
            else:
                body["logprobs"] = r.randint(0, 5)
        if stream:
            body["stream"] = True
            if r.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        elif r.random() < 0.1:
            body["stream"] = False
        if r.random() < 0.1:
            body["model"] = self.args.model_id
        return body

    def check_nonstream(self, chat: bool, body: dict, data: bytes) -> str:
        j = json.loads(data)
        ch = j["choices"][0]
        text = ch["message"]["content"] if chat else ch["text"]
        if not isinstance(text, str):
            return "text is not a string"
        if ch["finish_reason"] not in ("stop", "length"):
            return f"finish_reason {ch['finish_reason']!r}"
        u = j["usage"]
        if not 0 <= u["completion_tokens"] <= body["max_tokens"]:
            return f"completion_tokens {u['completion_tokens']} for max_tokens {body['max_tokens']}"
        if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
            return "usage totals disagree"
        stops = body.get("stop")
        for s in ([stops] if isinstance(stops, str) else stops or []):
            if s in text:
                return f"stop string {s!r} in the text"
        if "logprobs" in body and body["logprobs"] not in (False, None):
            if ch["logprobs"] is None:
                return "logprobs missing"
        return ""

    def valid(self, chat: bool, stream: bool) -> Outcome:
        kind = ("chat" if chat else "completion") + ("_stream" if stream else "")
        body = self.valid_body(chat, stream)
        o = Outcome(kind)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(self.t.host, self.t.port, timeout=self.args.timeout)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            o.status = resp.status
            if resp.status != 200:
                data = resp.read()
                if resp.status == 429:
                    if not resp.getheader("Retry-After"):
                        o.anomaly = "429 without Retry-After"
                else:
                    o.anomaly = f"HTTP {resp.status}: {data[:200]!r}"
                return o
            if not stream:
                o.anomaly = self.check_nonstream(chat, body, resp.read())
                return o
            done, finish, usage, text = False, None, None, ""
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line:
                    continue
                if not line.startswith(b"data: "):
                    o.anomaly = f"not an SSE data line: {line[:100]!r}"
                    break
                if line == b"data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                for c in ev["choices"]:
                    text += ((c.get("delta") or {}).get("content") or "") if chat else c["text"]
                    if c.get("finish_reason"):
                        finish = c["finish_reason"]
            if not o.anomaly:
                if not done:
                    o.anomaly = "stream ended without [DONE]"
                elif finish not in ("stop", "length"):
                    o.anomaly = f"finish_reason {finish!r}"
                elif body.get("stream_options") and usage is None:
                    o.anomaly = "no usage chunk"
                elif usage and usage["completion_tokens"] > body["max_tokens"]:
                    o.anomaly = "completion_tokens > max_tokens"
        except Exception as e:  # noqa: BLE001 - a soak counts every failure
            o.exc = type(e).__name__
            o.anomaly = f"{type(e).__name__}: {e}"
        finally:
            o.seconds = time.perf_counter() - t0
            conn.close()
        return o

    # ------------------------------------------------ invalid requests

    def invalid_cases(self):
        """(name, raw request bytes, allowed statuses; None in the set allows a closed connection)."""
        r = self.rng
        big = self.args.max_body
        cases = {
            "malformed_json": lambda: post_raw("/v1/completions", r.choice([b"{", b"{\"prompt\": }", b"nul", b"",
                                                                            b"{\"prompt\":\"x\",}", b"[1,2",
                                                                            b"\"just a string\"", b"123", b"{}{}"])),
            "malformed_json_chat": lambda: post_raw("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\""),
            "wrong_type": lambda: post_raw("/v1/completions", json.dumps(r.choice([
                {"prompt": 5}, {"prompt": "x", "max_tokens": "10"}, {"prompt": "x", "temperature": "hot"},
                {"prompt": "x", "stop": [1]}, {"prompt": "x", "stream": "yes"}, {"prompt": "x", "logprobs": True},
                {"prompt": {"a": 1}}, {"prompt": [1, "a"]}, {"prompt": "x", "model": 7}, {"prompt": []},
                {"prompt": "x", "stream_options": 3}, {"prompt": "x", "seed": 1.5}, {"prompt": [[1, "a"]]},
                {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, {"prompt": "x", "stop": [""]}])).encode()),
            "wrong_type_chat": lambda: post_raw("/v1/chat/completions", json.dumps(r.choice([
                {"messages": "hi"}, {"messages": []}, {"messages": [{"role": "user"}]},
                {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": [{"role": 1, "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
                {"messages": [{"role": "user", "content": "x"}], "logprobs": 1},
                {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
                {"messages": [{"role": "user", "content": 42}]}, {"messages": [None]}])).encode()),
            "absurd_value": lambda: post_raw("/v1/completions", r.choice([
                b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "max_tokens": 0}',
                b'{"prompt": "x", "max_tokens": 100000000000000000000000000000}',
                b'{"prompt": "x", "max_tokens": -18446744073709551615}',
                b'{"prompt": "x", "max_tokens": 1e30}', b'{"prompt": "x", "temperature": 1e308}',
                b'{"prompt": "x", "temperature": -0.5}', b'{"prompt": "x", "top_p": 7}',
                b'{"prompt": "x", "top_k": 99999999999}', b'{"prompt": "x", "n": 0}',
                b'{"prompt": "x", "logprobs": 100}', b'{"prompt": "x", "temperature": NaN}',
                b'{"prompt": "x", "temperature": 1e999}', b'{"prompt": [999999]}', b'{"prompt": [-1]}',
                b'{"prompt": [1, 4294967296]}', b'{"prompt": "x", "repetition_penalty": 0}',
                b'{"prompt": "x", "model": "gpt-17"}'])),
            # 500 repetitions are ~2,000 tokens (stories260K), under a 2048 context: 700 is over it.
            "prompt_too_long": lambda: post_raw("/v1/completions", json.dumps(
                {"prompt": "Once upon a time " * r.randint(700, 20000), "max_tokens": 4}).encode()),
            "bad_utf8": lambda: r.choice([
                post_raw("/v1/completions", b'{"prompt": "bad \xff\xfe utf8", "max_tokens": 2}'),
                post_raw("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'),
                post_raw("/v1/completions", b'{"prompt": "x", "stop": "\xed\xa0\x80"}'),
                post_raw("/tokenize", b'{"content": "\xf0\x28\x8c\x28"}'),
                post_raw("/v1/completions", b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}'),
                b"GET /\xff\xfe HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n"]),
            "deep_nesting": lambda: post_raw("/v1/completions", b"[" * r.choice([1000, 100000, 500000]) + b"]"),
            "unknown_route": lambda: r.choice([
                b"GET /v2/nothing HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n",
                post_raw("/v1/images/generations", b'{"prompt": "x"}'),
                b"GET /v1/completions HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n",
                b"DELETE /v1/models HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n",
                b"GET /" + b"a" * 6000 + b" HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n"]),
            "oversized_body": lambda: post_raw("/v1/completions", b'{"prompt": "' + b"a" * (big + r.randint(1, 50000)) + b'"}'),
            "oversized_chunked": lambda: (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                                          b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                          + (b"10000\r\n" + b"a" * 0x10000 + b"\r\n") * (big // 0x10000 + 2) + b"0\r\n\r\n"),
            "garbage_request_line": lambda: r.choice([b"HELLO\r\n\r\n", b"\x00\x01\x02\x03\r\n\r\n",
                                                      b"POST /v1/completions HTTP/9.9\r\n\r\n"]),
            # httplib reads (and drops) a declared body over the limit before answering 413, so
            # these wait for the server's read timeout (--timeout, 30 s) and hold a thread that long.
            "bad_content_length": lambda: r.choice([b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                                                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n"]),
        }
        allowed = {
            "malformed_json": {400}, "malformed_json_chat": {400}, "wrong_type": {400}, "wrong_type_chat": {400},
            "absurd_value": {400, 404}, "prompt_too_long": {400}, "bad_utf8": {400, 404},
            "deep_nesting": {400}, "unknown_route": {404, 405, 414},
            "oversized_body": {413, None}, "oversized_chunked": {411, 413, None},  # 411: chunked bodies are refused
            "garbage_request_line": {400, 505, None}, "bad_content_length": {400, 413, None},
        }
        return cases, allowed

    def invalid(self) -> Outcome:
        cases, allowed = self.invalid_cases()
        names = sorted(n for n in cases if n != "bad_content_length")
        name = "bad_content_length" if self.rng.random() < 0.01 else self.rng.choice(names)
        o = Outcome("invalid", name)
        t0 = time.perf_counter()
        try:
            o.status, resp = raw_exchange(self.t, cases[name](), timeout=self.args.timeout)
            if o.status is None and None not in allowed[name]:
                o.anomaly = f"{name}: no HTTP answer ({resp[:80]!r})"
            elif o.status is not None and o.status not in allowed[name]:
                o.anomaly = f"{name}: HTTP {o.status}: {resp[-200:]!r}"
            elif o.status is not None and o.status >= 400 and b'"error"' not in resp and name not in (
                    "garbage_request_line", "unknown_route", "bad_content_length"):
                o.anomaly = f"{name}: HTTP {o.status} without a JSON error body"
        except Exception as e:  # noqa: BLE001
            o.exc = type(e).__name__
            if None not in allowed[name] or isinstance(e, (TimeoutError, socket.timeout)):
                o.anomaly = f"{name}: {type(e).__name__}: {e}"
        o.seconds = time.perf_counter() - t0
        return o

    def cut_short(self) -> Outcome:
        """A request that ends early: headers cut, or fewer body bytes than Content-Length; then hang up."""
        o = Outcome("invalid", "cut_short")
        t0 = time.perf_counter()
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 50}).encode()
        data = post_raw("/v1/completions", body)
        cut = self.rng.randint(1, len(data) - 1)
        try:
            s = socket.create_connection((self.t.host, self.t.port), timeout=10)
            s.sendall(data[:cut])
            time.sleep(self.rng.random() * 0.05)
            s.close()
        except OSError as e:
            o.exc = type(e).__name__
            o.anomaly = f"cut_short: {e}"
        o.seconds = time.perf_counter() - t0
        return o

    # ------------------------------------------------ cancelled requests

    def cancel_stream(self) -> Outcome:
        """Streams a long completion, reads a few events, hangs up (sometimes with a reset)."""
        r = self.rng
        chat = r.random() < 0.5
        o = Outcome("cancel_stream", "chat" if chat else "completion")
        body = {"max_tokens": r.randint(300, 1500), "stream": True, "temperature": 1.0}
        if chat:
            body["messages"] = [{"role": "user", "content": r.choice(PROMPTS)}]
        else:
            body["prompt"] = r.choice(PROMPTS)
        if r.random() < 0.3:
            body["logprobs"] = True if chat else 3
        t0 = time.perf_counter()
        s = None
        try:
            s = socket.create_connection((self.t.host, self.t.port), timeout=self.args.timeout)
            s.sendall(post_raw("/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode()))
            want, got = r.randint(0, 6), b""
            while got.count(b"data: ") < want or b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            if got.startswith(b"HTTP/1."):
                o.status = int(got.split(b" ", 2)[1])
            if o.status not in (200, 429):
                o.anomaly = f"cancel_stream: status {o.status}: {got[:200]!r}"
            if r.random() < 0.3:  # abortive close: RST instead of FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except Exception as e:  # noqa: BLE001
            o.exc = type(e).__name__
            o.anomaly = f"cancel_stream: {type(e).__name__}: {e}"
        finally:
            if s is not None:
                s.close()
        o.seconds = time.perf_counter() - t0
        return o

    def cancel_nonstream(self) -> Outcome:
        """Sends a long non-streaming request and hangs up before the answer: at once, after a
        moment, or after the headers of the chunked (> 2 s) answer arrived."""
        r = self.rng
        chat = r.random() < 0.5
        mode = r.choice(["at_once", "soon", "after_headers"])
        o = Outcome("cancel_nonstream", mode)
        body = {"max_tokens": r.randint(500, 1800), "temperature": 1.0, "stop": ["\u0000"]}
        if chat:
            body["messages"] = [{"role": "user", "content": r.choice(PROMPTS)}]
        else:
            body["prompt"] = r.choice(PROMPTS)
        t0 = time.perf_counter()
        s = None
        try:
            s = socket.create_connection((self.t.host, self.t.port), timeout=self.args.timeout)
            s.sendall(post_raw("/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode()))
            if mode == "soon":
                time.sleep(r.uniform(0.05, 1.5))
            elif mode == "after_headers":
                got = b""
                s.settimeout(5)
                try:
                    while b"\r\n\r\n" not in got:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        got += chunk
                except socket.timeout:
                    pass
                if got.startswith(b"HTTP/1."):
                    o.status = int(got.split(b" ", 2)[1])
                    if o.status not in (200, 429):
                        o.anomaly = f"cancel_nonstream: status {o.status}: {got[:200]!r}"
        except Exception as e:  # noqa: BLE001
            o.exc = type(e).__name__
            o.anomaly = f"cancel_nonstream: {type(e).__name__}: {e}"
        finally:
            if s is not None:
                s.close()
        o.seconds = time.perf_counter() - t0
        return o

    # ------------------------------------------------ other endpoints

    def misc(self) -> Outcome:
        r = self.rng
        name = r.choice(["health", "metrics", "models", "tokenize", "detokenize", "keepalive", "index"])
        o = Outcome("misc", name)
        t0 = time.perf_counter()
        try:
            if name == "keepalive":  # a few requests over one connection
                conn = http.client.HTTPConnection(self.t.host, self.t.port, timeout=self.args.timeout)
                try:
                    for i in range(r.randint(2, 6)):
                        if i % 2:
                            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 3}),
                                         headers={"Content-Type": "application/json"})
                        else:
                            conn.request("GET", "/health")
                        resp = conn.getresponse()
                        resp.read()
                        o.status = resp.status
                        if resp.status not in (200, 429):
                            o.anomaly = f"keepalive: HTTP {resp.status}"
                            break
                finally:
                    conn.close()
            else:
                method, path, body, want = {
                    "health": ("GET", "/health", None, 200),
                    "metrics": ("GET", "/metrics", None, 200),
                    "models": ("GET", "/v1/models", None, 200),
                    "index": ("GET", "/", None, 200),
                    "tokenize": ("POST", "/tokenize", {"content": r.choice(PROMPTS), "add_special": r.random() < 0.5}, 200),
                    "detokenize": ("POST", "/detokenize", {"tokens": [r.randint(0, 511) for _ in range(r.randint(0, 40))]}, 200),
                }[name]
                o.status, _, data = self.t.request(method, path, body, timeout=self.args.timeout)
                if o.status != want:
                    o.anomaly = f"{name}: HTTP {o.status}: {data[:200]!r}"
        except Exception as e:  # noqa: BLE001
            o.exc = type(e).__name__
            o.anomaly = f"{name}: {type(e).__name__}: {e}"
        o.seconds = time.perf_counter() - t0
        return o

    def one(self) -> Outcome:
        w = self.args.weights
        kinds = list(w)
        kind = self.rng.choices(kinds, [w[k] for k in kinds])[0]
        if kind == "completion":
            return self.valid(False, False)
        if kind == "completion_stream":
            return self.valid(False, True)
        if kind == "chat":
            return self.valid(True, False)
        if kind == "chat_stream":
            return self.valid(True, True)
        if kind == "invalid":
            return self.cut_short() if self.rng.random() < 0.07 else self.invalid()
        if kind == "cancel_stream":
            return self.cancel_stream()
        if kind == "cancel_nonstream":
            return self.cancel_nonstream()
        return self.misc()


def overload_burst(t: Target, stats: Stats, n: int, args) -> int:
    """n long streaming requests at once; each holds its place until all have an answer. Returns
    the number of 429s (some are expected: n > --parallel + --max-queue)."""
    barrier, answered = threading.Barrier(n), threading.Barrier(n)
    results = []
    lock = threading.Lock()

    def fire(i: int) -> None:
        o = Outcome("overload")
        s = None
        t0 = time.perf_counter()
        try:
            barrier.wait(30)
            s = socket.create_connection((t.host, t.port), timeout=args.timeout)
            s.sendall(post_raw("/v1/completions", json.dumps({"prompt": "Once", "max_tokens": 1000, "stream": True,
                                                               "temperature": 1.0, "stop": ["\u0000"]}).encode()))
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            o.status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.") else None
            if o.status == 429 and b"Retry-After" not in got.split(b"\r\n\r\n")[0]:
                o.anomaly = "429 without Retry-After"
            elif o.status not in (200, 429):
                o.anomaly = f"overload: status {o.status}: {got[:200]!r}"
        except Exception as e:  # noqa: BLE001
            o.exc = type(e).__name__
            o.anomaly = f"overload: {type(e).__name__}: {e}"
        o.seconds = time.perf_counter() - t0
        with lock:
            results.append(o)
        try:
            answered.wait(60)
        except threading.BrokenBarrierError:
            pass
        if s is not None:
            s.close()

    threads = [threading.Thread(target=fire, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    for o in results:
        stats.add(o)
    return sum(1 for o in results if o.status == 429)


# ---------------------------------------------------------------- the run

def run(args) -> dict:
    proc_log = ""
    if args.server:
        proc_log = args.log or f"/tmp/llmq-soak-server-{os.getpid()}.log"
        t = start_server(args.server, args.model, shlex.split(args.server_args), proc_log)
    else:
        t = Target(args.url, args.pid)
        if t.request("GET", "/health")[0] != 200:
            raise RuntimeError(f"{args.url}/health is not 200")
    try:
        args.model_id = json.loads(t.request("GET", "/v1/models")[2])["data"][0]["id"]
        return soak(t, args)
    finally:
        if t.proc is not None and t.proc.poll() is None:
            t.proc.kill()
            t.proc.wait()


def soak(t: Target, args) -> dict:
    stats = Stats()
    samples = []  # (seconds since start, proc_status)
    total_s = args.minutes * 60.0
    warmup_s = args.warmup if args.warmup is not None else min(120.0, max(10.0, total_s * 0.1))
    start_status = proc_status(t.pid) if t.pid else {}
    go = threading.Event()   # cleared while traffic pauses (idle measurements)
    go.set()
    stop = threading.Event()
    busy = [0]
    busy_lock = threading.Lock()
    t_start = time.monotonic()

    def client(i: int) -> None:
        c = Client(t, stats, random.Random(args.seed * 1000 + i), args)
        while not stop.is_set():
            if not go.is_set():
                go.wait(1)
                continue
            with busy_lock:
                busy[0] += 1
            try:
                stats.add(c.one())
            finally:
                with busy_lock:
                    busy[0] -= 1

    def pause_and_measure(label: str) -> dict:
        go.clear()
        deadline = time.monotonic() + 120
        while busy[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        m = t.wait_idle(60)
        # Cancelled sequences leave at the scheduler's next step (probes take ~1 s), and an idle
        # server returns free heap pages to the system at most every 5 s: measure after both.
        time.sleep(6.0)
        m = t.wait_idle(60)
        st = proc_status(t.pid) if t.pid else {}
        st["kv_blocks_used"] = m.get("llmq_kv_cache_blocks_used")
        print(f"soak: {label}: {fmt_status(st)}", file=sys.stderr)
        return st

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for th in threads:
        th.start()
    warm_status, bursts, burst_429 = None, 0, []
    next_burst = t_start + warmup_s / 2
    next_sample = t_start
    next_report = t_start + 60
    while True:
        now = time.monotonic()
        if now - t_start >= total_s:
            break
        if warm_status is None and now - t_start >= warmup_s:
            warm_status = pause_and_measure(f"after warm-up ({warmup_s:.0f} s)")
            go.set()
        if args.overload_every > 0 and now >= next_burst:
            n = args.parallel + args.max_queue + args.overload_extra
            burst_429.append(overload_burst(t, stats, n, args))
            bursts += 1
            next_burst = time.monotonic() + args.overload_every
        if now >= next_sample:
            samples.append((round(now - t_start, 1), proc_status(t.pid) if t.pid else {}))
            next_sample = now + args.sample_every
        if now >= next_report:
            with stats.lock:
                n_req, n_bad = len(stats.outcomes), sum(1 for o in stats.outcomes if o.anomaly)
            print(f"soak: {(now - t_start) / 60:5.1f} min: {n_req} requests, {n_bad} anomalies, "
                  f"{fmt_status(samples[-1][1])}", file=sys.stderr)
            next_report = now + 60
        if t.pid and not pid_alive(t.pid):
            print("soak: the server process is gone", file=sys.stderr)
            break
        time.sleep(0.2)
    wall = time.monotonic() - t_start
    alive_before_end = not t.pid or pid_alive(t.pid)
    end_status, end_error = {}, ""
    if alive_before_end:
        try:
            end_status = pause_and_measure("at the end")
        except Exception as e:  # noqa: BLE001
            end_error = f"{type(e).__name__}: {e}"
    stop.set()
    go.set()
    for th in threads:
        th.join(args.timeout + 10)
    if warm_status is None:
        warm_status = end_status
    health = None
    try:
        health = t.request("GET", "/health", timeout=10)[0]
    except OSError as e:
        end_error = end_error or f"/health: {type(e).__name__}: {e}"

    # Stop the server we started: SIGTERM must end it cleanly.
    exit_code, log_markers = None, []
    if t.proc is not None and t.proc.poll() is None:
        t.proc.send_signal(signal.SIGTERM)
        try:
            exit_code = t.proc.wait(60)
        except subprocess.TimeoutExpired:
            t.proc.kill()
            exit_code = "did not exit within 60 s of SIGTERM"
    elif t.proc is not None:
        exit_code = t.proc.returncode
    if t.log_path:
        try:
            with open(t.log_path, errors="replace") as f:
                log = f.read()
            log_markers = [m for m in CRASH_MARKERS if m in log]
        except OSError:
            pass
    return summarize(args, stats, wall, bursts, burst_429, start_status, warm_status, end_status, samples,
                     alive_before_end, health, end_error, exit_code, log_markers, warmup_s)


def fmt_status(st: dict) -> str:
    if not st:
        return "(no process status)"
    return (f"RSS {st.get('VmRSS', 0) / 1024:.1f} MiB, peak {st.get('VmHWM', 0) / 1024:.1f} MiB, "
            f"{st.get('threads')} threads, {st.get('fds')} fds"
            + (f", KV blocks used {st['kv_blocks_used']:.0f}" if st.get("kv_blocks_used") is not None else ""))


def load_rss_growth(samples, warmup_s: float):
    """RSS growth under load: the median VmRSS of the samples in the last minute over that of the
    second minute after the warm-up (both while the traffic runs, so the allocator is in the same
    state; the idle samples depend on when malloc_trim last ran, and in the first minute after the
    warm-up's idle pause the trimmed heap grows back). None without enough samples."""
    rss = [(t, st["VmRSS"]) for t, st in samples if st.get("VmRSS")]
    if not rss:
        return None
    t_end = rss[-1][0]
    first = sorted(v for t, v in rss if warmup_s + 60 <= t <= warmup_s + 120)
    last = sorted(v for t, v in rss if t >= t_end - 60)
    if not first or not last or t_end - 60 <= warmup_s + 120:
        return None
    return last[len(last) // 2] / first[len(first) // 2] - 1


def summarize(args, stats, wall, bursts, burst_429, start, warm, end, samples, alive, health, end_error,
              exit_code, log_markers, warmup_s) -> dict:
    outs = stats.outcomes
    by_kind = defaultdict(list)
    for o in outs:
        by_kind[o.kind].append(o)
    kinds = {}
    for k, os_ in sorted(by_kind.items()):
        lat = [o.seconds for o in os_]
        kinds[k] = {
            "requests": len(os_),
            "outcomes": dict(Counter(o.label for o in os_).most_common()),
            "anomalies": sum(1 for o in os_ if o.anomaly),
            "p50_ms": round(percentile(lat, 0.5) * 1000, 1),
            "p99_ms": round(percentile(lat, 0.99) * 1000, 1),
        }
        subs = Counter(f"{o.sub}: {o.label}" for o in os_ if o.sub)
        if subs:
            kinds[k]["by_case"] = dict(sorted(subs.items()))
            case_lat = defaultdict(list)
            for o in os_:
                case_lat[o.sub].append(o.seconds)
            kinds[k]["p99_ms_by_case"] = {c: round(percentile(v, 0.99) * 1000, 1) for c, v in sorted(case_lat.items())}
    statuses = Counter(o.label for o in outs)
    served = sum(1 for o in outs if o.status is not None)
    five = [o for o in outs if o.status is not None and o.status >= 500]
    anomalies = [o for o in outs if o.anomaly]
    rss_growth = None  # idle to idle (after warm-up vs end): reported, not checked
    if warm.get("VmRSS") and end.get("VmRSS"):
        rss_growth = end["VmRSS"] / warm["VmRSS"] - 1
    load_growth = load_rss_growth(samples, warmup_s)
    checks = {
        "server alive at the end": bool(alive),
        "/health 200 at the end": health == 200,
        "no 5xx": not five,
        "every status as expected, no client-side failure": not anomalies,
        "idle at the end, all KV blocks free": not end_error and end.get("kv_blocks_used") == 0,
        f"RSS growth after warm-up < {args.max_rss_growth:.0%}": load_growth is not None and load_growth < args.max_rss_growth,
        "overload gave 429": args.overload_every <= 0 or (bursts > 0 and all(n > 0 for n in burst_429)),
        f"at least {args.min_requests} requests": len(outs) >= args.min_requests,
    }
    if exit_code is not None:
        checks["clean exit on SIGTERM (code 0, no crash marker in the log)"] = exit_code == 0 and not log_markers
    elif args.server is None and args.pid is None:
        checks.pop(f"RSS growth after warm-up < {args.max_rss_growth:.0%}")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "minutes": round(wall / 60, 2),
        "clients": args.clients,
        "seed": args.seed,
        "server_args": args.server_args if args.server else None,
        "requests": len(outs),
        "requests_with_http_answer": served,
        "requests_per_s": round(len(outs) / wall, 2) if wall else None,
        "outcomes": dict(statuses.most_common()),
        "kinds": kinds,
        "overload_bursts": bursts,
        "overload_429_per_burst": burst_429,
        "server": {"start": start, "after_warmup": warm, "end": end,
                   "rss_growth_after_warmup": None if load_growth is None else round(load_growth, 4),
                   "rss_growth_idle_to_idle": None if rss_growth is None else round(rss_growth, 4),
                   "samples": samples, "exit_code": exit_code, "log_crash_markers": log_markers,
                   "end_error": end_error},
        "anomalies": len(anomalies),
        "anomaly_examples": [f"{o.kind}/{o.sub}: {o.anomaly}" for o in anomalies[:20]],
        "checks": checks,
        "passed": all(checks.values()),
    }


def print_table(s: dict) -> None:
    print(f"\nllmq-server soak: {s['minutes']} min, {s['clients']} clients, {s['requests']} requests "
          f"({s['requests_per_s']}/s), {s['overload_bursts']} overload bursts (429s: {s['overload_429_per_burst']})")
    print(f"\n{'kind':<18}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'anom.':>6}  outcomes")
    for k, v in s["kinds"].items():
        oc = ", ".join(f"{lab} {n}" for lab, n in v["outcomes"].items())
        print(f"{k:<18}{v['requests']:>9}{v['p50_ms']:>9.1f}{v['p99_ms']:>9.1f}{v['anomalies']:>6}  {oc}")
    print("\noutcomes overall:", ", ".join(f"{lab} {n}" for lab, n in s["outcomes"].items()))
    sv = s["server"]
    for label, key in (("start", "start"), ("after warm-up", "after_warmup"), ("end", "end")):
        print(f"server {label:<14} {fmt_status(sv[key])}")
    if sv["rss_growth_after_warmup"] is not None:
        print(f"RSS growth after warm-up, under load (median of the last minute / of the first minute after "
              f"warm-up): {sv['rss_growth_after_warmup'] * 100:+.2f}%")
    if sv["rss_growth_idle_to_idle"] is not None:
        print(f"RSS idle after warm-up to idle at the end: {sv['rss_growth_idle_to_idle'] * 100:+.2f}%")
    if s["anomaly_examples"]:
        print("\nanomalies (first 20):")
        for a in s["anomaly_examples"]:
            print("  " + a[:300])
    print()
    for name, ok in s["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print("\nPASSED" if s["passed"] else "\nFAILED")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080")
    ap.add_argument("--pid", type=int, help="the running server's PID (for RSS); implied with --server")
    ap.add_argument("--server", help="llmq-server binary to start (instead of --url)")
    ap.add_argument("--model", help="model for --server")
    ap.add_argument("--server-args", default="-t 1 --parallel 8 --max-queue 16 --ctx 2048 --chat-template chatml",
                    help="more llmq-server arguments for --server (one string)")
    ap.add_argument("--log", help="server log file for --server (default /tmp/llmq-soak-server-PID.log)")
    ap.add_argument("--parallel", type=int, help="the server's --parallel (read from --server-args when starting it)")
    ap.add_argument("--max-queue", type=int, help="the server's --max-queue (read from --server-args when starting it)")
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, help="warm-up seconds (default 10%% of the run, 10..120 s)")
    ap.add_argument("--clients", type=int, default=16, help="client threads")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    ap.add_argument("--overload-every", type=float, default=60.0, help="seconds between overload bursts (0: none)")
    ap.add_argument("--overload-extra", type=int, default=8, help="burst size beyond --parallel + --max-queue")
    ap.add_argument("--max-body", type=int, default=1 << 20, help="the server's body limit (bytes)")
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--min-requests", type=int, default=0, help="fail unless at least this many requests were made")
    ap.add_argument("--sample-every", type=float, default=15.0, help="seconds between RSS samples in the JSON")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    if bool(args.url) == bool(args.server):
        ap.error("give either --url (a running server) or --server and --model")
    if args.server and not args.model:
        ap.error("--server needs --model")
    if args.server:
        sa = shlex.split(args.server_args)

        def opt(name: str, default: int) -> int:
            return int(sa[sa.index(name) + 1]) if name in sa else default
        args.parallel = args.parallel or opt("--parallel", 4)
        args.max_queue = args.max_queue if args.max_queue is not None else opt("--max-queue", 64)
    else:
        args.parallel = args.parallel or 4
        args.max_queue = args.max_queue if args.max_queue is not None else 64
    args.weights = {"completion": 18, "completion_stream": 14, "chat": 12, "chat_stream": 12, "invalid": 24,
                    "cancel_stream": 5, "cancel_nonstream": 4, "misc": 11}
    s = run(args)
    print_table(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
        print(f"summary: {args.json}")
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
