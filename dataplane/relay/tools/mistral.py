"""vLLM's `mistral` tool parser for v11+ tokenizers (Mistral Small 3.x, Devstral, Magistral:
`[ARGS]` in the vocabulary), as vLLM 0.32's MistralParser engine assembles a stream
(vllm/parser/mistral.py, read, not copied). The model writes
`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, one `[TOOL_CALLS]` per call (or
`[TOOL_CALLS]name{...}`, the brace then part of the arguments). vLLM's rules:

- content is the text before the first `[TOOL_CALLS]`; whitespace-only content is held, and
  dropped once a call comes (sent at the end of a stream without calls); a tail that could
  start the tag is held back until the end of the stream;
- a call's name is the text between `[TOOL_CALLS]` and `[ARGS]` (or the first `{`), kept as
  written (spaces too); at the end of the stream a name with no `[ARGS]` yet is sent whole,
  with no arguments;
- its arguments are the raw text after `[ARGS]` up to the next `[TOOL_CALLS]` or the end,
  not re-serialised, whitespace and any text after the JSON included.

vLLM turns skip_special_tokens off for a request with tools, so the tags' text is in the
stream. The pre-v11 format (`[TOOL_CALLS][{"name": ..., "arguments": ...}]`, tokenizers
without `[ARGS]`) is told apart by what follows the tag (a JSON array or object, where a
v11+ name cannot start) and read by mistral_json.py. Not followed: the reasoning tags of the
[THINK] tokenizers (Baton parses the text after reasoning)."""

# baton: pure

from __future__ import annotations

from dataplane.relay.tools import mistral_json
from dataplane.relay.tools.parser import Parsed, ParsedCall, Tools, held_back

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def _name_end(text: str, at: int) -> tuple[int, int] | None:
    """Where the name that starts at `at` ends, and where its arguments start."""
    args, brace = text.find(ARGS, at), text.find("{", at)
    if args >= 0 and (brace < 0 or args < brace):
        return args, args + len(ARGS)
    if brace >= 0:
        return brace, brace  # the brace is the arguments' first character
    return None


class Mistral:
    def __init__(self, tools: Tools) -> None:
        self._tools = tools  # the call names its tool; nothing is typed by schema

    def parse(self, text: str, *, final: bool = False) -> Parsed:
        first = text.find(TOOL_CALLS)
        if first < 0:
            if final:
                return Parsed(text)
            shown = text[: len(text) - held_back(text, TOOL_CALLS)]
            # Whitespace alone is held: a call after it drops it.
            return Parsed(shown if shown.strip() else "")
        after = text[first + len(TOOL_CALLS) :].lstrip()
        if after[:1] in ("[", "{"):  # pre-v11: content goes out as it comes, whitespace too
            calls, tail = mistral_json.parse_calls(text, first + len(TOOL_CALLS))
            return Parsed(text[:first] + tail, tuple(calls))
        content = text[:first] if text[:first].strip() else ""
        return Parsed(content, tuple(self._calls(text, first + len(TOOL_CALLS), final)))

    def _calls(self, text: str, at: int, final: bool) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        while True:
            ends = _name_end(text, at)
            if ends is None:
                if final:  # vLLM ends the call at the end of the stream: its name as is
                    calls.append(ParsedCall(text[at:], "", complete=True))
                return calls
            name, start = text[at : ends[0]], ends[1]
            nxt = text.find(TOOL_CALLS, start)
            if nxt < 0:
                args = text[start:]
                if not final:
                    args = args[: len(args) - held_back(args, TOOL_CALLS)]
                calls.append(ParsedCall(name, args, complete=final))
                return calls
            calls.append(ParsedCall(name, text[start:nxt], complete=True))
            at = nxt + len(TOOL_CALLS)
