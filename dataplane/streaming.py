"""One client stream, end to end: relay the first backend's events and, when that backend
fails mid-stream, resume every unfinished choice on another backend (resume.py plans it,
stitch.py shapes what the client sees). The client gets one unbroken stream or an explicit
error event; never a silently truncated one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import aiohttp
import orjson
from aiohttp import web

from control.model import Backend, BackendKind, RequestShape
from dataplane.errors import ErrorKind, OpenAIError
from dataplane.failover import Failure, classify_status
from dataplane.forward import AttemptFailed, Timeouts, classify_exception, open_attempt
from dataplane.oracle import ControlUnavailable, FailoverReport, Oracle
from dataplane.resume import (
    ChoiceProgress,
    Refused,
    ResumePath,
    ResumePlan,
    Seam,
    SeamCheck,
    plan_resume,
)
from dataplane.sse import SSEParser
from dataplane.stitch import FAILED_FINISH, Stitcher, StopMatcher, choice_text
from dataplane.validate import ClientRequest, Endpoint

log = logging.getLogger("baton.shim.stream")

TOKEN_KINDS = frozenset({BackendKind.VLLM, BackendKind.SGLANG})


@dataclass(frozen=True, slots=True)
class ResumeSettings:
    seam_tokens: int = 4  # m: resume this many tokens early and check them; 0 = off
    max_resumes: int = 3  # failovers per request
    max_resume_seconds: float = 30.0  # from the first failure to giving up
    first_token_timeout: float = 120.0  # no token this long after the request: a stall
    inter_token_timeout: float = 30.0  # no chunk this long between tokens: a stall
    # parallel: stream from the exact prefix and verify the overlap in a side request;
    # inline: resume m tokens early and check them before sending (costs m decode steps).
    seam_mode: str = "parallel"


class StreamFailed(Exception):
    def __init__(self, failure: str, detail: str = "") -> None:
        super().__init__(f"{failure}: {detail}" if detail else failure)
        self.failure = failure


@dataclass(slots=True)
class ChoiceResume:
    """How one choice's resume on one backend went."""

    path: ResumePath | None = None
    seam: Seam | None = None
    gap_ms: float = 0.0
    failure: str | None = None
    detail: str = ""
    verdict: asyncio.Task[Seam] | None = None  # a parallel seam check still running
    # Set at the resumed stream's first event. The seam check waits for it: on a card that
    # prefills one request at a time it would otherwise delay the resume itself.
    flowing: asyncio.Event = field(default_factory=asyncio.Event)


async def read_events(
    content: aiohttp.StreamReader, first: bytes, settings: ResumeSettings, got_token: bool
) -> AsyncIterator[tuple[bytes, bytes]]:
    """(data, raw) of each SSE event; raises StreamFailed on a stall, a broken connection,
    or EOF (the caller decides whether EOF was early). One timer, rescheduled per read."""
    parser = SSEParser()
    loop = asyncio.get_running_loop()
    chunk = first
    try:
        async with asyncio.timeout(None) as deadline:
            while True:
                # Disarmed while the caller handles events: time spent writing to a slow
                # client is backpressure, not a stalled backend.
                deadline.reschedule(None)
                for event in parser.feed(chunk):
                    if event.data:
                        got_token = True
                        yield event.data, event.raw
                limit = settings.inter_token_timeout if got_token else settings.first_token_timeout
                deadline.reschedule(loop.time() + limit)
                chunk = await content.readany()
                if not chunk:
                    raise StreamFailed(Failure.TRUNCATED, "stream ended before [DONE]")
    except TimeoutError:
        raise StreamFailed(Failure.STALL, "no data within the stall timeout") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise StreamFailed(Failure.DISCONNECT, type(exc).__name__) from None
    except ValueError as exc:  # an SSE event over the size limit
        raise StreamFailed(Failure.GARBAGE, str(exc)) from None


