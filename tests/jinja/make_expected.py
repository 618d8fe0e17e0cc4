#!/usr/bin/env python3
"""The oracle of tests/test_jinja.cpp: Python's jinja2 set up as Hugging Face transformers sets it
up for chat templates (transformers/utils/chat_template_utils.py, _compile_jinja_template):

  ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
  filters["tojson"]  = json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
                                  sort_keys=sort_keys)   (transformers' override)
  globals["raise_exception"] = raise TemplateError(message)
  globals["strftime_now"]    = a fixed time, 2024-07-26 10:30:00, for deterministic outputs
                               (the C++ test passes the same time in RenderOptions::now)

and the variables transformers passes (render_jinja_template): messages, tools (None when there
are none), documents (None), add_generation_prompt, the tokenizer's special tokens, and the
conversation's extra keyword arguments.

It renders every template of TEMPLATES over every conversation of conversations.json and writes
expected/<template>.json: per conversation the output, or the exception's type and message.
It also checks the construct tables of tests/test_jinja.cpp (between the BEGIN/END CONSTRUCTS
markers): each {R"J(template)J", R"J(expected)J"} pair must render so with jinja2 over
unit_context.json, and each template of kErrors must raise.

  python3 tests/jinja/make_expected.py          # writes expected/*.json, checks the C++ tables
  python3 tests/jinja/make_expected.py --check  # writes nothing; exit 1 on any difference

Needs python3 with jinja2 >= 3.1 (Debian: apt-get install python3-jinja2).
"""
import datetime
import json
import os
import re
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
NOW = datetime.datetime(2024, 7, 26, 10, 30, 0)

# template name -> (file, special tokens the tokenizer would pass)
TEMPLATES = {
    "qwen2.5": ("qwen2.5.jinja", {"eos_token": "<|im_end|>"}),
    "qwen3": ("qwen3.jinja", {"eos_token": "<|im_end|>"}),
    "llama3.1": ("llama3.1.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "llama3.2": ("llama3.2.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "gemma3": ("gemma3.jinja", {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "mistral": ("mistral.jinja", {"bos_token": "<s>", "eos_token": "</s>"}),
    "smollm2": ("smollm2.jinja", {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
    "phi3": ("phi3.jinja", {"bos_token": "<s>", "eos_token": "<|endoftext|>"}),
    "constructs": ("constructs.jinja", {"bos_token": "<s>", "eos_token": "</s>"}),
}


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return NOW.strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(env, source, variables):
    try:
        return {"output": env.from_string(source).render(**variables)}
    except Exception as e:  # the C++ side must throw too; TemplateError's message must match
        return {"error_type": type(e).__name__, "error": str(e)}


def context(conv, special_tokens):
    """The variables as transformers passes them."""
    v = {
        "messages": conv["messages"],
        "tools": conv.get("tools"),
        "documents": None,
        "add_generation_prompt": conv["add_generation_prompt"],
    }
    v.update(special_tokens)
    v.update(conv.get("kwargs", {}))
    return v


def expected_files(env):
    with open(os.path.join(HERE, "conversations.json"), encoding="utf-8") as f:
        convs = json.load(f)
    out = {}
    for name, (file, tokens) in TEMPLATES.items():
        with open(os.path.join(HERE, file), encoding="utf-8", newline="") as f:
            source = f.read()
        cases = []
        for conv in convs:
            case = {"conversation": conv["name"]}
            case.update(render(env, source, context(conv, tokens)))
            cases.append(case)
        doc = {"template": file, "special_tokens": tokens, "now": NOW.isoformat(), "jinja2": jinja2.__version__, "cases": cases}
        out[name] = json.dumps(doc, ensure_ascii=False, indent=1) + "\n"
    return out


RAW = r'R"J\((.*?)\)J"'


def cpp_tables():
    """The construct and error tables of test_jinja.cpp, as (template, expected) and templates."""
    with open(os.path.join(HERE, "..", "test_jinja.cpp"), encoding="utf-8") as f:
        src = f.read()
    m = re.search(r"// BEGIN CONSTRUCTS(.*?)// END CONSTRUCTS", src, re.S)
    pairs = re.findall(r"\{\s*" + RAW + r"\s*,\s*" + RAW + r"\s*\}", m.group(1), re.S) if m else []
    m = re.search(r"// BEGIN ERRORS(.*?)// END ERRORS", src, re.S)
    errors = re.findall(RAW, m.group(1), re.S) if m else []
    return pairs, errors


def check_cpp(env):
    with open(os.path.join(HERE, "unit_context.json"), encoding="utf-8") as f:
        variables = json.load(f)
    pairs, errors = cpp_tables()
    bad = 0
    for source, want in pairs:
        got = render(env, source, variables)
        if got.get("output") != want:
            bad += 1
            print(f"construct {source!r}: jinja2 gives {got!r}, the test expects {want!r}")
    for source in errors:
        got = render(env, source, variables)
        if "error" not in got:
            bad += 1
            print(f"error case {source!r}: jinja2 renders {got['output']!r}")
    print(f"C++ tables: {len(pairs)} constructs, {len(errors)} error cases, {bad} wrong")
    return bad


def main():
    check = "--check" in sys.argv[1:]
    env = make_env()
    bad = 0
    for name, text in expected_files(env).items():
        path = os.path.join(HERE, "expected", name + ".json")
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if check:
            def outcomes(doc):  # what was rendered, not which jinja2 rendered it
                return None if doc is None else {k: v for k, v in json.loads(doc).items() if k != "jinja2"}
            if outcomes(old) != outcomes(text):
                bad += 1
                print(f"{path}: differs from what jinja2 renders now")
        elif old != text:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {path}")
    bad += check_cpp(env)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
