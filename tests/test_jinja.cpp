// The Jinja2 chat-template interpreter (text/jinja.h) against Python's jinja2 set up as Hugging
// Face transformers sets it up: real chat templates (tests/jinja/*.jinja) over 30+ conversations
// with the outputs jinja2 renders (tests/jinja/expected/, written by tests/jinja/make_expected.py),
// a table of constructs and one of errors (checked against jinja2 by the same script), the API,
// hostile inputs and a fixed-seed mutation fuzz.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "text/jinja.h"

namespace fs = std::filesystem;
using llmq::UsageError;
using llmq::jinja::RenderOptions;
using llmq::jinja::Template;
using llmq::jinja::Value;
using ojson = nlohmann::ordered_json;

namespace {

fs::path fixture_dir() { return fs::path(__FILE__).parent_path() / "jinja"; }

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ojson read_json(const fs::path& p) { return ojson::parse(read_file(p)); }

/// make_expected.py's strftime_now time: 2024-07-26 10:30:00.
RenderOptions fixed_time() {
  std::tm t{};
  t.tm_year = 2024 - 1900, t.tm_mon = 6, t.tm_mday = 26, t.tm_hour = 10, t.tm_min = 30;
  RenderOptions o;
  o.now = t;
  return o;
}

/// The variables of make_expected.py's context(), as transformers passes them: messages, tools
/// (None without tools), documents (None), add_generation_prompt, the special tokens and the
/// conversation's extra keyword arguments.
Value conversation_context(const ojson& conv, const ojson& special_tokens) {
  Value v = Value::object();
  v.set("messages", Value::from_json(conv["messages"]));
  v.set("tools", conv.contains("tools") ? Value::from_json(conv["tools"]) : Value(nullptr));
  v.set("documents", nullptr);
  v.set("add_generation_prompt", conv["add_generation_prompt"].get<bool>());
  for (auto it = special_tokens.begin(); it != special_tokens.end(); ++it) v.set(it.key(), Value::from_json(it.value()));
  if (conv.contains("kwargs")) {
    for (auto it = conv["kwargs"].begin(); it != conv["kwargs"].end(); ++it) v.set(it.key(), Value::from_json(it.value()));
  }
  return v;
}

/// tests/jinja/unit_context.json: the variables of the construct and error tables.
const Value& unit_context() {
  static const Value v = Value::from_json(read_json(fixture_dir() / "unit_context.json"));
  return v;
}

std::string render_unit(const std::string& source) { return Template(source).render(unit_context(), fixed_time()); }

/// The message of the UsageError that rendering `source` throws ("" if it renders).
std::string error_of(const std::string& source, const RenderOptions& o = fixed_time()) {
  try {
    Template(source).render(unit_context(), o);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

struct Construct {
  const char* source;
  const char* expected;
};

// Each template renders `expected` over unit_context.json with jinja2 (make_expected.py checks
// every pair between these markers; it reads the R"J(...)J" strings).
// BEGIN CONSTRUCTS
const Construct kConstructs[] = {
    {R"J(Hello {{ s }}! {# a comment #}{{ n }} {{ f }} {{ t }} {{ z }} {{ e }} {{ undefined_name }}.)J",
     R"J(Hello Hello World! 5 2.5 True None [] .)J"},
    {R"J({{ "double" }} {{ 'single' }} {{ 'it\'s' }} {{ "tab\tnew\nline" }} {{ '\u00e9\x41\101' }} {{ 'a' 'b' }} {{ "{{ not a tag }}" }})J",
     R"J(double single it's tab	new
line éAA ab {{ not a tag }})J"},
    {R"J({{ 42 }} {{ -7 }} {{ 0x1F }} {{ 0o17 }} {{ 0b101 }} {{ 1_000 }} {{ 1.5 }} {{ 1e3 }} {{ 2.5E-3 }} {{ 1_0.5 }})J",
     R"J(42 -7 31 15 5 1000 1.5 1000.0 0.0025 10.5)J"},
    {R"J({{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1/3 }} {{ -0.0 }} {{ 2**0.5 }} {{ 10/2 }} {{ 1e300*1e300 }} {{ 123456789.125 }})J",
     R"J(1.0 0.30000000000000004 1e+16 1000000000000000.0 0.0001 1e-05 0.3333333333333333 -0.0 1.4142135623730951 5.0 inf 123456789.125)J"},
    {R"J({{ true }} {{ True }} {{ false }} {{ False }} {{ none }} {{ None }} {{ [true, none] }})J",
     R"J(True True False False None None [True, None])J"},
    {R"J({{ [1, 'a', "it's", 'say "hi"', none, true, 1.5, {'k': 'v'}, [], {}] }} {{ (1, 2) }} {{ (1,) }} {{ () }})J",
     R"J([1, 'a', "it's", 'say "hi"', None, True, 1.5, {'k': 'v'}, [], {}] (1, 2) (1,) ())J"},
    {R"J({{ {'a': 1, 'b': [1, 2], 'c': {'d': none}} }} {{ {'b': 1, 'a': 2, 'b': 3} }})J",
     R"J({'a': 1, 'b': [1, 2], 'c': {'d': None}} {'b': 3, 'a': 2})J"},
    {R"J({{ 'tab\there' ~ ['tab\there', 'new\nline', 'back\\slash', 'é😀\u200b\xa0'] }})J",
     R"J(tab	here['tab\there', 'new\nline', 'back\\slash', 'é😀\u200b\xa0'])J"},
    {R"J({{ 1 + 2 }} {{ 7 - 10 }} {{ 3 * 4 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** -1 }} {{ 1 + 2.5 }} {{ true + true }})J",
     R"J(3 -3 12 3.5 3 1 1024 -4 2 -2 3.0 0.5 0.5 3.5 2)J"},
    {R"J({{ 'ab' + 'cd' }} {{ 'ab' * 3 }} {{ 3 * 'x' }} {{ [1] + [2, 3] }} {{ [0] * 3 }} {{ 'a' ~ 1 ~ none ~ true ~ undefined_name ~ [1] }} {{ 'x' * -1 }}|)J",
     R"J(abcd ababab xxx [1, 2, 3] [0, 0, 0] a1NoneTrue[1] |)J"},
    {R"J({{ -n }} {{ +n }} {{ - -n }} {{ -f }} {{ not n }} {{ not not n }} {{ -n|abs }} {{ -(n|abs) }})J",
     R"J(-5 5 5 -2.5 False True 5 -5)J"},
    {R"J({{ 1 < 2 }} {{ 2 <= 2 }} {{ 3 > 4 }} {{ 3 >= 4 }} {{ 1 == 1.0 }} {{ 1 != 1 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ 'B' < 'a' }} {{ [1, 2] < [1, 3] }} {{ [1, 2] == [1, 2] }} {{ (1, 2) == [1, 2] }} {{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }} {{ none == none }} {{ undefined_a == undefined_b }})J",
     R"J(True True False False True False True True True True True False True True True)J"},
    {R"J({{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1 == 1.0 }} {{ 1 < n <= 5 }})J",
     R"J(True False True True)J"},
    {R"J({{ 3 in [1, 2, 3] }} {{ 4 not in [1, 2, 3] }} {{ 'ell' in 'hello' }} {{ '' in 'x' }} {{ 'a' in d }} {{ 'zz' in d }} {{ 1 in {'1': 2} }} {{ 'x' in undefined_name }} {{ [1] in [[1], [2]] }})J",
     R"J(True True True True True False False False True)J"},
    {R"J({{ 1 or 2 }} {{ 0 or 'fallback' }} {{ 0 or '' }}|{{ 0 and 1 }} {{ 'x' and 'y' }} {{ none and 1 }} {{ not 0 }} {{ not '' }} {{ not [] }} {{ not [0] }} {{ e or 'empty' }} {{ undefined_name or 'undefined' }})J",
     R"J(1 fallback |0 y None True True True False empty undefined)J"},
    {R"J({{ 'yes' if t else 'no' }} {{ 'yes' if z else 'no' }} {{ 'x' if false }}|{{ 1 if true }} {{ 'a' if false else 'b' if true else 'c' }})J",
     R"J(yes no |1 b)J"},
    {R"J({{ d.a }} {{ d['a'] }} {{ d.b.1 }} {{ d.b[0] }} {{ d.c.x }} {{ d['c']['x'] }} {{ d.missing }}|{{ d['missing'] }}|{{ messages[0].role }} {{ messages[-1]['content'] }})J",
     R"J(1 1 2 1 y y ||system Hello!)J"},
    {R"J({{ d.items is callable }} {{ d['items'] }} {{ d.keys()|list }} {{ d.values()|list|length }} {{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 'dflt') }})J",
     R"J(True 5 ['a', 'b', 'c', 'items'] 4 1 None dflt)J"},
    {R"J({{ [1, 2, 3][0] }} {{ [1, 2, 3][-1] }} {{ [1, 2, 3][3] }}|{{ 'héllo'[1] }} {{ 'abc'[-1] }} {{ 'abc'[5] }}|{{ none.attr }}|{{ (5).attr }}|{{ 'abc'.nosuchmethod }}|)J",
     R"J(1 3 |é c ||||)J"},
    {R"J({{ [1, 2, 3, 4, 5][1:3] }} {{ [1, 2, 3, 4, 5][::2] }} {{ [1, 2, 3, 4, 5][::-1] }} {{ [1, 2, 3, 4, 5][-2:] }} {{ [1, 2, 3, 4, 5][:-2] }} {{ [1, 2, 3, 4, 5][4:1:-2] }} {{ [1, 2, 3][10:] }} {{ [1, 2, 3][-10:1] }})J",
     R"J([2, 3] [1, 3, 5] [5, 4, 3, 2, 1] [4, 5] [1, 2, 3] [5, 3] [] [1])J"},
    {R"J({{ 'hello'[1:3] }} {{ 'héllo wörld'[::-1] }} {{ 'abcdef'[::2] }} {{ 'abc'[:-1] }} {{ '😀ab'[1:] }} {{ messages[1:]|length }} {{ messages[::-1]|map(attribute='role')|join(',') }} {{ (1, 2, 3)[1:] }})J",
     R"J(el dlröw olléh ace ab ab 2 assistant,user,system (2, 3))J"},
    {R"J({{ 'Hello World'.upper() }} {{ 'Hello World'.lower() }} {{ "they're bill's".title() }} {{ 'hello WORLD'.capitalize() }} {{ 'Straße'.upper() }} {{ 'ÉCOLE'.lower() }})J",
     R"J(HELLO WORLD hello world They'Re Bill'S Hello world STRASSE école)J"},
    {R"J({{ 'a,b,,c'.split(',') }} {{ '  a  b \n c '.split() }} {{ 'a b c'.split(None, 1) }} {{ 'a,b,c'.split(',', 1) }} {{ 'a b c'.rsplit(None, 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ 'x'.split('x') }} {{ ''.split() }})J",
     R"J(['a', 'b', '', 'c'] ['a', 'b', 'c'] ['a', 'b c'] ['a', 'b,c'] ['a b', 'c'] ['a,b', 'c'] ['', ''] [])J"},
    {R"J([{{ '  x  '.strip() }}] [{{ '  x  '.lstrip() }}] [{{ '  x  '.rstrip() }}] [{{ 'xxaxx'.strip('x') }}] [{{ '\n\tx\u3000'.strip() }}] [{{ 'abcba'.strip('ab') }}])J",
     R"J([x] [x  ] [  x] [a] [x] [c])J"},
    {R"J({{ 'abc'.startswith('a') }} {{ 'abc'.startswith('b') }} {{ 'abc'.startswith(('x', 'a')) }} {{ 'abc'.endswith('bc') }} {{ 'abc'.startswith('b', 1) }} {{ 'abc'.endswith('b', 0, 2) }})J",
     R"J(True False True True True True)J"},
    {R"J({{ 'abcabc'.find('c') }} {{ 'abcabc'.rfind('c') }} {{ 'abc'.find('z') }} {{ 'héllo'.find('l') }} {{ 'abcabc'.count('bc') }} {{ 'aaa'.count('') }} {{ 'abc'.index('b') }})J",
     R"J(2 5 -1 2 2 4 1)J"},
    {R"J({{ 'a-b'.replace('-', '+') }} {{ 'aaa'.replace('a', 'b', 2) }} {{ 'ab'.replace('', '.') }} {{ ','.join(['a', 'b']) }} {{ '-'.join('abc') }} {{ 'x'.removeprefix('x') }}|{{ 'file.txt'.removesuffix('.txt') }})J",
     R"J(a+b bba .a.b. a,b a-b-c |file)J"},
    {R"J({{ 'a\nb\r\nc\rd'.splitlines() }} {{ 'abc'.isalpha() }} {{ '123'.isdigit() }} {{ 'a1'.isalnum() }} {{ ' \t'.isspace() }} {{ 'abc'.islower() }} {{ 'ABC'.isupper() }} {{ ''.isalpha() }})J",
     R"J(['a', 'b', 'c', 'd'] True True True True True True False)J"},
    {R"J({{ s|upper }} {{ s|lower }} {{ 'hello wORLD-foo(bar [baz <q'|title }} {{ 'hello WORLD'|capitalize }} {{ s|length }} {{ 'héllo'|length }} {{ 'héllo'|count }} {{ d|length }} {{ messages|length }} {{ undefined_name|length }})J",
     R"J(HELLO WORLD hello world Hello World-Foo(Bar [Baz <Q Hello world 11 5 5 4 3 0)J"},
    {R"J([{{ '  padded \n'|trim }}] [{{ 'xxhixx'|trim('x') }}] [{{ undefined_name|trim }}] [{{ 42|string }}] [{{ [1, 'a']|string }}] [{{ none|string }}] [{{ 'x'|safe }}])J",
     R"J([padded] [hi] [] [42] [[1, 'a']] [None] [x])J"},
    {R"J({{ s|replace('o', '0') }} {{ s|replace('l', 'L', 2) }} {{ s|replace('', '.') }} {{ 5|replace('5', 'five') }} {{ [1, 2, 3]|join }} {{ [1, 2, 3]|join(', ') }} {{ messages|join(' ', attribute='role') }} {{ 'abc'|join('.') }})J",
     R"J(Hell0 W0rld HeLLo World .H.e.l.l.o. .W.o.r.l.d. five 123 1, 2, 3 system user assistant a.b.c)J"},
    {R"J({{ '42'|int }} {{ '-4.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ -3.9|int }} {{ true|int }} {{ none|int }} {{ '0x1f'|int(0, 16) }} {{ '0b11'|int(base=2) }} {{ ' 12 '|int }} {{ '1_000'|int }})J",
     R"J(42 -4 0 7 3 -3 1 0 31 3 12 1000)J"},
    {R"J({{ '1.5'|float }} {{ 'a'|float }} {{ 'a'|float(1.5) }} {{ 3|float }} {{ ' -2.5e3 '|float }} {{ 'inf'|float }} {{ none|float }} {{ true|float }})J",
     R"J(1.5 0.0 1.5 3.0 -2500.0 inf 0.0 1.0)J"},
    {R"J({{ [3, 1, 2]|first }} {{ [3, 1, 2]|last }} {{ 'abc'|first }} {{ 'abc'|last }} {{ d|first }} {{ d|last }} {{ e|first }}|{{ [3, 1, 2]|min }} {{ [3, 1, 2]|max }} {{ ['b', 'A', 'c']|max }} {{ ['b', 'A', 'c']|max(case_sensitive=true) }} {{ e|min }}|)J",
     R"J(3 2 a c a items |1 3 c c |)J"},
    {R"J({{ d|list }} {{ 'ab'|list }} {{ (1, 2)|list }} {{ undefined_name|list }} {{ d|items|list }} {{ undefined_name|items|list }} {% for k, v in d|items %}{{ k }}={{ v }};{% endfor %})J",
     R"J(['a', 'b', 'c', 'items'] ['a', 'b'] [1, 2] [] [('a', 1), ('b', [1, 2]), ('c', {'x': 'y'}), ('items', 5)] [] a=1;b=[1, 2];c={'x': 'y'};items=5;)J"},
    {R"J({{ undefined_name|default('dflt') }} {{ undefined_name|d('d') }} {{ ''|default('x') }}|{{ ''|default('x', true) }} {{ none|default('x') }} {{ 0|default(5, boolean=true) }} {{ undefined_name|default }}|)J",
     R"J(dflt d |x None 5 |)J"},
    {R"J({{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ ['b', 'A', 'c']|sort }} {{ ['b', 'A', 'c']|sort(case_sensitive=true) }} {{ messages|sort(attribute='role')|map(attribute='role')|join(',') }} {{ [[2, 'b'], [1, 'z'], [2, 'a']]|sort }})J",
     R"J([1, 2, 3] [3, 2, 1] ['A', 'b', 'c'] ['A', 'b', 'c'] assistant,system,user [[1, 'z'], [2, 'a'], [2, 'b']])J"},
    {R"J({{ [1, 2, 1, 3, 2]|unique|list }} {{ ['a', 'A', 'b']|unique|list }} {{ ['a', 'A', 'b']|unique(case_sensitive=true)|list }} {{ messages|unique(attribute='role')|map(attribute='role')|list }} {{ [1, 2, 3]|reverse|list }} {{ 'abc'|reverse }} {{ d|reverse|list }})J",
     R"J([1, 2, 3] ['a', 'b'] ['a', 'A', 'b'] ['system', 'user', 'assistant'] [3, 2, 1] cba ['items', 'c', 'b', 'a'])J"},
    {R"J({{ d|dictsort }} {{ {'b': 1, 'a': 2, 'C': 0}|dictsort }} {{ {'b': 1, 'a': 2, 'C': 0}|dictsort(true) }} {{ {'b': 1, 'a': 2}|dictsort(by='value') }} {{ {'b': 1, 'a': 2}|dictsort(reverse=true) }})J",
     R"J([('a', 1), ('b', [1, 2]), ('c', {'x': 'y'}), ('items', 5)] [('a', 2), ('b', 1), ('C', 0)] [('C', 0), ('a', 2), ('b', 1)] [('b', 1), ('a', 2)] [('b', 1), ('a', 2)])J"},
    {R"J({{ [1, 2, 3]|sum }} {{ [1.5, 2]|sum }} {{ [1, 2]|sum(start=10) }} {{ messages|map(attribute='content')|map('length')|sum }} {{ -3|abs }} {{ -2.5|abs }} {{ 2.567|round(2) }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 2.1|round(method='ceil') }} {{ 2.9|round(method='floor') }} {{ 2|round }} {{ 1234.5678|round(-2) }})J",
     R"J(6 3.5 13 30 3 2.5 2.57 2.0 4.0 2.67 3.0 2.0 2 1200.0)J"},
    {R"J({{ messages|map(attribute='role')|list }} {{ messages|map(attribute='tool_calls.0.function.name', default='-')|list }} {{ ['a', 'b']|map('upper')|join }} {{ [1, 2]|map('string')|list }} {{ e|map('upper')|list }} {{ ['x ', ' y']|map('trim')|list }} {{ [[1, 2], [3]]|map('length')|list }} {{ ['ab', 'cd']|map('replace', 'b', 'B')|list }})J",
     R"J(['system', 'user', 'assistant'] ['-', '-', 'f'] AB ['1', '2'] [] ['x', 'y'] [2, 1] ['aB', 'cd'])J"},
    {R"J({{ messages|selectattr('role', 'equalto', 'user')|list|length }} {{ messages|rejectattr('role', 'equalto', 'user')|map(attribute='role')|list }} {{ messages|selectattr('tool_calls', 'defined')|list|length }} {{ messages|selectattr('tool_calls', 'undefined')|list|length }} {{ messages|selectattr('tool_calls')|list|length }} {{ messages|selectattr('role', '==', 'system')|list|length }})J",
     R"J(1 ['system', 'assistant'] 1 2 1 1)J"},
    {R"J({{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3, 4]|reject('odd')|list }} {{ [0, 1, '', 'a', none]|select|list }} {{ [1, 5, 10]|select('greaterthan', 4)|list }} {{ [1, 5, 10]|select('divisibleby', 5)|list }} {{ ['a', 'b']|select('in', 'abc')|list }} {{ [1, 2]|reject('equalto', 1)|list }})J",
     R"J([1, 3] [2, 4] [1, 'a'] [5, 10] [5, 10] ['a', 'b'] [2])J"},
    {R"J({{ tools|tojson }})J",
     R"J([{"type": "function", "function": {"name": "get", "description": "Get it", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}])J"},
    {R"J({{ tools|tojson(indent=2) }})J",
     R"J([
  {
    "type": "function",
    "function": {
      "name": "get",
      "description": "Get it",
      "parameters": {
        "type": "object",
        "properties": {
          "q": {
            "type": "string"
          }
        },
        "required": [
          "q"
        ]
      }
    }
  }
])J"},
    {R"J({{ messages|tojson }}|{{ d|tojson(indent=4, sort_keys=true) }}|{{ d|tojson(separators=(',', ':')) }}|{{ [1, {'a': []}, {}]|tojson(indent=1) }})J",
     R"J([{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi \"there\"\n\\ é 😀"}, {"role": "assistant", "content": "Hello!", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [1.5, null, true]}}}]}]|{
    "a": 1,
    "b": [
        1,
        2
    ],
    "c": {
        "x": "y"
    },
    "items": 5
}|{"a":1,"b":[1,2],"c":{"x":"y"},"items":5}|[
 1,
 {
  "a": []
 },
 {}
])J"},
    {R"J({{ "é\u2028\x01\x7f\"\\"|tojson }} {{ "é😀"|tojson(ensure_ascii=true) }} {{ [1.0, 0.5, 1e-07, 1e16, 12345678901234, none, true]|tojson }} {{ 'x'|tojson(indent='\t') }} {{ {'k': [1]}|tojson(indent='--') }} {{ (1, 2)|tojson }})J",
     R"J("é \u0001\"\\" "\u00e9\ud83d\ude00" [1.0, 0.5, 1e-07, 1e+16, 12345678901234, null, true] "x" {
--"k": [
----1
--]
} [1, 2])J"},
    {R"J({{ "line1\nline2\n\nline4"|indent }}|{{ "a\nb"|indent(2, true) }}|{{ "a\n\nb"|indent(width='> ', blank=true) }}|{{ "x"|indent(first=true) }})J",
     R"J(line1
    line2

    line4|  a
  b|a
> 
> b|    x)J"},
    {R"J({{ 'hi'|center(6) }}|{{ 'hi'|center(7) }}|{{ '<a href="x">&</a>'|escape }} {{ "it's"|e }} {{ 'one two, three'|wordcount }} {{ d|attr('a') }}|{{ d|attr('items') is callable }} {{ messages|map(attribute='role')|map('capitalize')|join }})J",
     R"J(  hi  |   hi  |&lt;a href=&#34;x&#34;&gt;&amp;&lt;/a&gt; it&#39;s 3 |True SystemUserAssistant)J"},
    {R"J({{ n is even }} {{ n is odd }} {{ n is divisibleby 5 }} {{ n is divisibleby(2) }} {{ f is number }} {{ t is number }} {{ f is float }} {{ n is integer }} {{ t is integer }} {{ t is boolean }} {{ t is true }} {{ t is false }} {{ z is none }} {{ z is not none }})J",
     R"J(False True True False True True True True False True True False True False)J"},
    {R"J({{ d is mapping }} {{ e is mapping }} {{ e is sequence }} {{ s is sequence }} {{ n is sequence }} {{ s is iterable }} {{ d is iterable }} {{ n is iterable }} {{ s is string }} {{ n is not string }} {{ undefined_name is defined }} {{ undefined_name is undefined }} {{ d.a is defined }} {{ d.zz is defined }} {{ undefined_name is iterable }})J",
     R"J(True False True True False True True False True True False True True False True)J"},
    {R"J({{ 1 is eq 1 }} {{ 1 is ne 2 }} {{ 2 is gt 1 }} {{ 2 is ge 2 }} {{ 1 is lt 2 }} {{ 3 is le 2 }} {{ 'a' is in 'abc' }} {{ 1 is in [2] }} {{ 'abc' is lower }} {{ 'ABC' is upper }} {{ range is callable }} {{ 'upper' is filter }} {{ 'odd' is test }} {{ 'nope' is filter }} {{ none is sameas none }} {{ true is sameas true }})J",
     R"J(True True True True True False True False True True True True True False True True)J"},
    {R"J({% if n > 3 %}big{% elif n > 1 %}medium{% else %}small{% endif %} {% if z %}a{% elif e %}b{% else %}c{% endif %} {% if t %}{% if n %}nested{% endif %}{% endif %})J",
     R"J(big c nested)J"},
    {R"J({% for x in [1, 2, 3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}|{{ loop.previtem }}|{{ loop.nextitem }}|{{ loop.cycle('a', 'b') }}{{ loop.depth }}{{ loop.depth0 }};{% endfor %})J",
     R"J(1032TrueFalse3||2|a10;2121FalseFalse3|1|3|b10;3210FalseTrue3|2||a10;)J"},
    {R"J({% for x in [1, 2, 3, 4] if x is even %}{{ loop.index }}/{{ loop.length }}:{{ x }} {% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in [1] if false %}x{% else %}filtered out{% endfor %})J",
     R"J(1/2:2 2/2:4 |empty|filtered out)J"},
    {R"J({% for x in [1, 2, 3, 4, 5] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %} {% for x in [1, 2] %}{% for y in [1, 2, 3] %}{% if y == 2 %}{% break %}{% endif %}{{ x }}{{ y }} {% endfor %}{% endfor %})J",
     R"J(13 11 21 )J"},
    {R"J({% for a, b in d.items() %}{{ a }}={{ b }};{% endfor %} {% for a, b in [[1, 2], (3, 4), 'xy'] %}{{ a }}{{ b }} {% endfor %}{% for k in d %}{{ k }}{% endfor %} {% for c in 'hé' %}[{{ c }}]{% endfor %} {% for x in undefined_name %}x{% endfor %})J",
     R"J(a=1;b=[1, 2];c={'x': 'y'};items=5; 12 34 xy abcitems [h][é] )J"},
    {R"J({% for x in [1, 2] %}{% for y in 'ab' %}{{ loop.index }}{{ x }}{{ y }} {% endfor %}{{ loop.index }};{% endfor %})J",
     R"J(11a 21b 1;12a 22b 2;)J"},
    {R"J({% set x = 1 %}{% set y, z2 = 2, 3 %}{{ x }}{{ y }}{{ z2 }} {% set x = x + 10 %}{{ x }} {% set l = [1, 2] + [3] %}{{ l }} {% set a, b = 'xy' %}{{ b }}{{ a }})J",
     R"J(123 11 [1, 2, 3] yx)J"},
    {R"J({% set x = 5 %}{% for i in [1, 2] %}[{{ x }}]{% set x = i %}[{{ x }}]{% endfor %}[{{ x }}] {% for i in [1, 2] %}{% if i == 2 %}({{ y }}){% endif %}{% set y = i %}{% endfor %}({{ y }}) {% if true %}{% set w = 'set in if' %}{% endif %}{{ w }})J",
     R"J([5][1][5][2][5] ()() set in if)J"},
    {R"J({% set ns = namespace(count=0, items=[], found=false) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}{% set ns.items = ns.items + [m.role] %}{% if m.role == 'user' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.items }} {{ ns.found }} {{ ns.missing }}|{{ ns['count'] }} {{ ns }})J",
     R"J(3 ['system', 'user', 'assistant'] True |3 <Namespace {'count': 3, 'items': ['system', 'user', 'assistant'], 'found': True}>)J"},
    {R"J({% set ns = namespace(d) %}{{ ns.a }} {% set ns2 = namespace({'x': 1}, y=2) %}{{ ns2.x }}{{ ns2.y }} {{ dict(a=1, b='two') }} {{ dict({'k': 1}, z=2) }} {{ dict([['p', 1]]) }})J",
     R"J(1 12 {'a': 1, 'b': 'two'} {'k': 1, 'z': 2} {'p': 1})J"},
    {R"J({% set block %}captured {{ 1 + 1 }} {% for i in range(3) %}{{ i }}{% endfor %}{% endset %}[{{ block }}] {% set up | upper | replace('X', 'x') %}aXb{% endset %}{{ up }})J",
     R"J([captured 2 012] AxB)J"},
    {R"J({% filter upper %}filtered {{ 'text' }}{% endfilter %} {% filter replace('a', 'o') | title %}banana split{% endfilter %})J",
     R"J(FILTERED TEXT Bonono Split)J"},
    {R"J({% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Ana') }} {{ greet('Bo', 'Hi') }} {{ greet(greeting='Yo', name='Cy') }} {{ greet() }}|)J",
     R"J(Hello, Ana! Hi, Bo! Yo, Cy! Hello, !|)J"},
    {R"J({% macro m(a, b=a ~ '!') %}{{ a }}{{ b }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1) }}|{{ m(1, 2, 3) }}|{{ m(b=5) }}|{{ m(1, c=3) }})J",
     R"J(11!(){}|12(3,){}|5(){}|11!(){'c': 3})J"},
    {R"J({% macro fact(k) %}{% if k <= 1 %}1{% else %}{{ k * fact(k - 1)|int }}{% endif %}{% endmacro %}{{ fact(10) }} {% macro y() %}{{ s }}{% endmacro %}{% set s = 'late' %}{{ y() }})J",
     R"J(3628800 late)J"},
    {R"J({% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ n }}{% endcall %} {% macro each(xs) %}{% for x in xs %}{{ caller(x, loop.index) }}{% endfor %}{% endmacro %}{% call(item, i) each(['a', 'b']) %}{{ i }}:{{ item }} {% endcall %})J",
     R"J(<b>bold 5</b> 1:a 2:b )J"},
    {R"J({% with a = 1, b = n %}{{ a + b }}{% endwith %}[{{ a }}] {% with %}{% set inner = 1 %}{{ inner }}{% endwith %}[{{ inner }}])J",
     R"J(6[] 1[])J"},
    {R"J({{ range(5)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ range(0)|list }} {{ range(3)|length }} {% for i in range(2, 4) %}{{ i }}{% endfor %})J",
     R"J([0, 1, 2, 3, 4] [1, 4, 7] [5, 3, 1] [] 3 23)J"},
    {R"J({{ strftime_now('%d %b %Y') }} {{ strftime_now('%Y-%m-%d %H:%M:%S') }} {{ strftime_now('%A %B %j %%') }})J",
     R"J(26 Jul 2024 2024-07-26 10:30:00 Friday July 208 %)J"},
    {R"J({% raw %}{{ kept }} {% if %}{% endraw %} {%- raw %} x {% endraw -%} |)J",
     R"J({{ kept }} {% if %} x |)J"},
    {R"J({{ messages[1].content }}|{{ messages[1].content|tojson }}|{{ messages[2].tool_calls[0].function.arguments|tojson }}|{{ messages[2].tool_calls[0].function.arguments.b[0] }})J",
     R"J(Hi "there"
\ é 😀|"Hi \"there\"\n\\ é 😀"|{"a": 1, "b": [1.5, null, true]}|1.5)J"},
    {R"J({{ [1, [2, [3, [4]]]] }} {{ {'a': {'b': {'c': [1, {'d': none}]}}}|tojson }} {{ messages|map(attribute='role')|map('upper')|join('>') }})J",
     R"J([1, [2, [3, [4]]]] {"a": {"b": {"c": [1, {"d": null}]}}} SYSTEM>USER>ASSISTANT)J"},
    {R"J({{ (d.b|first) + (d.b|last) }} {{ (messages|last).role }} {{ messages|map(attribute='content')|select('string')|list|length }} {{ (n ~ '') is string }} {{ d.b|map('string')|join('+') }}
)J",
     R"J(3 assistant 3 True 1+2)J"},
    {R"J(a
  {% if t %}
  yes
  {% endif %}
b)J",
     R"J(a
  yes
