"""vLLM 0.32's llama3_json, mistral and qwen3_xml tool parsers, streaming and whole (pure).

Each streaming parser takes a chunk's text (the content after any reasoning),
keeps the text so far, and gives the chunk's delta or None, as sim.tools'
hermes parser does; sim.tools.ToolStream drives them (reasoning, the end of
stream flush, finish_reason). Deltas: content as ``{"content": text}``; a
call's name once complete, ``{"content": null, "tool_calls": [{"id", "type":
"function", "index": i, "function": {"name": name}}]}``; then argument text
as it grows, ``{"content": null, "tool_calls": [{"index": i, "function":
{"arguments": piece}}]}``.

* llama3_json (Llama3JsonToolParser): calls only when the text starts with
  ``<|python_tag|>`` or "{" (otherwise every chunk is content); JSON objects
  joined by "; ", "parameters" (or "arguments") holding the arguments.
* mistral (MistralParser, legacy pre-v11 path taken with a Hugging Face
  tokenizer that has no ``[ARGS]``): content before ``[TOOL_CALLS]``, then
  a JSON array of ``{"name", "arguments"}``; ids are 9 letters/digits and
  every argument delta carries ``"type": "function"``, as vLLM's do.
* qwen3_xml (Qwen3 engine parser): ``<tool_call>`` blocks of
  ``<function=NAME>`` and ``<parameter=KEY>\\nVALUE\\n</parameter>``;
  arguments are JSON built as the values come: a string parameter streams
  its value (JSON-escaped) as it grows, an integer/number one (by the
  request's tool schema) once complete; the closing brace with
  ``</function>``. Text between and after the blocks is content.

Simplified: vLLM's llama3_json re-parses partial JSON and streams the common
prefix of successive dumps (so a number or an escape can lag a chunk) and
sends a new call's name one chunk after the object opens; mistral splits
at JSON punctuation through ijson. Here argument text goes out as written,
once per chunk: the concatenated deltas (what a client assembles) are the
same, the cut between two deltas may differ.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from sim.tokenizer import PYTHON_TAG, TOOL_CALL_END, TOOL_CALL_START, TOOL_CALLS

Delta = dict[str, Any]
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_FUNC_RE = re.compile(r"<function=([^>\n]*)>")
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>\n?")
_PARAM_END = "\n</parameter>"
_ALNUM = string.ascii_letters + string.digits


def tool_call_id(fmt: str = "hermes") -> str:
    """vLLM's ids: "chatcmpl-tool-" and 16 random hex digits; Mistral's 9 letters/digits."""
    if fmt == "mistral":
        return "".join(_ALNUM[b % len(_ALNUM)] for b in os.urandom(9))
    return "chatcmpl-tool-" + os.urandom(8).hex()


def param_types(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """Per tool name, each parameter's JSON type (from the request's schemas)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties")
        if isinstance(props, Mapping):
            out[fn["name"]] = {
                str(k): str(v.get("type")) for k, v in props.items() if isinstance(v, Mapping)
            }
    return out


class _Call:
    __slots__ = ("name", "streamed")

    def __init__(self) -> None:
        self.name: str | None = None
        self.streamed = ""


