"""vLLM's `hermes` tool parser (Hermes 2 Pro, Qwen2.5, Qwen3), as vLLM 0.32's
Hermes2ProToolParser assembles a stream (vllm/tool_parsers/hermes_tool_parser.py, read, not
copied). The model writes `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block
per call. vLLM re-parses the whole text at every chunk, as Baton does, so its rules are
the ones here:

- content is the text before the first `<tool_call>`, less a tail that could start that
  tag (held back, and never flushed at the end of the stream either); nothing after the
  first tag is ever content;
- a call's name is sent once `"name": "…"` is whole in its block; a later call waits for
  an earlier one's name;
- its arguments are the block's text after `"arguments":` as it stands, the raw JSON text
  (not re-serialised): whitespace trimmed at the end, and once the block is complete
  (its end tag came, or its text is whole JSON already) the brace that closes the call
  object dropped.

vLLM sends a call's arguments as the difference in length from what it sent before, so
the client's string is always the latest of these texts (follow.py sends it the same
way). The engine turns skip_special_tokens off for such a request: the tags' text is in
the stream even where the tokenizer marks them special (parsers.keeps_special)."""

# baton: pure

from __future__ import annotations

import json
import re

from dataplane.relay.tools.parser import Parsed, ParsedCall, Tools, held_back

START = "<tool_call>"
END = "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class Hermes:
    def __init__(self, tools: Tools) -> None:
        self._tools = tools  # the format names its tool itself; nothing is typed by schema

    def parse(self, text: str, *, final: bool = False) -> Parsed:
        at = text.find(START)
        content = text[: len(text) - held_back(text, START)] if at < 0 else text[:at]
        calls: list[ParsedCall] = []
        for body, complete in _blocks(text):
            name = _NAME.search(body)
            if name is None:
                break  # a later call cannot start before this one's name
            calls.append(ParsedCall(name.group(1), _arguments(body, complete), complete))
        return Parsed(content, tuple(calls))


def _blocks(text: str) -> list[tuple[str, bool]]:
    """(JSON text, complete) of each `<tool_call>` block so far."""
    out: list[tuple[str, bool]] = []
    pos = 0
    while (start := text.find(START, pos)) >= 0:
        begin = start + len(START)
        end = text.find(END, begin)
        if end >= 0:
            out.append((text[begin:end].strip(), True))
            pos = end + len(END)
            continue
        raw = text[begin:]
        cut = held_back(raw, END)
        body = (raw[:-cut] if cut else raw).strip()
        # Whole JSON without its end tag: the call is complete, the tag still to come.
        out.append((body, bool(body) and _whole_json(body)))
        break
    return out


def _arguments(body: str, complete: bool) -> str:
    m = _ARGS.search(body)
    if m is None:
        return ""
    raw = body[m.end() :]
    if complete:
        raw = raw.rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
    return raw