b)J"},
    {R"J(a
  {%+ if t %}
  yes
  {%+ endif %}
b)J",
     R"J(a
    yes
  b)J"},
    {R"J(a
  {% if t +%}
  yes
  {% endif +%}
b)J",
     R"J(a

  yes

b)J"},
    {R"J(a  {%- if t -%}  yes  {%- endif -%}  b)J",
     R"J(ayesb)J"},
    {R"J(a

  {{- s -}}  

b)J",
     R"J(aHello Worldb)J"},
    {R"J(a
  {{ s }}
  b)J",
     R"J(a
  Hello World
  b)J"},
    {R"J(x  {# comment #}
y
  {# indented comment #}
z {#- trimmed -#}   w)J",
     R"J(x  y
zw)J"},
    {R"J(	{% for i in [1, 2] %}
	{{ i }}
	{% endfor %}
done)J",
     R"J(	1
	2
done)J"},
    {R"J({% for i in [1, 2] -%}
  {{ i }}
{%- endfor %})J",
     R"J(12)J"},
    {R"J(start
    {%- set x = 1 %}
    {{- x }}
end)J",
     R"J(start1
end)J"},
    {R"J(a {% if t %}b{% endif %} c
{% if t %}
line
{% endif %}
)J",
     R"J(a b c
