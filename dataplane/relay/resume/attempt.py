"""One choice's resume on one backend: plan it, open it (possibly before control has
answered), relay its chunks through the seam check and the stop strings, and have the seam
verified beside it when asked to (dataplane/relay/resume/sidecheck.py). StreamRelay
(dataplane/relay/stream.py) decides when and where; this module does one attempt."""

from __future__ import annotations

import asyncio
import functools
import hashlib
from array import array
from dataclasses import dataclass

import aiohttp

from baton.model import AttemptEnd, Backend, BackendKind, Failure, ResumePath, Seam, SeamMode
from dataplane.exceptions import AttemptFailed, Refused, StreamFailed
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume import detok, generate
from dataplane.relay.resume.plan import ResumePlan, plan_resume, tokens_allowed
from dataplane.relay.resume.reasoning import segments
from dataplane.relay.resume.resumed import ChoiceResume, Downstream, ResumedStream, ResumeState
from dataplane.relay.resume.seam import HeldText, SeamCheck, judge_fields
from dataplane.relay.resume.sidecheck import SideCheck
from dataplane.relay.resume.stops import StopMatcher
from dataplane.relay.stitch import Stitcher
from dataplane.relay.thinking import CutText, TagCut
from dataplane.request import ClientRequest
from dataplane.settings import ResumeSettings, Timeouts
from dataplane.upstream.engine import (
    detokenize,
    error_kind,
    json_body,
    open_attempt,
    resume_failure,
)

TOKEN_KINDS = frozenset({BackendKind.VLLM, BackendKind.SGLANG})


@dataclass(slots=True)
class Started:
    """A resume request that is open: its plan, its response and, in parallel mode, the
    plan of the seam check to run beside it."""

    plan: ResumePlan
    upstream: aiohttp.ClientResponse
    check: ResumePlan | None


