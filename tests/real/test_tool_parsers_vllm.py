"""Baton's tool parsers against vLLM's own: each text of tests/unit/test_tool_parsers (and
hermes's, and some of each format's odd cases) is streamed through vLLM 0.32's parser, as
its chat server drives it (tests/real/vllm_tool_parse.py, run by the engines' python), one
token per chunk and three; what the client assembles must be Baton's parse(text,
final=True). The texts here assemble the same for both chunkings (the parsers' docstrings
name the ones that do not).

Run: .venv/bin/pytest -m real tests/real/test_tool_parsers_vllm.py"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dataplane.relay.tools.parsers import PARSERS
from scripts.engines.replicas import Cache
from tests.unit.test_tool_parsers import CASES, TOOLS

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("vllm_tool_parse.py")

HERMES = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\"b\\né", '
    '"days": 3, "where": {"x": [1.50]}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {"zone": "CET"}}\n</tool_call>',
    "No call here.",
]  # fmt: skip
MORE = {
    "llama3_json": [
        '{"arguments": {"city": "Paris"}, "name": "get_weather"}',
        '{"name": "get_weather", "arguments": {"city": "x\\\\", "days": -0}}  ',
        '{"name": "get_time", "arguments": "raw"}',
        ' {"name": "get_time", "arguments": {}}',
    ],
    "mistral": [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}\nDone',
        "Hi [TOOL_CALLS]get_time",
        'x { [TOOL_CALLS] get_time [ARGS]{"zone": "CET"}[TOOL_CALLS]',
    ],
    "qwen3_xml": [
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2.0\n</parameter>\n"
        "<parameter=temp>\nabc\n</parameter>\n<parameter=metric>\n0\n</parameter>\n"
        "<parameter=tags>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
        "A\n<tool_call>\n<function=nope>\n<parameter=a>\n\nb\n\n</parameter>\n</function>\n"
        "</tool_call>\nB",
        "x <function=get_time>\n<parameter=zone>CET</parameter></function>\nY",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3",
    ],
}  # fmt: skip


def texts(name: str) -> list[str]:
    if name == "hermes":
        return HERMES
    more = MORE["qwen3_xml" if name == "qwen3_coder" else name]
    return [c[0] for c in CASES[name]] + more


def pre_v11(text: str) -> bool:
    """A pre-v11 Mistral text: a JSON array or object after the tag (vLLM reads it so with a
    tokenizer that has no [ARGS]; a v11+ tokenizer's model writes a name there)."""
    at = text.find("[TOOL_CALLS]")
    return at >= 0 and text[at + len("[TOOL_CALLS]") :].lstrip()[:1] in ("[", "{")


def vllm(name: str, batch: list[str], chunk: int) -> list[dict[str, Any]]:
    python = Cache.default().vllm_python
    if not python.exists():
        pytest.skip(f"vLLM is not installed ({python}): run `make engines`")
    if name == "mistral" and any(pre_v11(t) for t in batch):
        # Each text with the tokenizer its format belongs to.
        v11 = iter(vllm(name, [t for t in batch if not pre_v11(t)], chunk))
        old = iter(_run(name, [t for t in batch if pre_v11(t)], chunk, ["[ARGS]"]))
        return [next(old) if pre_v11(t) else next(v11) for t in batch]
    return _run(name, batch, chunk, [])


def _run(name: str, batch: list[str], chunk: int, without: list[str]) -> list[dict[str, Any]]:
    python = Cache.default().vllm_python
    job = {"parser": name, "tools": TOOLS, "texts": batch, "chunk": chunk, "without": without}
    out = subprocess.run([str(python), str(SCRIPT)], input=json.dumps(job), text=True,
                         capture_output=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    result: list[dict[str, Any]] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_xml", "qwen3_coder"])
def test_baton_assembles_what_vllm_assembles(name: str) -> None:
    if name not in PARSERS:
        pytest.skip(f"Baton has no {name} parser yet")
    batch = texts(name)
    for chunk in (1, 3):
        for text, theirs in zip(batch, vllm(name, batch, chunk), strict=True):
            p = PARSERS[name](TOOLS).parse(text, final=True)
            calls = [{"name": c.name, "arguments": c.arguments} for c in p.calls]
            ours = {"content": p.content, "calls": calls}
            assert ours == theirs, (chunk, text)
