"""vLLM's `mistral` tool parser for pre-v11 tokenizers (Mistral 7B Instruct v0.3 and other
Hugging Face tokenizers without `[ARGS]`), as vLLM 0.32's MistralParser assembles a stream
on its pre-v11 path (vllm/parser/mistral.py, `_extract_tool_calls_streaming_pre_v11_tokenizer`,
read, not copied). The model writes `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`
(or one bare object). vLLM's rules, as the client assembles them:

- content is the text before `[TOOL_CALLS]`, sent as it comes (the tag is one special token:
  no tail is held back), and the text after the array's closing `]`;
- a call's name is its `"name"` string, once whole, unescaped;
- its arguments are the raw text of its `"arguments"` object, from its `{` (whitespace before
  it dropped) to the matching `}`, not re-serialised: vLLM feeds the text to a JSON event
  parser and passes every piece of the object on as it is.

Not followed: `"arguments"` given as a JSON string (vLLM sends the decoded string)."""

# baton: pure

from __future__ import annotations

import json

from dataplane.relay.tools.parser import ParsedCall

_SPACE = " \t\r\n"


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at


def _string_end(text: str, at: int) -> int:
    """The index after the JSON string that opens at `at` (a quote); -1 while unclosed."""
    i = at + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return -1


def _value_end(text: str, at: int) -> int:
    """The index after the JSON value that starts at `at`; -1 while it is not closed."""
    if at >= len(text):
        return -1
    if text[at] == '"':
        return _string_end(text, at)
    if text[at] not in "[{":
        i = at
        while i < len(text) and text[i] not in ",}]" + _SPACE:
            i += 1
        return i if i < len(text) else -1
    depth, i = 0, at
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end < 0:
                return -1
            i = end
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _call(text: str, at: int) -> tuple[ParsedCall, int]:
    """The call object that opens at `at` (a brace): the call so far, and the index after
    it (-1 while it is not closed)."""
    name: str | None = None
    arguments = ""
    i = at + 1
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return ParsedCall(name, arguments), -1
        if text[i] == "}":
            return ParsedCall(name, arguments, complete=True), i + 1
        if text[i] == ",":
            i += 1
            continue
        key_end = _string_end(text, i) if text[i] == '"' else -1
        if key_end < 0:
            return ParsedCall(name, arguments), -1
        key = json.loads(text[i:key_end])
        i = _skip(text, key_end)
        if i >= len(text) or text[i] != ":":
            return ParsedCall(name, arguments), -1
        start = _skip(text, i + 1)
        end = _value_end(text, start)
        if key == "name" and end > 0 and text[start] == '"':
            name = json.loads(text[start:end])
        elif key == "arguments" and start < len(text) and text[start] == "{":
            arguments = text[start:end] if end > 0 else text[start:]
        if end < 0:
            return ParsedCall(name, arguments), -1
        i = end


def parse_calls(text: str, at: int) -> tuple[list[ParsedCall], str]:
    """The calls written from `at` (just after `[TOOL_CALLS]`), and the content after them."""
    i = _skip(text, at)
    if i >= len(text):
        return [], ""
    bare = text[i] == "{"
    if not bare:
        i += 1  # the array's "["
    calls: list[ParsedCall] = []
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return calls, ""
        if text[i] == ",":
            i += 1
            continue
        if text[i] == "]":
            return calls, text[i + 1 :]
        if text[i] != "{":
            return calls, ""  # not a call: vLLM's event parser stops here too
        call, end = _call(text, i)
        if call.name is not None or call.arguments:
            calls.append(call)
        if end < 0:
            return calls, ""
        if bare:
            return calls, text[end:]
        i = end
