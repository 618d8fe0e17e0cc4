#!/usr/bin/env python3
"""What constrained decoding costs per generated token (issue 21: at most 5% of decode time at
batch 1 and 8). Starts llmq-server on MODEL with --parallel 8 and, for batch 1 and 8, runs BATCH
concurrent completions of N tokens, interleaved, free (end-of-sequence tokens banned by
logit_bias, so they run to N) and under a constraint that never completes, so they run to N too:

- "string": a GBNF grammar of a JSON object whose string value never closes, the steady state of
  a long string field (what most of a structured reply's tokens are);
- "minLength": the JSON schema {"story": string, minLength 4000}; xgrammar expands the length
  into a repetition, and accepting a token then costs about 1 ms on SmolLM2 (a cost of length
  constraints, not of masks).

Prints decode tok/s, the throughput cost, and the share of wall time the server's scheduler
spent on the constraint (masks and accepting tokens: llmq_constraint_seconds_total).

    bench/structured_cost.py MODEL.llmq [N=96] [THREADS=2]
"""
import concurrent.futures as cf
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from llmq_server import llmq_server

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}
STRING_GRAMMAR = r'root ::= "{\"story\": \"" char*' + "\n" + r'char ::= [^"\\\x00-\x1f] | "\\" ["\\/bfnrt]'


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def metric(base, name):
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def info_ids(model):
    out = subprocess.run([str(ROOT / "build/llmq-info"), model], capture_output=True, text=True).stdout
    return sorted({int(m) for m in re.findall(r"tokenizer\.(?:eos|eot|bos)_token_id\s+int\s+(\d+)", out)})


def run(base, batch, n, constraint, ban):
    body = {"prompt": "Write a long story about a lighthouse keeper.\n", "max_tokens": n, "temperature": 0.8}
    if constraint == "minLength":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    elif constraint == "string":
        body["grammar"] = STRING_GRAMMAR
    else:
        body["logit_bias"] = {str(i): -100 for i in ban}
    c0, t0 = metric(base, "llmq_constraint_seconds_total"), time.time()
    with cf.ThreadPoolExecutor(batch) as ex:
        outs = list(ex.map(lambda s: post(base + "/v1/completions", dict(body, seed=s)), range(batch)))
    wall = time.time() - t0
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return tokens / wall, (metric(base, "llmq_constraint_seconds_total") - c0) / wall, tokens


def main():
    model, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 96
    threads = sys.argv[3] if len(sys.argv) > 3 else "2"
    with llmq_server(model, "-t", threads, "--parallel", "8") as (_, base):
        ban = info_ids(model)
        print(f"model {Path(model).name}, {n} tokens per request, {threads} threads, banned ids {ban}")
        print("| constraint | batch | free tok/s | constrained tok/s | throughput cost | constraint share of wall time |")
        print("|---|---|---|---|---|---|")
        for kind in ("string", "minLength"):
            for batch in (1, 8):
                free, cons, share = [], [], []
                for _ in range(2):  # interleaved
                    free.append(run(base, batch, n, None, ban)[0])
                    tps, sh, _ = run(base, batch, n, kind, ban)
                    cons.append(tps)
                    share.append(sh)
                f, c = max(free), max(cons)
                print(f"| {kind} | {batch} | {f:.1f} | {c:.1f} | {100 * (1 - c / f):.1f}% | {100 * min(share):.2f}% |")


if __name__ == "__main__":
    main()