line
)J"},
    {R"J(  {% if t %}leading{% endif %})J",
     R"J(leading)J"},
    {R"J(x
y
{% if t %}
z{% endif %}

)J",
     R"J(x
y
z)J"},
    {R"J(trailing newline kept once

)J",
     R"J(trailing newline kept once
)J"},
    {R"J({{ 'a' }}
{{ 'b' }}
)J",
     R"J(a
b)J"},
    {R"J({% if t %}

{% endif %}x)J",
     R"J(
x)J"},
    {R"J(unicode space　{%- if t %}|{% endif %})J",
     R"J(unicode space|)J"},
    {R"J({{- '  a  ' -}}
{{ '{' }}{{ '}' }})J",
     R"J(  a  {})J"},
    {R"J({% raw -%}   raw {{ x }}   {%- endraw %}|)J",
     R"J(raw {{ x }}|)J"},
    {R"J({{ 'a'|int(base=1) }} {{ 'abc'[none:] }}|{{ 'ΟΔΟΣ ΑΣ'|lower }} {{ 'straße ﬁx ǆemal'|title }} {{ 'straße'.title() }} {{ 'ǆemal'.capitalize() }})J",
     R"J(0 abc|οδος ας Straße FIx Ǆemal Straße ǅemal)J"},
    {R"J({{ loop is defined }} {% for x in 'ab' %}{% set outer = loop %}{% for y in [1] %}{{ outer.index }}{{ loop.index }} {% endfor %}{% endfor %}{{ messages|length is even }})J",
     R"J(False 11 21 False)J"},
    {R"J({% set x = [1, 2, 3] %}{{ x[1:][0] }} {{ (x|reverse|list)[0] }} {{ x|map('string')|join(x|length|string) }}
)J",
     R"J(2 3 13233)J"},
};
// END CONSTRUCTS

