#!/usr/bin/env python3
"""Time to first token with and without the prefix cache (issue 21, item 5): llmq-server on
MODEL, a long shared system prompt (about 1,500 tokens), then a second request with the same
system prompt and another question. Prints one JSON line: prompt tokens, cached tokens and
TTFT cold and warm (max_tokens 1, so the time is the prefill), and their ratio; the same again
with --no-prefix-cache as the control.

    bench/prefix_cache.py MODEL.llmq [THREADS=2]
"""
import json
import sys
import time
import urllib.request
from pathlib import Path

from llmq_server import llmq_server

SYSTEM = " ".join(f"Rule {i}: answer politely, briefly and truthfully about topic number {i}." for i in range(78))


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=600) as r:
        return time.time() - t0, json.load(r)


def measure(model, threads, extra):
    with llmq_server(model, "-t", threads, *extra) as (_, base):
        ask = lambda q: post(base, {"max_tokens": 1, "temperature": 0,
                                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]})
        cold, a = ask("Hello!")
        warm, b = ask("Good morning!")
        return {"prompt_tokens": b["usage"]["prompt_tokens"],
                "cached_tokens": b["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
                "ttft_cold_s": round(cold, 4), "ttft_warm_s": round(warm, 4), "speedup": round(cold / warm, 1)}


def main():
    model, threads = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "2"
    print(json.dumps({"model": Path(model).name, "threads": int(threads), "prefix_cache": measure(model, threads, []),
                      "no_prefix_cache": measure(model, threads, ["--no-prefix-cache"])}))


if __name__ == "__main__":
    main()
