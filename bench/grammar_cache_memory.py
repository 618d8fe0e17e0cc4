#!/usr/bin/env python3
"""Does the compiled-grammar cache keep llmq-server's memory bounded (issue 22)? Starts
llmq-server on MODEL (extra server arguments after the count) and sends N structured-output
requests, each with a JSON schema no earlier request used (so each one is compiled and cached),
max_tokens 1, one at a time. Prints the server's resident memory (VmRSS) every N/20 requests
and the compile time per schema; the RSS must level off once the cache is full.

    bench/grammar_cache_memory.py MODEL.llmq [N=2000] [server args...]
"""
import json
import sys
import time
import urllib.request
from pathlib import Path

from llmq_server import llmq_server


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def schema(i):
    """A schema of a few typical fields whose names and bounds depend on i (all distinct)."""
    return {"type": "object",
            "properties": {f"name_{i}": {"type": "string", "maxLength": 20 + i % 7},
                           f"count_{i}": {"type": "integer", "minimum": i % 13},
                           "tags": {"type": "array", "items": {"enum": [f"t{i}", f"u{i}", "v"]}}},
            "required": [f"name_{i}", f"count_{i}"]}


def main():
    model = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    extra = sys.argv[3:]
    with llmq_server(model, "-t", "1", "--parallel", "1", *extra, timeout_s=300) as (srv, base):
        print(f"model {Path(model).name}, {n} distinct schemas, server args {extra or 'default'}")
        print("| requests | VmRSS MiB | ms per request (last interval) |\n|---:|---:|---:|")
        print(f"| 0 | {rss_mib(srv.pid):.1f} | |")
        step, t0 = max(1, n // 20), time.time()
        for i in range(1, n + 1):
            body = {"prompt": "Give me JSON:", "max_tokens": 1,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(i)}}}
            req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=600).read()
            if i % step == 0:
                now = time.time()
                print(f"| {i} | {rss_mib(srv.pid):.1f} | {1000 * (now - t0) / step:.1f} |", flush=True)
                t0 = now


if __name__ == "__main__":
    main()