// jinja2 raises on each of these (make_expected.py checks it): syntax errors, type errors,
// undefined values used, sandbox refusals, raise_exception.
// BEGIN ERRORS
const char* const kErrors[] = {
    R"J({{ 1 + 'a' }})J",
    R"J({{ 'a' + 1 }})J",
    R"J({{ undefined_name.attr }})J",
    R"J({{ undefined_name + 1 }})J",
    R"J({{ undefined_name() }})J",
    R"J({{ undefined_name[0] }})J",
    R"J({{ d.zz.yy }})J",
    R"J({{ 10 / 0 }})J",
    R"J({{ 10 // 0 }})J",
    R"J({{ 10 % 0 }})J",
    R"J({{ 1.5 / 0 }})J",
    R"J({{ 1 < 'a' }})J",
    R"J({{ [1] < 'a' }})J",
    R"J({{ 1 in 5 }})J",
    R"J({{ 1 in 'abc' }})J",
    R"J({{ n() }})J",
    R"J({{ d|tojson(indent=1.5) }})J",
    R"J({{ undefined_name|tojson }})J",
    R"J({{ namespace()|tojson }})J",
    R"J({{ 5|length }})J",
    R"J({{ [1]|join(1, 2, 3) }})J",
    R"J({{ s|nosuchfilter }})J",
    R"J({{ s is nosuchtest }})J",
    R"J({% for a, b in [[1, 2, 3]] %}{% endfor %})J",
    R"J({% for a, b in [[1]] %}{% endfor %})J",
    R"J({% for x in 5 %}{% endfor %})J",
    R"J({% set ns2 = 5 %}{% set ns2.x = 1 %})J",
    R"J({% macro m(a) %}{% endmacro %}{{ m(1, 2) }})J",
    R"J({% macro m(a) %}{% endmacro %}{{ m(c=1) }})J",
    R"J({% macro m(a) %}{% endmacro %}{{ m(1, a=2) }})J",
    R"J({{ range(1, 2, 0) }})J",
    R"J({{ range(1000000) }})J",
    R"J({{ range('a') }})J",
    R"J({{ 'abc'.split('') }})J",
    R"J({{ 'abc'.index('z') }})J",
    R"J({{ [1].index(2) }})J",
    R"J({{ 'abc'.startswith(['a']) }})J",
    R"J({{ ','.join([1, 2]) }})J",
    R"J({{ raise_exception('custom failure') }})J",
    R"J({{ e.append(1) }})J",
    R"J({{ d.update({}) }})J",
    R"J({{ d.pop('a') }})J",
    R"J({{ x[1:2:0] }})J",
    R"J({{ -'a' }})J",
    R"J({{ [1]|sum(start='') }})J",
    R"J({{ none|indent }})J",
    R"J({{ {'a': 1}|dictsort(by='x') }})J",
    R"J({{ 3|round(method='x') }})J",
    R"J({{ 'x'|round }})J",
    R"J({{ undefined_name|int }})J",
    R"J({{ 1.5|int(1)|abs(1) }})J",
    R"J({{)J",
    R"J({{ 1 })J",
    R"J({% if true %})J",
    R"J({% if true %}{% endfor %})J",
    R"J({% for %}{% endfor %})J",
    R"J({% endif %})J",
    R"J({% unknowntag %})J",
    R"J({# unterminated comment)J",
    R"J({% raw %}unterminated raw)J",
    R"J({{ 'unterminated }})J",
    R"J({{ (1 }})J",
    R"J({{ [1) }})J",
    R"J({{ 1 + }})J",
    R"J({{ a b }})J",
    R"J({% set %})J",
    R"J({% set 1 = 2 %})J",
    R"J({% macro m(a=1, b) %}{% endmacro %})J",
    R"J({% break %})J",
    R"J({% for x in [1] %}{% macro m() %}{% break %}{% endmacro %}{% endfor %})J",
    R"J({% extends 'base.html' %})J",
    R"J({% include 'x' %})J",
    R"J({{ x is defined is defined }})J",
    R"J({{ 'a' ! 'b' }})J",
    R"J({{ 1 2 }})J",
    R"J({{ '\x4' }})J",
    R"J({% call m %}{% endcall %})J",
    R"J({{ f(*1) }})J",
    R"J({{ f(**[1]) }})J",
    R"J({{ dict(**[1]) }})J",
    R"J({{ 'x' % 1 }})J",
    R"J({{ 'abc'[undefined_name:] }})J",
    R"J({{ d[1:] }})J",
    R"J({% set x = 'a' %}{{ [1, 2][0:x] }})J",
    R"J({{ n[1:] }})J",
};
// END ERRORS

}  // namespace

