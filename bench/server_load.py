#!/usr/bin/env python3
"""Load measurement for llmq-server: N concurrent streaming clients, aggregate tokens/s.

Each client sends streaming /v1/completions requests (Server-Sent Events, with
stream_options.include_usage so the server reports the exact completion token count) one after
another; all clients start together. The aggregate rate is the sum of generated tokens over the
wall time from the first request to the last [DONE].

Against a running server:
    python3 bench/server_load.py --url http://127.0.0.1:8080 --clients 1,8 --tokens 64

Or let the script start llmq-server itself (stopped with SIGTERM at the end):
    python3 bench/server_load.py --server build/llmq-server --model smollm2.llmq --parallel 8 \
        --clients 1,8 --tokens 64

Only the Python standard library is used, so it runs without a virtual environment;
tests/server/test_load.py imports it.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

DEFAULT_PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"


@dataclass
class StreamResult:
    """What one streaming request saw."""
    status: int = 0
    ok: bool = False              # HTTP 200, every event parsed, finished with [DONE]
    error: str = ""
    headers: dict = field(default_factory=dict)
    body: str = ""                # the body of a non-200 answer
    text: str = ""                # the concatenated streamed text
    chunks: int = 0               # data events with text
    finish_reason: str | None = None
    usage: dict | None = None
    ttft: float | None = None     # seconds from sending to the first non-empty text
    seconds: float = 0.0          # seconds from sending to [DONE]

    @property
    def completion_tokens(self) -> int:
        return int(self.usage["completion_tokens"]) if self.usage else 0


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    return conn, u.path.rstrip("/")


def stream_completion(url: str, prompt: str = DEFAULT_PROMPT, max_tokens: int = 64, *, chat: bool = False,
                      temperature: float = 0.8, seed: int | None = None, api_key: str | None = None,
                      timeout: float = 120.0, extra: dict | None = None) -> StreamResult:
    """One streaming completion (or chat completion) through http.client; never raises."""
    res = StreamResult()
    body = {"max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if seed is not None:
        body["seed"] = seed
    body.update(extra or {})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    t0 = time.perf_counter()
    conn = None
    try:
        conn, base = _connect(url, timeout)
        conn.request("POST", base + ("/v1/chat/completions" if chat else "/v1/completions"),
                     body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        res.status = resp.status
        res.headers = {k.lower(): v for k, v in resp.getheaders()}
        if resp.status != 200:
            res.body = resp.read().decode("utf-8", "replace")
            res.error = f"HTTP {resp.status}: {res.body[:200]}"
            return res
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                res.seconds = time.perf_counter() - t0
                break
            ev = json.loads(data)
            if ev.get("usage"):
                res.usage = ev["usage"]
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                if piece:
                    if res.ttft is None:
                        res.ttft = time.perf_counter() - t0
                    res.text += piece
                    res.chunks += 1
                if ch.get("finish_reason"):
                    res.finish_reason = ch["finish_reason"]
        if not done:
            res.error = "the stream ended without [DONE]"
        elif res.finish_reason is None:
            res.error = "no finish_reason"
        elif res.usage is None:
            res.error = "no usage chunk"
        else:
            res.ok = True
    except Exception as e:  # noqa: BLE001 - a load test counts every failure
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if conn is not None:
            conn.close()
    return res


def generated_tokens_metric(url: str, api_key: str | None = None) -> int | None:
    """llmq_generated_tokens_total from the server's /metrics, or None."""
    try:
        conn, base = _connect(url, 10)
        try:
            conn.request("GET", base + "/metrics", headers={"Authorization": "Bearer " + api_key} if api_key else {})
            r = conn.getresponse()
            text = r.read().decode()
        finally:
            conn.close()
        for line in text.splitlines():
            if line.startswith("llmq_generated_tokens_total "):
                return int(float(line.split()[1]))
    except (OSError, ValueError):
        pass
    return None


