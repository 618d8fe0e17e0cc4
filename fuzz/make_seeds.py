#!/usr/bin/env python3
"""Writes the seed corpora fuzz/corpus/<target>/: tiny, valid (or nearly) inputs of every
kind each fuzz target reads, so the fuzzer starts deep inside the readers. Every file stays
far below 64 KiB. Run from the repository root after building (the .llmq seeds come from the
real llmq-convert):  python3 fuzz/make_seeds.py [BUILD_DIR]   (default build/)

Synthetic files: tiny llama2.c checkpoints (legacy, v1, v2) and tokenizer.bin files, GGUF
models (tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K) and a
GGUF byte-level vocabulary, safetensors files. Real data from ../shared: tok512.bin, the
llama.cpp tokenizer test inputs (texts for the tokenizer targets). Random bytes use a fixed
seed, so the output is reproducible."""
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("LLMQ_SHARED_DIR", os.path.join(ROOT, "..", "shared"))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
OUT = os.path.join(ROOT, "fuzz", "corpus")
rng = random.Random(8)


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    assert len(data) < 64 << 10, (target, name, len(data))
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def floats(n, scale=0.1):
    return struct.pack("<%df" % n, *[rng.uniform(-scale, scale) for _ in range(n)])


# ---------------------------------------------------------------- llama2.c

