"""Special think tags on a backend whose tool parser keeps special tokens' text for every
chat request: vLLM's qwen3_xml (like the legacy mistral) turns skip_special_tokens off
whenever its adjust_request runs, and on a server with a reasoning parser that is every
chat request, tools offered or not. So a chat without tools shows the special `</think>`
too, and the engine splits merged chunks (stream_interval 3) right; Baton must know it, or
every cut after the end tag is refused. A cut on each side of the end tag and later must
resume to what the uninterrupted stream assembles (reasoning and content)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.factories import sdk
from tests.integration import test_seam_tools as seam_tools
from tests.integration.test_seam_bytes import BytesFleet, seam_fleet
from tests.integration.test_seam_tools import with_reasoning

pytestmark = pytest.mark.timeout(600)

FLAGS = ("--tool-calls", "--tool-call-parser", "qwen3_xml", "--reasoning", "--think-special",
         "--byte-level", "--instant")  # fmt: skip
TOKENS = 60
MERGED = {"stream_interval": 3}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BytesFleet]:
    extra = 'tool_parser = "qwen3_xml"\nreasoning_parser = "deepseek_r1"'
    with seam_fleet(tmp_path_factory.mktemp("special-tags"), FLAGS, backend_extra=extra) as f:
        yield f


def read(c: openai.OpenAI, extra: dict[str, Any]) -> tuple[list[Any], openai.APIError | None]:
    """A greedy chat stream offering no tools (test_seam_tools.read)."""
    return seam_tools.read(c, tools=openai.omit, max_tokens=TOKENS, extra_body=extra)


@pytest.mark.parametrize("choice", [{}, {"tool_choice": None}], ids=["no-tools", "null-choice"])
@pytest.mark.parametrize("mode", ["parallel", "inline"])
def test_a_chat_without_tools_resumes_across_a_shown_special_end_tag(
    fleet: BytesFleet, mode: str, choice: dict[str, Any]
) -> None:
    f = fleet
    chunks, err = read(sdk(f.ref.ready + "/v1"), {"return_token_ids": True, **MERGED, **choice})
    assert err is None
    ids = [t for ch in chunks if ch.choices
           for t in (ch.choices[0].model_extra or {}).get("token_ids") or []]  # fmt: skip
    want = with_reasoning(chunks)
    assert want["reasoning"] and want["content"], want
    end = f.ref_think_end()
    assert end in ids and "</think>" not in want["reasoning"] + want["content"]
    think_at = ids.index(end)
    # On the end tag, on each side of it, and further into the content.
    tried = sorted({think_at - 1, think_at, think_at + 1, think_at + 2, think_at + 4})
    tried = [k for k in tried if 0 < k < len(ids)]
    before = len(f.admin.events(kind="failover", limit=10_000))
    for n, k in enumerate(tried):
        f.settled(before + n)
        f.arm.set(k)
        got, err = read(f.client(mode), {**MERGED, **choice})
        assert f.arm.fired.is_set()
        assert err is None, f"cut after {k} (the end tag is {think_at + 1}): {err!r}"
        assert with_reasoning(got) == want, f"cut after {k} tokens (the end tag is {think_at + 1})"
    f.settled(before + len(tried))
    events = f.admin.events(kind="failover", limit=10_000)[before:]
    assert len(events) == len(tried)
    assert {e["outcome"] for e in events} == {"resumed"}, events
    assert "divergent" not in {e["seam"] for e in events}