TEST_CASE("jinja: real chat templates render byte for byte as transformers' jinja2 does", "[jinja]") {
  const ojson convs = read_json(fixture_dir() / "conversations.json");
  REQUIRE(convs.size() >= 30);
  std::map<std::string, ojson> by_name;
  for (const auto& c : convs) by_name[c["name"].get<std::string>()] = c;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(fixture_dir() / "expected")) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() == 9);  // qwen2.5, qwen3, llama3.1, llama3.2, gemma3, mistral, smollm2, phi3, constructs
  size_t outputs = 0, errors = 0;
  for (const auto& file : files) {
    const ojson doc = read_json(file);
    const std::string name = doc["template"].get<std::string>();
    const Template t(read_file(fixture_dir() / name));
    REQUIRE(doc["cases"].size() == convs.size());
    for (const auto& c : doc["cases"]) {
      const std::string conv = c["conversation"].get<std::string>();
      INFO(name << " over conversation " << conv);
      const Value ctx = conversation_context(by_name.at(conv), doc["special_tokens"]);
      if (c.contains("output")) {
        outputs++;
        CHECK(t.render(ctx, fixed_time()) == c["output"].get<std::string>());
        continue;
      }
      errors++;
      std::string what;
      try {
        t.render(ctx, fixed_time());
      } catch (const UsageError& e) {
        what = e.what();
      }
      INFO("jinja2 raised " << c["error_type"].get<std::string>() << ": " << c["error"].get<std::string>());
      CHECK(!what.empty());
      const std::string message = c["error"].get<std::string>();
      if (c["error_type"] == "TemplateError") {
        CHECK(what == message);  // raise_exception(message)
      } else {  // TypeError, UndefinedError: the same text after "jinja: line N: "
        CHECK(what.size() > message.size());
        CHECK(what.compare(what.size() - message.size(), message.size(), message) == 0);
      }
    }
  }
  CHECK(outputs + errors == files.size() * convs.size());
  CHECK(outputs >= 250);
  CHECK(errors >= 20);
}

