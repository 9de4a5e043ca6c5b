"""In-process fakes for the shim's relay (dataplane/relay/): engines that answer scripted
streams over real HTTP on 127.0.0.1 (a port the OS picks), a control plane that records what
it was asked and told, and the client's side of the stream. Shared by test_relay_stream.py,
test_resumer.py and test_chooser.py.

The fake engines' tokenizer spells token id n as "wn " (detokenize and the scripted chunks
agree), so a test can say what text a client must end up with from the ids alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from baton.model import (
    Backend,
    BackendId,
    BackendKind,
    BackendStatus,
    Decision,
    FailoverReport,
    Health,
    HealthState,
    Reason,
    RequestShape,
    Snapshot,
)
from dataplane.exceptions import ControlUnavailable
from dataplane.link.needs import FleetView, fleet_view
from dataplane.metrics import ShimMetrics
from dataplane.relay.background import Background
from dataplane.relay.context import StreamContext
from dataplane.request import ClientRequest
from dataplane.settings import ResumeSettings, Timeouts
from dataplane.sse import DONE_EVENT

T = TypeVar("T")
WAIT_S = 10.0  # a bound on waiting for a state: only reached when the code under test is wrong


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


async def settle(background: Background) -> None:
    """Waits (bounded) for the work the code under test left running to end."""
    async with asyncio.timeout(WAIT_S):
        await background.settled()


def stream_context(
    client: ClientRequest,
    fallbacks: Sequence[Backend] = (),
    settings: ResumeSettings | None = None,
) -> StreamContext:
    """One client stream's context as the proxy builds it, request id "r1"."""
    return StreamContext(
        request_id="r1",
        client=client,
        shape=RequestShape("m"),
        fallbacks=tuple(fallbacks),
        settings=settings or ResumeSettings(),
        timeouts=Timeouts(),
        metrics=ShimMetrics(),
        background=Background(),
    )


def spell(ids: Sequence[int]) -> str:
    return "".join(f"w{n} " for n in ids)


# -- what an engine answers ------------------------------------------------------------------


def chunk(
    ids: Sequence[int] = (),
    *,
    finish: str | None = None,
    text: str | None = None,
    with_ids: bool = False,
    prompt_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One /v1/completions stream chunk carrying tokens `ids` (their text unless `text`
    says otherwise); `with_ids`: with the ids themselves, as vLLM sends them when asked."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": spell(ids) if text is None else text,
        "finish_reason": finish,
    }
    if with_ids:
        choice["token_ids"] = list(ids)
    if prompt_ids is not None:
        choice["prompt_token_ids"] = list(prompt_ids)
    return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
            "choices": [choice]}  # fmt: skip


def chat_chunk(content: str, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content else {}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip


@dataclass(frozen=True)
class Stream:
    """A 200 event stream of `events`, ended by [DONE] unless `done` is False (then the
    body just ends: a stream cut before its end). `hang`: after its events, it sends
    nothing more until the engine is closed (a generation still running)."""

    events: Sequence[dict[str, Any]]
    done: bool = True
    hang: bool = False


@dataclass(frozen=True)
class Answer:
    """A whole (non-streamed) answer: an error status, or a JSON body."""

    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)


Reply = Stream | Answer


