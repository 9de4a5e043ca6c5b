"""Streams that ask for logprobs, through a backend's death, on byte-level sims (characters
split across tokens, so candidates that decode alike, and vLLM's correction of a split
character's decoded token, are in play). The resume runs on vLLM's token-in/token-out
endpoint (`--enable-scale-out`), which gives logprobs in chat's shape: the client's tokens,
text and every token's logprobs (token, logprob, bytes, its top candidates; completions'
shape for a completions stream) must be an uninterrupted stream's, for a cut after every
token, both seam modes. Without the endpoint the resume is refused, saying so."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.factories import sdk
from tests.integration.harness import MODEL
from tests.integration.test_seam_bytes import BytesFleet, seam_fleet

pytestmark = pytest.mark.timeout(600)

FLAGS = ("--byte-level", "--instant", "--enable-scale-out")
TOKENS = 40
MESSAGES = [{"role": "user", "content": "héllo, wörld"}]


@pytest.fixture(scope="module")
def lf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BytesFleet]:
    with seam_fleet(tmp_path_factory.mktemp("logprobs"), FLAGS) as f:
        yield f


def chat_stream(c: openai.OpenAI, **kw: Any) -> tuple[dict[str, Any], Exception | None]:
    text, entries, finish = "", [], None
    try:
        for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, stream=True,  # type: ignore[arg-type]
            max_tokens=TOKENS, logprobs=True, top_logprobs=3, **kw,
        ):  # fmt: skip
            if not ch.choices:
                continue
            text += ch.choices[0].delta.content or ""
            lp = ch.choices[0].logprobs
            entries += [e.model_dump() for e in (lp.content or [])] if lp else []
            finish = ch.choices[0].finish_reason or finish
    except openai.APIError as e:
        return {}, e
    return {"text": text, "logprobs": entries, "finish": finish}, None


def completions_stream(c: openai.OpenAI, **kw: Any) -> tuple[dict[str, Any], Exception | None]:
    text, shaped, finish = "", {"text_offset": [], "token_logprobs": [], "tokens": [],
                                "top_logprobs": []}, None  # fmt: skip
    try:
        for ch in c.completions.create(
            model=MODEL, prompt="héllo, wörld", temperature=0, stream=True,
            max_tokens=TOKENS, logprobs=2, **kw,
        ):  # fmt: skip
            if not ch.choices:
                continue
            text += ch.choices[0].text
            lp = ch.choices[0].logprobs
            for key in shaped:
                shaped[key] += (getattr(lp, key) or []) if lp else []
            finish = ch.choices[0].finish_reason or finish
    except openai.APIError as e:
        return {}, e
    return {"text": text, "logprobs": shaped, "finish": finish}, None


STREAMS = {"chat": chat_stream, "completions": completions_stream}


@pytest.mark.parametrize("mode", ["parallel", "inline"])
@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("step", [pytest.param(2, id="every-2nd"),
                                  pytest.param(1, id="all", marks=pytest.mark.matrix)])  # fmt: skip
def test_every_cut_keeps_every_tokens_logprobs(
    lf: BytesFleet, api: str, mode: str, step: int
) -> None:
    read = STREAMS[api]
    want, err = read(sdk(lf.ref.ready + "/v1"))
    assert err is None and want["finish"] == "length"
    n = len(want["logprobs"]) if api == "chat" else len(want["logprobs"]["tokens"])
    assert n == TOKENS
    client = lf.client(mode)
    before = len(lf.admin.events(kind="failover", limit=10_000))
    tried = list(range(1, TOKENS, step))  # every token under the matrix marker
    for n, k in enumerate(tried):
        lf.settled(before + n)
        lf.arm.set(k)
        got, err = read(client)
        assert lf.arm.fired.is_set()
        assert err is None, f"{api}: cut after {k}: {err!r}"
        assert got == want, f"{api}: cut after {k} tokens"
    lf.settled(before + len(tried))
    events = lf.admin.events(kind="failover", limit=10_000)[before:]
    assert {e["outcome"] for e in events} == {"resumed"}, events
    assert "divergent" not in {e["seam"] for e in events}


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BytesFleet]:
    """Sims whose generate endpoint is off (vLLM without --enable-scale-out: 403)."""
    with seam_fleet(tmp_path_factory.mktemp("closed"), ("--byte-level", "--instant")) as f:
        yield f


def test_without_the_generate_endpoint_a_logprobs_resume_is_refused(closed: BytesFleet) -> None:
    before = len(closed.admin.events(kind="failover", limit=10_000))
    closed.arm.set(5)
    got, err = chat_stream(closed.client("inline"))
    assert err is not None and "--enable-scale-out" in str(err), err
    closed.settled(before + 2)
    tried, gave_up = closed.admin.events(kind="failover", limit=10_000)[before:]
    # The other backend lacks the endpoint: skipped as a refusal of this request (no
    # demotion), and the stream ends saying what it lacks.
    assert tried["outcome"] == "failed" and "--enable-scale-out" in tried["detail"], tried
    assert gave_up["outcome"] == "exhausted" and "--enable-scale-out" in gave_up["detail"]