TEST_CASE("jinja: each construct renders as jinja2 does", "[jinja]") {
  for (const auto& c : kConstructs) {
    INFO(c.source);
    CHECK(render_unit(c.source) == c.expected);
  }
  CHECK(std::size(kConstructs) >= 90);
}

TEST_CASE("jinja: what jinja2 rejects throws UsageError", "[jinja]") {
  for (const char* source : kErrors) {
    INFO(source);
    CHECK_THROWS_AS(render_unit(source), UsageError);
  }
  // raise_exception's message is the error's text, as transformers shows jinja2's TemplateError.
  CHECK(error_of("{{ raise_exception('Roles must alternate (user/assistant)') }}") == "Roles must alternate (user/assistant)");
  // Others name the line.
  CHECK(error_of("a\nb\n{{ 1 +\n}}") == "jinja: line 4: unexpected 'end of print statement'");
  CHECK(error_of("line 1\n{% for x in y %}\n{{ x }}") ==
        "jinja: line 3: Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'.");
  CHECK(error_of("\n\n{{ 'a' + 1 }}") == "jinja: line 3: can only concatenate str (not \"int\") to str");
  CHECK(error_of("{{ d.missing.x }}") == "jinja: line 1: 'dict object' has no attribute 'missing'");
}

TEST_CASE("jinja: what transformers adds and what is not supported", "[jinja]") {
  // transformers' {% generation %} tag (AssistantTracker) renders its body.
  CHECK(render_unit("a{% generation %}b{{ n }}{% endgeneration %}c") == "ab5c");
  // transformers' TemplateNamespace refuses underscore-prefixed attributes.
  CHECK_THROWS_AS(render_unit("{% set ns = namespace(_x=1) %}"), UsageError);
  CHECK_THROWS_AS(render_unit("{% set ns = namespace() %}{% set ns._x = 1 %}"), UsageError);
  // Unsupported jinja2 features fail loudly instead of rendering something else.
  CHECK(error_of("{{ '%s'|format(1) }}") == "jinja: line 1: the 'format' filter is not supported");
  CHECK(error_of("{{ '%s' % 1 }}") == "jinja: line 1: string formatting with % is not supported");
  CHECK_THROWS_AS(Template("{% for x in y recursive %}{% endfor %}"), UsageError);
  CHECK_THROWS_AS(Template("{% include 'other.jinja' %}"), UsageError);
  CHECK_THROWS_AS(render_unit("{{ 2 ** 64 }}"), UsageError);  // Python's integers are unbounded
  CHECK_THROWS_AS(render_unit("{{ {1: 'x'} }}"), UsageError);  // dict keys are strings here
  CHECK_THROWS_AS(render_unit("{{ '{}'.format(1) }}"), UsageError);
}