class FakeEngine:
    """An engine on 127.0.0.1: each generation POST takes the next scripted reply (a 500
    when none is left) and is recorded with its body; /detokenize spells ids."""

    def __init__(self, name: str, kind: BackendKind = BackendKind.OPENAI) -> None:
        self.name = name
        self.kind = kind
        self.replies: list[Reply] = []
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.detokenized: list[list[int]] = []
        self.detokenize_status = 200  # another status: /detokenize fails (a dying engine)
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/detokenize", self._detokenize)
        self._server = TestServer(app, host="127.0.0.1")
        self._closing = asyncio.Event()
        self.backend = Backend(BackendId(name), "http://unstarted", "m", kind=kind)

    async def start(self) -> FakeEngine:
        await self._server.start_server()
        url = str(self._server.make_url("")).rstrip("/")
        self.backend = Backend(BackendId(self.name), url, "m", kind=self.kind)
        return self

    async def close(self) -> None:
        self._closing.set()
        await self._server.close()

    def script(self, *replies: Reply) -> FakeEngine:
        self.replies.extend(replies)
        return self

    @property
    def generations(self) -> list[dict[str, Any]]:
        """The bodies of the generation requests it got, in order."""
        return [body for path, body in self.requests if path != "/detokenize"]

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body))
        reply = self.replies.pop(0) if self.replies else Answer(500, {"error": {"type": "x"}})
        if isinstance(reply, Answer):
            return web.json_response(reply.body, status=reply.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in reply.events:
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        if reply.hang:
            await self._closing.wait()
            return resp
        if reply.done:
            await resp.write(DONE_EVENT)
        await resp.write_eof()
        return resp

    async def _detokenize(self, request: web.Request) -> web.Response:
        ids = (await request.json())["tokens"]
        self.detokenized.append(ids)
        if self.detokenize_status != 200:
            return web.json_response({"error": {"type": "x"}}, status=self.detokenize_status)
        return web.json_response({"prompt": spell(ids)})


async def engines(*names: str, kind: BackendKind = BackendKind.OPENAI) -> list[FakeEngine]:
    return [await FakeEngine(n, kind).start() for n in names]


async def open_stream(
    session: aiohttp.ClientSession, engine: FakeEngine, body: dict[str, Any]
) -> aiohttp.ClientResponse:
    """The first attempt's response, as the proxy opens it (its status line is in)."""
    return await session.post(engine.backend.url + "/v1/completions", json=body)


# -- control and the client --------------------------------------------------------------------


@dataclass
class FailoverCall:
    failed: str
    failure: str
    exclude: list[str]
    preferred: list[str]


class FakeControl:
    """Control as the relay sees it (FailoverAdvice + FailoverAudit): `answers` are its
    Failover answers in turn (a backend, None for "none left", or ControlUnavailable when
    it is away); it records every call and report."""

    def __init__(
        self,
        answers: Sequence[Backend | None | type[ControlUnavailable]] = (),
        migrating: Sequence[Backend] = (),
    ) -> None:
        self.answers = list(answers)
        self.calls: list[FailoverCall] = []
        self.reports: list[FailoverReport] = []
        statuses = tuple(
            BackendStatus(b, Health(HealthState.DRAINING, "", 0.0), migrating=True)
            for b in migrating
        )
        self._fleet = fleet_view(Snapshot(1, statuses))
        self._news = asyncio.Event()  # set at every call and report

    async def until(self, check: Callable[[], bool]) -> None:
        """Waits (bounded) until `check` holds of what control was asked and told: calls
        and reports come from background tasks too."""
        async with asyncio.timeout(WAIT_S):
            while not check():
                self._news.clear()
                await self._news.wait()

    @property
    def fleet(self) -> FleetView:
        return self._fleet

    async def failover(
        self,
        request_id: str,
        shape: RequestShape,
        failed_backend_id: str,
        failure: str,
        exclude: Sequence[str],
        preferred: Sequence[str] = (),
        traceparent: str = "",
        pair_id: str = "",
    ) -> Decision:
        call = FailoverCall(failed_backend_id, str(failure), list(exclude), list(preferred))
        self.calls.append(call)
        self._news.set()
        answer = self.answers.pop(0) if self.answers else None
        if answer is ControlUnavailable:
            raise ControlUnavailable("control is away")
        if isinstance(answer, Backend):
            return Decision((answer,), Reason.FAILOVER, 1)
        return Decision((), Reason.NO_BACKEND, 1, "none left")

    def report_failover(self, report: FailoverReport) -> None:
        self.reports.append(report)
        self._news.set()


class Client:
    """The client's end of the stream: every byte the relay wrote to it."""

    def __init__(self) -> None:
        self.out = b""

    async def write(self, data: bytes) -> None:
        self.out += data

    @property
    def events(self) -> list[Any]:
        """The data events' objects; "[DONE]" for the end."""
        out: list[Any] = []
        for block in self.out.split(b"\n\n"):
            if block.startswith(b"data: "):
                data = block[6:]
                out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
        return out

    @property
    def text(self) -> str:
        """The answer's text as the client reads it (completion text or chat content)."""
        return "".join(
            ch.get("text") or (ch.get("delta") or {}).get("content") or "" for ch in self._choices
        )

    @property
    def _choices(self) -> list[dict[str, Any]]:
        return [ch for e in self.events if isinstance(e, dict) for ch in e.get("choices") or ()]

    @property
    def finishes(self) -> list[str]:
        return [ch["finish_reason"] for ch in self._choices if ch.get("finish_reason")]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]