class Resumer:
    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        settings: ResumeSettings,
        client: ClientRequest,
        stitcher: Stitcher,
        downstream: Downstream,
    ) -> None:
        """`downstream`: the relay that owns the client's stream."""
        self._down = downstream
        self._session = session
        self._timeouts = timeouts
        self._settings = settings
        self._client = client
        self._stitcher = stitcher
        # _decode's parts before a tag, by a digest of their ids (a reasoning's ids can be
        # tens of thousands: the stream holds them once already, in progress.py).
        self._stable: dict[bytes, str] = {}
        self._side = SideCheck(session, self._decode, settings.max_resume_seconds)
        self._stream = ResumedStream(
            settings=settings, stitcher=stitcher, downstream=downstream,
            decode=self._decode, settled_decode=self._settled_decode,
        )  # fmt: skip

    async def start(self, backend: Backend, p: ChoiceProgress, *, exact: bool) -> Started:
        """Plan and open one resume request. Raises Refused or AttemptFailed. The plans are
        taken from `p` as it is now, before any resumed token is added to it."""
        token_path = backend.kind in TOKEN_KINDS
        m = self._settings.seam_tokens
        tools = self._stitcher.tools
        if token_path:
            await self._rebuild_tools(backend, p)
        plan = functools.partial(plan_resume, self._client, p, token_path=token_path,
                                 seam_tokens=m, extra=self._stitcher.resume_fields,
                                 tools=tools is not None)  # fmt: skip
        resume = plan(exact=exact)
        check = None
        if exact and self._settings.seam_mode is SeamMode.PARALLEL:
            candidate = plan()
            check = candidate if candidate.seam is Seam.VERIFIED else None
        upstream = await self._open(backend, resume.engine_path, resume.body)
        return Started(resume, upstream, check)

    async def run(
        self,
        backend: Backend,
        p: ChoiceProgress,
        detected: float,
        early: Started | None = None,
    ) -> ChoiceResume:
        """Resume `p` on `backend` to its end. `early`: a start() already open there (this
        call owns it from now on)."""
        state = ResumeState()
        fields = self._stitcher.markers is not None  # reasoning: fields split by ids
        agreed = not fields or self._stitcher.fields_agree(p)  # the client's text up to the seam
        await self._run(state, backend, p, detected, early)
        if fields and state.failure is None:
            judged = judge_fields(state.seam, agreed, self._stitcher.fields_agree(p))
            if judged is not Seam.DIVERGENT:
                return state.result()
            state.seam = judged  # whatever the overlap said: not a verified seam
            if state.verdict is not None:
                state.verdict.cancel()
                state.verdict = None
        return state.result()

    async def _run(
        self,
        result: ResumeState,
        backend: Backend,
        p: ChoiceProgress,
        detected: float,
        early: Started | None,
    ) -> None:
        if tokens_left(self._client, p) == 0:
            if early is not None:
                early.upstream.close()
            try:
                await self.end_at_limit(p, backend)
            except AttemptFailed as failed:
                result.failure, result.detail = failed.failure, failed.detail
                return
            result.detail = "max_tokens reached before the failure; finished without a resume"
            return
        exact = generate.opens_exact(self._settings.seam_mode, self._client)
        verify: asyncio.Task[Seam] | None = None
        try:
            while True:
                try:
                    started = early or await self.start(backend, p, exact=exact)
                except Refused as why:
                    result.failure, result.detail = Failure.REFUSED, str(why)
                    return
                except AttemptFailed as failed:
                    result.failure, result.detail = failed.failure, failed.detail
                    return
                early = None
                result.path = started.plan.path
                verify = self._check_beside(backend, p, started, result, verify)
                outcome, seam, held = await self._relay_one(backend, started, p, detected, result)
                if outcome is AttemptEnd.FAILED:
                    return
                if outcome is AttemptEnd.DIVERGENT:
                    result.seam, exact = Seam.DIVERGENT, True
                    continue
                if held is not None and held.verdict is Seam.DIVERGENT:
                    result.seam = Seam.DIVERGENT  # the side check's verdict cannot undo it
                    if verify is not None:
                        verify.cancel()
                        verify = None
                if verify is not None:
                    # Reported when it lands; the client's stream need not wait for it.
                    result.verdict, verify = verify, None
                elif result.seam is None:
                    result.seam = seam.verdict
                return
        finally:
            if verify is not None:  # the resume failed: its verdict no longer matters
                verify.cancel()
            if early is not None:  # never relayed
                early.upstream.close()

    def _check_beside(
        self,
        backend: Backend,
        p: ChoiceProgress,
        started: Started,
        result: ResumeState,
        verify: asyncio.Task[Seam] | None,
    ) -> asyncio.Task[Seam] | None:
        """Start the side check when this resume needs one (and none runs yet), or settle
        the verdict it has without one. Returns the side check running."""
        plan = started.plan
        # An exact token resume at a character boundary passes the engine's text on:
        # checked beside the stream against the ids' own text.
        at_boundary = (
            plan.path is ResumePath.TOKEN and plan.held is None and not plan.checks
            and bool(p.token_ids)
        )  # fmt: skip
        if (started.check is not None or at_boundary) and verify is None:
            base: Seam = plan.seam if plan.seam is not Seam.VERIFIED else Seam.UNCHECKED
            if result.seam is not None:
                base = result.seam  # a divergent try keeps its verdict
            verify = asyncio.create_task(
                self._side.verdict(backend, started.check, result.watch, at_boundary, base)
            )
        elif result.seam is None and verify is None:  # a divergent try keeps its verdict
            result.seam = plan.seam if plan.seam is not Seam.VERIFIED else None
        if not at_boundary:
            result.watch.first_seen.set()  # nothing to watch
        return verify

    async def _relay_one(
        self,
        backend: Backend,
        started: Started,
        p: ChoiceProgress,
        detected: float,
        result: ResumeState,
    ) -> tuple[AttemptEnd, SeamCheck, HeldText | None]:
        """One resumed stream relayed with its inline seam check, Baton's stop strings and
        the held text: how it ended (FAILED with the result's failure set), the seam check
        and the held text."""
        plan = started.plan
        seam = SeamCheck(plan.overlap_ids, plan.overlap_text)
        stop_strings = _stops(self._client) if plan.held is not None else []
        include = bool(self._client.body.get("include_stop_str_in_output"))
        stops = StopMatcher(stop_strings, include) if stop_strings else None
        held = HeldText(plan.held) if plan.held is not None else None
        outcome = AttemptEnd.FAILED
        try:
            outcome = await self._stream.relay(
                backend, started.upstream, p, plan.endpoint, seam, held, stops, detected, result
            )
        except StreamFailed as failed:
            result.failure, result.detail = failed.failure, str(failed)
            outcome = AttemptEnd.FAILED
        except AttemptFailed as failed:  # decoding the held tokens' text failed
            result.failure, result.detail = failed.failure, failed.detail
            outcome = AttemptEnd.FAILED
        finally:
            result.watch.first_seen.set()
            if outcome is AttemptEnd.FINISHED:  # its generation is over: keep the connection
                self._down.keep(started.upstream)
            else:
                started.upstream.close()  # also stops a generation still running
            result.watch.ended.set()  # the engine is done with it: the side check may go now
        return outcome, seam, held

    async def end_at_limit(self, p: ChoiceProgress, backend: Backend | None = None) -> None:
        """Every token the client asked for was sent, only the finish was lost: end the
        choice with "length" as the engine would have (resuming would ask for max_tokens 0,
        which engines refuse). The text a token-path engine held back for a possible stop
        string is recovered through `backend`'s detokenizer; without a backend there must
        be none (ends_here). Raises AttemptFailed."""
        held = ""
        if backend is not None and backend.kind in TOKEN_KINDS:
            await self._rebuild_tools(backend, p)  # the end flushes what the parser held
        stops = backend is not None and backend.kind in TOKEN_KINDS and bool(_stops(self._client))
        pending = p.held(from_start=True) if stops else None
        if backend is not None and pending is not None:
            decoded = await self._settled_decode(backend, list(pending.ids))
            held = HeldText(pending).resolve(decoded, True) or ""
        await self._down.write(self._stitcher.ended_at_limit(p, held))

    async def _rebuild_tools(self, backend: Backend, p: ChoiceProgress) -> None:
        """A followed tool parser withheld the calls' text from the client: the choice's text
        is read from the ids again (ToolFollow.rebuild). Raises Refused or AttemptFailed."""
        tools = self._stitcher.tools
        if tools is None or p.reasoning or not p.token_ids or p.content_sent >= 0:
            return
        ids = list(p.token_ids)
        # Also the text up to where a seam overlap would start, decoded at the same time: a
        # character boundary there lets the resume check the overlap's text and take the
        # engine's text after it, rather than decode the new ids itself (a round trip more).
        cut = len(ids) - self._settings.seam_tokens
        early = cut if 0 < cut < len(ids) else 0
        raw, before = await asyncio.gather(
            self._decode(backend, ids), self._decode(backend, ids[:early]) if early else _none()
        )
        whole = detok.whole(raw)
        if not whole:  # the ids end inside a character: the client has the text before it
            raw = await self._settled_decode(backend, ids)
        boundary = None
        if before is not None and detok.whole(before) and raw.startswith(before):
            boundary = (early, len(before))
        why = tools.rebuild(p, raw, whole, boundary)
        if why:
            raise Refused(f"tool calls: {why}")

    async def _open(
        self, backend: Backend, path: str, body: dict[str, object]
    ) -> aiohttp.ClientResponse:
        """Raises AttemptFailed (REJECTED where the engine does not serve the path a logprobs
        resume needs)."""
        upstream = await open_attempt(
            self._session, backend, path, json_body(body), self._timeouts
        )
        status = upstream.status
        if status == 200:
            return upstream
        why = await error_kind(upstream, self._timeouts.connect)
        upstream.close()
        if path == generate.PATH and status in (403, 404, 405):
            # The backend lacks the endpoint, which says nothing of its health: skipped as a
            # refusal of this request (REJECTED), and the client is told what it lacks.
            raise AttemptFailed(
                Failure.REJECTED,
                f"a logprobs resume needs {generate.PATH}, which it does not serve "
                f"({status}{why}; vLLM serves it with --enable-scale-out)",
            )
        raise AttemptFailed(resume_failure(status), f"resume answered {status}{why}")

    async def cut_texts(
        self, backend: Backend, wants: list[TagCut]
    ) -> dict[int, CutText]:
        """The texts the stitcher asked for to split a first-stream chunk by ids (TagCut),
        decoded by `backend`'s tokenizer. Raises AttemptFailed when they cannot be had (the
        engine died under the question: the caller fails the stream before that chunk)."""
        out: dict[int, CutText] = {}
        for want in wants:
            before = await self._decode(backend, want.before) if want.before else ""
            # The ids before a tag: a later resume's text starts with them again.
            self._stable[_digest(want.before)] = before
            after = await self._settled_decode(backend, want.after) if want.after else ""
            out[want.index] = CutText(want.sent, before, after)
        return out

    async def _settled_decode(self, backend: Backend, ids: list[int]) -> str:
        return await detok.settled(functools.partial(self._decode, backend), ids)

    async def _decode(self, backend: Backend, ids: list[int]) -> str:
        """The new engine's text for `ids` as a stream shows it: /detokenize spells every
        token, so think tags whose text the stream skips (special) are cut out first."""
        markers = self._stitcher.markers
        skipped = markers.skipped if markers is not None else frozenset()
        if not skipped.intersection(ids):
            return await self._detokenize(backend, ids)
        parts = segments(ids, skipped)
        if not parts:
            return ""
        # The parts before the last tag do not change as a stream grows (the reasoning, when
        # the end tag is skipped): decoded once a request, not at every release of a resume.
        *stable, last = parts
        for part in stable:
            key = _digest(part)
            if key not in self._stable:
                self._stable[key] = await self._detokenize(backend, part)
        return "".join([*(self._stable[_digest(p)] for p in stable),
                        await self._detokenize(backend, last)])  # fmt: skip

    async def _detokenize(self, backend: Backend, ids: list[int]) -> str:
        return await detokenize(
            self._session, backend, self._client.model, ids, self._timeouts.connect
        )


async def _none() -> None:
    return None


def _digest(ids: list[int]) -> bytes:
    """A key for a run of token ids: 16 bytes, whatever its length."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


def tokens_left(client: ClientRequest, p: ChoiceProgress) -> int | None:
    """Tokens the client still allows this choice (None: no limit). A text-path count
    undercounts (a chunk can carry several tokens), so 0 here is never premature."""
    return tokens_allowed(client.body, p.generated)


def ends_here(client: ClientRequest, p: ChoiceProgress, tools: bool = False) -> bool:
    """A choice that can be ended without a backend: all its tokens were sent, and no text
    can be held back for a stop string or by a tool parser (`tools`: one is followed;
    recovering that text needs an engine's detokenizer)."""
    held = _stops(client) or (tools and not p.reasoning)
    return tokens_left(client, p) == 0 and not (held and p.token_ids)


def _stops(client: ClientRequest) -> list[str]:
    stop = client.body.get("stop")
    if isinstance(stop, str):
        return [stop]
    return list(stop or [])