class StreamRelay:
    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        oracle: Oracle,
        timeouts: Timeouts,
        settings: ResumeSettings,
        resp: web.StreamResponse,
        request_id: str,
        client: ClientRequest,
        shape: RequestShape,
        background: set[asyncio.Task[None]],
    ) -> None:
        """`background`: the proxy's set of tasks that may outlive this request (a seam
        check still running when the stream ends), kept referenced until they finish."""
        self._background = background
        self._session = session
        self._oracle = oracle
        self._timeouts = timeouts
        self._settings = settings
        self._resp = resp
        self._rid = request_id
        self._client = client
        self._shape = shape
        self.stitcher = Stitcher(client, strip_ids=not client.body.get("return_token_ids"))
        self.first_byte: float | None = None
        self.served_by: Backend | None = None

    async def run(self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes) -> bool:
        """True when the client got a complete answer, False when it got an error event."""
        self.served_by = backend
        try:
            await self._pump(upstream, first)
        except StreamFailed as failed:
            upstream.close()
            if self.stitcher.unfinished():
                return await self._failover(backend, failed)
            # Every choice had finished: only the tail (usage, [DONE]) was lost.
            self.stitcher.resumed = self.stitcher.usage is None
        await self._resp.write(self.stitcher.ending())
        return True

    async def _write(self, data: bytes) -> None:
        if self.first_byte is None:
            self.first_byte = time.monotonic()
        await self._resp.write(data)

    async def _pump(self, upstream: aiohttp.ClientResponse, first: bytes) -> None:
        out: list[bytes] = []
        async for data, raw in read_events(upstream.content, first, self._settings, False):
            if data == b"[DONE]":
                if self.stitcher.unfinished():
                    raise StreamFailed(Failure.TRUNCATED, "[DONE] before every choice finished")
                break
            piece, failure = self.stitcher.original(data, raw)
            if piece:
                out.append(piece)
            if failure:
                if out:
                    await self._write(b"".join(out))
                raise StreamFailed(failure)
            # Batch what one read delivered into one write; flush before the next read.
            if out:
                await self._write(b"".join(out))
                out.clear()

    # -- failover ------------------------------------------------------------------------

    async def _failover(self, failed_backend: Backend, failed: StreamFailed) -> bool:
        stitcher = self.stitcher
        stitcher.resumed = True
        # perf_counter, not loop.time(): uvloop's loop clock ticks in whole milliseconds,
        # too coarse for a gap of a few ms.
        detected = time.perf_counter()
        failure = failed.failure
        exclude: list[str] = []
        attempt = 0
        while True:
            pending = stitcher.unfinished()
            if not pending:
                await self._resp.write(stitcher.ending())
                return True
            attempt += 1
            sent = {p.index: p.generated for p in pending}
            try:
                for p in pending:  # a refusal needs no backend: check before asking for one
                    plan_resume(self._client, p, token_path=True, seam_tokens=0)
            except Refused as why:
                await self._oracle_failover(failed_backend, failure, exclude)
                return await self._give_up(failed_backend, failure, attempt, "refused", str(why))
            if attempt > self._settings.max_resumes or (
                time.perf_counter() - detected > self._settings.max_resume_seconds
            ):
                return await self._give_up(
                    failed_backend, failure, attempt, "exhausted", "resume budget exhausted"
                )
            backend = await self._oracle_failover(failed_backend, failure, exclude)
            if backend is None:
                return await self._give_up(
                    failed_backend, failure, attempt, "exhausted", "no other backend available"
                )
            log.info(
                "request %s: %s failed (%s); resuming on %s",
                self._rid,
                failed_backend.id,
                failure,
                backend.id,
            )
            results = await asyncio.gather(
                *(self._resume_choice(backend, p, detected) for p in pending)
            )
            for p, r in zip(pending, results, strict=True):
                self._report(
                    r,
                    FailoverReport(
                        self._rid,
                        failed_backend.id,
                        backend.id,
                        failure,
                        p.index,
                        sent[p.index],
                        r.path.value if r.path else "",
                        r.seam.value if r.seam else "",
                        r.gap_ms,
                        attempt,
                        "resumed" if r.failure is None else "failed",
                        r.detail,
                    ),
                )
            self.served_by = backend
            broken = [r for r in results if r.failure is not None]
            if broken:
                exclude.append(failed_backend.id)
                failed_backend, failure = backend, broken[0].failure or "failure"

    def _report(self, result: ChoiceResume, report: FailoverReport) -> None:
        if result.verdict is None:
            self._oracle.report_failover(report)
            return

        async def when_checked(verdict: asyncio.Task[Seam]) -> None:
            seam = await verdict
            self._oracle.report_failover(replace(report, seam=seam.value))

        task = asyncio.create_task(when_checked(result.verdict))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _oracle_failover(
        self, failed: Backend, failure: str, exclude: list[str]
    ) -> Backend | None:
        try:
            decision = await self._oracle.failover(
                self._rid, self._shape, failed.id, failure, exclude
            )
        except ControlUnavailable:
            return None
        return decision.backends[0] if decision.backends else None

    async def _give_up(
        self, backend: Backend, failure: str, attempt: int, outcome: str, why: str
    ) -> bool:
        for p in self.stitcher.unfinished():
            self._oracle.report_failover(
                FailoverReport(
                    self._rid,
                    backend.id,
                    "",
                    failure,
                    p.index,
                    p.generated,
                    "",
                    "",
                    0.0,
                    attempt,
                    outcome,
                    why,
                )
            )
        kind = ErrorKind.BACKEND_FAILED
        message = f"backend {backend.id} failed mid-stream ({failure}) and the stream " + (
            f"cannot be resumed: {why}" if outcome == "refused" else f"was not resumed: {why}"
        )
        await self._resp.write(OpenAIError(kind, message).sse())
        return False

    async def _resume_choice(
        self, backend: Backend, p: ChoiceProgress, detected: float
    ) -> ChoiceResume:
        result = ChoiceResume()
        token_path = backend.kind in TOKEN_KINDS
        # Parallel seam check: stream from the exact prefix at once and verify the overlap
        # in a side request, so the check costs the client no decode steps.
        parallel = self._settings.seam_mode == "parallel"
        exact = parallel
        verify: asyncio.Task[Seam] | None = None
        try:
            while True:
                try:
                    plan = plan_resume(
                        self._client,
                        p,
                        token_path=token_path,
                        seam_tokens=self._settings.seam_tokens,
                        exact=exact,
                    )
                    if parallel and verify is None and result.seam is None:
                        check = plan_resume(
                            self._client,
                            p,
                            token_path=token_path,
                            seam_tokens=self._settings.seam_tokens,
                        )
                        if check.seam is Seam.VERIFIED:
                            verify = asyncio.create_task(
                                self._verify(backend, check, result.flowing)
                            )
                        result.seam = check.seam if verify is None else None
                except Refused as why:
                    result.failure, result.detail = "refused", str(why)
                    return result
                result.path = plan.path
                if result.seam is None and verify is None:  # a divergent try keeps its verdict
                    result.seam = plan.seam if plan.seam is not Seam.VERIFIED else None
                try:
                    held = await self._held_text(backend, p) if plan.needs_held_text else ""
                    upstream = await self._open(backend, plan.endpoint, plan.body)
                except AttemptFailed as failed:
                    result.failure, result.detail = failed.failure, failed.detail
                    return result
                seam = SeamCheck(plan.overlap_ids, plan.overlap_text)
                stops = (
                    StopMatcher(
                        _stops(self._client),
                        bool(self._client.body.get("include_stop_str_in_output")),
                        held,
                    )
                    if plan.needs_held_text
                    else None
                )
                try:
                    outcome = await self._relay_resumed(
                        upstream, p, plan.endpoint, seam, stops, detected, result
                    )
                except StreamFailed as failed:
                    result.failure, result.detail = failed.failure, str(failed)
                    return result
                finally:
                    upstream.close()
                if outcome == "divergent":
                    result.seam, exact = Seam.DIVERGENT, True
                    continue
                if verify is not None:
                    # Reported when it lands; the client's stream need not wait for it.
                    result.verdict, verify = verify, None
                elif result.seam is None:
                    result.seam = seam.verdict
                return result
        finally:
            if verify is not None:  # the resume failed: its verdict no longer matters
                verify.cancel()

    async def _verify(self, backend: Backend, check: ResumePlan, flowing: asyncio.Event) -> Seam:
        """Would `backend` regenerate the overlap the client already has? One short,
        non-streaming request over the shared prefix, sent once the resume is flowing (so
        its prefill is cached and it does not compete with the resume's)."""
        await flowing.wait()
        body = {**check.body, "stream": False, "max_tokens": len(check.overlap_ids)}
        body.pop("min_tokens", None)
        try:
            async with self._session.post(
                backend.url + Endpoint.COMPLETIONS.value,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self._settings.max_resume_seconds),
            ) as resp:
                if resp.status != 200:
                    return Seam.UNCHECKED
                choice = (orjson.loads(await resp.read()).get("choices") or [{}])[0]
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return Seam.UNCHECKED
        got = tuple(choice.get("token_ids") or ())
        return Seam.VERIFIED if got == check.overlap_ids else Seam.DIVERGENT

    async def _relay_resumed(
        self,
        upstream: aiohttp.ClientResponse,
        p: ChoiceProgress,
        endpoint: Endpoint,
        seam: SeamCheck,
        stops: StopMatcher | None,
        detected: float,
        result: ChoiceResume,
    ) -> str:
        chat = endpoint is Endpoint.CHAT
        stitcher = self.stitcher
        async for data, _ in read_events(upstream.content, b"", self._settings, False):
            result.flowing.set()
            if data == b"[DONE]":
                break
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise StreamFailed(Failure.GARBAGE) from None
            if "error" in obj and not obj.get("choices"):
                raise StreamFailed(Failure.ERROR_EVENT)
            choices = obj.get("choices") or []
            if not choices:
                usage = obj.get("usage")
                if usage and stitcher.extra_prompt_tokens is None:
                    # Text path: the resume's prompt includes the text already sent.
                    stitcher.extra_prompt_tokens = max(
                        0, usage.get("prompt_tokens", 0) - p.generated
                    )
                continue
            ch = choices[0]
            finish = ch.get("finish_reason")
            if finish in FAILED_FINISH:
                raise StreamFailed(f"finish_{finish}")
            ids = ch.get("token_ids") or []
            text = choice_text(ch, chat)
            verified = seam.feed(ids, text, finish is not None)
            if seam.verdict is Seam.DIVERGENT:
                return "divergent"
            if verified is None:
                continue
            ids, text = verified
            stop_reason = ch.get("stop_reason")
            if stops is not None:
                text, matched = stops.feed(text)
                if matched is not None:
                    finish, stop_reason = "stop", matched
                elif finish:
                    text += stops.flush()
            p.add(text, ids)
            if finish:
                p.finish_reason, p.stop_reason = finish, stop_reason
            if text or finish or (ids and not stitcher.strip_ids):
                if result.gap_ms == 0.0:
                    result.gap_ms = (time.perf_counter() - detected) * 1000
                await self._write(stitcher.chunk(p.index, text, ids, finish, stop_reason))
            if finish:
                return "finished"
        raise StreamFailed(Failure.TRUNCATED, "resumed stream ended before finishing")

    async def _open(
        self, backend: Backend, endpoint: Endpoint, body: dict[str, object]
    ) -> aiohttp.ClientResponse:
        upstream = await open_attempt(
            self._session, backend, endpoint.value, orjson.dumps(body), self._timeouts
        )
        failure = classify_status(upstream.status)
        if failure is not None or upstream.status != 200:
            status = upstream.status
            upstream.close()
            raise AttemptFailed(failure or Failure.STATUS_5XX, f"resume answered {status}")
        return upstream

    async def _held_text(self, backend: Backend, p: ChoiceProgress) -> str:
        """Text the old engine generated but held back (a possible stop string): the tokens
        are in the resume prompt, so only their text needs recovering."""
        try:
            async with self._session.post(
                backend.url + "/detokenize",
                json={"model": self._client.model, "tokens": p.token_ids},
                timeout=aiohttp.ClientTimeout(total=self._timeouts.connect * 2),
            ) as resp:
                if resp.status != 200:
                    raise AttemptFailed(Failure.STATUS_5XX, f"detokenize answered {resp.status}")
                full = (await resp.json()).get("prompt", "")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise classify_exception(exc) from exc
        sent = p.text
        return full[len(sent) :] if full.startswith(sent) else ""


def _stops(client: ClientRequest) -> list[str]:
    stop = client.body.get("stop")
    if isinstance(stop, str):
        return [stop]
    return list(stop or [])


def with_token_ids(client: ClientRequest, backend: Backend, raw: bytes) -> bytes:
    """The first attempt's body: ask token-id engines for ids, so a failure can resume
    token-exact. Other backends get the client's bytes untouched."""
    if not client.stream or backend.kind not in TOKEN_KINDS or client.body.get("return_token_ids"):
        return raw
    return orjson.dumps({**client.body, "return_token_ids": True})
