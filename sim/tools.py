"""vLLM's ``--enable-auto-tool-choice --tool-call-parser hermes`` for chat (pure).

Three parts, as vLLM 0.32 has them:

* the request (sim.protocol's ``parse_tools``): ``tools`` and ``tool_choice``
  checked the way vLLM's ChatCompletionRequest checks them. A ToolSpec comes
  back only when tools are offered and tool_choice is absent, null or "auto"
  (vLLM's default when tools are given); then the parser runs and the model
  calls a tool.
  "none" (or no tools) gives None: the request is served as if the mode were
  off. "required" and a named tool are refused (400): vLLM serves those
  through guided decoding into another format, which the sim does not have.
* the model (sim.tool_script): the tools are rendered into the prompt
  (sim.tool_prompt) and the model's calls are a function of the ids.
* the parser (``ToolStream``, ``extract``): mirrors
  vllm/tool_parsers/hermes_tool_parser.py (Hermes2ProToolParser) as
  vllm/parser/abstract_parser.py (``Parser.parse_delta`` / ``parse``) and
  the chat server drive it. Streaming re-parses the whole text at each
  chunk: content before ``<tool_call>`` goes out as ``{"content": text}``
  (a suffix that could start the tag is held back); once a call's name is
  complete, ``{"content": null, "tool_calls": [{"id": "chatcmpl-tool-<16
  hex>", "type": "function", "index": i, "function": {"name": name}}]}``;
  then each chunk's new argument text as ``{"content": null, "tool_calls":
  [{"index": i, "function": {"arguments": text}}]}`` (partial JSON as it
  stands, the closing brace of the call object dropped once it is complete).
  A chunk with nothing new gives None (the chat server skips it; see
  sim.reasoning). A finishing delta that carries tool calls gets the
  arguments parsed but not streamed appended (vLLM's finalize_generation).
  The choice's finish_reason "stop" becomes "tool_calls" once any tool-call
  delta went out. Text after the first ``<tool_call>`` never goes out as
  content. Non-streaming: every ``<tool_call>…</tool_call>`` (or a last
  unclosed one) must parse as JSON with "name" and "arguments", else the
  whole text is content and there are no calls; content is the text before
  the first tag, null when blank; finish_reason "tool_calls" when calls
  were found.

With a reasoning parser before it (``think``: the sim's --reasoning), the
reasoning phase is sim.reasoning's until the ``</think>`` token; from that
chunk on the tool parser sees the content only, and the reasoning of the
transition chunk rides along (``{"reasoning": r}`` when the tool parser has
nothing, else added to its delta), as in Parser.parse_delta.

The parser's adjust_request (sim.adjust) turns skip_special_tokens off for a
request offering tools (hermes, mistral, qwen3_xml; with a reasoning parser,
mistral and qwen3_xml for every chat request): a special think tag's text then
shows in the stream, and the reasoning parser finds it there.

Simplified: requests the mode does not parse (no tools, tool_choice "none")
are otherwise served as with the mode off, whereas vLLM runs its parser for
them too and so skips chunks with no text (a finish then has an empty delta);
``include_reasoning: false`` nulls reasoning only where there was some (as
sim.reasoning does; vLLM adds ``"reasoning": null`` to every delta);
``parallel_tool_calls: false`` reaches the model through the prompt.

Other formats (``--tool-call-parser``): ToolStream drives sim.tool_parsers'
llama3_json, mistral and qwen3_xml parsers the same way (reasoning first, the
flush of unstreamed arguments at the end, finish_reason "tool_calls").
"""

# baton: pure

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sim import tool_parsers
from sim.reasoning import R1Stream
from sim.tokenizer import TOOL_CALL_END, TOOL_CALL_START

Delta = dict[str, Any]

MAX_TOOL_CALL_AFTER = 1 << 20
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS_RE = re.compile(r'"arguments"\s*:\s*')


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A chat request's tools (rendered into its prompt) and its parallel_tool_calls."""

    tools: tuple[Mapping[str, Any], ...]
    parallel: bool = True


# -- the parser --------------------------------------------------------------------
class _Call:
    __slots__ = ("name", "arguments", "streamed")

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments: str | None = None  # parsed so far (vLLM's prev_tool_call_arr)
        self.streamed = ""  # sent so far (streamed_args_for_tool)