def llama2c(version, dim, hidden, layers, heads, kv_heads, vocab, seq, shared=True, group=0):
    hd = dim // heads
    kvd = kv_heads * hd
    params = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab if shared or version else -vocab, seq)
    mats = [("emb", vocab * dim)]
    norms_first = version != 0
    body = b""
    if version == 0:
        body += floats(vocab * dim)
        body += floats(layers * dim, 1) + floats(layers * dim * dim) + floats(layers * kvd * dim) * 2
        body += floats(layers * dim * dim) + floats(layers * dim, 1)
        body += floats(layers * hidden * dim) + floats(layers * dim * hidden) + floats(layers * hidden * dim)
        body += floats(dim, 1) + floats(2 * seq * (hd // 2))
        if not shared:
            body += floats(vocab * dim)
        return params + body
    header = struct.pack("<Ii", 0x616B3432, version) + params + struct.pack("<B", 1 if shared else 0)
    if version == 2:
        header += struct.pack("<i", group)
    header += b"\0" * (256 - len(header))
    body = floats(layers * dim, 1) * 2 + floats(dim, 1)

    def q8(n):
        return bytes(rng.randrange(256) for _ in range(n)) + floats(n // group, 0.01)

    w = q8 if version == 2 else floats
    sizes = [vocab * dim] + [layers * dim * dim, layers * kvd * dim, layers * kvd * dim, layers * dim * dim,
                             layers * hidden * dim, layers * dim * hidden, layers * hidden * dim]
    if not shared:
        sizes.append(vocab * dim)
    for n in sizes:
        body += w(n)
    return header + body


def tokenizer_bin(pieces):
    out = struct.pack("<i", max(len(p.encode()) for p in pieces))
    for i, p in enumerate(pieces):
        b = p.encode()
        out += struct.pack("<fi", -float(i), len(b)) + b
    return out


TINY_PIECES = ["<unk>", "\n<s>\n", "\n</s>\n", " ", "a", "b", "ab", " a"]

# ---------------------------------------------------------------- GGUF

GGUF_BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
              10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gval(v):
    """(type id, encoded value) for a Python value: str, int (u32), float (f32), bool, lists."""
    if isinstance(v, bool):
        return 7, struct.pack("<B", v)
    if isinstance(v, str):
        return 8, gstr(v)
    if isinstance(v, int):
        return 4, struct.pack("<I", v)
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, tuple):  # ("i32", [..]) / ("f32", [..]) / ("str", [..])
        kind, items = v
        t = {"i32": 5, "f32": 6, "str": 8}[kind]
        enc = {"i32": lambda x: struct.pack("<i", x), "f32": lambda x: struct.pack("<f", x), "str": gstr}[kind]
        return 9, struct.pack("<IQ", t, len(items)) + b"".join(enc(x) for x in items)
    raise TypeError(v)


def gguf(kv, tensors, align=32):
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, v in kv.items():
        t, enc = gval(v)
        out += gstr(k) + struct.pack("<I", t) + enc
    data = b""
    for name, shape, ty, *given in tensors:  # shape outermost first; optionally the tensor's bytes
        blk, nb = GGUF_BLOCK[ty]
        ne = list(reversed(shape))
        n = ne[0] // blk * nb
        for d in ne[1:]:
            n *= d
        while len(data) % align:
            data += b"\0"
        out += gstr(name) + struct.pack("<I", len(ne)) + struct.pack("<%dQ" % len(ne), *ne)
        out += struct.pack("<IQ", ty, len(data))
        if given:
            data += given[0]
        elif ty == 0:
            data += floats(n // 4, 0.5)
        else:  # bytes below 0x30: every f16/bf16 scale or weight stays small and finite
            data += bytes(rng.randrange(0x30) for _ in range(n))
    while len(out) % align:
        out += b"\0"
    return out + data


def gguf_llama(types, layers=1, dim=32, hidden=32, vocab=8, tied=True, extra_kv=None):
    kv = {
        "general.architecture": "llama", "general.alignment": 32,
        "llama.embedding_length": dim, "llama.feed_forward_length": hidden, "llama.block_count": layers,
        "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1, "llama.context_length": 16,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ("str", ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "ab", "\u2581a"][:vocab]),
        "tokenizer.ggml.scores": ("f32", [-float(i) for i in range(vocab)]),
        "tokenizer.ggml.token_type": ("i32", [2, 3, 3] + [1] * (vocab - 3)),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{{ '<|im_start|>' + message['role'] }}",
    }
    kv.update(extra_kv or {})
    hd = dim // 2
    t = [("token_embd.weight", [vocab, dim], types["emb"])]
    for i in range(layers):
        p = "blk.%d." % i
        t += [(p + "attn_norm.weight", [dim], 0), (p + "attn_q.weight", [dim, dim], types["q"]),
              (p + "attn_k.weight", [hd, dim], types["k"]), (p + "attn_v.weight", [hd, dim], types["v"]),
              (p + "attn_output.weight", [dim, dim], types["o"]), (p + "ffn_norm.weight", [dim], 0),
              (p + "ffn_gate.weight", [hidden, dim], types["gate"]), (p + "ffn_up.weight", [hidden, dim], types["up"]),
              (p + "ffn_down.weight", [dim, hidden], types["down"])]
    t.append(("output_norm.weight", [dim], 0))
    if not tied:
        t.append(("output.weight", [vocab, dim], types["emb"]))
    return gguf(kv, t)


def gguf_arch(arch, fused=False, qk_norm=False, extra_kv=None, extra_tensors=()):
    """A tiny F32 model of `arch` (dim 32, 2 heads of 16, 1 KV head, hidden 32, vocabulary 8) as
    llama.cpp lays it out: with `fused`, attn_qkv and a gate+up ffn_up (Phi-3)."""
    kv = {"general.architecture": arch, "general.alignment": 32,
          arch + ".embedding_length": 32, arch + ".feed_forward_length": 32, arch + ".block_count": 1,
          arch + ".attention.head_count": 2, arch + ".attention.head_count_kv": 1, arch + ".context_length": 16,
          arch + ".attention.layer_norm_rms_epsilon": 1e-5, arch + ".rope.freq_base": 10000.0,
          "tokenizer.ggml.model": "llama",
          "tokenizer.ggml.tokens": ("str", ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "ab", "\u2581a"]),
          "tokenizer.ggml.scores": ("f32", [-float(i) for i in range(8)]),
          "tokenizer.ggml.token_type": ("i32", [2, 3, 3, 1, 1, 1, 1, 1]),
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    kv.update(extra_kv or {})
    p = "blk.0."
    t = [("token_embd.weight", [8, 32], 0), (p + "attn_norm.weight", [32], 0)]
    t += [(p + "attn_qkv.weight", [64, 32], 0)] if fused else [
        (p + "attn_q.weight", [32, 32], 0), (p + "attn_k.weight", [16, 32], 0), (p + "attn_v.weight", [16, 32], 0)]
    if qk_norm:
        t += [(p + "attn_q_norm.weight", [16], 0), (p + "attn_k_norm.weight", [16], 0)]
    t += [(p + "attn_output.weight", [32, 32], 0), (p + "ffn_norm.weight", [32], 0)]
    t += [(p + "ffn_up.weight", [64, 32], 0)] if fused else [
        (p + "ffn_gate.weight", [32, 32], 0), (p + "ffn_up.weight", [32, 32], 0)]
    t += [(p + "ffn_down.weight", [32, 32], 0), ("output_norm.weight", [32], 0)]
    return gguf(kv, t + list(extra_tensors))


def gguf_bpe_vocab():
    chars = [chr(c) for c in range(0x21, 0x7F)]
    toks = chars + ["Ġ", "Ġt", "he", "Ġthe", "<|endoftext|>"]
    return gguf({
        "general.architecture": "gpt2", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ("str", toks),
        "tokenizer.ggml.token_type": ("i32", [1] * (len(toks) - 1) + [3]),
        "tokenizer.ggml.merges": ("str", ["Ġ t", "h e", "Ġt he"]),
        "tokenizer.ggml.bos_token_id": len(toks) - 1, "tokenizer.ggml.eos_token_id": len(toks) - 1,
    }, [])

# ---------------------------------------------------------------- safetensors

def safetensors(entries, meta=None, pad=0):
    header, data = {}, b""
    for name, dtype, shape, size, *given in entries:  # optionally the tensor's bytes
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += given[0] if given else bytes(rng.randrange(256) for _ in range(n))
    if meta is not None:
        header["__metadata__"] = meta
    h = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(h)) + h + data


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    # llama2c: checkpoints and tokenizer files (the target reads the same bytes as both).
    put("llama2c", "legacy-shared.bin", llama2c(0, 8, 16, 1, 2, 1, 8, 4))
    put("llama2c", "legacy-unshared.bin", llama2c(0, 8, 16, 2, 2, 2, 8, 4, shared=False))
    put("llama2c", "v1.bin", llama2c(1, 8, 16, 1, 2, 1, 8, 4))
    put("llama2c", "v2-group8.bin", llama2c(2, 8, 16, 1, 2, 1, 8, 4, shared=False, group=8))
    put("llama2c", "tokenizer-tiny.bin", tokenizer_bin(TINY_PIECES))
    shutil.copy(os.path.join(SHARED, "models/stories260K/tok512.bin"), os.path.join(OUT, "llama2c", "tok512.bin"))

    # llmq_file: tiny checkpoints converted by the real llmq-convert, several types.
    convert = os.path.join(BUILD, "llmq-convert")
    with tempfile.TemporaryDirectory() as tmp:
        small = os.path.join(tmp, "small.bin")
        wide = os.path.join(tmp, "wide.bin")
        tok = os.path.join(tmp, "tok.bin")
        with open(small, "wb") as f:
            f.write(llama2c(0, 8, 16, 1, 2, 1, 8, 4))
        with open(wide, "wb") as f:
            f.write(llama2c(0, 32, 32, 1, 2, 1, 8, 8, shared=False))
        with open(tok, "wb") as f:
            f.write(tokenizer_bin(TINY_PIECES))
        runs = [("f32-dim8", small, ["--type", "f32"]), ("q8_0", wide, ["--type", "q8_0"]),
                ("q4_0-f16-bf16", wide, ["--type", "q4_0", "--tensor-type", "token_embd.weight=f16",
                                              "--tensor-type", "output.weight=bf16"]),
                ("q4_1", wide, ["--type", "q4_1"])]
        for name, ckpt, args in runs:
            out = os.path.join(tmp, name + ".llmq")
            subprocess.run([convert, ckpt, "--tokenizer", tok, "-o", out, "--no-progress", "-f"] + args,
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out, "rb") as f:
                put("llmq_file", name, f.read())

    # gguf: tiny llama models in every supported tensor type, a byte-level vocabulary.
    simple = {"emb": 8, "q": 2, "k": 3, "v": 6, "o": 7, "gate": 1, "up": 30, "down": 0}
    put("gguf", "llama-mixed", gguf_llama(simple, tied=False))
    put("gguf", "llama-kquants", gguf_llama({**simple, "down": 12, "gate": 2, "up": 3}, hidden=256,
                                                  extra_kv={"general.file_type": 15}))
    put("gguf", "llama-q5k", gguf_llama({**simple, "down": 13, "gate": 2, "up": 3}, hidden=256))
    put("gguf", "llama-q6k", gguf_llama({**simple, "down": 14, "gate": 2, "up": 3}, hidden=256))
    put("gguf", "vocab-gpt2", gguf_bpe_vocab())

    # safetensors
    put("safetensors", "two-tensors.seed",
        safetensors([("model.embed_tokens.weight", "F32", [8, 4], 4), ("model.norm.weight", "BF16", [4], 2)],
                    meta={"format": "pt"}))
    put("safetensors", "dtypes-padded.seed",
        safetensors([("a", "F16", [2, 3], 2), ("b", "I64", [2], 8), ("c", "U8", [], 1), ("d", "F64", [0, 5], 8)], pad=5))

    # tokenizers: flag byte + text (llama.cpp's tokenizer test inputs) or + ids (decode mode).
    def texts(vocab_file):
        with open(os.path.join(SHARED, "tokenizers/llamacpp-vocab", vocab_file), encoding="utf-8") as f:
            return [t for t in f.read().split("\n__ggml_vocab_test__\n") if len(t.encode()) < 4096]

    for target, inp in (("tokenizer_spm", "ggml-vocab-llama-spm.gguf.inp"), ("tokenizer_bpe", "ggml-vocab-gpt-2.gguf.inp")):
        for i, t in enumerate(texts(inp)):
            put(target, "text-%02d" % i, bytes([(i * 5) % 16]) + t.encode())
        put(target, "special", bytes([8 | 4]) + b"<s>Hello</s> <|endoftext|> <unk>")
        put(target, "ids", bytes([32 | 16]) + struct.pack("<8i", 0, 1, 2, 3, 100, 259, 300, 511))
        put(target, "ids-bad", bytes([32]) + struct.pack("<3i", 5, -1, 1 << 30))

    # chat_template: flag byte + fields separated by NUL: [jinja,] (role byte + role, content)...
    smol = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    conv = b"\0".join([b"\x00", b"Be brief.", b"\x01", b"Hi", b"\x02", b"Hello!", b"\x01", b"2+2?"])
    for i, name in enumerate(["chatml", "llama2", "llama3", "mistral", "zephyr", "gemma", "phi3"]):
        put("chat_template", "by-name-" + name, bytes([(i << 1) | 1]) + conv)
    for i, j in enumerate([smol, "{{ bos_token + '[INST] ' + '<<SYS>>\\n' + content }}", "{{ '<start_of_turn>' }}",
                           "{{ '<|user|>' + '<|end|>' }}", "{{ messages }}"]):
        put("chat_template", "jinja-%d" % i, bytes([(7 << 1) | (i & 1)]) + j.encode() + b"\0" + conv)
    put("chat_template", "unknown-role", bytes([1]) + b"\x03tool\0result")

    # server_request: flag byte (1 = chat) + body.
    bodies = [
        (1, {"model": "smollm2", "messages": [{"role": "system", "content": "You tell short stories."},
                                              {"role": "user", "content": "Hi"}], "max_tokens": 16,
             "temperature": 0.7, "top_p": 0.9, "stream": True, "stream_options": {"include_usage": True},
             "logprobs": True, "top_logprobs": 3, "stop": ["\n", "END"], "seed": 42}),
        (1, {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None}], "n": 1, "max_completion_tokens": 8}),
        (1, {"messages": [{"role": "wizard", "content": "x"}]}),
        (0, {"prompt": "Once upon a time", "max_tokens": 32, "logprobs": 2, "top_k": 40, "min_p": 0.05,
             "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "stop": "."}),
        (0, {"prompt": [1, 2, 3, 4], "model": "other"}),
        (0, {"prompt": ["one"], "temperature": 3}),
    ]
    for i, (chat, b) in enumerate(bodies):
        put("server_request", "body-%d" % i, bytes([chat]) + json.dumps(b).encode())
    put("server_request", "malformed", b"\x01{\"messages\": [")

    # Added later, at the end so the seeds above keep their bytes (one random stream):
    # architectures beyond llama in GGUF (phi3's fused qkv and gate+up with LongRoPE factor
    # tensors, llama 3.1's rope_freqs, qwen3's QK-norm) and requests with structured outputs,
    # forced tool calls and fill-in-the-middle.
    put("gguf", "phi3-fused-longrope", gguf_arch("phi3", fused=True, extra_kv={
        "phi3.rope.scaling.original_context_length": 8, "phi3.rope.scaling.attn_factor": 1.1,
        "phi3.attention.sliding_window": 4},
        extra_tensors=[("rope_factors_long.weight", [8], 0, struct.pack("<8f", *[1.0 + 2 * i for i in range(8)])),
                       ("rope_factors_short.weight", [8], 0, struct.pack("<8f", *[1.0 + 0.1 * i for i in range(8)]))]))
    put("gguf", "llama-rope-freqs", gguf_arch("llama", extra_tensors=[
        ("rope_freqs.weight", [8], 0, struct.pack("<8f", 1, 1, 1, 1.5, 3, 6, 8, 8))]))
    put("gguf", "qwen3-qk-norm", gguf_arch("qwen3", qk_norm=True))
    more = [
        (1, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
        (1, {"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= \"yes\" | \"no\""}),
        (1, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
             "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        (0, {"prompt": "def f(x):", "suffix": "\n    return y\n", "max_tokens": 8}),
    ]
    for i, (chat, b) in enumerate(more):
        put("server_request", "body-format-%d" % i, bytes([chat]) + json.dumps(b).encode())

    responses = [
        {"model": "smollm2", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                   {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
         "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}], "tool_choice": {"type": "function", "name": "w"},
         "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}, "stream": True},
    ]
    for i, b in enumerate(responses):
        put("server_request", "responses-%d" % i, bytes([2]) + json.dumps(b).encode())

    # /v1/embeddings bodies (flag byte 4) and a completions body that scores its prompt (echo + logprobs).
    embeds = [{"input": ["hello", "world"], "encoding_format": "base64", "model": "smollm2"},
              {"input": [[1, 2, 3], [4]], "dimensions": 576}, {"input": [5, 6, 7], "user": "u"}]
    for i, b in enumerate(embeds):
        put("server_request", "embed-%d" % i, bytes([4]) + json.dumps(b).encode())
    put("server_request", "echo-logprobs", bytes([0]) + json.dumps({"prompt": "Once", "echo": True, "logprobs": 2, "max_tokens": 0}).encode())

    # http_request: raw client bytes (fuzz/http_request.cpp): keep-alive and pipelined requests,
    # a chunked body, HTTP/1.0, a header at the limits, a request cut short.
    body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    http = {
        "get": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "pipelined": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post % (len(body), body) + b"GET /stream HTTP/1.1\r\n\r\n",
        "chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        "http10": b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
        "many-headers": b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(120)) + b"\r\n",
        "cut": post % (100, body),
    }
    for name, data in http.items():
        put("http_request", name, data)

    # structured_output: kind byte (0 schema, 1 grammar, 2 schema in tool-call tags, 3 json_object;
    # +4 strict) + the schema or grammar text.
    seeds = {
        "schema_person": (0 | 4, json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                                          "age": {"type": "integer", "minimum": 0}},
                                             "required": ["name", "age"], "additionalProperties": False})),
        "schema_nested": (0, json.dumps({"type": "object", "properties": {
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["a", "b", 1, None]}},
            "n": {"type": "number"}, "ok": {"type": "boolean"}}})),
        "schema_anyof_ref": (0, json.dumps({"$defs": {"p": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
                                            "anyOf": [{"$ref": "#/$defs/p"}, {"type": "integer", "maximum": 9}]})),
        "schema_bad_type": (0, json.dumps({"type": "wat"})),
        "schema_not_json": (0, '{"type": "object",'),
        "grammar_yes_no": (1, 'root ::= ("yes" | "no") ", " [a-z ]+ "."'),
        "grammar_recursive": (1, 'root ::= item ("," item)*\nitem ::= [0-9]+ | "(" root ")"'),
        "grammar_undefined": (1, "root ::= missing"),
        "tool_call": (2, json.dumps({"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
                                     "required": ["name", "arguments"]})),
        "json_object": (3, ""),
    }
    for name, (kind, text) in seeds.items():
        put("structured_output", name, bytes([kind]) + text.encode())

    # Added after the others so that the fixed-seed random bytes of the seeds above stay the same.
    put("gguf", "llama-q2k", gguf_llama({**simple, "down": 10, "gate": 2, "up": 3}, hidden=256))
    put("gguf", "llama-q3k", gguf_llama({**simple, "down": 11, "gate": 2, "up": 3}, hidden=256))


if __name__ == "__main__":
    main()
