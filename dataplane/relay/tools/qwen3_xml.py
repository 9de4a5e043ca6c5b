"""vLLM's `qwen3_xml` tool parser (also registered as `qwen3_coder`: the same class, vLLM
0.32's Qwen3 parser engine, vllm/parser/qwen3.py and parser/engine/, read, not copied), as
it assembles a stream. The model writes

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

vLLM's rules, as the client assembles them:

- content is the text outside calls: before the first `<tool_call>` (or a bare
  `<function=`), and after a `</tool_call>`; text between `</function>` and `</tool_call>`
  is dropped. Whitespace-only content is held, dropped once a call comes (sent at the end of
  a stream without calls); after a call, whitespace is dropped until content that is not
  whitespace comes. A tail that could start a tag is held back until the end of the stream.
- a call's name is the text of `<function=NAME>`;
- its arguments are json.dumps(ensure_ascii=False) of {parameter: value}, each value the
  text inside its tags less one leading and one trailing newline, converted by the type the
  request's tool schema gives that parameter (integer, number, boolean, null, object, array,
  else the string; see _coerce), in the order the parameters came. While the call is open
  vLLM sends the arguments up to the last parameter's value, and that value as it grows
  only where the schema makes it a plain string (or the tool has no schema); the rest when
  `</function>` comes. A stream cut inside a call keeps what was sent (no flush), except
  one cut inside `<function=`, whose name vLLM sends with arguments `{}`.

Where it cannot match: vLLM drops whitespace after a call by chunk (a chunk of only
whitespace), Baton character by character, so a token like " Next" after `</tool_call>`
keeps its space in vLLM's stream and not here; tags spelled with inner spaces
(`< parameter = x>`) and repeated parameter names are not followed; `</think>` in the
content is kept (vLLM drops it where a reasoning parser is configured: Baton parses the
text after the reasoning)."""

