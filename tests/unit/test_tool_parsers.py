"""Baton's tool parsers (dataplane/relay/tools): per parser, texts in the model's real
format and what vLLM 0.32's streaming parser assembles for them (the expected values were
read off vLLM's own classes, tests/real/vllm_tool_parse.py; tests/real/test_tool_parsers_vllm
checks them there again), and every prefix of each text, cut at every character: the parse
only ever grows (content and arguments are prefixes of the final ones, a name once given
stays), and the final parse of the whole text is the expected assembled result."""

from __future__ import annotations

from typing import Any

import pytest

from dataplane.relay.tools.parser import Parsed
from dataplane.relay.tools.parsers import PARSERS, parser_for

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "temp": {"type": "number"}, "metric": {"type": "boolean"},
            "where": {"type": "object"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip

W = "get_weather"
Case = tuple[str, str, list[tuple[str, str]]]  # text, content, [(name, arguments)]

LLAMA: list[Case] = [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [(W, '{"city": "Paris"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Lyon", "days": 3}}; '
     '{"name": "get_time", "arguments": {"zone": "CET"}}', "",
     [(W, '{"city": "Lyon", "days": 3}'), ("get_time", '{"zone": "CET"}')]),
    ("Sure: I will call it", "Sure: I will call it", []),
    ('{"name": "get_weather", "arguments": {"city": "a\\"b\\nc é \\u00e9", "temp": 1.50, '
     '"n": 1e3, "where": {"x": [1, true, null, {"y": -2}]}}}', "",
     [(W, '{"city": "a\\"b\\nc é é", "temp": 1.5, "n": 1000.0, '
          '"where": {"x": [1, true, null, {"y": -2}]}}')]),
    ('{"name":"get_time","arguments":{}}', "", [("get_time", "")]),
    ('<|python_tag|>{"name": "get_time", "arguments": {"zone": "\\ud83d\\ude00"}}\nok', "",
     [("get_time", '{"zone": "😀"}')]),
]  # fmt: skip

MISTRAL: list[Case] = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [(W, '{"city": "Paris"}')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     "", [(W, '{"city": "Lyon"}'), ("get_time", '{"zone": "CET"}')]),
    ('Let me check. [TOOL_CALLS]get_weather[ARGS]{"city":"a\\"b\\nc é", "days": 3, '
     '"where": {"x": [1.50]}}', "Let me check. ",
     [(W, '{"city":"a\\"b\\nc é", "days": 3, "where": {"x": [1.50]}}')]),
    ('  \n[TOOL_CALLS]get_time{"zone": "CET"} ', "", [("get_time", '{"zone": "CET"} ')]),
    ("No call [TOOL here", "No call [TOOL here", []),
    ("  ", "  ", []),
    # Pre-v11 (no [ARGS] in the vocabulary): a JSON array of calls, raw argument objects.
    ('Hi. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "a\\"}é", "days": 12}}, '
     '{"name": "get_time", "arguments": {"zone": {"id": "CET"}}}] done', "Hi.  done",
     [(W, '{"city": "a\\"}é", "days": 12}'), ("get_time", '{"zone": {"id": "CET"}}')]),
    ('[TOOL_CALLS] {"arguments":  {"zone": "CET"}, "name": "get_time"}', "",
     [("get_time", '{"zone": "CET"}')]),
]  # fmt: skip

QWEN_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa\"ris é\nline\n"
             "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=temp>\n2.50\n"
             "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=where>\n"
             '{"a": [1, {"b": null}]}\n</parameter>\n</function>\n</tool_call>')  # fmt: skip
QWEN_ARGS = ('{"city": "Pa\\"ris é\\nline", "days": 3, "temp": 2.5, "metric": true, '
             '"where": {"a": [1, {"b": null}]}}')  # fmt: skip
QWEN: list[Case] = [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "</function>\n</tool_call>", "", [(W, '{"city": "Paris"}')]),
    ("Checking.\n\n" + QWEN_CALL, "Checking.\n\n", [(W, QWEN_ARGS)]),
    (QWEN_CALL + "\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
     "<parameter=extra>\n5\n</parameter>\n</function>\n</tool_call>", "",
     [(W, QWEN_ARGS), ("get_time", '{"zone": "CET", "extra": "5"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\nsoon\n</parameter>\n"
     "</function>\n</tool_call>\n\nDone.", "Done.", [(W, '{"days": "soon"}')]),
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "", [("get_time", "{}")]),
    ("No call <tool_c", "No call <tool_c", []),
]  # fmt: skip

CASES: dict[str, list[Case]] = {
    "llama3_json": LLAMA, "mistral": MISTRAL, "qwen3_xml": QWEN, "qwen3_coder": QWEN,
}  # fmt: skip
PARAMS = [(name, i) for name, cases in CASES.items() for i in range(len(cases))]


def assembled(p: Parsed) -> tuple[str, list[tuple[str | None, str]]]:
    return p.content, [(c.name, c.arguments) for c in p.calls]


@pytest.mark.parametrize(("name", "i"), PARAMS)
def test_final_parse_is_vllms_assembled_result(name: str, i: int) -> None:
    text, content, calls = CASES[name][i]
    parsed = parser_for(name, TOOLS)
    assert parsed is not None
    final = parsed.parse(text, final=True)
    assert assembled(final) == (content, calls)
    assert all(c.complete for c in final.calls)


@pytest.mark.parametrize(("name", "i"), PARAMS)
def test_every_prefix_only_grows(name: str, i: int) -> None:
    text = CASES[name][i][0]
    parser = PARSERS[name](TOOLS)
    whole = parser.parse(text, final=True)
    seen = parser.parse("")
    for cut in range(len(text) + 1):
        p = parser.parse(text[:cut])
        assert whole.content.startswith(p.content), (cut, p)
        assert p.content.startswith(seen.content), (cut, p, seen)
        assert len(p.calls) <= len(whole.calls), (cut, p)
        for k, call in enumerate(p.calls):
            if call.name is not None:
                assert call.name == whole.calls[k].name, (cut, call)
            assert whole.calls[k].arguments.startswith(call.arguments), (cut, call)
            if k < len(seen.calls):
                assert call.arguments.startswith(seen.calls[k].arguments), (cut, call)
        seen = p


def test_registry_names() -> None:
    assert {"hermes", "llama3_json", "mistral", "qwen3_xml", "qwen3_coder"} <= set(PARSERS)
