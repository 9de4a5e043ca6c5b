"""Tool calls in a chat stream, kept across a seam (pure): the stitcher's part that knows
what the client has of its tool calls and continues them after a resume.

- First stream: the engine's parser sends content and `tool_calls` deltas, and withholds the
  text of the calls (and a tail that could start a tag). The client's calls are recorded
  (`said`): id, name, arguments as it assembled them.
- At a seam (`rebuild`): the generated ids are decoded by the new engine (the caller does
  that), so the choice's text is the model's raw text again. Baton's copy of the backend's
  parser reads it (parser.py) and what the client has must agree with that reading, call by
  call; else the stream is refused a resume, explicitly.
- Resumed chunks (`delta`): the raw text grows; Baton re-parses the reply and sends what the
  client lacks, the way vLLM does: content, each new call's id (a fresh one, as the engine
  would make), type and name once, then its arguments as the difference in length from what
  the client has. finish_reason "stop" becomes "tool_calls" once the client has a call.

The criterion is what the client assembles (content, reasoning, and per call id, name and
arguments): identical to an uninterrupted stream's. Chunk boundaries differ: a resumed
stream's chunks are its own."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dataplane.relay.progress import ChoiceProgress, SentCall
from dataplane.relay.tools.parser import Parsed, ToolParser


def runs_tool_parser(body: Mapping[str, Any]) -> bool:
    """Whether an engine with auto tool choice runs its tool parser on this chat request:
    tools offered, tool_choice "auto" or left out (vLLM's default then)."""
    return bool(body.get("tools")) and body.get("tool_choice", "auto") in ("auto", None)


def _compatible(a: str, b: str) -> bool:
    """One is a prefix of the other: texts of the same stream at two moments."""
    return a.startswith(b) or b.startswith(a)


class ToolFollow:
    """One request's tool calls, read by `parser` (the backend's, in Baton's copy).
    `new_id()`: an id for a call the resume starts, as the engine would make one."""

    def __init__(
        self, parser: ToolParser, new_id: Callable[[], str], *, first_only: bool = False
    ) -> None:
        self.parser = parser
        self._new_id = new_id
        # parallel_tool_calls: false: vLLM sends only the first call's deltas.
        self._first_only = first_only

    # -- the first stream ----------------------------------------------------------------

    @staticmethod
    def said(p: ChoiceProgress, tool_calls: Sequence[Any]) -> None:
        """The client got these tool-call deltas (a chat delta's `tool_calls`)."""
        for tc in tool_calls:
            if not isinstance(tc, Mapping):
                continue
            fn = tc.get("function") if isinstance(tc.get("function"), Mapping) else {}
            index = tc.get("index")
            if not isinstance(index, int) or index < 0:
                continue
            if index >= len(p.calls):
                # A call's first delta carries its id and name (vLLM's shape).
                while len(p.calls) <= index:
                    p.calls.append(SentCall("", ""))
            call = p.calls[index]
            if isinstance(tc.get("id"), str):
                call.id = tc["id"]
            name = fn.get("name") if fn else None
            if isinstance(name, str):
                call.name += name
            args = fn.get("arguments") if fn else None
            if isinstance(args, str):
                call.arguments += args

    # -- the seam --------------------------------------------------------------------------

    def rebuild(
        self,
        p: ChoiceProgress,
        raw: str,
        whole: bool = False,
        boundary: tuple[int, int] | None = None,
    ) -> str | None:
        """The choice's text becomes `raw`, the new engine's decoding of the generated ids
        (every one of them when `whole`: they end at a character boundary; else up to the
        last boundary); `boundary`: (tokens, characters) of another known boundary. Returns
        why the stream cannot be resumed (what the client has is not what Baton's parser
        reads there), else None. Only for a choice past its reasoning."""
        if p.content_sent >= 0:
            return None  # rebuilt at an earlier seam: its text is raw already
        old = p.text
        start = p.reply_start
        if not raw.startswith(old[:start]):
            return "the reasoning the client has is not the text of its ids"
        said = old[start:]
        parsed = self.parser.parse(raw[start:])
        if not _compatible(parsed.content, said):
            return (
                f"the client's content ends {said[-24:]!r} where the tool parser reads "
                f"{parsed.content[-24:]!r}"
            )
        for i, call in enumerate(p.calls):
            if i >= len(parsed.calls) or parsed.calls[i].name != call.name:
                return f"tool call {i} ({call.name!r}) is not what the tool parser reads"
            if not _compatible(parsed.calls[i].arguments, call.arguments):
                return f"tool call {i}'s arguments are not what the tool parser reads"
        p.set_text(raw)
        p.text_len = len(raw)
        p.recent_text.clear()
        # The engine's chunks told no character boundary of the raw text; the decoding tells
        # the end, when it is one. A resume whose prompt ends elsewhere derives its text from
        # ids, from the last boundary (progress.Held).
        p.settled.clear()
        p.settled.append((0, 0))
        if boundary is not None and 0 < boundary[0] < len(p.token_ids):
            p.settled.append(boundary)
        if whole and p.token_ids:
            p.settled.append((len(p.token_ids), len(raw)))
        p.content_sent = len(said)
        return None

    # -- resumed chunks ----------------------------------------------------------------------

    def delta(self, p: ChoiceProgress, *, final: bool) -> dict[str, Any]:
        """What the client lacks of the reply as it stands in `p` (raw text, rebuilt): the
        content and tool-call parts of a chat delta (empty: nothing new)."""
        parsed = self.parser.parse(p.reply, final=final)
        out: dict[str, Any] = {}
        if len(parsed.content) > p.content_sent:
            out["content"] = parsed.content[p.content_sent :]
            p.content_sent = len(parsed.content)
        calls = self._calls(p, parsed)
        if calls:
            out["tool_calls"] = calls
        return out

    def _calls(self, p: ChoiceProgress, parsed: Parsed) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if self._first_only and i > 0:
                break
            if i >= len(p.calls):
                sent = SentCall(self._new_id(), call.name)
                p.calls.append(sent)
                out.append({"index": i, "id": sent.id, "type": "function",
                            "function": {"name": call.name}})  # fmt: skip
            sent = p.calls[i]
            if len(call.arguments) > len(sent.arguments):
                piece = call.arguments[len(sent.arguments) :]
                sent.arguments = call.arguments
                out.append({"index": i, "function": {"arguments": piece}})
        return out

    @staticmethod
    def finish(p: ChoiceProgress, finish: str) -> str:
        """vLLM's finish for a stream whose client got tool calls: "tool_calls" for "stop"."""
        return "tool_calls" if finish == "stop" and p.calls else finish