# baton: pure

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from dataplane.relay.tools.parser import Parsed, ParsedCall, Tools, held_back

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string",
    "enum": "string", "int": "integer", "int32": "integer", "int64": "integer",
    "uint": "integer", "uint32": "integer", "uint64": "integer", "long": "integer",
    "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
    "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
    "arr": "array", "list": "array", "sequence": "array",
}  # fmt: skip
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))  # fmt: skip


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (vLLM's reading: type, enum, *Of)."""
    if not isinstance(schema, Mapping):
        return {"string"}
    out: set[str] = set()
    t = schema.get("type")
    out.update(
        [t]
        if isinstance(t, str)
        else [x for x in t if isinstance(x, str)]
        if isinstance(t, list)
        else []
    )
    enum = schema.get("enum")
    if isinstance(enum, list):
        for v in enum:
            out.add(
                "null"
                if v is None
                else next(n for k, n in _ENUM_TYPES if isinstance(v, k))
                if isinstance(v, (bool, int, float, str, list, dict))
                else "string"
            )
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for choice in schema[key]:
                out |= _types(choice)
    return out or {"string"}


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def _coerce(value: str, types: set[str]) -> Any:
    """A parameter's text as the schema's types make it: the first that fits of null,
    integer, number, boolean, object, array, string; else the text as JSON, else as is."""
    wanted = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for t in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if t not in wanted:
            continue
        if t == "string":
            return value
        if t == "null" and value.lower() == "null":
            return None
        if t == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if t == "number":
            try:
                f = float(value)
            except ValueError:
                continue
            if math.isfinite(f):
                return int(f) if f == int(f) else f
        if t == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if t in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _params(body: str, partial: bool) -> dict[str, str]:
    """The parameters in a function body, in order: a value ends at its end tag or where
    the next parameter starts. An unfinished last one counts only while the call is open
    (vLLM's final conversion leaves it out)."""
    out: dict[str, str] = {}
    at = body.find(PARAM)
    while at >= 0:
        close = body.find(">", at + len(PARAM))
        if close < 0:
            break
        name = body[at + len(PARAM) : close]
        end, nxt = body.find(PARAM_END, close + 1), body.find(PARAM, close + 1)
        if end >= 0 and (nxt < 0 or end < nxt):
            out[name] = _trim(body[close + 1 : end])
            at = body.find(PARAM, end + len(PARAM_END))
        elif nxt >= 0:
            out[name] = _trim(body[close + 1 : nxt])
            at = nxt
        else:
            if partial and name:
                out[name] = _trim(body[close + 1 :])
            break
    return out


def _properties(tools: Tools, name: str) -> Mapping[str, Any]:
    for tool in tools:
        fn = tool.get("function")
        if tool.get("type", "function") == "function" and isinstance(fn, Mapping):
            if fn.get("name") == name:
                props = (fn.get("parameters") or {}).get("properties")
                return props if isinstance(props, Mapping) else {}
    return {}


def _arguments(params: dict[str, str], props: Mapping[str, Any], open_: bool) -> str:
    """The arguments vLLM has sent: all of them once the call is closed; while it is open,
    up to the last value, and that value's text where it stays a plain string."""
    values: dict[str, Any] = {
        k: (_coerce(v, _types(props[k])) if isinstance(props.get(k), Mapping) else v)
        for k, v in params.items()
    }
    if not open_:
        return json.dumps(values, ensure_ascii=False)
    if not values:
        return ""
    *_, last = values
    tail = values.pop(last)
    head = json.dumps(values, ensure_ascii=False)[:-1]
    head = (head + ", " if values else head) + json.dumps(last, ensure_ascii=False) + ": "
    streams = not props or _types(props.get(last)) == {"string"}
    if isinstance(tail, str) and streams:
        head += json.dumps(tail, ensure_ascii=False)[:-1]
    return head


def _content(piece: str, before: list[str], after_call: bool, call_next: bool, final: bool) -> str:
    """What of a stretch of content vLLM sends (the whitespace rules, module docstring)."""
    if any(p.strip() for p in before):
        return piece
    if after_call:
        return piece.lstrip()
    if piece.strip():
        return piece
    return piece if final and not call_next else ""


class Qwen3Xml:
    def __init__(self, tools: Tools) -> None:
        self._tools = tools  # parameters are typed by the called tool's schema

    def parse(self, text: str, *, final: bool = False) -> Parsed:
        content: list[str] = []
        calls: list[ParsedCall] = []
        at, state, started = 0, "content", False
        while True:
            if state == "content":
                start = min(
                    (i for i in (text.find(TOOL_START, at), text.find(FUNC, at)) if i >= 0),
                    default=-1,
                )
                piece = text[at:] if start < 0 else text[at:start]
                if start < 0 and not final:
                    piece = piece[: len(piece) - held_back(piece, TOOL_START, FUNC)]
                content.append(_content(piece, content, started, start >= 0, final))
                if start < 0:
                    break
                started = True
                state, at = (
                    ("preamble", start + len(TOOL_START))
                    if text.startswith(TOOL_START, start)
                    else ("name", start + len(FUNC))
                )
            elif state in ("preamble", "between"):
                marks = [(text.find(TOOL_END, at), TOOL_END), (text.find(FUNC, at), FUNC)]
                if state == "between":
                    marks.append((text.find(TOOL_START, at), TOOL_START))
                found = [m for m in marks if m[0] >= 0]
                if not found:
                    break
                i, tag = min(found)
                at = i + len(tag)
                state = {TOOL_END: "content", FUNC: "name", TOOL_START: "preamble"}[tag]
            elif state == "name":
                close = text.find(">", at)
                if close < 0:
                    if final:
                        calls.append(ParsedCall(text[at:], "{}", complete=True))
                    break
                name, at = text[at:close], close + 1
                end = text.find(FUNC_END, at)
                body = text[at:] if end < 0 else text[at:end]
                if end < 0:
                    body = body[: len(body) - held_back(body, FUNC_END, PARAM_END, PARAM)]
                props = _properties(self._tools, name)
                calls.append(
                    ParsedCall(
                        name, _arguments(_params(body, end < 0), props, end < 0), complete=end >= 0
                    )
                )
                if end < 0:
                    break
                state, at = "between", end + len(FUNC_END)
        return Parsed("".join(content), tuple(calls))
