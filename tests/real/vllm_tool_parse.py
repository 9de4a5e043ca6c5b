"""What vLLM's own streaming tool parser assembles for some texts: run with the engines'
venv python (it imports vllm), never with Baton's. Reads one JSON object on stdin:
{"parser": vLLM's --tool-call-parser name, "tools": the request's tools, "texts": [...],
"chunk": tokens per streamed chunk}, and prints a JSON list, per text, of
{"content": joined content deltas, "calls": [{"name", "arguments"}, ...]}.

The parser is composed the way vLLM's chat server composes it (ParserManager.get_parser,
no reasoning parser) and fed through Parser.parse_delta, the chat server's own entry point,
with finished=True on the last chunk (the end-of-stream flush of unstreamed arguments).
The tokenizer is built here, offline: one token per character, plus each parser's marker
strings as added tokens, so that a marker is one id, as in the real models' vocabularies.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager

MARKERS = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]",
    "<think>", "</think>", "<|im_start|>", "<|im_end|>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
]  # fmt: skip


def tokenizer(texts: list[str], without: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A one-character-a-token tokenizer with the markers as added tokens, less `without`
    (a vocabulary without [ARGS] is a pre-v11 Mistral tokenizer to vLLM)."""
    chars = sorted({c for t in texts for c in t} | set(' \n{}[]":,<>=/|'))
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    markers = [m for m in MARKERS if m not in (without or ())]
    fast.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    return fast


def stream(name: str, tools: list[dict[str, Any]], text: str, chunk: int,
           tok: PreTrainedTokenizerFast) -> dict[str, Any]:  # fmt: skip
    parser_cls = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True)
    assert parser_cls is not None
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, stream=True
    )
    parser = parser_cls(tok, request.tools, chat_template_kwargs={}, model_config=None)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == text, (pieces, text)
    content, calls = "", {}  # type: tuple[str, dict[int, dict[str, str]]]
    for at in range(0, len(ids), chunk):
        last = at + chunk >= len(ids)
        delta = parser.parse_delta(
            "".join(pieces[at : at + chunk]), ids[at : at + chunk], request, [1, 2, 3],
            finished=last,
        )  # fmt: skip
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            fn = tc.function
            if fn is None:
                continue
            fn = fn if not isinstance(fn, dict) else type("F", (), fn)  # model_dump()ed
            call["name"] += getattr(fn, "name", None) or ""
            call["arguments"] += getattr(fn, "arguments", None) or ""
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}


def main() -> None:
    job = json.load(sys.stdin)
    tok = tokenizer(job["texts"], job.get("without"))
    out = [stream(job["parser"], job["tools"], t, job["chunk"], tok) for t in job["texts"]]
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