class ToolStream:
    """Per-choice streaming state of the hermes parser (after a reasoning parser, if any)."""

    __slots__ = ("_r1", "_think_end", "_answering", "_text", "_sent", "_calls", "called",
                 "_other")  # fmt: skip

    def __init__(
        self, think: tuple[int, int] | None = None, *, include_reasoning: bool = True,
        fmt: str = "hermes", tools: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self._r1: R1Stream | None = None
        self._think_end: int | None = None
        if think is not None:
            self._r1 = R1Stream(*think, include_reasoning=include_reasoning)
            self._think_end = think[1]
        self._answering = think is None  # past the reasoning phase
        self._text = ""  # the text the tool parser has seen
        self._sent = 0  # how much of it went out as content
        self._calls: list[_Call] = []
        self.called = False  # a tool-call delta went out: finish_reason "tool_calls"
        # Another format's parser (sim.tool_parsers); None: hermes, here.
        self._other = None if fmt == "hermes" else tool_parsers.CallStream(fmt, tools)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason

    def delta(self, text: str, ids: Sequence[int], *, finished: bool = False) -> Delta | None:
        """The chunk's delta for this text and these token ids; None = nothing to send."""
        thought = None
        if not self._answering:
            assert self._r1 is not None
            out = self._r1.delta(text, ids)
            if self._think_end not in ids:
                return out
            # The reasoning parser's content of this chunk opens the tool phase.
            self._answering = True
            thought = out.get("reasoning") if out else None
            text = (out.get("content") if out else None) or ""
        out = self._parse(text)
        if thought:
            if out is None:
                out = {"reasoning": thought}
            elif not out.get("reasoning"):
                out["reasoning"] = thought
        if finished and out and out.get("tool_calls"):
            fn = out["tool_calls"][-1]["function"]
            fn["arguments"] = (fn.get("arguments") or "") + self._unstreamed()
        return out

    def _parse(self, text: str) -> Delta | None:
        if self._other is not None:
            other = self._other.parse(text)
            self.called = self.called or bool(other and other.get("tool_calls"))
            return other
        self._text += text
        current = self._text
        content = self._content(current)
        calls: list[Delta] = []
        for i, (body, complete) in enumerate(_call_bodies(current)):
            if i >= len(self._calls):
                self._calls.append(_Call())
            call = self._calls[i]
            if call.name is None:
                m = _NAME_RE.search(body)
                if not m:
                    break  # a later call cannot go out before this one's name
                call.name = m.group(1)
                calls.append(
                    {"id": tool_call_id(), "type": "function", "index": i,
                     "function": {"name": call.name}}
                )  # fmt: skip
            args = _arguments(body, complete)
            if args is not None and len(args) > len(call.streamed):
                calls.append({"index": i, "function": {"arguments": args[len(call.streamed) :]}})
                call.streamed = call.arguments = args
        if not content and not calls:
            return None
        self.called = self.called or bool(calls)
        out: Delta = {"content": content}
        if calls:
            out["tool_calls"] = calls
        return out

    def _content(self, current: str) -> str | None:
        at = current.find(TOOL_CALL_START)
        if at < 0:
            at = len(current) - _overlap(current, TOOL_CALL_START)
        if at <= self._sent:
            return None
        content, self._sent = current[self._sent : at], at
        return content

    def _unstreamed(self) -> str:
        if self._other is not None:
            return self._other.unstreamed()
        if not self._calls:
            return ""
        call = self._calls[-1]
        expected = call.arguments if call.arguments is not None else "{}"
        return expected[len(call.streamed) :] if expected.startswith(call.streamed) else ""


def _call_bodies(text: str) -> list[tuple[str, bool]]:
    """(JSON text, complete) of each ``<tool_call>`` region so far."""
    out: list[tuple[str, bool]] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        begin = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, begin)
        if end >= 0:
            out.append((text[begin:end].strip(), True))
            pos = end + len(TOOL_CALL_END)
            continue
        raw = text[begin:]
        cut = _overlap(raw, TOOL_CALL_END)
        body = (raw[:-cut] if cut else raw).strip()
        # Valid JSON without the closing tag: the body is complete, the tag is still to come.
        out.append((body, bool(body) and _is_json(body)))
        break
    return out


def _arguments(body: str, complete: bool) -> str | None:
    """The text after ``"arguments":``; when complete, without the call object's last brace."""
    m = _ARGS_RE.search(body)
    if not m:
        return None
    raw = body[m.end() :]
    if complete:
        raw = raw.rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
    return raw


def _overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def tool_call_id() -> str:
    """vLLM's make_tool_call_id(): "chatcmpl-tool-" and 16 random hex digits."""
    return tool_parsers.tool_call_id()


def extract(
    text: str, fmt: str = "hermes", tools: Sequence[Mapping[str, Any]] = ()
) -> tuple[str | None, list[Delta]]:
    """Non-streaming: (content, tool calls); no calls means the text is all content."""
    if fmt != "hermes":
        return tool_parsers.extract(text, fmt, tools)
    if TOOL_CALL_START not in text:
        return text, []
    calls: list[Delta] = []
    try:
        for closed, open_ in _CALL_RE.findall(text):
            call = json.loads(closed or open_)
            name, args = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
            if not isinstance(name, str):
                raise TypeError("name")
            calls.append(
                {"id": tool_call_id(), "type": "function",
                 "function": {"name": name, "arguments": args}}
            )  # fmt: skip
    except (ValueError, TypeError, KeyError, IndexError):
        return text, []  # vLLM logs the error and returns the text as content
    content = text[: text.find(TOOL_CALL_START)]
    return (content if content.strip() else None), calls
