"""vLLM's `llama3_json` tool parser (Llama 3.x, Llama 4 JSON), as vLLM 0.32's
Llama3JsonToolParser assembles a stream (vllm/tool_parsers/llama_tool_parser.py, read, not
copied). The model writes `{"name": "f", "arguments": {"a": 1}}` (or "parameters"),
optionally after `<|python_tag|>` (special: a stream shows it only where the request keeps
special tokens), several calls joined by `; `. vLLM's rules, as the client assembles them:

- a text that does not start with `{` (or the tag) is all content, and there are no calls;
  one that does has no content at all;
- the calls are JSON objects read one after another, each starting two characters (the
  `; `) after the end of the one before; anything else there ends the calls (vLLM's partial
  JSON parse fails and it sends nothing more);
- a call's name once its `"name"` string is whole; its arguments are
  json.dumps(arguments, ensure_ascii=False), re-serialised (default separators, 1.50 sent
  as 1.5, escapes as json.dumps writes them), and "" where the arguments are falsy ({} or
  missing). vLLM streams the common prefix of successive partial parses; Baton sends what
  no later character can change (dump_prefix), which the final json.dumps extends.

Where it cannot match: vLLM's result depends on chunking where a call's closing brace and
the text after it come in one chunk (the rest of its arguments is then never sent), where
`;` has no space after it, and on a stream cut inside a call (vLLM may flush its partial
parse, closing quotes and braces included; Baton stops at the decided prefix). Duplicate
keys (json.loads keeps the last value at the first key's place) are not followed."""

# baton: pure

from __future__ import annotations

import json

from dataplane.relay.tools.parser import NOTHING, Parsed, ParsedCall, Tools

BOT = "<|python_tag|>"


_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER = set("0123456789+-.eE")


class Partial(Exception):
    """The text ends inside the value."""


