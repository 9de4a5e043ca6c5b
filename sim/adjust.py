"""vLLM 0.32's ``adjust_request``, as far as it decides ``skip_special_tokens`` (pure).

vLLM's chat renderer (renderers/online_renderer.py, preprocess_chat) hands a chat
request to the server's parsers' ``adjust_request`` when the server has a reasoning
parser, or when the request's tool_choice is not "none" (with tools and no tool_choice
vLLM resolves it to "auto"; an explicit null is not "none" either). The parser then
runs the reasoning parser's adjust_request (deepseek_r1's changes nothing here) and
the tool parser's:

* hermes (Hermes2ProToolParser): ``skip_special_tokens = False`` when the request
  offers tools and tool_choice is not "none" ("the tool_call tokens are marked special
  in some models");
* mistral (the legacy path, a Hugging Face tokenizer: MistralParser) and qwen3_xml
  (Qwen3Parser): both are ParserEngine parsers, whose adjust_request sets
  ``skip_special_tokens = False`` whenever it runs, tools or not (so on a server with
  a reasoning parser, for every chat request);
* llama3_json (Llama3JsonToolParser): the base ToolParser's, which leaves it.

The tool parser exists only with ``--enable-auto-tool-choice`` (the sim's
--tool-calls). With it off, a special token's text shows in the stream and in
/v1/completions decoding (sim.generation.Detokenizer), and the reasoning parser then
sees a special ``</think>``'s text, as vLLM's does. Completions run no parser: there
the request's own ``skip_special_tokens`` decides. The sim's Responses API renders no
tools, so only a reasoning parser brings its requests here.
"""

# baton: pure

from __future__ import annotations

from dataclasses import replace

from sim.protocol import GenRequest

# Tool parsers whose adjust_request turns skip_special_tokens off whenever it runs.
_ALWAYS = frozenset({"mistral", "qwen3_xml"})


def keeps_special(
    tool_parser: str | None, *, reasoning: bool, tools: bool, tool_choice_none: bool
) -> bool:
    """Whether the server's parsers turn skip_special_tokens off for a chat request.

    ``tool_parser``: the server's (None: no auto tool choice); ``reasoning``: it has a
    reasoning parser; ``tools``: the request offers tools."""
    if tool_parser is None or (tool_choice_none and not reasoning):
        return False  # no tool parser's adjust_request runs
    if tool_parser == "hermes":
        return tools and not tool_choice_none
    return tool_parser in _ALWAYS


def adjusted(req: GenRequest, tool_parser: str | None, *, reasoning: bool) -> GenRequest:
    """``req`` as the server's parsers leave it (module docstring)."""
    if req.kind != "chat" or not req.params.skip_special_tokens:
        return req
    if not keeps_special(
        tool_parser, reasoning=reasoning, tools=req.tool is not None,
        tool_choice_none=req.tool_choice_none,
    ):  # fmt: skip
        return req
    return replace(req, params=replace(req.params, skip_special_tokens=False))
