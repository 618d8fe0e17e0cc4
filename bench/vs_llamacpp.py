#!/usr/bin/env python3
"""llmq against llama.cpp on the same GGUF bytes, side by side on this machine, interleaved.

For each GGUF: llmq-convert (a lossless repack), then ROUNDS rounds of
`llama-bench -m X.gguf -p P -n N -t T -r R -o json` and `llmq-bench -m X.llmq -t T -r R` (`-p P -n 1`
for prefill, `-p 1 -n N` for decode: from an empty context, as llama-bench's tg), alternating; the
best of the rounds of each. Prints one table (prefill pp and decode tg tok/s,
ratios llmq / llama.cpp, llmq's decode fraction of the measured read bandwidth and prefill fraction
of the measured int8 dot-product peak) with the CPU model and ISA level, and the raw numbers as
JSON lines on stderr.

    bench/vs_llamacpp.py [--peer build-peer/cpu/bin] [--level avx512|avx2] [-t 2] [--rounds 2]
                         [-p 512] [-n 128] GGUF...

The peer comes from scripts/peer_cpu.sh (native, or `avx2` for an AVX2-only build to compare with
`--level avx2`, which sets LLMQ_CPU for llmq).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_json(cmd, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out)


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def peer_round(peer, gguf, a):
    rows = run_json([str(peer / "llama-bench"), "-m", str(gguf), "-p", str(a.p), "-n", str(a.n), "-t", str(a.t),
                     "-r", str(a.r), "-o", "json"])
    # The best repetition, as llmq-bench reports (llama-bench's avg_ts is their mean).
    best = lambda r: max(r.get("samples_ts") or [r["avg_ts"]])
    pp = next(best(r) for r in rows if r["n_prompt"] > 0)
    tg = next(best(r) for r in rows if r["n_gen"] > 0)
    return {"prefill_tok_s": pp, "decode_tok_s": tg}


def llmq_round(model, a, env):
    # Two runs, so that both tools measure the same work: llama-bench's tg decodes from an empty
    # context, llmq-bench's decode follows its prompt (here 1 token instead of P, whose KV cache
    # would add P positions of attention to every step).
    bench = [str(ROOT / "build/llmq-bench"), "-m", str(model), "-t", str(a.t), "-r", str(a.r)]
    pp = run_json(bench + ["-p", str(a.p), "-n", "1"], env)
    j = run_json(bench + ["-p", "1", "-n", str(a.n)], env)
    j["prefill_tok_s"] = pp["prefill_tok_s"]
    j["prefill_fraction_of_int8_peak"] = pp.get("prefill_fraction_of_int8_peak", 0)
    return j


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--peer", default=str(ROOT / "build-peer/cpu/bin"))
    ap.add_argument("--level", default=None, help="LLMQ_CPU for llmq (avx512, avx2); default: the best")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=2, help="repetitions inside each tool")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    peer = Path(a.peer)
    if not (peer / "llama-bench").exists():
        sys.exit(f"no llama-bench in {peer}: run scripts/peer_cpu.sh")
    env = dict(os.environ)
    if a.level:
        env["LLMQ_CPU"] = a.level
    tmp = ROOT / "bench/tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for g in map(Path, a.gguf):
        model = tmp / (g.stem + ".llmq")
        subprocess.run([str(ROOT / "build/llmq-convert"), str(g), "-o", str(model), "-f", "--no-progress"],
                       check=True, capture_output=True)
        best_p, best_q = None, None
        for _ in range(a.rounds):
            p = peer_round(peer, g, a)
            q = llmq_round(model, a, env)
            print(json.dumps({"gguf": g.name, "llama.cpp": p, "llmq": q}), file=sys.stderr)
            best_p = p if best_p is None else {k: max(best_p[k], p[k]) for k in p}
            if best_q is None or q["decode_tok_s"] > best_q["decode_tok_s"]:
                best_q = dict(q, prefill_tok_s=max(q["prefill_tok_s"], best_q["prefill_tok_s"] if best_q else 0))
        rows.append((g.stem, best_p, best_q))
    level = rows[0][2].get("cpu_kernels", "?") if rows else "?"
    print(f"CPU: {cpu_model()}, llmq kernels: {level}, {a.t} threads, pp{a.p} / tg{a.n} (decode from an empty "
          f"context, as llama-bench's tg), best of {a.rounds} interleaved rounds; peer: {peer}")
    print("| model | llmq pp | llama.cpp pp | ratio | llmq tg | llama.cpp tg | ratio | tg of read BW | pp of int8 peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p, q in rows:
        print(f"| {name} | {q['prefill_tok_s']:.1f} | {p['prefill_tok_s']:.1f} | {q['prefill_tok_s'] / p['prefill_tok_s']:.2f}x "
              f"| {q['decode_tok_s']:.1f} | {p['decode_tok_s']:.1f} | {q['decode_tok_s'] / p['decode_tok_s']:.2f}x "
              f"| {q.get('decode_bandwidth_fraction', 0):.2f} | {q.get('prefill_fraction_of_int8_peak', 0):.2f} |")


if __name__ == "__main__":
    main()
