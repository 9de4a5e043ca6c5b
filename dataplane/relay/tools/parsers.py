"""The tool parsers Baton follows, by vLLM's --tool-call-parser name. A backend whose parser
is not here gets no resume for a request that offers tools: refused, explicitly."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable

from dataplane.relay.tools import hermes, llama3_json, mistral, qwen3_xml
from dataplane.relay.tools.parser import ToolParser, Tools

PARSERS: dict[str, Callable[[Tools], ToolParser]] = {
    "hermes": hermes.Hermes,
    "llama3_json": llama3_json.Llama3Json,
    "mistral": mistral.Mistral,
    "qwen3_xml": qwen3_xml.Qwen3Xml,
    "qwen3_coder": qwen3_xml.Qwen3Xml,
}


def parser_for(name: str, tools: Tools) -> ToolParser | None:
    """The parser `name` for a request offering `tools`; None when Baton does not follow it."""
    make = PARSERS.get(name)
    return make(tools) if make is not None else None
