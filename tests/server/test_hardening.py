"""llmq-server against hostile and unusual clients at the socket level (issue 22 items 1, 3, 12,
16, and the connection limits): slowloris, oversized headers, pipelining, HTTP/1.0 with a
half-closed socket, per-address and total connection limits. Raw sockets, so that the test sends
exactly the bytes it means to. stories260K keeps the model's share of the time small.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

COMPLETION = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def srv(servers, stories_model):
    return servers.start(stories_model, "--request-timeout", "3", "--max-connections", "200", "--max-connections-per-ip", "100")


def connect(srv, source="127.0.0.1", timeout=10.0) -> socket.socket:
    s = socket.socket()
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", srv.port))
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        out += chunk
    return out


def request(srv, raw: bytes, source="127.0.0.1", half_close=False) -> bytes:
    with connect(srv, source) as s:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        return read_all(s)


def post(path: str, body: bytes, version="HTTP/1.1", extra="") -> bytes:
    return (f"POST {path} {version}\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0


def test_slowloris_does_not_starve_other_clients(srv):
    """500 connections each send their header one byte per second (item 1). Another client (from
    127.0.0.2) still gets /health and a completion within 2 s; the slow ones are dropped at the
    3 s request deadline or refused over the per-address limit, and /metrics counts both."""
    stop = threading.Event()
    socks = []
    for _ in range(500):
        try:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.setblocking(False)
            socks.append(s)
        except OSError:
            break
    assert len(socks) >= 400

    def drip():
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64
        for i in range(len(head)):
            if stop.is_set():
                return
            for s in socks:
                try:
                    s.send(head[i:i + 1])
                except OSError:
                    pass
            time.sleep(1.0)

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        time.sleep(1.5)
        for _ in range(4):
            t0 = time.monotonic()
            assert status(request(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "127.0.0.2")) == 200
            r = request(srv, post("/v1/completions", COMPLETION), "127.0.0.2")
            assert status(r) == 200 and b'"choices"' in r
            assert time.monotonic() - t0 < 2.0
            time.sleep(1.0)
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()
    m = srv.metrics()
    assert m.value("llmq_http_refused_connections_total") > 0
    assert m.value("llmq_http_dropped_requests_total") > 0


def test_request_deadline_is_total(srv):
    """A header sent a byte every 0.5 s is dropped at --request-timeout (3 s), not kept alive by
    each byte."""
    with connect(srv) as s:
        t0 = time.monotonic()
        closed = False
        for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 40:
            try:
                s.send(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.5)
            if time.monotonic() - t0 > 8:
                break
        if not closed:
            s.settimeout(3)
            try:
                closed = s.recv(1) == b""
            except (ConnectionResetError, socket.timeout):
                closed = True
        assert closed and time.monotonic() - t0 < 8


@pytest.mark.parametrize("extra", [
    "".join(f"X-H{i}: v\r\n" for i in range(200)),  # more header fields than --max-headers (100)
    "X-Big: " + "b" * 20000 + "\r\n",                # more header bytes than --max-header-bytes (16384)
])
def test_header_limits(srv, extra):
    r = request(srv, post("/v1/completions", COMPLETION, extra=extra))
    assert status(r) == 400, r[:200]
    assert b"limits" in r
    assert status(request(srv, post("/v1/completions", COMPLETION))) == 200  # the server is fine


def test_pipelined_requests_are_all_answered(srv):
    """Two requests in one send on a keep-alive connection (item 12): both get their response."""
    one = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    two = post("/v1/completions", COMPLETION)  # Connection: close ends the connection after it
    r = request(srv, one + two)
    assert r.count(b"HTTP/1.1 200") == 2, r[:400]
    assert b'"choices"' in r


def test_http10_client_that_half_closes(srv):
    """An HTTP/1.0 client that shuts down its sending side after the request (item 16) still gets
    a whole (not chunked) response."""
    r = request(srv, post("/v1/completions", COMPLETION, version="HTTP/1.0"), half_close=True)
    assert status(r) == 200, r[:200]
    head, _, body = r.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower()
    assert json.loads(body)["choices"][0]["text"]


def test_connection_limits(servers, stories_model):
    """Over --max-connections-per-ip a connection is answered 503 at once (a JSON error, Retry-After);
    other addresses still connect until --max-connections."""
    s = servers.start(stories_model, "--max-connections", "6", "--max-connections-per-ip", "3")
    health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

    def hold(source):
        # A connection that has had one keep-alive request answered is surely counted (a bare
        # connect may still wait for a worker, and a probe could take its place).
        c = connect(s, source)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b'{"status":"ok"}' not in got:
            chunk = c.recv(4096)
            assert chunk, got
            got += chunk
        return c

    held = [hold("127.0.0.1") for _ in range(3)]
    try:
        t0 = time.monotonic()
        r = request(s, health)
        assert status(r) == 503 and b"too_many_connections" in r and b"Retry-After: 1" in r
        assert time.monotonic() - t0 < 1.0
        assert status(request(s, health, "127.0.0.2")) == 200
        held += [hold("127.0.0.3") for _ in range(3)]
        assert status(request(s, health, "127.0.0.4")) == 503
    finally:
        for h in held:
            h.close()
    deadline = time.monotonic() + 10  # the server notices the closed connections as their workers see EOF
    while status(r := request(s, health)) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status(r) == 200