TEST_CASE("jinja: the Value and Template API", "[jinja]") {
  CHECK(Value().str() == "");
  CHECK(Value(nullptr).str() == "None");
  CHECK(Value(true).str() == "True");
  CHECK(Value(int64_t(-42)).str() == "-42");
  CHECK(Value(7).str() == "7");
  CHECK(Value(1.0).str() == "1.0");
  CHECK(Value(0.1 + 0.2).str() == "0.30000000000000004");
  CHECK(Value(1e-5).str() == "1e-05");
  CHECK(Value(1e16).str() == "1e+16");
  CHECK(Value("it's").str() == "it's");
  Value list = Value::array({Value(1), Value("it's"), Value(nullptr)});
  CHECK(list.str() == "[1, \"it's\", None]");
  // Copies share until written: set and push_back copy a shared dict or list first.
  Value copy = list;
  copy.push_back(Value(2.5));
  CHECK(list.str() == "[1, \"it's\", None]");
  CHECK(copy.str() == "[1, \"it's\", None, 2.5]");
  Value obj = Value::object();
  obj.set("b", 1);
  obj.set("a", "x");
  obj.set("b", 2);  // keeps its place
  CHECK(obj.str() == "{'b': 2, 'a': 'x'}");
  CHECK_THROWS_AS(list.set("k", 1), UsageError);
  CHECK_THROWS_AS(obj.push_back(1), UsageError);

  // nlohmann::json sorts keys; ordered_json keeps the text's order, as Python's json does.
  const std::string text = R"({"z": 1, "a": [true, null, 1.5, "é"], "m": {"y": 2, "b": 18446744073709551615}})";
  CHECK(Value::from_json(nlohmann::json::parse(text)).str() ==
        "{'a': [True, None, 1.5, 'é'], 'm': {'b': 1.8446744073709552e+19, 'y': 2}, 'z': 1}");
  CHECK(Value::from_json(ojson::parse(text)).str() == "{'z': 1, 'a': [True, None, 1.5, 'é'], 'm': {'y': 2, 'b': 1.8446744073709552e+19}}");
  std::string deep = std::string(300, '[') + std::string(300, ']');
  CHECK_THROWS_AS(Value::from_json(ojson::parse(deep)), UsageError);
  Value nest = Value::array();
  for (int i = 0; i < 255; i++) nest = Value::array({nest});
  CHECK_THROWS_AS(Value::array({nest}), UsageError);

  // A template parses once and renders many times, from several threads at once.
  const Template t("{% for m in messages %}{{ m.role }}:{{ m.content|length }};{% endfor %}{{ x }}");
  Value ctx = Value::object();
  ctx.set("messages", Value::from_json(ojson::parse(R"([{"role": "user", "content": "héllo"}])")));
  ctx.set("x", 1);
  CHECK(t.render(ctx) == "user:5;1");
  std::vector<std::thread> threads;
  std::vector<std::string> outs(4);
  for (int i = 0; i < 4; i++)
    threads.emplace_back([&, i] {
      for (int k = 0; k < 200; k++) outs[size_t(i)] = t.render(ctx);
    });
  for (auto& th : threads) th.join();
  for (const auto& o : outs) CHECK(o == "user:5;1");
  Template moved = Template("{{ y }}");
  moved = Template("[{{ x }}]");
  CHECK(moved.render(ctx) == "[1]");
  CHECK(llmq::jinja::render("{{ x + 1 }}", ctx) == "2");
  CHECK_THROWS_AS(t.render(Value(1)), UsageError);  // the context must be a dict
  // strftime_now: the time of the options, or now.
  CHECK(llmq::jinja::render("{{ strftime_now('%Y-%m-%d %a') }}", ctx, fixed_time()) == "2024-07-26 Fri");
  CHECK(llmq::jinja::render("{{ strftime_now('%Y')|length }}", ctx) == "4");
}