class Malformed(Exception):
    """The text is not JSON here."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _at(s: str, i: int) -> str:
    if i >= len(s):
        raise Partial
    return s[i]


def _encode(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _hex4(s: str, i: int) -> int:
    """The code unit of the \\uXXXX whose hex digits start at i."""
    digits = s[i : i + 4]
    if any(c not in "0123456789abcdefABCDEF" for c in digits):
        raise Malformed
    if len(digits) < 4:
        raise Partial
    return int(digits, 16)


def _escape(s: str, i: int) -> tuple[str, int]:
    """The character of the escape at s[i] == '\\', and the index after it."""
    c = _at(s, i + 1)
    if c in _ESCAPES:
        return _ESCAPES[c], i + 2
    if c != "u":
        raise Malformed
    unit = _hex4(s, i + 2)
    if 0xD800 <= unit < 0xDC00:
        # A high surrogate joins the low one after it (json.loads does): wait for it.
        rest = s[i + 6 : i + 8]
        if len(rest) < 2 and "\\u".startswith(rest):
            raise Partial
        if rest == "\\u":
            low = _hex4(s, i + 8)
            if 0xDC00 <= low < 0xE000:
                return chr(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)), i + 12
    return chr(unit), i + 6


def dump_string(s: str, i: int, out: list[str]) -> tuple[str, int]:
    """The string at s[i] == '"': its value and the index after it."""
    out.append('"')
    value: list[str] = []
    i += 1
    while True:
        c = _at(s, i)
        if c == '"':
            out.append('"')
            return "".join(value), i + 1
        if c == "\\":
            ch, i = _escape(s, i)
        elif ord(c) < 0x20:
            raise Malformed  # json.loads is strict: no raw control characters
        else:
            ch, i = c, i + 1
        value.append(ch)
        out.append(_encode(ch))


def _scalar(s: str, i: int, out: list[str]) -> int:
    j = i
    while j < len(s) and (s[j] in _NUMBER or s[j].isalpha()):
        j += 1
    if j == len(s):
        if any(w.startswith(s[i:j]) for w in ("true", "false", "null")) or s[i] in "-0123456789":
            raise Partial  # the next character may still extend it
        raise Malformed
    try:
        value = json.loads(s[i:j])
    except ValueError:
        raise Malformed from None
    out.append(json.dumps(value))
    return j


def _members(s: str, i: int, out: list[str], close: str, keyed: bool) -> int:
    """The members of the container opened at s[i - 1]."""
    out.append("{" if keyed else "[")
    i = skip_ws(s, i)
    if _at(s, i) == close:
        out.append(close)
        return i + 1
    first = True
    while True:
        i = skip_ws(s, i)
        if keyed and _at(s, i) != '"':
            raise Malformed
        _at(s, i)
        if not first:
            out.append(", ")
        if keyed:
            _, i = dump_string(s, i, out)
            i = skip_ws(s, i)
            if _at(s, i) != ":":
                raise Malformed
            out.append(": ")
            i += 1
        i = dump_prefix(s, i, out)
        i = skip_ws(s, i)
        c = _at(s, i)
        if c == close:
            out.append(close)
            return i + 1
        if c != ",":
            raise Malformed
        i, first = i + 1, False


def dump_prefix(s: str, i: int, out: list[str]) -> int:
    """Re-serialise the value at s[i:] (after whitespace) into `out`; the index after it."""
    i = skip_ws(s, i)
    c = _at(s, i)
    if c == "{":
        return _members(s, i + 1, out, "}", True)
    if c == "[":
        return _members(s, i + 1, out, "]", False)
    if c == '"':
        return dump_string(s, i, out)[1]
    return _scalar(s, i, out)


_ARG_KEYS = ("arguments", "parameters")


def _arguments(value: object) -> str:
    return json.dumps(value, ensure_ascii=False) if value else ""


def _partial_call(s: str, i: int) -> tuple[str | None, str]:
    """The name and the decided arguments of the unfinished call object at s[i] == '{'."""
    name: str | None = None
    args: list[str] = []
    done = False  # the arguments' value is whole
    try:
        i = skip_ws(s, i + 1)
        if _at(s, i) == "}":
            return None, ""
        while True:
            i = skip_ws(s, i)
            if _at(s, i) != '"':
                raise Malformed
            key, i = dump_string(s, i, [])
            i = skip_ws(s, i)
            if _at(s, i) != ":":
                raise Malformed
            i = skip_ws(s, i + 1)
            if key in _ARG_KEYS:
                args, done = [], False
                i = dump_prefix(s, i, args)
                done = True
            elif key == "name" and _at(s, i) == '"':
                value, i = dump_string(s, i, [])
                name = value or None
            else:
                i = dump_prefix(s, i, [])
            i = skip_ws(s, i)
            if _at(s, i) not in ",}":
                raise Malformed
            i += 1
    except (Partial, Malformed):
        pass
    text = "".join(args)
    if name is None or (done and not json.loads(text)):
        return name, ""  # vLLM sends falsy arguments ({}, [], "") as ""
    # A value's opening alone does not say it is truthy.
    return name, (text if len(text) > 1 else "")


class Llama3Json:
    def __init__(self, tools: Tools) -> None:
        self._tools = tools  # the call names its tool; nothing is typed by schema

    def parse(self, text: str, *, final: bool = False) -> Parsed:
        if text.startswith(BOT):
            at = len(BOT)
        elif text.startswith("{"):
            at = 0
        elif not final and text and BOT.startswith(text):
            return NOTHING  # may still become the tag
        else:
            return Parsed(text)
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        while at < len(text) and text[at] == "{":
            try:
                obj, end = decoder.raw_decode(text, at)
            except ValueError:
                name, args = _partial_call(text, at)
                if name is not None:
                    calls.append(ParsedCall(name, args))
                break
            if not isinstance(obj, dict) or all(k in obj for k in _ARG_KEYS):
                break  # vLLM's stream fails here and sends nothing more
            called = obj.get("name")
            if not isinstance(called, str) or not called:
                break
            value = obj["arguments"] if "arguments" in obj else obj.get("parameters")
            calls.append(ParsedCall(called, _arguments(value), complete=True))
            at = end + len("; ")
        return Parsed("", tuple(calls))