class CallStream:
    """Streaming state shared by the three formats: the calls so far and what went out."""

    def __init__(self, fmt: str, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.fmt = fmt
        self.types = param_types(tools)
        self.text = ""
        self.sent = 0  # of the text, what went out as content
        self.calls: list[_Call] = []
        self.parsed: list[tuple[str | None, str]] = []  # (name, arguments so far) per call

    def parse(self, text: str) -> Delta | None:
        prev = self.text
        self.text += text
        if self.fmt == "llama3_json":
            cur = self.text
            if not (cur.startswith(PYTHON_TAG) or cur.startswith("{")):
                self.sent = len(cur)
                return {"content": text} if text else None
            content, found = None, _json_calls(cur.removeprefix(PYTHON_TAG))
        elif self.fmt == "mistral":
            at = self.text.find(TOOL_CALLS)
            stop = len(self.text) if at < 0 else at
            content = self.text[self.sent : stop] or None
            self.sent = max(self.sent, stop)
            found = [] if at < 0 else _json_calls(self.text[at + len(TOOL_CALLS) :])
        else:
            content, found = self._xml_content(), _xml_calls(self.text, self.types)
        del prev
        self.parsed = found
        calls = self._deltas(found)
        if not content and not calls:
            return None
        out: Delta = {"content": content}
        if calls:
            out["tool_calls"] = calls
        return out

    def _deltas(self, found: list[tuple[str | None, str]]) -> list[Delta]:
        out: list[Delta] = []
        for i, (name, args) in enumerate(found):
            if i >= len(self.calls):
                self.calls.append(_Call())
            call = self.calls[i]
            if call.name is None:
                if name is None:
                    break  # a later call cannot go out before this one's name
                call.name = name
                out.append({"id": tool_call_id(self.fmt), "type": "function", "index": i,
                            "function": {"name": name}})  # fmt: skip
            if len(args) > len(call.streamed) and args.startswith(call.streamed):
                piece: Delta = {"index": i, "function": {"arguments": args[len(call.streamed) :]}}
                if self.fmt == "mistral":
                    piece = {"type": "function", **piece}
                out.append(piece)
                call.streamed = args
        return out

    def _xml_content(self) -> str | None:
        """qwen3_xml: text outside the <tool_call> blocks (a possible tag start held back)."""
        text, out = self.text, []
        pos = self.sent
        while pos < len(text):
            at = text.find(TOOL_CALL_START, pos)
            if at == pos:
                end = text.find(TOOL_CALL_END, pos)
                if end < 0:
                    break
                pos = end + len(TOOL_CALL_END)
                continue
            stop = at if at >= 0 else len(text) - _overlap(text[pos:], TOOL_CALL_START)
            out.append(text[pos:stop])
            pos = stop
            if at < 0:
                break
        self.sent = pos
        return "".join(out) or None

    def unstreamed(self) -> str:
        if not self.calls or len(self.parsed) < len(self.calls):
            return ""
        call, (_, args) = self.calls[-1], self.parsed[len(self.calls) - 1]
        expected = args or "{}"
        return expected[len(call.streamed) :] if expected.startswith(call.streamed) else ""


def _json_calls(text: str) -> list[tuple[str | None, str]]:
    """(name once complete, arguments text so far) of each top-level JSON object."""
    out: list[tuple[str | None, str]] = []
    for obj in _objects(text):
        m = _NAME_RE.search(obj)
        name = json.loads(f'"{m.group(1)}"') if m else None
        a = _ARGS_RE.search(obj)
        args = obj[a.end() : a.end() + _value_len(obj[a.end() :])] if a else ""
        out.append((name, args))
    return out


def _objects(text: str) -> list[str]:
    """The top-level ``{...}`` objects of the text, the last one possibly partial."""
    out: list[str] = []
    depth, start, in_str, esc = 0, 0, False, False
    for i, c in enumerate(text):
        if in_str:
            esc, in_str = (False, True) if esc else (c == "\\", c != '"')
            continue
        if c == '"' and depth:
            in_str = True
        elif c == "{":
            start = i if depth == 0 else start
            depth += 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                out.append(text[start : i + 1])
    if depth:
        out.append(text[start:])
    return out


def _value_len(text: str) -> int:
    """Length of the JSON value that opens the text (all of it while incomplete)."""
    depth, in_str, esc = 0, False, False
    for i, c in enumerate(text):
        if in_str:
            esc, in_str = (False, True) if esc else (c == "\\", c != '"')
            if not in_str and depth == 0:
                return i + 1
            continue
        if c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return i
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == "," and depth == 0:
            return i
    return len(text)


def _xml_calls(text: str, types: Mapping[str, Mapping[str, str]]) -> list[tuple[str | None, str]]:
    out: list[tuple[str | None, str]] = []
    pos = 0
    while (at := text.find(TOOL_CALL_START, pos)) >= 0:
        end = text.find(TOOL_CALL_END, at)
        block = text[at + len(TOOL_CALL_START) : end if end >= 0 else len(text)]
        m = _FUNC_RE.search(block)
        if not m:
            out.append((None, ""))
            break
        out.append((m.group(1), _xml_args(block[m.end() :], types.get(m.group(1), {}))))
        if end < 0:
            break
        pos = end + len(TOOL_CALL_END)
    return out


def _xml_args(body: str, types: Mapping[str, str]) -> str:
    """The arguments JSON as far as the parameters so far allow."""
    parts: list[str] = []
    pos, closed = 0, False
    while (m := _PARAM_RE.search(body, pos)) is not None:
        key = json.dumps(m.group(1), ensure_ascii=False)
        end = body.find(_PARAM_END, m.end())
        raw = body[m.end() : end] if end >= 0 else body[m.end() :]
        kind = types.get(m.group(1), "string")
        if kind in ("integer", "number"):
            if end < 0:
                parts.append(f"{key}: ")
                break
            parts.append(f"{key}: {_number(raw)}")
        else:
            if end < 0:
                held = raw[: len(raw) - _overlap(raw, _PARAM_END)]
                parts.append(f"{key}: " + json.dumps(held, ensure_ascii=False)[:-1])
                break
            parts.append(f"{key}: " + json.dumps(raw, ensure_ascii=False))
        pos = end + len(_PARAM_END)
    else:
        closed = "</function>" in body[pos:]
    if not parts and not closed:
        return ""
    return "{" + ", ".join(parts) + ("}" if closed else "")


def _number(raw: str) -> str:
    try:
        return json.dumps(json.loads(raw.strip()))
    except ValueError:
        return json.dumps(raw)


def _overlap(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def extract(
    text: str, fmt: str, tools: Sequence[Mapping[str, Any]] = ()
) -> tuple[str | None, list[Delta]]:
    """Non-streaming: (content, tool calls); no calls means the text is all content."""
    if fmt == "llama3_json":
        body = text.removeprefix(PYTHON_TAG)
        content = None
    elif fmt == "mistral":
        if TOOL_CALLS not in text:
            return text, []
        content, _, body = text.partition(TOOL_CALLS)
        content = content if content.strip() else None
    else:
        if TOOL_CALL_START not in text:
            return text, []
        content = text[: text.find(TOOL_CALL_START)]
        content = content if content.strip() else None
        body = text
    found = _xml_calls(body, param_types(tools)) if fmt == "qwen3_xml" else _json_calls(body)
    calls: list[Delta] = []
    try:
        for name, args in found:
            if name is None:
                raise ValueError("no name")
            parsed = json.loads(args or "{}")
            calls.append({"id": tool_call_id(fmt), "type": "function",
                          "function": {"name": name,
                                       "arguments": json.dumps(parsed, ensure_ascii=False)}})
    except ValueError:
        return text, []  # vLLM logs the error and returns the text as content
    if not calls:
        return text, []
    return content, calls