TEST_CASE("jinja: hostile templates throw UsageError, never crash, hang or exhaust memory", "[jinja]") {
  const std::string deep_parens = "{{ " + std::string(10000, '(') + "1" + std::string(10000, ')') + " }}";
  std::string deep_ifs, plus_chain = "{{ 1", filters = "{{ 1", nots = "{{ ";
  for (int i = 0; i < 10000; i++) deep_ifs = "{% if true %}" + deep_ifs + "{% endif %}";
  for (int i = 0; i < 20000; i++) plus_chain += " + 1", filters += "|abs", nots += "not ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{{", "unexpected end of template"},
      {"{% if x %}", "Unexpected end of template"},
      {"{% for x in y", "unexpected end of template"},
      {"{# never closed", "Missing end of comment tag"},
      {"{% raw %}never closed", "Missing end of raw directive"},
      {"{{ 'never closed }}", "unexpected char"},
      {"{{ (1 }}", "unexpected '}', expected ')'"},
      {deep_parens, "nesting too deep"},
      {deep_ifs, "nesting too deep"},
      {nots + "1 }}", "nesting too deep"},
      {plus_chain + " }}", "expression nested too deeply"},
      {filters + " }}", "expression nested too deeply"},
      {"{{ range(10 ** 9)|length }}", "Range too big"},
      {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "too deeply nested or recursive"},
      {"{% macro f() %}{{ g() }}{% endmacro %}{% macro g() %}{{ f() }}{% endmacro %}{{ f() }}", "too deeply nested or recursive"},
      {"{{ 'a' * 10 ** 12 }}", "too much text"},
      {"{{ ([1] * 10 ** 9)|length }}", "too much text"},
      {"{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "too much text"},
      {"{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "too much text"},
      {"{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}", "nest deeper than 256"},
      {"{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
       "too many steps"},
      {"{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}", "too long"},
      {"{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", "nests too deeply"},
      {"{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output is too long"},
      {"{{ 'x'|center(10 ** 12) }}", "too much text"},
      {"{{ [1]|tojson(indent=10 ** 9) }}", "indent too large"},
      {"{{ 9223372036854775807 + 1 }}", "integer overflow"},
      {"{{ 99999999999999999999 }}", "integer literal out of range"},
  };
  RenderOptions small = fixed_time();  // smaller budgets keep the test quick; the defaults behave the same
  small.max_output_bytes = 4 << 20;
  small.max_alloc_bytes = 16 << 20;
  small.max_steps = 2'000'000;
  for (const auto& [source, message] : cases) {
    INFO(source.substr(0, 200));
    const std::string what = error_of(source, small);
    CHECK(what.find(message) != std::string::npos);
  }
  // The default limits hold too (64 MiB of output, 1e6 loop iterations).
  CHECK(error_of("{% for i in range(100000) %}{% for j in range(10) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}").find("output is too long") !=
        std::string::npos);
  CHECK(error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").find("too many loop iterations") !=
        std::string::npos);
  // Bytes that are not UTF-8 pass through text and strings unchanged.
  CHECK(render_unit("a\xff\xfe{{ '\xc3' }}\x80") == "a\xff\xfe\xc3\x80");
}

namespace {

/// A random edit of a template: cut, insert a token, duplicate a span or change a byte.
std::string mutate(std::string s, std::mt19937_64& rng) {
  static const char* const tokens[] = {
      "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", "(", ")", "[", "]", "{", "}", "'", "\"", "|", ".", ",",
      ":", " if ", " else ", " elif ", " for ", " in ", " not ", " and ", " is ", "endfor", "endif", "endmacro", "-", "+",
      "*", "**", "//", "%", "~", "==", "\\", "\n", " ", "loop", "ns.", "messages", "0", "-1", "1e9", "range(99999)",
      "raise_exception('x')", "|tojson", "|length", "|items", "[::-1]", "is defined", "none", "caller()", "\xff", "\xc3", "é"};
  auto pick = [&](size_t n) { return n ? size_t(rng() % n) : 0; };
  const int edits = rng() % 3 ? 1 : 2 + int(rng() % 3);
  for (int i = 0; i < edits; i++) {
    const size_t pos = pick(s.size() + 1);
    switch (rng() % 4) {
      case 0: s.erase(std::min(pos, s.size()), 1 + pick(20)); break;
      case 1: s.insert(pos, tokens[pick(std::size(tokens))]); break;
      case 2: {
        const size_t from = pick(s.size() + 1), len = std::min<size_t>(1 + pick(60), s.size() - std::min(from, s.size()));
        s.insert(pos, s.substr(std::min(from, s.size()), len));
        break;
      }
      default:
        if (!s.empty()) s[pick(s.size())] = char(rng());
    }
  }
  return s;
}

}  // namespace

TEST_CASE("jinja: mutated templates render or throw UsageError", "[jinja]") {
  std::vector<std::string> chat_templates, constructs;  // over conversations, over unit_context.json
  for (const auto& e : fs::directory_iterator(fixture_dir()))
    if (e.path().extension() == ".jinja") chat_templates.push_back(read_file(e.path()));
  std::sort(chat_templates.begin(), chat_templates.end());
  for (const auto& c : kConstructs) constructs.emplace_back(c.source);
  REQUIRE(chat_templates.size() == 9);
  const ojson convs = read_json(fixture_dir() / "conversations.json");
  const ojson tokens = ojson::parse(R"({"bos_token": "<s>", "eos_token": "</s>"})");
  std::vector<Value> contexts;
  for (const auto& c : convs) contexts.push_back(conversation_context(c, tokens));
  RenderOptions o = fixed_time();
  o.max_output_bytes = 1 << 20, o.max_alloc_bytes = 8 << 20, o.max_steps = 200'000, o.max_loop_iterations = 20'000;
  std::mt19937_64 rng(20240726);
  int rendered = 0, rejected = 0;
  for (int i = 0; i < 8000; i++) {
    const bool chat = rng() % 2 == 0;
    const auto& pool = chat ? chat_templates : constructs;
    std::string src = mutate(pool[size_t(rng() % pool.size())], rng);
    if (rng() % 4 == 0) src = mutate(std::move(src), rng);
    const Value& ctx = chat ? contexts[size_t(rng() % contexts.size())] : unit_context();
    try {
      Template(src).render(ctx, o);
      rendered++;
    } catch (const UsageError&) {
      rejected++;
    }
  }
  INFO(rendered << " rendered, " << rejected << " rejected");
  CHECK(rendered > 1000);
  CHECK(rejected > 1000);
}