@dataclass
class LoadResult:
    clients: int
    requests: int
    errors: int
    wall_s: float
    tokens: int                   # generated tokens: the server's counter (else the sum of usage)
    usage_tokens: int             # the sum of completion_tokens the clients were told
    tokens_per_s: float           # aggregate: all generated tokens / wall time
    per_client_tokens_per_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    results: list

    def line(self) -> str:
        ttft = "-" if self.ttft_p50 is None else f"{self.ttft_p50 * 1000:.0f}/{self.ttft_p95 * 1000:.0f} ms"
        usage = "" if self.usage_tokens == self.tokens else f" (usage said {self.usage_tokens})"
        return (f"clients {self.clients:3d}: {self.requests} requests, {self.errors} errors, {self.tokens} tokens{usage} "
                f"in {self.wall_s:.2f} s = {self.tokens_per_s:.1f} tok/s aggregate "
                f"({self.per_client_tokens_per_s:.1f} per client), TTFT p50/p95 {ttft}")


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_load(url: str, clients: int, max_tokens: int = 64, requests_per_client: int = 1, *,
             prompt: str = DEFAULT_PROMPT, chat: bool = False, temperature: float = 0.8,
             api_key: str | None = None, timeout: float = 300.0) -> LoadResult:
    """`clients` threads, each sending `requests_per_client` streaming requests in turn."""
    results: list[StreamResult] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client(i: int) -> None:
        barrier.wait()
        for k in range(requests_per_client):
            r = stream_completion(url, prompt, max_tokens, chat=chat, temperature=temperature,
                                  seed=1000 * i + k, api_key=api_key, timeout=timeout)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    before = generated_tokens_metric(url, api_key)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    wall = time.perf_counter() - t0
    usage_tokens = sum(r.completion_tokens for r in results)
    tokens = usage_tokens
    if before is not None:
        # The server counts a stream's tokens just after its [DONE]: give it a moment.
        deadline = time.perf_counter() + 2.0
        while True:
            after = generated_tokens_metric(url, api_key)
            if after is None or after - before == usage_tokens or time.perf_counter() > deadline:
                break
            time.sleep(0.02)
        if after is not None:
            tokens = after - before
    ttfts = [r.ttft for r in results if r.ttft is not None]
    agg = tokens / wall if wall > 0 else 0.0
    return LoadResult(clients=clients, requests=len(results), errors=sum(not r.ok for r in results),
                      wall_s=wall, tokens=tokens, usage_tokens=usage_tokens, tokens_per_s=agg, per_client_tokens_per_s=agg / clients,
                      ttft_p50=_percentile(ttfts, 0.5), ttft_p95=_percentile(ttfts, 0.95), results=results)


# ---------------------------------------------------------------- starting a server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    conn, base = _connect(url, timeout)
    try:
        conn.request("GET", base)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"llmq-server exited with {proc.returncode} while starting")
        try:
            if http_get(url + "/health", 2.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout} s")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8080)")
    ap.add_argument("--server", help="llmq-server binary to start (with --model)")
    ap.add_argument("--model", help="model file for --server")
    ap.add_argument("--parallel", type=int, default=8, help="--parallel for a started server")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for a started server")
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts to measure in turn")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    ap.add_argument("--requests", type=int, default=1, help="requests per client")
    ap.add_argument("--rounds", type=int, default=1, help="repeat each client count; the best round is reported")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--api-key")
    ap.add_argument("--json", action="store_true", help="print one JSON object per client count")
    args = ap.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        if not (args.server and args.model):
            ap.error("give --url, or --server and --model")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [args.server, "-m", args.model, "--port", str(port), "--parallel", str(args.parallel),
               *args.server_arg]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_healthy(url, proc)
    try:
        print(f"# {cpu_name()}, {os.cpu_count()} CPUs; {url}; max_tokens {args.tokens}, "
              f"{args.requests} request(s) per client", file=sys.stderr)
        stream_completion(url, args.prompt, 8, chat=args.chat, api_key=args.api_key)  # warm-up
        time.sleep(0.3)  # the server counts the warm-up's tokens just after its [DONE]
        base = None
        for n in (int(x) for x in args.clients.split(",")):
            best = None
            for _ in range(args.rounds):
                r = run_load(url, n, args.tokens, args.requests, prompt=args.prompt, chat=args.chat,
                             temperature=args.temperature, api_key=args.api_key)
                if best is None or r.tokens_per_s > best.tokens_per_s:
                    best = r
            base = base or best.tokens_per_s
            if args.json:
                d = {k: v for k, v in best.__dict__.items() if k != "results"}
                d["speedup_vs_first"] = best.tokens_per_s / base if base else None
                print(json.dumps(d))
            else:
                print(best.line() + (f", x{best.tokens_per_s / base:.2f} vs the first" if base else ""))
            for r in best.results:
                if not r.ok:
                    print(f"  error: {r.error}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
